"""TritonKernels against TorchKernels (the reference) on 16-bit rows (bfloat16, float16): rows are
loaded as 16-bit, computed in float32 and stored rounded to the nearest value or stochastically with
the rows' seeds; the kernels land on the same 16-bit values as the reference.

On CPU the kernels run in the Triton interpreter (tiny sizes); on a CUDA machine on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tieredemb import optim  # noqa: E402
from tieredemb.ops.reference import TorchKernels  # noqa: E402
from tieredemb.ops.rounding import row_seeds, table_bases  # noqa: E402
from tieredemb.ops.triton import TritonKernels  # noqa: E402
from tieredemb.storage.row_store import RowStore  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16]
SEGMENT_ROWS = 8


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(11)


def make_store(gen: torch.Generator, width: int, rows: int, dtype: torch.dtype,
               state_from: int | None = None) -> tuple[RowStore, torch.Tensor]:
    """A ``dtype`` store of ``rows`` rows over several segments, random contents (columns from
    ``state_from`` on made >= 0: accumulators)."""
    store = RowStore(width, SEGMENT_ROWS, torch.device(DEVICE), dtype=dtype)
    addresses = store.allocate(rows)
    for seg in store.segments:
        values = torch.randn(seg.shape, generator=gen) * 0.5
        if state_from is not None:
            values[:, state_from:] = values[:, state_from:].abs()
        seg.copy_(values.to(dtype))
    return store, addresses


def twin_of(store: RowStore) -> RowStore:
    twin = RowStore(store.width, store.segment_rows, store.device, dtype=store.dtype)
    twin.allocate(store.rows_allocated())
    for dst, src in zip(twin.segments, store.segments):
        dst.copy_(src)
    return twin


def spacing(x: torch.Tensor) -> torch.Tensor:
    """The gap from each 16-bit value to the next one away from zero, as float32."""
    bits = x.view(torch.int16).to(torch.int32)
    return ((bits + 1).to(torch.int16).view(x.dtype).float() - x.float()).abs()


def assert_same_values(got: RowStore, want: RowStore) -> None:
    """The same 16-bit values, except where the two float32 computations straddled a rounding
    point: at most one value apart there, and rarely."""
    a = torch.cat(list(got.segments)).cpu()
    b = torch.cat(list(want.segments)).cpu()
    assert a.dtype == b.dtype
    differ = a.view(torch.int16) != b.view(torch.int16)
    assert bool(((a.float() - b.float()).abs() <= spacing(b))[differ].all())
    assert differ.float().mean().item() <= 0.02


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_pool_in_float32(gen, dtype):
    dim = 5
    store, addresses = make_store(gen, dim + 2, 30, dtype)
    addr = addresses[torch.randint(0, 30, (40,), generator=gen).to(DEVICE)]
    addr[::7] = -1
    got = TritonKernels().gather(store, addr, dim)
    assert got.dtype == torch.float32
    assert torch.equal(got, TorchKernels().gather(store, addr, dim))
    raw = TritonKernels().gather(store, addr, store.width, dtype=dtype)  # whole rows, unchanged
    assert raw.dtype == dtype and torch.equal(raw, store.gather(addr))
    offsets = torch.tensor([0, 3, 3, 10, 25, 40], device=DEVICE)
    scale = torch.rand(40, generator=gen).to(DEVICE)
    for s in (None, scale):
        got = TritonKernels().gather_pool(store, addr, offsets, s, dim)
        want = TorchKernels().gather_pool(store, addr, offsets, s, dim)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_rounds_to_nearest_and_copy_keeps_bits(gen, dtype):
    store, addresses = make_store(gen, 6, 20, dtype)
    twin = twin_of(store)
    addr = addresses[torch.randperm(20, generator=gen)[:12].to(DEVICE)]
    rows = torch.randn(12, 4, generator=gen).to(DEVICE)  # float32: rounded, the last 2 columns zero
    TritonKernels().scatter(store, addr, rows)
    TorchKernels().scatter(twin, addr, rows)
    for a, b in zip(store.segments, twin.segments):
        assert torch.equal(a, b)
    assert torch.equal(store.gather(addr)[:, :4], rows.to(dtype))
    other, dst = make_store(gen, 6, 20, dtype)
    TritonKernels().copy_rows(store, addr, other, dst[:12])
    assert torch.equal(other.gather(dst[:12]), store.gather(addr))
    f32, _ = make_store(gen, 6, 20, torch.float32)
    with pytest.raises(ValueError, match="rows of torch.bfloat16|rows of torch.float16"):
        TritonKernels().copy_rows(store, addr, f32, dst[:12])


def seeds_for(n: int, step: int) -> torch.Tensor:
    bases = table_bases(3, ["t"], DEVICE)
    return row_seeds(bases[torch.zeros(n, dtype=torch.int64, device=DEVICE)],
                     torch.arange(100, 100 + n, device=DEVICE), step)


KINDS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]


def make_optimizer(kind: str) -> optim.EmbeddingOptimizer:
    return {"sgd": lambda: optim.SGD(lr=0.1), "adagrad": lambda: optim.Adagrad(lr=0.1),
            "rowwise_adagrad": lambda: optim.RowWiseAdagrad(lr=0.1),
            "adam": lambda: optim.Adam(lr=0.01)}[kind]()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stochastic", [True, False])
def test_optimizer_update(gen, dtype, kind, stochastic):
    dim = 6
    opt = make_optimizer(kind)
    store, addresses = make_store(gen, dim + opt.state_width(dim), 24, dtype, state_from=dim)
    twin = twin_of(store)
    before = twin_of(store)
    for step in (1, 2, 3):
        addr = addresses[torch.randperm(24, generator=gen)[:16].to(DEVICE)]
        addr[3] = -1
        grads = torch.randn(16, dim, generator=gen).to(DEVICE)
        seeds = seeds_for(16, step) if stochastic else None
        TritonKernels().optimizer_update(store, addr, grads, opt, step, seeds)
        TorchKernels().optimizer_update(twin, addr, grads, opt, step, seeds)
    assert_same_values(store, twin)
    assert not all(torch.equal(a, b) for a, b in zip(store.segments, before.segments))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_reduce_update(gen, dtype, kind):
    """The fused reduction + update (a hot key over several pieces: the second kernel's update)."""
    from tieredemb.ops.triton.embedding import _PIECE

    dim, u = 4, 5
    opt = make_optimizer(kind)
    store, addresses = make_store(gen, dim + opt.state_width(dim), 10, dtype, state_from=dim)
    twin = twin_of(store)
    addr = addresses[torch.randperm(10, generator=gen)[:u].to(DEVICE)]
    inverse = torch.cat([torch.zeros(_PIECE + 5, dtype=torch.int64),
                         torch.randint(1, u, (30,), generator=gen)])
    inverse = inverse[torch.randperm(inverse.numel(), generator=gen)].to(DEVICE)
    n = inverse.numel()
    grad_src = (torch.randn(n, dim, generator=gen) * 0.05).to(DEVICE)
    src_of_id = torch.arange(n, device=DEVICE)
    seeds = seeds_for(u, 1)
    TritonKernels().reduce_update(grad_src, src_of_id, None, inverse, u, None, store, addr, opt, 1, seeds)
    TorchKernels().reduce_update(grad_src, src_of_id, None, inverse, u, None, twin, addr, opt, 1, seeds)
    assert_same_values(store, twin)


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_rounding_in_the_kernel_is_unbiased(dtype):
    """Many rows at 1.0 each take a step of an eighth of the dtype's spacing: rounded to nearest
    none moves; stochastically about an eighth of them go up one spacing."""
    rows, dim = 256, 4
    up = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    for stochastic in (True, False):
        store = RowStore(dim, 64, torch.device(DEVICE), dtype=dtype)
        addr = store.allocate(rows)
        TritonKernels().scatter(store, addr, torch.ones(rows, dim, device=DEVICE))
        grads = torch.full((rows, dim), -up / 8, device=DEVICE)
        TritonKernels().optimizer_update(store, addr, grads, optim.SGD(lr=1.0), 1,
                                         seeds_for(rows, 1) if stochastic else None)
        got = store.gather(addr).float()
        assert bool(((got == 1.0) | (got == 1.0 + up)).all())
        raised = (got > 1.0).float().mean().item()
        if stochastic:  # p = 1/8 over 1024 draws: standard error ~0.0103
            assert abs(raised - 0.125) < 0.05
        else:
            assert raised == 0.0
