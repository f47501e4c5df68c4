"""``route``: how a batch's distinct pairs go to their owners, against counts made by hand, and a
padded dedup's pairs (``count`` real, the rest whatever the buffers held) routed as the real ones;
pairs in owner order already routed as they come; the sharded step both ways against one process."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

import tieredemb as te
from tests.ranks import spawn_ranks
from tieredemb.distributed import owner_of, route, table_salts

TABLES = 3


def by_hand(owner: list[int], tables: list[int], counts: list[int], world: int):
    send = [0] * world
    pairs, ids = [0] * TABLES, [0] * TABLES
    for o, t, c in zip(owner, tables, counts):
        send[o] += 1
        pairs[t] += 1  # (world 1: every pair is this rank's to receive)
        ids[t] += c
    return send, pairs, ids


def _pairs(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    tables = torch.randint(0, TABLES, (n,), generator=gen)
    counts = torch.randint(1, 9, (n,), generator=gen)
    return keys, tables, counts


def test_a_route_counts_each_owners_pairs_and_ids() -> None:
    keys, tables, counts = _pairs(200, 0)
    salts = table_salts([f"t{i}" for i in range(TABLES)], torch.device("cpu"))
    owner = owner_of(keys, salts[tables], 1)
    way = route(owner, tables, counts, TABLES, 1, None)
    send, pairs, ids = by_hand(owner.tolist(), tables.tolist(), counts.tolist(), 1)
    assert way.send_splits == send == way.recv_splits
    assert way.pairs_per_table == pairs and way.ids_per_table == ids
    assert sorted(way.order.tolist()) == list(range(200))
    in_order = [(owner[i], tables[i]) for i in way.order.tolist()]
    assert in_order == sorted(in_order)  # owner by owner, table by table


def test_padding_past_the_count_is_routed_nowhere() -> None:
    """The first 150 of 200 pairs are real; the rest carry garbage (negative tables, huge
    counts): the route is the one of the 150, its order 150 long."""
    keys, tables, counts = _pairs(200, 1)
    real = route(torch.zeros(150, dtype=torch.int64), tables[:150], counts[:150], TABLES, 1, None)
    tables[150:], counts[150:] = -5, 10**6
    padded = route(torch.zeros(200, dtype=torch.int64), tables, counts, TABLES, 1, None,
                   count=torch.tensor([150]))
    assert padded.order.tolist() == real.order.tolist()
    assert sorted(real.order.tolist()) == list(range(150))
    for field in ("send_splits", "recv_splits", "pairs_per_table", "ids_per_table"):
        assert getattr(padded, field) == getattr(real, field), field


def test_pairs_in_owner_order_are_routed_as_they_come() -> None:
    """``in_order``: pairs already sorted by (owner, table) are counted as the reordering route
    counts them, and nothing is reordered (no ``order``); padding past the count goes nowhere."""
    keys, tables, counts = _pairs(200, 2)
    by_table = torch.argsort(tables, stable=True)
    tables, counts = tables[by_table], counts[by_table]
    owner = torch.zeros(200, dtype=torch.int64)
    reordered = route(owner, tables, counts, TABLES, 1, None)
    as_they_come = route(owner, tables, counts, TABLES, 1, None, in_order=True)
    assert as_they_come.order is None
    assert reordered.order.tolist() == list(range(200))  # (sorted already: the same order)
    send, pairs, ids = by_hand(owner.tolist(), tables.tolist(), counts.tolist(), 1)
    assert as_they_come.send_splits == send and as_they_come.pairs_per_table == pairs
    assert as_they_come.ids_per_table == ids
    tables[150:], counts[150:] = -5, 10**6
    padded = route(owner, tables, counts, TABLES, 1, None, count=torch.tensor([150]), in_order=True)
    assert padded.order is None and padded.send_splits == [150]
    assert padded.ids_per_table == by_hand([0] * 150, tables[:150].tolist(), counts[:150].tolist(), 1)[2]


WORLD = 2


def _bags(step: int, rank: int) -> dict[str, list[list[int]]]:
    """4 bags of 1-3 ids over 30 64-bit keys per feature (two tables of one group)."""
    gen = torch.Generator().manual_seed(31 * step + rank)
    return {f: [(torch.randint(0, 30, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen)
                 * (2**40 + 1)).tolist() for _ in range(4)] for f in ("a", "b")}


def _kjt(bags: dict[str, list[list[int]]]) -> te.KeyedJaggedTensor:
    values = [k for f in ("a", "b") for bag in bags[f] for k in bag]
    lengths = [len(bag) for f in ("a", "b") for bag in bags[f]]
    return te.KeyedJaggedTensor(["a", "b"], torch.tensor(values), lengths=torch.tensor(lengths))


def _collection(group=None) -> te.EmbeddingBagCollection:
    configs = [te.TableConfig("t0", 4, ["a"]), te.TableConfig("t1", 4, ["b"])]
    return te.EmbeddingBagCollection(configs, optimizer=te.optim.Adagrad(lr=0.1), process_group=group)


def _worker(rank: int, port: int, tmp: str, in_order: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        ebc = _collection(dist.group.WORLD)
        ebc.placement.cells_in_order = [in_order]
        for step in range(3):
            ebc(_kjt(_bags(step, rank))).values().pow(2).sum().backward()
        rows = ebc.export("t0"), ebc.export("t1")
        torch.save([dict(zip(r.keys.tolist(), r.weights)) for r in rows], os.path.join(tmp, f"r{rank}.pt"))
        ebc.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("in_order", [True, False], ids=["dedup in owner order", "route reorders"])
def test_the_sharded_step_equals_one_process_whichever_orders_the_pairs(tmp_path, in_order) -> None:
    """The sharded step's pairs sorted by owner in the dedup (no reordering) and reordered by the
    route (a group of over 2**16 cells): 2 gloo ranks train the rows one process trains on both
    ranks' batches together."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn_ranks(_worker, args=(port, str(tmp_path), in_order), nprocs=WORLD)
    got = [torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in range(WORLD)]
    ref = _collection()
    for step in range(3):
        together = {f: [bag for r in range(WORLD) for bag in _bags(step, r)[f]] for f in ("a", "b")}
        ref(_kjt(together)).values().pow(2).sum().backward()
    for i, t in enumerate(("t0", "t1")):
        want = ref.export(t)
        sharded = {**got[0][i], **got[1][i]}
        assert len(sharded) == len(got[0][i]) + len(got[1][i])  # each key on one rank
        assert sorted(sharded) == sorted(want.keys.tolist())
        for key, row in zip(want.keys.tolist(), want.weights):
            torch.testing.assert_close(sharded[key], row)
