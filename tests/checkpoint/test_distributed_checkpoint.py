"""A checkpoint saved by N gloo ranks loads into M ranks (and another storage layout): training on
from it equals one process trained on the same global batches without a break."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

import tieredemb as te
from tests.checkpoint.test_checkpoint_safety import chunks_of, read_manifest, replace_file
from tests.distributed.test_sharded import _free_port, build, concat, local_batch, step_losses, upstream
from tests.ranks import spawn_ranks
from tieredemb.checkpoint.paths import read_latest

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
        dist.barrier()  # both ranks done before either tears its process group down
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
        dist.barrier()  # both ranks done before either tears its process group down
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("before, after", [(2, 3), (3, 1)])
@pytest.mark.slow
def test_resume_on_another_world_size(before: int, after: int, tmp_path) -> None:
    spawn_ranks(_phase, args=(before, _free_port(), str(tmp_path), "hbm_direct", True), nprocs=before)
    spawn_ranks(_phase, args=(after, _free_port(), str(tmp_path), "cache", False), nprocs=after)
    assert_equals_one_process(tmp_path, before, after)


@pytest.mark.slow
def test_sharded_state_dict_into_another_layout(tmp_path) -> None:
    spawn_ranks(_state_dict_phase, args=(2, _free_port(), str(tmp_path)), nprocs=2)
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


def _refusals(rank: int, world: int, port: int, tmp: str) -> None:
    """Each bad copy of the checkpoint into a fresh sharded model: what this rank raised and its state
    after; then the good one. Written to ``refusals-<rank>.json``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = Holder(build(te.EmbeddingBagCollection, "adam", "hbm_direct", None, dist.group.WORLD))
        seen = {}
        for case in ("corrupted on one rank", "key on two ranks"):
            try:
                te.checkpoint.load(model, os.path.join(tmp, case))
                error = None
            except te.checkpoint.CheckpointError as e:
                error = str(e)
            seen[case] = {"error": error, "empty": model.ebc.is_empty(), "step": model.ebc.step}
        try:  # the retry, into the model of both refusals
            te.checkpoint.load(model, os.path.join(tmp, "ckpt"))
            error = None
        except ValueError as e:
            error = str(e)
        rows = {t: model.ebc.export(t).keys.tolist() for t in ("t0", "t1")}
        seen["good"] = {"error": error, "step": model.ebc.step, "rows": rows}
        with open(os.path.join(tmp, f"refusals-{rank}.json"), "w") as f:
            json.dump(seen, f)
        model.ebc.close()
        dist.barrier()  # both ranks done before either tears its process group down
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_refusal_on_one_rank_is_every_ranks_and_changes_nothing(tmp_path) -> None:
    """Each rank checks its share of the files, and the keys it stores in the model: one file only
    rank 1 reads is corrupted; a key is in a file rank 0 reads and in one rank 1 reads (only the
    rank that stores the key sees it twice). Every rank refuses, no rank changed anything, and the
    good checkpoint loads after."""
    spawn_ranks(_phase, args=(2, _free_port(), str(tmp_path), "hbm_direct", True), nprocs=2)
    for case in ("corrupted on one rank", "key on two ranks"):
        shutil.copytree(tmp_path / "ckpt", tmp_path / case)
    name = read_latest(tmp_path / "ckpt").name
    version = tmp_path / "corrupted on one rank" / name
    # rank r of 2 reads the files r, r + 2, ... of a table
    corrupted = version / chunks_of(read_manifest(version), "t0")[1]["file"]
    corrupted.write_bytes(b"\0" + corrupted.read_bytes()[1:])
    version = tmp_path / "key on two ranks" / name
    first, second = chunks_of(read_manifest(version), "t0")[:2]
    key = int(load_bytes((version / first["file"]).read_bytes())["keys"][0])
    tensors = load_bytes((version / second["file"]).read_bytes())
    tensors["keys"][-1] = key
    replace_file(version, second, save_bytes(tensors))

    spawn_ranks(_refusals, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    seen = [json.loads((tmp_path / f"refusals-{r}.json").read_text()) for r in range(2)]
    for rank in range(2):
        for case, problem in (("corrupted on one rank", corrupted.name), ("key on two ranks", f"key {key}")):
            got = seen[rank][case]
            assert got["error"] is not None and problem in got["error"], (rank, case, got)
            assert got["empty"] and got["step"] == 0, (rank, case, got)
    assert seen[0]["good"]["error"] is None and seen[1]["good"]["error"] is None
    for t in ("t0", "t1"):  # the retry: every saved row, once
        rows = seen[0]["good"]["rows"][t] + seen[1]["good"]["rows"][t]
        assert len(rows) == len(set(rows)) > 0
    assert seen[0]["good"]["step"] == seen[1]["good"]["step"] == STEPS
