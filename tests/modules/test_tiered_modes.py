"""Cache mode computes the same function as hbm_direct, whatever the cache size, eviction policy,
admission and prefetch schedule; after flush() the backing store alone holds the table.

The backing store here is the plain dict backend (the reference the real backends are tested
against in tests/storage)."""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tieredemb as te
from tests.storage.conftest import redis_factory, redis_server  # noqa: F401 (fixtures)
from tieredemb.storage.backend import DictBackend
from tieredemb.storage.backends import BackendSpec

DIM, ROWS = 4, 300


class DictStore(BackendSpec):
    """A spec opening DictBackends, and remembering them so the test can look inside."""

    def __init__(self) -> None:
        self.opened: dict[str, DictBackend] = {}

    def open(self, table: str, width: int, device: torch.device,
             dtype: torch.dtype = torch.float32) -> DictBackend:
        self.opened[table] = DictBackend(width, dtype)
        return self.opened[table]


def zipf_batches(steps: int, batch: int, seed: int) -> list[te.KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** 1.1
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (2 * batch,), generator=gen)
        n = int(lengths.sum())
        ids = (torch.multinomial(weights, n, replacement=True, generator=gen) if n
               else torch.empty(0, dtype=torch.int64))
        out.append(te.KeyedJaggedTensor(["a", "b"], ids * 7 % ROWS, lengths=lengths))
    return out


def make(storage: te.StorageConfig | None, eviction: str, admission: int | None,
         optimizer: te.optim.EmbeddingOptimizer) -> te.EmbeddingBagCollection:
    adm = te.FrequencyAdmission(admission) if admission else None
    tables = [te.TableConfig("t", DIM, ["a", "b"], num_embeddings=ROWS, eviction=eviction,
                             admission=adm, initializer=te.init.Normal(0.0, 0.1))]
    return te.EmbeddingBagCollection(tables, optimizer=optimizer, storage=storage, seed=3)


def train(ebc: te.EmbeddingBagCollection, batches: list, pipelined: bool,
          ahead: int = 0) -> list[torch.Tensor]:
    """30 steps; pipelined: prefetch(i+1) is issued before backward(i); ``ahead``: batch i+ahead's
    rows read ahead (into a host tier) before step i."""
    outs = []
    grad_gen = torch.Generator().manual_seed(11)
    if pipelined:
        ebc.prefetch(batches[0])
    for i, kjt in enumerate(batches):
        if ahead and i + ahead < len(batches):
            ebc.read_ahead(batches[i + ahead])
        out = ebc(kjt).values()
        if pipelined and i + 1 < len(batches):
            ebc.prefetch(batches[i + 1])
        (out * torch.randn(out.shape, generator=grad_gen)).sum().backward()
        outs.append(out.detach())
    return outs


def sorted_rows(rows: te.TableRows) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(rows.keys)
    return rows.keys[order], torch.cat([rows.weights, rows.optimizer_state], 1)[order]


