"""HostMemoryBackend: one table's rows in host memory, and the DRAM cache in front of a slower store.

Layout: a ``KeyIndex`` (raw int64 key -> row address) over a ``RowStore`` of host segments. On a CUDA
device (``device=cuda``) the index lives on the GPU and the segments are pinned: the Triton kernels
gather and scatter rows in host memory in place through UVA, as DynamicEmb and HierarchicalKV keep
their host tier; keys and rows in and out stay on the GPU. On the CPU it is the same structure with
the pure-torch reference.

With ``capacity`` the index is bounded and evicts the least recently used row of a full bucket
(``KeyIndex`` semantics): that is the DRAM cache ``CachedBackend`` puts in front of RocksDB or Redis
(FBGEMM's "L2"). Unbounded, it is the ``HostMemory`` backing store and never drops a row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tieredemb.index.key_index import KeyIndex, Region
from tieredemb.keys import RESERVED_KEY
from tieredemb.ops import to_host_later
from tieredemb.ops.reference import TorchKernels
from tieredemb.storage.backend import Backend, DeviceRows, Fetched, GroupStore, add_bytes
from tieredemb.storage.row_store import RowStore

_CPU = torch.device("cpu")
# a reserved store's index holds its rows at this load: keys fall in its 32-way buckets as a Poisson
# law of mean 9.6, and ~0.004 of 10M keys find theirs full (each time the region doubles: a rehash of
# every key, and the cache's insertion graphs, keyed by the index's generation, captured again). In
# 16-way buckets a quarter full ~4 of 10M keys did; 16 bytes a slot, so 53 bytes a reserved row
RESERVE_LOAD = 0.3


class _PinnedRowStore(RowStore):
    """A RowStore whose segments are page-locked host memory (for DMA to a CUDA device)."""

    def _add_segment(self) -> None:
        super()._add_segment()
        self.segments[-1] = self.segments[-1].pin_memory()
        self._segments_changed()


@dataclass(eq=False)
class _Upsert:
    """A ``set_distinct`` done on the device whose outcome the host has not read yet: ``counts``
    (int64, host memory once ``ready`` has passed; ``ready`` None on the CPU): the pool's rows
    taken, the keys left out (their bucket was full), then the index's sizes per region."""

    keys: torch.Tensor
    rows: torch.Tensor
    tables: torch.Tensor | None
    addresses: torch.Tensor  # each key's row (-1: left out, or padding)
    pool: torch.Tensor  # the free rows lent to the upsert; those past the taken ones go back
    counts: torch.Tensor
    ready: torch.cuda.Event | None
    settled: Callable[[], None] | None = None  # called once read (keys, rows... no longer needed)


