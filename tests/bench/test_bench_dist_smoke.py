"""``tieredemb bench dist`` on CPU (gloo processes) at a tiny scale: both workloads run at world sizes 1
and 2, and the shards split the rows (each key stored once, on one rank)."""

from __future__ import annotations

import json

import pytest

from tieredemb.bench import main


@pytest.mark.parametrize("workload", ["hbm", "cache"])
@pytest.mark.slow
def test_bench_dist_smoke(workload, tmp_path, capsys):
    rc = main(["dist", "--device", "cpu", "--workload", workload, "--gpus", "1,2", "--scale", "0.001",
               "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads(next(tmp_path.glob("*-dist.json")).read_text())
    assert report["workload"] == workload and report["scale"] == 0.001 and report["date"]
    printed = capsys.readouterr().out  # gloo processes on a CPU, not GPUs
    assert "2 processes: step" in printed and "per-process throughput" in printed and "GPU" not in printed
    one, two = report["results"]
    assert (one["gpus"], two["gpus"]) == (1, 2)
    assert one["step_ms"] > 0 and two["step_ms"] > 0
    assert all(r > 0 for r in two["rows_per_rank"])  # both ranks own rows
    if workload == "hbm":  # every row stored up front: the two shards hold each row once
        assert sum(two["rows_per_rank"]) == one["rows_per_rank"][0]
    else:
        assert all(0 < h <= 1 for h in two["hit_rate_per_rank"])
