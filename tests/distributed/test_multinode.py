"""``tieredemb train`` launched as two nodes: two torchrun launchers on this machine, joined by a c10d
rendezvous on localhost (the command shape of docs/distributed.md's multi-node launch), gloo ranks.

The job must end with the one-process run's loss and AUC, print its summary once (global rank 0),
and write one checkpoint holding every rank's rows. Each launcher runs in its own session with a
deadline, so a hung rendezvous or collective fails the test instead of blocking CI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--steps", "6", "--batch-size", "240", "--eval-every", "0", "--eval-size", "1024", "--no-progress"]
DEADLINE = 180  # seconds for a whole launch; the runs take about 10 s on two shared cores


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    """This checkout first on the path, whatever the launcher's working directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _launch_nodes(nproc_per_node: int, args: list[str], cwds: list[Path]) -> list[tuple[int, str, str]]:
    """Two torchrun launchers (one per "node", working in ``cwds``): (exit code, stdout, stderr) each."""
    port, run_id = _free_port(), uuid.uuid4().hex[:12]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                str(nproc_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
                "--rdzv-id", run_id, "--rdzv-conf", "join_timeout=60", "--max-restarts", "0",
                "-m", "tieredemb.cli", "train"]
    procs = [subprocess.Popen([*launcher, *args], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for cwd in cwds]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=DEADLINE)
            results.append((proc.returncode, out, err))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the two-node launch did not finish in {DEADLINE} s (a hung rendezvous or collective)")
    finally:
        for proc in procs:  # each launcher's session: the launcher and its workers
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def _summary(out: str) -> tuple[float, float]:
    """(final loss, eval AUC) from the printed summary."""
    values = {line.split()[0]: float(line.split()[-1]) for line in out.splitlines()
              if line.strip().startswith(("final loss", "eval AUC"))}
    return values["final"], values["eval"]


def _one_process(args: list[str]) -> str:
    return subprocess.run([sys.executable, "-m", "tieredemb.cli", "train", *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=DEADLINE, check=True).stdout


@pytest.mark.parametrize("nproc_per_node", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_two_nodes_train_like_one_process(nproc_per_node: int, tmp_path) -> None:
    """2 nodes x ``nproc_per_node`` gloo ranks (tables sharded over all of them, the dense layers under
    DDP, each rank a slice of the global batch) end with the one-process run's loss and AUC."""
    ckpt = tmp_path / "ckpt"
    runs = _launch_nodes(nproc_per_node, [*ARGS, "--checkpoint-dir", str(ckpt)], [tmp_path, tmp_path])
    for code, _, err in runs:
        assert code == 0, err[-3000:]
    summaries = [out for _, out, _ in runs if "summary:" in out]
    assert len(summaries) == 1 and summaries[0].count("summary:") == 1, runs  # global rank 0 only
    loss_n, auc_n = _summary(summaries[0])
    loss_1, auc_1 = _summary(_one_process(ARGS))
    assert loss_n == pytest.approx(loss_1, abs=2e-4) and auc_n == pytest.approx(auc_1, abs=2e-4), runs
    # one checkpoint, written by every rank of both nodes
    version = ckpt / (ckpt / "LATEST").read_text().strip()
    manifest = json.loads((version / "manifest.json").read_text())
    world = 2 * nproc_per_node
    assert manifest["world_size"] == world, manifest.keys()
    files = {p.name.split("-")[0] for p in version.rglob("r*-c*.safetensors")}
    assert files == {f"r{r}" for r in range(world)}


def test_checkpoint_dir_not_shared_by_the_nodes_is_refused(tmp_path) -> None:
    """A relative --checkpoint-dir from two working directories is two directories, as a node-local
    path on two machines is: every rank refuses it before training instead of writing half a
    checkpoint."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    runs = _launch_nodes(1, [*ARGS, "--checkpoint-dir", "ckpt"], cwds)
    for code, out, _ in runs:
        assert code != 0 and "summary:" not in out
    errors = "".join(err for _, _, err in runs)
    assert "is not the same directory on every rank" in errors, errors[-3000:]
    assert not any((cwd / "ckpt" / "LATEST").exists() for cwd in cwds)
