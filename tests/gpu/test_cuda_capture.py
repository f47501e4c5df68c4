"""The captured prefetch (``tieredemb/ops/capture.py``): the device half of a staged prefetch
replayed from a CUDA graph trains exactly as the same collection run eagerly (TIEREDEMB_CAPTURE=0):
the same outputs, rows, optimizer state, scores and counters, bit for bit (the same kernels on the
same inputs), through index growth, shapes that change, bad batches and a prefetch thread."""

from __future__ import annotations

import pytest
import torch

import tieredemb as te
import tieredemb.storage.tiers.device_insert as table_module

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run through tools/gpu_check.sh)", allow_module_level=True)

from tests.gpu.test_cuda_syncs import _Model  # noqa: E402 (the embedding-only model, loss = sum of squares)

DEV = torch.device("cuda")
FEATURES = ["f0", "f1", "f2"]


def make(module, optimizer, monkeypatch, capture: bool, pooling: str = "sum", dims=(16, 16, 16), **kw):
    monkeypatch.setenv("TIEREDEMB_CAPTURE", "1" if capture else "0")
    tables = [te.TableConfig(f"t{i}", dims[i], [f"f{i}"], pooling=pooling) for i in range(3)]
    if module is te.EmbeddingCollection:
        tables = [te.TableConfig(f"t{i}", 16, [f"f{i}"]) for i in range(3)]
    collection = module(tables, optimizer=optimizer, device=DEV, seed=3, **kw)
    stages = collection._stager.captured if collection._stager is not None else collection.placement.serves
    assert (stages is not None) == capture
    return collection


def batch(gen: torch.Generator, lengths: torch.Tensor, keys: int, weighted: bool = False):
    ids = torch.randint(0, keys, (int(lengths.sum()),), generator=gen) * 7919 + 11
    weights = torch.rand(ids.numel(), generator=gen) if weighted else None
    return te.KeyedJaggedTensor(FEATURES, ids, lengths=lengths, weights=weights).to(DEV)


def values(out) -> torch.Tensor:
    if isinstance(out, dict):
        return torch.cat([jt.values() for jt in out.values()])
    return out.values()


def step(collection, kjt, upstream: torch.Tensor) -> torch.Tensor:
    collection.prefetch(kjt)
    out = values(collection(kjt))
    (out * upstream[: out.shape[0]]).sum().backward()
    return out.detach()


def assert_same_tables(a, b) -> None:
    for name in ["t0", "t1", "t2"]:
        ra, rb = a.export(name), b.export(name)
        oa, ob = torch.argsort(ra.keys), torch.argsort(rb.keys)
        assert torch.equal(ra.keys[oa], rb.keys[ob]), name
        assert torch.equal(ra.weights[oa], rb.weights[ob]), name
        assert torch.equal(ra.optimizer_state[oa], rb.optimizer_state[ob]), name
        assert torch.equal(ra.scores[oa], rb.scores[ob]), name
        sa, sb = a.stats()[name], b.stats()[name]
        assert (sa.lookups, sa.unique_lookups, sa.hits, sa.misses) == \
            (sb.lookups, sb.unique_lookups, sb.hits, sb.misses), name


def train_both(module, optimizer, monkeypatch, batches, pooling="sum", dims=(16, 16, 16), **kw):
    eager = make(module, optimizer, monkeypatch, False, pooling, dims, **kw)
    captured = make(module, optimizer, monkeypatch, True, pooling, dims, **kw)
    gen = torch.Generator(device=DEV).manual_seed(1)
    upstream = torch.randn(8192, sum(dims), device=DEV, generator=gen)
    for i, kjt in enumerate(batches):
        up = upstream if module is te.EmbeddingBagCollection else upstream.view(-1, 16)
        want = step(eager, kjt, up)
        got = step(captured, kjt, up)
        assert torch.equal(got, want), f"step {i}: outputs differ"
    assert_same_tables(eager, captured)
    return eager, captured


