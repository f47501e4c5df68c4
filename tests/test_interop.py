"""Interop with TorchRec and FBGEMM.

- A ``torchrec.KeyedJaggedTensor`` is accepted by both collections and trains exactly like ours.
- RowWiseAdagrad equals FBGEMM's CPU table-batched embedding with ``EXACT_ROWWISE_ADAGRAD``.
  FBGEMM's CPU update (fbgemm_gpu/codegen/genscript/optimizers.py, ``rowwise_adagrad``,
  ``split_weight_update_cpu``) is, per touched row with summed gradient g of width D:
  ``s += sum(g*g) / D; w -= lr * g / (sqrt(s) + eps)`` -- the mean of squares, eps outside the sqrt:
  exactly our formula, so rows and state are compared directly. Its eps must be passed (1e-8, ours).
"""

from __future__ import annotations

import pytest
import torch

import tieredemb as te
from tests.conftest import (
    ATOL,
    RAW_KEYS,
    RTOL,
    assert_outputs_close,
    random_batch,
    random_upstream,
    sorted_export,
    weighted_loss,
)

# --------------------------------------------------------------------------------------------------
# torchrec.KeyedJaggedTensor
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, weighted",  # per-id weights only apply to pooled lookups
    [(te.EmbeddingBagCollection, False), (te.EmbeddingBagCollection, True), (te.EmbeddingCollection, False)],
    ids=["ebc", "ebc_weighted", "ec"],
)
def test_torchrec_kjt_trains_like_ours(module, weighted):
    pytest.importorskip("torchrec")
    pooled = module is te.EmbeddingBagCollection
    tables = [
        te.TableConfig("shared", 4, ["a", "b"], pooling="mean" if pooled else "sum"),
        te.TableConfig("small", 3, ["c"], num_embeddings=10),
    ]
    pools = {"a": RAW_KEYS[:5], "b": RAW_KEYS[3:], "c": list(range(10))}
    ours = module(tables, optimizer=te.optim.Adam(lr=0.01), seed=3)
    theirs = module(tables, optimizer=te.optim.Adam(lr=0.01), seed=3)
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        batch = random_batch(gen, pools, batch_size=3, weighted=weighted)
        upstream = random_upstream(gen, batch, tables, pooled)
        out_ours = ours(batch.kjt())
        out_theirs = theirs(batch.torchrec_kjt())
        assert_outputs_close(out_theirs, out_ours, f"step {step + 1}")
        weighted_loss(out_ours, upstream).backward()
        weighted_loss(out_theirs, upstream).backward()
    for t in tables:
        want, got = sorted_export(ours, t.name), sorted_export(theirs, t.name)
        for x, y in zip(got, want):
            assert torch.equal(x, y), f"table {t.name!r} differs after torchrec batches"


def test_torchrec_kjt_with_offsets_only():
    torchrec = pytest.importorskip("torchrec")
    tables = [te.TableConfig("t", 2, ["x", "y"])]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1))
    ebc.write("t", torch.tensor([1, 2, 3]), torch.arange(6.0).view(3, 2))
    kjt = torchrec.KeyedJaggedTensor(
        keys=["x", "y"], values=torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 2, 2, 3, 3])
    )
    out = ebc(kjt)  # x: [[1, 2], []], y: [[3], []]
    want = torch.tensor([[0.0 + 2.0, 1.0 + 3.0, 4.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out.values().detach(), want)


# --------------------------------------------------------------------------------------------------
# FBGEMM row-wise Adagrad
# --------------------------------------------------------------------------------------------------

FBGEMM_TABLES = [("shared", 9, 4, ["f0", "f1"]), ("single", 6, 8, ["f2"])]  # name, rows, dim, features
LR, EPS = 0.05, 1e-8


def fbgemm_tbe(pooling: str):
    tbe_mod = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
    common = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_common")
    configs = pytest.importorskip("fbgemm_gpu.split_embedding_configs")
    specs = [(n, d, common.EmbeddingLocation.HOST, tbe_mod.ComputeDevice.CPU) for _, n, d, _ in FBGEMM_TABLES]
    feature_table_map = [i for i, (_, _, _, fs) in enumerate(FBGEMM_TABLES) for _ in fs]
    mode = {"sum": common.PoolingMode.SUM, "mean": common.PoolingMode.MEAN}[pooling]
    return tbe_mod.SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=specs,
        feature_table_map=feature_table_map,
        optimizer=configs.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=mode,
    )


@pytest.mark.parametrize(
    "pooling, weighted", [("sum", False), ("mean", False), ("sum", True)], ids=["sum", "mean", "weighted_sum"]
)
def test_rowwise_adagrad_matches_fbgemm(pooling, weighted):
    tbe = fbgemm_tbe(pooling)
    tables = [
        te.TableConfig(name, d, fs, num_embeddings=n, pooling=pooling) for name, n, d, fs in FBGEMM_TABLES
    ]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.RowWiseAdagrad(lr=LR, eps=EPS))
    gen = torch.Generator().manual_seed(99)
    for (name, n, d, _), fb_weights in zip(FBGEMM_TABLES, tbe.split_embedding_weights()):
        rows = torch.rand(n, d, generator=gen) - 0.5
        ebc.write(name, torch.arange(n), rows)
        with torch.no_grad():
            fb_weights.copy_(rows)
    pools = {f: list(range(n)) for _, n, _, fs in FBGEMM_TABLES for f in fs}
    for step in range(20):
        batch = random_batch(gen, pools, batch_size=3, max_bag=4, weighted=weighted)
        kjt = batch.kjt()
        psw = kjt.weights_or_none()
        fb_out = tbe(kjt.values(), kjt.offsets(), per_sample_weights=psw)
        upstream = torch.randn(fb_out.shape, generator=gen)
        out = ebc(kjt)
        torch.testing.assert_close(
            out.values().detach(),
            fb_out.detach(),
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, s=step: f"step {s + 1}: {m}",
        )
        (out.values() * upstream).sum().backward()
        (fb_out * upstream).sum().backward()  # FBGEMM's fused update runs in its backward too

    fb_states = tbe.split_optimizer_states()
    for (name, n, _, _), fb_w, fb_s in zip(FBGEMM_TABLES, tbe.split_embedding_weights(), fb_states):
        keys, weights, state, _ = sorted_export(ebc, name)
        assert keys.tolist() == list(range(n))
        torch.testing.assert_close(weights, fb_w.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(state[:, 0], fb_s[0], rtol=1e-5, atol=1e-9)
