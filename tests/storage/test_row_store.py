"""RowStore: addressing across segments, the free list, zero rows for negative addresses."""

import pytest
import torch

from tieredemb.storage.row_store import RowStore


def test_rows_round_trip_across_segments() -> None:
    store = RowStore(width=5, segment_rows=3, device=torch.device("cpu"))
    addr = store.allocate(10)
    assert len(store.segments) == 4 and sorted(addr.tolist()) == list(range(10))
    rows = torch.randn(10, 5)
    store.scatter(addr, rows)
    perm = torch.randperm(10)
    assert torch.equal(store.gather(addr[perm]), rows[perm])
    assert torch.equal(store.gather(addr[:4], cols=2), rows[:4, :2])
    got = store.gather(torch.tensor([-1, int(addr[3])]))
    assert torch.equal(got[0], torch.zeros(5)) and torch.equal(got[1], rows[3])


def test_many_segments_against_a_dense_table() -> None:
    """Scattered and gathered in random order over 40 segments, with misses (-1) among the reads
    and segments no address of a call falls in: what a dense tensor of the same rows holds."""
    g = torch.Generator().manual_seed(0)
    store = RowStore(width=4, segment_rows=7, device=torch.device("cpu"))
    addr = store.allocate(280)
    dense = torch.zeros(280, 4)
    for _ in range(5):
        some = addr[torch.randperm(280, generator=g)[:90]]
        rows = torch.randn(90, 4, generator=g)
        store.scatter(some, rows, col_start=0)
        dense[some] = rows
        half = torch.randn(90, 2, generator=g)
        store.scatter(some, half, col_start=2)
        dense[some, 2:] = half
        asked = torch.cat([addr[torch.randint(0, 280, (60,), generator=g)], torch.full((5,), -1)])
        asked = asked[torch.randperm(65, generator=g)]
        want = torch.where((asked >= 0)[:, None], dense[asked.clamp(min=0)], torch.zeros(()))
        assert torch.equal(store.gather(asked), want)
        assert torch.equal(store.gather(asked[:10], cols=3), want[:10, :3])


def test_free_rows_are_reused_before_growth() -> None:
    store = RowStore(width=2, segment_rows=4, device=torch.device("cpu"))
    a = store.allocate(4)
    store.free(a[1:3])
    b = store.allocate(2)
    assert sorted(b.tolist()) == sorted(a[1:3].tolist())
    assert len(store.segments) == 1 and store.rows_in_use() == 4
    store.allocate(1)
    assert len(store.segments) == 2
    assert store.pointer_table().tolist() == [s.data_ptr() for s in store.segments]


def test_segments_past_the_device_limit_live_on_the_host() -> None:
    store = RowStore(width=3, segment_rows=2, device=torch.device("cpu"), device_segments=1)
    addr = store.allocate(5)
    assert store.rows_by_placement() == {"device": 2, "host": 4}
    rows = torch.randn(5, 3)
    store.scatter(addr, rows)
    assert torch.equal(store.gather(addr.flip(0)), rows.flip(0))


def test_reserve_allocates_segments_ahead_and_growth_uses_them():
    store = RowStore(width=3, segment_rows=4, device=torch.device("cpu"))
    store.reserve(10)
    assert store.rows_allocated() == 12 and store.rows_in_use() == 0
    store.allocate(12)
    assert len(store.segments) == 3  # no new segment for rows reserved
    store.allocate(1)
    assert len(store.segments) == 4


def test_host_memory_reserve_rows():
    import tieredemb as te

    backend = te.storage.HostMemory(segment_rows=8, reserve_rows=20).open("t", 5, torch.device("cpu"))
    assert backend._store.rows_allocated() == 24
    with pytest.raises(ValueError, match="reserve_rows"):
        te.storage.HostMemory(reserve_rows=-1)


def test_peek_shows_the_next_allocations_and_pop_takes_the_first_of_them() -> None:
    store = RowStore(width=2, segment_rows=4, device=torch.device("cpu"))
    ahead = store.peek(6)  # grows to two segments
    assert len(store.segments) == 2 and store.rows_in_use() == 0
    store.pop(2)
    assert store.rows_in_use() == 2
    assert store.allocate(4).tolist() == ahead[2:].tolist()


def test_host_memory_reserve_rows_sizes_the_index_for_them() -> None:
    """The reserved rows of every table go in without a rehash (the index's generation and its
    regions' sizes unchanged), and read back as written. (A call makes room for its keys in every
    region, as it does not read where they go: calls of a few hundred keys, as a cache's.)"""
    from tieredemb.storage.host import HostMemoryBackend

    n, tables = 3000, 3
    backend = HostMemoryBackend(width=4, tables=tables, reserve_rows=n * tables)
    buckets, generation = list(backend._index.region_buckets), backend._index.generation
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-(1 << 62), 1 << 62, (n,), generator=g)
    keys = torch.unique(keys)
    rows = torch.randn(tables, keys.numel(), 4, generator=g)
    for t in range(tables):
        for part in torch.arange(keys.numel()).split(500):
            backend.set(keys[part], rows[t, part], torch.full_like(keys[part], t))
    assert backend._index.region_buckets == buckets and backend._index.generation == generation
    for t in range(tables):
        got = backend.get(keys, torch.full_like(keys, t))
        assert bool(got.found.all()) and torch.equal(got.rows, rows[t])
    # a key and a row address a slot (no scores or locks: a store never evicts), the slots those
    # of 32-way buckets 30% full at the reserved rows, one bucket of rounding a table
    assert backend._index.nbytes() <= (16 / 0.3 * n + 16 * 32) * tables


def test_sets_alone_grow_only_the_regions_their_keys_need() -> None:
    """Each call makes room for its keys in every region (it does not read where they go), but the
    calls before it are read back first: sets into one table leave the other regions' size alone."""
    from tieredemb.storage.host import HostMemoryBackend

    backend = HostMemoryBackend(width=2, tables=4)
    empty = list(backend._index.region_buckets)
    keys = torch.arange(20_000) * 7919
    for part in keys.split(500):
        backend.set(part, torch.ones(part.numel(), 2), torch.zeros_like(part))
    assert backend._index.region_buckets[1:] == empty[1:]
    assert backend.size(0) == keys.numel()
