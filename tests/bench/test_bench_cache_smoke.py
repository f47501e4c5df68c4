"""``tieredemb bench cache`` and ``bench ssd`` end to end on CPU at a tiny scale.

Each run measures ours (cache mode over host memory / RocksDB) and the same tables all in device
memory on the same batches, then compares, after ``ebc.flush()``, ours' rows of a sample of keys with
the all-HBM rows. The unit test of ``compare`` makes sure that comparison can fail.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import tieredemb as te
from tieredemb.bench import main
from tieredemb.bench.cache import cache_shape
from tieredemb.bench.cache_runs import LR, CacheOptions, RankBatches, compare, prefill, table_configs
from tieredemb.bench.workloads import HbmShape

SCALE = 0.001  # 10,000 rows a table, batch 10: 1,000 lookups a step; cache 1,000 rows a table


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module", params=["cache", "ssd"])
def report(request, tmp_path_factory) -> dict:
    """A run with no ``--out``, from an empty working directory: its reports go to ./bench-cache
    (./bench-ssd). ``_text``: the table and the lines under it, as printed."""
    workload = request.param
    cwd = tmp_path_factory.mktemp(f"cwd-{workload}")
    args = [workload, "--scale", str(SCALE), "--steps", "3", "--warmup", "5", "--device", "cpu",
            "--threads", "1"]
    if workload == "ssd":
        args += ["--dir", str(tmp_path_factory.mktemp("rocksdb")), "--shards", "2", "--raw-rows", "2000"]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        rc = main(args)
    out = cwd / f"bench-{workload}"
    assert [p.name for p in cwd.iterdir()] == [out.name]
    files = list(out.glob(f"*-{workload}.json"))
    assert len(files) == 1, f"expected one {workload} report in {out}, found {files}"
    data = json.loads(files[0].read_text())
    data["_rc"], data["_text"] = rc, files[0].with_suffix(".txt").read_text()
    return data


def test_both_configurations_measured(report: dict) -> None:
    assert report["_rc"] == 0, report
    assert report["ok"] is True
    got = {r["configuration"]: r for r in report["results"]}
    assert set(got) == {"ours", "peer"}
    for r in got.values():
        assert r["error"] is None, r
        assert _finite_positive(r["step_ms"]) and len(r["step_ms_all"]) == 3
        assert all(_finite_positive(t) for t in r["step_ms_all"])
    ours = got["ours"]["extra"]
    assert ours["storage_mode"] == "cache"
    assert got["peer"]["extra"]["storage_mode"] == "hbm_direct"
    assert 0.0 <= ours["hit_rate"] <= 1.0
    moved = ours["bytes_moved_per_step"]
    assert moved["backend->device"] + moved["device->backend"] > 0
    assert ours["timed_counters"]["evictions"] > 0  # the cache is full: the run exercises eviction
    assert _finite_positive(report["ratio_vs_all_hbm"])
    assert _finite_positive(report["bandwidth"]["host_to_device_bytes_per_s"])
    shape = cache_shape(SCALE)
    assert report["footprint_bytes"] == shape.num_tables * shape.rows * 129 * 4
    assert report["cache_rows_per_table"][0] == shape.rows // 10


def test_rows_after_flush_equal_the_all_hbm_rows(report: dict) -> None:
    check = report["check"]
    assert check["passed"], check["problems"]
    assert check["rows_found"] > 0 and check["rows_moved"] > 0
    assert check["max_abs_diff"] <= 1e-5


def test_ssd_reports_raw_rocksdb_rates(report: dict) -> None:
    if report["workload"] != "ssd":
        assert report["rocksdb_rates"] is None
        return
    rates = report["rocksdb_rates"]
    assert rates["rows"] == 2000 and rates["raw_get_found"] == 2000 == rates["backend_get_found"]
    for key in ("raw_get_rows_per_s", "raw_put_rows_per_s", "backend_get_rows_per_s",
                "backend_set_rows_per_s", "raw_get_bytes_per_s"):
        assert _finite_positive(rates[key]), key


def test_ssd_reports_the_disk_and_the_floor_of_the_step(report: dict) -> None:
    """ssd: the disk's own figures (O_DIRECT where the file system takes it; RocksDB then reads with
    O_DIRECT too), and the least step time they allow ours' misses and writes, beside the step."""
    if report["workload"] != "ssd":
        assert report["disk"] is None and report["disk_floor"] is None
        assert report["options"]["direct_reads"] is False
        return
    d = report["disk"]
    for key in ("seq_write_bytes_per_s", "seq_read_bytes_per_s", "random_read_iops",
                "random_read_bytes_per_s"):
        assert _finite_positive(d[key]), key
    assert d["file_bytes"] >= 16 << 20 and d["random_read_threads"] == 32 and d["random_reads"] > 0
    assert (d["note"] is None) == d["direct"]
    assert report["options"]["direct_reads"] is d["direct"]  # asked for (the default), where allowed
    assert report["rocksdb_rates"]["direct_reads"] is d["direct"]
    ours = next(r for r in report["results"] if r["configuration"] == "ours")
    x = ours["extra"]
    f = report["disk_floor"]
    misses, written = x["misses_per_step"], x["bytes_moved_per_step"]["device->backend"]
    assert misses > 0 and written > 0
    want = 1e3 * (misses / d["random_read_iops"] + written / d["seq_write_bytes_per_s"])
    assert f["floor_ms"] == pytest.approx(want) and f["step_ms"] == ours["step_ms"]
    assert ours["x_floor"] == pytest.approx(ours["step_ms"] / want)
    text = report["_text"]
    assert "random 4 KiB reads" in text and "from 32 threads" in text
    assert f"disk floor of ours' step: {want:.3f} ms" in text
    assert ("O_DIRECT reads" in ours["label"]) is d["direct"]


