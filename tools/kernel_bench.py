"""Time the kernels of one ``hbm`` step on the inputs of a real step.

Builds the ``hbm`` workload (every row stored), runs a few steps and keeps the arguments of the step's
``gather_pool``, ``reduce_update`` and the dedup's sort; then times each call alone (CUDA events,
median of ``--repeats``, the queue drained before each), and the whole step (drained median and back
to back). ``--profile``: each kernel's GPU time inside the step (torch profiler); ``--table-order``:
the reduction again with the keys renumbered table by table (what L2 locality of the bag gradients
is worth); ``--overlap ORDER``: the whole step back to back with the next batch's prefetch in another
order (``Overlapped``; ``deferred`` is TrainPipeline's inline prefetch).

    python3 tools/kernel_bench.py [--scale S] [--optimizer sgd|adam] [--table-order] [--profile]
                                    [--set NAME=INT ...] [--overlap forward|backward|deferred|deferred-side]

Run it with PYTHONPATH on an older package (``git archive REV tieredemb``) for a before/after;
``--set NAME=INT`` sets a tuning constant of ``tieredemb.ops.triton.embedding`` first (``index.NAME=INT``:
of ``tieredemb.ops.triton.index``); ``--find TILE:WARPS,...`` times the index's ``find_touch`` on the
step's keys with each ``_FIND_TILE`` and ``_FIND_WARPS`` (the kernel's GPU time, torch profiler).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from profile_step import Overlapped, print_top_gpu  # tools/: the directory of this script

import tieredemb as te
import tieredemb.ops.triton.embedding as E
import tieredemb.ops.triton.index as I
from tieredemb.bench.hbm import OPTIMIZERS, preinsert_rows, synchronize, time_ms, upstream_grad
from tieredemb.bench.workloads import HbmBatches, HbmShape

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run on the interpreter


def timed(fn, repeats: int) -> float:
    """Median ms of ``repeats`` calls, each with the queue drained before and after."""
    return statistics.median(time_ms(fn, DEVICE) for _ in range(repeats))


def kernel_ms(fn, repeats: int, kernel: str) -> float:
    """Median GPU time (ms) of the kernel named ``kernel`` over ``repeats`` calls of ``fn`` (torch
    profiler): the kernel alone, whatever its launch costs the host."""
    if DEVICE.type != "cuda":
        return timed(fn, repeats)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        sync()
    times = [e.device_time for e in prof.events() if e.name == kernel]
    return statistics.median(times) / 1e3


def sync() -> None:
    synchronize(DEVICE)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile", action="store_true", help="GPU time of each kernel in 10 steps")
    p.add_argument("--set", action="append", default=[], metavar="NAME=INT",
                   help="a constant of tieredemb.ops.triton.embedding (index.NAME: of ...index), set "
                        "before anything runs")
    p.add_argument("--find", default=None, metavar="TILE:WARPS,...",
                   help="time find_touch on the step's keys with each _FIND_TILE and _FIND_WARPS")
    p.add_argument("--no-early-lookup", action="store_true",
                   help="the forward looks its rows up itself, not the prefetch right after its read")
    p.add_argument("--overlap", choices=["forward", "backward", "deferred", "deferred-side"], default=None,
                   help="each step prefetches the next batch on a high-priority side stream right after "
                        "its forward or its backward (waiting only for its forward); deferred: "
                        "prefetch_deferred between forward and backward, on the one stream; "
                        "deferred-side: the same on the side stream")
    p.add_argument("--table-order", action="store_true",
                   help="also reduce with the keys renumbered table by table (bag gradients of one "
                        "table at a time: what L2 locality is worth)")
    return p.parse_args()


def set_constants(assignments: list[str]) -> None:
    """NAME=INT: a constant of tieredemb.ops.triton.embedding; index.NAME=INT: of ...index."""
    for assignment in assignments:
        name, value = assignment.split("=")
        module, name = (I, name[len("index."):]) if name.startswith("index.") else (E, name)
        setattr(module, name, int(value))


def main() -> None:
    args = parse_args()
    set_constants(args.set)
    torch.autograd.set_multithreading_enabled(False)
    dev = DEVICE
    shape = HbmShape().scaled(args.scale)
    ebc = te.EmbeddingBagCollection(shape.table_configs(), optimizer=OPTIMIZERS[args.optimizer][0](),
                                    device=dev, kernels="triton")
    ebc._early_lookup = not args.no_early_lookup
    preinsert_rows(ebc, shape, dev, 0)
    batches = HbmBatches(shape, dev, 0)
    grad = upstream_grad(shape, dev, 0)
    kernels = ebc.kernels
    captured = capture(kernels, ("gather_pool", "reduce_update", "id_order", "sorted_runs_padded"))
    index = ebc.tiers[0].index
    found = capture(index, ("find_touch",))
    kjts = [batches.batch(i).kjt for i in range(args.steps * 2 + 5)]

    def step(kjt):
        ebc.prefetch(kjt)
        ebc(kjt).values().backward(grad)

    for kjt in kjts[:5]:
        step(kjt)
    sync()
    call = captured["reduce_update"]
    print(f"hbm scale {args.scale}, {args.optimizer}, kernels {kernels.name}; "
          f"n = {call[0][3].numel()}, u = {call[0][4]}")

    def whole_step() -> tuple[float, float]:
        if args.overlap:
            overlapped_steps(ebc, grad, kjts[5 : 5 + args.steps], args.overlap)  # warm: the side's graphs
            return float("nan"), overlapped_steps(ebc, grad, kjts[5 + args.steps : 5 + 2 * args.steps],
                                                  args.overlap)
        drained = statistics.median(timed(lambda k=k: step(k), 1) for k in kjts[5 : 5 + args.steps])
        sync()
        t0 = time.perf_counter()
        for kjt in kjts[5 + args.steps : 5 + 2 * args.steps]:
            step(kjt)
        sync()
        return drained, (time.perf_counter() - t0) / args.steps * 1e3

    rows = [("step", "", *whole_step())]
    a, k = captured["gather_pool"]
    rows.append(("gather_pool", "", timed(lambda: kernels.gather_pool(*a, **k), args.repeats), None))
    a, k = call
    rows.append(("reduce_update", "", timed(lambda: kernels.reduce_update(*a, **k), args.repeats),
                 timed(lambda: kernels.reduce_grads(*a[:6]), args.repeats)))
    if args.table_order:
        rows.extend(table_order_rows(kernels, call, shape.num_tables, args.repeats))
    if args.profile:
        profile(step, kjts[5:15])
    if args.find:
        rows.extend(find_rows(index, found["find_touch"], args.find, args.repeats))
    a, k = captured["sorted_runs_padded"]
    ids = a[0][torch.randperm(a[0].numel(), device=dev)]
    rows.append(("sort (int64 keys, stable)", "", timed(lambda: torch.sort(ids, stable=True), args.repeats),
                 None))
    if "id_order" in captured:
        a2, k2 = captured["id_order"]
        rows.append(("id_order (int32 hashes)", "", timed(lambda: kernels.id_order(*a2, **k2), args.repeats),
                     None))
    rows.append(("sorted_runs_padded", "", timed(lambda: kernels.sorted_runs_padded(*a, **k), args.repeats),
                 None))
    print(f"{'what':28s} {'variant':14s} {'ms':>8s} {'ms (2)':>8s}")
    for what, variant, t1, t2 in rows:
        second = f"{t2:8.3f}" if t2 is not None else ""
        print(f"{what:28s} {variant:14s} {t1:8.3f} {second}")
    print("(step: drained median, back-to-back mean; reduce_update, then reduce_grads alone)")


def overlapped_steps(ebc, grad, kjts, after: str) -> float:
    """Mean ms a step of ``Overlapped`` steps over ``kjts``, back to back."""
    run = Overlapped(ebc, grad, kjts[0], after, DEVICE)
    sync()
    t0 = time.perf_counter()
    for kjt, next_kjt in zip(kjts, [*kjts[1:], None]):
        run.step(kjt, next_kjt)
    sync()
    return (time.perf_counter() - t0) / len(kjts) * 1e3


def capture(kernels, names) -> dict[str, tuple]:
    """Wrap the kernel set's methods ``names``: each call's (args, kwargs) kept, the last one wins."""
    captured: dict[str, tuple] = {}

    def wrap(name, fn):
        def wrapper(*a, **k):
            captured[name] = (a, k)
            return fn(*a, **k)

        return wrapper

    for name in names:
        if hasattr(kernels, name):  # (an older package may lack one)
            setattr(kernels, name, wrap(name, getattr(kernels, name)))
    return captured


def find_rows(index, call: tuple, combos: str, repeats: int) -> list[tuple]:
    """``find_touch`` on the step's keys (touching them again changes nothing but their scores) with
    each TILE:WARPS of ``combos``, then the module's values back. The kernel's GPU time."""
    a, k = call
    rows = []
    saved = I._FIND_TILE, I._FIND_WARPS
    for combo in combos.split(","):
        I._FIND_TILE, I._FIND_WARPS = map(int, combo.split(":"))
        index.find_touch(*a, **k)  # compiled
        rows.append(("find_touch", combo, kernel_ms(lambda: index.find_touch(*a, **k), repeats,
                                                          "_find_touch_kernel"), None))
    I._FIND_TILE, I._FIND_WARPS = saved
    return rows


def table_order_rows(kernels, call, num_tables: int, repeats: int) -> list[tuple]:
    """reduce_grads / reduce_update timed on the same ids with the keys renumbered so that the keys of
    one table come first (each id's table: its bag row modulo the tables, a sample-major batch)."""
    from tieredemb.storage.tiers.parts import IdOrder

    a, k = call
    grad_src, src_of_id, scale, inverse, u, sorted_ids = a[:6]
    addresses = a[7]
    table_of_key = torch.empty(u, dtype=torch.int64, device=inverse.device)
    table_of_key[inverse] = src_of_id % num_tables
    perm = torch.argsort(table_of_key, stable=True)  # new key j = old key perm[j]
    rank = torch.empty_like(perm)
    rank[perm] = torch.arange(u, device=perm.device)
    new_inverse = rank[inverse]
    order = IdOrder(torch.argsort(new_inverse, stable=True), sorted_ids.entries[perm])
    new_a = (grad_src, src_of_id, scale, new_inverse, u, order, a[6], addresses[perm].contiguous(), *a[8:])
    return [("reduce_update, table order", "", timed(lambda: kernels.reduce_update(*new_a, **k), repeats),
             timed(lambda: kernels.reduce_grads(*new_a[:6]), repeats))]


def profile(step, kjts) -> None:
    """GPU time of each kernel per step over ``kjts``, from the torch profiler."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for kjt in kjts:
            step(kjt)
        sync()
    print_top_gpu(prof.key_averages(), len(kjts), "GPU time per step (ms), in-step:", top=14)


if __name__ == "__main__":
    main()
