"""Initial rows: a pure function of (seed, table name, key), with each initializer's distribution.

Rows are observed through the public API only: a collection trained on a zero gradient stores the keys
it sees without changing them, and ``export``/``read`` return them.
"""

from __future__ import annotations

import math

import pytest
import torch

import tieredemb as te
from tests.conftest import RAW_KEYS, Batch, initial_rows, loss_of, sorted_export

KEYS = RAW_KEYS + list(range(100, 160)) + [-(2**62), 2**62 + 3]


def stored_rows(collection, table: str) -> dict[int, torch.Tensor]:
    keys, weights, _, _ = sorted_export(collection, table)
    return dict(zip(keys.tolist(), weights))


def train_zero_grad(
    tables, chunks: list[dict[str, list[int]]], module=te.EmbeddingBagCollection, seed: int = 0
):
    """A collection that has seen ``chunks`` (one batch each: feature -> ids in one bag), each step
    with a zero gradient (SGD leaves the rows as they were)."""
    collection = module(tables, optimizer=te.optim.SGD(lr=1.0), seed=seed)
    features = [f for t in tables for f in t.feature_names]
    for chunk in chunks:
        batch = Batch({f: [chunk.get(f, [])] for f in features})
        (loss_of(collection(batch.kjt())) * 0).backward()
    return collection


