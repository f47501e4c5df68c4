"""``te.optim`` optimizers are ``torch.optim.Optimizer``s: learning-rate schedulers drive the fused
update, ``state_dict`` round-trips, a bad scheduled lr is refused before any row changes.

The reference is plain torch: ``torch.nn.EmbeddingBag(sparse=True)`` with ``torch.optim.SGD``,
``torch.optim.Adagrad`` (lr_decay 0, initial accumulator 0) and ``torch.optim.SparseAdam``, driven
by the same scheduler class; for RowWiseAdagrad, a ten-line ``torch.optim.Optimizer`` written here
from DESIGN's formula. The same rows are written into both before the first step.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch.optim import lr_scheduler

import tieredemb as te
from tests.conftest import ATOL, RTOL, Batch, assert_snapshot_equal, random_batch, snapshot, sorted_export

N, DIM, STEPS = 12, 4, 6
TABLES = [te.TableConfig("t", DIM, ["f", "g"], num_embeddings=N)]
LR = {"sgd": 0.1, "adagrad": 0.1, "rowwise_adagrad": 0.1, "adam": 0.01}
OURS = {"sgd": te.optim.SGD, "adagrad": te.optim.Adagrad, "rowwise_adagrad": te.optim.RowWiseAdagrad,
        "adam": te.optim.Adam}
SCHEDULERS = ["StepLR", "LambdaLR", "CosineAnnealingLR", "OneCycleLR", "ReduceLROnPlateau", "SequentialLR"]
PLATEAU_METRICS = [1.0, 1.0, 0.5, 0.6, 0.6, 0.4, 0.4]  # the loss ReduceLROnPlateau sees after each step


class RowWiseAdagradReference(torch.optim.Optimizer):
    """``s += mean(g*g); w -= lr * g / (sqrt(s) + eps)`` per touched row, on a sparse gradient."""

    def __init__(self, params, lr: float, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad.coalesce()
                rows, g = grad.indices()[0], grad.values()
                s = self.state[p].setdefault("sum", torch.zeros(p.shape[0]))
                s[rows] += (g * g).mean(dim=1)
                p[rows] -= group["lr"] * g / (s[rows].sqrt()[:, None] + group["eps"])


def torch_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR[name])
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=LR[name], lr_decay=0, initial_accumulator_value=0, eps=1e-10)
    if name == "rowwise_adagrad":
        return RowWiseAdagradReference(params, lr=LR[name])
    return torch.optim.SparseAdam(params, lr=LR[name])


def scheduler(kind: str, opt: torch.optim.Optimizer):
    base = opt.param_groups[0]["lr"]
    if kind == "StepLR":
        return lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "LambdaLR":
        return lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 / (1.0 + epoch))
    if kind == "CosineAnnealingLR":  # past T_max it climbs again; eta_min > 0 keeps every lr valid
        return lr_scheduler.CosineAnnealingLR(opt, T_max=3, eta_min=base / 20)
    if kind == "OneCycleLR":  # Adam's beta1 cycles too, on both sides (both have betas)
        return lr_scheduler.OneCycleLR(opt, max_lr=2 * base, total_steps=STEPS,
                                       cycle_momentum="betas" in opt.defaults)
    if kind == "ReduceLROnPlateau":
        return lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    warm = lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2)
    decay = lr_scheduler.ExponentialLR(opt, gamma=0.8)
    return lr_scheduler.SequentialLR(opt, [warm, decay], milestones=[2])


def advance(sched, step: int) -> None:
    if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
        sched.step(PLATEAU_METRICS[step])
    else:
        sched.step()


def batches(seed: int = 0) -> list[tuple[Batch, torch.Tensor]]:
    """STEPS batches of 3 samples and the upstream gradient of each (3, 2 * DIM)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        batch = random_batch(gen, {"f": range(N), "g": range(N)}, batch_size=3, max_bag=3)
        out.append((batch, torch.randn(3, 2 * DIM, generator=gen)))
    return out


def initial_rows() -> torch.Tensor:
    return torch.rand(N, DIM, generator=torch.Generator().manual_seed(1)) - 0.5


def collection(optimizer: te.optim.EmbeddingOptimizer) -> te.EmbeddingBagCollection:
    ebc = te.EmbeddingBagCollection(TABLES, optimizer=optimizer)
    ebc.write("t", torch.arange(N), initial_rows())
    return ebc


def reference_forward(table: torch.nn.EmbeddingBag, batch: Batch) -> torch.Tensor:
    outs = []
    for f in ("f", "g"):
        ids = torch.tensor([k for bag in batch.bags[f] for k in bag], dtype=torch.int64)
        lengths = torch.tensor([len(bag) for bag in batch.bags[f]])
        outs.append(table(ids, torch.cumsum(lengths, 0) - lengths))
    return torch.cat(outs, dim=1)


