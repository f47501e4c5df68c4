"""The ``hbm`` workload (DESIGN section 7): every table in device memory, ours against its peers.

10 tables x 1.68M rows x D=128 fp32, batch 10,486 with one 10-id bag per table (1,048,600 lookups a
step), Zipf alpha 1.05 over scrambled raw ids (``workloads.HbmBatches``). Per optimizer, in one process
and on the same batches:

    ours    te.EmbeddingBagCollection over raw ids (num_embeddings=None); a step is
            prefetch + forward + backward of a fixed upstream gradient (the fused update runs inside);
            with ``pipeline``, also under te.TrainPipeline (batch i+1's prefetch between forward i
            and backward i, its host read deferred to forward i+1; its mean step is both columns)
    peer    one torch.nn.EmbeddingBag(rows, D, mode="sum", sparse=True) per table, indexed by the Zipf
            rank, with torch.optim.SGD | Adagrad | SparseAdam; a step is forward + backward +
            optimizer.step + zero_grad. Its initial weights are ours' initial rows of the same keys.
    floor   the bytes a step must move / the measured device copy bandwidth (``floor_bytes``)

With ``capacity``, ours runs again with bounded tables (``max_capacity=capacity`` each, DynamicEmb's
case): no row stored first, so every step inserts the keys it misses and, once a bucket is full, evicts
its least recently used rows. A dense peer does not compute that function (an evicted row starts again
from its initial row), so these runs are held to ours' pure-torch reference kernels run on the same
bounded tables and batches (``compare_bounded``): the same misses and evictions, the same keys stored,
the same rows.

Steps are timed one at a time after ``warmup`` untimed ones (CUDA events, the queue drained before
each step; perf_counter on CPU) and summarized by the median; then as many more run back to back (the
host ahead of the device, as in training) and their mean is the "b2b ms" column. Ours runs first and
is freed before the peer is built; then the rows ours trained are checked (``compare_rows``): same
batches, same initial rows and the same optimizer must give the same rows (DESIGN section 2). For SGD
both ours and the peer are held to the exact rows, summed in float64 from the batches alone
(``sgd_reference``): the peer's fp32 rounding is itself ~1e-4 of a hot row's travel, so it is reported,
not trusted. For Adam ours is held to the peer's rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

import torch

import tieredemb as te
from tieredemb.bench.hbm_checks import (
    HbmRowCheck,
    RowSnapshot,
    check_ranks,
    compare_bounded,
    compare_rows,
    snapshot_rows,
)
from tieredemb.bench.hbm_tbe import HbmTbeRace, tbe_targets
from tieredemb.bench.report import (
    Measurement,
    Target,
    fill_ratios,
    host_rss_bytes,
    peak_host_rss_bytes,
)
from tieredemb.bench.tbe import PRECISIONS, TbeSpec, unavailable
from tieredemb.bench.timing import (
    free_memory,
    measure_copy_bandwidth,
    peak_device_bytes,
    reset_peak,
    synchronize,
    time_ms,
)
from tieredemb.bench.workloads import HbmBatch, HbmBatches, HbmShape, scramble

# optimizer name -> (ours, nn.EmbeddingBag's torch.optim peer or None (torch has no row-wise Adagrad),
# its kwargs: lr and eps, FBGEMM's TBE's too), at learning rates that move rows visibly
OPTIMIZERS: dict[str, tuple[Callable[[], te.optim.EmbeddingOptimizer], type | None, dict]] = {
    "sgd": (lambda: te.optim.SGD(lr=0.01), torch.optim.SGD, {"lr": 0.01}),
    "adagrad": (lambda: te.optim.Adagrad(lr=0.01), torch.optim.Adagrad, {"lr": 0.01, "eps": 1e-10}),
    "rowwise_adagrad": (lambda: te.optim.RowWiseAdagrad(lr=0.01), None, {"lr": 0.01, "eps": 1e-8}),
    "adam": (lambda: te.optim.Adam(lr=0.001), torch.optim.SparseAdam, {"lr": 0.001, "eps": 1e-8}),
}

ROW_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

FLOOR_FORMULA = (
    "bytes/step = U * (D + S) * 4 * 2   (each unique key's row, weights + optimizer state, read and "
    "written once; U = unique keys summed over tables, S = state floats per row: SGD 0, Adagrad D, "
    "Adam 2D) + N * 8 (the N int64 ids read) + B*T*D*4 (pooled output written) + B*T*D*4 (its "
    "gradient read); floor ms = bytes / copy bandwidth, the bandwidth being (bytes read + bytes "
    "written) / time of a large device-to-device copy"
)



@dataclass
class HbmOptions:
    """What ``tieredemb bench hbm`` runs. kernels: one entry per "ours" configuration."""

    shape: HbmShape = field(default_factory=HbmShape)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    optimizers: list[str] = field(default_factory=lambda: ["sgd", "adam"])
    kernels: list[str] = field(default_factory=lambda: ["auto"])
    steps: int = 50
    warmup: int = 10
    seed: int = 0
    preinsert: bool = True  # every row stored before timing, as the peer's dense tables are
    pipeline: bool = False  # each "ours" also under te.TrainPipeline
    capacity: int | None = None  # each "ours" also with tables of this max_capacity (bounded)
    init_capacity: int | None = None  # each table's init_capacity (at most its max_capacity)
    tbe: bool = True  # FBGEMM's TBE in turns with ours, where fbgemm_gpu imports (``hbm_tbe``)
    tbe_precision: str = "fp32"  # TBE's rows: "fp32" | "fp16"
    turn: int = 10  # steps a block when timed in turns with TBE
    dtype: str = "fp32"  # ours' rows: "fp32" | "bf16" | "fp16" (16-bit: no row check)

    def __post_init__(self) -> None:
        unknown = [o for o in self.optimizers if o not in OPTIMIZERS]
        if unknown:
            raise ValueError(f"unknown optimizers {unknown}; choose from {sorted(OPTIMIZERS)}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"need steps >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")
        if self.capacity is not None and (not isinstance(self.capacity, int) or self.capacity < 1):
            raise ValueError(f"capacity must be None or an int >= 1, got {self.capacity!r}")
        if self.init_capacity is not None and (not isinstance(self.init_capacity, int)
                                               or not 1 <= self.init_capacity <= self.shape.rows):
            raise ValueError(f"init_capacity must be None or an int in [1, {self.shape.rows}] (the "
                             f"tables' rows), got {self.init_capacity!r}")
        if self.tbe_precision not in PRECISIONS:
            raise ValueError(f"tbe_precision must be one of {PRECISIONS}, got {self.tbe_precision!r}")
        if self.turn < 1:
            raise ValueError(f"turn must be >= 1 steps, got {self.turn}")
        if self.dtype not in ROW_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(ROW_DTYPES)}, got {self.dtype!r}")
        if self.dtype != "fp32" and self.capacity is not None:
            raise ValueError("capacity: bounded tables are checked row for row; run them with fp32 rows")

    @property
    def row_dtype(self) -> torch.dtype:
        return ROW_DTYPES[self.dtype]


def run_steps(step: Callable[[HbmBatch], None], batches: HbmBatches, opts: HbmOptions,
              on_timed_start: Callable[[], None] | None = None) -> tuple[list[float], list[int]]:
    """Warmup, then timed steps. Returns step ms and unique keys (all tables) of the timed steps.
    Batches are generated outside the timed region."""
    times, unique = [], []
    for i in range(opts.warmup + opts.steps):
        if i == opts.warmup and on_timed_start is not None:
            on_timed_start()
        batch = batches.batch(i)
        ms = time_ms(lambda b=batch: step(b), opts.device)
        if i >= opts.warmup:
            times.append(ms)
            unique.append(sum(batch.unique_keys))
    return times, unique


def run_back_to_back(step: Callable[[HbmBatch], None], batches: HbmBatches, opts: HbmOptions) -> float:
    """Mean ms a step of ``opts.steps`` more steps (after the timed ones) run back to back: the host
    free to run ahead of the device, as in training (the timed steps each start on an empty queue).
    The batches are made first."""
    first = opts.warmup + opts.steps
    todo = [batches.batch(i) for i in range(first, first + opts.steps)]
    synchronize(opts.device)
    t0 = time.perf_counter()
    for batch in todo:
        step(batch)
    synchronize(opts.device)
    return (time.perf_counter() - t0) / len(todo) * 1e3


def upstream_grad(shape: HbmShape, device: torch.device, seed: int) -> torch.Tensor:
    """The fixed dL/d(pooled output) of every step: float32 (B, T*D), features in table order.

    Same-sign entries in [0.005, 0.015): a hot key sums ~10^4 of them a step. With signed entries
    that sum cancels, and its fp32 rounding error (~eps * sqrt(n) * sum|g| / |sum g|, about 4e-4
    relative, measured on the H200) differs between any two summation orders, ours and the peer's
    alike, beyond any tolerance that would still catch a wrong row. Same-sign sums are well
    conditioned, so the row check can stay tight."""
    gen = torch.Generator(device=device).manual_seed(seed + 17)
    g = torch.rand(shape.batch_size, shape.num_tables * shape.dim, generator=gen, device=device)
    return (g + 0.5) * 1e-2


# ------------------------------------------------------------------------------ configurations
def ours_label(kernels: str, pipelined: bool = False, capacity: int | None = None) -> str:
    """How the table names one configuration of ours (``kernels``: the kernels' name)."""
    return ("ours (" + ", ".join([f"{kernels} kernels"] + (["TrainPipeline"] if pipelined else [])
                                + ([f"max_capacity {capacity}"] if capacity is not None else [])) + ")")


def ours_name(kernels: str, pipelined: bool = False, capacity: int | None = None) -> str:
    """The short name of one configuration of ours, as its row check names it."""
    return kernels + ("+pipeline" if pipelined else "") + ("" if capacity is None else f"+cap{capacity}")


def run_ours(opts: HbmOptions, optimizer: str, kernels: str, batches: HbmBatches,
             grad: torch.Tensor, capacity: int | None = None) -> tuple[Measurement, RowSnapshot]:
    """Ours: prefetch + forward + backward (fused update) per step; then a snapshot of its rows.
    ``capacity``: every table bounded to it (``max_capacity``), none stored first. The collection is
    gone (and its memory freed) when this returns."""
    reset_peak(opts.device)
    result = _train_ours(opts, optimizer, kernels, batches, grad, capacity)
    free_memory(opts.device)
    return result


def build_ours(opts: HbmOptions, optimizer: str, kernels: str,
               capacity: int | None) -> te.EmbeddingBagCollection:
    init = opts.init_capacity if capacity is None or opts.init_capacity is None else \
        min(opts.init_capacity, capacity)
    configs = [dataclasses.replace(c, max_capacity=capacity, init_capacity=init, dtype=opts.row_dtype)
               for c in opts.shape.table_configs()]
    ebc = te.EmbeddingBagCollection(configs, optimizer=OPTIMIZERS[optimizer][0](),
                                    device=opts.device, seed=opts.seed, kernels=kernels)
    if opts.preinsert and capacity is None:  # a bounded table starts empty: its steps insert and evict
        preinsert_rows(ebc, opts.shape, opts.device, opts.seed)
    return ebc


def _counters(ebc: te.EmbeddingBagCollection) -> tuple[int, int]:
    """(misses, evictions) over every table so far."""
    stats = ebc.stats().values()
    return sum(s.misses for s in stats), sum(s.evictions for s in stats)


def _per_step(m: Measurement, ebc: te.EmbeddingBagCollection, before: tuple[int, int],
              steps: int) -> None:
    """Misses (``new_keys_per_step``) and evictions a step since ``before`` into ``m``."""
    misses, evictions = _counters(ebc)
    m.new_keys_per_step = (misses - before[0]) / steps
    m.extra["evictions_per_step"] = (evictions - before[1]) / steps


def _train_ours(opts: HbmOptions, optimizer: str, kernels: str, batches: HbmBatches,
                grad: torch.Tensor, capacity: int | None) -> tuple[Measurement, RowSnapshot]:
    shape, dev = opts.shape, opts.device
    ebc = build_ours(opts, optimizer, kernels, capacity)
    name = getattr(ebc.kernels, "name", type(ebc.kernels).__name__)
    m = Measurement("ours", optimizer, ours_label(name, capacity=capacity),
                    kernels=ours_name(name, capacity=capacity))

    def step(batch: HbmBatch) -> None:
        ebc.prefetch(batch.kjt)
        ebc(batch.kjt).values().backward(grad)

    before = {}
    times, unique = run_steps(step, batches, opts, lambda: before.setdefault("counters", _counters(ebc)))
    synchronize(dev)
    m.set_times(times, shape.lookups)
    m.unique_keys_per_step = statistics.mean(unique)
    _per_step(m, ebc, before["counters"], opts.steps)
    m.back_to_back_ms = run_back_to_back(step, batches, opts)
    return m, _finish_ours(m, ebc, opts, capacity)


class _WithUpstreamGrad(torch.autograd.Function):
    """A zero scalar whose backward gives ``out`` the fixed gradient ``grad``: the plain step's
    ``out.backward(grad)`` in the shape of a loss, with no kernel over the output (``(out *
    grad).sum()`` and its backward read and wrote the 54 MB output three times, ~0.15 ms a step)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.grad = grad
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, _: torch.Tensor):
        return ctx.grad, None


class UpstreamLoss(torch.nn.Module):
    """The bench's step as a model for ``te.TrainPipeline``: its "loss" hands the output the fixed
    upstream gradient, as the plain step's ``backward(grad)`` does. ``unused`` is the dense
    optimizer's parameter (the model has no other)."""

    def __init__(self, ebc: te.EmbeddingBagCollection, grad: torch.Tensor) -> None:
        super().__init__()
        self.ebc = ebc
        self.grad = grad
        self.unused = torch.nn.Parameter(torch.zeros(1, device=grad.device))

    def forward(self, batch: dict) -> torch.Tensor:
        return _WithUpstreamGrad.apply(self.ebc(batch["kjt"]).values(), self.grad)


def run_ours_pipelined(opts: HbmOptions, optimizer: str, kernels: str, batches: HbmBatches,
                       grad: torch.Tensor, capacity: int | None = None) -> tuple[Measurement, RowSnapshot]:
    """Ours under ``te.TrainPipeline`` (its default, inline prefetch) on the same batches as the plain
    run (warmup, then the timed and back-to-back ones, all timed here): the mean step of a pipeline,
    whose next batch's device work runs beside the step and whose host read waits for that batch's
    forward. The collection is gone (and its memory freed) when this returns."""
    reset_peak(opts.device)
    result = _train_pipelined(opts, optimizer, kernels, batches, grad, capacity)
    free_memory(opts.device)
    return result


def _train_pipelined(opts: HbmOptions, optimizer: str, kernels: str, batches: HbmBatches,
                     grad: torch.Tensor, capacity: int | None) -> tuple[Measurement, RowSnapshot]:
    ebc = build_ours(opts, optimizer, kernels, capacity)
    name = getattr(ebc.kernels, "name", type(ebc.kernels).__name__)
    m = Measurement("ours", optimizer, ours_label(name, True, capacity),
                    kernels=ours_name(name, True, capacity))
    model = UpstreamLoss(ebc, grad)
    pipe = te.TrainPipeline(model, torch.optim.SGD([model.unused], lr=0.0), device=opts.device)
    todo = [batches.batch(i) for i in range(opts.warmup + 2 * opts.steps)]
    data = [{"kjt": b.kjt} for b in todo]

    def train(part: list[dict]) -> None:
        it = iter(part)
        with contextlib.suppress(StopIteration):
            while True:
                pipe.progress(it)

    train(data[: opts.warmup])
    synchronize(opts.device)
    before = _counters(ebc)
    t0 = time.perf_counter()
    train(data[opts.warmup :])
    synchronize(opts.device)
    ms = (time.perf_counter() - t0) / (2 * opts.steps) * 1e3
    m.set_times([ms], opts.shape.lookups)
    m.back_to_back_ms = ms
    m.unique_keys_per_step = statistics.mean(sum(b.unique_keys) for b in todo[opts.warmup :])
    _per_step(m, ebc, before, 2 * opts.steps)
    return m, _finish_ours(m, ebc, opts, capacity)


def _finish_ours(m: Measurement, ebc: te.EmbeddingBagCollection, opts: HbmOptions,
                 capacity: int | None) -> RowSnapshot:
    """Memory and storage figures into ``m``; the snapshot of the rows ``ebc`` trained (its tables
    bounded to ``capacity``, or not)."""
    shape, dev = opts.shape, opts.device
    m.peak_device_bytes = peak_device_bytes(dev)
    m.host_rss_bytes = host_rss_bytes()
    stats = ebc.stats()
    m.extra.update({"storage_mode": ebc.storage_mode,
                    "rows_stored": sum(s.rows["device"] for s in stats.values()),
                    "row_memory_bytes": sum(s.memory_bytes.get("device", 0) for s in stats.values()),
                    "peak_host_rss_bytes": peak_host_rss_bytes()})
    snap = snapshot_rows(ebc, shape, dev, opts.seed, m.kernels)
    snap.preinserted, snap.table_rows = opts.preinsert and capacity is None, shape.rows
    return snap


def preinsert_rows(ebc: te.EmbeddingBagCollection, shape: HbmShape, device: torch.device,
                   seed: int) -> None:
    """Store every key of every table with its initial row (the values a first lookup would give),
    so that the timed steps are the steady state of a full table, like the peer's."""
    for t, config in enumerate(shape.table_configs()):
        for lo in range(0, shape.rows, 1 << 18):
            ranks = torch.arange(lo, min(lo + (1 << 18), shape.rows), device=device)
            ebc.write(config.name, scramble(ranks, t), initial_rows(config, t, ranks, seed))


def build_peer(shape: HbmShape, device: torch.device, seed: int) -> list[torch.nn.EmbeddingBag]:
    """One nn.EmbeddingBag per table, its row r = ours' initial row of key scramble(r)."""
    peers = []
    for t, config in enumerate(shape.table_configs()):
        weight = torch.empty(shape.rows, shape.dim, dtype=torch.float32, device=device)
        for lo in range(0, shape.rows, 1 << 18):
            ranks = torch.arange(lo, min(lo + (1 << 18), shape.rows), device=device)
            weight[lo : lo + ranks.numel()] = initial_rows(config, t, ranks, seed)
        peers.append(torch.nn.EmbeddingBag.from_pretrained(weight, freeze=False, mode="sum",
                                                           sparse=True))
    return peers


def peer_label(optimizer: str) -> str:
    peer = OPTIMIZERS[optimizer][1]
    return f"nn.EmbeddingBag + {peer.__name__ if peer else 'no torch.optim'}"


def initial_rows(config: te.TableConfig, t: int, ranks: torch.Tensor, seed: int) -> torch.Tensor:
    """float32 (k, D): ours' initial rows of ranks (int64 (k,)) in table ``t`` (a pure function of
    seed, table name and key: DESIGN section 2)."""
    return config.initializer.rows(seed, config.name, scramble(ranks, t), config.embedding_dim)


def run_peer(opts: HbmOptions, optimizer: str, batches: HbmBatches, grad: torch.Tensor,
             snapshots: list[RowSnapshot]) -> tuple[Measurement, list[HbmRowCheck]]:
    """The peer: forward + backward + optimizer.step + zero_grad; then its rows against ours'.
    The peer is gone (and its memory freed) when this returns."""
    reset_peak(opts.device)
    result = _train_peer(opts, optimizer, batches, grad, snapshots)
    free_memory(opts.device)
    return result


def _train_peer(opts: HbmOptions, optimizer: str, batches: HbmBatches, grad: torch.Tensor,
                snapshots: list[RowSnapshot]) -> tuple[Measurement, list[HbmRowCheck]]:
    shape, dev = opts.shape, opts.device
    peers = build_peer(shape, dev, opts.seed)
    _, peer_class, peer_kwargs = OPTIMIZERS[optimizer]
    opt = peer_class([p.weight for p in peers], **peer_kwargs)
    m = Measurement("peer", optimizer, peer_label(optimizer))

    def step(batch: HbmBatch) -> None:
        out = torch.cat([emb(batch.ranks[t]) for t, emb in enumerate(peers)], dim=1)  # (B, T*D)
        out.backward(grad)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, unique = run_steps(step, batches, opts)
    synchronize(dev)
    m.set_times(times, shape.lookups)
    m.back_to_back_ms = run_back_to_back(step, batches, opts)
    m.unique_keys_per_step = statistics.mean(unique)
    m.peak_device_bytes = peak_device_bytes(dev)
    m.host_rss_bytes = host_rss_bytes()
    weights = [p.weight.detach() for p in peers]
    # every snapshot holds the rows at check_ranks: one exact reference serves them all
    exact = (sgd_reference(opts, batches, grad, check_ranks(shape, opts.seed))
             if optimizer == "sgd" and snapshots else None)
    return m, [check_against_peer(opts, optimizer, snap, weights, batches, exact) for snap in snapshots]


def check_against_peer(opts: HbmOptions, optimizer: str, snap: RowSnapshot,
                       weights: list[torch.Tensor], batches: HbmBatches,
                       exact: list[torch.Tensor] | None = None) -> HbmRowCheck:
    """``compare_rows`` of ours' snapshot, the peer's weights (float32 (rows, D) per table) and, for
    SGD, the exact rows at the snapshot's ranks (float64 (k, D) host per table)."""
    dev, configs = opts.device, opts.shape.table_configs()
    ranks = [r.to(dev) for r in snap.ranks]
    peer_rows = [w[r].cpu() for w, r in zip(weights, ranks)]
    initial = [initial_rows(configs[t], t, r, opts.seed).cpu() for t, r in enumerate(ranks)]
    seen = [batches.seen[t][r].cpu() for t, r in enumerate(ranks)]
    return compare_rows(optimizer, snap, peer_rows, initial, seen, batches.seen.sum(dim=1).tolist(),
                        exact)


def sgd_reference(opts: HbmOptions, batches: HbmBatches, grad: torch.Tensor,
                  ranks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The exact rows SGD trains at ``ranks`` (int64 (k,) host per table): float64 (k, D) host each.

    For SGD a row's path does not depend on the forward: after every step run (warmup included),
    row = initial - lr * (the sum, over steps and over the row's occurrences, of the upstream gradient
    of the occurrence's bag). Summed in float64 for the checked rows only: (k, D) per table, not the
    table (at full scale ~250k of its 1.68M rows).
    """
    shape, dev = opts.shape, opts.device
    lr = OPTIMIZERS["sgd"][2]["lr"]
    slots, sums = [], []
    for r in ranks:
        slot = torch.full((shape.rows,), -1, dtype=torch.int64, device=dev)  # rank -> row of sums
        slot[r.to(dev)] = torch.arange(r.numel(), device=dev)
        slots.append(slot)
        sums.append(torch.zeros(r.numel(), shape.dim, dtype=torch.float64, device=dev))
    grad64 = grad.double().view(shape.batch_size, shape.num_tables, shape.dim)  # (B, T, D)
    for i in range(opts.warmup + 2 * opts.steps):  # warmup, timed, back to back
        ranks_i = batches.batch(i).ranks  # (T, B, L)
        for t in range(shape.num_tables):
            pos = slots[t][ranks_i[t]]  # (B, L): row of sums, -1 where the rank is not checked
            bag, j = (pos >= 0).nonzero(as_tuple=True)
            sums[t].index_add_(0, pos[bag, j], grad64[bag, t])
    configs = shape.table_configs()
    return [(initial_rows(configs[t], t, r.to(dev), opts.seed).double() - lr * s).cpu()
            for t, (r, s) in enumerate(zip(ranks, sums))]


def floor_measurement(opts: HbmOptions, optimizer: str, batches: HbmBatches,
                      bandwidth: float) -> Measurement:
    """The bandwidth floor of the timed steps (``FLOOR_FORMULA``)."""
    shape = opts.shape
    unique = [sum(batches.batch(i).unique_keys)
              for i in range(opts.warmup, opts.warmup + opts.steps)]
    parts = floor_bytes(shape, OPTIMIZERS[optimizer][0](), statistics.mean(unique),
                        opts.row_dtype.itemsize)
    m = Measurement("floor", optimizer, "bandwidth floor")
    m.set_times([sum(parts.values()) / bandwidth * 1e3], shape.lookups)
    m.unique_keys_per_step = statistics.mean(unique)
    m.extra = {"bytes_per_step": parts, "bandwidth_bytes_per_s": bandwidth,
               # DESIGN section 7's published floors also count each lookup's weight read
               # (N * D * 4) and leave out the gradient read: here for comparison
               "lookup_read_bytes": shape.lookups * shape.dim * 4}
    return m


def floor_bytes(shape: HbmShape, optimizer: te.optim.EmbeddingOptimizer,
                unique_keys: float, value_bytes: int = 4) -> dict[str, float]:
    """Bytes one step must move, by part (``FLOOR_FORMULA``)."""
    row_bytes = (shape.dim + optimizer.state_width(shape.dim)) * value_bytes
    pooled = shape.batch_size * shape.num_tables * shape.dim * 4
    return {"rows_read_and_written": unique_keys * row_bytes * 2, "ids_read": shape.lookups * 8,
            "output_written": pooled, "output_grad_read": pooled}


# ------------------------------------------------------------------------------------- driver
class HbmBench:
    """Runs every configuration of the ``hbm`` workload; ``results``/``checks`` fill as it goes.

    Args:
        options: the workload's size, device, optimizers, kernels and step counts.
        log: progress lines (the command line prints them to stderr).
    """

    def __init__(self, options: HbmOptions, log: Callable[[str], None] = lambda s: None) -> None:
        self.options = options
        self.log = log
        self.results: list[Measurement] = []
        self.checks: list[HbmRowCheck] = []
        self.bandwidth: dict = {}
        self.notes: list[str] = []  # configurations skipped, and why

    def run(self, on_update: Callable[[], None] = lambda: None) -> None:
        """Every configuration, optimizer by optimizer; ``on_update`` after each one."""
        opts = self.options
        self.log(f"hbm: {opts.shape} on {opts.device}, {opts.warmup} warmup + {opts.steps} steps")
        self.bandwidth = measure_copy_bandwidth(opts.device)
        self.log(f"copy bandwidth {self.bandwidth['bytes_per_s'] / 1e9:.1f} GB/s (read + write)")
        batches = HbmBatches(opts.shape, opts.device, opts.seed)
        grad = upstream_grad(opts.shape, opts.device, opts.seed)
        for optimizer in opts.optimizers:
            snapshots = self._run_ours(optimizer, batches, grad, None, on_update)
            if opts.dtype != "fp32":  # a 16-bit table's rows are not the fp32 peers' (tests/modules
                snapshots = []        # hold them to fp32 references within the dtype's rounding)
            if opts.capacity is not None:
                self._run_bounded(optimizer, batches, grad, on_update)
            if OPTIMIZERS[optimizer][1] is None:
                self._note(f"{optimizer}: no nn.EmbeddingBag peer (torch.optim has no such optimizer)")
            else:
                failed = Measurement("peer", optimizer, peer_label(optimizer))
                result = self._attempt(failed, partial(run_peer, opts, optimizer, batches, grad,
                                                       snapshots))
                if result is not None:
                    failed, checks = result
                    self._add_checks(checks)
                self._add(failed, on_update)
            self._add(floor_measurement(opts, optimizer, batches, self.bandwidth["bytes_per_s"]),
                      on_update)
            if opts.tbe:
                self._run_tbe(optimizer, batches, grad, on_update)

    def _note(self, line: str) -> None:
        self.notes.append(line)
        self.log(line)

    def _run_tbe(self, optimizer: str, batches: HbmBatches, grad: torch.Tensor,
                 on_update: Callable[[], None]) -> None:
        """Ours and FBGEMM's TBE in turns (``hbm_tbe``), or a note saying why TBE cannot run."""
        opts = self.options
        kwargs = OPTIMIZERS[optimizer][2]
        spec = TbeSpec(optimizer, kwargs["lr"], kwargs.get("eps", 1e-8), precision=opts.tbe_precision)
        why = unavailable(spec, opts.device)
        if why is not None:
            self._note(f"{optimizer}: {why}")
            return
        exact = (sgd_reference(opts, batches, grad, check_ranks(opts.shape, opts.seed))
                 if optimizer == "sgd" else None)
        check = None if opts.dtype != "fp32" else (
            lambda snap, weights: check_against_peer(opts, optimizer, snap, weights, batches, exact))
        race = HbmTbeRace(opts, optimizer, spec, partial(build_ours, opts, optimizer, opts.kernels[0], None),
                          lambda t, ranks: initial_rows(opts.shape.table_configs()[t], t, ranks, opts.seed),
                          check, opts.turn)
        failed = Measurement("tbe", optimizer, spec.label(opts.device))
        result = self._attempt(failed, partial(race.run, batches, grad, UpstreamLoss))
        if result is None:
            self._add(failed, on_update)
            return
        measurements, check = result
        if check is not None:
            check.reference = "FBGEMM TBE" if check.reference == "peer" else check.reference
            self._add_checks([check])
        for m in measurements:
            self._add(m, on_update)

    def _run_ours(self, optimizer: str, batches: HbmBatches, grad: torch.Tensor, capacity: int | None,
                  on_update: Callable[[], None], kernels: list[str] | None = None,
                  pipeline: bool | None = None, configuration: str = "ours") -> list[RowSnapshot]:
        """Ours with each of ``kernels`` (default: the options'), then under TrainPipeline if
        ``pipeline`` (default: the options'), tables bounded to ``capacity`` or not; measurements of
        ``configuration`` (another than "ours" prefixes their labels). Returns the snapshots of the
        runs that did not fail."""
        opts = self.options
        kernels = opts.kernels if kernels is None else kernels
        pipeline = opts.pipeline if pipeline is None else pipeline
        runs = [(k, False, run_ours) for k in kernels]
        runs += [(k, True, run_ours_pipelined) for k in kernels] if pipeline else []
        snapshots = []
        for k, pipelined, run in runs:
            failed = Measurement("ours", optimizer, ours_label(k, pipelined, capacity))
            result = self._attempt(failed, partial(run, opts, optimizer, k, batches, grad, capacity))
            if result is not None:
                failed, snap = result
                snapshots.append(snap)
            if configuration != "ours":
                failed.configuration, failed.label = configuration, f"{configuration}: {failed.label}"
            self._add(failed, on_update)
        return snapshots

    def _run_bounded(self, optimizer: str, batches: HbmBatches, grad: torch.Tensor,
                     on_update: Callable[[], None]) -> None:
        """Ours on tables bounded to ``capacity``, then the reference kernels on the same tables (a
        plain run: timed too); each run's rows checked against the reference's."""
        opts = self.options
        snapshots = self._run_ours(optimizer, batches, grad, opts.capacity, on_update)
        reference = self._run_ours(optimizer, batches, grad, opts.capacity, on_update, ["torch"], False,
                                   "reference")
        if not reference:
            return
        configs = opts.shape.table_configs()
        initial = [initial_rows(configs[t], t, r.to(opts.device), opts.seed).cpu()
                   for t, r in enumerate(reference[0].ranks)]
        self._add_checks([compare_bounded(optimizer, snap, reference[0], initial) for snap in snapshots])

    def _add_checks(self, checks: list[HbmRowCheck]) -> None:
        self.checks.extend(checks)
        for c in checks:
            verdict = "passed" if c.passed else "FAILED: " + "; ".join(c.problems)
            against = {"exact": "the exact float64 rows", "peer": "the peer"}.get(c.reference, c.reference)
            peer = "" if c.peer_max_abs_diff is None else f"; the peer's {c.peer_max_abs_diff:.3g}"
            self.log(f"{c.optimizer} rows of ours[{c.kernels}] vs {against}: {verdict} "
                     f"(max |diff| {c.max_abs_diff:.3g}, rtol {c.rtol:g}{peer}; rows moved up to "
                     f"{c.max_moved:.3g}; {c.rows_trained} trained rows)")

    def _attempt(self, failed: Measurement, fn: Callable[[], tuple]) -> tuple | None:
        """Run one configuration. A failure (out of memory, a missing kernel) is recorded in
        ``failed`` and the run goes on with the next configuration."""
        self.log(f"{failed.optimizer} {failed.label} ...")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
            self.log(traceback.format_exc())
            failed.error = f"{type(e).__name__}: {e}"
        free_memory(self.options.device)  # out here: the traceback no longer holds the tables
        return None

    def _add(self, m: Measurement, on_update: Callable[[], None]) -> None:
        if m.configuration == "ours" and self.options.dtype != "fp32":
            m.label += f", {self.options.dtype} rows"
        self.results.append(m)
        fill_ratios(self.results)
        if m.error is None:
            self.log(f"{m.optimizer} {m.label}: {m.step_ms:.3f} ms/step")
        on_update()

    def targets(self) -> list[Target]:
        """Ours in turns with TBE against TBE's step, per optimizer and loop order."""
        return tbe_targets(self.results)

    @property
    def ok(self) -> bool:
        """Every configuration ran and every row check passed."""
        return all(r.error is None for r in self.results) and all(c.passed for c in self.checks)

    def summary(self) -> dict:
        opts = self.options
        return {
            "shape": asdict(opts.shape),
            "lookups_per_step": opts.shape.lookups,
            "options": {"device": str(opts.device), "optimizers": opts.optimizers,
                        "kernels": opts.kernels, "pipeline": opts.pipeline, "capacity": opts.capacity,
                        "preinsert": opts.preinsert, "init_capacity": opts.init_capacity,
                        "steps": opts.steps,
                        "warmup": opts.warmup,
                        "seed": opts.seed,
                        "learning_rates": {o: OPTIMIZERS[o][2]["lr"] for o in opts.optimizers},
                        "tbe": opts.tbe, "tbe_precision": opts.tbe_precision, "turn": opts.turn,
                        "dtype": opts.dtype},
            "notes": self.notes,
            "targets": self.targets(),
            "bandwidth": self.bandwidth,
            "floor_formula": FLOOR_FORMULA,
            "results": self.results,
            "checks": self.checks,
        }


__all__ = ["FLOOR_FORMULA", "HbmBench", "HbmOptions", "HbmRowCheck", "compare_bounded", "compare_rows",
           "floor_bytes", "sgd_reference"]