def split(keys: list[int], sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(keys[start : start + n])
        start += n
    out.append(keys[start:])
    return out


def test_rows_do_not_depend_on_insertion_order_batch_split_capacity_or_module():
    def table(**kw) -> te.TableConfig:
        return te.TableConfig("user", 8, ["u"], initializer=te.init.Normal(0.0, 1.0), **kw)

    baseline = stored_rows(train_zero_grad([table()], [{"u": KEYS}]), "user")
    assert sorted(baseline) == sorted(KEYS)

    reversed_in_chunks = [{"u": c} for c in split(KEYS[::-1], [1, 5, 17, 2])]
    variants = {
        "reversed, split in 5 batches": train_zero_grad([table()], reversed_in_chunks),
        "max_capacity 10_000": train_zero_grad([table(max_capacity=10_000)], [{"u": KEYS}]),
        "another table beside it": train_zero_grad(
            [te.TableConfig("other", 8, ["o"]), table()],
            [{"o": KEYS[:9]}, {"u": KEYS[::2]}, {"u": KEYS[1::2], "o": KEYS}],
        ),
        "EmbeddingCollection": train_zero_grad([table()], [{"u": KEYS[::-1]}], module=te.EmbeddingCollection),
    }
    for what, collection in variants.items():
        rows = stored_rows(collection, "user")
        assert sorted(rows) == sorted(KEYS), what
        for k in KEYS:
            assert torch.equal(rows[k], baseline[k]), f"{what}: key {k} got a different row"


def test_rows_of_a_bounded_table_equal_those_of_an_unbounded_one():
    keys = list(range(0, 1000, 37))
    bounded = te.TableConfig("t", 4, ["x"], num_embeddings=1000)
    unbounded = te.TableConfig("t", 4, ["x"])
    torch.testing.assert_close(initial_rows(bounded, keys), initial_rows(unbounded, keys), rtol=0, atol=0)


def test_read_after_first_use_equals_first_forward():
    """The forward of a key's first step used exactly its stored initial row."""
    table = te.TableConfig("t", 4, ["x"], initializer=te.init.Uniform(-1.0, 1.0))
    ebc = te.EmbeddingBagCollection([table], optimizer=te.optim.SGD(lr=1.0), seed=5)
    out = ebc(Batch({"x": [[11], [-3]]}).kjt())
    (out.values().sum() * 0).backward()  # a zero gradient: SGD leaves the rows as they were
    rows, found = ebc.read("t", torch.tensor([11, -3]))
    assert found.all()
    torch.testing.assert_close(out.values().detach(), rows, rtol=0, atol=0)


def test_different_seeds_give_different_rows():
    table = te.TableConfig("t", 8, ["x"])
    a, b = initial_rows(table, KEYS, seed=0), initial_rows(table, KEYS, seed=1)
    assert not (a == b).all(dim=1).any(), "some key got the same row under two seeds"


def test_different_table_names_give_different_rows():
    tables = [te.TableConfig("left", 8, ["l"]), te.TableConfig("right", 8, ["r"])]
    collection = train_zero_grad(tables, [{"l": KEYS, "r": KEYS}])
    left, right = stored_rows(collection, "left"), stored_rows(collection, "right")
    for k in KEYS:
        assert not torch.equal(left[k], right[k]), f"key {k} has the same row in both tables"


def test_different_keys_and_columns_differ():
    rows = initial_rows(te.TableConfig("t", 8, ["x"]), KEYS)
    assert torch.unique(rows, dim=0).shape[0] == len(KEYS), "two keys share an initial row"
    assert (rows.std(dim=1) > 0).all(), "a row is constant across its columns"


# --------------------------------------------------------------------------------------------------
# Distributions
# --------------------------------------------------------------------------------------------------

N_KEYS, DIM = 4096, 8  # 32768 samples


def sample(initializer) -> torch.Tensor:
    """float64 (N_KEYS, DIM) initial rows of spread-out raw keys."""
    keys = (torch.arange(N_KEYS, dtype=torch.int64) * 7919 - 2**40).tolist()
    table = te.TableConfig("dist", DIM, ["x"], initializer=initializer)
    return initial_rows(table, keys, seed=17).double()


def assert_moments(x: torch.Tensor, mean: float, std: float) -> None:
    """Sample mean within 5 standard errors, sample std within 3%, overall and per column."""
    tol = 5 * std / math.sqrt(x.numel())
    assert abs(x.mean().item() - mean) < tol, f"mean {x.mean().item()} vs {mean}"
    assert abs(x.std().item() / std - 1) < 0.03, f"std {x.std().item()} vs {std}"
    col_tol = 5 * std / math.sqrt(x.shape[0])
    assert ((x.mean(dim=0) - mean).abs() < col_tol).all(), "a column's mean is off"


def test_uniform():
    lo, hi = -0.3, 0.7
    x = sample(te.init.Uniform(lo, hi))
    assert x.min() >= lo and x.max() <= hi
    assert x.min() < lo + 0.01 and x.max() > hi - 0.01, "does not fill the range"
    assert_moments(x, (lo + hi) / 2, (hi - lo) / math.sqrt(12))
    counts = torch.histc(x, bins=10, min=lo, max=hi)
    assert ((counts / x.numel() - 0.1).abs() < 0.01).all(), f"not flat: {counts}"


def test_normal():
    mean, std = 0.5, 2.0
    x = sample(te.init.Normal(mean, std))
    assert_moments(x, mean, std)
    within_one_sigma = ((x - mean).abs() < std).double().mean().item()
    assert abs(within_one_sigma - 0.6827) < 0.01, f"{within_one_sigma} within one sigma"


def _phi(z: float) -> float:
    return math.exp(-z * z / 2) / math.sqrt(2 * math.pi)


def _cdf(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def test_truncated_normal():
    mean, std, a, b = 0.1, 1.0, -0.5, 1.5
    x = sample(te.init.TruncatedNormal(mean, std, a, b))
    assert x.min() >= a and x.max() <= b
    # Moments of the normal truncated to [a, b] (a, b absolute bounds).
    alpha, beta = (a - mean) / std, (b - mean) / std
    z = _cdf(beta) - _cdf(alpha)
    shift = (_phi(alpha) - _phi(beta)) / z
    var = std**2 * (1 + (alpha * _phi(alpha) - beta * _phi(beta)) / z - shift**2)
    assert_moments(x, mean + std * shift, math.sqrt(var))


@pytest.mark.parametrize("value", [0.0, 0.25, -3.5])
def test_constant(value):
    x = initial_rows(te.TableConfig("c", 5, ["x"], initializer=te.init.Constant(value)), KEYS)
    assert torch.equal(x, torch.full((len(KEYS), 5), value))


def test_default_initializer_is_small_uniform():
    """TableConfig's default is documented as Uniform(-0.01, 0.01)."""
    x = initial_rows(te.TableConfig("d", 8, ["x"]), KEYS)
    assert x.abs().max() <= 0.01 and x.abs().max() > 0.005