def step(ebc, opt, sched, batch: Batch, upstream: torch.Tensor, i: int) -> None:
    """One training step in the usual order: forward, backward, optimizer.step, scheduler.step."""
    (ebc(batch.kjt()).values() * upstream).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        advance(sched, i)


# ------------------------------------------------------------------------------------------ protocol
@pytest.mark.parametrize("name", OURS)
def test_an_embedding_optimizer_is_a_torch_optimizer(name):
    opt = OURS[name](lr=0.05)
    assert isinstance(opt, torch.optim.Optimizer)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == 0.05 and opt.defaults["lr"] == 0.05
    opt.param_groups[0]["lr"] = 0.02
    assert opt.lr == 0.02
    opt.lr = 0.03
    assert opt.param_groups[0]["lr"] == 0.03
    opt.zero_grad()
    opt.zero_grad(set_to_none=False)
    assert opt.step() is None
    assert opt.step(lambda: torch.tensor(1.5)) == 1.5
    with pytest.raises(ValueError, match="no parameters"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    assert len(opt.param_groups) == 1


def test_constructor_arguments_keep_their_order_and_are_checked():
    adam = te.optim.Adam(0.02, (0.8, 0.9), 1e-6)
    assert (adam.lr, adam.betas, adam.eps) == (0.02, (0.8, 0.9), 1e-6)
    assert te.optim.Adagrad(0.3, 1e-5).eps == 1e-5
    assert te.optim.RowWiseAdagrad().eps == 1e-8 and te.optim.Adagrad().eps == 1e-10
    with pytest.raises(ValueError, match="betas"):
        te.optim.Adam(betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="eps"):
        te.optim.Adam(eps=0.0)
    with pytest.raises(ValueError, match="eps"):
        te.optim.Adagrad(eps=math.nan)


# ------------------------------------------------------------------------------------------ schedulers
@pytest.mark.parametrize("kind", SCHEDULERS)
@pytest.mark.parametrize("name", OURS)
def test_a_scheduler_drives_the_fused_update_as_it_drives_torch_optim(name, kind):
    """Every step's rows equal torch's sparse training under the same scheduler class."""
    ours = OURS[name](lr=LR[name])
    ebc, sched = collection(ours), None
    sched = scheduler(kind, ours)
    table = torch.nn.EmbeddingBag(N, DIM, mode="sum", sparse=True)
    with torch.no_grad():
        table.weight.copy_(initial_rows())
    theirs = torch_optimizer(name, table.parameters())
    their_sched = scheduler(kind, theirs)
    keys = torch.arange(N)
    lrs = []
    for i, (batch, upstream) in enumerate(batches()):
        assert ours.lr == pytest.approx(theirs.param_groups[0]["lr"], rel=1e-12), f"step {i}: lr differs"
        lrs.append(ours.lr)
        theirs.zero_grad()
        (reference_forward(table, batch) * upstream).sum().backward()
        theirs.step()
        advance(their_sched, i)
        step(ebc, ours, sched, batch, upstream, i)
        torch.testing.assert_close(ebc.read("t", keys)[0], table.weight.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, i=i: f"{name}/{kind} step {i}: {m}")
    assert len(set(lrs)) > 1, f"{kind} never changed the lr: the test would not see a schedule ignored"


@pytest.mark.parametrize("name", OURS)
def test_a_bad_lr_written_by_a_scheduler_is_refused_at_the_next_step_with_no_row_changed(name):
    """LambdaLR writes nan, then 0: the forward refuses it (nothing inserted, no row, score or step
    count changed); fixed, training goes on like a twin that never saw it."""
    factors = {0: 1.0, 1: 0.5, 2: math.nan, 3: 0.0}
    victim, twin = (OURS[name](lr=LR[name]) for _ in range(2))
    ebcs = [collection(victim), collection(twin)]
    sched = lr_scheduler.LambdaLR(victim, lambda epoch: factors.get(epoch, 0.5))
    data = batches()
    for i in range(2):
        twin.lr = victim.lr
        for ebc in ebcs:
            (ebc(data[i][0].kjt()).values() * data[i][1]).sum().backward()
        victim.step()
        sched.step()
    unseen = Batch({"f": [[N - 1], [], []], "g": [[], [], [0]]})  # rows only this batch would touch
    for bad in (math.nan, 0.0):
        assert victim.param_groups[0]["lr"] == bad or math.isnan(bad)
        before, step_count = snapshot(ebcs[0], TABLES), ebcs[0].step
        for batch in (data[2][0], unseen):
            with pytest.raises(ValueError, match=r"lr must be a finite number > 0"):
                ebcs[0](batch.kjt())
        assert_snapshot_equal(before, snapshot(ebcs[0], TABLES))
        assert ebcs[0].step == step_count
        victim.step()
        sched.step()
    victim.lr = twin.lr = 0.5 * LR[name]
    for batch, upstream in data[2:]:
        for ebc in ebcs:
            (ebc(batch.kjt()).values() * upstream).sum().backward()
    for got, want in zip(snapshot(ebcs[0], TABLES)["t"][:3], snapshot(ebcs[1], TABLES)["t"][:3]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", OURS)
def test_a_bad_lr_written_between_forward_and_backward_is_refused_by_the_backward(name):
    opt = OURS[name](lr=LR[name])
    ebc = collection(opt)
    data = batches()
    (ebc(data[0][0].kjt()).values() * data[0][1]).sum().backward()
    before, step_count = snapshot(ebc, TABLES), ebc.step
    loss = (ebc(data[1][0].kjt()).values() * data[1][1]).sum()
    opt.param_groups[0]["lr"] = math.inf
    with pytest.raises(ValueError, match="lr"):
        loss.backward()
    del loss
    keys, weights, state, _ = before["t"]
    after = sorted_export(ebc, "t")
    assert torch.equal(after[0], keys) and torch.equal(after[1], weights) and torch.equal(after[2], state)
    assert ebc.step == step_count
    opt.lr = LR[name]  # fixed: the next step runs
    (ebc(data[1][0].kjt()).values() * data[1][1]).sum().backward()
    assert ebc.step == step_count + 1


def test_a_bad_beta_written_into_param_groups_is_refused():
    opt = te.optim.Adam(lr=0.01)
    ebc = collection(opt)
    opt.param_groups[0]["betas"] = (0.9, 1.0)
    with pytest.raises(ValueError, match="betas"):
        ebc(batches()[0][0].kjt())


# ------------------------------------------------------------------------------------------ state_dict
class Model(torch.nn.Module):
    def __init__(self, optimizer: te.optim.EmbeddingOptimizer) -> None:
        super().__init__()
        self.ebc = collection(optimizer)
        self.dense = torch.nn.Linear(2 * DIM, 1)
        torch.nn.init.constant_(self.dense.weight, 0.5)


def materialized(state: dict) -> dict:
    """A model's ``state_dict`` with the table handles read into plain tensors (what a file holds)."""
    return {k: v.materialize() if hasattr(v, "materialize") else v.clone() for k, v in state.items()}


def train(model, opt, dense_opt, sched, data, first: int) -> None:
    for i, (batch, upstream) in enumerate(data, start=first):
        dense_opt.zero_grad()
        out = model.ebc(batch.kjt()).values()
        (model.dense(out).sum() + (out * upstream).sum()).backward()
        dense_opt.step()
        opt.step()
        advance(sched, i)


@pytest.mark.parametrize("name", OURS)
def test_state_dicts_of_model_optimizer_and_scheduler_resume_exactly(name):
    """3 steps, save the model's, the optimizers' and the scheduler's state, load them into fresh ones,
    3 more steps: the rows, their optimizer state and the dense weights equal 6 straight steps."""
    data = batches()

    def build():
        opt = OURS[name](lr=LR[name])
        model = Model(opt)
        dense_opt = torch.optim.SGD(model.dense.parameters(), lr=0.01)
        return model, opt, dense_opt, scheduler("OneCycleLR", opt)

    straight = build()
    train(*straight, data, 0)

    first = build()
    train(*first, data[:3], 0)
    saved = (materialized(first[0].state_dict()), copy.deepcopy(first[1].state_dict()),
             copy.deepcopy(first[2].state_dict()), first[3].state_dict())
    del first
    resumed = build()
    model, opt, dense_opt, sched = resumed
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    dense_opt.load_state_dict(saved[2])
    sched.load_state_dict(saved[3])
    assert model.ebc.step == 3 and opt.lr == saved[1]["param_groups"][0]["lr"]
    train(*resumed, data[3:], 3)

    assert opt.state_dict() == straight[1].state_dict()
    for got, want in zip(sorted_export(model.ebc, "t"), sorted_export(straight[0].ebc, "t")):
        assert torch.equal(got, want)
    assert torch.equal(model.dense.weight, straight[0].dense.weight)


def test_an_optimizer_state_dict_holds_the_hyperparameters_and_refuses_another_optimizers():
    adam = te.optim.Adam(lr=0.02, betas=(0.8, 0.99), eps=1e-7)
    state = adam.state_dict()
    assert state["optimizer"] == "Adam" and state["state"] == {}
    assert {k: state["param_groups"][0][k] for k in ("lr", "betas", "eps")} == \
        {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-7}
    other = te.optim.Adam()
    other.load_state_dict(state)
    assert (other.lr, other.betas, other.eps) == (0.02, (0.8, 0.99), 1e-7)

    sgd = te.optim.SGD(lr=0.3)
    with pytest.raises(ValueError, match="Adam"):
        sgd.load_state_dict(state)
    bad = copy.deepcopy(state)
    bad["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        other.load_state_dict(bad)
    with pytest.raises(ValueError, match="eps"):
        te.optim.Adagrad().load_state_dict({"state": {}, "param_groups": [{"lr": 0.1, "params": []}]})
    assert sgd.lr == 0.3 and other.lr == 0.02
