"""Stochastic rounding of float32 values to a 16-bit row dtype inside the update kernels: the same
bits as the reference (``tieredemb.ops.rounding``: murmur3's finalizer of the row's seed and the
column, in int64 arithmetic masked to 32 bits; then the bit arithmetic described there).
"""

from __future__ import annotations

import triton
import triton.language as tl

ROUND_NEAREST, ROUND_BF16, ROUND_FP16 = 0, 1, 2  # the update's ROUND: how rows are stored


@triton.jit
def _element_bits(seed, col):
    """uint32 (R, C): the draws of the elements of rows with seeds ``seed`` (int64 (R,) in
    [0, 2**32)) at columns ``col`` (int64 (C,)). In 32-bit unsigned arithmetic, whose wrap-around is
    the reference's masking to 32 bits (64-bit multiplies cost several instructions each)."""
    golden = tl.full([1], 0x9E3779B9, tl.uint32)
    fmix1 = tl.full([1], 0x85EBCA6B, tl.uint32)
    fmix2 = tl.full([1], 0xC2B2AE35, tl.uint32)
    h = seed.to(tl.uint32)[:, None] + col.to(tl.uint32)[None, :] * golden
    h = h ^ (h >> 16)
    h = h * fmix1
    h = h ^ (h >> 13)
    h = h * fmix2
    return h ^ (h >> 16)


@triton.jit
def _stochastic_round(x, bits, ROUND: tl.constexpr):
    """float32 ``x`` rounded up or down at random (``bits``: uint32 draws of x's shape) onto the
    values of bfloat16 (ROUND_BF16) or float16 (ROUND_FP16); still float32, exact in that type."""
    xi = x.to(tl.int32, bitcast=True)
    if ROUND == 1:
        out = ((xi + (bits & 0xFFFF).to(tl.int32)) & -65536).to(tl.float32, bitcast=True)
    else:
        normal = ((xi + (bits & 0x1FFF).to(tl.int32)) & -8192).to(tl.float32, bitcast=True)
        a = tl.abs(x)
        t = a * 16777216.0  # 2**24: float16's subnormals are the multiples of 2**-24
        n = tl.floor(t)
        u = (bits >> 9).to(tl.float32) * 1.1920928955078125e-07  # 23 bits over 2**23
        sub = (n + (t - n > u).to(tl.float32)) * 5.9604644775390625e-08
        out = tl.where(a < 6.103515625e-05, tl.where(x < 0, -sub, sub), normal)
    return tl.where(x != x, x, out)


@triton.jit
def _nearest(x, ROW_DTYPE: tl.constexpr):
    """``x`` rounded to the nearest ``ROW_DTYPE`` value (ties to even), still float32 where it is a
    16-bit type. Written out for bfloat16: a conversion by the store rounds on the GPU but truncates
    in Triton's interpreter."""
    if ROW_DTYPE == tl.bfloat16:  # noqa: SIM300 (a constexpr compared with a dtype)
        x = x.to(tl.float32)
        xi = x.to(tl.int32, bitcast=True)
        near = ((xi + 0x7FFF + ((xi >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, near)
    return x


@triton.jit
def _store_row_values(ptr, x, seed, col, mask, ROW_DTYPE: tl.constexpr, ROUND: tl.constexpr):
    """Store float32 ``x`` (R, C) at ``ptr`` (ROW_DTYPE pointers): with ROUND (bfloat16 or float16
    rows, seeds int64 (R,), columns int64 (C,)) rounded stochastically, else to the nearest value."""
    if ROUND != 0:  # noqa: SIM108 (a constexpr branch: the other one is not compiled)
        x = _stochastic_round(x, _element_bits(seed, col), ROUND)
    else:
        x = _nearest(x, ROW_DTYPE)
    tl.store(ptr, x, mask=mask)


__all__ = ["ROUND_NEAREST", "ROUND_BF16", "ROUND_FP16"]
