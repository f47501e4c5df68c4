"""Backing-store specifications: what a user names in ``StorageConfig(backing=...)``.

A spec is plain configuration; the collection opens one backend per table from it. The backends
themselves (copy-based ``get``/``set``/``delete``/``scan``/``flush``/``close``) arrive with the
tiered-storage issue (#3); in ``hbm_direct`` mode the backing store is never touched.
"""

from __future__ import annotations

from dataclasses import dataclass

_EXISTING = ("error", "reuse", "clear")


class BackendSpec:
    """Base class of backing-store specs."""


@dataclass(frozen=True)
class HostMemory(BackendSpec):
    """Rows in host memory (pinned when the device is CUDA)."""


@dataclass(frozen=True)
class RocksDB(BackendSpec):
    """Rows in RocksDB on local disk (through ``rocksdict``), sharded by key hash."""

    path: str
    shards: int = 8
    existing: str = "error"

    def __post_init__(self) -> None:
        if self.existing not in _EXISTING:
            raise ValueError(f"RocksDB existing must be one of {_EXISTING}, got {self.existing!r}")
        if not isinstance(self.shards, int) or self.shards < 1:
            raise ValueError(f"RocksDB shards must be an int >= 1, got {self.shards!r}")


@dataclass(frozen=True)
class Redis(BackendSpec):
    """Rows in Redis (or Redis Cluster) as binary values, one key namespace per table."""

    url: str = "redis://127.0.0.1:6379/0"
    password: str | None = None
    existing: str = "error"

    def __post_init__(self) -> None:
        if self.existing not in _EXISTING:
            raise ValueError(f"Redis existing must be one of {_EXISTING}, got {self.existing!r}")
