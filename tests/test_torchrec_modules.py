"""``tieredemb.torchrec`` against TorchRec itself: its collections and its models are the oracle.

TorchRec's unsharded ``EmbeddingBagCollection``/``EmbeddingCollection`` keep one ``nn.EmbeddingBag``
/ ``nn.Embedding`` per table, whose ``weight`` gets a dense gradient (``sparse=False``). With the same
rows written into ours, the matching torch optimizers over those weights are our fused ones:
``torch.optim.SGD`` and ``torch.optim.Adagrad`` on the dense gradient (untouched rows get a zero
gradient, which moves neither), and ``torch.optim.SparseAdam`` (lazy Adam) with the modules switched
to ``sparse=True``, as dense Adam would move untouched rows by their momentum.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import tieredemb as te

torchrec = pytest.importorskip("torchrec")
tt = pytest.importorskip("tieredemb.torchrec")

from torchrec import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType  # noqa: E402
from torchrec.models.deepfm import SimpleDeepFMNN  # noqa: E402
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRM_Projection  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6

# name -> (ours, torch's over a list of weights, whether torch's needs sparse gradients)
OPTIMIZERS = {
    "sgd": (lambda: te.optim.SGD(lr=0.1), lambda ws: torch.optim.SGD(ws, lr=0.1), False),
    "adagrad": (lambda: te.optim.Adagrad(lr=0.1), lambda ws: torch.optim.Adagrad(ws, lr=0.1), False),
    "adam": (lambda: te.optim.Adam(lr=0.05), lambda ws: torch.optim.SparseAdam(ws, lr=0.05), True),
}


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def their_tables(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """TorchRec's per-table modules (``nn.EmbeddingBag`` or ``nn.Embedding``) by table name."""
    inner = module.embedding_bags if hasattr(module, "embedding_bags") else module.embeddings
    return dict(inner.items())


def copy_rows(theirs: torch.nn.Module, ours: torch.nn.Module) -> None:
    """TorchRec's initial rows written into ours, every row of every table."""
    for name, table in their_tables(theirs).items():
        w = table.weight.detach()
        ours.write(name, torch.arange(w.shape[0]), w.clone())


def assert_rows_equal(theirs: torch.nn.Module, ours: torch.nn.Module, what: str) -> None:
    for name, table in their_tables(theirs).items():
        want = table.weight.detach()
        got, found = ours.read(name, torch.arange(want.shape[0]))
        assert bool(found.all()), f"{what}: table {name!r} lost rows"
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=f"{what}: table {name!r} rows")


def random_kjt(gen: torch.Generator, ids_below: dict[str, int], batch_size: int = 4,
               weighted: bool = False) -> torchrec.KeyedJaggedTensor:
    """A TorchRec batch: per feature, B bags of 0-3 ids in [0, ids_below[feature])."""
    keys = list(ids_below)
    lengths = torch.randint(0, 4, (len(keys) * batch_size,), generator=gen)
    per_feature = lengths.view(len(keys), batch_size).sum(dim=1).tolist()
    values = torch.cat([torch.randint(0, ids_below[k], (n,), generator=gen)
                        for k, n in zip(keys, per_feature)])
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return torchrec.KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights)


def upstream_for(gen: torch.Generator, out: object) -> object:
    """A random upstream gradient of the output's shape (a KeyedTensor or a dict of JaggedTensors)."""
    if isinstance(out, torchrec.KeyedTensor):
        return torch.randn(out.values().shape, generator=gen)
    return {k: torch.randn(jt.values().shape, generator=gen) for k, jt in out.items()}


def loss_of(out: object, upstream: object) -> torch.Tensor:
    if isinstance(out, torchrec.KeyedTensor):
        return (out.values() * upstream).sum()
    return sum((jt.values() * upstream[k]).sum() for k, jt in out.items())


