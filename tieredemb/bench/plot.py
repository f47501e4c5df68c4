"""``tieredemb bench plot REPORT.json [...]``: PNG plots of bench reports (matplotlib).

- every report: step time by configuration (a bar per configuration and optimizer), ``<report>.png``;
- several ``cache``/``ssd`` reports of one workload at different ``--budget-fraction``: step time and
  hit rate against the cache size, ``<out>/cache-size.png``;
- several ``cache``/``ssd`` reports at different ``--alpha``: hit rate against the Zipf alpha,
  ``<out>/hit-rate-alpha.png``.

The benches run where the GPU is; the plots can be drawn anywhere from their JSON files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def step_times(report: dict, png: Path) -> Path:
    """A bar per measured configuration (label, optimizer) of one report."""
    plt = _pyplot()
    rows = [r for r in report["results"] if r.get("step_ms")]
    names = [f"{r['label']} ({r['optimizer']})" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.2))
    ax.barh(range(len(rows)), [r["step_ms"] for r in rows], color="tab:blue")
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        ax.text(r["step_ms"], i, f" {r['step_ms']:.3g}", va="center", fontsize=8)
    ax.set_xlabel(f"step ms (median{'; log scale' if time_axis(ax, [r['step_ms'] for r in rows]) else ''})")
    ax.set_title(f"tieredemb bench {report.get('workload', '')}: {report['machine'].get('gpu', '')}")
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return png


def time_axis(ax, times: list[float]) -> bool:
    """The step-time axis of a bar chart: linear from 0, so that a bar's length is its time (1.55
    against 1.2 ms reads as 1.3x, not as 10x on a log axis cut at 1.2); log from the decade below the
    shortest where the times span more than 20x (a 35 ms peer beside 1 ms steps). True: log."""
    if len(times) > 1 and max(times) > 20 * min(times):
        ax.set_xscale("log")
        ax.set_xlim(left=10 ** math.floor(math.log10(min(times))))
        return True
    ax.set_xlim(left=0)
    return False


def _ours(report: dict) -> dict | None:
    return next((r for r in report["results"] if r["configuration"] == "ours" and r.get("step_ms")), None)


def sweep(reports: list[dict], key: str, png: Path) -> Path | None:
    """Step time (ours, and the all-HBM peer) and hit rate against ``key``: "budget_fraction" (the
    cache size) or "alpha" (the shape's Zipf exponent). None: fewer than two values of ``key``."""
    def value(r: dict) -> float:
        return r["options"]["budget_fraction"] if key == "budget_fraction" else r["shape"]["alpha"]

    points = sorted(((value(r), r) for r in reports if _ours(r) is not None), key=lambda p: p[0])
    if len({x for x, _ in points}) < 2:
        return None
    plt = _pyplot()
    xs = [x for x, _ in points]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(xs, [_ours(r)["step_ms"] for _, r in points], "o-", label="ours, step ms")
    peers = [next((p["step_ms"] for p in r["results"] if p["configuration"] == "peer"), None)
             for _, r in points]
    if all(p is not None for p in peers):
        left.plot(xs, peers, "s--", label="all in HBM, step ms")
    left.set_xlabel("cache size (fraction of the footprint)" if key == "budget_fraction" else "Zipf alpha")
    left.set_ylabel("step ms")
    right = left.twinx()
    right.plot(xs, [_ours(r)["extra"]["hit_rate"] for _, r in points], "^:", color="tab:green",
               label="hit rate")
    right.set_ylabel("hit rate (unique keys)")
    right.set_ylim(0, 1)
    fig.legend(loc="upper center", ncol=3, fontsize=8)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return png


def main(paths: list[str], out: str | None = None) -> list[Path]:
    """Draw what the reports allow; returns the PNG files written."""
    reports = [(Path(p), json.loads(Path(p).read_text())) for p in paths]
    written = [step_times(r, p.with_suffix(".png")) for p, r in reports
               if r.get("results") and "label" in r["results"][0]]  # (bench stash draws its own)
    out_dir = Path(out) if out else reports[0][0].parent
    cache = [r for _, r in reports if r.get("workload") in ("cache", "ssd")]
    for key, name in (("budget_fraction", "cache-size.png"), ("alpha", "hit-rate-alpha.png")):
        png = sweep(cache, key, out_dir / name)
        if png is not None:
            written.append(png)
    return written
