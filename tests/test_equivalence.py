"""Training equals DESIGN section 2's reference (tests/conftest.py ``DenseReference``).

Every test trains a collection and the reference side by side on the same batches, with the same rows
written into both, and compares each step's output and, at the end, every stored row and its optimizer
state. Hypothesis draws the tables (mixed dims, shared tables, bounded and raw-id tables, sum and mean
pooling, weights) and 20 batches (empty bags, all-empty batches, single ids, duplicates within a bag
and across the features of a shared table, features in any order).
"""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tieredemb as te
from tests.conftest import (
    INT64_MAX,
    OPTIMIZERS,
    RAW_KEYS,
    Batch,
    DenseReference,
    assert_outputs_close,
    assert_snapshot_equal,
    assert_tables_match_reference,
    feature_dims,
    feature_order,
    initial_rows,
    make_optimizer,
    probed_init,
    random_batch,
    random_upstream,
    snapshot,
    sorted_export,
    weighted_loss,
)
from tieredemb.storage.tiers.device import DeviceTier

STEPS = 20
SCHEDULES = ["prefetch", "pipelined", "deferred"]  # besides "plain": see train_side_by_side
HYPOTHESIS = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Scenario:
    """Tables, the keys each may see, the keys written up front, and the batches to train on."""

    tables: list[te.TableConfig]
    pools: dict[str, list[int]]  # table -> keys its features draw from
    written: dict[str, list[int]]  # table -> keys written (ebc.write) before training
    batches: list[Batch]
    seed: int = 0  # rows written and upstream gradients


# --------------------------------------------------------------------------------------------------
# Driving a collection and the reference side by side
# --------------------------------------------------------------------------------------------------


def build_pair(module: type, scenario: Scenario, optimizer: str, seed: int = 0, **kwargs):
    """A collection and its reference, with the scenario's written rows in both."""
    opt = make_optimizer(optimizer)
    collection = module(scenario.tables, optimizer=opt, seed=seed, **kwargs)
    pooled = module is te.EmbeddingBagCollection
    init = probed_init(scenario.tables, scenario.pools, seed, module=module)
    reference = DenseReference(scenario.tables, opt, pooled=pooled, init=init)
    gen = torch.Generator().manual_seed(scenario.seed)
    for t in scenario.tables:
        keys = scenario.written.get(t.name, [])
        if keys:
            rows = torch.rand(len(keys), t.embedding_dim, generator=gen) - 0.5
            collection.write(t.name, torch.tensor(keys, dtype=torch.int64), rows)
            reference.write(t.name, keys, rows)
    return collection, reference


def train_side_by_side(
    collection, reference: DenseReference, batches, gen: torch.Generator, schedule: str = "plain"
) -> None:
    """One step per batch on both; outputs compared at every step.

    schedule: "plain" (forward, backward), "prefetch" (prefetch(i), forward(i), backward(i)),
    "pipelined" (forward(i), prefetch(i + 1), backward(i): the next batch is resolved before this
    batch's update lands, as a training pipeline does) or "deferred" (the same with
    prefetch_deferred: batch i+1's host half waits for its forward, after backward i).
    """
    tables = reference.configs
    kjts = [batch.kjt() for batch in batches]
    ahead = collection.prefetch_deferred if schedule == "deferred" else collection.prefetch
    if schedule in ("pipelined", "deferred") and kjts:
        ahead(kjts[0])
    for step, batch in enumerate(batches):
        upstream = random_upstream(gen, batch, tables, pooled=reference.pooled)
        if schedule == "prefetch":
            collection.prefetch(kjts[step])
        out = collection(kjts[step])
        if schedule in ("pipelined", "deferred") and step + 1 < len(kjts):
            ahead(kjts[step + 1])
        weighted_loss(out, upstream).backward()
        want = reference.train_step(batch, upstream)
        assert_outputs_close(out, want, f"step {step + 1}")


def check_scenario(module: type, scenario: Scenario, optimizer: str, schedule: str = "plain") -> None:
    collection, reference = build_pair(module, scenario, optimizer)
    gen = torch.Generator().manual_seed(scenario.seed + 1)
    train_side_by_side(collection, reference, scenario.batches, gen, schedule)
    assert_tables_match_reference(collection, reference, f"after {len(scenario.batches)} steps")


# --------------------------------------------------------------------------------------------------
# Hypothesis strategies
# --------------------------------------------------------------------------------------------------


INITIALIZERS = [te.init.Uniform(-0.01, 0.01), te.init.Normal(0.0, 0.1), te.init.Constant(0.25)]


@st.composite
def table_configs(draw, pooled: bool):
    """1-3 tables: mixed dims, 1-2 features each (shared tables), bounded or raw-id keys, mixed
    initializers and eviction policies (tables of one dim are batched together)."""
    tables, pools = [], {}
    for i in range(draw(st.integers(1, 3))):
        n_features = draw(st.integers(1, 2))
        # Feature names deliberately not in sorted order inside a table.
        features = [f"t{i}_f{n_features - j}" for j in range(n_features)]
        if draw(st.booleans()):
            n = draw(st.integers(1, 6))
            num_embeddings, pool = n, list(range(n))
        else:
            num_embeddings = None
            pool = draw(st.lists(st.sampled_from(RAW_KEYS), min_size=1, max_size=5, unique=True))
        tables.append(
            te.TableConfig(
                name=f"table{i}",
                # dims repeat often: tables of one dim share an index and a row store (a group)
                embedding_dim=draw(st.sampled_from([1, 2, 2, 3, 3, 8])),
                feature_names=features,
                num_embeddings=num_embeddings,
                pooling=draw(st.sampled_from(["sum", "mean"])) if pooled else "sum",
                initializer=draw(st.sampled_from(INITIALIZERS)),
                eviction=draw(st.sampled_from(["lru", "lfu"])),
            )
        )
        pools[tables[-1].name] = pool
    return tables, pools


@st.composite
def batches(draw, tables: list[te.TableConfig], pools: dict[str, list[int]], weighted: bool):
    """One batch: B in 1..3, bags of 0..3 ids from the table's pool, sometimes no id at all."""
    b = draw(st.integers(1, 3))
    features = feature_order(tables)
    all_empty = draw(st.integers(0, 7)) == 0
    bags, weights = {}, {} if weighted else None
    # Positive weights (no cancellation that only summation order decides) and exact zeros: a row
    # touched with a zero gradient still takes its optimizer step (Adam's moments decay).
    weight = st.one_of(st.just(0.0), st.floats(0.25, 2.0, width=32))
    for t in tables:
        bag = st.lists(st.sampled_from(pools[t.name]), max_size=0 if all_empty else 3)
        for f in t.feature_names:
            bags[f] = [draw(bag) for _ in range(b)]
            if weights is not None:
                weights[f] = [draw(st.lists(weight, min_size=len(x), max_size=len(x))) for x in bags[f]]
    return Batch(bags, weights, key_order=draw(st.permutations(features)))