def test_a_cpu_run_says_device_memory_not_hbm(report: dict) -> None:
    """On a CPU the peer's tables are in host memory: the reports call it device memory ("HBM" is
    a GPU's); "hbm_direct", the storage mode's name, stays."""
    peer = next(r for r in report["results"] if r["configuration"] == "peer")
    assert peer["label"] == "all in device memory (hbm_direct)"
    assert "HBM" not in report["_text"]
    assert "device memory budget 0.1" in report["_text"]
    assert "check ours vs all in device memory after flush: same rows" in report["_text"]


def test_every_target_line_gives_its_verdict(report: dict) -> None:
    """cache: the step against the peer's, at most 1.5x; ssd: our RocksDB backend's get and set rates,
    at least 80% of raw rocksdict's. Each line says met or NOT met, and so does the JSON."""
    targets = report["targets"]
    if report["workload"] == "cache":
        assert [(t["what"], t["op"], t["bound"]) for t in targets] == [
            ("ours / all in device memory step time", "<=", 1.5)]
        assert targets[0]["figure"] == pytest.approx(report["ratio_vs_all_hbm"])
    else:
        rates = report["rocksdb_rates"]
        assert [(t["what"], t["op"], t["bound"]) for t in targets] == [
            ("RocksDBBackend / raw rocksdict get", ">=", 0.8),
            ("RocksDBBackend / raw rocksdict set", ">=", 0.8)]
        ratio = rates["backend_set_rows_per_s"] / rates["raw_put_rows_per_s"]
        assert targets[1]["figure"] == pytest.approx(ratio)
    lines = [line for line in report["_text"].splitlines() if "(target: " in line]
    assert len(lines) == len(targets)
    for line, t in zip(lines, targets):
        assert t["met"] == (t["figure"] <= t["bound"] if t["op"] == "<=" else t["figure"] >= t["bound"])
        assert line.startswith(t["what"] + ": ") and line.endswith("): met" if t["met"] else "): NOT met")


def test_compare_catches_a_different_row() -> None:
    shape = cache_shape(SCALE)
    batch = RankBatches(shape, torch.device("cpu")).batch(0)
    keys = [torch.arange(4) for _ in range(shape.num_tables)]
    rows = [(torch.full((4, shape.dim), 0.5), torch.ones(4, dtype=torch.bool))
            for _ in range(shape.num_tables)]
    assert batch.kjt.values().numel() == shape.lookups
    assert compare(shape, keys, rows, [(w.clone(), f.clone()) for w, f in rows], 0).passed
    other = [(w.clone(), f.clone()) for w, f in rows]
    other[3][0][2, 7] += 1e-3
    bad = compare(shape, keys, rows, other, 0)
    assert not bad.passed and "table 3" in bad.problems[0]
    other = [(w.clone(), f.clone()) for w, f in rows]
    other[1][1][0] = False
    assert not compare(shape, keys, rows, other, 0).passed


def test_ids_are_the_hbm_workloads_ranks() -> None:
    from tieredemb.bench.workloads import HbmBatches

    shape = cache_shape(SCALE)
    ours = RankBatches(shape, torch.device("cpu"), seed=3).batch(5)
    hbm = HbmBatches(shape, torch.device("cpu"), seed=3).batch(5)
    assert torch.equal(ours.ranks, hbm.ranks)
    assert torch.equal(ours.kjt.values(), hbm.ranks.reshape(-1))
    assert ours.unique_keys == sum(hbm.unique_keys)


