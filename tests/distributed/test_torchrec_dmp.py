"""TorchRec's ``DistributedModelParallel`` with tieredemb's sharder, over real gloo ranks (spawned
from pytest).

A TorchRec ``DLRM`` over ``tieredemb.torchrec.EmbeddingBagCollection``, wrapped in DMP with
``EmbeddingBagCollectionSharder`` on 2 ranks, each feeding its half of every batch, must train like
one process on the concatenated batch: each rank's logits are its half of the reference's, the
ranks' losses add up to the reference's, and afterwards the ranks' shards hold exactly the
reference's rows (with optimizer state) and the dense layers match. Rows written into the
collection before DMP shards it are moved to their owners. Driven by a plain DMP
forward/backward loop and by TorchRec's ``TrainPipelineSparseDist``. The reference is the same
model unsharded, with no DMP and no process group.

Each rank's loss is its share of the global mean (a sum over its samples divided by the global batch
size), so the embedding gradients, which the ranks' backwards add up on the owners (as TorchRec's
row-wise sharding does), are the reference's; the dense gradients are summed too (a DDP comm hook)
instead of DDP's average.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tieredemb as te
from tests.distributed.test_sharded import _free_port, _sorted
from tests.ranks import spawn_ranks

torchrec = pytest.importorskip("torchrec")
tt = pytest.importorskip("tieredemb.torchrec")

from torchrec.datasets.utils import Batch  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel, get_module  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology  # noqa: E402
from torchrec.distributed.sharding_plan import get_default_sharders  # noqa: E402
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist  # noqa: E402
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan  # noqa: E402
from torchrec.models.dlrm import DLRM  # noqa: E402

WORLD, STEPS, B, DENSE_IN = 2, 5, 4, 3  # B samples a rank a step
TABLES = (("t0", 40, "f0"), ("t1", 10**6, "f1"))  # name, num_embeddings, feature
DIM, LR = 4, 0.1


def configs() -> list:
    return [torchrec.EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
            for n, rows, f in TABLES]


class Train(torch.nn.Module):
    """DLRM and its loss: this rank's share of the global mean BCE; returns (loss, (loss, logits))."""

    def __init__(self, dlrm: torch.nn.Module, global_batch: int) -> None:
        super().__init__()
        self.model, self.global_batch = dlrm, global_batch

    def forward(self, batch: Batch):
        logits = self.model(batch.dense_features, batch.sparse_features).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
        loss = loss / self.global_batch
        return loss, (loss.detach(), logits.detach())


def build(global_batch: int) -> Train:
    torch.manual_seed(0)  # the dense layers: the same on every rank and in the reference
    ebc = tt.EmbeddingBagCollection(configs(), optimizer=te.optim.Adagrad(lr=LR), seed=3)
    # rows written before DMP: the sharder moves them to their owners
    ebc.write("t0", torch.arange(0, 30, 2), torch.linspace(-1, 1, 15 * DIM).view(15, DIM))
    return Train(DLRM(ebc, dense_in_features=DENSE_IN, dense_arch_layer_sizes=[8, DIM],
                      over_arch_layer_sizes=[8, 1]), global_batch)


