"""The bottom layer: the reserved key and the key hashes every layer shares. It imports nothing of
the package.

Arithmetic is int64 with wrap-around (the same on CPU and CUDA); ``shr`` is the logical shift that
torch's arithmetic ``>>`` is not. The Triton versions in ``tieredemb.ops.triton.hashing`` give the
same bits (uint64 arithmetic) and are tested equal.
"""

from __future__ import annotations

import hashlib

import torch

RESERVED_KEY = -(2**63)
"""The one int64 value no table accepts as an id: it marks an empty slot in every index."""

GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: splitmix64's increment
_MUL1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MUL2 = -7723592293110705685  # 0x94D049BB133111EB


def shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer on int64 tensors (wrapping arithmetic)."""
    x = x + GOLDEN
    x = (x ^ shr(x, 30)) * _MUL1
    x = (x ^ shr(x, 27)) * _MUL2
    return x ^ shr(x, 31)


def bucket_of(keys: torch.Tensor, num_buckets: int | torch.Tensor) -> torch.Tensor:
    """int64 (n,) keys -> int64 (n,) bucket in [0, num_buckets) (a scalar or one per key): a
    multiply-shift of the high half of splitmix64(key), monotone in the hash (the index's buckets)."""
    hi = shr(splitmix64(keys), 32)  # [0, 2**32)
    return (hi * num_buckets) >> 32


def keep_where(mask: torch.Tensor, keys: torch.Tensor,
               tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (key, table) pairs where ``mask`` holds: selected on the CPU; on a device, every pair
    kept and the others made (``RESERVED_KEY``, table 0) (a selection there would read its count
    back; the others' table numbers may be another group's, past this one's tables)."""
    if keys.device.type == "cpu":
        return keys[mask], tables[mask]
    return torch.where(mask, keys, RESERVED_KEY), torch.where(mask, tables, 0)


def stable_name_hash(name: str) -> int:
    """A process-independent int64 hash of a string (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little", signed=True)


__all__ = ["RESERVED_KEY", "GOLDEN", "shr", "splitmix64", "bucket_of", "keep_where", "stable_name_hash"]
