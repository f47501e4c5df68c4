"""The ``ssd`` workload with a host tier (``--host-budget``) and reads issued ahead (``--lookahead``).

Beside ``bench ssd``'s own runs (ours over RocksDB, the same tables all in device memory), on the same
batches:

    host_tier            ours with ``StorageConfig(host_budget=...)`` in front of RocksDB, the plain
                         loop reading batch i+k's rows ahead by hand (``ebc.read_ahead``) before step i
    host_memory          the same device cache over ``HostMemory`` (every row in host memory, no store):
                         what a host tier that holds the rows a step needs may come close to
    pipeline             ours over RocksDB alone, under ``te.TrainPipeline`` with a DLRM-style dense
                         model (bottom MLP, pooled embeddings, a top MLP of ``dense_layers`` x
                         ``dense_width``: make its step longer than the store's time to hide it)
    pipeline_host_tier   the same with the host tier and ``TrainPipeline(lookahead=k)``
    pipeline_peer        the same model with every row in device memory

The host tier's rows are checked after ``flush`` against the all-in-device rows (as ours' are), and
the three pipeline runs' losses against each other (one function: equal up to summation order).
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import tieredemb as te
from tieredemb.bench.cache_runs import (
    LR,
    OPTIMIZER,
    CacheOptions,
    ConfigRun,
    RankBatch,
    RankBatches,
    prefill,
    prefill_rows,
    table_configs,
)
from tieredemb.bench.disk import DiskFigures, disk_io, io_between, step_floor
from tieredemb.bench.report import Measurement, host_rss_bytes
from tieredemb.bench.stash import DLRM, NUM_DENSE
from tieredemb.bench.timing import free_memory, synchronize, time_ms
from tieredemb.pipeline.batches import pin_batch

LOSS_RTOL = 1e-4


def host_budget_bytes(value: float | int, footprint: int) -> int:
    """``--host-budget``: a fraction of the tables' bytes (a float below 1) or bytes (an int >= 1)."""
    if isinstance(value, float) and 0 < value < 1:
        return max(1, int(value * footprint))
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"--host-budget must be a fraction in (0, 1) of the tables' bytes or a byte count "
                     f">= 1, got {value!r}")


class WindowBatches:
    """``RankBatches`` generated ``ahead`` steps early and kept a while: a run asking for batch i
    (outside its timed step) also makes batches i+1..i+ahead, which a read ahead inside the step
    then finds made."""

    def __init__(self, batches: RankBatches, ahead: int) -> None:
        self.batches, self.ahead = batches, ahead
        self.made: dict[int, RankBatch] = {}

    def batch(self, step: int) -> RankBatch:
        for s in range(step, step + self.ahead + 1):
            if s not in self.made:
                self.made[s] = self.batches.batch(s)
        for s in [s for s in self.made if s < step - 1]:
            del self.made[s]
        return self.made[step]


class AheadRun(ConfigRun):
    """Ours with a host tier: before step i, batch i+``lookahead``'s rows are read ahead."""

    def __init__(self, *args, lookahead: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lookahead = lookahead

    def _step(self, b: RankBatch) -> None:
        if self.lookahead:
            self.ebc.read_ahead(self.batches.batch(b.step + self.lookahead).kjt)
        super()._step(b)


def host_counters(ebc: te.EmbeddingBagCollection) -> dict[str, int]:
    """The host tiers' counters summed over tables (``TableStats.host_tier``; none: {})."""
    out: dict[str, int] = {}
    for table in ebc.stats().values():
        for k, v in vars(table.host_tier).items() if table.host_tier is not None else ():
            out[k] = out.get(k, 0) + v
    return out


@dataclass
class PipelineRun:
    """One configuration under ``te.TrainPipeline`` with the DLRM-style model; ``losses`` its losses."""

    configuration: str
    label: str
    storage: te.StorageConfig
    lookahead: int = 0

    def run(self, opts: CacheOptions, data: list[dict], rows: int,
            hot: int | None = None) -> tuple[Measurement, list[float]]:
        """Build, prefill ``rows`` ranks a table (``hot`` of them last), train ``warmup + steps``
        batches of ``data``."""
        dev, shape = opts.device, opts.shape
        m = Measurement(self.configuration, OPTIMIZER, self.label)
        torch.manual_seed(opts.seed)  # the same dense model in every run
        ebc = te.EmbeddingBagCollection(table_configs(shape), optimizer=te.optim.RowWiseAdagrad(lr=LR),
                                        storage=self.storage, device=dev, seed=opts.seed)
        try:
            if rows and opts.prefill:
                prefill(ebc, shape, rows, dev, opts.seed, hot, flush=bool(opts.store_rows))
            model = DLRM(ebc, shape.dim, opts.dense_width, opts.dense_layers).to(dev)
            dense = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("ebc.")],
                                    lr=0.01)
            pipe = te.TrainPipeline(model, dense, device=dev, lookahead=self.lookahead)
            batches = iter(data)
            losses, times = [], []
            out: list[torch.Tensor] = []
            for i in range(opts.warmup + opts.steps):
                ms = time_ms(lambda: out.append(pipe.progress(batches)), dev)
                losses.append(float(out[-1].detach()))
                if i >= opts.warmup:
                    times.append(ms)
            synchronize(dev)
            m.set_times(times, shape.lookups)
            m.host_rss_bytes = host_rss_bytes()
            if self.storage.host_budget is not None:
                m.extra["host_tier"] = host_counters(ebc)
            pipe.close()
            return m, losses
        finally:
            ebc.close()
            free_memory(dev)