def test_turns_change_no_configurations_training(tmp_path) -> None:
    """Ours and the peer timed in turns of one step train exactly as when each runs alone from start
    to finish: the same counters, the same checked rows."""
    reports = {}
    for turn in (0, 1):
        out = tmp_path / f"turn{turn}"
        rc = main(["cache", "--scale", str(SCALE), "--steps", "3", "--warmup", "2", "--device", "cpu",
                   "--threads", "1", "--interleave", str(turn), "--out", str(out)])
        data = json.loads(next(out.glob("*-cache.json")).read_text())
        assert rc == 0 and data["ok"] is True and data["options"]["interleave"] == turn
        reports[turn] = {r["configuration"]: r for r in data["results"]}
        assert [r["configuration"] for r in data["results"]] == ["ours", "peer"]
    for configuration in ("ours", "peer"):
        alone, turns = reports[0][configuration], reports[1][configuration]
        assert len(turns["step_ms_all"]) == 3
        assert alone["extra"]["timed_counters"] == turns["extra"]["timed_counters"]
        assert alone["unique_keys_per_step"] == turns["unique_keys_per_step"]
    assert reports[1]["ours"]["extra"]["timed_counters"]["misses"] > 0


def test_interleave_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="interleave must be >= 0"):
        CacheOptions(interleave=-1)


@pytest.mark.parametrize("turn", [0, 2], ids=["one-after-the-other", "in-turns"])
def test_a_configuration_that_fails_is_reported_once_and_the_other_still_runs(turn, monkeypatch) -> None:
    from tieredemb.bench.cache import CacheBench
    from tieredemb.bench.cache_runs import ConfigRun

    start = ConfigRun.start

    def failing_start(self, others=0):
        if self.configuration == "ours":
            raise RuntimeError("no room for the cache")
        start(self, others)

    monkeypatch.setattr(ConfigRun, "start", failing_start)
    bench = CacheBench(CacheOptions(shape=cache_shape(SCALE), steps=3, warmup=1, interleave=turn))
    bench.run()
    assert [(r.configuration, r.error) for r in bench.results] == [
        ("ours", "RuntimeError: no room for the cache"), ("peer", None)]
    assert len(bench.results[1].step_ms_all) == 3
    assert bench.check is None and not bench.ok


def test_ssd_with_a_host_tier_and_reads_ahead(tmp_path) -> None:
    """``--host-budget`` adds the host tier's run (its rows checked against all in device memory after
    flush), the same cache over HostMemory, and three TrainPipeline runs with a DLRM-style model
    (their losses checked equal)."""
    args = ["ssd", "--scale", str(SCALE), "--steps", "3", "--warmup", "3", "--device", "cpu",
            "--threads", "1", "--dir", str(tmp_path / "db"), "--shards", "2", "--raw-rows", "2000",
            "--host-budget", "20000", "--lookahead", "2", "--dense-width", "16", "--dense-layers", "1",
            "--out", str(tmp_path / "out"), "--interleave", "2"]  # (turns of 2 steps, then 1)
    assert main(args) == 0
    data = json.loads(next((tmp_path / "out").glob("*-ssd.json")).read_text())
    got = {r["configuration"]: r for r in data["results"]}
    assert len(got) == len(data["results"])  # (each run reported once)
    assert set(got) == {"ours", "peer", "host_tier", "host_memory", "pipeline", "pipeline_host_tier",
                        "pipeline_peer"}
    for r in got.values():
        assert r["error"] is None and _finite_positive(r["step_ms"]), r
    host = data["host_tier"]
    assert host["check"]["passed"] and host["check"]["rows_moved"] > 0
    assert host["pipeline_losses"]["passed"] and host["pipeline_losses"]["steps"] == 6
    shape = cache_shape(SCALE)
    per_table = 20000 // shape.num_tables // (129 * 4)  # 3 rows: the store takes most write-downs
    tier = got["host_tier"]["extra"]["host_tier"]
    assert tier["capacity"] == shape.num_tables * per_table
    assert tier["hits"] > 0 and tier["misses"] > 0 and tier["evictions"] > 0
    assert got["pipeline_host_tier"]["extra"]["host_tier"]["read_ahead_rows"] > 0
    assert _finite_positive(host["step_ms"]["pipeline_host_tier / pipeline_peer"])
    assert _finite_positive(host["step_ms"]["host_tier / host_memory"])  # the reference of the target
    assert "host_tier" not in got["host_memory"]["extra"]  # (no tier there)
    floor = host["disk_floor"]["asked"]  # every row asked of the store counted as a disk read
    assert floor["misses_per_step"] == tier["misses"] + tier["read_ahead_rows"]
    assert floor["written_bytes_per_step"] == tier["written_down"] * 129 * 4
    assert floor["step_ms"] == got["host_tier"]["step_ms"] and floor["floor_ms"] > 0


