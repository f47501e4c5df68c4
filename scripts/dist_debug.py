"""Debug aid for the sharded path on GPUs: 2 NCCL ranks train the sharded test's batches and report,
step by step, the largest difference of their outputs from one CPU process on the concatenated batch.

    python3 scripts/dist_debug.py adam [--module EmbeddingBagCollection] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tieredemb as te  # noqa: E402
from tests.distributed import test_sharded as T  # noqa: E402


def worker(rank: int, world: int, port: int, opt: str, module_name: str, steps: int, tmp: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    module = getattr(te, module_name)
    ebc = T.build(module, opt, "hbm_direct", None, dist.group.WORLD, f"cuda:{rank}")
    outs = []
    for step in range(steps):
        kjt, _ = T.local_batch(step, rank)
        out = ebc(kjt)
        outs.append(T.outputs(out))
        T.step_losses(module, out, step, rank).backward()
    torch.cuda.synchronize()
    torch.save({"outs": outs, "step": ebc.step}, f"{tmp}/r{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("opt")
    p.add_argument("--module", default="EmbeddingBagCollection")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--single", action="store_true",
                   help="no sharding: one CUDA process on the concatenated batch vs the CPU")
    args = p.parse_args()
    if args.single:
        return single(args)
    tmp, world = os.environ.get("OUT", "/tmp"), 2
    mp.spawn(worker, args=(world, T._free_port(), args.opt, args.module, args.steps, tmp), nprocs=world)
    res = [torch.load(f"{tmp}/r{r}.pt", weights_only=False) for r in range(world)]
    print("steps taken per rank:", [r["step"] for r in res])
    module = getattr(te, args.module)
    ref = T.build(module, args.opt, "hbm_direct", None)
    for step in range(args.steps):
        local = [T.local_batch(step, r) for r in range(world)]
        out = ref(T.concat([k for k, _ in local]))
        got = [res[r]["outs"][step] for r in range(world)]
        if module is te.EmbeddingBagCollection:
            bounds = torch.cumsum(torch.tensor([0] + [b for _, b in local]), 0).tolist()
            diffs = [float((got[r][0] - out.values()[bounds[r]:bounds[r + 1]].detach()).abs().max())
                     if bounds[r + 1] > bounds[r] else 0.0 for r in range(world)]
            loss = sum((out.values()[bounds[r]:bounds[r + 1]]
                        * T.upstream(step, r, tuple(got[r][0].shape))).sum() for r in range(world))
        else:
            diffs, loss = [], 0
            for i, f in enumerate(T.features()):
                parts = torch.split(out[f].values(), [g[i].shape[0] for g in got])
                diffs.append(max(float((got[r][i] - parts[r].detach()).abs().max()) if parts[r].numel()
                                 else 0.0 for r in range(world)))
                loss = loss + sum((parts[r] * T.upstream(step, r * 10 + i, tuple(parts[r].shape))).sum()
                                  for r in range(world))
        print(f"step {step}: batch sizes {[b for _, b in local]}, max |diff| {[f'{d:.2e}' for d in diffs]}")
        loss.backward()


def single(args) -> None:
    """The same batches, unsharded: one collection on CUDA and one on the CPU, step by step."""
    module = getattr(te, args.module)
    gpu, cpu = (T.build(module, args.opt, "hbm_direct", None, None, d) for d in ("cuda", "cpu"))
    for step in range(args.steps):
        kjt = T.concat([T.local_batch(step, r)[0] for r in range(2)])
        diffs = []
        for ebc in (gpu, cpu):
            out = ebc(kjt)
            T.step_losses(module, out, step, 0).backward()
            diffs.append(T.outputs(out))
        print(f"step {step}: max |cuda - cpu| "
              f"{max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(*diffs)):.2e}")


if __name__ == "__main__":
    main()
