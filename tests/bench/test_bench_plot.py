"""``tieredemb bench plot``: PNGs from bench reports, including the cache-size and alpha sweeps drawn
from several ``bench cache`` runs (CPU, tiny)."""

from __future__ import annotations

import json
import time

from tieredemb.bench import main


def test_plots_from_cache_reports(tmp_path):
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
    assert main(["plot", *map(str, reports), "--out", str(tmp_path)]) == 0
    for r in reports:
        assert r.with_suffix(".png").stat().st_size > 1000
    assert (tmp_path / "cache-size.png").stat().st_size > 1000
    assert (tmp_path / "hit-rate-alpha.png").stat().st_size > 1000


def test_step_time_bars_start_at_zero_unless_the_times_span_decades():
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
