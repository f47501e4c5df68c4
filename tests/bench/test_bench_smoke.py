"""``tieredemb bench hbm`` end to end on CPU at a tiny scale, and the row check it relies on.

The smoke run measures every configuration (ours, the nn.EmbeddingBag peer, the bandwidth floor) for
SGD and Adam, and checks the rows ours trained after the steps: for SGD against the exact float64 rows
(``sgd_reference``, itself tested against a float64 nn.EmbeddingBag), for Adam against the peer's. The
unit tests of ``compare_rows`` make sure that check can fail: a check that always passes would prove
nothing.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tieredemb.bench import main
from tieredemb.bench.hbm import HbmOptions, initial_rows, sgd_reference, upstream_grad
from tieredemb.bench.hbm_checks import (
    CHECK_ATOL,
    CHECK_RTOL,
    EXACT_RTOL,
    RowSnapshot,
    check_ranks,
    compare_bounded,
    compare_rows,
)
from tieredemb.bench.workloads import HbmBatches, HbmShape, ZipfSampler, scramble

SCALE = 0.0005  # 840 rows a table, batch 5: 500 lookups a step


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """A run with no ``--out``, from an empty working directory: its reports go to ./bench-hbm."""
    cwd = tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        rc = main(["hbm", "--scale", str(SCALE), "--steps", "2", "--warmup", "2", "--device", "cpu",
                   "--optimizers", "sgd,adam", "--threads", "1", "--no-tbe"])
    assert [p.name for p in cwd.iterdir()] == ["bench-hbm"]
    files = list((cwd / "bench-hbm").glob("*-hbm.json"))
    assert len(files) == 1, f"expected one hbm report in {cwd / 'bench-hbm'}, found {files}"
    assert files[0].with_suffix(".txt").exists()
    data = json.loads(files[0].read_text())
    data["_rc"] = rc
    return data


def test_every_configuration_measured(report: dict) -> None:
    assert report["_rc"] == 0, report
    assert report["ok"] is True
    got = {(r["configuration"], r["optimizer"]) for r in report["results"]}
    assert got == {(c, o) for c in ("ours", "peer", "floor") for o in ("sgd", "adam")}
    for r in report["results"]:
        assert r["error"] is None, r
        for key in ("step_ms", "lookups_per_s", "speedup_vs_peer", "x_floor", "unique_keys_per_step"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] > 0, (key, r)
        if r["configuration"] != "floor":
            assert len(r["step_ms_all"]) == 2
            assert math.isfinite(r["back_to_back_ms"]) and r["back_to_back_ms"] > 0, r
            assert all(math.isfinite(t) and t > 0 for t in r["step_ms_all"])
            assert r["host_rss_bytes"] > 0
    shape = HbmShape().scaled(SCALE)
    assert report["lookups_per_step"] == shape.lookups == 500
    assert report["bandwidth"]["bytes_per_s"] > 0
    assert report["machine"]["torch"] == torch.__version__
    assert report["command_line"].startswith("tieredemb bench hbm --scale")
    assert report["scale"] == SCALE and report["date"]  # what a plot's title names


def test_ours_trained_the_same_rows_as_the_peer(report: dict) -> None:
    checks = {c["optimizer"]: c for c in report["checks"]}
    assert set(checks) == {"sgd", "adam"}
    shape = HbmShape().scaled(SCALE)
    for c in checks.values():
        assert c["passed"], c["problems"]
        assert c["rows_compared"] == shape.num_tables * shape.rows  # every row at this size
        assert c["rows_trained"] > shape.num_tables  # rows were stored and compared...
        assert c["max_moved"] > 100 * CHECK_ATOL  # ...and training moved them well past tolerance
    assert checks["sgd"]["reference"] == "exact" and checks["sgd"]["rtol"] == EXACT_RTOL
    assert 0 <= checks["sgd"]["peer_max_abs_diff"] < 1e-3 * checks["sgd"]["max_moved"]
    assert checks["adam"]["reference"] == "peer" and checks["adam"]["peer_max_abs_diff"] is None


def test_the_pipelined_configuration_trains_the_same_rows(tmp_path) -> None:
    """``--pipeline``: ours again under TrainPipeline (its inline, deferred prefetch), timed and held to
    the same exact rows as the plain run."""
    rc = main(["hbm", "--scale", str(SCALE), "--steps", "2", "--warmup", "2", "--device", "cpu",
               "--optimizers", "sgd", "--threads", "1", "--pipeline", "--no-tbe", "--out", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("*-hbm.json")).read_text())
    assert rc == 0 and data["ok"] is True
    labels = [r["label"] for r in data["results"] if r["configuration"] == "ours"]
    assert labels == ["ours (torch kernels)", "ours (torch kernels, TrainPipeline)"]
    piped = next(r for r in data["results"] if r["label"].endswith("TrainPipeline)"))
    assert piped["error"] is None and piped["step_ms"] > 0 and piped["back_to_back_ms"] == piped["step_ms"]
    checks = {c["kernels"]: c for c in data["checks"]}
    assert set(checks) == {"torch", "torch+pipeline"}
    assert checks["torch+pipeline"]["passed"] and checks["torch+pipeline"]["reference"] == "exact"
    assert checks["torch+pipeline"]["rows_trained"] == checks["torch"]["rows_trained"] > 0


def test_sgd_reference_is_float64_sgd() -> None:
    """The exact rows equal a float64 nn.EmbeddingBag + torch.optim.SGD trained on the same batches
    (warmup and back-to-back steps included): what the SGD check holds ours to is plain SGD, not ours'
    own arithmetic."""
    opts = HbmOptions(shape=HbmShape().scaled(SCALE), steps=2, warmup=1)
    shape, cpu = opts.shape, torch.device("cpu")
    batches, grad = HbmBatches(shape, cpu, opts.seed), upstream_grad(shape, cpu, opts.seed)
    ranks = check_ranks(shape, opts.seed)  # every rank at this size
    exact = sgd_reference(opts, batches, grad, ranks)
    configs = shape.table_configs()
    peers = [torch.nn.EmbeddingBag.from_pretrained(initial_rows(c, t, ranks[t], opts.seed).double(),
                                                   freeze=False, mode="sum", sparse=True)
             for t, c in enumerate(configs)]
    opt = torch.optim.SGD([p.weight for p in peers], lr=0.01)
    for i in range(opts.warmup + 2 * opts.steps):  # warmup, timed, back to back
        ranks_i = batches.batch(i).ranks
        torch.cat([emb(ranks_i[t]) for t, emb in enumerate(peers)], dim=1).backward(grad.double())
        opt.step()
        opt.zero_grad(set_to_none=True)
    for t, emb in enumerate(peers):
        assert exact[t].dtype == torch.float64 and exact[t].shape == (shape.rows, shape.dim)
        torch.testing.assert_close(exact[t], emb.weight.detach(), rtol=1e-12, atol=1e-15)
    assert float((exact[0] - peers[0].weight.detach()).abs().max()) < 1e-12
    assert float((exact[0] - initial_rows(configs[0], 0, ranks[0], opts.seed)).abs().max()) > 1e-3


def test_floor_bytes_follow_the_formula(report: dict) -> None:
    shape = HbmShape().scaled(SCALE)
    floors = {r["optimizer"]: r for r in report["results"] if r["configuration"] == "floor"}
    for optimizer, row_floats in (("sgd", shape.dim), ("adam", 3 * shape.dim)):
        parts = floors[optimizer]["extra"]["bytes_per_step"]
        unique = floors[optimizer]["unique_keys_per_step"]
        assert parts["rows_read_and_written"] == pytest.approx(unique * row_floats * 4 * 2)
        assert parts["ids_read"] == shape.lookups * 8
        assert parts["output_written"] == parts["output_grad_read"] == (
            shape.batch_size * shape.num_tables * shape.dim * 4)


@pytest.mark.slow
def test_bounded_tables_are_held_to_the_reference_kernels(tmp_path) -> None:
    """``--capacity``: ours again with every table bounded (no row stored first, so misses and
    evictions every step), plain and under TrainPipeline, and the torch kernels' run of the same
    bounded tables as the reference; each bounded run's counters and rows checked against it. Every
    table with ``init_capacity`` 32 (rows allocated up front)."""
    args = ["hbm", "--scale", str(SCALE), "--steps", "2", "--warmup", "2", "--device", "cpu",
            "--optimizers", "adam", "--threads", "1", "--pipeline", "--capacity", "64", "--no-tbe",
            "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="init_capacity"):
        main([*args, "--init-capacity", "0"])
    assert not list(tmp_path.iterdir())
    rc = main([*args, "--init-capacity", "32"])
    data = json.loads(next(tmp_path.glob("*-hbm.json")).read_text())
    assert rc == 0 and data["ok"] is True and data["options"]["capacity"] == 64
    assert data["options"]["init_capacity"] == 32
    labels = [(r["configuration"], r["label"]) for r in data["results"]]
    assert labels == [("ours", "ours (torch kernels)"), ("ours", "ours (torch kernels, TrainPipeline)"),
                      ("ours", "ours (torch kernels, max_capacity 64)"),
                      ("ours", "ours (torch kernels, TrainPipeline, max_capacity 64)"),
                      ("reference", "reference: ours (torch kernels, max_capacity 64)"),
                      ("peer", "nn.EmbeddingBag + SparseAdam"), ("floor", "bandwidth floor")]
    shape = HbmShape().scaled(SCALE)
    for r in data["results"][2:5]:
        assert r["error"] is None and r["step_ms"] > 0
        assert r["new_keys_per_step"] > 0 and r["extra"]["evictions_per_step"] > 0
        assert r["extra"]["rows_stored"] == 64 * shape.num_tables  # 64: two whole buckets
    checks = {c["kernels"]: c for c in data["checks"]}
    assert set(checks) == {"torch", "torch+pipeline", "torch+cap64", "torch+pipeline+cap64"}
    for name in ("torch+cap64", "torch+pipeline+cap64"):
        assert checks[name]["passed"] and checks[name]["reference"] == "torch+cap64"
        assert checks[name]["rows_trained"] == 64 * shape.num_tables
        assert checks[name]["max_moved"] > 100 * CHECK_ATOL
    assert checks["torch"]["reference"] == "peer"


@pytest.mark.slow
def test_tables_that_outgrow_their_first_allocation_train_the_same_rows(tmp_path) -> None:
    """Enough steps that every table stores thousands of keys: the index rehashes and the row store
    adds segments mid-run, and the rows must still match the peer's (~30 s on CPU)."""
    rc = main(["hbm", "--scale", "0.03", "--steps", "2", "--warmup", "6", "--device", "cpu",
               "--optimizers", "sgd", "--threads", "1", "--no-tbe", "--out", str(tmp_path)])
    data = json.loads(next(tmp_path.glob("*-hbm.json")).read_text())
    ours = next(r for r in data["results"] if r["configuration"] == "ours")
    assert ours["extra"]["rows_stored"] > 10 * 5000  # over 5000 keys a table
    (check,) = data["checks"]
    assert check["passed"], check["problems"]
    assert rc == 0


