"""te.KeyedJaggedTensor, te.JaggedTensor and te.KeyedTensor against TorchRec's own classes.

Each batch is built twice from the same tensors, once as ours and once as ``torchrec``'s, and every
method a TorchRec user or training pipeline calls is compared tensor for tensor (values, dtype and
shape): accessors, per-key figures, ``kjt[key]``, ``to_dict``, ``permute``, ``split``, ``concat``,
the ``*_sync`` constructors, ``to``. Hypothesis draws the batches: one to four features, batch sizes
1 to 4, empty bags, features without ids, weights or none, int32 or int64 lengths, lengths or offsets.
Then: positional arguments after ``values`` are refused, a batch goes to TorchRec's type and back, and
a collection given a permuted, split or moved batch computes what it computes on the original.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tieredemb as te

torchrec = pytest.importorskip("torchrec")
TR = torchrec.sparse.jagged_tensor

HYPOTHESIS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same(got, want, what: str = "") -> None:
    """Equal tensors (dtype and shape included), equal lists, or both None."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: {type(got)} is not a tensor"
        assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{what}: {got} != {want}"
    else:
        assert got == want, f"{what}: {got} != {want}"


def same_jt(got, want, what: str) -> None:
    assert isinstance(got, te.JaggedTensor), f"{what}: {type(got)}"
    same(got.values(), want.values(), f"{what} values")
    same(got.lengths(), want.lengths(), f"{what} lengths")
    same(got.offsets(), want.offsets(), f"{what} offsets")
    same(got.weights_or_none(), want.weights_or_none(), f"{what} weights")


def same_kjt(got, want, what: str) -> None:
    """Everything a step and a pipeline read of a batch."""
    assert isinstance(got, te.KeyedJaggedTensor), f"{what}: {type(got)}"
    same(got.keys(), want.keys(), f"{what} keys")
    same(got.stride(), want.stride(), f"{what} stride")
    same(got.values(), want.values(), f"{what} values")
    same(got.weights_or_none(), want.weights_or_none(), f"{what} weights")
    same(got.lengths(), want.lengths(), f"{what} lengths")
    same(got.length_per_key(), want.length_per_key(), f"{what} length_per_key")
    same(got.offset_per_key(), want.offset_per_key(), f"{what} offset_per_key")
    same(got.offsets(), want.offsets(), f"{what} offsets")


@st.composite
def batches(draw, min_batch: int = 1):
    """keyword arguments for both constructors: keys, values, lengths or offsets, weights."""
    n_keys = draw(st.integers(1, 4))
    b = draw(st.integers(min_batch, 4))
    lengths = []
    for _ in range(n_keys):
        empty_feature = draw(st.booleans()) and draw(st.booleans())  # a quarter: a feature with no ids
        lengths += [0 if empty_feature else draw(st.integers(0, 3)) for _ in range(b)]
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    lengths_t = torch.tensor(lengths, dtype=dtype)
    n = sum(lengths)
    kwargs = {"keys": [f"f{i}" for i in range(n_keys)],
              "values": torch.randint(-(2**40), 2**40, (n,), generator=torch.Generator().manual_seed(n))}
    if draw(st.booleans()):
        kwargs["weights"] = torch.rand(n, generator=torch.Generator().manual_seed(n + 1))
    if draw(st.booleans()):
        kwargs["lengths"] = lengths_t
    else:
        kwargs["offsets"] = torch.cat([lengths_t.new_zeros(1), torch.cumsum(lengths_t, 0, dtype=dtype)])
    return kwargs


def both(kwargs):
    return te.KeyedJaggedTensor(**kwargs), torchrec.KeyedJaggedTensor(**kwargs)


# --------------------------------------------------------------------------------------------------
# KeyedJaggedTensor, method by method
# --------------------------------------------------------------------------------------------------


