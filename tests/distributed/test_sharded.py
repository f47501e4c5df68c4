"""Row-wise sharding over real gloo process groups (ranks spawned from pytest).

N ranks training on their local batches must compute what one process computes on the concatenated
batch with the per-rank losses summed: the same outputs on every rank, and the union of the ranks'
shards holding exactly the reference's rows (so every key is owned by exactly one rank). Batches
include ranks with no sample at all and a table that gets no id on rank 0.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

import tieredemb as te
from tests.ranks import spawn_ranks

STEPS = 10
POOL = [0, 1, 2, 3, 5, 8, 13, 21, 34, 49, -7, 2**40, -(2**62)]
OPTIMIZERS = {
    "sgd": lambda: te.optim.SGD(lr=0.1),
    "adagrad": lambda: te.optim.Adagrad(lr=0.1),
    "rowwise": lambda: te.optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: te.optim.Adam(lr=0.05),
}
# +prefetch: prefetch(i+1) before backward(i); +pipeline: te.TrainPipeline with the prefetch thread
# cache+host_tier+pipeline: a host tier of 2 rows a table in front of RocksDB, reads 2 batches ahead
MODES = ("hbm_direct", "cache", "cache+prefetch", "cache+pipeline", "cache+host_tier+pipeline")


def tables(pooled: bool) -> list[te.TableConfig]:
    mean = "mean" if pooled else "sum"
    return [
        te.TableConfig("t0", 4, ["a", "b"], initializer=te.init.Normal(0.0, 0.1)),
        te.TableConfig("t1", 4, ["c"], num_embeddings=50, pooling=mean),  # same dim: one group with t0
        te.TableConfig("t2", 3, ["d"], eviction="lfu"),  # a second group
    ]


def features() -> list[str]:
    return ["a", "b", "c", "d"]


def local_batch(step: int, rank: int) -> tuple[te.KeyedJaggedTensor, int]:
    """Rank ``rank``'s batch of ``step``: 0-3 samples (rank 1 has none every third step), 0-3 ids a
    bag; feature d gets no id on rank 0."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    b = 0 if rank == 1 and step % 3 == 0 else int(torch.randint(1, 4, (1,), generator=gen))
    lengths, values = [], []
    for f in features():
        lens = torch.randint(0, 4, (b,), generator=gen)
        if f == "d" and rank == 0:
            lens = torch.zeros(b, dtype=torch.int64)
        pool = torch.tensor(POOL) if f != "c" else torch.arange(50)
        values.append(pool[torch.randint(0, pool.numel(), (int(lens.sum()),), generator=gen)])
        lengths.append(lens)
    return te.KeyedJaggedTensor(features(), torch.cat(values), lengths=torch.cat(lengths)), b


def concat(batches: list[te.KeyedJaggedTensor]) -> te.KeyedJaggedTensor:
    """The batches side by side: each feature's bags, rank after rank."""
    values, lengths = [], []
    for i in range(len(features())):
        for kjt in batches:
            b = kjt.stride()
            lens = kjt.lengths()[i * b : (i + 1) * b]
            start = int(kjt.lengths()[: i * b].sum())
            values.append(kjt.values()[start : start + int(lens.sum())])
            lengths.append(lens)
    return te.KeyedJaggedTensor(features(), torch.cat(values), lengths=torch.cat(lengths))


