"""TritonKeyIndex: the KeyIndex with its probe (``find``) and insertion core (``_claim``) in Triton.

Same layout, same hash and the same deterministic claim rules as the reference
(``tieredemb.index.key_index.KeyIndex``), so every call gives identical slots, values, scores, locks
and evictions; ``tests/index/test_triton_index.py`` checks that on random workloads.

- ``find``: one program probes ``BLOCK_K`` keys, each against the ``width`` ways of its bucket
  (a ``[BLOCK_K, BLOCK_W]`` tile); the bucket hash (splitmix64, multiply-shift) is computed in-kernel.
- ``_claim`` (``_insert``'s core): the misses are sorted by (bucket, key) on the device; one program
  per position, and the program at the head of a bucket's run does that bucket's whole insertion: it
  ranks the bucket's available ways (empty ones by way, then, when the index is bounded, unlocked
  ones by (score, way)) and hands the r-th miss of the run the way of rank r. A bucket is written by
  its head program only, so there are no races and no atomics.
- ``insert_rows``: the same insertion over a batch's pairs with no compaction and no host read (the
  misses sorted first), then each miss's row (a victim's, or a pool's address) in one more kernel.
- ``find_touch``: the probe of ``find_or_insert``, which also locks and touches the keys found,
  reads their row addresses and counts misses and keys per region, in one pass.

Growth (``_grow``) and the other verbs are the reference's torch code (they call ``find``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tieredemb.index.key_index import Claim, KeyIndex, device_tensor
from tieredemb.keys import RESERVED_KEY
from tieredemb.ops.triton.hashing import bucket_of as _bucket_of
from tieredemb.ops.triton.hashing import buckets
from tieredemb.ops.triton.launch import fast_launch

_INT64_MAX = 2**63 - 1
# key x way elements and warps of one find program: 4096 / (4 x 32 threads) gives a thread the 32 ways
# of one key at the default bucket width; on the H200 any other share cost 1.3-4x (docs/kernels.md)
_FIND_TILE = 4096
_FIND_WARPS = 4
# insert kernel warps: most programs are not a bucket's head and return at once; a head's work is a few
# (width x width) tiles. H200, the cache's shape (10 x 300k slots, 45k keys evicting), the kernel alone:
# width 32: 0.037 ms with 1 warp, 0.085 with 4, 0.117 with 8; width 16: 0.033 / 0.057 / 0.100
_INSERT_WARPS = 1


@triton.jit
def _bucket_base(keys, tables, region_start, region_buckets, i, in_range, num_buckets, width,
                 REGIONS: tl.constexpr, BLOCK_K: tl.constexpr, first_table=0):
    """keys[i] (key 0 out of range), their regions and the first slot of each one's bucket.
    REGIONS: keys carry their region in ``tables`` (minus ``first_table``); else one region of
    ``num_buckets``."""
    k = tl.load(keys + i, mask=in_range, other=0)
    r = tl.zeros([BLOCK_K], dtype=tl.int64)
    if REGIONS:
        r = tl.load(tables + i, mask=in_range, other=first_table) - first_table
        start = tl.load(region_start + r, mask=in_range, other=0)
        nb = tl.load(region_buckets + r, mask=in_range, other=1).to(tl.uint64)
        base = (start + _bucket_of(k, nb)) * width
    else:
        base = _bucket_of(k, num_buckets) * width
    return k, r, base


@triton.jit
def _probe(keys, tables, region_start, region_buckets, table_keys, i, in_range, num_buckets, width,
           RESERVED: tl.constexpr, REGIONS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
           first_table=0):
    """The slots of keys[i] (int64 (BLOCK_K,), -1 where absent) and their regions."""
    k, r, base = _bucket_base(keys, tables, region_start, region_buckets, i, in_range, num_buckets, width,
                              REGIONS, BLOCK_K, first_table)
    return _probe_at(table_keys, k, base, in_range, width, RESERVED, BLOCK_W), r


@triton.jit
def _probe_at(table_keys, k, base, in_range, width, RESERVED: tl.constexpr, BLOCK_W: tl.constexpr):
    """The slot holding each key ``k`` in the bucket starting at ``base``, -1 where absent."""
    ways = tl.arange(0, BLOCK_W)
    wmask = in_range[:, None] & (ways[None, :] < width)
    stored = tl.load(table_keys + base[:, None] + ways[None, :], mask=wmask, other=0)
    hit = wmask & (stored == k[:, None]) & (k[:, None] != RESERVED)  # the empty mark is never found
    first = tl.min(tl.where(hit, ways[None, :], BLOCK_W), axis=1)  # (BLOCK_K,)
    return tl.where(in_range & (first < BLOCK_W), base + first, -1)


@triton.jit
def _index_arrays(arrays):
    """The index's tables where the last rehash left them, from the int64 addresses at ``arrays``
    (``TritonKeyIndex._arrays``): keys, values, scores, locks, each bucket's evictable flag, each
    region's first bucket and bucket count; then the bucket count."""
    keys = tl.load(arrays).to(tl.pointer_type(tl.int64))
    values = tl.load(arrays + 1).to(tl.pointer_type(tl.int64))
    scores = tl.load(arrays + 2).to(tl.pointer_type(tl.int64))
    locks = tl.load(arrays + 3).to(tl.pointer_type(tl.int32))
    evictable = tl.load(arrays + 4).to(tl.pointer_type(tl.int1))
    start = tl.load(arrays + 5).to(tl.pointer_type(tl.int64))
    buckets = tl.load(arrays + 6).to(tl.pointer_type(tl.int64))
    return keys, values, scores, locks, evictable, start, buckets, tl.load(arrays + 7)


