"""The counter-based hashes of ``tieredemb.keys`` and ``tieredemb.init`` in Triton: the
same bits as the torch versions (uint64 wrap-around arithmetic), in one kernel instead of a dozen
elementwise torch ops each."""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from tieredemb.ops.triton.launch import fast_launch

_BLOCK_N = 32  # keys per random_bits program (x BLOCK_D columns)


@triton.jit
def splitmix64(x):
    """The splitmix64 finalizer on uint64 (``tieredemb.keys.splitmix64``)."""
    x = x + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def bucket_of(keys, num_buckets):
    """int64 keys -> int64 bucket: ``(splitmix64(key) >> 32) * num_buckets >> 32`` (logical shifts;
    ``tieredemb.keys.bucket_of``)."""
    hi = splitmix64(keys.to(tl.uint64, bitcast=True)) >> 32
    # (zeros + num_buckets): a uint64 tensor even when num_buckets arrives specialized as constant 1
    return ((hi * (tl.zeros_like(hi) + num_buckets)) >> 32).to(tl.int64)


@triton.jit
def _bits_tile(keys, tables, bases, n, dim, HAS_TABLES: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D: tl.constexpr):
    """This program's tile of ``tieredemb.init.random_bits``: (offsets into an (n, dim) output,
    their mask, the uint64 bits). Grid (cdiv(n, BLOCK_N), cdiv(dim, BLOCK_D))."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < n
    k = tl.load(keys + rows, mask=rmask, other=0).to(tl.uint64, bitcast=True)
    t = tl.zeros([BLOCK_N], dtype=tl.int64)
    if HAS_TABLES:
        t = tl.load(tables + rows, mask=rmask, other=0)
    base = tl.load(bases + t, mask=rmask, other=0).to(tl.uint64, bitcast=True)
    per_key = splitmix64(k ^ base)
    step = (cols + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
    bits = splitmix64(per_key[:, None] + step[None, :])
    return rows[:, None] * dim + cols[None, :], rmask[:, None] & (cols[None, :] < dim), bits


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _random_bits_kernel(keys, tables, bases, out, n, dim, HAS_TABLES: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    # out int64 (n, dim)
    at, mask, bits = _bits_tile(keys, tables, bases, n, dim, HAS_TABLES, BLOCK_N, BLOCK_D)
    tl.store(out + at, bits.to(tl.int64, bitcast=True), mask=mask)


def random_bits(bases: torch.Tensor, keys: torch.Tensor, dim: int,
                tables: torch.Tensor | None) -> torch.Tensor:
    """``tieredemb.init.random_bits`` given the tables' bases (int64 (t,), on the keys' device)."""
    return _per_column(_random_bits_kernel, torch.int64, bases, keys, dim, tables)


def _per_column(kernel, dtype: torch.dtype, bases: torch.Tensor, keys: torch.Tensor, dim: int,
                tables: torch.Tensor | None, *extra, **options) -> torch.Tensor:
    """``kernel`` (a ``_bits_tile`` kernel, ``extra`` arguments after ``bases``) over every (key,
    column) of a ``dtype`` (n, dim) output."""
    n = keys.numel()
    out = torch.empty(n, dim, dtype=dtype, device=keys.device)
    if n == 0 or dim == 0:
        return out
    block_d = min(128, triton.next_power_of_2(dim))
    keys = keys.to(torch.int64).contiguous()
    kernel[(triton.cdiv(n, _BLOCK_N), triton.cdiv(dim, block_d))](
        keys, keys if tables is None else tables.contiguous(), bases, *extra, out, n, dim,
        HAS_TABLES=tables is not None, BLOCK_N=_BLOCK_N, BLOCK_D=block_d, **options)
    return out


@fast_launch  # the first launch compiles with the caller's options (no FMA); later ones reuse it
@triton.jit(do_not_specialize=["n", "low", "span"])
def _uniform_kernel(keys, tables, bases, low, span, out, n, dim, HAS_TABLES: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # the bits made ``Uniform``'s rows: float32 (n, dim) = low + span * u, u the top 53 bits over
    # 2**53, in float64 (low, span: the bits of float64 scalars, as ints: a float argument would be
    # float32), rounded once
    at, mask, bits = _bits_tile(keys, tables, bases, n, dim, HAS_TABLES, BLOCK_N, BLOCK_D)
    u = (bits >> 11).to(tl.float64) * 1.1102230246251565e-16  # 2**-53: exact
    x = low.to(tl.int64).to(tl.float64, bitcast=True) + span.to(tl.int64).to(tl.float64, bitcast=True) * u
    tl.store(out + at, x.to(tl.float32), mask=mask)


def uniform_rows(bases: torch.Tensor, keys: torch.Tensor, dim: int, tables: torch.Tensor | None,
                 low: float, high: float) -> torch.Tensor:
    """``tieredemb.init.Uniform(low, high).rows`` given the tables' bases, in one kernel (the torch
    version: the bits, then five float64 passes over them). The float64 ``low + span * u`` is
    compiled without fused multiply-adds, so it rounds as torch's two operations do. The bounds go
    as arguments, not a tensor (whose copy from pageable memory would make the host wait)."""
    return _per_column(_uniform_kernel, torch.float32, bases, keys, dim, tables, _float64_bits(low),
                       _float64_bits(high - low), enable_fp_fusion=False)


def _float64_bits(x: float) -> int:
    """The bits of ``x`` as a float64, read as an int64."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


