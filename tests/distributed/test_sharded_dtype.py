"""16-bit tables sharded row-wise over 2 gloo ranks (spawned from pytest) hold, bit for bit, the rows
one process trains on the concatenated batch: rows travel between ranks in their dtype, and the
stochastic rounding's draws depend on (seed, table, key, step) only, not on which rank owns the key.

The upstream gradients are small multiples of 2**-4 and pooling is a plain sum, so every gradient
sum is exact in float32 whatever order the ranks add it in: any difference is a rounding that
depends on the shard."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import tieredemb as te
from tests.distributed.test_sharded import _free_port
from tests.ranks import spawn_ranks

STEPS, WORLD = 6, 2
MODES = ("hbm_direct", "cache")


def tables() -> list[te.TableConfig]:
    return [te.TableConfig("b", 4, ["x"], dtype=torch.bfloat16, initializer=te.init.Normal(0.0, 0.1)),
            te.TableConfig("h", 4, ["y"], dtype=torch.float16, initializer=te.init.Normal(0.0, 0.1)),
            te.TableConfig("f", 4, ["z"])]


def local_batch(step: int, rank: int) -> te.KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(10 * step + rank)
    lengths = torch.randint(0, 4, (3 * 3,), generator=gen)
    return te.KeyedJaggedTensor(["x", "y", "z"], torch.randint(-20, 20, (int(lengths.sum()),), generator=gen),
                                lengths=lengths)


def upstream(step: int, rank: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(500 + 10 * step + rank)
    return torch.randint(-8, 9, shape, generator=gen).float() / 16


def build(mode: str, group=None) -> te.EmbeddingBagCollection:
    storage = te.StorageConfig(hbm_budget=200, bucket_width=4, segment_rows=8) if mode == "cache" else None
    return te.EmbeddingBagCollection(tables(), optimizer=te.optim.Adam(lr=0.03), storage=storage, seed=9,
                                     process_group=group)


def _worker(rank: int, port: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    result = {}
    try:
        for mode in MODES:
            ebc = build(mode, dist.group.WORLD)
            for step in range(STEPS):
                out = ebc(local_batch(step, rank)).values()
                (out * upstream(step, rank, tuple(out.shape))).sum().backward()
            ebc.flush()
            rows = {}
            for t in ("b", "h", "f"):
                e = ebc.export(t)
                rows[t] = (e.keys, e.weights, e.optimizer_state)
            read = ebc.read("b", torch.arange(-20, 20)[rank::WORLD])  # a collective read
            result[mode] = (rows, read)
            ebc.close()
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()




def concat(batches: list[te.KeyedJaggedTensor]) -> te.KeyedJaggedTensor:
    """The ranks' batches side by side (feature-major: each feature's bags, rank after rank)."""
    lengths = [k.lengths().view(3, -1) for k in batches]  # (features, samples)
    values = []
    for f in range(3):
        for k, ln in zip(batches, lengths):
            values.append(k.values()[int(ln[:f].sum()) : int(ln[: f + 1].sum())])
    return te.KeyedJaggedTensor(["x", "y", "z"], torch.cat(values), lengths=torch.cat(lengths, 1).reshape(-1))


@pytest.mark.slow
def test_sharded_16bit_rows_equal_one_process(tmp_path):
    spawn_ranks(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    ref = build("hbm_direct")
    for step in range(STEPS):
        batches = [local_batch(step, r) for r in range(WORLD)]
        kjt = concat(batches)
        out = ref(kjt).values()
        up = torch.cat([upstream(step, r, (3, 12)) for r in range(WORLD)])
        (out * up).sum().backward()
    for mode in MODES:
        for t in ("b", "h", "f"):
            shards = [results[r][mode][0][t] for r in range(WORLD)]
            keys, weights, state = (torch.cat(parts) for parts in zip(*shards))
            want = ref.export(t)
            order, want_order = torch.argsort(keys), torch.argsort(want.keys)
            assert torch.equal(keys[order], want.keys[want_order]), (mode, t)
            assert weights.dtype == want.weights.dtype
            assert torch.equal(weights[order], want.weights[want_order]), (mode, t)
            assert torch.equal(state[order], want.optimizer_state[want_order]), (mode, t)
        for r in range(WORLD):
            w, found = results[r][mode][1]
            ww, wf = ref.read("b", torch.arange(-20, 20)[r::WORLD])
            assert w.dtype == torch.bfloat16 and torch.equal(found, wf) and torch.equal(w, ww)
