"""Triton kernels for the embedding data path: gather, gather+pool, gradient reduction, fused update.

Each kernel reaches rows through the RowStore's segment pointer table: a row address ``a`` lives in
segment ``a // segment_rows`` at offset ``a % segment_rows``, and the kernel loads that segment's int64
base pointer and casts it to a float32 pointer. Segments may therefore live anywhere the device can
address (device memory, pinned host memory). An address < 0 reads as a zero row and is never written.

Tables have mixed widths: ``D`` (embedding dim) and ``W`` (row width, D + optimizer state) are runtime
arguments; column tiles are ``BLOCK_D = next_power_of_2(D)`` wide with masks.

``TritonKernels`` has exactly ``TorchKernels``' methods and meaning (``tieredemb.ops.reference``); the
two are tested equal in ``tests/ops/test_triton_kernels.py``. No method reads a device value on the
host: grids and buffers come from tensor shapes only. ``docs/kernels.md`` lists the tuning knobs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tieredemb.ops import reference
from tieredemb.ops.triton.checks import batch_checks
from tieredemb.ops.triton.groups import regroup_ids
from tieredemb.ops.triton.hashing import splitmix64
from tieredemb.ops.triton.index import TritonKeyIndex
from tieredemb.ops.triton.launch import fast_launch
from tieredemb.optim import EmbeddingOptimizer
from tieredemb.storage.row_store import RowStore

# Tiles measured on the H200 (D=128, ~100k random rows; docs/kernels.md): a [rows x BLOCK_D] tile of
# 1024 fp32 over 4 warps (8 registers a thread per live tile) beat 2k-16k tiles, which spill in the
# Adam update (four live tiles: w, m, v, g) and run up to 10x slower.
_TILE_ELEMS = 1024
_MAX_ROWS = 128  # rows per program in gather / reduce_grads / optimizer_update
# elements of one bag's ids a loop iteration of gather_pool (8 ids at most): at D=128 4 ids pooled the
# `hbm` batch in 0.166-0.170 ms, 8 ids in 0.204-0.207, 2 in 0.163-0.166 (H200, 2026-11-21)
_BAG_ELEMS = 512
_RUN_BLOCK = 1024  # sorted ids per program in the dedup's passes
_NO_KEY = 2**63 - 1  # the reduction plan's key of a program past the last piece
_MAX_RUN_PROGRAMS = 1024  # the dedup's runs: programs of consecutive blocks, counts summed in one load
_REGROUP_PROGRAMS = 64  # programs over the hashes two pairs share (each takes one at a time)
_OPTIMIZER_KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam")


def _block_d(dim: int) -> int:
    return triton.next_power_of_2(max(dim, 1))


def _block_rows(block_d: int) -> int:
    return max(1, min(_MAX_ROWS, _TILE_ELEMS // block_d))


def _programs(n: int, block_n: int, cap: int | None) -> int:
    """A row kernel's grid: one program a block of ``block_n`` rows, at most ``cap``."""
    blocks = triton.cdiv(n, block_n)
    return blocks if cap is None else max(1, min(blocks, cap))


def _num_warps(tile_elems: int) -> int:
    return 4 if tile_elems <= 2048 else 8


