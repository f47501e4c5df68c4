"""Host time of TritonKeyIndex.insert_rows (scripts/host_time.py's finer view): ten bounded regions
of 400k slots, 33k distinct pairs a region a step of which 10k miss (the bounded groups_bench's
steady state); the call's median host time, then the torch ops' self CPU time under the profiler.

    PYTHONPATH=. python3 scripts/insert_rows_host.py [--steps 40]
"""

from __future__ import annotations

import argparse
import time

import torch

from tieredemb.index import Region
from tieredemb.ops.triton import TritonKeyIndex


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    dev = torch.device("cuda")
    regions, per_region, misses_per_region = 10, 33_000, 10_000
    index = TritonKeyIndex(16, device=dev, regions=[Region("lru", 400_000, 4096)] * regions)
    gen = torch.Generator(device=dev).manual_seed(0)
    total = []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    for step in range(1, args.steps + 1):
        if step == args.steps - 9:
            profiler.start()
        keys = torch.randint(0, 2**62, (regions * per_region,), device=dev, generator=gen)
        tables = torch.arange(regions, device=dev).repeat_interleave(per_region)
        counts = torch.ones_like(keys)
        slots, values, _ = index.find_touch(keys, tables, step, counts)
        # all but misses_per_region of each region's pairs stand for found keys (slot -2: left out)
        slots = torch.where((torch.arange(keys.numel(), device=dev) % per_region) < misses_per_region,
                            -1, -2)
        misses = regions * misses_per_region
        pool = torch.arange(misses, device=dev) + step * misses
        torch.cuda.synchronize()
        start = time.perf_counter()
        index.insert_rows(keys, tables, counts, slots, values, misses, step, pool)
        total.append(time.perf_counter() - start)
        torch.cuda.synchronize()
        index.unlock_slots(slots[slots >= 0], index.generation)
    profiler.stop()
    runs = sorted(total[5:-10])
    print(f"insert_rows: median {1e3 * runs[len(runs) // 2]:.3f} ms of host a call (without the profiler)")
    print("under the profiler, the last 10 steps (find_touch and the unlock included), self CPU time:")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
