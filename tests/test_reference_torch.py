"""SGD, Adagrad and Adam equal torch's own sparse embedding training (DESIGN section 2).

``torch.nn.EmbeddingBag(sparse=True)`` / ``torch.nn.Embedding(sparse=True)`` with ``torch.optim.SGD``,
``torch.optim.Adagrad`` (lr_decay 0, initial accumulator 0, eps 1e-10) and ``torch.optim.SparseAdam``
are the reference here: nothing of this file's expectations is computed by code written for the project.
Ids are in ``[0, n)`` so a plain torch table holds every key, and the same rows are written into both.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tieredemb as te
from tests.conftest import ATOL, RTOL, Batch, random_batch, sorted_export

STEPS = 20

TABLES = {  # name -> (rows n, dim, features); "shared" serves two features
    "shared": (7, 4, ["f0", "f1"]),
    "single": (5, 3, ["f2"]),
}


def configs(pooling: str, bounded: bool) -> list[te.TableConfig]:
    return [
        te.TableConfig(name, dim, features, num_embeddings=n if bounded else None, pooling=pooling)
        for name, (n, dim, features) in TABLES.items()
    ]


def library_optimizer(name: str) -> te.optim.EmbeddingOptimizer:
    return {
        "sgd": te.optim.SGD(lr=0.1),
        "adagrad": te.optim.Adagrad(lr=0.1, eps=1e-10),
        "adam": te.optim.Adam(lr=0.01, betas=(0.9, 0.999), eps=1e-8),
    }[name]


def torch_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.1, lr_decay=0, initial_accumulator_value=0, eps=1e-10)
    return torch.optim.SparseAdam(params, lr=0.01, betas=(0.9, 0.999), eps=1e-8)


def torch_state(name: str, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
    """The torch optimizer's state of ``param`` in our per-row layout (n, S)."""
    state = optimizer.state[param]
    if name == "sgd":
        return torch.zeros(param.shape[0], 0)
    if name == "adagrad":
        return state["sum"]
    return torch.cat([state["exp_avg"], state["exp_avg_sq"]], dim=1)


def batches(gen: torch.Generator, weighted: bool) -> list[Batch]:
    pools = {f: list(range(n)) for n, _, features in TABLES.values() for f in features}
    out = [random_batch(gen, pools, batch_size=3, max_bag=4, weighted=weighted) for _ in range(STEPS)]
    out[4] = Batch(
        {f: [[], [], []] for f in pools},  # one step with no id at all
        {f: [[], [], []] for f in pools} if weighted else None,
    )
    return out


