"""Time the Triton index's insert path on a cache-shaped index: 10 bounded regions (tables) of
``--slots`` slots, full, then batches of absent keys that evict (the cache's steady state), for each
``num_warps`` of the insert kernel. Needs a CUDA device.

    python3 scripts/index_bench.py [--slots 300000] [--keys 45000] [--width 16]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from tieredemb.index.key_index import Region
from tieredemb.ops.triton import TritonKeyIndex
from tieredemb.ops.triton import index as index_module


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slots", type=int, default=300_000)
    p.add_argument("--keys", type=int, default=45_000)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--tables", type=int, default=10)
    args = p.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{args.tables} regions x {args.slots} slots, width {args.width}; {args.keys} absent keys a call")
    print("insert kernel num_warps | find_or_insert ms (CUDA events around the call, median of 20) "
          "| insert kernel ms (profiler, mean)")
    for warps in (1, 2, 4, 8):
        index_module._INSERT_WARPS = warps
        regions = [Region("lru", args.slots) for _ in range(args.tables)]
        index = TritonKeyIndex(args.width, device=dev, regions=regions)
        step = 0

        def batch():
            keys = torch.unique(torch.randint(0, 2**62, (args.keys,), generator=gen, device=dev))
            return keys, torch.randint(0, args.tables, (keys.numel(),), generator=gen, device=dev)

        for _ in range(2 * args.slots * args.tables // args.keys):  # fill
            step += 1
            keys, tables = batch()
            index.find_or_insert(keys, step, tables=tables, given_order=True)
        times = []
        for _ in range(20):
            step += 1
            keys, tables = batch()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            index.find_or_insert(keys, step, tables=tables, given_order=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step += 1
                keys, tables = batch()
                index.find_or_insert(keys, step, tables=tables, given_order=True)
            torch.cuda.synchronize()
        kernel = [e.device_time_total for e in prof.key_averages() if e.key == "_insert_kernel"]
        print(f"{warps:23d} | {times[len(times) // 2]:.3f} | {sum(kernel) / 5e3:.3f}")


if __name__ == "__main__":
    main()
