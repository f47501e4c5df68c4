"""Host reads of a steady-state training step on CUDA (DESIGN section 4, rule 1), counted with torch's sync
debug mode: every operation that makes the host wait for the device warns once. The staged prefetch (of
one table group, or of several together) reads the device once a step (the batch checks, the number of
distinct keys and the misses together); forward and backward read nothing. (torch calls the mode a
prototype that does not see every synchronizing operation; the profiler's count of
`cudaStreamSynchronize` agrees here: `python3 tools/profile_step.py` prints it.)"""

from __future__ import annotations

import threading
import traceback
import warnings

import pytest
import torch

import tieredemb as te

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run through tools/gpu_check.sh)", allow_module_level=True)

DEV = torch.device("cuda")


def _watch_reads(fn, seen) -> None:
    """Run ``fn`` with torch's sync debug mode warning; ``seen()`` is called at each synchronizing
    operation, on the thread that ran it."""
    torch.cuda.synchronize()

    def show(message, *args, **kwargs):
        if "called a synchronizing" in str(message):
            seen()

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)


def host_reads(fn) -> list[str]:
    """The synchronizing operations ``fn`` runs (torch.cuda.set_sync_debug_mode's warnings), each
    named by the innermost tieredemb lines that ran it (a failing count says where the reads are)."""
    reads: list[str] = []

    def seen():
        frames = [f for f in traceback.extract_stack()[:-2] if "/tieredemb/" in f.filename]
        reads.append(" < ".join(f"{f.filename.rsplit('/tieredemb/', 1)[1]}:{f.lineno} {f.name}"
                                for f in reversed(frames[-3:])) or "outside tieredemb")

    _watch_reads(fn, seen)
    return reads