def upstream(step: int, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Same-sign gradients: a key's summed gradient never nearly cancels, so Adam (which divides by
    its magnitude) does not turn summation-order rounding (ranks, atomics) into sign flips."""
    gen = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.rand(shape, generator=gen) + 0.5


def build(module: type, optimizer: str, mode: str, store: str | None, group=None, device="cpu"):
    storage = None
    if mode.startswith("cache"):
        storage = te.StorageConfig(hbm_budget=3 * 4 * 12 * 4, bucket_width=4, segment_rows=8,
                                   backing=te.storage.RocksDB(store, shards=2),
                                   host_budget=3 * 2 * 12 * 4 if "host_tier" in mode else None)
    return module(tables(module is te.EmbeddingBagCollection), optimizer=OPTIMIZERS[optimizer](),
                  storage=storage, seed=5, process_group=group, device=device)


def step_losses(module, out, step: int, rank: int) -> torch.Tensor:
    """The loss whose gradient the step applies: outputs times a fixed random upstream gradient."""
    if isinstance(out, te.KeyedTensor):
        v = out.values()
        return (v * upstream(step, rank, tuple(v.shape)).to(v.device)).sum()
    return sum((out[f].values() * upstream(step, rank * 10 + i, tuple(out[f].values().shape))
                .to(out[f].values().device)).sum() for i, f in enumerate(features()))


def outputs(out) -> list[torch.Tensor]:
    if isinstance(out, te.KeyedTensor):
        return [out.values().detach().cpu()]
    return [out[f].values().detach().cpu() for f in features()]


class StepLoss(torch.nn.Module):
    """A model for the pipeline: the collection's outputs times the step's upstream gradient."""

    def __init__(self, collection, rank: int) -> None:
        super().__init__()
        self.collection, self.rank, self.outs = collection, rank, []

    def forward(self, batch):
        out = self.collection(batch["kjt"])
        self.outs.append(outputs(out))
        return step_losses(type(self.collection), out, int(batch["step"]), self.rank)


def train_pipelined(ebc, rank: int, lookahead: int = 0) -> list[list[torch.Tensor]]:
    model = StepLoss(ebc, rank)
    pipeline = te.TrainPipeline(model, None, prefetch_in_thread=True, lookahead=lookahead)
    it = iter([{"kjt": local_batch(step, rank)[0], "step": torch.tensor(step)} for step in range(STEPS)])
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
    return model.outs


def _worker(rank: int, world: int, port: int, module_name: str, tmp: str, device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("nccl" if device != "cpu" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                           rank=rank, world_size=world)
    module = getattr(te, module_name)
    result = {}
    try:
        for optimizer in OPTIMIZERS:
            for mode in MODES:
                ebc = build(module, optimizer, mode, os.path.join(tmp, f"{optimizer}-{mode}"),
                            dist.group.WORLD, device)
                outs = (train_pipelined(ebc, rank, 2 if "host_tier" in mode else 0)
                        if mode.endswith("+pipeline") else [])
                ahead = mode.endswith("+prefetch")
                if ahead:
                    ebc.prefetch(local_batch(0, rank)[0])
                for step in range(0 if outs else STEPS):
                    kjt, _ = local_batch(step, rank)
                    out = ebc(kjt)
                    outs.append(outputs(out))
                    if ahead and step + 1 < STEPS:  # input dist of the next batch before this backward
                        ebc.prefetch(local_batch(step + 1, rank)[0])
                    step_losses(module, out, step, rank).backward()
                ebc.flush()
                rows = {t: ebc.export(t) for t in ("t0", "t1", "t2")}
                read = ebc.read("t0", torch.tensor(POOL[rank::world]))  # a collective read
                loads = ebc.stats(all_ranks=True)  # every rank's load, gathered on every rank
                assert loads[rank]["t0"].lookups == ebc.stats()["t0"].lookups
                lookups = [{t: s[t].lookups for t in s} for s in loads]
                shard = {t: (r.keys.cpu(), r.weights.cpu(), r.optimizer_state.cpu()) for t, r in rows.items()}
                result[(optimizer, mode)] = (outs, shard, tuple(x.cpu() for x in read), lookups)
                ebc.close()
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sorted(keys, weights, state):
    order = torch.argsort(keys)
    return keys[order], torch.cat([weights, state], 1)[order]


def check_loads(loads: list, world: int, msg: str) -> None:
    """``stats(all_ranks=True)`` as each rank got it: the same report everywhere, and every id of
    every rank's batches served once, by its owner."""
    assert all(load == loads[0] for load in loads), msg
    ids = {"t0": 0, "t1": 0, "t2": 0}
    table_of = {"a": "t0", "b": "t0", "c": "t1", "d": "t2"}
    for step in range(STEPS):
        for r in range(world):
            kjt, b = local_batch(step, r)
            per_feature = kjt.lengths().view(len(features()), b).sum(1).tolist() if b else [0] * 4
            for f, n in zip(features(), per_feature):
                ids[table_of[f]] += n
    assert {t: sum(load[t] for load in loads[0]) for t in ids} == ids, msg


