"""``tieredemb bench dist``: weak scaling of the ``hbm`` or ``cache`` workload, row-wise sharded over
1, 2, 4 ... GPUs.

Every rank trains its own batch of the workload's size (a fixed per-GPU batch) on tables sharded over
all ranks (NCCL); the tables keep their size, so each GPU holds 1/N of the rows. Reported per world
size: the step time (the slowest rank's median), lookups per second per GPU, and the per-GPU
throughput as a fraction of the one-GPU run (the issue's bar: at least 85% at 4 GPUs).

``--workload cache``: the ``cache`` workload's tables (10 x 10M rows at scale 1, RowWiseAdagrad, ids =
Zipf ranks) in cache mode over host memory, each rank's device cache 10% of its shard's footprint and
its host store reserved for its shard; no prefill (the warmup steps fill the caches), the same at every
world size.

    tieredemb bench dist [--workload hbm|cache] [--gpus 1,2,4] [--scale S] [--steps N] [--warmup N]
                         [--optimizer adam] [--alpha 1.05,1.2] [--pipeline] [--replicate-hot N] [--out DIR]

At one GPU the same batches are also run through the collection with no process group (what sharding
itself costs). Each step's parts are timed apart (prefetch, forward, backward); ``--pipeline`` times
each collection under ``te.TrainPipeline`` too.

``--replicate-hot N``: each run again with the N hottest keys of every table (the Zipf ranks 0..N-1)
replicated on every rank (``te.HotRows(keys=...)``), so the load columns show what replication takes
off the busiest rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

import tieredemb as te
from tieredemb.bench.cache_runs import RankBatches
from tieredemb.bench.cache_runs import table_configs as cache_tables
from tieredemb.bench.hbm import OPTIMIZERS, UpstreamLoss, upstream_grad
from tieredemb.bench.report import machine_info, report_path, write_report
from tieredemb.bench.timing import free_memory, synchronize, time_ms
from tieredemb.bench.workloads import HbmBatches, HbmShape, scramble

CACHE_FRACTION = 0.1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _preinsert(ebc: te.EmbeddingBagCollection, shape: HbmShape, rank: int, world: int, seed: int) -> None:
    """Every key of every table stored with its initial row (a steady state): rank r writes an r-th
    of them, the collective ``write`` routes each to its owner."""
    chunk = 1 << 18
    for t, config in enumerate(shape.table_configs()):
        for lo in range(0, shape.rows, chunk * world):
            mine = min(lo + rank * chunk, shape.rows)  # past the end: an empty share (still a collective)
            ranks = torch.arange(mine, min(mine + chunk, shape.rows), device=ebc.device)
            keys = scramble(ranks, t)
            ebc.write(config.name, keys, config.initializer.rows(seed, config.name, keys, shape.dim))


@dataclass(frozen=True)
class DistOptions:
    """What every rank of every run is given. ``replicate_hot``: that many hottest keys a table
    replicated on every rank (0: none); ``pipeline``: each collection also under ``TrainPipeline``."""

    workload: str
    shape: HbmShape
    optimizer: str
    steps: int
    warmup: int
    seed: int
    cuda: bool
    pipeline: bool = False
    replicate_hot: int = 0


def _hot(workload: str, configs: list[te.TableConfig], n: int) -> te.HotRows | None:
    """The n hottest keys of every table replicated (their Zipf ranks 0..n-1), or None (n = 0)."""
    if not n:
        return None
    ranks = torch.arange(n)
    return te.HotRows(keys={c.name: ranks if workload == "cache" else scramble(ranks, t)
                            for t, c in enumerate(configs)})


def _build(opts: DistOptions, dev: torch.device, rank: int, world: int, sharded: bool = True):
    """(collection, batches) of one rank; ``sharded=False``: the same collection with no process
    group (the world-size-1 baseline)."""
    shape, seed = opts.shape, opts.seed
    group = dist.group.WORLD if sharded else None
    if opts.workload == "cache":
        budget = CACHE_FRACTION * shape.num_tables * shape.rows * (shape.dim + 1) * 4 / world
        # each rank's host store page-locked up front for its shard (+5% for imbalance): growing it
        # while training stalls a rank (docs/backends.md), and the slowest rank sets the step
        backing = te.storage.HostMemory(reserve_rows=int(shape.rows / world * 1.05))
        storage = te.StorageConfig(hbm_budget=int(budget), backing=backing,
                                   replicate_hot=_hot(opts.workload, cache_tables(shape), opts.replicate_hot))
        ebc = te.EmbeddingBagCollection(cache_tables(shape), optimizer=te.optim.RowWiseAdagrad(lr=0.05),
                                        storage=storage, device=dev, seed=seed, process_group=group)
        return ebc, RankBatches(shape, dev, seed=seed + 1 + rank)
    storage = te.StorageConfig(replicate_hot=_hot(opts.workload, shape.table_configs(), opts.replicate_hot))
    ebc = te.EmbeddingBagCollection(shape.table_configs(), optimizer=OPTIMIZERS[opts.optimizer][0](),
                                    storage=storage, device=dev, seed=seed, process_group=group)
    _preinsert(ebc, shape, rank, world, seed)
    return ebc, HbmBatches(shape, dev, seed=seed + 1 + rank)  # each rank its own batches


PARTS = ("prefetch", "forward", "backward")
"""The parts of a step timed apart: prefetch = input dist (ids to owners) + the owners' resolution;
forward = the owners' gather + output dist (rows back) + pooling; backward = gradient dist + the
owners' fused update."""


