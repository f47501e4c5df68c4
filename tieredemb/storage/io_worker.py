"""IOWorker: one thread and one FIFO queue per backend (DESIGN section 4, rules 3 and 5).

Every call on a backend goes through its worker, in submission order, so a ``get`` never overtakes
an earlier ``set`` of the same key: a row written back is what the next fetch reads.

Errors cross threads. When a task raises, the worker

- fails that task's handle: ``handle.result()`` raises ``BackendError`` chained to the original;
- refuses every task submitted before the caller has seen the error (their handles raise
  ``BackendError`` chained to the same original, without running them): a task queued behind a
  failed write-back would otherwise read a stale row, or write an older one over a newer;
- raises the error at the caller's next ``submit`` or ``drain`` if no ``result()`` reported it.

Once the caller has seen the error (through any of those), new work runs again: a failed ``set``
can be resubmitted with the same rows, which the caller still holds (nothing is dropped).

At interpreter exit every open worker stops: the task it is running finishes, those queued behind it
are not started (what a program did not ``flush`` is not kept, queued or not). A daemon thread still
inside a torch call when Python finalizes would abort the process ("terminate called without an
active exception") as the call returns.

Example::

    worker = IOWorker(name="user/rocksdb")
    done = worker.submit(backend.set, keys, rows)      # returns at once
    fetched = worker.submit(backend.get, keys).result()  # runs after the set, sees its rows
    worker.close()
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from tieredemb.storage.errors import BackendError

log = logging.getLogger(__name__)

_STOP = object()
_EXIT_JOIN_S = 30.0  # how long exit waits for the workers' running tasks, all together


class IOHandle:
    """The pending result of one submitted task (a small ``concurrent.futures.Future``)."""

    def __init__(self, worker: IOWorker, what: str, epoch: int) -> None:
        self._worker = worker
        self._what = what
        self._epoch = epoch
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._refused = False  # not run: ``_error`` is the earlier task's failure

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the task has finished (or was refused), without raising; False on timeout."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """The task's return value; raises ``BackendError`` chained to the task's exception.

        Raises ``TimeoutError`` if the task has not finished within ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self._worker.name}: {self._what} still running after {timeout} s")
        if self._error is not None:
            self._worker._acknowledge(self._error)
            outcome = "not run: an earlier I/O task failed" if self._refused else "failed"
            raise BackendError(f"{self._worker.name}: {self._what} {outcome}: {self._error}") from self._error
        return self._value

    def _finish(self, value: Any = None, error: BaseException | None = None, refused: bool = False) -> None:
        self._value, self._error, self._refused = value, error, refused
        self._done.set()


class IOWorker:
    """One worker thread running submitted calls one at a time, in submission order.

    Args:
        name: names the thread and prefixes error messages (e.g. ``"user/rocksdb"``).
    """

    def __init__(self, name: str = "io") -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        # error bookkeeping (see the module docstring): the caller's epoch goes up each time it has
        # seen an error; tasks of an epoch in which a task failed are refused, not run
        self._epoch = 0
        self._failed_epoch = -1
        self._unseen: BaseException | None = None  # the failure no call has reported yet
        self._last_error: BaseException | None = None  # what refused tasks are chained to
        self._closed = False
        self._exiting = False  # the interpreter exits: queued tasks are not started
        self._thread = threading.Thread(target=self._run, name=f"tieredemb-io-{name}", daemon=True)
        self._thread.start()
        _OPEN.add(self)

    # ---------------------------------------------------------------------- training thread
    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> IOHandle:
        """Queue ``fn(*args, **kwargs)`` behind every earlier task; returns its handle at once.

        Raises ``BackendError`` (chained) if an earlier task failed and no call has reported it yet,
        or if the worker is closed.
        """
        self._raise_unseen()
        with self._lock:
            if self._closed:
                raise BackendError(f"{self.name}: I/O worker is closed")
            handle = IOHandle(self, getattr(fn, "__name__", repr(fn)), self._epoch)
            self._queue.put((fn, args, kwargs, handle))
        return handle

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every task submitted so far has finished; raise an unreported failure."""
        with self._lock:
            closed = self._closed
        if not closed:
            barrier = IOHandle(self, "drain", -1)  # epoch -1: never refused
            self._queue.put((_noop, (), {}, barrier))
            if not barrier._done.wait(timeout):
                raise TimeoutError(f"{self.name}: tasks still running after {timeout} s")
        self._raise_unseen()

    def close(self) -> None:
        """Finish the queued tasks, stop the thread. An unreported failure is raised here."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join()
        self._raise_unseen()

    def _stop_at_exit(self) -> None:
        """Let the running task finish, start no queued one (the exit hook's; ``_join_at_exit`` waits)."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._exiting = True
            self._queue.put(_STOP)

    def _join_at_exit(self, deadline: float) -> None:
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("%s: a task still running %.0f s into the interpreter's exit", self.name,
                        _EXIT_JOIN_S)

    def _raise_unseen(self) -> None:
        with self._lock:
            error, self._unseen = self._unseen, None
            if error is not None:
                self._epoch += 1
        if error is not None:
            raise BackendError(f"{self.name}: an earlier I/O task failed: {error}") from error

    def _acknowledge(self, error: BaseException) -> None:
        """The caller has seen ``error`` (or one chained to it): new tasks may run again."""
        with self._lock:
            if error is self._unseen:
                self._unseen = None
                self._epoch += 1

    # ------------------------------------------------------------------------- worker thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, args, kwargs, handle = item
            with self._lock:
                refused = handle._epoch != -1 and handle._epoch <= self._failed_epoch
                cause = self._last_error
            if self._exiting:
                handle._finish(error=BackendError(f"{self.name}: not run: the interpreter is exiting"))
                continue
            if refused:
                handle._finish(error=cause, refused=True)
                continue
            try:
                value = fn(*args, **kwargs)
            except BaseException as e:  # every failure must reach the caller
                log.debug("%s: %s failed", self.name, handle._what, exc_info=True)
                with self._lock:
                    self._failed_epoch = max(self._failed_epoch, handle._epoch)
                    self._unseen = self._last_error = e
                handle._finish(error=e)
            else:
                handle._finish(value)


def _noop() -> None:
    return None


_OPEN: weakref.WeakSet[IOWorker] = weakref.WeakSet()


@atexit.register
def _stop_open_workers() -> None:
    """Run at interpreter exit, before daemon threads are frozen: every open worker stopped, all of
    them waited for ``_EXIT_JOIN_S`` at most."""
    workers = list(_OPEN)
    for worker in workers:
        worker._stop_at_exit()
    deadline = time.monotonic() + _EXIT_JOIN_S
    for worker in workers:
        worker._join_at_exit(deadline)
