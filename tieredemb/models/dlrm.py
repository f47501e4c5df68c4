"""A small DLRM: bottom MLP over dense features, embedding bags over categorical ones, pairwise dot
interaction, top MLP to one click logit (Naumov et al., 2019)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import nn

import tieredemb as te


def mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    """Linear layers ``sizes[0] -> sizes[1] -> ...`` with ReLU between (and after the last if asked)."""
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DotInteraction(nn.Module):
    """Pairwise dot products of F vectors (upper triangle, no diagonal) beside the dense vector.

    dense: (B, D); sparse: (B, F-1, D) -> (B, D + F * (F - 1) / 2).
    """

    def __init__(self, num_vectors: int, device: torch.device | None = None) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(num_vectors, num_vectors, offset=1, device=device)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        vectors = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # (B, F, D)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, F, F)
        pairs = gram[:, self.rows, self.cols]  # (B, F * (F - 1) / 2)
        return torch.cat([dense, pairs], dim=1)

    @staticmethod
    def output_dim(num_vectors: int, dim: int) -> int:
        return dim + num_vectors * (num_vectors - 1) // 2


@dataclass(frozen=True)
class DLRMConfig:
    """Layer sizes of the DLRM.

    Args:
        num_dense: dense input features.
        embedding_dim: D, the width of every table and of the bottom MLP's output.
        bottom_mlp: hidden sizes of the bottom MLP (its output size is ``embedding_dim``).
        top_mlp: hidden sizes of the top MLP (its output size is 1).
    """

    num_dense: int = 13
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 32)
    top_mlp: tuple[int, ...] = (128, 64)


class DLRM(nn.Module):
    """DLRM over a ``te.EmbeddingBagCollection`` whose tables all have width ``embedding_dim``.

    Args:
        config: layer sizes.
        ebc: the embedding bag collection (its fused optimizer trains the embeddings in backward).
        feature_names: the categorical features, in the order their vectors enter the interaction.
        device: where the dense layers live (the collection was placed by its own ``device``). They
            are initialized on the CPU from torch's global generator and then moved, so the same seed
            gives the same layers on every device.

    Example::

        ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.Adam(lr=1e-3))
        model = DLRM(DLRMConfig(), ebc, feature_names, device=torch.device("cpu"))
        logits = model(dense, kjt)   # (B,) click logits
    """

    def __init__(
        self,
        config: DLRMConfig,
        ebc: nn.Module,
        feature_names: Sequence[str],
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        d = config.embedding_dim
        num_vectors = len(feature_names) + 1
        self.feature_names = list(feature_names)
        self.bottom = mlp([config.num_dense, *config.bottom_mlp, d], last_relu=True).to(device)
        self.ebc = ebc
        self.interaction = DotInteraction(num_vectors, device)
        top_in = DotInteraction.output_dim(num_vectors, d)
        self.top = mlp([top_in, *config.top_mlp, 1], last_relu=False).to(device)
        self.embedding_dim = d

    def forward(self, dense: torch.Tensor, sparse: te.KeyedJaggedTensor) -> torch.Tensor:
        """dense: float32 (B, num_dense); sparse: one bag per (feature, sample) -> logits (B,)."""
        x = self.bottom(dense)  # (B, D)
        kt = self.ebc(sparse)
        pooled = torch.stack([kt[f] for f in self.feature_names], dim=1)  # (B, F-1, D)
        return self.top(self.interaction(x, pooled)).squeeze(1)


def make_tables(
    feature_names: Sequence[str],
    embedding_dim: int,
    init_scale: float = 0.05,
    *,
    num_embeddings: Sequence[int | None] | None = None,
    mean_pooled: Collection[str] = (),
    dtype: torch.dtype = torch.float32,
) -> list[te.TableConfig]:
    """One table per feature: sum pooling (mean for the features in ``mean_pooled``: bags of ids),
    raw int64 ids, or ids in ``[0, num_embeddings[i])`` where that is given; rows in ``dtype``."""
    init = te.init.Uniform(-init_scale, init_scale)
    sizes = list(num_embeddings) if num_embeddings is not None else [None] * len(feature_names)
    return [
        te.TableConfig(
            name=f"t_{f}", embedding_dim=embedding_dim, feature_names=[f], num_embeddings=n,
            pooling="mean" if f in mean_pooled else "sum", initializer=init, dtype=dtype,
        )
        for f, n in zip(feature_names, sizes)
    ]


__all__ = ["DLRM", "DLRMConfig", "DotInteraction", "make_tables", "mlp"]
