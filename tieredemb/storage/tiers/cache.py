"""A group of tables in ``cache`` mode: a bounded device tier, write-back, over backing stores.

One index (a bounded region per table: its cache rows) over one row store, as in ``DeviceTier``;
each table keeps its own backend (its namespace in RocksDB or Redis). Prefetch does all the moving;
forward and backward see row addresses like in ``hbm_direct``:

    unique (table, key) pairs ─► find in the cache ─┬─ hit: lock
                                 ├─ in an earlier batch's scratch pad: share that row
                                 └─ miss: get from the table's backend ─► admission (new keys only)
                                      ─► find_or_insert: victims written down first, then the
                                         fetched (or initial) rows written into their slots
                                      ─► no way free in the bucket (conflict miss), or not
                                         admitted: a scratch row for the batch

Over host memory (no admission, no bounded table, no scratch row owed) the same happens on the
device without a host read, in another order (``_insert_on_device``, replayed from a CUDA graph): the
misses are inserted first (victims' rows reused, a scratch row from a lent pool for a pair without a
way), the victims written down while the misses' rows are fetched into their new rows; the host learns
the counts (conflict misses, rows taken) at the next prefetch.

At release (after backward) the batch's slots are unlocked and its scratch rows are written down to
the backend (conflict misses; the last batch sharing a row writes it) or dropped (not admitted).
Evicted rows are always written down: the cache never loses a row. Write-downs to a store doing host
I/O (RocksDB, Redis) go to its I/O worker and the prefetch goes on; every fetch first waits for the
earlier write-downs (one FIFO), so it reads the newest rows. Rows whose write-down failed are kept on
the host and retried at the next call that needs the store; until the store takes them that call
raises ``BackendError`` chained to the store's exception, before anything changes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tieredemb.config import RESERVED_KEY, TableConfig
from tieredemb.index.key_index import CONTESTED, KeyIndex, Region
from tieredemb.ops.capture import CapturedStages, Slot, padded_size
from tieredemb.ops.reference import TorchKernels
from tieredemb.optim import EmbeddingOptimizer
from tieredemb.profiling import label
from tieredemb.storage.backend import Fetched, GroupStore, add_bytes
from tieredemb.storage.errors import BackendError
from tieredemb.storage.io_worker import IOHandle, IOWorker
from tieredemb.storage.tiers.device import DeviceTier
from tieredemb.storage.tiers.parts import (
    CONFLICTS,
    EVICTIONS,
    MISSES,
    NOT_ADMITTED,
    UNIQUE,
    CachePrefetch,
    GroupPrefetch,
    LentRows,
    StagedPrefetch,
    TableRows,
    TableStats,
)


@dataclass(eq=False)
class _Pending:
    """Rows written down and not yet confirmed taken by the backing store (distinct pairs), with
    the I/O worker's handle while they are in its queue."""

    keys: torch.Tensor
    tables: torch.Tensor
    rows: torch.Tensor
    handle: IOHandle | None = None