@fast_launch
@triton.jit(do_not_specialize=["n", "num_buckets"])
def _bucket_kernel(keys, tables, slots, region_start, region_buckets, out, n, num_buckets,
                   REGIONS: tl.constexpr, MISSES: tl.constexpr, BLOCK: tl.constexpr):
    # out (int64 or int32): each key's bucket; MISSES: num_buckets where slots is not -1
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    k = tl.load(keys + i, mask=m, other=0)
    if REGIONS:
        r = tl.load(tables + i, mask=m, other=0)
        nb = tl.load(region_buckets + r, mask=m, other=1).to(tl.uint64)
        b = tl.load(region_start + r, mask=m, other=0) + bucket_of(k, nb)
    else:
        b = bucket_of(k, num_buckets)
    if MISSES:
        b = tl.where(tl.load(slots + i, mask=m, other=0) == -1, b, num_buckets)
    tl.store(out + i, b.to(out.dtype.element_ty), mask=m)


def buckets(keys: torch.Tensor, tables: torch.Tensor | None, region_start: torch.Tensor,
            region_buckets: torch.Tensor, num_buckets: int, slots: torch.Tensor | None = None,
            dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``KeyIndex._bucket``: int64 (n,) the bucket of each key in its region (``tables``; None:
    one region of ``num_buckets``). ``slots`` (int64 (n,)): only the keys at -1 get their bucket,
    the others ``num_buckets`` (after every bucket: ``insert_rows``' sort key); ``dtype``: int32
    where that fits (a radix sort of half the passes)."""
    n = keys.numel()
    out = torch.empty(n, dtype=dtype, device=keys.device)
    if n:
        keys = keys.to(torch.int64).contiguous()
        _bucket_kernel[(triton.cdiv(n, 1024),)](
            keys, keys if tables is None else tables.contiguous(), keys if slots is None else slots,
            region_start, region_buckets, out, n, num_buckets, REGIONS=tables is not None,
            MISSES=slots is not None, BLOCK=1024)
    return out


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _owner_kernel(keys, salts, out, n, world, BLOCK: tl.constexpr):
    # out int64 (n,): each key's rank, a multiply-shift of the low half of splitmix64(key ^ salt)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    k = tl.load(keys + i, mask=m, other=0)
    s = tl.load(salts + i, mask=m, other=0)
    low = splitmix64((k ^ s).to(tl.uint64, bitcast=True)) & 0xFFFFFFFF
    # (zeros + world): a uint64 tensor even when world arrives specialized as constant 1
    tl.store(out + i, ((low * (tl.zeros_like(low) + world)) >> 32).to(tl.int64), mask=m)


def owner_of(keys: torch.Tensor, salts: torch.Tensor, world: int) -> torch.Tensor:
    """``tieredemb.distributed.owner_of`` in one kernel (the torch version: ~18 elementwise ops):
    int64 (n,) the rank of each key, ``salts`` int64 (n,) its table's salt."""
    n = keys.numel()
    out = torch.empty(n, dtype=torch.int64, device=keys.device)
    if n:
        _owner_kernel[(triton.cdiv(n, 1024),)](keys.to(torch.int64).contiguous(),
                                               salts.to(torch.int64).contiguous(), out, n, world, BLOCK=1024)
    return out


@fast_launch
@triton.jit(do_not_specialize=["n", "bits"])
def _bloom_kernel(words, keys, tables, out, n, bits, HASHES: tl.constexpr, BLOCK: tl.constexpr):
    # out bool (n,): every one of the pair's HASHES bits set in words (int64, 63 bits a word)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    k = tl.load(keys + i, mask=m, other=0)
    t = tl.load(tables + i, mask=m, other=0)
    h1 = splitmix64((k ^ (t * -7046029254386353131)).to(tl.uint64, bitcast=True))  # t * GOLDEN
    h2 = splitmix64(h1) | 1
    hold = m
    for j in tl.static_range(HASHES):
        p = (h1 + j * h2).to(tl.int64, bitcast=True) % bits
        p = tl.where(p < 0, p + bits, p)  # (torch.remainder's sign: the divisor's)
        w = tl.load(words + p // 63, mask=m, other=0)
        hold = hold & (((w >> (p % 63)) & 1) != 0)
    tl.store(out + i, hold, mask=m)


def bloom_may_hold(words: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor, bits: int,
                   hashes: int) -> torch.Tensor:
    """``KeyFilter.may_hold`` in one kernel (the torch version: ~35 elementwise ops): bool (n,)."""
    n = keys.numel()
    out = torch.empty(n, dtype=torch.bool, device=keys.device)
    if n:
        _bloom_kernel[(triton.cdiv(n, 1024),)](words, keys.to(torch.int64).contiguous(),
                                               tables.to(torch.int64).contiguous(), out, n, bits,
                                               HASHES=hashes, BLOCK=1024)
    return out
