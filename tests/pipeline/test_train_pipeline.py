"""TrainPipeline (CPU): the pipelined schedule trains exactly like a plain loop.

The plain loop is ``loss = model(batch); loss.backward(); opt.step(); opt.zero_grad()``. The pipeline
prefetches batch i+1 between forward i and backward i; the losses, the dense parameters and every
stored embedding row (weights, optimizer state, scores) must come out identical.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import namedtuple

import pytest
import torch
from torch import nn

import tieredemb as te
from tieredemb.pipeline import TrainPipeline

DIM = 4
NUM_DENSE = 3
OPTIMIZERS = {
    "sgd": lambda: te.optim.SGD(lr=0.1),
    "adagrad": lambda: te.optim.Adagrad(lr=0.1),
    "rowwise_adagrad": lambda: te.optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: te.optim.Adam(lr=0.01),
}
# raw int64 ids, negatives and extremes included; a small pool so batches share keys
POOL = [0, 1, -1, 7, 12, 99, 2**40, -(2**50), 2**63 - 1, 123456789] + list(range(100, 130))


# ------------------------------------------------------------------------------------------ models
def make_tables(prefix: str, limited: bool, capacity: int = 16,
                admission: bool = True) -> list[te.TableConfig]:
    """Two tables (one shared by two features); ``limited``: a small capacity and (``admission``)
    admission at 2."""
    kw = {"max_capacity": capacity} if limited else {}
    if limited and admission:
        kw["admission"] = te.FrequencyAdmission(2)
    return [
        te.TableConfig(f"{prefix}_a", DIM, [f"{prefix}0", f"{prefix}1"], **kw),
        te.TableConfig(f"{prefix}_b", DIM, [f"{prefix}2"], **kw),
    ]


def make_collection(
    module: type, prefix: str, optimizer: str = "adam", limited: bool = False, capacity: int = 16,
    admission: bool = True,
):
    storage = te.StorageConfig(bucket_width=4) if limited else None
    tables = make_tables(prefix, limited, capacity, admission)
    return module(tables, optimizer=OPTIMIZERS[optimizer](), storage=storage, seed=0)


def pooled(out: object, batch_size: int) -> torch.Tensor:
    """(B, F * DIM): an EBC's KeyedTensor as is, an EC's sequences sum-pooled per sample."""
    if isinstance(out, te.KeyedTensor):
        return out.values()
    blocks = []
    for jt in out.values():
        sample = torch.repeat_interleave(torch.arange(batch_size), jt.lengths())
        blocks.append(torch.zeros(batch_size, DIM).index_add(0, sample, jt.values()))
    return torch.cat(blocks, dim=1)


class Model(nn.Module):
    """Dense features and one or more collections' pooled embeddings -> a click logit -> BCE loss.

    ``fields``: (batch field, collection) pairs; ``get(batch, name)`` reads a field of the batch.
    """

    def __init__(
        self,
        fields: list[tuple[str, nn.Module]],
        returns_output: bool = False,
        fail_at_call: int | None = None,
    ) -> None:
        super().__init__()
        self.names = [name for name, _ in fields]
        self.collections = nn.ModuleList([c for _, c in fields])
        self.bottom = nn.Linear(NUM_DENSE, DIM)
        self.top = nn.Linear(DIM * (1 + 3 * len(fields)), 1)
        self.returns_output = returns_output
        self.fail_at_call = fail_at_call
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        if self.calls == self.fail_at_call:
            raise ValueError("the model failed on purpose")
        dense, labels = get(batch, "dense"), get(batch, "labels")
        parts = [torch.relu(self.bottom(dense))]
        parts += [pooled(c(get(batch, n)), labels.shape[0]) for n, c in zip(self.names, self.collections)]
        logits = self.top(torch.cat(parts, dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        return (loss, logits.detach()) if self.returns_output else loss


def get(batch, name: str):
    if type(batch).__module__.startswith("torchrec"):  # torchrec.datasets.utils.Batch
        return getattr(batch, {"dense": "dense_features", "sparse": "sparse_features"}.get(name, name))
    if isinstance(batch, dict):
        return batch[name]
    if isinstance(batch, tuple) and not hasattr(batch, "_fields"):
        return batch[("dense", "sparse", "labels").index(name)]
    return getattr(batch, name)


def build(
    module: type, optimizer: str = "adam", limited: bool = False, fields=("sparse",), capacity: int = 16,
    admission: bool = True, **kw
):
    """A model (same dense init every time) and its dense optimizer."""
    torch.manual_seed(0)
    collections = [(f, make_collection(module, f, optimizer, limited, capacity, admission)) for f in fields]
    model = Model(collections, **kw)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


# ----------------------------------------------------------------------------------------- batches
def make_kjt(gen: torch.Generator, prefix: str, batch_size: int, max_bag: int) -> te.KeyedJaggedTensor:
    lengths = torch.randint(0, max_bag + 1, (3 * batch_size,), generator=gen)
    picks = torch.randint(0, len(POOL), (int(lengths.sum()),), generator=gen)
    values = torch.tensor(POOL, dtype=torch.int64)[picks]
    return te.KeyedJaggedTensor([f"{prefix}0", f"{prefix}1", f"{prefix}2"], values, lengths=lengths)


def make_batches(n: int, fields=("sparse",), seed: int = 0, batch_size: int = 4, max_bag: int = 3):
    """``n`` dict batches: dense (B, 3), a KJT per field (3 features, bags of 0..max_bag ids), labels."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        batch = {"dense": torch.randn(batch_size, NUM_DENSE, generator=gen)}
        batch.update({f: make_kjt(gen, f, batch_size, max_bag) for f in fields})
        batch["labels"] = torch.randint(0, 2, (batch_size,), generator=gen).float()
        out.append(batch)
    return out