@st.composite
def scenarios(draw, pooled: bool):
    tables, pools = draw(table_configs(pooled))
    weighted = pooled and draw(st.booleans())
    written = {t: draw(st.lists(st.sampled_from(p), unique=True)) for t, p in pools.items()}
    steps = [draw(batches(tables, pools, weighted)) for _ in range(STEPS)]
    return Scenario(tables, pools, written, steps, seed=draw(st.integers(0, 2**16)))


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@HYPOTHESIS
@given(data=st.data())
def test_embedding_bag_collection_matches_reference(optimizer, data):
    scenario = data.draw(scenarios(pooled=True))
    schedule = data.draw(st.sampled_from(["plain", *SCHEDULES]))
    check_scenario(te.EmbeddingBagCollection, scenario, optimizer, schedule)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@HYPOTHESIS
@given(data=st.data())
def test_embedding_collection_matches_reference(optimizer, data):
    scenario = data.draw(scenarios(pooled=False))
    schedule = data.draw(st.sampled_from(["plain", *SCHEDULES]))
    check_scenario(te.EmbeddingCollection, scenario, optimizer, schedule)


def edge_scenario(weighted: bool) -> Scenario:
    """Hand-written corner cases, cycled to 20 steps: the same as Hypothesis draws, but always run."""
    tables = [
        te.TableConfig("shared", 3, ["u", "v"]),
        te.TableConfig("small", 2, ["w"], num_embeddings=4, pooling="mean"),
    ]
    pools = {"shared": [5, 7, -1, INT64_MAX], "small": [0, 1, 2, 3]}
    cycle = [
        {"u": [[], []], "v": [[], []], "w": [[], []]},  # a batch with no id at all
        {"u": [[5], []], "v": [[], []], "w": [[], []]},  # one id
        {"u": [[5, 5, 5], [7]], "v": [[7, 5], []], "w": [[1, 1], [3]]},  # duplicates in a bag
        {"u": [[INT64_MAX]], "v": [[INT64_MAX, -1]], "w": [[0]]},  # duplicates across features
        {"u": [[], [-1], []], "v": [[-1], [], [7, 7]], "w": [[], [2], [2, 2, 2]]},
    ]
    steps = []
    for i in range(STEPS):
        bags = cycle[i % len(cycle)]
        weights = None
        if weighted:
            weights = {f: [[0.5 + 0.25 * j for j in range(len(bag))] for bag in fb] for f, fb in bags.items()}
        order = ["w", "v", "u"] if i % 2 else ["u", "v", "w"]
        steps.append(Batch(bags, weights, key_order=order))
    return Scenario(tables, pools, {"shared": [5, -1], "small": [0, 3]}, steps, seed=7)


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_edge_batches_match_reference(optimizer, weighted):
    check_scenario(te.EmbeddingBagCollection, edge_scenario(weighted), optimizer)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_edge_batches_match_reference_sequence(optimizer):
    check_scenario(te.EmbeddingCollection, edge_scenario(weighted=False), optimizer)


@pytest.mark.parametrize(
    "storage",
    [
        None,
        te.StorageConfig(bucket_width=4, segment_rows=64),
        te.StorageConfig(bucket_width=1, segment_rows=5),
    ],
    ids=["default", "narrow_buckets", "one_slot_buckets"],
)
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
@pytest.mark.slow
def test_thousands_of_keys_grow_the_table_and_match_reference(optimizer, storage):
    """Enough distinct raw ids that the index and the row store grow many times during training."""
    gen = torch.Generator().manual_seed(42)
    raw = torch.randint(-(2**63) + 1, 2**63 - 1, (2000,), generator=gen, dtype=torch.int64)
    pool = sorted(set(raw.tolist()) - {te.RESERVED_KEY})
    tables = [te.TableConfig("big", 4, ["a", "b"], pooling="mean"), te.TableConfig("wide", 16, ["c"])]
    steps = [
        random_batch(gen, {"a": pool, "b": pool[:300], "c": pool}, batch_size=48, max_bag=6)
        for _ in range(STEPS)
    ]
    scenario = Scenario(tables, {"big": pool, "wide": pool}, {"big": pool[:50]}, steps, seed=4)
    kwargs = {} if storage is None else {"storage": storage}
    collection, reference = build_pair(te.EmbeddingBagCollection, scenario, optimizer, **kwargs)
    assert collection.storage_mode == "hbm_direct"
    train_side_by_side(collection, reference, steps, gen)
    assert_tables_match_reference(collection, reference, "after growth")


@pytest.mark.parametrize("mode", ["hbm_direct", "hybrid"])
def test_init_capacity_allocates_up_front_and_trains_as_the_reference(mode):
    """``init_capacity``: the rows and an index for them exist before the first batch, and ~5k new
    keys (more than the 4096 an index without it starts with) go in without a rehash; the tables
    train as a dense reference does. The same tables without it rehash on these batches."""
    gen = torch.Generator().manual_seed(11)
    pool = list(range(10**12, 10**12 + 9000))
    tables = [te.TableConfig("grow", 4, ["a", "b"], init_capacity=7000),
              te.TableConfig("held", 8, ["c"], max_capacity=1000, init_capacity=100, eviction="lfu")]
    steps = [random_batch(gen, {"a": pool, "b": pool[:3000], "c": pool[:600]}, batch_size=256, max_bag=8)
             for _ in range(4)]
    scenario = Scenario(tables, {"grow": pool, "held": pool[:600]}, {}, steps, seed=5)
    storage = te.StorageConfig(segment_rows=512)
    if mode == "hybrid":  # half the budget each: 2048 rows of "grow" on the device, the rest up front
        storage = te.StorageConfig(segment_rows=512, hbm_budget=2 * 2048 * 4 * 4, caching=False)
    collection, reference = build_pair(te.EmbeddingBagCollection, scenario, "sgd", storage=storage)
    assert collection.storage_mode == mode
    group = collection.tiers[0]  # "grow" alone ("held" has another dim)
    assert group.store.rows_allocated() == 7168 and group.store.rows_in_use() == 0
    assert collection.tiers[1].store.rows_allocated() == 512  # a segment: the bounded table's 100
    if mode == "hybrid":
        assert group.store.rows_by_placement() == {"device": 2048, "host": 7168 - 2048}
    train_side_by_side(collection, reference, steps, gen)
    assert_tables_match_reference(collection, reference, "after the steps")
    assert len({k for b in steps for f in "ab" for bag in b.bags[f] for k in bag}) > 4096
    assert group.index.generation == 0  # no rehash
    assert group.store.rows_allocated() == 7168  # nor a segment more

    plain = [dataclasses.replace(t, init_capacity=None) for t in tables]
    without = te.EmbeddingBagCollection(plain, optimizer=make_optimizer("sgd"), storage=storage)
    for batch in steps:
        without(batch.kjt()).values().sum().backward()
    assert without.tiers[0].index.generation > 0


