"""The main job: train a small DLRM on click data and report eval AUC.

``train(TrainConfig(...)) -> TrainResult`` is what ``tieredemb train`` runs; tests call it directly with
a reduced config. The data is synthetic (the default), a Criteo-format TSV file, or MovieLens-100k
(ratings of 4 or more as clicks). On synthetic data the result also carries ``auc_best``, the AUC of
the hidden ground-truth logit on the same eval set, and the job passes when the model recovers at least
``target_fraction`` (90%) of the lift over 0.5: ``auc >= 0.5 + 0.9 * (auc_best - 0.5)``. On MovieLens
it carries a baseline's AUC on the same eval set (each movie's click rate in the training part).

The tables live in any storage mode and backing store (``hbm_budget``, ``backing``), may be stashed
during the dense part (``stash``), and a run checkpoints and resumes (``checkpoint_dir``,
``resume``): a resumed run ends where the uninterrupted one ends. ``docs/train.md`` is the guide.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import tieredemb as te
from tieredemb.config import parse_bytes
from tieredemb.data import ClickBatch, ClickSource
from tieredemb.data.synthetic import SyntheticClicks, SyntheticConfig
from tieredemb.models import DLRM, DLRMConfig, make_tables
from tieredemb.pipeline import Stash, StashConfig, TrainPipeline
from tieredemb.storage.errors import ExistingRowsError
from tieredemb.storage.urls import redact
from tieredemb.train_state import TrainState, check_checkpoint_dir, check_shared_dir

logger = logging.getLogger(__name__)

EMB_OPTIMIZERS: dict[str, type[te.optim.EmbeddingOptimizer]] = {
    "sgd": te.optim.SGD,
    "adagrad": te.optim.Adagrad,
    "rowwise_adagrad": te.optim.RowWiseAdagrad,
    "adam": te.optim.Adam,
}


ROW_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``TrainConfig.dtype``'s names of the embedding rows' storage types."""


