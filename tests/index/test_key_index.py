"""KeyIndex (pure torch) against a plain-Python model of a bucketed LRU/LFU table."""

from __future__ import annotations

import random

import pytest
import torch

from tieredemb.config import RESERVED_KEY
from tieredemb.index import KeyIndex, Region, bucket_of


class DictModel:
    """Per bucket a list of ways, each None or [key, score, locks]: the claim rules written the plain
    way, one key at a time."""

    def __init__(self, width: int, num_buckets: int, policy: str) -> None:
        self.width, self.num_buckets, self.policy = width, num_buckets, policy
        self.ways: list[list[list[int] | None]] = [[None] * width for _ in range(num_buckets)]

    def bucket(self, key: int) -> list[list[int] | None]:
        return self.ways[int(bucket_of(torch.tensor([key]), self.num_buckets)[0])]

    def find_or_insert(self, keys: list[int], step: int, counts: list[int]):
        evicted, conflicts = set(), set()
        batch = set(keys)
        present = {w[0] for k in keys for w in self.bucket(k) if w is not None and w[0] == k}
        for k in sorted(batch - present):
            ways = self.bucket(k)
            free = [i for i, w in enumerate(ways) if w is None]
            victims = sorted((w[1], i) for i, w in enumerate(ways)
                             if w is not None and w[2] == 0 and w[0] not in batch)
            if free:
                i = free[0]
            elif victims:
                i = victims[0][1]
                evicted.add(ways[i][0])
            else:
                conflicts.add(k)
                continue
            ways[i] = [k, 0, 0]
        for k, c in zip(keys, counts):
            for w in self.bucket(k):
                if w is not None and w[0] == k:
                    w[1] = step if self.policy == "lru" else w[1] + c
        return evicted, conflicts

    def contents(self) -> dict[int, int]:
        return {w[0]: w[1] for b in self.ways for w in b if w is not None}


def _contents(index: KeyIndex) -> dict[int, int]:
    keys, _, scores = index.export()
    return dict(zip(keys.tolist(), scores.tolist()))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_bounded_eviction_matches_dict_model(policy: str) -> None:
    """Eviction takes the lowest (score, way) in the bucket among slots that are neither locked nor
    used by the batch itself; the batch's misses claim ways in ascending key order."""
    rng = random.Random(0)
    width = 4
    index = KeyIndex(width, policy, torch.device("cpu"), max_slots=4 * width)
    model = DictModel(width, index.num_buckets, policy)
    for step in range(1, 60):
        keys = rng.sample(range(80), rng.randint(1, 12))
        counts = [rng.randint(1, 3) for _ in keys]
        res = index.find_or_insert(torch.tensor(keys), step, torch.tensor(counts))
        ev, conflicts = model.find_or_insert(keys, step, counts)
        got_conflicts = set(torch.tensor(keys)[res.slots < 0].tolist())
        assert got_conflicts == conflicts
        assert set(res.evicted_keys.tolist()) == ev
        assert _contents(index) == model.contents()
        assert index.size() == len(_contents(index))


def test_locked_slots_survive_eviction() -> None:
    width = 2
    index = KeyIndex(width, "lru", torch.device("cpu"), max_slots=width)  # one bucket
    index.find_or_insert(torch.tensor([1, 2]), step=1, lock=True)
    res = index.find_or_insert(torch.tensor([3]), step=2)
    assert res.slots.tolist() == [-1]  # conflict: both ways locked
    assert res.evicted_keys.numel() == 0
    index.unlock(torch.tensor([1]))
    res = index.find_or_insert(torch.tensor([3]), step=3)
    assert res.evicted_keys.tolist() == [1]
    assert sorted(_contents(index)) == [2, 3]


def test_an_index_without_locking_keeps_no_locks() -> None:
    """Locks shield rows from eviction: a locking index (the default) counts the batches holding a
    slot; one made with ``locking=False`` (never evicts) keeps them at 0, so its batches need no
    release; a bounded index cannot be made without them."""
    keys = torch.tensor([5, 6, 7])
    for locking, want in ((False, [0, 0, 0]), (True, [2, 2, 1])):
        index = KeyIndex(8, "lru", torch.device("cpu"), locking=locking)
        index.find_or_insert(keys, step=1, lock=True)  # inserted: locked once
        index.find_or_insert(keys[:2], step=2, lock=True)  # found: locked again
        assert index.locks[index.find(keys)].tolist() == want
        index.unlock(keys)
        index.unlock(keys[:2])
        assert int(index.locks.sum()) == 0
    with pytest.raises(ValueError, match="bounded region needs its locks"):
        KeyIndex(8, "lru", torch.device("cpu"), max_slots=64, locking=False)


