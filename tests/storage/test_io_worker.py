"""IOWorker: FIFO order, errors crossing threads (chained, reported at the next call), no row lost."""

from __future__ import annotations

import contextlib
import errno
import threading
import time

import pytest
import torch

from tieredemb.storage.backend import DictBackend, Fetched
from tieredemb.storage.errors import BackendError
from tieredemb.storage.io_worker import IOWorker

W = 3


class SlowSetBackend(DictBackend):
    """``set`` takes a while: a ``get`` that overtook it would not see its rows."""

    def set(self, keys, rows):
        time.sleep(0.05)
        super().set(keys, rows)


class DiskFullOnce(DictBackend):
    """Fails the first ``failures`` sets with ENOSPC, as a full disk would; stores nothing then."""

    def __init__(self, width: int, failures: int = 1) -> None:
        super().__init__(width)
        self.failures = failures

    def set(self, keys, rows):
        if self.failures:
            self.failures -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        super().set(keys, rows)


@pytest.fixture
def worker():
    w = IOWorker(name="test")
    yield w
    with contextlib.suppress(BackendError):
        w.close()


def test_get_after_set_sees_the_set(worker):
    backend = SlowSetBackend(W)
    keys = torch.tensor([3, 1, 4])
    for i in range(5):
        worker.submit(backend.set, keys, torch.full((3, W), float(i)))
        got: Fetched = worker.submit(backend.get, keys).result()
        assert got.found.all() and torch.equal(got.rows, torch.full((3, W), float(i)))


def test_tasks_run_in_submission_order_on_one_thread(worker):
    seen: list[tuple[int, str]] = []

    def record(i: int) -> None:
        time.sleep(0.001 * (i % 3))
        seen.append((i, threading.current_thread().name))

    handles = [worker.submit(record, i) for i in range(50)]
    worker.drain()
    assert all(h.done() for h in handles)
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"tieredemb-io-test"}


def test_result_returns_the_value_and_times_out(worker):
    assert worker.submit(lambda a, b=0: a + b, 2, b=3).result() == 5
    slow = worker.submit(time.sleep, 0.3)
    with pytest.raises(TimeoutError, match="still running"):
        slow.result(timeout=0.01)
    slow.result()


def test_worker_exception_surfaces_in_result_chained(worker):
    def boom():
        raise KeyError("the original")

    handle = worker.submit(boom)
    with pytest.raises(BackendError, match="test: boom failed") as info:
        handle.result()
    assert isinstance(info.value.__cause__, KeyError)
    # reported once: the worker runs new tasks again
    assert worker.submit(lambda: 7).result() == 7


def test_unreported_exception_surfaces_at_the_next_submit(worker):
    def boom():
        raise ValueError("lost?")

    worker.submit(boom).wait()  # the caller never asks for this result
    with pytest.raises(BackendError, match="an earlier I/O task failed") as info:
        worker.submit(lambda: None)
    assert isinstance(info.value.__cause__, ValueError)
    assert worker.submit(lambda: 1).result() == 1


def test_unreported_exception_surfaces_at_drain_and_close():
    w = IOWorker(name="d")
    w.submit(lambda: 1 / 0)
    with pytest.raises(BackendError) as info:
        w.drain()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    w.drain()  # reported once
    w.submit(lambda: 1 / 0)
    with pytest.raises(BackendError):
        w.close()
    with pytest.raises(BackendError, match="closed"):
        w.submit(lambda: None)


def test_tasks_queued_behind_a_failure_are_refused_not_run(worker):
    backend = DictBackend(W)
    gate = threading.Event()

    def failing_write():
        gate.wait()
        raise OSError(errno.EIO, "I/O error")

    failed = worker.submit(failing_write)
    behind = worker.submit(backend.set, torch.tensor([1]), torch.ones(1, W))
    gate.set()
    with pytest.raises(BackendError, match="not run") as info:
        behind.result()
    assert isinstance(info.value.__cause__, OSError)
    assert backend.size() == 0  # it did not run
    with pytest.raises(BackendError):
        failed.result()
    worker.submit(backend.set, torch.tensor([1]), torch.ones(1, W)).result()
    assert backend.size() == 1


def test_failed_set_keeps_its_rows_for_a_retry(worker):
    backend = DiskFullOnce(W)
    keys = torch.tensor([10, 20, 30])
    rows = torch.randn(3, W)
    kept = rows.clone()
    with pytest.raises(BackendError) as info:
        worker.submit(backend.set, keys, rows).result()
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert torch.equal(rows, kept)  # the caller's rows are untouched
    worker.submit(backend.set, keys, rows).result()  # the retry, same rows
    got = worker.submit(backend.get, keys).result()
    assert got.found.all() and torch.equal(got.rows, kept)


def test_error_raised_in_submit_chains_to_the_worker_traceback(worker):
    def deep():
        raise RuntimeError("from the worker")

    worker.submit(deep).wait()
    with pytest.raises(BackendError) as info:
        worker.drain()
    tb = info.value.__cause__.__traceback__
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "deep" in names


_EXIT_WHILE_BUSY = """
import pathlib, sys, threading, time, torch
from tieredemb.storage.io_worker import IOWorker

out = pathlib.Path(sys.argv[1])
started = [threading.Event(), threading.Event()]

def torch_work(i):  # inside torch calls (the GIL released) when the main thread returns
    started[i].set()
    a = torch.randn(1000, 1000)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        a @ a
    (out / f"running_task_{i}_finished").touch()

for i in range(2):
    worker = IOWorker(name=f"exit-test-{i}")
    worker.submit(torch_work, i)
    worker.submit((out / f"queued_task_{i}_ran").touch)
for event in started:
    event.wait()
"""


def test_the_process_exits_cleanly_while_a_worker_is_inside_torch(tmp_path):
    """A program that leaves without closing, two workers busy in torch: exit code 0, not an abort
    (a daemon thread returning from torch into a finalizing interpreter calls std::terminate); each
    running task finishes, the queued ones are not started."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_BUSY, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "terminate" not in done.stderr
    for i in range(2):
        assert (tmp_path / f"running_task_{i}_finished").exists()
        assert not (tmp_path / f"queued_task_{i}_ran").exists()