@dataclass
class RankTimes:
    """One collection's figures on one rank: the plain step's median, each part's median, and the
    mean step under ``te.TrainPipeline`` (None when not run)."""

    median_ms: float
    times_ms: list[float]
    parts_ms: dict[str, float]
    pipelined_ms: float | None = None


def _time_collection(ebc, batches, grad, dev: torch.device, opts: DistOptions, sync) -> RankTimes:
    """Plain steps (prefetch, forward, backward), then the same number with each part timed apart,
    then (``pipeline``) as many under ``te.TrainPipeline``; each on batches of its own."""
    steps, warmup = opts.steps, opts.warmup

    def step(batch) -> None:
        ebc.prefetch(batch.kjt)
        ebc(batch.kjt).values().backward(grad)

    times = []
    for i in range(warmup + steps):
        batch = batches.batch(i)
        sync()
        ms = time_ms(lambda b=batch: step(b), dev)
        if i >= warmup:
            times.append(ms)
    parts: dict[str, list[float]] = {name: [] for name in PARTS}
    for i in range(warmup + steps, warmup + 2 * steps):
        for name, fn in zip(PARTS, _step_parts(ebc, batches.batch(i).kjt, grad)):
            sync()
            parts[name].append(time_ms(fn, dev))
    result = RankTimes(statistics.median(times), times, {k: statistics.median(v) for k, v in parts.items()})
    if opts.pipeline:
        result.pipelined_ms = _pipelined_ms(ebc, batches, grad, dev, warmup + 2 * steps, steps, warmup, sync)
    return result


def _step_parts(ebc, kjt, grad) -> list:
    """The calls of one step, in order: prefetch, forward, backward."""
    out = []
    return [lambda: ebc.prefetch(kjt), lambda: out.append(ebc(kjt).values()), lambda: out[0].backward(grad)]


