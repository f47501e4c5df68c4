"""The ``tieredemb`` command line: ``tieredemb train`` (the main job) and ``tieredemb bench``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

import torch
from tqdm import tqdm

from tieredemb.models import DLRMConfig
from tieredemb.train import EMB_OPTIMIZERS, TrainConfig, TrainEvent, TrainResult, train


def _add_train_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (default %(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="samples per step (default %(default)s)"
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="log loss and eval AUC every N steps; 0: only at the end (default %(default)s)",
    )
    p.add_argument(
        "--lr", type=float, default=d.lr, help="learning rate of the dense MLPs, Adam (default %(default)s)"
    )
    p.add_argument(
        "--emb-optimizer",
        choices=sorted(EMB_OPTIMIZERS),
        default=d.emb_optimizer,
        help="fused embedding optimizer (default %(default)s)",
    )
    p.add_argument(
        "--emb-lr", type=float, default=d.emb_lr, help="embedding learning rate (default %(default)s)"
    )
    p.add_argument(
        "--embedding-dim",
        type=int,
        default=d.model.embedding_dim,
        help="embedding width D (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="seed of data and model (default 0)")
    p.add_argument("--device", default=d.device, help="cpu or cuda (default %(default)s)")
    p.add_argument(
        "--data",
        default=None,
        metavar="TSV",
        help="Criteo-format TSV (label, 13 ints, 26 hex ids) instead of synthetic data",
    )
    p.add_argument(
        "--eval-fraction",
        type=float,
        default=d.eval_fraction,
        help="with --data: tail fraction held out for eval (default %(default)s)",
    )
    p.add_argument("--max-rows", type=int, default=None, help="with --data: read at most N rows")
    p.add_argument(
        "--eval-size",
        type=int,
        default=d.synthetic.eval_size,
        help="synthetic eval samples (default %(default)s)",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="train through te.TrainPipeline: the next batches' copy and prefetch beside the step",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes to spawn on this machine (tables sharded over them, dense layers under DDP; "
        "--batch-size is the global batch): gloo on cpu, NCCL with one GPU each on cuda. Under "
        "torchrun leave it at 1: the job joins torchrun's group (default %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")


def build_parser() -> argparse.ArgumentParser:
    """The ``tieredemb`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="tieredemb", description="Tiered embedding tables: the training job and the benchmarks."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser(
        "train",
        help="train a small DLRM on synthetic clicks (or a Criteo TSV) and report AUC",
        description="Train a small DLRM on synthetic click data with a known best AUC, or on a "
        "Criteo-format TSV with --data, and report eval AUC.",
    )
    _add_train_args(train_p)
    # Listed for --help only: main() hands everything after "bench" to tieredemb.bench.main.
    bench_p = sub.add_parser("bench", help="benchmarks: tieredemb bench --help for their options")
    bench_p.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="ARGS")
    return parser


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    d = TrainConfig()
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        eval_every=args.eval_every,
        lr=args.lr,
        emb_optimizer=args.emb_optimizer,
        emb_lr=args.emb_lr,
        model=DLRMConfig(embedding_dim=args.embedding_dim),
        seed=args.seed,
        device=args.device,
        data=args.data,
        eval_fraction=args.eval_fraction,
        max_rows=args.max_rows,
        synthetic=replace(d.synthetic, eval_size=args.eval_size),
        pipeline=args.pipeline,
    )


def _print_summary(result: TrainResult) -> None:
    print(
        f"summary: {result.steps} steps, {result.samples:,} samples, "
        f"{result.samples_per_second:,.0f} samples/s (training), wall {result.wall_seconds:.1f} s"
    )
    print(f"  final loss {result.loss:.4f}")
    print(f"  eval AUC   {result.auc:.4f}")
    if result.auc_best is None:
        print("  AUC_best   n/a (no ground truth for --data)")
        return
    print(f"  AUC_best   {result.auc_best:.4f} (ground-truth logit, same eval set)")
    print(f"  target     {result.target:.4f} (0.5 + 0.9 * (AUC_best - 0.5))")
    print(
        f"  {'PASS' if result.passed else 'FAIL'}: eval AUC {result.auc:.4f} "
        f"{'>=' if result.passed else '<'} target {result.target:.4f}"
    )


def run_train(args: argparse.Namespace) -> int:
    """``tieredemb train``: train with a progress bar, print eval lines and a summary."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.data is not None and not os.path.isfile(args.data):
        print(f"error: --data {args.data}: no such file", file=sys.stderr)
        return 2
    try:
        config = _config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.nproc < 1 or (args.nproc > 1 and config.batch_size % args.nproc):
        print(f"error: --nproc {args.nproc} must be >= 1 and divide --batch-size {config.batch_size}",
              file=sys.stderr)
        return 2
    if args.nproc > 1:
        if config.device.startswith("cuda") and torch.cuda.device_count() < args.nproc:
            print(f"error: --nproc {args.nproc} needs as many GPUs, torch sees {torch.cuda.device_count()}",
                  file=sys.stderr)
            return 2
        import torch.multiprocessing as mp

        mp.spawn(_train_rank, args=(args.nproc, _free_port(), config, args.no_progress), nprocs=args.nproc)
        return 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun: join its group
        return _train_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, config,
                           args.no_progress)
    return _train_and_report(config, args.no_progress)


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
        local = int(os.environ.get("LOCAL_RANK", rank))
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tieredemb`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # bench parses its own arguments (argparse would reject the ones it doesn't know here).
        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    level = logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return run_train(args)


if __name__ == "__main__":
    sys.exit(main())