@fast_launch
@triton.jit(do_not_specialize=["n", "num_buckets"])
def _find_kernel(
    keys, tables, region_start, region_buckets, table_keys, out_slots, n, num_buckets, width,
    RESERVED: tl.constexpr, REGIONS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr
):
    # grid: (cdiv(n, BLOCK_K),); out_slots: int64 (n,), slot of the first way holding the key, or -1.
    i = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_range = i < n
    slot, _ = _probe(keys, tables, region_start, region_buckets, table_keys, i, in_range, num_buckets,
                     width, RESERVED, REGIONS, BLOCK_K, BLOCK_W)
    tl.store(out_slots + i, slot, mask=in_range)


@fast_launch
@triton.jit(do_not_specialize=["n", "step", "first_table"])
def _find_touch_kernel(
    keys, tables, counts, region_lfu, arrays, out_slots, out_values, per_region, valid, guard, n,
    width, step, step_ptr, first_table, regions, RESERVED: tl.constexpr, REGIONS: tl.constexpr,
    POLICY: tl.constexpr, BINS: tl.constexpr, GUARD: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr, LOCK: tl.constexpr, STEP_PTR: tl.constexpr,
    RANGE: tl.constexpr, CONTEST: tl.constexpr, SCORES: tl.constexpr,
):
    # ``_probe``, and then for the keys found (distinct slots: no two programs touch one):
    # lock += 1, score touched (POLICY 0: LRU = step, 1: LFU += count, 2: per region), row address
    # out; per_region int64 (3, BINS, programs): this program's misses per region, keys per region,
    # contested keys per region (bin BINS - 1 collects what is not counted; summed over programs
    # after: no atomics). valid: int64 (1,) the real keys (the rest is padding); guard: int64
    # (GUARD,), nothing is changed unless it is all zero; STEP_PTR: the step is int64 (1,) at
    # step_ptr (a captured probe); RANGE: only the keys of tables first_table .. first_table +
    # regions - 1 are this index's; CONTEST: an absent key whose bucket is evictable and holds a
    # locked way gets slot -2 (contested), and the keys found are not locked here (``_lock_kernel``
    # does it after, so that no program sees another's locks of this batch); arrays: the index's
    # tables and bucket count (``_index_arrays``); SCORES: the index keeps scores (else none touched)
    if STEP_PTR:
        step = tl.load(step_ptr)
    bins = tl.arange(0, BINS)
    programs = tl.num_programs(0)
    column = per_region + tl.program_id(0)
    real = tl.minimum(n, tl.load(valid))
    if tl.program_id(0).to(tl.int64) * BLOCK_K >= real:  # all padding: counts nothing
        for row in tl.static_range(3):
            tl.store(column + (row * BINS + bins) * programs, tl.zeros([BINS], dtype=tl.int64))
        return
    i = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_range = i < real
    if RANGE:
        t = tl.load(tables + i, mask=in_range, other=first_table - 1)
        in_range = in_range & (t >= first_table) & (t < first_table + regions)
    (table_keys, table_values, table_scores, table_locks, bucket_evictable, region_start, region_buckets,
     num_buckets) = _index_arrays(arrays)
    k, r, base = _bucket_base(keys, tables, region_start, region_buckets, i, in_range, num_buckets, width,
                              REGIONS, BLOCK_K, first_table)
    slot = _probe_at(table_keys, k, base, in_range, width, RESERVED, BLOCK_W)
    found = slot >= 0
    if CONTEST:
        ways = tl.arange(0, BLOCK_W)
        held = in_range & ~found & (tl.load(bucket_evictable + base // width, mask=in_range & ~found,
                                            other=0) != 0)
        locked = tl.load(table_locks + base[:, None] + ways[None, :],
                         mask=held[:, None] & (ways[None, :] < width), other=0)
        slot = tl.where(held & (tl.max(locked, axis=1) > 0), -2, slot)
    tl.store(out_slots + i, slot, mask=in_range)
    tl.store(out_values + i, tl.load(table_values + slot, mask=found, other=-1), mask=in_range)
    # the counts below include what a guarded batch would have touched
    g = tl.arange(0, BLOCK_G)
    failed = tl.sum((tl.load(guard + g, mask=g < GUARD, other=0) != 0).to(tl.int32), axis=0)
    touch = found & ((tl.zeros([BLOCK_K], dtype=tl.int32) + failed) == 0)
    if LOCK and not CONTEST:  # an index made with locking=False keeps none
        tl.store(table_locks + slot, tl.load(table_locks + slot, mask=touch, other=0) + 1, mask=touch)
    if SCORES and POLICY == 0:
        tl.store(table_scores + slot, tl.zeros([BLOCK_K], dtype=tl.int64) + step, mask=touch)
    elif SCORES:
        score = tl.load(table_scores + slot, mask=touch, other=0)
        lfu = score + tl.load(counts + i, mask=touch, other=0)
        if POLICY == 2:
            lru = tl.zeros([BLOCK_K], dtype=tl.int64) + step
            lfu = tl.where(tl.load(region_lfu + r, mask=touch, other=0) != 0, lfu, lru)
        tl.store(table_scores + slot, lfu, mask=touch)
    spare = BINS - 1
    misses = tl.histogram(tl.where(in_range & (slot == -1), r, spare).to(tl.int32), BINS)
    tl.store(column + bins * programs, misses.to(tl.int64))
    present = tl.histogram(tl.where(in_range, r, spare).to(tl.int32), BINS)
    tl.store(column + (BINS + bins) * programs, present.to(tl.int64))
    contested = tl.zeros([BINS], dtype=tl.int32)
    if CONTEST:
        contested = tl.histogram(tl.where(in_range & (slot == -2), r, spare).to(tl.int32), BINS)
    tl.store(column + (2 * BINS + bins) * programs, contested.to(tl.int64))