def pipeline_data(opts: CacheOptions, batches: RankBatches, n: int) -> list[dict]:
    """``n`` DLRM batches on the host (pinned on CUDA), made before any run is timed."""
    gen = torch.Generator().manual_seed(opts.seed + 7)
    b = opts.shape.batch_size
    out = []
    for i in range(n):
        batch = {"dense": torch.randn(b, NUM_DENSE, generator=gen),
                 "sparse": _to_cpu(batches.batch(i).kjt),
                 "labels": torch.randint(0, 2, (b,), generator=gen).float()}
        out.append(pin_batch(batch) if opts.device.type == "cuda" else batch)
    return out


def _to_cpu(kjt: te.KeyedJaggedTensor) -> te.KeyedJaggedTensor:
    return te.KeyedJaggedTensor(list(kjt.keys()), kjt.values().cpu(), lengths=kjt.lengths().cpu())


def run_host_tier(opts: CacheOptions, directory: str, direct_reads: bool, batches: RankBatches,
                  grad: torch.Tensor, cache_rows: int, log: Callable[[str], None],
                  on_result: Callable[[Measurement, ConfigRun | None], None]) -> dict:
    """The runs of the module docstring, each reported through ``on_result`` as it ends (the plain
    host-tier run with its ``ConfigRun``, whose ``rows`` the caller checks). Returns the pipeline
    runs' loss check."""
    budget = int(opts.budget_fraction * opts.footprint_bytes)
    host = host_budget_bytes(opts.host_budget, opts.footprint_bytes)
    k = opts.lookahead

    def rocksdb(name: str) -> te.storage.RocksDB:
        path = os.path.join(directory, name)
        shutil.rmtree(path, ignore_errors=True)
        return opts.rocksdb(path, direct_reads)

    def storage(name: str, with_host: bool) -> te.StorageConfig:
        return te.StorageConfig(hbm_budget=budget, backing=rocksdb(name),
                                host_budget=host if with_host else None)

    tier = f"host tier {host / 1e6:.3g} MB"
    rows = prefill_rows(opts, cache_rows)
    # the target's reference (in turns with the tier): the same device cache over every row in host
    # memory, no store (timed alone: ``bench cache`` checks the rows of this path)
    reference = ConfigRun(opts, "ours (cache, HostMemory)",
                          te.StorageConfig(hbm_budget=budget, backing=te.storage.HostMemory()),
                          batches, grad, rows, "host_memory", hot_rows=cache_rows)
    ahead = AheadRun(opts, f"ours (cache, RocksDB, {tier}, reads {k} ahead)", storage("store-host", True),
                     WindowBatches(batches, k), grad, rows, "host_tier", hot_rows=cache_rows, lookahead=k)
    plain_runs([ahead, reference], opts, log, lambda m, run: on_result(m, run if run is ahead else None))
    data = pipeline_data(opts, batches, opts.warmup + opts.steps + 2 + k)
    losses: dict[str, list[float]] = {}
    under = "ours under TrainPipeline (cache, RocksDB"
    for p in (PipelineRun("pipeline", under + ")", storage("store-pipe", False)),
              PipelineRun("pipeline_host_tier", f"{under}, {tier}, lookahead {k})",
                          storage("store-pipe-host", True), k),
              PipelineRun("pipeline_peer", "all in device memory under TrainPipeline", te.StorageConfig())):
        log(f"{p.label} ...")
        t0 = time.perf_counter()
        try:
            m, losses[p.configuration] = p.run(opts, data, prefill_rows(opts, cache_rows), cache_rows)
        except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
            m = Measurement(p.configuration, OPTIMIZER, p.label, error=f"{type(e).__name__}: {e}")
        log(f"{p.label}: {m.step_ms or float('nan'):.3f} ms/step ({time.perf_counter() - t0:.1f} s)")
        on_result(m, None)
    return _loss_check(losses)


@dataclass(eq=False)
class _Timed:
    """A plain run being timed: its host tiers' counters before, the disk's counters over its turns."""

    run: ConfigRun
    tier: dict[str, int]
    io: dict[str, float] | None


