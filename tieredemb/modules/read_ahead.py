"""The keys of a batch by table, for reads issued ahead (``collection.read_ahead``).

A read ahead is a hint: it moves rows from a backing store into the host tier in front of it (see
``tieredemb.storage.host_tier``) and changes nothing a training step sees, so the batch is only read
here, not checked as a prefetch checks it (that happens when the batch's own turn comes).
"""

from __future__ import annotations

import torch

from tieredemb.config import TableConfig


def keys_by_table(kjt: object, tables: list[TableConfig]) -> dict[str, torch.Tensor]:
    """Each table's keys in ``kjt`` (a ``te.KeyedJaggedTensor`` or TorchRec's): int64 (n,) on the
    CPU, repeats kept (the host tier takes the distinct ones on the device, where that is cheap).
    A feature no table reads, or a table's feature missing, is a ``ValueError``."""
    if not hasattr(kjt, "keys") or not hasattr(kjt, "values") or not hasattr(kjt, "lengths"):
        raise TypeError(f"read_ahead takes a KeyedJaggedTensor, got {type(kjt).__name__}")
    features = list(kjt.keys())
    known = {f for t in tables for f in t.feature_names}
    unknown = [f for f in features if f not in known]
    missing = sorted(known - set(features))
    if unknown or missing:
        raise ValueError(f"read_ahead: the batch's features {features} are not the collection's "
                         f"(unknown: {unknown}, missing: {missing})")
    values = kjt.values().reshape(-1).to(torch.int64).cpu()
    lengths = kjt.lengths().reshape(-1).to(torch.int64).cpu()
    if features and lengths.numel() % len(features):
        raise ValueError(f"read_ahead: {lengths.numel()} lengths for {len(features)} features")
    per_feature = lengths.reshape(len(features), -1).sum(1).tolist() if features else []
    if sum(per_feature) != values.numel():
        raise ValueError(f"read_ahead: lengths sum to {sum(per_feature)}, values has {values.numel()}")
    spans = dict(zip(features, torch.split(values, per_feature)))
    return {t.name: torch.cat([spans[f] for f in t.feature_names]) for t in tables if t.feature_names}


def keys_by_group(kjt: object, tables: list[TableConfig],
                  where: dict[str, tuple[int, int]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per table group: the keys of its tables in ``kjt`` and each key's table in the group, int64
    (n,) each; ``where`` maps a table's name to (group, position in the group)."""
    parts: dict[int, list[tuple[torch.Tensor, int]]] = {}
    for name, keys in keys_by_table(kjt, tables).items():
        g, i = where[name]
        parts.setdefault(g, []).append((keys, i))
    return {g: (torch.cat([k for k, _ in p]), torch.cat([torch.full_like(k, i) for k, i in p]))
            for g, p in parts.items()}
