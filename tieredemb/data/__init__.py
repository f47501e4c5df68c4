"""Click data for the training job: the batch type shared by every source.

A source is one of ``tieredemb.data.synthetic.SyntheticClicks`` (generated from a seed, with a hidden
ground-truth model), ``tieredemb.data.criteo.CriteoClicks`` (a Criteo-format TSV file: 13 dense
features, one id for each of 26 categorical features) or ``tieredemb.data.movielens.MovieLensClicks``
(MovieLens ratings as clicks: user, item and their attributes, the item's genres as a bag). Each gives
``ClickBatch``es and answers to the ``ClickSource`` protocol the training loop uses.
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
"""Names of the 26 categorical features of synthetic and Criteo data, in KeyedJaggedTensor key order."""


@dataclass(frozen=True)
class Feature:
    """A categorical feature of a source.

    Args:
        name: the KeyedJaggedTensor key.
        num_embeddings: ids lie in ``[0, num_embeddings)``; None: any raw int64 id.
        bag: a bag of ids per sample (pooled by their mean) instead of exactly one id.
    """

    name: str
    num_embeddings: int | None = None
    bag: bool = False


CLICK_FEATURES: list[Feature] = [Feature(name) for name in SPARSE_FEATURES]
"""The features of synthetic and Criteo data: 26 single raw ids."""


@dataclass
class ClickBatch:
    """One batch of click samples.

    Args:
        dense: float32 (B, num_dense) dense features.
        ids: int64 (F, B) one raw id per single-valued categorical feature and sample, feature-major.
        labels: float32 (B,) click (1.0) or not (0.0).
        true_logits: float32 (B,) the ground-truth logit (synthetic data only) or None.
        bags: int64 (G, B, K) the ids of G multi-valued features, each bag padded to K ids; or None.
        bag_lengths: int64 (G, B) ids in each bag (the first ``bag_lengths[g, b]`` of ``bags[g, b]``).
    """

    dense: torch.Tensor
    ids: torch.Tensor
    labels: torch.Tensor
    true_logits: torch.Tensor | None = None
    bags: torch.Tensor | None = None
    bag_lengths: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    def kjt(self, keys: Sequence[str] = SPARSE_FEATURES) -> KeyedJaggedTensor:
        """The ids as a KeyedJaggedTensor: the single-valued features (one id per sample) and then the
        bags, feature-major. ``keys`` names them in that order. With bags, build it on the host: the
        ids kept from the padded bags have a data-dependent count."""
        values = self.ids.reshape(-1)  # (F, B) -> (F * B,), feature-major
        lengths = torch.ones(values.shape[0], dtype=torch.int64, device=values.device)
        if self.bags is not None:
            width = self.bags.shape[2]
            kept = torch.arange(width, device=values.device) < self.bag_lengths.unsqueeze(2)  # (G, B, K)
            values = torch.cat([values, self.bags[kept]])  # bag ids by feature, sample, position
            lengths = torch.cat([lengths, self.bag_lengths.reshape(-1)])
        return KeyedJaggedTensor(keys=list(keys), values=values, lengths=lengths)

    def slice(self, start: int, stop: int) -> ClickBatch:
        """Samples ``[start, stop)`` (clipped to the batch, as a Python slice; no negative indices)."""
        start = min(start, len(self))
        return self._map(lambda t, dim: t.narrow(dim, start, max(0, min(stop, len(self)) - start)))

    def take(self, rows: torch.Tensor) -> ClickBatch:
        """The samples at ``rows`` (int64 (n,), on this batch's device)."""
        return self._map(lambda t, dim: t.index_select(dim, rows))

    def to(self, device: torch.device | str) -> ClickBatch:
        """The same batch on ``device``."""
        return self._map(lambda t, dim: t.to(device))

    def _map(self, fn) -> ClickBatch:
        """``fn(tensor, sample_dim)`` applied to every tensor of the batch."""
        def opt(t: torch.Tensor | None, dim: int) -> torch.Tensor | None:
            return None if t is None else fn(t, dim)

        return ClickBatch(fn(self.dense, 0), fn(self.ids, 1), fn(self.labels, 0), opt(self.true_logits, 0),
                          opt(self.bags, 1), opt(self.bag_lengths, 1))


def cat_batches(batches: Sequence[ClickBatch]) -> ClickBatch:
    """Concatenate batches along the sample dimension (bags padded to the widest)."""
    logits = bags = bag_lengths = None
    if all(b.true_logits is not None for b in batches):
        logits = torch.cat([b.true_logits for b in batches])
    if all(b.bags is not None for b in batches):
        width = max(b.bags.shape[2] for b in batches)
        bags = torch.cat([torch.nn.functional.pad(b.bags, (0, width - b.bags.shape[2])) for b in batches], 1)
        bag_lengths = torch.cat([b.bag_lengths for b in batches], dim=1)
    return ClickBatch(
        dense=torch.cat([b.dense for b in batches]),
        ids=torch.cat([b.ids for b in batches], dim=1),
        labels=torch.cat([b.labels for b in batches]),
        true_logits=logits,
        bags=bags,
        bag_lengths=bag_lengths,
    )


def cyclic_batch(rows: ClickBatch, index: int, batch_size: int) -> ClickBatch:
    """Rows ``[index * batch_size, (index + 1) * batch_size)`` of ``rows``, wrapping around its end."""
    return rows.take((torch.arange(batch_size) + index * batch_size) % len(rows))


@dataclass
class Baseline:
    """A simple predictor's scores on the eval set, for comparison with the model's AUC.

    Args:
        name: what it is, in a few words.
        scores: float (n_eval,) its score of each eval sample.
    """

    name: str
    scores: torch.Tensor


def mean_rate_scores(train_ids: torch.Tensor, train_labels: torch.Tensor,
                     eval_ids: torch.Tensor) -> torch.Tensor:
    """Each eval id's mean label over the training samples with that id; ids unseen in training get
    the global mean. ids: int64 (n,), n >= 1; labels: float (n,) -> float64 (n_eval,)."""
    keys, inverse = torch.unique(train_ids, return_inverse=True)  # keys sorted
    clicks = torch.zeros(keys.numel(), dtype=torch.float64).index_add_(0, inverse, train_labels.double())
    counts = torch.bincount(inverse, minlength=keys.numel()).double()
    at = torch.searchsorted(keys, eval_ids).clamp(max=keys.numel() - 1)
    overall = torch.full(eval_ids.shape, train_labels.double().mean().item(), dtype=torch.float64)
    return torch.where(keys[at] == eval_ids, clicks[at] / counts[at], overall)


class ClickSource(Protocol):
    """What the training loop needs from a data source."""

    features: list[Feature]
    """The categorical features, single-valued first, then bags: the batch's KJT keys in order."""
    num_dense: int
    """Dense features per sample."""

    def train_batch(self, index: int, batch_size: int) -> ClickBatch:
        """Training batch number ``index`` (a pure function of the source and ``index``)."""
        ...

    def eval_set(self) -> ClickBatch:
        """The fixed held-out evaluation samples."""
        ...

    def baseline(self) -> Baseline | None:
        """A simple predictor's scores on the eval set, or None when the source has none."""
        ...


__all__ = [
    "CLICK_FEATURES",
    "NUM_DENSE",
    "NUM_SPARSE",
    "SPARSE_FEATURES",
    "Baseline",
    "ClickBatch",
    "ClickSource",
    "Feature",
    "cat_batches",
    "cyclic_batch",
    "mean_rate_scores",
]
