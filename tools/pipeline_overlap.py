"""Does TrainPipeline hide the cache's prefetch behind the dense model? End-to-end step times of a
cache-mode collection under a heavy dense MLP: plain loop vs pipeline (prefetch inline) vs pipeline
with the prefetch thread, against the same model with every row in HBM.

    python3 tools/pipeline_overlap.py [--scale 0.1] [--hidden 8192] [--layers 6] [--steps 15]
                                        [--reserve] [--prefill] [--stages] [--autograd-threads]
                                        [--only LABEL_PART]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import tieredemb as te
from tieredemb.bench.cache import cache_shape
from tieredemb.bench.cache_runs import RankBatches, prefill
from tieredemb.bench.cache_runs import table_configs as cache_table_configs


class Model(nn.Module):
    def __init__(self, ebc: te.EmbeddingBagCollection, width: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.ebc = ebc
        dims = [width] + [hidden] * layers
        self.mlp = nn.Sequential(*[m for a, b in zip(dims, dims[1:]) for m in (nn.Linear(a, b), nn.ReLU())],
                                 nn.Linear(hidden, 1))

    def forward(self, batch: dict) -> torch.Tensor:
        return self.mlp(self.ebc(batch["kjt"]).values()).square().mean()


def run(label: str, ebc: te.EmbeddingBagCollection, batches: list, args, pipelined: bool | None) -> float:
    dev = torch.device("cuda")
    model = Model(ebc, batches[0]["width"], args.hidden, args.layers).to(dev)
    opt = torch.optim.SGD(model.mlp.parameters(), lr=1e-6)
    data = [{"kjt": b["kjt"]} for b in batches]
    warm, timed = data[: args.warmup], data[args.warmup :]
    if pipelined is None:
        def steps(part):
            for b in part:
                loss = model(b)
                loss.backward()
                opt.step()
                opt.zero_grad()
    else:
        pipe = te.TrainPipeline(model, opt, device=dev, prefetch_in_thread=pipelined,
                                autograd_threads=args.autograd_threads)

        def steps(part):
            it = iter(part)
            while True:
                try:
                    pipe.progress(it)
                except StopIteration:
                    return
    steps(warm)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps(timed)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / len(timed) * 1e3
    if args.stages and pipelined:  # after the timing: a replay of the same batches hits more
        stage_profile(label, steps, timed)
    print(f"{label:48s} {ms:9.2f} ms/step", flush=True)
    return ms


def stage_profile(label: str, steps, batches: list) -> None:
    """Host time per labelled stage of the pipelined steps over ``batches`` (the training thread)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        steps(batches)
        torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.cpu_time_total):
        if e.key.startswith("##"):
            print(f"    {label[:24]:24s} {e.key:28s} {e.count / len(batches):5.1f} a step "
                  f"{e.cpu_time_total / 1e3 / len(batches):7.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--reserve", action="store_true", help="page-lock the host store's rows up front")
    p.add_argument("--prefill", action="store_true", help="start with the cache full (as bench cache)")
    p.add_argument("--autograd-threads", action="store_true",
                   help="backward on autograd's device threads (default: the calling thread, "
                        "TrainPipeline's default)")
    p.add_argument("--only", default=None, help="run only the configurations whose label contains this")
    p.add_argument("--stages", action="store_true",
                   help="also profile the pipelined runs: host time per labelled stage")
    args = p.parse_args()
    torch.autograd.set_multithreading_enabled(args.autograd_threads)
    dev = torch.device("cuda")
    shape = cache_shape(args.scale)
    gen = RankBatches(shape, dev, 0)
    width = shape.num_tables * shape.dim
    batches = [{"kjt": gen.batch(i).kjt, "width": width} for i in range(args.warmup + args.steps)]
    configs = cache_table_configs(shape)
    footprint = sum(t.num_embeddings * (t.embedding_dim + 1) * 4 for t in configs)

    def ebc(cached: bool) -> te.EmbeddingBagCollection:
        backing = te.storage.HostMemory(reserve_rows=shape.rows if args.reserve else 0)
        storage = te.StorageConfig(hbm_budget=footprint // 10, backing=backing) if cached else None
        collection = te.EmbeddingBagCollection(configs, optimizer=te.optim.RowWiseAdagrad(lr=0.05),
                                               storage=storage, device=dev)
        if args.prefill:
            prefill(collection, shape, shape.rows // 10, dev, 0)
        return collection

    print(f"{shape.num_tables} tables x {shape.rows} rows, batch {shape.batch_size}, MLP {args.layers} x "
          f"{args.hidden}; {torch.cuda.get_device_name()}")
    runs = {
        "dense model alone (all rows in HBM, plain loop)": (False, None),
        "cache, plain loop": (True, None),
        "cache, pipeline (prefetch inline)": (True, False),
        "cache, pipeline (prefetch thread)": (True, True),
        "all in HBM, pipeline (prefetch thread)": (False, True),
    }
    results = {label: run(label, ebc(cached), batches, args, pipelined)
               for label, (cached, pipelined) in runs.items() if args.only is None or args.only in label}
    dense_only = results.pop(next(iter(runs)), None)
    if dense_only is None:
        return
    print("ratio to the all-in-HBM plain loop:")
    for k, v in results.items():
        print(f"  {k:46s} {v / dense_only:6.2f}x")


if __name__ == "__main__":
    main()