# gloo on CPU everywhere; NCCL on GPUs where the machine has enough of them (tools/gpu_check.sh)
DEVICES = [("cpu", w) for w in (2, 3)] + [("cuda", w) for w in (2, 4) if torch.cuda.device_count() >= w]


@pytest.mark.parametrize("module_name", ["EmbeddingBagCollection", "EmbeddingCollection"])
@pytest.mark.parametrize("device, world", DEVICES)
@pytest.mark.slow
def test_sharded_training_equals_one_process_on_the_concatenated_batch(device, world, module_name, tmp_path):
    spawn_ranks(_worker, args=(world, _free_port(), module_name, str(tmp_path), device), nprocs=world)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    module = getattr(te, module_name)
    # the reference runs on the ranks' kind of device: what is compared is sharding, not CPU vs GPU
    ref_device = "cpu" if device == "cpu" else "cuda:0"
    for optimizer in OPTIMIZERS:
        for mode in MODES:
            msg = f"{module_name} world={world} {optimizer} {mode}"
            ref = build(module, optimizer, "hbm_direct", None, device=ref_device)
            for step in range(STEPS):
                local = [local_batch(step, r) for r in range(world)]
                out = ref(concat([k for k, _ in local]))
                # per rank, its slice of the reference's output
                got = [results[r][(optimizer, mode)][0][step] for r in range(world)]
                want = outputs(out)
                if module is te.EmbeddingBagCollection:
                    bounds = torch.cumsum(torch.tensor([0] + [b for _, b in local]), 0).tolist()
                    for r in range(world):
                        torch.testing.assert_close(got[r][0], want[0][bounds[r] : bounds[r + 1]],
                                                   rtol=1e-5, atol=1e-6, msg=f"{msg} step {step} rank {r}")
                    loss = sum((out.values()[bounds[r] : bounds[r + 1]]
                                * upstream(step, r, tuple(got[r][0].shape)).to(ref_device)).sum()
                               for r in range(world))
                else:
                    loss = 0
                    for i, f in enumerate(features()):
                        sizes = [g[i].shape[0] for g in got]
                        parts = torch.split(out[f].values(), sizes)
                        for r in range(world):
                            where = f"{msg} step {step} rank {r} feature {f}"
                            torch.testing.assert_close(got[r][i], parts[r].detach().cpu(), rtol=1e-5,
                                                       atol=1e-6, msg=where)
                            up = upstream(step, r * 10 + i, tuple(parts[r].shape)).to(ref_device)
                            loss = loss + (parts[r] * up).sum()
                loss.backward()
            for t in ("t0", "t1", "t2"):
                shards = [results[r][(optimizer, mode)][1][t] for r in range(world)]
                keys, rows = _sorted(*(torch.cat(parts) for parts in zip(*shards)))
                want = ref.export(t)
                want_keys, want_rows = _sorted(*(x.cpu() for x in (want.keys, want.weights,
                                                                    want.optimizer_state)))
                assert torch.equal(keys, want_keys), f"{msg} table {t}: keys (each owned by one rank)"
                torch.testing.assert_close(rows, want_rows, rtol=1e-5, atol=1e-6, msg=f"{msg} table {t}")
                assert all(s[0].numel() for s in shards) or t == "t2", f"{msg}: a rank owns no {t} row"
            check_loads([results[r][(optimizer, mode)][3] for r in range(world)], world, msg)
            for r in range(world):
                w, found = results[r][(optimizer, mode)][2]
                ww, wf = ref.read("t0", torch.tensor(POOL[r::world]))
                assert torch.equal(found, wf.cpu())
                torch.testing.assert_close(w, ww.cpu(), rtol=1e-5, atol=1e-6)
