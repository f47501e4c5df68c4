"""Replicated hot rows by key, over 2 gloo ranks: ``write``, ``read`` and ``delete_rows`` of a hot key
reach every rank's copy; a checkpoint of a replicated run loads into an unreplicated one with the same
rows, and the reverse; bad options are refused before anything is built; and the load of each rank
(``keys_received``) against counts made here with a dict."""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import tieredemb as te
from tests.distributed.test_sharded import _free_port
from tests.ranks import spawn_ranks

WORLD = 2
HOT = {"t0": torch.tensor([3, 0, 1])}


def tables() -> list[te.TableConfig]:
    return [te.TableConfig("t0", 4, ["a"]), te.TableConfig("t1", 3, ["b"])]


def batch(step: int, rank: int, alpha: float = 1.2) -> te.KeyedJaggedTensor:
    """4 bags a feature of 1-4 ids, Zipf(alpha) ranks over 0..99 (key = rank: 0 the hottest)."""
    gen = torch.Generator().manual_seed(50 * step + rank)
    weights = torch.arange(1, 101, dtype=torch.float64) ** -alpha
    lengths = torch.randint(1, 5, (8,), generator=gen)
    values = torch.multinomial(weights, int(lengths.sum()), replacement=True, generator=gen)
    return te.KeyedJaggedTensor(["a", "b"], values, lengths=lengths)


def build(hot: te.HotRows | None):
    return te.EmbeddingBagCollection(tables(), optimizer=te.optim.Adam(lr=0.05),
                                     storage=te.StorageConfig(replicate_hot=hot), seed=3,
                                     process_group=dist.group.WORLD)


def train(ebc, rank: int, steps: range) -> None:
    for step in steps:
        ebc(batch(step, rank)).values().sum().backward()


def rows(ebc) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for t in ("t0", "t1"):
        r = ebc.export(t)
        out[t] = (r.keys, torch.cat([r.weights, r.optimizer_state], 1))
    return out


