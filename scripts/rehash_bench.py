"""Host and device time of one rehash (``KeyIndex._grow`` through ``double``) of a Triton index shaped
like the ``hbm`` workload's trained from scratch: ``--tables`` unbounded regions of ``--buckets``
buckets of 32 ways each, filled to ``--load``, one region doubled at a time. Then one doubling under
the torch profiler: the CUDA runtime calls that take the host's time. Needs a CUDA device.

    python3 scripts/rehash_bench.py [--tables 10] [--buckets 32768] [--load 0.45]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tieredemb.index.key_index import Region
from tieredemb.ops.triton import TritonKeyIndex


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tables", type=int, default=10)
    p.add_argument("--buckets", type=int, default=32768)
    p.add_argument("--load", type=float, default=0.45)
    args = p.parse_args()
    dev, width = torch.device("cuda"), 32
    gen = torch.Generator(device="cuda").manual_seed(0)

    def filled() -> TritonKeyIndex:
        regions = [Region("lru", None, args.buckets * width)] * args.tables
        index = TritonKeyIndex(width, device=dev, regions=regions)
        n = int(args.load * args.buckets * width)
        for t in range(args.tables):
            keys = torch.randint(0, 2**62, (n,), device=dev, generator=gen).unique()
            index.find_or_insert(keys, 1, tables=torch.full_like(keys, t))
        torch.cuda.synchronize()
        return index

    print(f"{args.tables} regions x {args.buckets} buckets x {width} ways, load {args.load}; one doubles")
    print("region | host ms | host + device ms")
    for r in (0, args.tables // 2, args.tables - 1):
        index = filled()
        start = time.perf_counter()
        index.double([r])
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        print(f"{r:6d} | {host * 1e3:7.3f} | {(time.perf_counter() - start) * 1e3:7.3f}", flush=True)
    index = filled()
    index.double([0])  # the allocator's first blocks of these sizes
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        index.double([args.tables // 2])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))


if __name__ == "__main__":
    main()
