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
device without a host read, in another order (``cache_on_device.py``).

At release (after backward) the batch's slots are unlocked and its scratch rows are written down to
the backend (conflict misses; the last batch sharing a row writes it) or dropped (not admitted).
Evicted rows are always written down: the cache never loses a row. The rows on their way down, in
order, and the store's reads behind them are ``WriteDowns``' (``write_down.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tieredemb.config import TableConfig
from tieredemb.index.key_index import CONTESTED, InsertResult, KeyIndex, Region
from tieredemb.keys import RESERVED_KEY
from tieredemb.ops.reference import TorchKernels
from tieredemb.optim import EmbeddingOptimizer
from tieredemb.profiling import label
from tieredemb.storage.backend import Fetched, GroupStore, add_bytes
from tieredemb.storage.tiers.cache_on_device import OnDeviceInsertion, per_table
from tieredemb.storage.tiers.device import DeviceTier
from tieredemb.storage.tiers.parts import (
    CONFLICTS,
    EVICTIONS,
    MISSES,
    NOT_ADMITTED,
    UNIQUE,
    CachePrefetch,
    GroupPrefetch,
    StagedPrefetch,
    TableRows,
    TableStats,
)
from tieredemb.storage.tiers.write_down import WriteDowns


@dataclass
class Placing:
    """A training batch on its way through ``CacheTier._place``, filled step by step. Positions are
    of the batch's distinct pairs (u of them)."""

    empty: torch.Tensor  # int64 (0,) on the device
    miss: torch.Tensor  # int64 (m,): the pairs fetched from the store (no cache row, no pad)
    misses: torch.Tensor  # int64 (R,): of them per table
    info: list[int]  # misses per region (the pads' left out), then the index's sizes
    shared: torch.Tensor | None = None  # int64 (u,): each pair's slot in ``in_flight`` (-1: none)
    in_pad: torch.Tensor | None = None  # int64 (p,): the pairs in an earlier batch's scratch pad
    rest: torch.Tensor | None = None  # int64: the other pairs (None: all)
    row_of: torch.Tensor | None = None  # int64 (u,): each pair's row in the fetch (-1: none), if made
    keep: torch.Tensor | None = None  # int64: the pairs the cache stores this batch (None: all)
    dropped: torch.Tensor | None = None  # int64: pairs it does not store (not admitted, outside a bound)
    bound: GroupPrefetch | None = None  # bounded tables: the pairs locked in the capacity index
    deferring: torch.Tensor | None = None  # pairs whose insertion waits for an earlier batch
    placed: torch.Tensor | None = None  # int64: the pairs given a cache row (None: all)
    conflict: torch.Tensor | None = None  # int64: the pairs kept without one (conflict misses)
    locked_slots: torch.Tensor | None = None  # int64: the slots of ``placed``, locked


class CacheTier(OnDeviceInsertion, DeviceTier):
    """A device cache of ``cache_rows[t]`` rows for each table t over the group's backing store.

    Args: as ``DeviceTier``, plus ``cache_rows`` (slots of each table's region, whole buckets) and
    ``below``, the tables' backing store (``GroupStore``: one call for all tables where it can).
    """

    _contest = False  # which rows stay in the cache is not a table's semantics: nothing waits for a batch
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
        # rows moved per table: fetched from / written to the backing store
        self._moved = torch.zeros(2, len(configs), dtype=torch.int64, device=self.backend_device)
        self._init_insertion()  # the insertion on the device over host memory (``OnDeviceInsertion``)
        # rows written down and not yet taken by the backing store, in order (an I/O worker's queue)
        self.writes = WriteDowns(below, self.names, self._moved[1])
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
        slots, values, per_region = self.index.find_touch(unique, utab, step, counts)
        info = torch.cat([per_region[: len(self.configs)], self.index.sizes_on_device]).tolist()
        return self._place(unique, utab, inverse, counts, step, slots, values, per_region, info)

    def can_stage(self) -> bool:
        """Every key of a batch gets a cache row or a scratch row: staged unless a table is bounded
        or admits keys (their decisions read the device first)."""
        return self.bound is None and self.admission is None

    def stage_prefetch(self, ids: torch.Tensor, tables: torch.Tensor, step: int | torch.Tensor,
                       guard: torch.Tensor, id_count: torch.Tensor | None = None,
                       occurrences: torch.Tensor | None = None) -> tuple[StagedPrefetch, list[torch.Tensor]]:
        """``DeviceTier.stage_prefetch`` without per-id rows (a cache's misses get theirs after the
        read). Its probe is the step's only one: the keys found are locked and touched there, the
        misses inserted after the fetch (``_place``)."""
        return super().stage_prefetch(ids, tables, step, guard, by_id=False, id_count=id_count,
                                      occurrences=occurrences)

    @property
    def below_reads(self) -> int:
        """Over a tier of a slower store (a host tier), with the insertion staged: 2, the tier's
        ``DeviceRows.lacking`` of the probe's misses."""
        rows = self._rows_below
        return rows.lacking_reads if rows is not None and self.can_stage() else 0

    def stage_below(self, keys: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor,
                    count: torch.Tensor) -> list[torch.Tensor]:
        """The count of the probe's misses the tier below lacks and its store may hold, with the
        tier's erasures before it (``DeviceRows.lacking``): where it says none (the tables in the
        tier's reach, nearly always), the insertion runs on the device and asks the store nothing;
        else on the host path, the store read first (``_needs_below``)."""
        if not self.below_reads:
            return []
        pair = torch.arange(keys.numel(), device=keys.device) < count
        # (the padding's pairs are whatever the buffers held: a table out of range is read nowhere)
        keys, tables = torch.where(pair, keys, RESERVED_KEY), torch.where(pair, tables, 0)
        return [self._rows_below.lacking(keys, tables, pair & (slots == -1))]

    def capture_key(self) -> tuple:
        """The index's rehashes, and over a host tier what ``stage_below`` bakes in of it."""
        return (*super().capture_key(), *(self._rows_below.capture_key() if self.below_reads else ()))

    def _finish_staged(self, staged: StagedPrefetch, u: int, info: list[int]) -> GroupPrefetch:
        regions = len(self.configs)
        below = info[3 * regions :]  # ``stage_below``'s
        info = info[: 2 * regions]  # misses and sizes (its probe contests nothing)
        try:
            with label("## resolve ##"):
                return self._place(staged.keys[:u], staged.tables[:u], staged.inverse, staged.counts[:u],
                                   staged.step, staged.slots[:u], staged.values[:u], staged.per_region, info,
                                   below)
        finally:
            self.disarm()  # an arm the insertion did not take (it took it, or found it wrong)

    def _place(self, unique: torch.Tensor, utab: torch.Tensor, inverse: torch.Tensor, counts: torch.Tensor,
               step: int, slots: torch.Tensor, values: torch.Tensor, per_region: torch.Tensor,
               info: list[int], below: list[int] = ()) -> CachePrefetch:
        """The training prefetch after the probe (``slots``, ``values``, ``per_region``: the pairs
        found are locked and touched) and its host read (``info``: misses per region, then the
        index's sizes; ``below``: ``stage_below``'s, where staged): pads, fetch, insert, write-down.
        A fetch that raises unlocks the pairs found and changes nothing else but their scores (which
        rows stay in the cache, not what they hold)."""
        can = self._inserts_on_device()
        on_device = can and not self._needs_below(below)
        self.insertions[0 if on_device else 1 if can else 2] += 1
        if on_device:
            return self._insert_on_device(unique, utab, inverse, counts, step, slots, values, per_region,
                                          info)
        regions = len(self.configs)
        p = self._split_pads(unique, utab, slots, per_region, info)
        with label("## cache.fetch ##"):
            try:
                fetched = self._fetch(unique[p.miss], utab[p.miss])  # (m, W) rows: the store's, else
                # initial. May raise (a failed write-down or fetch): nothing else has changed yet
            except BaseException:
                self.index.unlock_slots(slots, self.index.generation)
                raise
        with label("## cache.insert ##"):
            res = self._insert_fetched(p, unique, utab, counts, step, slots, values, per_region, fetched)
        with label("## cache.write_down ##"):
            self._write_down(res.evicted_keys, res.evicted_tables, res.evicted_values)
        addresses = self._cache_rows(p, res, unique.numel(), fetched)
        # scratch: conflict misses (owed to the backend) and keys not admitted (dropped)
        conflict, dropped, deferring, empty = p.conflict, p.dropped, p.deferring, p.empty
        owed = self._scratch(fetched.rows, p.row_of, addresses, conflict)
        private = self._scratch(fetched.rows, p.row_of, addresses, dropped)
        self._register_owed(unique[conflict], utab[conflict], owed)
        refused = dropped if deferring is None else dropped[~torch.isin(dropped, deferring)]
        # columns UNIQUE, HITS (in the cache or in a pad), MISSES: adjacent, one add per table
        pairs_in = per_region[regions : 2 * regions]
        self._counts[:, UNIQUE:MISSES + 1] += torch.stack([pairs_in, pairs_in - p.misses, p.misses], dim=1)
        self._count((CONFLICTS, utab[conflict], None), (EVICTIONS, res.evicted_tables, None),
                    (NOT_ADMITTED, utab[refused], None))
        owed_pos = torch.cat([p.in_pad, conflict]) if p.in_pad.numel() or conflict.numel() else empty
        locked = (unique, utab) if p.placed is None else (unique[p.placed], utab[p.placed])
        pf = CachePrefetch(unique, utab, inverse, addresses, *locked, p.locked_slots, self.index.generation,
                           private, write_back=unique[owed_pos] if owed_pos.numel() else empty,
                           write_back_tables=utab[owed_pos] if owed_pos.numel() else empty, bound=p.bound)
        self._owing += bool(owed_pos.numel())
        if deferring is not None:
            pf.deferred = (deferring, step, counts[deferring])
            self._pending.append(pf)
        return pf

    def _split_pads(self, unique: torch.Tensor, utab: torch.Tensor, slots: torch.Tensor,
                    per_region: torch.Tensor, info: list[int]) -> Placing:
        """``_place``'s first step: the pairs to fetch (at slot -1 and in no scratch pad still owed by
        an earlier batch) and the pairs in such a pad (one more host read, where a batch owes some)."""
        dev, regions = self.device, len(self.configs)
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        missing, misses, n_pad, shared = slots < 0, per_region[:regions], 0, None
        if self._owing:  # pairs in flight in a scratch pad (a batch not yet released owes some)
            shared = self.in_flight.find(unique, utab)
            pad = shared >= 0
            missing = missing & ~pad
            misses = per_table(utab, missing, regions)
            n_pad, *pad_info = torch.cat([pad.sum().view(1), misses]).tolist()
            info = pad_info + info[regions:]
        miss = torch.nonzero_static(missing, size=sum(info[:regions])).squeeze(1)
        p = Placing(empty, miss, misses, info, shared, in_pad=empty, dropped=empty)
        if n_pad:
            p.in_pad = torch.nonzero_static(pad, size=n_pad).squeeze(1)
            p.rest = torch.nonzero_static(~pad, size=unique.numel() - n_pad).squeeze(1)
        return p

    def _insert_fetched(self, p: Placing, unique: torch.Tensor, utab: torch.Tensor, counts: torch.Tensor,
                        step: int, slots: torch.Tensor, values: torch.Tensor, per_region: torch.Tensor,
                        fetched: Fetched) -> InsertResult:
        """``_place``'s insertion after the probe: the pairs the cache stores (``p.keep``: every pair
        not in a pad, or, with bounded tables or admission, those ``_stored`` keeps) inserted where
        the probe missed them (victims chosen, not yet written down)."""
        regions = len(self.configs)
        if self.can_stage():  # no bounded table, no admission: every pair not in a pad is stored
            p.keep = p.rest
            info = p.info
        else:
            rest = p.rest if p.rest is not None else torch.arange(unique.numel(), device=self.device)
            p.row_of = self._fetched_rows_of(unique.numel(), p.miss)
            p.keep, p.dropped, p.bound, p.deferring = self._stored(unique, utab, counts, step, rest, slots,
                                                                   p.miss, fetched, p.row_of)
            # a pair found is stored (its lock from the probe is its batch's); one host read: the
            # misses kept per region, and the index's sizes (whether to grow first)
            kept_misses = per_table(utab[p.keep], slots[p.keep] == -1, regions)
            info = torch.cat([kept_misses, self.index.sizes_on_device]).tolist()
        if p.keep is not None:
            unique, utab, counts, slots, values = (t[p.keep] for t in (unique, utab, counts, slots, values))
            every = torch.ones_like(utab, dtype=torch.bool)
            per_region = torch.cat([per_region[:regions], per_table(utab, every, regions)])
        return self.index.complete(unique, utab, step, counts, True, slots, values, per_region, info,
                                   given_order=True)

    def _cache_rows(self, p: Placing, res: InsertResult, u: int, fetched: Fetched) -> torch.Tensor:
        """``_place``'s rows: the inserted pairs' cache rows filled with the fetched (or initial) rows,
        the pairs in a pad given its row (one more batch sharing it). Returns int64 (u,) each pair's
        address (-1: none yet, a conflict miss's or a dropped pair's); sets ``p.placed``,
        ``p.conflict``, ``p.locked_slots``."""
        if p.keep is None and res.unplaced == 0:  # every miss inserted: positions and rows as fetched
            rows_at = self._fill_inserted(res, fetched.rows, inserted=p.miss)
        else:
            if p.row_of is None:
                p.row_of = self._fetched_rows_of(u, p.miss)
            rows_at = self._fill_inserted(res, fetched.rows, p.row_of if p.keep is None else p.row_of[p.keep])
        if res.unplaced == 0:  # no conflict miss: every kept key got a cache row
            p.placed, p.conflict, p.locked_slots = p.keep, p.empty, res.slots
        else:
            placed = (res.slots >= 0).nonzero().squeeze(1)
            unplaced = (res.slots < 0).nonzero().squeeze(1)
            p.placed, p.conflict = (i if p.keep is None else p.keep[i] for i in (placed, unplaced))
            rows_at, p.locked_slots = rows_at[placed], res.slots[placed]
        if p.placed is None:  # every pair placed in the cache (the common case)
            addresses = rows_at
        else:
            addresses = torch.full((u,), -1, dtype=torch.int64, device=self.device)
            addresses[p.placed] = rows_at
        if p.in_pad.numel():
            pad_slots = p.shared[p.in_pad]
            addresses[p.in_pad] = self.in_flight.values[pad_slots]
            self.in_flight.locks[pad_slots] += 1
        return addresses

    def place_overflow(self) -> None:
        """Besides ``DeviceTier``'s: the counts of the batches inserted on the device (``_owe_conflicts``),
        before anything reads the index, the scratch pads or the free rows."""
        super().place_overflow()
        self._owe_conflicts()

    def before_staging(self) -> None:
        """Besides ``DeviceTier``'s: the backing store's upkeep (``DeviceRows.maintain``: a host
        tier's evictions, write-downs and reads ahead), before the batch is staged, not between its
        staged read and its insertion (a device insertion calls no verb of the store's)."""
        super().before_staging()
        if self._rows_below is not None:
            self._rows_below.maintain()

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
        self.writes.drain()  # a queued write-down of the key must not bring it back after the delete
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

    def _get(self, keys: torch.Tensor, tables: torch.Tensor, reading: bool = False) -> Fetched:
        """Backing-store rows of the pairs. Every earlier write-down is taken first (the store then
        answers with the newest rows); a write-down that failed is retried, and raised if it fails
        again, before anything changes. ``reading`` (``read``): while it still fails, the rows kept
        in the process answer for their pairs instead (``WriteDowns.read``)."""
        bdev = self.backend_device
        keys, tables = keys.to(bdev), tables.to(bdev)
        got = self.writes.read(keys, tables) if reading else self.writes.get(keys, tables)
        if self.bound is not None:  # a row a bounded table dropped may outlive its delete
            got.found &= self._held(keys, tables).to(got.found.device)
        self._moved[0].index_add_(0, tables, got.found.to(torch.int64))
        return got

    def _fetch(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        """Rows of missed pairs on the device: the backend's where it has them, else initial rows.
        Returns ``rows`` (m, W) in the rows' dtype and ``found`` bool (m,), on the device."""
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
        rows = self.kernels.gather(self.store, addresses, self.width, dtype=self.dtype)
        self.writes.keep(keys, tables, rows)

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
        got = self._get(keys[missing], tables[missing], reading=True)
        out[missing] = got.rows[:, :cols].to(self.device)
        found[missing] = got.found.to(self.device)
        return out, found

    def write(self, table: int, keys: torch.Tensor, weights: torch.Tensor, step: int) -> None:
        """Upsert through the cache: rows land in the cache (victims written down), or straight
        in the backend where the bucket has no room."""
        self.place_overflow()
        tables = self._tables_of(table, keys)
        rows = torch.zeros(keys.numel(), self.width, dtype=self.dtype, device=self.device)
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
            self.writes.keep(keys[spill], tables[spill], rows[spill])
        self._count((EVICTIONS, res.evicted_tables, None))

    def flush(self) -> None:
        """Write every cached row down (the backends alone then hold the tables) and flush them."""
        self.place_overflow()
        self.writes.drain()
        for t in range(len(self.configs)):
            keys, addresses, _ = self.index.export(t)
            self._write_down(keys, self._tables_of(t, keys), addresses)
        self.writes.drain()
        self.below.flush()

    def export(self, table: int) -> TableRows:
        """Every row of the table, wherever it is (``export_chunks``, in one piece)."""
        parts = [(k.to(self.device), r.to(self.device), sc.to(self.device))
                 for k, r, sc in self.export_chunks(table, 1 << 16)]
        if not parts:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            parts = [(empty, torch.empty(0, self.width, dtype=self.dtype, device=self.device), empty)]
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
        chunks of at most ``rows``: the store is scanned, never loaded whole. Rows on their way down
        count as the store's (``WriteDowns.scan``): a store that fails to take them does not hide them."""
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
        for bkeys, brows in self.writes.scan(table, rows):
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
            self.writes.keep(keys, tables, rows)
            self.writes.drain()

    def delete_rows(self, table: int, keys: torch.Tensor) -> None:
        """Remove rows from the cache and the backing store."""
        if keys.numel():
            super().delete_rows(table, keys)
            if self.bound is not None:
                self.bound.erase(keys, self._tables_of(table, keys))
            self.writes.drain()
            self.below.table(table).delete(keys.to(self.backend_device))

    def is_empty(self) -> bool:
        self.writes.drain()
        return self.index.size() == 0 and all(b.size() == 0 for b in self.below.backends)

    def stats(self, table: int, backend_rows: bool = True) -> TableStats:
        """As ``DeviceTier.stats``; ``backend_rows=False`` skips counting the backend's rows (a
        scan of every key in RocksDB)."""
        out = super().stats(table)
        out.rows = {"device": self.index.size(table)}
        if backend_rows:
            self.writes.drain()
            out.rows["backend"] = self.below.table(table).size()
        out.capacity = self.index.capacity(table)
        fetched, written = (self._moved[:, table] * self.store.row_bytes).tolist()
        out.bytes_moved = {"backend->device": fetched, "device->backend": written}
        out.host_tier = self.below.table(table).tier_stats()
        if out.host_tier is not None:
            out.rows["host"] = out.host_tier.rows
        return out

    def reads_ahead(self) -> bool:
        return self.below.reads_ahead()

    def read_ahead(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """Start reading the (``tables``, ``keys``) pairs' rows from the store into the tier in front
        of it (a host tier; none: nothing). The device cache, its scores and admission counts do not
        move."""
        self.below.read_ahead(keys, tables)  # where they are: the tier takes them to its device later

    def index_bytes(self, table: int) -> dict[str, int]:
        return add_bytes(super().index_bytes(table), self.below.table(table).index_bytes())

    def _indexes(self) -> list[KeyIndex]:
        return super()._indexes() + [self.in_flight] + ([self.bound] if self.bound is not None else [])

    def close(self) -> None:
        try:
            self.writes.close()
        finally:
            self.below.close()
