"""16-bit rows (``TableConfig(dtype=torch.bfloat16 | torch.float16)``): training follows an fp32
reference (``torch.nn.EmbeddingBag`` + ``torch.optim``) within what the dtype's rounding allows;
stochastic rounding lets updates smaller than the dtype's spacing add up where rounding to nearest
stalls; every storage mode and backing store holds the same rows as ``hbm_direct``, bit for bit;
``read``/``write``/``export`` speak the table's dtype; bad dtypes are refused."""

from __future__ import annotations

import pytest
import torch

import tieredemb as te
from tests.modules.test_tiered_modes import DictStore
from tests.storage.conftest import redis_factory, redis_server  # noqa: F401 (fixtures)

DTYPES = [torch.bfloat16, torch.float16]
# unit roundoff u: half the spacing of the dtype's values relative to the value (bfloat16 keeps 8
# significant bits, float16 11)
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
N, D, B = 24, 8, 6


def batches(steps: int, seed: int = 0) -> list[tuple[te.KeyedJaggedTensor, torch.Tensor, torch.Tensor]]:
    """(kjt, offsets, loss weights r): the loss is sum(out * r), so every id's gradient is its bag's
    r, the same whatever the rows hold. |r| in [0.5, 1.5]: Adam's second moment stays in float16's
    normal range (above 6.1e-5)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, 4, (B,), generator=gen)
        ids = torch.randint(0, N, (int(lengths.sum()),), generator=gen)
        sign = torch.randint(0, 2, (B, D), generator=gen) * 2 - 1
        r = sign * (0.5 + torch.rand(B, D, generator=gen))
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])  # starts
        out.append((te.KeyedJaggedTensor(["f"], ids, lengths=lengths), offsets, r))
    return out


OPTIMIZERS = {
    "sgd": (lambda: te.optim.SGD(lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    "adagrad": (lambda: te.optim.Adagrad(lr=0.05),
                lambda p: torch.optim.Adagrad(p, lr=0.05, eps=1e-10, initial_accumulator_value=0.0)),
    "adam": (lambda: te.optim.Adam(lr=0.01), lambda p: torch.optim.SparseAdam(p, lr=0.01)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("stochastic", [True, False])
def test_follows_fp32_reference(dtype, name, stochastic):
    ours_opt, torch_opt = OPTIMIZERS[name]
    table = te.TableConfig("t", D, ["f"], num_embeddings=N, dtype=dtype, stochastic_rounding=stochastic)
    ebc = te.EmbeddingBagCollection([table], optimizer=ours_opt(), seed=1)
    keys = torch.arange(N)
    ebc.write("t", keys, torch.randn(N, D, generator=torch.Generator().manual_seed(5)) * 0.3)
    start, found = ebc.read("t", keys)
    assert start.dtype == dtype and bool(found.all())
    ref = torch.nn.EmbeddingBag(N, D, mode="sum", sparse=True)
    with torch.no_grad():
        ref.weight.copy_(start.float())  # the same (rounded) rows to start from
    opt = torch_opt(ref.parameters())
    steps = batches(12)
    biggest_step = 0.0
    for kjt, offsets, r in steps:
        (ebc(kjt).values() * r).sum().backward()
        before = ref.weight.detach().clone()
        opt.zero_grad()
        (ref(kjt.values(), offsets) * r).sum().backward()
        opt.step()
        biggest_step = max(biggest_step, (ref.weight.detach() - before).abs().max().item())
    got, _ = ebc.read("t", keys)
    assert got.dtype == dtype
    want = ref.weight.detach()
    # Each update stores a weight within one spacing (2u |w|) of its float32 value, rounded either
    # way (stochastically) or within half of one (to nearest). Over K updates these errors add up to
    # at most K * 2u * max|w|; the optimizer state is stored in the dtype too, so each step itself is
    # off by a relative error of a few u per update that fed its state (Adagrad's sum, Adam's
    # moments: at most K of them): another K * 2u * 2 * max|step| bounds that part.
    k = len(steps)
    u = UNIT[dtype]
    tol = k * 2 * u * (want.abs().max().item() + 2 * biggest_step)
    err = (got.float() - want).abs().max().item()
    assert err <= tol, (err, tol)
    # and the rows are the dtype's values, not float32 ones that were never rounded
    assert not torch.equal(got.float(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_small_updates_add_up_only_with_stochastic_rounding(dtype):
    """Weights at 1.0, each step adds an eighth of the dtype's spacing there (2**-7 bfloat16,
    2**-10 float16): rounded to nearest the weight never moves; rounded stochastically it follows
    float32 (1 + 64 / 8 spacings after 64 steps) within a few standard errors."""
    spacing = 2.0 * UNIT[dtype] * 2  # at 1.0 the spacing of the values above is 2 u * 2
    keys, dim, steps = 64, 16, 64
    increment = spacing / 8
    result = {}
    for stochastic in (True, False):
        table = te.TableConfig("t", dim, ["f"], num_embeddings=keys, dtype=dtype,
                               stochastic_rounding=stochastic)
        ebc = te.EmbeddingBagCollection([table], optimizer=te.optim.SGD(lr=1.0))
        ebc.write("t", torch.arange(keys), torch.ones(keys, dim))
        kjt = te.KeyedJaggedTensor(["f"], torch.arange(keys), lengths=torch.ones(keys, dtype=torch.int64))
        for _ in range(steps):
            (ebc(kjt).values() * -increment).sum().backward()  # w -= lr * g = w + increment
        result[stochastic] = ebc.read("t", torch.arange(keys))[0].double()
    assert bool((result[False] == 1.0).all())  # stalled: each step is under half a spacing
    exact = 1.0 + steps * increment
    # each rounding adds an error of mean 0 and variance p(1-p) spacing**2 <= spacing**2 / 4
    stderr = (steps * spacing**2 / 4) ** 0.5 / (keys * dim) ** 0.5
    assert abs(result[True].mean().item() - exact) < 5 * stderr
    assert exact - 1.0 > 50 * stderr  # far from the stalled value


def tables_of(dtype: torch.dtype) -> list[te.TableConfig]:
    """A 16-bit table and a float32 one of the same dim (they must not share a row store), and a
    16-bit table without stochastic rounding."""
    return [te.TableConfig("t", 4, ["a"], dtype=dtype, initializer=te.init.Normal(0.0, 0.1)),
            te.TableConfig("u", 4, ["b"], initializer=te.init.Normal(0.0, 0.1)),
            te.TableConfig("v", 4, ["c"], dtype=dtype, stochastic_rounding=False)]


def train(storage: te.StorageConfig | None, dtype: torch.dtype, optimizer) -> dict:
    ebc = te.EmbeddingBagCollection(tables_of(dtype), optimizer=optimizer, storage=storage, seed=4)
    gen = torch.Generator().manual_seed(2)
    for _ in range(8):
        lengths = torch.randint(0, 4, (3 * 5,), generator=gen)
        ids = torch.randint(-30, 30, (int(lengths.sum()),), generator=gen)
        kjt = te.KeyedJaggedTensor(["a", "b", "c"], ids, lengths=lengths)
        out = ebc(kjt).values()
        assert out.dtype == torch.float32
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    ebc.flush()
    rows = {}
    for name in ("t", "u", "v"):
        e = ebc.export(name)
        order = torch.argsort(e.keys)
        rows[name] = (e.keys[order], e.weights[order], e.optimizer_state[order])
    ebc.close()
    return {"mode": ebc.storage_mode, "rows": rows, "groups": len(ebc.tiers)}


def storages(kind: str, tmp_path, redis_url) -> te.StorageConfig:
    small = dict(hbm_budget=700, segment_rows=8, bucket_width=4)
    if kind == "cache":
        return te.StorageConfig(**small)
    if kind == "hybrid":
        return te.StorageConfig(hbm_budget=700, caching=False, segment_rows=8)
    if kind == "dict":
        return te.StorageConfig(**small, backing=DictStore())
    if kind == "rocksdb":
        return te.StorageConfig(**small, backing=te.storage.RocksDB(str(tmp_path / "db"), shards=2))
    if kind == "host_tier":  # a host tier of a few rows a table between the cache and RocksDB
        return te.StorageConfig(**small, backing=te.storage.RocksDB(str(tmp_path / "db"), shards=2),
                                host_budget=300)
    return te.StorageConfig(**small, backing=te.storage.Redis(redis_url, existing="clear"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["cache", "hybrid", "dict", "rocksdb", "host_tier", "redis"])
def test_every_mode_and_backend_holds_the_same_rows(dtype, kind, tmp_path, request):
    redis_url = request.getfixturevalue("redis_server") if kind == "redis" else None
    optimizer = te.optim.Adam(lr=0.02)
    want = train(None, dtype, optimizer)
    got = train(storages(kind, tmp_path, redis_url), dtype, optimizer)
    assert want["mode"] == "hbm_direct" and got["mode"] == ("hybrid" if kind == "hybrid" else "cache")
    assert want["groups"] == 3  # one row store per (dim, dtype, rounding)
    for name in ("t", "u", "v"):
        for a, b in zip(want["rows"][name], got["rows"][name]):
            assert a.dtype == b.dtype
            assert torch.equal(a, b), name
        assert want["rows"][name][1].dtype == (torch.float32 if name == "u" else dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_read_write_export_speak_the_dtype(dtype):
    ebc = te.EmbeddingBagCollection([te.TableConfig("t", 3, ["f"], dtype=dtype)],
                                    optimizer=te.optim.RowWiseAdagrad(lr=0.1))
    given = torch.tensor([[0.1, 1.0 / 3.0, -2.7182818]], dtype=torch.float64)
    ebc.write("t", torch.tensor([4]), given)
    got, found = ebc.read("t", torch.tensor([4, 5]))
    assert got.dtype == dtype and found.tolist() == [True, False]
    assert torch.equal(got[0], given[0].to(dtype))  # rounded to the nearest value
    e = ebc.export("t")
    assert e.weights.dtype == dtype and e.optimizer_state.dtype == dtype
    assert ebc.stats()["t"].memory_bytes["device"] % (4 * dtype.itemsize) == 0


def test_write_refuses_rows_beyond_the_dtype_and_changes_nothing():
    ebc = te.EmbeddingBagCollection([te.TableConfig("h", 2, ["f"], dtype=torch.float16),
                                     te.TableConfig("s", 2, ["g"])])
    ebc.write("h", torch.tensor([1]), torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"table 'h'.*finite.*torch.float16"):
        ebc.write("h", torch.tensor([1, 2]), torch.tensor([[7e4, 0.0], [1.0, 1.0]]))  # > 65504
    got, found = ebc.read("h", torch.tensor([1, 2]))
    assert got[0].tolist() == [1.0, 1.0] and found.tolist() == [True, False]
    ebc.write("s", torch.tensor([1]), torch.tensor([[7e4, 0.0]]))  # a float32 table takes it


@pytest.mark.parametrize("bad", [torch.int8, torch.float64, torch.float8_e4m3fn, "bf16", "float16", None])
def test_bad_dtype_refused(bad):
    with pytest.raises(ValueError, match=r"table 'x'.*dtype.*" + repr(bad).replace("(", r"\(")[:8]):
        te.TableConfig("x", 4, ["f"], dtype=bad)


def test_bad_stochastic_rounding_refused():
    with pytest.raises(TypeError, match="table 'x'.*stochastic_rounding"):
        te.TableConfig("x", 4, ["f"], dtype=torch.bfloat16, stochastic_rounding="yes")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backing_stores_keep_half_the_bytes(dtype, tmp_path, redis_server):  # noqa: F811
    """A 16-bit row is stored as 2 bytes a value: a float32 table reusing the store is refused,
    told the rows' size."""
    width = 4
    for spec, again in ((te.storage.RocksDB(str(tmp_path / "db"), shards=1),
                         te.storage.RocksDB(str(tmp_path / "db"), shards=1, existing="reuse")),
                        (te.storage.Redis(redis_server), te.storage.Redis(redis_server, existing="reuse"))):
        b = spec.open("t", width, torch.device("cpu"), dtype)
        rows = torch.randn(3, width)
        b.set(torch.tensor([1, 2, 3]), rows)
        got = b.get(torch.tensor([3, 1, 9]))
        assert got.rows.dtype == dtype and got.found.tolist() == [True, True, False]
        assert torch.equal(got.rows[:2], rows[[2, 0]].to(dtype))
        b.close()
        with pytest.raises(ValueError, match=f"holds rows of {width * 2} bytes"):
            again.open("t", width, torch.device("cpu"))
    host = te.storage.HostMemory(segment_rows=16).open("t", width, torch.device("cpu"), dtype)
    host.set(torch.arange(16), torch.ones(16, width))
    assert host.nbytes() == 16 * width * 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernels_train_the_rows_the_reference_does(dtype):
    """The whole step on Triton's kernels (the interpreter on the CPU): the same 16-bit rows as the
    reference kernels, but where the two float32 computations straddle a rounding point (one value
    apart there)."""
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the interpreter on a CPU
    rows = {}
    for kernels in ("torch", "triton"):
        ebc = te.EmbeddingBagCollection(tables_of(dtype), optimizer=te.optim.Adam(lr=0.02), seed=4,
                                        kernels=kernels, device=device)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            lengths = torch.randint(0, 4, (3 * 4,), generator=gen)
            ids = torch.randint(-10, 10, (int(lengths.sum()),), generator=gen)
            kjt = te.KeyedJaggedTensor(["a", "b", "c"], ids.to(device), lengths=lengths.to(device))
            out = ebc(kjt).values()
            (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
        e = ebc.export("t")
        order = torch.argsort(e.keys)
        rows[kernels] = torch.cat([e.weights[order], e.optimizer_state[order]], 1).cpu()
    a, b = rows["triton"], rows["torch"]
    assert a.dtype == dtype
    step = ((b.view(torch.int16) + 1).view(dtype).float() - b.float()).abs()
    assert bool(((a.float() - b.float()).abs() <= step).all())
    assert (a.view(torch.int16) != b.view(torch.int16)).float().mean().item() < 0.02