@pytest.mark.parametrize("schedule", ["plain", *SCHEDULES])
def test_pairs_whose_bucket_was_full_keep_the_rows_they_trained(schedule, monkeypatch):
    """Unbounded tables insert a batch's misses on the device, new rows from a pool
    (``DeviceTier._inserted``); a pair whose bucket is full all the same (one-slot buckets at load
    up to 0.5: many are) has its row for the batch and is inserted with it before the index is used
    again (``place_overflow``), under every prefetch schedule. Rows and outputs equal a dense
    table's at every step; the full buckets happened (counted as they are placed)."""
    full = []
    place = DeviceTier.place_overflow

    def counting(group):
        regions = len(group.configs)
        for batch in group._overflow:
            if batch.ready is not None:
                batch.ready.synchronize()
            full.append(sum(batch.counts.tolist()[regions : 2 * regions]))
        place(group)

    monkeypatch.setattr(DeviceTier, "place_overflow", counting)
    gen = torch.Generator().manual_seed(7)
    pool = list(range(1000, 1600))
    tables = [te.TableConfig("t", 4, ["a", "b"]), te.TableConfig("u", 4, ["c"], pooling="mean")]
    steps = [random_batch(gen, {"a": pool, "b": pool[:200], "c": pool}, batch_size=64, max_bag=5)
             for _ in range(4)]
    scenario = Scenario(tables, {"t": pool, "u": pool}, {}, steps, seed=3)
    collection, reference = build_pair(te.EmbeddingBagCollection, scenario, "adam",
                                       storage=te.StorageConfig(bucket_width=1, segment_rows=64))
    train_side_by_side(collection, reference, steps, gen, schedule)
    assert_tables_match_reference(collection, reference, "after the steps")
    assert sum(full) > 0 and len(full) >= 4


def test_write_mid_training_resets_state_and_training_continues():
    """write() upserts rows (stored and new keys) and zeroes their optimizer state."""
    tables = [te.TableConfig("t", 3, ["x", "y"]), te.TableConfig("u", 2, ["z"], num_embeddings=9)]
    pools = {"t": [1, 2, 3, 4, 5, -6], "u": list(range(9))}
    gen = torch.Generator().manual_seed(8)
    features = {"x": pools["t"], "y": pools["t"], "z": pools["u"]}
    scenario = Scenario(tables, pools, {"t": [1, 2]}, [], seed=8)
    collection, reference = build_pair(te.EmbeddingBagCollection, scenario, "adagrad")
    train_side_by_side(collection, reference, [random_batch(gen, features, 3) for _ in range(6)], gen)

    keys = [2, 3, 77]  # stored with state, stored with state, new
    rows = torch.rand(3, 3, generator=gen)
    collection.write("t", torch.tensor(keys), rows)
    reference.write("t", keys, rows)
    written = {k: i for i, k in enumerate(keys)}
    got_keys, got_w, got_s, _ = sorted_export(collection, "t")
    for j, k in enumerate(got_keys.tolist()):
        if k in written:
            assert torch.equal(got_w[j], rows[written[k]]), f"key {k}: written row not stored"
            assert torch.count_nonzero(got_s[j]) == 0, f"key {k}: optimizer state not reset"
    assert_tables_match_reference(collection, reference, "after write")

    features["x"] = features["x"] + [77]
    train_side_by_side(collection, reference, [random_batch(gen, features, 3) for _ in range(6)], gen)
    assert_tables_match_reference(collection, reference, "after write and more training")


def test_read_changes_nothing_and_reports_missing_keys():
    tables = [te.TableConfig("t", 3, ["x"], eviction="lfu"), te.TableConfig("u", 2, ["y"])]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.Adam(lr=0.1))
    for _ in range(3):
        loss = ebc(Batch({"x": [[1, 2], [2]], "y": [[5], []]}).kjt()).values().sum()
        loss.backward()
    before = snapshot(ebc, tables)
    rows, found = ebc.read("t", torch.tensor([2, 99, 1, 2]))
    assert found.tolist() == [True, False, True, True]
    assert tuple(rows.shape) == (4, 3) and rows.dtype == torch.float32
    assert torch.count_nonzero(rows[1]) == 0, "a key not stored must read as zeros"
    torch.testing.assert_close(rows[0], rows[3])
    empty, none_found = ebc.read("u", torch.zeros(0, dtype=torch.int64))
    assert tuple(empty.shape) == (0, 2) and none_found.numel() == 0
    assert_snapshot_equal(before, snapshot(ebc, tables))


def test_stats_and_storage_mode():
    tables = [te.TableConfig("t", 3, ["x"]), te.TableConfig("u", 2, ["y"], num_embeddings=4)]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1))
    ebc(Batch({"x": [[1, 2]], "y": [[3]]}).kjt()).values().sum().backward()
    assert ebc.storage_mode == "hbm_direct"
    stats = ebc.stats()
    assert set(stats) == {"t", "u"}
    assert all(isinstance(s, te.TableStats) for s in stats.values())


