"""``tieredemb bench plot REPORT.json [...] [--out DIR]``: PNG plots of bench reports, written into
``--out`` (matplotlib, the ``plot`` extra: ``pip install tieredemb[plot]``).

- an ``hbm``, ``cache`` or ``ssd`` report: step time by configuration (a bar per configuration and
  optimizer; ours, the peers, the bandwidth floor and a reference run each in a colour of their own),
  ``<out>/<report>.png``;
- a ``stash`` report of a CUDA run: device memory over one step per configuration, ``<out>/<report>.png``;
- several ``cache``/``ssd`` reports of one workload at different ``--budget-fraction``: step time and
  hit rate against the cache size, ``<out>/cache-size.png``;
- several ``cache``/``ssd`` reports at different ``--alpha``: hit rate against the Zipf alpha,
  ``<out>/hit-rate-alpha.png``.

Every title names the device, the date and the scale of the runs it draws. The benches run where the
GPU is; the plots can be drawn anywhere from their JSON files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tieredemb.bench.report import device_name

INSTALL = "matplotlib is not installed: pip install tieredemb[plot]"
COLOURS = {"ours": "tab:blue", "peer": "tab:orange", "floor": "tab:gray", "reference": "tab:purple"}
NAMES = {"ours": "ours", "peer": "peers", "floor": "bandwidth floor", "reference": "reference run"}
HIT_RATE_COLOUR = "tab:green"


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(INSTALL) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_report(path: str | Path) -> dict:
    """The bench report in ``path``; an error naming the file where there is none."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.is_dir():
        raise ValueError(f"{path}: a directory, not a bench report (a JSON file)")
    try:
        report = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not (isinstance(report, dict) and isinstance(report.get("machine"), dict)
            and isinstance(report.get("results"), list)
            and all(isinstance(r, dict) for r in report["results"])):
        raise ValueError(f"{path}: not a tieredemb bench report (no 'machine' and 'results')")
    return report


def _scale(report: dict) -> str:
    scale = report.get("scale", report.get("options", {}).get("scale"))
    if scale is not None:
        return f"scale {scale:g}"
    rows = report.get("shape", {}).get("rows")  # a report from before the scale was recorded
    return "scale not recorded" if rows is None else f"{rows:,} rows a table"


def title(reports: list[dict], what: str) -> str:
    """"tieredemb bench <workload>: <what>" over "<device>; <date>; <scale>" (each value the
    reports differ in listed; the dates by the day where they differ)."""
    def values(of) -> list[str]:
        return list(dict.fromkeys(of(r) for r in reports))

    dates = values(lambda r: (r.get("date") or "undated").replace("T", " ")[:16])
    if len(dates) > 1:
        dates = list(dict.fromkeys(d[:10] for d in dates))
    workload = values(lambda r: r.get("workload") or (r.get("argv") or ["?"])[0])
    return (f"tieredemb bench {', '.join(workload)}: {what}\n"
            f"{', '.join(values(lambda r: device_name(r['machine'])))}; {', '.join(dates)}; "
            f"{', '.join(values(_scale))}")