# -------------------------------------------------------------------------- the row comparison
def _snapshot_and_peer(gen: torch.Generator):
    """Two tables of 6 rows, D=3: a consistent (snapshot, peer rows, initial rows, seen) set. Row 1 of
    table 1 moved to 10, so relative tolerances matter there."""
    ranks = [torch.arange(6), torch.arange(6)]
    seen = [torch.tensor([1, 1, 0, 1, 0, 0], dtype=torch.bool)] * 2
    initial = [torch.rand(6, 3, generator=gen) for _ in ranks]
    peer = [init + seen_t[:, None] * torch.rand(6, 3, generator=gen)
            for init, seen_t in zip(initial, seen)]
    peer[1][1] = 10.0
    ours = [torch.where(seen_t[:, None], p, torch.zeros(())) for p, seen_t in zip(peer, seen)]
    snap = RowSnapshot("torch", ranks, ours, [s.clone() for s in seen], [3, 3])
    return snap, peer, initial, seen, [3, 3]


def test_compare_rows_passes_when_rows_agree() -> None:
    snap, peer, initial, seen, total = _snapshot_and_peer(torch.Generator().manual_seed(0))
    check = compare_rows("sgd", snap, peer, initial, seen, total)
    assert check.passed, check.problems
    assert check.rows_trained == 6 and check.rows_compared == 12


