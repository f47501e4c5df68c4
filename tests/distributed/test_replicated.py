"""Hot rows replicated on every rank (``StorageConfig(replicate_hot=te.HotRows(...))``) over real gloo
ranks: training equals the unreplicated run and one process on the concatenated batch (outputs and
rows), and every rank's copy of a hot row is the same, bit for bit, after training (16-bit rows with
stochastic rounding too). Batches are Zipf-like, so hot keys occur on several ranks in one step."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import tieredemb as te
from tests.distributed.test_sharded import OPTIMIZERS, _free_port, concat
from tests.ranks import spawn_ranks

STEPS = 6
POOL = [3, 0, 1, 2, 5, 8, 13, 21, 34, 49, -7, 2**40, -(2**62), 11, 12, 17]  # the first ones the hottest
HOT = {"t0": [3, 0, 1, 999], "t1": [3, 0], "t2": [3]}  # 999: never used
# plain: no replication; keys: the HOT keys given; chosen: the 2 most used a table after 2 batches;
# keys+cache+prefetch: in cache mode, batch i+1's input dist before backward i; chosen+prefetch: the same
# around the choice (the owners' rows copied after the backward of the last batch before it)
VARIANTS = ("plain", "keys", "chosen", "keys+cache+prefetch", "chosen+prefetch")
FEATURES = ["a", "b", "c", "d"]


def tables(dtype=torch.float32) -> list[te.TableConfig]:
    return [
        te.TableConfig("t0", 4, ["a", "b"], initializer=te.init.Normal(0.0, 0.1), dtype=dtype),
        te.TableConfig("t1", 4, ["c"], num_embeddings=50, pooling="mean", dtype=dtype),
        te.TableConfig("t2", 3, ["d"], eviction="lfu", dtype=dtype),
    ]


def local_batch(step: int, rank: int) -> tuple[te.KeyedJaggedTensor, int]:
    """2-4 samples of 1-4 ids a bag, ids Zipf-like over POOL (its first ids far more often)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    b = int(torch.randint(2, 5, (1,), generator=gen))
    lengths, values = [], []
    for f in FEATURES:
        lens = torch.randint(1, 5, (b,), generator=gen)
        pool = torch.tensor(POOL) if f != "c" else torch.tensor(POOL[:10])  # t1: ids in [0, 50)
        ranks = (torch.rand(int(lens.sum()), generator=gen) ** 3 * pool.numel()).long()
        values.append(pool[ranks])
        lengths.append(lens)
    return te.KeyedJaggedTensor(FEATURES, torch.cat(values), lengths=torch.cat(lengths)), b


def upstream(step: int, rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7000 + 100 * step + rank)
    return torch.rand(shape, generator=gen) + 0.5  # same sign: Adam far from sign flips


def build(optimizer: str, variant: str, store: str | None, group=None, dtype=torch.float32, device="cpu"):
    hot = None
    if variant.startswith("keys"):
        hot = te.HotRows(keys={t: torch.tensor(k) for t, k in HOT.items()})
    elif variant.startswith("chosen"):
        hot = te.HotRows(per_table=2, window=2)
    kwargs = {}
    if "cache" in variant:
        kwargs = dict(hbm_budget=3 * 4 * 12 * 4, bucket_width=4, segment_rows=8,
                      backing=te.storage.RocksDB(store, shards=2))
    storage = te.StorageConfig(replicate_hot=hot, **kwargs)
    return te.EmbeddingBagCollection(tables(dtype), optimizer=OPTIMIZERS[optimizer](), storage=storage,
                                     seed=5, process_group=group, device=device)


def train(ebc, rank: int, ahead: bool) -> list[torch.Tensor]:
    def batch(step: int) -> te.KeyedJaggedTensor:
        return local_batch(step, rank)[0].to(ebc.device)

    outs = []
    if ahead:
        ebc.prefetch(batch(0))
    for step in range(STEPS):
        kjt = batch(step)
        out = ebc(kjt).values()
        outs.append(out.detach().cpu())
        if ahead and step + 1 < STEPS:
            ebc.prefetch(batch(step + 1))
        (out * upstream(step, rank, tuple(out.shape)).to(out.device)).sum().backward()
    return outs


