"""Embedding memory stashing (CPU): the rows really move (host copies, device tensors dropped, copied
back), so training with stashing on must equal training with it off, for every strategy, both
collections, hbm_direct and cache mode; reads, exports and checkpoints in the stashed window see the
rows; a prefetch in that window writes the copy that comes back. The CUDA run of the same tests and the
memory figures are in tests/gpu and ``tieredemb bench stash``."""

from __future__ import annotations

import pytest
import torch

import tieredemb as te
from tests.pipeline.test_train_pipeline import (
    MODULES,
    OPTIMIZERS,
    Model,
    assert_same_training,
    build,
    make_batches,
    make_tables,
    pipelined,
    plain_loop,
)
from tieredemb.pipeline import Stash, StashConfig, TrainPipeline

STEPS = 20


def stashed_stores(model) -> list:
    return [s for c in model.collections for s in (c.stash._stores.get(c, []) if c.stash else [])]


def watch(model) -> dict:
    """Counts stashes/restores and checks, at each backward, that the rows were on the host
    between the lookup and the restore (the stash really happened)."""
    seen = {"stash": 0, "restore": 0, "moved_bytes": 0}
    for c in model.collections:
        stash = c.stash
        after, restore = stash.after_lookup, stash.restore

        def counted_after(coll, after=after, stash=stash):
            after(coll)
            stores = stash._stores.get(coll, [])
            assert all(s.stashed and s.rows_by_placement()["device"] == 0 for s in stores)
            seen["stash"] += 1
            seen["moved_bytes"] += sum(s.rows_by_placement()["stashed"] * s.width * 4 for s in stores)

        def counted_restore(coll=None, restore=restore):
            if any(s.stashed for s in stashed_stores(model)):
                seen["restore"] += 1
            restore(coll)
            assert not any(s.stashed for s in stashed_stores(model))

        stash.after_lookup, stash.restore = counted_after, counted_restore
    return seen


