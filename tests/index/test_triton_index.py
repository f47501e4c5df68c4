"""TritonKeyIndex against KeyIndex (the reference): identical tensors and answers, call by call.

On CPU the kernels run in the Triton interpreter; on a CUDA machine the same tests run on the GPU.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tieredemb.config import RESERVED_KEY  # noqa: E402
from tieredemb.index import KeyIndex, Region  # noqa: E402
from tieredemb.index.key_index import CONTESTED  # noqa: E402
from tieredemb.ops.triton import TritonKeyIndex  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INT64_MAX = 2**63 - 1
# a key pool with the int64 extremes, negatives and near-collisions, scrambled
POOL = [0, 1, -1, INT64_MAX, RESERVED_KEY + 1, 2**40, -(2**40), 123456789012345] + [
    7919 * i - 50_000 for i in range(72)
]

FIELDS = ("slots", "found", "values", "evicted_keys", "evicted_values", "evicted_scores", "evicted_tables")


def assert_same_state(got: KeyIndex, want: KeyIndex, msg: str) -> None:
    assert got.num_buckets == want.num_buckets, msg
    assert got.size() == want.size(), msg
    assert len(got._columns()) == len(want._columns()) == (4 if want.scored else 2), msg
    for name, a, b in zip(("keys", "values", "scores", "locks"), got._columns(), want._columns()):
        assert torch.equal(a, b), f"{msg}: {name} differ"


def assert_same_result(got, want, msg: str) -> None:
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{msg}: {name} differ"


def _pairs(rng: random.Random, n: int, regions: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """n distinct (key, region) pairs; regions None for a one-region index."""
    pairs = rng.sample([(k, r) for k in POOL for r in range(regions)], n)
    keys = torch.tensor([k for k, _ in pairs], dtype=torch.int64, device=DEVICE)
    if regions == 1:
        return keys, None
    return keys, torch.tensor([r for _, r in pairs], dtype=torch.int64, device=DEVICE)


def run_workload(width: int, policy: str, max_slots: int | None, seed: int, steps: int = 8,
                 regions: list[Region] | None = None, locking: bool = True, scores: bool = True) -> None:
    """Random find_or_insert (lock on/off, LFU counts), assign, unlock, erase, find and export, on
    both indexes in lockstep."""
    rng = random.Random(seed)
    if regions is not None:
        kw = {"regions": regions}
    elif max_slots is not None:
        kw = {"max_slots": max_slots}
    else:
        kw = {"initial_slots": 2 * width}
    ref = KeyIndex(width, policy, DEVICE, locking=locking, scores=scores, **kw)
    tri = TritonKeyIndex(width, policy, DEVICE, locking=locking, scores=scores, **kw)
    nreg = len(ref.regions)
    next_address = 0
    locked: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for step in range(1, steps + 1):
        keys, tables = _pairs(rng, rng.randint(0, 24), nreg)
        counts = torch.tensor(
            [rng.randint(1, 3) for _ in range(keys.numel())], dtype=torch.int64, device=DEVICE
        )
        lock, given = rng.random() < 0.5, rng.random() < 0.5
        msg = f"step {step} lock={lock} given_order={given}"
        want = ref.find_or_insert(keys, step, counts, lock=lock, tables=tables, given_order=given)
        got = tri.find_or_insert(keys, step, counts, lock=lock, tables=tables, given_order=given)
        assert_same_result(got, want, msg)
        for res in (got, want):  # the host-side counts agree with the tensors
            assert res.inserted_count == int(res.inserted.sum()), msg
            assert res.unplaced == int(((res.slots < 0) & ~res.found).sum()), msg
            assert res.new_rows == int((res.inserted & (res.values < 0)).sum()), msg
        assert_same_state(tri, ref, msg)
        assert locking or not scores or int(ref.locks.abs().sum()) == 0, msg  # no lock ever taken
        fresh = want.inserted & (want.values < 0)  # the caller gives new rows an address
        addresses = torch.arange(next_address, next_address + int(fresh.sum()), device=DEVICE)
        next_address += addresses.numel()
        for index in (ref, tri):
            index.assign(want.slots[fresh], addresses)
        if lock:
            locked.append((keys, tables))
        placed = want.slots >= 0
        if placed.any() and rng.random() < 0.5:  # a batch whose keys are all stored: the fast path
            again, atables = keys[placed], None if tables is None else tables[placed]
            want = ref.find_or_insert(again, step, counts[placed], lock=True, tables=atables)
            got = tri.find_or_insert(again, step, counts[placed], lock=True, tables=atables)
            assert not want.any_miss and not got.any_miss, msg
            assert_same_result(got, want, msg)
            per_region = torch.bincount(torch.zeros_like(again) if atables is None else atables,
                                        minlength=nreg)
            assert torch.equal(got.region_keys, per_region), msg
            assert torch.equal(want.region_keys, per_region), msg
            assert_same_state(tri, ref, msg)
            locked.append((again, atables))
        if locked and rng.random() < 0.5:  # backward of an earlier batch
            batch, btables = locked.pop(0)
            ref.unlock(batch, btables)
            tri.unlock(batch, btables)
        if rng.random() < 0.3:
            gone, gtables = _pairs(rng, 5, nreg)
            assert torch.equal(tri.erase(gone, gtables), ref.erase(gone, gtables)), msg
        probe, ptables = _pairs(rng, 20, nreg)
        assert torch.equal(tri.find(probe, ptables), ref.find(probe, ptables)), msg
        assert_same_state(tri, ref, msg)
        for r in [None, *range(nreg)]:
            for a, b in zip(tri.export(r), ref.export(r)):
                assert torch.equal(a, b), msg


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("width", [4, 6])  # 6: ways masked inside a power-of-two tile
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.slow
def test_bounded_matches_reference(policy, width, seed):
    """Small bounded indexes: full buckets, evictions by (score, way), locked conflict misses."""
    run_workload(width, policy, max_slots=4 * width, seed=seed)


@pytest.mark.parametrize("layout", ["locks", "no locks", "no scores"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("width", [4, 6])
@pytest.mark.slow
def test_unbounded_matches_reference(policy, width, layout):
    """Unbounded indexes starting tiny: growth by doubling, including mid-insert rehashes; with and
    without lock counts (``locking=False``: hbm_direct's index, which never evicts), and with neither
    scores nor locks (a host store's index; its exported scores are 0)."""
    run_workload(width, policy, max_slots=None, seed=3, locking=layout == "locks",
                 scores=layout != "no scores")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.slow
def test_regions_match_reference(seed):
    """Several tables in one index: bounded and unbounded regions, LRU and LFU side by side."""
    regions = [Region("lru", 2 * 4), Region("lfu", None, 8), Region("lfu", 3 * 4), Region("lru", None, 4)]
    run_workload(4, "lru", None, seed=seed, steps=10, regions=regions)


def test_single_bucket_ties_and_conflicts():
    """One bucket: equal LFU scores break ties by way; more misses than ways give conflict misses."""
    ref = KeyIndex(4, "lfu", DEVICE, max_slots=4)
    tri = TritonKeyIndex(4, "lfu", DEVICE, max_slots=4)
    batches = [([5, 3, 9], True), ([1, 2, 4, 6, 7, 8], False), ([10, 11, 12, 13, 14], False)]
    for step, (keys, lock) in enumerate(batches, start=1):
        keys = torch.tensor(keys, dtype=torch.int64, device=DEVICE)
        want = ref.find_or_insert(keys, step, lock=lock)
        got = tri.find_or_insert(keys, step, lock=lock)
        assert_same_result(got, want, f"step {step}")
        assert_same_state(tri, ref, f"step {step}")
    assert int((want.slots < 0).sum()) > 0 and want.evicted_keys.numel() > 0


@pytest.mark.parametrize("index_class", [KeyIndex, TritonKeyIndex])
def test_given_order_claims_ways_in_the_order_given(index_class):
    """One bucket: by default the misses claim ways in key order; with ``given_order`` in the order
    given, which is the same for sorted keys."""
    def ways(keys, given):
        index = index_class(4, "lru", DEVICE, max_slots=4)
        res = index.find_or_insert(torch.tensor(keys, device=DEVICE), 1, given_order=given)
        return res.slots.tolist()

    assert ways([5, 3, 9], False) == [1, 0, 2]
    assert ways([5, 3, 9], True) == [0, 1, 2]
    assert ways([3, 5, 9], True) == ways([3, 5, 9], False) == [0, 1, 2]


def test_find_hashes_like_the_reference():
    """Keys placed by the reference in many buckets are found by the Triton probe (in-kernel hash)."""
    ref = KeyIndex(8, "lru", DEVICE, initial_slots=8 * 512)
    gen = torch.Generator().manual_seed(0)
    keys = torch.cat([torch.tensor(POOL), torch.randint(-(2**62), 2**62, (200,), generator=gen)])
    keys = torch.unique(keys).to(DEVICE)
    ref.find_or_insert(keys, step=1)
    tri = TritonKeyIndex(8, "lru", DEVICE, initial_slots=8 * 512)
    for name in ("keys", "values", "scores", "locks"):
        setattr(tri, name, getattr(ref, name).clone())
    absent = torch.tensor([2, 3, -2, INT64_MAX - 1, RESERVED_KEY], dtype=torch.int64, device=DEVICE)
    probe = torch.cat([keys, absent])
    assert torch.equal(tri.find(probe), ref.find(probe))
    assert bool((tri.find(keys) >= 0).all())
    assert int(tri.find(probe)[-1]) == -1  # the empty mark is never found


def test_empty_calls():
    for cls in (KeyIndex, TritonKeyIndex):
        index = cls(4, "lru", DEVICE, max_slots=8)
        none = torch.empty(0, dtype=torch.int64, device=DEVICE)
        assert index.find(none).numel() == 0
        res = index.find_or_insert(none, step=1)
        assert res.slots.numel() == 0 and res.evicted_keys.numel() == 0


@pytest.mark.parametrize("step_on_device", [False, True])
@pytest.mark.parametrize("locking", [True, False])
@pytest.mark.parametrize("guarded", [False, True])
def test_find_touch_with_a_device_count_and_guard(guarded, locking, step_on_device):
    """find_touch on padded keys: only keys[:valid] count, and a nonzero guard changes nothing; the
    Triton index equals the reference, whose sliced probe is the plain ``find``. An index made with
    ``locking=False`` does not lock the keys found. The step may come from the device (a captured
    probe): the LRU region's scores are that step."""
    regions = [Region("lru", None, 16), Region("lfu", None, 16)]
    ref, tri = (cls(4, device=DEVICE, regions=regions, locking=locking) for cls in (KeyIndex, TritonKeyIndex))
    keys = torch.tensor([5, 6, 7, 8, 9, 10], dtype=torch.int64, device=DEVICE)
    tables = torch.tensor([0, 1, 0, 1, 0, 1], dtype=torch.int64, device=DEVICE)
    for index in (ref, tri):
        index.find_or_insert(keys[:4], 1, tables=tables[:4])
    before = {name: getattr(ref, name).clone() for name in ("keys", "values", "scores", "locks")}
    padded = torch.cat([keys[2:], torch.full((3,), 99, dtype=torch.int64, device=DEVICE)])  # 4 real
    ptables = torch.cat([tables[2:], torch.zeros(3, dtype=torch.int64, device=DEVICE)])
    counts = torch.full_like(padded, 2)
    valid = torch.tensor([4], device=DEVICE)
    guard = torch.tensor([0, 0, 0, -3 if guarded else 0], device=DEVICE)  # any nonzero entry guards
    step = torch.tensor(3, device=DEVICE) if step_on_device else 3
    got = tri.find_touch(padded, ptables, step, counts, valid, guard)
    want = ref.find_touch(padded, ptables, 3, counts, valid, guard)
    assert torch.equal(got[0][:4], want[0][:4]) and torch.equal(got[1][:4], want[1][:4])
    assert torch.equal(got[2], want[2])
    assert torch.equal(want[0][:4] >= 0, torch.tensor([True, True, False, False], device=DEVICE))
    # misses, keys and contested keys per region (padding not counted)
    assert got[2].tolist() == [1, 1, 2, 2, 0, 0]
    assert_same_state(tri, ref, f"guarded={guarded}")
    changed = [name for name, t in before.items() if not torch.equal(getattr(ref, name), t)]
    assert changed == ([] if guarded else ["scores", "locks"] if locking else ["scores"])


@pytest.mark.parametrize("regions", [1, 3])
def test_find_touch_of_one_index_among_several_tables(regions):
    """find_touch with ``first_table``: the keys carry tables numbered across several indexes (here
    2 before this index's, 2 after), and only those of this index's tables (first_table ..
    first_table + regions - 1) are probed, touched and counted, their slots and values written into
    the shared outputs at their own positions, every other entry left as it was. The same as the plain
    probe of just those keys, with the tables made local (and as the reference does it)."""
    rng = random.Random(regions)
    first, total = 2, regions + 4
    made = [[Region("lfu", None, 16) for _ in range(regions)], KeyIndex, TritonKeyIndex]
    plain, ref, tri = (cls(4, device=DEVICE, regions=made[0]) for cls in (KeyIndex, *made[1:]))
    keys = torch.tensor(rng.sample(POOL, 40), dtype=torch.int64, device=DEVICE)
    tables = torch.tensor([rng.randrange(total) for _ in range(40)], dtype=torch.int64, device=DEVICE)
    mine = (tables >= first) & (tables < first + regions)
    for index in (plain, ref, tri):  # half of this index's keys stored
        index.find_or_insert(keys[mine][::2], 1, tables=tables[mine][::2] - first)
    counts = torch.arange(40, dtype=torch.int64, device=DEVICE) % 3 + 1
    valid = torch.tensor([36], device=DEVICE)  # the last 4 are padding
    mine[36:] = False
    want_slots, want_values, want_counts = plain.find_touch(keys[mine], tables[mine] - first, 5, counts[mine])
    for index in (ref, tri):
        out = tuple(torch.full((40,), -7, dtype=torch.int64, device=DEVICE) for _ in range(2))
        slots, values, per_region = index.find_touch(keys, tables, 5, counts, valid, first_table=first,
                                                     out=out)
        assert slots is out[0] and values is out[1]
        assert torch.equal(slots[mine], want_slots) and torch.equal(values[mine], want_values)
        assert bool((slots[~mine] == -7).all()) and bool((values[~mine] == -7).all())
        assert torch.equal(per_region, want_counts)
        assert_same_state(index, plain, f"{type(index).__name__}, {regions} regions")
    assert int(want_counts[regions : 2 * regions].sum()) == int(mine.sum()) > 0
    assert int(want_counts[:regions].sum()) > 0


@pytest.mark.parametrize("guarded", [False, True])
@pytest.mark.slow
def test_find_touch_contests_the_misses_of_buckets_an_earlier_batch_holds(guarded):
    """``contest``: an absent key of a bounded region whose bucket holds a way locked before the call
    (an earlier batch in flight) gets slot CONTESTED and is counted apart from the misses; the keys
    found are locked as usual, and this call's own locks contest nothing, whatever order the kernel's
    programs run in (a batch of several programs). Both indexes against the definition, computed in
    plain Python from the index's state before the call; the unbounded region contests nothing."""
    regions = [Region("lru", 2048, 16), Region("lru", None, 2048)]
    ref, tri = (cls(4, device=DEVICE, regions=regions) for cls in (KeyIndex, TritonKeyIndex))
    rng = random.Random(7)
    keys = torch.tensor(rng.sample(range(-(2**40), 2**40), 2400), dtype=torch.int64, device=DEVICE)
    tables = torch.tensor([rng.randrange(2) for _ in range(2400)], dtype=torch.int64, device=DEVICE)
    for index in (ref, tri):
        index.find_or_insert(keys[:1200], 1, tables=tables[:1200])
        index.find_or_insert(keys[:1200:5], 2, lock=True, tables=tables[:1200:5])  # in flight
    batch, btables = keys[600:2100], tables[600:2100]  # 600 stored, 900 new: two programs
    stored = {(int(k), int(t)): s for s, (k, t) in enumerate(zip(ref.keys.tolist(), ref.region_of_slots(
        torch.arange(ref.keys.numel(), device=DEVICE)).tolist())) if k != RESERVED_KEY}
    bucket = ref._bucket(batch, btables).tolist()
    held = [any(ref.locks[b * 4 : b * 4 + 4].tolist()) for b in bucket]
    want_slots = [stored.get((k, t), CONTESTED if (t == 0 and h) else -1)
                  for k, t, h in zip(batch.tolist(), btables.tolist(), held)]
    counts = torch.ones_like(batch)
    guard = torch.tensor([int(guarded)], device=DEVICE)
    locks_before = ref.locks.clone()
    for index in (ref, tri):
        slots, values, per_region = index.find_touch(batch, btables, 3, counts, guard=guard, contest=True)
        assert slots.tolist() == want_slots, type(index).__name__
        assert torch.equal(values, torch.where(slots >= 0, index.values[slots.clamp(min=0)], -1))
        want = [sum(1 for s, t in zip(want_slots, btables.tolist()) if cond(s) and t == r)
                for cond in (lambda s: s == -1, lambda s: True, lambda s: s == CONTESTED) for r in range(2)]
        assert per_region.tolist() == want
    assert_same_state(tri, ref, f"guarded={guarded}")
    found = torch.tensor([s for s in want_slots if s >= 0], dtype=torch.int64, device=DEVICE)
    added = torch.zeros_like(locks_before).index_add_(0, found, torch.ones_like(found, dtype=torch.int32))
    assert torch.equal(ref.locks, locks_before + (0 if guarded else added))
    # the definition is met both ways, among the new keys of the bounded region
    absent = sum(1 for s, t in zip(want_slots, btables.tolist()) if s < 0 and t == 0)
    assert 0 < want_slots.count(CONTESTED) < absent


def check_upsert(index: KeyIndex, model: dict, keys: torch.Tensor, tables: torch.Tensor | None,
                 pool: torch.Tensor, step: int) -> int:
    """One ``upsert`` against a dict of (region, key) -> value: keys already there keep their value,
    new ones take distinct pool addresses (exactly ``pool[:taken]``), a key left out (-1) is not
    stored; the index then finds exactly the model's keys with their values and scores ``step``.
    Returns the keys left out."""
    regions = torch.zeros_like(keys) if tables is None else tables
    pairs = list(zip(regions.tolist(), keys.tolist()))
    before = dict(model)
    values, (taken, left_out) = index.upsert(keys, tables, pool, step)
    new = []
    for pair, value in zip(pairs, values.tolist()):
        if pair in before:
            assert value == before[pair], pair
        elif value >= 0:
            new.append(value)
            model[pair] = value
    assert sorted(new) == sorted(pool[:taken].tolist())
    assert left_out == sum(v < 0 for v in values.tolist())
    slots = index.find(keys, tables)
    assert torch.equal(slots >= 0, values >= 0)
    placed = slots >= 0
    assert torch.equal(index.values[slots[placed]], values[placed])
    assert not index.scored or bool((index.scores[slots[placed]] == step).all())
    for r in range(len(index.regions)):
        assert index.size(r) == sum(1 for (t, _) in model if t == r)
    return left_out


@pytest.mark.parametrize("scores", [True, False], ids=["scores", "no scores"])
@pytest.mark.parametrize("index_class", [KeyIndex, TritonKeyIndex])
def test_upsert_stores_absent_keys_with_pool_addresses(index_class, scores):
    """Unbounded regions that start tiny: the reference grows as it inserts; the Triton index leaves
    out the keys of full buckets until ``reserve_regions`` grows it, never losing or duplicating."""
    rng = random.Random(5)
    index = index_class(4, "lru", DEVICE, regions=[Region("lru", None, 8), Region("lru", None, 8)],
                        locking=scores, scores=scores)
    model: dict = {}
    next_address, left = 0, 0
    for step in range(1, 7):
        keys, tables = _pairs(rng, rng.randint(1, 40), 2)
        pool = torch.arange(next_address, next_address + keys.numel(), device=DEVICE)
        left += check_upsert(index, model, keys, tables, pool, step)
        next_address += keys.numel()
        index.reserve_regions([2 * index.size(r) for r in range(2)])
    assert (left > 0) == (index_class is TritonKeyIndex)  # the tiny start fills buckets


def test_upsert_refuses_a_bounded_or_lfu_index():
    pool = torch.arange(4, device=DEVICE)
    for kwargs in ({"max_slots": 8}, {"policy": "lfu"}):
        for cls in (KeyIndex, TritonKeyIndex):
            index = cls(4, device=DEVICE, **kwargs)
            with pytest.raises(ValueError, match="unbounded and LRU"):
                index.upsert(torch.tensor([1, 2], device=DEVICE), None, pool, 1)


def test_host_store_writes_keys_left_out_by_a_full_bucket():
    """A host store over the Triton index (tiny regions, so the upsert leaves keys out): every row
    set is read back, as from a plain dict, and the sizes count each pair once."""
    from tieredemb.storage.backend import DictBackend
    from tieredemb.storage.host import HostMemoryBackend

    width = 3
    store = HostMemoryBackend(width, bucket_width=4, tables=2, device=DEVICE)
    store._index = TritonKeyIndex(4, device=DEVICE, regions=[Region("lru", None, 8), Region("lru", None, 8)])
    want = [DictBackend(width), DictBackend(width)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        keys = torch.randint(0, 150, (120,), generator=gen).to(DEVICE)
        tables = torch.randint(0, 2, (120,), generator=gen).to(DEVICE)
        rows = torch.randn(120, width, generator=gen).to(DEVICE)
        store.set(keys, rows, tables)
        for t in range(2):  # a plain sequence of sets: the last row of a repeated key wins
            for k, row in zip(keys[tables == t].tolist(), rows[tables == t]):
                want[t].set(torch.tensor([k]), row[None])
    for t in range(2):
        keys = torch.arange(-5, 160, device=DEVICE)
        got = store.get(keys, torch.full_like(keys, t))
        ref = want[t].get(keys.cpu())
        assert torch.equal(got.found.cpu(), ref.found)
        assert torch.equal(got.rows.cpu(), ref.rows)
        assert store.size(t) == want[t].size()


def _insert_rows_in_lockstep(ref: KeyIndex, tri: TritonKeyIndex, keys, tables, counts, step: int,
                             next_address: int, msg: str, own_rows: torch.Tensor | None = None):
    """``find_touch`` then ``insert_rows`` (the pool: the next addresses from ``next_address``, or
    each pair's ``own_rows``) on both indexes: the same answers and state. Returns the reference's
    (slots, values, positions, rows, counts per region)."""
    answers = []
    for index in (ref, tri):
        slots, values, _ = index.find_touch(keys, tables, step, counts)
        misses = int((slots == -1).sum())
        pool = own_rows if own_rows is not None else torch.arange(next_address, next_address + misses,
                                                                  device=DEVICE)
        answers.append((slots, values, *index.insert_rows(keys, tables, counts, slots, values, misses,
                                                          step, pool, own_rows=own_rows is not None)))
    for got, want in zip(answers[1], answers[0]):
        assert torch.equal(got, want), msg
    assert_same_state(tri, ref, msg)
    return answers[0]


@pytest.mark.parametrize("policy", ["lru", "lfu", "mixed"])
@pytest.mark.parametrize("seed", [0, 1])
def test_insert_rows_gives_every_miss_a_row(policy, seed):
    """``insert_rows`` (regions all bounded, the staged insertion without a host read): the Triton
    index equal to the reference in lockstep, both equal to ``find_or_insert`` (the host-read path)
    run on a twin index, and each miss's row where the definition puts it: a victim's row reused,
    the pool's next address for an empty way, an address from the pool's end for a key left without
    a way (batches stay locked a while, so buckets fill with locked ways)."""
    rng = random.Random(seed)
    width = 4
    policies = {"lru": ("lru", "lru"), "lfu": ("lfu", "lfu"), "mixed": ("lru", "lfu")}[policy]
    regions = [Region(p, 3 * width, 8) for p in policies]
    ref, tri, twin = (cls(width, device=DEVICE, regions=regions)
                      for cls in (KeyIndex, TritonKeyIndex, KeyIndex))
    in_flight: list[tuple[torch.Tensor, torch.Tensor]] = []
    next_address, fresh_total, lacking_total, victims_total = 0, 0, 0, 0
    for step in range(1, 10):
        keys, tables = _pairs(rng, rng.randint(0, 24), 2)
        counts = torch.tensor([rng.randint(1, 3) for _ in range(keys.numel())], dtype=torch.int64,
                              device=DEVICE)
        msg = f"step {step}"
        slots, values, pos, rows, per_region = _insert_rows_in_lockstep(ref, tri, keys, tables, counts, step,
                                                                        next_address, msg)
        res = twin.find_or_insert(keys, step, counts, lock=True, tables=tables, given_order=True)
        assert torch.equal(res.slots, slots), msg
        fresh = res.inserted & (res.values < 0)
        twin.assign(res.slots[fresh], values[fresh])
        assert_same_state(twin, ref, msg)
        # the definition, by hand: rows by kind
        misses = pos.numel()
        taken, lacking, evicted = (per_region[k].sum().item() for k in range(3))
        assert evicted == res.evicted_keys.numel() and lacking == res.unplaced, msg
        assert torch.equal(per_region[2], torch.bincount(res.evicted_tables, minlength=2)), msg
        assert taken + lacking + evicted == misses, msg
        assert torch.equal(values[pos], rows), msg
        got_rows = sorted(rows.tolist())
        want_rows = sorted(list(range(next_address, next_address + taken))
                           + list(range(next_address + misses - lacking, next_address + misses))
                           + res.evicted_values.tolist())
        assert got_rows == want_rows, msg
        placed = slots >= 0
        assert torch.equal(ref.values[slots[placed]], values[placed]), msg  # the index's rows are the batch's
        assert int((slots[pos] < 0).sum()) == lacking, msg
        next_address += misses
        fresh_total, lacking_total, victims_total = (fresh_total + taken, lacking_total + lacking,
                                                     victims_total + evicted)
        in_flight.append((keys[placed], tables[placed]))
        if len(in_flight) > 2:  # the oldest batch is released
            gone = in_flight.pop(0)
            for index in (ref, tri, twin):
                index.unlock(*gone)
    assert fresh_total and victims_total and lacking_total  # each kind of row was exercised


@pytest.mark.parametrize("scores", [True, False], ids=["scores", "no scores"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("seed", [0, 1])
def test_insert_rows_leaves_a_full_bucket_of_an_unbounded_region_to_the_caller(policy, seed, scores):
    """``insert_rows`` of unbounded regions (the device insertion of tables that grow) does not grow
    them: a bucket's misses take its empty ways, by hand from the index before the call; those that
    find no empty way keep slot -1 and take addresses from the pool's end, the others the pool's
    next ones; the Triton index equal to the reference in lockstep, the capacity unchanged."""
    rng = random.Random(seed)
    width = 4
    regions = [Region(policy, None, 8), Region(policy, None, 16)]  # 2 and 4 buckets: they fill
    ref, tri = (cls(width, device=DEVICE, regions=regions, locking=False, scores=scores)
                for cls in (KeyIndex, TritonKeyIndex))
    next_address, lacking_total = 0, 0
    for step in range(1, 6):
        keys, tables = _pairs(rng, rng.randint(1, 20), 2)
        counts = torch.ones_like(keys)
        bucket = ref._bucket(keys, tables)
        empty_ways = (ref.keys.view(-1, width) == RESERVED_KEY).sum(1)
        msg = f"step {step}"
        slots, values, pos, rows, per_region = _insert_rows_in_lockstep(ref, tri, keys, tables, counts, step,
                                                                        next_address, msg)
        assert ref.capacity() == tri.capacity() == 24, msg
        missed = bucket[pos]  # by hand: a bucket's first misses (claim order) fill its empty ways
        want_lacking = sum(max(0, int((missed == b).sum()) - int(empty_ways[b])) for b in missed.unique())
        taken, lacking, evicted = (per_region[k].sum().item() for k in range(3))
        assert (lacking, evicted, taken + lacking) == (want_lacking, 0, pos.numel()), msg
        assert int((slots[pos] == -1).sum()) == lacking, msg
        assert sorted(rows[slots[pos] >= 0].tolist()) == list(range(next_address, next_address + taken)), msg
        assert sorted(rows[slots[pos] == -1].tolist()) == list(range(next_address + taken,
                                                                     next_address + pos.numel())), msg
        assert torch.equal(values[pos], rows), msg
        next_address += pos.numel()
        lacking_total += lacking
    assert lacking_total  # some buckets were full


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "unbounded"])
def test_padded_insert_rows_is_the_insert_rows_of_its_misses(bounded):
    """``insert_rows(padded=True)`` (what ``DeviceTier`` captures in a CUDA graph): the pairs past
    the batch's marked found (slot 0), ``misses`` a bound of the misses and the pool as long with
    garbage past them, the step on the device; the same slots, values, rows, counts and index as the
    plain call on a twin index, and rows -1 past the misses. Evictions (bounded) and full buckets
    (unbounded) included."""
    rng = random.Random(5)
    width = 4
    regions = ([Region("lru", 3 * width, 8), Region("lfu", 3 * width, 8)] if bounded
               else [Region("lru", None, 8), Region("lfu", None, 16)])
    plain, padded = (TritonKeyIndex(width, device=DEVICE, regions=regions, locking=bounded) for _ in range(2))
    kinds = torch.zeros(3, dtype=torch.int64)
    for step in range(1, 8):
        keys, tables = _pairs(rng, rng.randint(1, 24), 2)
        counts = torch.tensor([rng.randint(1, 3) for _ in range(keys.numel())], device=DEVICE)
        u, extra, msg = keys.numel(), rng.randint(0, 9), f"step {step}"
        slots, values, _ = plain.find_touch(keys, tables, step, counts)
        misses = int((slots == -1).sum())
        pool = torch.arange(100 * step, 100 * step + misses, device=DEVICE)
        want = plain.insert_rows(keys, tables, counts, slots, values, misses, step, pool)

        def pad(t: torch.Tensor, n: int, fill: int) -> torch.Tensor:
            return torch.cat([t, torch.full((n,), fill, dtype=t.dtype, device=DEVICE)])

        pslots, pvalues, _ = padded.find_touch(keys, tables, step, counts)
        pslots, pvalues = pad(pslots, extra, 0), pad(pvalues, extra, 77)
        bound = min(misses + rng.randint(0, 5), u + extra)  # as padded_size: misses <= bound <= pairs
        pos, rows, per_region = padded.insert_rows(
            pad(keys, extra, 3), pad(tables, extra, 1), pad(counts, extra, 1), pslots, pvalues, bound,
            torch.tensor(step, device=DEVICE), pad(pool, bound - misses, -7), padded=True)
        assert torch.equal(pslots[:u], slots) and torch.equal(pvalues[:u], values), msg
        assert torch.equal(pos[:misses], want[0]) and torch.equal(rows[:misses], want[1]), msg
        assert bool((rows[misses:] == -1).all()) and torch.equal(per_region, want[2]), msg
        assert torch.equal(pvalues[u:], torch.full((extra,), 77, device=DEVICE)), msg  # not touched
        assert_same_state(padded, plain, msg)
        kinds += want[2].sum(1).cpu()
        if bounded and step % 2 == 0:  # batches go: their locks with them
            for index in (plain, padded):
                index.unlock(keys, tables)
    assert bool((kinds[:2] > 0).all()) and (kinds[2] > 0 or not bounded), kinds  # rows of each kind


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_insert_rows_with_own_rows(policy):
    """``insert_rows(own_rows=True)`` (``place_overflow``: pairs trained before they had a slot):
    each miss takes its own row, placed or not, found pairs keep theirs; a bucket's misses past its
    empty ways stay at slot -1; the Triton index equal to the reference in lockstep. Refused for an
    index that evicts and for a pool that is not one row a pair, changing nothing."""
    rng = random.Random(3)
    width = 4
    regions = [Region(policy, None, 8), Region(policy, None, 16)]
    ref, tri = (cls(width, device=DEVICE, regions=regions, locking=False)
                for cls in (KeyIndex, TritonKeyIndex))
    lacking_total = 0
    for step in range(1, 6):
        keys, tables = _pairs(rng, rng.randint(1, 20), 2)
        counts = torch.ones_like(keys)
        own = torch.tensor(rng.sample(range(1000, 2000), keys.numel()), device=DEVICE)
        before = ref.find(keys, tables)
        stored = torch.where(before >= 0, ref.values[before.clamp(min=0)], -1)
        slots, values, pos, rows, per_region = _insert_rows_in_lockstep(ref, tri, keys, tables, counts, step,
                                                                        0, f"step {step}", own)
        miss = before < 0
        assert torch.equal(values, torch.where(miss, own, stored)) and torch.equal(rows, own[pos])
        placed = miss & (slots >= 0)
        assert torch.equal(ref.values[slots[placed]], own[placed])
        lacking = int(per_region[1].sum())
        assert int((slots[miss] == -1).sum()) == lacking and int(per_region[0].sum()) == int(placed.sum())
        lacking_total += lacking
    assert lacking_total  # some buckets were full
    bounded = KeyIndex(4, device=DEVICE, max_slots=8)
    keys = torch.tensor([5, 6, 7], device=DEVICE)
    for index, pool in ((bounded, keys), (ref, keys[:2])):
        slots, values = torch.full_like(keys, -1), torch.full_like(keys, -1)
        state = [t.clone() for t in (index.keys, index.values, index.scores)]
        with pytest.raises(ValueError, match="own rows need one row for each of the 3 pairs"):
            index.insert_rows(keys, torch.zeros_like(keys), torch.ones_like(keys), slots, values, 3, 9, pool,
                              own_rows=True)
        assert all(torch.equal(a, b) for a, b in zip((index.keys, index.values, index.scores), state))


@pytest.mark.parametrize("index_class", [KeyIndex, TritonKeyIndex])
def test_insert_rows_refuses_a_short_pool(index_class):
    """A pool with fewer rows than misses raises before anything changes."""
    keys = torch.tensor([5, 6, 7], device=DEVICE)
    tables = torch.zeros_like(keys)
    counts = torch.ones_like(keys)
    bounded = index_class(4, device=DEVICE, max_slots=8)
    slots, values, _ = bounded.find_touch(keys, tables, 1, counts)
    before = [t.clone() for t in (bounded.keys, bounded.values, bounded.scores, bounded.locks)]
    with pytest.raises(ValueError, match="a pool of 2 rows for 3 misses"):
        bounded.insert_rows(keys, tables, counts, slots, values, 3, 1, torch.arange(2, device=DEVICE))
    after = (bounded.keys, bounded.values, bounded.scores, bounded.locks)
    assert all(torch.equal(a, b) for a, b in zip(after, before)) and bounded.size() == 0
    assert torch.equal(slots, torch.full_like(slots, -1))
