"""Initial rows as a pure function of (seed, table name, key, column).

Every initializer draws from a counter-based generator (splitmix64 over the counter), so a key gets the
same initial row on any device, tier, shard, world size and insertion order: there is no RNG stream
whose position could depend on which keys came first. Arithmetic is int64 with wrap-around (the same
on CPU and CUDA); the float transforms run in float64 and round once to float32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from tieredemb.keys import GOLDEN, shr, splitmix64, stable_name_hash
from tieredemb.ops import triton_hashing


@functools.lru_cache(maxsize=256)
def _table_bases(seed: int, names: tuple[str, ...], stream: int, device: torch.device) -> torch.Tensor:
    """int64 (t,): the generator's base of each table, kept on ``device`` (no copy per call)."""
    hashes = torch.tensor([stable_name_hash(n) for n in names], dtype=torch.int64)
    return splitmix64(torch.tensor(seed, dtype=torch.int64) * 31 + hashes + stream).to(device)


def _bases(seed: int, table: str | list[str], stream: int, device: torch.device) -> torch.Tensor:
    names = (table,) if isinstance(table, str) else tuple(table)
    return _table_bases(int(seed), names, stream, device)


def random_bits(seed: int, table: str | list[str], keys: torch.Tensor, dim: int, stream: int = 0,
                tables: torch.Tensor | None = None) -> torch.Tensor:
    """int64 (n, dim) of well-mixed bits, a pure function of (seed, table, key, column, stream).

    ``table`` is one name, or several with ``tables`` (int64 (n,)) the position of each key's."""
    bases = _bases(seed, table, stream, keys.device)
    if keys.is_cuda and triton_hashing() is not None:  # the same bits in one kernel
        return triton_hashing().random_bits(bases, keys, dim, tables)
    base = bases[0] if tables is None else bases[tables]
    per_key = splitmix64(keys.to(torch.int64) ^ base)  # (n,)
    cols = torch.arange(1, dim + 1, dtype=torch.int64, device=keys.device) * GOLDEN  # (dim,)
    return splitmix64(per_key[:, None] + cols[None, :])




def uniform01(bits: torch.Tensor) -> torch.Tensor:
    """int64 bits -> float64 in [0, 1) with 53 random bits."""
    return shr(bits, 11).to(torch.float64) * (2.0**-53)


class Initializer:
    """Base class: ``rows(seed, table, keys, dim) -> float32 (n, dim)`` on ``keys.device``.

    ``table`` may also be a list of table names, with ``tables`` (int64 (n,)) the position of each
    key's table in it: several tables' rows in one call, each as if drawn alone."""

    def rows(self, seed: int, table: str | list[str], keys: torch.Tensor, dim: int,
             tables: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Uniform(Initializer):
    """Uniform on ``[low, high)``."""

    low: float = -0.01
    high: float = 0.01

    def rows(self, seed: int, table: str | list[str], keys: torch.Tensor, dim: int,
             tables: torch.Tensor | None = None) -> torch.Tensor:
        if keys.is_cuda and triton_hashing() is not None:  # the same rows in one kernel
            return triton_hashing().uniform_rows(_bases(seed, table, 0, keys.device), keys, dim, tables,
                                                  self.low, self.high)
        u = uniform01(random_bits(seed, table, keys, dim, tables=tables))
        return (self.low + (self.high - self.low) * u).to(torch.float32)


@dataclass(frozen=True)
class Normal(Initializer):
    """Normal(mean, std) by the Box-Muller transform of two counter streams."""

    mean: float = 0.0
    std: float = 0.01

    def rows(self, seed: int, table: str | list[str], keys: torch.Tensor, dim: int,
             tables: torch.Tensor | None = None) -> torch.Tensor:
        u1 = 1.0 - uniform01(random_bits(seed, table, keys, dim, stream=0, tables=tables))  # (0, 1]
        u2 = uniform01(random_bits(seed, table, keys, dim, stream=1, tables=tables))
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
        return (self.mean + self.std * z).to(torch.float32)


@dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """Normal(mean, std) truncated to ``[a, b]`` (absolute bounds, as ``torch.nn.init.trunc_normal_``),
    drawn by inverting the normal CDF on the truncated range."""

    mean: float = 0.0
    std: float = 0.01
    a: float = -0.02
    b: float = 0.02

    def __post_init__(self) -> None:
        if not self.a < self.b:
            raise ValueError(f"TruncatedNormal needs a < b, got a={self.a}, b={self.b}")

    def rows(self, seed: int, table: str | list[str], keys: torch.Tensor, dim: int,
             tables: torch.Tensor | None = None) -> torch.Tensor:
        def cdf(x: float) -> float:
            return 0.5 * (1.0 + math.erf((x - self.mean) / (self.std * math.sqrt(2.0))))

        lo, hi = cdf(self.a), cdf(self.b)
        u = uniform01(random_bits(seed, table, keys, dim, tables=tables))
        p = (lo + (hi - lo) * u).clamp(1e-16, 1 - 1e-16)
        x = self.mean + self.std * math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)
        return x.clamp(self.a, self.b).to(torch.float32)


@dataclass(frozen=True)
class Constant(Initializer):
    """Every element equal to ``value``."""

    value: float = 0.0

    def rows(self, seed: int, table: str | list[str], keys: torch.Tensor, dim: int,
             tables: torch.Tensor | None = None) -> torch.Tensor:
        return torch.full((keys.numel(), dim), float(self.value), dtype=torch.float32,
                          device=keys.device)


__all__ = ["Initializer", "Uniform", "Normal", "TruncatedNormal", "Constant"]