# ---------------------------------------------------------------------------------------- training
def plain_loop(model, opt, batches) -> list:
    outputs = []
    for batch in batches:
        out = model(batch)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        opt.step()
        opt.zero_grad()
        outputs.append(out)
    return outputs


def pipelined(pipeline: TrainPipeline, batches) -> list:
    outputs, it = [], iter(batches)
    while True:
        try:
            outputs.append(pipeline.progress(it))
        except StopIteration:
            return outputs


def count_prefetches(model) -> list[int]:
    """Counts the calls of each collection's prefetch or prefetch_deferred (from now on); the list
    grows in place."""
    counts = [0] * len(model.collections)

    def counting(i, inner):
        def counted(kjt):
            counts[i] += 1
            inner(kjt)

        return counted

    for i, c in enumerate(model.collections):
        for name in ("prefetch", "prefetch_deferred"):
            setattr(c, name, counting(i, getattr(c, name)))
    return counts


def loss_values(outputs) -> torch.Tensor:
    return torch.stack([(o[0] if isinstance(o, tuple) else o).detach() for o in outputs]) if outputs else None


def assert_same_training(got_model, want_model, got_outputs, want_outputs, scores: bool = True) -> None:
    """Same losses, dense parameters, and stored rows: keys, weights, optimizer state (and scores)."""
    assert len(got_outputs) == len(want_outputs)
    if want_outputs:
        assert torch.equal(loss_values(got_outputs), loss_values(want_outputs))
    for (name, p), q in zip(got_model.named_parameters(), want_model.parameters()):
        assert torch.equal(p, q), f"dense parameter {name} differs"
    for got_c, want_c in zip(got_model.collections, want_model.collections):
        assert got_c.step == want_c.step
        for t in want_c.table_configs:
            got, want = got_c.export(t.name), want_c.export(t.name)
            go, wo = torch.argsort(got.keys), torch.argsort(want.keys)
            assert torch.equal(got.keys[go], want.keys[wo]), f"table {t.name}: stored keys differ"
            for what in ("weights", "optimizer_state", "scores")[: 3 if scores else 2]:
                assert torch.equal(getattr(got, what)[go], getattr(want, what)[wo]), f"{t.name}: {what}"


MODULES = [te.EmbeddingBagCollection, te.EmbeddingCollection]


# ------------------------------------------------------------------------------------------- tests
def stat(model, name: str) -> int:
    return sum(getattr(s, name) for c in model.collections for s in c.stats().values())


