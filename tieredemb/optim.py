"""Fused embedding optimizers: their state lives in the row, beside the weights.

A row is ``[weights (D) | state (state_width(D))]`` in the table's dtype (``TableConfig.dtype``:
float32, or 16-bit with the update computed in float32), in every tier. ``update`` is the pure-torch
reference of the fused update (it is the CPU path); the Triton kernel in ``tieredemb.ops.triton`` does
the same arithmetic in one pass over row and state. Per row, with ``g`` the gradient summed over the
batch's duplicates and ``t`` the number of steps the collection has taken (1 on the first):

- SGD: ``w -= lr * g``
- Adagrad: ``s += g*g; w -= lr * g / (sqrt(s) + eps)``
- RowWiseAdagrad: ``s += mean(g*g); w -= lr * g / (sqrt(s) + eps)``, one ``s`` per row
- Adam: ``torch.optim.SparseAdam``'s lazy update, ``m`` and ``v`` per element.

Each is a ``torch.optim.Optimizer`` with no parameters and one parameter group: the collection's
backward applies the update to the touched rows, reading the hyperparameters from
``param_groups[0]`` at every step. So ``torch.optim.lr_scheduler``'s schedulers drive it, and
``state_dict()`` / ``load_state_dict()`` carry its hyperparameters. ``step()`` changes no row (the rows
were updated in backward): call it once per step, before the scheduler's, as with any optimizer.

A value the update must not use (an ``lr`` that is not a finite number > 0, say) is refused: at once
when set through ``optimizer.lr`` or the constructor, and, when written into ``param_groups`` (by a
scheduler), at the next step of a collection, before it changes anything.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real
from typing import Any

import torch


def _checked_lr(owner: str, lr: object) -> float:
    if isinstance(lr, bool) or not isinstance(lr, Real):
        raise TypeError(f"{owner}: lr must be a number, got {lr!r}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"{owner}: lr must be a finite number > 0, got {lr!r}")
    return float(lr)


def _checked_eps(owner: str, eps: object, positive: bool) -> float:
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise TypeError(f"{owner}: eps must be a number, got {eps!r}")
    if not (math.isfinite(eps) and (eps > 0 if positive else eps >= 0)):
        raise ValueError(f"{owner}: eps must be a finite number {'>' if positive else '>='} 0, got {eps!r}")
    return float(eps)


def _checked_betas(owner: str, betas: object) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2 or \
            any(isinstance(b, bool) or not isinstance(b, Real) for b in betas):
        raise TypeError(f"{owner}: betas must be two numbers, got {betas!r}")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{owner}: betas must be in [0, 1), got {betas!r}")
    return float(betas[0]), float(betas[1])


class EmbeddingOptimizer(torch.optim.Optimizer):
    """Base class of the fused optimizers. ``kind`` names the fused kernel variant.

    No parameters: ``param_groups`` is one group holding the hyperparameters (``lr`` and the
    optimizer's own), which the next fused update reads; ``optimizer.lr`` reads and sets
    ``param_groups[0]["lr"]``, refusing a bad value at once.
    """

    kind: str = ""

    def __init__(self, **defaults: Any) -> None:
        owner = type(self).__name__
        checked = self._checked(owner, defaults)  # before the base class keeps anything
        self._names = tuple(checked)  # the hyperparameters (torch.optim adds to ``defaults``)
        super().__init__([{"params": []}], checked)

    # -------------------------------------------------------------------- hyperparameters
    @classmethod
    def _checked(cls, owner: str, group: dict) -> dict:
        """``group``'s hyperparameters checked (``TypeError``/``ValueError`` naming the bad one)."""
        return {"lr": _checked_lr(owner, group["lr"])}

    def check(self) -> None:
        """Raise ``ValueError``/``TypeError`` if ``param_groups`` holds a value the fused update must
        not use (a scheduler wrote an ``lr`` that is not finite and > 0, say). A collection calls it
        before each training step changes anything."""
        self._checked(f"{type(self).__name__} (param_groups[0])", self.param_groups[0])

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: object) -> None:
        self.param_groups[0]["lr"] = _checked_lr(type(self).__name__, value)

    # -------------------------------------------------------------------- torch.optim protocol
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Changes no row: the collection's backward already applied this step's update. With a
        ``closure`` (which runs forward and backward), calls it and returns its loss. Call it every
        step, as with any optimizer: learning-rate schedulers expect it."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to zero: the rows' gradients never leave the backward."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.param_groups or list(param_group.get("params", [])):
            raise ValueError(f"{type(self).__name__} takes no parameters and has one parameter group: it "
                             "updates the collection's rows in backward; give dense parameters to a "
                             "torch.optim optimizer")
        super().add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {}, "param_groups": [hyperparameters], "optimizer": class name}``. The rows'
        optimizer state and the step count ``t`` belong to the collection (its ``state_dict``)."""
        out = super().state_dict()
        out["optimizer"] = type(self).__name__
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the hyperparameters of a ``state_dict()`` of the same optimizer class; a state of
        another class, or holding a bad value, is refused before anything changes."""
        owner = type(self).__name__
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("param_groups"), list):
            raise TypeError(f"{owner}.load_state_dict: expected a dict with 'param_groups'")
        saved = state_dict.get("optimizer", owner)
        if saved != owner:
            raise ValueError(f"{owner}.load_state_dict: the state is a {saved}'s")
        groups = state_dict["param_groups"]
        if len(groups) != 1 or not isinstance(groups[0], dict):
            raise ValueError(f"{owner}.load_state_dict: expected one parameter group, got {len(groups)}")
        missing = [k for k in self._names if k not in groups[0]]
        if missing:
            raise ValueError(f"{owner}.load_state_dict: param_groups[0] lacks {missing}")
        self._checked(f"{owner}.load_state_dict (param_groups[0])", groups[0])
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "optimizer"})

    def __repr__(self) -> str:
        group = self.param_groups[0]
        args = ", ".join(f"{k}={group.get(k)!r}" for k in self._names)
        return f"{type(self).__name__}({args})"

    # -------------------------------------------------------------------- the update
    def state_width(self, dim: int) -> int:
        """float32 state elements stored after the D weights of a row."""
        raise NotImplementedError

    def update(self, rows: torch.Tensor, grads: torch.Tensor, step: int) -> torch.Tensor:
        """Reference update. rows: float32 (n, W); grads: float32 (n, D); returns new rows (n, W)."""
        raise NotImplementedError