@dataclass
class TrainConfig:
    """Options of the training job (the command line's flags).

    Args:
        steps: training steps (one batch each), counted from the start of the run (a resumed run
            trains from its checkpoint's step to ``steps``).
        batch_size: samples per step.
        eval_every: evaluate every this many steps (and always after the last); 0: only at the end.
        lr: learning rate of the dense parameters (Adam).
        emb_optimizer: fused embedding optimizer, one of ``EMB_OPTIMIZERS``.
        emb_lr: its learning rate.
        model: layer sizes (``num_dense`` is taken from the data).
        seed: seeds the data, the embedding initializer and the MLP initialization.
        device: ``"cpu"`` or ``"cuda"``.
        data: ``None``: synthetic data; ``"movielens"`` (the files of the installed ``recbole``
            package) or ``"movielens:DIR"``; ``"criteo:PATH"`` or a path: a Criteo-format TSV file.
        eval_fraction: with ``data``, the share held out for eval: the file's tail (Criteo), the
            latest ratings (MovieLens).
        max_rows: with ``data``, read at most this many rows.
        synthetic: the ground truth of the synthetic data (its ``seed`` is replaced by ``seed``).
        target_fraction: the share of the achievable AUC lift over 0.5 the job must recover.
        pipeline: train through ``te.TrainPipeline`` (the next batches' copy and prefetch overlapped
            with the step); the same result as the plain loop.
        hbm_budget: bytes (int or ``"64MiB"``) for the tables' rows and optimizer state on the
            device; ``None``: all on the device. Over budget, the device holds a cache of each table
            over ``backing``.
        backing: the store under the cache: ``"host"`` (host memory, the default), ``"rocksdb:PATH"``
            or a Redis URL ``"redis://HOST:PORT/DB"``. Needs ``hbm_budget``.
        stash: stash every table's device rows to host memory between the lookup and the embedding
            backward (``te.StashConfig``); on the CPU the same copies run and free nothing.
        checkpoint_dir: save a checkpoint there (``te.checkpoint``: the tables, the dense model, its
            optimizer and the step) every ``checkpoint_every`` steps and after the last.
        checkpoint_every: steps between checkpoints; 0: only after the last step.
        resume: load the latest checkpoint of ``checkpoint_dir`` and train on from its step; the
            backing store is cleared and filled from the checkpoint.
        dtype: the embedding rows' storage type: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"``
            (``TableConfig.dtype``: weights and optimizer state in it, stochastic rounding).

    Run inside an initialized ``torch.distributed`` default group (``torchrun``, or ``tieredemb
    train --nproc N``), ``train`` shards the embedding tables over the ranks, wraps the dense layers
    in DistributedDataParallel, and gives each rank its slice of every batch (``batch_size`` is the
    global batch): the same function as one process, up to summation order. Each rank keeps its
    RocksDB store in ``PATH/rank-R`` and its Redis rows under the namespace ``tieredemb-rank-R``.
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
    hbm_budget: int | str | None = None
    backing: str | None = None
    stash: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        if self.dtype not in ROW_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(ROW_DTYPES)}, got {self.dtype!r}")
        if self.emb_optimizer not in EMB_OPTIMIZERS:
            raise ValueError(
                f"emb_optimizer must be one of {sorted(EMB_OPTIMIZERS)}, got {self.emb_optimizer!r}"
            )
        if self.steps < 1 or self.batch_size < 1 or self.eval_every < 0 or self.checkpoint_every < 0:
            raise ValueError("steps and batch_size must be >= 1, eval_every and checkpoint_every >= 0")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.max_rows is not None and self.max_rows < 2:
            raise ValueError(f"max_rows must be >= 2 (rows to train on and to evaluate), got {self.max_rows}")
        self.hbm_budget = parse_bytes(self.hbm_budget)
        if self.backing is not None:
            if self.hbm_budget is None:
                raise ValueError("a backing store (--backing) needs an HBM budget (--hbm-budget): "
                                 "without one every row stays on the device")
            backing_spec(self.backing)  # raises on a malformed one
        if (self.resume or self.checkpoint_every) and self.checkpoint_dir is None:
            raise ValueError("resume and checkpoint_every need a checkpoint directory (--checkpoint-dir)")


MOVIELENS_DEFAULTS: dict[str, float] = {"steps": 60, "emb_lr": 0.02}
"""What ``tieredemb train --data movielens`` trains with unless told otherwise: its 90,000 training
ratings are 22 steps of 4,096, and the eval AUC peaks after about 3 passes (``docs/train.md``)."""


def defaults_for_data(data: str | None) -> dict[str, float]:
    """The options whose default depends on the data (``MOVIELENS_DEFAULTS`` for MovieLens)."""
    return dict(MOVIELENS_DEFAULTS) if data is not None and data.split(":")[0] == "movielens" else {}


def backing_spec(backing: str | None, existing: str = "error", rank: int = 0,
                 world: int = 1) -> te.storage.BackendSpec:
    """``"host"`` (or None), ``"rocksdb:PATH"`` or a ``redis://`` URL as the store's spec for
    this rank (in a group of ``world``: a directory or a key namespace of its own)."""
    if backing is None or backing == "host":
        return te.storage.HostMemory()
    if backing.startswith("rocksdb:"):
        path = backing[len("rocksdb:"):]
        if not path:
            raise ValueError("backing rocksdb:PATH needs a PATH (a directory for the store)")
        if world > 1:
            path = os.path.join(path, f"rank-{rank}")
        return te.storage.RocksDB(path, existing=existing)
    if backing.startswith(("redis://", "rediss://")):
        namespace = "tieredemb" if world == 1 else f"tieredemb-rank-{rank}"
        return te.storage.Redis(backing, existing=existing, namespace=namespace)
    raise ValueError(f"backing must be host, rocksdb:PATH or redis://HOST:PORT/DB, got {redact(backing)!r}")


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
    """Summary of a run. ``auc_best``, ``target`` and ``passed`` are None without a ground truth;
    ``baseline`` and ``baseline_auc`` None where the data has no baseline.

    ``steps`` and ``samples`` count what this run trained (from ``start_step``, the checkpoint's step
    when resumed); ``storage_mode`` is the collection's (``hbm_direct`` or ``cache``);
    ``stashed_bytes`` the most bytes of rows stashed at once (0 without stashing)."""

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
    baseline: str | None = None
    baseline_auc: float | None = None
    start_step: int = 0
    storage_mode: str = "hbm_direct"
    stashed_bytes: int = 0

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
    """The data ``config.data`` names (see ``TrainConfig``). Raises ``FileNotFoundError`` or
    ``ValueError`` with a message naming what is missing or malformed."""
    data = config.data
    if data is None:
        return SyntheticClicks(replace(config.synthetic, seed=config.seed))
    if data == "movielens" or data.startswith("movielens:"):
        from tieredemb.data.movielens import MovieLensClicks, find_movielens

        directory = data[len("movielens:"):] or None
        if directory is None:
            directory = find_movielens()
            if directory is None:
                raise FileNotFoundError("MovieLens-100k not found: pip install --no-deps recbole (its "
                                        "package holds the files), or give movielens:DIR")
        return MovieLensClicks(directory, eval_fraction=config.eval_fraction, seed=config.seed,
                               max_rows=config.max_rows)
    from tieredemb.data.criteo import CriteoClicks

    path = data[len("criteo:"):] if data.startswith("criteo:") else data
    if os.path.isdir(path):
        raise ValueError(f"{path} is a directory, not a Criteo TSV file (MovieLens files: movielens:DIR)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (data: a Criteo TSV file, criteo:PATH, "
                                "movielens or movielens:DIR)")
    return CriteoClicks(path, eval_fraction=config.eval_fraction, max_rows=config.max_rows)


def check_eval_set(eval_set: ClickBatch) -> None:
    """Refuse an eval set AUC cannot be computed on (one class only), before any training."""
    clicks = int(eval_set.labels.sum().item())
    if clicks in (0, len(eval_set)):
        kind = "clicks" if clicks else "non-clicks"
        raise ValueError(f"the eval set's {len(eval_set)} samples are all {kind}: AUC needs both; "
                         "give more data or a larger eval fraction (--eval-fraction)")


def make_model(config: TrainConfig, source: ClickSource, device: torch.device, process_group=None,
               rank: int = 0, world: int = 1) -> DLRM:
    """The DLRM over ``source``'s features, with its EmbeddingBagCollection (storage per ``config``:
    a cache over the backing store when over ``hbm_budget``; its tables sharded over
    ``process_group`` when one is given) and fused embedding optimizer on ``device``."""
    features = source.features
    tables = make_tables([f.name for f in features], config.model.embedding_dim,
                         num_embeddings=[f.num_embeddings for f in features],
                         mean_pooled=[f.name for f in features if f.bag],
                         dtype=ROW_DTYPES[config.dtype])
    optimizer = EMB_OPTIMIZERS[config.emb_optimizer](lr=config.emb_lr)
    storage = None
    if config.hbm_budget is not None:
        # a resumed run fills the store from its checkpoint; a new one refuses a store holding rows
        spec = backing_spec(config.backing, "clear" if config.resume else "error", rank, world)
        storage = te.StorageConfig(hbm_budget=config.hbm_budget, backing=spec)
    try:
        ebc = te.EmbeddingBagCollection(tables, optimizer=optimizer, storage=storage, device=device,
                                        seed=config.seed, process_group=process_group)
    except ExistingRowsError as e:
        raise ExistingRowsError(f"backing store {redact(config.backing)} already holds rows of an "
                                "earlier run: resume it from its checkpoint (--resume), or give an empty "
                                "store") from e
    with torch.random.fork_rng(devices=[]):  # seed the MLPs without touching the caller's RNG
        torch.manual_seed(config.seed)
        dims = replace(config.model, num_dense=source.num_dense)
        return DLRM(dims, ebc, [f.name for f in features], device=device)


def _inputs(batch: ClickBatch, keys: list[str]) -> dict[str, object]:
    """``{"dense", "sparse", "labels"}`` of a host batch: the KJT built on the host (the bags' id
    count is data-dependent: on the device it would wait for the device)."""
    return {"dense": batch.dense, "sparse": batch.kjt(keys), "labels": batch.labels}


def _to(inputs: dict[str, object], device: torch.device) -> dict[str, object]:
    return {name: value.to(device) for name, value in inputs.items()}


@torch.no_grad()
def evaluate(
    model: DLRM, data: ClickBatch, device: torch.device, batch_size: int = 16_384
) -> tuple[float, float]:
    """(AUC, mean log loss) of ``model`` on ``data`` (a host batch), in eval mode (read-only
    embeddings)."""
    model.eval()
    try:
        logits = []
        for start in range(0, len(data), batch_size):
            batch = _to(_inputs(data.slice(start, start + batch_size), model.feature_names), device)
            logits.append(model(batch["dense"], batch["sparse"]).float().cpu())
        scores = torch.cat(logits)
    finally:
        model.train()
    loss = nn.functional.binary_cross_entropy_with_logits(scores, data.labels.float()).item()
    return roc_auc(scores, data.labels), loss


def _batches(source: ClickSource, start: int, steps: int, batch_size: int) -> Iterator[ClickBatch]:
    """Training batches start..steps-1, batch i+1 generated on a worker thread while i trains."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredemb-data") as pool:
        pending = pool.submit(source.train_batch, start, batch_size)
        for i in range(start, steps):
            batch = pending.result()
            if i + 1 < steps:
                pending = pool.submit(source.train_batch, i + 1, batch_size)
            yield batch


