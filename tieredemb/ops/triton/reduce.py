"""The gradient reduction per unique key, and the fused update of the rows it finishes.

Deterministic: the ids of each unique key are summed in one fixed order (their batch order), in
pieces of PIECE ids (``embedding._PIECE``, 256: so a hot key's thousands of ids spread over many
programs), and a key's pieces are then added in piece order (only the few keys of several pieces
have a second pass). No atomics: the same batch gives the same bits every run.

The plan (``_plan_counts_kernel``, ``_plan_pieces_kernel``) lays the pieces out in two passes over the
keys; ``_reduce_pieces_kernel`` sums each piece, ``_reduce_keys_kernel`` adds the pieces of the keys of
several. Launched by ``TritonKernels`` (``embedding.py``: ``reduce_grads``, ``reduce_update``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tieredemb.ops.triton.launch import fast_launch
from tieredemb.ops.triton.update import _update_rows


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
    ptr_table, addresses, seeds, row_width, segment_rows, lr, eps, beta1, beta2, step_size,  # UPDATE's
    HAS_SCALE: tl.constexpr,
    PIECE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPDATE: tl.constexpr,
    KIND: tl.constexpr,
    PRESORTED: tl.constexpr,
    ROW_DTYPE: tl.constexpr,
    ROUND: tl.constexpr,
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
                at = key + tl.zeros([1], dtype=tl.int64)
                if ROUND != 0:  # noqa: SIM108 (a constexpr branch: the other one is not compiled)
                    seed = tl.load(seeds + at)
                else:
                    seed = at
                _update_rows(ptr_table, tl.load(addresses + at), seed, acc[None, :], D, row_width,
                             segment_rows, lr, eps, beta1, beta2, step_size, KIND, BLOCK_D, ROW_DTYPE, ROUND)
            else:
                tl.store(out + key * D + cols, acc, mask=cmask)
        else:
            tl.store(partial + pid * D + cols, acc, mask=cmask)


@fast_launch
@triton.jit(do_not_specialize=["num_unique"])
def _reduce_keys_kernel(partial, counts, piece_first, candidates, out, num_unique, D, ptr_table, addresses,
                        seeds, row_width, segment_rows, lr, eps, beta1, beta2, step_size, PIECE: tl.constexpr,
                        BLOCK_D: tl.constexpr, UPDATE: tl.constexpr, KIND: tl.constexpr,
                        ROW_DTYPE: tl.constexpr, ROUND: tl.constexpr):
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
            at = key + tl.zeros([1], dtype=tl.int64)
            if ROUND != 0:  # noqa: SIM108 (a constexpr branch: the other one is not compiled)
                seed = tl.load(seeds + at)
            else:
                seed = at
            _update_rows(ptr_table, tl.load(addresses + at), seed, acc[None, :], D, row_width, segment_rows,
                         lr, eps, beta1, beta2, step_size, KIND, BLOCK_D, ROW_DTYPE, ROUND)
        else:
            tl.store(out + key * D + cols, acc, mask=cmask)
