"""Spawning the ranks of the multi-process tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch.multiprocessing as mp


def spawn_ranks(fn: Callable, args: tuple, nprocs: int) -> None:
    """``mp.spawn(fn, args, nprocs)``, each rank leaving without the interpreter's teardown once
    ``fn`` returned. In that teardown gloo's worker threads can still free tensors that hold Python
    objects and abort the process ("terminate called without an active exception"), after the rank
    did and wrote everything the test checks. A rank whose ``fn`` raised reports it as before."""
    mp.spawn(_leave_after, args=(fn, *args), nprocs=nprocs, join=True)


def _leave_after(rank: int, fn: Callable, *args) -> None:
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
