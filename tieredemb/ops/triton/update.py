"""The fused optimizer update of rows in place (``tieredemb.optim``'s formulas): ``_update_rows``, one
pass over ``[w | state]`` that the reduction's kernels also call, and ``_optimizer_kernel`` over given
gradients. Launched by ``TritonKernels`` (``embedding.py``: ``optimizer_update``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tieredemb.ops.triton.launch import fast_launch
from tieredemb.ops.triton.rounding import _store_row_values
from tieredemb.ops.triton.rows import _row_pointers


@triton.jit
def _update_rows(ptr_table, addr, seed, g, D, row_width, segment_rows, lr, eps, beta1, beta2, step_size,
                 KIND: tl.constexpr, BLOCK_D: tl.constexpr, ROW_DTYPE: tl.constexpr, ROUND: tl.constexpr):
    # One pass over [w | state] of the rows at ``addr`` (int64 (R,), < 0: skipped) with their
    # gradients ``g`` (R, BLOCK_D). KIND: 0 sgd, 1 adagrad, 2 rowwise_adagrad, 3 adam (the formulas of
    # tieredemb.optim), in float32 whatever ROW_DTYPE; ROUND (``rounding.py``): how the results are
    # stored, with ``seed`` (int64 (R,)) the rows' seeds of stochastic rounding (column c of the row
    # [w | state] draws with c).
    cols = tl.arange(0, BLOCK_D)
    cols64 = cols.to(tl.int64)
    valid = addr >= 0
    row = _row_pointers(ptr_table, addr, valid, segment_rows, row_width, ROW_DTYPE)
    mask = valid[:, None] & (cols[None, :] < D)
    w_ptr = row[:, None] + cols[None, :]
    w = tl.load(w_ptr, mask=mask, other=0.0).to(tl.float32)
    if KIND == 0:
        w = w - lr * g
    elif KIND == 1:
        s = tl.load(w_ptr + D, mask=mask, other=0.0).to(tl.float32) + g * g
        w = w - lr * g / (tl.sqrt(s) + eps)
        _store_row_values(w_ptr + D, s, seed, cols64 + D, mask, ROW_DTYPE, ROUND)
    elif KIND == 2:
        s = tl.load(row + D, mask=valid, other=0.0).to(tl.float32) + tl.sum(g * g, axis=1) / D
        w = w - lr * g / (tl.sqrt(s)[:, None] + eps)
        _store_row_values((row + D)[:, None], s[:, None], seed, tl.zeros([1], dtype=tl.int64) + D,
                          valid[:, None], ROW_DTYPE, ROUND)
    else:
        m = tl.load(w_ptr + D, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(w_ptr + 2 * D, mask=mask, other=0.0).to(tl.float32)
        m = m + (g - m) * (1.0 - beta1)
        v = v + (g * g - v) * (1.0 - beta2)
        w = w - step_size * m / (tl.sqrt(v) + eps)
        _store_row_values(w_ptr + D, m, seed, cols64 + D, mask, ROW_DTYPE, ROUND)
        _store_row_values(w_ptr + 2 * D, v, seed, cols64 + 2 * D, mask, ROW_DTYPE, ROUND)
    _store_row_values(w_ptr, w, seed, cols64, mask, ROW_DTYPE, ROUND)


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _optimizer_kernel(
    ptr_table,
    addresses,
    seeds,
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
    ROW_DTYPE: tl.constexpr,
    ROUND: tl.constexpr,
):
    # grid: (cdiv(n, BLOCK_N),); BLOCK_N distinct rows a program; seeds int64 (n,) (read with ROUND
    # 1 or 2: stochastic rounding).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    addr = tl.load(addresses + rows, mask=rows < n, other=-1)
    g = tl.load(grads + rows[:, None] * D + cols[None, :], mask=(addr >= 0)[:, None] & (cols[None, :] < D),
                other=0.0)
    if ROUND != 0:  # noqa: SIM108 (a constexpr branch: the other one is not compiled)
        seed = tl.load(seeds + rows, mask=rows < n, other=0)
    else:
        seed = rows
    _update_rows(ptr_table, addr, seed, g, D, row_width, segment_rows, lr, eps, beta1, beta2, step_size, KIND,
                 BLOCK_D, ROW_DTYPE, ROUND)