@fast_launch
@triton.jit(do_not_specialize=["n", "first_table"])
def _lock_kernel(slots, tables, arrays, valid, guard, n, first_table, regions, GUARD: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, RANGE: tl.constexpr):
    # find_touch's locks of the keys found (slots >= 0, distinct), after a probe that contested:
    # the same keys as there (valid, RANGE), nothing unless guard is all zero
    table_locks = tl.load(arrays + 3).to(tl.pointer_type(tl.int32))
    real = tl.minimum(n, tl.load(valid))
    i = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_range = i < real
    if RANGE:
        t = tl.load(tables + i, mask=in_range, other=first_table - 1)
        in_range = in_range & (t >= first_table) & (t < first_table + regions)
    g = tl.arange(0, BLOCK_G)
    failed = tl.sum((tl.load(guard + g, mask=g < GUARD, other=0) != 0).to(tl.int32), axis=0)
    slot = tl.load(slots + i, mask=in_range, other=-1)
    touch = in_range & (slot >= 0) & ((tl.zeros([BLOCK_K], dtype=tl.int32) + failed) == 0)
    tl.store(table_locks + slot, tl.load(table_locks + slot, mask=touch, other=0) + 1, mask=touch)


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _unlock_kernel(slots, table_locks, n, BLOCK: tl.constexpr):
    # one lock less on each slot >= 0 (distinct: no two programs meet)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots + i, mask=i < n, other=-1)
    held = slot >= 0
    tl.store(table_locks + slot, tl.load(table_locks + slot, mask=held, other=1) - 1, mask=held)


