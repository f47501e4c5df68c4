"""The regroup of a batch of several table groups deduped together (``TorchKernels.regroup_ids``):
one kernel over the ids instead of ~20 torch ops (scatters, gathers, repeats, subtractions), each
id's feature found by a binary search of its position among the features' ends."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tieredemb.ops.triton.launch import fast_launch

_BLOCK = 1024  # ids per program


@fast_launch
@triton.jit(do_not_specialize=["n", "features"])
def _regroup_ids_kernel(shifts, values, tables, weights, inverse, pair_values, order, pair_tables,
                        table_first, count, out_values, out_tables, out_weights, out_inverse, out_pair_values,
                        out_order, out_pair_tables, n, features, STEPS: tl.constexpr,
                        HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (cdiv(n, BLOCK),). Position p is at once an id (moved to p + its feature's shift, its
    # table and pair made its group's), a sorted position (order[p] made a position within its
    # group) and a pair (its table made its group's). shifts int64 (5, features): see the reference.
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = p < n
    real = tl.load(shifts + features - 1)
    mine = inside & (p < real)
    f = _feature_of(shifts, p, mine, features, STEPS, BLOCK)
    moved = p + tl.load(shifts + features + f, mask=mine, other=0)
    tl.store(out_values + moved, tl.load(values + p, mask=inside), mask=inside)
    table_base = tl.load(shifts + 3 * features + f, mask=mine, other=0)
    tl.store(out_tables + moved, tl.load(tables + p, mask=inside) - table_base, mask=inside)
    if HAS_WEIGHTS:
        tl.store(out_weights + moved, tl.load(weights + p, mask=inside), mask=inside)
    pair = tl.load(inverse + p, mask=inside, other=0)
    pair_base = tl.load(shifts + 4 * features + f, mask=mine, other=0)
    tl.store(out_inverse + moved, pair - pair_base, mask=inside)
    value = tl.load(pair_values + pair, mask=mine & (pair >= 0) & (pair < n), other=-1)
    tl.store(out_pair_values + moved, value, mask=inside)
    q = tl.load(order + p, mask=inside, other=0)
    sorted_real = inside & (q < real)
    fq = _feature_of(shifts, q, sorted_real, features, STEPS, BLOCK)
    tl.store(out_order + p, q + tl.load(shifts + 2 * features + fq, mask=sorted_real, other=0), mask=inside)
    is_pair = inside & (p < tl.load(count))
    t = tl.load(pair_tables + p, mask=inside, other=0)
    tl.store(out_pair_tables + p, t - tl.load(table_first + t, mask=is_pair, other=0), mask=inside)


@triton.jit
def _feature_of(shifts, p, mask, features, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """The first feature whose end (``shifts``' first row) is past ``p``."""
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + features - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        open_ = lo < hi
        right = open_ & (tl.load(shifts + mid, mask=mask & open_, other=0) <= p)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    return lo


def regroup_ids(shifts: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                weights: torch.Tensor | None, inverse: torch.Tensor, pair_values: torch.Tensor,
                order: torch.Tensor, pair_tables: torch.Tensor, table_first: torch.Tensor,
                count: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """``TorchKernels.regroup_ids`` in one kernel, reading nothing on the host."""
    n, features = values.numel(), shifts.shape[1]
    outs = [torch.empty_like(t) for t in (values, tables)]
    outs.append(None if weights is None else torch.empty_like(weights))
    outs += [torch.empty_like(t) for t in (inverse, inverse, order, pair_tables)]
    if n:
        _regroup_ids_kernel[(triton.cdiv(n, _BLOCK),)](
            shifts.contiguous(), values, tables, values if weights is None else weights, inverse, pair_values,
            order, pair_tables, table_first, count, outs[0], outs[1], outs[0] if weights is None else outs[2],
            *outs[3:], n, features, STEPS=max(1, (features - 1).bit_length()),
            HAS_WEIGHTS=weights is not None, BLOCK=_BLOCK)
    return tuple(outs)