def click_loss(logits: torch.Tensor, labels: torch.Tensor, global_batch: int | None = None) -> torch.Tensor:
    """Mean BCE over the global batch: this rank's summed loss divided by ``global_batch`` (the
    ranks' losses then add up to the one-process loss; default: this batch alone)."""
    total = nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
    return total / (labels.shape[0] if global_batch is None else global_batch)


class DLRMLoss(nn.Module):
    """``model(batch) -> loss`` for ``TrainPipeline``: batch is ``{"dense", "sparse", "labels"}``."""

    def __init__(self, dlrm: nn.Module, global_batch: int | None = None) -> None:
        super().__init__()
        self.dlrm = dlrm
        self.global_batch = global_batch

    def forward(self, batch: dict[str, object]) -> torch.Tensor:
        logits = self.dlrm(batch["dense"], batch["sparse"])
        return click_loss(logits, batch["labels"], self.global_batch)


def train_step(model: DLRMLoss, dense_opt: torch.optim.Optimizer, batch: dict[str, object],
               stash: Stash | None = None) -> float:
    """One step on ``batch`` (``{"dense", "sparse", "labels"}`` on the model's device): forward, BCE
    loss, backward (the embeddings' fused optimizer updates their rows in there), then the dense
    optimizer's step. With ``stash``, the forward runs inside its tracking. Returns the loss."""
    with stash.tracking() if stash is not None else contextlib.nullcontext():
        loss = model(batch)
    dense_opt.zero_grad(set_to_none=True)
    loss.backward()
    dense_opt.step()
    return loss.item()


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


