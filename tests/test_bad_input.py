"""Bad input is refused with a clear error and changes nothing (DESIGN section 2).

Each bad batch must raise ``ValueError`` or ``TypeError`` whose message names the offending feature
(where there is one) and the problem. Afterwards every table's export is unchanged, and one more good
step leaves the collection equal to a twin that never saw the bad batch (so a refused batch took no
optimizer step and left nothing behind).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import pytest
import torch

import tieredemb as te
from tests.conftest import Batch, assert_snapshot_equal, loss_of, make_kjt, snapshot

SMALL, BIG, CTX = "small_ids", "big_ids", "big_ctx"  # distinctive, so a message naming them is clear


def tables() -> list[te.TableConfig]:
    return [
        te.TableConfig("small", 3, [SMALL], num_embeddings=10),
        # Admission counters are state too: a refused batch must not count toward a threshold.
        te.TableConfig("big", 4, [BIG, CTX], pooling="mean", admission=te.FrequencyAdmission(3)),
    ]


GOOD = {SMALL: [[1, 2], [3]], BIG: [[5], []], CTX: [[7, 8], [9]]}  # B = 2, 6 ids
KEYS = [SMALL, BIG, CTX]
VALUES = [1, 2, 3, 5, 7, 8, 9]
LENGTHS = [2, 1, 1, 0, 2, 1]


def trained(module: type, optimizer: te.optim.EmbeddingOptimizer | None = None):
    """A collection with rows, optimizer state, scores and admission counts from three steps
    (``optimizer``: default Adagrad(lr=0.1)).

    Counts in "big" after it: 9 -> 3 (stored), 7, 8, 10 -> 2, 5, 6, 11 -> 1 (not stored).
    """
    collection = module(tables(), optimizer=optimizer or te.optim.Adagrad(lr=0.1), seed=1)
    for i in range(3):
        bags = {f: [[k + i for k in bag] for bag in b] for f, b in GOOD.items()}
        loss_of(collection(Batch(bags).kjt())).backward()
    return collection


@dataclass
class BadBatch:
    kjt: te.KeyedJaggedTensor
    feature: str | None  # the feature the message must name, if the problem has one
    problem: str  # a regex the message must match (case-insensitive)


def bad_batches(pooled: bool) -> dict[str, BadBatch]:
    cases = {
        "float ids": BadBatch(
            make_kjt(KEYS, torch.tensor(VALUES, dtype=torch.float32), LENGTHS),
            None,
            r"dtype|int64|integer|float",
        ),
        "float lengths": BadBatch(
            make_kjt(KEYS, VALUES, torch.tensor(LENGTHS, dtype=torch.float32)),
            None,
            r"dtype|length|integer|float",
        ),
        "lengths sum != number of ids": BadBatch(
            make_kjt(KEYS, VALUES + [4], LENGTHS), None, r"length|sum|values"
        ),
        "lengths count not a multiple of the keys": BadBatch(
            make_kjt(KEYS, VALUES, LENGTHS[:-1] + [0, 0]), None, r"length|multiple|keys|batch"
        ),
        "negative length": BadBatch(make_kjt(KEYS, VALUES, [2, 1, 1, 0, 3, -1]), None, r"negative|length"),
        "unknown feature": BadBatch(
            make_kjt(KEYS + ["nope_feature"], VALUES + [1], LENGTHS + [1, 0]),
            "nope_feature",
            r"unknown|not|expected|feature",
        ),
        "missing feature": BadBatch(
            make_kjt([SMALL, BIG], VALUES[:4], LENGTHS[:4]), CTX, r"missing|not|expected|feature"
        ),
        "repeated feature": BadBatch(
            make_kjt(KEYS + [SMALL], VALUES + [1], LENGTHS + [1, 0]),
            SMALL,
            r"duplicate|repeat|twice|more than once|feature",
        ),
        "id = num_embeddings": BadBatch(
            make_kjt(KEYS, [1, 10, 3, 5, 7, 8, 9], LENGTHS), SMALL, r"range|num_embeddings|10"
        ),
        "negative id in a bounded table": BadBatch(
            make_kjt(KEYS, [1, 2, -1, 5, 7, 8, 9], LENGTHS), SMALL, r"range|negative|num_embeddings"
        ),
        "reserved key in a raw-id table": BadBatch(
            make_kjt(KEYS, [1, 2, 3, 5, te.RESERVED_KEY, 8, 9], LENGTHS), CTX, rf"reserved|{te.RESERVED_KEY}"
        ),
        # a tensor without data: the collection cannot read it
        "ids on the meta device": BadBatch(
            make_kjt(KEYS, torch.tensor(VALUES, device="meta"), LENGTHS), None, r"values.*device meta"
        ),
        "lengths on the meta device": BadBatch(
            make_kjt(KEYS, VALUES, torch.tensor(LENGTHS, device="meta")), None, r"lengths.*device meta"
        ),
    }
    if pooled:

        def weights(bad: float, at: int) -> list[float]:
            w = [1.0] * len(VALUES)
            w[at] = bad
            return w

        cases |= {
            "nan weight": BadBatch(make_kjt(KEYS, VALUES, LENGTHS, weights(math.nan, 5)), CTX, r"finite|nan"),
            "inf weight": BadBatch(make_kjt(KEYS, VALUES, LENGTHS, weights(math.inf, 3)), BIG, r"finite|inf"),
            "-inf weight": BadBatch(
                make_kjt(KEYS, VALUES, LENGTHS, weights(-math.inf, 0)), SMALL, r"finite|inf"
            ),
            "weights of the wrong length": BadBatch(
                make_kjt(KEYS, VALUES, LENGTHS, [1.0] * (len(VALUES) - 1)), None, r"weight"
            ),
            "weights on the meta device": BadBatch(
                make_kjt(KEYS, VALUES, LENGTHS, torch.ones(len(VALUES), device="meta")), None,
                r"weights.*device meta"
            ),
        }
    return cases


MODULES = {"ebc": te.EmbeddingBagCollection, "ec": te.EmbeddingCollection}
CASES = [(m, name) for m in MODULES for name in bad_batches(pooled=m == "ebc")]


def one_group_tables() -> list[te.TableConfig]:
    """Tables of one width without admission: one table group, whose training prefetch is staged
    (checks, dedup and probe read on the host at once; the probe is guarded by the checks)."""
    return [te.TableConfig("small", 4, [SMALL], num_embeddings=10),
            te.TableConfig("big", 4, [BIG, CTX], pooling="mean")]


STAGED_CASES = [(m, name, k) for m in MODULES for name in bad_batches(pooled=m == "ebc")
                for k in ("torch", "triton")
                if k == "torch" or name in ("id = num_embeddings", "reserved key in a raw-id table",
                                            "negative length", "lengths sum != number of ids", "nan weight")]


@pytest.mark.parametrize("module_name, case, kernels", STAGED_CASES,
                         ids=[f"{m}: {c} ({k})" for m, c, k in STAGED_CASES])
@pytest.mark.slow
def test_bad_batch_of_a_staged_group_changes_nothing(module_name, case, kernels):
    """As below, for a one-group collection: scores and lock counts of the index too (the staged
    probe runs before the host sees the checks)."""
    module = MODULES[module_name]
    bad = bad_batches(pooled=module is te.EmbeddingBagCollection)[case]

    def trained_one_group():
        # Triton: the real kernels on a GPU, the interpreter on CPU tensors elsewhere
        device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
        collection = module(one_group_tables(), optimizer=te.optim.Adagrad(lr=0.1), seed=1, kernels=kernels,
                            device=device)
        for i in range(3):
            bags = {f: [[k + i for k in bag] for bag in b] for f, b in GOOD.items()}
            loss_of(collection(Batch(bags).kjt())).backward()
        return collection

    victim, twin = trained_one_group(), trained_one_group()
    assert len(victim.tiers) == 1 and victim.tiers[0].can_stage()
    index = victim.tiers[0].index
    before = snapshot(victim, one_group_tables())
    scores, locks = index.scores.clone(), index.locks.clone()
    kjt = bad.kjt if victim.device.type == "cpu" else bad.kjt.to(victim.device)
    for call in (lambda: victim.prefetch(kjt), lambda: loss_of(victim(kjt)).backward()):
        with pytest.raises((ValueError, TypeError)):
            call()
        assert_snapshot_equal(before, snapshot(victim, one_group_tables()))
        assert torch.equal(index.scores, scores) and torch.equal(index.locks, locks)
    good = Batch(GOOD).kjt()
    good = good.to(victim.device)
    for c in (victim, twin):
        loss_of(c(good)).backward()
    assert_snapshot_equal(snapshot(twin, one_group_tables()), snapshot(victim, one_group_tables()))


@pytest.mark.parametrize("module_name, case", CASES, ids=[f"{m}: {c}" for m, c in CASES])
def test_bad_batch_is_refused_and_changes_nothing(module_name, case):
    module = MODULES[module_name]
    bad = bad_batches(pooled=module is te.EmbeddingBagCollection)[case]
    victim, twin = trained(module), trained(module)
    before = snapshot(victim, tables())

    def forward_and_backward():
        loss_of(victim(bad.kjt)).backward()  # backward only if forward wrongly took the batch

    for call in (lambda: victim.prefetch(bad.kjt), forward_and_backward):
        with pytest.raises((ValueError, TypeError)) as info:
            call()
        message = str(info.value)
        if bad.feature is not None:
            assert bad.feature in message, f"message does not name {bad.feature!r}: {message!r}"
        assert re.search(bad.problem, message, re.IGNORECASE), f"unclear message: {message!r}"
        assert_snapshot_equal(before, snapshot(victim, tables()))

    good = Batch(GOOD).kjt()
    for c in (victim, twin):
        loss_of(c(good)).backward()
    assert_snapshot_equal(snapshot(twin, tables()), snapshot(victim, tables()))


@pytest.mark.parametrize("module", MODULES.values(), ids=MODULES.keys())
def test_not_a_kjt_is_a_type_error(module):
    collection = trained(module)
    before = snapshot(collection, tables())
    with pytest.raises(TypeError):
        collection({SMALL: torch.tensor([1])})
    with pytest.raises(TypeError):
        collection(torch.tensor([1, 2, 3]))
    assert_snapshot_equal(before, snapshot(collection, tables()))


def test_bad_write_is_refused_and_changes_nothing():
    collection = trained(te.EmbeddingBagCollection)
    before = snapshot(collection, tables())
    with pytest.raises(ValueError):
        collection.write("small", torch.tensor([1, 2]), torch.zeros(2, 4))  # D is 3
    with pytest.raises(ValueError):
        collection.write("small", torch.tensor([1, 2]), torch.zeros(3, 3))  # 2 keys, 3 rows
    with pytest.raises(ValueError, match="small"):
        collection.write("small", torch.tensor([1, 10]), torch.zeros(2, 3))  # 10 out of [0, 10)
    with pytest.raises(ValueError):
        collection.write("big", torch.tensor([te.RESERVED_KEY]), torch.zeros(1, 4))
    with pytest.raises((ValueError, KeyError), match="no_such_table"):
        collection.write("no_such_table", torch.tensor([1]), torch.zeros(1, 3))
    assert_snapshot_equal(before, snapshot(collection, tables()))


def test_lengths_and_offsets_that_disagree_are_refused():
    """Given both, they must say the same bags (lengths were used and offsets ignored): a batch or a
    JaggedTensor where they differ is refused when it is made; where they agree it trains as with
    lengths alone."""
    lengths = torch.tensor(LENGTHS)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    shifted = offsets.clone()
    shifted[1] -= 1  # bags [1, 2, 1, 0, 2, 1]: the same ids in all, other bags
    for bad, problem in ((shifted, r"offsets\[1\] is 1.*lengths.* 2"),
                         (offsets[:-1], r"offsets has 6 entries.*lengths has 6"),
                         (offsets + 1, r"offsets\[0\] is 1")):
        with pytest.raises(ValueError, match=problem):
            te.KeyedJaggedTensor(KEYS, torch.tensor(VALUES), lengths=lengths, offsets=bad)
        with pytest.raises(ValueError, match=problem):
            te.JaggedTensor(torch.tensor(VALUES), lengths=lengths, offsets=bad)
    both, alone = trained(te.EmbeddingBagCollection), trained(te.EmbeddingBagCollection)
    given = te.KeyedJaggedTensor(KEYS, torch.tensor(VALUES), lengths=lengths, offsets=offsets)
    loss_of(both(given)).backward()
    loss_of(alone(te.KeyedJaggedTensor(KEYS, torch.tensor(VALUES), lengths=lengths))).backward()
    assert_snapshot_equal(snapshot(alone, tables()), snapshot(both, tables()))


def test_a_write_on_the_meta_device_is_refused():
    collection = trained(te.EmbeddingBagCollection)
    before = snapshot(collection, tables())
    with pytest.raises(ValueError, match="keys.*device meta"):
        collection.write("small", torch.tensor([1, 2], device="meta"), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="weights.*device meta"):
        collection.write("small", torch.tensor([1, 2]), torch.zeros(2, 3, device="meta"))
    with pytest.raises(ValueError, match="keys.*device meta"):
        collection.read("small", torch.tensor([1, 2], device="meta"))
    assert_snapshot_equal(before, snapshot(collection, tables()))


def test_a_write_of_rows_not_finite_in_the_tables_dtype_is_refused():
    """float64 rows finite in float64 but beyond float32's range (the rows' dtype) would be stored
    as inf."""
    collection = trained(te.EmbeddingBagCollection)
    before = snapshot(collection, tables())
    rows = torch.tensor([[0.5, 1e300, 0.5], [0.5, 0.5, -1e39]], dtype=torch.float64)
    assert bool(torch.isfinite(rows).all()) and not bool(torch.isfinite(rows.to(torch.float32)).all())
    with pytest.raises(ValueError, match="'small'.*float32"):
        collection.write("small", torch.tensor([1, 2]), rows)
    assert_snapshot_equal(before, snapshot(collection, tables()))
    collection.write("small", torch.tensor([1, 2]), rows.clamp(-1e38, 1e38))  # finite in float32: taken
    got, found = collection.read("small", torch.tensor([1, 2]))
    assert bool(found.all()) and torch.equal(got, rows.clamp(-1e38, 1e38).to(torch.float32))


# --------------------------------------------------------------------------------------------------
# Bad configurations
# --------------------------------------------------------------------------------------------------


def build(tables_, **kwargs):
    kwargs.setdefault("optimizer", te.optim.SGD(lr=0.1))
    return te.EmbeddingBagCollection(tables_, **kwargs)


def test_duplicate_table_names():
    with pytest.raises(ValueError, match="twin"):
        build([te.TableConfig("twin", 4, ["x"]), te.TableConfig("twin", 4, ["y"])])


def test_feature_in_two_tables():
    with pytest.raises(ValueError, match="shared_feature"):
        build([te.TableConfig("a", 4, ["shared_feature"]), te.TableConfig("b", 4, ["shared_feature"])])


def test_no_tables():
    with pytest.raises(ValueError):
        build([])


@pytest.mark.parametrize("dim", [0, -3])
def test_dim_below_one(dim):
    with pytest.raises(ValueError, match="embedding_dim"):
        te.TableConfig("t", dim, ["x"])


def test_unknown_pooling_and_eviction():
    with pytest.raises(ValueError, match="pooling"):
        te.TableConfig("t", 4, ["x"], pooling="max")
    with pytest.raises(ValueError, match="eviction"):
        te.TableConfig("t", 4, ["x"], eviction="random")


@pytest.mark.parametrize("kwargs, message", [
    (dict(init_capacity=0), "init_capacity must be None or an int >= 1"),
    (dict(init_capacity=2.5), "init_capacity must be None or an int >= 1"),
    (dict(init_capacity=101, max_capacity=100), "init_capacity 101 is more than its max_capacity 100"),
    (dict(init_capacity=11, num_embeddings=10), "init_capacity 11 is more than its num_embeddings 10"),
])
def test_bad_init_capacity(kwargs, message):
    with pytest.raises(ValueError, match=message):
        te.TableConfig("t", 4, ["x"], **kwargs)


def test_bad_admission_threshold():
    with pytest.raises(ValueError):
        te.FrequencyAdmission(0)


def test_optimizer_must_be_a_fused_optimizer():
    params = [torch.nn.Parameter(torch.zeros(1))]
    for bad in (torch.optim.SGD(params, lr=0.1), "adam"):
        with pytest.raises(TypeError):
            build([te.TableConfig("t", 4, ["x"])], optimizer=bad)


OPTIMIZERS = {"sgd": te.optim.SGD, "adagrad": te.optim.Adagrad, "rowwise_adagrad": te.optim.RowWiseAdagrad,
              "adam": te.optim.Adam}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_learning_rate_not_finite_and_positive_is_refused_when_set(name):
    """Set between steps (as a schedule does) or given to the constructor; the lr and the rows stay
    as they were, and the next step equals a twin's that never saw it."""
    victim, twin = (trained(te.EmbeddingBagCollection, OPTIMIZERS[name](lr=0.1)) for _ in range(2))
    before = snapshot(victim, tables())
    for bad, error in ((math.nan, ValueError), (math.inf, ValueError), (-math.inf, ValueError),
                       (0.0, ValueError), (0, ValueError), (-0.1, ValueError),
                       ("0.1", TypeError), (None, TypeError), (True, TypeError)):
        with pytest.raises(error, match=rf"{OPTIMIZERS[name].__name__}.*lr.*{bad!r}"):
            victim.optimizer.lr = bad
        assert victim.optimizer.lr == 0.1
        with pytest.raises(error, match="lr"):
            OPTIMIZERS[name](lr=bad)
    assert_snapshot_equal(before, snapshot(victim, tables()))
    for c in (victim, twin):
        c.optimizer.lr = 0.05
        loss_of(c(Batch(GOOD).kjt())).backward()
    assert_snapshot_equal(snapshot(twin, tables()), snapshot(victim, tables()))