def _pipelined_ms(ebc, batches, grad, dev: torch.device, first: int, steps: int, warmup: int, sync) -> float:
    """The mean step of ``te.TrainPipeline`` (the next batch's input dist and prefetch beside this
    step's compute) over ``steps`` batches after ``warmup`` untimed ones."""
    model = UpstreamLoss(ebc, grad)
    pipe = te.TrainPipeline(model, torch.optim.SGD([model.unused], lr=0.0), device=dev)

    data = [{"kjt": batches.batch(i).kjt} for i in range(first, first + warmup + steps)]  # made untimed

    def train(part: list[dict]) -> None:
        it = iter(part)
        with contextlib.suppress(StopIteration):
            while True:
                pipe.progress(it)

    train(data[:warmup])
    sync()
    synchronize(dev)
    t0 = time.perf_counter()
    train(data[warmup:])
    synchronize(dev)
    return (time.perf_counter() - t0) / steps * 1e3


LOAD_FIELDS = ("lookups", "keys_received", "unique_lookups", "rows")
"""The per-rank load reported: ids served, pairs received (rows sent back, gradients received),
distinct keys resolved, rows held; all tables, every step (warmup included)."""


def rank_loads(everyone: list[dict]) -> dict[str, list[int]]:
    """``stats(all_ranks=True)`` summed over the tables: field -> one value per rank."""
    def total(stats: dict, name: str) -> int:
        return sum(sum(s.rows.values()) if name == "rows" else getattr(s, name) for s in stats.values())

    return {name: [total(stats, name) for stats in everyone] for name in LOAD_FIELDS}