@HYPOTHESIS
@given(batches())
def test_accessors_and_per_key_figures(kwargs):
    ours, theirs = both(kwargs)
    same(ours.lengths_or_none(), theirs.lengths_or_none(), "lengths_or_none before")
    same(ours.offsets_or_none(), theirs.offsets_or_none(), "offsets_or_none before")
    same(ours.length_per_key_or_none(), theirs.length_per_key_or_none(), "unsynced")
    same_kjt(ours, theirs, "batch")
    same(ours.lengths_or_none(), theirs.lengths_or_none(), "lengths_or_none after")
    same(ours.offsets_or_none(), theirs.offsets_or_none(), "offsets_or_none after")
    for name in ("stride_per_key", "stride_per_key_per_rank", "variable_stride_per_key", "index_per_key",
                 "lengths_offset_per_key", "device", "size_in_bytes", "dist_labels",
                 "inverse_indices_or_none"):
        same(getattr(ours, name)(), getattr(theirs, name)(), name)
    for got, want in zip(ours.dist_tensors(), theirs.dist_tensors()):
        same(got, want, "dist_tensors")
    same(ours.dist_splits([len(ours.keys())]), theirs.dist_splits([len(ours.keys())]), "dist_splits")
    same(ours.unsync().length_per_key_or_none(), theirs.unsync().length_per_key_or_none(), "unsync")
    same(ours.sync().offset_per_key_or_none(), theirs.sync().offset_per_key_or_none(), "sync")
    if "weights" not in kwargs:
        with pytest.raises(ValueError, match="no weights"):
            ours.weights()


@HYPOTHESIS
@given(batches())
def test_getitem_and_to_dict(kwargs):
    ours, theirs = both(kwargs)
    for key in kwargs["keys"]:
        same_jt(ours[key], theirs[key], f"kjt[{key!r}]")
    got, want = ours.to_dict(), theirs.to_dict()
    assert list(got) == list(want)
    for key in want:
        same_jt(got[key], want[key], f"to_dict()[{key!r}]")
    with pytest.raises(KeyError, match="nope"):
        ours["nope"]


@HYPOTHESIS
@given(batches(), st.data())
def test_permute(kwargs, data):
    ours, theirs = both(kwargs)
    n = len(kwargs["keys"])
    indices = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6), "indices")
    same_kjt(ours.permute(indices), theirs.permute(indices), f"permute({indices})")
    with pytest.raises(ValueError, match="index"):
        ours.permute([n])


@HYPOTHESIS
@given(batches(), st.data())
def test_split_and_concat(kwargs, data):
    ours, theirs = both(kwargs)
    n = len(kwargs["keys"])
    cuts = sorted(data.draw(st.lists(st.integers(0, n), max_size=3), "cuts"))
    segments = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    got, want = ours.split(segments), theirs.split(segments)
    assert len(got) == len(want) == len(segments)
    for i, (g, w) in enumerate(zip(got, want)):
        same(g.keys(), w.keys(), f"split {segments}[{i}] keys")
        same(g.stride(), w.stride(), f"split {segments}[{i}] stride")
        same(g.values(), w.values(), f"split {segments}[{i}] values")
        same(g.lengths(), w.lengths(), f"split {segments}[{i}] lengths")
        same(g.weights_or_none(), w.weights_or_none(), f"split {segments}[{i}] weights")
        same(g.length_per_key(), w.length_per_key(), f"split {segments}[{i}] length_per_key")
    with pytest.raises(ValueError, match="segments"):
        ours.split([n + 1])
    pieces = [p for p in got if p.keys()]
    same_kjt(te.KeyedJaggedTensor.concat(pieces), TR.KeyedJaggedTensor.concat([p for p in want if p.keys()]),
             "concat of the split")


@HYPOTHESIS
@given(batches())
def test_sync_constructors_from_jt_dict_and_flatten(kwargs):
    keys, values, weights = kwargs["keys"], kwargs["values"], kwargs.get("weights")
    ours, theirs = both(kwargs)
    lengths, offsets = theirs.lengths(), theirs.offsets()
    got = te.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights)
    same_kjt(got, TR.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths, weights), "from_lengths_sync")
    assert got.length_per_key_or_none() is not None  # read by the constructor
    got = te.KeyedJaggedTensor.from_offsets_sync(keys, values, offsets, weights)
    same_kjt(got, TR.KeyedJaggedTensor.from_offsets_sync(keys, values, offsets, weights), "from_offsets_sync")
    same_kjt(te.KeyedJaggedTensor.from_jt_dict(ours.to_dict()),
             TR.KeyedJaggedTensor.from_jt_dict(theirs.to_dict()), "from_jt_dict(to_dict())")
    same_kjt(ours.flatten_lengths(), theirs.flatten_lengths(), "flatten_lengths")