def trains_alike(ebc: te.EmbeddingBagCollection, ref: te.EmbeddingBagCollection, batches: list,
                 pipelined: bool, ahead: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Train both on ``batches``; assert equal outputs and equal stored rows. Returns the reference's
    (keys, rows) sorted by key."""
    for g, w in zip(train(ebc, batches, pipelined, ahead), train(ref, batches, pipelined)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    keys, rows = sorted_rows(ebc.export("t"))
    want_keys, want_rows = sorted_rows(ref.export("t"))
    assert torch.equal(keys, want_keys)
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-6)
    for tier in ebc.tiers:  # every batch retired: no lock left behind in any index
        for index in (tier.index, getattr(tier, "bound", None), getattr(tier, "in_flight", None)):
            if index is not None and index.locking:
                assert int(index.locks.sum()) == 0, f"{type(tier).__name__}: locks left held"
    return want_keys, want_rows


@pytest.mark.parametrize("optimizer", [te.optim.Adam(lr=0.05), te.optim.RowWiseAdagrad(lr=0.1)],
                         ids=["adam", "rowwise"])
@pytest.mark.parametrize("cache_buckets", [1, 3, 74])  # 74 x 4 = 296 of 300 rows
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("admission", [None, 2])
@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("backing", ["dict", "host"])  # host memory: inserted on the device (no admission)
@pytest.mark.slow
def test_cache_matches_hbm_direct(optimizer, cache_buckets, eviction, admission, pipelined, backing) -> None:
    width = 4
    row_bytes = (DIM + optimizer.state_width(DIM)) * 4
    store = DictStore() if backing == "dict" else te.storage.HostMemory(segment_rows=64)
    storage = te.StorageConfig(hbm_budget=cache_buckets * width * row_bytes, backing=store,
                               bucket_width=width, segment_rows=16)
    cached = make(storage, eviction, admission, optimizer)
    assert cached.storage_mode == "cache"
    plain = make(None, eviction, admission, optimizer)
    batches = zipf_batches(30, 6, seed=cache_buckets)
    want_keys, want_rows = trains_alike(cached, plain, batches, pipelined)
    stats = cached.stats()["t"]
    if cache_buckets == 1:
        assert stats.evictions > 0  # the small caches really evicted
    cached.flush()
    backend = cached.tiers[0].below.table(0)
    assert backend.size() == want_keys.numel()
    fetched = backend.get(want_keys)
    assert bool(fetched.found.all())
    torch.testing.assert_close(fetched.rows, want_rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backing", ["dict", "host"])
@pytest.mark.parametrize("cache_buckets", [1, 3])
@pytest.mark.parametrize("pipelined", [False, True])
def test_tables_batched_in_one_cache_stay_apart(backing, cache_buckets, pipelined) -> None:
    """Three tables of one dim share a cache index and row store (a region each); the same raw
    ids in each are different rows, with their own policy, admission and initializer. Trained as
    hbm_direct would, and after flush each table's backend holds exactly its own rows."""
    optimizer = te.optim.Adagrad(lr=0.1)
    tables = [te.TableConfig("t", DIM, ["a"], num_embeddings=ROWS, initializer=te.init.Normal(0.0, 0.1)),
              te.TableConfig("u", DIM, ["b"], num_embeddings=ROWS, eviction="lfu",
                             admission=te.FrequencyAdmission(2)),
              te.TableConfig("v", DIM, ["c"], num_embeddings=ROWS, pooling="mean",
                             initializer=te.init.Constant(0.5))]
    row_bytes = (DIM + optimizer.state_width(DIM)) * 4
    store = DictStore() if backing == "dict" else te.storage.HostMemory()  # one store for the group
    storage = te.StorageConfig(hbm_budget=3 * cache_buckets * 4 * row_bytes, backing=store,
                               bucket_width=4, segment_rows=16)
    cached = te.EmbeddingBagCollection(tables, optimizer=optimizer, storage=storage, seed=3)
    plain = te.EmbeddingBagCollection(tables, optimizer=optimizer, seed=3)
    assert cached.storage_mode == "cache" and len(cached.tiers) == 1
    batches = []
    for kjt in zipf_batches(30, 5, seed=cache_buckets):  # feature c repeats feature a's bags
        ids, lengths = kjt.values(), kjt.lengths()
        a_ids = ids[: int(lengths[:5].sum())]
        batches.append(te.KeyedJaggedTensor(["a", "b", "c"], torch.cat([ids, a_ids]),
                                            lengths=torch.cat([lengths, lengths[:5]])))
    for g, w in zip(train(cached, batches, pipelined), train(plain, batches, pipelined)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert sum(s.evictions for s in cached.stats().values()) > 0
    cached.flush()
    for i, name in enumerate(("t", "u", "v")):
        want_keys, want_rows = sorted_rows(plain.export(name))
        backend = cached.tiers[0].below.table(i)
        assert backend.size() == want_keys.numel(), name
        got = backend.get(want_keys)
        assert bool(got.found.all()), name
        torch.testing.assert_close(got.rows, want_rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backing", ["dict", "host"])  # host memory: inserted on the device
def test_bytes_moved_counts_each_row_moved_once(backing) -> None:
    """``stats().bytes_moved`` per table, against the other counters: with every key already in the
    backing store (a first pass, flushed), each miss brings one row up (every one found) and each
    eviction or conflict miss writes one down; a flush writes down every cached row."""
    optimizer = te.optim.Adagrad(lr=0.1)
    tables = [te.TableConfig(name, DIM, [f], num_embeddings=ROWS) for name, f in (("t", "a"), ("u", "b"))]
    row_bytes = (DIM + optimizer.state_width(DIM)) * 4
    store = DictStore() if backing == "dict" else te.storage.HostMemory()
    storage = te.StorageConfig(hbm_budget=2 * 2 * 4 * row_bytes, backing=store, bucket_width=4,
                               segment_rows=16)
    cached = te.EmbeddingBagCollection(tables, optimizer=optimizer, storage=storage, seed=3)
    batches = zipf_batches(15, 6, seed=5)
    train(cached, batches, pipelined=False)
    cached.flush()

    def counters():
        return {name: (s.bytes_moved["backend->device"] // row_bytes,
                       s.bytes_moved["device->backend"] // row_bytes,
                       s.misses, s.evictions + s.conflict_misses, s.rows["device"])
                for name, s in cached.stats().items()}

    before = counters()
    train(cached, batches, pipelined=False)  # the same keys again: every miss is in the store
    after = counters()
    cached.flush()
    flushed = counters()
    for name in ("t", "u"):
        up, down, misses, written, _ = (a - b for a, b in zip(after[name], before[name]))
        assert misses > 0 and written > 0, name
        assert (up, down) == (misses, written), name
        assert flushed[name][1] - after[name][1] == after[name][4] > 0, name


@pytest.mark.parametrize("cache_buckets", [1, 3])
@pytest.mark.parametrize("pipelined", [False, True])
def test_tables_of_two_dims_in_cache_mode_stage_together(cache_buckets, pipelined, monkeypatch) -> None:
    """Tables of two dims form two cache groups, whose prefetches stage together (one dedup, a
    probe per group, one read): trained as hbm_direct, through evictions of both caches, and after
    flush each table's backend holds exactly its own rows."""
    from tieredemb.modules.staged import StagedPrefetcher

    staged_together = []
    stage_all = StagedPrefetcher._stage_all

    def spy(self, *args):
        staged_together.append(1)
        return stage_all(self, *args)

    monkeypatch.setattr(StagedPrefetcher, "_stage_all", spy)
    optimizer = te.optim.Adam(lr=0.05)
    tables = [te.TableConfig("t", DIM, ["a"], num_embeddings=ROWS, initializer=te.init.Normal(0.0, 0.1)),
              te.TableConfig("u", 2 * DIM, ["b"], num_embeddings=ROWS, eviction="lfu")]
    row_bytes = (2 * DIM + optimizer.state_width(2 * DIM)) * 4
    store = DictStore()
    storage = te.StorageConfig(hbm_budget=4 * cache_buckets * 4 * row_bytes, backing=store, bucket_width=4,
                               segment_rows=16)
    cached = te.EmbeddingBagCollection(tables, optimizer=optimizer, storage=storage, seed=3)
    plain = te.EmbeddingBagCollection(tables, optimizer=optimizer, seed=3)
    assert cached.storage_mode == "cache" and len(cached.tiers) == 2
    batches = zipf_batches(30, 6, seed=cache_buckets)
    for g, w in zip(train(cached, batches, pipelined), train(plain, batches, pipelined)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert len(staged_together) >= 30
    assert all(cached.stats()[name].evictions > 0 for name in ("t", "u"))
    cached.flush()
    for name in ("t", "u"):
        want_keys, want_rows = sorted_rows(plain.export(name))
        backend = store.opened[name]
        assert backend.size() == want_keys.numel(), name
        got = backend.get(want_keys)
        assert bool(got.found.all()), name
        torch.testing.assert_close(got.rows, want_rows, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backing", ["dict", "rocksdb"])
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("admission", [None, 2])
@pytest.mark.parametrize("pipelined", [False, True])
def test_bounded_tables_in_cache_mode_match_hbm_direct(backing, eviction, admission, pipelined,
                                                       tmp_path) -> None:
    """max_capacity in cache mode: the table holds the rows an hbm_direct table of that bound holds
    (the same evictions, across every tier), with a device cache smaller still; a second, unbounded
    table of the group is unaffected. After flush the store holds exactly the kept rows."""
    adm = te.FrequencyAdmission(admission) if admission else None
    tables = [te.TableConfig("t", DIM, ["a"], max_capacity=24, eviction=eviction, admission=adm,
                             initializer=te.init.Normal(0.0, 0.1)),
              te.TableConfig("u", DIM, ["b"], num_embeddings=ROWS)]
    optimizer = te.optim.Adagrad(lr=0.2)
    row = (DIM + optimizer.state_width(DIM)) * 4
    store = DictStore() if backing == "dict" else te.storage.RocksDB(str(tmp_path / "db"), shards=2)
    cached = te.EmbeddingBagCollection(tables, optimizer=optimizer, seed=3, storage=te.StorageConfig(
        hbm_budget=2 * 8 * row, backing=store, bucket_width=8, segment_rows=8))
    plain = te.EmbeddingBagCollection(tables, optimizer=optimizer, seed=3,
                                      storage=te.StorageConfig(bucket_width=8))
    assert cached.storage_mode == "cache" and plain.storage_mode == "hbm_direct"
    batches = zipf_batches(30, 3 if pipelined else 6, seed=21)  # pipelined: fewer keys locked at once
    for g, w in zip(train(cached, batches, pipelined), train(plain, batches, pipelined)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    assert cached.stats()["t"].evictions > 0 and plain.stats()["t"].evictions > 0
    for t in ("t", "u"):
        got, want = cached.export(t), plain.export(t)
        go, wo = torch.argsort(got.keys), torch.argsort(want.keys)
        assert torch.equal(got.keys[go], want.keys[wo]), t  # the same rows kept, the same dropped
        torch.testing.assert_close(got.weights[go], want.weights[wo], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.optimizer_state[go], want.optimizer_state[wo], rtol=1e-5, atol=1e-6)
        if t == "t":
            assert torch.equal(got.scores[go], want.scores[wo])
    cached.flush()
    assert cached.tiers[0].below.table(0).size() <= 24  # dropped rows were deleted from the store
    cached.close()


def shared_pads(monkeypatch) -> list[int]:
    """How many pairs each device insertion found in an earlier batch's scratch pad (appended as
    the insertions run)."""
    from tieredemb.storage.tiers.cache import CacheTier

    found = []
    shared = CacheTier._shared_pads

    def spy(self, *args):
        pads = shared(self, *args)
        found.append(int(pads[0].sum()))
        return pads

    monkeypatch.setattr(CacheTier, "_shared_pads", spy)
    return found


@pytest.mark.parametrize("backing", ["dict", "host"])
def test_conflict_misses_and_shared_scratch_rows(backing, monkeypatch) -> None:
    """One bucket of two ways and batches of many keys: most keys are conflict misses, trained in
    scratch rows; with prefetch(i+1) before backward(i) a key in both batches shares its row. Over
    host memory every batch is inserted on the device, its conflict misses found owed only when the
    host reads its counts (at the next prefetch), and a later batch's keys in those rows share them
    there too."""
    from tieredemb.storage.tiers.cache import CacheTier

    on_device = []
    insert = CacheTier._insert_on_device

    def spy(self, *args):
        pf = insert(self, *args)
        on_device.append(pf)
        return pf

    monkeypatch.setattr(CacheTier, "_insert_on_device", spy)
    pads = shared_pads(monkeypatch)
    optimizer = te.optim.SGD(lr=0.5)
    row_bytes = DIM * 4
    store = DictStore() if backing == "dict" else te.storage.HostMemory(segment_rows=8)
    storage = te.StorageConfig(hbm_budget=2 * row_bytes, backing=store, bucket_width=2, segment_rows=8)
    cached = make(storage, "lru", None, optimizer)
    plain = make(None, "lru", None, optimizer)
    batches = [te.KeyedJaggedTensor(["a", "b"], torch.tensor(ids), lengths=torch.tensor([len(ids), 0]))
               for ids in ([1, 2, 3, 4, 5], [3, 4, 5, 6], [1, 5, 9], [9, 9, 2])]
    got, want = train(cached, batches, True), train(plain, batches, True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert cached.stats()["t"].conflict_misses > 0
    if backing == "host":  # the device insertion's conflict misses were owed, then shared
        assert len(on_device) == len(batches) and on_device[0].write_back.numel() == 3
        assert sum(pads) > 0, pads
    else:
        assert not on_device
    torch.testing.assert_close(sorted_rows(cached.export("t"))[1], sorted_rows(plain.export("t"))[1])


class PaddedEagerly:
    """A stand-in for ``CapturedStages`` on the CPU: what a replayed CUDA graph computes, run eagerly
    on static inputs of the padded sizes kept per shape (past a batch's own entries they hold what
    the last batch of that shape left, as a graph's do)."""

    def __init__(self) -> None:
        self.static: dict[tuple, list] = {}
        self.fns: dict[tuple, object] = {}
        self.calls = 0

    def acquire(self, key, fn, *inputs, lengths=(), capture=True):
        lengths = tuple(lengths) + (None,) * (len(inputs) - len(lengths))
        self.static.setdefault(key, [
            torch.zeros((n or t.shape[0], *t.shape[1:]), dtype=t.dtype) if torch.is_tensor(t) else None
            for t, n in zip(inputs, lengths)])
        self.fns[key] = fn
        slot = SimpleNamespace(key=key)
        self.load(slot, *inputs)
        self.replay(slot)
        return slot

    def take(self, key):  # a shape run before (as a captured one): its inputs loaded ahead of its run
        return SimpleNamespace(key=key) if key in self.static else None

    def load(self, slot, *inputs) -> None:
        static = self.static[slot.key]
        for buffer, t in zip(static, inputs):
            if buffer is not None:
                if t.dim():
                    buffer[: t.shape[0]] = t
                else:
                    buffer.copy_(t)
        slot.args = [torch.tensor(t) if isinstance(t, int) else t.clone() if b is None else b
                     for t, b in zip(inputs, static)]

    def replay(self, slot) -> None:
        self.calls += 1
        slot.outputs = self.fns[slot.key](*slot.args)

    def cancel(self, slot) -> None:
        pass

    def release(self, slot, stream) -> None:
        pass


@pytest.mark.parametrize("pipelined", [False, True])
def test_cache_insertion_as_its_graph_replays_it(pipelined, monkeypatch) -> None:
    """The cache's insertion over host memory as its CUDA graph replays it (the pairs padded to a
    bucket, the misses to a power of two, the pool of free rows as long), run eagerly through
    Triton's interpreter with conflict misses: the same outputs and rows as hbm_direct. Session 24
    found a replay giving back to the store the scratch rows of its conflict misses (the kernel
    takes them from the end of the misses, the group looked at the end of the padded pool): other
    keys then took those rows while they were trained. In the plain loop some insertions are armed
    before their read (``CacheTier.arm``) and run so, others armed for sizes the read then changes
    and given back."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():  # Triton's interpreter is off (tests/conftest.py): the graph runs there
        pytest.skip("with CUDA: tests/gpu replays the graph itself (test_captured_cache_insertion_"
                    "trains_like_eager, test_a_training_stream_behind_keeps_its_batch)")
    import tieredemb.storage.tiers.cache_on_device as cache_module

    # pairs padded to 32s, as a large batch's are to buckets: the sizes repeat, so insertions are armed
    monkeypatch.setattr(cache_module, "padded_size", lambda n: -(-n // 32) * 32 + 32)  # noqa: E731
    row_bytes = DIM * 4
    storage = te.StorageConfig(hbm_budget=2 * row_bytes, backing=te.storage.HostMemory(segment_rows=8),
                               bucket_width=2, segment_rows=8)
    tables = [te.TableConfig("t", DIM, ["a", "b"], num_embeddings=ROWS, initializer=te.init.Normal(0.0, 0.1))]
    cached = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.5), storage=storage, seed=3,
                                       kernels="triton")
    (group,) = cached.tiers
    group.may_capture, group._insert_graphs = (lambda: True), PaddedEagerly()
    plain = make(None, "lru", None, te.optim.SGD(lr=0.5))
    batches = zipf_batches(6, 4, seed=5)  # ~10 misses a batch: padded to 16 rows of the pool
    pads = shared_pads(monkeypatch)
    got, want = train(cached, batches, pipelined), train(plain, batches, pipelined)
    assert group._insert_graphs.calls > 0 and cached.stats()["t"].conflict_misses > 0
    if pipelined:  # keys of the batch before in its scratch rows, shared by the replayed insertion
        assert sum(pads) > 0, pads
    if not pipelined:  # insertions armed before their read, run as armed or given back (sizes changed)
        assert group.arms[0] > 0 and group.arms[1] > 0, group.arms
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(sorted_rows(cached.export("t"))[1], sorted_rows(plain.export("t"))[1])
    # every row of the cache's store is a key's or free, once: none leaked, none freed twice
    free = group.store.peek(group.store.rows_allocated() - group.store.rows_in_use())
    assert free.unique().numel() == free.numel() and group.store.rows_in_use() == group.index.size()


def test_forwards_without_backward_release_everything() -> None:
    store = DictStore()
    storage = te.StorageConfig(hbm_budget=4 * DIM * 4, backing=store, bucket_width=4, segment_rows=8)
    cached = make(storage, "lru", None, te.optim.SGD(lr=0.1))
    plain = make(None, "lru", None, te.optim.SGD(lr=0.1))
    batches = zipf_batches(100, 4, seed=5)
    for ebc in (cached, plain):  # train-mode forwards insert their keys, in both modes
        for kjt in batches:
            with torch.no_grad():
                ebc(kjt)
    (table,) = cached.tiers
    assert int(table.index.locks.sum()) == 0 and table.in_flight.size() == 0
    rows_in_use = table.store.rows_in_use()
    assert rows_in_use <= table.index.capacity()  # no scratch row leaked
    for ebc in (cached, plain):
        for kjt in batches[:5]:
            ebc(kjt).values().sum().backward()
    torch.testing.assert_close(sorted_rows(cached.export("t"))[1], sorted_rows(plain.export("t"))[1])


def test_eval_reads_without_inserting() -> None:
    store = DictStore()
    storage = te.StorageConfig(hbm_budget=4 * DIM * 4, backing=store, bucket_width=4, segment_rows=8)
    cached = make(storage, "lru", None, te.optim.SGD(lr=0.1))
    for kjt in zipf_batches(5, 4, seed=1):
        cached(kjt).values().sum().backward()
    before = sorted_rows(cached.export("t"))
    cached.eval()
    kjt = te.KeyedJaggedTensor(["a", "b"], torch.tensor([0, 7, 299, 123]), lengths=torch.tensor([2, 1, 1, 0]))
    out = cached(kjt).values()
    after = sorted_rows(cached.export("t"))
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    w, found = cached.read("t", torch.tensor([0, 7, 299]))
    expect = torch.where(found[:, None], w, torch.zeros_like(w))
    torch.testing.assert_close(out[0, :DIM], expect[0] + expect[1])


@pytest.mark.parametrize("optimizer", [te.optim.Adam(lr=0.05), te.optim.Adagrad(lr=0.1)],
                         ids=["adam", "adagrad"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_hybrid_matches_hbm_direct(optimizer, pipelined) -> None:
    """Hybrid: one index, the first rows in device segments and the rest in host segments."""
    row_bytes = (DIM + optimizer.state_width(DIM)) * 4
    storage = te.StorageConfig(hbm_budget=32 * row_bytes, caching=False, segment_rows=16)
    hybrid = make(storage, "lru", 2, optimizer)
    assert hybrid.storage_mode == "hybrid"
    plain = make(None, "lru", 2, optimizer)
    batches = zipf_batches(30, 6, seed=9)
    trains_alike(hybrid, plain, batches, pipelined)
    placement = hybrid.tiers[0].store.rows_by_placement()
    assert placement["device"] == 32 and placement["host"] > 0  # rows really spilled to the host


@pytest.mark.parametrize("backend", ["host", "rocksdb", "redis", "rocksdb+host_tier", "redis+host_tier"])
@pytest.mark.parametrize("cache_buckets", [1, 74])
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_cache_over_real_backends_matches_hbm_direct(backend, cache_buckets, eviction, tmp_path,
                                                      request) -> None:
    """The same equivalence over HostMemory, RocksDB on disk and a real redis-server (with a host
    tier of 3 rows in front, and reads 2 batches ahead), pipelined and with admission; after close()
    the backend alone holds the table (read back through a fresh handle for RocksDB and Redis)."""
    optimizer = te.optim.Adam(lr=0.05)
    backend, _, host_tier = backend.partition("+")
    if backend == "host":
        spec = te.storage.HostMemory()
    elif backend == "rocksdb":
        spec = te.storage.RocksDB(str(tmp_path / "db"), shards=2)
    else:
        spec = te.storage.Redis(request.getfixturevalue("redis_server"))
    row_bytes = (DIM + optimizer.state_width(DIM)) * 4
    storage = te.StorageConfig(hbm_budget=cache_buckets * 4 * row_bytes, backing=spec, bucket_width=4,
                               segment_rows=16, host_budget=3 * row_bytes if host_tier else None)
    cached = make(storage, eviction, 2, optimizer)
    plain = make(None, eviction, 2, optimizer)
    batches = zipf_batches(30, 6, seed=cache_buckets)
    want_keys, want_rows = trains_alike(cached, plain, batches, True, ahead=2 if host_tier else 0)
    if host_tier and cache_buckets == 1:
        stats = cached.stats()["t"].host_tier
        assert stats.capacity == 3 and stats.evictions > 0 and stats.written_down > 0
    cached.close()
    if backend == "host":
        return  # host memory does not outlive its collection
    reopened = dataclasses.replace(spec, existing="reuse").open("t", want_rows.shape[1], torch.device("cpu"))
    try:
        assert reopened.size() == want_keys.numel()
        got = reopened.get(want_keys)
        assert bool(got.found.all())
        torch.testing.assert_close(got.rows, want_rows, rtol=1e-5, atol=1e-6)
    finally:
        reopened.close()


def test_write_downs_go_to_the_io_worker_and_fetches_wait_for_them() -> None:
    """A store doing host I/O takes write-downs on its I/O worker while the prefetch goes on; a row
    evicted and needed again by the next batch is fetched only after its slow write-down landed."""
    threads: set[str] = set()

    class SlowStore(BackendSpec):
        def open(self, table: str, width: int, device: torch.device) -> DictBackend:
            class Slow(DictBackend):
                def set(self, keys, rows):
                    threads.add(threading.current_thread().name)
                    time.sleep(0.005)  # still queued when the next batch fetches
                    super().set(keys, rows)

            return Slow(width)

    optimizer = te.optim.Adagrad(lr=0.2)
    storage = te.StorageConfig(hbm_budget=4 * DIM * 2 * 4, backing=SlowStore(), bucket_width=4,
                               segment_rows=8)
    cached = make(storage, "lru", None, optimizer)
    plain = make(None, "lru", None, optimizer)
    trains_alike(cached, plain, zipf_batches(15, 5, seed=8), pipelined=True)
    assert threads and all(name.startswith("tieredemb-io") for name in threads), threads


class FlakyStore(BackendSpec):
    """Dict backends whose ``set`` / ``get`` fail while ``failing`` says so (an injected fault)."""

    def __init__(self) -> None:
        self.failing = {"set": False, "get": False}
        self.opened: dict[str, DictBackend] = {}

    def open(self, table: str, width: int, device: torch.device):
        store = self

        class Flaky(DictBackend):
            def set(self, keys, rows):
                if store.failing["set"]:
                    raise OSError(28, "No space left on device")
                super().set(keys, rows)

            def get(self, keys):
                if store.failing["get"]:
                    raise ConnectionError("backend unreachable")
                return super().get(keys)

        self.opened[table] = Flaky(width)
        return self.opened[table]


@pytest.mark.parametrize("host_tier", [False, True])
def test_backend_faults_surface_chained_and_lose_no_row(host_tier) -> None:
    """A store that refuses writes, then reads, then comes back; with a host tier of 3 rows in front
    of it, the tier's write-downs fail, and so do the cache's into it."""
    optimizer = te.optim.SGD(lr=0.3)
    store = FlakyStore()
    storage = te.StorageConfig(hbm_budget=4 * DIM * 4, backing=store, bucket_width=4, segment_rows=8,
                               host_budget=3 * DIM * 4 if host_tier else None)
    cached = make(storage, "lru", None, optimizer)
    plain = make(None, "lru", None, optimizer)
    batches = zipf_batches(12, 5, seed=4)
    for kjt in batches[:4]:
        for ebc in (cached, plain):
            ebc(kjt).values().sum().backward()
    # write-downs fail (the evicted rows wait on the host): the next call raises on this thread,
    # chained to the store's own exception, and keeps raising until the store takes the rows; the
    # call that raised changed nothing, so once the store is back it is simply made again
    errors = []
    for kjt in batches[4:8]:
        plain(kjt).values().sum().backward()
        store.failing["set"] = True
        for attempt in range(3):
            try:
                cached(kjt).values().sum().backward()
                break
            except te.storage.BackendError as e:
                errors.append(e)
                store.failing["set"] = attempt == 0  # down for two calls, then back
        store.failing["set"] = False
    assert errors and all(isinstance(e.__cause__, OSError) for e in errors)
    assert len(errors) >= 2  # it kept raising while the store was down
    store.failing["set"] = False
    store.failing["get"] = True  # a fetch fails before anything changes
    with pytest.raises(te.storage.BackendError) as info:  # raised on the store's I/O thread
        cached(batches[8])
    assert isinstance(info.value.__cause__, ConnectionError)
    store.failing["get"] = False
    for kjt in batches[8:]:
        for ebc in (cached, plain):
            ebc(kjt).values().sum().backward()
    torch.testing.assert_close(sorted_rows(cached.export("t"))[1], sorted_rows(plain.export("t"))[1])
    cached.flush()
    want_keys, want_rows = sorted_rows(plain.export("t"))
    got = store.opened["t"].get(want_keys)
    assert bool(got.found.all())
    torch.testing.assert_close(got.rows, want_rows)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cache_rows=st.integers(1, 120), width=st.sampled_from([1, 2, 4, 8]), dim=st.integers(1, 9),
       batch=st.integers(0, 7), eviction=st.sampled_from(["lru", "lfu"]),
       admission=st.sampled_from([None, 2, 3]), pipelined=st.booleans(),
       opt=st.sampled_from(["sgd", "adagrad", "rowwise", "adam"]), seed=st.integers(0, 2**16),
       host_rows=st.sampled_from([None, 1, 7]), ahead=st.integers(0, 3))
def test_cache_matches_hbm_direct_on_drawn_shapes(cache_rows, width, dim, batch, eviction, admission,
                                                  pipelined, opt, seed, host_rows, ahead) -> None:
    optimizer = {"sgd": te.optim.SGD(lr=0.2), "adagrad": te.optim.Adagrad(lr=0.2),
                 "rowwise": te.optim.RowWiseAdagrad(lr=0.2), "adam": te.optim.Adam(lr=0.05)}[opt]
    row_bytes = (dim + optimizer.state_width(dim)) * 4
    adm = te.FrequencyAdmission(admission) if admission else None

    def build(storage):
        tables = [te.TableConfig("t", dim, ["a", "b"], num_embeddings=ROWS, eviction=eviction,
                                 admission=adm, initializer=te.init.Normal(0.0, 0.1))]
        return te.EmbeddingBagCollection(tables, optimizer=optimizer, storage=storage, seed=seed)

    cached = build(te.StorageConfig(hbm_budget=cache_rows * row_bytes, backing=DictStore(),
                                    bucket_width=width, segment_rows=8,
                                    host_budget=None if host_rows is None else host_rows * row_bytes))
    assert cached.storage_mode == "cache"
    plain = build(None)
    batches = zipf_batches(10, batch, seed=seed)
    trains_alike(cached, plain, batches, pipelined, ahead)
    cached.close()


class _Loss(torch.nn.Module):
    def __init__(self, ebc: te.EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch: dict) -> torch.Tensor:
        return (self.ebc(batch["kjt"]).values() * batch["grad"]).sum()


@pytest.mark.parametrize("in_thread", [False, True])
@pytest.mark.parametrize("lookahead", [None, 0, 3])  # None: no host tier; else one, reading k ahead
def test_cache_through_the_pipeline_with_a_prefetch_thread(in_thread, lookahead, tmp_path) -> None:
    """Prefetch of batch i+1 on a worker thread, beside batch i's backward: the collection serializes
    index and row-store changes, so the result is the plain loop's. The same with a host tier of 5
    rows over RocksDB and reads issued ``lookahead`` batches ahead."""
    optimizer = te.optim.Adam(lr=0.05)
    row_bytes = (DIM + optimizer.state_width(DIM)) * 4
    host = lookahead is not None
    backing = te.storage.RocksDB(str(tmp_path / "db"), shards=2) if host else DictStore()
    storage = te.StorageConfig(hbm_budget=8 * row_bytes, bucket_width=4, segment_rows=8, backing=backing,
                               host_budget=5 * row_bytes if host else None)
    cached, plain = make(storage, "lru", 2, optimizer), make(None, "lru", 2, optimizer)
    gen = torch.Generator().manual_seed(2)
    data = [{"kjt": kjt, "grad": torch.randn(6, 2 * DIM, generator=gen)}
            for kjt in zipf_batches(25, 6, seed=8)]
    pipe = te.TrainPipeline(_Loss(cached), None, prefetch_in_thread=in_thread, lookahead=lookahead or 0)
    it = iter(data)
    got = []
    while True:
        try:
            got.append(pipe.progress(it).detach())
        except StopIteration:
            break
    model = _Loss(plain)
    want = []
    for b in data:
        loss = model(b)
        loss.backward()
        want.append(loss.detach())
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sorted_rows(cached.export("t"))[1], sorted_rows(plain.export("t"))[1],
                               rtol=1e-5, atol=1e-6)
    if lookahead:
        stats = cached.stats()["t"].host_tier
        assert stats.read_ahead_rows > 0 and stats.read_ahead_hits > 0, stats
    cached.close()


def test_a_failed_fetch_leaves_a_bounded_cache_table_unchanged() -> None:
    """max_capacity in cache mode: a fetch that fails raises before the capacity index or the cache
    change (no lock held, no key taken in without its row); training then goes on as hbm_direct."""
    tables = [te.TableConfig("t", DIM, ["a"], max_capacity=16, initializer=te.init.Normal(0.0, 0.1)),
              te.TableConfig("u", DIM, ["b"], num_embeddings=ROWS)]
    optimizer = te.optim.SGD(lr=0.3)
    store = FlakyStore()
    cached = te.EmbeddingBagCollection(tables, optimizer=optimizer, seed=3, storage=te.StorageConfig(
        hbm_budget=2 * 4 * DIM * 4, backing=store, bucket_width=4, segment_rows=8))
    plain = te.EmbeddingBagCollection(tables, optimizer=optimizer, seed=3,
                                      storage=te.StorageConfig(bucket_width=4))
    batches = zipf_batches(10, 5, seed=2)
    for kjt in batches[:5]:
        for ebc in (cached, plain):
            ebc(kjt).values().sum().backward()
    (group,) = cached.tiers
    before = [t.clone() for t in (group.bound.keys, group.bound.scores, group.bound.locks, group.index.keys)]
    store.failing["get"] = True
    with pytest.raises(te.storage.BackendError):
        cached(batches[5])
    after = (group.bound.keys, group.bound.scores, group.bound.locks, group.index.keys)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "the failed call changed the tables"
    store.failing["get"] = False
    for kjt in batches[5:]:
        for ebc in (cached, plain):
            ebc(kjt).values().sum().backward()
    for t in ("t", "u"):
        got, want = sorted_rows(cached.export(t)), sorted_rows(plain.export(t))
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("mode", ["hbm_direct", "cache"])
def test_a_release_with_nothing_to_release_takes_no_lock(mode) -> None:
    """hbm_direct's index never evicts, so it keeps no locks: a batch's release (at the end of its
    backward) has nothing to unlock or free and must not wait for the collection's lock, which
    TrainPipeline's prefetch thread holds while it resolves the next batch (0.9 ms a step on the
    H200, session 7). A cache batch's release has work (unlock, write-down) and waits for it."""
    storage = None
    if mode == "cache":
        storage = te.StorageConfig(hbm_budget=8 * DIM * 4, backing=DictStore(), bucket_width=4,
                                   segment_rows=8)
    ebc = make(storage, "lru", None, te.optim.SGD(lr=0.1))
    ref = make(None, "lru", None, te.optim.SGD(lr=0.1))
    assert ebc.storage_mode == mode
    batches = zipf_batches(3, 4, seed=9)
    for model in (ebc, ref):
        for kjt in batches[:2]:  # the second batch's keys are stored: its release has only locks
            model(kjt).values().sum().backward()
    out = ebc(batches[2]).values()
    holding, done = threading.Event(), threading.Event()

    def hold_lock():
        with ebc._lock:
            holding.set()
            done.wait(10)

    holder = threading.Thread(target=hold_lock)
    holder.start()
    holding.wait(10)
    backward = threading.Thread(target=lambda: out.sum().backward())
    backward.start()
    backward.join(2 if mode == "hbm_direct" else 0.3)
    waited = backward.is_alive()
    done.set()
    backward.join(10)
    holder.join(10)
    assert not backward.is_alive()
    assert waited == (mode == "cache"), f"{mode}: the release {'waited' if waited else 'did not wait'}"
    ref(batches[2]).values().sum().backward()
    if mode == "hbm_direct":
        assert int(ebc.tiers[0].index.locks.sum()) == 0
    torch.testing.assert_close(sorted_rows(ebc.export("t"))[1], sorted_rows(ref.export("t"))[1])


@pytest.mark.parametrize("backing", ["dict", "host"])
@pytest.mark.parametrize("admission", [None, 2])
def test_a_cache_step_probes_its_index_once(backing, admission) -> None:
    """The probe that finds a batch's pairs locks and touches them; the insertion of its misses goes
    on from that probe's slots (no second probe of the cache's index), and the result is hbm_direct's."""
    optimizer = te.optim.Adam(lr=0.05)
    row_bytes = (DIM + optimizer.state_width(DIM)) * 4
    store = DictStore() if backing == "dict" else te.storage.HostMemory(segment_rows=64)
    storage = te.StorageConfig(hbm_budget=6 * 4 * row_bytes, backing=store, bucket_width=4, segment_rows=16)
    cached, plain = make(storage, "lru", admission, optimizer), make(None, "lru", admission, optimizer)
    (tier,) = cached.tiers
    probes, inside = [], []
    for name in ("find_touch", "find"):
        method = getattr(tier.index, name)

        def counted(*args, _method=method, _name=name, **kwargs):
            if not inside:  # (the reference's find_touch finds through find)
                probes.append(_name)
            inside.append(_name)
            try:
                return _method(*args, **kwargs)
            finally:
                inside.pop()

        setattr(tier.index, name, counted)
    batches = zipf_batches(12, 6, seed=5)
    for i, kjt in enumerate(batches):
        probes.clear()
        for ebc in (cached, plain):
            ebc.prefetch(kjt)
            ebc(kjt).values().sum().backward()
        assert probes == ["find_touch"], f"step {i}: the cache's index was probed by {probes}"
    for kept, want in zip(sorted_rows(cached.export("t")), sorted_rows(plain.export("t"))):
        torch.testing.assert_close(kept, want, rtol=1e-5, atol=1e-6)


def test_a_failed_fetch_leaves_no_lock_in_the_cache() -> None:
    """The probe locks the pairs it finds before the fetch; a fetch that raises gives them back (a
    lock left would pin those rows in the cache for good)."""
    optimizer = te.optim.SGD(lr=0.3)
    store = FlakyStore()
    storage = te.StorageConfig(hbm_budget=4 * DIM * 4, backing=store, bucket_width=4, segment_rows=8)
    cached, plain = make(storage, "lru", None, optimizer), make(None, "lru", None, optimizer)
    batches = zipf_batches(10, 5, seed=6)
    for kjt in batches[:4]:
        for ebc in (cached, plain):
            ebc(kjt).values().sum().backward()
    (tier,) = cached.tiers
    keys_before = tier.index.keys.clone()
    assert int(tier.index.locks.sum()) == 0
    store.failing["get"] = True
    for _ in range(2):
        with pytest.raises(te.storage.BackendError):
            cached(batches[4])
        assert int(tier.index.locks.sum()) == 0, "a failed prefetch left locks held"
        assert torch.equal(tier.index.keys, keys_before)
    store.failing["get"] = False
    for kjt in batches[4:]:
        for ebc in (cached, plain):
            ebc(kjt).values().sum().backward()
    for kept, want in zip(sorted_rows(cached.export("t")), sorted_rows(plain.export("t"))):
        torch.testing.assert_close(kept, want, rtol=1e-5, atol=1e-6)
