"""FBGEMM's TBE as the ``hbm`` bench's peer, timed in turns with ours (``tieredemb.bench.hbm_tbe``).

On a CPU, ``fbgemm-gpu-cpu`` runs TBE over host rows (SGD and both Adagrads): the bench's TBE code
path runs here as it does on the GPU machine, and TBE's rows are an independent reference for ours.
"""

from __future__ import annotations

import json

import pytest
import torch

from tieredemb.bench import main
from tieredemb.bench.hbm import HbmOptions, build_ours, check_against_peer, initial_rows, upstream_grad
from tieredemb.bench.hbm_tbe import HbmTbeRace, blocks
from tieredemb.bench.tbe import TbeSpec, TbeTables, unavailable
from tieredemb.bench.workloads import HbmBatches, HbmShape

pytest.importorskip("fbgemm_gpu", reason="fbgemm-gpu-cpu is installed by ./run test (the interop extra)")

SCALE = 0.0005  # 840 rows a table, batch 5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tbe")
    rc = main(["hbm", "--scale", str(SCALE), "--steps", "4", "--warmup", "2", "--device", "cpu",
               "--optimizers", "sgd,rowwise_adagrad,adam", "--threads", "1", "--pipeline", "--turn", "2",
               "--out", str(out)])
    data = json.loads(next(out.glob("*-hbm.json")).read_text())
    data["_rc"] = rc
    data["_text"] = next(out.glob("*-hbm.txt")).read_text()
    return data


def test_tbe_runs_in_turns_with_ours_and_trains_the_same_rows(report: dict) -> None:
    assert report["_rc"] == 0 and report["ok"] is True
    tbe = [r for r in report["results"] if r["configuration"] == "tbe"]
    assert [(r["optimizer"], r["label"]) for r in tbe] == [
        ("sgd", "FBGEMM TBE (HOST, fp32)"), ("rowwise_adagrad", "FBGEMM TBE (HOST, fp32)")]
    for optimizer in ("sgd", "rowwise_adagrad"):
        raced = [r for r in report["results"] if r["optimizer"] == optimizer and "in_turns_of" in r["extra"]]
        # ours plain, ours under TrainPipeline, TBE: 2 * steps batches in blocks of 2, taken in turns
        assert len(raced) == 3 and all(r["extra"]["in_turns_of"] == 2 for r in raced)
        ours = [r for r in raced if r["configuration"] == "ours"]
        assert sorted(len(r["step_ms_all"]) for r in ours) == [2, 2]
        assert len(next(r for r in raced if r["configuration"] == "tbe")["step_ms_all"]) == 4
        assert all(r["step_ms"] > 0 and r["error"] is None for r in raced)
    checks = {c["optimizer"]: c for c in report["checks"] if c["kernels"] == "in turns with TBE"}
    assert set(checks) == {"sgd", "rowwise_adagrad"}
    assert checks["sgd"]["reference"] == "exact" and checks["sgd"]["passed"]
    assert 0 <= checks["sgd"]["peer_max_abs_diff"] < 1e-3 * checks["sgd"]["max_moved"]  # TBE's own rows
    assert checks["rowwise_adagrad"]["reference"] == "FBGEMM TBE" and checks["rowwise_adagrad"]["passed"]
    assert checks["rowwise_adagrad"]["max_moved"] > 1e-3 and checks["rowwise_adagrad"]["rows_trained"] > 0


def test_each_target_against_tbe_has_a_verdict_and_skips_are_noted(report: dict) -> None:
    targets = report["targets"]
    assert len(targets) == 4  # (plain, pipeline) x (sgd, rowwise_adagrad)
    for t in targets:
        assert t["op"] == "<=" and t["bound"] == 1.0 and t["met"] == (t["figure"] <= 1.0)
        assert "/ FBGEMM TBE (HOST, fp32)" in t["what"]
    assert "adam: FBGEMM's TBE skipped: its CPU build has no Adam" in report["notes"]
    assert "rowwise_adagrad: no nn.EmbeddingBag peer (torch.optim has no such optimizer)" in report["notes"]


def test_tbe_rows_start_as_ours_and_a_wrong_tbe_is_caught() -> None:
    """TBE's rows before training are ours' initial rows of the same keys; a TBE trained with another
    learning rate gives rows the check refuses (the check can fail)."""
    opts = HbmOptions(shape=HbmShape().scaled(SCALE), device=CPU, optimizers=["rowwise_adagrad"],
                      kernels=["torch"], steps=2, warmup=2, pipeline=False)
    configs = opts.shape.table_configs()

    def initial(t, ranks):
        return initial_rows(configs[t], t, ranks, opts.seed)

    fresh = TbeTables(opts.shape, CPU, TbeSpec("rowwise_adagrad", 0.01), initial)
    ranks = torch.arange(opts.shape.rows)
    assert torch.equal(fresh.rows(3, ranks), initial(3, ranks))
    batches = HbmBatches(opts.shape, CPU, opts.seed)
    grad = upstream_grad(opts.shape, CPU, opts.seed)
    for lr, passed in ((0.01, True), (0.02, False)):
        race = HbmTbeRace(opts, "rowwise_adagrad", TbeSpec("rowwise_adagrad", lr),
                          lambda: build_ours(opts, "rowwise_adagrad", "torch", None), initial,
                          lambda snap, w: check_against_peer(opts, "rowwise_adagrad", snap, w, batches),
                          turn=3)
        results, check = race.run(batches, grad, None)
        assert [r.configuration for r in results] == ["ours", "tbe"]
        assert check.passed is passed, check.problems