def test_stats_count_the_key_indexes_memory():
    """``index_bytes`` against the documented sizes: a table with ``init_capacity=n`` has an index of
    ceil(n / 0.5) slots of 28 bytes (key, row address, score, lock count), in whole buckets of 32; a
    host-memory store reserved for r rows a table keeps ceil(r / 0.3) slots of 16 bytes (key, row
    address) a table, in host memory on the CPU. Each table counts its own region."""
    width = 32

    def slots(n: int, load: float) -> int:
        return -(-math.ceil(n / load) // width) * width

    tables = [te.TableConfig("a", 4, ["x"], init_capacity=1000),
              te.TableConfig("b", 4, ["y"], init_capacity=300)]
    stats = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1)).stats()
    assert stats["a"].index_bytes == {"device": slots(1000, 0.5) * 28}
    assert stats["b"].index_bytes == {"device": slots(300, 0.5) * 28}

    tables = [te.TableConfig(name, 4, [name], num_embeddings=10_000) for name in ("c", "d")]
    storage = te.StorageConfig(hbm_budget=2 * 100 * 4 * 4, backing=te.storage.HostMemory(reserve_rows=2000))
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1), storage=storage)
    ebc(Batch({"c": [[1, 2]], "d": [[3]]}).kjt()).values().sum().backward()
    for name in ("c", "d"):
        got = ebc.stats()[name].index_bytes
        assert got["host"] == slots(2000, 0.3) * 16, name
        assert got["device"] >= slots(100, 1.0) * 28, name  # the device cache's 100 rows, and more


def test_stats_count_hits_misses_conflicts_evictions_and_refusals():
    """The counters against a count by hand: table a admits a key at its second occurrence; table b
    holds 4 rows in one bucket (max_capacity 4, bucket width 4), so 5 new keys in one batch leave
    one without a row (a conflict miss) and 2 new keys the next step evict 2 unlocked rows."""
    tables = [te.TableConfig("a", 2, ["x"], admission=te.FrequencyAdmission(2)),
              te.TableConfig("b", 2, ["y"], max_capacity=4)]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1),
                                    storage=te.StorageConfig(bucket_width=4))
    for bags in ({"x": [[1, 2, 2, 3]], "y": [[10, 11, 12, 13, 14]]}, {"x": [[1, 2]], "y": [[20, 21]]}):
        ebc(Batch(bags).kjt()).values().sum().backward()
    a, b = ebc.stats()["a"], ebc.stats()["b"]
    # a: step 1 distinct 1, 2, 3 (2 admitted, a miss; 1 and 3 refused), step 2: 2 a hit, 1 admitted
    assert (a.lookups, a.unique_lookups, a.hits, a.misses, a.not_admitted) == (6, 5, 1, 2, 2)
    assert (b.lookups, b.unique_lookups, b.hits, b.misses) == (7, 7, 0, 7)
    assert (b.conflict_misses, b.evictions, b.not_admitted) == (1, 2, 0)
    assert sorted_export(ebc, "a")[0].tolist() == [1, 2] and sorted_export(ebc, "b")[0].numel() == 4


def test_bounded_tables_count_by_hand_and_give_every_row_not_stored_back():
    """Tables all bounded: the insertion runs on the device, the new rows from a pool of free rows
    (``DeviceTier._inserted``). The counters against a count by hand (b as in the test above: a
    conflict miss, then 2 evictions; a's 2 buckets of 4 never fill), the rows against a plain
    loop's initial rows and SGD updates, and once the batches are released every row of the store
    that no table holds is free again (the pool's unused rows, the conflict miss's scratch row)."""
    tables = [te.TableConfig("a", 2, ["x"], max_capacity=8), te.TableConfig("b", 2, ["y"], max_capacity=4)]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1),
                                    storage=te.StorageConfig(bucket_width=4))
    batches = ({"x": [[1, 2, 2, 3]], "y": [[10, 11, 12, 13, 14]]}, {"x": [[1, 4]], "y": [[20, 21]]})
    for bags in batches:
        ebc(Batch(bags).kjt()).values().sum().backward()
    a, b = ebc.stats()["a"], ebc.stats()["b"]
    assert (a.lookups, a.unique_lookups, a.hits, a.misses) == (6, 5, 1, 4)
    assert (a.conflict_misses, a.evictions) == (0, 0)
    assert (b.lookups, b.unique_lookups, b.hits, b.misses) == (7, 7, 0, 7)
    assert (b.conflict_misses, b.evictions) == (1, 2)
    keys, weights = sorted_export(ebc, "a")[:2]
    assert keys.tolist() == [1, 2, 3, 4]
    # a sum pooling's gradient is 1 per occurrence: each row moved by -lr x its occurrences
    occurrences = torch.tensor([[2.0], [2.0], [1.0], [1.0]])
    torch.testing.assert_close(weights, initial_rows(tables[0], [1, 2, 3, 4]) - 0.1 * occurrences)
    ebc.flush()
    (group,) = ebc.tiers
    assert group.store.rows_in_use() == group.index.size() == 8


def test_kjt_given_by_offsets_equals_kjt_given_by_lengths():
    tables = [te.TableConfig("t", 3, ["x", "y"], pooling="mean")]
    batch = Batch(
        {"x": [[1, 2], [], [3]], "y": [[], [4, 4], [1]]},
        {"x": [[1.0, 2.0], [], [0.5]], "y": [[], [3.0, 1.0], [2.0]]},
    )
    by_lengths = batch.kjt()
    by_offsets = te.KeyedJaggedTensor(
        keys=by_lengths.keys(),
        values=by_lengths.values(),
        offsets=torch.tensor([0, 2, 2, 3, 3, 5, 6]),
        weights=by_lengths.weights_or_none(),
    )
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1))
    ebc.eval()
    torch.testing.assert_close(ebc(by_offsets).values(), ebc(by_lengths).values())


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_prefetch_schedules_match_reference(optimizer, schedule):
    check_scenario(te.EmbeddingBagCollection, edge_scenario(weighted=True), optimizer, schedule)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_prefetch_schedules_with_admission_match_reference(module, schedule):
    check_scenario(module, admission_scenario(threshold=2), "adam", schedule)


def test_keyed_tensor_layout_follows_table_config_order():
    tables = [
        te.TableConfig("b_table", 3, ["z", "a"]),
        te.TableConfig("a_table", 2, ["m"]),
    ]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1))
    batch = Batch({"m": [[1], []], "a": [[2, 3], [4]], "z": [[], [5]]})  # KJT order: m, a, z
    out = ebc(batch.kjt())
    assert out.keys() == ["z", "a", "m"]
    assert out.length_per_key() == [3, 3, 2]
    assert tuple(out.values().shape) == (2, 8)
    parts = out.to_dict()
    assert list(parts) == ["z", "a", "m"]
    torch.testing.assert_close(out["a"], out.values()[:, 3:6])
    torch.testing.assert_close(parts["m"], out.values()[:, 6:8])