def _worker(rank: int, port: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    res = {}
    try:
        ebc = build(te.HotRows(keys=HOT))
        train(ebc, rank, range(3))
        ebc.write("t0", torch.tensor([3]), torch.full((1, 4), 1.0 + rank))  # the later rank's wins
        res["read"] = ebc.read("t0", torch.tensor([3, 0]))
        res["copy"] = ebc.read_full_rows("t0", torch.tensor([3, 0]))  # this rank's own copies
        ebc.delete_rows("t0", torch.tensor([0]) if rank == 0 else torch.empty(0, dtype=torch.int64))
        res["deleted"] = ebc.read("t0", torch.tensor([0]))[1], ebc.read_full_rows("t0", torch.tensor([0]))
        train(ebc, rank, range(3, 5))
        te.checkpoint.save(ebc, os.path.join(tmp, "replicated"))
        res["saved"] = rows(ebc)
        plain = build(None)  # the replicated checkpoint into an unreplicated collection
        te.checkpoint.load(plain, os.path.join(tmp, "replicated"))
        res["loaded_plain"] = rows(plain)
        train(ebc, rank, range(5, 7))
        train(plain, rank, range(5, 7))
        res["after"] = rows(ebc), rows(plain)
        # the reverse: an unreplicated checkpoint into a replicated collection
        te.checkpoint.save(plain, os.path.join(tmp, "plain"))
        again = build(te.HotRows(keys=HOT))
        te.checkpoint.load(again, os.path.join(tmp, "plain"))
        res["loaded_replicated"] = rows(again), again.read_full_rows("t0", HOT["t0"])
        train(again, rank, range(7, 9))
        train(plain, rank, range(7, 9))
        res["after_reverse"] = rows(again), rows(plain), again.read_full_rows("t0", HOT["t0"])
        for c in (ebc, plain, again):
            c.close()
        torch.save(res, os.path.join(tmp, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def gathered(per_rank: list[dict], t: str) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.cat([r[t][0] for r in per_rank])
    full = torch.cat([r[t][1] for r in per_rank])
    order = torch.argsort(keys)
    return keys[order], full[order]


def same_rows(a: list[dict], b: list[dict], exact: bool = False) -> None:
    for t in ("t0", "t1"):
        ka, ra = gathered(a, t)
        kb, rb = gathered(b, t)
        assert torch.equal(ka, kb), t  # each row once (the copies are not exported twice)
        if exact:
            assert torch.equal(ra, rb), t
        else:
            torch.testing.assert_close(ra, rb, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_hot_rows_by_key_and_checkpoints(tmp_path) -> None:
    spawn_ranks(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD)
    got = [torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(WORLD)]
    for r in range(WORLD):
        weights, found = got[r]["read"]
        assert found.all() and torch.equal(weights[0], torch.full((4,), 2.0))  # rank 1's write
        copy = got[r]["copy"]
        assert torch.equal(copy[0, :4], torch.full((4,), 2.0)) and not copy[0, 4:].any()  # state reset
        assert torch.equal(copy, got[0]["copy"])  # every rank's copy
        found, copy = got[r]["deleted"]
        assert not found.any() and not copy.any()  # gone from every rank
    saved = [g["saved"] for g in got]
    same_rows(saved, [g["loaded_plain"] for g in got], exact=True)
    same_rows([g["after"][0] for g in got], [g["after"][1] for g in got])
    same_rows([g["loaded_replicated"][0] for g in got], [g["after"][1] for g in got], exact=True)
    keys, full = gathered([g["after"][1] for g in got], "t0")
    for r in range(WORLD):  # every rank's copies are the owners' rows of the loaded checkpoint
        want = torch.stack([full[keys.tolist().index(k)] for k in HOT["t0"].tolist()])
        assert torch.equal(got[r]["loaded_replicated"][1], want)
        assert torch.equal(got[r]["after_reverse"][2], got[0]["after_reverse"][2])
    same_rows([g["after_reverse"][0] for g in got], [g["after_reverse"][1] for g in got])


def _load_worker(rank: int, port: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        out = {}
        for name, hot in (("plain", None), ("replicated", te.HotRows(keys=HOT))):
            ebc = build(hot)
            train(ebc, rank, range(4))
            out[name] = ({t: s.keys_received for t, s in ebc.stats().items()},
                         {t: ebc.export(t).keys.tolist() for t in ("t0", "t1")}, ebc.stats()["t0"].replicated)
            ebc.close()
        torch.save(out, os.path.join(tmp, f"load{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_replication_takes_the_hot_load_off_its_owner(tmp_path) -> None:
    spawn_ranks(_load_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD)
    got = [torch.load(tmp_path / f"load{r}.pt", weights_only=False) for r in range(WORLD)]
    owner = {(t, k): r for r in range(WORLD) for t, keys in got[r]["plain"][1].items() for k in keys}
    hot = {("t0", k) for k in HOT["t0"].tolist()}
    busiest = {}
    for name, skip in (("plain", set()), ("replicated", hot)):
        received = Counter()  # each requester's distinct keys of the step, at their owner
        for step in range(4):
            for r in range(WORLD):
                kjt = batch(step, r)
                ids = torch.split(kjt.values(), kjt.lengths().view(2, -1).sum(1).tolist())
                for t, part in zip(("t0", "t1"), ids):
                    received.update((owner[t, k], t) for k in set(part.tolist()) if (t, k) not in skip)
        for r in range(WORLD):
            assert got[r][name][0] == {t: received[r, t] for t in ("t0", "t1")}, (name, r)
        busiest[name] = max(sum(got[r][name][0].values()) for r in range(WORLD))
    assert busiest["replicated"] < busiest["plain"]
    assert got[0]["replicated"][2] == 3 and got[0]["plain"][2] == 0


def test_bad_options_are_refused_and_build_nothing(tmp_path) -> None:
    store = te.storage.RocksDB(str(tmp_path / "db"))
    hot = te.HotRows(keys=HOT)
    with pytest.raises(ValueError, match="replicate_hot.*process_group"):
        te.EmbeddingBagCollection(tables(), storage=te.StorageConfig(backing=store, hbm_budget=64,
                                                                     replicate_hot=hot))
    # the store was never opened: another collection takes it
    te.EmbeddingBagCollection(tables(), storage=te.StorageConfig(backing=store, hbm_budget=64)).close()
    for bad, match in (
        (dict(), "exactly one of per_table and keys"),
        (dict(per_table=2, keys=HOT), "exactly one of per_table and keys"),
        (dict(per_table=0), "per_table must be an int >= 1"),
        (dict(per_table=2, window=0), "window must be an int >= 1"),
        (dict(keys={"t0": torch.tensor([[1]])}), r"replicate_hot.keys\['t0'\].*1-D int64"),
        (dict(keys={"t0": torch.tensor([te.RESERVED_KEY])}), "reserved key"),
    ):
        with pytest.raises(ValueError, match=match):
            te.HotRows(**bad)
    with pytest.raises(TypeError, match="replicate_hot must be a te.HotRows"):
        te.StorageConfig(replicate_hot=3)


def _refusal_worker(rank: int, port: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        group, errors = dist.group.WORLD, []
        cases = [
            (tables(), te.HotRows(keys={"nope": torch.tensor([1])}), None),
            ([te.TableConfig("t0", 4, ["a"], num_embeddings=10)], te.HotRows(keys={"t0": torch.tensor([10])}),
             None),
            ([te.TableConfig("t0", 4, ["a"], max_capacity=64)], te.HotRows(per_table=1), None),
            ([te.TableConfig("t0", 4, ["a"], admission=te.FrequencyAdmission(2))], te.HotRows(per_table=1),
             None),
            (tables(), te.HotRows(per_table=1), 64),  # cache mode
            (tables(), te.HotRows(keys={"t0": torch.tensor([rank])}), None),  # ranks disagree
        ]
        for configs, hot, budget in cases:
            try:
                db = te.storage.RocksDB(os.path.join(tmp, "db"))
                te.EmbeddingBagCollection(configs, process_group=group, storage=te.StorageConfig(
                    replicate_hot=hot, hbm_budget=budget, backing=db))
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        # the store of every refused collection is free
        ebc = te.EmbeddingBagCollection(tables(), process_group=group, storage=te.StorageConfig(
            hbm_budget=64, backing=te.storage.RocksDB(os.path.join(tmp, "db"))))
        ebc.close()
        torch.save(errors, os.path.join(tmp, f"errors{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_bad_options_are_refused(tmp_path) -> None:
    spawn_ranks(_refusal_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD)
    errors = torch.load(tmp_path / "errors0.pt")
    expected = ["unknown table 'nope'", r"keys out of \[0, 10\)", "'t0' has max_capacity",
                "'t0' has admission", "needs storage mode hbm_direct or hybrid", "differ between ranks"]
    assert len(errors) == len(expected)
    for message, want in zip(errors, expected):
        assert message is not None and re.search(want, message), (message, want)


def test_a_hot_sets_positions_match_a_dict() -> None:
    """``HotSet.position`` against a dict of (table, key) -> index: keys of 64 bits, a key hot in one
    table asked in another, a table with no hot key, keys past every hot key of their table."""
    from tieredemb.distributed.replicated import HotSet

    gen = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.randint(-(2**62), 2**62, (40,), generator=gen), torch.tensor([5, 7])])
    tables = torch.cat([torch.randint(0, 3, (40,), generator=gen), torch.tensor([0, 2])])  # none in 3
    hot = HotSet(keys, tables, 4, torch.arange(4), world=1)
    index = {(int(t), int(k)): i for i, (k, t) in enumerate(zip(hot.keys.tolist(), hot.tables.tolist()))}
    asked_keys = torch.cat([keys, torch.tensor([5, 7, 2**62 + 3, -(2**62) - 3, 6])])
    asked_tables = torch.cat([tables, torch.tensor([1, 3, 0, 2, 0])])
    got = hot.position(asked_keys, asked_tables).tolist()
    want = [index.get((int(t), int(k)), -1) for k, t in zip(asked_keys.tolist(), asked_tables.tolist())]
    assert got == want and sum(w >= 0 for w in want) == 42
