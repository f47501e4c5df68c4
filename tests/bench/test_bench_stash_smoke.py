"""``tieredemb bench stash`` at a CPU smoke scale: every strategy trains the stash-off run's rows, and
the check that says so fails when the copy back is broken."""

from __future__ import annotations

import json

import pytest
import torch

from tieredemb.bench.stash import StashOptions, run
from tieredemb.storage.row_store import RowStore

OPTS = dict(scale=0.001, device=torch.device("cpu"), steps=2, warmup=3, width=16, layers=2, long_steps=3)


@pytest.mark.slow
def test_bench_stash_smoke(tmp_path):
    assert run(StashOptions(**OPTS), str(tmp_path), ["stash"], log=lambda s: None) == 0
    report = json.loads(next(tmp_path.glob("*-stash.json")).read_text())
    assert report["workload"] == "stash" and report["date"] and report["options"]["scale"] == 0.001
    configs = [r["config"] for r in report["results"]]
    assert configs == ["off", "blocking", "record_stream", "event"]
    assert all(r["same_as_off"] == "yes" for r in report["results"][1:])
    assert all(r["stashed_bytes"] > 0 for r in report["results"][1:])
    assert report["long_run"]["same_rows"] == "yes"


@pytest.mark.slow
def test_bench_stash_catches_a_broken_restore(tmp_path, monkeypatch):
    restore = RowStore.restore

    def restore_zeroing_a_row(self, stream, chunk_rows, into=None):
        restore(self, stream, chunk_rows, into)
        self.segments[0][0].add_(1.0)  # one row comes back wrong

    monkeypatch.setattr(RowStore, "restore", restore_zeroing_a_row)
    assert run(StashOptions(**{**OPTS, "long_steps": 0}), str(tmp_path), ["stash"], log=lambda s: None) == 1
    report = json.loads(next(tmp_path.glob("*-stash.json")).read_text())
    assert all(r["same_as_off"].startswith("NO") for r in report["results"][1:])
