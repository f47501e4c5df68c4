"""Which storage mode a collection runs in and which tiers it builds (DESIGN section 3): the
footprint against the HBM budget, the tables grouped by row width, one tier per group."""

from __future__ import annotations

import torch

from tieredemb.config import StorageConfig, TableConfig
from tieredemb.optim import EmbeddingOptimizer
from tieredemb.storage.backends import HostMemory
from tieredemb.storage.host_tier import HostTierGroup
from tieredemb.storage.tiers.cache import CacheTier
from tieredemb.storage.tiers.device import DeviceTier


def _row_bytes(t: TableConfig, optimizer: EmbeddingOptimizer) -> int:
    return (t.embedding_dim + optimizer.state_width(t.embedding_dim)) * t.dtype.itemsize


def _shard_rows(t: TableConfig, world: int) -> int | None:
    """Rows one rank's shard of ``t`` can hold: ``max_capacity`` (a bound per shard), else its share
    of ``num_embeddings``, else None (unbounded)."""
    if t.max_capacity is not None:
        return t.max_capacity
    return None if t.num_embeddings is None else -(-t.num_embeddings // world)


def select_mode(tables: list[TableConfig], optimizer: EmbeddingOptimizer, storage: StorageConfig,
                 world: int = 1) -> str:
    """``hbm_direct`` when there is no budget or the footprint (of one rank's shard) fits it; over
    it, ``cache`` or ``hybrid`` by ``storage.caching`` (DESIGN section 3)."""
    if storage.hbm_budget is None:
        return "hbm_direct"
    rows = [_shard_rows(t, world) for t in tables]
    footprint = sum(float("inf") if r is None else r * _row_bytes(t, optimizer) for r, t in zip(rows, tables))
    if footprint <= storage.hbm_budget:
        if storage.host_budget is not None:
            raise ValueError(f"host_budget: the tables ({footprint:.0f} bytes) fit hbm_budget "
                             f"({storage.hbm_budget} bytes), so they run in hbm_direct mode with no "
                             "backing store for a host tier to stand in front of; drop host_budget")
        return "hbm_direct"
    if not storage.caching and not isinstance(storage.backing, HostMemory):
        raise ValueError("hybrid mode (caching=False) keeps its overflow rows in host memory: its "
                         f"backing must be te.storage.HostMemory(), got {storage.backing!r}")
    return "cache" if storage.caching else "hybrid"


def _budget_rows(tables: list[TableConfig], optimizer: EmbeddingOptimizer, budget: int,
                 world: int = 1) -> list[int]:
    """Rows of each table on the device under ``budget`` bytes: shared in proportion to the tables'
    (shards') footprints when every table is bounded, else in equal bytes."""
    sizes = [_shard_rows(t, world) for t in tables]
    if all(s is not None for s in sizes):
        total = sum(s * _row_bytes(t, optimizer) for s, t in zip(sizes, tables))
        shares = [s * _row_bytes(t, optimizer) / total for s, t in zip(sizes, tables)]
    else:
        shares = [1.0 / len(tables)] * len(tables)
    return [max(1, int(budget * f) // _row_bytes(t, optimizer)) for f, t in zip(shares, tables)]


def group_tables(tables: list[TableConfig]) -> list[list[int]]:
    """Tables batched together: those of one embedding dim (so one row width), one row dtype and
    one rounding (so one row store and one update), in config order."""
    groups: dict[tuple, list[int]] = {}
    for t, config in enumerate(tables):
        key = (config.embedding_dim, config.dtype, config.rounds_stochastically)
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def build_tiers(mode: str, tables: list[TableConfig], members: list[list[int]],
                  optimizer: EmbeddingOptimizer, storage: StorageConfig, seed: int, device: torch.device,
                  kernels, world: int = 1) -> list[DeviceTier]:
    """One storage object per group, of the mode's class."""
    common = dict(optimizer=optimizer, seed=seed, device=device, kernels=kernels,
                  bucket_width=storage.bucket_width, segment_rows=storage.segment_rows)
    if mode == "hbm_direct":
        return [DeviceTier([tables[t] for t in m], **common) for m in members]
    rows = _budget_rows(tables, optimizer, storage.hbm_budget, world)
    if mode == "hybrid":
        return [DeviceTier([tables[t] for t in m], **common, device_rows=sum(rows[t] for t in m))
                for m in members]
    host_rows = (None if storage.host_budget is None
                 else _budget_rows(tables, optimizer, storage.host_budget, world))
    out = []
    for m in members:
        width = tables[m[0]].embedding_dim + optimizer.state_width(tables[m[0]].embedding_dim)
        dtype = tables[m[0]].dtype  # named only for 16-bit rows (a spec for float32 rows still opens)
        below = storage.backing.open_group([tables[t].name for t in m], width, device,
                                           **({} if dtype == torch.float32 else {"dtype": dtype}))
        if host_rows is not None:  # a host tier in front of each table's store
            known = [tables[t].num_embeddings for t in m]
            below = HostTierGroup(below, [host_rows[t] for t in m], [tables[t].eviction for t in m], device,
                                  expected_keys=None if None in known else sum(known))
        out.append(CacheTier([tables[t] for t in m], **common, cache_rows=[rows[t] for t in m],
                              below=below))
    return out