@HYPOTHESIS
@given(batches())
def test_to_keeps_the_batch_and_converts_weights(kwargs):
    ours, theirs = both(kwargs)
    ours.sync()
    moved = ours.to(torch.device("cpu"), non_blocking=True)
    same_kjt(moved, theirs.to(torch.device("cpu")), "to(cpu)")
    assert moved.length_per_key_or_none() == ours.length_per_key()  # carried, not read again
    if "weights" in kwargs:
        got, want = ours.to("cpu", dtype=torch.float64), theirs.to(torch.device("cpu"), dtype=torch.float64)
        same(got.weights(), want.weights(), "to(dtype=float64) weights")
        same(got.values(), want.values(), "to(dtype=float64) values")


def test_empty_and_batch_size_zero():
    for kw in ({}, {"is_weighted": True, "values_dtype": torch.int64, "weights_dtype": torch.float64}):
        got, want = te.KeyedJaggedTensor.empty(**kw), TR.KeyedJaggedTensor.empty(**kw)
        same_kjt(got, want, f"empty({kw})")
        same(got.to_dict(), {}, "empty to_dict")
    kwargs = {"keys": ["a", "b"], "values": torch.zeros(0, dtype=torch.int64),
              "lengths": torch.zeros(0, dtype=torch.int32)}  # B = 0
    ours, theirs = both(kwargs)
    same_kjt(ours, theirs, "B = 0")
    same_jt(ours["b"], theirs["b"], "B = 0 kjt['b']")
    same_kjt(ours.permute([1, 0]), theirs.permute([1, 0]), "B = 0 permute")
    # TorchRec's own case of 2-D empty lengths. Its to_dict gives these no-bag features empty offsets;
    # ours, like every offsets, have one entry more than the lengths.
    kwargs = {"keys": ["a", "b"], "values": torch.tensor([]), "lengths": torch.tensor([[], []])}
    ours, theirs = both(kwargs)
    for key in kwargs["keys"]:
        got, want = ours.to_dict()[key], theirs.to_dict()[key]
        same(got.values(), want.values(), f"2-D empty lengths to_dict()[{key!r}] values")
        same(got.lengths(), want.lengths(), f"2-D empty lengths to_dict()[{key!r}] lengths")
        same(got.offsets(), torch.zeros(1), f"2-D empty lengths to_dict()[{key!r}] offsets")


def test_two_dimensional_values():
    kwargs = {"keys": ["a", "b"], "values": torch.arange(24.0).view(8, 3),
              "weights": torch.rand(8), "offsets": torch.tensor([0, 2, 2, 3, 4, 5, 8], dtype=torch.int32)}
    ours, theirs = both(kwargs)
    same_jt(ours["a"], theirs["a"], "2-D values kjt['a']")
    # TorchRec's permute flattens 2-D values: permute the row numbers with it, then take those rows
    rows_of = torchrec.KeyedJaggedTensor(**{**kwargs, "values": torch.arange(8)}).permute([1, 0, 1])
    got = ours.permute([1, 0, 1])
    same(got.values(), kwargs["values"][rows_of.values()], "2-D values permute")
    same(got.weights(), kwargs["weights"][rows_of.values()], "2-D values permute weights")
    same(got.lengths(), rows_of.lengths(), "2-D values permute lengths")


# --------------------------------------------------------------------------------------------------
# Construction: keyword-only after values, variable batch refused, checks kept
# --------------------------------------------------------------------------------------------------


