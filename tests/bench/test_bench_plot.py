"""``tieredemb bench plot``: PNGs from bench reports, including the cache-size and alpha sweeps drawn
from several ``bench cache`` runs (CPU, tiny); what the plots show (titles, colours, legends); and a
one-line error naming the file for anything that is not a bench report."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tieredemb.bench import main

NO_PLOT_EXTRA = "matplotlib is not installed (the plot extra: pip install tieredemb[plot])"


def _matplotlib():
    return pytest.importorskip("matplotlib", reason=NO_PLOT_EXTRA)


def _report(workload: str = "hbm", **fields) -> dict:
    """A bench report as the benches write it, cut to what the plots read."""
    results = [
        {"configuration": "ours", "optimizer": "sgd", "label": "ours (torch kernels)", "step_ms": 2.0,
         "extra": {"hit_rate": 0.7}},
        {"configuration": "peer", "optimizer": "sgd", "label": "nn.EmbeddingBag + SGD", "step_ms": 3.0},
        {"configuration": "floor", "optimizer": "sgd", "label": "bandwidth floor", "step_ms": 0.1},
        {"configuration": "ours", "optimizer": "adam", "label": "ours (torch kernels)", "step_ms": 2.5},
    ]
    report = {"workload": workload, "date": "2026-11-27T23:24:56", "scale": 0.001,
              "machine": {"device": "cpu", "cpu": "Test CPU 9000"}, "options": {}, "results": results}
    return {**report, **fields}


@pytest.mark.slow
def test_plots_from_cache_reports(tmp_path, monkeypatch):
    """Two ``bench cache`` runs, plotted with no ``--out``: every PNG in ./bench-plot."""
    _matplotlib()
    reports = []
    for fraction, alpha in ((0.1, 1.05), (0.3, 1.3)):
        out = tmp_path / f"run-{fraction}"
        args = ["cache", "--scale", "0.0005", "--steps", "2", "--warmup", "2", "--device", "cpu",
                "--threads", "1", "--budget-fraction", str(fraction), "--alpha", str(alpha),
                "--out", str(out)]
        assert main(args) == 0
        reports += list(out.glob("*-cache.json"))
        time.sleep(1)  # report names carry the second (each run its own directory anyway)
    assert len(reports) == 2
    assert {json.loads(r.read_text())["shape"]["alpha"] for r in reports} == {1.05, 1.3}
    monkeypatch.chdir(tmp_path)
    assert main(["plot", *map(str, reports)]) == 0
    pngs = sorted(p.name for p in (tmp_path / "bench-plot").iterdir())
    assert pngs == sorted([*(f"{r.stem}.png" for r in reports), "cache-size.png", "hit-rate-alpha.png"])
    assert all((tmp_path / "bench-plot" / p).stat().st_size > 1000 for p in pngs)


def test_step_times_name_the_device_date_and_scale_and_colour_each_kind_apart():
    _matplotlib()
    from tieredemb.bench.plot import step_times

    fig = step_times(_report())
    ax = fig.axes[0]
    title = ax.get_title()
    assert "tieredemb bench hbm" in title
    assert "Test CPU 9000" in title and "2026-11-27 23:24" in title and "scale 0.001" in title
    colours = {bars.get_label(): {tuple(b.get_facecolor()) for b in bars} for bars in ax.containers}
    assert set(colours) == {"ours", "peers", "bandwidth floor"}
    assert all(len(c) == 1 for c in colours.values())  # one colour for each kind of configuration...
    assert len(set().union(*colours.values())) == 3  # ...and a different one for each kind
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["ours", "peers", "bandwidth floor"]
    fig.clf()


def test_a_gpu_report_names_the_gpu_and_an_old_report_its_rows():
    _matplotlib()
    from tieredemb.bench.plot import step_times

    report = _report(machine={"device": "cuda", "gpu": "NVIDIA H200", "cpu": "Test CPU 9000"},
                     shape={"rows": 840})
    del report["scale"]  # written before reports recorded their scale
    title = step_times(report).axes[0].get_title()
    assert "NVIDIA H200" in title and "Test CPU" not in title and "840 rows a table" in title


def test_sweep_colours_ours_and_the_peer_apart():
    _matplotlib()
    from tieredemb.bench.plot import sweep

    reports = []
    for fraction, ms, date in ((0.1, 2.0, "2026-11-27T10:00:00"), (0.3, 1.5, "2026-11-28T09:00:00")):
        r = _report("cache", date=date, options={"budget_fraction": fraction}, shape={"alpha": 1.05})
        r["results"] = [{**r["results"][0], "step_ms": ms},
                        {**r["results"][1], "label": "all in device memory (hbm_direct)"}]
        reports.append(r)
    fig = sweep(reports, "budget_fraction")
    left, right = fig.axes
    assert "Test CPU 9000" in left.get_title() and "2026-11-27, 2026-11-28" in left.get_title()
    lines = {line.get_label(): line.get_color() for line in left.get_lines() + right.get_lines()}
    assert list(lines) == ["ours, step ms", "all in device memory (hbm_direct), step ms", "hit rate"]
    assert len(set(lines.values())) == 3
    fig.clf()


def test_a_stash_report_plots_its_memory_curves_with_device_date_and_scale():
    _matplotlib()
    from tieredemb.bench.plot import memory_curves

    curve = {"ms": [0.0, 1.0], "gib": [1.0, 2.0]}
    report = {"workload": "stash", "date": "2026-11-27T23:24:56", "options": {"scale": 0.5},
              "machine": {"device": "cuda", "gpu": "NVIDIA H100"},
              "results": [{"config": c, "memory_curve": curve} for c in ("off", "event")]}
    fig = memory_curves(report)
    title = fig.axes[0].get_title()
    assert "NVIDIA H100" in title and "2026-11-27 23:24" in title and "scale 0.5" in title
    assert memory_curves({**report, "results": [{"config": "off", "memory_curve": None}]}) is None
    fig.clf()


def test_step_time_bars_start_at_zero_unless_the_times_span_decades():
    _matplotlib()
    from tieredemb.bench.plot import _pyplot, time_axis

    plt = _pyplot()
    fig, ax = plt.subplots()
    ax.barh([0, 1], [1.55, 1.2])
    assert not time_axis(ax, [1.55, 1.2])
    assert ax.get_xscale() == "linear" and ax.get_xlim()[0] == 0  # lengths compare as the times do
    fig, wide = plt.subplots()
    wide.barh([0, 1], [1.2, 35.8])
    assert time_axis(wide, [1.2, 35.8])
    assert wide.get_xscale() == "log" and wide.get_xlim()[0] == 1.0  # from the decade below 1.2 ms
    plt.close("all")


@pytest.mark.parametrize("case", ["missing", "directory", "not JSON", "binary", "JSON, not a report",
                                  "results not records", "nothing to plot"])
def test_plot_names_the_file_that_is_not_a_bench_report(case, tmp_path):
    path = tmp_path / "report.json"
    if case == "directory":
        path.mkdir()
    elif case == "not JSON":
        path.write_text("step ms: 1.2\n")
    elif case == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    elif case == "JSON, not a report":
        path.write_text('{"steps": 3}')
    elif case == "results not records":
        path.write_text(json.dumps({**_report(), "results": [1, 2]}))
    elif case == "nothing to plot":  # a bench dist report: no configurations timed side by side
        path.write_text(json.dumps({**_report("dist"), "results": [{"gpus": 1, "step_ms": 1.0}]}))
    error = FileNotFoundError if case == "missing" else ValueError
    with pytest.raises(error) as caught:
        main(["plot", str(path), "--out", str(tmp_path / "plots")])
    message = str(caught.value)
    assert str(path) in message and "\n" not in message
    assert {"missing": "no such file", "directory": "a directory", "not JSON": "not JSON",
            "binary": "not JSON", "JSON, not a report": "not a tieredemb bench report",
            "results not records": "not a tieredemb bench report",
            "nothing to plot": "nothing to plot"}[case] in message
    assert not (tmp_path / "plots").exists()


def test_without_matplotlib_plot_says_to_install_the_extra(tmp_path, monkeypatch):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    with pytest.raises(ImportError, match=r"matplotlib is not installed: pip install tieredemb\[plot\]$"):
        main(["plot", str(path), "--out", str(tmp_path / "plots")])
    assert not (tmp_path / "plots").exists()
