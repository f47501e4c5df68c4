"""The steps of tables that insert every step, on the ``hbm`` workload's batches, in a plain loop
and under TrainPipeline: bounded ones (``--capacity N``, misses and evictions) or unbounded ones
trained from scratch (``--capacity 0``: first touches, growth). Prints the step time and which
insertion path the steps took: the device insertion of bounded tables (``_inserted``, no read) or the
host one (``KeyIndex.complete``, a read), with the contested pairs.

    python scripts/insertion_profile.py [--capacity 400000] [--init-capacity N] [--scale 1]
                                        [--steps 40] [--optimizer adam] [--profile | --python]

The second half of the steps is timed (--profile: under the torch profiler, with GPU busy time, host
syncs, idle gaps and the top kernels a step; --python: under cProfile, the functions with the most
time of their own and the most time in all).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import time

import torch

import tieredemb as te
from tieredemb.bench.hbm import OPTIMIZERS, UpstreamLoss, upstream_grad
from tieredemb.bench.workloads import HbmBatches, HbmShape
from tieredemb.modules.table import TableGroup


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@contextlib.contextmanager
def profiled(on: bool, steps: int):
    """The block under the torch profiler (``on``), its summary a step printed after it."""
    if not on:
        yield
        return
    from profile_step import gpu_busy_ms, print_summary
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    print(f"GPU busy {gpu_busy_ms(prof.events()) / steps:.3f} ms a step")
    print_summary(prof, steps)


@contextlib.contextmanager
def python_profiled(on: bool):
    """The block under cProfile (``on``), the top functions printed after it."""
    if not on:
        yield
        return
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    yield
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumtime").print_stats(45)


def looper(ebc: te.EmbeddingBagCollection, grad: torch.Tensor, dev: torch.device, pipelined: bool):
    """A function training ``ebc`` on a list of batches: a plain loop, or TrainPipeline's."""
    if not pipelined:
        def loop(part: list) -> None:
            for kjt in part:
                ebc.prefetch(kjt)
                ebc(kjt).values().backward(grad)
        return loop
    model = UpstreamLoss(ebc, grad)
    pipe = te.TrainPipeline(model, torch.optim.SGD([model.unused], lr=0.0), device=dev)

    def loop(part: list) -> None:
        it = iter([{"kjt": kjt} for kjt in part])
        with contextlib.suppress(StopIteration):
            while True:
                pipe.progress(it)
    return loop


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--capacity", type=int, default=400_000, help="max_capacity a table; 0: unbounded")
    p.add_argument("--init-capacity", type=int, default=None, help="init_capacity a table")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--python", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.autograd.set_multithreading_enabled(False)
    shape = HbmShape().scaled(args.scale)
    batches, grad = HbmBatches(shape, dev, 0), upstream_grad(shape, dev, 0)
    paths = collections.Counter()
    placed, inserted = TableGroup._placed, TableGroup._inserted

    def counting_placed(self, *a, **k):
        paths["_placed"] += 1
        info = a[8]
        r = len(self.configs)
        paths["contested pairs"] += sum(info[2 * r : 3 * r])
        paths["steps with contested pairs"] += any(info[2 * r : 3 * r])
        paths["holding at the probe"] += bool(self._holding)
        return placed(self, *a, **k)

    def counting_inserted(self, *a, **k):
        paths["_inserted (device)"] += 1
        return inserted(self, *a, **k)

    TableGroup._placed, TableGroup._inserted = counting_placed, counting_inserted
    for pipelined in (False, True):
        paths.clear()
        configs = [dataclasses.replace(c, max_capacity=args.capacity or None,
                                       init_capacity=args.init_capacity) for c in shape.table_configs()]
        ebc = te.EmbeddingBagCollection(configs, optimizer=OPTIMIZERS[args.optimizer][0](), device=dev)
        todo = [batches.batch(i).kjt for i in range(args.steps)]
        half = args.steps // 2  # the second half timed
        loop = looper(ebc, grad, dev, pipelined)
        loop(todo[:half])
        sync(dev)
        with profiled(args.profile, args.steps - half), python_profiled(args.python):
            t0 = time.perf_counter()
            loop(todo[half:])
            sync(dev)
        ms = (time.perf_counter() - t0) / (args.steps - half) * 1e3
        stats = ebc.stats().values()
        graphs = getattr(ebc._groups[0], "_insert_graphs", None)  # None: eager (or an older package)
        replayed = "" if graphs is None else \
            f"; insertion graphs: {graphs.captures} captured, {graphs.replays} replayed"
        print(f"{'pipelined' if pipelined else 'plain'}: {ms:.3f} ms a step; {dict(paths)}; misses "
              f"{sum(s.misses for s in stats)}, evictions {sum(s.evictions for s in stats)}, "
              f"conflict misses {sum(s.conflict_misses for s in stats)}{replayed}", flush=True)
        del ebc


if __name__ == "__main__":
    main()
