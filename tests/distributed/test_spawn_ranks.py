"""The multi-process tests' spawner: a rank that raised still fails the test, although every rank
leaves without the interpreter's teardown."""

from __future__ import annotations

import os

import pytest
import torch.multiprocessing as mp

from tests.ranks import spawn_ranks


def _rank(rank: int, tmp: str, failing: int) -> None:
    if rank == failing:
        raise ValueError(f"rank {rank} failed on purpose")
    with open(os.path.join(tmp, f"done-{rank}"), "w") as f:
        f.write("done")


def test_a_rank_that_raises_fails_the_spawn_and_the_others_finish(tmp_path) -> None:
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 failed on purpose"):
        spawn_ranks(_rank, args=(str(tmp_path), 1), nprocs=2)
    spawn_ranks(_rank, args=(str(tmp_path), -1), nprocs=2)
    assert sorted(os.listdir(tmp_path)) == ["done-0", "done-1"]
