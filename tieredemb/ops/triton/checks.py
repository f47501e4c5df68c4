"""A batch's device-side checks in two kernels (the torch reference takes ~20 ops): ids and negative
lengths per feature, ids out of their table's range or equal to the reserved key, non-finite
weights, the lengths' total against the ids, and each id's table. Nothing is read on the host."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tieredemb.keys import RESERVED_KEY
from tieredemb.ops.triton.launch import fast_launch

_LENGTHS_BLOCK = 4096  # lengths of one feature summed per program
_IDS_BLOCK = 1024  # ids checked per program


@fast_launch
@triton.jit(do_not_specialize=["batch_size"])
def _feature_sums_kernel(lengths, summary, batch_size, F, BLOCK: tl.constexpr):
    # grid: (F, cdiv(B, BLOCK)); lengths int64 (F, B). summary[f] += ids of feature f,
    # summary[F + f] += its negative lengths (integer atomics: the same result in any order)
    f = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = b < batch_size
    x = tl.load(lengths + f * batch_size + b, mask=m, other=0)
    tl.atomic_add(summary + f, tl.sum(x, axis=0))
    negative = tl.sum((x < 0).to(tl.int64), axis=0)
    if negative > 0:
        tl.atomic_add(summary + F + f, negative)


@fast_launch
@triton.jit(do_not_specialize=["n"])
def _check_ids_kernel(values, weights, limits, table_of_feature, tables, summary, n, n_ptr, F,
                      RESERVED: tl.constexpr, HAS_LIMITS: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                      HAS_TABLES: tl.constexpr, N_PTR: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (max(1, cdiv(n, BLOCK)),), after _feature_sums_kernel. The feature of position p is the
    # number of features ending at or before p (clamped to F - 1: the counts are not checked yet).
    # Flags: summary[2F] bad ids, summary[2F + 1] non-finite weights; program 0 writes
    # summary[2F + 2] = (ids the lengths count) - n. N_PTR: the ids are int64 (1,) at n_ptr, the rest
    # of the n positions padding (not checked; their table 0)
    bound = n
    if N_PTR:
        n = tl.load(n_ptr)
    p0 = tl.program_id(0).to(tl.int64) * BLOCK
    f = 0
    end = tl.load(summary)
    while (end <= p0) & (f < F - 1):  # the feature of p0
        f += 1
        end += tl.load(summary + f)
    pos = p0 + tl.arange(0, BLOCK)
    feature = tl.zeros([BLOCK], dtype=tl.int64) + f
    while (end < p0 + BLOCK) & (f < F - 1):  # features ending inside the block
        f += 1
        feature += (pos >= end).to(tl.int64)
        end += tl.load(summary + f)
    m = pos < n
    v = tl.load(values + pos, mask=m, other=0)
    if HAS_LIMITS:
        limit = tl.load(limits + feature, mask=m, other=-1)
        bad = tl.where(limit >= 0, (v < 0) | (v >= limit), v == RESERVED)
    else:
        bad = v == RESERVED
    if tl.max((bad & m).to(tl.int32), axis=0) > 0:
        tl.atomic_max(summary + 2 * F, 1)
    if HAS_WEIGHTS:
        w = tl.load(weights + pos, mask=m, other=0.0)
        if tl.max(((w != w) | (tl.abs(w) == float("inf"))).to(tl.int32), axis=0) > 0:
            tl.atomic_max(summary + 2 * F + 1, 1)
    if HAS_TABLES:
        tl.store(tables + pos, tl.load(table_of_feature + feature, mask=m, other=0), mask=pos < bound)
    if tl.program_id(0) == 0:
        total = tl.load(summary)
        for g in range(1, F):
            total += tl.load(summary + g)
        tl.store(summary + 2 * F + 2, total - n)


def batch_checks(values: torch.Tensor, per_feature: torch.Tensor, limits: torch.Tensor | None,
                 table_of_feature: torch.Tensor | None, weights: torch.Tensor | None,
                 count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``TorchKernels.batch_checks`` in two kernels."""
    nf, batch_size = per_feature.shape
    n, dev = values.numel(), values.device
    summary = torch.zeros(2 * nf + 3, dtype=torch.int64, device=dev)
    tables = torch.empty(n, dtype=torch.int64, device=dev) if table_of_feature is not None else None
    _feature_sums_kernel[(nf, max(1, triton.cdiv(batch_size, _LENGTHS_BLOCK)))](
        per_feature.contiguous(), summary, batch_size, nf, BLOCK=_LENGTHS_BLOCK)
    _check_ids_kernel[(max(1, triton.cdiv(n, _IDS_BLOCK)),)](
        values, values if weights is None else weights.contiguous(),
        values if limits is None else limits, values if tables is None else table_of_feature,
        values if tables is None else tables, summary, n, summary if count is None else count, nf,
        RESERVED=RESERVED_KEY, HAS_LIMITS=limits is not None, HAS_WEIGHTS=weights is not None,
        HAS_TABLES=tables is not None, N_PTR=count is not None, BLOCK=_IDS_BLOCK)
    return summary, tables