def local_batch(step: int, rank: int, samples: int = B) -> Batch:
    """Rank ``rank``'s half of batch ``step``: 0-3 ids a bag (some bags empty), repeated ids."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 4, (len(TABLES) * samples,), generator=gen)
    per_table = lengths.view(len(TABLES), samples).sum(1).tolist()
    values = torch.cat([torch.randint(0, min(rows, 30), (n,), generator=gen)
                        for (_, rows, _), n in zip(TABLES, per_table)])
    kjt = torchrec.KeyedJaggedTensor(keys=[f for _, _, f in TABLES], values=values, lengths=lengths)
    return Batch(dense_features=torch.rand(samples, DENSE_IN, generator=gen), sparse_features=kjt,
                 labels=torch.randint(0, 2, (samples,), generator=gen).float())


def concat(batches: list[Batch]) -> Batch:
    """The ranks' halves side by side (each feature's bags rank after rank)."""
    kjts = [b.sparse_features for b in batches]
    values = torch.cat([torch.cat([k[f].values() for k in kjts]) for _, _, f in TABLES])
    lengths = torch.cat([torch.cat([k[f].lengths() for k in kjts]) for _, _, f in TABLES])
    kjt = torchrec.KeyedJaggedTensor(keys=[f for _, _, f in TABLES], values=values, lengths=lengths)
    return Batch(dense_features=torch.cat([b.dense_features for b in batches]), sparse_features=kjt,
                 labels=torch.cat([b.labels for b in batches]))


def topology() -> Topology:
    return Topology(world_size=WORLD, compute_device="cpu", local_world_size=WORLD)


def _sum_hook(state, bucket):
    """DDP comm hook: the dense gradients summed over the ranks (DDP's default averages them)."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _train(dmp: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, how: str,
           device: torch.device) -> list:
    batches = [local_batch(step, rank) for step in range(STEPS)]
    outs = []
    if how == "pipeline":  # the pipeline copies each batch to the device itself
        pipeline = TrainPipelineSparseDist(dmp, opt, device)
        it = iter(batches)
        for _ in range(STEPS):
            outs.append(pipeline.progress(it))
        with pytest.raises(StopIteration):
            pipeline.progress(it)
        return outs
    for batch in batches:
        loss, out = dmp(batch.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        outs.append(out)
    return outs


def _refusals(rank: int) -> dict:
    """Plans tieredemb's sharder does not do: each refused with a ValueError, the model untouched."""
    got = {}
    for name, change in {"table_wise": dict(sharding_type="table_wise"),
                         "kernel": dict(compute_kernel="fused_uvm_caching"),
                         "ranks": dict(ranks=[0])}.items():
        model = build(WORLD * B)
        params = {"t0": ParameterSharding(**{**dict(sharding_type="row_wise", compute_kernel="fused",
                                                    ranks=[0, 1]), **change}),
                  "t1": ParameterSharding(sharding_type="row_wise", compute_kernel="fused", ranks=[0, 1])}
        plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": params})
        try:
            DistributedModelParallel(model, plan=plan, sharders=[tt.EmbeddingBagCollectionSharder()])
            got[name] = None
        except ValueError as e:
            loss, _ = model(local_batch(0, rank))  # the unsharded collection still works
            got[name] = (str(e), bool(torch.isfinite(loss)))
    # a table TorchRec's planner may only place table-wise (a constraint): no plan for it at all
    only_table_wise = {"t0": ParameterConstraints(sharding_types=["table_wise"])}
    planner = EmbeddingShardingPlanner(topology(), constraints=only_table_wise)
    try:
        planner.plan(build(WORLD * B), [tt.EmbeddingBagCollectionSharder()])
        got["constraint"] = None
    except Exception as e:  # noqa: BLE001 - TorchRec's planner raises its own error types
        got["constraint"] = f"{type(e).__name__}: {e}"
    return got


class Mixed(torch.nn.Module):
    """One table of ours and one of TorchRec's, side by side, under a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        ours, theirs = configs()
        self.ours = tt.EmbeddingBagCollection([ours], optimizer=te.optim.SGD(lr=LR), seed=3)
        self.theirs = torchrec.EmbeddingBagCollection([theirs])
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, batch: Batch):
        kt = torch.cat([self.ours(batch.sparse_features).values(),
                        self.theirs(batch.sparse_features).values()], 1)
        out = self.head(kt).squeeze(-1)
        return (out * batch.labels).sum(), out.detach()


def _mixed(rank: int) -> dict:
    """DMP over ``Mixed`` with both sharders: TorchRec's table planned by TorchRec (data-parallel, a
    constraint), ours row-wise; the dense head and TorchRec's table stepped by SGD."""
    constraints = {"t1": ParameterConstraints(sharding_types=["data_parallel"])}
    planner = EmbeddingShardingPlanner(topology(),
                                       constraints=constraints)
    sharders = [tt.EmbeddingBagCollectionSharder(), *get_default_sharders()]
    model = Mixed()
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    dmp = DistributedModelParallel(model, plan=plan, sharders=sharders)
    get_module(dmp).register_comm_hook(None, _sum_hook)
    opt = torch.optim.SGD(dmp.parameters(), lr=LR)
    initial = dmp.module.theirs.state_dict()["embedding_bags.t1.weight"].detach().clone()
    outs = []
    for step in range(STEPS):
        loss, out = dmp(local_batch(step, rank))
        opt.zero_grad()
        loss.backward()
        opt.step()
        outs.append(out)
    rows = dmp.module.ours.export("t0")
    theirs = dmp.module.theirs.state_dict()["embedding_bags.t1.weight"].detach().clone()
    return {"outs": outs, "rows": (rows.keys, rows.weights, rows.optimizer_state), "plan": str(dmp.plan),
            "theirs": theirs.detach().clone(), "initial": initial, "types": (type(dmp.module.ours).__name__,
                                                         type(dmp.module.theirs).__module__)}


class Sequences(torch.nn.Module):
    """``tieredemb.torchrec.EmbeddingCollection`` (one row per id) and a linear layer over every
    id's row; the loss is this rank's share of the sum over the global batch's ids."""

    def __init__(self, global_batch: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ec = tt.EmbeddingCollection(
            [torchrec.EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=rows, feature_names=[f])
             for n, rows, f in TABLES], optimizer=te.optim.Adam(lr=LR), seed=3)
        self.top, self.global_batch = torch.nn.Linear(DIM, 1), global_batch

    def forward(self, kjt) -> torch.Tensor:
        out = self.ec(kjt)
        return sum(self.top(out[f].values()).sum() for _, _, f in TABLES) / self.global_batch


