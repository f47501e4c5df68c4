"""Rounding float32 rows to a 16-bit table's storage type (``TableConfig.dtype``).

Updates are computed in float32 and rounded once when stored. To the nearest value, an update
smaller than half the spacing of the 16-bit values around a weight is lost every time (a weight of 1.0
in bfloat16 ignores any step under 2**-8); stochastic rounding goes up or down with the probabilities
that make the stored value right on average, so such steps still add up.

The random draw of each element is a pure function of (seed, table name, key, step, column): rows
come out the same in every storage mode, tier, shard and batch order. Per updated row the caller makes
a 32-bit seed (``row_seeds``); per element ``element_bits`` mixes it with the column (murmur3's 32-bit
finalizer). Everything is int64 arithmetic masked to 32 bits, which the Triton kernel
(``tieredemb.ops.triton.update``) repeats bit for bit.

How a float32 ``x`` with 32 random bits ``r`` is rounded:

- bfloat16 keeps the top 16 bits of ``x``: ``(bits(x) + (r & 0xFFFF)) & ~0xFFFF`` rounds the
  magnitude up with probability (dropped bits) / 2**16, exactly, subnormals included.
- float16 keeps 10 of float32's 23 mantissa bits where it has normal numbers (``|x| >= 2**-14``):
  the same with 13 bits. Below, its values are the multiples of 2**-24: ``t = |x| * 2**24`` is
  rounded up when its fraction exceeds a uniform draw of 23 bits (``r >> 9``).
"""

from __future__ import annotations

import functools

import torch

from tieredemb.keys import GOLDEN, splitmix64, stable_name_hash

_MASK32 = 0xFFFFFFFF
_COLUMN_STEP = 0x9E3779B9  # the 32-bit golden ratio: consecutive columns far apart
_FMIX1 = 0x85EBCA6B
_FMIX2 = 0xC2B2AE35
_STREAM = 0x5352  # keeps the rounding's draws apart from the initializers' (init.py's streams)


@functools.lru_cache(maxsize=256)
def _table_bases(seed: int, names: tuple[str, ...], device: torch.device) -> torch.Tensor:
    hashes = torch.tensor([stable_name_hash(n) for n in names], dtype=torch.int64)
    return splitmix64(torch.tensor(seed, dtype=torch.int64) * 31 + hashes + _STREAM).to(device)


def table_bases(seed: int, names: list[str], device: torch.device) -> torch.Tensor:
    """int64 (T,): each table's base of the rounding's draws, from the seed and its name."""
    return _table_bases(int(seed), tuple(names), torch.device(device))


def row_seeds(bases: torch.Tensor, keys: torch.Tensor, step: int) -> torch.Tensor:
    """int64 (u,) in [0, 2**32): the seed of each updated row. bases: int64 (u,) its table's
    ``table_bases`` entry; keys: int64 (u,); step: the optimizer step (1 on the first)."""
    salt = (int(step) * GOLDEN + 2**63) % 2**64 - 2**63  # int64 wrap-around, as on the device
    mixed = splitmix64(splitmix64(keys ^ bases) + salt)
    return mixed & _MASK32


def element_bits(seeds: torch.Tensor, width: int) -> torch.Tensor:
    """int64 (u, width) in [0, 2**32): 32 random bits per element of the rows whose ``row_seeds``
    are ``seeds`` (int64 (u,))."""
    cols = torch.arange(width, dtype=torch.int64, device=seeds.device) * _COLUMN_STEP
    h = (seeds[:, None] + cols[None, :]) & _MASK32
    h = h ^ (h >> 16)
    h = (h * _FMIX1) & _MASK32
    h = h ^ (h >> 13)
    h = (h * _FMIX2) & _MASK32
    return h ^ (h >> 16)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to ``dtype`` (bfloat16 or float16) up or down at random, unbiased;
    bits: int64 of x's shape in [0, 2**32) (``element_bits``). NaN and infinities stay."""
    x = x.to(torch.float32)
    xi = x.view(torch.int32)
    if dtype == torch.bfloat16:
        out = ((xi + (bits & 0xFFFF).to(torch.int32)) & ~0xFFFF).view(torch.float32)
    elif dtype == torch.float16:
        normal = ((xi + (bits & 0x1FFF).to(torch.int32)) & ~0x1FFF).view(torch.float32)
        t = x.abs() * 2.0**24
        n = t.floor()
        u = (bits >> 9).to(torch.float32) * 2.0**-23
        sub = (n + (t - n > u).to(torch.float32)) * 2.0**-24
        out = torch.where(x.abs() < 2.0**-14, torch.where(x < 0, -sub, sub), normal)
    else:
        raise ValueError(f"stochastic rounding is for bfloat16 and float16, not {dtype}")
    return torch.where(torch.isnan(x), x, out).to(dtype)


def round_rows(x: torch.Tensor, dtype: torch.dtype, seeds: torch.Tensor | None) -> torch.Tensor:
    """float32 rows (u, W) in ``dtype``: stochastically with ``seeds`` (``row_seeds``, int64 (u,))
    for a 16-bit type, else to the nearest value (a float32 ``dtype``: unchanged)."""
    if dtype == torch.float32 or seeds is None:
        return x.to(dtype)
    return stochastic_round(x, dtype, element_bits(seeds, x.shape[1]))


__all__ = ["table_bases", "row_seeds", "element_bits", "stochastic_round", "round_rows"]
