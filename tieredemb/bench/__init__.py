"""``tieredemb bench``: named workloads, ours and the peers side by side in one process.

    tieredemb bench hbm [--scale S] [--device cpu|cuda] [--optimizers sgd,adam] [--steps N]
                        [--warmup N] [--kernels auto|torch|triton[,...]] [--threads N] [--seed N]
                        [--pipeline] [--capacity N] [--no-preinsert] [--init-capacity N]
                        [--batch-size B] [--dtype fp32|bf16|fp16] [--no-tbe] [--tbe-precision fp32|fp16]
                        [--turn N] [--out DIR]

prints one table (configuration | optimizer | step ms | lookups/s | speedup vs peer | x floor | ...)
and writes ``<out>/<YYYYmmdd-HHMMSS>-hbm.json`` (machine, command line, options, every measurement,
the row checks) with the table beside it as ``.txt``. Both are rewritten after each configuration, so
a run cut short still leaves what it measured. The exit status is 0 when every configuration ran and
ours trained the same rows as the peer (with ``--capacity``, the bounded runs the same rows as the
torch kernels' run of the same bounded tables). Where ``fbgemm_gpu`` imports, FBGEMM's TBE runs too, in
turns with ours on the same batches (``tieredemb.bench.hbm_tbe``), and a line per configuration of
ours says whether its step is at most TBE's (``met`` / ``NOT met``); where it cannot run, a note
says why. Every bench's ``--out`` defaults to a folder named for
it in the current directory: ``./bench-hbm``, ``./bench-cache``, ``./bench-plot`` ...

    tieredemb bench cache|ssd [--scale S] [--device cpu|cuda] [--steps N] [--warmup N]
                              [--budget-fraction F] [--interleave N] [--dir DIR] [--shards N]
                              [--no-direct-reads] [--out DIR]

runs the cache-mode workloads (``tieredemb.bench.cache``): 10 tables x 10M rows in a device cache of
10% of the footprint over host memory (``cache``) or RocksDB on local disk (``ssd``), against the same
tables all in device memory, both built and timed in turns of ``--interleave`` steps; report
``<out>/<YYYYmmdd-HHMMSS>-cache.json`` (``-ssd.json``) and ``.txt``. A line that states a target (the
``cache`` step at most 1.5x the all-in-device-memory step; ``ssd``, our RocksDB backend at least 80% of
raw rocksdict's rates) ends in its verdict, ``met`` or ``NOT met``; the JSON lists them in ``targets``.
A verdict does not change the exit status, which says whether the runs completed and trained the same
rows.
``ssd --host-budget B`` adds runs with a host tier in front of RocksDB (B: a fraction of the tables'
bytes or bytes) reading ``--lookahead`` batches ahead, the same device cache over ``HostMemory`` (the
tier's reference), and under ``TrainPipeline`` with a DLRM-style dense model
(``tieredemb.bench.host_tier``). RocksDB is served by a process per shard unless ``--no-store-process``.
``ssd`` also measures the disk under ``--dir`` itself with O_DIRECT (sequential write and read,
random 4 KiB reads from 32 threads; ``tieredemb.bench.disk``) and prints the least step time it allows
ours' misses and writes; RocksDB reads with O_DIRECT unless ``--no-direct-reads``.

    tieredemb bench dist [--workload hbm|cache] [--gpus 1,2,4] [--scale S] [--steps N]
                         [--optimizer adam] [--alpha 1.05,1.2] [--pipeline] [--replicate-hot N]
                         [--device cpu|cuda] [--out DIR]

weak scaling of ``hbm`` or ``cache`` row-wise sharded over several GPUs (``tieredemb.bench.dist``;
NCCL; ``--device cpu`` runs gloo processes instead, a smoke run), at each Zipf ``--alpha``, with
each rank's load (lookups served, keys received, rows held) and the busiest rank over the mean;
one GPU also against the collection with no process group, each step's parts timed apart;
``--pipeline`` also under ``te.TrainPipeline``; ``--replicate-hot N`` runs each again with the N
hottest keys of every table on every rank.

    tieredemb bench stash [--scale S] [--steps N] [--width W] [--layers L] [--long-steps N] [--out DIR]

embedding memory stashing on a DLRM-style model, off vs each free strategy (``tieredemb.bench.stash``).

    tieredemb bench plot REPORT.json [...] [--out DIR]

PNG plots from reports into ``--out`` (``tieredemb.bench.plot``; matplotlib, ``pip install
tieredemb[plot]``): step time by configuration, a ``stash`` report's device memory over a step, and
from several ``cache``/``ssd`` reports (``--budget-fraction`` / ``--alpha`` sweeps) step time and hit
rate against the cache size or the Zipf alpha.

    tieredemb bench checkpoint [--rows N] [--dim D] [--dir DIR] [--buffer-mib M]

``te.checkpoint`` save and load throughput against the disk's sequential speed
(``tieredemb.bench.checkpoint``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from contextlib import contextmanager
from datetime import datetime

import torch

from tieredemb.bench.hbm import OPTIMIZERS, HbmBench, HbmOptions
from tieredemb.bench.report import (
    check_directory,
    format_table,
    machine_info,
    memory_name,
    report_path,
    write_report,
)
from tieredemb.bench.workloads import HbmShape
from tieredemb.config import parse_bytes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tieredemb bench",
                                     description="Benchmark workloads against their peers.")
    sub = parser.add_subparsers(dest="workload", required=True)
    timed = [_add_hbm(sub)]
    for name, text in (("cache", "10 tables x 10M rows, RowWiseAdagrad, device cache of 10%% of the "
                                 "footprint over host memory, vs all in device memory (DESIGN "
                                 "section 7)"),
                       ("ssd", "as cache, backing RocksDB on local disk, plus raw rocksdict rates")):
        timed.append(_add_cache(sub, name, text))
    _add_dist(sub)
    timed.append(_add_stash(sub))
    for p in timed:
        p.add_argument("--autograd-threads", action="store_true",
                       help="run backward on autograd's per-device threads (torch's default); without "
                            "it every configuration, ours and the peers', runs backward on the calling "
                            "thread, as TrainPipeline does")
    _add_plot(sub)
    _add_checkpoint(sub)
    return parser


def _add_hbm(sub) -> argparse.ArgumentParser:
    hbm = sub.add_parser("hbm", help="10 tables x 1.68M rows x D=128 in device memory, Zipf ids "
                                     "(DESIGN section 7)")
    hbm.add_argument("--scale", type=_positive, default=1.0,
                     help="multiplies rows and batch size (e.g. 0.001 for a CPU smoke run)")
    hbm.add_argument("--device", choices=["cpu", "cuda"], default=None,
                     help="default: cuda when available, else cpu")
    hbm.add_argument("--optimizers", default="sgd,adam",
                     help=f"comma-separated, from {','.join(OPTIMIZERS)}")
    hbm.add_argument("--steps", type=_at_least(1), default=50, help="timed steps (median reported)")
    hbm.add_argument("--warmup", type=_at_least(0), default=10, help="untimed steps first")
    hbm.add_argument("--kernels", default="auto",
                     help="auto|torch|triton, or several comma-separated: one 'ours' row each")
    hbm.add_argument("--threads", type=_at_least(1), default=None,
                     help="torch CPU threads for the run (default: torch's own choice)")
    hbm.add_argument("--seed", type=_at_least(0), default=0, help="seed of the batches and initial rows")
    hbm.add_argument("--no-preinsert", dest="preinsert", action="store_false",
                     help="start from empty tables (new keys are inserted while timing)")
    hbm.add_argument("--pipeline", action="store_true",
                     help="also each 'ours' under te.TrainPipeline (inline prefetch, read deferred)")
    hbm.add_argument("--capacity", type=int, default=None,
                     help="also each 'ours' with every table bounded to this max_capacity (no row "
                          "stored first: misses and evictions every step), checked against the torch "
                          "kernels' run of the same bounded tables")
    hbm.add_argument("--init-capacity", type=int, default=None,
                     help="each table's init_capacity: rows and index allocated up front (with "
                          "--no-preinsert, a table that grows without rehashing up to it)")
    hbm.add_argument("--batch-size", type=_at_least(1), default=None,
                     help="bags a table per step (default: 10,486 x --scale)")
    hbm.add_argument("--no-tbe", dest="tbe", action="store_false",
                     help="leave out FBGEMM's TBE (by default it runs in turns with ours where "
                          "fbgemm_gpu imports)")
    hbm.add_argument("--tbe-precision", choices=["fp32", "fp16"], default="fp32",
                     help="TBE's rows (fp16: its production default; no row check then)")
    hbm.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
                     help="ours' rows (weights and optimizer state); 16-bit rows are timed, not "
                          "checked row for row against the fp32 peers")
    hbm.add_argument("--turn", type=_at_least(1), default=10,
                     help="steps a block when ours and TBE take turns")
    _add_out(hbm, "hbm")
    return hbm


def _add_cache(sub, name: str, text: str) -> argparse.ArgumentParser:
    """``cache`` or ``ssd``: the same options, and each its own few."""
    p = sub.add_parser(name, help=text)
    p.add_argument("--scale", type=_positive, default=1.0,
                   help="multiplies rows and batch size (e.g. 0.001 for a CPU smoke run)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--steps", type=_at_least(1), default=20, help="timed steps (median reported)")
    p.add_argument("--warmup", type=_at_least(0), default=20, help="untimed steps first")
    p.add_argument("--budget-fraction", type=_fraction, default=0.1,
                   help="device memory budget as a fraction of the tables' footprint")
    p.add_argument("--seed", type=_at_least(0), default=0, help="seed of the batches and initial rows")
    p.add_argument("--alpha", type=_positive, default=None, help="Zipf exponent of the ids (default 1.05)")
    p.add_argument("--threads", type=_at_least(1), default=None, help="torch CPU threads for the run")
    p.add_argument("--no-prefill", dest="prefill", action="store_false",
                   help="start empty (default: the hottest cache-rows ranks written first)")
    p.add_argument("--interleave", type=_at_least(0), default=10,
                   help="build ours and the all-in-device-memory peer both, then time them in turns "
                        "of this many steps, so both see the same machine (default %(default)s; 0: "
                        "one after the other, each built only while it runs: less device memory)")
    _add_out(p, name)
    if name == "cache":
        p.add_argument("--reserve", action="store_true",
                       help="size the stores up front: the host store's rows page-locked and its "
                            "index (HostMemory(reserve_rows=rows)), the all-in-device-memory peer's "
                            "rows and index (init_capacity=rows)")
    if name == "ssd":
        p.add_argument("--dir", default=None,
                       help="RocksDB directory on the disk to test (default: a fresh temporary "
                            "directory under /tmp, removed after)")
        p.add_argument("--shards", type=_at_least(1), default=8, help="RocksDB shards (= threads)")
        p.add_argument("--raw-rows", type=_at_least(1), default=None,
                       help="rows of the raw rocksdict baseline (default: 1M x scale)")
        p.add_argument("--direct-reads", action=argparse.BooleanOptionalAction, default=True,
                       help="RocksDB reads the disk with O_DIRECT, not the page cache, where the "
                            "directory's file system allows it (default: on)")
        p.add_argument("--host-budget", type=_host_budget, default=None,
                       help="also run with a host tier in front of RocksDB of this size: a fraction "
                            "of the tables' bytes (e.g. 0.1) or bytes (e.g. 4GiB); and under "
                            "TrainPipeline with a DLRM-style dense model, without and with it")
        p.add_argument("--store-rows", type=_share, default=0.0,
                       help="the share of each table's ranks (their initial rows) written to the store "
                            "before timing and flushed to its files, so that misses read rows from the "
                            "disk (default 0: the store starts with the cache's rows; most misses are "
                            "then new keys)")
        p.add_argument("--block-cache", type=_bytes, default=None,
                       help="RocksDB's block cache, one for the store, in bytes (e.g. 64MiB; 0: none); "
                            "default: RocksDB's own per column family, which may hold a small store "
                            "whole (reads then never reach the disk)")
        p.add_argument("--store-process", action=argparse.BooleanOptionalAction, default=True,
                       help="RocksDB served by a child process of its own (RocksDB(process=True)): its "
                            "writes do not hold the training process's interpreter lock (default: on)")
        p.add_argument("--lookahead", type=_at_least(0), default=2,
                       help="with --host-budget: batches whose rows are read ahead (default %(default)s)")
        p.add_argument("--dense-width", type=_at_least(1), default=1024,
                       help="with --host-budget: the dense model's top MLP width (default %(default)s)")
        p.add_argument("--dense-layers", type=_at_least(1), default=4,
                       help="with --host-budget: the dense model's top MLP layers (default %(default)s)")
    return p


def _add_dist(sub) -> None:
    d = sub.add_parser("dist", help="weak scaling of hbm, row-wise sharded over 1, 2, 4 ... GPUs (NCCL)")
    d.add_argument("--workload", dest="dist_workload", choices=["hbm", "cache"], default="hbm",
                   help="the workload sharded (default %(default)s)")
    d.add_argument("--gpus", type=_world_sizes, default="1,2,4",
                   help="comma-separated world sizes (default %(default)s)")
    d.add_argument("--scale", type=_positive, default=1.0, help="multiplies rows and the per-GPU batch")
    d.add_argument("--optimizer", default="adam", choices=list(OPTIMIZERS))
    d.add_argument("--steps", type=_at_least(1), default=20, help="timed steps (median reported)")
    d.add_argument("--warmup", type=_at_least(0), default=5, help="untimed steps first")
    d.add_argument("--seed", type=_at_least(0), default=0)
    d.add_argument("--alpha", type=_alphas, default=None,
                   help="comma-separated Zipf exponents of the ids, each run at every world size "
                        "(default: the workload's, 1.05); the report gives each rank's load")
    d.add_argument("--replicate-hot", type=_at_least(0), default=0,
                   help="also run each with this many hottest keys a table replicated on every rank "
                        "(te.HotRows); the report compares the busiest rank's load with and without")
    _add_out(d, "dist")
    d.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cuda: NCCL over GPUs (default when available); cpu: gloo processes (a smoke run)")
    d.add_argument("--pipeline", dest="dist_pipeline", action="store_true",
                   help="also time each world size under te.TrainPipeline (the next batch's input dist and "
                        "prefetch beside this step)")


def _add_stash(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("stash", help="embedding memory stashing on a DLRM-style model: off vs each "
                                     "free strategy (DESIGN section 5)")
    s.add_argument("--scale", type=_positive, default=1.0, help="multiplies rows and batch size")
    s.add_argument("--device", choices=["cpu", "cuda"], default=None)
    s.add_argument("--steps", type=_at_least(1), default=10, help="timed steps (median reported)")
    s.add_argument("--warmup", type=_at_least(0), default=4, help="untimed steps first (>= 3: calibration)")
    s.add_argument("--width", type=_at_least(1), default=4096, help="top MLP width")
    s.add_argument("--layers", type=_at_least(1), default=8, help="top MLP layers")
    s.add_argument("--long-steps", type=_at_least(0), default=0,
                   help="then train the fastest strategy and stash off this many steps and compare rows")
    s.add_argument("--seed", type=_at_least(0), default=0)
    _add_out(s, "stash")
    return s


def _add_plot(sub) -> None:
    pl = sub.add_parser("plot", help="PNG plots of bench reports: step time by configuration; from several "
                                     "cache reports, step time and hit rate against cache size or alpha")
    pl.add_argument("reports", nargs="+", help="JSON reports of tieredemb bench")
    _add_out(pl, "plot", "PNG files")


def _add_checkpoint(sub) -> None:
    c = sub.add_parser("checkpoint", help="te.checkpoint save/load throughput against the disk")
    c.add_argument("--rows", type=_at_least(1), default=500_000)
    c.add_argument("--dim", type=_at_least(1), default=64)
    c.add_argument("--dir", default=None, help="directory on the disk to test (default: a temporary one)")
    c.add_argument("--buffer-mib", type=_at_least(1), default=256)
    c.add_argument("--device", choices=["cpu", "cuda"], default=None)
    _add_out(c, "checkpoint")


def _add_out(p: argparse.ArgumentParser, name: str, what: str = "reports (JSON and the table)") -> None:
    p.add_argument("--out", default=f"bench-{name}",
                   help=f"directory of the {what} (default: ./%(default)s, in the current directory)")


def _at_least(low: int):
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {n}")
        return n

    return parse


def _positive(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return x


def _fraction(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    x = _positive(text)
    if not x < 1:
        raise argparse.ArgumentTypeError(f"must be below 1, got {text}")
    return x


def _share(text: str) -> float:
    """An argparse type: a number from 0 to 1."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text!r}") from None
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {text}")
    return x


