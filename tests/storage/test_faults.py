"""Faults of the backing stores: a clear ``BackendError`` chained to the cause, no row lost, bounded
retries of transient Redis errors.

RocksDB: path not writable, disk full (a tiny tmpfs), directory gone or read-only after open.
Redis: down (nothing listening), refused (password), slow (``CLIENT PAUSE``), transient (killed and
restarted between calls), out of memory. Through an ``IOWorker`` the error reaches the caller at its
next call and the rows of a failed write can be written again.

Mounting a tmpfs needs root (CAP_SYS_ADMIN): those tests skip without it (and fail in CI). What
happens after a fault, once it clears, is ``test_store_recovery.py``'s.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

import tieredemb as te
from tieredemb.storage.backend import DictBackend
from tieredemb.storage.errors import BackendError
from tieredemb.storage.io_worker import IOWorker

pytestmark = pytest.mark.faults

W = 16
CPU = torch.device("cpu")
IS_ROOT = os.geteuid() == 0


def assert_chained(error: BaseException, *needles: str) -> None:
    assert isinstance(error, BackendError)
    assert error.__cause__ is not None, "not chained to the cause"
    for needle in needles:
        assert needle in str(error), f"{needle!r} not in {error}"


# ------------------------------------------------------------------------------------------ RocksDB
def test_rocksdb_path_under_a_file_names_the_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    path = str(blocker / "db")
    with pytest.raises(BackendError) as info:
        te.storage.RocksDB(path).open("user", W, CPU)
    assert_chained(info.value, path, "open")
    assert isinstance(info.value.__cause__, OSError)


def test_rocksdb_read_only_path_names_the_path(tmp_path, tmpfs):
    if IS_ROOT:  # root writes through permission bits: a read-only file system it is
        path = os.path.join(tmpfs("1m", read_only=True), "db")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        path = str(ro / "db")
    with pytest.raises(BackendError) as info:
        te.storage.RocksDB(path).open("user", W, CPU)
    assert_chained(info.value, path)


def test_rocksdb_disk_full_is_a_clear_error_and_rows_stay_readable(tmpfs):
    path = os.path.join(tmpfs("2m"), "db")
    backend = te.storage.RocksDB(path, shards=2).open("user", W, CPU)
    keys = torch.arange(40_000)
    rows = torch.randn(40_000, W)  # 2.5 MB: more than the disk
    with pytest.raises(BackendError) as info:
        for start in range(0, 40_000, 1000):  # the write-ahead log fills the disk
            backend.set(keys[start : start + 1000], rows[start : start + 1000])
    assert_chained(info.value, path, "set", "No space left")
    got = backend.get(keys[:100])  # the rows written before stay readable: nothing was lost
    assert got.found.all() and torch.equal(got.rows, rows[:100])
    try:
        backend.close()  # flushes: fails the same way, but still closes
    except BackendError as e:
        assert_chained(e, path)


def test_rocksdb_directory_unusable_after_open(tmp_path):
    path = tmp_path / "db"
    backend = te.storage.RocksDB(str(path), shards=1).open("user", W, CPU)
    backend.set(torch.arange(100), torch.randn(100, W))
    shard = path / "shard-00"
    if IS_ROOT:  # permission bits do not stop root: take the directory away instead
        os.rename(shard, tmp_path / "moved")
    else:  # read-only after open
        shard.chmod(0o500)
    try:
        with pytest.raises(BackendError) as info:
            backend.flush()
        assert_chained(info.value, str(path), "flush")
    finally:
        if IS_ROOT:
            os.rename(tmp_path / "moved", shard)
        else:
            shard.chmod(0o700)
    try:
        backend.close()  # RocksDB may stay in its error state: closing still releases the store
    except BackendError as e:
        assert_chained(e, str(path))
    te.storage.RocksDB(str(path), shards=1, existing="clear").open("user", W, CPU).close()  # released


def test_rocksdb_store_open_elsewhere_is_a_clear_error(tmp_path):
    first = te.storage.RocksDB(str(tmp_path)).open("user", W, CPU)
    with pytest.raises(BackendError) as info:  # another spec, same path: RocksDB's lock
        te.storage.RocksDB(str(tmp_path)).open("item", W, CPU)
    assert_chained(info.value, str(tmp_path), "lock")
    first.close()


def test_disk_full_through_the_worker_keeps_rows_for_a_retry(tmpfs):
    """A write-back that fails with ENOSPC: the caller sees it at its next call, keeps its rows,
    and writes them once there is room."""

    class FullOnce(DictBackend):
        full = True

        def set(self, keys, rows):
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().set(keys, rows)

    backend = FullOnce(W)
    worker = IOWorker(name="user")
    keys, rows = torch.tensor([1, 2, 3]), torch.randn(3, W)
    worker.submit(backend.set, keys, rows).wait()  # a write-back nobody waits on, failed
    with pytest.raises(BackendError) as info:  # the next call (a prefetch) reports it
        worker.submit(backend.get, keys)
    assert isinstance(info.value.__cause__, OSError)
    backend.full = False  # room again: the caller still has its rows
    worker.submit(backend.set, keys, rows)
    assert torch.equal(worker.submit(backend.get, keys).result().rows, rows)
    worker.close()


# -------------------------------------------------------------------------------------------- Redis
def test_redis_down_fails_after_bounded_retries():
    import socket

    pytest.importorskip("redis")  # the client library (CI installs it; the GPU machine lacks it)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free: nothing listens there
    url = f"redis://127.0.0.1:{port}/0"
    start = time.monotonic()
    with pytest.raises(BackendError) as info:
        te.storage.Redis(url, retries=2, backoff_s=0.05, timeout_s=0.5).open("user", W, CPU)
    elapsed = time.monotonic() - start
    assert_chained(info.value, url, "after 3 attempts", "Connection")
    assert elapsed < 3 * 0.5 + 0.05 + 0.1 + 2.0  # the bound: attempts x timeout + backoff


def test_redis_server_gone_mid_run_fails_through_the_worker(redis_factory):
    server = redis_factory()
    backend = te.storage.Redis(server.url, retries=1, backoff_s=0.01, timeout_s=0.5).open("user", W, CPU)
    worker = IOWorker(name="user/redis")
    worker.submit(backend.set, torch.arange(10), torch.randn(10, W)).result()
    server.stop()
    handle = worker.submit(backend.get, torch.arange(10))
    with pytest.raises(BackendError) as info:
        handle.result()
    assert isinstance(info.value.__cause__, BackendError)  # the backend's, chained to redis-py's
    assert "after 2 attempts" in str(info.value.__cause__)
    worker.close()
    backend.close()


@pytest.mark.parametrize("password", [None, "wrong"])
def test_redis_refused_credentials_fail_at_once(redis_factory, password):
    server = redis_factory("--requirepass", "sekret")
    start = time.monotonic()
    with pytest.raises(BackendError) as info:
        te.storage.Redis(server.url, password=password, retries=5, backoff_s=0.5).open("user", W, CPU)
    assert time.monotonic() - start < 0.5 + 0.4  # not retried: the first backoff never slept
    assert_chained(info.value, "refused the credentials", "password")
    assert "sekret" not in str(info.value) and "wrong" not in str(info.value)
    backend = te.storage.Redis(server.url, password="sekret").open("user", W, CPU)
    backend.set(torch.tensor([1]), torch.ones(1, W))
    assert backend.get(torch.tensor([1])).found.all()
    backend.close()


def test_redis_slow_server_times_out_within_the_retry_bound(redis_factory):
    server = redis_factory()
    backend = te.storage.Redis(server.url, timeout_s=0.2, retries=2, backoff_s=0.05).open("user", W, CPU)
    # paused longer than the 3 attempts (3 x 0.2 s + 0.15 s of backoff) take; no CLIENT UNPAUSE:
    # a paused server postpones that command too
    server.cli("CLIENT", "PAUSE", 1500, "ALL")
    start = time.monotonic()
    with pytest.raises(BackendError) as info:
        backend.get(torch.arange(8))
    elapsed = time.monotonic() - start
    assert_chained(info.value, "after 3 attempts", "Timeout")
    assert 3 * 0.2 <= elapsed < 1.5
    time.sleep(max(0.0, 1.6 - elapsed))
    assert not backend.get(torch.arange(8)).found.any()  # the server answers again
    backend.close()


def test_redis_slow_server_within_the_bound_succeeds(redis_factory):
    server = redis_factory()
    backend = te.storage.Redis(server.url, timeout_s=0.2, retries=6, backoff_s=0.05).open("user", W, CPU)
    server.cli("CLIENT", "PAUSE", 500, "ALL")
    backend.set(torch.arange(8), torch.ones(8, W))
    assert backend.get(torch.arange(8)).found.all()
    backend.close()


def test_redis_restarted_between_calls_is_retried(redis_factory):
    server = redis_factory()
    backend = te.storage.Redis(server.url, retries=6, backoff_s=0.1, timeout_s=1.0).open("user", W, CPU)
    keys, rows = torch.arange(100), torch.randn(100, W)
    backend.set(keys, rows)
    server.stop()  # the client's pooled connection is now dead
    restart = threading.Timer(0.3, server.start)
    restart.start()
    try:
        backend.set(keys, rows)  # refused, refused, ... then the restarted server takes it
    finally:
        restart.join()
    got = backend.get(keys)
    assert got.found.all() and torch.equal(got.rows, rows)
    backend.close()


def test_redis_out_of_memory_is_not_retried(redis_factory):
    server = redis_factory("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    backend = te.storage.Redis(server.url, retries=5, backoff_s=0.5).open("user", 256, CPU)
    start = time.monotonic()
    with pytest.raises(BackendError) as info:
        for i in range(20):
            backend.set(torch.arange(i * 1000, (i + 1) * 1000), torch.randn(1000, 256))
    assert time.monotonic() - start < 5
    assert_chained(info.value, "maxmemory")
    assert "MSET" not in str(info.value)  # the binary command is not echoed
    backend.close()


def test_a_write_down_queued_behind_a_failed_one_reports_the_stores_own_error():
    """The cache's write-downs go to an I/O worker. When a second one is handed over after the first
    failed on the worker (the failure not reported yet), the error the cache raises is chained to the
    store's own exception, not to the worker's wrapper of it; both batches' rows are kept and land
    once the store takes writes again."""
    from tieredemb.storage.backend import GroupStore
    from tieredemb.storage.tiers.write_down import WriteDowns

    failing = {"set": True}

    class Full(DictBackend):
        def set(self, keys, rows):
            if failing["set"]:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().set(keys, rows)

    backend = Full(2)
    downs = WriteDowns(GroupStore([backend]), ["t"], torch.zeros(1, dtype=torch.int64))
    tables = torch.zeros(2, dtype=torch.int64)
    downs.keep(torch.tensor([1, 2]), tables, torch.ones(2, 2))
    first = downs.unwritten[0].handle
    deadline = time.monotonic() + 10
    while not first.done() and time.monotonic() < deadline:  # the worker has run (and failed) it
        time.sleep(0.01)
    # handing the second over meets the first's failure (the worker raises it, wrapped, at submit);
    # what the cache keeps for its next call is the store's own error: a drain whose resend meets
    # the failure that way raises chained to it
    downs.keep(torch.tensor([3, 4]), tables, torch.full((2, 2), 2.0))
    assert isinstance(downs.error, OSError), repr(downs.error)
    with pytest.raises(BackendError) as info:
        downs.drain()
    assert isinstance(info.value.__cause__, OSError), repr(info.value.__cause__)
    failing["set"] = False
    downs.drain()
    got = backend.get(torch.tensor([1, 2, 3, 4]))
    assert bool(got.found.all())
    torch.testing.assert_close(got.rows, torch.tensor([[1.0, 1.0]] * 2 + [[2.0, 2.0]] * 2))
    downs.close()