def imbalance(values: list[int]) -> float | None:
    """The busiest rank's value over the mean (1.0: balanced); None when all are 0."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean else None


def _rank(rank: int, world: int, port: int, opts: DistOptions, out: str) -> None:
    # the host's cores shared out (cache mode does host work): N ranks with a thread per core each
    # oversubscribe the CPU (torchrun sets OMP_NUM_THREADS=1 for the same reason)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if opts.cuda:
        torch.cuda.set_device(rank)
    dev = torch.device(f"cuda:{rank}" if opts.cuda else "cpu")
    dist.init_process_group("nccl" if opts.cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        grad = upstream_grad(opts.shape, dev, opts.seed)
        report: dict = {}
        if world == 1 and not opts.replicate_hot:  # the same batches, no process group: sharding's cost
            ebc, batches = _build(opts, dev, rank, world, sharded=False)
            report["unsharded"] = dataclasses.asdict(_time_collection(ebc, batches, grad, dev, opts,
                                                                      lambda: None))
            del ebc, batches
            free_memory(dev)
        ebc, batches = _build(opts, dev, rank, world)
        report.update(dataclasses.asdict(_time_collection(ebc, batches, grad, dev, opts, dist.barrier)))
        stats = ebc.stats().values()
        hits, unique = sum(s.hits for s in stats), sum(s.unique_lookups for s in stats)
        report["rows"] = sum(s.rows["device"] for s in stats)
        report["hit_rate"] = hits / unique if unique else None
        report["load"] = rank_loads(ebc.stats(all_ranks=True))  # a collective: every rank's
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


def run(gpus: list[int], shape: HbmShape, optimizer: str, steps: int, warmup: int, seed: int,
        out_dir: str, argv: list[str], workload: str = "hbm", device: str = "cuda",
        scale: float | None = None, alphas: list[float] | None = None, pipeline: bool = False,
        replicate_hot: int = 0) -> int:
    """``gpus``: world sizes; on ``device="cpu"`` they are gloo processes (a smoke run: the figures
    that mean something are NCCL's). ``scale``: the one the shape was scaled by, for the report.
    ``alphas``: Zipf exponents of the ids, each run at every world size (default: the shape's).
    ``pipeline``: each collection also under ``te.TrainPipeline``. ``replicate_hot``: where > 0, each
    run again with that many hottest keys a table replicated."""
    import torch.multiprocessing as mp

    cuda = device == "cuda"
    unit, units = ("GPU", "GPUs") if cuda else ("process", "processes")
    available = torch.cuda.device_count() if cuda else os.cpu_count() or 1
    if not gpus or max(gpus) > available:
        raise ValueError(f"--gpus {','.join(map(str, gpus))}: asked for up to {max(gpus, default=0)} "
                         f"{units}, there are {available}")
    started = datetime.now()
    results = []
    for alpha in alphas or [shape.alpha]:
        zipf = dataclasses.replace(shape, alpha=alpha)
        for world in gpus:
            for hot in [0, replicate_hot] if replicate_hot else [0]:
                opts = DistOptions(workload, zipf, optimizer, steps, warmup, seed, cuda, pipeline, hot)
                with tempfile.TemporaryDirectory() as tmp:
                    mp.spawn(_rank, args=(world, _free_port(), opts, tmp), nprocs=world, join=True)
                    ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
                results.append(_result(world, alpha, zipf, ranks) | {"replicate_hot": hot})
                print(_rank_lines(results[-1], units), flush=True)
    table = _table(results, shape, workload, optimizer, steps, unit, units)
    print(table)
    path = report_path(out_dir, "dist", started)
    write_report(path, {"machine": machine_info(torch.device(device)), "argv": argv,
                        "date": started.isoformat(timespec="seconds"), "scale": scale,
                        "workload": workload, "shape": dataclasses.asdict(shape), "optimizer": optimizer,
                        "pipeline": pipeline, "results": results},
                 table)
    print(f"report: {path}")
    return 0


OVERHEAD_TARGET = 1.2  # the sharded step at one GPU over the unsharded one, at most
SCALING_TARGET = 0.9  # per-GPU throughput at 2 and 4 GPUs over one GPU's, at least


def _slowest(ranks: list[dict], key: str) -> float | None:
    values = [r[key] for r in ranks]
    return None if None in values else max(values)


def _result(world: int, alpha: float, shape: HbmShape, ranks: list[dict]) -> dict:
    step_ms = max(r["median_ms"] for r in ranks)
    load = ranks[0]["load"]
    out = {"gpus": world, "alpha": alpha, "step_ms": step_ms,
           "rank_median_ms": [r["median_ms"] for r in ranks],
           "parts_ms": {name: max(r["parts_ms"][name] for r in ranks) for name in PARTS},
           "pipelined_ms": _slowest(ranks, "pipelined_ms"),
           "rows_per_rank": [r["rows"] for r in ranks], "hit_rate_per_rank": [r["hit_rate"] for r in ranks],
           "lookups_per_s_per_gpu": shape.lookups / (step_ms / 1e3), "load_per_rank": load,
           "load_imbalance": {name: imbalance(load[name]) for name in LOAD_FIELDS}}
    if "unsharded" in ranks[0]:
        out["unsharded"] = {k: ranks[0]["unsharded"][k] for k in ("median_ms", "parts_ms", "pipelined_ms")}
    return out


def _rank_lines(r: dict, units: str) -> str:
    load = r["load_per_rank"]
    parts = "/".join(f"{r['parts_ms'][name]:.3f}" for name in PARTS)
    hot = f", {r['replicate_hot']} hot keys a table replicated" if r["replicate_hot"] else ""
    lines = [f"{r['gpus']} {units}, alpha {r['alpha']}{hot}: step {r['step_ms']:.3f} ms (ranks "
             f"{[round(x, 3) for x in r['rank_median_ms']]}), prefetch/fwd/bwd {parts}, TrainPipeline "
             f"{_ms(r['pipelined_ms'])}, device rows per rank {r['rows_per_rank']}, hit rates "
             f"{[None if h is None else round(h, 3) for h in r['hit_rate_per_rank']]}"]
    if "unsharded" in r:
        u = r["unsharded"]
        parts = "/".join(f"{u['parts_ms'][name]:.3f}" for name in PARTS)
        lines.append(f"  unsharded: step {u['median_ms']:.3f} ms, prefetch/fwd/bwd {parts}, TrainPipeline "
                     f"{_ms(u['pipelined_ms'])}")
    return "\n".join(lines + [f"  {name:<15} per rank {load[name]}" for name in LOAD_FIELDS])


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _table(results: list[dict], shape: HbmShape, workload: str, optimizer: str, steps: int, unit: str,
           units: str) -> str:
    """One line per (alpha, world size, replication); throughput against the first world size at that
    alpha and replication; then the unsharded baseline and the targets."""
    what = optimizer if workload == "hbm" else "rowwise_adagrad, cache of 10% of each shard"
    lines = [f"dist: {workload} workload {shape.num_tables} tables x {shape.rows} rows x D={shape.dim}, "
             f"{what}, per-{unit} batch {shape.batch_size} x {shape.bag_size} ids a table; "
             f"median of {steps} steps, the slowest rank; parts timed apart (prefetch = input dist + "
             f"resolve, forward = gather + output dist, backward = grad dist + update); "
             f"load: the busiest rank over the mean"]
    head = [units, "alpha", "hot replicated", "step ms", "prefetch/fwd/bwd ms", "TrainPipeline ms",
            f"lookups/s per {unit}", f"per-{unit} throughput vs 1st", "lookups max/mean",
            "keys received max/mean", "rows max/mean"]
    w = [len(h) for h in head]
    lines += [" | ".join(head), "-+-".join("-" * n for n in w)]
    base: dict[tuple, float] = {}
    for r in results:
        first = base.setdefault((r["alpha"], r["replicate_hot"]), r["lookups_per_s_per_gpu"])
        r["efficiency"] = r["lookups_per_s_per_gpu"] / first
        ratios = [r["load_imbalance"][name] for name in ("lookups", "keys_received", "rows")]
        cells = [f"{x:.3f}" if x is not None else "-" for x in ratios]
        parts = "/".join(f"{r['parts_ms'][name]:.2f}" for name in PARTS)
        lines.append(f"{r['gpus']:>{w[0]}} | {r['alpha']:>{w[1]}} | {r['replicate_hot']:>{w[2]}} | "
                     f"{r['step_ms']:{w[3]}.3f} | {parts:>{w[4]}} | {_ms(r['pipelined_ms']):>{w[5]}} | "
                     f"{r['lookups_per_s_per_gpu']:{w[6]}.3e} | {r['efficiency']:{w[7]}.2f} | "
                     f"{cells[0]:>{w[8]}} | {cells[1]:>{w[9]}} | {cells[2]:>{w[10]}}")
    return "\n".join(lines + _targets(results, unit, units))


def _targets(results: list[dict], unit: str, units: str) -> list[str]:
    """The world-size-1 overhead against the unsharded step, and the per-GPU throughput at 2+."""
    lines = []
    for r in results:
        plain = r.get("unsharded")
        if plain:
            parts = "/".join(f"{plain['parts_ms'][name]:.2f}" for name in PARTS)
            lines.append(f"alpha {r['alpha']}: unsharded (no process group) step {plain['median_ms']:.3f} ms "
                         f"(prefetch/fwd/bwd {parts}), TrainPipeline {_ms(plain['pipelined_ms'])}")
            pairs = [("plain loop", r["step_ms"], plain["median_ms"]),
                     ("TrainPipeline", r["pipelined_ms"], plain["pipelined_ms"])]
            for how, sharded, unsharded in pairs:
                if sharded and unsharded:
                    ratio = sharded / unsharded
                    met = "met" if ratio <= OVERHEAD_TARGET else "NOT met"
                    lines.append(f"  sharded over 1 {unit} / unsharded, {how}: {ratio:.2f}x "
                                 f"(target <= {OVERHEAD_TARGET}: {met})")
        elif r["gpus"] > 1 and not r["replicate_hot"]:
            met = "met" if r["efficiency"] >= SCALING_TARGET else "NOT met"
            lines.append(f"alpha {r['alpha']}, {r['gpus']} {units}: per-{unit} throughput "
                         f"{r['efficiency']:.2f} of the first (target >= {SCALING_TARGET}: {met})")
    return lines
