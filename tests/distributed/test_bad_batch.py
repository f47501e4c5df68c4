"""A bad batch on one rank of a sharded collection (2 gloo ranks): every rank raises at the same
step, none waits in an exchange the bad rank left, no rank's rows change, and the steps after it
train as if the bad step had not been: the rows equal one process trained on the good steps'
batches of both ranks together (a plain collection, no process group). Tables of one group (the
verdict read with the route), of two groups, and one group whose features come in another order
(the verdict read first, then sent in the first group's route)."""

from __future__ import annotations

import datetime
import os
import socket

import pytest
import torch
import torch.distributed as dist

import tieredemb as te
from tests.ranks import spawn_ranks

WORLD = 2
STEPS, BAD_STEP, BAD_RANK = 4, 2, 1
LAYOUTS = {  # name: (the dims of tables t0 (feature a) and t1 (feature b), the batch's feature order)
    "one group": ((4, 4), ["a", "b"]),
    "two groups": ((4, 8), ["a", "b"]),
    "one group, features in another order": ((4, 4), ["b", "a"]),
}


def tables(layout: str) -> list[te.TableConfig]:
    dims, _ = LAYOUTS[layout]
    return [te.TableConfig("t0", dims[0], ["a"]), te.TableConfig("t1", dims[1], ["b"])]


def bags(step: int, rank: int) -> dict[str, list[list[int]]]:
    """Each feature's bags of (step, rank): 3 bags of 1-3 ids over 0..19 (64-bit ids, not ranks)."""
    gen = torch.Generator().manual_seed(97 * step + rank)
    return {f: [torch.randint(0, 20, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
                for _ in range(3)] for f in ("a", "b")}


def kjt(per_feature: dict[str, list[list[int]]], layout: str) -> te.KeyedJaggedTensor:
    features = LAYOUTS[layout][1]
    values = [k for f in features for bag in per_feature[f] for k in bag]
    lengths = [len(bag) for f in features for bag in per_feature[f]]
    return te.KeyedJaggedTensor(features, torch.tensor(values, dtype=torch.int64),
                                lengths=torch.tensor(lengths))


def bad(per_feature: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    """The same bags with one id that no table accepts."""
    return {**per_feature, "b": [[te.RESERVED_KEY], *per_feature["b"][1:]]}


def _worker(rank: int, port: int, tmp: str, layout: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        ebc = te.EmbeddingBagCollection(tables(layout), optimizer=te.optim.SGD(lr=0.1),
                                        process_group=dist.group.WORLD)
        errors, unchanged = [], None
        for step in range(STEPS):
            given = bags(step, rank)
            if step == BAD_STEP and rank == BAD_RANK:
                given = bad(given)
            try:
                if step == BAD_STEP:
                    before = {t: ebc.export(t) for t in ("t0", "t1")}
                ebc(kjt(given, layout)).values().sum().backward()
            except ValueError as e:
                errors.append((step, str(e)))
                after = {t: ebc.export(t) for t in ("t0", "t1")}
                unchanged = all(torch.equal(before[t].keys, after[t].keys)
                                and torch.equal(before[t].weights, after[t].weights) for t in before)
        rows = {t: ebc.export(t) for t in ("t0", "t1")}
        torch.save({"errors": errors, "unchanged": unchanged,
                    "rows": {t: dict(zip(r.keys.tolist(), r.weights)) for t, r in rows.items()}},
                   os.path.join(tmp, f"r{rank}.pt"))
        ebc.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_bad_batch_on_one_rank_raises_on_every_rank_and_changes_nothing(tmp_path, layout) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_ranks(_worker, args=(port, str(tmp_path), layout), nprocs=WORLD)
    got = [torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(WORLD)]
    for r in range(WORLD):
        assert [step for step, _ in got[r]["errors"]] == [BAD_STEP], got[r]["errors"]
        assert got[r]["unchanged"] is True
    assert "RESERVED_KEY" in got[BAD_RANK]["errors"][0][1]  # the bad rank names what is wrong
    assert f"rank {BAD_RANK}" in got[1 - BAD_RANK]["errors"][0][1]  # the others name the bad rank

    ref = te.EmbeddingBagCollection(tables(layout), optimizer=te.optim.SGD(lr=0.1))
    for step in range(STEPS):
        if step == BAD_STEP:
            continue
        together = {f: [bag for r in range(WORLD) for bag in bags(step, r)[f]] for f in ("a", "b")}
        ref(kjt(together, layout)).values().sum().backward()
    for t in ("t0", "t1"):
        want = ref.export(t)
        sharded = {**got[0]["rows"][t], **got[1]["rows"][t]}
        assert len(sharded) == len(got[0]["rows"][t]) + len(got[1]["rows"][t])  # each key on one rank
        assert sorted(sharded) == sorted(want.keys.tolist())
        for key, row in zip(want.keys.tolist(), want.weights):
            torch.testing.assert_close(sharded[key], row)