def test_tables_must_be_table_configs():
    with pytest.raises(TypeError):
        build([{"name": "t", "embedding_dim": 4, "feature_names": ["x"]}])


def test_unknown_kernels():
    with pytest.raises(ValueError, match="kernels"):
        build([te.TableConfig("t", 4, ["x"])], kernels="cuda_magic")


def test_default_storage_is_hbm_direct():
    assert build([te.TableConfig("t", 4, ["x"])]).storage_mode == "hbm_direct"
    fits = build(
        [te.TableConfig("t", 4, ["x"], num_embeddings=100)], storage=te.StorageConfig(hbm_budget="1GiB")
    )
    assert fits.storage_mode == "hbm_direct"


class _DictStore(te.storage.BackendSpec):
    def open(self, table, width, device):
        from tieredemb.storage.backend import DictBackend

        return DictBackend(width)


@pytest.mark.parametrize(
    "table, budget",
    [
        (te.TableConfig("bounded", 16, ["x"], num_embeddings=1000), 1),
        (te.TableConfig("unbounded", 16, ["x"]), "1GiB"),  # counts as over any finite budget
    ],
    ids=["num_embeddings", "unbounded"],
)
def test_over_budget_selects_cache_or_hybrid(table, budget):
    cache = build([table], storage=te.StorageConfig(hbm_budget=budget, backing=_DictStore()))
    assert cache.storage_mode == "cache"
    hybrid = build([table], storage=te.StorageConfig(hbm_budget=budget, caching=False))
    assert hybrid.storage_mode == "hybrid"
    with pytest.raises(ValueError, match="HostMemory"):
        build([table], storage=te.StorageConfig(hbm_budget=budget, caching=False, backing=_DictStore()))