def _bytes(text: str) -> int:
    """An argparse type: bytes >= 0 ("64MiB", "0")."""
    try:
        return parse_bytes(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _host_budget(text: str) -> float | int:
    """An argparse type: a fraction in (0, 1) of the tables' bytes ("0.1"), or bytes ("4GiB", an int)."""
    if re.fullmatch(r"\s*[0-9]*\.[0-9]*\s*", text):  # a plain decimal number: a fraction
        x = float(text) if text.strip() != "." else 0.0
        if not 0 < x < 1:
            raise argparse.ArgumentTypeError(f"a fraction must be in (0, 1), got {text}")
        return x
    try:
        n = parse_bytes(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{e}; or a fraction in (0, 1)") from None
    if not n:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1) or bytes >= 1, got {text}")
    return n


def _world_sizes(text: str) -> list[int]:
    """An argparse type: comma-separated world sizes, each >= 1."""
    sizes = [_at_least(1)(x) for x in _split(text)]
    if not sizes:
        raise argparse.ArgumentTypeError("no world size given")
    return sizes


def _alphas(text: str) -> list[float]:
    """An argparse type: comma-separated Zipf exponents, each > 0."""
    try:
        values = [float(x) for x in _split(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or not all(v > 0 and v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(f"Zipf exponents must be finite and > 0, got {text!r}")
    return values


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tieredemb bench``; ``argv`` excludes the program and the word ``bench``.

    A bad option ends in argparse's message (exit status 2); a bad file or directory, an unavailable
    device or a missing matplotlib raise an exception (ValueError, FileNotFoundError, ImportError) whose
    message names it, which the command line prints on one line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    check_directory("--out", args.out)
    if getattr(args, "dir", None) is not None:
        check_directory("--dir", args.dir)
    if args.workload == "plot":
        from tieredemb.bench.plot import main as plot

        for png in plot(args.reports, args.out):
            print(f"plot: {png}")
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available")
    if hasattr(args, "autograd_threads"):
        with torch.autograd.set_multithreading_enabled(args.autograd_threads):
            return _dispatch(args, argv, device)
    return _dispatch(args, argv, device)


def _dispatch(args: argparse.Namespace, argv: list[str], device: torch.device) -> int:
    if args.workload in ("cache", "ssd"):
        return _main_cache(args, argv, device)
    if args.workload == "checkpoint":
        from tieredemb.bench.checkpoint import run as run_checkpoint

        return run_checkpoint(args.rows, args.dim, args.dir, args.buffer_mib, device, args.out, argv)
    if args.workload == "stash":
        from tieredemb.bench.stash import StashOptions
        from tieredemb.bench.stash import run as run_stash

        return run_stash(StashOptions(args.scale, device, args.steps, args.warmup, args.width, args.layers,
                                      args.long_steps, args.seed), args.out, argv, log=_log)
    if args.workload == "dist":
        from tieredemb.bench.cache_runs import CACHE_SHAPE
        from tieredemb.bench.dist import run

        shape = (CACHE_SHAPE if args.dist_workload == "cache" else HbmShape()).scaled(args.scale)
        return run(args.gpus, shape, args.optimizer, args.steps, args.warmup, args.seed, args.out, argv,
                   args.dist_workload, device.type, args.scale, args.alpha, args.dist_pipeline,
                   args.replicate_hot)
    for k in _split(args.kernels):
        if k not in ("auto", "torch", "triton"):
            raise ValueError(f"--kernels: unknown kernels {k!r} (auto, torch or triton)")
    shape = HbmShape().scaled(args.scale)
    if args.batch_size is not None:
        shape = dataclasses.replace(shape, batch_size=args.batch_size)
    options = HbmOptions(shape=shape, device=device,
                         optimizers=_split(args.optimizers), kernels=_split(args.kernels),
                         steps=args.steps, warmup=args.warmup, seed=args.seed,
                         preinsert=args.preinsert, pipeline=args.pipeline, capacity=args.capacity,
                         init_capacity=args.init_capacity, tbe=args.tbe,
                         tbe_precision=args.tbe_precision, turn=args.turn, dtype=args.dtype)
    with _torch_threads(args.threads):
        return _run_hbm(options, argv, args.out, args.scale)


@contextmanager
def _torch_threads(n: int | None):
    """torch's intra-op threads set to ``n`` (None: unchanged) for the block, restored after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_hbm(options: HbmOptions, argv: list[str], out_dir: str, scale: float) -> int:
    started = datetime.now()
    path = report_path(out_dir, "hbm", started)
    machine = machine_info(options.device)
    s = options.shape
    title = (f"hbm: {s.num_tables} tables x {s.rows} rows x D={s.dim}, batch {s.batch_size} x "
             f"{s.bag_size} ids, {s.lookups} lookups/step, Zipf {s.alpha}; "
             f"{machine.get('gpu', options.device)}; median of {options.steps} steps")
    bench = HbmBench(options, log=_log)

    def table() -> str:
        bw = bench.bandwidth.get("bytes_per_s")
        bw_text = f"; copy bandwidth {bw / 1e9:.1f} GB/s" if bw else ""
        return format_table(title + bw_text, bench.results)

    def save() -> None:
        report = {"workload": "hbm", "date": started.isoformat(timespec="seconds"), "scale": scale,
                  "command_line": "tieredemb bench " + " ".join(argv), "machine": machine,
                  **bench.summary(), "ok": bench.ok}
        write_report(path, report, table())

    bench.run(on_update=save)
    save()
    print(table())
    for line in bench.notes:
        print(line)
    for target in bench.targets():
        print(target.line())
    for c in bench.checks:
        verdict = "same rows" if c.passed else "DIFFERENT ROWS: " + "; ".join(c.problems)
        against = getattr(c, "reference", "peer")
        peer = getattr(c, "peer_max_abs_diff", None)
        print(f"check {c.optimizer} ours[{c.kernels}] vs {against}: {verdict} "
              f"(max |diff| {c.max_abs_diff:.3g}, {c.rows_trained} trained rows compared"
              + (f"; the peer is {peer:.3g} from exact)" if peer is not None else ")"))
    print(f"report: {path}")
    return 0 if bench.ok else 1


def _main_cache(args: argparse.Namespace, argv: list[str], device: torch.device) -> int:
    from tieredemb.bench.cache import CacheBench, CacheOptions, cache_shape

    shape = cache_shape(args.scale)
    if args.alpha is not None:
        shape = dataclasses.replace(shape, alpha=args.alpha)
    options = CacheOptions(workload=args.workload, shape=shape, device=device,
                           steps=args.steps, warmup=args.warmup, seed=args.seed,
                           budget_fraction=args.budget_fraction,
                           directory=getattr(args, "dir", None),
                           shards=getattr(args, "shards", 8), prefill=args.prefill,
                           raw_rows=getattr(args, "raw_rows", None),
                           direct_reads=getattr(args, "direct_reads", True),
                           reserve=getattr(args, "reserve", False), interleave=args.interleave,
                           host_budget=getattr(args, "host_budget", None),
                           store_rows=getattr(args, "store_rows", 0.0),
                           block_cache_bytes=getattr(args, "block_cache", None),
                           lookahead=getattr(args, "lookahead", 2),
                           store_process=getattr(args, "store_process", True),
                           dense_width=getattr(args, "dense_width", 1024),
                           dense_layers=getattr(args, "dense_layers", 4))
    with _torch_threads(args.threads):
        started = datetime.now()
        path = report_path(args.out, args.workload, started)
        machine = machine_info(device)
        s = options.shape
        title = (f"{args.workload}: {s.num_tables} tables x {s.rows} rows x D={s.dim} RowWiseAdagrad, "
                 f"{memory_name(device)} budget {options.budget_fraction:g} of "
                 f"{options.footprint_bytes / 1e9:.2f} GB, "
                 f"batch {s.batch_size} x {s.bag_size} ids, {s.lookups} lookups/step, Zipf "
                 f"{s.alpha}; {machine.get('gpu', device)}; median of {options.steps} steps"
                 + (f", in turns of {options.interleave}" if options.interleave else ""))
        bench = CacheBench(options, log=_log)

        def text() -> str:
            return format_table(title, bench.results) + "\n" + bench.details()

        def save() -> None:
            report = {"workload": args.workload, "date": started.isoformat(timespec="seconds"),
                      "scale": args.scale, "command_line": "tieredemb bench " + " ".join(argv),
                      "machine": machine,
                      **bench.summary(), "ok": bench.ok}
            write_report(path, report, text())

        bench.run(on_update=save)
        save()
        print(text())
        print(f"report: {path}")
        return 0 if bench.ok else 1


__all__ = ["main"]