@pytest.mark.parametrize("limited", [False, True], ids=["unbounded", "admission+bounded"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("module", MODULES, ids=["ebc", "ec"])
def test_pipeline_trains_like_a_plain_loop(module, optimizer, limited):
    # the bounded tables get small batches: no bucket fills up with rows locked by batches i and i+1
    # (see test_bounded_table_whose_buckets_fill_with_locked_rows)
    batches = make_batches(12, batch_size=2, max_bag=2) if limited else make_batches(12)
    want_model, want_opt = build(module, optimizer, limited)
    want = plain_loop(want_model, want_opt, batches)
    model, opt = build(module, optimizer, limited)
    prefetches = count_prefetches(model)
    got = pipelined(TrainPipeline(model, opt), batches)
    assert_same_training(model, want_model, got, want)
    assert prefetches == [len(batches)]
    if limited:  # the scenario exercises what it is named for
        assert stat(model, "not_admitted") > 0 and stat(model, "evictions") > 0
        assert stat(model, "conflict_misses") == 0


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "hybrid"])
def test_pipeline_over_tiered_storage(caching):
    """A device budget of a few rows: misses go to the backing store (cache) or host segments (hybrid).
    In cache mode only the rows count, not the scores: which rows sit in the device cache differs."""
    storage = te.StorageConfig(hbm_budget=8 * 12 * 4, caching=caching, bucket_width=4, segment_rows=4)

    def build_tiered():
        torch.manual_seed(0)
        tables = make_tables("sparse", limited=False)
        ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.Adam(lr=0.01), storage=storage, seed=0)
        model = Model([("sparse", ebc)])
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    batches = make_batches(12)
    want_model, want_opt = build_tiered()
    want = plain_loop(want_model, want_opt, batches)
    model, opt = build_tiered()
    assert model.collections[0].storage_mode == ("cache" if caching else "hybrid")
    got = pipelined(TrainPipeline(model, opt), batches)
    assert_same_training(model, want_model, got, want, scores=not caching)
    if caching:  # evictions write back; conflict misses go through the scratch pad
        assert stat(model, "evictions") > 0 and stat(model, "conflict_misses") > 0
    else:
        assert sum(s.memory_bytes["host"] for s in model.collections[0].stats().values()) > 0


@pytest.mark.parametrize("seed", range(7))
def test_tiny_caches_over_host_memory_through_the_pipeline_equal_hbm_direct(seed, monkeypatch):
    """Random small device caches over HostMemory (2-16 rows, buckets of 2 or 4 ways), one or two
    tables, each optimizer, with or without the prefetch thread: two batches in flight lock most
    ways, so misses train in scratch rows that later batches share, inserted on the device. The
    losses and every row equal hbm_direct's, and no row of the cache's store is lost or freed
    twice."""
    import random

    from tests.modules.test_tiered_modes import shared_pads

    pads = shared_pads(monkeypatch)
    rnd = random.Random(seed)
    optimizer = OPTIMIZERS[rnd.choice(sorted(OPTIMIZERS))]()
    width = DIM + optimizer.state_width(DIM)
    storage = te.StorageConfig(hbm_budget=rnd.choice([2, 4, 8, 16]) * width * 4, segment_rows=8,
                               bucket_width=rnd.choice([2, 4]), backing=te.storage.HostMemory(segment_rows=8))
    features = [f"f{i}" for i in range(rnd.choice([1, 2]))]
    tables = [te.TableConfig(f"t{i}", DIM, [f], num_embeddings=60) for i, f in enumerate(features)]
    gen = torch.Generator().manual_seed(seed)
    batch = rnd.choice([2, 4, 8])

    class Loss(nn.Module):
        def __init__(self, ebc) -> None:
            super().__init__()
            self.ebc = ebc

        def forward(self, b: dict) -> torch.Tensor:
            return (self.ebc(b["kjt"]).values() * b["grad"]).sum()

    data = []
    for _ in range(12):
        lengths = torch.randint(0, 5, (len(features) * batch,), generator=gen)
        ids = torch.randint(0, rnd.choice([10, 30, 60]), (int(lengths.sum()),), generator=gen)
        data.append({"kjt": te.KeyedJaggedTensor(features, ids, lengths=lengths),
                     "grad": torch.randn(batch, len(features) * DIM, generator=gen)})
    cached = te.EmbeddingBagCollection(tables, optimizer=optimizer, storage=storage, seed=1)
    plain = te.EmbeddingBagCollection(tables, optimizer=optimizer, seed=1)
    in_thread = rnd.random() < 0.3
    got = pipelined(TrainPipeline(Loss(cached), None, prefetch_in_thread=in_thread), data)
    want = []
    for b in data:
        loss = Loss(plain)(b)
        loss.backward()
        want.append(loss.detach())
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-4, atol=1e-4)
    for t in tables:
        a, b = cached.export(t.name), plain.export(t.name)
        oa, ob = torch.argsort(a.keys), torch.argsort(b.keys)
        assert torch.equal(a.keys[oa], b.keys[ob])
        torch.testing.assert_close(torch.cat([a.weights, a.optimizer_state], 1)[oa],
                                   torch.cat([b.weights, b.optimizer_state], 1)[ob], rtol=1e-4, atol=1e-5)
    (group,) = cached.tiers
    free = group.store.peek(group.store.rows_allocated() - group.store.rows_in_use())
    assert free.unique().numel() == free.numel() and group.store.rows_in_use() == group.index.size()
    assert group.insertions[1:] == [0, 0], group.insertions  # every insertion on the device
    if not in_thread:  # (these seeds' draws share pads; with the thread, when is not fixed)
        assert sum(pads) > 0, pads


