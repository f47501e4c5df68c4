"""KeyIndex: a bucketed hash index from raw int64 keys to row addresses, for one table or several.

Layout (all on one device, CPU or CUDA): ``num_buckets x width`` slots, slot = bucket * width + way.

    keys:   int64 (C,)  RESERVED_KEY marks an empty slot
    values: int64 (C,)  the row address of the key in the RowStore (rows never move when the index does)
    scores: int64 (C,)  LRU: step of last use; LFU: use count
    locks:  int32 (C,)  batches holding the slot; a locked slot is never evicted. An index made with
                        ``locking=False`` (one that never evicts: nothing to shield) keeps them at 0,
                        so its batches need no release

An index made with ``scores=False`` (it never evicts, and nobody reads its scores: a backing store's)
keeps neither scores nor locks: 16 bytes a slot instead of 28.

The buckets are cut into **regions**, one per table of a table group: region r owns buckets
``[start_r, start_r + buckets_r)`` and has its own eviction policy and bound, so tables batched into
one index never share a bucket and a bounded table evicts only its own rows. Every verb takes
``tables``, the region of each key (None: region 0); the identity of a row is (region, key).

A key's bucket in its region is a multiply-shift reduction of its splitmix64 hash, monotone in the
hash, so doubling a region's buckets splits each of them in two and a rehash can never overflow one.
Unbounded regions grow by doubling; a region with ``max_slots`` is allocated at that size once and
evicts the lowest-score unlocked slot of the key's bucket when the bucket is full (exact LRU/LFU per
bucket).

Insertion is deterministic: a bucket's misses, in ascending key order, take first its empty ways
(in way order), then, when eviction is allowed, its unlocked ways by ascending (score, way). With
``given_order`` the misses claim in the order the caller gives them instead (one sort fewer): the
collections pass their dedup's order (``id_order``: table by table, by hash); a store that never
evicts may pass any order. The Triton implementation (``tieredemb.ops.triton.index``) follows
exactly these rules and is tested equal.

This module is the pure-torch reference; it is also the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tieredemb.keys import RESERVED_KEY, bucket_of

_INT64_MAX = 2**63 - 1
MAX_LOAD = 0.5  # unbounded regions double before inserts would pass this load
_REHASH_BUCKETS = 1 << 17  # old buckets a rehash moves at a time
# find_touch(contest=True)'s slot for an absent key of a bounded region whose bucket holds a way
# locked by an earlier batch: ``complete`` inserts only the absent keys at -1, never those below
CONTESTED = -2


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor of host ``values`` on ``device``, without making the host wait: on CUDA through
    pinned memory (a copy from pageable memory blocks until the device is idle)."""
    out = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return out.to(device)
    return out.pin_memory().to(device, non_blocking=True)


def region_counts(tables: torch.Tensor, mask: torch.Tensor | None, regions: int) -> torch.Tensor:
    """int64 (regions,): the entries of ``tables`` (int64 (n,), where ``mask``) per region. A
    histogram: no host read, and not 10^5 atomics on a few counters (``index_add_``: ~0.1 ms)."""
    if tables.numel() == 0:
        return torch.zeros(regions, dtype=torch.int64, device=tables.device)
    idx = tables if mask is None else torch.where(mask, tables, regions)
    hist = torch.histc(idx.to(torch.float32), bins=regions + 1, min=0, max=regions + 1)
    return hist[:regions].to(torch.int64)


