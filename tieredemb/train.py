"""The main job: train a small DLRM on synthetic click data (or a Criteo TSV) and report eval AUC.

``train(TrainConfig(...)) -> TrainResult`` is what ``tieredemb train`` runs; tests call it directly with
a reduced config. On synthetic data the result also carries ``auc_best``, the AUC of the hidden
ground-truth logit on the same eval set, and the job passes when the model recovers at least
``target_fraction`` (90%) of the lift over 0.5: ``auc >= 0.5 + 0.9 * (auc_best - 0.5)``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tieredemb as te
from tieredemb.data import SPARSE_FEATURES, ClickBatch, ClickSource
from tieredemb.data.synthetic import SyntheticClicks, SyntheticConfig
from tieredemb.models import DLRM, DLRMConfig, make_tables
from tieredemb.pipeline import TrainPipeline

logger = logging.getLogger(__name__)

EMB_OPTIMIZERS: dict[str, type[te.optim.EmbeddingOptimizer]] = {
    "sgd": te.optim.SGD,
    "adagrad": te.optim.Adagrad,
    "rowwise_adagrad": te.optim.RowWiseAdagrad,
    "adam": te.optim.Adam,
}


@dataclass
class TrainConfig:
    """Options of the training job (the command line's flags).

    Args:
        steps: training steps (one batch each).
        batch_size: samples per step.
        eval_every: evaluate every this many steps (and always after the last); 0: only at the end.
        lr: learning rate of the dense parameters (Adam).
        emb_optimizer: fused embedding optimizer, one of ``EMB_OPTIMIZERS``.
        emb_lr: its learning rate.
        model: layer sizes.
        seed: seeds the data, the embedding initializer and the MLP initialization.
        device: ``"cpu"`` or ``"cuda"``.
        data: path of a Criteo-format TSV file; ``None``: synthetic data.
        eval_fraction: with ``data``, the tail fraction of the file held out for eval.
        max_rows: with ``data``, read at most this many rows.
        synthetic: the ground truth of the synthetic data (its ``seed`` is replaced by ``seed``).
        target_fraction: the share of the achievable AUC lift over 0.5 the job must recover.
        pipeline: train through ``te.TrainPipeline`` (the next batches' copy and prefetch overlapped
            with the step); the same result as the plain loop.

    Run inside an initialized ``torch.distributed`` default group (``torchrun``, or ``tieredemb
    train --nproc N``), ``train`` shards the embedding tables over the ranks, wraps the dense layers
    in DistributedDataParallel, and gives each rank its slice of every batch (``batch_size`` is the
    global batch): the same function as one process, up to summation order.
    """

    steps: int = 250
    batch_size: int = 4_096
    eval_every: int = 50
    lr: float = 3e-3
    emb_optimizer: str = "rowwise_adagrad"
    emb_lr: float = 0.05
    model: DLRMConfig = field(default_factory=DLRMConfig)
    seed: int = 0
    device: str = "cpu"
    data: str | None = None
    eval_fraction: float = 0.1
    max_rows: int | None = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    target_fraction: float = 0.9
    pipeline: bool = False

    def __post_init__(self) -> None:
        if self.emb_optimizer not in EMB_OPTIMIZERS:
            raise ValueError(
                f"emb_optimizer must be one of {sorted(EMB_OPTIMIZERS)}, got {self.emb_optimizer!r}"
            )
        if self.steps < 1 or self.batch_size < 1 or self.eval_every < 0:
            raise ValueError("steps and batch_size must be >= 1 and eval_every >= 0")


@dataclass
class TrainEvent:
    """What the loop reports to its callback: after every step, and after every evaluation.

    ``loss`` is the step's training loss; ``auc`` and ``eval_loss`` are set on ``"eval"`` events.
    """

    kind: str
    step: int
    loss: float
    auc: float | None = None
    eval_loss: float | None = None


@dataclass
class TrainResult:
    """Summary of a run. ``auc_best``, ``target`` and ``passed`` are None without a ground truth."""

    steps: int
    samples: int
    train_seconds: float
    wall_seconds: float
    loss: float
    auc: float
    auc_best: float | None
    target: float | None
    passed: bool | None
    history: list[TrainEvent] = field(default_factory=list)

    @property
    def samples_per_second(self) -> float:
        """Training throughput (evaluation time excluded)."""
        return self.samples / max(self.train_seconds, 1e-9)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC (Mann-Whitney U, ties counted half). scores, labels: (n,), labels 0/1.

    Raises ``ValueError`` when the labels are all of one class.
    """
    scores = scores.detach().double().flatten().cpu()
    positive = labels.detach().flatten().cpu() > 0.5
    n_pos = int(positive.sum())
    n_neg = positive.numel() - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative labels")
    sorted_scores, order = torch.sort(scores)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()  # 1-based rank of each tie group's last member
    mean_rank = ends - (counts.double() - 1) / 2  # average rank within each tie group
    rank_sum = mean_rank[inverse][positive[order]].sum().item()
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def make_source(config: TrainConfig) -> ClickSource:
    """Synthetic data from ``config.seed``, or the Criteo TSV at ``config.data``."""
    if config.data is None:
        return SyntheticClicks(replace(config.synthetic, seed=config.seed))
    from tieredemb.data.criteo import CriteoClicks

    return CriteoClicks(config.data, eval_fraction=config.eval_fraction, max_rows=config.max_rows)


def make_model(config: TrainConfig, device: torch.device, process_group=None) -> DLRM:
    """The DLRM with its EmbeddingBagCollection and fused embedding optimizer on ``device`` (its
    tables sharded over ``process_group`` when one is given)."""
    tables = make_tables(SPARSE_FEATURES, config.model.embedding_dim)
    optimizer = EMB_OPTIMIZERS[config.emb_optimizer](lr=config.emb_lr)
    ebc = te.EmbeddingBagCollection(tables, optimizer=optimizer, device=device, seed=config.seed,
                                    process_group=process_group)
    with torch.random.fork_rng(devices=[]):  # seed the MLPs without touching the caller's RNG
        torch.manual_seed(config.seed)
        return DLRM(config.model, ebc, SPARSE_FEATURES, device=device)


@torch.no_grad()
def evaluate(
    model: DLRM, data: ClickBatch, device: torch.device, batch_size: int = 16_384
) -> tuple[float, float]:
    """(AUC, mean log loss) of ``model`` on ``data``, in eval mode (read-only embeddings)."""
    model.eval()
    try:
        logits = []
        for start in range(0, len(data), batch_size):
            batch = data.slice(start, start + batch_size).to(device)
            logits.append(model(batch.dense, batch.kjt()).float().cpu())
        scores = torch.cat(logits)
    finally:
        model.train()
    loss = nn.functional.binary_cross_entropy_with_logits(scores, data.labels.float()).item()
    return roc_auc(scores, data.labels), loss


def _batches(source: ClickSource, steps: int, batch_size: int) -> Iterator[ClickBatch]:
    """Training batches 0..steps-1, batch i+1 generated on a worker thread while i trains."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredemb-data") as pool:
        pending = pool.submit(source.train_batch, 0, batch_size)
        for i in range(steps):
            batch = pending.result()
            if i + 1 < steps:
                pending = pool.submit(source.train_batch, i + 1, batch_size)
            yield batch


def click_loss(logits: torch.Tensor, labels: torch.Tensor, global_batch: int | None = None) -> torch.Tensor:
    """Mean BCE over the global batch: this rank's summed loss divided by ``global_batch`` (the
    ranks' losses then add up to the one-process loss; default: this batch alone)."""
    total = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    return total / (labels.shape[0] if global_batch is None else global_batch)


def train_step(model: nn.Module, dense_opt: torch.optim.Optimizer, batch: ClickBatch,
               global_batch: int | None = None) -> float:
    """One step: forward, BCE loss, backward (the embeddings' fused optimizer updates their rows in
    there), then the dense optimizer's step. Returns the loss."""
    logits = model(batch.dense, batch.kjt())
    loss = click_loss(logits, batch.labels, global_batch)
    dense_opt.zero_grad(set_to_none=True)
    loss.backward()
    dense_opt.step()
    return loss.item()


class DLRMLoss(nn.Module):
    """``model(batch) -> loss`` for ``TrainPipeline``: batch is ``{"dense", "sparse", "labels"}``."""

    def __init__(self, dlrm: nn.Module, global_batch: int | None = None) -> None:
        super().__init__()
        self.dlrm = dlrm
        self.global_batch = global_batch

    def forward(self, batch: dict[str, object]) -> torch.Tensor:
        logits = self.dlrm(batch["dense"], batch["sparse"])
        return click_loss(logits, batch["labels"], self.global_batch)


def _sum_gradients(_state, bucket):
    """DDP communication hook: sum the ranks' dense gradients (their losses are already divided by
    the global batch; DDP's default would divide by the world size once more)."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _distributed(config: TrainConfig, device: torch.device):
    """(process group or None, rank, world) of this process; checks the batch splits evenly."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None, 0, 1
    world, rank = dist.get_world_size(), dist.get_rank()
    if config.batch_size % world:
        raise ValueError(f"batch_size {config.batch_size} does not split over {world} ranks")
    return dist.group.WORLD, rank, world


def _pipelined_losses(
    model: nn.Module,
    dense_opt: torch.optim.Optimizer,
    batches: Iterator[ClickBatch],
    device: torch.device,
    segment: int,
    global_batch: int | None = None,
) -> Iterator[float]:
    """The losses of ``TrainPipeline`` steps over ``batches``. The pipeline drains every ``segment``
    steps (0: never), so an evaluation between them finds no batch prefetched ahead."""
    pipeline = TrainPipeline(DLRMLoss(model, global_batch), dense_opt, device=device)
    # the KJT is built once per batch: the pipeline prefetches that object and the model uses it
    inputs = ({"dense": b.dense, "sparse": b.kjt(), "labels": b.labels} for b in batches)
    while True:
        part = itertools.islice(inputs, segment) if segment else inputs
        steps = 0
        while True:
            try:
                loss = pipeline.progress(part)
            except StopIteration:
                break
            steps += 1
            yield loss.item()
        if steps == 0:
            return


def _summed(loss: float, device: torch.device) -> float:
    """The global batch's loss: the ranks' losses added up."""
    t = torch.tensor([loss], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t)


def _ground_truth(eval_set: ClickBatch, fraction: float) -> tuple[float | None, float | None]:
    """(AUC_best, target AUC) from the eval set's true logits, or (None, None) without them."""
    if eval_set.true_logits is None:
        return None, None
    best = roc_auc(eval_set.true_logits, eval_set.labels)
    return best, 0.5 + fraction * (best - 0.5)


def train(config: TrainConfig, callback: Callable[[TrainEvent], None] | None = None) -> TrainResult:
    """Train the DLRM per ``config``; ``callback`` sees a ``TrainEvent`` after each step and eval."""
    wall_start = time.perf_counter()
    device = torch.device(config.device)
    source = make_source(config)
    eval_set = source.eval_set()
    auc_best, target = _ground_truth(eval_set, config.target_fraction)
    group, rank, world = _distributed(config, device)
    model = make_model(config, device, group)
    dense_opt = torch.optim.Adam(model.parameters(), lr=config.lr)
    history: list[TrainEvent] = []
    train_seconds, auc, loss = 0.0, 0.5, float("nan")
    batches = _batches(source, config.steps, config.batch_size)
    trained: nn.Module = model
    if group is not None:  # this rank's slice of each batch; dense gradients summed over the ranks
        local = config.batch_size // world
        batches = (b.slice(rank * local, (rank + 1) * local) for b in batches)
        trained = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        trained.register_comm_hook(None, _sum_gradients)
    global_batch = config.batch_size
    if config.pipeline:
        losses = _pipelined_losses(trained, dense_opt, batches, device, config.eval_every, global_batch)
    else:
        losses = (train_step(trained, dense_opt, batch.to(device), global_batch) for batch in batches)
    if group is not None:
        losses = (_summed(x, device) for x in losses)
    step_start = time.perf_counter()
    for step, loss in enumerate(losses, start=1):
        if callback is not None:
            callback(TrainEvent("step", step, loss))
        last = step == config.steps
        if last or (config.eval_every and step % config.eval_every == 0):
            train_seconds += time.perf_counter() - step_start
            auc, eval_loss = evaluate(model, eval_set, device)
            event = TrainEvent("eval", step, loss, auc, eval_loss)
            history.append(event)
            logger.info("step %d: loss %.4f, eval loss %.4f, eval AUC %.4f", step, loss, eval_loss, auc)
            if callback is not None:
                callback(event)
            step_start = time.perf_counter()
    passed = None if target is None else auc >= target
    return TrainResult(
        steps=config.steps,
        samples=config.steps * config.batch_size,
        train_seconds=train_seconds,
        wall_seconds=time.perf_counter() - wall_start,
        loss=loss,
        auc=auc,
        auc_best=auc_best,
        target=target,
        passed=passed,
        history=history,
    )


__all__ = [
    "EMB_OPTIMIZERS",
    "DLRMLoss",
    "TrainConfig",
    "TrainEvent",
    "TrainResult",
    "click_loss",
    "evaluate",
    "make_model",
    "make_source",
    "roc_auc",
    "train",
    "train_step",
]