def _sequences(rank: int) -> dict:
    """``EmbeddingCollectionSharder``: the losses of each step and the shard's rows afterwards."""
    dmp = DistributedModelParallel(Sequences(WORLD * B), device=torch.device("cpu"),
                                   sharders=[tt.EmbeddingCollectionSharder()])
    get_module(dmp).register_comm_hook(None, _sum_hook)
    opt = torch.optim.SGD(dmp.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = dmp(local_batch(step, rank).sparse_features)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    ec = dmp.module.ec
    rows = {n: (lambda r: (r.keys, r.weights, r.optimizer_state))(ec.export(n)) for n, _, _ in TABLES}
    return {"losses": losses, "rows": rows, "type": type(ec).__name__, "plan": str(dmp.plan)}


def _worker(rank: int, world: int, port: int, tmp: str, how: str, backend: str = "gloo") -> None:
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if how in ("refusals", "mixed", "sequences"):
            result = {"refusals": _refusals, "mixed": _mixed, "sequences": _sequences}[how](rank)
            torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
            return
        dmp = DistributedModelParallel(build(world * B), device=device,
                                       sharders=[tt.EmbeddingBagCollectionSharder()])
        get_module(dmp).register_comm_hook(None, _sum_hook)
        opt = torch.optim.SGD(dmp.parameters(), lr=LR)
        outs = _train(dmp, opt, rank, how, device)
        ebc = dmp.module.model.sparse_arch.embedding_bag_collection
        rows = {n: (lambda r: (r.keys, r.weights, r.optimizer_state))(ebc.export(n)) for n, _, _ in TABLES}
        dense = {k: v.detach().clone() for k, v in dmp.module.state_dict().items() if torch.is_tensor(v)
                 and not k.startswith("model.sparse_arch")}
        result = {"outs": outs, "rows": rows, "dense": dense, "plan": str(dmp.plan),
                  "type": type(ebc).__name__, "pipelined": ebc.is_pipelined, "device": str(ebc.device)}
        torch.save(_to_cpu(result), os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _to_cpu(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _spawn(tmp_path, how: str, backend: str = "gloo") -> list:
    spawn_ranks(_worker, args=(WORLD, _free_port(), str(tmp_path), how, backend), nprocs=WORLD)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("how", ["loop", "pipeline"])
def test_dmp_dlrm_trains_like_one_process_on_the_concatenated_batch(how, tmp_path):
    _check_dlrm(_spawn(tmp_path, how), how, "cpu", rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA devices (NCCL)")
@pytest.mark.parametrize("how", ["loop", "pipeline"])
def test_dmp_dlrm_on_nccl_gpus_trains_like_one_process(how, tmp_path):
    """The same over NCCL on 2 GPUs, each rank's collection on its own GPU; the reference runs on
    the CPU, so the tolerance allows for the GPU's other order of float sums."""
    _check_dlrm(_spawn(tmp_path, how, "nccl"), how, "cuda", rtol=1e-4, atol=1e-5)


def _check_dlrm(results: list, how: str, device_type: str, rtol: float, atol: float) -> None:
    """Each rank's logits are its half of the one process's, the losses add up, and the shards and
    dense layers hold the one process's rows and weights."""
    for rank, r in enumerate(results):
        assert r["type"] == "ShardedEmbeddingBagCollection"
        assert "row_wise" in r["plan"] and "fused" in r["plan"], r["plan"]
        # TorchRec's pipeline replaced the collection's forward by its own (input dist ahead)
        assert r["pipelined"] == (how == "pipeline")
        want_device = "cpu" if device_type == "cpu" else f"cuda:{rank}"
        assert r["device"] == want_device, r["device"]
    ref = build(WORLD * B)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        loss, (_, logits) = ref(concat([local_batch(step, r) for r in range(WORLD)]))
        got = [results[r]["outs"][step] for r in range(WORLD)]
        for r in range(WORLD):
            torch.testing.assert_close(got[r][1], logits[r * B : (r + 1) * B], rtol=rtol, atol=atol,
                                       msg=f"{how} step {step}: rank {r}'s logits")
        torch.testing.assert_close(sum(g[0] for g in got), loss.detach(), rtol=rtol, atol=atol,
                                   msg=f"{how} step {step}: the ranks' losses")
        opt.zero_grad()
        loss.backward()
        opt.step()
    ebc = ref.model.sparse_arch.embedding_bag_collection
    for name, _, _ in TABLES:
        keys, rows = _sorted(*(torch.cat(parts) for parts in zip(*(r["rows"][name] for r in results))))
        want = ebc.export(name)
        want_keys, want_rows = _sorted(want.keys, want.weights, want.optimizer_state)
        assert torch.equal(keys, want_keys), f"{how} table {name}: keys (each owned by one rank)"
        torch.testing.assert_close(rows, want_rows, rtol=rtol, atol=atol, msg=f"{how} table {name}")
        assert all(r["rows"][name][0].numel() for r in results), f"{how}: a rank owns no {name} row"
    want_dense = {k: v for k, v in ref.state_dict().items() if torch.is_tensor(v)
                  and not k.startswith("model.sparse_arch")}
    for r in results:
        assert r["dense"].keys() == want_dense.keys()
        for k, v in want_dense.items():
            torch.testing.assert_close(r["dense"][k], v, rtol=rtol, atol=atol, msg=f"{how} dense {k}")


def test_dmp_one_table_of_ours_and_one_of_torchrec(tmp_path):
    results = _spawn(tmp_path, "mixed")
    ref = Mixed()
    with torch.no_grad():  # TorchRec's sharded table draws its own initial rows: start from them
        ref.theirs.embedding_bags["t1"].weight.copy_(results[0]["initial"])
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for r in results:
        want = ("ShardedEmbeddingBagCollection", "torchrec.distributed.embeddingbag")
        assert r["types"] == want, r["types"]
        assert "data_parallel" in r["plan"] and "row_wise" in r["plan"], r["plan"]
    for step in range(STEPS):
        loss, out = ref(concat([local_batch(step, r) for r in range(WORLD)]))
        for r in range(WORLD):
            torch.testing.assert_close(results[r]["outs"][step], out[r * B : (r + 1) * B], rtol=1e-5,
                                       atol=1e-6, msg=f"step {step}: rank {r}'s outputs")
        opt.zero_grad()
        loss.backward()
        # TorchRec's data-parallel table sits under a DDP of its own, which averages its gradient
        ref.theirs.embedding_bags["t1"].weight.grad /= WORLD
        opt.step()
    keys, rows = _sorted(*(torch.cat(parts) for parts in zip(*(r["rows"] for r in results))))
    want = ref.ours.export("t0")
    want_keys, want_rows = _sorted(want.keys, want.weights, want.optimizer_state)
    assert torch.equal(keys, want_keys)
    torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-6, msg="our table's rows")
    for r in results:
        torch.testing.assert_close(r["theirs"], ref.theirs.embedding_bags["t1"].weight.detach(), rtol=1e-5,
                                   atol=1e-6, msg="TorchRec's table")


def test_dmp_refuses_plans_it_does_not_do(tmp_path):
    for got in _spawn(tmp_path, "refusals"):
        message, still_works = got["table_wise"]
        assert "table 't0'" in message and "'table_wise'" in message and "'row_wise'" in message
        assert still_works
        message, still_works = got["kernel"]
        assert "'fused_uvm_caching'" in message and still_works
        message, still_works = got["ranks"]
        assert "[0]" in message and "all 2 ranks" in message and still_works
        assert got["constraint"] is not None and "t0" in got["constraint"]


def test_sharder_needs_a_process_group():
    model = build(B)
    params = {n: ParameterSharding(sharding_type="row_wise", compute_kernel="fused") for n, _, _ in TABLES}
    ebc = model.model.sparse_arch.embedding_bag_collection
    with pytest.raises(ValueError, match="needs a process group"):
        tt.EmbeddingBagCollectionSharder().shard(ebc, params, ShardingEnv.from_local(2, 0))
    assert torch.isfinite(model(local_batch(0, 0))[0])


def test_dmp_embedding_collection_trains_like_one_process(tmp_path):
    """``EmbeddingCollectionSharder``: unpooled rows, row-wise by our routing; the ranks' losses add
    up to the one process's on the concatenated batch, and their shards hold its rows."""
    results = _spawn(tmp_path, "sequences")
    for r in results:
        assert r["type"] == "ShardedEmbeddingCollection", r["type"]
        assert "row_wise" in r["plan"], r["plan"]
    ref = Sequences(WORLD * B)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        loss = ref(concat([local_batch(step, r) for r in range(WORLD)]).sparse_features)
        torch.testing.assert_close(sum(r["losses"][step] for r in results), loss.detach(), rtol=1e-5,
                                   atol=1e-6, msg=f"step {step}: the ranks' losses")
        opt.zero_grad()
        loss.backward()
        opt.step()
    for name, _, _ in TABLES:
        keys, rows = _sorted(*(torch.cat(parts) for parts in zip(*(r["rows"][name] for r in results))))
        want = ref.ec.export(name)
        want_keys, want_rows = _sorted(want.keys, want.weights, want.optimizer_state)
        assert torch.equal(keys, want_keys), f"table {name}: keys (each owned by one rank)"
        torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-6, msg=f"table {name}")