def test_arguments_after_values_are_keyword_only():
    """TorchRec's positional order is (keys, values, weights, lengths): ours must not read a positional
    call another way, so it refuses it."""
    values, lengths = torch.tensor([1, 2, 3]), torch.tensor([1, 2])
    with pytest.raises(TypeError):
        te.KeyedJaggedTensor(["a"], values, lengths)
    with pytest.raises(TypeError):
        te.KeyedJaggedTensor(["a"], values, None, lengths)
    with pytest.raises(TypeError):
        te.JaggedTensor(values, lengths)
    with pytest.raises(TypeError):
        te.JaggedTensor(values, None, lengths)
    same_kjt(te.KeyedJaggedTensor(["a"], values, lengths=lengths),
             torchrec.KeyedJaggedTensor(["a"], values, None, lengths), "keywords")
    same_jt(te.JaggedTensor(values, lengths=lengths), torchrec.JaggedTensor(values, None, lengths),
            "keywords")


def test_variable_batch_and_bad_figures_are_refused():
    values, lengths = torch.arange(8), torch.tensor([2, 0, 1, 1, 1, 3])
    with pytest.raises(ValueError, match="variable batch"):
        te.KeyedJaggedTensor(["a", "b"], values, lengths=lengths, stride_per_key_per_rank=[[2], [4]])
    with pytest.raises(ValueError, match="stride 2 .* needs 4 lengths, got 6"):
        te.KeyedJaggedTensor(["a", "b"], values, lengths=lengths, stride=2)
    with pytest.raises(ValueError, match="length_per_key"):
        te.KeyedJaggedTensor(["a", "b"], values, lengths=lengths, length_per_key=[3, 4])
    with pytest.raises(ValueError, match="different batch sizes"):
        te.KeyedJaggedTensor.from_jt_dict({"a": te.JaggedTensor(values[:3], lengths=lengths[:3]),
                                           "b": te.JaggedTensor(values[3:], lengths=lengths[2:])})
    vbe = torchrec.KeyedJaggedTensor(["a", "b"], values, lengths=lengths, stride_per_key_per_rank=[[2], [4]])
    ebc = te.EmbeddingBagCollection([te.TableConfig("t", 2, ["a", "b"])], optimizer=te.optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match="variable batch"):
        ebc(vbe)
    known = te.KeyedJaggedTensor(["a", "b"], values, lengths=lengths, stride=3, length_per_key=[3, 5],
                                 offset_per_key=[0, 3, 8], index_per_key={"a": 0, "b": 1})
    same_kjt(known, torchrec.KeyedJaggedTensor(["a", "b"], values, lengths=lengths), "per-key figures given")


# --------------------------------------------------------------------------------------------------
# JaggedTensor
# --------------------------------------------------------------------------------------------------


@HYPOTHESIS
@given(st.lists(st.integers(0, 4), min_size=1, max_size=6), st.booleans(), st.integers(0, 5),
       st.integers(1, 3))
def test_jagged_tensor_dense_forms(sizes, weighted, desired, width):
    gen = torch.Generator().manual_seed(sum(sizes))
    shape = (width,) if width > 1 else ()
    dense = [torch.randn(n, *shape, generator=gen) for n in sizes]
    weights = [torch.rand(n, generator=gen) for n in sizes] if weighted else None
    ours, theirs = te.JaggedTensor.from_dense(dense, weights), TR.JaggedTensor.from_dense(dense, weights)
    same_jt(ours, theirs, "from_dense")
    for got, want in zip(ours.to_dense(), theirs.to_dense()):
        same(got, want, "to_dense")
    if weighted:
        for got, want in zip(ours.to_dense_weights(), theirs.to_dense_weights()):
            same(got, want, "to_dense_weights")
    if width == 1:  # fbgemm's padded dense takes 1-D values here
        same(ours.to_padded_dense(), theirs.to_padded_dense(), "to_padded_dense()")
        same(ours.to_padded_dense(desired, -1.0), theirs.to_padded_dense(desired, -1.0), "to_padded_dense(N)")
        same(ours.to_padded_dense_weights(desired, 2.0), theirs.to_padded_dense_weights(desired, 2.0),
             "to_padded_dense_weights")
    padded = theirs.to_padded_dense(max(sizes)) if width == 1 else None
    if padded is not None:
        lengths = theirs.lengths()
        same_jt(te.JaggedTensor.from_dense_lengths(padded, lengths),
                TR.JaggedTensor.from_dense_lengths(padded, lengths), "from_dense_lengths")


