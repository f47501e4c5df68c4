"""``tieredemb bench dist`` on CPU (gloo processes) at a tiny scale: both workloads run at world sizes 1
and 2, and the shards split the rows (each key stored once, on one rank); world size 1 is timed
against the unsharded collection too, each step's parts apart and (``--pipeline``) under
``te.TrainPipeline``."""

from __future__ import annotations

import json

import pytest

from tieredemb.bench import main


@pytest.mark.parametrize("workload", ["hbm", "cache"])
@pytest.mark.slow
def test_bench_dist_smoke(workload, tmp_path, capsys):
    pipeline = ["--pipeline"] if workload == "hbm" else []
    rc = main(["dist", "--device", "cpu", "--workload", workload, "--gpus", "1,2", "--scale", "0.001",
               "--steps", "2", "--warmup", "1", "--out", str(tmp_path), *pipeline])
    assert rc == 0
    report = json.loads(next(tmp_path.glob("*-dist.json")).read_text())
    assert report["workload"] == workload and report["scale"] == 0.001 and report["date"]
    printed = capsys.readouterr().out  # gloo processes on a CPU, not GPUs
    assert "2 processes, alpha 1.05: step" in printed and "per-process throughput" in printed
    assert "GPU" not in printed
    one, two = report["results"]
    assert (one["gpus"], two["gpus"]) == (1, 2)
    assert one["step_ms"] > 0 and two["step_ms"] > 0
    assert all(r > 0 for r in two["rows_per_rank"])  # both ranks own rows
    # each rank's load: every id of both ranks' batches served once, by one of them: 1 warmup + 2
    # timed steps, 2 with the parts apart, then (--pipeline) 1 warmup + 2 under TrainPipeline
    lookups = 10 * report["shape"]["batch_size"] * report["shape"]["bag_size"]  # ids a rank's step
    served = two["load_per_rank"]["lookups"]
    assert sum(served) == 2 * (5 + 3 * bool(pipeline)) * lookups and min(served) > 0
    for r in (one, two, one["unsharded"]):
        assert set(r["parts_ms"]) == {"prefetch", "forward", "backward"}
        assert all(ms > 0 for ms in r["parts_ms"].values())
        assert (r["pipelined_ms"] is not None and r["pipelined_ms"] > 0) == bool(pipeline)
    assert "unsharded" not in two
    assert "sharded over 1 process / unsharded, plain loop:" in printed
    assert ("sharded over 1 process / unsharded, TrainPipeline:" in printed) == bool(pipeline)
    assert "2 processes: per-process throughput" in printed
    assert two["load_imbalance"]["lookups"] >= 1.0 and one["load_imbalance"]["lookups"] == 1.0
    if workload == "hbm":  # every row stored up front: the two shards hold each row once
        assert sum(two["rows_per_rank"]) == one["rows_per_rank"][0]
    else:
        assert all(0 < h <= 1 for h in two["hit_rate_per_rank"])


@pytest.mark.slow
def test_bench_dist_reports_each_rank_load_at_each_alpha(tmp_path, capsys):
    rc = main(["dist", "--device", "cpu", "--gpus", "2", "--scale", "0.001", "--steps", "1", "--warmup", "0",
               "--alpha", "1.05,1.2", "--optimizer", "sgd", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads(next(tmp_path.glob("*-dist.json")).read_text())
    assert [(r["gpus"], r["alpha"]) for r in report["results"]] == [(2, 1.05), (2, 1.2)]
    received = [r["load_per_rank"]["keys_received"] for r in report["results"]]
    assert sum(received[1]) < sum(received[0])  # a steeper Zipf: fewer distinct keys a batch
    printed = capsys.readouterr().out
    assert "keys received max/mean" in printed and "keys_received   per rank" in printed


@pytest.mark.slow
def test_bench_dist_replicate_hot_takes_load_off_the_busiest_rank(tmp_path, capsys):
    rc = main(["dist", "--device", "cpu", "--gpus", "2", "--scale", "0.001", "--steps", "1", "--warmup", "1",
               "--alpha", "1.2", "--optimizer", "sgd", "--replicate-hot", "8", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads(next(tmp_path.glob("*-dist.json")).read_text())
    plain, hot = report["results"]
    assert (plain["replicate_hot"], hot["replicate_hot"]) == (0, 8)
    received = plain["load_per_rank"]["keys_received"], hot["load_per_rank"]["keys_received"]
    assert max(received[1]) < max(received[0])  # the hottest keys no longer go to their owners
    # every id of both ranks' 2 steps still served once (the hot ones where they occur)
    assert sum(hot["load_per_rank"]["lookups"]) == sum(plain["load_per_rank"]["lookups"])
    printed = capsys.readouterr().out
    assert "8 hot keys a table replicated" in printed and "hot replicated" in printed
