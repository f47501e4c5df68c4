"""``tieredemb train`` as a user runs it: MovieLens over a device budget and RocksDB, checkpoints and
resume, the baseline in the report, and a one-line error (exit 2) for every bad input."""

from __future__ import annotations

import socket
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY_RATINGS, write_movielens
from tieredemb import cli
from tieredemb.train import TrainConfig, train

# MovieLens-100k in a few small steps: a 16 KB budget holds ~200 of the 2,700 user and item rows
SMALL = ["--data", "movielens", "--steps", "6", "--batch-size", "256", "--eval-every", "3",
         "--hbm-budget", "16K", "--no-progress"]


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _number(word: str) -> float | None:
    try:
        return float(word)
    except ValueError:
        return None


def _report(out: str) -> dict[str, float]:
    """The summary's numbers by their line's first word (``final``, ``eval``, ``baseline``, ``lift``)."""
    report = {}
    for line in out.splitlines():
        words = line.split()
        if line.startswith("  ") and words[0] in ("final", "eval", "baseline", "lift"):
            report[words[0]] = next(x for x in map(_number, words) if x is not None)
    return report


def test_movielens_over_rocksdb_checkpoints_resumes_and_reports_the_baseline(capsys, tmp_path,
                                                                               movielens_dir) -> None:
    """The issue's command, stopped after 3 steps and resumed to 6 (with stashing and the pipeline
    on the second half), reports what the run straight to 6 reports: AUC, the baseline's, the lift."""
    whole = ["--backing", f"rocksdb:{tmp_path / 'db-whole'}"]
    rc, out, err = _run(capsys, ["train", *SMALL, *whole])
    assert rc == 0, err
    want = _report(out)
    assert "tables     cache" in out and "per-movie click rate" in out
    assert 0.0 < want["eval"] < 1.0 and 0.0 < want["baseline"] < 1.0
    assert want["lift"] == pytest.approx(want["eval"] - want["baseline"], abs=2e-4)

    part = ["--backing", f"rocksdb:{tmp_path / 'db'}", "--checkpoint-dir", str(tmp_path / "ck")]
    first = [a if a != "6" else "3" for a in SMALL]  # --steps 3
    assert _run(capsys, ["train", *first, *part])[0] == 0
    rc, out, err = _run(capsys, ["train", *SMALL, *part, "--resume", "--stash", "--pipeline"])
    assert rc == 0, err
    assert "summary: 3 steps (from step 3)" in out
    assert "--stash on cpu" in err  # says what stashing does here
    assert _report(out) == want


def test_resumed_run_ends_where_the_uninterrupted_run_ends(tmp_path) -> None:
    """Embedding rows in a cache over RocksDB (Adam's state with them), the dense model, its Adam
    moments and the step survive the checkpoints exactly: resumed, with the checkpoint taken while
    the pipeline held the next batch and with stashing on, the run's losses and AUCs are the
    uninterrupted plain run's, bit for bit."""
    write_movielens(tmp_path / "ml", TINY_RATINGS)
    config = TrainConfig(data=f"movielens:{tmp_path / 'ml'}", eval_fraction=0.3, steps=6, batch_size=4,
                         eval_every=2, hbm_budget="1K", backing=f"rocksdb:{tmp_path / 'a'}",
                         emb_optimizer="adam")
    events: list = []
    whole = train(config, callback=events.append)
    assert whole.storage_mode == "cache"
    part = replace(config, backing=f"rocksdb:{tmp_path / 'b'}", checkpoint_dir=str(tmp_path / "ck"),
                   checkpoint_every=2, pipeline=True, stash=True)
    first = train(replace(part, steps=3))  # checkpoints at steps 2 and 3
    assert first.stashed_bytes > 0
    resumed_events: list = []  # from step 3: the first evaluation (step 4) drains the pipeline after one step
    resumed = train(replace(part, resume=True), callback=resumed_events.append)
    assert resumed.start_step == 3 and resumed.steps == 3
    assert [(e.kind, e.step, e.loss, e.auc) for e in resumed_events] == \
        [(e.kind, e.step, e.loss, e.auc) for e in events if e.step > 3]
    assert (resumed.loss, resumed.auc, resumed.baseline_auc) == (whole.loss, whole.auc, whole.baseline_auc)


# ------------------------------------------------------------------------------------------ errors
def _criteo_line(label: int, i: int) -> str:
    return "\t".join([str(label), *[str(i)] * 13, *[f"{i:x}"] * 26]) + "\n"