@fast_launch
@triton.jit(do_not_specialize=["n", "num_buckets"])
def _insert_kernel(
    keys, order, sorted_bucket, slots, table_keys, table_values, table_scores, table_locks, bucket_evictable,
    ev_flag, ev_keys, ev_values, ev_scores, taken, n, num_buckets, width, RESERVED: tl.constexpr,
    BLOCK_W: tl.constexpr, LOCK: tl.constexpr, ROWS: tl.constexpr, EV_KEYS: tl.constexpr,
    SCORES: tl.constexpr,
):
    # grid: (n,) over the keys to insert: keys[order[p]] at position p of their (bucket, key) order
    # (sorted_bucket: int64 or int32, their buckets); the head of each bucket's run inserts the run,
    # writing slots[order[p]] where the key got a way. By position: ev_flag (int8) 1 where a victim
    # was evicted, its ev_keys, ev_values, ev_scores. ROWS (``insert_rows``): no ev_scores, ev_keys
    # only with EV_KEYS (RESERVED where no victim: the caller fills them first); taken int32 (2, n):
    # 1 where the key took an empty way (row 0), got no way (row 1), else 0; and every position
    # written (ev_flag and taken need no zeros first), a position past the misses (bucket
    # num_buckets: a padded insertion's grid) with zeros. SCORES: the index keeps scores and locks
    # (else its buckets never evict, and only their empty ways are claimed)
    p = tl.program_id(0).to(tl.int64)
    b = tl.load(sorted_bucket + p).to(tl.int64)
    prev = tl.load(sorted_bucket + p - 1, mask=p > 0, other=-1).to(tl.int64)
    if ROWS:  # past the first ``width`` of its run: no way for it, and no head writes its flags
        pad = b >= num_buckets
        past = tl.load(sorted_bucket + p - width, mask=p >= width, other=-1).to(tl.int64) == b
        tl.store(ev_flag + p, 0, mask=past | pad)
        tl.store(taken + p, 0, mask=past | pad)
        tl.store(taken + n + p, (~pad).to(tl.int32), mask=past | pad)
    if (b < num_buckets) & (prev != b):
        ways = tl.arange(0, BLOCK_W)
        wmask = ways < width
        first_slot = b * width
        k = tl.load(table_keys + first_slot + ways, mask=wmask, other=RESERVED)
        sc = tl.zeros([BLOCK_W], dtype=tl.int64)
        lk = tl.full([BLOCK_W], 1, tl.int32)
        if SCORES:
            sc = tl.load(table_scores + first_slot + ways, mask=wmask, other=0)
            lk = tl.load(table_locks + first_slot + ways, mask=wmask, other=1)
        is_empty = k == RESERVED
        evictable = (~is_empty) & (lk == 0) & (tl.load(bucket_evictable + b) != 0)
        prio = tl.where(is_empty, -1, sc)
        avail = wmask & (is_empty | evictable) & (prio < 9223372036854775807)
        # rank of each available way in (prio, way) order: the claim order of the reference
        before = (prio[None, :] < prio[:, None]) | (
            (prio[None, :] == prio[:, None]) & (ways[None, :] < ways[:, None])
        )
        rank = tl.sum((before & avail[None, :]).to(tl.int32), axis=1)  # (BLOCK_W,) per way
        # the run: misses r = 0.. of this bucket, in key order; miss r claims the way of rank r (the
        # ranks of the available ways are 0 .. available - 1)
        r = tl.arange(0, BLOCK_W)
        pos = p + r
        in_run = (r < width) & (pos < n)
        in_run = in_run & (tl.load(sorted_bucket + pos, mask=in_run, other=-1).to(tl.int64) == b)
        got = in_run & (r < tl.sum(avail.to(tl.int32), axis=0))
        way = tl.sum(tl.where(avail[None, :] & (rank[None, :] == r[:, None]), ways[None, :], 0), axis=1)
        old_key = tl.load(table_keys + first_slot + way, mask=got, other=RESERVED)
        old_value = tl.load(table_values + first_slot + way, mask=got, other=0)
        old_score = tl.zeros([BLOCK_W], dtype=tl.int64)
        if SCORES:
            old_score = tl.load(table_scores + first_slot + way, mask=got, other=0)
        victim = got & (old_key != RESERVED)
        idx = tl.load(order + pos, mask=in_run, other=0)
        new_key = tl.load(keys + idx, mask=got, other=0)
        slot = first_slot + way
        # every thread has read the bucket before any thread overwrites a way of it
        tl.debug_barrier()
        tl.store(slots + idx, slot, mask=got)
        tl.store(ev_flag + pos, victim.to(tl.int8), mask=in_run)
        tl.store(ev_values + pos, old_value, mask=victim)
        if ROWS:
            tl.store(taken + pos, (got & ~victim).to(tl.int32), mask=in_run)
            tl.store(taken + n + pos, (~got).to(tl.int32), mask=in_run)
            if EV_KEYS:
                tl.store(ev_keys + pos, old_key, mask=victim)
        else:
            tl.store(ev_keys + pos, old_key, mask=victim)
            tl.store(ev_scores + pos, old_score, mask=victim)
        tl.store(table_keys + slot, new_key, mask=got)
        tl.store(table_values + slot, tl.full([BLOCK_W], -1, tl.int64), mask=got & ~victim)
        if SCORES:
            tl.store(table_scores + slot, tl.zeros([BLOCK_W], tl.int64), mask=got)
        if LOCK:
            tl.store(table_locks + slot, tl.full([BLOCK_W], 1, tl.int32), mask=got)