def last_of_duplicates(keys: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
    """Position of the last occurrence of each distinct key (of each distinct (table, key) pair
    with ``tables``): int64 (u,). An upsert with a key twice keeps the later row, as a sequence of
    single sets would."""
    uniq, inverse = torch.unique(keys, return_inverse=True)
    if tables is not None:  # pairs as one int64 each (a group has far fewer than 2**24 tables): two
        # 1-D uniques, where ``torch.unique(dim=1)`` took ~200 ms for 100k pairs on the host
        uniq, inverse = torch.unique(inverse * (1 << 24) + tables, return_inverse=True)
    last = torch.full((uniq.shape[-1],), -1, dtype=torch.int64, device=keys.device)
    last.scatter_reduce_(0, inverse, torch.arange(keys.numel(), device=keys.device), reduce="amax")
    return last


class HostMemoryBackend(Backend, DeviceRows):
    """One table's rows in (pinned) host memory.

    Args:
        width: elements per row (weights + optimizer state).
        pinned: page-lock the segments (only when a CUDA device will read them).
        capacity: None: unbounded (a backing store). An int: at most about this many rows, the least
            recently used row of a full bucket making room for a new one (a cache).
        segment_rows: rows per host segment (the unit of growth).
        bucket_width: slots per index bucket (default: 32 for a store, 16 for a cache).
        device: where the index lives and keys and rows come and go (a CUDA device: the index on
            the GPU, rows pinned and reached through UVA); default the CPU.
        tables: rows of this many tables (a region of the index each; the verbs then take
            ``tables``, the table of each key). ``capacity`` applies per table.
        reserve_rows: rows (of all the tables together) to allocate up front, and the index sized
            for them (``RESERVE_LOAD``).
        dtype: the rows' storage type (``TableConfig.dtype``); ``get`` gives rows in it, ``set``
            rounds what it is given to it.

    A store (no ``capacity``) never evicts: its index keeps no scores and no locks (16 bytes a slot).

    Example::

        b = HostMemoryBackend(width=4)
        b.set(torch.tensor([7, -3]), torch.ones(2, 4))
        fetched = b.get(torch.tensor([7, 8]))   # rows (2, 4); found [True, False]
    """

    def __init__(self, width: int, pinned: bool = False, capacity: int | None = None,
                 segment_rows: int = 65536, bucket_width: int | None = None,
                 device: torch.device | None = None, tables: int = 1, reserve_rows: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        self.width = width
        self.dtype = dtype
        self.capacity = capacity
        if capacity is not None:
            segment_rows = min(segment_rows, max(capacity, 1))
        self.device = torch.device(device) if device is not None else _CPU
        store = capacity is None
        if bucket_width is None:
            bucket_width = 32 if store else 16
        # reserved, the index is made at its final size: a rehash on the way costs a few steps
        per_table = -(-reserve_rows // tables)
        initial = math.ceil(per_table / RESERVE_LOAD) if store and reserve_rows else Region.initial_slots
        self._regions = [Region("lru", capacity, initial) for _ in range(tables)]
        self._index_args = dict(width=bucket_width, regions=self._regions, locking=not store,
                                scores=not store)
        if self.device.type == "cuda":
            # the index on the GPU, the rows in pinned host segments that the kernels read and
            # write in place through UVA: no host work and no staging copy per call
            from tieredemb.ops import select_kernels

            self._kernels = select_kernels("auto", self.device)
            # the row kernels on host rows run one program per SM, each looping over its rows: PCIe
            # needs ~100 KB in flight, not a program per 4 rows on every SM, which under a pipeline
            # took the SMs from the dense model's kernels (H200: 1.042x instead of 1.048-1.053x the
            # all-in-HBM pipeline; 32 programs starve PCIe: +0.3 ms a plain cache step)
            self._uva_programs = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._index = self._kernels.index_class(device=self.device, **self._index_args)
            self._store = RowStore(width, segment_rows, self.device, device_segments=0, dtype=dtype)
        else:
            self._kernels = None
            self._index = KeyIndex(device=_CPU, **self._index_args)
            store_cls = _PinnedRowStore if pinned else RowStore
            self._store = store_cls(width, segment_rows, _CPU, dtype=dtype)
        self._store.reserve(reserve_rows)
        self._step = 0  # LRU clock: one tick per call
        # upserts on the device not yet read back (``set_distinct``), in order; the index's sizes
        # per region as last read (None: read them when needed)
        self._upserts: list[_Upsert] = []
        self._sizes_read: list[int] | None = [0] * tables
        self._count_buffers: list[torch.Tensor] = []  # pinned buffers of settled upserts, reused

    # The kernels reach pinned host rows in address order: random 512 B rows move at ~28 GB/s in key
    # order and ~51 GB/s sorted by address, the pinned copy's 55 (H200, the gather kernel alone).
    def _gather(self, addresses: torch.Tensor) -> torch.Tensor:
        if self._kernels is None:
            return self._store.gather(addresses)
        order = self.address_order(addresses)
        rows = self._gather_in_order(addresses[order])
        return torch.empty_like(rows).index_copy_(0, order, rows)

    def _scatter(self, addresses: torch.Tensor, rows: torch.Tensor) -> None:
        if self._kernels is None:
            self._store.scatter(addresses, rows)
        else:
            order = self.address_order(addresses)
            self.scatter_in_order(addresses[order], rows[order])

    def _gather_in_order(self, addresses: torch.Tensor) -> torch.Tensor:
        """Rows at ``addresses`` (sorted, -1 reads zeros)."""
        if self._kernels is None:
            return self._store.gather(addresses)
        return self._kernels.gather(self._store, addresses, self.width, self._uva_programs, self.dtype)

    def scatter_in_order(self, addresses: torch.Tensor, rows: torch.Tensor,
                         source: torch.Tensor | None = None) -> None:
        """Rows to ``addresses`` (sorted, -1 writes nothing); ``source``: row i is ``rows[source[i]]``."""
        if self._kernels is None:
            self._store.scatter(addresses, rows if source is None else rows[source])
        else:
            self._kernels.scatter(self._store, addresses, rows, self._uva_programs, source=source)

    def scatter_beside(self, addresses: torch.Tensor, rows: torch.Tensor, source: torch.Tensor | None,
                       stream: torch.cuda.Stream | None, keep: bool = True) -> None:
        """``scatter_in_order`` on ``stream``, a side stream of the current one (None: in place), so
        that the current stream's kernels run while it writes. On an eighth of the SMs: stores to
        host memory hold up the memory pipes of their SM, and every kernel beside them with it. On
        an H100, the ``cache`` bench's step (22.6 MB written down a step, scale 0.3): 2.13-2.52 ms
        with the write in the insertion's graph on every SM, 2.19-3.19 beside it on half the SMs,
        2.11-2.43 on a quarter, 1.66 on an eighth, in one call (H100, 2026-11-27).
        Whatever reaches the rows next, on any stream, waits for it (``RowStore.ready``). ``keep``:
        the tensors given stay allocated until it is done (False: the caller keeps them until then)."""
        if stream is None or self._kernels is None:
            self.scatter_in_order(addresses, rows, source)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        programs = max(1, self._uva_programs // 8)
        with torch.cuda.stream(stream):
            self._kernels.scatter(self._store, addresses, rows, programs, source=source)
        done = torch.cuda.Event()
        done.record(stream)
        if keep:  # their memory is not reused on the current stream before the write has read them
            for t in (addresses, rows) if source is None else (addresses, rows, source):
                t.record_stream(stream)
        self._store.ready = done

    def read_into(self, addresses: torch.Tensor, store: RowStore, to: torch.Tensor) -> None:
        """The rows at ``addresses`` (sorted, -1 copies nothing) into rows ``to`` of ``store`` (a
        device's: a cache's rows), without a buffer between."""
        if self._kernels is None:
            TorchKernels().copy_rows(self._store, addresses, store, to)
        else:
            self._kernels.copy_rows(self._store, addresses, store, to, self._uva_programs)

    def address_order(self, addresses: torch.Tensor) -> torch.Tensor:
        """The permutation sorting ``addresses``; on 32 bits while they fit (half the radix passes:
        14 launches instead of 22, 64 us of host time instead of 100 for 45k rows on the H200)."""
        if self._store.rows_allocated() < 2**31:
            addresses = addresses.to(torch.int32)
        return torch.argsort(addresses)

    # ------------------------------------------------------------------------------------ verbs
    def _keys(self, keys: torch.Tensor, tables: torch.Tensor | None):
        keys = keys.reshape(-1).to(device=self.device, dtype=torch.int64)
        return keys, None if tables is None else tables.reshape(-1).to(device=self.device)

    def get(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> Fetched:
        """keys int64 (n,) -> rows (n, W) in the store's dtype (zeros where absent), found bool (n,), on
        ``self.device`` (the CPU, or the CUDA device whose index this is)."""
        keys, tables = self._keys(keys, tables)
        self.settle()
        addresses, found = self._addresses(keys, tables)
        rows = self._gather(addresses)  # address -1 reads zeros
        if self.capacity is not None and bool(found.any()):
            self._touch(keys[found], None if tables is None else tables[found])
        return Fetched(rows, found)

    def _addresses(self, keys: torch.Tensor,
                   tables: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each key's row address (-1 where absent; ``RESERVED_KEY`` never found) and found bool."""
        slots = self._index.find(keys, tables)
        found = slots >= 0
        return torch.where(found, self._index.values[slots.clamp(min=0)], -1), found

    def locate(self, keys: torch.Tensor,
               tables: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``get``'s probe alone (keys on ``self.device``, after ``settle``; no score moves): each
        key's row address (-1 where absent) and found bool. Its read in the rows' address order:
        ``read_into(addresses[address_order(addresses)], ...)``."""
        return self._addresses(keys, tables)

    def set(self, keys: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor | None = None) -> None:
        """Upsert keys int64 (n,) with rows (n, W) (rounded to the store's dtype); a repeated key keeps
        its last row.

        Bounded: a key whose bucket has no room in this call (more new keys than ways) is skipped.
        """
        keys, tables = self._keys(keys, tables)
        if keys.numel() == 0:
            return
        if bool((keys == RESERVED_KEY).any()):
            raise ValueError(f"key {RESERVED_KEY} (te.RESERVED_KEY) cannot be stored")
        last = last_of_duplicates(keys, tables)
        self.set_distinct(keys[last], rows[last], None if tables is None else tables[last])

    def set_distinct(self, keys: torch.Tensor, rows: torch.Tensor,
                     tables: torch.Tensor | None = None) -> torch.Tensor:
        """``set`` of keys the caller knows are distinct (distinct pairs with ``tables``) and valid,
        on ``self.device``: the write-down path of a cache, without the checks. ``RESERVED_KEY``
        entries are padding (nothing stored): a cache writes down its victims without counting
        them. Unbounded: one ``upsert`` on the device (new keys take rows of a pool of n free ones)
        and no host read: how many rows it took, and the keys it left out because their bucket was
        full, are read back at the next call that needs the index (``settle``). Returns the row
        addresses written (unbounded: one a key, -1 for padding or a key left out)."""
        self._step += 1
        rows = rows.to(device=self.device, dtype=self.dtype)
        if self.capacity is not None:
            self.settle()
            return self._insert_rows(keys, rows, tables)
        n = keys.numel()
        if n == 0:
            return torch.full_like(keys, -1)
        pool = self.room_for(n)
        addresses, counts = self.upsert_keys(keys, tables, pool)
        self._scatter(addresses, rows)  # a key left out (address -1) writes nothing
        self.upserted(keys, tables, rows, addresses, counts, pool)
        return addresses

    # ``set_distinct`` of an unbounded store in steps, the middle ones device work alone (a cache
    # replays them in a CUDA graph with its insertion): room, the upsert, the rows written, its record
    def room_for(self, n: int) -> torch.Tensor:
        """Make room for an upsert of n keys: the index grown to stay under its load limit even if
        every key is new (the sizes read are at most one call old), and a pool of n free rows lent to
        it (int64 (n,)); the rows it does not take go back when its counts are read."""
        # the upserts already done first (on the CPU all of them): each one left unread counts as
        # all new keys in every region, and calls of ``set`` alone would grow the index without end
        self.settle(wait=False)
        if self._sizes_read is None:
            self.settle()
            self._sizes_read = self._index.sizes_on_device.tolist()
        pending = sum(u.keys.numel() for u in self._upserts) + n
        self._index.reserve_regions([s + pending for s in self._sizes_read])
        pool = self._store.peek(n)
        self._store.pop(n)
        return pool

    def capture_key(self) -> tuple[int, int]:
        """What a CUDA graph of the device verbs bakes in: the index's rehashes and the row
        segments' table."""
        return self._index.generation, self._store.pointer_table().data_ptr()

    def give_back(self, pool: torch.Tensor) -> None:
        """A pool ``room_for`` lent and no upsert took, back to the free rows (in its order: the
        next ``room_for`` lends the same rows)."""
        self._store.free(pool)

    def upsert_keys(self, keys: torch.Tensor, tables: torch.Tensor | None,
                    pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The upsert's index on the device (``KeyIndex.upsert``; the rows to write follow): each
        key's row address (-1: left out, or padding) and int64 (2 + R,): rows taken from ``pool``,
        keys left out, the index's sizes."""
        addresses, counts = self._index.upsert(keys, tables, pool, self._step)
        return addresses, torch.cat([counts, self._index.sizes_on_device])

    def upserted(self, keys: torch.Tensor, tables: torch.Tensor | None, rows: torch.Tensor,
                 addresses: torch.Tensor, counts: torch.Tensor, pool: torch.Tensor,
                 settled: Callable[[], None] | None = None) -> None:
        """Record an ``upsert_keys`` (its rows written) for ``settle``: its counts copied to the
        host behind it. ``settled``: called once they are read (the tensors given are not needed
        after it)."""
        host, ready = to_host_later(counts, self._count_buffers)
        self._upserts.append(_Upsert(keys, rows, tables, addresses, pool, host, ready, settled))

    def settle(self, wait: bool = True) -> None:
        """Read back the upserts done on the device, in order (waiting for them; without ``wait``,
        those done): the pool rows they did not take go back to the store; keys left out go in
        now, the index growing."""
        while self._upserts:
            u = self._upserts[0]
            if u.ready is not None:
                if not wait and not u.ready.query():
                    return
                u.ready.synchronize()
            self._upserts.pop(0)
            taken, left_out, *sizes = u.counts.tolist()
            if u.ready is not None:
                self._count_buffers.append(u.counts)
            self._store.free(u.pool[taken:])
            self._sizes_read = sizes
            if left_out:  # their bucket was full: the index grows as they go in
                out = ((u.addresses < 0) & (u.keys != RESERVED_KEY)).nonzero().squeeze(1)
                self._insert_rows(u.keys[out], u.rows[out], None if u.tables is None else u.tables[out])
            if u.settled is not None:
                u.settled()

    def _insert_rows(self, keys: torch.Tensor, rows: torch.Tensor,
                     tables: torch.Tensor | None) -> torch.Tensor:
        """Upsert distinct keys through ``find_or_insert``: the index grows, or a bounded store evicts
        (a key whose bucket has no room in this call, more new keys than ways, is skipped). Returns
        the row addresses written."""
        self._sizes_read = None
        res = self._index.find_or_insert(keys, self._step, tables=tables, given_order=True)
        if res.any_miss:  # rows for the new keys: the victims' where a bounded store evicted
            addresses = res.values.clone()
            fresh = (res.slots >= 0) & (addresses < 0)
            new = (fresh.nonzero() if res.new_rows is None
                   else torch.nonzero_static(fresh, size=res.new_rows)).squeeze(1)
            fresh = self._store.allocate(new.numel())
            addresses[new] = fresh
            self._index.assign(res.slots[new], fresh)
        else:
            addresses = res.values
        if self.capacity is not None and res.unplaced != 0:  # skipped: a full bucket of a bounded store
            placed = (res.slots >= 0).nonzero().squeeze(1)
            addresses, rows = addresses[placed], rows[placed]
        self._scatter(addresses, rows)
        return addresses

    def delete(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> None:
        """Remove keys int64 (n,) (absent ones ignored)."""
        keys, tables = self._keys(keys, tables)
        if keys.numel() == 0:
            return
        self.settle()
        self._sizes_read = None
        last = last_of_duplicates(keys, tables)
        self._store.free(self._index.erase(keys[last], None if tables is None else tables[last]))

    def scan(self, chunk_rows: int = 65536, table: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every stored row once, by ascending key: (keys int64 (m,), rows (m, W) in the store's dtype).

        The keys are a snapshot taken at the first chunk; rows are read as each chunk is yielded.
        Do not ``set`` or ``delete`` while scanning (a freed row may be reused).
        """
        self.settle()
        keys, addresses, _ = self._index.export(table)
        order = torch.argsort(keys)
        keys, addresses = keys[order], addresses[order]
        for start in range(0, keys.numel(), chunk_rows):
            part = slice(start, start + chunk_rows)
            yield keys[part].clone(), self._gather(addresses[part])

    def size(self, table: int | None = None) -> int:
        self.settle()
        return self._index.size(table)

    def close(self) -> None:
        self._upserts.clear()
        self._sizes_read = [0] * len(self._regions)
        self._index = KeyIndex(device=self.device, **self._index_args)
        self._store = RowStore(self.width, self._store.segment_rows, self.device, device_segments=0,
                               dtype=self.dtype)

    def nbytes(self) -> int:
        """Host bytes held by rows (allocated segments)."""
        return self._store.nbytes()

    def index_bytes(self, table: int | None = None) -> dict[str, int]:
        """Bytes of the index's slots of ``table`` (None: all): in device memory on CUDA."""
        return {"device" if self.device.type == "cuda" else "host": self._index.nbytes(table)}

    def _touch(self, keys: torch.Tensor, tables: torch.Tensor | None) -> None:
        """Refresh the LRU score of present keys (a cache hit)."""
        self._step += 1
        last = last_of_duplicates(keys, tables)
        self._index.find_or_insert(keys[last], self._step, tables=None if tables is None else tables[last])


class _TableView(Backend):
    """Table ``t`` of a several-table ``HostMemoryBackend``, as a one-table backend."""

    def __init__(self, rows: HostMemoryBackend, t: int) -> None:
        self.rows, self.t = rows, t
        self.width, self.device, self.dtype = rows.width, rows.device, rows.dtype

    def _tables(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.full((keys.numel(),), self.t, dtype=torch.int64, device=self.device)

    def get(self, keys: torch.Tensor) -> Fetched:
        return self.rows.get(keys, self._tables(keys))

    def set(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        self.rows.set(keys, rows, self._tables(keys))

    def delete(self, keys: torch.Tensor) -> None:
        self.rows.delete(keys, self._tables(keys))

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.rows.scan(chunk_rows, self.t)

    def size(self) -> int:
        return self.rows.size(self.t)

    def index_bytes(self) -> dict[str, int]:
        return self.rows.index_bytes(self.t)


class HostMemoryGroup(GroupStore):
    """A table group's rows in one ``HostMemoryBackend`` (a region per table): every call is one
    call, whatever the number of tables. Its calls are device (or memory) work, not I/O: they run on
    the caller's thread and stream."""

    io_bound = False

    def __init__(self, rows: HostMemoryBackend) -> None:
        self.rows = rows
        self.device_rows = rows
        self.device = rows.device
        self.width = rows.width
        self.dtype = rows.dtype
        self.backends = [_TableView(rows, t) for t in range(len(rows._regions))]

    def get(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        return self.rows.get(keys, tables)

    def set(self, keys: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
            distinct: bool = False) -> None:
        if distinct:
            self.rows.set_distinct(keys, rows, tables)
        else:
            self.rows.set(keys, rows, tables)

    def delete(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        self.rows.delete(keys, tables)

    def close(self) -> None:
        self.rows.close()


class CachedBackend(Backend):
    """A write-through DRAM cache of rows in front of a slower backend (FBGEMM's "L2" cache).

    ``get`` answers hits from host memory and fetches only the misses from ``store``, keeping what
    it fetched; ``set`` writes ``store`` first, then the cache. Write-through, not write-back: the
    store always holds every row, so an eviction from the cache never writes, a failed ``set``
    leaves cache and store agreeing on the old rows, and ``scan``/``size`` read the store alone. What
    it saves is the expensive part on SSD or over the network, the random reads; RocksDB's writes
    (WAL off, into the memtable) are cheap.

    Args:
        store: the backend below (RocksDB, Redis), owned: closed with this one.
        cache_rows: about how many rows the cache holds (least recently used evicted per bucket).
        pinned: page-lock the cache rows.
    """

    def __init__(self, store: Backend, cache_rows: int, pinned: bool = False) -> None:
        self.width, self.dtype = store.width, store.dtype
        self.store = store
        self.cache = HostMemoryBackend(store.width, pinned=pinned, capacity=cache_rows, dtype=store.dtype)
        self.hits = 0
        self.misses = 0

    def get(self, keys: torch.Tensor) -> Fetched:
        keys = keys.reshape(-1).to(torch.int64)
        cached = self.cache.get(keys)
        miss = ~cached.found
        n_miss = int(miss.sum())
        self.hits += keys.numel() - n_miss
        self.misses += n_miss
        if n_miss == 0:
            return cached
        miss_keys = keys[miss]
        fetched = self.store.get(miss_keys)
        cached.rows[miss] = fetched.rows
        cached.found[miss] = fetched.found
        self.cache.set(miss_keys[fetched.found], fetched.rows[fetched.found])
        return cached

    def set(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        self.store.set(keys, rows)  # raises before the cache changes: both keep the old rows
        self.cache.set(keys, rows)

    def delete(self, keys: torch.Tensor) -> None:
        self.store.delete(keys)
        self.cache.delete(keys)

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.store.scan(chunk_rows)

    def size(self) -> int:
        return self.store.size()

    def index_bytes(self) -> dict[str, int]:
        return add_bytes(self.cache.index_bytes(), self.store.index_bytes())

    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.cache.close()
        self.store.close()