def bounded_buckets(max_slots: int, width: int) -> int:
    """Buckets of a bounded region: ``max_slots`` rounded up to whole buckets of ``width``."""
    return -(-max_slots // width)


def bucket_loads(keys: torch.Tensor, max_slots: int, width: int) -> torch.Tensor:
    """int64 (buckets,): how many of ``keys`` (int64 (n,), distinct) fall in each bucket of a bounded
    region of ``max_slots`` slots in buckets of ``width``. The region holds them all at once iff no
    bucket gets more than ``width``; otherwise inserting them evicts some."""
    buckets = bounded_buckets(max_slots, width)
    return torch.bincount(bucket_of(keys, buckets), minlength=buckets)


@dataclass(frozen=True)
class Region:
    """One table's part of an index: its eviction ``policy``, its bound ``max_slots`` (None:
    unbounded, grows by doubling from ``initial_slots``)."""

    policy: str = "lru"
    max_slots: int | None = None
    initial_slots: int = 1024


@dataclass
class InsertResult:
    """Answer of ``find_or_insert`` for n unique keys (all tensors on the index device).

    slots:   int64 (n,) index slot, -1 where the bucket had no room (a conflict miss)
    found:   bool (n,)  the key was already present
    values:  int64 (n,) the key's row address; for a key inserted into an evicted slot, the victim's
             address (the caller reuses that row); -1 for a key inserted into an empty slot, until
             the caller calls ``assign``
    evicted_keys / evicted_values / evicted_scores / evicted_tables: (e,) what eviction removed
    """

    slots: torch.Tensor
    found: torch.Tensor
    values: torch.Tensor
    evicted_keys: torch.Tensor
    evicted_values: torch.Tensor
    evicted_scores: torch.Tensor
    evicted_tables: torch.Tensor
    any_miss: bool = True  # host-side: False when every key was found (nothing inserted or evicted)
    region_keys: torch.Tensor | None = None  # int64 (R,) keys per region, when every key was found
    inserted_count: int | None = None  # host-side: keys inserted (None: not known without a read)
    unplaced: int | None = None  # host-side: conflict misses, keys left without a slot

    @property
    def new_rows(self) -> int | None:
        """Host-side: inserted keys that took an empty slot (the others took a victim's row)."""
        return None if self.inserted_count is None else self.inserted_count - self.evicted_keys.numel()

    @property
    def inserted(self) -> torch.Tensor:
        """bool (n,): stored by this call."""
        return ~self.found & (self.slots >= 0)


@dataclass
class Claim:
    """What ``KeyIndex._claim`` did for k keys: ``order`` int64 (k,) the claim order (positions into
    the keys given); ``slots`` int64 (k,) each key's slot, -1 where its bucket had no way for it,
    in the order given; in claim order: ``victim`` bool (k,) the slot held a key, evicted, whose
    ``old_keys``, ``old_values``, ``old_scores`` (int64 (k,), undefined elsewhere) it had."""

    order: torch.Tensor
    slots: torch.Tensor
    victim: torch.Tensor
    old_keys: torch.Tensor
    old_values: torch.Tensor
    old_scores: torch.Tensor


class KeyIndex:
    """Bucketed key -> row-address index with scores and lock counts (pure torch).

    Args:
        width: slots per bucket.
        policy, max_slots, initial_slots: the single region of a one-table index (see ``Region``).
        device: where the index tensors live.
        regions: several tables' regions instead (then ``policy``/``max_slots``/``initial_slots``
            are not used).
        locking: keep lock counts (the default). False only for an index no region of which evicts:
            locks then stay 0, ``find_or_insert(lock=True)`` and ``unlock`` change nothing.
        scores: keep a score a slot (the default). False (with ``locking=False``, every region
            unbounded): no ``scores`` and no ``locks`` tensors; ``export`` gives scores of 0.
    """

    def __init__(self, width: int, policy: str = "lru", device: torch.device | str = "cpu",
                 max_slots: int | None = None, initial_slots: int = 1024,
                 regions: list[Region] | None = None, locking: bool = True, scores: bool = True) -> None:
        regions = [Region(policy, max_slots, initial_slots)] if regions is None else list(regions)
        for r in regions:
            if r.policy not in ("lru", "lfu"):
                raise ValueError(f"unknown eviction policy {r.policy!r}")
        self.width = width
        self.device = torch.device(device)
        self.regions = regions
        self.bounded = any(r.max_slots is not None for r in regions)  # some region evicts
        if self.bounded and not locking:
            raise ValueError("an index with a bounded region needs its locks (locking=True): they "
                             "keep the rows of batches in flight from being evicted")
        if not scores and locking:
            raise ValueError("an index without scores keeps no locks either: make it with locking=False")
        self.locking = locking
        self.scored = scores
        self._lfu = torch.tensor([r.policy == "lfu" for r in regions], device=self.device)
        buckets = []
        for r in regions:
            if r.max_slots is not None:
                buckets.append(bounded_buckets(r.max_slots, width))
            else:  # any count: a key's bucket is a multiply-shift of its hash, and doubling splits it
                buckets.append(max(1, -(-r.initial_slots // width)))
        self._allocate(buckets)
        # sizes live on the device (no sync per insert)
        self._sizes = torch.zeros(len(regions), dtype=torch.int64, device=self.device)
        self.generation = 0  # rehashes so far

    # ----------------------------------------------------------------------------------- layout
    def _allocate(self, region_buckets: list[int]) -> None:
        self.region_buckets = list(region_buckets)
        self.region_start = [0]
        for nb in region_buckets[:-1]:
            self.region_start.append(self.region_start[-1] + nb)
        self.num_buckets = sum(region_buckets)
        c = self.num_buckets * self.width
        dev = self.device
        self._start_dev = device_tensor(self.region_start, torch.int64, dev)
        self._nb_dev = device_tensor(region_buckets, torch.int64, dev)
        counts = self._nb_dev
        bounded = device_tensor([r.max_slots is not None for r in self.regions], torch.bool, dev)
        # per bucket: may its full ways be evicted (its region is bounded)
        self.bucket_evictable = torch.repeat_interleave(bounded, counts, output_size=self.num_buckets)
        self.keys = torch.full((c,), RESERVED_KEY, dtype=torch.int64, device=dev)
        self.values = torch.full((c,), -1, dtype=torch.int64, device=dev)
        self.scores = torch.zeros(c, dtype=torch.int64, device=dev) if self.scored else None
        self.locks = torch.zeros(c, dtype=torch.int32, device=dev) if self.scored else None

    def _columns(self) -> tuple[torch.Tensor, ...]:
        """The per-slot tensors: keys, values, then scores and locks where the index keeps them."""
        if self.scored:
            return self.keys, self.values, self.scores, self.locks
        return self.keys, self.values

    def nbytes(self, region: int | None = None) -> int:
        """Bytes of the per-slot tensors of ``region`` (None: all), where the index lives."""
        return self.capacity(region) * sum(t.element_size() for t in self._columns())

    def capacity(self, region: int | None = None) -> int:
        """Slots of ``region`` (None: all)."""
        nb = self.num_buckets if region is None else self.region_buckets[region]
        return nb * self.width

    @property
    def capture_key(self) -> int:
        """What a CUDA graph of ``find_touch`` depends on besides its inputs: a graph captured at
        another value reads tables that are gone. Here the rehashes so far (they replace them)."""
        return self.generation

    @property
    def sizes_on_device(self) -> torch.Tensor:
        """int64 (R,) keys stored per region, on the index device (read it with other values)."""
        return self._sizes

    def size(self, region: int | None = None) -> int:
        """Keys stored in ``region`` (None: all). Reads a device value."""
        return int(self._sizes.sum() if region is None else self._sizes[region])

    def _tables(self, keys: torch.Tensor, tables: torch.Tensor | None) -> torch.Tensor:
        if tables is None:
            return torch.zeros_like(keys)
        return tables

    def _bucket(self, keys: torch.Tensor, tables: torch.Tensor | None) -> torch.Tensor:
        if len(self.regions) == 1:
            return bucket_of(keys, self.num_buckets)
        return self._start_dev[tables] + bucket_of(keys, self._nb_dev[tables])

    def region_of_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """int64 (n,) region of each slot."""
        if len(self.regions) == 1:
            return torch.zeros_like(slots)
        return torch.searchsorted(self._start_dev, slots // self.width, right=True) - 1

    # ------------------------------------------------------------------------------------ verbs
    def find(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        """keys: int64 (n,) -> slots: int64 (n,), -1 where absent. Scores and locks unchanged."""
        if keys.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        base = self._bucket(keys, tables) * self.width  # (n,)
        ways = base[:, None] + torch.arange(self.width, device=self.device)[None, :]  # (n, W)
        hit = (self.keys[ways] == keys[:, None]) & (keys[:, None] != RESERVED_KEY)  # never the empty mark
        way = hit.to(torch.int8).argmax(dim=1)
        return torch.where(hit.any(dim=1), base + way, torch.full_like(base, -1))

    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None,
                       lock: bool = False, tables: torch.Tensor | None = None,
                       given_order: bool = False) -> InsertResult:
        """Find ``keys`` (unique (region, key) pairs, int64 (n,)), inserting the absent ones.

        Every key that ends in a slot gets its score updated (LRU: ``step``; LFU: ``+= counts``, the
        occurrences in the batch, 1 each by default). With ``lock`` those slots' lock counts go up by
        one (release with ``unlock``), unless the index was made with ``locking=False``. Keys
        present or inserted earlier in the same call are never evicted by it. ``given_order``: the
        misses claim ways in the order given (module docstring).
        Host syncs: the miss count per region, the insertion's compaction, and one check for a full
        bucket in an unbounded region.
        """
        n = keys.numel()
        tables = self._tables(keys, tables)
        if counts is None:
            counts = torch.ones(n, dtype=torch.int64, device=self.device)
        # the keys found are locked (shielded from this call's evictions) and touched right away
        slots, values, per_region = self.find_touch(keys, tables, step, counts)
        # one host read: misses and sizes per region (whether to insert, whether to grow first)
        info = torch.cat([per_region[: len(self.regions)], self._sizes]).tolist()
        return self.complete(keys, tables, step, counts, lock, slots, values, per_region, info, given_order)

    def complete(self, keys: torch.Tensor, tables: torch.Tensor, step: int, counts: torch.Tensor,
                 lock: bool, slots: torch.Tensor, values: torch.Tensor, per_region: torch.Tensor,
                 info: list[int], given_order: bool = False) -> InsertResult:
        """The rest of ``find_or_insert`` after ``find_touch``: ``info`` is the host copy of misses
        per region, then ``_sizes``, read once (a caller may read them together with its own).
        Inserts the keys at slot -1; those a probe marked ``CONTESTED`` (or a caller otherwise, any
        slot below -1) keep their slot and are not counted in ``misses``."""
        regions = len(self.regions)
        misses, sizes = info[:regions], info[regions:]
        found = slots >= 0
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        if not any(misses):  # the steady state of a warm table: every key found
            if not lock and self.locking:
                self.locks.index_add_(0, slots.clamp(min=0), -found.to(torch.int32))
            return InsertResult(slots, found, values, empty, empty, empty, empty, any_miss=False,
                                region_keys=per_region[regions : 2 * regions], inserted_count=0, unplaced=0)
        miss = slots == -1  # absent keys below -1 (``CONTESTED``, a caller's own marks) stay out
        if self._reserve([s + m for s, m in zip(sizes, misses)]):
            # the rehash moved every slot
            slots = torch.where(slots < -1, slots, self.find(keys, tables))
        evicted, unplaced = self._insert(keys, tables, slots, miss, sum(misses), given_order)
        grow = []
        if not all(r.max_slots is not None for r in self.regions):
            failed = miss & (slots < 0) & ~self._region_bounded(tables)
            grow = self._per_region(tables, failed)
        # keys left without a slot (conflict misses of bounded regions): those of unbounded regions
        # are placed by the growth below
        unplaced = 0 if unplaced is None else unplaced - sum(grow)
        while any(grow):  # a full bucket in an unbounded region: double it, place the rest
            self._grow([nb * 2 if g else nb for nb, g in zip(self.region_buckets, grow)])
            slots = torch.where(slots >= 0, self.find(keys, tables), slots)
            self._insert(keys, tables, slots, failed, sum(grow), given_order)
            failed = failed & (slots < 0)
            grow = self._per_region(tables, failed)
        placed = slots >= 0
        safe = slots.clamp(min=0)
        values = torch.where(placed, self.values[safe], -1)
        self._touch(safe, placed & miss, tables, step, counts)
        if not lock and self.locking:
            self.locks.index_add_(0, safe, -placed.to(torch.int32))
        self._sizes += region_counts(tables, miss & placed, regions)
        if evicted[3].numel():
            self._sizes -= region_counts(evicted[3], None, regions)
        return InsertResult(slots, found, values, *evicted, inserted_count=sum(misses) - unplaced,
                            unplaced=unplaced)

    def upsert(self, keys: torch.Tensor, tables: torch.Tensor | None, pool: torch.Tensor,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The insert of a store that never evicts (every region unbounded and LRU), in one call:
        ``keys`` (distinct pairs) found keep their value, absent ones are stored, each taking an
        address of ``pool`` (int64, at least n) as its value; every key's score becomes ``step``,
        locks do not change. ``RESERVED_KEY`` entries are padding: value -1, nothing stored, not
        counted. Returns int64 (n,) each key's value (-1: left out, nothing stored) and int64 (2,)
        on the index device: addresses taken (``pool[:taken]``, which key got which is not
        specified) and keys left out. The reference grows the index as it inserts and leaves
        nothing out; the Triton index leaves out the keys whose bucket is full (the caller grows
        the index and upserts them again)."""
        self._check_upsert()
        values = torch.full_like(keys, -1)
        real = (keys != RESERVED_KEY).nonzero().squeeze(1)
        res = self.find_or_insert(keys[real], step, tables=None if tables is None else tables[real],
                                  given_order=True)
        new = res.inserted.nonzero().squeeze(1)
        values[real] = res.values
        values[real[new]] = pool[: new.numel()]
        self.assign(res.slots[new], pool[: new.numel()])
        return values, torch.tensor([new.numel(), 0], dtype=torch.int64, device=self.device)

    def _check_upsert(self) -> None:
        if self.bounded or any(r.policy != "lru" for r in self.regions):
            raise ValueError("upsert needs an index whose regions are all unbounded and LRU")

    def reserve_regions(self, wanted: list[int]) -> bool:
        """Grow the unbounded regions where ``wanted`` keys (one count per region) would pass the
        load limit. Returns whether the index was rehashed."""
        return self._reserve(wanted)

    def double(self, regions: list[int]) -> None:
        """Double each of the unbounded ``regions`` once (a bucket of theirs was found full), as
        ``complete`` does when an insertion finds one."""
        if any(self.regions[r].max_slots is not None for r in regions):
            raise ValueError(f"only an unbounded region grows; regions {regions} include a bounded one")
        self._grow([nb * 2 if r in regions else nb for r, nb in enumerate(self.region_buckets)])

    def _per_region(self, tables: torch.Tensor, mask: torch.Tensor) -> list[int]:
        """How many of ``mask`` (bool (n,)) fall in each region (one host read)."""
        return region_counts(tables, mask, len(self.regions)).tolist()

    def find_touch(self, keys: torch.Tensor, tables: torch.Tensor, step: int | torch.Tensor,
                   counts: torch.Tensor, valid: torch.Tensor | None = None,
                   guard: torch.Tensor | None = None, first_table: int | None = None,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None, contest: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Probe ``keys`` (unique pairs); lock and touch (``_touch``) the slots found. Returns slots
        (-1: absent), their row addresses (-1: absent) and int64 (3R,): misses per region, keys per
        region, contested keys per region. ``contest``: an absent key of a bounded region whose
        bucket holds a way locked before this call (by an earlier batch still in flight) gets slot
        ``CONTESTED`` and is counted there, not among the misses: a plain loop would insert it after
        that batch's release, choosing victims among its rows too (``DeviceTier.settle``).
        ``valid``: int64 (1,) on the device, only keys[:valid] are real (the rest of
        every output is unspecified); ``guard``: int64 (G,) on the device, nothing changes unless it
        is all zero (a batch whose checks are read later). Neither is read on the host by the Triton index.
        ``step`` may be an int64 tensor of one element on the device (a probe captured in a CUDA
        graph). ``first_table``: ``tables`` number the tables of several indexes, this one's regions
        from ``first_table`` on; the keys of other tables are left out (not probed, not counted, their
        entries of ``out`` unchanged). ``out``: (slots, values), int64 (n,) each, written in place."""
        n = keys.numel()
        real = n if valid is None else int(valid)  # the reference reads the count (no sync to spare)
        regions = len(self.regions)
        mine = None
        if first_table is not None:
            local = tables[:real] - first_table
            mine = ((local >= 0) & (local < regions)).nonzero().squeeze(1)
            keys, tables, counts = keys[mine], local[mine], counts[mine]
        elif real < n:
            keys, tables, counts = keys[:real], tables[:real], counts[:real]
        slots = self.find(keys, tables)
        found = slots >= 0
        safe = slots.clamp(min=0)
        if contest and self.bounded:  # the locks as they are before this call's
            bucket = self._bucket(keys, tables)
            ways = bucket[:, None] * self.width + torch.arange(self.width, device=self.device)[None, :]
            held = (self.locks[ways] > 0).any(dim=1) & self.bucket_evictable[bucket]
            slots = torch.where(held & ~found, CONTESTED, slots)
        if guard is None or not bool(guard.any()):
            if self.locking:
                self.locks.index_add_(0, safe, found.to(torch.int32))
            self._touch(safe, found, tables, step, counts)
        per_region = torch.cat([torch.bincount(tables[slots == -1], minlength=regions),
                                torch.bincount(tables, minlength=regions),
                                torch.bincount(tables[slots == CONTESTED], minlength=regions)])
        values = torch.where(found, self.values[safe], -1)
        if out is None:
            out = tuple(torch.full((n,), -1, dtype=torch.int64, device=self.device) for _ in range(2))
        at = slice(0, slots.numel()) if mine is None else mine
        out[0][at], out[1][at] = slots, values
        return out[0], out[1], per_region

    def _region_bounded(self, tables: torch.Tensor) -> torch.Tensor:
        return self.bucket_evictable[self._start_dev[tables]]

    def _insert(self, keys: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor, todo: torch.Tensor,
                count: int | None = None, given_order: bool = False):
        """Place keys[todo] in their buckets; writes slots in place, locks the new slots once.
        ``count``: how many of ``todo`` are set, if the caller knows (a kernel may use it);
        ``given_order``: a bucket's misses claim in the order given, not by key.

        Returns the evicted (keys, values, scores, tables), and how many of keys[todo] found no way
        (None where the index does not know it without a host read: nothing is left unplaced once an
        unbounded region has grown)."""
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        if keys.numel() == 0:
            return (empty, empty, empty, empty), 0
        idx = todo.nonzero() if count is None else torch.nonzero_static(todo, size=count)
        idx = idx.squeeze(1)
        if idx.numel() == 0:
            return (empty, empty, empty, empty), (0 if self.bounded else None)
        tables = tables[idx]
        claim = self._claim(keys[idx], tables, given_order)
        slots[idx] = claim.slots
        if not self.bounded:  # only a bounded region evicts: nothing to select (and no host read)
            return (empty, empty, empty, empty), None
        # one host read: the victims (for the four selections) and the keys left without a way
        victims, unplaced = torch.stack([claim.victim.sum(dtype=torch.int64),
                                         (claim.slots < 0).sum()]).tolist()
        victim = torch.nonzero_static(claim.victim, size=victims).squeeze(1)
        evicted = (claim.old_keys[victim], claim.old_values[victim], claim.old_scores[victim],
                   tables[claim.order[victim]])
        return evicted, unplaced

    def _claim(self, keys: torch.Tensor, tables: torch.Tensor, given_order: bool) -> Claim:
        """Insert ``keys`` (int64 (k,), absent pairs, with their regions ``tables``) by the claim
        rules: a bucket's keys, in key order (or as given), take its empty ways, then its
        evictable ones. New slots get value -1 (unless a victim's: its row stays), score 0, one lock."""
        bucket = self._bucket(keys, tables)
        # misses sorted by (bucket, key) (or bucket, then as given): the order in which they claim ways
        if given_order:
            order = torch.argsort(bucket, stable=True)
        else:
            order = torch.argsort(keys, stable=True)
            order = order[torch.argsort(bucket[order], stable=True)]
        mk, bucket = keys[order], bucket[order]
        ubuckets, counts = torch.unique_consecutive(bucket, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(keys.numel(), device=self.device) - torch.repeat_interleave(starts, counts)
        cand = self._candidates(ubuckets)  # (u, W) ways in claim order, -1 = unavailable
        bpos = torch.repeat_interleave(torch.arange(ubuckets.numel(), device=self.device), counts)
        way = torch.where(rank < self.width, cand[bpos, rank.clamp(max=self.width - 1)], -1)
        ok = way >= 0
        slot = torch.where(ok, bucket * self.width + way, -1)  # in claim order
        safe = slot.clamp(min=0)
        victim = ok & (self.keys[safe] != RESERVED_KEY)
        old = [t[safe].clone() if t is not None else torch.zeros_like(safe)
               for t in (self.keys, self.values, self.scores)]
        s = slot[ok]
        self.values[slot[ok & ~victim]] = -1
        self.keys[s] = mk[ok]
        if self.scored:
            self.scores[s] = 0
        if self.locking:
            self.locks[s] = 1
        slots = torch.empty_like(slot)
        slots[order] = slot
        return Claim(order, slots, victim, *old)

    def insert_rows(self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                    slots: torch.Tensor, values: torch.Tensor, misses: int, step: int | torch.Tensor,
                    pool: torch.Tensor, own_rows: bool = False, evicted: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``complete``'s insertion, with rows, reading nothing on the host: ``keys``, ``tables``,
        ``counts`` (int64 (u,)) a batch's distinct pairs after ``find_touch``, whose ``slots`` and
        ``values`` (int64 (u,)) are written in place; ``misses``: the pairs at slot -1 (the host's
        count), inserted by the claim rules in the order given, locked once, scores touched as
        ``find_touch`` touches; each gets a row: a victim's (its row is reused), else the next
        address of ``pool`` (int64 (misses,) free rows; the index's value for an empty slot), or,
        left without a way, an address of ``pool`` from its end (its slot stays -1). ``values`` then
        holds every pair's row. An unbounded region does not grow here (the caller makes room
        first, ``reserve_regions``): a pair of a bounded region left without a way is a conflict
        miss (the row a scratch row for the batch), one of an unbounded region found its bucket
        full (the caller grows the region and inserts it with that row).

        Returns the positions int64 (misses,) of the inserted pairs in the order they claimed ways,
        their rows int64 (misses,), and int64 (3, R) on the index device: per region, the pool's
        addresses taken from its start (empty slots, counted in the sizes), the pairs left without a
        way (addresses from the pool's end) and the victims evicted. ``own_rows`` (an index that
        never evicts): ``pool`` (int64 (u,)) holds each pair's own row, which it takes instead (pairs
        trained before they had a slot). ``evicted`` (int64 (misses,)): written with the key each
        inserted pair evicted, in the claim order (``RESERVED_KEY`` where none; the victim's table is
        the pair's), for a caller that keeps the victims' rows (a cache writing them down)."""
        self._check_insert_rows(pool, misses, keys.numel() if own_rows else None, evicted)
        pos = torch.nonzero_static(slots == -1, size=misses).squeeze(1)
        per_region = torch.zeros(3, len(self.regions), dtype=torch.int64, device=self.device)
        if misses == 0:
            return pos, pos, per_region
        claim = self._claim(keys[pos], tables[pos], given_order=True)
        pos, slot = pos[claim.order], claim.slots[claim.order]  # claim order from here
        fresh, unplaced = (slot >= 0) & ~claim.victim, slot < 0
        taken = torch.stack([fresh, unplaced]).to(torch.int64).cumsum(1)
        rows = pool[pos] if own_rows else torch.where(
            claim.victim, claim.old_values, torch.where(fresh, pool[(taken[0] - 1).clamp(min=0)],
                                                        pool[(misses - taken[1]).clamp(max=misses - 1)]))
        self.values[slot[fresh]] = rows[fresh]
        self._touch(slot.clamp(min=0), slot >= 0, tables[pos], step, counts[pos])
        slots[pos], values[pos] = slot, rows
        if evicted is not None:
            evicted.copy_(torch.where(claim.victim, claim.old_keys, RESERVED_KEY))
        for k, mask in enumerate((fresh, unplaced, claim.victim)):
            per_region[k] = region_counts(tables[pos], mask, len(self.regions))
        self._sizes += per_region[0]
        return pos, rows, per_region

    def _check_insert_rows(self, pool: torch.Tensor, misses: int, pairs: int | None,
                           evicted: torch.Tensor | None = None) -> None:
        """``pairs``: the pairs given, when ``pool`` holds their own rows."""
        if evicted is not None and evicted.shape != (misses,):
            raise ValueError(f"insert_rows: evicted must be int64 ({misses},), got {tuple(evicted.shape)}")
        if pairs is None and pool.numel() < misses:
            raise ValueError(f"insert_rows: a pool of {pool.numel()} rows for {misses} misses")
        if pairs is not None and (pool.numel() != pairs or self.bounded):
            raise ValueError(f"insert_rows: own rows need one row for each of the {pairs} pairs (got "
                             f"{pool.numel()}) and an index that never evicts (bounded: {self.bounded})")

    def _candidates(self, buckets: torch.Tensor) -> torch.Tensor:
        """Ways of each bucket in claim order: empty by way, then evictable by (score, way)."""
        ways = buckets[:, None] * self.width + torch.arange(self.width, device=self.device)[None, :]
        k = self.keys[ways]
        is_empty = k == RESERVED_KEY
        if self.scored:
            sc, lk = self.scores[ways], self.locks[ways]
        else:  # nothing evicts: only the empty ways are candidates, in way order
            sc = lk = torch.zeros_like(k)
        evictable = ~is_empty & (lk == 0) & self.bucket_evictable[buckets][:, None]
        prio = torch.where(is_empty, torch.full_like(sc, -1), sc)
        prio = torch.where(is_empty | evictable, prio, torch.full_like(sc, _INT64_MAX))
        prio, order = torch.sort(prio, dim=1, stable=True)
        return torch.where(prio < _INT64_MAX, order, torch.full_like(order, -1))

    def _touch(self, safe: torch.Tensor, placed: torch.Tensor, tables: torch.Tensor, step: int,
               counts: torch.Tensor) -> None:
        """Scores of the placed slots: LRU ``step``, LFU ``+= counts`` (new slots start at 0)."""
        if not self.scored:
            return
        policies = {r.policy for r in self.regions}
        if policies == {"lru"}:
            delta = step - self.scores[safe]
        elif policies == {"lfu"}:
            delta = counts
        else:
            delta = torch.where(self._lfu[tables], counts, step - self.scores[safe])
        self.scores.index_add_(0, safe, torch.where(placed, delta, 0))  # unplaced entries add 0

    def assign(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Set the row addresses of occupied ``slots``."""
        self.values[slots] = values

    def unlock_slots(self, slots: torch.Tensor, generation: int) -> bool:
        """Release one lock on each of ``slots`` (int64 (n,), distinct, occupied; -1 entries are
        skipped) if the index has not been rehashed since they were found (``generation``). Returns
        False (nothing done) if it has: then ``unlock`` the keys."""
        if generation != self.generation:
            return False
        if self.locking and slots.numel():  # else no locks were taken
            self._unlock_at(slots)
        return True

    def _unlock_at(self, slots: torch.Tensor) -> None:
        self.locks.index_add_(0, slots.clamp(min=0), -(slots >= 0).to(torch.int32))

    def unlock(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> None:
        """Release one lock on each present key (absent keys are ignored)."""
        if not self.locking:  # no locks were taken
            return
        slots = self.find(keys, tables)
        self.locks.index_add_(0, slots.clamp(min=0), -(slots >= 0).to(torch.int32))
        self.locks.clamp_(min=0)

    def erase(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        """Remove keys. Returns the row addresses of the removed ones (int64 (r,))."""
        tables = self._tables(keys, tables)
        slots = self.find(keys, tables)
        present = slots >= 0
        slots, tables = slots[present], tables[present]
        values = self.values[slots].clone()
        self.keys[slots] = RESERVED_KEY
        self.values[slots] = -1
        if self.scored:
            self.scores[slots] = 0
            self.locks[slots] = 0
        self._sizes.index_add_(0, tables, torch.full_like(tables, -1))
        return values

    def export(self, region: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, scores) of every occupied slot of ``region`` (None: all), in slot order."""
        keys, values = self.keys, self.values
        scores = self.scores if self.scored else torch.zeros_like(keys)
        if region is not None:
            lo = self.region_start[region] * self.width
            hi = lo + self.region_buckets[region] * self.width
            keys, values, scores = keys[lo:hi], values[lo:hi], scores[lo:hi]
        occupied = keys != RESERVED_KEY
        return keys[occupied], values[occupied], scores[occupied]

    def reserve(self, n: int, region: int = 0) -> None:
        """Grow an unbounded ``region`` by doubling until ``n`` keys stay under the load limit."""
        sizes = self._sizes.tolist()
        wanted = list(sizes)
        wanted[region] = max(n, sizes[region])
        self._reserve(wanted)

    def _reserve(self, wanted: list[int]) -> bool:
        """Grow the unbounded regions where ``wanted`` keys would pass the load limit. Returns
        whether the index was rehashed."""
        buckets = list(self.region_buckets)
        for r, reg in enumerate(self.regions):
            if reg.max_slots is not None:
                continue
            while wanted[r] > MAX_LOAD * buckets[r] * self.width:
                buckets[r] *= 2
        if buckets == self.region_buckets:
            return False
        self._grow(buckets)
        return True

    def _grow(self, region_buckets: list[int]) -> None:
        """Rehash into ``region_buckets`` (each a power-of-two multiple ``f`` of the old). A region
        that keeps its buckets is copied as it is (the regions before and after the growing ones
        move as blocks); in a growing one, old bucket ``b`` splits into its ``f`` children ``b*f ..
        b*f+f-1`` (the multiplicative bucket of a key taking its high bits), and each key keeps its
        order within its bucket: its way in its child is the number of keys before it in the old
        bucket that go to the same child; an empty old slot goes to a free way of the first child. So
        every old slot has its own new one and the move is one scatter of the old arrays, with no
        sort and no host read. The other ways of the children stay empty."""
        factors = [new // old for new, old in zip(region_buckets, self.region_buckets)]
        if any(f < 1 or f & (f - 1) or f * old != new
               for f, old, new in zip(factors, self.region_buckets, region_buckets)):
            raise ValueError(f"a rehash takes each region to a power-of-two multiple of its buckets: "
                             f"{self.region_buckets} -> {region_buckets}")
        self.generation += 1  # slots found before now are stale
        w, old_first, old_buckets = self.width, self.region_start, self.region_buckets
        old_start, old_nb = self._start_dev, self._nb_dev
        old = self._columns()
        self._allocate(region_buckets)
        growing, r = [], 0
        while r < len(factors):  # runs of regions that grow or not, in region order
            end = r + 1
            while end < len(factors) and (factors[end] > 1) == (factors[r] > 1):
                end += 1
            lo, hi = old_first[r], old_first[end - 1] + old_buckets[end - 1]  # their old buckets
            if factors[r] > 1:
                growing.append((lo, hi))
            else:  # one copy per array: each slot stays in its way, its bucket shifted
                at = self.region_start[r] * w
                for new, was in zip(self._columns(), old):
                    new[at : at + (hi - lo) * w].copy_(was[lo * w : hi * w])
            r = end
        if growing:
            self._split(old, old_start, old_nb, sum(old_buckets), factors, growing)

    def _split(self, old: tuple[torch.Tensor, ...], old_start: torch.Tensor, old_nb: torch.Tensor,
               nb_old: int, factors: list[int], runs: list[tuple[int, int]]) -> None:
        """``_grow``'s scatter of the old buckets ``lo .. hi`` of each of ``runs`` (growing regions)
        into their children; ``old``: the old ``_columns``, whose regions started at ``old_start``
        with ``old_nb`` buckets (``nb_old`` in all)."""
        w = self.width
        keys, values = old[:2]
        regions = torch.arange(len(self.regions), device=self.device)
        region_of = torch.repeat_interleave(regions, old_nb, output_size=nb_old)  # (B,) of each old bucket
        factor = device_tensor(factors, torch.int64, self.device)
        # counts of earlier ways as a product with a strictly upper triangular 0/1 matrix (0/1 terms,
        # sums of at most W: exact in float32 and in TF32): torch's cumsum along the 32 ways of 128k
        # buckets took ~0.7 ms on an H200 (its scan is made for long rows)
        before = torch.ones(w, w, device=self.device).triu(1)
        parts = [(lo, min(lo + _REHASH_BUCKETS, end)) for start, end in runs
                 for lo in range(start, end, _REHASH_BUCKETS)]
        for lo, hi in parts:  # a bounded working set: ~10 (n, W) tensors
            region = region_of[lo:hi]
            first = self._start_dev[region] + (  # the first child of each old bucket
                torch.arange(lo, hi, device=self.device) - old_start[region]) * factor[region]
            part = slice(lo * w, hi * w)
            occupied = (keys[part] != RESERVED_KEY).view(hi - lo, w)
            child = self._bucket(keys[part], region.repeat_interleave(w)).view(hi - lo, w) - first[:, None]
            way = torch.zeros(hi - lo, w, dtype=torch.float32, device=self.device)
            for c in range(max(factors)):  # way in child c: the keys before, in the old bucket, going there
                going = (occupied & (child == c)).to(torch.float32)
                way += going * (going @ before)
            firsts = (occupied & (child == 0)).sum(1, keepdim=True)  # ways the first child's keys take
            empty = (~occupied).to(torch.float32) @ before  # an empty slot: after the first child's keys
            way = torch.where(occupied, way.to(torch.int64), firsts + empty.to(torch.int64))
            slot = ((first[:, None] + torch.where(occupied, child, 0)) * w + way).view(-1)
            full = occupied.view(-1)  # an empty slot gets what a new one holds, whatever it held
            self.keys[slot] = keys[part]
            self.values[slot] = torch.where(full, values[part], -1)
            for new, was in zip(self._columns()[2:], old[2:]):  # scores and locks
                new[slot] = torch.where(full, was[part], 0)