@fast_launch
@triton.jit(do_not_specialize=["n", "step"])
def _give_kernel(
    order, slots, victim, old_values, taken, pool, tables, counts, region_lfu, table_values, table_scores,
    values, rows, per_region, n, step, step_ptr, regions, n_ptr, POLICY: tl.constexpr, BINS: tl.constexpr,
    BLOCK: tl.constexpr, STEP_PTR: tl.constexpr, OWN: tl.constexpr, N_PTR: tl.constexpr,
    SCORES: tl.constexpr,
):
    # ``insert_rows`` after the insert kernel, by claim position p < n (the pair order[p], whose slot
    # the insert kernel wrote in slots, -1 where none): its row (the victim's, the pool's next from
    # its start for an empty way, from its end for no way) into values[order[p]] and rows[p]; the
    # index's value of an empty way taken and the new slots' scores; per_region int64 (3, regions)
    # += taken from the start, from the end, victims (atomics of one program's histograms). taken:
    # int32 (2, n) the running count of both kinds, row 1's after row 0's (one scan of 2n: a scan by
    # rows of two rows is one slow block a row); OWN: pool[order[p]] is the pair's own row, which it
    # takes (no victims: an index that never evicts). N_PTR: a padded insertion, the misses are the
    # first int64 () at n_ptr of the n positions (rows -1 past them); SCORES: the index keeps scores
    if STEP_PTR:
        step = tl.load(step_ptr)
    real = n
    if N_PTR:
        real = tl.load(n_ptr)
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = p < real
    idx = tl.load(order + p, mask=in_range, other=0)
    slot = tl.load(slots + idx, mask=in_range, other=-1)
    evicts = tl.load(victim + p, mask=in_range, other=0) != 0
    placed = in_range & (slot >= 0)
    fresh = placed & ~evicts
    lacking = in_range & (slot < 0)
    start = tl.load(taken + p, mask=fresh, other=1) - 1
    end = real - (tl.load(taken + n + p, mask=lacking, other=1) - tl.load(taken + n - 1))
    if OWN:
        row = tl.load(pool + idx, mask=in_range, other=-1)
    else:
        row = tl.load(old_values + p, mask=in_range & evicts, other=-1)
        row = tl.where(fresh, tl.load(pool + start, mask=fresh, other=-1), row)
        row = tl.where(lacking, tl.load(pool + end, mask=lacking, other=-1), row)
    tl.store(table_values + slot, row, mask=fresh)
    r = tl.load(tables + idx, mask=in_range, other=0)
    lru = tl.zeros([BLOCK], dtype=tl.int64) + step
    if POLICY == 0:
        score = lru
    else:
        score = tl.load(counts + idx, mask=placed, other=0)  # a new slot's score starts at 0
        if POLICY == 2:
            score = tl.where(tl.load(region_lfu + r, mask=placed, other=0) != 0, score, lru)
    if SCORES:
        tl.store(table_scores + slot, score, mask=placed)
    tl.store(values + idx, row, mask=in_range)
    tl.store(rows + p, row, mask=p < n)
    bins = tl.arange(0, BINS)
    spare = BINS - 1
    for_region = bins < regions
    counted = tl.histogram(tl.where(fresh, r, spare).to(tl.int32), BINS)
    tl.atomic_add(per_region + bins, counted.to(tl.int64), mask=for_region)
    counted = tl.histogram(tl.where(lacking, r, spare).to(tl.int32), BINS)
    tl.atomic_add(per_region + regions + bins, counted.to(tl.int64), mask=for_region)
    counted = tl.histogram(tl.where(in_range & evicts, r, spare).to(tl.int32), BINS)
    tl.atomic_add(per_region + 2 * regions + bins, counted.to(tl.int64), mask=for_region)