@pytest.mark.parametrize("strategy", ["event", "record_stream", "blocking"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("module", MODULES, ids=["ebc", "ec"])
def test_stashing_trains_like_no_stashing(module, optimizer, strategy):
    batches = make_batches(STEPS)
    want_model, want_opt = build(module, optimizer)
    want = pipelined(TrainPipeline(want_model, want_opt), batches)
    model, opt = build(module, optimizer)
    pipeline = TrainPipeline(model, opt, stash=StashConfig(strategy=strategy))
    seen = watch(model)
    got = pipelined(pipeline, batches)
    assert_same_training(model, want_model, got, want)
    assert seen["stash"] == STEPS and seen["restore"] == STEPS and seen["moved_bytes"] > 0


def test_stashing_matches_a_plain_loop_without_it():
    """Against the plain loop too (not only the pipeline), with all four optimizers' state moving."""
    batches = make_batches(STEPS)
    for optimizer in OPTIMIZERS:
        want_model, want_opt = build(te.EmbeddingBagCollection, optimizer)
        want = plain_loop(want_model, want_opt, batches)
        model, opt = build(te.EmbeddingBagCollection, optimizer)
        got = pipelined(TrainPipeline(model, opt, stash=StashConfig()), batches)
        assert_same_training(model, want_model, got, want)


def build_cache(module, prefetch_in_thread: bool = False):
    storage = te.StorageConfig(hbm_budget=8 * 12 * 4, caching=True, bucket_width=4, segment_rows=4)
    torch.manual_seed(0)
    coll = module(make_tables("sparse", limited=False), optimizer=te.optim.Adam(lr=0.01),
                  storage=storage, seed=0)
    model = Model([("sparse", coll)])
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


@pytest.mark.parametrize("in_thread", [False, True], ids=["inline", "thread"])
@pytest.mark.parametrize("module", MODULES, ids=["ebc", "ec"])
def test_cache_mode_stashed_while_the_next_batch_prefetches(module, in_thread):
    """Cache mode: prefetch(i+1) runs while batch i's cache is stashed; its fetched rows and
    evictions go through the host copy, which is what comes back."""
    batches = make_batches(STEPS)
    want_model, want_opt = build_cache(module)
    want = pipelined(TrainPipeline(want_model, want_opt), batches)
    model, opt = build_cache(module)
    assert model.collections[0].storage_mode == "cache"
    names = [t.name for t in model.collections[0].table_configs]
    pipeline = TrainPipeline(model, opt, stash=StashConfig(tables=names), prefetch_in_thread=in_thread)
    seen = watch(model)
    got = pipelined(pipeline, batches)
    assert_same_training(model, want_model, got, want, scores=False)
    assert seen["stash"] == STEPS
    assert sum(s.evictions for s in model.collections[0].stats().values()) > 0


def test_prefetch_in_the_stashed_window_writes_the_host_copy():
    """New keys of batch i+1 get their initial rows while batch i is stashed: those rows must be
    written to the host copy (a write to the dropped device tensor would be lost)."""
    batches = make_batches(STEPS, seed=3)
    want_model, want_opt = build(te.EmbeddingCollection, "sgd")
    want = pipelined(TrainPipeline(want_model, want_opt), batches)
    model, opt = build(te.EmbeddingCollection, "sgd")
    coll = model.collections[0]
    pipeline = TrainPipeline(model, opt, stash=StashConfig())
    inserted_while_stashed = []
    prefetch = coll.prefetch

    def prefetch_counting(kjt):
        before = sum(s.rows_in_use() for s in stashed_stores(model))
        prefetch(kjt)
        if any(s.stashed for s in stashed_stores(model)):
            inserted_while_stashed.append(sum(s.rows_in_use() for s in stashed_stores(model)) - before)

    coll.prefetch = prefetch_counting
    got = pipelined(pipeline, batches)
    assert_same_training(model, want_model, got, want)
    assert sum(inserted_while_stashed) > 0  # the scenario happened


def sorted_rows(coll, table: str) -> te.TableRows:
    rows = coll.export(table)
    order = torch.argsort(rows.keys)
    return te.TableRows(rows.keys[order], rows.weights[order], rows.optimizer_state[order],
                        rows.scores[order])


def assert_same_rows(got: te.TableRows, want: te.TableRows) -> None:
    for what in ("keys", "weights", "optimizer_state", "scores"):
        assert torch.equal(getattr(got, what), getattr(want, what)), what


def test_read_export_and_checkpoint_while_stashed(tmp_path):
    """Between the lookup and the restore, read / export / a checkpoint see the rows (compared with a
    twin that does not stash); the checkpoint loads into a fresh model with those rows."""
    model, opt = build(te.EmbeddingBagCollection, "adam")
    twin, twin_opt = build(te.EmbeddingBagCollection, "adam")
    coll, twin_coll = model.collections[0], twin.collections[0]
    stash = Stash([coll], StashConfig(), model)
    batches = make_batches(4)
    plain_loop(twin, twin_opt, batches[:3])
    for batch in batches[:3]:
        with stash.tracking():
            loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    with stash.tracking():
        loss = model(batches[3])  # stashed now, and freed at the end of the forward
    twin_loss = twin(batches[3])
    assert all(s.stashed for s in stashed_stores(model))
    for t in coll.table_configs:
        want = sorted_rows(twin_coll, t.name)
        assert_same_rows(sorted_rows(coll, t.name), want)
        weights, found = coll.read(t.name, want.keys)
        assert found.all() and torch.equal(weights, want.weights)
    te.checkpoint.save(model, tmp_path / "ckpt")
    assert all(s.stashed for s in stashed_stores(model))  # the save did not need a restore
    fresh, _ = build(te.EmbeddingBagCollection, "adam")
    te.checkpoint.load(fresh, tmp_path / "ckpt")
    for t in coll.table_configs:
        assert_same_rows(sorted_rows(fresh.collections[0], t.name), sorted_rows(twin_coll, t.name))
    loss.backward()
    twin_loss.backward()
    for t in coll.table_configs:
        assert_same_rows(sorted_rows(coll, t.name), sorted_rows(twin_coll, t.name))
    stash.close()


def test_a_forward_without_backward_restores_at_the_next_forward():
    model, opt = build(te.EmbeddingBagCollection, "sgd")
    want_model, want_opt = build(te.EmbeddingBagCollection, "sgd")
    Stash([model.collections[0]], StashConfig(), model)
    batches = make_batches(3)
    for m in (model, want_model):
        m(batches[0])  # graph dropped: no backward
    assert all(s.stashed for s in stashed_stores(model))
    got = plain_loop(model, opt, batches[1:])
    want = plain_loop(want_model, want_opt, batches[1:])
    assert_same_training(model, want_model, got, want)


def test_named_sites():
    """free_site / restore_site name modules of the model: the free runs in that module's forward,
    the restore in its backward (before the embedding backward)."""
    model, opt = build(te.EmbeddingBagCollection, "sgd")
    want_model, want_opt = build(te.EmbeddingBagCollection, "sgd")
    batches = make_batches(6)
    want = pipelined(TrainPipeline(want_model, want_opt), batches)
    pipeline = TrainPipeline(model, opt, stash=StashConfig(free_site="top", restore_site="top"))
    stash = model.collections[0].stash
    events = []  # the calls that had something to do
    free, restore = stash.free, stash.restore

    def logged_free():
        if stash._pending:
            events.append("free")
        free()

    def logged_restore(c=None):
        if any(s.stashed for s in stashed_stores(model)):
            events.append("restore at top" if c is None else "restore at the latest")
        restore(c)

    stash.free, stash.restore = logged_free, logged_restore
    got = pipelined(pipeline, batches)
    assert_same_training(model, want_model, got, want)
    assert events == ["free", "restore at top"] * len(batches)


def test_bad_config():
    model, opt = build(te.EmbeddingBagCollection)
    with pytest.raises(ValueError, match="strategy"):
        StashConfig(strategy="lazy")
    with pytest.raises(ValueError, match="free_site applies to the 'event'"):
        StashConfig(strategy="blocking", free_site="top")
    with pytest.raises(ValueError, match="unknown tables"):
        TrainPipeline(model, opt, stash=StashConfig(tables=["nope"]))
    with pytest.raises(ValueError, match="share one row store"):
        TrainPipeline(model, opt, stash=StashConfig(tables=["sparse_a"]))  # sparse_b has the same dim
    with pytest.raises(ValueError, match="no module 'nowhere'"):
        TrainPipeline(model, opt, stash=StashConfig(restore_site="nowhere"))
    with pytest.raises(TypeError, match="StashConfig"):
        TrainPipeline(model, opt, stash={"strategy": "event"})
    pipeline = TrainPipeline(model, opt, stash=StashConfig())
    with pytest.raises(ValueError, match="already attached"):
        Stash(list(model.collections), StashConfig())
    pipeline.close()
    Stash(list(model.collections), StashConfig()).close()  # free again after close