@pytest.mark.parametrize("admission", [True, False])  # without: the prefetch is staged
def test_bounded_table_whose_buckets_fill_with_locked_rows(monkeypatch, admission):
    """prefetch(i+1) meets buckets holding rows batch i still has locked: the misses there are
    inserted after batch i's release (as a plain loop does, choosing victims among those rows too),
    so the pipeline keeps and evicts exactly the plain loop's rows. With admission the prefetch
    inserts before that release and defers them (``settle``); staged (no admission), its insertion
    comes after batch i gave its locks back, and the pairs its probe contested go in with the
    misses, none deferred."""
    from tieredemb.storage.tiers.device import DeviceTier

    deferrals, contested = [], []
    placed = DeviceTier._placed

    def counted(self, *args, **kwargs):
        info, regions = args[8], len(self.configs)
        contested.append(sum(info[2 * regions : 3 * regions]))
        pf = placed(self, *args, **kwargs)
        deferrals.append(0 if pf.deferred is None else pf.deferred[0].numel())
        return pf

    monkeypatch.setattr(DeviceTier, "_placed", counted)
    batches = make_batches(12)
    kw = {"limited": True, "capacity": 12, "admission": admission}
    want_model, want_opt = build(te.EmbeddingBagCollection, "sgd", **kw)
    want = plain_loop(want_model, want_opt, batches)
    assert sum(deferrals) == sum(contested) == 0  # nothing in flight
    model, opt = build(te.EmbeddingBagCollection, "sgd", **kw)
    got = pipelined(TrainPipeline(model, opt), batches)
    assert sum(contested[len(batches):]) > 0  # the pipelined run's probes met locked buckets
    assert (sum(deferrals[len(batches):]) > 0) == admission
    assert stat(model, "conflict_misses") == stat(want_model, "conflict_misses")
    assert stat(model, "evictions") == stat(want_model, "evictions") > 0
    assert_same_training(model, want_model, got, want)


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_every_batch_is_trained_then_stop_iteration(n):
    batches = make_batches(n)
    want_model, want_opt = build(te.EmbeddingBagCollection)
    want = plain_loop(want_model, want_opt, batches)
    model, opt = build(te.EmbeddingBagCollection)
    pipeline = TrainPipeline(model, opt)
    it = iter(batches)
    got = []
    for _ in range(n):
        got.append(pipeline.progress(it))
    for _ in range(2):  # drained: StopIteration, and again
        with pytest.raises(StopIteration):
            pipeline.progress(it)
    assert model.calls == n
    assert_same_training(model, want_model, got, want)
    # a new iterator starts a new epoch
    more = make_batches(3, seed=1)
    assert_same_training(model, want_model, pipelined(pipeline, more), plain_loop(want_model, want_opt, more))


