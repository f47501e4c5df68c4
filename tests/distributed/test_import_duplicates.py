"""A sharded ``load_state_dict`` given the same full state on every rank (each rank loading one
checkpoint of an unsharded model, say): every key is stored once, by its owner, with the saved row,
as a dict of the saved rows says."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import tieredemb as te
from tests.distributed.test_sharded import _free_port
from tests.ranks import spawn_ranks

WORLD = 2
TABLES = [te.TableConfig("t", 4, ["f"])]


def saved_state() -> dict:
    """An unsharded collection's state after two steps, as plain tensors."""
    ebc = te.EmbeddingBagCollection(TABLES, optimizer=te.optim.Adagrad(lr=0.1), seed=5)
    for step in range(2):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 50, (24,), generator=gen)
        ebc(te.KeyedJaggedTensor(["f"], ids, lengths=torch.full((8,), 3))).values().sum().backward()
    return {k: (v.materialize() if hasattr(v, "materialize") else v) for k, v in ebc.state_dict().items()}


def _worker(rank: int, port: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        ebc = te.EmbeddingBagCollection(TABLES, optimizer=te.optim.Adagrad(lr=0.1), seed=5,
                                        process_group=dist.group.WORLD)
        ebc.load_state_dict(saved_state())  # the same full state on both ranks
        e = ebc.export("t")
        torch.save((e.keys, e.weights, e.optimizer_state, ebc.stats()["t"].rows),
                   os.path.join(tmp, f"r{rank}.pt"))
        ebc.close()
    finally:
        dist.destroy_process_group()


def test_the_same_state_on_every_rank_stores_each_key_once(tmp_path) -> None:
    spawn_ranks(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD)
    want = saved_state()
    saved = {int(k): (w, s) for k, w, s in zip(want["t.keys"], want["t.weights"], want["t.optimizer_state"])}
    got = [torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(WORLD)]
    keys = [k for g in got for k in g[0].tolist()]
    assert sorted(keys) == sorted(saved), "each saved key stored exactly once over the ranks"
    for k, w, s, _ in got:
        for key, row, state in zip(k.tolist(), w, s):
            assert torch.equal(row, saved[key][0]) and torch.equal(state, saved[key][1])
    assert sum(sum(g[3].values()) for g in got) == len(saved)  # the tiers count no twin rows