def test_sequence_output_has_one_row_per_id():
    tables = [te.TableConfig("t", 4, ["x", "y"])]
    ec = te.EmbeddingCollection(tables, optimizer=te.optim.SGD(lr=0.1))
    out = ec(Batch({"y": [[1, 2, 1], []], "x": [[], [3]]}).kjt())
    assert set(out) == {"x", "y"}
    assert tuple(out["y"].values().shape) == (3, 4)
    assert out["y"].lengths().tolist() == [3, 0]
    assert tuple(out["x"].values().shape) == (1, 4)
    assert out["x"].lengths().tolist() == [0, 1]
    torch.testing.assert_close(out["y"].values()[0], out["y"].values()[2])


def test_zero_batch_size_is_a_step_without_rows():
    """B = 0 (lengths and values both empty): an empty (0, sum dims) output, no row changes."""
    tables = [te.TableConfig("t", 4, ["x", "y"])]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.Adagrad(lr=0.1))
    ebc.write("t", torch.tensor([1, 2]), torch.ones(2, 4))
    before = snapshot(ebc, tables)
    out = ebc(Batch({"x": [], "y": []}).kjt())
    assert tuple(out.values().shape) == (0, 8)
    out.values().sum().backward()
    assert_snapshot_equal(before, snapshot(ebc, tables))


# --------------------------------------------------------------------------------------------------
# Eval mode
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_eval_is_read_only(module):
    """Eval forwards change nothing (rows, state, scores, step count); unseen keys read as zeros."""
    pooled = module is te.EmbeddingBagCollection
    tables = [
        te.TableConfig("shared", 4, ["u", "v"], pooling="mean" if pooled else "sum"),
        te.TableConfig("small", 2, ["w"], num_embeddings=50),
    ]
    seen = {"u": [1, 2, 3], "v": [3, 4], "w": [0, 1, 2]}
    scenario = Scenario(
        tables, {"shared": [1, 2, 3, 4, 100, 101], "small": list(range(50))}, {"shared": [1, 2]}, [], seed=3
    )
    collection, reference = build_pair(module, scenario, "adam")
    gen = torch.Generator().manual_seed(11)
    train = [random_batch(gen, seen, batch_size=3) for _ in range(3)]
    train_side_by_side(collection, reference, train, gen)
    before = snapshot(collection, tables)

    collection.eval()
    unseen = Batch({"u": [[100, 1], [101], []], "v": [[4, 100], [], [100]], "w": [[40], [2, 41], []]})
    with torch.no_grad():
        out = collection(unseen.kjt())
    assert_outputs_close(out, reference.forward(unseen, train=False), "eval")
    only_unseen = Batch({"u": [[100]], "v": [[101, 100]], "w": [[49]]})
    out = collection(only_unseen.kjt())  # this time without no_grad
    values = out.values() if pooled else torch.cat([jt.values().flatten() for jt in out.values()])
    assert torch.count_nonzero(values) == 0, "keys not stored must read as zeros in eval"
    assert_snapshot_equal(before, snapshot(collection, tables))
    _, found = collection.read("shared", torch.tensor([100, 101]))
    assert not found.any(), "eval inserted keys"

    collection.train()  # training resumes exactly where it was (eval took no step)
    more = [random_batch(gen, seen, batch_size=2) for _ in range(3)]
    train_side_by_side(collection, reference, more, gen)
    assert_tables_match_reference(collection, reference, "after eval and more training")


# --------------------------------------------------------------------------------------------------
# Admission
# --------------------------------------------------------------------------------------------------


def admission_scenario(threshold: int) -> Scenario:
    tables = [
        te.TableConfig("gated", 3, ["g1", "g2"], admission=te.FrequencyAdmission(threshold)),
        te.TableConfig("open", 2, ["o"], pooling="mean"),
    ]
    pools = {"gated": [10, 11, 12, 13, -5], "open": [1, 2]}
    fixed = [
        # 11 three times in one batch (twice in one bag): admitted at once when threshold <= 3.
        Batch({"g1": [[10, 10], [11]], "g2": [[11, 11], []], "o": [[1], []]}),
        Batch({"g1": [[10], []], "g2": [[], [12]], "o": [[], [2]]}),
        Batch({"g1": [[], []], "g2": [[], []], "o": [[], []]}),
        Batch({"g1": [[12, 13]], "g2": [[10]], "o": [[1, 2]]}),
    ]
    gen = torch.Generator().manual_seed(threshold)
    rest = [
        random_batch(gen, {"g1": pools["gated"], "g2": pools["gated"], "o": [1, 2]}, 2)
        for _ in range(STEPS - len(fixed))
    ]
    return Scenario(tables, pools, {}, fixed + rest, seed=threshold)


@pytest.mark.parametrize("threshold", [1, 2, 3, 5])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_frequency_admission_matches_reference(module, optimizer, threshold):
    check_scenario(module, admission_scenario(threshold), optimizer)


def test_admission_stores_a_key_in_the_batch_that_reaches_the_threshold():
    """Spelled out for k = 3: key 7 occurs twice in step 1 (not stored), once in step 2 (stored)."""
    table = te.TableConfig(
        "t", 2, ["x"], admission=te.FrequencyAdmission(3), initializer=te.init.Constant(0.5)
    )
    ebc = te.EmbeddingBagCollection([table], optimizer=te.optim.SGD(lr=1.0))
    out = ebc(Batch({"x": [[7, 7]]}).kjt())
    torch.testing.assert_close(out.values(), torch.full((1, 2), 1.0))  # two initial rows pooled
    out.values().sum().backward()
    assert sorted_export(ebc, "t")[0].numel() == 0, "stored before reaching the threshold"

    out = ebc(Batch({"x": [[7], [7, 7]]}).kjt())
    torch.testing.assert_close(out.values(), torch.tensor([[0.5, 0.5], [1.0, 1.0]]))
    out.values().sum().backward()  # the whole batch's gradient: 3 occurrences of 1.0
    keys, weights, _, _ = sorted_export(ebc, "t")
    assert keys.tolist() == [7]
    torch.testing.assert_close(weights, torch.full((1, 2), 0.5 - 3.0))


# --------------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU)
# --------------------------------------------------------------------------------------------------


