"""Each rank's load, ``stats(all_ranks=True)``, over 2 gloo ranks and skewed batches (a hot key in
every bag), against counts made here from the batches with a dict: which rank owns a key is read
from the ranks' exports, not from the routing code."""

from __future__ import annotations

import os
import socket
from collections import Counter

import torch
import torch.distributed as dist

import tieredemb as te
from tests.ranks import spawn_ranks

STEPS, WORLD = 3, 2
TABLES = {"t0": ["a"], "t1": ["b", "c"]}  # t1: two features read one table


def batch(step: int, rank: int) -> te.KeyedJaggedTensor:
    """4 bags a feature of 1-4 ids: key 7 (hot) in every bag, the rest Zipf-like over 0..39."""
    gen = torch.Generator().manual_seed(31 * step + rank)
    values, lengths = [], []
    for _ in ("a", "b", "c"):
        lens = torch.randint(1, 5, (4,), generator=gen)
        for n in lens.tolist():
            rest = (torch.rand(n - 1, generator=gen) ** 3 * 40).long()  # small ids far more often
            values.append(torch.cat([torch.tensor([7]), rest]))
        lengths.append(lens)
    return te.KeyedJaggedTensor(["a", "b", "c"], torch.cat(values), lengths=torch.cat(lengths))


def ids_by_table(kjt: te.KeyedJaggedTensor) -> dict[str, list[int]]:
    per_feature = dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.lengths().view(3, -1).sum(1).tolist())))
    return {t: [k for f in feats for k in per_feature[f].tolist()] for t, feats in TABLES.items()}


def _worker(rank: int, port: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        tables = [te.TableConfig(t, 4, feats) for t, feats in TABLES.items()]
        ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1),
                                        process_group=dist.group.WORLD)
        for step in range(STEPS):
            ebc(batch(step, rank)).values().sum().backward()
        loads = ebc.stats(all_ranks=True)
        owned = {t: ebc.export(t).keys.tolist() for t in TABLES}
        torch.save({"loads": loads, "mine": ebc.stats(), "owned": owned}, os.path.join(tmp, f"r{rank}.pt"))
        ebc.close()
    finally:
        dist.destroy_process_group()


def test_all_ranks_stats_count_each_ranks_load(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_ranks(_worker, args=(port, str(tmp_path)), nprocs=WORLD)
    got = [torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(WORLD)]
    owner = {(t, k): r for r in range(WORLD) for t, keys in got[r]["owned"].items() for k in keys}
    lookups, received, unique = Counter(), Counter(), Counter()
    for step in range(STEPS):
        per_rank = [ids_by_table(batch(step, r)) for r in range(WORLD)]
        for t in TABLES:
            for ids in (p[t] for p in per_rank):
                lookups.update((owner[t, k], t) for k in ids)  # every id, served by its owner
                received.update((owner[t, k], t) for k in set(ids))  # each requester's distinct keys
            unique.update((owner[t, k], t) for k in set().union(*(p[t] for p in per_rank)))
    hot = [owner[t, 7] for t in TABLES]
    assert lookups[hot[0], "t0"] > lookups[1 - hot[0], "t0"]  # the hot key's owner serves more
    for r in range(WORLD):
        assert got[r]["loads"] == got[0]["loads"]  # every rank gathered the same report
        load = got[0]["loads"][r]
        assert {t: s.keys_received for t, s in got[r]["mine"].items()} == {t: load[t].keys_received
                                                                         for t in TABLES}
        for t in TABLES:
            assert load[t].lookups == lookups[r, t], (r, t)
            assert load[t].keys_received == received[r, t], (r, t)
            assert load[t].unique_lookups == unique[r, t], (r, t)
            assert load[t].rows["device"] == len(got[r]["owned"][t])


def test_one_process_receives_nothing() -> None:
    ebc = te.EmbeddingBagCollection([te.TableConfig(t, 4, feats) for t, feats in TABLES.items()],
                                    optimizer=te.optim.SGD(lr=0.1))
    ebc(batch(0, 0))
    [stats] = ebc.stats(all_ranks=True)
    assert stats["t1"].lookups == len(ids_by_table(batch(0, 0))["t1"]) and stats["t1"].keys_received == 0
