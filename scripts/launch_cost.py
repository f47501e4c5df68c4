"""Host cost of one launch, by kind: a Triton kernel through ``kernel[grid](...)``, the same compiled
kernel launched directly, through ``FastLaunch`` (``tieredemb.ops.triton.launch``), a small torch op,
and a CUDA graph replay. The numbers say what a step of N launches costs the training thread when the
GPU is not the bound.

    python3 scripts/launch_cost.py [--calls N]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl

from tieredemb.ops.triton.launch import FastLaunch


@triton.jit(do_not_specialize=["n", "step"])
def _touch(a_ptr, b_ptr, c_ptr, d_ptr, n, step, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(a_ptr + offs, mask=m, other=0.0) + tl.load(b_ptr + offs, mask=m, other=0.0)
    if FLAG:
        x = x * scale + step
    tl.store(c_ptr + offs, x, mask=m)
    tl.store(d_ptr + offs, x, mask=m)


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return host


def single_thread(fn, calls: int) -> float:
    with torch.autograd.set_multithreading_enabled(False):
        return per_call_us(fn, calls)


def graph_replay(fn, kernels: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``kernels`` calls of ``fn``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiled before the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(kernels):
            fn()
    return g


def autograd_round_trip(out: torch.Tensor):
    """forward + backward of a custom Function whose forward is one clone."""

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, dummy):
            return out.clone()

        @staticmethod
        def backward(ctx, grad):
            return None

    dummy = torch.zeros(1, device=out.device, requires_grad=True)
    grad = torch.ones_like(out)
    return lambda: Identity.apply(dummy).backward(grad)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=3000)
    calls = p.parse_args().calls
    a, b, c, d = (torch.zeros(1024, device="cuda") for _ in range(4))
    grid = (1,)
    kernel = _touch[grid](a, b, c, d, 1024, 7, 0.5, BLOCK=1024, FLAG=True)
    kernel._init_handles()
    stream = torch.cuda.current_stream().cuda_stream

    def direct_call():  # the compiled kernel's launcher, without JITFunction.run's binding
        kernel.run(1, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                   a, b, c, d, 1024, 7, 0.5, 1024, True)

    fast = FastLaunch(_touch)
    graph = graph_replay(lambda: _touch[grid](a, b, c, d, 1024, 7, 0.5, BLOCK=1024, FLAG=True), 20)
    round_trip = autograd_round_trip(c)
    rows = [
        ("triton kernel[grid](...)",
         per_call_us(lambda: _touch[grid](a, b, c, d, 1024, 7, 0.5, BLOCK=1024, FLAG=True), calls)),
        ("triton compiled kernel.run", per_call_us(direct_call, calls)),
        ("tieredemb FastLaunch kernel[grid](...)",
         per_call_us(lambda: fast[grid](a, b, c, d, 1024, 7, 0.5, BLOCK=1024, FLAG=True), calls)),
        ("torch.add(out=)", per_call_us(lambda: torch.add(a, b, out=c), calls)),
        ("a + b (allocates)", per_call_us(lambda: a + b, calls)),
        ("a.sum()", per_call_us(lambda: a.sum(), calls)),
        ("graph replay (20 kernels)", per_call_us(graph.replay, calls // 10)),
        ("custom Function forward+backward (1 clone)", per_call_us(round_trip, calls // 10)),
        ("  same, autograd multithreading off", single_thread(round_trip, calls // 10)),
    ]
    print(f"torch {torch.__version__} triton {triton.__version__} {torch.cuda.get_device_name()}")
    print(f"{'launch':44s} host us a call")
    for name, us in rows:
        print(f"{name:44s} {us:8.2f}")


if __name__ == "__main__":
    main()
