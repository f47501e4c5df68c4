"""Step time of a collection of several table groups (tables of two dims) on the hbm workload's
batch shape (every key stored first): prefetch + forward + backward in a plain loop, and in
TrainPipeline's order (batch i+1's prefetch_deferred between forward i and backward i). Run it
with PYTHONPATH on an older package for a before/after in one call (only one call's runs compare).

    PYTHONPATH=. python3 scripts/groups_bench.py [--dims 64,128] [--steps 40] [--optimizer adam]
                                                 [--capacity N] [--rows N] [--alpha A]
                                                 [--profile] [--python]

--profile: the plain and deferred loops once more under the torch profiler: GPU busy time, host
syncs and the GPU's idle gaps a step (profile_step.py's summaries). --python: both loops under
cProfile (where the host's time goes).
"""

from __future__ import annotations

import argparse
import time

import torch

import tieredemb as te
from tieredemb.bench.workloads import ZipfSampler


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dims", default="64,128", help="table dims, cycled over the tables")
    p.add_argument("--tables", type=int, default=10)
    p.add_argument("--rows", type=int, default=200_000, help="keys a table draws from, all stored first")
    p.add_argument("--capacity", type=int, default=None,
                   help="max_capacity of every table (bounded tables: their prefetch is not staged)")
    p.add_argument("--alpha", type=float, default=None,
                   help="Zipf exponent of the ranks (the hbm workload's law, e.g. 1.05; default u ** -1)")
    p.add_argument("--batch", type=int, default=10_486)
    p.add_argument("--bag", type=int, default=10)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--optimizer", default="adam", choices=["sgd", "adam"])
    p.add_argument("--profile", action="store_true")
    p.add_argument("--python", action="store_true")
    return p.parse_args()


def key(ranks: torch.Tensor) -> torch.Tensor:
    return ranks * 0x9E3779B1 + 12345


def batch_maker(args: argparse.Namespace, dev: torch.device, gen: torch.Generator):
    """A function making the next batch: ids Zipf-like, u ** -1 over the rows (or --alpha's law), hashed."""
    n = args.tables * args.batch * args.bag
    lengths = torch.full((args.tables * args.batch,), args.bag, dtype=torch.int64, device=dev)
    keys = [f"f{i}" for i in range(args.tables)]
    zipf = None if args.alpha is None else ZipfSampler(args.rows, args.alpha, dev)

    def batch() -> te.KeyedJaggedTensor:
        if zipf is not None:
            return te.KeyedJaggedTensor(keys, key(zipf.sample((n,), gen)), lengths)
        u = torch.rand(n, generator=gen, device=dev)
        ranks = (u.pow(-1.0).long() - 1).clamp_(max=args.rows - 1)
        return te.KeyedJaggedTensor(keys, key(ranks), lengths)

    return batch


def main() -> None:
    args = arguments()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.autograd.set_multithreading_enabled(False)
    dims = [int(d) for d in args.dims.split(",")]
    tables = [te.TableConfig(f"t{i}", dims[i % len(dims)], [f"f{i}"], max_capacity=args.capacity)
              for i in range(args.tables)]
    opt = te.optim.Adam(lr=0.01) if args.optimizer == "adam" else te.optim.SGD(lr=0.01)
    ebc = te.EmbeddingBagCollection(tables, optimizer=opt, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    batch = batch_maker(args, dev, gen)
    n = args.tables * args.batch * args.bag
    every = key(torch.arange(args.rows, device=dev))
    for t in tables if args.capacity is None else []:  # every key stored first: steps without misses,
        # as the hbm bench's (bounded tables: the warm steps insert, a write could overflow a bucket)
        ebc.write(t.name, every, torch.zeros(args.rows, t.embedding_dim, device=dev))

    def batches() -> list:  # new ones every loop: a bounded table's misses stay those of a steady state
        return [batch() for _ in range(args.steps)]

    width = sum(t.embedding_dim for t in tables)
    grad = torch.randn(args.batch, width, generator=gen, device=dev)

    def plain(kjts) -> float:
        sync()
        t0 = time.perf_counter()
        for kjt in kjts:
            ebc.prefetch(kjt)
            ebc(kjt).values().backward(grad)
        sync()
        return (time.perf_counter() - t0) / len(kjts) * 1e3

    def deferred(kjts) -> float:
        sync()
        t0 = time.perf_counter()
        ebc.prefetch_deferred(kjts[0])
        for i, kjt in enumerate(kjts):
            out = ebc(kjt).values()
            if i + 1 < len(kjts):
                ebc.prefetch_deferred(kjts[i + 1])
            out.backward(grad)
        sync()
        return (time.perf_counter() - t0) / len(kjts) * 1e3

    plain(batches())  # warm: most keys inserted, each loop's CUDA graphs captured
    deferred(batches())
    s = args.steps
    rows = []
    for name, loop in (("plain", plain), ("deferred", deferred)):
        before = ebc.stats()["t0"]
        rows.append((name, loop(batches()), before, ebc.stats()["t0"]))
    print(f"groups {len(ebc._groups)} (dims {args.dims}), {args.tables} tables, {n} ids a step, "
          f"{args.optimizer}")
    counters = {"unique": "unique_lookups", "misses": "misses", "evictions": "evictions",
                "conflicts": "conflict_misses"}
    for name, ms, a, b in rows:
        per_step = ", ".join(f"{(getattr(b, f) - getattr(a, f)) / s:.0f} {c}" for c, f in counters.items())
        print(f"groups_bench {name:10s} {ms:8.3f} ms/step   t0 a step: {per_step}")
    profiles(args, plain, deferred, batches)


def profiles(args: argparse.Namespace, plain, deferred, batches) -> None:
    """--profile and --python: the loops again (on new batches), under the torch profiler or cProfile."""
    if args.profile:
        for name, loop in (("plain", plain), ("deferred", deferred)):
            profiled(name, loop, batches())
    if args.python:
        for name, loop in (("plain", plain), ("deferred", deferred)):
            python_profile(name, loop, batches())


def python_profile(name: str, loop, kjts) -> None:
    """``loop`` over ``kjts`` under cProfile: where the host's time goes."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    ms = loop(kjts)
    prof.disable()
    print(f"{name}: {ms:.3f} ms a step under cProfile")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumtime").print_stats(40)


def profiled(name: str, loop, kjts) -> None:
    """``loop`` over ``kjts`` under the torch profiler: wall and GPU busy time, host syncs, idle gaps."""
    from profile_step import gpu_busy_ms, print_summary
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms = loop(kjts)
    steps = len(kjts)
    print(f"{name}: {ms:.3f} ms a step under the profiler, GPU busy {gpu_busy_ms(prof.events()) / steps:.3f}")
    print_summary(prof, steps)


if __name__ == "__main__":
    main()
