"""Checkpoints of 16-bit tables: the rows saved in the table's dtype (safetensors BF16 / F16), a resume
that trains on exactly as the uninterrupted run (stochastic rounding's draws depend on the step, not
on the process), and a checkpoint loaded into a table of another dtype: float32 rows into a bfloat16
table are rounded to the nearest value, bfloat16 rows into a float32 table are exact, and float32
rows beyond float16's range are refused before anything changes."""

from __future__ import annotations

import glob

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import tieredemb as te
from tieredemb.checkpoint import CheckpointError

DIM = 4


class Model(nn.Module):
    def __init__(self, dtype: torch.dtype, storage: te.StorageConfig | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = te.EmbeddingBagCollection(
            [te.TableConfig("t", DIM, ["a"], dtype=dtype, initializer=te.init.Normal(0.0, 0.1))],
            optimizer=te.optim.Adam(lr=0.05), storage=storage, seed=3)
        self.top = nn.Linear(DIM, 1)

    def forward(self, kjt: te.KeyedJaggedTensor) -> torch.Tensor:
        return self.top(self.ebc(kjt).values()).square().mean()


def batch(step: int) -> te.KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (8,), generator=gen)
    ids = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    return te.KeyedJaggedTensor(["a"], ids, lengths=lengths)


def train(model: Model, steps: range) -> None:
    opt = torch.optim.SGD(model.top.parameters(), lr=0.05)
    for step in steps:
        opt.zero_grad()
        model(batch(step)).backward()
        opt.step()


def rows(model: Model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    e = model.ebc.export("t")
    order = torch.argsort(e.keys)
    return e.keys[order], e.weights[order], e.optimizer_state[order]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_resume_is_the_uninterrupted_run(dtype, tmp_path):
    straight = Model(dtype)
    train(straight, range(8))
    first = Model(dtype)
    train(first, range(4))
    version = te.checkpoint.save(first, tmp_path)
    saved = [load_file(f) for f in glob.glob(str(version / "**" / "*.safetensors"), recursive=True)]
    row_files = [s for s in saved if "rows" in s]
    assert row_files and all(s["rows"].dtype == dtype for s in row_files)  # 2 bytes a value on disk
    resumed = Model(dtype, te.StorageConfig(hbm_budget=300, segment_rows=8, bucket_width=4))  # a cache
    te.checkpoint.load(resumed, tmp_path)
    assert resumed.ebc.storage_mode == "cache"
    train(resumed, range(4, 8))
    for a, b in zip(rows(straight), rows(resumed)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_float32_checkpoint_into_bfloat16_and_back(tmp_path):
    f32 = Model(torch.float32)
    train(f32, range(3))
    te.checkpoint.save(f32, tmp_path / "f32")
    bf16 = Model(torch.bfloat16)
    te.checkpoint.load(bf16, tmp_path / "f32")
    keys, w, s = rows(f32)
    k16, w16, s16 = rows(bf16)
    assert torch.equal(keys, k16)
    assert w16.dtype == torch.bfloat16
    assert torch.equal(w16, w.to(torch.bfloat16)) and torch.equal(s16, s.to(torch.bfloat16))  # nearest
    te.checkpoint.save(bf16, tmp_path / "bf16")
    back = Model(torch.float32)
    te.checkpoint.load(back, tmp_path / "bf16")
    kb, wb, sb = rows(back)
    assert wb.dtype == torch.float32
    assert torch.equal(wb, w16.float()) and torch.equal(sb, s16.float())  # exact: every bf16 is a float32


def test_float32_rows_beyond_float16_refused(tmp_path):
    f32 = Model(torch.float32)
    f32.ebc.write("t", torch.tensor([1, 2]), torch.tensor([[7e4, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]))
    te.checkpoint.save(f32, tmp_path)
    fp16 = Model(torch.float16)
    with pytest.raises(CheckpointError, match=r"\.safetensors.*not finite.*float16"):
        te.checkpoint.load(fp16, tmp_path)
    assert fp16.ebc.is_empty()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_state_dict_round_trip(dtype):
    a = Model(dtype)
    train(a, range(3))
    state = a.state_dict()
    assert state["ebc.t.weights"].dtype == dtype and state["ebc.t.weights"].element_size() == 2
    b = Model(dtype)
    b.load_state_dict(state)
    for x, y in zip(rows(a), rows(b)):
        assert torch.equal(x, y)
