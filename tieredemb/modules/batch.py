"""Input checking and per-table layout of a KeyedJaggedTensor batch.

Every check runs before any state changes, and every error names the feature and the problem.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tieredemb.config import RESERVED_KEY, TableConfig
from tieredemb.jagged import KeyedJaggedTensor, _offsets_from_lengths, as_kjt

_INT_DTYPES = (torch.int64, torch.int32)


@dataclass
class TableBatch:
    """One table's ids of a batch, features concatenated in the table's ``feature_names`` order.

    ids: int64 (n,); lengths: int64 (F_t * B,) ids per (feature, sample); offsets: int64 (F_t*B + 1,);
    weights: float32 (n,) or None; ids_per_feature: list of F_t ints (host).
    """

    ids: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    ids_per_feature: list[int]


@dataclass
class Batch:
    batch_size: int
    tables: dict[str, TableBatch]


def check_tables(tables: list[TableConfig]) -> None:
    """A collection's table configs: unique table names, each feature in exactly one table."""
    if not tables:
        raise ValueError("a collection needs at least one TableConfig")
    names: set[str] = set()
    owner: dict[str, str] = {}
    for t in tables:
        if not isinstance(t, TableConfig):
            raise TypeError(f"tables must be te.TableConfig, got {type(t).__name__}")
        if t.name in names:
            raise ValueError(f"duplicate table name {t.name!r}")
        names.add(t.name)
        for f in t.feature_names:
            if f in owner:
                raise ValueError(f"feature {f!r} is in two tables: {owner[f]!r} and {t.name!r}")
            owner[f] = t.name


def _check_structure(kjt: KeyedJaggedTensor, features: list[str]) -> tuple[int, torch.Tensor, list[int]]:
    keys = kjt.keys()
    if len(set(keys)) != len(keys):
        raise ValueError(f"batch has duplicate feature names: {keys}")
    unknown = [k for k in keys if k not in features]
    if unknown:
        raise ValueError(f"batch has unknown features {unknown}; this collection has {features}")
    missing = [f for f in features if f not in keys]
    if missing:
        raise ValueError(f"batch is missing features {missing}")
    values, lengths = kjt.values(), kjt.lengths()
    if values.dtype not in _INT_DTYPES or values.dim() != 1:
        raise TypeError(f"batch values must be a 1-D int64 or int32 tensor of ids, got "
                        f"{values.dtype} with shape {tuple(values.shape)}")
    if lengths.dtype not in _INT_DTYPES or lengths.dim() != 1:
        raise TypeError(f"batch lengths must be a 1-D int64 or int32 tensor, got {lengths.dtype} "
                        f"with shape {tuple(lengths.shape)}")
    if lengths.numel() % len(keys):
        raise ValueError(f"batch lengths has {lengths.numel()} entries, not a multiple of its "
                         f"{len(keys)} features")
    batch_size = lengths.numel() // len(keys)
    per_feature = lengths.view(len(keys), batch_size).to(torch.int64)
    # one host transfer: ids per feature, and how many negative lengths each has
    summary = torch.stack([per_feature.sum(dim=1), (per_feature < 0).sum(dim=1)]).tolist()
    counts, negative = summary
    if any(negative):
        raise ValueError(f"feature {keys[[n > 0 for n in negative].index(True)]!r}: negative lengths")
    if sum(counts) != values.numel():
        raise ValueError(f"batch lengths sum to {sum(counts)} but values has {values.numel()} ids")
    return batch_size, per_feature, counts


def _check_weights(kjt: KeyedJaggedTensor, bounds: list[int]) -> None:
    weights = kjt.weights_or_none()
    if weights is None:
        return
    if not weights.is_floating_point() or weights.dim() != 1:
        raise TypeError(f"batch weights must be a 1-D float tensor, got {weights.dtype} with shape "
                        f"{tuple(weights.shape)}")
    if weights.numel() != kjt.values().numel():
        raise ValueError(f"batch weights has {weights.numel()} entries but values has "
                         f"{kjt.values().numel()}")
    bad = ~torch.isfinite(weights)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0])
        feature = kjt.keys()[sum(1 for b in bounds[1:] if b <= pos)]
        raise ValueError(f"feature {feature!r}: non-finite weight {float(weights[pos])}")


