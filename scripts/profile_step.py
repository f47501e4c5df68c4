"""Profile steady-state steps of the ``hbm`` workload: where the training thread spends its time and
how many host syncs a step makes. Writes the full table to $OUT/profile.txt; prints a summary.

    python3 scripts/profile_step.py [--scale S] [--optimizer adam|sgd] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

import tieredemb as te
from tieredemb.bench.hbm import OPTIMIZERS, preinsert_rows, upstream_grad
from tieredemb.bench.workloads import HbmBatches, HbmShape

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::item",
               "aten::_local_scalar_dense", "aten::nonzero", "aten::unique", "aten::_unique2")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    dev = torch.device("cuda")
    shape = HbmShape().scaled(args.scale)
    ebc = te.EmbeddingBagCollection(shape.table_configs(), optimizer=OPTIMIZERS[args.optimizer][0](),
                                    device=dev)
    t0 = time.perf_counter()
    preinsert_rows(ebc, shape, dev, 0)
    torch.cuda.synchronize()
    print(f"preinsert {shape.num_tables} x {shape.rows} rows: {time.perf_counter() - t0:.1f} s")
    batches = HbmBatches(shape, dev, 0)
    grad = upstream_grad(shape, dev, 0)

    def step(i: int) -> None:
        kjt = batches.batch(i).kjt
        ebc.prefetch(kjt)
        ebc(kjt).values().backward(grad)

    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(3, 3 + args.steps):
            step(i)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
    avg = prof.key_averages()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "profile.txt"), "w") as f:
        f.write(avg.table(sort_by="self_cpu_time_total", row_limit=60))
        f.write("\n\n")
        f.write(avg.table(sort_by="self_cuda_time_total", row_limit=40))
    print(f"{args.optimizer}: {wall:.2f} ms a step (wall, {args.steps} steps under the profiler)")
    print("per step:  event | count | self CPU ms")
    for e in avg:
        if e.key in SYNC_EVENTS:
            ms = e.self_cpu_time_total / 1e3 / args.steps
            print(f"  {e.key:32s} {e.count / args.steps:8.1f} {ms:8.2f}")
    top = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:12]
    print("top self-CPU ops per step (ms):")
    for e in top:
        ms = e.self_cpu_time_total / 1e3 / args.steps
        print(f"  {e.key[:48]:48s} {e.count / args.steps:8.1f} {ms:8.2f}")


if __name__ == "__main__":
    main()
