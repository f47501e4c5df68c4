"""TieredRows: a host tier's rows, a ``HostMemoryBackend`` whose rows carry marks for a tier.

Per row address, on the rows' device (the GPU under CUDA, beside the index): ``version`` (one more at
each write), ``clean`` (the version the store below holds), ``used`` (the tick of the last read or
write, or of a read ahead that wants the row; the uses under LFU) and ``ahead`` (read ahead, not
used since). The device verbs a cache's insertion graph replays (``upsert_keys``, ``locate``) keep
them, so a tier over a store (``HostTierGroup``) knows which rows are dirty and which are least used
without a host read per row.
"""

from __future__ import annotations

import torch

from tieredemb.keys import RESERVED_KEY
from tieredemb.storage.host import HostMemoryBackend


class TieredRows(HostMemoryBackend):
    """A ``HostMemoryBackend`` of several tables whose rows carry a version, the store's version, a
    use mark and a read-ahead flag (the module docstring), kept by every write and read of the
    device verbs. ``lfu``: per table, whether ``used`` counts uses (else it is the tick of the last)."""

    def __init__(self, width: int, lfu: list[bool], pinned: bool, device: torch.device | None,
                 reserve_rows: int, dtype: torch.dtype) -> None:
        super().__init__(width, pinned=pinned, device=device, tables=len(lfu), reserve_rows=reserve_rows,
                         dtype=dtype)
        dev = self.device
        self._lfu = torch.tensor(lfu, dtype=torch.bool, device=dev)
        self.tick = torch.zeros((), dtype=torch.int64, device=dev)
        # versions are only compared for equality: 32 bits wrap harmlessly (a row would have to be
        # written 2**32 times while one write-down of it is on its way to be mistaken for clean)
        self.version = torch.zeros(0, dtype=torch.int32, device=dev)
        self.clean = torch.zeros(0, dtype=torch.int32, device=dev)
        self.used = torch.zeros(0, dtype=torch.int64, device=dev)
        self.ahead = torch.zeros(0, dtype=torch.bool, device=dev)
        # per table: pairs found here by the device cache's fetches, and of those read ahead
        self.hits = torch.zeros(len(lfu), dtype=torch.int64, device=dev)
        self.ahead_hits = torch.zeros(len(lfu), dtype=torch.int64, device=dev)
        self._cover()

    def _cover(self) -> None:
        """The marks cover every allocated row, and one more: where address -1 marks (nothing)."""
        n = self._store.rows_allocated() + 1
        if self.version.numel() >= n:
            return
        more = n + n // 4 - self.version.numel()
        grow = lambda t: torch.cat([t, torch.zeros(more, dtype=t.dtype, device=t.device)])  # noqa: E731
        self.version, self.clean, self.used, self.ahead = map(grow, (self.version, self.clean, self.used,
                                                                    self.ahead))

    def _at(self, addresses: torch.Tensor) -> torch.Tensor:
        return torch.where(addresses >= 0, addresses, self.version.numel() - 1)

    def _mark(self, addresses: torch.Tensor, tables: torch.Tensor | None, write: bool,
              uses: int = 1) -> torch.Tensor:
        """Rows read (``write``: written) at ``addresses`` (-1: none): used now (under LFU ``uses``
        more), and a version more."""
        at = self._at(addresses)
        self.tick.add_(1)
        lfu = self._lfu[0] if tables is None else self._lfu[tables]
        self.used[at] = torch.where(lfu, self.used[at] + uses, self.tick)
        if write:
            self.version.index_add_(0, at, torch.ones_like(at, dtype=torch.int32))
        return at

    # the device verbs, marking
    def room_for(self, n: int) -> torch.Tensor:
        pool = super().room_for(n)
        self._cover()
        return pool

    def upsert_keys(self, keys, tables, pool):
        addresses, counts = super().upsert_keys(keys, tables, pool)
        self._mark(addresses, tables, write=True)
        return addresses, counts

    def _insert_rows(self, keys, rows, tables) -> torch.Tensor:
        addresses = super()._insert_rows(keys, rows, tables)
        self._cover()
        self._mark(addresses, tables, write=True)
        return addresses

    def locate(self, keys: torch.Tensor, tables: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``HostMemoryBackend.locate``, and the rows found marked used (a device cache's fetch)."""
        addresses, found = self._addresses(keys, tables)
        at = self._mark(addresses, tables, write=False)
        if tables is not None:
            self.hits.index_add_(0, tables, found.to(torch.int64))
            self.ahead_hits.index_add_(0, tables, (found & self.ahead[at]).to(torch.int64))
        self.ahead.index_fill_(0, at, False)  # (no host scalar: this runs in a CUDA graph's capture)
        return addresses, found

    def capture_key(self) -> tuple[int, ...]:
        return (*super().capture_key(), self.version.data_ptr())

    def delete(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> None:
        """As ``HostMemoryBackend.delete``; the freed rows' use marks start again from zero."""
        keys, tables = self._keys(keys, tables)
        self.settle()
        addresses, found = self._addresses(keys, tables)
        super().delete(keys, tables)
        freed = addresses[found]
        self.used[freed], self.ahead[freed] = 0, False

    # the tier's own work
    def where(self, keys: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's row address (-1: absent) and found, marking nothing."""
        self.settle()
        return self._addresses(keys, tables)

    def held(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """bool (n,): which pairs are held, in the device's order of work and without a host read
        (a pair an upsert left out reads as absent until ``settle`` puts it in)."""
        return self._addresses(keys, tables)[1]

    def wanted(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """bool (n,): which pairs are held, as ``held``; under LRU those held are marked used now (a
        batch read ahead will ask for them: evicted last), without a host read. Under LFU nothing
        moves (a use is counted when it happens)."""
        addresses, found = self._addresses(keys, tables)
        self._mark(addresses, tables, write=False, uses=0)
        return found

    def insert_absent(self, keys: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The distinct pairs absent here put in with ``rows`` (pinned, or anywhere), clean and read
        ahead: one upsert on the device, no host read (its counts are read at ``settle``; a pair it
        leaves out goes in then, dirty). Returns which went in (bool (n,) on the device)."""
        keys, tables = (t.to(self.device, non_blocking=True) for t in (keys, tables))
        rows = rows.to(self.device, self.dtype, non_blocking=True)  # (from pinned rows: no host wait)
        keys = torch.where(self.held(keys, tables), RESERVED_KEY, keys)  # (padding: nothing stored)
        addresses = self.set_distinct(keys, rows, tables)  # (its upsert marks them written)
        at = self._at(addresses)
        self.clean[at] = self.version[at]
        self.ahead.index_fill_(0, at, True)  # (address -1: the spare mark, never read as found)
        return addresses >= 0

    def table_rows(self, table: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every pair of ``table`` held: keys, addresses (int64 on the device)."""
        self.settle()
        keys, addresses, _ = self._index.export(table)
        return keys, addresses

    def oldest(self, over: list[int], busy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each table t's ``over[t]`` least used rows but those at ``busy`` (addresses on their way
        down), all tables in one pass: keys, addresses, tables (int64 on the device)."""
        self.settle()
        index, dev = self._index, self.device
        slots = (index.keys != RESERVED_KEY).nonzero().squeeze(1)
        ends = torch.tensor(index.region_start[1:], dtype=torch.int64, device=dev) * index.width
        tables = torch.searchsorted(ends, slots, right=True)
        addresses = index.values[slots]
        wanted = torch.tensor(over, dtype=torch.int64, device=dev)
        take = wanted[tables] > 0
        if busy.numel():
            take &= ~torch.isin(addresses, busy)
        at = take.nonzero().squeeze(1)
        slots, tables, addresses = slots[at], tables[at], addresses[at]
        # by table, then rows read ahead and not used yet last (a coming batch needs them), then by
        # use: a row's rank in its table
        order = torch.argsort(self.used[addresses], stable=True)
        order = order[torch.argsort(self.ahead[addresses][order].to(torch.uint8), stable=True)]
        order = order[torch.argsort(tables[order], stable=True)]
        tables = tables[order]
        first = torch.searchsorted(tables, torch.arange(len(over), device=dev))
        rank = torch.arange(tables.numel(), device=dev) - first[tables]
        chosen = (rank < wanted[tables]).nonzero().squeeze(1)
        pick = order[chosen]
        return index.keys[slots[pick]], addresses[pick], tables[chosen]

    def marks_nbytes(self) -> int:
        """Bytes of the per-row marks (on the rows' device's index side: the GPU under CUDA)."""
        return sum(t.numel() * t.element_size() for t in (self.version, self.clean, self.used, self.ahead))

    def dirty(self, addresses: torch.Tensor) -> torch.Tensor:
        return self.version[addresses] != self.clean[addresses]

    def read_rows(self, addresses: torch.Tensor) -> torch.Tensor:
        """The rows at ``addresses`` (on the device)."""
        return self._gather(addresses)

    def sizes(self) -> list[int]:
        """Pairs held per table (the last upsert's counts where read, else a device read)."""
        self.settle()
        if self._sizes_read is None:
            self._sizes_read = self._index.sizes_on_device.tolist()
        return list(self._sizes_read)
