"""Bench reports (the JSON file, the table beside it, the printed table) never show a store's
password: a command line, an error or any field that holds a URL with one shows it redacted."""

from __future__ import annotations

import json

import pytest
import torch

from tieredemb.bench.report import Measurement, Target, format_table, memory_name, write_report

SECRET = "s3cret-Pw"


def test_a_password_never_shows_in_a_report(tmp_path):
    failed = Measurement("ours", "sgd", f"redis://:{SECRET}@10.0.0.5:6379/0",
                         error=f"BackendError: Redis at redis://default:{SECRET}@10.0.0.5:6379/0: down")
    ran = Measurement("ours", "adam", "cache", step_ms=1.5, extra={
        "stores": [{"url": f"rediss://10.0.0.5:6380/1?password={SECRET}&ssl_cert_reqs=none"}]})
    report = {"command_line": f"tieredemb bench cache --redis redis://u:{SECRET}@10.0.0.5:6379/0",
              "results": [failed, ran]}
    table = format_table("cache", [failed, ran])
    path = tmp_path / "report.json"
    write_report(path, report, table)
    texts = {"table": table, "json": path.read_text(), "txt": path.with_suffix(".txt").read_text()}
    for name, text in texts.items():
        assert SECRET not in text, name
        assert "10.0.0.5:6379" in text, name  # the rest still says which store
    saved = json.loads(texts["json"])
    assert saved["results"][1]["extra"]["stores"][0]["url"].endswith("?password=***&ssl_cert_reqs=none")
    assert saved["results"][1]["step_ms"] == 1.5


@pytest.mark.parametrize(("figure", "op", "bound", "unit", "line"), [
    (1.45, "<=", 1.5, "x", "step: 1.45x (target: <= 1.50x): met"),
    (1.96, "<=", 1.5, "x", "step: 1.96x (target: <= 1.50x): NOT met"),
    (0.92, ">=", 0.8, "%", "step: 92% (target: >= 80%): met"),
    (0.53, ">=", 0.8, "%", "step: 53% (target: >= 80%): NOT met"),
])
def test_a_target_line_gives_the_figure_the_target_and_the_verdict(figure, op, bound, unit, line):
    target = Target("step", figure, op, bound, unit)
    assert target.line() == line
    assert target.met == line.endswith(": met")


def test_the_device_memory_is_hbm_only_on_a_gpu():
    assert memory_name(torch.device("cuda")) == "HBM"
    assert memory_name(torch.device("cpu")) == "device memory"
