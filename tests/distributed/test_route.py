"""``route``: how a batch's distinct pairs go to their owners, against counts made by hand, and a
padded dedup's pairs (``count`` real, the rest whatever the buffers held) routed as the real ones."""

from __future__ import annotations

import torch

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