def assert_outputs_equal(want: object, got: object, what: str) -> None:
    if isinstance(want, torchrec.KeyedTensor):
        assert isinstance(got, torchrec.KeyedTensor), f"{what}: {type(got)} is not a torchrec.KeyedTensor"
        assert got.keys() == want.keys(), f"{what}: keys {got.keys()} != TorchRec's {want.keys()}"
        assert got.length_per_key() == want.length_per_key()
        torch.testing.assert_close(got.values(), want.values(), rtol=RTOL, atol=ATOL, msg=what)
        return
    assert list(got) == list(want), f"{what}: names {list(got)} != TorchRec's {list(want)}"
    for k in want:
        assert isinstance(got[k], torchrec.JaggedTensor)
        torch.testing.assert_close(got[k].values(), want[k].values(), rtol=RTOL, atol=ATOL, msg=f"{what} {k}")
        assert torch.equal(got[k].lengths(), want[k].lengths()), f"{what} {k}: lengths"
        wi, gi = want[k].weights_or_none(), got[k].weights_or_none()
        assert (wi is None) == (gi is None) and (wi is None or torch.equal(gi, wi)), f"{what} {k}: indices"


def train_side_by_side(theirs, ours, optimizer: str, batches, steps: int = 4) -> None:
    """Both collections fed the same batches and upstream gradients; outputs compared each step,
    rows at the end. TorchRec's tables stepped by the torch optimizer matching ours."""
    _, make_torch, sparse = OPTIMIZERS[optimizer]
    for table in their_tables(theirs).values():
        table.sparse = sparse
    opt = make_torch([t.weight for t in their_tables(theirs).values()])
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        kjt = batches(step)
        want, got = theirs(kjt), ours(kjt)
        assert_outputs_equal(want, got, f"step {step + 1}")
        upstream = upstream_for(gen, want)
        opt.zero_grad()
        loss_of(want, upstream).backward()
        loss_of(got, upstream).backward()
        opt.step()
    assert_rows_equal(theirs, ours, f"after {steps} {optimizer} steps")


# --------------------------------------------------------------------------------------------------
# EmbeddingBagCollection
# --------------------------------------------------------------------------------------------------

# name -> (table configs, is_weighted, the batch's features and id bounds, batch weighted)
EBC_CASES = {
    "sum": ([("t1", 4, 12, ["f1", "f2"], PoolingType.SUM), ("t2", 3, 9, ["f3"], PoolingType.SUM)],
            False, {"f1": 12, "f2": 12, "f3": 9}, False),
    "mean": ([("t1", 4, 12, ["f1", "f2"], PoolingType.MEAN), ("t2", 3, 9, ["f3"], PoolingType.SUM)],
             False, {"f3": 9, "f1": 12, "f2": 12}, False),
    "weighted": ([("t1", 4, 12, ["f1"], PoolingType.SUM), ("t2", 3, 9, ["f2"], PoolingType.SUM)],
                 True, {"f1": 12, "f2": 9}, True),
    "weights_ignored": ([("t1", 4, 12, ["f1"], PoolingType.SUM)], False, {"f1": 12}, True),
    "shared": ([("t1", 4, 12, ["f1", "f2"], PoolingType.SUM), ("t2", 3, 9, ["f2", "f3"], PoolingType.MEAN)],
               False, {"f1": 12, "f2": 9, "f3": 9}, False),
    "unread": ([("t1", 4, 12, ["f1"], PoolingType.SUM), ("t2", 3, 9, ["f3"], PoolingType.SUM)],
               False, {"junk": 10**6, "f3": 9, "f1": 12, "more": 5}, False),
}


def bag_configs(spec) -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=rows, feature_names=list(f),
                               pooling=p) for n, d, rows, f, p in spec]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("case", list(EBC_CASES))
def test_ebc_trains_like_torchrecs(case: str, optimizer: str) -> None:
    spec, weighted, features, batch_weighted = EBC_CASES[case]
    configs = bag_configs(spec)
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingBagCollection(configs, is_weighted=weighted)
    ours = tt.EmbeddingBagCollection(configs, optimizer=OPTIMIZERS[optimizer][0](), is_weighted=weighted)
    copy_rows(theirs, ours)
    gen = torch.Generator().manual_seed(2)
    batches = [random_kjt(gen, features, weighted=batch_weighted) for _ in range(4)]
    train_side_by_side(theirs, ours, optimizer, lambda i: batches[i])


def test_torchrecs_ebc_gives_dense_gradients() -> None:
    """Why SGD/Adagrad are compared dense and Adam through SparseAdam (module docstring)."""
    theirs = torchrec.EmbeddingBagCollection(bag_configs(EBC_CASES["sum"][0]))
    kjt = random_kjt(torch.Generator().manual_seed(0), {"f1": 12, "f2": 12, "f3": 9})
    theirs(kjt).values().sum().backward()
    assert not theirs.embedding_bags["t1"].weight.grad.is_sparse


