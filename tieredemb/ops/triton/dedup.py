"""The dedup of a batch's (id, table) pairs: each id's int32 sort key (``_dedup_hash_kernel``, the
reference's ``dedup_hash``), after the sort the pairs that share a sort key laid out one after another
(``_pairs_in_order_kernel``, ``_regroup_kernel``), then the runs of equal pairs counted and scattered
(``_run_counts_kernel``, ``_run_scatter_kernel``). Launched by ``TritonKernels`` (``embedding.py``:
``id_order``, ``sorted_runs_padded``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tieredemb.ops.triton.hashing import splitmix64
from tieredemb.ops.triton.launch import fast_launch


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _dedup_hash_kernel(ids, tables, out, n, n_ptr, TABLE_BITS: tl.constexpr, HASH_BITS: tl.constexpr,
                       PAD: tl.constexpr, N_PTR: tl.constexpr, BLOCK: tl.constexpr):
    # out[i]: the reference's ``dedup_hash`` of (ids[i], tables[i]); PAD past the real ids (N_PTR:
    # their number is int64 (1,) at n_ptr)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    real = n
    if N_PTR:
        real = tl.load(n_ptr)
    k = tl.load(ids + i, mask=m, other=0).to(tl.uint64, bitcast=True)
    t = tl.load(tables + i, mask=m, other=0)
    key = tl.zeros([BLOCK], dtype=tl.int64)
    if HASH_BITS > 0:
        if TABLE_BITS > 0:
            mixed = splitmix64(k)
        else:
            mixed = splitmix64(k ^ (t.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15))
        key = (mixed >> (64 - HASH_BITS)).to(tl.int64)
    if TABLE_BITS > 0:
        key += t << HASH_BITS
    key = tl.minimum(key - 2**31, PAD - 1)
    tl.store(out + i, tl.where(i < real, key, PAD).to(tl.int32), mask=m)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _pairs_in_order_kernel(shash, order, ids, tables, skeys, stables, claims, groups, found, n, n_ptr,
                           N_PTR: tl.constexpr, BLOCK: tl.constexpr):
    # Each sorted position's key and table (skeys, stables: sequential reads for the runs after);
    # where the pair changes within one hash (two pairs share it), the hash's first position s (in
    # the block, else a scan back block by block), claimed once (claims: int32 (n,) zeros) and
    # listed in groups[found[0]++].
    bound = n
    if N_PTR:
        n = tl.load(n_ptr)
    start = tl.program_id(0).to(tl.int64) * BLOCK
    lanes = tl.arange(0, BLOCK)
    i = start + lanes
    m = i < bound
    o = tl.load(order + i, mask=m, other=0)
    k = tl.load(ids + o, mask=m, other=0)
    t = tl.load(tables + o, mask=m, other=0)
    tl.store(skeys + i, k, mask=m)
    tl.store(stables + i, t, mask=m)
    real = i < n
    h = tl.load(shash + i, mask=real, other=0)
    new_hash = (i == 0) | (tl.load(shash + i - 1, mask=real & (i > 0), other=0) != h)
    same = real & ~new_hash
    tl.debug_barrier()  # the block's keys and tables stored: the previous position's, read back
    inner = same & (i > start)
    edge = same & (i == start)  # (the previous position is the program before's)
    op = tl.load(order + i - 1, mask=edge, other=0)
    kp = tl.where(edge, tl.load(ids + op, mask=edge, other=0),
                  tl.load(skeys + i - 1, mask=inner, other=0))
    tp = tl.where(edge, tl.load(tables + op, mask=edge, other=0),
                  tl.load(stables + i - 1, mask=inner, other=0))
    split = same & ((k != kp) | (t != tp))
    if tl.sum(split.to(tl.int32), axis=0) > 0:
        first = tl.associative_scan(tl.where(new_hash, i, -1), 0, _max)  # the hash's first in the block
        if tl.sum((split & (first < 0)).to(tl.int32), axis=0) > 0:  # the block's first hash began before
            h0 = tl.load(shash + start)
            s = start
            more = start > 0
            while more:
                j = s - BLOCK + lanes
                differs = (j < 0) | (tl.load(shash + j, mask=j >= 0, other=0) != h0)
                any_differs = tl.sum(differs.to(tl.int32), axis=0) > 0
                s = tl.where(any_differs, tl.max(tl.where(differs, j, -1), axis=0) + 1, s - BLOCK)
                more = ~any_differs
            first = tl.where(first < 0, s, first)
        claimed = split & (tl.atomic_xchg(claims + first, 1, mask=split) == 0)
        base = tl.atomic_add(found, tl.sum(claimed.to(tl.int64), axis=0))
        tl.store(groups + base + tl.cumsum(claimed.to(tl.int64), axis=0) - 1, first, mask=claimed)


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _regroup_kernel(shash, order, ids, tables, skeys, stables, groups, found, scratch, n, n_ptr,
                    N_PTR: tl.constexpr, BLOCK: tl.constexpr):
    # Each listed hash's positions [s, e) of ``order`` (and skeys, stables) rewritten: its pairs one
    # after another, in the order of their first position, each pair's ids in their order. One
    # program a hash at a time; a pass takes the first pair left, the rest go to the other half of
    # scratch (2n).
    bound = n
    if N_PTR:
        n = tl.load(n_ptr)
    lanes = tl.arange(0, BLOCK)
    for g in range(tl.program_id(0), tl.load(found).to(tl.int32), tl.num_programs(0)):
        s = tl.load(groups + g)
        h = tl.load(shash + s)
        e = s + 1
        more = e < n
        while more:  # e: the first position past hash h
            j = e + lanes
            differs = (j >= n) | (tl.load(shash + j, mask=j < n, other=0) != h)
            any_differs = tl.sum(differs.to(tl.int32), axis=0) > 0
            e = tl.where(any_differs, tl.min(tl.where(differs, j, e + BLOCK), axis=0), e + BLOCK)
            more = ~any_differs
        left = e - s
        for b in range(0, left, BLOCK):
            j = s + b + lanes
            tl.store(scratch + j, tl.load(order + j, mask=j < e), mask=j < e)
        tl.debug_barrier()
        src = s
        dst = s + bound
        at = s
        while left > 0:
            pair = tl.load(scratch + src)
            key = tl.load(ids + pair)
            table = tl.load(tables + pair)
            rest = left * 0
            for b in range(0, left, BLOCK):
                j = b + lanes
                mj = j < left
                p = tl.load(scratch + src + j, mask=mj, other=0)
                match = mj & (tl.load(ids + p, mask=mj, other=0) == key) & \
                    (tl.load(tables + p, mask=mj, other=0) == table)
                other = mj & ~match
                to = at + tl.cumsum(match.to(tl.int64), axis=0) - 1
                tl.store(order + to, p, mask=match)
                tl.store(skeys + to, key + tl.zeros_like(p), mask=match)
                tl.store(stables + to, table + tl.zeros_like(p), mask=match)
                tl.store(scratch + dst + rest + tl.cumsum(other.to(tl.int64), axis=0) - 1, p, mask=other)
                at += tl.sum(match.to(tl.int64), axis=0)
                rest += tl.sum(other.to(tl.int64), axis=0)
            tl.debug_barrier()
            src, dst = dst, src
            left = rest


@triton.jit
def _run_heads(skeys, stables, i, n):
    """int64 (BLOCK,): 1 where a run of equal (key, table) starts at position ``i`` (i < n) of the
    dedup's order (keys ``skeys``, tables ``stables``: each pair's ids adjacent)."""
    m = i < n
    prev = m & (i > 0)
    k = tl.load(skeys + i, mask=m, other=0)
    t = tl.load(stables + i, mask=m, other=0)
    kp = tl.load(skeys + i - 1, mask=prev, other=0)
    tp = tl.load(stables + i - 1, mask=prev, other=0)
    return (m & ((i == 0) | (k != kp) | (t != tp))).to(tl.int64)


@fast_launch
@triton.jit(do_not_specialize=["n", "blocks"])
def _run_counts_kernel(skeys, stables, counts, n, n_ptr, blocks, BLOCK: tl.constexpr,
                       N_PTR: tl.constexpr):
    # counts[p]: the runs starting in program p's ``blocks`` consecutive blocks of sorted positions;
    # N_PTR: the real ids are int64 (1,) at n_ptr (padding, sorted after them, makes no run)
    if N_PTR:
        n = tl.load(n_ptr)
    total = tl.zeros([BLOCK], dtype=tl.int64)
    for b in range(0, blocks):
        i = (tl.program_id(0).to(tl.int64) * blocks + b) * BLOCK + tl.arange(0, BLOCK)
        total += _run_heads(skeys, stables, i, n)
    tl.store(counts + tl.program_id(0), tl.sum(total, axis=0))


@fast_launch
@triton.jit(do_not_specialize=["n", "blocks", "programs"])
def _run_scatter_kernel(skeys, stables, order, counts, keys_out, tables_out, inverse, starts, ends, n, n_ptr,
                        blocks, programs, BLOCK: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
                        N_PTR: tl.constexpr):
    # the runs before this program's blocks (the earlier programs' counts), then block by block: each
    # position's run (a prefix sum of the heads), the run's key, table, first and last position.
    # N_PTR: the real ids are int64 (1,) at n_ptr, the other positions up to n padding (run 0)
    bound = n
    if N_PTR:
        n = tl.load(n_ptr)
    pid = tl.program_id(0)
    p = tl.arange(0, MAX_PROGRAMS)
    before = tl.load(counts + p, mask=p < pid, other=0)
    run_base = tl.sum(before, axis=0)
    if pid == 0:  # the number of runs, after the programs' counts
        tl.store(counts + MAX_PROGRAMS, tl.sum(tl.load(counts + p, mask=p < programs, other=0), axis=0))
    for b in range(0, blocks):
        i = (pid.to(tl.int64) * blocks + b) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        head = _run_heads(skeys, stables, i, n)
        run = run_base + tl.cumsum(head, axis=0) - 1
        pos = tl.load(order + i, mask=i < bound, other=0)
        tl.store(inverse + pos, tl.where(m, run, 0), mask=i < bound)
        first = head != 0
        tl.store(keys_out + run, tl.load(skeys + i, mask=first, other=0), mask=first)
        tl.store(tables_out + run, tl.load(stables + i, mask=first, other=0), mask=first)
        tl.store(starts + run, i, mask=first)
        last = m & ((i + 1 == n) | (_run_heads(skeys, stables, i + 1, n) != 0))
        tl.store(ends + run, i + 1, mask=last)
        run_base += tl.sum(head, axis=0)
