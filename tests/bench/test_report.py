"""Bench reports (the JSON file, the table beside it, the printed table) never show a store's
password: a command line, an error or any field that holds a URL with one shows it redacted."""

from __future__ import annotations

import json

from tieredemb.bench.report import Measurement, format_table, write_report

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