def test_lowest_unlocked_score_is_evicted() -> None:
    index = KeyIndex(4, "lru", torch.device("cpu"), max_slots=4)
    for step, key in enumerate([10, 11, 12, 13], start=1):
        index.find_or_insert(torch.tensor([key]), step)
    index.find_or_insert(torch.tensor([10]), step=5)  # 10 is now the most recent
    index.find_or_insert(torch.tensor([11]), step=6, lock=True)
    res = index.find_or_insert(torch.tensor([14]), step=7)
    assert res.evicted_keys.tolist() == [12]  # 11 has a lower score but is locked


def test_growth_keeps_every_key_and_value() -> None:
    index = KeyIndex(8, "lru", torch.device("cpu"), initial_slots=8)
    keys = torch.randperm(50_000)[:5000] * 7919 - 123456789
    for i, chunk in enumerate(keys.split(333)):
        res = index.find_or_insert(chunk, step=i, lock=(i % 2 == 0))
        assert bool((res.slots >= 0).all())
        index.assign(res.slots[res.inserted], chunk[res.inserted] * 3)
    assert index.capacity() >= 5000 / 0.5
    assert index.size() == 5000
    got_keys, got_values, _ = index.export()
    assert sorted(got_keys.tolist()) == sorted(keys.tolist())
    assert torch.equal(got_values, got_keys * 3)
    assert int(index.locks.sum()) == sum(c.numel() for c in keys.split(333)[::2])
    slots = index.find(keys)
    assert bool((slots >= 0).all()) and torch.equal(index.keys[slots], keys)


def test_double_grows_the_regions_named_and_refuses_a_bounded_one() -> None:
    """``double``: the named unbounded regions twice their buckets, the others as they were, every key
    found with its value; a bounded region named raises and changes nothing."""
    index = KeyIndex(4, regions=[Region("lru", None, 8), Region("lru", None, 8), Region("lru", 16, 8)])
    keys = torch.arange(30) * 7919 - 5
    tables = torch.arange(30) % 3
    res = index.find_or_insert(keys, 1, tables=tables)
    index.assign(res.slots[res.inserted], keys[res.inserted] * 3)
    stored = res.slots >= 0
    before = list(index.region_buckets)
    with pytest.raises(ValueError, match="bounded"):
        index.double([0, 2])
    assert index.region_buckets == before and torch.equal(index.find(keys, tables) >= 0, stored)
    index.double([1])
    assert index.region_buckets == [before[0], 2 * before[1], before[2]]
    slots = index.find(keys, tables)
    assert torch.equal(slots >= 0, stored)
    assert torch.equal(index.values[slots[stored]], keys[stored] * 3)


def _buckets_by_hand(index: KeyIndex) -> list[list[tuple[int, int, int, int] | None]]:
    """Per bucket of ``index``, its ways in order: (key, value, score, locks) or None."""
    rows = zip(index.keys.tolist(), index.values.tolist(), index.scores.tolist(), index.locks.tolist())
    ways = [None if k == RESERVED_KEY else (k, v, s, lk) for k, v, s, lk in rows]
    return [ways[b * index.width : (b + 1) * index.width] for b in range(index.num_buckets)]


