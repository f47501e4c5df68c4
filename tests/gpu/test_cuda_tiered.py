"""Cache and hybrid modes on CUDA, with tiny caches and the pipeline (races show there): the same
outputs and rows as hbm_direct on the CPU."""

from __future__ import annotations

import pytest
import torch

import tieredemb as te

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run through tools/gpu_check.sh)", allow_module_level=True)

DIM, ROWS = 16, 2000


def batches(steps: int, batch: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** 1.05
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 6, (2 * batch,), generator=gen)
        ids = torch.multinomial(weights, int(lengths.sum()), replacement=True, generator=gen)
        out.append({"kjt": te.KeyedJaggedTensor(["a", "b"], ids, lengths=lengths),
                    "grad": torch.randn(batch, 2 * DIM, generator=gen)})
    return out


class Model(torch.nn.Module):
    def __init__(self, ebc: te.EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch: dict) -> torch.Tensor:
        return (self.ebc(batch["kjt"]).values() * batch["grad"]).sum()


def build(storage, device, kernels="auto") -> te.EmbeddingBagCollection:
    tables = [te.TableConfig("t", DIM, ["a", "b"], num_embeddings=ROWS)]
    return te.EmbeddingBagCollection(tables, optimizer=te.optim.Adam(lr=0.01), storage=storage,
                                     device=device, seed=1, kernels=kernels)


def train_both(pipe: te.TrainPipeline, data: list[dict]) -> te.EmbeddingBagCollection:
    """``data`` through ``pipe`` and through hbm_direct on the CPU, the losses compared; the CPU
    collection back."""
    it = iter(data)
    losses = []
    while True:
        try:
            losses.append(float(pipe.progress(it).detach()))
        except StopIteration:
            break
    cpu = build(None, torch.device("cpu"))
    model = Model(cpu)
    want = []
    for b in data:
        loss = model(b)
        loss.backward()
        want.append(float(loss.detach()))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-4, atol=1e-4)
    return cpu


def rows(ebc) -> torch.Tensor:
    r = ebc.export("t")
    order = torch.argsort(r.keys)
    return torch.cat([r.weights, r.optimizer_state], 1)[order].cpu()


@pytest.mark.parametrize("in_thread", [False, True])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["cache", "hybrid"])
def test_tiny_tiers_through_the_pipeline_match_cpu(kernels, mode, in_thread, monkeypatch) -> None:
    """A device budget of 8 rows under TrainPipeline: in cache mode the two batches in flight lock
    every way, so misses are conflict misses in scratch rows that later batches share, on the
    device (``_shared_pads``: in the insertion's CUDA graph with Triton's kernels)."""
    from tests.modules.test_tiered_modes import shared_pads

    pads = shared_pads(monkeypatch)
    row_bytes = (DIM + 2 * DIM) * 4
    storage = te.StorageConfig(hbm_budget=8 * row_bytes, caching=mode == "cache", bucket_width=4,
                               segment_rows=8)
    gpu = build(storage, torch.device("cuda"), kernels)
    assert gpu.storage_mode == mode
    data = batches(25, 32)
    pipe = te.TrainPipeline(Model(gpu), None, device=torch.device("cuda"), prefetch_in_thread=in_thread)
    cpu = train_both(pipe, data)
    torch.testing.assert_close(rows(gpu), rows(cpu), rtol=1e-4, atol=1e-5)
    if mode == "cache":
        assert sum(pads) > 0 and gpu.stats()["t"].conflict_misses > 0, pads


@pytest.mark.parametrize("lookahead", [0, 2])
def test_a_host_tier_over_rocksdb_through_the_pipeline_matches_cpu(lookahead, tmp_path) -> None:
    """A tiny device cache over a host tier (pinned rows) over RocksDB, reads issued ahead by the
    pipeline: the losses and rows of hbm_direct on the CPU."""
    row_bytes = (DIM + 2 * DIM) * 4
    storage = te.StorageConfig(hbm_budget=8 * row_bytes, bucket_width=4, segment_rows=8,
                               host_budget=64 * row_bytes, backing=te.storage.RocksDB(str(tmp_path / "db")))
    gpu = build(storage, torch.device("cuda"))
    assert gpu.storage_mode == "cache"
    data = batches(25, 32)
    pipe = te.TrainPipeline(Model(gpu), None, device=torch.device("cuda"), lookahead=lookahead)
    cpu = train_both(pipe, data)
    gpu.flush()
    torch.testing.assert_close(rows(gpu), rows(cpu), rtol=1e-4, atol=1e-5)
    stats = gpu.stats()["t"].host_tier
    assert stats.hits > 0 and stats.evictions > 0, stats  # the host tier served rows and filled up
    gpu.close()