def _rows(count: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``count`` int64 (n,) buffers from one allocation (each ~4-7 us of host on its own), every
    one starting 16-byte aligned (what Triton specializes on)."""
    return tuple(torch.empty(count, n + (n & 1), dtype=torch.int64, device=device)[:, :n].unbind(0))


def _scan_grid(n: int) -> tuple[int, int]:
    """A two-pass scan's grid over n items in blocks of ``_RUN_BLOCK``: (consecutive blocks a
    program, programs), at most ``_MAX_RUN_PROGRAMS`` programs (their sums are read in one load)."""
    blocks = triton.cdiv(triton.cdiv(n, _RUN_BLOCK), _MAX_RUN_PROGRAMS)
    return blocks, triton.cdiv(triton.cdiv(n, _RUN_BLOCK), blocks)


def _bag_warps(tile_elems: int) -> int:
    """One warp per 1024 elements of a tile of one bag's (or one key's) ids, 1 to 8: D=128 pools and
    reduces fastest with a single warp."""
    return max(1, min(8, tile_elems // 1024))


def _bag_chunk(block_d: int) -> int:
    """gather_pool's ids of one bag a loop iteration: ``_BAG_ELEMS`` elements, 1 to 8 ids."""
    return max(1, min(8, _BAG_ELEMS // block_d))


# ----------------------------------------------------------------------------------------- helpers
@triton.jit
def _row_pointers(ptr_table, addr, valid, segment_rows, row_width):
    """float32 pointers to column 0 of the rows at ``addr`` (int64 (R,)); rows where not ``valid``
    point at segment 0, offset 0 and must be masked by the caller."""
    addr = tl.where(valid, addr, 0)
    seg = addr // segment_rows
    offset = addr - seg * segment_rows
    base = tl.load(ptr_table + seg, mask=valid, other=0).to(tl.pointer_type(tl.float32))
    return base + offset * row_width


@triton.jit
def _block_of_rows(ptr_table, addresses, block, n, segment_rows, row_width, BLOCK_N: tl.constexpr):
    """Block ``block`` of a row kernel's ``n`` rows: their positions, which are in range, which
    have an address (>= 0), and pointers to those rows (``_row_pointers``)."""
    rows = (tl.zeros([BLOCK_N], dtype=tl.int64) + block) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = rows < n
    addr = tl.load(addresses + rows, mask=in_range, other=-1)
    valid = addr >= 0
    return rows, in_range, valid, _row_pointers(ptr_table, addr, valid, segment_rows, row_width)


# ----------------------------------------------------------------------------------------- scatter
@fast_launch
@triton.jit(do_not_specialize=["n"])
def _scatter_kernel(
    ptr_table, addresses, rows_in, source, n, in_width, row_width, segment_rows, HAS_SOURCE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr
):
    # grid: (cdiv(n, BLOCK_N),) or fewer programs, each then taking every num_programs-th block;
    # rows_in: float32 (m, in_width) -> the rows at addresses (row i: rows_in[source[i]] with
    # HAS_SOURCE, else rows_in[i]), their columns from in_width on zero
    cols = tl.arange(0, BLOCK_W)
    for block in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        rows, in_range, valid, dst = _block_of_rows(ptr_table, addresses, block, n, segment_rows, row_width,
                                                    BLOCK_N)
        if HAS_SOURCE:
            rows = tl.load(source + rows, mask=in_range, other=0)
        mask = valid[:, None] & (cols[None, :] < row_width)
        given = mask & (cols[None, :] < in_width)
        w = tl.load(rows_in + rows[:, None] * in_width + cols[None, :], mask=given, other=0.0)
        tl.store(dst[:, None] + cols[None, :], w, mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _copy_rows_kernel(
    src_table, src_addresses, dst_table, dst_addresses, n, row_width, src_segment_rows, dst_segment_rows,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr
):
    # grid: as _scatter_kernel; row src_addresses[i] of one store -> row dst_addresses[i] of another
    # (of the same width), where both are >= 0
    cols = tl.arange(0, BLOCK_W)
    for block in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        rows, in_range, valid, src = _block_of_rows(src_table, src_addresses, block, n, src_segment_rows,
                                                    row_width, BLOCK_N)
        to = tl.load(dst_addresses + rows, mask=in_range, other=-1)
        valid = valid & (to >= 0)
        dst = _row_pointers(dst_table, to, valid, dst_segment_rows, row_width)
        mask = valid[:, None] & (cols[None, :] < row_width)
        tl.store(dst[:, None] + cols[None, :], tl.load(src[:, None] + cols[None, :], mask=mask), mask=mask)


# ------------------------------------------------------------------------------------------ gather
@fast_launch
@triton.jit(do_not_specialize=["n"])
def _gather_kernel(
    ptr_table, addresses, out, n, D, row_width, segment_rows, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr
):
    # grid: (cdiv(n, BLOCK_N),) or fewer programs, as _scatter_kernel; out: float32 (n, D)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols[None, :] < D
    for block in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        rows, in_range, valid, src = _block_of_rows(ptr_table, addresses, block, n, segment_rows, row_width,
                                                    BLOCK_N)
        w = tl.load(src[:, None] + cols[None, :], mask=valid[:, None] & cmask, other=0.0)
        tl.store(out + rows[:, None] * D + cols[None, :], w, mask=in_range[:, None] & cmask)


# ------------------------------------------------------------------------------------- gather+pool
@fast_launch
@triton.jit
def _gather_pool_kernel(
    ptr_table,
    addresses,
    offsets,
    scale,
    out,
    D,
    row_width,
    segment_rows,
    bags_per_feature,
    features,
    HAS_SCALE: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (num_bags,); out: float32 (num_bags, D); one program sums one bag. Bag f * B + b (B =
    # bags_per_feature) goes to row b * features + f: (B, features * D) with each sample's features
    # side by side.
    bag = tl.program_id(0).to(tl.int64)
    out_row = (bag % bags_per_feature) * features + bag // bags_per_feature
    start = tl.load(offsets + bag)
    end = tl.load(offsets + bag + 1)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i0 in range(start, end, BLOCK_I):
        ids = i0 + tl.arange(0, BLOCK_I)
        in_bag = ids < end
        addr = tl.load(addresses + ids, mask=in_bag, other=-1)
        valid = addr >= 0
        src = _row_pointers(ptr_table, addr, valid, segment_rows, row_width)
        w = tl.load(src[:, None] + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0.0)
        if HAS_SCALE:
            s = tl.load(scale + ids, mask=in_bag, other=0.0)
            w = w * s[:, None]
        acc += tl.sum(w, axis=0)
    tl.store(out + out_row * D + cols, acc, mask=cmask)


@fast_launch
@triton.jit(do_not_specialize=["n", "num_bags"])
def _bag_rows_kernel(offsets, out, n, num_bags, bags_per_feature, features, STEPS: tl.constexpr,
                     BLOCK: tl.constexpr):
    # out int64 (n,): the output row (see _gather_pool_kernel) of each id's bag, the bag found by a
    # binary search of the id's position among the bag ends offsets[1:] (STEPS >= log2(bags + 1))
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + num_bags
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        open_ = lo < hi
        right = open_ & (tl.load(offsets + mid + 1, mask=m & open_, other=0) <= i)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    tl.store(out + i, (lo % bags_per_feature) * features + lo // bags_per_feature, mask=m)


# ------------------------------------------------------------------------------------ grad reduce
# Deterministic: the ids of each unique key are summed in one fixed order (their batch order),
# in pieces of _PIECE ids (so a hot key's thousands of ids spread over many programs), and a key's
# pieces are then added in piece order (only the few keys of several pieces have a second pass). No
# atomics: the same batch gives the same bits every run.
_PIECE = 256


@triton.jit
def _plan_block(counts, i, u, PIECE: tl.constexpr):
    """Keys ``i``: their ids, their pieces (at least one; 0 past u), whether they have several."""
    m = i < u
    c = tl.load(counts + i, mask=m, other=0)
    return c, tl.where(m, tl.maximum((c + PIECE - 1) // PIECE, 1), 0), (m & (c > PIECE)).to(tl.int64)


@fast_launch
@triton.jit(do_not_specialize=["u", "blocks"])
def _plan_counts_kernel(counts, sums, u, u_ptr, blocks, PIECE: tl.constexpr, BLOCK: tl.constexpr,
                        MAX_PROGRAMS: tl.constexpr, U_PTR: tl.constexpr):
    # sums int64 (3, MAX_PROGRAMS): program p's ids, pieces and keys of several pieces, over its
    # ``blocks`` consecutive blocks of keys; U_PTR: the number of keys is int64 (1,) at u_ptr (the
    # grid then covers a bound of it)
    if U_PTR:
        u = tl.load(u_ptr)
    ids = tl.zeros([BLOCK], dtype=tl.int64)
    pieces = tl.zeros([BLOCK], dtype=tl.int64)
    several = tl.zeros([BLOCK], dtype=tl.int64)
    for b in range(0, blocks):
        i = (tl.program_id(0).to(tl.int64) * blocks + b) * BLOCK + tl.arange(0, BLOCK)
        c, p, s = _plan_block(counts, i, u, PIECE)
        ids += c
        pieces += p
        several += s
    pid = tl.program_id(0)
    tl.store(sums + pid, tl.sum(ids, axis=0))
    tl.store(sums + MAX_PROGRAMS + pid, tl.sum(pieces, axis=0))
    tl.store(sums + 2 * MAX_PROGRAMS + pid, tl.sum(several, axis=0))


@fast_launch
@triton.jit(do_not_specialize=["u", "blocks"])
def _plan_pieces_kernel(counts, sums, starts, piece_first, piece_key, candidates, u, u_ptr, blocks,
                        PIECE: tl.constexpr, BLOCK: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
                        U_PTR: tl.constexpr):
    # the earlier programs' sums, then block by block prefix sums: each key's first id and first
    # piece, the key of every piece, and the keys of several pieces compacted into ``candidates``
    if U_PTR:
        u = tl.load(u_ptr)
    pid = tl.program_id(0)
    p = tl.arange(0, MAX_PROGRAMS)
    ids_base = tl.sum(tl.load(sums + p, mask=p < pid, other=0), axis=0)
    pieces_base = tl.sum(tl.load(sums + MAX_PROGRAMS + p, mask=p < pid, other=0), axis=0)
    several_base = tl.sum(tl.load(sums + 2 * MAX_PROGRAMS + p, mask=p < pid, other=0), axis=0)
    for b in range(0, blocks):
        i = (pid.to(tl.int64) * blocks + b) * BLOCK + tl.arange(0, BLOCK)
        m = i < u
        c, pieces, several = _plan_block(counts, i, u, PIECE)
        tl.store(starts + i, ids_base + tl.cumsum(c, axis=0) - c, mask=m)
        first = pieces_base + tl.cumsum(pieces, axis=0) - pieces
        tl.store(piece_first + i, first, mask=m)
        tl.store(piece_key + first, i, mask=m)  # every key's first piece
        rank = tl.cumsum(several, axis=0)
        tl.store(candidates + several_base + rank - 1, i, mask=several != 0)
        # the further pieces of the keys of several, one such key at a time, BLOCK pieces a store (a
        # loop over each lane's pieces took one iteration a piece: 0.11 ms for a key of 200 pieces)
        for h in range(0, tl.sum(several, axis=0)):
            this = (rank == h + 1) & (several != 0)
            key = tl.sum(tl.where(this, i, 0), axis=0)
            key_first = tl.sum(tl.where(this, first, 0), axis=0)
            key_pieces = tl.sum(tl.where(this, pieces, 0), axis=0)
            for j in range(1, key_pieces, BLOCK):
                at = j + tl.arange(0, BLOCK)
                tl.store(piece_key + key_first + at, tl.zeros([BLOCK], dtype=tl.int64) + key,
                         mask=at < key_pieces)
        ids_base += tl.sum(c, axis=0)
        pieces_base += tl.sum(pieces, axis=0)
        several_base += tl.sum(several, axis=0)


@fast_launch
@triton.jit(do_not_specialize=["num_unique"])
def _reduce_pieces_kernel(
    grad_src,
    src_of_id,
    scale,
    order,
    starts,
    counts,
    piece_key,
    piece_first,
    out,
    partial,
    num_unique,
    D,
    ptr_table, addresses, row_width, segment_rows, lr, eps, beta1, beta2, step_size,  # UPDATE's
    HAS_SCALE: tl.constexpr,
    PIECE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPDATE: tl.constexpr,
    KIND: tl.constexpr,
    PRESORTED: tl.constexpr,
):
    # grid: (an upper bound of the number of pieces,); piece_key[pid] >= num_unique: no piece.
    # UPDATE: a key of one piece updates its row (addresses[key]) with the sum instead of storing it.
    # PRESORTED: src_of_id and scale come in ``order``'s order (read at the position, not the id).
    pid = tl.program_id(0).to(tl.int64)
    key = tl.load(piece_key + pid)
    if key < num_unique:
        count = tl.load(counts + key)
        start = tl.load(starts + key)
        lo = start + (pid - tl.load(piece_first + key)) * PIECE
        hi = tl.minimum(lo + PIECE, start + count)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for j in range(lo, hi, CHUNK):
            pos = j + tl.arange(0, CHUNK)
            m = pos < hi
            if PRESORTED:  # noqa: SIM108 (a constexpr branch: the other one is not compiled)
                at = pos
            else:
                at = tl.load(order + pos, mask=m, other=0)
            src = tl.load(src_of_id + at, mask=m, other=0)
            g = tl.load(grad_src + src[:, None] * D + cols[None, :], mask=m[:, None] & cmask[None, :],
                        other=0.0)
            if HAS_SCALE:
                g = g * tl.load(scale + at, mask=m, other=0.0)[:, None]
            acc += tl.sum(g, axis=0)
        if count <= PIECE:  # the key's only piece: its result
            if UPDATE:
                addr = tl.load(addresses + key + tl.zeros([1], dtype=tl.int64))
                _update_rows(ptr_table, addr, acc[None, :], D, row_width, segment_rows, lr, eps, beta1,
                             beta2, step_size, KIND, BLOCK_D)
            else:
                tl.store(out + key * D + cols, acc, mask=cmask)
        else:
            tl.store(partial + pid * D + cols, acc, mask=cmask)


@fast_launch
@triton.jit(do_not_specialize=["num_unique"])
def _reduce_keys_kernel(partial, counts, piece_first, candidates, out, num_unique, D, ptr_table, addresses,
                        row_width, segment_rows, lr, eps, beta1, beta2, step_size, PIECE: tl.constexpr,
                        BLOCK_D: tl.constexpr, UPDATE: tl.constexpr, KIND: tl.constexpr):
    # grid: (k,) over the compacted keys of several pieces (num_unique: an empty slot); such a key
    # adds its partials in piece order (UPDATE: and updates its row with the sum).
    key = tl.load(candidates + tl.program_id(0))
    if key < num_unique:
        count = tl.load(counts + key)
        cols = tl.arange(0, BLOCK_D)
        cmask = cols < D
        first = tl.load(piece_first + key)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for p in range(first, first + (count + PIECE - 1) // PIECE):
            acc += tl.load(partial + p * D + cols, mask=cmask, other=0.0)
        if UPDATE:
            addr = tl.load(addresses + key + tl.zeros([1], dtype=tl.int64))
            _update_rows(ptr_table, addr, acc[None, :], D, row_width, segment_rows, lr, eps, beta1, beta2,
                         step_size, KIND, BLOCK_D)
        else:
            tl.store(out + key * D + cols, acc, mask=cmask)


# ------------------------------------------------------------------------------------------ dedup
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


# -------------------------------------------------------------------------------- fused optimizer
@triton.jit
def _update_rows(ptr_table, addr, g, D, row_width, segment_rows, lr, eps, beta1, beta2, step_size,
                 KIND: tl.constexpr, BLOCK_D: tl.constexpr):
    # One pass over [w | state] of the rows at ``addr`` (int64 (R,), < 0: skipped) with their
    # gradients ``g`` (R, BLOCK_D). KIND: 0 sgd, 1 adagrad, 2 rowwise_adagrad, 3 adam (the formulas of
    # tieredemb.optim).
    cols = tl.arange(0, BLOCK_D)
    valid = addr >= 0
    row = _row_pointers(ptr_table, addr, valid, segment_rows, row_width)
    mask = valid[:, None] & (cols[None, :] < D)
    w_ptr = row[:, None] + cols[None, :]
    w = tl.load(w_ptr, mask=mask, other=0.0)
    if KIND == 0:
        w = w - lr * g
    elif KIND == 1:
        s = tl.load(w_ptr + D, mask=mask, other=0.0) + g * g
        w = w - lr * g / (tl.sqrt(s) + eps)
        tl.store(w_ptr + D, s, mask=mask)
    elif KIND == 2:
        s = tl.load(row + D, mask=valid, other=0.0) + tl.sum(g * g, axis=1) / D
        w = w - lr * g / (tl.sqrt(s)[:, None] + eps)
        tl.store(row + D, s, mask=valid)
    else:
        m = tl.load(w_ptr + D, mask=mask, other=0.0)
        v = tl.load(w_ptr + 2 * D, mask=mask, other=0.0)
        m = m + (g - m) * (1.0 - beta1)
        v = v + (g * g - v) * (1.0 - beta2)
        w = w - step_size * m / (tl.sqrt(v) + eps)
        tl.store(w_ptr + D, m, mask=mask)
        tl.store(w_ptr + 2 * D, v, mask=mask)
    tl.store(w_ptr, w, mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _optimizer_kernel(
    ptr_table,
    addresses,
    grads,
    n,
    D,
    row_width,
    segment_rows,
    lr,
    eps,
    beta1,
    beta2,
    step_size,
    KIND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (cdiv(n, BLOCK_N),); BLOCK_N distinct rows a program.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    addr = tl.load(addresses + rows, mask=rows < n, other=-1)
    g = tl.load(grads + rows[:, None] * D + cols[None, :], mask=(addr >= 0)[:, None] & (cols[None, :] < D),
                other=0.0)
    _update_rows(ptr_table, addr, g, D, row_width, segment_rows, lr, eps, beta1, beta2, step_size, KIND,
                 BLOCK_D)


def _optimizer_args(optimizer: EmbeddingOptimizer, step: int) -> tuple[float, ...]:
    """The fused update's runtime arguments: lr, eps, betas, Adam's bias-corrected step size, KIND."""
    if optimizer.kind not in _OPTIMIZER_KINDS:
        raise ValueError(f"no Triton kernel for optimizer kind {optimizer.kind!r}")
    beta1, beta2 = getattr(optimizer, "betas", (0.0, 0.0))
    step_size = optimizer.step_size(step) if optimizer.kind == "adam" else 0.0
    return (float(optimizer.lr), float(getattr(optimizer, "eps", 0.0)), float(beta1), float(beta2),
            float(step_size), _OPTIMIZER_KINDS.index(optimizer.kind))


# --------------------------------------------------------------------------------------- wrapper
class TritonKernels:
    """Triton implementation of the kernel interface (``tieredemb.ops.reference.TorchKernels``).

    Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``).
    """

    name = "triton"
    index_class = TritonKeyIndex

    def gather(self, store: RowStore, addresses: torch.Tensor, dim: int,
               programs: int | None = None) -> torch.Tensor:
        """Weights of rows. addresses: int64 (n,) -> float32 (n, dim). ``programs``: at most that
        many programs (each loops over its share): rows in host memory need a few loads in flight,
        not the whole device."""
        n = addresses.numel()
        out = torch.empty(n, dim, dtype=torch.float32, device=addresses.device)
        if n == 0 or dim == 0:
            return out
        block_d = _block_d(dim)
        block_n = _block_rows(block_d)
        _gather_kernel[(_programs(n, block_n, programs),)](
            store.pointer_table(),
            addresses.contiguous(),
            out,
            n,
            dim,
            store.width,
            store.segment_rows,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            num_warps=_num_warps(block_n * block_d),
        )
        return out

    def scatter(self, store: RowStore, addresses: torch.Tensor, rows: torch.Tensor,
                programs: int | None = None, source: torch.Tensor | None = None) -> None:
        """Whole rows in place. addresses: int64 (n,) distinct (-1: none); rows: float32 (n, C),
        C <= W, the rows' first C columns (the others are set to zero). ``programs``: as ``gather``.
        ``source``: int64 (n,), row i takes ``rows[source[i]]`` (rows then (m, C))."""
        n = addresses.numel()
        if n == 0:
            return
        block_w = _block_d(store.width)
        block_n = _block_rows(block_w)
        _scatter_kernel[(_programs(n, block_n, programs),)](
            store.pointer_table(),
            addresses.contiguous(),
            rows.contiguous(),
            addresses if source is None else source.contiguous(),
            n,
            rows.shape[1],
            store.width,
            store.segment_rows,
            HAS_SOURCE=source is not None,
            BLOCK_N=block_n,
            BLOCK_W=block_w,
            num_warps=_num_warps(block_n * block_w),
        )

    def copy_rows(self, src: RowStore, src_addresses: torch.Tensor, dst: RowStore,
                  dst_addresses: torch.Tensor, programs: int | None = None) -> None:
        """Rows ``src_addresses`` (int64 (n,)) of ``src`` to rows ``dst_addresses`` (int64 (n,),
        distinct) of ``dst``, of the same width, where both are >= 0. ``programs``: as ``gather``."""
        n = src_addresses.numel()
        if n == 0:
            return
        if src.width != dst.width:
            raise ValueError(f"copy_rows: rows of width {src.width} into rows of width {dst.width}")
        block_w = _block_d(src.width)
        block_n = _block_rows(block_w)
        _copy_rows_kernel[(_programs(n, block_n, programs),)](
            src.pointer_table(),
            src_addresses.contiguous(),
            dst.pointer_table(),
            dst_addresses.contiguous(),
            n,
            src.width,
            src.segment_rows,
            dst.segment_rows,
            BLOCK_N=block_n,
            BLOCK_W=block_w,
            num_warps=_num_warps(block_n * block_w),
        )

    def gather_pool(
        self,
        store: RowStore,
        addresses: torch.Tensor,
        offsets: torch.Tensor,
        scale: torch.Tensor | None,
        dim: int,
        features: int = 1,
    ) -> torch.Tensor:
        """Pooled bags. addresses: int64 (n,) one per id; offsets: int64 (b+1,) bag boundaries;
        scale: float32 (n,) per-id factor (weights, 1/len for mean) or None -> float32 (b, dim).
        ``features``: the bags are that many features' blocks of B bags; bag f * B + i goes to row
        i * features + f (the rows are then (B, features * dim), sample-major)."""
        num_bags = offsets.numel() - 1
        out = torch.empty(num_bags, dim, dtype=torch.float32, device=offsets.device)
        if num_bags <= 0 or dim == 0:
            return out
        addresses = addresses.contiguous()
        block_d = _block_d(dim)
        chunk = _bag_chunk(block_d)
        _gather_pool_kernel[(num_bags,)](
            store.pointer_table(),
            addresses,
            offsets.contiguous(),
            addresses if scale is None else scale.contiguous(),
            out,
            dim,
            store.width,
            store.segment_rows,
            num_bags // features,
            features,
            HAS_SCALE=scale is not None,
            BLOCK_I=chunk,
            BLOCK_D=block_d,
            num_warps=_bag_warps(chunk * block_d),
        )
        return out

    def id_order(self, ids: torch.Tensor, tables: torch.Tensor, num_tables: int,
                 count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's ``id_order`` without a host sync: a radix sort of the int32 sort keys
        (``dedup_hash``: 4 passes on 12 bytes an id; the int64 ids took 8 on 16), then one pass
        that writes each position's id and table and finds the sort keys two pairs share (~20 a
        batch of 335k distinct pairs), and one that lays each such key's pairs out one after
        another, as the reference orders them."""
        n, dev = ids.numel(), ids.device
        if n == 0:
            return ids, ids, tables
        hashes = torch.empty(n, dtype=torch.int32, device=dev)
        real = hashes if count is None else count  # (a dummy pointer without padding)
        grid = (triton.cdiv(n, _RUN_BLOCK),)
        table_bits, hash_bits = reference.dedup_key_bits(num_tables)
        _dedup_hash_kernel[grid](ids, tables, hashes, n, real, TABLE_BITS=table_bits, HASH_BITS=hash_bits,
                                 PAD=reference.DEDUP_PAD_HASH, N_PTR=count is not None, BLOCK=_RUN_BLOCK)
        shash, order = torch.sort(hashes, stable=True)
        even = n + (n & 1)
        claims = torch.zeros(even + 2, dtype=torch.int32, device=dev)  # + the number found (int64)
        found = claims[even:].view(torch.int64)
        skeys, stables, groups, *scratch = _rows(5, n, dev)  # (scratch: 2n from its first row on)
        _pairs_in_order_kernel[grid](shash, order, ids, tables, skeys, stables, claims, groups, found, n,
                                     real, N_PTR=count is not None, BLOCK=_RUN_BLOCK)
        _regroup_kernel[(_REGROUP_PROGRAMS,)](shash, order, ids, tables, skeys, stables, groups, found,
                                              scratch[0], n, real, N_PTR=count is not None, BLOCK=_RUN_BLOCK)
        return order, skeys, stables

    def sorted_runs(
        self, skeys: torch.Tensor, stables: torch.Tensor, order: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's ``sorted_runs``; one host sync (the number of runs)."""
        keys, runs_tables, inverse, entries, count = self.sorted_runs_padded(skeys, stables, order)
        u = int(count)
        return keys[:u], runs_tables[:u], inverse, entries[:u]

    def sorted_runs_padded(
        self, skeys: torch.Tensor, stables: torch.Tensor, order: torch.Tensor,
        count: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's ``sorted_runs_padded`` in two launches, no host sync: each program counts
        the runs starting in its blocks, then each adds the counts of the programs before it (at most
        ``_MAX_RUN_PROGRAMS``, one load) to a prefix sum of its own heads and scatters. (A ``cumsum``
        between two kernels before: CUB's scan allocates its scratch, 25-44 us of host a call.)"""
        n, dev = skeys.numel(), skeys.device
        if n == 0:
            return skeys, stables, skeys, skeys, torch.zeros(1, dtype=torch.int64, device=dev)
        blocks, programs = _scan_grid(n)
        counts = torch.empty(_MAX_RUN_PROGRAMS + 1, dtype=torch.int64, device=dev)  # + the total
        real = counts if count is None else count  # (a dummy pointer without padding)
        _run_counts_kernel[(programs,)](skeys, stables, counts, n, real, blocks, BLOCK=_RUN_BLOCK,
                                        N_PTR=count is not None)
        keys, runs_tables, inverse, starts, ends = _rows(5, n, dev)
        _run_scatter_kernel[(programs,)](skeys, stables, order, counts, keys, runs_tables, inverse, starts,
                                         ends, n, real, blocks, programs, BLOCK=_RUN_BLOCK,
                                         MAX_PROGRAMS=_MAX_RUN_PROGRAMS, N_PTR=count is not None)
        return keys, runs_tables, inverse, ends.sub_(starts), counts[_MAX_RUN_PROGRAMS:]

    def batch_checks(self, values: torch.Tensor, per_feature: torch.Tensor, limits: torch.Tensor | None,
                     table_of_feature: torch.Tensor | None, weights: torch.Tensor | None,
                     count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reference's ``batch_checks`` in two kernels (``checks.py``)."""
        return batch_checks(values, per_feature, limits, table_of_feature, weights, count)

    def regroup_ids(self, shifts: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                    weights: torch.Tensor | None, inverse: torch.Tensor, pair_values: torch.Tensor,
                    order: torch.Tensor, pair_tables: torch.Tensor, table_first: torch.Tensor,
                    count: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The reference's ``regroup_ids`` in one kernel (``groups.py``)."""
        return regroup_ids(shifts, values, tables, weights, inverse, pair_values, order, pair_tables,
                           table_first, count)

    def bag_rows(self, offsets: torch.Tensor, n: int, features: int = 1) -> torch.Tensor:
        """The reference's ``bag_rows``: a binary search a position (one program a bag was 4x
        slower: 164k programs of a few ids)."""
        out = torch.empty(n, dtype=torch.int64, device=offsets.device)
        num_bags = offsets.numel() - 1
        if n and num_bags > 0:
            _bag_rows_kernel[(triton.cdiv(n, _RUN_BLOCK),)](
                offsets, out, n, num_bags, num_bags // features, features,
                STEPS=max(1, num_bags.bit_length()), BLOCK=_RUN_BLOCK)
        return out

    def reduce_grads(
        self,
        grad_src: torch.Tensor,
        src_of_id: torch.Tensor,
        scale: torch.Tensor | None,
        inverse: torch.Tensor,
        num_unique: int,
        sorted_ids: object | None = None,
    ) -> torch.Tensor:
        """Gradient per unique key: sum over ids i of grad_src[src_of_id[i]] * scale[i], grouped by
        inverse[i]. grad_src: float32 (m, D); src_of_id, inverse: int64 (n,) -> float32 (u, D).

        Deterministic (no atomics): each key's ids are summed in their batch order, in pieces of
        ``_PIECE`` ids added in order; equal to the reference within fp32 rounding.
        ``sorted_ids`` (the dedup's ``IdOrder``: ``order``, ``entries``) spares that sort; with its
        ``sources`` (and ``scales``: ``src_of_id[order]``, ``scale[order]``) the kernel reads those
        instead of going through ``order`` (one dependent load an id fewer).
        """
        n, dim = inverse.numel(), grad_src.shape[1]
        if n == 0 or num_unique == 0 or dim == 0:
            return torch.zeros(num_unique, dim, dtype=torch.float32, device=grad_src.device)
        return self._reduce(grad_src, src_of_id, scale, inverse, num_unique, sorted_ids, None)

    def reduce_plan(self, counts: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The reduction's plan for the ``count`` (int64 (1,) on the device) keys of ``counts``
        (int64 (n,), ids per key; entries past the count unspecified), made before the count is
        known on the host (``IdOrder.plan``): buffers sized for any count up to n. None for no ids."""
        if counts.numel() == 0:
            return None
        return self._plan(counts, counts.numel(), count)

    def _plan(self, counts: torch.Tensor, n: int, keys: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(starts, piece_first, piece_key, candidates): each key's first id (in the sort), its first
        piece of _PIECE ids (a key without ids still gets one: its program stores the zero row), the
        key of every piece (past the last piece ``_NO_KEY``) and the keys of several pieces (at most
        n // _PIECE; they need a second pass). Two passes over the keys, as ``sorted_runs_padded``'s.
        n: the ids; ``keys``: their number of keys, an int, or int64 (1,) on the device (then the
        buffers hold as many keys as ``counts`` has entries)."""
        dev = counts.device
        on_device = isinstance(keys, torch.Tensor)
        bound = counts.numel() if on_device else keys
        blocks, programs = _scan_grid(bound)
        sums = torch.empty(3, _MAX_RUN_PROGRAMS, dtype=torch.int64, device=dev)
        u, u_ptr = (0, keys) if on_device else (keys, sums)  # (sums: a pointer not read)
        _plan_counts_kernel[(programs,)](counts, sums, u, u_ptr, blocks, PIECE=_PIECE, BLOCK=_RUN_BLOCK,
                                         MAX_PROGRAMS=_MAX_RUN_PROGRAMS, U_PTR=on_device)
        starts, piece_first = _rows(2, bound, dev)
        pieces = bound + n // _PIECE + 1
        piece_key = torch.full((pieces + min(bound, n // _PIECE + 1),), _NO_KEY, dtype=torch.int64,
                               device=dev)
        candidates = piece_key[pieces:]
        _plan_pieces_kernel[(programs,)](counts, sums, starts, piece_first, piece_key, candidates, u, u_ptr,
                                         blocks, PIECE=_PIECE, BLOCK=_RUN_BLOCK,
                                         MAX_PROGRAMS=_MAX_RUN_PROGRAMS, U_PTR=on_device)
        return starts, piece_first, piece_key, candidates

    def reduce_update(self, grad_src: torch.Tensor, src_of_id: torch.Tensor, scale: torch.Tensor | None,
                      inverse: torch.Tensor, num_unique: int, sorted_ids: object | None, store: RowStore,
                      addresses: torch.Tensor, optimizer: EmbeddingOptimizer, step: int) -> None:
        """``optimizer_update(store, addresses, reduce_grads(...), optimizer, step)`` in the
        reduction's kernels: each key's row is updated by the program that finishes its sum, and the
        (u, D) sums are never written (~0.1 ms and u x D x 4 bytes of device memory on ``hbm``)."""
        n, dim = inverse.numel(), grad_src.shape[1]
        if n == 0 or num_unique == 0 or dim == 0:
            grads = self.reduce_grads(grad_src, src_of_id, scale, inverse, num_unique, sorted_ids)
            self.optimizer_update(store, addresses, grads, optimizer, step)
            return
        self._reduce(grad_src, src_of_id, scale, inverse, num_unique, sorted_ids,
                     (store, addresses.contiguous(), optimizer, step))

    def _reduce(self, grad_src, src_of_id, scale, inverse, num_unique, sorted_ids, update):
        """``reduce_grads`` (``update`` None: returns the sums) or ``reduce_update`` (``update``:
        store, addresses, optimizer, step; returns None)."""
        n, dim = inverse.numel(), grad_src.shape[1]
        dev = grad_src.device
        if sorted_ids is None:
            order = torch.argsort(inverse, stable=True)
            counts = torch.bincount(inverse, minlength=num_unique)[:num_unique]
        else:
            order, counts = sorted_ids.order, sorted_ids.entries
        presorted = getattr(sorted_ids, "sources", None) is not None
        if presorted:  # the sources (and scales) in ``order``'s order, made by the prefetch
            src_of_id, scale = sorted_ids.sources, sorted_ids.scales
        plan = getattr(sorted_ids, "plan", None)  # made by the prefetch, or now
        if plan is None:
            plan = self._plan(counts, n, num_unique)
        starts, piece_first, piece_key, candidates = plan
        # grid: an upper bound of the pieces, known without a host sync (programs past the last
        # piece find a key >= num_unique and do nothing); k: a bound of the keys of several pieces
        grid = num_unique + n // _PIECE + 1
        k = min(num_unique, n // _PIECE + 1)
        out = None if update else torch.empty(num_unique, dim, dtype=torch.float32, device=dev)
        partial = torch.empty(grid, dim, dtype=torch.float32, device=dev)
        if update:
            store, addresses, optimizer, step = update
            table, width, seg_rows = store.pointer_table(), store.width, store.segment_rows
            lr, eps, beta1, beta2, step_size, kind = _optimizer_args(optimizer, step)
        else:  # unused: the update's arguments
            table, addresses, width, seg_rows = partial, partial, dim, 1
            lr, eps, beta1, beta2, step_size, kind = 0.0, 0.0, 0.0, 0.0, 0.0, 0
        block_d = _block_d(dim)
        chunk = max(1, min(32, _TILE_ELEMS // block_d))
        _reduce_pieces_kernel[(grid,)](
            grad_src.contiguous(), src_of_id.contiguous(), inverse if scale is None else scale.contiguous(),
            order, starts, counts, piece_key, piece_first, partial if out is None else out, partial,
            num_unique, dim, table, addresses, width, seg_rows, lr, eps, beta1, beta2, step_size,
            HAS_SCALE=scale is not None, PIECE=_PIECE, CHUNK=chunk, BLOCK_D=block_d, UPDATE=bool(update),
            KIND=kind, PRESORTED=presorted, num_warps=_bag_warps(chunk * block_d),
        )
        _reduce_keys_kernel[(k,)](
            partial, counts, piece_first, candidates, partial if out is None else out, num_unique, dim, table,
            addresses, width, seg_rows, lr, eps, beta1, beta2, step_size, PIECE=_PIECE, BLOCK_D=block_d,
            UPDATE=bool(update), KIND=kind, num_warps=1,
        )
        return out

    def optimizer_update(
        self,
        store: RowStore,
        addresses: torch.Tensor,
        grads: torch.Tensor,
        optimizer: EmbeddingOptimizer,
        step: int,
    ) -> None:
        """Fused update in place of the rows at ``addresses`` (int64 (u,), distinct; < 0 skipped)
        with their summed gradients ``grads`` float32 (u, D)."""
        n, dim = addresses.numel(), grads.shape[1]
        if n == 0 or dim == 0:
            return
        lr, eps, beta1, beta2, step_size, kind = _optimizer_args(optimizer, step)
        block_d = _block_d(dim)
        block_n = _block_rows(block_d)
        _optimizer_kernel[(triton.cdiv(n, block_n),)](
            store.pointer_table(),
            addresses.contiguous(),
            grads.contiguous(),
            n,
            dim,
            store.width,
            store.segment_rows,
            lr,
            eps,
            beta1,
            beta2,
            step_size,
            KIND=kind,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            num_warps=_num_warps(block_n * block_d),
        )
