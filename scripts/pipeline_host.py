"""What ``te.TrainPipeline`` costs on the host over the loop it runs: the ``hbm`` workload (every row
stored) trained by the bare deferred loop (forward i, ``prefetch_deferred(i+1)``, backward i) and by
TrainPipeline with and without a dense optimizer, alternating in one process (ms a step, back to
back), then the pipeline's host time by part (wall clocks around its methods, no profiler).

    python3 scripts/pipeline_host.py [--scale S] [--optimizer sgd|adam] [--steps 60] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import tieredemb as te
from tieredemb.bench.hbm import OPTIMIZERS, UpstreamLoss, preinsert_rows, upstream_grad
from tieredemb.bench.workloads import HbmBatches, HbmShape
from tieredemb.pipeline import train_pipeline as tp


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def bare_loop(ebc, grad):
    def run(kjts: list) -> None:
        ebc.prefetch_deferred(kjts[0])
        for kjt, nxt in zip(kjts, [*kjts[1:], None]):
            out = ebc(kjt).values()
            if nxt is not None:
                ebc.prefetch_deferred(nxt)
            out.backward(grad)
    return run


def pipeline_loop(ebc, grad, dev, dense_optimizer: bool):
    model = UpstreamLoss(ebc, grad)
    opt = torch.optim.SGD([model.unused], lr=0.0) if dense_optimizer else None
    pipe = te.TrainPipeline(model, opt, device=dev)

    def run(kjts: list) -> None:
        it = iter([{"kjt": k} for k in kjts])
        with contextlib.suppress(StopIteration):
            while True:
                pipe.progress(it)
    return run


def timed(run, kjts, dev) -> float:
    sync(dev)
    t0 = time.perf_counter()
    run(kjts)
    sync(dev)
    return (time.perf_counter() - t0) / len(kjts) * 1e3


def host_parts(run, kjts, dev) -> dict[str, float]:
    """ms a step of host time in TrainPipeline's methods and the collection's entry points."""
    spent: dict[str, float] = {}
    wrapped = []

    def wrap(owner, name, label):
        fn = getattr(owner, name)

        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
        setattr(owner, name, call)
        wrapped.append((owner, name, fn))

    P = tp.TrainPipeline
    for name in ("progress", "_step", "_wait_for_batch", "_forward", "_start_prefetch", "_backward",
                 "_optimizer_step", "_copy_batch", "_place", "_plan"):
        wrap(P, name, f"pipeline.{name}")
    C = type(run.ebc)
    for name in ("prefetch_deferred", "_finish_deferred", "forward"):
        wrap(C, name, f"collection.{name}")
    wrap(torch.nn.Module, "train", "Module.train")
    try:
        ms = timed(run, kjts, dev)
    finally:
        for owner, name, fn in wrapped:
            setattr(owner, name, fn)
    return {"step (wall)": ms, **{k: v / len(kjts) * 1e3 for k, v in spent.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.autograd.set_multithreading_enabled(False)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = HbmShape().scaled(args.scale)
    ebc = te.EmbeddingBagCollection(shape.table_configs(), optimizer=OPTIMIZERS[args.optimizer][0](),
                                    device=dev)
    preinsert_rows(ebc, shape, dev, 0)
    batches = HbmBatches(shape, dev, 0)
    grad = upstream_grad(shape, dev, 0)
    kjts = [batches.batch(i).kjt for i in range(2 * args.steps)]
    loops = {"bare deferred loop": bare_loop(ebc, grad),
             "TrainPipeline": pipeline_loop(ebc, grad, dev, True),
             "TrainPipeline, no dense optimizer": pipeline_loop(ebc, grad, dev, False)}
    loops["TrainPipeline"].ebc = ebc
    for run in loops.values():  # warm-up: compilations, graph captures
        run(kjts[: args.steps])
    results: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, run in loops.items():
            results[name].append(timed(run, kjts[args.steps :], dev))
    print(f"{args.optimizer}, {len(kjts) - args.steps} steps a run, ms a step back to back:")
    for name, ms in results.items():
        print(f"  {name:36s} median {statistics.median(ms):6.3f}   runs {' '.join(f'{m:.3f}' for m in ms)}")
    print("TrainPipeline's host time by part, ms a step (nested parts inside their callers):")
    for name, ms in host_parts(loops["TrainPipeline"], kjts[args.steps :], dev).items():
        print(f"  {name:36s} {ms:7.3f}")


if __name__ == "__main__":
    main()
