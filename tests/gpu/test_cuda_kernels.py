"""Triton kernels on CUDA where the interpreter cannot show it: reduce_grads gives the same bits every
run (no float atomics), with Zipf-hot keys spanning many pieces."""

from __future__ import annotations

import pytest
import torch

from tieredemb.ops.triton.embedding import _PIECE, TritonKernels

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run through scripts/gpu_check.sh)", allow_module_level=True)


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
