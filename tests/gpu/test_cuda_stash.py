"""Stashing on CUDA (copy stream, pinned buffers, the three free strategies, the calibrated free site):
20 training steps equal to the same run without stashing, EBC and EC, hbm_direct and cache mode, with
the prefetch inline and on its thread; the device memory really goes and comes back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tieredemb as te

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run through tools/gpu_check.sh)", allow_module_level=True)

DIM, ROWS, STEPS, BATCH = 32, 5000, 20, 64


def batches() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    weights = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** 1.05
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 6, (2 * BATCH,), generator=gen)
        ids = torch.multinomial(weights, int(lengths.sum()), replacement=True, generator=gen)
        out.append({"kjt": te.KeyedJaggedTensor(["a", "b"], ids, lengths=lengths),
                    "w": torch.randn(ids.numel(), 1, generator=gen),
                    "dense": torch.randn(BATCH, 8, generator=gen),
                    "labels": torch.randint(0, 2, (BATCH,), generator=gen).float()})
    return out


class Model(nn.Module):
    def __init__(self, coll) -> None:
        super().__init__()
        self.coll = coll
        self.top = nn.Sequential(nn.Linear(8 + 2 * DIM, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                                 nn.Linear(256, 1))

    def forward(self, batch: dict) -> torch.Tensor:
        out = self.coll(batch["kjt"])
        if isinstance(out, te.KeyedTensor):
            pooled = out.values()
            extra = 0.0
        else:  # sequences: a fixed weight per id (no scatter: float atomics would make runs differ)
            pooled = torch.zeros(BATCH, 2 * DIM, device=batch["dense"].device)
            extra = (torch.cat([jt.values() for jt in out.values()]) * batch["w"]).sum() * 1e-3
        logits = self.top(torch.cat([batch["dense"], pooled], 1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch["labels"]) + extra


def build(module, cache: bool):
    torch.manual_seed(0)
    storage = te.StorageConfig(hbm_budget=ROWS * DIM * 4, segment_rows=512) if cache else \
        te.StorageConfig(segment_rows=512)
    coll = module([te.TableConfig("t", DIM, ["a", "b"])], optimizer=te.optim.Adam(lr=0.01),
                  storage=storage, device="cuda", seed=0)
    model = Model(coll).cuda()
    return model, torch.optim.Adam(model.top.parameters(), lr=0.01)


def train(model, opt, stash, in_thread: bool = False) -> torch.Tensor:
    pipeline = te.TrainPipeline(model, opt, device="cuda", stash=stash, prefetch_in_thread=in_thread)
    it, losses = iter(batches()), []
    while True:
        try:
            losses.append(pipeline.progress(it).detach())
        except StopIteration:
            break
    pipeline.close()
    return torch.stack(losses)


def rows(coll) -> torch.Tensor:
    r = coll.export("t")
    order = torch.argsort(r.keys)
    return torch.cat([r.keys[order, None].double(), r.weights[order].double(),
                      r.optimizer_state[order].double()], 1)


@pytest.mark.parametrize("in_thread", [False, True], ids=["inline", "thread"])
@pytest.mark.parametrize("strategy", ["event", "record_stream", "blocking"])
@pytest.mark.parametrize("cache", [False, True], ids=["hbm_direct", "cache"])
@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_stashing_on_cuda_trains_like_no_stashing(module, cache, strategy, in_thread):
    want_model, want_opt = build(module, cache)
    want = train(want_model, want_opt, None, in_thread)
    model, opt = build(module, cache)
    assert model.coll.storage_mode == ("cache" if cache else "hbm_direct")
    got = train(model, opt, te.StashConfig(tables=["t"], strategy=strategy), in_thread)
    assert torch.equal(got, want)
    assert torch.equal(rows(model.coll), rows(want_model.coll))


def test_the_device_memory_goes_and_comes_back():
    model, opt = build(te.EmbeddingBagCollection, cache=False)
    stash = te.Stash([model.coll], te.StashConfig(), model)
    store = model.coll.tiers[0].store
    data = batches()
    for batch in data[:3]:  # rows inserted, calibration under way
        b = {k: v.to("cuda") for k, v in batch.items()}
        with stash.tracking():
            loss = model(b)
        loss.backward()
    torch.cuda.synchronize()
    b = {k: v.to("cuda") for k, v in data[3].items()}
    before = torch.cuda.memory_allocated()
    device_bytes = store.device_bytes()
    assert device_bytes > 0
    with stash.tracking():
        loss = model(b)
    assert store.stashed and store.rows_by_placement()["device"] == 0
    # the forward's own activations are small next to the table's segments
    assert torch.cuda.memory_allocated() <= before - device_bytes + (8 << 20)
    loss.backward()
    assert not store.stashed and store.device_bytes() == device_bytes
    stash.close()