@pytest.mark.parametrize("capacity", [None, 4096], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("dims", [(16, 16, 16), (16, 32, 16)], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("optimizer", [te.optim.SGD(lr=0.1), te.optim.Adam(lr=0.01)], ids=["sgd", "adam"])
@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_a_warm_step_reads_the_device_once(module, optimizer, dims, capacity):
    """One group, or two (tables of two dims, staged together), bounded tables (``max_capacity``
    over more slots than keys: warm, nothing misses) or not: one host read a warm step."""
    tables = [te.TableConfig(f"t{i}", d, [f"f{i}"], max_capacity=capacity)  # raw ids
              for i, d in enumerate(dims)]
    collection = module(tables, optimizer=optimizer, device=DEV)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 5, (3 * 64,), generator=gen)
    ids = torch.randint(0, 500, (int(lengths.sum()),), generator=gen)
    kjt = te.KeyedJaggedTensor([f"f{i}" for i in range(3)], ids, lengths=lengths).to(DEV)

    def step():
        collection.prefetch(kjt)
        out = collection(kjt)
        loss = out.values().sum() if module is te.EmbeddingBagCollection else \
            sum(jt.values().sum() for jt in out.values())
        loss.backward()

    for _ in range(2):  # the batch's keys are stored: the next steps find every key
        step()
    reads = host_reads(step)
    assert len(reads) == 1, f"{len(reads)} host reads in a warm step: {reads}"


def cache_steps_read_once(ebc) -> tuple:
    """46 plain-loop steps of ids drawn from the first 600 keys of three features (warm after 40:
    the cache fills and evicts, the stores below hold every key and stop growing); each of the last
    6 reads the device at most once. Returns table t0's stats before and after those 6."""
    gen = torch.Generator().manual_seed(0)
    for i in range(46):
        lengths = torch.randint(1, 6, (3 * 64,), generator=gen)
        ids = torch.randint(0, 600, (int(lengths.sum()),), generator=gen)
        kjt = te.KeyedJaggedTensor([f"f{i}" for i in range(3)], ids, lengths=lengths).to(DEV)

        def step(kjt=kjt):
            ebc.prefetch(kjt)
            ebc(kjt).values().sum().backward()

        if i < 40:
            step()
            continue
        if i == 40:
            before = ebc.stats()["t0"]
        reads = host_reads(step)
        assert len(reads) <= 1, f"{len(reads)} host reads in a cache step: {reads}"
    return before, ebc.stats()["t0"]


def test_a_cache_step_with_misses_and_evictions_reads_the_device_once():
    """A plain loop in cache mode (a quarter of the rows on the device, misses and evictions every
    step): the staged prefetch's read (checks, distinct keys, probe) and no other: the insertion
    (victims, conflict misses) and the write-down (the host store's upsert) count on the device, read
    back behind the work; forward and backward none. (The ids come from the first 600 keys, so the
    host store is done growing after the warm steps: a growing store reads more.)"""
    dim, rows = 16, 4000
    storage = te.StorageConfig(hbm_budget=rows // 4 * (dim + 1) * 4, backing=te.storage.HostMemory())
    tables = [te.TableConfig(f"t{i}", dim, [f"f{i}"], num_embeddings=rows) for i in range(3)]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.RowWiseAdagrad(lr=0.05), storage=storage,
                                    device=DEV)
    assert ebc.storage_mode == "cache"
    before, after = cache_steps_read_once(ebc)
    assert after.evictions > before.evictions and after.misses > before.misses


@pytest.mark.parametrize("loop", ["plain", "pipelined"])
def test_a_bounded_step_with_misses_and_evictions_reads_the_device_once(loop):
    """Bounded tables (hbm_direct, ``max_capacity`` a fifth of the keys drawn): misses, evictions and
    conflict misses every step; a step reads the device once (the staged prefetch's read: the
    insertion takes its rows from a pool and counts on the device), forward and backward never. Also in
    TrainPipeline's order (batch i+1's ``prefetch_deferred`` between forward i and backward i), where
    the probe of batch i+1 meets buckets batch i holds: its insertion waits for batch i's locks to be
    given back, and nothing is inserted later (``settle``), with its own reads."""
    tables = [te.TableConfig(f"t{i}", 16, [f"f{i}"], max_capacity=128) for i in range(3)]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.Adam(lr=0.01), device=DEV,
                                    storage=te.StorageConfig(bucket_width=8))
    gen = torch.Generator().manual_seed(0)
    kjts = []
    for _ in range(17):
        lengths = torch.randint(1, 6, (3 * 64,), generator=gen)
        ids = torch.randint(0, 640, (int(lengths.sum()),), generator=gen)
        kjts.append(te.KeyedJaggedTensor([f"f{i}" for i in range(3)], ids, lengths=lengths).to(DEV))
    if loop == "pipelined":
        ebc.prefetch_deferred(kjts[0])
    before = None
    for i, kjt in enumerate(kjts[:-1]):

        def step(kjt=kjt, following=kjts[i + 1]):
            if loop == "plain":
                ebc.prefetch(kjt)
            out = ebc(kjt).values()
            if loop == "pipelined":
                ebc.prefetch_deferred(following)
            out.sum().backward()

        if i < 10:
            step()
            continue
        before = before or ebc.stats()["t0"]
        reads = host_reads(step)
        assert len(reads) <= 1, f"{len(reads)} host reads in a bounded step: {reads}"
    after = ebc.stats()["t0"]
    assert after.evictions > before.evictions and after.conflict_misses > before.conflict_misses


def test_a_step_that_grows_the_row_store_reads_the_device_once():
    """Bounded tables far from their bound, new keys every step and small segments: the store adds
    segments every step (its pointer table made again, copied to the device without a wait), and a
    step still reads the device once."""
    tables = [te.TableConfig(f"t{i}", 16, [f"f{i}"], max_capacity=1 << 20) for i in range(3)]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.Adam(lr=0.01), device=DEV,
                                    storage=te.StorageConfig(bucket_width=8, segment_rows=64))
    (group,) = ebc.tiers
    gen = torch.Generator().manual_seed(0)
    grown = 0
    for i in range(16):
        lengths = torch.randint(1, 6, (3 * 64,), generator=gen)
        ids = torch.randint(0, 400, (int(lengths.sum()),), generator=gen) + 400 * i  # new keys
        kjt = te.KeyedJaggedTensor([f"f{t}" for t in range(3)], ids, lengths=lengths).to(DEV)

        def step(kjt=kjt):
            ebc.prefetch(kjt)
            ebc(kjt).values().sum().backward()

        if i < 8:
            step()
            continue
        before = group.store.rows_allocated()
        reads = host_reads(step)
        grown += group.store.rows_allocated() > before
        assert len(reads) <= 1, f"{len(reads)} host reads in a step that grows the store: {reads}"
    assert grown >= 6  # the scenario happened