def test_ebc_interface_and_names() -> None:
    configs = bag_configs(EBC_CASES["shared"][0])
    ours = tt.EmbeddingBagCollection(configs, optimizer=te.optim.SGD(lr=0.1))
    theirs = torchrec.EmbeddingBagCollection(configs)
    assert ours.embedding_bag_configs() is configs
    assert ours.is_weighted() is False and theirs.is_weighted() is False
    assert ours.device == theirs.device == torch.device("cpu")
    kjt = random_kjt(torch.Generator().manual_seed(0), {"f1": 12, "f2": 9, "f3": 9})
    assert ours(kjt).keys() == theirs(kjt).keys() == ["f1", "f2@t1", "f2@t2", "f3"]
    assert not list(ours.parameters())  # the tables are updated in backward, not by a dense optimizer


def test_ebc_takes_our_kjt_and_prefetch() -> None:
    """A te.KeyedJaggedTensor works like TorchRec's; a prefetched batch with unread features is the
    one its forward takes, and a withdrawn one leaves nothing in flight."""
    configs = bag_configs(EBC_CASES["unread"][0])
    theirs = torchrec.EmbeddingBagCollection(configs)
    ours = tt.EmbeddingBagCollection(configs, optimizer=te.optim.SGD(lr=0.1))
    copy_rows(theirs, ours)
    gen = torch.Generator().manual_seed(3)
    kjt = random_kjt(gen, {"junk": 10**6, "f3": 9, "f1": 12})
    mine = te.KeyedJaggedTensor(kjt.keys(), kjt.values(), lengths=kjt.lengths())
    assert_outputs_equal(theirs(kjt), ours(mine), "te.KeyedJaggedTensor")
    ours.prefetch(kjt)
    assert ours.is_prefetched(kjt)
    assert_outputs_equal(theirs(kjt), ours(kjt), "prefetched")
    assert not ours.is_prefetched(kjt)
    ours.prefetch(kjt)
    ours.withdraw(kjt)
    assert not ours.is_prefetched(kjt)
    assert_outputs_equal(theirs(kjt), ours(kjt), "after a withdraw")


def test_our_own_collection_still_refuses_unread_features() -> None:
    ours = te.EmbeddingBagCollection([te.TableConfig("t1", 4, ["f1"])], optimizer=te.optim.SGD(lr=0.1))
    kjt = te.KeyedJaggedTensor(["f1", "junk"], torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="unknown features"):
        ours(kjt)