@pytest.mark.parametrize("fault", ["weight", "missing_key", "extra_row_count", "untouched_moved",
                                   "nothing_moved"])
def test_compare_rows_catches_differences(fault: str) -> None:
    snap, peer, initial, seen, total = _snapshot_and_peer(torch.Generator().manual_seed(1))
    if fault == "weight":
        snap.weights[1][3, 2] += 1e-3
    elif fault == "missing_key":
        snap.found[0] = snap.found[0].clone()
        snap.found[0][1] = False
    elif fault == "extra_row_count":
        snap.stored[0] = 4
    elif fault == "untouched_moved":
        peer[1][4, 0] += 1.0
    else:
        peer = [init.clone() for init in initial]
        snap.weights = [torch.where(s[:, None], p, torch.zeros(())) for p, s in zip(peer, seen)]
    check = compare_rows("adam", snap, peer, initial, seen, total)
    assert not check.passed and check.problems


def _bounded_snapshots(gen: torch.Generator):
    """Two tables of 8 checked ranks, D=3, bounded to 4 rows (a bucket of 32 would round them up to
    32): (snapshot, an equal reference, initial rows). Table 0 stores ranks 0-3, table 1 ranks 4-7."""
    ranks = [torch.arange(8), torch.arange(8)]
    found = [torch.arange(8) < 4, torch.arange(8) >= 4]
    initial = [torch.rand(8, 3, generator=gen) for _ in ranks]
    weights = [torch.where(f[:, None], init + torch.rand(8, 3, generator=gen), torch.zeros(()))
               for f, init in zip(found, initial)]

    def snapshot(kernels: str) -> RowSnapshot:
        return RowSnapshot(kernels, ranks, [w.clone() for w in weights], [f.clone() for f in found],
                           [4, 4], misses=[9, 7], evictions=[5, 3], capacity=[4, 4])

    return snapshot("triton+cap4"), snapshot("torch+cap4"), initial