def test_model_returning_loss_and_output():
    batches = make_batches(5)
    want_model, want_opt = build(te.EmbeddingCollection, returns_output=True)
    want = plain_loop(want_model, want_opt, batches)
    model, opt = build(te.EmbeddingCollection, returns_output=True)
    got = pipelined(TrainPipeline(model, opt), batches)
    assert all(isinstance(o, tuple) and len(o) == 2 for o in got)
    assert_same_training(model, want_model, got, want)
    for (_, g), (_, w) in zip(got, want):
        assert torch.equal(g, w)


def test_two_collections_fed_from_two_fields():
    fields = ("user", "item")
    batches = make_batches(10, fields)
    want_model, want_opt = build(te.EmbeddingBagCollection, fields=fields)
    want = plain_loop(want_model, want_opt, batches)
    model, opt = build(te.EmbeddingBagCollection, fields=fields)
    prefetches = count_prefetches(model)
    got = pipelined(TrainPipeline(model, opt), batches)
    assert_same_training(model, want_model, got, want)
    assert prefetches == [10, 10]


Fields = namedtuple("Fields", ["dense", "sparse", "labels"])


@dataclasses.dataclass
class DataclassBatch:
    dense: torch.Tensor
    sparse: te.KeyedJaggedTensor
    labels: torch.Tensor


class MovableBatch:
    """TorchRec-style: moves itself; the KJT is the ``sparse_features`` attribute."""

    def __init__(self, dense, sparse_features, labels) -> None:
        self.dense, self.sparse_features, self.labels = dense, sparse_features, labels
        self.moves = 0

    @property
    def sparse(self):
        return self.sparse_features

    def to(self, device, non_blocking: bool = False) -> MovableBatch:
        moved = MovableBatch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse_features.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )
        moved.moves = self.moves + 1
        return moved


@pytest.mark.parametrize("kind", ["tuple", "namedtuple", "dataclass", "to"])
def test_batch_types(kind):
    make = {
        "tuple": lambda b: (b["dense"], b["sparse"], b["labels"]),
        "namedtuple": lambda b: Fields(b["dense"], b["sparse"], b["labels"]),
        "dataclass": lambda b: DataclassBatch(b["dense"], b["sparse"], b["labels"]),
        "to": lambda b: MovableBatch(b["dense"], b["sparse"], b["labels"]),
    }[kind]
    batches = [make(b) for b in make_batches(4)]
    want_model, want_opt = build(te.EmbeddingBagCollection)
    want = plain_loop(want_model, want_opt, batches)
    model, opt = build(te.EmbeddingBagCollection)
    seen = []
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    prefetches = count_prefetches(model)
    got = pipelined(TrainPipeline(model, opt), batches)
    assert_same_training(model, want_model, got, want)
    assert prefetches == [4]
    if kind == "to":
        assert all(b.moves == 1 for b in seen)  # the pipeline called the batch's own .to


def test_torchrec_batch_and_kjt():
    """TorchRec's ``Batch`` (moves itself) with a ``torchrec.KeyedJaggedTensor`` as sparse_features."""
    torchrec = pytest.importorskip("torchrec")
    from torchrec.datasets.utils import Batch as TorchRecBatch

    def convert(b):
        kjt = b["sparse"]
        sparse = torchrec.KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths())
        return TorchRecBatch(dense_features=b["dense"], sparse_features=sparse, labels=b["labels"])

    batches = [convert(b) for b in make_batches(4)]
    want_model, want_opt = build(te.EmbeddingBagCollection)
    want = plain_loop(want_model, want_opt, batches)
    model, opt = build(te.EmbeddingBagCollection)
    prefetches = count_prefetches(model)
    got = pipelined(TrainPipeline(model, opt), batches)
    assert_same_training(model, want_model, got, want)
    assert prefetches == [4]