def plain_runs(runs: list[ConfigRun], opts: CacheOptions, log: Callable[[str], None],
               on_result: Callable[[Measurement, ConfigRun | None], None]) -> None:
    """Time ``runs`` in a plain loop, all built first and then in turns of ``opts.interleave`` steps
    (0: each from start to finish), and report each (with its host tiers' counters and the disk's a
    step, where it has any). A run that fails is reported with its error; the others go on."""
    def failed(run: ConfigRun, e: Exception) -> None:
        run.m.error = f"{type(e).__name__}: {e}"
        run.close()
        on_result(run.m, None)

    live: list[_Timed] = []
    for run in runs:
        log(f"{run.label} ...")
        try:
            run.start()
            live.append(_Timed(run, host_counters(run.ebc), {}))
        except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
            failed(run, e)
    turn = opts.interleave or opts.steps
    while any(t.run.left for t in live):
        for t in [t for t in live if t.run.left]:
            try:
                before = disk_io()
                t.run.time_steps(turn)
                spent = io_between(before, disk_io(), 1)
                t.io = None if spent is None or t.io is None else {
                    k: t.io.get(k, 0) + v for k, v in spent.items()}
            except Exception as e:  # noqa: BLE001
                live.remove(t)
                failed(t.run, e)
    for t in live:
        try:
            m = _measured(t, opts, log)
        except Exception as e:  # noqa: BLE001
            failed(t.run, e)
            continue
        try:
            on_result(m, t.run)  # (a failure here is the report's: raised, not taken for the run's)
        finally:
            t.run.close()


def _measured(t: _Timed, opts: CacheOptions, log: Callable[[str], None]) -> Measurement:
    """A timed run's measurement, with its host tiers' counters and the disk's a step."""
    after = host_counters(t.run.ebc)
    m = t.run.finish(log)
    if after:
        m.extra["host_tier"] = {key: after[key] if key in ("rows", "capacity", "dirty")  # else a step's
                                else (after[key] - t.tier.get(key, 0)) / opts.steps for key in after}
        below = t.run.ebc.tiers[0].below
        m.extra["host_tier"]["row_bytes"] = below.width * below.dtype.itemsize
    if t.io is not None:
        m.extra["disk_io_per_step"] = {k: v / opts.steps for k, v in t.io.items()}
    return m


def host_tier_floor(disk: DiskFigures, m: Measurement) -> dict | None:
    """The disk floor of the plain host-tier run's step (``step_floor``) for the rows it wrote down
    and read: ``asked`` counts every row asked of the store (its misses and reads ahead) as a read of
    the disk; ``measured`` counts the reads the disk did (``disk_io``; None where not counted)."""
    h = m.extra.get("host_tier")
    if not h or not m.step_ms:
        return None
    written = h["written_down"] * h["row_bytes"]
    io = m.extra.get("disk_io_per_step")
    return {"asked": step_floor(disk, h["misses"] + h["read_ahead_rows"], written, m.step_ms),
            "measured": None if io is None else step_floor(disk, io["reads"], written, m.step_ms),
            "disk_io_per_step": io}


def host_tier_floor_line(f: dict) -> str:
    def over(x: dict) -> str:  # (a step that moves nothing has no floor to be over)
        return f"the step {x['step_ms']:.1f} ms is {x['step_over_floor']:.2f}x it" \
            if x["step_over_floor"] is not None else f"the step {x['step_ms']:.1f} ms"

    a, d = f["asked"], f["measured"]
    line = (f"disk floor of the host tier's step, every row asked of the store a disk read: "
            f"{a['floor_ms']:.1f} ms ({a['misses_per_step']:.0f} reads {a['reads_ms']:.1f} ms + "
            f"{a['written_bytes_per_step'] / 1e6:.2f} MB written {a['writes_ms']:.1f} ms); {over(a)}")
    if d is not None:
        io = f["disk_io_per_step"]
        line += (f"\n  the disk's own counters a step: {io['reads']:.0f} reads ({io['read_bytes'] / 1e6:.2f} "
                 f"MB), {io['write_bytes'] / 1e6:.2f} MB written (the page cache may write later); floor "
                 f"with those reads {d['floor_ms']:.1f} ms: {over(d)}")
    return line


def _loss_check(losses: dict[str, list[float]]) -> dict:
    """The pipeline runs' losses against the all-in-device run's."""
    want = losses.get("pipeline_peer")
    if want is None or len(losses) < 2:
        return {"passed": False, "problems": ["a pipeline run failed"]}
    problems = []
    for name, got in losses.items():
        worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want))
        if worst > LOSS_RTOL:
            problems.append(f"{name}: losses differ from pipeline_peer's by up to {worst:.3g} (relative)")
    return {"passed": not problems, "problems": problems, "steps": len(want),
            "mean_loss": statistics.mean(want)}