@pytest.mark.parametrize("fault", [None, "weight", "stored_key", "misses", "evictions", "no_evictions",
                                   "over_capacity", "nothing_moved"])
def test_compare_bounded_catches_differences(fault: str | None) -> None:
    """The bounded runs' check passes on equal snapshots and fails on each kind of difference, and on
    a run that evicted nothing or stores more rows than its bound."""
    snap, ref, initial = _bounded_snapshots(torch.Generator().manual_seed(3))
    if fault == "weight":
        snap.weights[1][5, 1] += 1e-3
    elif fault == "stored_key":
        snap.found[0][3], snap.found[0][4] = False, True
    elif fault == "misses":
        snap.misses[1] += 1
    elif fault == "evictions":
        snap.evictions[0] -= 1
    elif fault == "no_evictions":
        snap.evictions[1] = ref.evictions[1] = 0
    elif fault == "over_capacity":
        snap.stored[0] = ref.stored[0] = 33  # over 4 rounded up to one bucket of 32
    elif fault == "nothing_moved":
        snap.weights = [torch.where(f[:, None], i, torch.zeros(())) for f, i in zip(snap.found, initial)]
        ref.weights = [w.clone() for w in snap.weights]
    check = compare_bounded("adam", snap, ref, initial)
    assert check.reference == "torch+cap4" and check.kernels == "triton+cap4"
    if fault is None:
        assert check.passed, check.problems
        assert check.rows_compared == 16 and check.rows_trained == 8 and check.max_moved > 0
    else:
        assert not check.passed and check.problems, fault