@fast_launch
@triton.jit(do_not_specialize=["n", "num_buckets", "step"])
def _upsert_kernel(
    keys, tables, region_start, region_buckets, table_keys, table_values, table_scores, pool, counters,
    sizes, out_values, n, num_buckets, width, step, regions,
    RESERVED: tl.constexpr, REGIONS: tl.constexpr, BINS: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_W: tl.constexpr, SCORES: tl.constexpr,
):
    # grid: (cdiv(n, BLOCK_K),). An unbounded index: keys[i] found keep their value; an absent key
    # claims an empty way of its bucket by compare-and-swap (racing keys of the bucket take
    # different ways) and the next pool address (one atomic per program on counters[0], then the
    # program's prefix sum); no empty way: value -1, counted in counters[1]. Scores = step for all
    # (SCORES: the index keeps them);
    # sizes (R,) += the keys placed per region. A RESERVED key is padding: value -1, nothing stored.
    i = tl.program_id(0).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    in_range = i < n
    k, r, base = _bucket_base(keys, tables, region_start, region_buckets, i, in_range, num_buckets, width,
                              REGIONS, BLOCK_K)
    slot = _probe_at(table_keys, k, base, in_range, width, RESERVED, BLOCK_W)  # never finds RESERVED
    found = slot >= 0
    todo = in_range & ~found & (k != RESERVED)
    # the ways seen empty are the candidates, tried in order until a CAS wins (nothing leaves a way
    # during an upsert, so a way seen taken stays taken): one CAS a key unless keys of one bucket
    # race; 16 CAS a key, one per way whatever it held, took 3x the insert of the same keys
    ways = tl.arange(0, BLOCK_W)
    held = tl.load(table_keys + base[:, None] + ways[None, :], mask=todo[:, None] & (ways[None, :] < width),
                   other=0)
    empty = todo[:, None] & (ways[None, :] < width) & (held == RESERVED)
    placed = tl.full([BLOCK_K], -1, tl.int64)
    tried = tl.full([BLOCK_K], -1, tl.int32)
    pending = todo
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        way = tl.min(tl.where(empty & (ways[None, :] > tried[:, None]), ways[None, :], BLOCK_W), axis=1)
        trying = pending & (way < BLOCK_W)
        # a lane not trying swaps its own key for itself at its bucket's first way: never a change
        # (distinct keys, and an absent key is in no way)
        old = tl.atomic_cas(table_keys + tl.where(trying, base + way, base), tl.where(trying, RESERVED, k), k)
        won = trying & (old == RESERVED)
        placed = tl.where(won, base + way, placed)
        tried = way
        pending = trying & ~won  # lost a race: the next way seen empty; none left: left out
    new = placed >= 0
    first = tl.atomic_add(counters, tl.sum(new.to(tl.int64), axis=0))
    address = tl.load(pool + first + tl.cumsum(new.to(tl.int64), axis=0) - 1, mask=new, other=-1)
    tl.store(table_values + placed, address, mask=new)
    if SCORES:
        tl.store(table_scores + placed, tl.zeros([BLOCK_K], dtype=tl.int64) + step, mask=new)
        tl.store(table_scores + slot, tl.zeros([BLOCK_K], dtype=tl.int64) + step, mask=found)
    value = tl.where(found, tl.load(table_values + slot, mask=found, other=-1), address)
    tl.store(out_values + i, value, mask=in_range)
    tl.atomic_add(counters + 1, tl.sum((todo & ~new).to(tl.int64), axis=0))
    bins = tl.arange(0, BINS)
    per_region = tl.histogram(tl.where(new, r, BINS - 1).to(tl.int32), BINS)
    tl.atomic_add(sizes + bins, per_region.to(tl.int64), mask=bins < regions)


