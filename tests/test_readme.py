"""README.md's examples run as written: its Python blocks in order, in one namespace (the names the
prose leaves to the reader, a dense model, a loader, are given here, small), on the CPU where the
README says "cuda" and there is none; the quick start's script knows its two commands; the main job's
MovieLens lines and the distributed lines run through the shell (temporary paths, fewer steps, the
ranks this machine has); every pip line resolves."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def reader_names(device: torch.device) -> dict:
    """What the README's examples take from the reader: a dense model over the pooled embeddings, a
    model that returns a loss for TrainPipeline, its optimizer, a loader of three batches."""
    import tieredemb as te

    def batch(seed: int) -> te.KeyedJaggedTensor:
        gen = torch.Generator().manual_seed(seed)
        return te.KeyedJaggedTensor(keys=["user_id", "item_id", "seen_items"],
                                    values=torch.randint(0, 1000, (6,), generator=gen),
                                    lengths=torch.tensor([1, 1, 1, 0, 2, 1]))

    class Model(torch.nn.Module):  # what TrainPipeline runs: a batch in, the loss out
        def __init__(self, ebc) -> None:
            super().__init__()
            self.ebc, self.top = ebc, torch.nn.Linear(128, 1, device=device)

        def forward(self, kjt):
            return self.top(self.ebc(kjt).values()).sum()

    return {"dense_model": torch.nn.Linear(128, 1).to(device), "batch": batch, "Model": Model,
            "loader": [batch(i) for i in range(3)], "batches": [batch(i) for i in range(3)],
            "loss_of": lambda out: out.values().sum()}


def test_the_readme_python_examples_run(tmp_path, monkeypatch) -> None:
    blocks = python_blocks()
    assert len(blocks) >= 6, "README.md lost its examples"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    namespace = reader_names(torch.device(device))
    monkeypatch.chdir(tmp_path)  # checkpoints and stores go into the test's own directory
    for i, code in enumerate(blocks):
        code = code.replace('"cuda"', repr(device))
        if "TrainPipeline(model" in code and "model" not in namespace:
            namespace["model"] = namespace["Model"](namespace["ebc"])
            namespace["dense_params"] = list(namespace["model"].top.parameters())
            namespace["opt"] = torch.optim.Adam(namespace["dense_params"])
        if "fresh_model" in code:
            import tieredemb as te

            fresh = te.EmbeddingBagCollection(namespace["tables_of_the_first"],
                                              optimizer=te.optim.RowWiseAdagrad(lr=0.05),
                                              device=torch.device(device))
            namespace["fresh_model"] = namespace["Model"](fresh)
        if ("te.Stash(" in code or "StashConfig" in code) and device == "cpu":
            continue  # stashing moves device memory to the host: a CUDA feature (tests/gpu run it)
        if "import torchrec" in code and importlib.util.find_spec("torchrec") is None:
            continue  # the TorchRec example needs TorchRec (installed by ./run test)
        exec(compile(code, f"README.md python block {i}", "exec"), namespace)  # noqa: S102
        if i == 0:
            namespace["tables_of_the_first"] = namespace["tables"]
        if "fresh_model" in code:  # the checkpoint brought the trained rows into the fresh model
            for table in ("user", "item"):
                got = namespace["fresh_model"].ebc.export(table)
                want = namespace["model"].ebc.export(table)
                order_got, order_want = torch.argsort(got.keys), torch.argsort(want.keys)
                assert torch.equal(got.keys[order_got], want.keys[order_want]) and want.keys.numel()
                assert torch.equal(got.weights[order_got], want.weights[order_want])


def test_the_quick_start_script_knows_its_commands() -> None:
    run = ROOT / "run"
    assert os.access(run, os.X_OK), "./run is not executable"
    for args, code in ((["--help"], 2), (["nonsense"], 2)):
        out = subprocess.run([str(run), *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == code
        assert "./run train" in out.stdout + out.stderr and "./run test" in out.stdout + out.stderr
    quick = re.search(r"## Quick start\n.*?```bash\n(.*?)```", README, re.S).group(1)
    commands = re.findall(r"^(\./run \w+)", quick, re.M)
    assert commands == ["./run train", "./run test"], commands


def bash_block_after(heading: str) -> list[str]:
    """The commands of the first ```bash block after ``heading`` in README.md: continuation lines
    joined, comments dropped, one command a line."""
    start = README.index(heading)
    block = re.search(r"```bash\n(.*?)```", README[start:], re.S).group(1)
    block = re.sub(r"\\\n\s*", " ", block)
    commands = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    return [c for c in commands if c and not c.startswith("#")]


def run_readme_command(command: str, tmp_path: pathlib.Path, env: dict) -> str:
    """One README command through the shell, in ``tmp_path``, the repository's ``./run`` as written."""
    line = command.replace("./run ", f"{ROOT / 'run'} ", 1)
    out = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, f"README command failed: {command}\n{out.stderr[-3000:]}"
    return out.stdout


def installed() -> bool:
    """Whether this environment is an install of the project (``./run`` makes one; CI runs in it):
    the shell lines need the ``tieredemb`` command and the extras. A plain checkout with the package
    on PYTHONPATH (the GPU machine's) is not one."""
    import importlib.metadata
    import shutil
    import sys

    try:
        importlib.metadata.version("tieredemb")
    except importlib.metadata.PackageNotFoundError:
        return False
    return shutil.which("tieredemb", path=str(pathlib.Path(sys.executable).parent)) is not None


needs_install = pytest.mark.skipif(not installed(), reason="the project is not installed in this environment "
                                   "(./run test installs it): the README's shell lines need its command")


def readme_env() -> dict:
    """./run with this interpreter's virtualenv (set up already: it installs nothing then)."""
    import sys

    env = dict(os.environ, TIEREDEMB_VENV=sys.prefix, PATH=f"{pathlib.Path(sys.executable).parent}"
               f"{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.slow
@needs_install
def test_the_readme_movielens_lines_run_as_written(tmp_path) -> None:
    """The main job's three MovieLens lines, with the README's /tmp paths moved into the test's own
    directory: it trains, then trains a cache over RocksDB with checkpoints, then resumes from the
    last checkpoint to step 80; each reports its AUC above the baseline."""
    commands = bash_block_after("The main job takes real data")
    assert [c.split()[:4] for c in commands] == [["./run", "train", "--data", "movielens"]] * 3, commands
    assert "/tmp/ml-store" in commands[1] and "--resume" in commands[2], commands
    env = readme_env()
    outputs = [run_readme_command(c.replace("/tmp/", f"{tmp_path}/"), tmp_path, env) for c in commands]
    for out in outputs:
        auc = float(re.search(r"eval AUC\s+([0-9.]+)", out).group(1))
        baseline = float(re.search(r"baseline\s+([0-9.]+)", out).group(1))
        assert auc > baseline, out[-800:]
    assert "tables     cache" in outputs[1] and (tmp_path / "ml-store").is_dir()
    assert re.search(r"\d+ steps \(from step (\d+)\)", outputs[2]), outputs[2][-800:]
    resumed_from = int(re.search(r"\(from step (\d+)\)", outputs[2]).group(1))
    assert resumed_from > 0 and resumed_from % 20 == 0
    assert re.search(r"step\s+80:", outputs[2])


@pytest.mark.slow
@needs_install
def test_the_readme_distributed_lines_run(tmp_path) -> None:
    """`tieredemb train --nproc 2` as written, shortened by --steps; the torchrun line with the ranks
    and device this machine has (2 gloo ranks on the CPU, the GPUs where there are as many)."""
    commands = bash_block_after("## Several GPUs or processes")
    assert commands[0] == "tieredemb train --nproc 2", commands
    assert commands[1].startswith("torchrun --nproc-per-node 8 -m tieredemb.cli train"), commands
    env = readme_env()
    steps = " --steps 30 --eval-every 30"
    out = run_readme_command(commands[0] + steps, tmp_path, env)
    assert "eval AUC" in out and "30 steps" in out, out[-800:]
    torchrun = commands[1]
    if torch.cuda.device_count() < 8:
        nproc = 2 if torch.cuda.device_count() < 2 else torch.cuda.device_count()
        torchrun = torchrun.replace("--nproc-per-node 8", f"--nproc-per-node {nproc}")
        if not torch.cuda.is_available():
            torchrun = torchrun.replace(" --device cuda", "")
    torchrun = torchrun.replace("torchrun ", "python -m torch.distributed.run ", 1)
    out = run_readme_command(torchrun + steps, tmp_path, env)
    assert "eval AUC" in out, out[-800:]


@needs_install
def test_the_readme_pip_lines_resolve(tmp_path) -> None:
    """Every `pip install` line of the README names what exists: each resolves (pip's dry run, no
    index: against what this test environment has installed) from the repository's root."""
    import sys

    lines = [line for line in re.findall(r"```bash\n(.*?)```", README, re.S) for line in line.splitlines()
             if line.strip().startswith("pip install")]
    assert len(lines) >= 5, lines
    for line in lines:
        args = re.sub(r"\s+#.*$", "", line).split()[2:]
        args = [a.strip('"') for a in args]
        out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index",
                              "--no-build-isolation", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, f"README line does not resolve: {line}\n{out.stderr[-2000:]}"
        assert "does not provide the extra" not in out.stderr, f"{line}: {out.stderr[-2000:]}"
