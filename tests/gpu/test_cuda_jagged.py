"""The batch types on CUDA: a batch made on the device and what a collection reads of it read nothing
back to the host; pinned, moved with ``non_blocking`` and recorded on a side stream, a batch keeps its
data; its re-layouts on the device equal those on the host."""

from __future__ import annotations

import pytest
import torch

import tieredemb as te

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run through tools/gpu_check.sh)", allow_module_level=True)

from tests.gpu.test_cuda_syncs import host_reads  # noqa: E402 (CUDA only)

DEV = torch.device("cuda")


def host_batch() -> te.KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (3 * 8,), generator=gen)
    n = int(lengths.sum())
    return te.KeyedJaggedTensor(["a", "b", "c"], torch.randint(0, 100, (n,), generator=gen), lengths=lengths,
                                weights=torch.rand(n, generator=gen))


def test_what_a_step_reads_reads_nothing_back():
    cpu = host_batch()
    values, lengths, weights = (t.to(DEV) for t in (cpu.values(), cpu.lengths(), cpu.weights()))

    def step():
        kjt = te.KeyedJaggedTensor(["a", "b", "c"], values, lengths=lengths, weights=weights)
        kjt.keys(), kjt.values(), kjt.lengths(), kjt.weights_or_none(), kjt.offsets(), kjt.stride()
        kjt.to(DEV, non_blocking=True).lengths()
        te.KeyedJaggedTensor(["a", "b", "c"], values, offsets=kjt.offsets(), weights=weights).lengths()

    assert host_reads(step) == []


def test_pinned_moved_and_recorded_on_a_side_stream():
    cpu = host_batch()
    pinned = cpu.pin_memory()
    assert all(t.is_pinned() for t in (pinned.values(), pinned.lengths(), pinned.weights()))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        moved = pinned.to(DEV, non_blocking=True)
    torch.cuda.current_stream().wait_stream(side)
    moved.record_stream(torch.cuda.current_stream())
    assert moved.device().type == "cuda"
    for name in ("values", "lengths", "weights", "offsets"):
        assert torch.equal(getattr(moved, name)().cpu(), getattr(cpu, name)()), name


def test_re_layouts_on_the_device_equal_the_host_ones():
    cpu = host_batch()
    dev = cpu.to(DEV)
    pairs = [(dev.permute([2, 0, 2]), cpu.permute([2, 0, 2])), (dev.split([1, 2])[1], cpu.split([1, 2])[1]),
             (te.KeyedJaggedTensor.from_jt_dict(dev.to_dict()), cpu)]
    for got, want in pairs:
        assert got.keys() == want.keys()
        for name in ("values", "lengths", "weights", "offsets"):
            assert torch.equal(getattr(got, name)().cpu(), getattr(want, name)()), name
    assert torch.equal(dev["b"].to_padded_dense().cpu(), cpu["b"].to_padded_dense())
    kt = te.KeyedTensor(["x", "y"], [2, 3], torch.randn(4, 5, device=DEV))
    kt.record_stream(torch.cuda.current_stream())
    assert torch.equal(te.KeyedTensor.regroup([kt.to("cpu")], [["y", "x"]])[0],
                       te.KeyedTensor.regroup([kt], [["y", "x"]])[0].cpu())