def _criteo(path: Path, labels: list[int]) -> str:
    path.write_text("".join(_criteo_line(y, i) for i, y in enumerate(labels)))
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bad_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    """(arguments after ``train``, what the error line must say)."""
    malformed = tmp / "malformed.tsv"
    malformed.write_text(_criteo_line(1, 1) + "1\t2\t3\n")
    latin = tmp / "latin.tsv"
    latin.write_bytes(_criteo_line(0, 1).encode() + _criteo_line(1, 2).encode().replace(b"2", b"\xe9", 1))
    ml = tmp / "ml"
    ml.mkdir()
    (ml / "x.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
    held = tmp / "held"
    held.mkdir()
    (held / "LATEST").write_text("v-000001\n")
    (tmp / "store").write_text("a file, not a store directory")
    ok = ["--data", _criteo(tmp / "ok.tsv", [0, 1] * 10), "--eval-fraction", "0.2"]
    return [
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--batch-size", "many"], "argument --batch-size: 'many' is not an integer"),
        (["--eval-fraction", "1.5"], "argument --eval-fraction: must be > 0.0 and < 1.0"),
        (["--emb-lr", "-1"], "argument --emb-lr: must be > 0.0"),
        (["--hbm-budget", "lots"], "argument --hbm-budget: cannot read byte size 'lots'"),
        (["--backing", "s3://bucket"], "argument --backing: backing must be host, rocksdb:PATH or redis://"),
        (["--backing", "rocksdb:"], "rocksdb:PATH needs a PATH"),
        (["--backing", "host"], "needs an HBM budget (--hbm-budget)"),
        (["--resume"], "need a checkpoint directory (--checkpoint-dir)"),
        (["--checkpoint-every", "5"], "need a checkpoint directory (--checkpoint-dir)"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--data", str(tmp / "missing.tsv")], "missing.tsv: no such file"),
        (["--data", str(tmp)], "is a directory, not a Criteo TSV file"),
        (["--data", str(malformed)], "malformed.tsv: Criteo line 2: expected 40 tab-separated fields, got 3"),
        (["--data", str(latin)], "latin.tsv: Criteo line 2: not ASCII text"),
        (["--data", _criteo(tmp / "one.tsv", [1])], "one.tsv: 1 rows are too few to split"),
        (["--data", _criteo(tmp / "skew.tsv", [0, 1] * 5 + [0] * 10), "--eval-fraction", "0.2"],
         "the eval set's 4 samples are all non-clicks: AUC needs both"),
        (["--data", f"movielens:{tmp / 'none'}"], "none: no such directory"),
        (["--data", f"movielens:{ml}"], "x.user: no such file"),
        (["--checkpoint-dir", str(held)], "holds a checkpoint already: --resume to train on from it"),
        (["--checkpoint-dir", str(tmp / "empty"), "--resume"], "no checkpoint in"),
        (["--checkpoint-dir", str(tmp / "store")], "is a file"),
        (["--hbm-budget", "1K", "--backing", f"rocksdb:{tmp / 'store'}", *ok], "RocksDB open failed"),
        (["--hbm-budget", "1K", "--backing", f"redis://:hunter2@127.0.0.1:{_free_port()}/0", *ok],
         "Connection refused"),
    ]


def test_every_bad_input_is_one_line_and_exit_2(capsys, tmp_path) -> None:
    for args, message in _bad_inputs(tmp_path):
        steps = [] if "--steps" in args else ["--steps", "1"]
        rc = cli.main(["train", *args, *steps, "--no-progress"])
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if not line.startswith("WARNING ")]  # retries
        assert rc == 2, (args, err)
        assert len(lines) == 1 and lines[0].startswith("tieredemb train: error: "), (args, err)
        assert message in lines[0], (args, lines[0])
        assert "Traceback" not in err and "hunter2" not in err and out == ""


def test_data_too_small_or_one_class_is_refused_before_training(capsys, tmp_path, monkeypatch) -> None:
    import tieredemb.train as job

    monkeypatch.setattr(job, "make_model", lambda *a, **k: pytest.fail("built a model for bad data"))
    data = _criteo(tmp_path / "skew.tsv", [0, 1] * 5 + [1] * 10)
    rc, _, err = _run(capsys, ["train", "--data", data, "--eval-fraction", "0.2", "--no-progress"])
    assert rc == 2 and "all clicks" in err


def test_a_store_holding_rows_of_an_earlier_run_is_refused(capsys, tmp_path) -> None:
    write_movielens(tmp_path / "ml", TINY_RATINGS)
    args = ["train", "--data", f"movielens:{tmp_path / 'ml'}", "--eval-fraction", "0.3", "--steps", "2",
            "--batch-size", "4", "--no-progress", "--hbm-budget", "1K",
            "--backing", f"rocksdb:{tmp_path / 'db'}", "--checkpoint-dir", str(tmp_path / "ck")]
    assert _run(capsys, args)[0] == 0
    rc, _, err = _run(capsys, [*args[:-2], "--checkpoint-dir", str(tmp_path / "other")])
    assert rc == 2 and "already holds rows of an earlier run: resume it" in err
    rc, _, err = _run(capsys, [*args, "--resume"])  # resuming clears the store and refills it
    assert rc == 2 and "the checkpoint in" in err and "is at step 2: nothing to train" in err
    rc, _, err = _run(capsys, [*args, "--resume", "--steps", "3", "--embedding-dim", "8"])
    assert rc == 2 and "dim 8 in the model, 16 in the checkpoint" in err


def test_verbose_shows_the_traceback(capsys, tmp_path) -> None:
    rc, _, err = _run(capsys, ["train", "--data", str(tmp_path / "missing.tsv"), "-v"])
    assert rc == 2 and "Traceback" in err and err.rstrip().endswith("missing.tsv: no such file "
                                                                     "(data: a Criteo TSV file, criteo:PATH, "
                                                                     "movielens or movielens:DIR)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line(capsys) -> None:
    rc, _, err = _run(capsys, ["train", "--device", "cuda"])
    assert rc == 2 and err == "tieredemb train: error: --device cuda but torch sees no CUDA device\n"


def test_movielens_missing_says_how_to_get_it(capsys, monkeypatch) -> None:
    import tieredemb.data.movielens as movielens

    monkeypatch.setattr(movielens, "find_movielens", lambda: None)
    rc, _, err = _run(capsys, ["train", "--data", "movielens"])
    assert rc == 2 and "pip install --no-deps recbole" in err and "movielens:DIR" in err


def test_bench_errors_are_printed_the_same_way(capsys, monkeypatch) -> None:
    def bench_main(argv):
        raise ValueError(f"unknown workload {argv[0]!r}")

    fake = types.ModuleType("tieredemb.bench")
    fake.main = bench_main
    monkeypatch.setitem(sys.modules, "tieredemb.bench", fake)
    rc, _, err = _run(capsys, ["bench", "nope"])
    assert rc == 2 and err == "tieredemb bench: error: unknown workload 'nope'\n"


def test_a_rank_error_comes_back_as_one_line(capsys, tmp_path) -> None:
    malformed = tmp_path / "malformed.tsv"
    malformed.write_text(_criteo_line(1, 1) + "1\t2\t3\n")
    rc, _, err = _run(capsys, ["train", "--data", str(malformed), "--nproc", "2", "--batch-size", "8"])
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("tieredemb train: error: rank ") and "Criteo line 2" in lines[0]


def test_movielens_has_its_own_defaults_and_flags_win() -> None:
    parser = cli.build_parser()

    def config(*args: str) -> tuple[int, float]:
        c = cli._config_from_args(parser.parse_args(["train", *args]))
        return c.steps, c.emb_lr

    assert config("--data", "movielens") == (60, 0.02)
    assert config("--data", "movielens:/x", "--steps", "7") == (7, 0.02)
    assert config() == (TrainConfig().steps, TrainConfig().emb_lr)


def test_train_with_16bit_rows(capsys, tmp_path) -> None:
    """``--dtype bf16``: the tables' rows are bfloat16 (the checkpoint's manifest says so, its files
    hold 2 bytes a value), the run trains and reports; a dtype it does not know is one line, exit 2."""
    import json

    write_movielens(tmp_path / "ml", TINY_RATINGS)
    args = ["train", "--data", f"movielens:{tmp_path / 'ml'}", "--eval-fraction", "0.3", "--steps", "4",
            "--batch-size", "4", "--eval-every", "2", "--no-progress", "--dtype", "bf16",
            "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4"]
    rc, out, err = _run(capsys, args)
    assert rc == 0, err
    assert "final" in _report(out)
    manifests = [json.loads(p.read_text()) for p in (tmp_path / "ck").rglob("manifest.json")]
    tables = [t for m in manifests for c in m["collections"].values() for t in c["tables"].values()]
    assert tables and {t["dtype"] for t in tables} == {"bfloat16"}
    rc = cli.main(["train", "--dtype", "int8", "--steps", "1", "--no-progress"])
    _, err = capsys.readouterr()
    assert rc == 2 and "--dtype" in err and "int8" in err


def test_nproc_under_a_launcher_is_one_line(capsys, monkeypatch) -> None:
    """torchrun starts the processes: ``--nproc 2`` inside one of its 4 would spawn 8."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    rc, _, err = _run(capsys, ["train", "--nproc", "2"])
    assert rc == 2 and "--nproc 2 under a launcher of 4 processes" in err
