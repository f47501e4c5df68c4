"""The ``tieredemb`` command line: ``tieredemb train`` (the main job) and ``tieredemb bench``."""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import sys
import traceback
from collections.abc import Sequence
from dataclasses import replace
from typing import NoReturn

import torch
from tqdm import tqdm

from tieredemb.config import parse_bytes
from tieredemb.models import DLRMConfig
from tieredemb.storage.errors import BackendError
from tieredemb.storage.urls import redact_text
from tieredemb.train import (
    EMB_OPTIMIZERS,
    MOVIELENS_DEFAULTS,
    TrainConfig,
    TrainEvent,
    TrainResult,
    backing_spec,
    defaults_for_data,
    train,
)


class _Parser(argparse.ArgumentParser):
    """One line on a bad option: ``tieredemb train: error: ...`` (not the whole usage), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(kind: type, low: float, high: float | None = None, *, low_open: bool = False):
    """An argparse type: a ``kind`` in [low, high] (``(low, ...`` with ``low_open``)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        above = value > low if low_open else value >= low
        if not (above and (high is None or value < high) and math.isfinite(value)):
            bound = f"{'>' if low_open else '>='} {low}" + ("" if high is None else f" and < {high}")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _backing(text: str) -> str:
    try:
        backing_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


_COUNT, _STEPS = _number(int, 1), _number(int, 0)
_RATE = _number(float, 0.0, low_open=True)


def _add_train_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    movielens = MOVIELENS_DEFAULTS
    p.add_argument("--steps", type=_COUNT, default=None,
                   help=f"training steps (default {d.steps}; {movielens['steps']} with --data movielens)")
    p.add_argument("--batch-size", type=_COUNT, default=d.batch_size,
                   help="samples per step (default %(default)s)")
    p.add_argument("--eval-every", type=_STEPS, default=d.eval_every,
                   help="log loss and eval AUC every N steps; 0: only at the end (default %(default)s)")
    p.add_argument("--lr", type=_RATE, default=d.lr,
                   help="learning rate of the dense MLPs, Adam (default %(default)s)")
    p.add_argument("--emb-optimizer", choices=sorted(EMB_OPTIMIZERS), default=d.emb_optimizer,
                   help="fused embedding optimizer (default %(default)s)")
    p.add_argument("--emb-lr", type=_RATE, default=None,
                   help=f"embedding learning rate (default {d.emb_lr}; {movielens['emb_lr']} with "
                   "--data movielens)")
    p.add_argument("--embedding-dim", type=_COUNT, default=d.model.embedding_dim,
                   help="embedding width D (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of data and model (default 0)")
    p.add_argument("--device", default=d.device, help="cpu or cuda (default %(default)s)")
    _add_data_args(p, d)
    _add_storage_args(p)
    p.add_argument("--pipeline", action="store_true",
                   help="train through te.TrainPipeline: the next batches' copy and prefetch beside the step")
    p.add_argument(
        "--nproc", type=_COUNT, default=1,
        help="processes to spawn on this machine (tables sharded over them, dense layers under DDP; "
        "--batch-size is the global batch): gloo on cpu, NCCL with one GPU each on cuda. Under "
        "torchrun leave it at 1: the job joins torchrun's group (default %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log at INFO level; on an error, show its traceback")


def _add_data_args(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    p.add_argument(
        "--data", default=None, metavar="SOURCE",
        help="movielens (MovieLens-100k from the installed recbole package: pip install --no-deps "
        "recbole), movielens:DIR (RecBole's .inter/.user/.item files), or a Criteo-format TSV "
        "(PATH or criteo:PATH: label, 13 ints, 26 hex ids); default: synthetic clicks",
    )
    p.add_argument("--eval-fraction", type=_number(float, 0.0, 1.0, low_open=True), default=d.eval_fraction,
                   help="with --data: share held out for eval, the file's tail (Criteo) or the latest "
                   "ratings (MovieLens) (default %(default)s)")
    p.add_argument("--max-rows", type=_number(int, 2), default=None, help="with --data: read at most N rows")
    p.add_argument("--eval-size", type=_COUNT, default=d.synthetic.eval_size,
                   help="synthetic eval samples (default %(default)s)")


def _add_storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hbm-budget", type=_byte_size, default=None, metavar="BYTES",
        help="device memory for the tables' rows and optimizer state (e.g. 64M, 1GiB); over it, the "
        "device holds a cache of each table over --backing (default: no limit, all rows on the device)",
    )
    p.add_argument(
        "--backing", type=_backing, default=None, metavar="STORE",
        help="the store under the cache (needs --hbm-budget): host (host memory, the default), "
        "rocksdb:PATH (a RocksDB directory) or redis://HOST:PORT/DB",
    )
    p.add_argument(
        "--dtype", choices=["fp32", "bf16", "fp16"], default="fp32",
        help="the embedding rows' storage type (weights and optimizer state; updates in fp32, "
        "stochastically rounded): fp32 (default), bf16 or fp16",
    )
    p.add_argument(
        "--stash", action="store_true",
        help="stash the tables' device rows to host memory between the lookup and the embedding "
        "backward, so the dense model can use that memory (CUDA; on cpu the same copies run and "
        "free nothing)",
    )
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save checkpoints there (tables, dense model, its optimizer, the step), after the "
                   "last step and every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=_STEPS, default=0, metavar="N",
                   help="steps between checkpoints; 0: only after the last step (default %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="load the latest checkpoint of --checkpoint-dir and train on from its step up to "
                   "--steps (the backing store is cleared and filled from the checkpoint)")


