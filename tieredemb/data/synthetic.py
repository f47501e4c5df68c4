"""Synthetic click data drawn from a hidden ground-truth model, reproducible from a seed.

Each categorical feature ``f`` has a vocabulary of ``V_f`` ids with Zipf(``alpha_f``) frequencies over
their ranks. An id is the splitmix64 scramble of (seed, feature, rank): a raw 64-bit-looking int64, not
a small contiguous int. Every id carries a hidden scalar effect, the 13 dense features are standard
normal with a hidden linear weight, and

    logit = bias + dense @ w + sum_f effect_f[id_f],    label ~ Bernoulli(sigmoid(logit)).

Because the true logit is known, the best achievable AUC on the eval set (``AUC_best``: the AUC of the
true logit itself) is known too, and a trained model is judged by how much of the lift over 0.5 it
recovers.

Batches are pure functions of (seed, stream, index): training batch ``i`` is the same whatever was
generated before it, and the eval set is a separate stream, held out from every training batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tieredemb.data import CLICK_FEATURES, NUM_DENSE, NUM_SPARSE, Baseline, ClickBatch, cat_batches
from tieredemb.keys import RESERVED_KEY, splitmix64

_TRAIN_STREAM = 1
_EVAL_STREAM = 2
_TRUTH_STREAM = 3


@dataclass(frozen=True)
class SyntheticConfig:
    """The hidden ground truth and the size of the eval set.

    Args:
        seed: every number drawn follows from it.
        min_vocab, max_vocab: feature vocabularies are log-spaced between these (shuffled over
            features).
        min_alpha, max_alpha: each feature's Zipf exponent is drawn uniformly from this range.
        sparse_logit_std: standard deviation of the summed id effects over samples.
        dense_logit_std: standard deviation of the dense term.
        rare_decay: an id of rank r has effect scale ``min(1, (head_rank / r) ** rare_decay)``: ids
            too rare to be learned from a few hundred thousand samples carry less of the signal.
        head_rank: the rank up to which effects have full scale.
        bias: the logit's constant term (sets the click rate, about 0.3 at -1.0).
        eval_size: samples in the held-out eval set.
    """

    seed: int = 0
    min_vocab: int = 1_000
    max_vocab: int = 50_000
    min_alpha: float = 1.05
    max_alpha: float = 1.2
    sparse_logit_std: float = 1.5
    dense_logit_std: float = 0.6
    rare_decay: float = 0.5
    head_rank: int = 500
    bias: float = -1.0
    eval_size: int = 65_536


@dataclass
class _Feature:
    """One categorical feature of the ground truth: ranks -> ids and effects."""

    cdf: np.ndarray  # float64 (V,) cumulative Zipf probabilities over ranks 1..V
    ids: torch.Tensor  # int64 (V,) raw id of each rank
    effects: torch.Tensor  # float32 (V,) hidden effect of each rank


def _zipf_cdf(vocab: int, alpha: float) -> np.ndarray:
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -alpha
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def _scrambled_ids(seed: int, feature: int, vocab: int) -> torch.Tensor:
    """int64 (vocab,): distinct raw ids (splitmix64 is a bijection on 64-bit words)."""
    ranks = torch.arange(vocab, dtype=torch.int64)
    ids = splitmix64(ranks + ((seed * NUM_SPARSE + feature) << 32))
    # Astronomically unlikely, but the reserved key must never appear as an id.
    return torch.where(ids == RESERVED_KEY, torch.full_like(ids, RESERVED_KEY + 1), ids)


class SyntheticClicks:
    """A reproducible stream of click batches and a fixed eval set, from ``SyntheticConfig``.

    Example::

        data = SyntheticClicks(SyntheticConfig(seed=0))
        batch = data.train_batch(0, batch_size=4096)   # ClickBatch, same for the same (seed, index)
        auc_best = roc_auc(data.eval_set().true_logits, data.eval_set().labels)
    """

    features = CLICK_FEATURES
    num_dense = NUM_DENSE

    def __init__(self, config: SyntheticConfig) -> None:
        self.config = config
        rng = np.random.default_rng([config.seed, _TRUTH_STREAM])
        vocabs = np.geomspace(config.min_vocab, config.max_vocab, NUM_SPARSE).round().astype(int)
        vocabs = rng.permutation(vocabs)
        alphas = rng.uniform(config.min_alpha, config.max_alpha, NUM_SPARSE)
        self.truth = [
            self._make_feature(f, int(vocabs[f]), float(alphas[f]), rng) for f in range(NUM_SPARSE)
        ]
        self.dense_weight = self._make_dense_weight(rng)
        self._eval: ClickBatch | None = None

    def _make_feature(self, f: int, vocab: int, alpha: float, rng: np.random.Generator) -> _Feature:
        cfg = self.config
        cdf = _zipf_cdf(vocab, alpha)
        ranks = np.arange(1, vocab + 1, dtype=np.float64)
        scale = np.minimum(1.0, (cfg.head_rank / ranks) ** cfg.rare_decay)
        raw = rng.standard_normal(vocab) * scale
        # Center and scale under the sampling distribution so each feature's effect has mean 0 and
        # standard deviation sparse_logit_std / sqrt(26).
        probs = np.diff(cdf, prepend=0.0)
        mean = float(probs @ raw)
        std = math.sqrt(float(probs @ (raw - mean) ** 2))
        effects = (raw - mean) / std * cfg.sparse_logit_std / math.sqrt(NUM_SPARSE)
        return _Feature(cdf, _scrambled_ids(cfg.seed, f, vocab), torch.from_numpy(effects).float())

    def _make_dense_weight(self, rng: np.random.Generator) -> torch.Tensor:
        w = rng.standard_normal(NUM_DENSE)
        w *= self.config.dense_logit_std / np.linalg.norm(w)  # dense ~ N(0, I): std of dense @ w
        return torch.from_numpy(w).float()

    @property
    def vocab_sizes(self) -> list[int]:
        """Ids per categorical feature."""
        return [f.ids.numel() for f in self.truth]

    def _generate(self, stream: int, index: int, batch_size: int) -> ClickBatch:
        rng = np.random.default_rng([self.config.seed, stream, index])
        dense = torch.from_numpy(rng.standard_normal((batch_size, NUM_DENSE), dtype=np.float32))
        u = rng.random((NUM_SPARSE, batch_size))
        ids = torch.empty((NUM_SPARSE, batch_size), dtype=torch.int64)
        logits = self.config.bias + dense @ self.dense_weight  # (B,)
        for f, feat in enumerate(self.truth):
            ranks = np.minimum(np.searchsorted(feat.cdf, u[f], side="right"), feat.cdf.size - 1)
            ranks = torch.from_numpy(ranks)
            ids[f] = feat.ids[ranks]
            logits += feat.effects[ranks]
        clicks = torch.from_numpy(rng.random(batch_size)) < torch.sigmoid(logits.double())
        return ClickBatch(dense=dense, ids=ids, labels=clicks.float(), true_logits=logits)

    def train_batch(self, index: int, batch_size: int) -> ClickBatch:
        """Training batch ``index``: a pure function of (seed, index, batch_size)."""
        return self._generate(_TRAIN_STREAM, index, batch_size)

    def eval_set(self) -> ClickBatch:
        """``eval_size`` held-out samples (their own stream, disjoint from training batches)."""
        if self._eval is None:
            chunk = 16_384
            n = self.config.eval_size
            parts = [
                self._generate(_EVAL_STREAM, i, min(chunk, n - start))
                for i, start in enumerate(range(0, n, chunk))
            ]
            self._eval = cat_batches(parts)
        return self._eval

    def baseline(self) -> Baseline | None:
        """None: the ground truth (``true_logits``) is the yardstick here."""
        return None


__all__ = ["SyntheticConfig", "SyntheticClicks"]
