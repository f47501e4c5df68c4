"""The training job's checkpoints: the model, its dense optimizer and the step, saved as one.

``te.checkpoint`` saves a model's embedding tables and its ``state_dict`` (no pickle: safetensors and
JSON). The training job adds what a resumed run needs beyond the model: the dense optimizer's state
(Adam's moments and step counts) and the training step. ``TrainState`` is a module over the model
that holds them as buffers, so one ``te.checkpoint.save`` writes all of it into one version (written
whole, then published: a crash leaves the previous one) and ``load`` checks all of it before it
changes anything.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import tieredemb as te

_ADAM = ("step", "exp_avg", "exp_avg_sq")  # torch.optim.Adam's state of a parameter (no amsgrad)


def check_checkpoint_dir(path: str | os.PathLike, resume: bool) -> None:
    """Resuming, ``path`` must hold a checkpoint; starting, it must not (a new run would replace it).

    Raises ``ValueError`` saying which."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint directory {path} is a file")
    held = (path / "LATEST").is_file()
    if resume and not held:
        raise ValueError(f"no checkpoint in {path} to resume from (a run with this --checkpoint-dir "
                         "and no --resume writes one)")
    if not resume and held:
        raise ValueError(f"{path} holds a checkpoint already: --resume to train on from it, or give "
                         "another checkpoint directory")


def check_shared_dir(path: str | os.PathLike, group) -> None:
    """Every rank of ``group`` must see ``path`` as one directory: a checkpoint is written by all
    ranks into rank 0's version directory, so on several nodes it must be on a file system they
    share. Rank 0 creates ``path`` and a probe file in it; every rank looks for the probe. A
    collective: raises ``ValueError`` on every rank, naming the ranks that did not see it."""
    path = Path(path)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    box: list[object] = [None]
    if rank == 0:
        try:
            path.mkdir(parents=True, exist_ok=True)
            probe = path / f".shared-probe-{secrets.token_hex(8)}"
            probe.touch(exist_ok=False)
            box[0] = probe.name
        except OSError as e:
            box[0] = OSError(e.errno, f"cannot write into checkpoint directory {path}: {e.strerror}")
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], OSError):
        raise box[0]
    seen: list[object] = [None] * world
    dist.all_gather_object(seen, (path / str(box[0])).is_file(), group=group)
    if rank == 0:
        (path / str(box[0])).unlink(missing_ok=True)
    blind = [r for r, saw in enumerate(seen) if not saw]
    if blind:
        raise ValueError(f"checkpoint directory {path} is not the same directory on every rank: rank(s) "
                         f"{', '.join(map(str, blind))} do not see the files rank 0 writes there; on several "
                         "nodes give a directory on a file system they share")


class TrainState(nn.Module):
    """The model with its dense Adam's state and the step as buffers, for ``te.checkpoint``.

    Args:
        model: the trained model (its embedding collections are saved by ``te.checkpoint``).
        optimizer: ``torch.optim.Adam`` over ``model``'s dense parameters (no amsgrad).

    ``save(path, step)`` copies the optimizer's state into the buffers and saves; ``load(path)``
    loads into a freshly built model and gives the optimizer its state back, returning the step.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        if not isinstance(optimizer, torch.optim.Adam) or any(g["amsgrad"] for g in optimizer.param_groups):
            raise TypeError("TrainState keeps the state of torch.optim.Adam (amsgrad off)")
        self.model = model
        self._optimizer = optimizer
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        for i, p in enumerate(self._params):
            self.register_buffer(f"adam_{i}_step", torch.zeros((), dtype=torch.float32))
            for name in _ADAM[1:]:
                moments = torch.zeros_like(p, memory_format=torch.contiguous_format)
                self.register_buffer(f"adam_{i}_{name}", moments)

    def save(self, path: str | os.PathLike, step: int) -> Path:
        """Checkpoint the model, the optimizer and ``step`` under ``path``; returns the version."""
        with torch.no_grad():
            self.step.fill_(step)
            for i, p in enumerate(self._params):
                state = self._optimizer.state.get(p, {})
                for name in _ADAM:
                    buffer = getattr(self, f"adam_{i}_{name}")
                    if name in state:
                        buffer.copy_(state[name])
                    else:  # a parameter the optimizer has not stepped yet
                        buffer.zero_()
        return te.checkpoint.save(self, path)

    def load(self, path: str | os.PathLike) -> int:
        """Load the latest checkpoint under ``path`` into this freshly built state; returns its step."""
        te.checkpoint.load(self, path)
        for i, p in enumerate(self._params):
            state = {name: getattr(self, f"adam_{i}_{name}").clone() for name in _ADAM}
            if state["step"].item() > 0:
                state["step"] = state["step"].cpu()  # where Adam keeps it (not capturable, not fused)
                self._optimizer.state[p] = state
        return int(self.step.item())


__all__ = ["TrainState", "check_checkpoint_dir", "check_shared_dir"]