def test_jagged_tensor_from_offsets_and_empty():
    values, offsets = torch.arange(8.0), torch.tensor([0, 2, 2, 3, 4, 5, 8], dtype=torch.int32)
    ours, theirs = te.JaggedTensor(values, offsets=offsets), torchrec.JaggedTensor(values, offsets=offsets)
    same(ours.lengths_or_none(), theirs.lengths_or_none(), "lengths_or_none")
    same_jt(ours, theirs, "from offsets")
    same(ours.to_padded_dense(2, 10.0), theirs.to_padded_dense(2, 10.0), "to_padded_dense(2)")
    same_jt(ours.to("cpu"), theirs.to(torch.device("cpu")), "to(cpu)")
    same(ours.device(), theirs.device(), "device")
    got, want = te.JaggedTensor.empty(is_weighted=True), TR.JaggedTensor.empty(is_weighted=True)
    for name in ("values", "lengths", "weights"):
        same(getattr(got, name)(), getattr(want, name)(), f"empty {name}")
    same(got.offsets(), torch.zeros(1, dtype=torch.int32), "empty offsets")  # TorchRec's: none at all


# --------------------------------------------------------------------------------------------------
# KeyedTensor
# --------------------------------------------------------------------------------------------------


def keyed_tensors(theirs: bool, requires_grad: bool = False):
    cls = TR.KeyedTensor if theirs else te.KeyedTensor
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(3, 2 + 3, generator=gen).requires_grad_(requires_grad)
    b = torch.randn(3, 4 + 1 + 2, generator=gen).requires_grad_(requires_grad)
    kts = [cls(["x", "y"], [2, 3], a), cls.from_tensor_list(["z", "u", "v"], list(b.split([4, 1, 2], 1)))]
    return kts, (a, b)


GROUPS = [[["x", "z"], ["y", "u", "v"]], [["v"], ["x"], ["u", "z", "y"]], [["x", "y"], ["x", "v"]]]


@pytest.mark.parametrize("groups", GROUPS, ids=["two_groups", "one_key_groups", "key_twice"])
def test_keyed_tensor_regroup_and_accessors(groups):
    (ours, (oa, ob)), (theirs, (ta, tb)) = keyed_tensors(False, True), keyed_tensors(True, True)
    for got, want in zip(ours, theirs):
        for name in ("keys", "length_per_key", "offset_per_key", "key_dim", "device"):
            same(getattr(got, name)(), getattr(want, name)(), name)
        same(got.values(), want.values(), "values")
        for key in want.to_dict():
            same(got[key], want[key], f"kt[{key!r}]")
            same(got.to_dict()[key], want.to_dict()[key], f"to_dict()[{key!r}]")
        same(got.to("cpu").values(), want.to(torch.device("cpu")).values(), "to(cpu)")
    got, want = te.KeyedTensor.regroup(ours, groups), TR.KeyedTensor.regroup(theirs, groups)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        same(g.detach(), w.detach(), f"regroup {groups}")
    names = [f"g{i}" for i in range(len(groups))]
    got_d, want_d = (te.KeyedTensor.regroup_as_dict(ours, groups, names),
                     TR.KeyedTensor.regroup_as_dict(theirs, groups, names))
    assert list(got_d) == list(want_d)
    upstream = [torch.randn(w.shape, generator=torch.Generator().manual_seed(i)) for i, w in enumerate(want)]
    sum((g * u).sum() for g, u in zip(got, upstream)).backward()
    sum((w * u).sum() for w, u in zip(want, upstream)).backward()
    same(oa.grad, ta.grad, "regroup gradient a")
    same(ob.grad, tb.grad, "regroup gradient b")
    with pytest.raises(ValueError, match="nope"):
        te.KeyedTensor.regroup(ours, [["x", "nope"]])