@pytest.mark.parametrize("module", ["ebc", "ec"])
def test_a_table_without_features_reads_its_own_name(module: str) -> None:
    make = (lambda: [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10)]) if module == "ebc" \
        else (lambda: [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10)])
    theirs_cls, ours_cls = ((torchrec.EmbeddingBagCollection, tt.EmbeddingBagCollection) if module == "ebc"
                            else (torchrec.EmbeddingCollection, tt.EmbeddingCollection))
    their_configs, our_configs = make(), make()
    theirs = theirs_cls(their_configs)
    ours = ours_cls(our_configs, optimizer=te.optim.SGD(lr=0.1))
    assert our_configs[0].feature_names == their_configs[0].feature_names == ["t"]
    copy_rows(theirs, ours)
    kjt = torchrec.KeyedJaggedTensor(keys=["t"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    assert_outputs_equal(theirs(kjt), ours(kjt), "a table without features")
    bad = make()
    with pytest.raises(ValueError, match="duplicate table name"):
        ours_cls([*bad, *bad], optimizer=te.optim.SGD(lr=0.1))
    assert bad[0].feature_names == []  # a refused config is left as it was


def test_ebc_initial_rows_follow_weight_init_bounds() -> None:
    """Rows never written are drawn uniformly from [weight_init_min, weight_init_max)."""
    configs = [EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=1000, feature_names=["f"],
                                  weight_init_min=0.5, weight_init_max=0.75)]
    ours = tt.EmbeddingBagCollection(configs, optimizer=te.optim.SGD(lr=0.1))
    kjt = torchrec.KeyedJaggedTensor(keys=["f"], values=torch.arange(1000),
                                     lengths=torch.ones(1000, dtype=torch.long))
    rows = ours(kjt).values().detach()
    assert rows.min() >= 0.5 and rows.max() < 0.75 and rows.std() > 0.05


# --------------------------------------------------------------------------------------------------
# EmbeddingCollection
# --------------------------------------------------------------------------------------------------

EC_CASES = {
    "plain": ([("t1", 12, ["f1", "f2"]), ("t2", 9, ["f3"])], {"f1": 12, "f2": 12, "f3": 9}, False),
    "shared": ([("t1", 12, ["f1", "f2"]), ("t2", 9, ["f2"])], {"f2": 9, "f1": 12}, False),
    "unread": ([("t1", 12, ["f1"])], {"junk": 10**6, "f1": 12}, False),
    "need_indices": ([("t1", 12, ["f1"]), ("t2", 9, ["f2"])], {"f1": 12, "f2": 9}, True),
}


def seq_configs(spec, dim: int = 4) -> list[EmbeddingConfig]:
    return [EmbeddingConfig(name=n, embedding_dim=dim, num_embeddings=rows, feature_names=list(f))
            for n, rows, f in spec]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("case", list(EC_CASES))
def test_ec_trains_like_torchrecs(case: str, optimizer: str) -> None:
    spec, features, need_indices = EC_CASES[case]
    configs = seq_configs(spec)
    torch.manual_seed(0)
    theirs = torchrec.EmbeddingCollection(configs, need_indices=need_indices)
    ours = tt.EmbeddingCollection(configs, optimizer=OPTIMIZERS[optimizer][0](), need_indices=need_indices)
    copy_rows(theirs, ours)
    gen = torch.Generator().manual_seed(2)
    batches = [random_kjt(gen, features, weighted=True) for _ in range(4)]  # EC ignores weights
    train_side_by_side(theirs, ours, optimizer, lambda i: batches[i])


def test_ec_interface() -> None:
    configs = seq_configs(EC_CASES["shared"][0])
    ours = tt.EmbeddingCollection(configs, optimizer=te.optim.SGD(lr=0.1))
    theirs = torchrec.EmbeddingCollection(configs)
    assert ours.embedding_configs() is configs
    assert ours.embedding_dim() == theirs.embedding_dim() == 4
    assert ours.need_indices() is False
    names = [["f1", "f2@t1"], ["f2@t2"]]
    assert ours.embedding_names_by_table() == theirs.embedding_names_by_table() == names
    assert ours.device == theirs.device


# --------------------------------------------------------------------------------------------------
# TorchRec's models
# --------------------------------------------------------------------------------------------------

D, ROWS, DENSE_IN = 8, 30, 5
MODELS = {
    "dlrm": lambda ebc: DLRM(ebc, DENSE_IN, [16, D], [16, 1]),
    "dlrm_dcn": lambda ebc: DLRM_DCN(ebc, DENSE_IN, [16, D], [16, 1], dcn_num_layers=2, dcn_low_rank_dim=4),
    "dlrm_projection": lambda ebc: DLRM_Projection(ebc, DENSE_IN, [16, D], [16, 1],
                                                   interaction_branch1_layer_sizes=[16, 2 * D],
                                                   interaction_branch2_layer_sizes=[16, 3 * D]),
    "deepfm": lambda ebc: SimpleDeepFMNN(DENSE_IN, ebc, hidden_layer_size=16, deep_fm_dimension=4),
}


def model_pair(name: str, optimizer: str):
    """TorchRec's model over TorchRec's collection, and the same model over ours: the same dense
    parameters (loaded from TorchRec's) and the same rows."""
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=D, num_embeddings=ROWS, feature_names=[f"f{i}"])
               for i in range(3)]
    torch.manual_seed(0)
    their_ebc = torchrec.EmbeddingBagCollection(configs)
    theirs = MODELS[name](their_ebc)
    our_ebc = tt.EmbeddingBagCollection(configs, optimizer=OPTIMIZERS[optimizer][0]())
    torch.manual_seed(1)  # a different dense init, overwritten below
    ours = MODELS[name](our_ebc)
    dense = {k: v for k, v in theirs.state_dict().items() if ".embedding_bags." not in k}
    loaded = ours.load_state_dict(dense, strict=False)
    assert not loaded.unexpected_keys
    their_dense = [(k, p) for k, p in theirs.named_parameters() if ".embedding_bags." not in k]
    assert [k for k, _ in their_dense] == [k for k, _ in ours.named_parameters()]
    for (k, p), q in zip(their_dense, ours.parameters()):
        assert torch.equal(p, q), k
    copy_rows(their_ebc, our_ebc)
    return their_ebc, theirs, our_ebc, ours