def _per_table(tables: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """int64 (n,): how many of ``tables`` (int64 (m,), each < n) are ``mask``ed, per table: a
    histogram (no atomics of 10^4 entries on a few counters: ``index_add_`` took 47 us there)."""
    hist = torch.histc(torch.where(mask, tables, n).to(torch.float32), bins=n + 1, min=0, max=n + 1)
    return hist[:n].to(torch.int64)


class _Beside:
    """Work queued on a side stream behind the current stream's work so far (``with beside:``);
    ``join()`` makes the current stream wait for it. Without a side stream (the CPU) it runs in
    place, in the order written."""

    def __init__(self, side: torch.cuda.Stream | None, current: torch.cuda.Stream | None = None) -> None:
        self.side, self.current = side, current

    def __enter__(self) -> _Beside:
        if self.side is not None:
            self.side.wait_stream(self.current)
            self._on = torch.cuda.stream(self.side)
            self._on.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.side is not None:
            self._on.__exit__(*exc)

    def join(self) -> None:
        if self.side is not None:
            self.current.wait_stream(self.side)


@dataclass
class _Armed:
    """``CacheTier.arm``'s work for the insertion graph of ``key`` (``CacheTier._insert_key``): the
    free rows lent (the cache's, the host store's) and the graph slot taken, its inputs loaded."""

    key: tuple
    pool: torch.Tensor
    hpool: torch.Tensor
    slot: Slot | None


class CacheTier(DeviceTier):
    """A device cache of ``cache_rows[t]`` rows for each table t over the group's backing store.

    Args: as ``DeviceTier``, plus ``cache_rows`` (slots of each table's region, whole buckets) and
    ``below``, the tables' backing store (``GroupStore``: one call for all tables where it can).
    """

    _contest = False  # the staged probe only counts: the insertion probes again, after the fetch
    _rows_up_front = False  # the cache holds what the budget gives it; the rows live below

    def __init__(self, configs: list[TableConfig], optimizer: EmbeddingOptimizer, seed: int,
                 device: torch.device, kernels: TorchKernels, bucket_width: int, segment_rows: int,
                 cache_rows: list[int], below: GroupStore) -> None:
        super().__init__(configs, optimizer, seed, device, kernels, bucket_width,
                         min(segment_rows, sum(cache_rows)), index_slots=cache_rows)
        self.below = below
        self.backend_device = below.device
        # pairs whose rows are in a scratch pad and still owed to the backend: value = scratch
        # address, lock = batches sharing it
        self.in_flight = kernels.index_class(bucket_width, device=device, regions=[
            Region("lru", None, 256) for _ in configs])
        self._owing = 0  # prefetched batches not yet released that owe pairs in ``in_flight``
        self._probe_only = torch.ones(1, dtype=torch.int64, device=device)  # find_touch's guard: no change
        # rows moved per table: fetched from / written to the backing store
        self._moved = torch.zeros(2, len(configs), dtype=torch.int64, device=self.backend_device)
        # batches inserted on the device (``_insert_on_device``) whose counts the host has not read
        self._inserting: list[CachePrefetch] = []
        self._last_insert: tuple[int, int] | None = None  # the last graph's padded pairs and misses
        self._armed: _Armed | None = None  # the next insertion's host work, done (``arm``)
        self.arms = [0, 0]  # arms replayed, arms given back (other sizes, no free slot, a bad batch)
        # side streams by priority and use (``_beside``, ``_write_stream``)
        self._side_streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        # rows written down but not yet confirmed taken by the backing store, in order
        self._unwritten: list[_Pending] = []
        self._write_error: Exception | None = None
        # stores doing host I/O (RocksDB, Redis) take write-downs on their own thread, in order
        self.io = IOWorker(name=f"{'+'.join(self.names)}/backing") if below.io_bound else None
        # tables with max_capacity: which keys the table holds, in every tier, decided by an index
        # of exactly hbm_direct's shape (same buckets, scores, locks), so the same rows are stored
        # and evicted as there; an evicted key's row is dropped from the cache and the store
        self.bound = None
        if any(c.max_capacity is not None for c in configs):
            self.bound = kernels.index_class(bucket_width, device=device, regions=[
                Region(c.eviction, c.max_capacity, 16) for c in configs])
            self._bounded = torch.tensor([c.max_capacity is not None for c in configs], device=device)

    # --------------------------------------------------------------------------------- prefetch
    def _prefetch_pairs(self, unique: torch.Tensor, utab: torch.Tensor, inverse: torch.Tensor,
                        counts: torch.Tensor, step: int, training: bool) -> GroupPrefetch:
        if not training:
            return self._prefetch_eval(unique, utab, inverse)
        slots, _, per_region = self.index.find_touch(unique, utab, step, counts, None, self._probe_only)
        info = torch.cat([per_region[: len(self.configs)], self.index.sizes_on_device]).tolist()
        return self._place(unique, utab, inverse, counts, step, slots, per_region, info)

    def can_stage(self) -> bool:
        """Every key of a batch gets a cache row or a scratch row: staged unless a table is bounded
        or admits keys (their decisions read the device first)."""
        return self.bound is None and self.admission is None

    def stage_prefetch(self, ids: torch.Tensor, tables: torch.Tensor, step: int | torch.Tensor,
                       guard: torch.Tensor,
                       id_count: torch.Tensor | None = None) -> tuple[StagedPrefetch, list[torch.Tensor]]:
        """``DeviceTier.stage_prefetch`` with a probe that changes nothing whatever ``guard`` says:
        the cache locks and touches the keys it finds after the fetch (``_place``); no per-id rows
        (a cache's misses get theirs after the read)."""
        return super().stage_prefetch(ids, tables, step, self._probe_only, by_id=False, id_count=id_count)

    def stage_probe(self, keys: torch.Tensor, tables: torch.Tensor, step: int | torch.Tensor,
                    counts: torch.Tensor, count: torch.Tensor, guard: torch.Tensor, first_table: int,
                    out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``DeviceTier.stage_probe`` changing nothing, as ``stage_prefetch``'s probe."""
        return super().stage_probe(keys, tables, step, counts, count, self._probe_only, first_table, out)

    def _finish_staged(self, staged: StagedPrefetch, u: int, info: list[int]) -> GroupPrefetch:
        info = info[: 2 * len(self.configs)]  # misses and sizes (its probe contests nothing)
        try:
            with label("## resolve ##"):
                return self._place(staged.keys[:u], staged.tables[:u], staged.inverse, staged.counts[:u],
                                   staged.step, staged.slots[:u], staged.per_region, info)
        finally:
            self.disarm()  # an arm the insertion did not take (it took it, or found it wrong)

    def arm(self, staged: StagedPrefetch, count: torch.Tensor) -> None:
        """The device insertion's host work before the staged read, where its graph is replayed:
        the pools of free rows lent, a captured slot taken and its inputs copied (the pairs as the
        staged graph left them, padded; their count from the device), for the padded pairs and
        misses of the last insertion (they change every few steps). ``_insert_on_device`` replays it
        at once if the read says the same sizes; else it gives everything back and goes on as
        without. What it moves off the path from the read to the replay (H200, ``cache`` bench):
        ~0.2 ms of host a step with the device idle."""
        self.disarm()
        last = self._last_insert
        if last is None or not self._inserts_on_device() or not self._device_graphs_for(staged.step):
            return
        pairs, bound = last
        pool, hpool = self._lend(bound)
        key = self._insert_key(pairs, bound)
        armed = _Armed(key, pool, hpool, self._insert_graphs.take(key))
        if armed.slot is None:  # none captured for these sizes, or every one in flight
            self._give_back(armed)
            return
        pairs_of = (staged.keys[:pairs], staged.tables[:pairs], staged.counts[:pairs])
        self._insert_graphs.load(armed.slot, *pairs_of, pool, hpool, staged.step, count)
        self._armed = armed

    def _lend(self, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device insertion's pools of ``bound`` free rows, the cache's and the host store's,
        after the host store's earlier upserts are read back (the fetch then sees every row written
        down before; keys they left out go in now)."""
        self.below.settle()
        pool = self.store.peek(bound)
        self.store.pop(bound)
        return pool, self.below.room_for(bound)

    def disarm(self) -> None:
        armed, self._armed = self._armed, None
        if armed is not None:
            self._give_back(armed)

    def _give_back(self, armed: _Armed) -> None:
        """An arm's pools back where they came from, in their order; its slot free."""
        self.arms[1] += 1
        self.store.free(armed.pool)
        self.below.give_back(armed.hpool)
        if armed.slot is not None:
            self._insert_graphs.cancel(armed.slot)

    def _insert_key(self, pairs: int, bound: int) -> tuple:
        """The insertion graph's key: the sizes and what it bakes in (the indexes' rehashes, the row
        stores' segment tables)."""
        return (pairs, bound, self.index.generation, self.store.pointer_table().data_ptr(),
                *self.below.capture_key())

    def _place(self, unique: torch.Tensor, utab: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor,
               step: int, slots: torch.Tensor, per_region: torch.Tensor, info: list[int]) -> CachePrefetch:
        """The training prefetch after the probe (``slots``, ``per_region``) and its host read
        (``info``: misses per region, then the index's sizes): pads, fetch, insert, write-down."""
        if self._inserts_on_device():
            return self._insert_on_device(unique, utab, inverse, counts, step, slots, per_region, info)
        dev, regions = self.device, len(self.configs)
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        missing, misses, n_pad = slots < 0, per_region[:regions], 0
        if self._owing:  # pairs in flight in a scratch pad (a batch not yet released owes some)
            shared = self.in_flight.find(unique, utab)
            pad = shared >= 0
            missing = missing & ~pad
            misses = torch.zeros(regions, dtype=torch.int64, device=dev).index_add_(0, utab, missing.long())
            n_pad, *pad_info = torch.cat([pad.sum().view(1), misses]).tolist()
            info = pad_info + info[regions:]
        miss = torch.nonzero_static(missing, size=sum(info[:regions])).squeeze(1)
        in_pad, rest = empty, None  # positions of the pairs in a pad and of the others (None: all)
        if n_pad:
            in_pad = torch.nonzero_static(pad, size=n_pad).squeeze(1)
            rest = torch.nonzero_static(~pad, size=unique.numel() - n_pad).squeeze(1)
        with label("## cache.fetch ##"):
            fetched = self._fetch(unique[miss], utab[miss])  # (m, W) rows: the store's, else
            # initial. May raise (a failed write-down or fetch): nothing has changed yet
        row_of = None  # each position's row in ``fetched`` (-1: a hit), made where needed
        with label("## cache.insert ##"):
            if self.can_stage():  # no bounded table, no admission: every pair not in a pad is stored
                keep, dropped, bound, deferring = rest, empty, None, None
                keys, tabs, cnts = (t if keep is None else t[keep] for t in (unique, utab, counts))
                # lock and touch the pairs found; the misses per region are the probe's
                found, values, per_table = self.index.find_touch(keys, tabs, step, cnts)
                res = self.index.complete(keys, tabs, step, cnts, True, found, values, per_table, info,
                                          given_order=True)
            else:
                if rest is None:
                    rest = torch.arange(unique.numel(), device=dev)
                row_of = self._fetched_rows_of(unique.numel(), miss)
                keep, dropped, bound, deferring = self._stored(unique, utab, counts, step, rest, slots,
                                                               miss, fetched, row_of)
                res = self.index.find_or_insert(unique[keep], step, counts[keep], lock=True,
                                                tables=utab[keep], given_order=True)
        with label("## cache.write_down ##"):
            self._write_down(res.evicted_keys, res.evicted_tables, res.evicted_values)
        if keep is None and res.unplaced == 0:  # every miss inserted: positions and rows as fetched
            rows_at = self._fill_inserted(res, fetched.rows, inserted=miss)
        else:
            if row_of is None:
                row_of = self._fetched_rows_of(unique.numel(), miss)
            rows_at = self._fill_inserted(res, fetched.rows, row_of if keep is None else row_of[keep])
        if res.unplaced == 0:  # no conflict miss: every kept key got a cache row
            placed_keys, conflict, locked_slots = keep, empty, res.slots
        else:
            placed = (res.slots >= 0).nonzero().squeeze(1)
            unplaced = (res.slots < 0).nonzero().squeeze(1)
            placed_keys, conflict = (i if keep is None else keep[i] for i in (placed, unplaced))
            rows_at, locked_slots = rows_at[placed], res.slots[placed]
        if placed_keys is None:  # every pair placed in the cache (the common case)
            addresses = rows_at
        else:
            addresses = torch.full((unique.numel(),), -1, dtype=torch.int64, device=dev)
            addresses[placed_keys] = rows_at
        if in_pad.numel():
            pad_slots = shared[in_pad]
            addresses[in_pad] = self.in_flight.values[pad_slots]
            self.in_flight.locks[pad_slots] += 1
        # scratch: conflict misses (owed to the backend) and keys not admitted (dropped)
        owed = self._scratch(fetched.rows, row_of, addresses, conflict)
        private = self._scratch(fetched.rows, row_of, addresses, dropped)
        self._register_owed(unique[conflict], utab[conflict], owed)
        refused = dropped if deferring is None else dropped[~torch.isin(dropped, deferring)]
        # columns UNIQUE, HITS (in the cache or in a pad), MISSES: adjacent, one add per table
        self._counts[:, UNIQUE:MISSES + 1] += torch.stack(
            [per_region[regions : 2 * regions], per_region[regions : 2 * regions] - misses, misses], dim=1)
        self._count((CONFLICTS, utab[conflict], None), (EVICTIONS, res.evicted_tables, None),
                    (NOT_ADMITTED, utab[refused], None))
        owed_pos = torch.cat([in_pad, conflict]) if in_pad.numel() or conflict.numel() else empty
        locked = (unique, utab) if placed_keys is None else (unique[placed_keys], utab[placed_keys])
        pf = CachePrefetch(unique, utab, inverse, addresses, *locked, locked_slots, self.index.generation,
                           private, write_back=unique[owed_pos] if owed_pos.numel() else empty,
                           write_back_tables=utab[owed_pos] if owed_pos.numel() else empty, bound=bound)
        self._owing += bool(owed_pos.numel())
        if deferring is not None:
            pf.deferred = (deferring, step, counts[deferring])
            self._pending.append(pf)
        return pf

    def _inserts_on_device(self) -> bool:
        """Whether this batch's insertion runs on the device without a host read: every pair gets a
        cache row or a scratch row (no bounded table, no admission), no scratch row of an earlier
        batch is still owed (``in_flight``), and the backing store takes padded write-downs on this
        device (host memory: ``GroupStore.padded_writes``)."""
        return self.can_stage() and not self._owing and self.below.padded_writes and \
            self.backend_device == self.device

    def _insert_on_device(self, unique: torch.Tensor, utab: torch.Tensor, inverse: torch.Tensor,
                          counts: torch.Tensor, step: int, slots: torch.Tensor, per_region: torch.Tensor,
                          info: list[int]) -> CachePrefetch:
        """``_place`` reading nothing on the host, as ``hbm_direct``'s bounded tables insert: the
        pairs found locked and touched, the misses (``info``'s count of ``slots`` -1) inserted in the
        dedup's order (``insert_rows``), each taking a victim's row or one of a pool of as many free
        rows (from its end: a scratch row, where its bucket had no free way); the victims (padded to
        the misses: ``RESERVED_KEY`` where a pair evicted none) gathered and written down to the host
        store while the misses' rows are fetched from it (initial rows where it has none) into their
        rows. Replayed
        from a CUDA graph where one is captured (``_device_insert``). How many of the pool's rows were
        taken, and which pairs got none (conflict misses, owed to the store at release), the host
        learns later (``_owe_conflicts``)."""
        regions, below = len(self.configs), self.below
        misses = sum(info[:regions])
        graphs = self._device_graphs_for(step)
        u = unique.numel()
        pairs = padded_size(u) if graphs else u
        bound = min(pairs, 1 << (misses - 1).bit_length()) if graphs and misses else misses
        armed, self._armed = self._armed, None
        if armed is not None and armed.key != self._insert_key(pairs, bound):
            self._give_back(armed)  # armed for other sizes (or segment tables, or a rehash since)
            armed = None
        if armed is None:
            pool, hpool = self._lend(bound)
        else:  # lent before the read (``arm``), the slot loaded
            pool, hpool = armed.pool, armed.hpool
        with label("## cache.insert ##"):
            slot = None
            if armed is not None:
                slot = armed.slot
                self._insert_graphs.replay(slot)
                self.arms[0] += 1
            elif graphs:
                def insert(keys, tables, counts, pool, hpool, step, u):
                    return self._device_insert(keys, tables, counts, pool, hpool, step, u, bound)

                key = self._insert_key(pairs, bound)
                slot = self._insert_graphs.acquire(key, insert, unique, utab, counts, pool, hpool, step, u,
                                                   lengths=(pairs,) * 3, capture=self.may_capture())
            # the next batch is armed for these sizes only where a graph of them replayed (a thread
            # that may not capture runs a shape no one captured eagerly: no arm would find a slot)
            self._last_insert = None if slot is None else (pairs, bound)
            write = self._write_stream()
            if slot is None:  # eagerly, with the misses' exact count (the pools sized for a graph: cut)
                self.store.free(pool[misses:])
                pool = pool[:misses]
                out = self._device_insert(unique, utab, counts, pool, hpool, step, None, misses)
                settled = None
            else:
                out = slot.outputs
                settled = functools.partial(self._graph_settled, slot, write)
            slots, values, kinds, written, (down_at, down_order) = out
            if slot is not None:  # the batch's own copies: the slot serves the next batch
                slots, values, kinds = slots[:u].clone(), values[:u].clone(), kinds.clone()
            below.written(*written, hpool, settled)
            # the victims' rows go down to the host store beside the rest of the step: nothing of this
            # batch waits for them, what reads the store next does (a graph's slot: kept by ``settled``)
            below.scatter_beside(down_at, written[2], down_order, write, keep=slot is None)
        pairs_in, missed = per_region[regions : 2 * regions], per_region[:regions]
        self._counts[:, UNIQUE : MISSES + 1] += torch.stack([pairs_in, pairs_in - missed, missed], dim=1)
        self._counts[:, CONFLICTS : EVICTIONS + 1] += kinds[1:].T  # left without a way, victims
        empty = unique[:0]
        pf = CachePrefetch(unique, utab, inverse, values, unique, utab, slots, self.index.generation, empty,
                           write_back=empty, write_back_tables=empty,
                           lent=LentRows(pool, *self._to_host(kinds)))
        self._inserting.append(pf)
        return pf

    def _device_graphs_for(self, step: int) -> bool:
        """Whether the device insertion may replay a CUDA graph (as ``DeviceTier._insert_graph``: on
        the thread that may capture, the step an int, one built-in initializer)."""
        if self.may_capture is None or not isinstance(step, int) or self._inits[0][1] is not None or \
                type(self._inits[0][0]).__module__ != "tieredemb.init":
            return False
        if self._insert_graphs is None:
            self._insert_graphs = CapturedStages(self.device, (torch.int64,) * 7, max_slots=8,
                                                 what="the cache's insertion")
        return True

    def _device_insert(self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                       pool: torch.Tensor, hpool: torch.Tensor, step: int | torch.Tensor,
                       u: torch.Tensor | None, bound: int):
        """``_insert_on_device``'s device work: ``keys``, ``tables``, ``counts`` the batch's pairs (the
        first ``u``, int64 () on the device, of them when padded for a graph; None: all), ``bound``
        the misses (padded: at least them), ``pool`` and ``hpool`` that many free rows of the cache
        and of the host store. Returns (slots, values, kinds), each pair's slot (-1: a conflict miss)
        and row, and ``insert_rows``'s counts; and the host store's upsert (keys, tables, rows, their
        addresses, its counts) for ``written``."""
        if u is None:
            slots, values, _ = self.index.find_touch(keys, tables, step, counts)  # lock, touch the found
        else:
            slots, values, _ = self.index.find_touch(keys, tables, step, counts, u)
            padding = torch.arange(keys.numel(), device=self.device) >= u
            slots.masked_fill_(padding, 0)  # no miss
            # and of a valid table: an armed insertion's padding is what the staged graph left there
            # (``arm``), and the insertion's sort reads each pair's region by its table
            tables = tables.masked_fill(padding, 0)
        evicted = torch.empty(bound, dtype=torch.int64, device=self.device)
        padded = {} if u is None else {"padded": True}  # (the Triton index's: a graph's)
        pos, rows, kinds = self.index.insert_rows(keys, tables, counts, slots, values, bound, step, pool,
                                                  evicted=evicted, **padded)
        # the victims' rows go down to the host store while the misses' rows come up from it
        # (opposite PCIe directions; different host rows: a victim was cached, a miss was not), each
        # in the order of its host rows (the order they move fastest). First, on this stream: the
        # misses located (the upsert then changes the host index), the victims' rows gathered (the
        # fetch then overwrites them). The read then runs beside the initial rows and the upsert: the
        # two directions share one limit of host access (~52 GB/s together on an H200),
        # so the link is best kept busy from the read's start; and the victims' write slows every
        # kernel beside it (x10-x25: its stores to host memory hold the SMs' memory pipes).
        vtables, victim = tables[pos], evicted != RESERVED_KEY
        wanted = torch.where(rows >= 0, keys[pos], RESERVED_KEY)
        located, found = self.below.locate(wanted, vtables)
        down = self.kernels.gather(self.store, torch.where(victim, rows, -1), self.width)
        with self._beside() as fetching:  # (what it reads from this stream stays referenced to the join)
            fetch = self.below.address_order(located)
            self.below.copy_in_order(located[fetch], self.store, rows[fetch])
        # the misses the store lacks take initial rows (HBM work: beside the read, not the write)
        self.kernels.scatter(self.store, torch.where(found, -1, rows), self._initial_weights(wanted, vtables))
        addresses, hcounts = self.below.upsert_keys(evicted, vtables, hpool)
        order = self.below.address_order(addresses)
        fetching.join()
        # rows moved per table: victims (``insert_rows``'s count), misses the store had
        self._moved[1] += kinds[2]
        self._moved[0] += _per_table(vtables, found, len(self.configs))
        return slots, values, kinds, (evicted, vtables, down, addresses, hcounts), (addresses[order], order)

    def _graph_settled(self, slot, write: torch.cuda.Stream | None) -> None:
        """The host store has read the counts of the insertion replayed on ``slot``: the slot serves
        another batch once the current stream's work so far and the victims' write-down (queued on
        ``write`` at the insertion, maybe by another thread) are done."""
        if write is not None:
            write.wait_stream(torch.cuda.current_stream(self.device))
        self._insert_graphs.release(slot, write)

    def _beside(self) -> _Beside:
        """A side stream of the current one (its priority) for work that may overlap the current
        stream's (inside a capture: a branch of the graph); on the CPU, the current stream itself."""
        if self.device.type != "cuda":
            return _Beside(None)
        current = torch.cuda.current_stream(self.device)
        return _Beside(self._side_stream(current.priority, 0), current)

    def _write_stream(self) -> torch.cuda.Stream | None:
        """The stream of the victims' write-downs beside the current stream (of its priority; None
        on the CPU): not the capture's side stream (``_beside``), as it runs outside the graphs."""
        if self.device.type != "cuda":
            return None
        return self._side_stream(torch.cuda.current_stream(self.device).priority, 1)

    def _side_stream(self, priority: int, use: int) -> torch.cuda.Stream:
        side = self._side_streams.get((priority, use))
        if side is None:
            side = self._side_streams[(priority, use)] = torch.cuda.Stream(self.device, priority=priority)
        return side

    def place_overflow(self) -> None:
        """Besides ``DeviceTier``'s: the counts of the batches inserted on the device (``_owe_conflicts``),
        before anything reads the index, the scratch pads or the free rows."""
        super().place_overflow()
        self._owe_conflicts()

    def _owe_conflicts(self) -> None:
        """Read the counts of the batches inserted on the device, oldest first (waiting for them; by
        the next prefetch they are long done): the pool rows a batch did not take go back to the
        store; its conflict misses' scratch rows become owed to the backing store as an earlier
        path's are (``in_flight``: shared by later batches, written down at the last release)."""
        regions = len(self.configs)
        if self._inserting:
            self.below.settle()  # the host store's upserts first: they may hold a graph's slot
        while self._inserting:
            pf = self._inserting.pop(0)
            lent, pf.lent = pf.lent, None
            if lent.ready is not None:
                lent.ready.synchronize()
            unused, scratch = lent.split(regions)
            if lent.ready is not None:  # its pinned buffer serves a later batch
                self._count_buffers.append(lent.counts)
            self.store.free(unused)
            lacking = scratch.numel()
            if lacking:
                conflict = torch.nonzero_static(pf.locked_slots < 0, size=lacking).squeeze(1)
                keys, tables = pf.unique_keys[conflict], pf.unique_tables[conflict]
                self._register_owed(keys, tables, pf.addresses[conflict])
                pf.write_back, pf.write_back_tables = keys, tables
                self._owing += 1

    def _fetched_rows_of(self, n: int, miss: torch.Tensor) -> torch.Tensor:
        """int64 (n,): the row of each position in the fetch of ``miss`` (its positions), -1 elsewhere."""
        row_of = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        row_of[miss] = torch.arange(miss.numel(), device=self.device)
        return row_of

    def _stored(self, unique: torch.Tensor, utab: torch.Tensor, counts: torch.Tensor, step: int,
                rest: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor, fetched: Fetched,
                row_of: torch.Tensor):
        """Bounded tables or admission: which of the ``rest`` (positions of the pairs not in a pad)
        the cache stores this batch. The capacity index decides first (``_bound_members``: a pair it
        holds from now on starts from its initial row, whatever the store still had), then the
        admission policy for the misses. Returns positions kept, positions dropped (private scratch
        rows), the capacity index's locks and the deferred positions."""
        outside, fresh, bound, deferring = self._bound_members(unique, utab, counts, step)
        if bound is not None:
            renew = fresh[miss].nonzero().squeeze(1)
            if renew.numel():
                fetched.rows[renew] = self._initial_rows(unique[miss[renew]], utab[miss[renew]])
                fetched.found[renew] = False
            rest = rest[(~outside[rest]).nonzero().squeeze(1)]
            outside = outside.nonzero().squeeze(1)
        else:
            outside = torch.empty(0, dtype=torch.int64, device=self.device)
        if self.admission is None:
            return rest, outside, bound, deferring
        m = rest[(slots[rest] < 0).nonzero().squeeze(1)]  # the misses among them
        known = fetched.found[row_of[m]]  # bounded tables: admitted by the capacity index already
        if self.bound is not None:
            known = known | self._bounded[utab[m]]
        store = torch.ones(unique.numel(), dtype=torch.bool, device=self.device)
        store[m] = self._count_admission(unique[m], utab[m], counts[m], known)
        store = store[rest]
        return rest[store], torch.cat([rest[~store], outside]), bound, deferring

    def settle(self, pf: GroupPrefetch) -> None:
        """Bounded tables: the deferred keys go into the capacity index now (evicting as a plain
        loop would); those placed keep their scratch rows for the batch, now owed to the store
        (written down at release, like a conflict miss's), instead of dropped."""
        taken = self._insert_deferred(pf, self.bound)
        if taken is None:
            return
        pos, keys, tables, res, placed = taken
        self._drop(res.evicted_keys, res.evicted_tables)
        keys, tables, scratch = keys[placed], tables[placed], pf.addresses[pos[placed]]
        pf.scratch = pf.scratch[~torch.isin(pf.scratch, scratch)]
        self._register_owed(keys, tables, scratch)
        self._owing += not pf.write_back.numel()
        pf.write_back = torch.cat([pf.write_back, keys])
        pf.write_back_tables = torch.cat([pf.write_back_tables, tables])
        pf.bound.locked = torch.cat([pf.bound.locked, keys])
        pf.bound.locked_tables = torch.cat([pf.bound.locked_tables, tables])
        pf.bound.generation = -1  # slots of two moments: release unlocks by key

    def _bound_members(self, unique: torch.Tensor, utab: torch.Tensor, counts: torch.Tensor, step: int):
        """Tables with max_capacity: the batch's pairs go into the capacity index as into an
        hbm_direct table's (admission first, then insert with eviction, locked); the keys it evicts
        are dropped from every tier. Returns bool (u,) pairs the table does not store this batch
        (not admitted, or a full bucket of locked keys), bool (u,) pairs it holds from now on or
        not at all (their rows start from the initializer, whatever a store still has), what to
        unlock at release, and the positions whose insertion waits for an earlier batch (or None)."""
        outside = torch.zeros(unique.numel(), dtype=torch.bool, device=self.device)
        if self.bound is None:
            return outside, outside, None, None
        b = self._bounded[utab].nonzero().squeeze(1)
        keys, tabs, cnts = unique[b], utab[b], counts[b]
        if self.admission is not None:
            admitted = self._count_admission(keys, tabs, cnts, self.bound.find(keys, tabs) >= 0)
            outside[b[~admitted]] = True
            b, keys, tabs, cnts = b[admitted], keys[admitted], tabs[admitted], cnts[admitted]
        # contested pairs (``find_touch``) are inserted when the batch holding their bucket goes
        slots, values, per_region = self.bound.find_touch(keys, tabs, step, cnts, contest=True)
        r = len(self.configs)
        waiting = per_region[2 * r :].sum().view(1)
        info = torch.cat([per_region[:r], self.bound.sizes_on_device, waiting]).tolist()
        res = self.bound.complete(keys, tabs, step, cnts, True, slots, values, per_region, info[: 2 * r],
                                  given_order=True)
        deferring = None
        if info[-1]:
            deferring = b[torch.nonzero_static(res.slots == CONTESTED, size=info[-1]).squeeze(1)]
            outside[deferring] = True
        self._drop(res.evicted_keys, res.evicted_tables)
        self._count((EVICTIONS, res.evicted_tables, None))
        placed = (res.slots >= 0).nonzero().squeeze(1)
        outside[b[(res.slots < 0).nonzero().squeeze(1)]] = True
        fresh = outside.clone()
        fresh[b[res.inserted.nonzero().squeeze(1)]] = True
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return outside, fresh, GroupPrefetch(empty, empty, empty, empty, keys[placed], tabs[placed],
                                             res.slots[placed], self.bound.generation, empty), deferring

    def _held(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """bool (n,): the table holds the pair (always, for a table without max_capacity)."""
        if self.bound is None:
            return torch.ones(keys.numel(), dtype=torch.bool, device=keys.device)
        keys, tables = keys.to(self.device), tables.to(self.device)
        return (~self._bounded[tables] | (self.bound.find(keys, tables) >= 0))

    def _drop(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """Rows a bounded table no longer holds: out of the cache (no write-down) and the store."""
        if keys.numel() == 0:
            return
        freed = self.index.erase(keys, tables)
        self.store.free(freed)
        self._drain()  # a queued write-down of the key must not bring it back after the delete
        self.below.delete(keys.to(self.backend_device), tables.to(self.backend_device))

    def _prefetch_eval(self, unique: torch.Tensor, utab: torch.Tensor,
                       inverse: torch.Tensor) -> GroupPrefetch:
        """Read-only: cached rows by address, others fetched into private scratch rows (keys the
        backend does not hold read as zeros). Nothing is inserted and no score moves."""
        self._count((UNIQUE, utab, None))
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        addresses, found = self._locate(unique, utab)
        missing = (~found).nonzero().squeeze(1)
        got = self._get(unique[missing], utab[missing])
        have = missing[got.found.to(self.device)]
        private = self.store.allocate(have.numel())
        self.kernels.scatter(self.store, private, got.rows.to(self.device)[got.found.to(self.device)])
        addresses[have] = private
        return CachePrefetch(unique, utab, inverse, addresses, empty, empty, empty,
                             self.index.generation, private, write_back=empty, write_back_tables=empty)

    def _locate(self, keys: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Device addresses of pairs in the cache or in flight in a scratch pad (-1 elsewhere)."""
        slots = self.index.find(keys, tables)
        addresses = torch.where(slots >= 0, self.index.values[slots.clamp(min=0)], -1)
        shared = self.in_flight.find(keys, tables)
        addresses = torch.where(shared >= 0, self.in_flight.values[shared.clamp(min=0)], addresses)
        return addresses, addresses >= 0

    def _get(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        """Backing-store rows of the pairs. Every earlier write-down is taken first (the store then
        answers with the newest rows); a write-down that failed is retried, and raised if it fails
        again, before anything changes."""
        self._drain()
        bdev = self.backend_device
        keys, tables = keys.to(bdev), tables.to(bdev)
        if self.io is None:
            got = self.below.get(keys, tables)
        else:
            got = self.io.submit(self.below.get, keys, tables).result()
        if self.bound is not None:  # a row a bounded table dropped may outlive its delete
            got.found &= self._held(keys, tables).to(got.found.device)
        self._moved[0].index_add_(0, tables, got.found.to(torch.int64))
        return got

    def _fetch(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        """Rows of missed pairs on the device: the backend's where it has them, else initial rows.
        Returns ``rows`` float32 (m, W) and ``found`` bool (m,), on the device."""
        got = self._get(keys, tables)
        rows = got.rows.to(self.device)
        found = got.found.to(self.device)
        if keys.numel():  # initial rows for all, kept where the store had none: no host read
            rows = torch.where(found[:, None], rows, self._initial_rows(keys, tables))
        return Fetched(rows, found)

    def _fill_inserted(self, res, rows: torch.Tensor, row_of: torch.Tensor | None = None,
                       inserted: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of the pairs ``res`` inserted: a victim's row (already written down) or a fresh
        one, filled with the fetched or initial row: ``rows[row_of[p]]`` for position p, or, given
        ``inserted`` (the positions of the pairs inserted), ``rows`` in their order. Returns every
        pair's row address (-1: not placed)."""
        if not res.any_miss:
            return res.values
        inserted = self._give_rows(res, inserted)
        rows_at = self._slot_rows(res)
        source = rows if row_of is None else rows[row_of[inserted]]
        self.kernels.scatter(self.store, rows_at[inserted], source)
        return rows_at

    def _scratch(self, fetched: torch.Tensor, row_of: torch.Tensor | None, addresses: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """Scratch rows holding the fetched rows (``fetched[row_of[positions]]``) of the pairs at
        ``positions``; their addresses go to ``addresses[positions]``."""
        if positions.numel() == 0:  # the common case: nothing to launch
            return positions
        scratch = self.store.allocate(positions.numel())
        self.kernels.scatter(self.store, scratch, fetched[row_of[positions]])
        addresses[positions] = scratch
        return scratch

    def _register_owed(self, keys: torch.Tensor, tables: torch.Tensor, scratch: torch.Tensor) -> None:
        if keys.numel() == 0:
            return
        res = self.in_flight.find_or_insert(keys, 0, lock=True, tables=tables)
        self.in_flight.assign(res.slots, scratch)

    def _write_down(self, keys: torch.Tensor, tables: torch.Tensor, addresses: torch.Tensor) -> None:
        """Copy rows at ``addresses`` to the backends under (``tables``, ``keys``). The host copies
        are kept until the backends have taken them: a failed write loses no row. The failure is
        raised at the next call that needs a backend (never in the middle of a prefetch), and the
        rows are retried then, in order."""
        if keys.numel() == 0:
            return
        rows = self.kernels.gather(self.store, addresses, self.width)
        self._keep(keys, tables, rows)

    def _keep(self, keys: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor) -> None:
        """Hold distinct pairs' rows until the backing store has taken them, and hand them to it."""
        bdev = self.backend_device
        pending = _Pending(keys.to(bdev), tables.to(bdev), rows.to(bdev))
        self._unwritten.append(pending)
        if self._write_error is None:  # after a failure, later rows wait for it: order matters
            self._send(pending)

    def _send(self, pending: _Pending) -> None:
        """Write ``pending`` down: on the I/O worker (returns at once), or here. Never raises: a
        failure is kept for the next call."""
        try:
            if self.io is not None:
                pending.handle = self.io.submit(self.below.set, pending.keys, pending.tables,
                                                pending.rows, True)
                return
            self.below.set(pending.keys, pending.tables, pending.rows, True)
        except Exception as e:  # noqa: BLE001 - any backend failure: keep the rows, report later
            self._write_error = self._write_error or e
            return
        self._taken(pending)

    def _taken(self, pending: _Pending) -> None:
        self._unwritten.remove(pending)
        self._moved[1].index_add_(0, pending.tables, (pending.keys != RESERVED_KEY).to(torch.int64))

    def _settle(self) -> None:
        """Wait for the write-downs on the I/O worker; keep the ones that failed (or were refused
        behind a failure) for a retry."""
        for pending in list(self._unwritten):
            if pending.handle is None:
                continue
            handle, pending.handle = pending.handle, None
            try:
                handle.result()
            except BackendError as e:
                self._write_error = self._write_error or e.__cause__ or e
                continue
            self._taken(pending)

    def _drain(self) -> None:
        """Every row written down so far is in the backing store when this returns. Rows of a
        failed write-down are retried, in order; if that fails too, ``BackendError`` chained to the
        cause (the rows are still kept, and retried at the next call)."""
        self._settle()
        if not self._unwritten:
            self._write_error = None
            return
        self._write_error = None
        for pending in list(self._unwritten):
            self._send(pending)
            if self._write_error is not None:
                break
        self._settle()
        if self._write_error is not None:
            cause, self._write_error = self._write_error, None
            tables = torch.cat([p.tables for p in self._unwritten]).unique().tolist()
            n = sum(p.keys.numel() for p in self._unwritten)
            raise BackendError(f"tables {[self.names[t] for t in tables]}: writing {n} rows down to the "
                               "backing store failed; they are kept and retried at the next call") from cause

    # ---------------------------------------------------------------------------------- release
    def holds(self, pf: GroupPrefetch) -> bool:
        """A cache batch's release always has work: its slots' locks, its rows' write-down."""
        return True

    def release(self, pf: GroupPrefetch) -> None:
        """Unlock the batch's slots; write down the scratch rows no later batch still shares; drop
        the private ones; then the later batches' deferred insertions (after the write-downs: a
        key they evict must not be written back after its delete)."""
        self._owe_conflicts()  # a batch inserted on the device: its conflict misses are owed
        bound = getattr(pf, "bound", None)
        if bound is not None and not self.bound.unlock_slots(bound.locked_slots, bound.generation):
            self.bound.unlock(bound.locked, bound.locked_tables)
        self._release_own(pf)
        owed, otab = pf.write_back, pf.write_back_tables
        if owed is not None and owed.numel():
            self._owing -= 1
            slots = self.in_flight.find(owed, otab)
            self.in_flight.locks[slots] -= 1
            done = self.in_flight.locks[slots] == 0
            if bool(done.any()):
                dkeys, dtab = owed[done], otab[done]
                addresses = self.in_flight.erase(dkeys, dtab)
                self._write_down(dkeys, dtab, addresses)
                self.store.free(addresses)
        self._settle_pending()

    # ------------------------------------------------------------------------------ row access
    def read(self, table: int, keys: torch.Tensor,
             cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.place_overflow()
        cols = self.dim if cols is None else cols
        tables = self._tables_of(table, keys)
        addresses, found = self._locate(keys, tables)
        out = self.store.gather(addresses, cols)
        missing = (~found).nonzero().squeeze(1)
        got = self._get(keys[missing], tables[missing])
        out[missing] = got.rows[:, :cols].to(self.device)
        found[missing] = got.found.to(self.device)
        return out, found

    def write(self, table: int, keys: torch.Tensor, weights: torch.Tensor, step: int) -> None:
        """Upsert through the cache: rows land in the cache (victims written down), or straight
        in the backend where the bucket has no room."""
        self.place_overflow()
        tables = self._tables_of(table, keys)
        rows = torch.zeros(keys.numel(), self.width, dtype=torch.float32, device=self.device)
        rows[:, : self.dim] = weights
        if self.bound is not None and self.configs[table].max_capacity is not None:
            held = self.bound.find_or_insert(keys, step, tables=tables)
            if bool((held.slots < 0).any()):
                raise RuntimeError(f"table {self.names[table]!r}: no room for {int((held.slots < 0).sum())} "
                                   "keys (their buckets are full of rows locked by in-flight batches)")
            self._drop(held.evicted_keys, held.evicted_tables)
        # a key in flight in a scratch pad: that row is the key's until its batch writes it down at
        # release, so the write goes there (the batch's forward reads it, its backward updates it)
        shared = self.in_flight.find(keys, tables)
        pad = shared >= 0
        if bool(pad.any()):
            self.kernels.scatter(self.store, self.in_flight.values[shared[pad]], rows[pad])
            keys, tables, rows = keys[~pad], tables[~pad], rows[~pad]
        res = self.index.find_or_insert(keys, step, tables=tables)
        self._write_down(res.evicted_keys, res.evicted_tables, res.evicted_values)
        if res.any_miss:
            self._give_rows(res)
        placed = (res.slots >= 0).nonzero().squeeze(1)
        self.kernels.scatter(self.store, self._slot_rows(res)[placed], rows[placed])
        spill = (res.slots < 0).nonzero().squeeze(1)
        if spill.numel():
            self._keep(keys[spill], tables[spill], rows[spill])
        self._count((EVICTIONS, res.evicted_tables, None))

    def flush(self) -> None:
        """Write every cached row down (the backends alone then hold the tables) and flush them."""
        self.place_overflow()
        self._drain()
        for t in range(len(self.configs)):
            keys, addresses, _ = self.index.export(t)
            self._write_down(keys, self._tables_of(t, keys), addresses)
        self._drain()
        self.below.flush()

    def export(self, table: int) -> TableRows:
        """Every row of the table, wherever it is (``export_chunks``, in one piece)."""
        parts = [(k.to(self.device), r.to(self.device), sc.to(self.device))
                 for k, r, sc in self.export_chunks(table, 1 << 16)]
        if not parts:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            parts = [(empty, torch.empty(0, self.width, device=self.device), empty)]
        k, rows, sc = (torch.cat(p) for p in zip(*parts))
        return TableRows(k, rows[:, : self.dim], rows[:, self.dim :], sc)

    # ------------------------------------------------------------------------------ checkpoints
    def _scores(self, table: int, keys: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """A bounded table's scores are its capacity index's (the cache's count only its stay)."""
        if self.bound is None or self.configs[table].max_capacity is None:
            return scores
        slots = self.bound.find(keys.to(self.device), self._tables_of(table, keys.to(self.device)))
        return torch.where(slots >= 0, self.bound.scores[slots.clamp(min=0)], 0).to(scores.device)

    def export_chunks(self, table: int, rows: int):
        """Cached rows (with their scores), rows still owed by a batch in flight (a conflict miss's
        scratch row, newer than the store's), then the backing store's other rows (scores 0), in
        chunks of at most ``rows``: the store is scanned, never loaded whole."""
        self._drain()
        seen = []
        for keys, full, scores in super().export_chunks(table, rows):
            seen.append(keys)
            yield keys, full, self._scores(table, keys, scores)
        keys, addresses, _ = self.in_flight.export(table)
        for start in range(0, keys.numel(), rows):
            part = slice(start, start + rows)
            seen.append(keys[part])
            yield keys[part], self.store.gather(addresses[part]), self._scores(table, keys[part],
                                                                              torch.zeros_like(keys[part]))
        seen = torch.cat(seen) if seen else None
        for bkeys, brows in self.below.table(table).scan(rows):
            keep = self._held(bkeys, self._tables_of(table, bkeys)).to(bkeys.device)
            if seen is not None:
                keep &= ~torch.isin(bkeys, seen.to(bkeys.device))
            bkeys, brows = bkeys[keep], brows[keep]
            if bkeys.numel():
                yield bkeys, brows, self._scores(table, bkeys, torch.zeros(bkeys.numel(), dtype=torch.int64,
                                                                          device=bkeys.device))

    def import_rows(self, table: int, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> None:
        """Whole rows straight into the backing store (the cache fills as training asks); a bounded
        table's keys and scores into its capacity index."""
        if keys.numel():
            tables = self._tables_of(table, keys)
            if self.bound is not None and self.configs[table].max_capacity is not None:
                res = self.bound.find_or_insert(keys, 0, tables=tables)
                placed = (res.slots >= 0).nonzero().squeeze(1)
                self.bound.scores[res.slots[placed]] = scores[placed].to(self.device)
                keys, tables, rows = keys[placed], tables[placed], rows[placed]
            self._keep(keys, tables, rows)
            self._drain()

    def delete_rows(self, table: int, keys: torch.Tensor) -> None:
        """Remove rows from the cache and the backing store."""
        if keys.numel():
            super().delete_rows(table, keys)
            if self.bound is not None:
                self.bound.erase(keys, self._tables_of(table, keys))
            self._drain()
            self.below.table(table).delete(keys.to(self.backend_device))

    def is_empty(self) -> bool:
        self._drain()
        return self.index.size() == 0 and all(b.size() == 0 for b in self.below.backends)

    def stats(self, table: int, backend_rows: bool = True) -> TableStats:
        """As ``DeviceTier.stats``; ``backend_rows=False`` skips counting the backend's rows (a
        scan of every key in RocksDB)."""
        out = super().stats(table)
        out.rows = {"device": self.index.size(table)}
        if backend_rows:
            self._drain()
            out.rows["backend"] = self.below.table(table).size()
        out.capacity = self.index.capacity(table)
        fetched, written = (self._moved[:, table] * self.width * 4).tolist()
        out.bytes_moved = {"backend->device": fetched, "device->backend": written}
        return out

    def index_bytes(self, table: int) -> dict[str, int]:
        return add_bytes(super().index_bytes(table), self.below.table(table).index_bytes())

    def _indexes(self) -> list[KeyIndex]:
        return super()._indexes() + [self.in_flight] + ([self.bound] if self.bound is not None else [])

    def close(self) -> None:
        try:
            if self.io is not None:
                self.io.close()
        finally:
            self.below.close()