def most_used(world: int, window: int = 2, n: int = 2) -> dict[str, list[int]]:
    """The ``n`` most used keys of each table over every rank's first ``window`` batches, ties to the
    smaller key, counted here with a dict (what ``HotRows(per_table=n, window=window)`` must choose)."""
    table_of = {"a": "t0", "b": "t0", "c": "t1", "d": "t2"}
    counts = {t: {} for t in HOT}
    for step in range(window):
        for r in range(world):
            kjt, b = local_batch(step, r)
            ids = torch.split(kjt.values(), kjt.lengths().view(len(FEATURES), b).sum(1).tolist())
            for f, part in zip(FEATURES, ids):
                for k in part.tolist():
                    counts[table_of[f]][k] = counts[table_of[f]].get(k, 0) + 1
    return {t: sorted(c, key=lambda k: (-c[k], k))[:n] for t, c in counts.items()}


def copies(ebc, hot: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """This rank's own tier's whole rows of the ``hot`` keys (its copies; zeros where it has none)."""
    return {t: ebc.read_full_rows(t, torch.tensor(k, device=ebc.device)).cpu() for t, k in hot.items()}


def _worker(rank: int, world: int, port: int, tmp: str, optimizers: list[str], variants: list[str],
            dtype: torch.dtype, device: str) -> None:
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    result = {}
    try:
        for optimizer in optimizers:
            for variant in variants:
                ebc = build(optimizer, variant, os.path.join(tmp, f"{optimizer}-{variant}"), dist.group.WORLD,
                            dtype, device)
                outs = train(ebc, rank, ahead=variant.endswith("prefetch"))
                ebc.flush()
                rows = {t: ebc.export(t) for t in ("t0", "t1", "t2")}
                hot = HOT if variant.startswith("keys") else most_used(world)
                result[(optimizer, variant)] = {
                    "outs": outs, "copies": copies(ebc, hot),
                    "replicated": {t: s.replicated for t, s in ebc.stats().items()},
                    "lookups": {t: s.lookups for t, s in ebc.stats().items()},
                    "rows": {t: (r.keys.cpu(), torch.cat([r.weights, r.optimizer_state], 1).cpu())
                             for t, r in rows.items()}}
                ebc.close()
        torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, tmp, optimizers, variants, dtype=torch.float32, device="cpu") -> list[dict]:
    spawn_ranks(_worker, args=(world, _free_port(), str(tmp), optimizers, variants, dtype, device),
                nprocs=world)
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


def reference(optimizer: str, world: int, dtype=torch.float32):
    """One process on the concatenated batches: (outputs per step, split per rank; the collection)."""
    ref = build(optimizer, "plain", None, dtype=dtype)
    outs = []
    for step in range(STEPS):
        local = [local_batch(step, r) for r in range(world)]
        out = ref(concat([k for k, _ in local])).values()
        parts = torch.split(out, [b for _, b in local])
        outs.append([p.detach().clone() for p in parts])
        sum((p * upstream(step, r, tuple(p.shape))).sum() for r, p in enumerate(parts)).backward()
    return outs, ref


def rows_of(shards: list) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.cat([k for k, _ in shards])
    rows = torch.cat([r for _, r in shards])
    order = torch.argsort(keys)
    return keys[order], rows[order]