def test_a_kjt_matching_no_collection_is_a_clear_error():
    batches = make_batches(3)
    batches[0]["extra"] = te.KeyedJaggedTensor(["nope"], torch.tensor([1]),
                                               lengths=torch.tensor([1, 0, 0, 0]))
    model, opt = build(te.EmbeddingBagCollection)
    pipeline = TrainPipeline(model, opt)
    with pytest.raises(ValueError, match=r"'extra'.*\['nope'\] matches no embedding collection"):
        pipeline.progress(iter(batches))
    assert model.calls == 0


def test_a_batch_on_the_meta_device_is_a_clear_error():
    """A batch with no data (``meta``) is refused naming the device, when its turn comes; the model
    never sees it."""
    batches = make_batches(2)
    sparse = batches[0]["sparse"]
    batches[0]["sparse"] = te.KeyedJaggedTensor(sparse.keys(), sparse.values().to("meta"),
                                                lengths=sparse.lengths().to("meta"))
    model, opt = build(te.EmbeddingBagCollection)
    with pytest.raises(ValueError, match="meta device holds no data"):
        TrainPipeline(model, opt).progress(iter(batches))
    assert model.calls == 0


def test_a_collection_without_a_kjt_resolves_in_forward(caplog):
    """The model builds its KJT itself: nothing to prefetch, same training, one warning."""
    batches = make_batches(4)

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch):  # batch: (dense, values, lengths, labels), no KJT in it
            dense, values, lengths, labels = batch
            kjt = te.KeyedJaggedTensor(["sparse0", "sparse1", "sparse2"], values, lengths=lengths)
            return self.inner({"dense": dense, "sparse": kjt, "labels": labels})

    def plain(b):
        return (b["dense"], b["sparse"].values(), b["sparse"].lengths(), b["labels"])

    want_model, want_opt = build(te.EmbeddingBagCollection)
    want = plain_loop(want_model, want_opt, batches)
    model, opt = build(te.EmbeddingBagCollection)
    with caplog.at_level(logging.WARNING, logger="tieredemb.pipeline.train_pipeline"):
        got = pipelined(TrainPipeline(Wrapped(model), opt), [plain(b) for b in batches])
    assert_same_training(model, want_model, got, want)
    assert sum("resolve their rows in forward" in r.message for r in caplog.records) == 1


def test_an_error_in_the_model_fails_the_pipeline_and_releases_the_model():
    batches = make_batches(6)
    model, opt = build(te.EmbeddingBagCollection, fail_at_call=3)
    pipeline = TrainPipeline(model, opt)
    it = iter(batches)
    pipeline.progress(it)
    pipeline.progress(it)
    with pytest.raises(ValueError, match="failed on purpose"):
        pipeline.progress(it)
    with pytest.raises(RuntimeError, match="failed in an earlier step") as info:
        pipeline.progress(it)
    assert isinstance(info.value.__cause__, ValueError)
    # nothing of the pipeline is left queued in the collection: plain steps and a new pipeline work
    plain_loop(model, opt, [batches[3]])
    pipelined(TrainPipeline(model, opt), batches[4:])
    assert model.calls == 3 + 1 + 2


def test_a_bad_batch_fails_when_its_turn_comes():
    """Batch 2's ids are invalid: its prefetch (during step 1) fails, step 1 still completes, and
    step 2 raises the collection's ValueError; the rows are those of batches 0 and 1 exactly."""
    batches = make_batches(5)
    bad = batches[2]["sparse"]
    values = bad.values().clone()
    values[0] = te.RESERVED_KEY
    batches[2]["sparse"] = te.KeyedJaggedTensor(bad.keys(), values, lengths=bad.lengths())
    want_model, want_opt = build(te.EmbeddingBagCollection)
    want = plain_loop(want_model, want_opt, batches[:2])
    model, opt = build(te.EmbeddingBagCollection)
    pipeline = TrainPipeline(model, opt)
    it = iter(batches)
    got = [pipeline.progress(it), pipeline.progress(it)]
    with pytest.raises(ValueError, match="RESERVED_KEY"):
        pipeline.progress(it)
    assert model.calls == 2
    assert_same_training(model, want_model, got, want)