class _WithEps(EmbeddingOptimizer):
    """An optimizer with an ``eps`` hyperparameter (``param_groups[0]["eps"]``)."""

    _eps_positive = False

    @classmethod
    def _checked(cls, owner: str, group: dict) -> dict:
        return {**super()._checked(owner, group), "eps": _checked_eps(owner, group["eps"], cls._eps_positive)}

    @property
    def eps(self) -> float:
        return self.param_groups[0]["eps"]

    @eps.setter
    def eps(self, value: object) -> None:
        self.param_groups[0]["eps"] = _checked_eps(type(self).__name__, value, self._eps_positive)


class SGD(EmbeddingOptimizer):
    """``w -= lr * g`` on the touched rows; no state."""

    kind = "sgd"

    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(lr=lr)

    def state_width(self, dim: int) -> int:
        return 0

    def update(self, rows: torch.Tensor, grads: torch.Tensor, step: int) -> torch.Tensor:
        dim = grads.shape[1]
        out = rows.clone()
        out[:, :dim] -= self.lr * grads
        return out


class Adagrad(_WithEps):
    """``s += g*g; w -= lr * g / (sqrt(s) + eps)``: ``torch.optim.Adagrad`` (lr_decay 0, initial
    accumulator 0) on the touched rows; ``s`` per element."""

    kind = "adagrad"

    def __init__(self, lr: float = 0.01, eps: float = 1e-10) -> None:
        super().__init__(lr=lr, eps=eps)

    def state_width(self, dim: int) -> int:
        return dim

    def update(self, rows: torch.Tensor, grads: torch.Tensor, step: int) -> torch.Tensor:
        dim = grads.shape[1]
        w, s = rows[:, :dim], rows[:, dim : 2 * dim]
        s = s + grads * grads
        w = w - self.lr * grads / (s.sqrt() + self.eps)
        return torch.cat([w, s], dim=1)


class RowWiseAdagrad(_WithEps):
    """``s += mean(g*g); w -= lr * g / (sqrt(s) + eps)``, one ``s`` per row."""

    kind = "rowwise_adagrad"

    def __init__(self, lr: float = 0.01, eps: float = 1e-8) -> None:
        super().__init__(lr=lr, eps=eps)

    def state_width(self, dim: int) -> int:
        return 1

    def update(self, rows: torch.Tensor, grads: torch.Tensor, step: int) -> torch.Tensor:
        dim = grads.shape[1]
        w, s = rows[:, :dim], rows[:, dim : dim + 1]
        s = s + (grads * grads).mean(dim=1, keepdim=True)
        w = w - self.lr * grads / (s.sqrt() + self.eps)
        return torch.cat([w, s], dim=1)


class Adam(_WithEps):
    """Lazy Adam, exactly ``torch.optim.SparseAdam``'s update on the touched rows."""

    kind = "adam"
    _eps_positive = True

    def __init__(self, lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        super().__init__(lr=lr, betas=betas, eps=eps)

    @classmethod
    def _checked(cls, owner: str, group: dict) -> dict:
        base = super()._checked(owner, group)
        return {"lr": base["lr"], "betas": _checked_betas(owner, group["betas"]), "eps": base["eps"]}

    @property
    def betas(self) -> tuple[float, float]:
        return self.param_groups[0]["betas"]

    @betas.setter
    def betas(self, value: object) -> None:
        self.param_groups[0]["betas"] = _checked_betas(type(self).__name__, value)

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