def triton_matches_torch(module, tables, pools, optimizer: str, seed: int, batch_size: int, rows=None,
                         steps: int = 3, prepare=None):
    """Train both kernel sets on the same ``steps`` batches (weighted when pooled): outputs and rows
    equal. ``rows``: (table, keys, weights) written first; ``prepare(collection)``: done to the
    Triton one first. Returns the two collections (torch, triton)."""
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pooled = module is te.EmbeddingBagCollection
    gen = torch.Generator().manual_seed(seed)
    steps = [random_batch(gen, pools, batch_size=batch_size, weighted=pooled) for _ in range(steps)]
    paths = [module(tables, optimizer=make_optimizer(optimizer), device=device, kernels=k)
             for k in ("torch", "triton")]
    if prepare is not None:
        prepare(paths[1])
    if rows is not None:
        for c in paths:
            c.write(rows[0], rows[1].to(device), rows[2].to(device))
    for step, batch in enumerate(steps):
        upstream = random_upstream(gen, batch, tables, pooled)
        upstream = ({f: u.to(device) for f, u in upstream.items()} if isinstance(upstream, dict)
                    else upstream.to(device))
        outs = []
        for c in paths:
            out = c(batch.kjt().to(device))
            weighted_loss(out, upstream).backward()
            outs.append(out)
        assert_outputs_close(outs[1], outs[0], f"step {step + 1}")
    for t in tables:
        want, got = sorted_export(paths[0], t.name), sorted_export(paths[1], t.name)
        assert got[0].tolist() == want[0].tolist()
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    return paths


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_triton_kernels_match_torch_kernels(module, optimizer):
    """kernels="triton" (on CUDA, else the interpreter on CPU) equals kernels="torch"."""
    pooled = module is te.EmbeddingBagCollection
    tables = [
        te.TableConfig("shared", 4, ["a", "b"]),
        te.TableConfig("small", 2, ["c"], num_embeddings=6, pooling="mean" if pooled else "sum"),
    ]
    pools = {"a": [3, -9, INT64_MAX], "b": [3, 4], "c": [0, 1, 5]}
    rows = ("shared", torch.tensor([3, 4]), torch.rand(2, 4, generator=torch.Generator().manual_seed(9)))
    triton_matches_torch(module, tables, pools, optimizer, seed=5, batch_size=2, rows=rows)


@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_triton_kernels_match_torch_kernels_in_one_staged_group(module):
    """One table group of raw ids (the staged prefetch: the backward reads each id's gradient source
    and scale in the dedup's order, made with the prefetch), weighted and mean-pooled bags: the
    Triton kernels equal the torch reference."""
    pooled = module is te.EmbeddingBagCollection
    tables = [te.TableConfig("s", 4, ["a", "b"]),
              te.TableConfig("m", 4, ["c"], pooling="mean" if pooled else "sum")]
    pools = {"a": [3, -9, INT64_MAX], "b": [3, 4, 11], "c": [0, 1, 5, 8]}
    _, triton_path = triton_matches_torch(module, tables, pools, "adam", seed=6, batch_size=3)
    assert len(triton_path.tiers) == 1 and triton_path.tiers[0].can_stage()


def test_triton_staged_group_takes_a_batch_without_ids():
    """A batch whose bags are all empty goes through the staged prefetch (no plan, no sort) and
    changes no row; the next batch trains as the torch kernels do."""
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tables = [te.TableConfig("t", 4, ["a", "b"])]
    paths = [te.EmbeddingBagCollection(tables, device=device, kernels=k) for k in ("torch", "triton")]
    none = torch.empty(0, dtype=torch.int64)
    empty = te.KeyedJaggedTensor(["a", "b"], none, lengths=torch.zeros(4, dtype=torch.int64))
    some = te.KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 2]), lengths=torch.tensor([1, 0, 2, 0]))
    for c in paths:
        for kjt in (empty, some):
            out = c(kjt.to(device))
            (out.values() * torch.arange(1.0, 17.0, device=device).view(2, 8)).sum().backward()
    want, got = sorted_export(paths[0], "t"), sorted_export(paths[1], "t")
    assert got[0].tolist() == want[0].tolist() == [1, 2]
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_lookup_made_with_the_prefetch_when_every_key_is_found(module):
    """A staged prefetch whose batch found every key looks its rows up right after its read; with a
    new key the forward looks them up. Outputs and rows equal the torch kernels' either way."""
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pooled = module is te.EmbeddingBagCollection
    tables = [te.TableConfig("s", 4, ["a", "b"], pooling="mean" if pooled else "sum")]
    paths = [module(tables, optimizer=make_optimizer("adam"), device=device, kernels=k)
             for k in ("torch", "triton")]

    def kjt(ids, lengths):
        weights = torch.linspace(0.5, 1.5, len(ids)) if pooled else None
        return te.KeyedJaggedTensor(["a", "b"], torch.tensor(ids), lengths=torch.tensor(lengths),
                                    weights=weights).to(device)

    known = kjt([1, 2, 3, 2, 5, 1], [2, 1, 2, 1])
    steps = [(known, False), (known, True), (kjt([5, 3, 1, 1], [1, 1, 0, 2]), True),
             (kjt([5, 9, 1], [1, 1, 1, 0]), False),  # key 9 is new
             (kjt([2, 9], [1, 0, 0, 1]), True), (kjt([9, 9, 3, 2, 5], [2, 1, 1, 1]), True)]
    gen = torch.Generator().manual_seed(7)
    for i, (batch, found) in enumerate(steps):
        outs = []
        for c in paths:
            c.prefetch(batch)
            assert (c._queue.newest().looked is not None) == found, f"step {i}"
            outs.append(c(batch))
        upstream = torch.randn(values_of(outs[0]).shape, generator=gen).to(device)
        for out in outs:
            (values_of(out) * upstream).sum().backward()
        torch.testing.assert_close(values_of(outs[1]), values_of(outs[0]), rtol=1e-5, atol=1e-6)
    want, got = sorted_export(paths[0], "s"), sorted_export(paths[1], "s")
    assert got[0].tolist() == want[0].tolist()
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)


def test_a_lookup_made_before_rows_changed_is_not_used():
    """Batch B prefetched (and looked up) before batch A's backward, as a pipeline does, or before a
    write: the forward of B looks its rows up again and sees the change; after the first such miss
    the collection stops looking up early."""
    tables = [te.TableConfig("s", 4, ["a"])]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.5))
    a = te.KeyedJaggedTensor(["a"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    b = te.KeyedJaggedTensor(["a"], torch.tensor([2, 1]), lengths=torch.tensor([1, 1]))
    ebc(a).values().sum().backward()  # both keys stored
    ebc.write("s", torch.tensor([1]), torch.ones(1, 4))
    out_a = ebc(a)
    ebc.prefetch(b)
    assert ebc._queue.newest().looked is not None
    out_a.values().sum().backward()  # rows 1 and 2 change
    rows, _ = ebc.read("s", torch.tensor([2, 1]))
    torch.testing.assert_close(ebc(b).values(), rows)
    assert not ebc._early_lookup
    ebc.prefetch(b)
    assert ebc._queue.newest().looked is None
    ebc(b)

    again = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.5))
    again(a).values().sum().backward()
    again.prefetch(b)
    again.write("s", torch.tensor([2]), torch.full((1, 4), 7.0))
    torch.testing.assert_close(again(b).values()[0], torch.full((4,), 7.0))


