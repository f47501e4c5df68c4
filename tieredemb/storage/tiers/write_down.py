"""A cache's rows on their way down to its backing store (``CacheTier``'s write-downs).

Write-downs to a store doing host I/O (RocksDB, Redis) go to its I/O worker and the prefetch goes on;
every fetch first waits for the earlier write-downs (one FIFO), so it reads the newest rows. Rows
whose write-down failed are kept on the host and retried at the next call that needs the store; until
the store takes them a training call raises ``BackendError`` chained to the store's exception, before
anything changes, while ``read`` and ``scan`` (the collection's ``read``, ``export`` and checkpoints)
answer with the kept rows over the store's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tieredemb.config import RESERVED_KEY
from tieredemb.storage.backend import Fetched, GroupStore
from tieredemb.storage.errors import BackendError
from tieredemb.storage.io_worker import IOHandle, IOWorker

log = logging.getLogger(__name__)


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
        (never in the middle of a prefetch), and the rows are retried then, in order. Rows of another
        float dtype than the store's are rounded to it (to the nearest value)."""
        bdev = self.device
        pending = Pending(keys.to(bdev), tables.to(bdev), rows.to(bdev, self.below.dtype))
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
        return self._store_get(keys, tables)

    def read(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        """As ``get``, but while the store does not take the rows kept here (a fault that lasts) they
        answer for their pairs, and the store is asked only for the others: nothing kept here is
        out of reach. Raises only if the store must be asked and cannot answer."""
        if self._retried():
            return self._store_get(keys, tables)
        rows, found = self._lookup_kept(keys, tables)
        rest = (~found).nonzero().squeeze(1)
        if rest.numel():
            got = self._store_get(keys[rest], tables[rest])
            rows[rest], found[rest] = got.rows.to(self.device), got.found.to(self.device)
        return Fetched(rows, found)

    def scan(self, table: int, chunk_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row of the group's table ``table``: (keys int64 (m,), rows (m, W)) chunks on the
        store's device, the rows kept here first (the newest of each key), then the store's others.
        Answers during a fault as ``read`` does."""
        kept = torch.empty(0, dtype=torch.int64, device=self.device)
        if not self._retried():
            keys, tables, rows = self._kept()
            mine = (tables == table).nonzero().squeeze(1)
            kept, rows = keys[mine], rows[mine]
            for start in range(0, kept.numel(), chunk_rows):
                yield kept[start : start + chunk_rows], rows[start : start + chunk_rows]
        for keys, rows in self.below.table(table).scan(chunk_rows):
            if kept.numel():
                new = ~torch.isin(keys, kept.to(keys.device))
                keys, rows = keys[new], rows[new]
            if keys.numel():
                yield keys, rows

    def _retried(self) -> bool:
        """Retry the kept rows (``drain``); False if the store still does not take them."""
        try:
            self.drain()
        except BackendError as e:
            log.warning("%s; answering with the rows kept in this process", e)
            return False
        return True

    def _store_get(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        if self.io is None:
            return self.below.get(keys, tables)
        return self.io.submit(self.below.get, keys, tables).result()

    def _kept(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows kept here, the newest of each pair: keys int64 (k,), tables int64 (k,), rows
        (k, W), in (table, key) order."""
        if not self.unwritten:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return empty, empty, torch.empty(0, self.below.width, dtype=self.below.dtype, device=self.device)
        keys, tables, rows = (torch.cat(parts) for parts in zip(*((p.keys, p.tables, p.rows)
                                                                  for p in self.unwritten)))
        real = (keys != RESERVED_KEY).nonzero().squeeze(1)  # not the padding of a padded write
        keys, tables, rows = keys[real], tables[real], rows[real]
        pairs, inverse = torch.unique(torch.stack([tables, keys], 1), dim=0, return_inverse=True)
        newest = torch.full((pairs.shape[0],), -1, dtype=torch.int64, device=keys.device)
        newest.scatter_reduce_(0, inverse, torch.arange(keys.numel(), device=keys.device), "amax")
        return pairs[:, 1], pairs[:, 0], rows[newest]

    def _lookup_kept(self, keys: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest row kept here of each pair: rows (n, W) in the store's dtype (zeros where none),
        found bool (n,)."""
        n = keys.numel()
        rows = torch.zeros(n, self.below.width, dtype=self.below.dtype, device=self.device)
        kkeys, ktables, krows = self._kept()
        if n == 0 or kkeys.numel() == 0:
            return rows, torch.zeros(n, dtype=torch.bool, device=self.device)
        pairs = torch.stack([torch.cat([tables, ktables]), torch.cat([keys, kkeys])], 1)
        _, inverse = torch.unique(pairs, dim=0, return_inverse=True)
        at = torch.full((int(inverse.max()) + 1,), -1, dtype=torch.int64, device=self.device)
        at[inverse[n:]] = torch.arange(kkeys.numel(), device=self.device)  # the kept pairs are distinct
        at = at[inverse[:n]]
        found = at >= 0
        rows[found] = krows[at[found]]
        return rows, found

    def close(self) -> None:
        """Stop the I/O worker (its queue done first)."""
        if self.io is not None:
            self.io.close()