def test_host_memory_backend_with_a_gpu_index_matches_the_dict_backend() -> None:
    """HostMemory under a CUDA collection: index on the GPU, rows in pinned host segments read and
    written in place by the Triton kernels."""
    from tieredemb.storage.backend import DictBackend

    width = 7
    backend = te.storage.HostMemory(segment_rows=64).open("t", width, torch.device("cuda"))
    assert backend.device.type == "cuda"
    ref = DictBackend(width)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        keys = torch.randint(-500, 500, (int(torch.randint(0, 200, (1,), generator=gen)),), generator=gen)
        rows = torch.randn(keys.numel(), width, generator=gen)
        backend.set(keys.cuda(), rows.cuda())
        ref.set(keys, rows)
        gone = torch.randint(-500, 500, (10,), generator=gen)
        backend.delete(gone.cuda())
        ref.delete(gone)
        probe = torch.randint(-600, 600, (300,), generator=gen)
        got, want = backend.get(probe.cuda()), ref.get(probe)
        assert torch.equal(got.found.cpu(), want.found)
        assert torch.equal(got.rows.cpu(), want.rows)
    assert backend.size() == ref.size()
    scanned = {k: r for ks, rs in backend.scan(chunk_rows=50) for k, r in zip(ks.tolist(), rs.cpu())}
    assert sorted(scanned) == sorted(ref._rows)
    assert all(torch.equal(scanned[k], ref._rows[k]) for k in scanned)


@pytest.mark.parametrize("autograd_threads", [False, True])
def test_pipeline_backward_thread(autograd_threads) -> None:
    """TrainPipeline's backward runs on the training thread unless asked for autograd's device
    threads (the hand-over costs a fraction of a millisecond a step: docs/performance.md)."""
    import threading

    gpu = build(None, torch.device("cuda"))
    seen = []

    class Hooked(Model):
        def forward(self, batch: dict) -> torch.Tensor:
            out = self.ebc(batch["kjt"]).values()
            out.register_hook(lambda g: seen.append(threading.get_ident()))
            return (out * batch["grad"]).sum()

    pipe = te.TrainPipeline(Hooked(gpu), None, device=torch.device("cuda"), autograd_threads=autograd_threads)
    it = iter(batches(3, 8))
    for _ in range(3):
        pipe.progress(it)
    main = threading.get_ident()
    assert len(seen) == 3
    assert all((t != main) == autograd_threads for t in seen)


@pytest.mark.parametrize("order", ["lagging", "ahead"])
@pytest.mark.parametrize("mode", ["hbm_direct", "cache_over_host_memory"])
def test_a_training_stream_behind_keeps_its_batch(mode, order) -> None:
    """TrainPipeline(prefetch_in_thread=True)'s hazard made certain: the training stream runs far
    behind the host (a long sleep queued before each backward), and the next batch's prefetch runs
    on its own stream ordered only after the forward, its host work either after the host has
    released the batch ("lagging": a prefetch thread slower than the backward's launches) or before
    the backward ("ahead"). Blocks of the batch's tensors that the host freed must not reach the
    prefetch stream before the training stream has read them: the rows trained equal a plain CPU
    loop's. Over host memory it found, session 24, a replayed insertion giving back the scratch rows
    of its conflict misses while they were trained (``LentRows.split``)."""
    dev = torch.device("cuda")
    storage = None if mode == "hbm_direct" else te.StorageConfig(
        hbm_budget=64 * (DIM + 2 * DIM) * 4, backing=te.storage.HostMemory(segment_rows=64))
    gpu = build(storage, dev)
    model = Model(gpu)
    data = [{"kjt": b["kjt"].to(dev), "grad": b["grad"].to(dev)} for b in batches(12, 64)]
    main, side = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)

    def prefetch(i: int, after: torch.cuda.Event | None) -> None:
        with torch.cuda.stream(side):
            if after is not None:
                side.wait_event(after)
            gpu.prefetch(data[i]["kjt"])

    prefetch(0, None)
    for i in range(len(data)):
        main.wait_stream(side)
        loss = model(data[i])
        forward_done = main.record_event()
        if order == "ahead" and i + 1 < len(data):
            prefetch(i + 1, forward_done)
        torch.cuda._sleep(50_000_000)  # ~25 ms of the training stream's work ahead of the backward
        loss.backward()
        del loss  # the batch's autograd graph, and with it the prefetch's tensors, freed by the host
        if order == "lagging" and i + 1 < len(data):
            prefetch(i + 1, forward_done)
    torch.cuda.synchronize()

    cpu = build(None, torch.device("cpu"))
    reference = Model(cpu)
    for b in batches(12, 64):
        reference(b).backward()
    torch.testing.assert_close(rows(gpu), rows(cpu), rtol=1e-4, atol=1e-5)


def test_a_segment_table_made_on_one_stream_is_whole_on_another() -> None:
    """``RowStore.pointer_table`` copies a new table to the device on the stream that asks first;
    another stream handed the same table reads it only after that copy (TrainPipeline's prefetch
    thread grew the store and read a table the training stream, far behind, had not filled yet: an
    illegal address at scale 0.3, session 24)."""
    from tieredemb.storage.row_store import RowStore

    dev = torch.device("cuda")
    store = RowStore(4, 8, dev)
    store.allocate(20)  # three segments
    behind, other = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    with torch.cuda.stream(behind):
        torch.cuda._sleep(100_000_000)  # ~50 ms: the table's copy is queued after it
        store.pointer_table()
    with torch.cuda.stream(other):
        seen = store.pointer_table().clone()
    other.synchronize()
    assert seen.cpu().tolist() == [s.data_ptr() for s in store.segments]
