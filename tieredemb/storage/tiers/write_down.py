"""A cache's rows on their way down to its backing store (``CacheTier``'s write-downs).

Write-downs to a store doing host I/O (RocksDB, Redis) go to its I/O worker and the prefetch goes on;
every fetch first waits for the earlier write-downs (one FIFO), so it reads the newest rows. Rows
whose write-down failed are kept on the host and retried at the next call that needs the store; until
the store takes them that call raises ``BackendError`` chained to the store's exception, before
anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tieredemb.config import RESERVED_KEY
from tieredemb.storage.backend import Fetched, GroupStore
from tieredemb.storage.errors import BackendError
from tieredemb.storage.io_worker import IOHandle, IOWorker


@dataclass(eq=False)
class Pending:
    """Rows written down and not yet confirmed taken by the backing store (distinct pairs), with
    the I/O worker's handle while they are in its queue."""

    keys: torch.Tensor
    tables: torch.Tensor
    rows: torch.Tensor
    handle: IOHandle | None = None


class WriteDowns:
    """The rows a cache handed to its backing store (``below``) and the store has not confirmed
    taken, in order, and the store's reads behind them.

    Args:
        below: the tables' backing store (a ``GroupStore``).
        names: the tables' names (for the error raised when a write-down fails).
        written: int64 (R,) on the store's device, rows written down per table: counted in place
            (the tier's counter row).
    """

    def __init__(self, below: GroupStore, names: list[str], written: torch.Tensor) -> None:
        self.below = below
        self.names = names
        self.device = below.device
        self.written = written
        # rows written down but not yet confirmed taken by the backing store, in order
        self.unwritten: list[Pending] = []
        self.error: Exception | None = None
        # stores doing host I/O (RocksDB, Redis) take write-downs on their own thread, in order
        self.io = IOWorker(name=f"{'+'.join(names)}/backing") if below.io_bound else None

    def keep(self, keys: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor) -> None:
        """Hold distinct pairs' rows until the backing store has taken them, and hand them to it.
        A failed write loses no row: the failure is raised at the next call that needs the store
        (never in the middle of a prefetch), and the rows are retried then, in order."""
        bdev = self.device
        pending = Pending(keys.to(bdev), tables.to(bdev), rows.to(bdev))
        self.unwritten.append(pending)
        if self.error is None:  # after a failure, later rows wait for it: order matters
            self._send(pending)

    def _send(self, pending: Pending) -> None:
        """Write ``pending`` down: on the I/O worker (returns at once), or here. Never raises: a
        failure is kept for the next call."""
        try:
            if self.io is not None:
                pending.handle = self.io.submit(self.below.set, pending.keys, pending.tables,
                                                pending.rows, True)
                return
            self.below.set(pending.keys, pending.tables, pending.rows, True)
        except Exception as e:  # noqa: BLE001 - any backend failure: keep the rows, report later
            # the I/O worker's submit raises an earlier task's failure wrapped: keep the store's own
            self.error = self.error or (e.__cause__ if isinstance(e, BackendError) and e.__cause__ else e)
            return
        self._taken(pending)

    def _taken(self, pending: Pending) -> None:
        self.unwritten.remove(pending)
        self.written.index_add_(0, pending.tables, (pending.keys != RESERVED_KEY).to(torch.int64))

    def _settle(self) -> None:
        """Wait for the write-downs on the I/O worker; keep the ones that failed (or were refused
        behind a failure) for a retry."""
        for pending in list(self.unwritten):
            if pending.handle is None:
                continue
            handle, pending.handle = pending.handle, None
            try:
                handle.result()
            except BackendError as e:
                self.error = self.error or e.__cause__ or e
                continue
            self._taken(pending)

    def drain(self) -> None:
        """Every row written down so far is in the backing store when this returns. Rows of a
        failed write-down are retried, in order; if that fails too, ``BackendError`` chained to the
        cause (the rows are still kept, and retried at the next call)."""
        self._settle()
        if not self.unwritten:
            self.error = None
            return
        self.error = None
        for pending in list(self.unwritten):
            self._send(pending)
            if self.error is not None:
                break
        self._settle()
        if self.error is not None:
            cause, self.error = self.error, None
            tables = torch.cat([p.tables for p in self.unwritten]).unique().tolist()
            n = sum(p.keys.numel() for p in self.unwritten)
            raise BackendError(f"tables {[self.names[t] for t in tables]}: writing {n} rows down to the "
                               "backing store failed; they are kept and retried at the next call") from cause

    def get(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        """The backing store's rows of the pairs (``keys``, ``tables`` on its device), read on the I/O
        worker where there is one. Every earlier write-down is taken first (``drain``: the store then
        answers with the newest rows)."""
        self.drain()
        if self.io is None:
            return self.below.get(keys, tables)
        return self.io.submit(self.below.get, keys, tables).result()

    def close(self) -> None:
        """Stop the I/O worker (its queue done first)."""
        if self.io is not None:
            self.io.close()