def _check_ids(feature: str, table: TableConfig, ids: torch.Tensor) -> None:
    if ids.numel() == 0:
        return
    if table.num_embeddings is not None:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= table.num_embeddings:
            bad = lo if lo < 0 else hi
            raise ValueError(f"feature {feature!r}: id {bad} out of range [0, {table.num_embeddings})"
                             f" of table {table.name!r}")
    elif bool((ids == RESERVED_KEY).any()):
        raise ValueError(f"feature {feature!r}: id {RESERVED_KEY} is te.RESERVED_KEY, which no table "
                         "accepts")


def _check_all_ids(values: torch.Tensor, tables: list[TableConfig], features: list[str],
                   counts: list[int], bounds: list[int]) -> None:
    """Every feature's ids at once (one host sync); the failing feature is checked again alone for
    its message. values: int64 (n,) feature-major; tables/features/counts: per feature."""
    if values.numel() == 0:
        return
    limits = [t.num_embeddings if t.num_embeddings is not None else -1 for t in tables]
    limit = torch.repeat_interleave(torch.tensor(limits, device=values.device),
                                    torch.tensor(counts, device=values.device), output_size=values.numel())
    bad = torch.where(limit >= 0, (values < 0) | (values >= limit), values == RESERVED_KEY)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0])
        i = sum(1 for b in bounds[1:] if b <= pos)
        _check_ids(features[i], tables[i], values[bounds[i] : bounds[i + 1]])


def layout_batch(batch: object, tables: list[TableConfig], device: torch.device,
                 use_weights: bool) -> Batch:
    """Check a batch against the collection's tables and cut it into per-table id lists."""
    kjt = as_kjt(batch)
    table_of = {f: t for t in tables for f in t.feature_names}
    batch_size, per_feature, counts = _check_structure(kjt, list(table_of))
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    _check_weights(kjt, bounds)
    values = kjt.values().to(device=device, dtype=torch.int64)
    weights = kjt.weights_or_none() if use_weights else None
    if weights is not None:
        weights = weights.to(device=device, dtype=torch.float32)
    order = kjt.keys()
    position = {f: i for i, f in enumerate(order)}
    _check_all_ids(values, [table_of[f] for f in order], order, counts, bounds)
    per_feature = per_feature.to(device)
    out: dict[str, TableBatch] = {}
    for t in tables:
        idx = [position[f] for f in t.feature_names]
        ids = torch.cat([values[bounds[i] : bounds[i + 1]] for i in idx])
        lengths = torch.cat([per_feature[i] for i in idx])
        w = None if weights is None else torch.cat([weights[bounds[i] : bounds[i + 1]] for i in idx])
        out[t.name] = TableBatch(ids, lengths, _offsets_from_lengths(lengths), w,
                                 [counts[i] for i in idx])
    return Batch(batch_size, out)


def check_keys(table: TableConfig, keys: object, device: torch.device) -> torch.Tensor:
    """Keys given to read/write/erase: a 1-D integer tensor of valid ids -> int64 on ``device``."""
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"table {table.name!r}: keys must be a tensor, got {type(keys).__name__}")
    if keys.dtype not in _INT_DTYPES or keys.dim() != 1:
        raise TypeError(f"table {table.name!r}: keys must be a 1-D int64 tensor, got {keys.dtype} "
                        f"with shape {tuple(keys.shape)}")
    keys = keys.to(device=device, dtype=torch.int64)
    _check_ids(f"<keys of table {table.name}>", table, keys)
    return keys
