"""A checkpoint saved by N gloo ranks loads into M ranks (and another storage layout): training on
from it equals one process trained on the same global batches without a break."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tieredemb as te
from tests.distributed.test_sharded import _free_port, build, concat, local_batch, step_losses, upstream

STEPS = 4  # per phase


class Holder(torch.nn.Module):
    def __init__(self, ebc) -> None:
        super().__init__()
        self.ebc = ebc


def _phase(rank: int, world: int, port: int, tmp: str, mode: str, first: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = Holder(build(te.EmbeddingBagCollection, "adam", mode, os.path.join(tmp, f"db-{world}"),
                             dist.group.WORLD))
        steps = range(STEPS) if first else range(STEPS, 2 * STEPS)
        if not first:
            te.checkpoint.load(model, os.path.join(tmp, "ckpt"))
        for step in steps:
            out = model.ebc(local_batch(step, rank)[0])
            step_losses(te.EmbeddingBagCollection, out, step, rank).backward()
        if first:
            te.checkpoint.save(model, os.path.join(tmp, "ckpt"), buffer_bytes=256)
        else:
            rows = {t: model.ebc.export(t) for t in ("t0", "t1", "t2")}
            torch.save({t: (r.keys, torch.cat([r.weights, r.optimizer_state], 1)) for t, r in rows.items()},
                       os.path.join(tmp, f"rows-{rank}.pt"))
        model.ebc.close()
    finally:
        dist.destroy_process_group()


def _state_dict_phase(rank: int, world: int, port: int, tmp: str) -> None:
    """Train on hbm_direct, hand the shard's state_dict to a fresh cache-mode collection of the same
    group (load_state_dict: collective, chunk by chunk), train on with it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        first = build(te.EmbeddingBagCollection, "adam", "hbm_direct", None, dist.group.WORLD)
        for step in range(STEPS):
            step_losses(te.EmbeddingBagCollection, first(local_batch(step, rank)[0]), step, rank).backward()
        second = build(te.EmbeddingBagCollection, "adam", "cache", os.path.join(tmp, f"db-sd-{rank}"),
                       dist.group.WORLD)
        second.load_state_dict(first.state_dict())
        for step in range(STEPS, 2 * STEPS):
            step_losses(te.EmbeddingBagCollection, second(local_batch(step, rank)[0]), step, rank).backward()
        rows = {t: second.export(t) for t in ("t0", "t1", "t2")}
        torch.save({t: (r.keys, torch.cat([r.weights, r.optimizer_state], 1)) for t, r in rows.items()},
                   os.path.join(tmp, f"rows-{rank}.pt"))
        second.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("before, after", [(2, 3), (3, 1)])
def test_resume_on_another_world_size(before: int, after: int, tmp_path) -> None:
    mp.spawn(_phase, args=(before, _free_port(), str(tmp_path), "hbm_direct", True), nprocs=before)
    mp.spawn(_phase, args=(after, _free_port(), str(tmp_path), "cache", False), nprocs=after)
    assert_equals_one_process(tmp_path, before, after)


def test_sharded_state_dict_into_another_layout(tmp_path) -> None:
    mp.spawn(_state_dict_phase, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    assert_equals_one_process(tmp_path, 2, 2)


def assert_equals_one_process(tmp_path, before: int, after: int) -> None:
    """The ranks' rows (rows-<rank>.pt) equal one process trained on the concatenated batches."""
    ref = build(te.EmbeddingBagCollection, "adam", "hbm_direct", None)
    for step in range(2 * STEPS):
        world = before if step < STEPS else after
        local = [local_batch(step, r) for r in range(world)]
        out = ref(concat([k for k, _ in local]))
        bounds = torch.cumsum(torch.tensor([0] + [b for _, b in local]), 0).tolist()
        v = out.values()  # rank r's rows of it get rank r's upstream gradient, as in the ranks' steps
        sum((v[bounds[r] : bounds[r + 1]] * upstream(step, r, (bounds[r + 1] - bounds[r], v.shape[1]))).sum()
            for r in range(world)).backward()
    shards = [torch.load(tmp_path / f"rows-{r}.pt") for r in range(after)]
    for t in ("t0", "t1", "t2"):
        keys = torch.cat([s[t][0] for s in shards])
        rows = torch.cat([s[t][1] for s in shards])
        order = torch.argsort(keys)
        want = ref.export(t)
        worder = torch.argsort(want.keys)
        assert torch.equal(keys[order], want.keys[worder]), t
        torch.testing.assert_close(rows[order], torch.cat([want.weights, want.optimizer_state], 1)[worder],
                                   rtol=1e-5, atol=1e-6)