def step_times(report: dict):
    """A bar per measured configuration (label, optimizer) of one report: a matplotlib figure."""
    plt = _pyplot()
    rows = [r for r in report["results"] if r.get("step_ms")]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.6))
    for configuration in dict.fromkeys(r["configuration"] for r in rows):
        at = [i for i, r in enumerate(rows) if r["configuration"] == configuration]
        ax.barh(at, [rows[i]["step_ms"] for i in at], color=COLOURS.get(configuration, "tab:brown"),
                label=NAMES.get(configuration, configuration))
    ax.set_yticks(range(len(rows)), [f"{r['label']} ({r['optimizer']})" for r in rows], fontsize=8)
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        ax.text(r["step_ms"], i, f" {r['step_ms']:.3g}", va="center", fontsize=8)
    ax.set_xlabel(f"step ms (median{'; log scale' if time_axis(ax, [r['step_ms'] for r in rows]) else ''})")
    ax.set_title(title([report], "step time by configuration"), fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return fig


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


def _measured(report: dict, configuration: str) -> dict | None:
    return next((r for r in report["results"] if r["configuration"] == configuration and r.get("step_ms")),
                None)


def sweep(reports: list[dict], key: str):
    """Step time (ours, and the all-in-device-memory peer) and hit rate against ``key``:
    "budget_fraction" (the cache size) or "alpha" (the shape's Zipf exponent); a matplotlib figure, or
    None: fewer than two values of ``key``."""
    def value(r: dict) -> float:
        return r["options"]["budget_fraction"] if key == "budget_fraction" else r["shape"]["alpha"]

    points = sorted(((value(r), r) for r in reports if _measured(r, "ours") is not None), key=lambda p: p[0])
    if len({x for x, _ in points}) < 2:
        return None
    plt = _pyplot()
    xs = [x for x, _ in points]
    fig, left = plt.subplots(figsize=(7, 4.4))
    left.plot(xs, [_measured(r, "ours")["step_ms"] for _, r in points], "o-", color=COLOURS["ours"],
              label="ours, step ms")
    peers = [_measured(r, "peer") for _, r in points]
    if all(p is not None for p in peers):
        left.plot(xs, [p["step_ms"] for p in peers], "s--", color=COLOURS["peer"],
                  label=f"{peers[0]['label']}, step ms")
    what = "cache size (fraction of the footprint)" if key == "budget_fraction" else "Zipf alpha"
    left.set_xlabel(what)
    left.set_ylabel("step ms")
    right = left.twinx()
    right.plot(xs, [_measured(r, "ours")["extra"]["hit_rate"] for _, r in points], "^:",
               color=HIT_RATE_COLOUR, label="hit rate")
    right.set_ylabel("hit rate (unique keys)")
    right.set_ylim(0, 1)
    left.set_title(title([r for _, r in points], f"against the {what}"), fontsize=10)
    fig.legend(loc="lower center", ncol=3, fontsize=8, bbox_to_anchor=(0.5, -0.08))
    return fig


def memory_curves(report: dict):
    """Device memory over one step per configuration of a ``bench stash`` report: a matplotlib figure,
    or None where the report has no curves (a CPU run)."""
    curves = [(r["config"], r["memory_curve"]) for r in report["results"] if r.get("memory_curve")]
    if not curves:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, c in curves:
        ax.plot(c["ms"], c["gib"], label=name, linewidth=1.2)
    ax.set_xlabel("ms since the step's first allocation")
    ax.set_ylabel("device memory allocated (GiB)")
    ax.set_title(title([report], "device memory over one training step"), fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def save(fig, png: Path) -> Path:
    """``fig`` written to ``png`` (its folder made) and closed."""
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    return png


def _timed(report: dict) -> bool:
    """A report of configurations timed side by side (``hbm``, ``cache``, ``ssd``)."""
    results = report["results"]
    return bool(results) and all({"configuration", "label"} <= r.keys() for r in results)


def main(paths: list[str], out: str | Path) -> list[Path]:
    """Draw what the reports allow into ``out``; returns the PNG files written."""
    reports = [(Path(p), load_report(p)) for p in paths]
    out = Path(out)
    figures = []
    for path, report in reports:
        fig = step_times(report) if _timed(report) else memory_curves(report)
        if fig is not None:
            figures.append((fig, out / f"{path.stem}.png"))
    cache = [r for _, r in reports if r.get("workload") in ("cache", "ssd") and _timed(r)]
    for key, name in (("budget_fraction", "cache-size.png"), ("alpha", "hit-rate-alpha.png")):
        fig = sweep(cache, key)
        if fig is not None:
            figures.append((fig, out / name))
    if not figures:
        raise ValueError(f"nothing to plot in {', '.join(paths)}: plots are drawn from hbm, cache and "
                         "ssd reports, and from stash reports of CUDA runs")
    return [save(fig, png) for fig, png in figures]