@pytest.mark.parametrize("chunk", [None, 3])
def test_a_rehash_splits_each_bucket_in_order(chunk, monkeypatch) -> None:
    """``_grow`` of three regions, one doubling, one staying, one growing 4x, with holes left by
    erased keys and locked keys: each new bucket of a growing region holds, in order, the keys of its
    parent bucket (in their old order) that hash to it, with their values, scores and locks, then
    empty ways (written here one bucket at a time from the old layout); a staying region's buckets
    are as they were, holes included; every key is found again. ``chunk``: old buckets moved at a
    time (3: several parts, across regions)."""
    from tieredemb.index import Region, key_index

    if chunk is not None:
        monkeypatch.setattr(key_index, "_REHASH_BUCKETS", chunk)

    regions = [Region("lru", None, 16), Region("lfu", 32), Region("lru", None, 8)]
    index = KeyIndex(4, regions=regions)
    rng = random.Random(5)
    keys = torch.tensor(rng.sample(range(-(10**12), 10**12), 36))
    tables = torch.tensor([i % 3 for i in range(36)])
    res = index.find_or_insert(keys, 1, torch.arange(1, 37), lock=True, tables=tables)
    placed = res.slots >= 0
    index.assign(res.slots[placed], keys[placed] + 7)
    index.unlock(keys[placed][::2], tables[placed][::2])
    index.erase(keys[placed][1::5], tables[placed][1::5])  # holes inside buckets
    before, old_nb, old_start = _buckets_by_hand(index), index.region_buckets, index.region_start
    generation = index.generation

    new_nb = [old_nb[0] * 2, old_nb[1], old_nb[2] * 4]
    index._grow(new_nb)

    assert index.region_buckets == new_nb and index.generation == generation + 1
    want: list[list] = [[] for _ in range(sum(new_nb))]
    for r in range(3):
        for b in range(old_nb[r]):
            for way in before[old_start[r] + b]:
                if new_nb[r] == old_nb[r]:
                    want[index.region_start[r] + b].append(way)
                elif way is not None:
                    child = int(bucket_of(torch.tensor([way[0]]), new_nb[r])[0])
                    want[index.region_start[r] + child].append(way)
    want = [ways + [None] * (index.width - len(ways)) for ways in want]
    assert _buckets_by_hand(index) == want
    still = index.find(keys, tables) >= 0
    assert int(still.sum()) == int(placed.sum()) - len(keys[placed][1::5])
    assert int(index.values[index.find(keys[still], tables[still])].sub(keys[still] + 7).abs().sum()) == 0
    with pytest.raises(ValueError, match="power-of-two"):
        index._grow([new_nb[0] * 3, new_nb[1], new_nb[2]])
    assert index.region_buckets == new_nb and _buckets_by_hand(index) == want


def test_erase_find_and_reserved_key() -> None:
    index = KeyIndex(4, "lfu", torch.device("cpu"))
    index.find_or_insert(torch.tensor([5, -5, 2**62]), step=1, counts=torch.tensor([3, 1, 1]))
    assert _contents(index) == {5: 3, -5: 1, 2**62: 1}
    index.erase(torch.tensor([-5, 99]))
    assert index.find(torch.tensor([5, -5, 99])).ge(0).tolist() == [True, False, False]
    assert index.size() == 2
    assert int((index.keys == RESERVED_KEY).sum()) == index.capacity() - 2


def test_the_empty_mark_is_never_found() -> None:
    index = KeyIndex(4, "lru", torch.device("cpu"))
    index.find_or_insert(torch.tensor([1, 2]), step=1)
    assert index.find(torch.tensor([RESERVED_KEY, 1])).tolist()[0] == -1


def test_regions_behave_as_separate_indexes() -> None:
    """Tables batched into one index (a region each) answer exactly as one index per table: same
    slots within the region, same evictions, conflicts, scores and growth."""
    from tieredemb.index import Region

    regions = [Region("lru", 8), Region("lfu", None, 8), Region("lfu", 12), Region("lru", None, 4)]
    multi = KeyIndex(4, regions=regions)
    alone = [KeyIndex(4, r.policy, max_slots=r.max_slots, initial_slots=r.initial_slots) for r in regions]
    rng = random.Random(11)
    pool = [rng.randrange(-(2**63) + 1, 2**63) for _ in range(60)]
    for step in range(1, 16):
        pairs = rng.sample([(k, r) for k in pool for r in range(len(regions))], 30)
        keys = torch.tensor([k for k, _ in pairs])
        tables = torch.tensor([r for _, r in pairs])
        counts = torch.tensor([rng.randint(1, 3) for _ in pairs])
        lock = step % 3 == 0
        got = multi.find_or_insert(keys, step, counts, lock=lock, tables=tables)
        fresh = got.inserted & (got.values < 0)
        multi.assign(got.slots[fresh], keys[fresh])  # the key as its address: comparable across indexes
        for r, index in enumerate(alone):
            mine = tables == r
            want = index.find_or_insert(keys[mine], step, counts[mine], lock=lock)
            fresh_r = want.inserted & (want.values < 0)
            index.assign(want.slots[fresh_r], keys[mine][fresh_r])
            base = multi.region_start[r] * multi.width
            assert multi.region_buckets[r] == index.num_buckets, f"step {step} region {r}"
            slots = got.slots[mine]
            msg = f"step {step} region {r}"
            assert torch.equal(torch.where(slots >= 0, slots - base, -1), want.slots), msg
            ev = got.evicted_tables == r
            assert torch.equal(got.evicted_keys[ev], want.evicted_keys), f"step {step} region {r}"
            for a, b in zip(multi.export(r), index.export()):
                assert torch.equal(a, b), f"step {step} region {r}"
            assert multi.size(r) == index.size()
        if lock:  # release the batch again
            multi.unlock(keys, tables)
            for r, index in enumerate(alone):
                index.unlock(keys[tables == r])
    assert multi.generation > 0  # the unbounded regions grew during the run
