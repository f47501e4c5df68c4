"""``tieredemb bench stash``: embedding memory stashing on a DLRM-style model (DESIGN sections 5, 7).

    tieredemb bench stash [--scale S] [--device cpu|cuda] [--steps N] [--warmup N] [--width W]
                          [--layers L] [--long-steps N] [--out DIR]

One hbm_direct EBC (4 tables x 500k rows x D=128, SGD: 1 GiB of rows at scale 1) and a top MLP whose
activations compete with it (batch 16384, ``--layers`` layers of ``--width``), trained by
``te.TrainPipeline`` with stashing off and with each free strategy. For each: median step time, peak
allocated and reserved device memory, host RSS, the bytes stashed, where the free and the restore
happened, and the device memory over one step (``torch.cuda.memory`` history, replayed). Rows and losses
must equal the stash-off run's exactly. ``--long-steps N`` then trains the fastest strategy and stash
off N more steps and compares every row (no NaN, no corrupted row). Writes ``<out>/<time>-stash.json``
and ``.txt``, and on CUDA a PNG of the memory curves when matplotlib is installed (``tieredemb bench
plot`` draws it from the report later).
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch
from torch import nn

import tieredemb as te
from tieredemb.bench.hbm import preinsert_rows
from tieredemb.bench.report import device_name, host_rss_bytes, machine_info, report_path, write_report
from tieredemb.bench.timing import free_memory, time_ms
from tieredemb.bench.workloads import HbmBatches, HbmShape
from tieredemb.pipeline.batches import pin_batch

CONFIGS = ["off", "blocking", "record_stream", "event"]
NUM_DENSE = 13
POOL = 8  # distinct batches, cycled


@dataclass
class StashOptions:
    scale: float = 1.0
    device: torch.device = torch.device("cpu")
    steps: int = 10
    warmup: int = 4  # >= 3: the event strategy calibrates its free site over the first steps
    width: int = 4096
    layers: int = 8
    long_steps: int = 0
    seed: int = 0

    @property
    def shape(self) -> HbmShape:
        return HbmShape(num_tables=4, rows=500_000, batch_size=16384).scaled(self.scale)


class DLRM(nn.Module):
    """Dense features -> bottom MLP; pooled embeddings; concat -> a top MLP of ``layers`` x ``width``
    -> a logit; mean BCE loss."""

    def __init__(self, ebc: te.EmbeddingBagCollection, dim: int, width: int, layers: int) -> None:
        super().__init__()
        self.ebc = ebc
        self.bottom = nn.Sequential(nn.Linear(NUM_DENSE, dim), nn.ReLU())
        tables = len(ebc.table_configs)
        top: list[nn.Module] = []
        for i in range(layers):
            top += [nn.Linear((tables + 1) * dim if i == 0 else width, width), nn.ReLU()]
        self.top = nn.Sequential(*top, nn.Linear(width, 1))

    def forward(self, batch: dict) -> torch.Tensor:
        pooled = self.ebc(batch["sparse"]).values()
        x = torch.cat([self.bottom(batch["dense"]), pooled], dim=1)
        logits = self.top(x).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch["labels"])


def make_batches(opts: StashOptions) -> list[dict]:
    """``POOL`` batches on the host (pinned on CUDA): the pipeline copies them like a loader's."""
    shape, gen = opts.shape, torch.Generator().manual_seed(opts.seed)
    ids = HbmBatches(shape, torch.device("cpu"), opts.seed)
    out = []
    for i in range(POOL):
        batch = {"dense": torch.randn(shape.batch_size, NUM_DENSE, generator=gen),
                 "sparse": ids.batch(i).kjt,
                 "labels": torch.randint(0, 2, (shape.batch_size,), generator=gen).float()}
        out.append(pin_batch(batch) if opts.device.type == "cuda" else batch)
    return out


def build(opts: StashOptions) -> tuple[DLRM, torch.optim.Optimizer]:
    shape = opts.shape
    torch.manual_seed(opts.seed)
    ebc = te.EmbeddingBagCollection(shape.table_configs(), optimizer=te.optim.SGD(lr=0.01),
                                    device=opts.device, seed=opts.seed)
    preinsert_rows(ebc, shape, opts.device, opts.seed)
    model = DLRM(ebc, shape.dim, opts.width, opts.layers).to(opts.device)
    return model, torch.optim.SGD(model.top.parameters(), lr=0.01)


