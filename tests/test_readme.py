"""README.md's examples run as written: its Python blocks in order, in one namespace (the names the
prose leaves to the reader, a dense model, a loader, are given here, small), on the CPU where the
README says "cuda" and there is none; the quick start's script knows its two commands."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

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
            self.ebc, self.top = ebc, torch.nn.Linear(128, 1)

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
                                              optimizer=te.optim.RowWiseAdagrad(lr=0.05))
            namespace["fresh_model"] = namespace["Model"](fresh)
        if ("te.Stash(" in code or "StashConfig" in code) and device == "cpu":
            continue  # stashing moves device memory to the host: a CUDA feature (tests/gpu run it)
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
