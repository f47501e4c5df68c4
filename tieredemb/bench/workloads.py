"""Synthetic batches for the benchmarks: Zipf-distributed ids over scrambled raw int64 keys.

A table's id is drawn in two steps: a rank ``r`` in ``[0, rows)`` with ``P(r) ~ 1 / (r + 1)**alpha``
(rank 0 hottest), then ``id = scramble(r)``, a fixed bijection of int64 (splitmix64 of the rank xor a
per-table salt). Raw-id tables see hot keys scattered over the whole int64 range, as real feature
hashes are; a peer that can only index ``[0, rows)`` (``nn.EmbeddingBag``) gets the rank itself: the
same multiset of rows touched, row for row.

Every batch is a pure function of (seed, step), so configurations measured one after the other in the
same process train on identical batches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import tieredemb as te
from tieredemb.keys import splitmix64


@dataclass(frozen=True)
class HbmShape:
    """The ``hbm`` workload's shape (DESIGN section 7): one single-feature table per ``t``, every bag
    ``bag_size`` ids long. ``scaled`` shrinks rows and batch for CPU smoke runs."""

    num_tables: int = 10
    rows: int = 1_680_000
    dim: int = 128
    batch_size: int = 10_486
    bag_size: int = 10
    alpha: float = 1.05

    def scaled(self, scale: float) -> HbmShape:
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        return replace(self, rows=max(16, round(self.rows * scale)),
                       batch_size=max(1, round(self.batch_size * scale)))

    @property
    def lookups(self) -> int:
        """Ids per step over all tables."""
        return self.num_tables * self.batch_size * self.bag_size

    def table_name(self, t: int) -> str:
        return f"t{t}"

    def feature_name(self, t: int) -> str:
        return f"f{t}"

    def table_configs(self) -> list[te.TableConfig]:
        """Raw-id tables (``num_embeddings=None``), one feature each, sum pooling."""
        return [te.TableConfig(name=self.table_name(t), embedding_dim=self.dim,
                               feature_names=[self.feature_name(t)], num_embeddings=None,
                               initializer=te.init.Uniform(-0.01, 0.01))
                for t in range(self.num_tables)]


class ZipfSampler:
    """Ranks in ``[0, n)`` with ``P(r) ~ 1 / (r + 1)**alpha``, by inverting the CDF.

    Args:
        n: number of ranks.
        alpha: the Zipf exponent (any alpha > 0; the support is finite).
        device: where the CDF (float64 (n,)) and the samples live.
    """

    def __init__(self, n: int, alpha: float, device: torch.device) -> None:
        weights = torch.arange(1, n + 1, dtype=torch.float64, device=device).pow(-alpha)
        cdf = torch.cumsum(weights, 0)
        self.cdf = cdf / cdf[-1]  # float64 (n,), last entry exactly 1
        self.n = n

    def sample(self, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """int64 ``shape`` ranks on the sampler's device."""
        u = torch.rand(shape, dtype=torch.float64, device=self.cdf.device, generator=generator)
        return torch.searchsorted(self.cdf, u, right=True).clamp_(max=self.n - 1)


def table_salt(t: int) -> int:
    """A fixed int64 per table index: tables scramble their ranks differently."""
    return int(splitmix64(torch.tensor(0x7E1D_0000 + t, dtype=torch.int64)))


def scramble(ranks: torch.Tensor, t: int) -> torch.Tensor:
    """Raw int64 ids of ``ranks`` (int64, any shape) in table ``t``: a bijection of int64."""
    return splitmix64(ranks ^ table_salt(t))


@dataclass
class HbmBatch:
    """One step's ids in both forms.

    ranks: int64 (T, B, L) device: row numbers for the peer (``nn.EmbeddingBag`` per table);
    kjt: the same ids scrambled to raw keys, features f0..f{T-1}, feature-major, every length L;
    unique_keys: list of T ints, distinct ids per table in this batch (host).
    """

    step: int
    ranks: torch.Tensor
    kjt: te.KeyedJaggedTensor
    unique_keys: list[int]


class HbmBatches:
    """The ``hbm`` workload's batch ``step`` for any step, a pure function of (seed, step).

    It also records which ranks any generated batch touched (``seen``: bool (T, rows) device), the
    rows a trained table must hold afterwards.
    """

    def __init__(self, shape: HbmShape, device: torch.device, seed: int = 0) -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.seed = seed
        self.sampler = ZipfSampler(shape.rows, shape.alpha, self.device)
        self.seen = torch.zeros(shape.num_tables, shape.rows, dtype=torch.bool, device=self.device)
        all_ranks = torch.arange(shape.rows, device=self.device)
        for t in range(shape.num_tables):  # astronomically unlikely, but a reserved id would be refused
            if bool((scramble(all_ranks, t) == te.RESERVED_KEY).any()):
                raise ValueError(f"table {t}: a rank scrambles to te.RESERVED_KEY; change the salt")

    def batch(self, step: int) -> HbmBatch:
        s = self.shape
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + step)
        ranks = self.sampler.sample((s.num_tables, s.batch_size, s.bag_size), gen)  # (T, B, L)
        ids = torch.stack([scramble(ranks[t], t) for t in range(s.num_tables)])  # (T, B, L)
        lengths = torch.full((s.num_tables * s.batch_size,), s.bag_size, dtype=torch.int64,
                             device=self.device)
        kjt = te.KeyedJaggedTensor(keys=[s.feature_name(t) for t in range(s.num_tables)],
                                   values=ids.reshape(-1), lengths=lengths)
        unique = []
        for t in range(s.num_tables):
            u = torch.unique(ranks[t])
            self.seen[t, u] = True
            unique.append(int(u.numel()))
        return HbmBatch(step, ranks, kjt, unique)


__all__ = ["HbmBatch", "HbmBatches", "HbmShape", "ZipfSampler", "scramble", "table_salt"]