def build_parser() -> argparse.ArgumentParser:
    """The ``tieredemb`` argument parser."""
    parser = _Parser(
        prog="tieredemb", description="Tiered embedding tables: the training job and the benchmarks."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser(
        "train",
        help="train a small DLRM on synthetic clicks, MovieLens or a Criteo TSV and report AUC",
        description="Train a small DLRM on synthetic click data with a known best AUC, on "
        "MovieLens-100k (--data movielens) against a per-movie baseline, or on a Criteo-format TSV, "
        "with its tables in any storage mode and backing store, and report eval AUC.",
    )
    _add_train_args(train_p)
    # Listed for --help only: main() hands everything after "bench" to tieredemb.bench.main.
    bench_p = sub.add_parser("bench", help="benchmarks: tieredemb bench --help for their options")
    bench_p.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS")
    return parser


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    d = TrainConfig()
    data_defaults = defaults_for_data(args.data)
    steps = args.steps if args.steps is not None else data_defaults.get("steps", d.steps)
    emb_lr = args.emb_lr if args.emb_lr is not None else data_defaults.get("emb_lr", d.emb_lr)
    return TrainConfig(
        steps=steps,
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        lr=args.lr,
        emb_optimizer=args.emb_optimizer,
        emb_lr=emb_lr,
        model=DLRMConfig(embedding_dim=args.embedding_dim),
        seed=args.seed,
        device=args.device,
        data=args.data,
        eval_fraction=args.eval_fraction,
        max_rows=args.max_rows,
        synthetic=replace(d.synthetic, eval_size=args.eval_size),
        pipeline=args.pipeline,
        hbm_budget=args.hbm_budget,
        backing=args.backing,
        dtype=args.dtype,
        stash=args.stash,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
    )


def _print_summary(result: TrainResult) -> None:
    resumed = f" (from step {result.start_step})" if result.start_step else ""
    print(
        f"summary: {result.steps} steps{resumed}, {result.samples:,} samples, "
        f"{result.samples_per_second:,.0f} samples/s (training), wall {result.wall_seconds:.1f} s"
    )
    print(f"  tables     {result.storage_mode}"
          + (f", {result.stashed_bytes / 2**20:.1f} MiB stashed a step" if result.stashed_bytes else ""))
    print(f"  final loss {result.loss:.4f}")
    print(f"  eval AUC   {result.auc:.4f}")
    if result.baseline_auc is not None:
        print(f"  baseline   {result.baseline_auc:.4f} ({result.baseline}, same eval set)")
        print(f"  lift       {result.auc - result.baseline_auc:+.4f} AUC over the baseline")
    if result.auc_best is None:
        if result.baseline_auc is None:
            print("  AUC_best   n/a (no ground truth for --data)")
        return
    print(f"  AUC_best   {result.auc_best:.4f} (ground-truth logit, same eval set)")
    print(f"  target     {result.target:.4f} (0.5 + 0.9 * (AUC_best - 0.5))")
    print(
        f"  {'PASS' if result.passed else 'FAIL'}: eval AUC {result.auc:.4f} "
        f"{'>=' if result.passed else '<'} target {result.target:.4f}"
    )


def run_train(args: argparse.Namespace) -> int:
    """``tieredemb train``: train with a progress bar, print eval lines and a summary. Bad input
    raises (``ValueError``, ``OSError``, ``te.storage.BackendError``): ``main`` prints it."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no CUDA device")
    config = _config_from_args(args)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1 and args.nproc > 1:
        raise ValueError(f"--nproc {args.nproc} under a launcher of {world} processes (torchrun): leave "
                         "--nproc at 1, the launcher starts the processes")
    if config.stash and not config.device.startswith("cuda") and rank == 0:
        print("tieredemb train: note: --stash on cpu runs the stash and restore copies but frees no "
              "device memory (there is none): it saves memory on cuda", file=sys.stderr)
    if args.nproc > 1 and config.batch_size % args.nproc:
        raise ValueError(f"--nproc {args.nproc} must divide --batch-size {config.batch_size}")
    if args.nproc > 1:
        if config.device.startswith("cuda") and torch.cuda.device_count() < args.nproc:
            raise ValueError(f"--nproc {args.nproc} needs as many GPUs, torch sees "
                             f"{torch.cuda.device_count()}")
        return _spawn(config, args.nproc, args.no_progress)
    if world > 1:  # launched by torchrun (one node or several): join its group
        return _train_rank(rank, world, None, config, args.no_progress)
    return _train_and_report(config, args.no_progress)


def _spawn(config: TrainConfig, nproc: int, no_progress: bool) -> int:
    """Run ``nproc`` ranks on this machine; a rank's error comes back as one line (the first)."""
    import torch.multiprocessing as mp

    errors = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(_spawned_rank, args=(nproc, _free_port(), config, no_progress, errors), nprocs=nproc)
    except mp.ProcessExitedException:
        if errors.empty():
            raise
        raise _RankError(errors.get()) from None
    return 0


class _RankError(Exception):
    """A spawned rank's error, already one line."""


def _spawned_rank(rank: int, world: int, port: int, config: TrainConfig, no_progress: bool, errors) -> None:
    try:
        _train_rank(rank, world, port, config, no_progress)
    except _USER_ERRORS as e:
        errors.put(f"rank {rank}: {_one_line(e)}")
        sys.exit(2)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_rank(rank: int, world: int, port: int | None, config: TrainConfig, no_progress: bool) -> int:
    """One rank of a distributed run: join the group (spawned: on ``port`` here; under torchrun:
    from its environment), train, and report on rank 0."""
    import torch.distributed as dist

    cuda = config.device.startswith("cuda")
    if cuda:
        # the GPU of this process on its node: torchrun's LOCAL_RANK (RANK counts every node's
        # processes); spawned here, the rank itself
        local = int(os.environ.get("LOCAL_RANK", rank))
        if local >= torch.cuda.device_count():
            raise ValueError(f"rank {rank} (local rank {local} on its node) needs GPU {local}, torch sees "
                             f"{torch.cuda.device_count()}: start at most that many processes a node")
        torch.cuda.set_device(local)
        config = replace(config, device=f"cuda:{local}")
    if port is not None and "OMP_NUM_THREADS" not in os.environ:
        # spawned here: the host's cores shared out, as torchrun's OMP_NUM_THREADS=1 would keep the
        # ranks from oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    try:
        return _train_and_report(config, no_progress or rank != 0, report=rank == 0)
    finally:
        dist.destroy_process_group()


def _train_and_report(config: TrainConfig, no_progress: bool, report: bool = True) -> int:
    bar = tqdm(total=config.steps, desc="train", unit="step", disable=no_progress, dynamic_ncols=True)

    def on_event(event: TrainEvent) -> None:
        if event.kind == "step":
            if bar.n == 0 and event.step > 1:  # resumed: the bar starts at the checkpoint's step
                bar.update(event.step - 1)
            bar.update(1)
            if event.step % 10 == 0:
                bar.set_postfix(loss=f"{event.loss:.4f}", refresh=False)
        elif report:
            tqdm.write(
                f"step {event.step:>6}: loss {event.loss:.4f}  eval loss {event.eval_loss:.4f}  "
                f"eval AUC {event.auc:.4f}"
            )

    try:
        result = train(config, callback=on_event)
    finally:
        bar.close()
    if report:
        _print_summary(result)
    return 0


def run_bench(argv: Sequence[str]) -> int:
    """``tieredemb bench ARGS``: hands ARGS to ``tieredemb.bench.main`` when that exists."""
    try:
        bench = importlib.import_module("tieredemb.bench")
    except ModuleNotFoundError as e:
        if e.name != "tieredemb.bench":
            raise
        bench = None
    bench_main = getattr(bench, "main", None)
    if bench_main is None:
        print("error: bench not available (no tieredemb.bench.main in this install)", file=sys.stderr)
        return 2
    rc = bench_main(list(argv))
    return 0 if rc is None else int(rc)


# What a bad input raises: a wrong option value or combination, a missing, unreadable or malformed
# file, a checkpoint that does not fit, a store that cannot be opened or reached.
_USER_ERRORS = (ValueError, OSError, ImportError, BackendError, _RankError)  # ImportError: an optional extra


def _one_line(error: BaseException) -> str:
    """The error's message on one line, a store URL's password redacted."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        text = f"{error.filename}: {error.strerror}"
    else:
        text = str(error) or type(error).__name__
    return redact_text(" ".join(text.split()))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tieredemb`` console script.

    A bad input (``_USER_ERRORS``) prints ``tieredemb <command>: error: <one line>`` to stderr and
    returns 2; with ``-v``/``--verbose`` its traceback comes first."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv[:1] in (["train"], ["bench"]) else "train"
    verbose = "-v" in argv or "--verbose" in argv
    try:
        if argv[:1] == ["bench"]:
            # bench parses its own arguments (argparse would reject the ones it doesn't know here).
            return run_bench(argv[1:])
        try:
            args, unknown = build_parser().parse_known_args(argv)
        except SystemExit as e:  # --help, or a bad option: argparse has printed it
            return e.code if isinstance(e.code, int) else 2
        if unknown:
            raise ValueError(f"unrecognized arguments: {' '.join(unknown)} (see tieredemb train --help)")
        level = logging.INFO if args.verbose else logging.WARNING
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
        return run_train(args)
    except _USER_ERRORS as e:
        if verbose:
            traceback.print_exc()
        print(f"tieredemb {command}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tieredemb {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
