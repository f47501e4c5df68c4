"""Click data for the training job: the batch type shared by every source.

A source is one of ``tieredemb.data.synthetic.SyntheticClicks`` (generated from a seed, with a hidden
ground-truth model) or ``tieredemb.data.criteo.CriteoClicks`` (a Criteo-format TSV file). Both give
``ClickBatch``es with 13 dense features and one id for each of 26 categorical features, and answer to
the ``ClickSource`` protocol the training loop uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tieredemb.jagged import KeyedJaggedTensor

NUM_DENSE = 13
NUM_SPARSE = 26
SPARSE_FEATURES: list[str] = [f"c{i}" for i in range(NUM_SPARSE)]
"""Names of the 26 categorical features, in KeyedJaggedTensor key order."""


@dataclass
class ClickBatch:
    """One batch of click samples.

    Args:
        dense: float32 (B, 13) dense features.
        ids: int64 (26, B) one raw id per categorical feature and sample, feature-major.
        labels: float32 (B,) click (1.0) or not (0.0).
        true_logits: float32 (B,) the ground-truth logit (synthetic data only) or None.
    """

    dense: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor
    true_logits: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    def kjt(self, keys: Sequence[str] = SPARSE_FEATURES) -> KeyedJaggedTensor:
        """The ids as a KeyedJaggedTensor: one id per (feature, sample), feature-major."""
        values = self.ids.reshape(-1)  # (26, B) -> (26 * B,), feature-major
        lengths = torch.ones(values.shape[0], dtype=torch.int64, device=values.device)
        return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths)

    def slice(self, start: int, stop: int) -> ClickBatch:
        """Samples ``[start, stop)``."""
        logits = None if self.true_logits is None else self.true_logits[start:stop]
        return ClickBatch(self.dense[start:stop], self.ids[:, start:stop], self.labels[start:stop], logits)

    def to(self, device: torch.device | str) -> ClickBatch:
        """The same batch on ``device``."""
        logits = None if self.true_logits is None else self.true_logits.to(device)
        return ClickBatch(self.dense.to(device), self.ids.to(device), self.labels.to(device), logits)


def cat_batches(batches: Sequence[ClickBatch]) -> ClickBatch:
    """Concatenate batches along the sample dimension."""
    logits = None
    if all(b.true_logits is not None for b in batches):
        logits = torch.cat([b.true_logits for b in batches])
    return ClickBatch(
        dense=torch.cat([b.dense for b in batches]),
        ids=torch.cat([b.ids for b in batches], dim=1),
        labels=torch.cat([b.labels for b in batches]),
        true_logits=logits,
    )


class ClickSource(Protocol):
    """What the training loop needs from a data source."""

    def train_batch(self, index: int, batch_size: int) -> ClickBatch:
        """Training batch number ``index`` (a pure function of the source and ``index``)."""
        ...

    def eval_set(self) -> ClickBatch:
        """The fixed held-out evaluation samples."""
        ...


__all__ = ["NUM_DENSE", "NUM_SPARSE", "SPARSE_FEATURES", "ClickBatch", "ClickSource", "cat_batches"]
