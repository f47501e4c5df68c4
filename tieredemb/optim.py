"""Fused embedding optimizers: their state lives in the row, beside the weights.

A row is ``[weights (D) | state (state_width(D))]`` float32, in every tier. ``update`` is the pure-torch
reference of the fused update (it is the CPU path); the Triton kernel in ``tieredemb.ops.triton`` does
the same arithmetic in one pass over row and state. Per row, with ``g`` the gradient summed over the
batch's duplicates and ``t`` the number of steps the collection has taken (1 on the first):

- SGD: ``w -= lr * g``
- Adagrad: ``s += g*g; w -= lr * g / (sqrt(s) + eps)``
- RowWiseAdagrad: ``s += mean(g*g); w -= lr * g / (sqrt(s) + eps)``, one ``s`` per row
- Adam: ``torch.optim.SparseAdam``'s lazy update, ``m`` and ``v`` per element.

``lr`` may be changed between steps (a learning-rate schedule sets ``optimizer.lr``); a value that
is not a finite number > 0 is refused when it is set, so no step ever runs with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

import torch


def _checked_lr(owner: str, lr: object) -> float:
    if isinstance(lr, bool) or not isinstance(lr, Real):
        raise TypeError(f"{owner}: lr must be a number, got {lr!r}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"{owner}: lr must be a finite number > 0, got {lr!r}")
    return float(lr)


class EmbeddingOptimizer:
    """Base class. ``kind`` names the fused kernel variant."""

    kind: str = ""
    lr: float

    def __setattr__(self, name: str, value: object) -> None:
        if name == "lr":  # the constructor's assignment too
            value = _checked_lr(type(self).__name__, value)
        super().__setattr__(name, value)

    def state_width(self, dim: int) -> int:
        """float32 state elements stored after the D weights of a row."""
        raise NotImplementedError

    def update(self, rows: torch.Tensor, grads: torch.Tensor, step: int) -> torch.Tensor:
        """Reference update. rows: float32 (n, W); grads: float32 (n, D); returns new rows (n, W)."""
        raise NotImplementedError


@dataclass
class SGD(EmbeddingOptimizer):
    lr: float = 0.01
    kind = "sgd"

    def state_width(self, dim: int) -> int:
        return 0

    def update(self, rows: torch.Tensor, grads: torch.Tensor, step: int) -> torch.Tensor:
        dim = grads.shape[1]
        out = rows.clone()
        out[:, :dim] -= self.lr * grads
        return out


@dataclass
class Adagrad(EmbeddingOptimizer):
    lr: float = 0.01
    eps: float = 1e-10
    kind = "adagrad"

    def state_width(self, dim: int) -> int:
        return dim

    def update(self, rows: torch.Tensor, grads: torch.Tensor, step: int) -> torch.Tensor:
        dim = grads.shape[1]
        w, s = rows[:, :dim], rows[:, dim : 2 * dim]
        s = s + grads * grads
        w = w - self.lr * grads / (s.sqrt() + self.eps)
        return torch.cat([w, s], dim=1)


@dataclass
class RowWiseAdagrad(EmbeddingOptimizer):
    lr: float = 0.01
    eps: float = 1e-8
    kind = "rowwise_adagrad"

    def state_width(self, dim: int) -> int:
        return 1

    def update(self, rows: torch.Tensor, grads: torch.Tensor, step: int) -> torch.Tensor:
        dim = grads.shape[1]
        w, s = rows[:, :dim], rows[:, dim : dim + 1]
        s = s + (grads * grads).mean(dim=1, keepdim=True)
        w = w - self.lr * grads / (s.sqrt() + self.eps)
        return torch.cat([w, s], dim=1)


@dataclass
class Adam(EmbeddingOptimizer):
    """Lazy Adam, exactly ``torch.optim.SparseAdam``'s update on the touched rows."""

    lr: float = 0.001
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    kind = "adam"

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"Adam betas must be in [0, 1), got {self.betas}")

    def state_width(self, dim: int) -> int:
        return 2 * dim

    def step_size(self, step: int) -> float:
        """lr * sqrt(1 - b2**t) / (1 - b1**t): the bias-corrected step of SparseAdam."""
        b1, b2 = self.betas
        return self.lr * math.sqrt(1.0 - b2**step) / (1.0 - b1**step)

    def update(self, rows: torch.Tensor, grads: torch.Tensor, step: int) -> torch.Tensor:
        dim = grads.shape[1]
        b1, b2 = self.betas
        w, m, v = rows[:, :dim], rows[:, dim : 2 * dim], rows[:, 2 * dim : 3 * dim]
        m = m + (grads - m) * (1.0 - b1)
        v = v + (grads * grads - v) * (1.0 - b2)
        w = w - self.step_size(step) * m / (v.sqrt() + self.eps)
        return torch.cat([w, m, v], dim=1)


__all__ = ["EmbeddingOptimizer", "SGD", "Adagrad", "RowWiseAdagrad", "Adam"]