def cycle(batches: list[dict], n: int):
    return iter([batches[i % len(batches)] for i in range(n)])


def run_config(opts: StashOptions, config: str, batches: list[dict], steps: int) -> tuple[dict, dict]:
    """Train ``steps`` timed steps (after the warmup) with stashing ``config``: (measurement, state)."""
    dev = opts.device
    free_memory(dev)
    model, opt = build(opts)
    stash = None if config == "off" else te.StashConfig(strategy=config)
    pipeline = te.TrainPipeline(model, opt, device=dev, stash=stash)
    total = opts.warmup + steps + 1  # +1: one more step under the memory history
    it = cycle(batches, total + 2)
    losses, times = [], []
    cuda = dev.type == "cuda"
    for i in range(opts.warmup + steps):
        if i == opts.warmup and cuda:
            # blocks cached by the warmup and unusable since (the row store's first segments, freed
            # by the first stash, come back as one block) go back to the driver: the peaks below
            # are the steady state's; the same for every configuration
            free_memory(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        ms = time_ms(lambda: losses.append(pipeline.progress(it).detach()), dev)
        if i >= opts.warmup:
            times.append(ms)
    m = {"config": config, "step_ms": statistics.median(times), "steps": steps,
         "peak_allocated": torch.cuda.max_memory_allocated(dev) if cuda else None,
         "peak_reserved": torch.cuda.max_memory_reserved(dev) if cuda else None,
         "host_rss": host_rss_bytes()}
    m["memory_curve"] = memory_curve(lambda: pipeline.progress(it), dev) if cuda else None
    if cuda:  # the allocator's counter drops at a record_stream free; the trace waits for the block
        m["peak_held"] = int((m["memory_curve"]["max_gib"] or 0) * 2**30)
    s = model.ebc.stash
    if s is not None:
        m.update({k: s.stats[k] for k in ("stashed_bytes", "free_site", "restore_site", "copy_ms",
                                          "window_ms")})
    pipeline.close()
    return m, {"losses": torch.stack(losses).cpu(), "rows": table_rows(model.ebc)}


def table_rows(ebc: te.EmbeddingBagCollection) -> list[str]:
    """Per table: the SHA-256 of its rows (keys and weights, sorted by key), or "non-finite". Digests,
    not the rows: the bench keeps one set per configuration, and the host RSS column stays the
    stash's own."""
    out = []
    for t in ebc.table_configs:
        rows = ebc.export(t.name)
        order = torch.argsort(rows.keys)
        if not torch.isfinite(rows.weights).all():
            out.append("non-finite")
            continue
        h = hashlib.sha256(rows.keys[order].cpu().numpy().tobytes())
        h.update(rows.weights[order].cpu().numpy().tobytes())
        out.append(h.hexdigest())
    return out


def memory_curve(step, device: torch.device, points: int = 400) -> dict:
    """Device memory allocated over one step: the caching allocator's history replayed (alloc +size,
    free_completed -size), sampled at ``points`` times (ms since the step's first event)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    try:
        step()
        torch.cuda.synchronize(device)
        trace = torch.cuda.memory._snapshot()["device_traces"][device.index or 0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    level, t0, curve = base, None, []
    for e in trace:
        if e["action"] == "alloc":
            level += e["size"]
        elif e["action"] == "free_completed":
            level -= e["size"]
        else:
            continue
        t = e.get("time_us", len(curve)) / 1e3
        t0 = t if t0 is None else t0
        curve.append((t - t0, level))
    stride = max(1, len(curve) // points)
    sampled = curve[::stride] + curve[-1:]
    return {"ms": [round(t, 3) for t, _ in sampled], "gib": [round(v / 2**30, 4) for _, v in sampled],
            "events": len(curve), "max_gib": max(v for _, v in curve) / 2**30 if curve else None}


def same_training(got: dict, want: dict) -> list[str]:
    problems = []
    if not torch.equal(got["losses"], want["losses"]):
        problems.append("losses differ")
    for t, (g, w) in enumerate(zip(got["rows"], want["rows"])):
        if g == "non-finite":
            problems.append(f"table {t}: non-finite rows")
        elif g != w:
            problems.append(f"table {t}: rows differ")
    return problems


def format_results(opts: StashOptions, results: list[dict], device: str) -> str:
    shape = opts.shape
    off = next((r for r in results if r["config"] == "off"), None)
    lines = [f"stash: {shape.num_tables} tables x {shape.rows} rows x D={shape.dim} SGD (hbm_direct), "
             f"batch {shape.batch_size}, top MLP {opts.layers} x {opts.width}; {device}; "
             f"median of {opts.steps} steps",
             "config        | step ms | vs off | peak alloc GiB | saved / stashed | peak held GiB "
             "| peak reserved GiB | host RSS GiB | same rows",
             "--------------+---------+--------+----------------+-----------------+---------------"
             "+-------------------+--------------+----------"]
    for r in results:
        saved = "-"
        if off and r.get("stashed_bytes") and r["peak_allocated"] is not None:
            saved = f"{(off['peak_allocated'] - r['peak_allocated']) / r['stashed_bytes']:.0%}"
        ratio = f"{r['step_ms'] / off['step_ms']:.3f}" if off else "-"
        lines.append(f"{r['config']:<13} | {r['step_ms']:7.1f} | {ratio:>6} "
                     f"| {_gib(r['peak_allocated']):>14} | {saved:>15} | {_gib(r.get('peak_held')):>13} "
                     f"| {_gib(r['peak_reserved']):>17} "
                     f"| {_gib(r['host_rss']):>12} | {r.get('same_as_off', '-')}")
    for r in results:
        if r.get("stashed_bytes"):
            lines.append(f"{r['config']}: stashed {r['stashed_bytes'] / 2**30:.2f} GiB; "
                         f"free: {r['free_site']}; restore: {r['restore_site']}; copy {_ms(r['copy_ms'])} "
                         f"ms in a forward window of {_ms(r['window_ms'])} ms after the lookup")
    return "\n".join(lines)


def _gib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def run(opts: StashOptions, out_dir: str, argv: list[str], log=print) -> int:
    """Every configuration, then the long run; prints the table, writes the report. 0: all equal."""
    when = datetime.now()
    batches = make_batches(opts)
    info = machine_info(opts.device)
    results, states = [], {}
    path = report_path(out_dir, "stash", when)
    report = {"workload": "stash", "date": when.isoformat(timespec="seconds"), "machine": info,
              "argv": argv, "options": _options(opts), "results": results}
    ok = True
    for config in CONFIGS:
        log(f"stash {config} ...")
        m, states[config] = run_config(opts, config, batches, opts.steps)
        if config != "off":
            problems = same_training(states[config], states["off"])
            m["same_as_off"] = "yes" if not problems else "NO: " + "; ".join(problems)
            ok &= not problems
        results.append(m)
        table = format_results(opts, results, device_name(info))
        write_report(path, report, table)
    long = _long_run(opts, batches, results, log) if opts.long_steps else None
    if long is not None:
        ok &= long["same_rows"] == "yes"
        table += (f"\nlong run: {long['config']} vs off, {long['steps']} steps: same losses and rows: "
                  f"{long['same_rows']}")
    report["long_run"] = long
    write_report(path, report, table)
    _plot_if_possible(report, path.with_suffix(".png"), log)
    log(table)
    return 0 if ok else 1


def _long_run(opts: StashOptions, batches: list[dict], results: list[dict], log) -> dict:
    fastest = min((r for r in results if r["config"] != "off"), key=lambda r: r["step_ms"])["config"]
    log(f"long run: {fastest} and off, {opts.long_steps} steps ...")
    long_opts = StashOptions(**{**_options(opts), "device": opts.device, "warmup": 0})
    _, got = run_config(long_opts, fastest, batches, opts.long_steps)
    _, want = run_config(long_opts, "off", batches, opts.long_steps)
    problems = same_training(got, want)
    return {"config": fastest, "steps": opts.long_steps, "same_rows": "yes" if not problems else
            "NO: " + "; ".join(problems)}


def _options(opts: StashOptions) -> dict:
    return {"scale": opts.scale, "device": str(opts.device), "steps": opts.steps, "warmup": opts.warmup,
            "width": opts.width, "layers": opts.layers, "long_steps": opts.long_steps, "seed": opts.seed}


def _plot_if_possible(report: dict, png: Path, log) -> None:
    """The memory curves of a CUDA run into ``png``; without matplotlib, a line saying so."""
    from tieredemb.bench.plot import memory_curves, save

    try:
        fig = memory_curves(report)
    except ImportError as e:
        log(f"no plot: {e}")
        return
    if fig is not None:
        log(f"plot: {save(fig, png)}")