def check_run(results: list[dict], optimizer: str, variant: str, ref_outs, ref, world: int,
              tol: dict) -> None:
    msg = f"world={world} {optimizer} {variant}"
    got = [results[r][(optimizer, variant)] for r in range(world)]
    for step in range(STEPS):
        for r in range(world):
            torch.testing.assert_close(got[r]["outs"][step], ref_outs[step][r], **tol,
                                       msg=f"{msg} step {step} rank {r}")
    for t in ("t0", "t1", "t2"):
        keys, rows = rows_of([g["rows"][t] for g in got])
        want = ref.export(t)
        want_keys, want_rows = rows_of([(want.keys, torch.cat([want.weights, want.optimizer_state], 1))])
        assert torch.equal(keys, want_keys), f"{msg} {t}: each row exported once, by its owner"
        # each id counted once, by the rank that served it (a hot row's: the rank that asked)
        assert sum(g["lookups"][t] for g in got) == ref.stats()[t].lookups, f"{msg} {t}: lookups"
        torch.testing.assert_close(rows.float(), want_rows.float(), **tol, msg=f"{msg} {t}")
    if variant != "plain":
        for t in HOT:  # every rank's copy of every hot row the same, bit for bit
            if variant.startswith("chosen"):  # every rank holds a copy of each chosen row
                assert bool((got[0]["copies"][t] != 0).any(1).all()), f"{msg} {t}: a chosen row missing"
            for r in range(1, world):
                assert torch.equal(got[r]["copies"][t], got[0]["copies"][t]), f"{msg} {t}: rank {r} diverged"
        if variant.startswith("keys"):
            assert got[0]["replicated"] == {t: len(set(k)) for t, k in HOT.items()}
            # the copies are the owners' rows (each hot key used is stored on every rank)
            keys, rows = rows_of([g["rows"]["t0"] for g in got])
            for j, k in enumerate(HOT["t0"]):
                if k in keys.tolist():
                    assert torch.equal(got[0]["copies"]["t0"][j], rows[keys.tolist().index(k)]), msg
        else:
            assert got[0]["replicated"] == {"t0": 2, "t1": 2, "t2": 2}, msg


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_replicated_training_equals_unreplicated_and_one_process(world, tmp_path):
    results = run_ranks(world, tmp_path, list(OPTIMIZERS), list(VARIANTS))
    for optimizer in OPTIMIZERS:
        ref_outs, ref = reference(optimizer, world)
        for variant in VARIANTS:
            check_run(results, optimizer, variant, ref_outs, ref, world, dict(rtol=1e-5, atol=1e-6))
        for variant in VARIANTS[1:]:  # and to the unreplicated run
            for r in range(world):
                plain = results[r][(optimizer, "plain")]["outs"]
                for a, b in zip(results[r][(optimizer, variant)]["outs"], plain):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bf16_rows_stay_identical_on_every_rank(tmp_path):
    """16-bit rows, rounded stochastically: the copies agree bit for bit and the run stays within
    bfloat16's rounding of one process's."""
    results = run_ranks(2, tmp_path, ["adam", "sgd"], ["keys", "chosen"], torch.bfloat16)
    for optimizer in ("adam", "sgd"):
        ref_outs, ref = reference(optimizer, 2, torch.bfloat16)
        for variant in ("keys", "chosen"):
            check_run(results, optimizer, variant, ref_outs, ref, 2, dict(rtol=2e-2, atol=2e-3))


@pytest.mark.parametrize("world", [w for w in (2, 4) if torch.cuda.device_count() >= w] or
                         [pytest.param(2, marks=pytest.mark.skip(reason="needs 2 CUDA devices (NCCL)"))])
def test_replicated_on_nccl_gpus_equals_one_process(world, tmp_path):
    """The same on NCCL, each rank on its GPU, against one process on the CPU (the GPU sums floats
    in another order: a looser tolerance); the hot copies still agree bit for bit."""
    results = run_ranks(world, tmp_path, list(OPTIMIZERS), list(VARIANTS), device="cuda")
    for optimizer in OPTIMIZERS:
        ref_outs, ref = reference(optimizer, world)
        for variant in VARIANTS:
            check_run(results, optimizer, variant, ref_outs, ref, world, dict(rtol=1e-4, atol=1e-5))