class TritonKeyIndex(KeyIndex):
    """``KeyIndex`` with Triton ``find`` and ``_insert``; identical results. Same arguments."""

    _arrays: torch.Tensor | None = None  # int64 (8,) on the device: see ``_allocate``

    def find(self, keys: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        """keys: int64 (n,) -> slots: int64 (n,), -1 where absent. Scores and locks unchanged."""
        n = keys.numel()
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        if n == 0:
            return out
        block_w = triton.next_power_of_2(self.width)
        block_k = max(1, _FIND_TILE // block_w)
        regions = len(self.regions) > 1
        keys = keys.to(torch.int64).contiguous()
        _find_kernel[(triton.cdiv(n, block_k),)](
            keys,
            tables.contiguous() if regions else keys,
            self._start_dev,
            self._nb_dev,
            self.keys,
            out,
            n,
            self.num_buckets,
            self.width,
            RESERVED=RESERVED_KEY,
            REGIONS=regions,
            BLOCK_K=block_k,
            BLOCK_W=block_w,
            num_warps=_FIND_WARPS,
        )
        return out

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # find_touch's defaults, device constants: every key valid, guard 0
        self._unguarded = torch.tensor([_INT64_MAX, 0], dtype=torch.int64, device=self.device)

    def _allocate(self, region_buckets: list[int]) -> None:
        super()._allocate(region_buckets)
        # where find_touch's kernels find the tables: their addresses and the bucket count in one
        # device tensor that a rehash rewrites in place, so that a CUDA graph of the probe outlives it
        # (an index without scores has no scores and locks: null, never read by its kernels)
        arrays = (self.keys, self.values, self.scores, self.locks, self.bucket_evictable, self._start_dev,
                  self._nb_dev)
        addresses = device_tensor([0 if t is None else t.data_ptr() for t in arrays] + [self.num_buckets],
                                  torch.int64, self.device)
        if self._arrays is None:
            self._arrays = addresses
        else:
            self._arrays.copy_(addresses)

    @property
    def capture_key(self) -> int:
        """Always 0: ``find_touch`` reads the tables through ``_arrays``, which stays put."""
        return 0

    def _bucket(self, keys: torch.Tensor, tables: torch.Tensor | None) -> torch.Tensor:
        one = len(self.regions) == 1
        return buckets(keys, None if one else tables, self._start_dev, self._nb_dev, self.num_buckets)

    def find_touch(self, keys: torch.Tensor, tables: torch.Tensor, step: int | torch.Tensor,
                   counts: torch.Tensor, valid: torch.Tensor | None = None,
                   guard: torch.Tensor | None = None, first_table: int | None = None,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None, contest: bool = False,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's ``find_touch`` in one kernel (probe, lock, touch, count per region), two
        when it contests (the locks after); reads nothing on the host."""
        n = keys.numel()
        regions = len(self.regions)
        if out is None:
            out = tuple(torch.empty(n, dtype=torch.int64, device=self.device) for _ in range(2))
        slots, values = out
        if n == 0:
            return slots, values, torch.zeros(3 * regions, dtype=torch.int64, device=self.device)
        contest = contest and self.bounded
        block_w = triton.next_power_of_2(self.width)
        block_k = max(1, _FIND_TILE // block_w)
        bins = triton.next_power_of_2(regions + 1)
        programs = triton.cdiv(n, block_k)
        partial = torch.empty(3, bins, programs, dtype=torch.int64, device=self.device)
        keys = keys.to(torch.int64).contiguous()
        tables = tables.contiguous()
        valid = self._unguarded[:1] if valid is None else valid
        guard = self._unguarded[1:] if guard is None else guard
        on_device = isinstance(step, torch.Tensor)
        block_g = triton.next_power_of_2(guard.numel())
        _find_touch_kernel[(programs,)](
            keys, tables, counts.contiguous(), self._lfu, self._arrays, slots, values, partial, valid, guard,
            n, self.width, 0 if on_device else step, step if on_device else valid,
            first_table or 0, regions, RESERVED=RESERVED_KEY, REGIONS=regions > 1, POLICY=self._policy,
            BINS=bins, GUARD=guard.numel(), BLOCK_G=block_g, BLOCK_K=block_k, BLOCK_W=block_w,
            LOCK=self.locking, STEP_PTR=on_device, RANGE=first_table is not None, CONTEST=contest,
            SCORES=self.scored, num_warps=_FIND_WARPS,
        )
        if contest:
            block = 1024
            _lock_kernel[(triton.cdiv(n, block),)](
                slots, tables, self._arrays, valid, guard, n, first_table or 0, regions, GUARD=guard.numel(),
                BLOCK_G=block_g, BLOCK_K=block, RANGE=first_table is not None, num_warps=4,
            )
        return slots, values, partial[:, :regions].sum(dim=2).view(-1)

    def upsert(self, keys: torch.Tensor, tables: torch.Tensor | None, pool: torch.Tensor,
               step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's ``upsert`` in one kernel, reading nothing on the host. Racing absent keys
        of a bucket take its empty ways, and the pool's addresses, in no fixed order; a key whose
        bucket has no empty way is left out (-1, counted) instead of growing the index."""
        self._check_upsert()
        n = keys.numel()
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        counters = torch.zeros(2, dtype=torch.int64, device=self.device)
        if n == 0:
            return out, counters
        regions = len(self.regions)
        block_w = triton.next_power_of_2(self.width)
        block_k = max(1, _FIND_TILE // block_w)
        keys = keys.to(torch.int64).contiguous()
        _upsert_kernel[(triton.cdiv(n, block_k),)](
            keys, keys if tables is None else tables.contiguous(), self._start_dev, self._nb_dev, self.keys,
            self.values, self._arg(self.scores), pool.contiguous(), counters, self._sizes, out, n,
            self.num_buckets, self.width, step, regions, RESERVED=RESERVED_KEY, REGIONS=regions > 1,
            BINS=triton.next_power_of_2(regions + 1), BLOCK_K=block_k, BLOCK_W=block_w, SCORES=self.scored,
            num_warps=_FIND_WARPS,
        )
        return out, counters

    def _unlock_at(self, slots: torch.Tensor) -> None:
        block = 1024
        _unlock_kernel[(triton.cdiv(slots.numel(), block),)](slots, self.locks, slots.numel(), BLOCK=block,
                                                             num_warps=4)

    def _claim(self, keys: torch.Tensor, tables: torch.Tensor, given_order: bool) -> Claim:
        """The reference's ``_claim`` (same slots, victims and index state): the keys sorted by
        (bucket, key) (or bucket, then as given) on the device, then one program per position, the
        head of each bucket's run inserting the run."""
        n = keys.numel()
        keys = keys.to(torch.int64).contiguous()
        one = len(self.regions) == 1
        bucket = buckets(keys, None if one else tables, self._start_dev, self._nb_dev, self.num_buckets,
                         dtype=self._sort_dtype)
        if given_order:
            sorted_bucket, order = torch.sort(bucket, stable=True)
        else:
            order = torch.argsort(keys, stable=True)
            sorted_bucket, by_bucket = torch.sort(bucket[order], stable=True)
            order = order[by_bucket]
        out_slots = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        ev_flag = torch.zeros(n, dtype=torch.int8, device=self.device)
        ev_keys, ev_values, ev_scores = (torch.empty(n, dtype=torch.int64, device=self.device)
                                         for _ in range(3))
        self._launch_insert(keys, order, sorted_bucket, out_slots, ev_flag, ev_keys, ev_values, ev_scores,
                            ev_flag, n=n, rows=False)
        return Claim(order, out_slots, ev_flag.view(torch.bool), ev_keys, ev_values, ev_scores)

    def _arg(self, column: torch.Tensor | None) -> torch.Tensor:
        """A kernel's argument for ``column`` (the scores or the locks): itself, or any tensor where the
        index keeps none (its kernels, told SCORES=False, never touch it)."""
        return self.values if column is None else column

    @property
    def _policy(self) -> int:
        """The kernels' POLICY: 0 every region LRU, 1 every region LFU, 2 some of each."""
        policies = {r.policy for r in self.regions}
        return 2 if len(policies) > 1 else int(policies == {"lfu"})

    @property
    def _sort_dtype(self) -> torch.dtype:
        """Buckets as sort keys: int32 where they fit (and the sentinel ``num_buckets`` with them),
        whose radix sort makes half the passes of int64's."""
        return torch.int32 if self.num_buckets < 2**31 - 1 else torch.int64

    def _launch_insert(self, keys: torch.Tensor, order: torch.Tensor, sorted_bucket: torch.Tensor,
                       slots: torch.Tensor, *out: torch.Tensor, n: int, rows: bool,
                       evicted_keys: bool = False) -> None:
        _insert_kernel[(n,)](
            keys, order, sorted_bucket, slots, self.keys, self.values, self._arg(self.scores),
            self._arg(self.locks), self.bucket_evictable, *out, n, self.num_buckets,
            self.width, RESERVED=RESERVED_KEY, BLOCK_W=triton.next_power_of_2(self.width), LOCK=self.locking,
            ROWS=rows, EV_KEYS=evicted_keys, SCORES=self.scored, num_warps=_INSERT_WARPS,
        )

    def insert_rows(self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                    slots: torch.Tensor, values: torch.Tensor, misses: int, step: int | torch.Tensor,
                    pool: torch.Tensor, own_rows: bool = False, padded: bool = False,
                    evicted: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's ``insert_rows`` in four kernels and a sort, no compaction: the pairs sort
        by the bucket of the misses, the others after them; the insert kernel runs over the first
        ``misses`` positions, the give kernel after the running counts of the kinds. ``padded``:
        ``misses`` is a bound of them (a CUDA graph's, ``DeviceTier``), their number counted on the
        device; the results past it are as a position that is no miss (rows -1)."""
        self._check_insert_rows(pool, misses, keys.numel() if own_rows else None, evicted)
        regions = len(self.regions)
        per_region = torch.zeros(3, regions, dtype=torch.int64, device=self.device)
        if misses == 0:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return empty, empty, per_region
        block = 1024
        keys, tables = keys.contiguous(), tables.contiguous()
        sort_key = buckets(keys, tables if regions > 1 else None, self._start_dev, self._nb_dev,
                           self.num_buckets, slots, self._sort_dtype)
        sorted_bucket, order = torch.sort(sort_key, stable=True)
        victim = torch.empty(misses, dtype=torch.int8, device=self.device)
        old_values = torch.empty(misses, dtype=torch.int64, device=self.device)
        taken = torch.empty(2, misses, dtype=torch.int32, device=self.device)
        if evicted is not None:
            evicted.fill_(RESERVED_KEY)
        ev_keys = old_values if evicted is None else evicted
        self._launch_insert(keys, order, sorted_bucket, slots, victim, ev_keys, old_values, old_values, taken,
                            n=misses, rows=True, evicted_keys=evicted is not None)
        taken = taken.view(-1).cumsum(0, dtype=torch.int32)
        rows = torch.empty(misses, dtype=torch.int64, device=self.device)
        on_device = isinstance(step, torch.Tensor)
        # padded: the misses' count on the device (else a pointer the kernel never reads)
        real = (sorted_bucket[:misses] < self.num_buckets).sum() if padded else order
        _give_kernel[(triton.cdiv(misses, block),)](
            order, slots, victim, old_values, taken, pool, tables, counts, self._lfu, self.values,
            self._arg(self.scores), values, rows, per_region, misses, 0 if on_device else step,
            step if on_device else order, regions, real,
            POLICY=self._policy,
            BINS=triton.next_power_of_2(regions + 1), BLOCK=block, STEP_PTR=on_device, OWN=own_rows,
            N_PTR=padded, SCORES=self.scored,
            num_warps=4,
        )
        self._sizes += per_region[0]
        return order[:misses], rows, per_region