@pytest.mark.parametrize("bad", ["0", "1.0", "-3", "lots"])
def test_a_bad_host_budget_is_refused(bad, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["ssd", "--host-budget", bad])
    assert info.value.code == 2 and "--host-budget" in capsys.readouterr().err


def test_ssd_store_rows_are_in_the_store_before_timing(tmp_path) -> None:
    """``--store-rows 1``: every rank of every table is written before timing (in both runs), the
    device cache's share of them (the hottest) last, and flushed: the store holds every rank (misses
    then read rows the store holds), the device cache its share; the rows after training equal the
    all-in-device run's."""
    args = ["ssd", "--scale", str(SCALE), "--steps", "3", "--warmup", "5", "--device", "cpu",
            "--threads", "1", "--dir", str(tmp_path / "db"), "--shards", "2", "--raw-rows", "2000",
            "--store-rows", "1", "--out", str(tmp_path / "out"), "--interleave", "0"]
    assert main(args) == 0
    data = json.loads(next((tmp_path / "out").glob("*-ssd.json")).read_text())
    assert data["options"]["store_rows"] == 1.0
    shape = cache_shape(SCALE)
    ours = next(r for r in data["results"] if r["configuration"] == "ours")
    assert ours["extra"]["prefill_rows_per_table"] == shape.rows
    tiers = ours["extra"]["rows_after_prefill"]
    cached = data["cache_rows_per_table"][0] * shape.num_tables
    assert tiers["device"] >= cached and tiers["backend"] == shape.rows * shape.num_tables
    assert data["check"]["passed"]


@pytest.mark.parametrize("bad", ["-0.1", "1.5", "all"])
def test_a_bad_store_rows_is_refused(bad, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["ssd", "--store-rows", bad])
    assert "--store-rows" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["-1", "lots"])
def test_a_bad_block_cache_is_refused(bad, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["ssd", "--block-cache", bad])
    assert "--block-cache" in capsys.readouterr().err


def test_the_block_cache_reaches_the_store(tmp_path) -> None:
    """``--block-cache`` bounds the one block cache of every store the ssd runs open; unset, the
    stores keep RocksDB's own caches."""
    for given, want in ((64 << 20, 64 << 20), (0, 0), (None, None)):
        opts = CacheOptions(workload="ssd", block_cache_bytes=given)
        spec = opts.rocksdb(str(tmp_path / f"db{given}"), direct_reads=False)
        assert spec.process  # (by default a process per shard: look at the store in-process here)
        group = dataclasses.replace(spec, process=False).open_group(["t"], 4, torch.device("cpu"))
        try:
            assert group.store.disk.block_cache_bytes == want and group.store.shards == opts.shards
            assert (group.store.block_cache is None) == (not want)  # one cache shared by the store
        finally:
            group.close()
    with pytest.raises(ValueError, match="block_cache_bytes"):
        CacheOptions(workload="ssd", block_cache_bytes=-1)
    with pytest.raises(ValueError, match="store_rows"):
        CacheOptions(workload="ssd", store_rows=1.5)


def test_prefill_writes_the_hot_ranks_last(tmp_path) -> None:
    """``prefill(rows, hot)``: ranks [hot, rows) first, then [0, hot), so a device cache ends holding
    the hottest ranks even where the ranks take several writes (here 300k, two of 262,144): a batch
    of the hottest then misses nothing. (Written coldest last, they would all miss.)"""
    shape = HbmShape(num_tables=1, rows=300_000, dim=4, batch_size=10, bag_size=10)
    storage = te.StorageConfig(hbm_budget=1024 * (shape.dim + 1) * 4,
                               backing=te.storage.RocksDB(str(tmp_path / "db"), shards=2))
    ebc = te.EmbeddingBagCollection(table_configs(shape), optimizer=te.optim.RowWiseAdagrad(lr=LR),
                                    storage=storage)
    try:
        hot = 500
        prefill(ebc, shape, shape.rows, torch.device("cpu"), 0, hot)
        name = shape.table_name(0)
        before = ebc.stats()[name]
        assert before.rows["device"] + before.rows["backend"] == shape.rows
        kjt = te.KeyedJaggedTensor([shape.feature_name(0)], torch.arange(hot), lengths=torch.tensor([hot]))
        ebc.prefetch(kjt)
        ebc(kjt)
        assert ebc.stats()[name].misses == before.misses
    finally:
        ebc.close()