def _stash_config(model: DLRM) -> StashConfig:
    """Every table: in a cache too (its next prefetch then works on the host copy)."""
    return StashConfig(tables=[t.name for t in model.ebc.table_configs])


def _pipelined_losses(model: DLRMLoss, dense_opt: torch.optim.Optimizer, inputs: Iterator[dict],
                      device: torch.device, start: int, every: int,
                      stash: StashConfig | None) -> Iterator[float]:
    """The losses of ``TrainPipeline`` steps ``start + 1, ...`` over ``inputs``. The pipeline drains
    at every step that is a multiple of ``every`` (0: never), so an evaluation there finds no batch
    prefetched ahead."""
    pipeline = TrainPipeline(model, dense_opt, device=device, stash=stash)
    step = start
    try:
        while True:
            part = itertools.islice(inputs, every - step % every) if every else inputs
            before = step
            while True:
                try:
                    loss = pipeline.progress(part)
                except StopIteration:
                    break
                step += 1
                yield loss.item()
            if step == before:
                return
    finally:
        pipeline.close()


def _plain_losses(model: DLRMLoss, dense_opt: torch.optim.Optimizer, inputs: Iterator[dict],
                  device: torch.device, stash: Stash | None) -> Iterator[float]:
    """The losses of plain steps over ``inputs``; ``stash`` (if any) is closed at the end."""
    try:
        for batch in inputs:
            yield train_step(model, dense_opt, _to(batch, device), stash)
    finally:
        if stash is not None:
            stash.close()


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


@dataclass
class _Run:
    """What a run is made of, built before its first step."""

    config: TrainConfig
    device: torch.device
    source: ClickSource
    eval_set: ClickBatch
    model: DLRM
    state: TrainState
    dense_opt: torch.optim.Optimizer
    group: object
    rank: int
    world: int
    start: int

    def losses(self) -> Iterator[float]:
        """The losses of steps ``start + 1 .. steps``."""
        config, device = self.config, self.device
        batches = _batches(self.source, self.start, config.steps, config.batch_size)
        trained: nn.Module = self.model
        if self.group is not None:  # this rank's slice of each batch; dense gradients summed over ranks
            local = config.batch_size // self.world
            batches = (b.slice(self.rank * local, (self.rank + 1) * local) for b in batches)
            trained = DistributedDataParallel(self.model,
                                              device_ids=[device.index] if device.type == "cuda" else None)
            trained.register_comm_hook(None, _sum_gradients)
        inputs = (_inputs(b, self.model.feature_names) for b in batches)
        loss_model = DLRMLoss(trained, config.batch_size)
        stash = _stash_config(self.model) if config.stash else None
        if config.pipeline:
            losses = _pipelined_losses(loss_model, self.dense_opt, inputs, device, self.start,
                                       config.eval_every, stash)
        else:
            stasher = Stash([self.model.ebc], stash, loss_model) if stash is not None else None
            losses = _plain_losses(loss_model, self.dense_opt, inputs, device, stasher)
        if self.group is not None:
            losses = (_summed(x, device) for x in losses)
        return losses

    def checkpoint_due(self, step: int) -> bool:
        every = self.config.checkpoint_every
        return self.config.checkpoint_dir is not None and (
            step == self.config.steps or (every > 0 and step % every == 0))