def host_reads_by_thread(fn) -> dict[str, int]:
    """The synchronizing operations ``fn`` runs, counted per thread (the pipeline's worker too)."""
    counts: dict[str, int] = {}

    def seen():
        name = threading.current_thread().name
        counts[name] = counts.get(name, 0) + 1

    _watch_reads(fn, seen)
    return counts


class _Model(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc

    def forward(self, batch):
        return self.ebc(batch["kjt"]).values().square().sum()


@pytest.mark.parametrize("mode", ["hbm_direct", "cache"])
def test_the_training_thread_never_waits_for_the_device_under_the_prefetch_thread(mode):
    """DESIGN section 4 rule 1 with TrainPipeline(prefetch_in_thread=True): every host read of a
    steady-state step (the prefetch's) happens on the worker thread; the training thread's forward,
    backward and pipeline bookkeeping read nothing, in hbm_direct and in cache mode (which reads the
    device three times a prefetch)."""
    dim, rows = 16, 4000
    storage = None
    if mode == "cache":  # 1/4 of the rows in the cache, host memory behind (misses every step)
        storage = te.StorageConfig(hbm_budget=rows // 4 * (dim + 1) * 4, backing=te.storage.HostMemory())
    tables = [te.TableConfig(f"t{i}", dim, [f"f{i}"], num_embeddings=rows) for i in range(3)]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.RowWiseAdagrad(lr=0.05), storage=storage,
                                    device=DEV)
    assert ebc.storage_mode == mode
    gen = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.05
    batches = []
    for _ in range(14):
        lengths = torch.randint(1, 6, (3 * 64,), generator=gen)
        ids = torch.multinomial(weights, int(lengths.sum()), replacement=True, generator=gen)
        batches.append({"kjt": te.KeyedJaggedTensor([f"f{i}" for i in range(3)], ids, lengths=lengths)})
    pipeline = te.TrainPipeline(_Model(ebc), None, device=DEV, prefetch_in_thread=True)
    it = iter(batches)
    for _ in range(4):  # warm: kernels compiled, the pipeline full
        pipeline.progress(it)

    def steps():
        for _ in range(6):
            pipeline.progress(it)

    reads = host_reads_by_thread(steps)
    worker = sum(n for name, n in reads.items() if name.startswith("tieredemb-prefetch"))
    # the mode sees them: six prefetches are issued in the window, the last one's read may land on the
    # worker after the window closes (the training thread does not wait for it)
    assert worker >= 5, f"the prefetches' reads should show on the worker: {reads}"
    # the rule is about this thread: a thread an earlier test left running (an I/O worker, say) may
    # read too, so the message names every thread's reads
    training = reads.get(threading.current_thread().name, 0)
    assert training == 0, f"{training} host reads on the training thread in 6 steady-state steps: {reads}"
    pipeline.close()
    # the control: a prefetch on this thread is counted here
    kjt = batches[-1]["kjt"].to(DEV)
    reads = host_reads_by_thread(lambda: ebc.prefetch(kjt))
    assert reads.get(threading.current_thread().name, 0) >= 1, reads
    ebc(kjt).values().sum().backward()


def test_a_read_ahead_of_a_batch_on_the_device_reads_nothing_back(tmp_path):
    """``read_ahead`` of a KJT on the GPU (two groups, one of three tables: the other group's pairs
    padded, not selected, with table numbers past this group's) hands the host tier its pairs
    without a host read, over a store that holds rows at open (a tier over an empty store reads
    nothing ahead); the reader thread gets them behind the device's work, and the tier marks the
    pairs it holds used (``TieredRows.wanted``) without reading out of range."""
    tables = [te.TableConfig("t0", 16, ["f0"])] + [te.TableConfig(f"t{i}", 32, [f"f{i}"]) for i in (1, 2, 3)]
    features = [f"f{i}" for i in range(4)]

    def build(existing):
        storage = te.StorageConfig(hbm_budget=64 * 16 * 4, host_budget=1 << 20,
                                   backing=te.storage.RocksDB(str(tmp_path / "db"), existing=existing))
        return te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1), storage=storage, device=DEV)

    kjt = te.KeyedJaggedTensor(features, torch.arange(80), lengths=torch.full((16,), 5)).to(DEV)
    first = build("error")  # rows in the store, then reopened over them
    first.prefetch(kjt)
    first(kjt).values().sum().backward()
    first.close()
    ebc = build("reuse")
    ebc.read_ahead(kjt)  # (the features' map to the groups made once)
    assert host_reads(lambda: ebc.read_ahead(kjt)) == []
    for group in ebc.tiers:  # the reads ahead located, started and landed
        group.below.maintain()
        group.below.finish_reads()
    ebc.prefetch(kjt)
    ebc(kjt).values().sum().backward()
    torch.cuda.synchronize()  # (a read out of range would raise here at the latest)
    assert sum(ebc.stats()[t.name].host_tier.read_ahead_rows for t in tables) > 0
    ebc.close()