def model_batches(steps: int):
    gen = torch.Generator().manual_seed(5)
    return [(torch.rand(4, DENSE_IN, generator=gen), random_kjt(gen, {"f0": ROWS, "f1": ROWS, "f2": ROWS}),
             torch.randint(0, 2, (4, 1), generator=gen).float()) for _ in range(steps)]


def train_models(name: str, optimizer: str, steps: int, trace: bool = False) -> None:
    their_ebc, theirs, our_ebc, ours = model_pair(name, optimizer)
    _, make_torch, sparse = OPTIMIZERS[optimizer]
    for table in their_tables(their_ebc).values():
        table.sparse = sparse
    their_rows = [t.weight for t in their_tables(their_ebc).values()]
    their_dense = [p for n, p in theirs.named_parameters() if ".embedding_bags." not in n]
    opts = [make_torch(their_rows), torch.optim.SGD(their_dense, lr=0.05),
            torch.optim.SGD(ours.parameters(), lr=0.05)]
    if trace:
        ours = torchrec.fx.symbolic_trace(ours)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for step, (dense, kjt, label) in enumerate(model_batches(steps)):
        want, got = loss_fn(theirs(dense, kjt), label), loss_fn(ours(dense, kjt), label)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=f"{name}: loss of step {step + 1}")
        for o in opts:
            o.zero_grad()
        want.backward()
        got.backward()
        for o in opts:
            o.step()
    assert_rows_equal(their_ebc, our_ebc, f"{name} after {steps} steps")


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_dlrm_trains_like_torchrecs(optimizer: str) -> None:
    train_models("dlrm", optimizer, steps=5)


@pytest.mark.parametrize("name", ["dlrm_dcn", "dlrm_projection", "deepfm"])
def test_other_torchrec_models_train_like_torchrecs(name: str) -> None:
    train_models(name, "adagrad", steps=2)


def test_traced_dlrm_trains_like_torchrecs() -> None:
    """``torchrec.fx.symbolic_trace`` keeps our collection as one call (a leaf) and the traced model
    trains like TorchRec's untraced one."""
    _, _, our_ebc, ours = model_pair("dlrm", "sgd")
    graph = torchrec.fx.symbolic_trace(ours).graph
    calls = [n.target for n in graph.nodes if n.op == "call_module"]
    assert "sparse_arch.embedding_bag_collection" in calls
    train_models("dlrm", "adagrad", steps=3, trace=True)


def test_dlrm_in_train_pipeline_trains_like_torchrecs() -> None:
    """``te.TrainPipeline`` prefetches TorchRec batches into our collection inside TorchRec's DLRM
    (the batch goes through as it is, so the prefetch is the one its forward takes)."""
    their_ebc, theirs, our_ebc, ours = model_pair("dlrm", "adagrad")
    loss_fn = torch.nn.BCEWithLogitsLoss()

    class Step(torch.nn.Module):  # what TrainPipeline runs: a batch in, the loss out
        def __init__(self) -> None:
            super().__init__()
            self.model = ours

        def forward(self, batch):
            dense, kjt, label = batch
            return loss_fn(self.model(dense, kjt), label)

    their_dense = [p for n, p in theirs.named_parameters() if ".embedding_bags." not in n]
    their_opts = [torch.optim.Adagrad([t.weight for t in their_tables(their_ebc).values()], lr=0.1),
                  torch.optim.SGD(their_dense, lr=0.05)]
    batches = model_batches(4)
    pipe = te.TrainPipeline(Step(), torch.optim.SGD(ours.parameters(), lr=0.05))
    feed = iter(batches)
    for step, (dense, kjt, label) in enumerate(batches):
        got = pipe.progress(feed)
        want = loss_fn(theirs(dense, kjt), label)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=f"loss of step {step + 1}")
        for o in their_opts:
            o.zero_grad()
        want.backward()
        for o in their_opts:
            o.step()
    assert_rows_equal(their_ebc, our_ebc, "after 4 pipelined steps")