def _prepare(config: TrainConfig) -> _Run:
    """Read the data, check it, build the model (open its store) and, resuming, load the checkpoint."""
    device = torch.device(config.device)
    group, rank, world = _distributed(config, device)
    if config.checkpoint_dir is not None:
        if group is not None:  # every rank writes into one directory (on several nodes: shared)
            check_shared_dir(config.checkpoint_dir, group)
        check_checkpoint_dir(config.checkpoint_dir, config.resume)
    source = make_source(config)
    eval_set = source.eval_set()
    check_eval_set(eval_set)
    model = make_model(config, source, device, group, rank, world)
    try:
        dense_opt = torch.optim.Adam(model.parameters(), lr=config.lr)
        state = TrainState(model, dense_opt)
        start = 0
        if config.resume:
            start = state.load(config.checkpoint_dir)
            if start >= config.steps:
                raise ValueError(f"the checkpoint in {config.checkpoint_dir} is at step {start}: nothing "
                                 f"to train up to step {config.steps} (give more --steps)")
    except BaseException:
        model.ebc.close()
        raise
    return _Run(config, device, source, eval_set, model, state, dense_opt, group, rank, world, start)


def train(config: TrainConfig, callback: Callable[[TrainEvent], None] | None = None) -> TrainResult:
    """Train the DLRM per ``config``; ``callback`` sees a ``TrainEvent`` after each step and eval.

    Every check of the data (files, formats, an eval set of one class) and of the options is made
    before the first step: a problem raises ``ValueError`` (or ``FileNotFoundError``, ``OSError``,
    ``te.storage.BackendError`` for a store that cannot be opened) naming it."""
    wall_start = time.perf_counter()
    run = _prepare(config)
    try:
        return _train(run, callback, wall_start)
    finally:
        run.model.ebc.close()  # flush and release the backing store (its directory, its lease)


def _train(run: _Run, callback: Callable[[TrainEvent], None] | None, wall_start: float) -> TrainResult:
    config, model = run.config, run.model
    auc_best, target = _ground_truth(run.eval_set, config.target_fraction)
    baseline = run.source.baseline()
    history: list[TrainEvent] = []
    train_seconds, auc, loss = 0.0, 0.5, float("nan")
    step_start = time.perf_counter()
    stash = None  # the te.Stash attached to the collection while training (it detaches at the end)
    for step, loss in enumerate(run.losses(), start=run.start + 1):
        stash = model.ebc.stash or stash
        if callback is not None:
            callback(TrainEvent("step", step, loss))
        last = step == config.steps
        if last or (config.eval_every and step % config.eval_every == 0):
            train_seconds += time.perf_counter() - step_start
            auc, eval_loss = evaluate(model, run.eval_set, run.device)
            event = TrainEvent("eval", step, loss, auc, eval_loss)
            history.append(event)
            logger.info("step %d: loss %.4f, eval loss %.4f, eval AUC %.4f", step, loss, eval_loss, auc)
            if callback is not None:
                callback(event)
            step_start = time.perf_counter()
        if run.checkpoint_due(step):
            run.state.save(config.checkpoint_dir, step)
    steps = config.steps - run.start
    return TrainResult(
        steps=steps,
        samples=steps * config.batch_size,
        train_seconds=train_seconds,
        wall_seconds=time.perf_counter() - wall_start,
        loss=loss,
        auc=auc,
        auc_best=auc_best,
        target=target,
        passed=None if target is None else auc >= target,
        history=history,
        baseline=None if baseline is None else baseline.name,
        baseline_auc=None if baseline is None else roc_auc(baseline.scores, run.eval_set.labels),
        start_step=run.start,
        storage_mode=model.ebc.storage_mode,
        stashed_bytes=0 if stash is None else stash.stats["stashed_bytes"],
    )


__all__ = [
    "EMB_OPTIMIZERS",
    "DLRMLoss",
    "TrainConfig",
    "TrainEvent",
    "TrainResult",
    "MOVIELENS_DEFAULTS",
    "backing_spec",
    "check_eval_set",
    "defaults_for_data",
    "click_loss",
    "evaluate",
    "make_model",
    "make_source",
    "roc_auc",
    "train",
    "train_step",
]