def test_a_prefetch_on_another_thread_never_looks_early():
    """A pipeline's worker prefetching beside the training thread: its lookup could run before that
    thread's last update (launched on another stream, the change already counted), so only the thread
    that runs forward and backward looks the rows up with the prefetch."""
    ebc = te.EmbeddingBagCollection([te.TableConfig("s", 4, ["a"])], optimizer=te.optim.SGD(lr=0.5))
    a = te.KeyedJaggedTensor(["a"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    ebc(a).values().sum().backward()  # both keys stored
    worker = threading.Thread(target=ebc.prefetch, args=(a,))
    worker.start()
    worker.join()
    assert ebc._queue.newest().looked is None
    ebc(a).values().sum().backward()
    ebc.prefetch(a)
    assert ebc._queue.newest().looked is not None
    rows, _ = ebc.read("s", torch.tensor([1, 2]))
    torch.testing.assert_close(ebc(a).values(), rows)  # one id a bag


def test_a_bad_batch_between_early_lookups_raises_and_changes_nothing():
    """After batches that were looked up with their prefetch, bad ones (lengths that overrun the ids,
    a reserved id) raise the checks' error with no row changed, and the next batch trains as the
    torch kernels do."""
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tables = [te.TableConfig("s", 4, ["a", "b"])]
    paths = [te.EmbeddingBagCollection(tables, device=device, kernels=k) for k in ("torch", "triton")]
    good = te.KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4]),
                                lengths=torch.tensor([1, 1, 1, 1])).to(device)
    for c in paths:
        for _ in range(2):
            c(good).values().sum().backward()
    assert paths[1]._early_lookup
    before = sorted_export(paths[1], "s")
    overrun = te.KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3, 4]),
                                   lengths=torch.tensor([900, 1, 1, -3]))
    reserved = te.KeyedJaggedTensor(["a", "b"], torch.tensor([1, te.RESERVED_KEY, 3, 4]),
                                    lengths=torch.tensor([1, 1, 1, 1]))
    for bad, message in ((overrun, "negative lengths"), (reserved, "RESERVED_KEY")):
        with pytest.raises(ValueError, match=message):
            paths[1](bad.to(device))
    after = sorted_export(paths[1], "s")
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    for c in paths:
        c(good).values().sum().backward()
    torch.testing.assert_close(sorted_export(paths[1], "s")[1], sorted_export(paths[0], "s")[1])


def test_a_deferred_prefetch_fails_at_its_forward_and_settles_before_any_change():
    """prefetch_deferred of a bad batch returns; the batch's forward raises the checks' error with no
    row and no counter changed, and the collection trains on. A deferred batch of new keys is settled
    (its host half run: keys inserted and counted) by whatever touches the tables first (stats(),
    read(), write(), the next prefetch) and trains as after a plain prefetch."""
    from tieredemb.modules.in_flight import StagedRecord

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tables = [te.TableConfig("s", 4, ["a", "b"])]

    def kjt(ids):
        return te.KeyedJaggedTensor(["a", "b"], torch.tensor(ids),
                                    lengths=torch.tensor([1] * len(ids))).to(device)

    good, new = kjt([1, 2, 3, 4]), kjt([5, 6, 1, 2])  # keys 5 and 6 are new

    def trained():
        c = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.5), device=device)
        c(good).values().sum().backward()
        return c

    ebc = trained()
    before, stats = sorted_export(ebc, "s"), ebc.stats()["s"]
    bad = kjt([1, te.RESERVED_KEY, 3, 4])
    ebc.prefetch_deferred(bad)
    assert isinstance(ebc._queue.oldest()[1], StagedRecord)  # nothing read, nothing raised yet
    with pytest.raises(ValueError, match="RESERVED_KEY"):
        ebc(bad)
    assert all(torch.equal(a, b) for a, b in zip(before, sorted_export(ebc, "s")))
    assert ebc.stats()["s"] == stats and not ebc._queue
    ebc(good).values().sum().backward()  # trains on

    settles = {"stats": lambda c: c.stats(), "read": lambda c: c.read("s", torch.tensor([9])),
               "write": lambda c: c.write("s", torch.tensor([9]), torch.ones(1, 4)),
               "prefetch": lambda c: c.prefetch_deferred(good)}
    for name, settle in settles.items():
        want, got = trained(), trained()
        want.prefetch(new)
        got.prefetch_deferred(new)
        assert isinstance(got._queue.oldest()[1], StagedRecord), name
        settle(got)
        assert not isinstance(got._queue.oldest()[1], StagedRecord), name
        if name == "write":
            want.write("s", torch.tensor([9]), torch.ones(1, 4))
        for c in (want, got):
            c(new).values().sum().backward()
            c(good).values().sum().backward()  # got: the batch its settle queued
        assert got.stats()["s"] == want.stats()["s"], name
        assert all(torch.equal(a, b) for a, b in zip(sorted_export(got, "s"), sorted_export(want, "s"))), name


@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_several_table_groups_with_shared_keys_match_reference(module, schedule):
    """Tables of two dims (two groups; one of them two tables that share keys), features given in and
    out of the groups' order, mean pooling, weights, empty batches: trains as the dense reference
    in every prefetch schedule."""
    edge = edge_scenario(weighted=False)
    tables = [*edge.tables, te.TableConfig("other", 3, ["x"])]  # a second table in "shared"'s group
    pools = {**edge.pools, "other": edge.pools["shared"]}  # the same keys: two pairs each
    steps = []
    for i, step in enumerate(edge.batches):
        bags = {**step.bags, "x": step.bags["u"][::-1]}
        order = [["x", "w", "v", "u"], ["u", "v", "w", "x"], ["w", "x", "u", "v"]][i % 3]
        weights = None
        if module is te.EmbeddingBagCollection:
            weights = {f: [[0.5 + 0.25 * j for j in range(len(bag))] for bag in fb] for f, fb in bags.items()}
        steps.append(Batch(bags, weights, key_order=order))
    scenario = Scenario(tables, pools, {**edge.written, "other": [7]}, steps, seed=7)
    collection, reference = build_pair(module, scenario, "adam")
    assert len(collection.tiers) == 2
    train_side_by_side(collection, reference, scenario.batches, torch.Generator().manual_seed(2), schedule)
    assert_tables_match_reference(collection, reference, f"after the {schedule} steps")