# --------------------------------------------------------------------------------------------------
# A batch through TorchRec's type and through a collection
# --------------------------------------------------------------------------------------------------

TABLES = [te.TableConfig("ab", 3, ["a", "b"], pooling="mean"), te.TableConfig("c", 2, ["c"])]


def three_feature_batch(weighted: bool, b: int = 3) -> te.KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(b)
    lengths = torch.randint(0, 4, (3 * b,), generator=gen)
    lengths[b : 2 * b] = 0  # feature b: no ids at all
    n = int(lengths.sum())
    values = torch.randint(0, 6, (n,), generator=gen)
    weights = torch.rand(n, generator=gen) if weighted else None
    return te.KeyedJaggedTensor(["a", "b", "c"], values, lengths=lengths, weights=weights)


@pytest.mark.parametrize("weighted", [False, True])
def test_round_trip_through_torchrec(weighted):
    ours = three_feature_batch(weighted)
    theirs = torchrec.KeyedJaggedTensor(keys=ours.keys(), values=ours.values(),
                                        weights=ours.weights_or_none(), lengths=ours.lengths(),
                                        stride=ours.stride())
    same_kjt(ours, theirs, "ours as torchrec's")
    back = te.KeyedJaggedTensor(keys=theirs.keys(), values=theirs.values(), weights=theirs.weights_or_none(),
                                lengths=theirs.lengths(), stride=theirs.stride())
    same_kjt(back, theirs, "and back")
    one = te.EmbeddingBagCollection(TABLES, optimizer=te.optim.SGD(lr=0.1), seed=1)
    two = te.EmbeddingBagCollection(TABLES, optimizer=te.optim.SGD(lr=0.1), seed=1)
    same(two(theirs).values(), one(ours).values(), "collection output, torchrec's batch")


def twins(tables=TABLES):
    return [te.EmbeddingBagCollection(tables, optimizer=te.optim.Adagrad(lr=0.1), seed=7) for _ in range(2)]


def rows(ebc, table: str) -> torch.Tensor:
    return ebc.read(table, torch.arange(6))[0]


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("how", ["permute", "torchrec_permute", "to", "from_jt_dict", "offsets_only"])
def test_collection_takes_a_reshaped_batch(how, weighted):
    """A permuted, moved or rebuilt batch is the same batch: same output, same training."""
    kjt = three_feature_batch(weighted)
    if how == "permute":
        other = kjt.permute([2, 0, 1])
    elif how == "torchrec_permute":
        other = torchrec.KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                                           weights=kjt.weights_or_none()).permute([1, 2, 0])
    elif how == "to":
        other = kjt.to(torch.device("cpu"), non_blocking=True)
    elif how == "from_jt_dict":
        other = te.KeyedJaggedTensor.from_jt_dict(kjt.to_dict())
    else:
        other = te.KeyedJaggedTensor(kjt.keys(), kjt.values(), offsets=kjt.offsets(),
                                     weights=kjt.weights_or_none())
    want_ebc, got_ebc = twins()
    want, got = want_ebc(kjt), got_ebc(other)
    assert got.keys() == want.keys() == ["a", "b", "c"]
    same(got.values().detach(), want.values().detach(), f"{how} output")
    upstream = torch.randn(want.values().shape, generator=torch.Generator().manual_seed(0))
    (want.values() * upstream).sum().backward()
    (got.values() * upstream).sum().backward()
    for t in ("ab", "c"):
        same(rows(got_ebc, t), rows(want_ebc, t), f"{how}: rows of {t!r} after backward")


def test_collections_take_the_split_of_a_batch():
    """Split per table: each piece through a collection of its tables gives that part of the whole."""
    kjt = three_feature_batch(True, b=4)
    (whole, _), (first, _), (second, _) = twins(), twins(TABLES[:1]), twins(TABLES[1:])
    ab, c = kjt.split([2, 1])
    want = whole(kjt)
    got = torch.cat([first(ab).values(), second(c).values()], dim=1)
    same(got.detach(), want.values().detach(), "split output")
