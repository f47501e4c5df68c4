"""The training job: AUC, the DLRM, a reduced training run, and the command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tieredemb import cli
from tieredemb.data.synthetic import SyntheticClicks, SyntheticConfig
from tieredemb.models import DotInteraction
from tieredemb.train import TrainConfig, roc_auc, train

REDUCED_SYNTHETIC = SyntheticConfig(min_vocab=100, max_vocab=2_000, eval_size=4_096)


def _pairwise_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    pos, neg = scores[labels > 0.5], scores[labels <= 0.5]
    diff = pos[:, None] - neg[None, :]
    return ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()


def test_roc_auc_matches_pairwise_definition_with_ties() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 20, (500,), generator=g).float()  # many ties
    labels = (torch.rand(500, generator=g) < 0.3).float()
    assert roc_auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels), abs=1e-12)
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0
    assert roc_auc(torch.ones(4), torch.tensor([0.0, 1.0, 0.0, 1.0])) == 0.5
    with pytest.raises(ValueError, match="both"):
        roc_auc(torch.rand(3), torch.ones(3))


def test_dot_interaction_is_pairwise_dots() -> None:
    dense, sparse = torch.randn(2, 4), torch.randn(2, 3, 4)
    out = DotInteraction(4)(dense, sparse)
    assert out.shape == (2, DotInteraction.output_dim(4, 4)) == (2, 4 + 6)
    vecs = [dense, *sparse.unbind(1)]
    expected = [(vecs[i] * vecs[j]).sum(1) for i in range(4) for j in range(i + 1, 4)]
    assert torch.allclose(out, torch.cat([dense, torch.stack(expected, 1)], 1), atol=1e-6)


def test_reduced_training_run_learns() -> None:
    events = []
    config = TrainConfig(steps=30, batch_size=512, eval_every=15, synthetic=REDUCED_SYNTHETIC)
    result = train(config, callback=events.append)
    assert result.steps == 30 and result.samples == 30 * 512
    assert [e.step for e in result.history] == [15, 30]
    assert sum(e.kind == "step" for e in events) == 30
    assert result.auc_best is not None and result.auc_best > 0.75
    assert result.target == pytest.approx(0.5 + 0.9 * (result.auc_best - 0.5))
    # Well above chance: at least half of the achievable lift after 15k samples (about 70% here).
    assert result.auc > 0.5 + 0.5 * (result.auc_best - 0.5), (result.auc, result.auc_best)
    assert result.history[-1].auc > result.history[0].auc
    assert result.passed == (result.auc >= result.target)


def test_training_is_reproducible() -> None:
    config = TrainConfig(
        steps=5,
        batch_size=256,
        eval_every=0,
        synthetic=SyntheticConfig(min_vocab=100, max_vocab=500, eval_size=2_048),
    )
    assert train(config).auc == train(config).auc


@pytest.mark.parametrize("eval_every", [0, 2])
def test_pipelined_training_matches_the_plain_loop(eval_every) -> None:
    """TrainPipeline gives the plain loop's step losses and eval AUCs (evaluations run drained)."""
    config = TrainConfig(
        steps=5,
        batch_size=256,
        eval_every=eval_every,
        synthetic=SyntheticConfig(min_vocab=100, max_vocab=500, eval_size=2_048),
    )
    plain, piped = [], []
    want = train(config, callback=plain.append)
    got = train(replace(config, pipeline=True), callback=piped.append)

    def summary(events):
        return [(e.kind, e.step, e.loss, e.auc) for e in events]

    assert summary(piped) == summary(plain)
    assert got.auc == want.auc and got.steps == want.steps


def _write_criteo(path: Path, n: int) -> None:
    """A Criteo-format file whose labels follow synthetic ground truth (so AUC can beat 0.5)."""
    data = SyntheticClicks(REDUCED_SYNTHETIC).train_batch(0, n)
    lines = []
    for i in range(n):
        ints = ["" if i % 7 == j else str(int(abs(v) * 10)) for j, v in enumerate(data.dense[i])]
        ids = ["" if (i + f) % 11 == 0 else f"{int(data.ids[f, i]) & 0xFFFFFFFF:08x}" for f in range(26)]
        lines.append("\t".join([str(int(data.labels[i])), *ints, *ids]))
    path.write_text("\n".join(lines) + "\n")


def test_training_on_criteo_file(tmp_path) -> None:
    path = tmp_path / "train.tsv"
    _write_criteo(path, 6_000)
    config = TrainConfig(steps=40, batch_size=512, eval_every=0, data=str(path), eval_fraction=0.2)
    result = train(config)
    assert result.auc_best is None and result.target is None and result.passed is None
    assert result.auc > 0.55  # about 0.63: the labels follow a ground truth the ids carry


def _tieredemb_command() -> list[str]:
    """The installed console script beside this interpreter, else the module it runs."""
    script = shutil.which("tieredemb", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "tieredemb.cli"]


@pytest.mark.slow
def test_cli_train_prints_summary() -> None:
    cmd = [
        *_tieredemb_command(),
        "train",
        "--steps",
        "8",
        "--batch-size",
        "256",
        "--eval-every",
        "4",
        "--eval-size",
        "4096",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "summary: 8 steps" in out and "eval AUC" in out and "AUC_best" in out
    assert "step      4:" in out and ("PASS" in out or "FAIL" in out)


def test_cli_bench_dispatches_to_bench_main(monkeypatch) -> None:
    seen = []
    fake = types.ModuleType("tieredemb.bench")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "tieredemb.bench", fake)
    assert cli.main(["bench", "--quick", "x"]) == 0
    assert seen == [["--quick", "x"]]


@pytest.mark.parametrize("module", [None, types.ModuleType("tieredemb.bench")])
def test_cli_bench_missing_is_a_clear_error(monkeypatch, capsys, module) -> None:
    monkeypatch.setitem(sys.modules, "tieredemb.bench", module)  # None: import fails
    assert cli.main(["bench"]) == 2
    assert "bench not available" in capsys.readouterr().err


def _summary(out: str) -> tuple[float, float]:
    """(final loss, eval AUC) from the printed summary."""
    values = {line.split()[0]: float(line.split()[-1]) for line in out.splitlines()
              if line.strip().startswith(("final loss", "eval AUC"))}
    return values["final"], values["eval"]


@pytest.mark.parametrize("nproc, pipeline", [(2, True), (3, False)])
@pytest.mark.slow
def test_ranks_train_like_one_process(nproc: int, pipeline: bool) -> None:
    """``tieredemb train --nproc N`` (gloo ranks, tables sharded, dense layers under DDP, each rank a
    slice of the global batch) ends with the loss and AUC of the one-process run."""
    args = ["--steps", "12", "--batch-size", "240", "--eval-every", "0", "--eval-size", "1024",
            "--no-progress", *(["--pipeline"] if pipeline else [])]
    runs = [subprocess.run([sys.executable, "-m", "tieredemb.cli", "train", *args, *extra],
                           capture_output=True, text=True, timeout=300, check=True).stdout
            for extra in ([], ["--nproc", str(nproc)])]
    (loss1, auc1), (loss_n, auc_n) = (_summary(out) for out in runs)
    assert loss_n == pytest.approx(loss1, abs=2e-4) and auc_n == pytest.approx(auc1, abs=2e-4), runs
