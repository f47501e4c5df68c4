"""Launches and host time of the torch operations the cache's bookkeeping is made of, on 45k
elements (a cache step's misses): argsort by dtype, compaction, indexing. Needs a CUDA device.

    python3 scripts/sort_cost.py
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cudaMemsetAsync", "cudaMemcpyAsync")


def main(n: int = 45_000, repeats: int = 200) -> None:
    dev = torch.device("cuda")
    wide = torch.randint(0, 2**40, (n,), device=dev)
    small = torch.randint(0, 2**26, (n,), device=dev)
    narrow = small.to(torch.int32)
    cases = {
        "argsort int64 stable": lambda: torch.argsort(wide, stable=True),
        "argsort int64 (< 2^26) stable": lambda: torch.argsort(small, stable=True),
        "argsort int32 stable": lambda: torch.argsort(narrow, stable=True),
        "argsort int32": lambda: torch.argsort(narrow),
        "nonzero_static": lambda: torch.nonzero_static(narrow > 2**25, size=100),
        "boolean index": lambda: wide[narrow > 2**25],
        "index": lambda: wide[small % n],
        "cumsum": lambda: torch.cumsum(narrow, 0),
    }
    print(f"{'operation':32s} launches  host us  wall us  ({n} elements)")
    for name, fn in cases.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        launches = sum(1 for e in prof.events() if e.name in LAUNCHES)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        host = (time.perf_counter() - t0) / repeats * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / repeats * 1e6
        print(f"{name:32s} {launches:8d} {host:8.1f} {wall:8.1f}")


if __name__ == "__main__":
    main()
