"""state_dict / load_state_dict of the collections: table state as tensor-like handles read in chunks
(``narrow``), loaded chunk by chunk into any storage layout; a resume through them equals an
uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint.test_checkpoint import (
    Model,
    assert_trains_on_like,
    first_half,
    rows_of,
    storages,
    train,
)
from tests.storage.conftest import redis_factory, redis_server  # noqa: F401 (fixtures)
from tieredemb.modules import state as table_state
from tieredemb.modules.state import TableSlice


@pytest.mark.parametrize("before, after", [("hbm", "cache-rocksdb"), ("cache-rocksdb", "hbm"),
                                           ("cache-redis", "hybrid")])
@pytest.mark.slow
def test_resume_through_state_dict_equals_an_uninterrupted_run(before, after, tmp_path, request, monkeypatch):
    monkeypatch.setattr(table_state, "CHUNK_ROWS", 7)  # several chunks per table
    configs = storages(tmp_path, request)
    bounded, whole, want, first, got = first_half(configs, before, after)
    state = first.state_dict()
    assert isinstance(state["ebc.t.weights"], TableSlice) and "top.weight" in state
    second = Model(configs[after], bounded)
    second.load_state_dict(state)  # reads the handles of the first model, chunk by chunk
    assert second.ebc.step == 6
    first.ebc.close()
    assert_trains_on_like(whole, want, second, got)


def test_handles_read_in_chunks_what_export_holds():
    model = Model(None)
    train(model, range(5))
    state = model.ebc.state_dict()
    for t in ("t", "u", "w"):
        rows = model.ebc.export(t)
        keys, weights, opt = state[f"{t}.keys"], state[f"{t}.weights"], state[f"{t}.optimizer_state"]
        n, dim = keys.numel(), model.ebc.table_configs[["t", "u", "w"].index(t)].embedding_dim
        assert n > 10 and weights.shape == (n, dim) and opt.shape == (n, 2 * dim)
        assert weights.dtype == torch.float32 and weights.element_size() == 4
        assert weights.numel() == n * dim and weights.nbytes == 4 * n * dim and len(weights) == n
        chunks = [weights.narrow(0, s, min(4, n - s)) for s in range(0, n, 4)]
        by_key = dict(zip(rows.keys.tolist(), rows.weights))
        want = torch.stack([by_key[k] for k in keys.tolist()])
        assert torch.equal(torch.cat(chunks), want)
        by_key = dict(zip(rows.keys.tolist(), rows.optimizer_state))
        assert torch.equal(opt.materialize(), torch.stack([by_key[k] for k in keys.tolist()]))
        by_key = dict(zip(rows.keys.tolist(), rows.scores.tolist()))
        assert state[f"{t}.scores"].tolist() == [by_key[k] for k in keys.tolist()]
    assert int(state["step"]) == 5
    with pytest.raises(ValueError, match="out of"):
        state["t.weights"].narrow(0, 1, state["t.keys"].numel())
    with pytest.raises(ValueError, match="only dim 0"):
        state["t.weights"].narrow(1, 0, 1)


def test_narrow_reads_only_its_rows(monkeypatch):
    model = Model(None)
    train(model, range(3))
    handle = model.ebc.state_dict()["t.weights"]
    asked = []
    read = model.ebc.read_full_rows
    monkeypatch.setattr(model.ebc, "read_full_rows", lambda t, keys: (asked.append(keys.numel()),
                                                                      read(t, keys))[1])
    handle.narrow(0, 2, 3)
    assert asked == [3]


def test_a_bad_state_is_refused_naming_the_entry_and_changes_nothing():
    model = Model(None)
    train(model, range(3))
    before = {t: rows_of(model, t) for t in ("t", "u", "w")}
    state = Model(None).state_dict()
    state["ebc.u.weights"] = torch.zeros(state["ebc.u.keys"].numel(), 5)
    with pytest.raises(RuntimeError, match="ebc.u.weights: shape"):
        model.load_state_dict(state)
    del state["ebc.w.scores"]
    with pytest.raises(RuntimeError, match="Missing key.*ebc.w.scores"):
        model.load_state_dict(state)
    for t, (k, r) in before.items():
        k2, r2 = rows_of(model, t)
        assert torch.equal(k, k2) and torch.equal(r, r2)
    assert model.ebc.step == 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e39], ids=["nan", "inf", "beyond_float32"])
def test_rows_that_are_not_finite_are_refused_and_change_nothing(bad):
    """Bad values never enter a table: a loaded row that is not finite in the table's dtype (a
    float64 1e39 overflows float32) is refused, naming the entry and row, before any row changes."""
    model = Model(None)
    train(model, range(3))
    before = {t: rows_of(model, t) for t in ("t", "u", "w")}
    other = Model(None)
    train(other, range(10, 13))
    state = {k: (v.materialize() if hasattr(v, "materialize") else v) for k, v in other.state_dict().items()}
    weights = state["ebc.w.optimizer_state" if bad == 1e39 else "ebc.w.weights"].double()
    weights[2, 0] = bad
    state["ebc.w.optimizer_state" if bad == 1e39 else "ebc.w.weights"] = weights
    entry = "optimizer_state" if bad == 1e39 else "weights"
    with pytest.raises(RuntimeError, match=f"ebc.w.{entry}: row 2 is not finite"):
        model.load_state_dict(state)
    for t, (k, r) in before.items():
        k2, r2 = rows_of(model, t)
        assert torch.equal(k, k2) and torch.equal(r, r2)
    assert model.ebc.step == 3


def test_loading_replaces_the_rows_and_a_model_loads_its_own_state():
    a, b = Model(None), Model(None)
    train(a, range(4))
    train(b, range(10, 13))  # other keys: they must go
    b.load_state_dict(a.state_dict())
    for t in ("t", "u", "w"):
        assert all(torch.equal(x, y) for x, y in zip(rows_of(a, t), rows_of(b, t)))
    a.load_state_dict(a.state_dict())  # its own live handles: read before its rows are replaced
    for t in ("t", "u", "w"):
        assert all(torch.equal(x, y) for x, y in zip(rows_of(a, t), rows_of(b, t)))
