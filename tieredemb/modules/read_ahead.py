"""The keys of a batch by table, for reads issued ahead (``collection.read_ahead``).

A read ahead is a hint: it moves rows from a backing store into the host tier in front of it (see
``tieredemb.storage.host_tier``) and changes nothing a training step sees, so the batch is only read
here, not checked as a prefetch checks it (that happens when the batch's own turn comes).
"""

from __future__ import annotations

import torch

from tieredemb.config import TableConfig
from tieredemb.keys import keep_where
from tieredemb.ops import to_device_at_once


class BatchKeys:
    """Each table group's keys in a batch and each key's table in the group, int64 (n,) each, on the
    batch's device: a batch on the GPU is not read back (its pairs of other groups are
    ``RESERVED_KEY``: ``keep_where``), one on the CPU is checked and split there. Repeats are kept
    (the host tier takes the distinct ones). ``where`` maps a table's name to (group, position in
    the group)."""

    def __init__(self, tables: list[TableConfig], where: dict[str, tuple[int, int]]) -> None:
        self.of_feature = {f: where[t.name] for t in tables for f in t.feature_names}
        self._maps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # by (features, device)

    def by_group(self, kjt: object, device: torch.device | None = None,
                 wanted: set[int] | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """A feature no table reads, or a table's feature missing, is a ``ValueError``. ``device``:
        where the pairs are wanted; a CPU batch for a CUDA device is checked on the CPU, then its
        values and lengths go there in one copy from pinned memory and its tables are found there
        (the host's work a batch: a copy, not a pass over its ids). ``wanted``: the groups whose
        pairs to make (None: all); the batch is checked whatever it holds."""
        if not hasattr(kjt, "keys") or not hasattr(kjt, "values") or not hasattr(kjt, "lengths"):
            raise TypeError(f"read_ahead takes a KeyedJaggedTensor, got {type(kjt).__name__}")
        features = tuple(kjt.keys())
        unknown = [f for f in features if f not in self.of_feature]
        missing = sorted(set(self.of_feature) - set(features))
        if unknown or missing:
            raise ValueError(f"read_ahead: the batch's features {list(features)} are not the collection's "
                             f"(unknown: {unknown}, missing: {missing})")
        if not features:
            return {}
        values = kjt.values().reshape(-1).to(torch.int64)
        lengths = kjt.lengths().reshape(-1).to(values.device)
        if lengths.numel() % len(features):
            raise ValueError(f"read_ahead: {lengths.numel()} lengths for {len(features)} features")
        if lengths.device.type == "cpu" and (total := int(lengths.sum())) != values.numel():
            raise ValueError(f"read_ahead: lengths sum to {total}, values has {values.numel()}")
        present = sorted({self.of_feature[f][0] for f in features})
        groups = [g for g in present if wanted is None or g in wanted]
        if not groups:
            return {}
        if device is not None and device.type == "cuda" and values.device.type == "cpu":
            values, lengths = to_device_at_once([[values], [lengths]], device)[1]
        group, position = self._map(features, values.device)
        per_feature = lengths.reshape(len(features), -1).sum(1)
        if values.device.type == "cpu":  # (its lengths checked above: each feature's values repeated)
            feature = torch.repeat_interleave(torch.arange(len(features)), per_feature,
                                              output_size=values.numel())
        else:  # each value's feature: the first whose values end past it (whatever the lengths hold)
            at = torch.arange(values.numel(), device=values.device)
            feature = torch.searchsorted(per_feature.cumsum(0), at, right=True).clamp_(max=len(features) - 1)
        tables = position[feature]
        if len(present) == 1:
            return {groups[0]: (values, tables)}
        of = group[feature]
        return {g: keep_where(of == g, values, tables) for g in groups}

    def _map(self, features: tuple[str, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Each feature's group and position in it, int64 on ``device`` (made once per order)."""
        key = (features, device)
        if key not in self._maps:
            g, i = zip(*(self.of_feature[f] for f in features))
            self._maps[key] = (torch.tensor(g, dtype=torch.int64, device=device),
                               torch.tensor(i, dtype=torch.int64, device=device))
        return self._maps[key]

