"""A bad batch on one rank of a sharded collection (2 gloo ranks): every rank raises at the same
step, none waits in an exchange the bad rank left, no rank's rows change, and the steps after it
train as if the bad step had not been: the rows equal one process trained on the good steps'
batches of both ranks together (a plain collection, no process group)."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

import tieredemb as te
from tests.ranks import spawn_ranks

WORLD, DIM = 2, 4
FEATURES = ["a", "b"]
STEPS, BAD_STEP, BAD_RANK = 4, 2, 1


def tables() -> list[te.TableConfig]:
    return [te.TableConfig("t0", DIM, ["a"]), te.TableConfig("t1", DIM, ["b"])]  # one group


def bags(step: int, rank: int) -> dict[str, list[list[int]]]:
    """Each feature's bags of (step, rank): 3 bags of 1-3 ids over 0..19 (64-bit ids, not ranks)."""
    gen = torch.Generator().manual_seed(97 * step + rank)
    return {f: [torch.randint(0, 20, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
                for _ in range(3)] for f in FEATURES}


def kjt(per_feature: dict[str, list[list[int]]]) -> te.KeyedJaggedTensor:
    values = [k for f in FEATURES for bag in per_feature[f] for k in bag]
    lengths = [len(bag) for f in FEATURES for bag in per_feature[f]]
    return te.KeyedJaggedTensor(FEATURES, torch.tensor(values, dtype=torch.int64),
                                lengths=torch.tensor(lengths))


def bad(per_feature: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
    """The same bags with one id that no table accepts."""
    return {**per_feature, "b": [[te.RESERVED_KEY], *per_feature["b"][1:]]}


def _worker(rank: int, port: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        ebc = te.EmbeddingBagCollection(tables(), optimizer=te.optim.SGD(lr=0.1),
                                        process_group=dist.group.WORLD)
        errors, unchanged = [], None
        for step in range(STEPS):
            given = bags(step, rank)
            if step == BAD_STEP and rank == BAD_RANK:
                given = bad(given)
            try:
                if step == BAD_STEP:
                    before = {t: ebc.export(t) for t in ("t0", "t1")}
                ebc(kjt(given)).values().sum().backward()
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


def test_a_bad_batch_on_one_rank_raises_on_every_rank_and_changes_nothing(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_ranks(_worker, args=(port, str(tmp_path)), nprocs=WORLD)
    got = [torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(WORLD)]
    for r in range(WORLD):
        assert [step for step, _ in got[r]["errors"]] == [BAD_STEP], got[r]["errors"]
        assert got[r]["unchanged"] is True
    assert "RESERVED_KEY" in got[BAD_RANK]["errors"][0][1]  # the bad rank names what is wrong
    assert f"rank {BAD_RANK}" in got[1 - BAD_RANK]["errors"][0][1]  # the others name the bad rank

    ref = te.EmbeddingBagCollection(tables(), optimizer=te.optim.SGD(lr=0.1))
    for step in range(STEPS):
        if step == BAD_STEP:
            continue
        together = {f: [bag for r in range(WORLD) for bag in bags(step, r)[f]] for f in FEATURES}
        ref(kjt(together)).values().sum().backward()
    for t in ("t0", "t1"):
        want = ref.export(t)
        sharded = {**got[0]["rows"][t], **got[1]["rows"][t]}
        assert len(sharded) == len(got[0]["rows"][t]) + len(got[1]["rows"][t])  # each key on one rank
        assert sorted(sharded) == sorted(want.keys.tolist())
        for key, row in zip(want.keys.tolist(), want.weights):
            torch.testing.assert_close(sharded[key], row)