@pytest.mark.parametrize("dims", [(16, 16, 16), (16, 32, 16)], ids=["one-group", "two-groups"])
def test_a_cache_step_over_a_host_tier_that_holds_the_tables_reads_the_device_once(dims, tmp_path):
    """A device cache of a quarter of the rows over a host tier that holds them all, over RocksDB:
    the cache misses and evicts every step, the tier holds every miss (or the store never had it),
    so the staged read says so and the insertion asks the store nothing: one host read a step, as
    over host memory alone."""
    rows = 4000
    width = max(dims) + 1  # (row-wise Adagrad: one state value a row)
    storage = te.StorageConfig(hbm_budget=rows // 4 * width * 4, host_budget=3 * 2 * rows * width * 4,
                               backing=te.storage.RocksDB(str(tmp_path / "db")))
    tables = [te.TableConfig(f"t{i}", d, [f"f{i}"], num_embeddings=rows) for i, d in enumerate(dims)]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.RowWiseAdagrad(lr=0.05), storage=storage,
                                    device=DEV)
    assert ebc.storage_mode == "cache"
    before, after = cache_steps_read_once(ebc)
    assert after.evictions > before.evictions and after.misses > before.misses
    assert after.host_tier.hits > before.host_tier.hits and after.host_tier.misses == 0, after.host_tier
    ebc.close()


def test_a_warm_sharded_step_at_world_size_one_reads_the_device_twice(tmp_path):
    """The sharded path (NCCL, one rank, one group whose features are the batch's): the route's split
    sizes with the batch checks' verdict and the number of distinct pairs, then the owner's staged
    probe of the pairs it received (its dedup and probe in one read): two host reads a warm step
    (the requester's and the owner's dedups read no count of their own)."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        tables = [te.TableConfig("t0", 16, ["f0", "f1"])]
        collection = te.EmbeddingBagCollection(tables, optimizer=te.optim.Adam(lr=0.01), device=DEV,
                                               process_group=dist.group.WORLD)
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(0, 5, (2 * 64,), generator=gen)
        ids = torch.randint(0, 500, (int(lengths.sum()),), generator=gen)
        kjt = te.KeyedJaggedTensor(["f0", "f1"], ids, lengths=lengths).to(DEV)

        def step():
            collection(kjt).values().sum().backward()

        for _ in range(2):  # warm: the batch's keys are stored
            step()
        reads = host_reads(step)
        assert len(reads) <= 2, f"{len(reads)} host reads in a warm sharded step: {reads}"
    finally:
        dist.destroy_process_group()