def test_checkpoint_round_trips_a_dlrm_over_ours(tmp_path) -> None:
    _, _, our_ebc, ours = model_pair("dlrm", "adam")
    dense, kjt, label = model_batches(1)[0]
    torch.nn.BCEWithLogitsLoss()(ours(dense, kjt), label).backward()
    te.checkpoint.save(ours, tmp_path)
    fresh_ebc = tt.EmbeddingBagCollection(our_ebc.embedding_bag_configs(), optimizer=te.optim.Adam(lr=0.05))
    fresh = MODELS["dlrm"](fresh_ebc)
    te.checkpoint.load(fresh, tmp_path)
    for name in ("t0", "t1", "t2"):
        want, got = our_ebc.read(name, torch.arange(ROWS)), fresh_ebc.read(name, torch.arange(ROWS))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    dense, kjt, _ = model_batches(2)[1]
    torch.testing.assert_close(fresh(dense, kjt), ours(dense, kjt))


def test_traced_ec_is_a_leaf() -> None:
    ec = tt.EmbeddingCollection(seq_configs(EC_CASES["plain"][0]), optimizer=te.optim.SGD(lr=0.1))

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = ec

        def forward(self, kjt):
            return self.ec(kjt)["f1"].values().sum()

    gm = torch.fx.symbolic_trace(Model())
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["ec"]
    kjt = random_kjt(torch.Generator().manual_seed(0), {"f1": 12, "f2": 12, "f3": 9})
    torch.testing.assert_close(gm(kjt), Model()(kjt))


# --------------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------------


def bag(**fields) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(**{"name": "t", "embedding_dim": 4, "num_embeddings": 10,
                                 "feature_names": ["f"], **fields})


def custom_init(weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight)


BAD_CONFIGS = [  # (configs, keyword arguments, error, what the message names)
    ([bag(pooling=PoolingType.NONE)], {}, ValueError, "pooling=PoolingType.NONE"),
    ([bag(data_type=DataType.INT8)], {}, ValueError, "data_type=DataType.INT8"),
    ([bag(init_fn=custom_init)], {}, ValueError, "init_fn"),
    ([bag(need_pos=True)], {}, ValueError, "need_pos"),
    ([bag(num_embeddings_post_pruning=5)], {}, ValueError, "num_embeddings_post_pruning"),
    ([bag(use_virtual_table=True)], {}, ValueError, "use_virtual_table"),
    ([bag(enable_embedding_update=True)], {}, ValueError, "enable_embedding_update"),
    ([bag(stash_weights=True)], {}, ValueError, "stash_weights"),
    ([bag(input_dim=3)], {}, ValueError, "input_dim"),
    ([bag(total_num_buckets=2)], {}, ValueError, "total_num_buckets"),
    ([bag(pooling=PoolingType.MEAN)], {"is_weighted": True}, ValueError,
     "is_weighted=True with PoolingType.MEAN"),
    ([bag(), bag()], {}, ValueError, "duplicate table name"),
    ([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])], {}, TypeError,
     "EmbeddingBagConfig"),
    ([te.TableConfig("t", 4, ["f"])], {}, TypeError, "EmbeddingBagConfig"),
    (bag(), {}, TypeError, "list of torchrec EmbeddingBagConfig"),
    ([bag()], {"device": "meta"}, ValueError, "meta"),
    ([bag()], {"initializers": {"nope": te.init.Constant(0.0)}}, ValueError, "nope"),
]


@pytest.mark.parametrize("configs, kwargs, error, match", BAD_CONFIGS,
                         ids=[m.split("=")[0].split("|")[0] for *_, m in BAD_CONFIGS])
def test_bad_configs_are_refused(configs, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        tt.EmbeddingBagCollection(configs, optimizer=te.optim.SGD(lr=0.1), **kwargs)


def test_is_weighted_must_be_given_by_keyword() -> None:
    with pytest.raises(TypeError, match="is_weighted"):
        tt.EmbeddingBagCollection([bag()], True, optimizer=te.optim.SGD(lr=0.1))


def test_optimizer_is_required() -> None:
    with pytest.raises(TypeError, match="optimizer"):
        tt.EmbeddingBagCollection([bag()])


def test_custom_init_fn_replaced_by_an_initializer_is_accepted() -> None:
    ours = tt.EmbeddingBagCollection([bag(init_fn=custom_init)], optimizer=te.optim.SGD(lr=0.1),
                                     initializers={"t": te.init.Constant(0.25)})
    kjt = torchrec.KeyedJaggedTensor(keys=["f"], values=torch.tensor([3]), lengths=torch.tensor([1]))
    assert torch.equal(ours(kjt).values().detach(), torch.full((1, 4), 0.25))


def test_ec_refusals() -> None:
    mixed = [EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"]),
             EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=10, feature_names=["g"])]
    with pytest.raises(ValueError, match="one embedding_dim"):
        tt.EmbeddingCollection(mixed, optimizer=te.optim.SGD(lr=0.1))
    with pytest.raises(TypeError, match="EmbeddingConfig"):
        tt.EmbeddingCollection([bag()], optimizer=te.optim.SGD(lr=0.1))
    bad = dataclasses.replace(mixed[0], data_type=DataType.INT4)
    with pytest.raises(ValueError, match="data_type=DataType.INT4 is not supported"):
        tt.EmbeddingCollection([bad], optimizer=te.optim.SGD(lr=0.1))