class TorchModel(torch.nn.Module):
    """Plain torch tables: one ``nn.EmbeddingBag`` (or ``nn.Embedding``) per table."""

    def __init__(self, pooling: str | None, rows: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.pooling = pooling
        self.tables = torch.nn.ModuleDict()
        for name, w in rows.items():
            if pooling is None:
                t = torch.nn.Embedding(w.shape[0], w.shape[1], sparse=True)
            else:
                t = torch.nn.EmbeddingBag(w.shape[0], w.shape[1], mode=pooling, sparse=True)
            with torch.no_grad():
                t.weight.copy_(w)
            self.tables[name] = t

    def forward(self, batch: Batch):
        outs = {}
        for name, (_, _, features) in TABLES.items():
            for f in features:
                ids = torch.tensor([k for bag in batch.bags[f] for k in bag], dtype=torch.int64)
                if self.pooling is None:
                    outs[f] = self.tables[name](ids)
                    continue
                lengths = torch.tensor([len(bag) for bag in batch.bags[f]])
                offsets = torch.cumsum(lengths, 0) - lengths
                psw = None
                if batch.weights is not None:
                    psw = torch.tensor([x for bag in batch.weights[f] for x in bag])
                outs[f] = self.tables[name](ids, offsets, per_sample_weights=psw)
        return outs


def written_rows(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {name: torch.rand(n, dim, generator=gen) - 0.5 for name, (n, dim, _) in TABLES.items()}


def train_both(collection, model: TorchModel, opt: torch.optim.Optimizer, steps, gen, pooled: bool):
    for step, batch in enumerate(steps):
        ref = model(batch)
        if pooled:
            ref_out = torch.cat([ref[f] for _, _, fs in TABLES.values() for f in fs], dim=1)
            upstream = torch.randn(ref_out.shape, generator=gen)
            out = collection(batch.kjt())
            got_out = out.values()
            (got_out * upstream).sum().backward()
            ref_loss = (ref_out * upstream).sum()
        else:
            upstream = {f: torch.randn(r.shape, generator=gen) for f, r in ref.items()}
            out = collection(batch.kjt())
            got_out = torch.cat([out[f].values().flatten() for f in ref])
            ref_out = torch.cat([ref[f].flatten() for f in ref])
            sum((out[f].values() * upstream[f]).sum() for f in ref).backward()
            ref_loss = sum((ref[f] * upstream[f]).sum() for f in ref)
        opt.zero_grad(set_to_none=True)
        ref_loss.backward()
        opt.step()
        torch.testing.assert_close(
            got_out.detach(),
            ref_out.detach(),
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, s=step: f"step {s + 1}: {m}",
        )


def assert_rows_match(collection, model: TorchModel, opt, opt_name: str) -> None:
    for name, (n, _, _) in TABLES.items():
        keys, weights, state, _ = sorted_export(collection, name)
        assert keys.tolist() == list(range(n))
        param = model.tables[name].weight
        torch.testing.assert_close(weights, param.detach(), rtol=RTOL, atol=ATOL)
        if param in opt.state:  # SGD keeps none; the others do once a step touched the table
            torch.testing.assert_close(
                state, torch_state(opt_name, opt, param).to_dense(), rtol=RTOL, atol=ATOL
            )


CASES = [  # (pooling, weighted): torch's EmbeddingBag takes per-sample weights with "sum" only
    ("sum", False),
    ("mean", False),
    ("sum", True),
]


@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "raw_ids"])
@pytest.mark.parametrize("pooling, weighted", CASES, ids=["sum", "mean", "weighted_sum"])
@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "adam"])
def test_embedding_bag_collection_matches_torch(opt_name, pooling, weighted, bounded):
    gen = torch.Generator().manual_seed(2024)
    rows = written_rows(gen)
    collection = te.EmbeddingBagCollection(configs(pooling, bounded), optimizer=library_optimizer(opt_name))
    for name, w in rows.items():
        collection.write(name, torch.arange(w.shape[0]), w)
    model = TorchModel(pooling, rows)
    opt = torch_optimizer(opt_name, model.parameters())
    train_both(collection, model, opt, batches(gen, weighted), gen, pooled=True)
    assert_rows_match(collection, model, opt, opt_name)


@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "adam"])
def test_embedding_collection_matches_torch(opt_name):
    gen = torch.Generator().manual_seed(7)
    rows = written_rows(gen)
    collection = te.EmbeddingCollection(configs("sum", bounded=True), optimizer=library_optimizer(opt_name))
    for name, w in rows.items():
        collection.write(name, torch.arange(w.shape[0]), w)
    model = TorchModel(None, rows)
    opt = torch_optimizer(opt_name, model.parameters())
    train_both(collection, model, opt, batches(gen, weighted=False), gen, pooled=False)
    assert_rows_match(collection, model, opt, opt_name)


def test_mean_of_empty_bag_is_zero_like_torch():
    w = torch.rand(3, 2)
    collection = te.EmbeddingBagCollection(
        [te.TableConfig("t", 2, ["x"], pooling="mean")], optimizer=te.optim.SGD(lr=0.1)
    )
    collection.write("t", torch.arange(3), w)
    out = collection(Batch({"x": [[], [0, 2], []]}).kjt()).values()
    want = F.embedding_bag(torch.tensor([0, 2]), w, torch.tensor([0, 0, 2]), mode="mean")
    torch.testing.assert_close(out.detach(), want)
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[2]) == 0


def test_run_ids_matches_repeat_interleave() -> None:
    """The run index of each position, empty runs included (a bag with no ids, a feature without
    any), as torch.repeat_interleave computes it."""
    from tieredemb.ops.reference import run_ids

    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        lengths = torch.randint(0, 4, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
        lengths[torch.rand(lengths.numel(), generator=gen) < 0.3] = 0
        n = int(lengths.sum())
        want = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        assert torch.equal(run_ids(torch.cumsum(lengths, 0), n), want), lengths.tolist()