def test_blocks_cover_the_range_in_order() -> None:
    assert blocks(0, 7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert [i for b in blocks(2, 11, 4) for i in b] == list(range(2, 11))


def test_what_tbe_cannot_run_is_said() -> None:
    assert unavailable(TbeSpec("adam", 0.001), CPU) == "FBGEMM's TBE skipped: its CPU build has no Adam"
    assert unavailable(TbeSpec("sgd", 0.01, location="managed_caching"), CPU) == \
        "FBGEMM's TBE skipped: MANAGED_CACHING needs CUDA"
    assert unavailable(TbeSpec("adam", 0.001, precision="fp16"), torch.device("cuda")) == \
        "FBGEMM's TBE skipped: its Adam refuses fp16 rows"
    assert unavailable(TbeSpec("sgd", 0.01), CPU) is None
    with pytest.raises(ValueError, match="no optimizer 'lamb'"):
        TbeSpec("lamb", 0.01)
    with pytest.raises(ValueError, match="precision must be one of"):
        TbeSpec("sgd", 0.01, precision="bf16")


def test_the_cache_check_of_tbe_can_fail() -> None:
    """``compare_tbe``: TBE's rows equal the peer's where the peer stores the key, and are the initial
    rows elsewhere; a changed row or a moved untouched row is reported."""
    from tieredemb.bench.cache_runs import table_configs
    from tieredemb.bench.cache_tbe import compare_tbe

    shape = HbmShape(num_tables=2, rows=50, dim=4, batch_size=2, bag_size=2)
    keys = [torch.arange(10), torch.arange(10)]
    found = torch.arange(10) < 6
    initial = [c.initializer.rows(0, c.name, k, shape.dim) for c, k in zip(table_configs(shape), keys)]
    peer = [(torch.where(found[:, None], init + 0.5, torch.zeros(())), found) for init in initial]
    tbe = [torch.where(found[:, None], init + 0.5, init) for init in initial]
    assert compare_tbe(shape, keys, tbe, peer, 0).passed
    changed = [tbe[0].clone(), tbe[1]]
    changed[0][2, 1] += 1e-2
    check = compare_tbe(shape, keys, changed, peer, 0)
    assert not check.passed and "table 0: TBE's rows differ" in check.problems[0]
    moved = [tbe[0], tbe[1].clone()]
    moved[1][8] += 1.0
    check = compare_tbe(shape, keys, moved, peer, 0)
    assert check.problems == ["table 1: TBE's untouched rows are not their initial rows"]


def test_the_cache_bench_says_why_tbe_did_not_run(tmp_path) -> None:
    rc = main(["cache", "--scale", "0.0002", "--steps", "2", "--warmup", "2", "--device", "cpu",
               "--out", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("*-cache.json")).read_text())
    assert rc == 0 and data["notes"] == ["FBGEMM's TBE skipped: MANAGED_CACHING needs CUDA"]
    assert data["tbe_check"] is None
    text = next(tmp_path.glob("*-cache.txt")).read_text()
    assert "FBGEMM's TBE skipped: MANAGED_CACHING needs CUDA" in text


def test_16_bit_rows_are_timed_beside_tbe_fp16(tmp_path) -> None:
    """``--dtype bf16``: ours' tables store 16-bit rows (the floor counts 2 bytes a value), TBE's
    fp16 rows beside them; no row check (16-bit rows are not the fp32 peers')."""
    rc = main(["hbm", "--scale", str(SCALE), "--steps", "2", "--warmup", "2", "--device", "cpu",
               "--optimizers", "sgd", "--threads", "1", "--dtype", "bf16", "--tbe-precision", "fp16",
               "--turn", "2", "--out", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("*-hbm.json")).read_text())
    assert rc == 0 and data["options"]["dtype"] == "bf16" and data["checks"] == []
    labels = [r["label"] for r in data["results"]]
    assert "ours (torch kernels), bf16 rows" in labels and "FBGEMM TBE (HOST, fp16)" in labels
    assert "ours (torch kernels), in turns with TBE, bf16 rows" in labels
    floor = next(r for r in data["results"] if r["configuration"] == "floor")
    unique = floor["unique_keys_per_step"]
    assert floor["extra"]["bytes_per_step"]["rows_read_and_written"] == unique * 128 * 2 * 2
    with pytest.raises(ValueError, match="bounded tables"):
        HbmOptions(shape=HbmShape().scaled(SCALE), dtype="bf16", capacity=64)
