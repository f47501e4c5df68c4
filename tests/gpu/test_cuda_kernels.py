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