def test_the_model_must_pass_on_the_prefetched_kjt():
    class Skips(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, batch):
            return self.inner.bottom(batch["dense"]).sum()  # never calls the collection

    model, opt = build(te.EmbeddingBagCollection)
    pipeline = TrainPipeline(Skips(model), opt)
    with pytest.raises(RuntimeError, match="did not pass"):
        pipeline.progress(iter(make_batches(3)))
    plain_loop(model, opt, make_batches(1))  # the withdrawn prefetches do not block the collection


def test_prefetch_in_thread_trains_like_a_plain_loop():
    """The worker-thread prefetch, where the race it still has cannot change a row (see the class
    docstring): unbounded tables, no admission."""
    batches = make_batches(12)
    want_model, want_opt = build(te.EmbeddingCollection)
    want = plain_loop(want_model, want_opt, batches)
    model, opt = build(te.EmbeddingCollection)
    pipeline = TrainPipeline(model, opt, prefetch_in_thread=True)
    threads = []
    inner = model.collections[0].prefetch
    model.collections[0].prefetch = lambda kjt: (threads.append(threading.current_thread().name), inner(kjt))
    got = pipelined(pipeline, batches)
    assert len(threads) == len(batches) and all(t.startswith("tieredemb-prefetch") for t in threads)
    pipeline.close()
    assert_same_training(model, want_model, got, want)


@pytest.mark.parametrize("autograd_threads", [False, True])
def test_backward_runs_with_autograd_multithreading_as_asked(autograd_threads):
    """The pipeline's backward runs with autograd's worker threads off by default (on CUDA the
    backward then runs on the training thread) and leaves the process-wide setting as it found it."""
    model, opt = build(te.EmbeddingBagCollection)
    seen = []
    model.bottom.weight.register_hook(lambda g: seen.append(torch._C._is_multithreading_enabled()))
    pipeline = TrainPipeline(model, opt, autograd_threads=autograd_threads)
    pipelined(pipeline, make_batches(3))
    assert seen == [autograd_threads] * 3
    assert torch._C._is_multithreading_enabled()


def test_close_releases_batches_in_flight():
    model, opt = build(te.EmbeddingBagCollection)
    pipeline = TrainPipeline(model, opt)
    pipeline.progress(iter(make_batches(5)))  # batch 1 is prefetched now
    pipeline.close()
    with pytest.raises(RuntimeError, match="closed"):
        pipeline.progress(iter(make_batches(1)))
    model.eval()
    with torch.no_grad():
        model(make_batches(1, seed=3)[0])  # a forward of another batch: nothing queued ahead of it


def test_profiler_labels_each_stage():
    model, opt = build(te.EmbeddingBagCollection)
    pipeline = TrainPipeline(model, opt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipelined(pipeline, make_batches(3))
    names = {e.key for e in prof.key_averages()}
    for stage in ("copy_batch", "prefetch", "wait_for_batch", "forward", "backward", "optimizer"):
        assert f"## {stage} ##" in names


def test_arguments():
    model, opt = build(te.EmbeddingBagCollection)
    with pytest.raises(TypeError, match="StashConfig"):
        TrainPipeline(model, opt, stash=object())
    pipeline = TrainPipeline(model, opt)
    assert pipeline.device == torch.device("cpu")
    with pytest.raises(TypeError, match="iterator"):
        pipeline.progress(make_batches(2))  # a list, not an iterator


def test_dense_only_model_without_optimizer_of_embeddings():
    """A model of embeddings only (optimizer None) returning a loss without dense parameters."""
    ebc = make_collection(te.EmbeddingBagCollection, "sparse")
    twin = make_collection(te.EmbeddingBagCollection, "sparse")

    def loss_fn(collection):
        return lambda batch: (collection(batch["sparse"]).values() ** 2).sum()

    class Fn(nn.Module):
        def __init__(self, collection):
            super().__init__()
            self.collections = nn.ModuleList([collection])
            self.fn = loss_fn(collection)

        def forward(self, batch):
            return self.fn(batch)

    batches = make_batches(4)
    want_model, model = Fn(twin), Fn(ebc)
    want = []
    for b in batches:
        loss = want_model(b)
        loss.backward()
        want.append(loss)
    got = pipelined(TrainPipeline(model, None), batches)
    assert_same_training(model, want_model, got, want)