def test_compare_rows_holds_sgd_to_the_exact_rows() -> None:
    """With exact rows ours is held to them, tighter than to the peer: an error of 5e-5 of the row
    passes against the peer (CHECK_RTOL) but not against the exact rows (EXACT_RTOL); the peer's own
    distance is reported, and a peer that trained something else fails."""
    snap, peer, initial, seen, total = _snapshot_and_peer(torch.Generator().manual_seed(2))
    exact = [p.double() for p in peer]
    peer[1][1] *= 1 + 1e-4  # the peer's fp32 rounding: reported, within PEER_EXACT_RTOL
    check = compare_rows("sgd", snap, peer, initial, seen, total, exact)
    assert check.passed, check.problems
    assert check.reference == "exact" and check.max_abs_diff == 0.0
    assert check.peer_max_abs_diff == pytest.approx(1e-3, rel=1e-3)

    snap.weights[1][1, 2] *= 1 + 5e-5
    assert EXACT_RTOL < 5e-5 < CHECK_RTOL
    assert compare_rows("sgd", snap, peer, initial, seen, total).passed  # against the peer alone
    check = compare_rows("sgd", snap, peer, initial, seen, total, exact)
    assert not check.passed and "exact rows" in check.problems[0]

    snap.weights[1][1, 2] = float(exact[1][1, 2])
    peer[0][1, 0] += 0.1  # not rounding: the peer trained something else
    check = compare_rows("sgd", snap, peer, initial, seen, total, exact)
    assert not check.passed and "the peer's trained rows" in check.problems[0]


# ---------------------------------------------------------------------------------- workload
def test_zipf_sampler_and_scramble() -> None:
    sampler = ZipfSampler(1000, 1.05, torch.device("cpu"))
    ranks = sampler.sample((20000,), torch.Generator().manual_seed(0))
    assert int(ranks.min()) >= 0 and int(ranks.max()) < 1000
    counts = torch.bincount(ranks, minlength=1000).double()
    # P(0) / P(9) = 10**1.05 ~ 11.2
    assert 8 < float(counts[0] / counts[9]) < 15
    ids = scramble(torch.arange(1000), 3)
    assert torch.unique(ids).numel() == 1000  # a bijection: no two ranks share an id
    assert not torch.equal(ids, scramble(torch.arange(1000), 4))


def test_batches_are_a_function_of_seed_and_step() -> None:
    shape = HbmShape().scaled(SCALE)
    a = HbmBatches(shape, torch.device("cpu"), seed=5)
    b = HbmBatches(shape, torch.device("cpu"), seed=5)
    later = a.batch(3)
    a.batch(0)
    assert torch.equal(b.batch(3).ranks, later.ranks)
    assert torch.equal(a.batch(3).kjt.values(), later.kjt.values())
    assert later.ranks.shape == (shape.num_tables, shape.batch_size, shape.bag_size)
    assert later.kjt.keys() == [f"f{t}" for t in range(shape.num_tables)]
    assert torch.equal(later.kjt.values().view(shape.num_tables, -1)[2],
                       scramble(later.ranks[2].reshape(-1), 2))
    first = a.batch(0)
    for t in range(shape.num_tables):  # seen: exactly the ranks of the batches generated (0 and 3)
        want = torch.zeros(shape.rows, dtype=torch.bool)
        want[first.ranks[t].reshape(-1)] = True
        want[later.ranks[t].reshape(-1)] = True
        assert torch.equal(a.seen[t], want)


@pytest.mark.slow
def test_bench_checkpoint_smoke(tmp_path) -> None:
    """``tieredemb bench checkpoint`` at a tiny size: saves and loads both layouts, writes its report."""
    from tieredemb.bench import main

    assert main(["checkpoint", "--rows", "3000", "--dim", "8", "--dir", str(tmp_path / "disk"),
                 "--buffer-mib", "1", "--out", str(tmp_path / "out")]) == 0
    report = json.loads(next((tmp_path / "out").glob("*-checkpoint.json")).read_text())
    assert [r["layout"] for r in report["results"]] == ["hbm_direct", "cache over RocksDB"]
    assert all(r["bytes"] > 3000 * 8 * 3 * 4 for r in report["results"])  # every row was written


def test_reports_name_the_source_that_ran(report: dict, tmp_path) -> None:
    """``machine.source_hash`` follows the package's Python files (a path or a byte changed, a file
    added), not the checkout's commit, which a copied working tree does not move."""
    from tieredemb.bench.report import source_hash

    assert len(report["machine"]["source_hash"]) == 16
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    first = source_hash(tmp_path)
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    second = source_hash(tmp_path)
    (tmp_path / "pkg" / "b.py").write_text("")
    third = source_hash(tmp_path)
    (tmp_path / "notes.txt").write_text("not code")
    assert len({first, second, third}) == 3 and source_hash(tmp_path) == third