@pytest.mark.parametrize("optimizer", [te.optim.SGD(lr=0.1), te.optim.Adam(lr=0.01)], ids=["sgd", "adam"])
@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_captured_prefetch_trains_like_eager_through_index_growth(module, optimizer, monkeypatch):
    """The probe reads the index's tables through a device table of their addresses, so its graph
    outlives a rehash: one capture for the one shape, every step but the first replayed."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 17, (3 * 256,), generator=gen)  # one shape throughout
    # ~2000 ids a table and step from ever more keys: past the index's first 8192 slots a table
    # (rehashes, which the captured probe must follow)
    batches = [batch(gen, lengths, 1000 + 4000 * i) for i in range(10)]
    _, captured = train_both(module, optimizer, monkeypatch, batches)
    assert captured.tiers[0].index.generation >= 2, "the index grew less than twice: the test misses it"
    stages = captured._stager.captured
    assert (stages.captures, stages.replays) == (1, 9), (stages.captures, stages.replays)


@pytest.mark.parametrize("mode", ["hbm_direct", "cache"])
def test_the_sharded_steps_captured_halves_train_like_eager(mode, monkeypatch, tmp_path):
    """The sharded path at world size one (NCCL): the requester's device half (checks, dedup, the
    route's counts) and the owner's serve of the pairs it received (dedup, probe), replayed from
    CUDA graphs, train as the same collection run eagerly, bit for bit; cache mode with misses and
    evictions every step. Three batches in turn: a bucket's graph serves batches of several counts.
    A bad batch of a captured shape raises on both, changes nothing, and holds no graph. Both
    train the rows of the collection without a process group."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        optimizer = te.optim.Adam(lr=0.01)
        kw = {"process_group": dist.group.WORLD}
        if mode == "cache":  # 384 rows a table on the device; the three batches use ~670 keys a table
            kw["storage"] = te.StorageConfig(hbm_budget=3 * 384 * (16 + optimizer.state_width(16)) * 4,
                                             backing=te.storage.HostMemory())
        gen = torch.Generator().manual_seed(5)
        shapes = [batch(gen, torch.randint(0, 5, (3 * 128,), generator=gen), 2000) for _ in range(3)]
        eager, captured = train_both(te.EmbeddingBagCollection, optimizer, monkeypatch,
                                     [shapes[i % 3] for i in range(12)], **kw)
        assert captured.storage_mode == mode
        for stages in (captured.placement.requests, captured.placement.serves):
            assert stages.replays >= 8 and stages.captures <= 6, (stages.what, stages.captures,
                                                                  stages.replays)
        bad = te.KeyedJaggedTensor(FEATURES, shapes[0].values().clone(), lengths=shapes[0].lengths())
        bad.values()[3] = te.RESERVED_KEY
        for collection in (eager, captured):
            with pytest.raises(ValueError, match="RESERVED_KEY"):
                collection(bad)
        assert not any(s.busy for s in captured.placement.requests._slots), "a bad batch holds a graph"
        up = torch.randn(8192, 48, device=DEV, generator=torch.Generator(device=DEV).manual_seed(2))
        for kjt in shapes * 2:  # the graphs of these shapes again, after the bad batch
            assert torch.equal(step(captured, kjt, up), step(eager, kjt, up))
        assert_same_tables(eager, captured)
        kw.pop("process_group")
        plain = make(te.EmbeddingBagCollection, optimizer, monkeypatch, True, **kw)
        first = torch.randn(8192, 48, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
        for i in range(12):
            step(plain, shapes[i % 3], first)
        for kjt in shapes * 2:
            step(plain, kjt, up)
        for name in ("t0", "t1", "t2"):
            want, got = plain.export(name), captured.export(name)
            ow, og = torch.argsort(want.keys), torch.argsort(got.keys)
            assert torch.equal(want.keys[ow], got.keys[og]), name
            for field in ("weights", "optimizer_state"):
                torch.testing.assert_close(getattr(got, field)[og], getattr(want, field)[ow], rtol=1e-5,
                                           atol=1e-6, msg=f"{name} {field}")
        if mode == "cache":
            stats = captured.stats()["t0"]
            assert stats.misses > 0 and stats.evictions > 0, stats
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("optimizer", [te.optim.SGD(lr=0.1), te.optim.Adam(lr=0.01)], ids=["sgd", "adam"])
def test_captured_prefetch_of_two_table_groups(optimizer, monkeypatch):
    """Tables of two dims (two groups) staged together (one dedup, a probe per group): the captured
    prefetch trains as the eager one, through the growth of both groups' indexes, and replays every
    step but the first."""
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(0, 17, (3 * 256,), generator=gen)
    batches = [batch(gen, lengths, 1000 + 4000 * i) for i in range(10)]
    _, captured = train_both(te.EmbeddingBagCollection, optimizer, monkeypatch, batches, dims=(16, 32, 16))
    assert len(captured.tiers) == 2
    assert all(g.index.generation > 0 for g in captured.tiers), "an index never grew"
    assert (captured._stager.captured.captures, captured._stager.captured.replays) == (1, 9)


@pytest.mark.parametrize("optimizer", [te.optim.SGD(lr=0.1), te.optim.Adam(lr=0.01)], ids=["sgd", "adam"])
@pytest.mark.parametrize("bounded", [True, False], ids=["max_capacity", "init_capacity"])
def test_captured_insertion_trains_like_eager(bounded, optimizer, monkeypatch):
    """Misses every step, inserted on the device (``DeviceTier._inserted``): bounded tables evicting
    (rows of victims reused, pairs contested by the batch in flight) or tables trained from scratch
    in an index sized ahead. The insertion and the new rows' initial values replayed from CUDA graphs
    of padded sizes (``_insert_graph``; the padding made coarse here, so that most of a graph's
    pairs and misses are padding and one graph serves every step) train as the same collection run
    eagerly, bit for bit: outputs, rows, states, scores, counters. The row store was stashed and
    restored first, as a Stash leaves it (a capture must not wait for that copy's event)."""
    monkeypatch.setattr(table_module, "padded_size", lambda n: -(-n // 4096) * 4096 + 4096)  # noqa: E731
    kw = {"max_capacity": 512} if bounded else {"init_capacity": 30000}

    def make_tables(capture: bool):
        monkeypatch.setenv("TIEREDEMB_CAPTURE", "1" if capture else "0")
        tables = [te.TableConfig(f"t{i}", 16, [f"f{i}"], **kw) for i in range(3)]
        return te.EmbeddingBagCollection(tables, optimizer=optimizer, device=DEV, seed=3)

    eager, captured = make_tables(False), make_tables(True)
    for collection in (eager, captured):  # as a Stash leaves a store: its last copy's event recorded
        store = collection.tiers[0].store
        side = torch.cuda.Stream(DEV)
        store.stash(side, 4096)
        store.restore(side, 4096)
        assert store.ready is not None and not store.stashed
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(0, 9, (3 * 256,), generator=gen)  # ~1000 ids a table and step
    batches = [batch(gen, lengths, 3000 if bounded else 1000 + 2000 * i) for i in range(10)]
    upstream = torch.randn(8192, 48, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    eager_loop, captured_loop = pipelined(eager, upstream), pipelined(captured, upstream)
    # the backward on this thread, as TrainPipeline runs it: a bounded batch's release inserts the
    # next batch's misses there, and only the forward's thread captures
    with torch.autograd.set_multithreading_enabled(False):
        outputs = [(captured_loop(kjt), eager_loop(kjt)) for kjt in [*batches, None]]
    assert_insertions_alike(outputs[1:], eager, captured, replays=6)
    stats = captured.stats()["t0"]
    assert stats.misses > 0 and (stats.evictions > 0 or not bounded), stats
    assert captured.tiers[0].index.generation == 0 or bounded, "the index grew: init_capacity too small"


@pytest.mark.parametrize("loop", ["plain", "pipelined"])
def test_captured_cache_insertion_trains_like_eager(loop, monkeypatch):
    """Cache mode over host memory, half the keys on the device (room for the two batches in flight
    of a pipeline: no conflict misses, which the device insertion leaves to the host path while their
    rows are owed): misses and evictions every step, inserted on the device
    (``CacheTier._insert_on_device``: the insertion, the victims' write-down and the misses' fetch
    replayed from CUDA graphs of padded sizes, the padding made coarse so that most of a graph is
    padding; its host work done before the staged read where the sizes repeat) train as the same
    collection run eagerly, bit for bit; a bad batch leaves nothing lent; after flush the host store
    holds the same rows."""
    import tieredemb.storage.tiers.cache_on_device as cache_module

    monkeypatch.setattr(cache_module, "padded_size", lambda n: -(-n // 4096) * 4096 + 4096)  # noqa: E731
    optimizer = te.optim.Adam(lr=0.01)

    def make_tables(capture: bool):
        monkeypatch.setenv("TIEREDEMB_CAPTURE", "1" if capture else "0")
        tables = [te.TableConfig(f"t{i}", 16, [f"f{i}"], num_embeddings=4000 * 7919) for i in range(3)]
        budget = 3 * 2048 * (16 + optimizer.state_width(16)) * 4
        storage = te.StorageConfig(hbm_budget=budget, backing=te.storage.HostMemory())
        collection = te.EmbeddingBagCollection(tables, optimizer=optimizer, device=DEV, seed=3,
                                               storage=storage)
        assert collection.storage_mode == "cache"
        return collection

    eager, captured = make_tables(False), make_tables(True)
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(0, 3, (3 * 256,), generator=gen)  # ~240 keys a table and step
    batches = [batch(gen, lengths, 4000) for i in range(16)]
    upstream = torch.randn(8192, 48, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    with torch.autograd.set_multithreading_enabled(False):
        if loop == "plain":
            outputs = [(step(captured, kjt, upstream), step(eager, kjt, upstream)) for kjt in batches]
        else:
            eager_loop, captured_loop = pipelined(eager, upstream), pipelined(captured, upstream)
            outputs = [(captured_loop(kjt), eager_loop(kjt)) for kjt in [*batches, None]][1:]
    assert_insertions_alike(outputs, eager, captured, replays=4)
    stats = captured.stats()["t0"]
    assert stats.misses > 0 and stats.evictions > 0 and stats.conflict_misses == 0, stats
    # insertions armed before their read (``CacheTier.arm``) and replayed as armed: 4 of 16 at least
    group = captured.tiers[0]
    assert group.arms[0] >= 4, group.arms
    if loop == "plain":  # an arm given back whole when the batch is bad: no row lent stays lent
        free = (group.store._free_count, group.below.rows._store._free_count)
        bad = batch(gen, lengths, 4000)
        bad.values()[5] = te.RESERVED_KEY
        # armed where the last insertion replayed a graph (else it ran eagerly: nothing to arm for)
        given_back = group.arms[1] + (group._last_insert is not None)
        with pytest.raises(ValueError, match="out of range"):  # (below 0: the tables are bounded)
            captured.prefetch(bad)
        assert group.arms[1] == given_back, group.arms
        assert (group.store._free_count, group.below.rows._store._free_count) == free
        more = [batch(gen, lengths, 4000) for _ in range(3)]
        with torch.autograd.set_multithreading_enabled(False):
            for kjt in more:
                assert torch.equal(step(captured, kjt, upstream), step(eager, kjt, upstream))
        assert_same_tables(eager, captured)
    for collection in (eager, captured):
        collection.flush()
    for t in range(3):
        keys, rows = (b.rows.scan(1 << 20, t) for b in (eager.tiers[0].below, captured.tiers[0].below))
        (k1, r1), (k2, r2) = next(keys), next(rows)
        assert torch.equal(k1, k2) and torch.equal(r1, r2), f"t{t}: the host stores differ"


def test_captured_insertion_over_a_host_tier_trains_like_eager(monkeypatch, tmp_path):
    """A device cache over a host tier over RocksDB, batches read ahead: the insertion (which marks
    the tier's rows used and written on the device) is captured and replayed, never failing, and
    trains as the same collection run eagerly, bit for bit; the tier evicted and wrote down."""
    import tieredemb.storage.tiers.cache_on_device as cache_module

    monkeypatch.setattr(cache_module, "padded_size", lambda n: -(-n // 4096) * 4096 + 4096)  # noqa: E731
    optimizer = te.optim.RowWiseAdagrad(lr=0.05)
    row_bytes = (16 + optimizer.state_width(16)) * 4

    def make_tables(capture: bool):
        monkeypatch.setenv("TIEREDEMB_CAPTURE", "1" if capture else "0")
        tables = [te.TableConfig(f"t{i}", 16, [f"f{i}"], num_embeddings=4000 * 7919) for i in range(3)]
        storage = te.StorageConfig(hbm_budget=3 * 1024 * row_bytes, host_budget=3 * 1500 * row_bytes,
                                   backing=te.storage.RocksDB(str(tmp_path / f"db{int(capture)}")))
        return te.EmbeddingBagCollection(tables, optimizer=optimizer, device=DEV, seed=3, storage=storage)

    eager, captured = make_tables(False), make_tables(True)
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(0, 3, (3 * 256,), generator=gen)
    batches = [batch(gen, lengths, 4000) for i in range(18)]
    upstream = torch.randn(8192, 48, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    outputs = []
    with torch.autograd.set_multithreading_enabled(False):
        for i, kjt in enumerate(batches[:-2]):
            for collection in (captured, eager):
                collection.read_ahead(batches[i + 2].to(torch.device("cpu")))
            outputs.append((step(captured, kjt, upstream), step(eager, kjt, upstream)))
    assert_insertions_alike(outputs, eager, captured, replays=4)
    tier = captured.stats()["t0"].host_tier
    assert tier.evictions > 0 and tier.written_down > 0 and tier.read_ahead_rows > 0, tier
    for collection in (eager, captured):
        collection.close()


def assert_insertions_alike(outputs, eager, captured, replays: int) -> None:
    """The same (captured, eager) outputs step by step and the same tables; the first group's
    insertion graphs captured, replayed at least ``replays`` times and never failed."""
    for i, (got, want) in enumerate(outputs):
        assert torch.equal(got, want), f"step {i}: outputs differ"
    assert_same_tables(eager, captured)
    graphs = captured.tiers[0]._insert_graphs
    assert graphs is not None and graphs.failed is None, graphs.failed
    assert graphs.captures >= 1 and graphs.replays >= replays, (graphs.captures, graphs.replays)


def pipelined(collection, upstream: torch.Tensor):
    """TrainPipeline's order by hand (forward i, ``prefetch_deferred`` of i+1, backward i): a
    function of the next batch returning the output of the one before (None: the last one's)."""
    held = []

    def step(kjt):
        out = None
        if held:
            out = values(collection(held[0]))
        if kjt is not None:
            collection.prefetch_deferred(kjt)
        if held:
            (out * upstream[: out.shape[0]]).sum().backward()
            held.pop(0)
            out = out.detach()
        if kjt is not None:
            held.append(kjt)
        return out
    return step


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_captured_prefetch_with_weights_and_pooling(pooling, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(0, 6, (3 * 128,), generator=gen)
    batches = [batch(gen, lengths, 200, weighted=True) for _ in range(6)]
    _, captured = train_both(te.EmbeddingBagCollection, te.optim.RowWiseAdagrad(lr=0.1), monkeypatch,
                             batches, pooling=pooling)
    assert captured._stager.captured.replays >= 4


def test_shapes_that_change_are_captured_each_or_padded(monkeypatch):
    """Two shapes alternating: each captured once and replayed; a shape new every step: its ids
    padded to a bucket, the bucket captured once seen twice; the same training either way."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(1, 6, (3 * 64,), generator=gen)
    b = torch.randint(1, 6, (3 * 32,), generator=gen)
    batches = [batch(gen, a if i % 2 == 0 else b, 150) for i in range(10)]
    _, captured = train_both(te.EmbeddingBagCollection, te.optim.Adagrad(lr=0.1), monkeypatch, batches)
    assert captured._stager.captured.captures == 2 and captured._stager.captured.replays == 8

    fresh = []
    for i in range(6):  # one more id each step: n = 96 .. 101, in the buckets 96, 100 (x4), 104
        lengths = torch.full((3 * 16,), 2)
        lengths[0] += i
        fresh.append(batch(gen, lengths, 150))
    _, captured = train_both(te.EmbeddingBagCollection, te.optim.Adagrad(lr=0.1), monkeypatch, fresh)
    assert captured._stager.captured.captures == 1 and captured._stager.captured.replays == 3


@pytest.mark.parametrize("optimizer", [te.optim.SGD(lr=0.1), te.optim.Adam(lr=0.01)], ids=["sgd", "adam"])
def test_jagged_batches_replay_a_padded_graph(optimizer, monkeypatch):
    """Lengths drawn anew every step (the id count changes every step, as with real features): the
    prefetch replays the graph of the ids' bucket, padded; the same training as eagerly."""
    gen = torch.Generator().manual_seed(9)
    batches = []
    for i in range(10):  # n = 3000 + i ids, all in the bucket of 3072
        lengths = torch.full((3 * 256,), 3)
        lengths[torch.randperm(3 * 256, generator=gen)[: 696 + i]] += 1
        batches.append(batch(gen, lengths, 400, weighted=True))
    assert [kjt.values().numel() for kjt in batches] == list(range(3000, 3010))
    _, captured = train_both(te.EmbeddingBagCollection, optimizer, monkeypatch, batches, pooling="mean")
    stages = captured._stager.captured
    assert stages.captures == 1 and stages.replays == 9, (stages.captures, stages.replays)


def test_a_bad_batch_in_a_captured_shape_raises_and_changes_nothing(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 5, (3 * 64,), generator=gen)
    batches = [batch(gen, lengths, 100) for _ in range(4)]
    eager, captured = train_both(te.EmbeddingBagCollection, te.optim.Adam(lr=0.01), monkeypatch, batches)
    replays = captured._stager.captured.replays
    bad = batch(gen, lengths, 100)
    bad.values()[5] = te.RESERVED_KEY
    before = captured.export("t0")
    with pytest.raises(ValueError, match="RESERVED_KEY"):
        captured.prefetch(bad)
    assert captured._stager.captured.replays == replays + 1  # it went through the graph
    after = captured.export("t0")
    assert torch.equal(before.scores.sort().values, after.scores.sort().values)
    # the slot came back, and training goes on exactly as the eager collection's
    up = torch.randn(64, 48, device=DEV)
    for _ in range(3):
        kjt = batch(gen, lengths, 100)
        assert torch.equal(step(captured, kjt, up), step(eager, kjt, up))
    assert_same_tables(eager, captured)


def test_more_batches_in_flight_than_slots(monkeypatch):
    """Three prefetches of one shape before their forwards: two slots of the shape replay, the third
    batch takes the padded bucket's graph (the first round, before any forward: nothing captured; the
    second: the two slots and the bucket captured; the third: replays); every batch trains as it does
    eagerly."""
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(1, 5, (3 * 64,), generator=gen)
    eager = make(te.EmbeddingBagCollection, te.optim.SGD(lr=0.1), monkeypatch, False)
    captured = make(te.EmbeddingBagCollection, te.optim.SGD(lr=0.1), monkeypatch, True)
    up = torch.randn(64, 48, device=DEV)
    for round_ in range(3):
        kjts = [batch(gen, lengths, 120) for _ in range(3)]
        for collection in (eager, captured):
            for kjt in kjts:
                collection.prefetch(kjt)
        for kjt in kjts:
            want = eager(kjt).values()
            got = captured(kjt).values()
            assert torch.equal(got, want), round_
            (want * up).sum().backward()
            (got * up).sum().backward()
    assert_same_tables(eager, captured)
    stages = captured._stager.captured
    assert stages.captures == 3 and stages.replays == 6, (stages.captures, stages.replays)


def test_a_prefetch_thread_replays_but_never_captures(monkeypatch):
    """A plain loop captures the batch shape on the training thread; a TrainPipeline
    (prefetch_in_thread=True) over the same collection then replays that graph on its worker's stream
    and captures nothing there (a capture is not safe beside a thread that synchronizes); a shape
    first seen under the worker stays eager. Trains exactly as an eager loop over the same batches."""
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 6, (3 * 128,), generator=gen)
    batches = [batch(gen, lengths, 400) for _ in range(12)]
    other = torch.randint(1, 6, (3 * 128,), generator=gen)
    batches += [batch(gen, other, 400) for _ in range(4)]  # a new shape, under the worker only
    eager = make(te.EmbeddingBagCollection, te.optim.Adam(lr=0.01), monkeypatch, False)
    for kjt in batches:
        eager(kjt).values().square().sum().backward()
    captured = make(te.EmbeddingBagCollection, te.optim.Adam(lr=0.01), monkeypatch, True)
    captured.prefetch(batches[0])  # seen
    captured(batches[0]).values().square().sum().backward()
    captured.prefetch(batches[1])  # two in flight, as under the pipeline: both slots captured here
    captured.prefetch(batches[2])
    for kjt in batches[1:3]:
        captured(kjt).values().square().sum().backward()
    stages = captured._stager.captured
    assert (stages.captures, stages.replays) == (2, 2)
    pipeline = te.TrainPipeline(_Model(captured), None, device=DEV, prefetch_in_thread=True)
    it = iter([{"kjt": kjt} for kjt in batches[3:]])
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
    pipeline.close()
    assert (stages.captures, stages.replays) == (2, 11), (stages.captures, stages.replays)
    assert stages.failed is None
    assert_same_tables(eager, captured)


def test_the_inline_pipeline_defers_its_read_and_trains_as_an_eager_loop(monkeypatch):
    """TrainPipeline's inline prefetch (``prefetch_deferred``): batch i+1's captured device half is
    replayed between forward i and backward i and read at forward i+1, after backward i's launches;
    jagged batches of one shape and then new keys in a second shape. Trains exactly as an eager loop
    (rows, optimizer state, scores, counters)."""
    gen = torch.Generator().manual_seed(9)
    lengths = torch.randint(1, 6, (3 * 128,), generator=gen)
    batches = [batch(gen, lengths, 300) for _ in range(10)]
    other = torch.randint(1, 6, (3 * 128,), generator=gen)
    batches += [batch(gen, other, 3000) for _ in range(6)]  # new keys in every batch
    eager = make(te.EmbeddingBagCollection, te.optim.Adam(lr=0.01), monkeypatch, False)
    for kjt in batches:
        eager(kjt).values().square().sum().backward()
    captured = make(te.EmbeddingBagCollection, te.optim.Adam(lr=0.01), monkeypatch, True)
    deferred = []
    inner = captured.prefetch_deferred

    def counted(kjt):
        inner(kjt)
        deferred.append(captured._queue.newest().__class__.__name__ == "StagedRecord")

    captured.prefetch_deferred = counted
    pipeline = te.TrainPipeline(_Model(captured), None, device=DEV)
    it = iter([{"kjt": kjt} for kjt in batches])
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
    assert len(deferred) == len(batches) and all(deferred)
    # pinned read buffers kept and reused, not one a batch
    assert 1 <= len(captured._stager._read_buffers) <= 2
    assert captured._stager.captured.replays > 0 and captured._stager.captured.failed is None
    assert_same_tables(eager, captured)


def test_a_capture_that_fails_leaves_the_eager_path_working():
    """A staging function that reads the device cannot be captured: ``acquire`` warns, returns None
    (the caller runs eagerly) and never tries again; CUDA keeps working."""
    from tieredemb.ops.capture import CapturedStages

    stages = CapturedStages(DEV, (torch.int64,), after=0)

    def reads(x):
        return x + int(x.sum())  # a host read: not allowed while capturing

    x = torch.arange(8, device=DEV)
    with pytest.warns(RuntimeWarning, match="runs eagerly from now on"):
        assert stages.acquire(("k",), reads, x) is None
    assert stages.failed is not None and stages.captures == 0
    assert stages.acquire(("k",), lambda t: t + 1, x) is None  # no second try
    assert torch.equal(reads(x), x + 28)  # the eager path, after the failed capture

    ok = CapturedStages(DEV, (torch.int64,), after=0)
    slot = ok.acquire(("k",), lambda t: t * 2, x)
    assert slot is not None and torch.equal(slot.outputs, x * 2)
    ok.release(slot, None)
    slot = ok.acquire(("k",), lambda t: t * 2, x + 1)  # replayed on new inputs
    assert ok.captures == 1 and torch.equal(slot.outputs, (x + 1) * 2)


def test_no_garbage_collection_runs_during_a_capture():
    """A collection of cyclic garbage during a capture could run a finalizer that launches onto or
    reads the capturing stream (a dropped batch's release): staging that allocates past the
    collector's threshold, with such garbage about, is still captured; the finalizer runs after."""
    import gc

    from tieredemb.ops.capture import CapturedStages

    stages = CapturedStages(DEV, (torch.int64,), after=0)
    x = torch.arange(8, device=DEV)
    ran = []

    class Cycle:
        def __init__(self):
            self.me = self

        def __del__(self):
            ran.append(int(x.sum()))  # a host read

    def stage(t):
        Cycle()  # freed only by a collection
        _ = [[] for _ in range(5000)]  # tracked allocations past the threshold of a collection
        return t * 2

    gc.collect()
    slot = stages.acquire(("k",), stage, x)
    assert stages.failed is None and slot is not None and torch.equal(slot.outputs, x * 2)
    assert gc.isenabled() and not ran
    gc.collect()
    assert ran == [28]


@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_early_lookup_after_a_captured_prefetch(module, monkeypatch):
    """Batches of known keys: the rows are looked up right after the replayed prefetch's read (from
    the graph's outputs) and the forward uses that lookup; a batch with a new key looks up in the
    forward. The same outputs and rows as the eager collection."""
    gen = torch.Generator().manual_seed(6)
    lengths = torch.randint(1, 6, (3 * 64,), generator=gen)
    warm = batch(gen, lengths, 50)
    per_feature = lengths.view(3, 64).sum(dim=1).tolist()

    def rolled(shift: int):  # warm's ids, each feature's rolled: only known (table, key) pairs
        parts = warm.values().split(per_feature)
        return te.KeyedJaggedTensor(FEATURES, torch.cat([p.roll(shift) for p in parts]),
                                    lengths=lengths.to(DEV))

    batches = [warm, warm] + [rolled(s) for s in range(1, 6)]
    batches[4].values()[0] = 10**12 + 7  # a key no batch had
    eager = make(module, te.optim.Adam(lr=0.01), monkeypatch, False)
    captured = make(module, te.optim.Adam(lr=0.01), monkeypatch, True)
    up = torch.randn(8192, 16, device=DEV)
    used = []
    for kjt in batches:
        outs = []
        for c in (eager, captured):
            c.prefetch(kjt)
            if c is captured:
                used.append(c._queue.newest().looked is not None)
            out = values(c(kjt))
            (out * up.view(-1)[: out.numel()].view_as(out)).sum().backward()
            outs.append(out.detach())
        assert torch.equal(outs[1], outs[0])
    assert used == [False, True, True, True, False, True, True], used
    assert captured._stager.captured.replays >= 5
    assert_same_tables(eager, captured)
