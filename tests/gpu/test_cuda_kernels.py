"""Triton kernels on CUDA where the interpreter cannot show it: reduce_grads gives the same bits every
run (no float atomics), with Zipf-hot keys spanning many pieces; the index's upsert under real races
(thousands of programs claiming ways of the same buckets)."""

from __future__ import annotations

import pytest
import torch

from tieredemb.ops.triton.embedding import _PIECE, TritonKernels

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run through tools/gpu_check.sh)", allow_module_level=True)


def test_reduce_grads_is_deterministic_and_exact_to_fp32_rounding():
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, m, u, dim = 300_000, 30_000, 5000, 128
    weights = 1.0 / torch.arange(1, u + 1, dtype=torch.float64, device="cuda") ** 1.05
    inverse = torch.multinomial(weights, n, replacement=True, generator=gen)
    assert int(torch.bincount(inverse).max()) > 10 * _PIECE  # the hot key spans many pieces
    grad_src = torch.rand(m, dim, generator=gen, device="cuda") - 0.5
    src_of_id = torch.randint(0, m, (n,), generator=gen, device="cuda")
    scale = torch.rand(n, generator=gen, device="cuda")
    k = TritonKernels()
    runs = [k.reduce_grads(grad_src, src_of_id, scale, inverse, u) for _ in range(4)]
    for r in runs[1:]:
        assert torch.equal(r, runs[0])
    want = torch.zeros(u, dim, dtype=torch.float64, device="cuda").index_add_(
        0, inverse, grad_src.double()[src_of_id] * scale.double()[:, None])
    torch.testing.assert_close(runs[0].double(), want, rtol=1e-4, atol=1e-4)


def test_a_replaced_pointer_table_outlives_kernels_queued_on_another_stream():
    """TrainPipeline's prefetch thread grows a store (its pointer table is replaced) while the
    training stream's update still has kernels queued that read the old table: the old table's block
    must not go to a new tensor before they ran (it did: the update wrote rows to wild addresses)."""
    from tieredemb.storage.row_store import RowStore

    training, prefetch = torch.cuda.Stream(), torch.cuda.Stream()
    rows = torch.arange(32, dtype=torch.float32, device="cuda").view(8, 4)
    decoy = torch.full((8, 4), 7.0, device="cuda")  # what wild pointers would read
    torch.cuda.synchronize()
    with torch.cuda.stream(prefetch):  # the store and its table made on the prefetch stream
        store = RowStore(4, 8, torch.device("cuda"))
        addresses = store.allocate(8)
        store.scatter(addresses, rows)
        TritonKernels().gather(store, addresses, 4)  # compiled now (and the table made) on this stream
    prefetch.synchronize()
    with torch.cuda.stream(training):
        torch.cuda._sleep(1_000_000_000)  # the dense model's work ahead of the update (~0.5 s)
        got = TritonKernels().gather(store, addresses, 4)
    with torch.cuda.stream(prefetch):
        store.allocate(8)  # grows: the table is replaced and the old one dropped
        reused = [torch.full((1,), decoy.data_ptr(), dtype=torch.int64, device="cuda") for _ in range(64)]
    training.synchronize()
    assert torch.equal(got, rows), "the gather read a pointer table reused by the other stream"
    del reused


def test_upsert_under_contention_stores_each_pair_once():
    """Batches of distinct pairs from a small universe (most keys seen again, buckets contended by
    many programs): a pair stored earlier keeps its value, each new one takes a distinct address of
    the pool's first ``taken``, a pair left out is not stored, and the sizes count each pair once."""
    from tieredemb.index.key_index import Region
    from tieredemb.ops.triton import TritonKeyIndex

    tables, universe, n = 4, 100_000, 60_000
    index = TritonKeyIndex(16, device="cuda", regions=[Region("lru", None, 1 << 14) for _ in range(tables)])
    known = torch.full((tables * universe,), -1, dtype=torch.int64, device="cuda")  # pair id -> value
    gen = torch.Generator(device="cuda").manual_seed(1)
    next_address, left = 0, 0
    for step in range(1, 6):
        ids = torch.randperm(tables * universe, generator=gen, device="cuda")[:n]
        keys, regions = ids % universe, ids // universe
        before = known[ids]
        pool = torch.arange(next_address, next_address + n, device="cuda")
        values, counts = index.upsert(keys, regions, pool, step)
        taken, left_out = counts.tolist()
        assert torch.equal(values[before >= 0], before[before >= 0])
        new = (before < 0) & (values >= 0)
        assert torch.equal(values[new].sort().values, pool[:taken])
        assert int((values < 0).sum()) == left_out
        slots = index.find(keys, regions)
        assert torch.equal(slots >= 0, values >= 0)
        assert torch.equal(index.values[slots[slots >= 0]], values[values >= 0])
        known[ids[new]] = values[new]
        for r in range(tables):
            assert index.size(r) == int((known[r * universe:(r + 1) * universe] >= 0).sum())
        index.reserve_regions([index.size(r) for r in range(tables)])
        next_address += taken
        left += left_out
    assert left > 0  # the first batch overfills the small regions
