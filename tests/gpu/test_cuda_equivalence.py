"""On CUDA, every kernel set computes what the CPU torch reference computes (DESIGN section 2).

A collection on CUDA (kernels "torch" and "triton") and the same collection on CPU with kernels
"torch" (same seed, so the same initial rows) train side by side on 20 random batches: duplicate ids,
empty bags and an all-empty batch, sum and mean pooling, per-id weights, tables of different dims, one
table shared by two features, raw int64 ids and a bounded-id table, prefetch on some steps. Every
step's outputs and, at the end, every stored key, row, optimizer state and score must agree; so must
an eval forward afterwards. The module is skipped where there is no GPU (run it through
tools/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

import tieredemb as te
from tests.conftest import (
    OPTIMIZERS,
    RAW_KEYS,
    Batch,
    make_optimizer,
    output_tensors,
    random_batch,
    random_upstream,
    sorted_export,
)
from tieredemb.storage.tiers.device import DeviceTier

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run through tools/gpu_check.sh)", allow_module_level=True)

pytestmark = pytest.mark.gpu

STEPS = 20
RTOL, ATOL = 1e-5, 1e-6
KERNELS = ["torch", "triton"]
SEED = 7  # the collections' seed: initial rows


def make_tables() -> list[te.TableConfig]:
    return [
        te.TableConfig(name="user", embedding_dim=8, feature_names=["user_id"], pooling="sum"),
        te.TableConfig(name="item", embedding_dim=16, feature_names=["item_id", "item_hist"],
                       pooling="mean"),
        te.TableConfig(name="hour", embedding_dim=4, feature_names=["hour"], num_embeddings=24),
    ]


# the key pools the features draw from: small pools give duplicates within and across bags
POOLS = {
    "user_id": RAW_KEYS + list(range(6)),
    "item_id": [11, 12, 13, -5, 2**50, 17],
    "item_hist": [12, 13, 14, -5, 99],  # overlaps item_id's pool: the shared table sees both
    "hour": list(range(24)),
}


def _to(x, device: torch.device):
    if isinstance(x, dict):
        return {k: v.to(device) for k, v in x.items()}
    return x.to(device)


def _loss(out, upstream) -> torch.Tensor:
    """sum(out * upstream): its gradient w.r.t. the output is exactly ``upstream``."""
    if isinstance(out, dict):
        return sum((out[f].values() * upstream[f]).sum() for f in out)
    return (out.values() * upstream).sum()


def _assert_outputs_close(got, want, msg: str) -> None:
    got_t = {f: t.detach().cpu() for f, t in output_tensors(got).items()}
    want_t = output_tensors(want)
    assert list(got_t) == list(want_t), msg
    for f in want_t:
        torch.testing.assert_close(got_t[f], want_t[f].detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, f=f: f"{msg} [{f}]: {m}")


def _assert_tables_equal(got, want, tables: list[te.TableConfig], msg: str) -> None:
    for t in tables:
        keys, w, s, scores = (x.cpu() for x in sorted_export(got, t.name))
        want_keys, want_w, want_s, want_scores = sorted_export(want, t.name)
        assert torch.equal(keys, want_keys), f"{msg} table {t.name!r}: stored keys differ"
        torch.testing.assert_close(w, want_w, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=t.name: f"{msg} table {n!r} weights: {m}")
        torch.testing.assert_close(s, want_s, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=t.name: f"{msg} table {n!r} state: {m}")
        assert torch.equal(scores, want_scores), f"{msg} table {t.name!r}: scores differ"
        read_w, found = got.read(t.name, want_keys.to(got.device))
        assert bool(found.all()), f"{msg} table {t.name!r}: read() misses stored keys"
        torch.testing.assert_close(read_w.detach().cpu(), want_w, rtol=RTOL, atol=ATOL)


def _batch(gen: torch.Generator, step: int) -> Batch:
    if step == 7:  # every bag of every feature empty
        return random_batch(gen, POOLS, batch_size=3, max_bag=0)
    return random_batch(gen, POOLS, batch_size=1 + step % 5, max_bag=4, weighted=step % 2 == 1)


def train_side_by_side(module: type, optimizer: str, kernels: str, device: torch.device,
                       tables: list[te.TableConfig] | None = None, steps: int = STEPS,
                       batches=_batch, **kwargs) -> tuple[object, object]:
    """Train ``module`` on ``device`` with ``kernels`` and on CPU with kernels="torch"; compare.
    ``kwargs``: more arguments of both collections. Returns both collections (device one first)."""
    tables = make_tables() if tables is None else tables
    pooled = module is te.EmbeddingBagCollection
    want = module(tables, optimizer=make_optimizer(optimizer), device="cpu", kernels="torch",
                  seed=SEED, **kwargs)
    got = module(tables, optimizer=make_optimizer(optimizer), device=device, kernels=kernels,
                 seed=SEED, **kwargs)
    assert kernels in getattr(got.kernels, "name", type(got.kernels).__name__).lower(), (
        f"kernels={kernels!r} gave {got.kernels!r}")
    gen = torch.Generator().manual_seed(1000 + OPTIMIZERS.index(optimizer))
    for step in range(steps):
        batch = batches(gen, step)
        upstream = random_upstream(gen, batch, tables, pooled)
        kjt = batch.kjt()
        kjt_dev = kjt.to(device)
        if step % 3 == 0:
            want.prefetch(kjt)
            got.prefetch(kjt_dev)
        out_want, out_got = want(kjt), got(kjt_dev)
        msg = f"{module.__name__} {optimizer} kernels={kernels} step {step}"
        _assert_outputs_close(out_got, out_want, msg)
        _loss(out_want, upstream).backward()
        _loss(out_got, _to(upstream, device)).backward()
    _assert_tables_equal(got, want, tables, f"{module.__name__} {optimizer} kernels={kernels}")
    want.eval()
    got.eval()
    batch = batches(gen, steps)  # keys stored and not: eval reads zeros for the latter
    with torch.no_grad():
        _assert_outputs_close(got(batch.kjt().to(device)), want(batch.kjt()), "eval forward")
    return got, want


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("kernels", KERNELS)
def test_embedding_bag_collection_matches_cpu(kernels: str, optimizer: str) -> None:
    train_side_by_side(te.EmbeddingBagCollection, optimizer, kernels, torch.device("cuda"))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("kernels", KERNELS)
def test_embedding_collection_matches_cpu(kernels: str, optimizer: str) -> None:
    train_side_by_side(te.EmbeddingCollection, optimizer, kernels, torch.device("cuda"))


@pytest.mark.parametrize("kernels", KERNELS)
def test_bounded_table_evicts_like_cpu(kernels: str) -> None:
    """A table of 64 rows (two buckets) over a pool of 200 keys: evictions every step, and the
    index must pick the same victims on CUDA as on CPU."""
    tables = [te.TableConfig(name="capped", embedding_dim=8, feature_names=["x"], max_capacity=64,
                             eviction="lfu"),
              te.TableConfig(name="user", embedding_dim=4, feature_names=["user_id"])]
    pools = {"x": list(range(1000, 1200)), "user_id": RAW_KEYS}

    def batches(gen: torch.Generator, step: int) -> Batch:
        return random_batch(gen, pools, batch_size=8, max_bag=6, weighted=step % 2 == 0)

    got, _ = train_side_by_side(te.EmbeddingBagCollection, "adagrad", kernels,
                                torch.device("cuda"), tables=tables, batches=batches)
    assert got.stats()["capped"].evictions > 0, "the bounded table never evicted: test too easy"
    # its insertions took rows from pools (DeviceTier._inserted): every row no table holds is back
    got.flush()
    capped = next(g for g in got.tiers if "capped" in g.names)
    assert capped.store.rows_in_use() == capped.index.size()


@pytest.mark.parametrize("kernels", KERNELS)
def test_full_buckets_of_unbounded_tables_like_cpu(kernels: str, monkeypatch) -> None:
    """One-slot buckets: unbounded tables inserting on the device find buckets full below load 0.5
    most steps; the pairs keep the rows their batch trained (``DeviceTier.place_overflow``, whose
    counts come back through pinned memory and an event on CUDA), and the rows, states and scores
    equal the CPU's."""
    full = []
    place = DeviceTier.place_overflow

    def counting(group):
        if group.device.type == "cuda":
            regions = len(group.configs)
            for batch in group._overflow:
                batch.ready.synchronize()
                full.append(sum(batch.counts.tolist()[regions : 2 * regions]))
        place(group)

    monkeypatch.setattr(DeviceTier, "place_overflow", counting)
    tables = [te.TableConfig(name="u", embedding_dim=8, feature_names=["x"]),
              te.TableConfig(name="v", embedding_dim=8, feature_names=["user_id"], pooling="mean")]
    pools = {"x": list(range(1000, 1400)), "user_id": RAW_KEYS + list(range(60))}

    def batches(gen: torch.Generator, step: int) -> Batch:
        return random_batch(gen, pools, batch_size=16, max_bag=6, weighted=step % 2 == 0)

    train_side_by_side(te.EmbeddingBagCollection, "adam", kernels, torch.device("cuda"), tables=tables,
                       batches=batches, storage=te.StorageConfig(bucket_width=1, segment_rows=64))
    assert sum(full) > 0, "no bucket was ever full: test too easy"