@pytest.mark.parametrize("batch, error, match", [
    (dict(keys=["g"], values=torch.tensor([1]), lengths=torch.tensor([1])), ValueError, "missing features"),
    (dict(keys=["f"], values=torch.tensor([1]), lengths=torch.tensor([1])), ValueError, "has no weights"),
    (dict(keys=["f", "f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]),
          weights=torch.ones(2)), ValueError, "duplicate"),
    (dict(keys=["f", "x"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 2]),
          weights=torch.ones(2)), ValueError, "lengths sum to 3"),
    (dict(keys=["f"], values=torch.tensor([10]), lengths=torch.tensor([1]), weights=torch.ones(1)),
     ValueError, "out of range"),
], ids=["missing", "unweighted", "duplicate", "bad_lengths", "out_of_range"])
def test_bad_batches_are_refused_and_change_nothing(batch, error, match) -> None:
    ours = tt.EmbeddingBagCollection([bag()], optimizer=te.optim.SGD(lr=0.1), is_weighted=True)
    before, _ = ours.read("t", torch.arange(10))
    with pytest.raises(error, match=match):
        ours(torchrec.KeyedJaggedTensor(**batch))
    after, found = ours.read("t", torch.arange(10))
    assert not bool(found.any()) and torch.equal(before, after)
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        ours({"f": torch.tensor([1])})
    good = torchrec.KeyedJaggedTensor(keys=["f"], values=torch.tensor([1]), lengths=torch.tensor([1]),
                                      weights=torch.ones(1))
    ours(good).values().sum().backward()  # the collection still works


# --------------------------------------------------------------------------------------------------
# docs/torchrec.md
# --------------------------------------------------------------------------------------------------


def test_the_docs_example_runs(capsys) -> None:
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "torchrec.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    # the last, DistributedModelParallel's, needs ranks: tests/distributed/test_torchrec_dmp.py
    assert len(blocks) == 3, "docs/torchrec.md examples changed: update this test"
    namespace: dict = {}
    exec(compile(blocks[0], "docs/torchrec.md example", "exec"), namespace)  # noqa: S102
    assert "{'device': 2}" in capsys.readouterr().out
    exec(compile(blocks[1], "docs/torchrec.md schedule and DCP example", "exec"), namespace)  # noqa: S102
    assert capsys.readouterr().out.split() == ["0.025", "{'device':", "2}"]
    got = namespace["fresh"].sparse_arch.embedding_bag_collection.export("t0")
    want = namespace["ebc"].export("t0")
    order_got, order_want = torch.argsort(got.keys), torch.argsort(want.keys)
    assert torch.equal(got.weights[order_got], want.weights[order_want])  # DCP brought the rows


@pytest.mark.parametrize("data_type, dtype", [(DataType.FP16, torch.float16),
                                             (DataType.BF16, torch.bfloat16)])
def test_16_bit_data_types_store_rows_in_that_dtype(data_type, dtype) -> None:
    """TorchRec's FP16/BF16 ``data_type`` is the rows' dtype; the output is float32 and equals
    TorchRec's table with the same 16-bit rows, pooled in float32."""
    config = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"],
                                data_type=data_type)
    ours = tt.EmbeddingBagCollection([config], optimizer=te.optim.SGD(lr=0.1))
    rows = torch.randn(10, 4).to(dtype)
    ours.write("t", torch.arange(10), rows.float())
    stored, found = ours.read("t", torch.arange(10))
    assert stored.dtype == dtype and bool(found.all()) and torch.equal(stored, rows)
    kjt = torchrec.KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2, 7]), lengths=torch.tensor([2, 1]))
    out = ours(kjt).values()
    assert out.dtype == torch.float32
    want = torch.stack([rows[1].float() + rows[2].float(), rows[7].float()])
    torch.testing.assert_close(out.detach(), want)
