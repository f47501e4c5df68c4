"""The row kernels that move whole rows or their weights: scatter, copy between stores, gather,
gather+pool of bags, and each id's output row of its bag. Launched by ``TritonKernels``
(``embedding.py``), which sizes their tiles; rows are addressed as ``rows.py`` says.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tieredemb.ops.triton.launch import fast_launch
from tieredemb.ops.triton.rounding import _nearest
from tieredemb.ops.triton.rows import _block_of_rows, _row_pointers


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _scatter_kernel(
    ptr_table, addresses, rows_in, source, n, in_width, row_width, segment_rows, HAS_SOURCE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, ROW_DTYPE: tl.constexpr
):
    # grid: (cdiv(n, BLOCK_N),) or fewer programs, each then taking every num_programs-th block;
    # rows_in: float (m, in_width) -> the rows at addresses (row i: rows_in[source[i]] with
    # HAS_SOURCE, else rows_in[i]; converted to the rows' type, to the nearest value), their columns
    # from in_width on zero
    cols = tl.arange(0, BLOCK_W)
    for block in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        rows, in_range, valid, dst = _block_of_rows(ptr_table, addresses, block, n, segment_rows, row_width,
                                                    BLOCK_N, ROW_DTYPE)
        if HAS_SOURCE:
            rows = tl.load(source + rows, mask=in_range, other=0)
        mask = valid[:, None] & (cols[None, :] < row_width)
        given = mask & (cols[None, :] < in_width)
        w = tl.load(rows_in + rows[:, None] * in_width + cols[None, :], mask=given, other=0.0)
        tl.store(dst[:, None] + cols[None, :], _nearest(w, ROW_DTYPE), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _copy_rows_kernel(
    src_table, src_addresses, dst_table, dst_addresses, n, row_width, src_segment_rows, dst_segment_rows,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, ROW_DTYPE: tl.constexpr
):
    # grid: as _scatter_kernel; row src_addresses[i] of one store -> row dst_addresses[i] of another
    # (of the same width and type), where both are >= 0
    cols = tl.arange(0, BLOCK_W)
    for block in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        rows, in_range, valid, src = _block_of_rows(src_table, src_addresses, block, n, src_segment_rows,
                                                    row_width, BLOCK_N, ROW_DTYPE)
        to = tl.load(dst_addresses + rows, mask=in_range, other=-1)
        valid = valid & (to >= 0)
        dst = _row_pointers(dst_table, to, valid, dst_segment_rows, row_width, ROW_DTYPE)
        mask = valid[:, None] & (cols[None, :] < row_width)
        tl.store(dst[:, None] + cols[None, :], tl.load(src[:, None] + cols[None, :], mask=mask), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _gather_kernel(
    ptr_table, addresses, out, n, D, row_width, segment_rows, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROW_DTYPE: tl.constexpr
):
    # grid: (cdiv(n, BLOCK_N),) or fewer programs, as _scatter_kernel; out: (n, D) of float32 or the
    # rows' type (the values converted)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols[None, :] < D
    for block in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        rows, in_range, valid, src = _block_of_rows(ptr_table, addresses, block, n, segment_rows, row_width,
                                                    BLOCK_N, ROW_DTYPE)
        w = tl.load(src[:, None] + cols[None, :], mask=valid[:, None] & cmask, other=0.0)
        tl.store(out + rows[:, None] * D + cols[None, :], w, mask=in_range[:, None] & cmask)


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
    ROW_DTYPE: tl.constexpr,
):
    # grid: (num_bags,); out: float32 (num_bags, D); one program sums one bag, in float32. Bag f * B + b (B =
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
        src = _row_pointers(ptr_table, addr, valid, segment_rows, row_width, ROW_DTYPE)
        w = tl.load(src[:, None] + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0.0)
        w = w.to(tl.float32)
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