def test_an_eval_forward_between_a_deferred_prefetch_and_its_forward():
    """A batch of new keys prefetched deferred, an eval forward of another batch, then the batch's
    training forward: the eval forward settles the batch first (it sees the new keys' rows, as after a
    plain prefetch) and changes nothing; outputs, rows and counters equal the plain prefetch's."""
    tables = [te.TableConfig("s", 4, ["a", "b"])]

    def kjt(ids):
        return te.KeyedJaggedTensor(["a", "b"], torch.tensor(ids), lengths=torch.tensor([1] * len(ids)))

    runs = []
    for deferred in (False, True):
        ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.Adam(lr=0.1))
        ebc(kjt([1, 2, 3, 4])).values().sum().backward()
        batch = kjt([1, 5, 6, 2])  # keys 5 and 6 are new
        (ebc.prefetch_deferred if deferred else ebc.prefetch)(batch)
        ebc.eval()
        with torch.no_grad():
            seen = ebc(kjt([5, 1, 7, 6])).values()
        ebc.train()
        out = ebc(batch).values()
        out.sum().backward()
        runs.append((seen, out.detach(), *sorted_export(ebc, "s"), ebc.stats()["s"]))
    assert torch.count_nonzero(runs[0][0][0]) > 0  # the eval forward found key 5 stored
    for got, want in zip(runs[1], runs[0]):
        assert torch.equal(got, want) if isinstance(got, torch.Tensor) else got == want


@pytest.mark.parametrize("dims", [(4, 4), (4, 8)], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_padded_staging_trains_as_the_torch_kernels(module, dims, monkeypatch):
    """What a CUDA graph of a jagged batch shape replays: the staged prefetch's device half over ids
    padded to a bucket (stale ids and weights past the batch, as a graph's static buffer holds),
    trimmed after. Run here eagerly on the interpreter (the graph itself: tests/gpu), for every
    staged prefetch of jagged, weighted, mean-pooled batches, of one table group or two (tables of
    two dims, staged together): outputs and rows equal the torch kernels'."""
    import types
    from types import SimpleNamespace

    from tieredemb.ops.capture import padded_size

    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pooled = module is te.EmbeddingBagCollection
    replays = []

    def padded_replay(self, given, group, step):
        n = given.values.numel()
        if n == 0:
            return None
        bucket = padded_size(n) + 3
        values = torch.randint(0, 50, (bucket,), device=device)  # what the last batch left there
        values[:n] = given.values.to(device)
        weights = None
        if given.weights is not None:
            weights = torch.rand(bucket, device=device) * 9
            weights[:n] = given.weights.to(device)
        outputs = self._captured_stage(given, group, values, given.per_feature.to(device), weights,
                                       torch.tensor(step, device=device), torch.tensor(n, device=device))
        replays.append(n)
        return SimpleNamespace(outputs=outputs)

    def prepare(padded):  # the Triton collection; the reference stays unpadded
        stager = padded._stager
        monkeypatch.setattr(stager, "_replay_staged", types.MethodType(padded_replay, stager))
        stager.captured = SimpleNamespace(release=lambda slot, stream: None)  # no graph to hand back

    tables = [te.TableConfig("s", dims[0], ["a", "b"], pooling="mean" if pooled else "sum"),
              te.TableConfig("t", dims[1], ["c"])]
    pools = {"a": [3, -9, INT64_MAX, 8], "b": [3, 4, 11], "c": [0, 1, 5, 8, 40]}
    triton_matches_torch(module, tables, pools, "adam", seed=8, batch_size=4, steps=5, prepare=prepare)
    assert len(replays) >= 4  # nearly every step


def values_of(out) -> torch.Tensor:
    return torch.cat([jt.values() for jt in out.values()]) if isinstance(out, dict) else out.values()


def test_feature_dims_helper_is_consistent():
    """Guards the helpers the suite leans on (a wrong helper would make every test vacuous)."""
    tables = [te.TableConfig("a", 2, ["x", "y"]), te.TableConfig("b", 5, ["z"])]
    assert feature_order(tables) == ["x", "y", "z"]
    assert feature_dims(tables) == {"x": 2, "y": 2, "z": 5}


def test_forward_uses_the_prefetch_of_an_equal_batch_once() -> None:
    """An equal (not identical) batch consumes the pending prefetch: admission counts it once."""
    table = te.TableConfig("t", 2, ["x"], admission=te.FrequencyAdmission(2))
    ebc = te.EmbeddingBagCollection([table], optimizer=te.optim.SGD(lr=0.1))

    def kjt() -> te.KeyedJaggedTensor:
        return te.KeyedJaggedTensor(["x"], torch.tensor([7]), lengths=torch.tensor([1]))

    ebc.prefetch(kjt())
    ebc(kjt()).values().sum().backward()
    assert ebc.export("t").keys.tolist() == []  # one occurrence of a threshold of 2
    ebc(kjt()).values().sum().backward()
    assert ebc.export("t").keys.tolist() == [7]


def test_forward_of_another_batch_than_the_prefetched_one_is_refused() -> None:
    table = te.TableConfig("t", 2, ["x"])
    ebc = te.EmbeddingBagCollection([table])
    ebc.prefetch(te.KeyedJaggedTensor(["x"], torch.tensor([7]), lengths=torch.tensor([1])))
    with pytest.raises(RuntimeError, match="oldest prefetched"):
        ebc(te.KeyedJaggedTensor(["x"], torch.tensor([8]), lengths=torch.tensor([1])))


def test_eval_forward_between_a_prefetch_and_its_forward() -> None:
    """An eval forward leaves a training prefetch queued for its own forward."""
    table = te.TableConfig("t", 2, ["x"])
    ebc = te.EmbeddingBagCollection([table], optimizer=te.optim.SGD(lr=0.1))
    batch = te.KeyedJaggedTensor(["x"], torch.tensor([7]), lengths=torch.tensor([1]))
    ebc.prefetch(batch)
    ebc.eval()
    late = te.KeyedJaggedTensor(["x"], torch.tensor([8]), lengths=torch.tensor([1]))
    assert torch.equal(ebc(late).values(), torch.zeros(1, 2))
    ebc.train()
    ebc(batch).values().sum().backward()
    assert ebc.export("t").keys.tolist() == [7]
