"""Every backend against DictBackend, the reference: same answers to the same verbs.

Backends under test: HostMemory, RocksDB (1 and 3 shards, with and without the DRAM cache), Redis
(standalone, with the DRAM cache, and a 3-node Redis Cluster).
"""

from __future__ import annotations

import pytest
import torch

import tieredemb as te
from tieredemb.storage.backend import Backend, DictBackend
from tieredemb.storage.codec import decode_keys, decode_rows, encode_keys, key_bytes, row_bytes
from tieredemb.storage.errors import BackendError, ExistingRowsError
from tieredemb.storage.host import CachedBackend, HostMemoryBackend

W = 5
CPU = torch.device("cpu")
EXTREMES = torch.tensor([-(2**63) + 1, 2**63 - 1, 0, -1, 1, 2**32, -(2**32)], dtype=torch.int64)

KINDS = ["host", "rocksdb1", "rocksdb3", "rocksdb_cached", "redis", "redis_cached", "redis_cluster"]
PERSISTENT = ["rocksdb3", "rocksdb_cached", "redis", "redis_cluster"]


@pytest.fixture
def make_spec(request, tmp_path):
    """kind -> a factory of specs (keyword overrides) for that kind of store (one store per test)."""

    def make(kind: str, **kw) -> te.storage.BackendSpec:
        if kind == "host":
            return te.storage.HostMemory(**kw)
        if kind.startswith("rocksdb"):
            shards = 1 if kind == "rocksdb1" else 3
            cache = 16 if kind == "rocksdb_cached" else 0
            return te.storage.RocksDB(str(tmp_path / "db"), **{"shards": shards, "cache_rows": cache, **kw})
        if kind == "redis_cluster":
            return te.storage.Redis(request.getfixturevalue("redis_cluster"), cluster=True, **kw)
        url = request.getfixturevalue("redis_server")
        return te.storage.Redis(url, **{"cache_rows": 16 if kind == "redis_cached" else 0, **kw})

    return make


def assert_same(got, want, msg: str = "") -> None:
    assert torch.equal(got.found, want.found), f"{msg}: found differs"
    assert got.rows.shape == want.rows.shape, f"{msg}: shape {tuple(got.rows.shape)}"
    assert got.rows.dtype == torch.float32
    assert torch.equal(got.rows, want.rows), f"{msg}: rows differ"


def scan_all(backend: Backend, chunk_rows: int) -> dict[int, tuple[float, ...]]:
    """key -> row over every chunk; asserts chunk sizes and that no key comes twice."""
    out: dict[int, tuple[float, ...]] = {}
    for keys, rows in backend.scan(chunk_rows):
        assert 0 < keys.numel() <= chunk_rows
        assert keys.dtype == torch.int64 and rows.shape == (keys.numel(), backend.width)
        for k, r in zip(keys.tolist(), rows.tolist()):
            assert k not in out, f"scan returned key {k} twice"
            out[k] = tuple(r)
    return out


def random_keys(gen: torch.Generator, n: int) -> torch.Tensor:
    """n keys, duplicates and the int64 extremes included."""
    keys = torch.randint(-40, 40, (n,), generator=gen) * 1_000_003
    if n:
        extra = EXTREMES[torch.randint(0, EXTREMES.numel(), (max(n // 4, 1),), generator=gen)]
        keys = torch.cat([keys, extra])[torch.randperm(n + extra.numel(), generator=gen)][:n]
    return keys


@pytest.mark.parametrize("kind", KINDS)
def test_random_sequences_match_dict_backend(make_spec, kind):
    backend = make_spec(kind).open("user", W, CPU)
    ref = DictBackend(W)
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    for step in range(60):
        n = int(torch.randint(0, 30, (1,), generator=gen))
        keys = random_keys(gen, n)
        op = step % 4
        if op in (0, 1):  # set twice as often: overwrites and duplicates within a call
            rows = torch.randn(n, W, generator=gen)
            backend.set(keys, rows)
            ref.set(keys, rows)
        elif op == 2:
            backend.delete(keys)
            ref.delete(keys)
        probe = torch.cat([keys, random_keys(gen, 8)])  # some present, some absent
        assert_same(backend.get(probe), ref.get(probe), f"{kind} step {step}")
    assert backend.size() == ref.size()
    assert scan_all(backend, 7) == scan_all(ref, 7)
    backend.close()


@pytest.mark.parametrize("kind", KINDS)
def test_empty_inputs_and_empty_store(make_spec, kind):
    backend = make_spec(kind).open("user", W, CPU)
    none = torch.zeros(0, dtype=torch.int64)
    got = backend.get(none)
    assert got.rows.shape == (0, W) and got.found.shape == (0,) and got.found.dtype == torch.bool
    backend.set(none, torch.zeros(0, W))
    backend.delete(none)
    assert backend.size() == 0
    assert list(backend.scan(4)) == []
    miss = backend.get(torch.tensor([3, 4]))
    assert not miss.found.any() and torch.equal(miss.rows, torch.zeros(2, W))
    backend.flush()
    backend.close()


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_scan_covers_every_row_exactly_once(make_spec, kind):
    backend = make_spec(kind).open("user", W, CPU)
    keys = torch.cat([torch.randperm(997) * 7919 - 3_000_000, EXTREMES])
    rows = torch.randn(keys.numel(), W)
    backend.set(keys, rows)
    want = {k: tuple(r) for k, r in zip(keys.tolist(), rows.tolist())}
    for chunk in (1, 97, 5000):
        assert scan_all(backend, chunk) == want
        parts = list(backend.scan_keys(chunk))  # the keys alone: the same, each once
        assert all(0 < p.numel() <= chunk and p.dtype == torch.int64 for p in parts)
        assert sorted(torch.cat(parts).tolist()) == sorted(want)
    assert backend.size() == keys.numel()
    backend.close()


@pytest.mark.parametrize("kind", KINDS)
def test_duplicate_keys_in_one_set_keep_the_last_row(make_spec, kind):
    backend = make_spec(kind).open("user", W, CPU)
    keys = torch.tensor([5, 9, 5, 5, 9])
    rows = torch.arange(5 * W, dtype=torch.float32).reshape(5, W)
    backend.set(keys, rows)
    got = backend.get(torch.tensor([5, 9]))
    assert torch.equal(got.rows, rows[[3, 4]])
    backend.close()


@pytest.mark.parametrize("kind", KINDS)
def test_two_tables_in_one_store_are_isolated(make_spec, kind):
    spec = make_spec(kind)
    # "a:b" extends "a" with the key separator: a prefix-based store must still keep them apart
    a, ab = spec.open("a", W, CPU), spec.open("a:b", W + 1, CPU)
    keys = torch.tensor([1, 2, 3, -7])
    a.set(keys, torch.ones(4, W))
    ab.set(keys[:2], 2 * torch.ones(2, W + 1))
    assert torch.equal(a.get(keys).rows, torch.ones(4, W))
    got = ab.get(keys)
    assert got.found.tolist() == [True, True, False, False]
    ab.delete(keys)
    assert a.size() == 4 and ab.size() == 0
    assert set(scan_all(a, 3)) == set(keys.tolist())
    a.close()
    ab.close()


@pytest.mark.parametrize("kind", PERSISTENT)
def test_existing_modes(make_spec, kind):
    keys, rows = torch.tensor([4, -4, 2**40]), torch.randn(3, W)
    first = make_spec(kind).open("user", W, CPU)
    first.set(keys, rows)
    first.flush()
    first.close()
    with pytest.raises(ExistingRowsError, match="already holds rows of table 'user'"):
        make_spec(kind).open("user", W, CPU)
    other = make_spec(kind).open("item", W, CPU)  # another table of the same store is free
    other.close()
    with pytest.raises(ValueError, match="rows of 20 bytes, this table's rows have 24"):
        make_spec(kind, existing="reuse").open("user", W + 1, CPU)
    reused = make_spec(kind, existing="reuse").open("user", W, CPU)
    assert torch.equal(reused.get(keys).rows, rows)
    reused.close()
    cleared = make_spec(kind, existing="clear").open("user", W, CPU)
    assert cleared.size() == 0 and not cleared.get(keys).found.any()
    cleared.close()


@pytest.mark.parametrize("kind", PERSISTENT)
def test_reopen_after_close_sees_flushed_rows(make_spec, kind):
    keys = torch.arange(-100, 100) * 31
    rows = torch.randn(200, W)
    spec = make_spec(kind)
    backend = spec.open("user", W, CPU)
    backend.set(keys, rows)
    backend.delete(keys[:10])
    backend.flush()
    backend.close()
    again = make_spec(kind, existing="reuse").open("user", W, CPU)
    got = again.get(keys)
    assert got.found.tolist() == [False] * 10 + [True] * 190
    assert torch.equal(got.rows[10:], rows[10:])
    again.close()


def test_rocksdb_reopen_with_other_shard_count_is_refused(tmp_path):
    backend = te.storage.RocksDB(str(tmp_path), shards=2).open("user", W, CPU)
    backend.close()
    with pytest.raises(ValueError, match="created with 2 shards"):
        te.storage.RocksDB(str(tmp_path), shards=4, existing="reuse").open("user", W, CPU)


def test_rocksdb_refuses_a_directory_that_is_not_a_store(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a tieredemb store"):
        te.storage.RocksDB(str(tmp_path)).open("user", W, CPU)


def test_rocksdb_one_shard_scans_in_numeric_key_order(tmp_path):
    backend = te.storage.RocksDB(str(tmp_path), shards=1).open("user", W, CPU)
    keys = EXTREMES[torch.randperm(EXTREMES.numel())]
    backend.set(keys, torch.randn(keys.numel(), W))
    (scanned, _), = list(backend.scan(100))
    assert scanned.tolist() == sorted(EXTREMES.tolist())
    backend.close()


def test_rocksdb_table_opened_twice_is_refused(tmp_path):
    spec = te.storage.RocksDB(str(tmp_path))
    backend = spec.open("user", W, CPU)
    with pytest.raises(ValueError, match="already open"):
        spec.open("user", W, CPU)
    backend.close()


def test_host_memory_bounded_is_an_lru_cache():
    cache = HostMemoryBackend(W, capacity=32, bucket_width=4)
    keys = torch.arange(200)
    cache.set(keys, torch.randn(200, W))
    assert cache.size() <= 32
    stored = cache.get(keys).found
    assert 0 < int(stored.sum()) <= 32
    hot = keys[stored][:4]
    for cold in range(1000, 1100):  # touch the hot keys, insert a cold one: the hot ones stay
        cache.get(hot)
        cache.set(torch.tensor([cold]), torch.zeros(1, W))
    assert cache.get(hot).found.all()
    assert int(cache.get(torch.arange(1000, 1100)).found.sum()) > 0


def test_cached_backend_write_through_and_hits():
    store = DictBackend(W)
    cached = CachedBackend(store, cache_rows=256)
    keys = torch.arange(50)
    rows = torch.randn(50, W)
    cached.set(keys, rows)
    assert store.size() == 50  # write-through: the store holds every row
    cached.get(keys)
    assert cached.hits == 50 and cached.misses == 0
    fresh = CachedBackend(store, cache_rows=256)
    assert torch.equal(fresh.get(keys).rows, rows) and fresh.misses == 50
    assert torch.equal(fresh.get(keys).rows, rows) and fresh.hits == 50  # kept what it fetched
    fresh.delete(keys[:5])
    assert not fresh.get(keys[:5]).found.any() and store.size() == 45


def test_host_memory_refuses_the_reserved_key():
    with pytest.raises(ValueError, match="RESERVED_KEY"):
        HostMemoryBackend(W).set(torch.tensor([te.RESERVED_KEY]), torch.zeros(1, W))


def test_codec_round_trip_and_order():
    keys = EXTREMES
    raw = key_bytes(encode_keys(keys))
    assert all(len(b) == 8 for b in raw)
    assert torch.equal(decode_keys(raw), keys)
    assert sorted(raw) == key_bytes(encode_keys(torch.sort(keys).values))  # bytes order = numeric
    rows = torch.randn(7, W)
    values = row_bytes(rows)
    got, found = decode_rows([values[0], None, values[2]], W, "here")
    assert found.tolist() == [True, False, True]
    assert torch.equal(got[0], rows[0]) and torch.equal(got[1], torch.zeros(W))
    every, all_found = decode_rows(values, W, "here")  # every key found: the joined bytes are the rows
    assert bool(all_found.all()) and torch.equal(every, rows)
    every += 1  # the rows are the caller's to change (not a view of immutable bytes)
    assert torch.equal(every, rows + 1)
    empty, none = decode_rows([], W, "here")
    assert empty.shape == (0, W) and none.numel() == 0
    with pytest.raises(BackendError, match="here: a stored row has 20 bytes, this table's rows have 24"):
        decode_rows([values[0]], W + 1, "here")
    with pytest.raises(BackendError, match="a stored row has 20 bytes"):
        decode_rows([values[0], values[1]], W + 1, "here")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: te.storage.RocksDB("/tmp/x", existing="keep"), "existing must be one of"),
        (lambda: te.storage.RocksDB("/tmp/x", shards=0), "shards must be an int >= 1"),
        (lambda: te.storage.RocksDB("/tmp/x", cache_rows=-1), "cache_rows must be an int >= 0"),
        (lambda: te.storage.Redis(retries=-1), "retries must be an int >= 0"),
        (lambda: te.storage.Redis(timeout_s=0), "timeout_s must be a number"),
        (lambda: te.storage.Redis(existing="yes"), "existing must be one of"),
        (lambda: te.storage.HostMemory(segment_rows=0), "segment_rows must be an int >= 1"),
    ],
)
def test_spec_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_specs_stay_plain_configuration():
    a, b = te.storage.RocksDB("/tmp/x"), te.storage.RocksDB("/tmp/x")
    assert a == b and hash(a) == hash(b) and "_open" not in repr(a)
    assert "secret" not in repr(te.storage.Redis(password="secret"))


def test_host_memory_keeps_several_tables_apart() -> None:
    """One host-memory store for a table group: the same keys in different tables are different
    rows; every verb answers as one DictBackend per table would."""
    from tieredemb.storage.backend import DictBackend
    from tieredemb.storage.host import HostMemoryBackend

    group = te.storage.HostMemory(segment_rows=8).open_group(["a", "b", "c"], 3, torch.device("cpu"))
    assert isinstance(group.rows, HostMemoryBackend)
    refs = [DictBackend(3) for _ in range(3)]
    gen = torch.Generator().manual_seed(4)
    for _ in range(6):
        _set_both(group, refs, gen, span=20, n=40)
        gone = torch.randint(-20, 20, (5,), generator=gen)
        group.table(1).delete(gone)
        refs[1].delete(gone)
        _compare(group, refs, span=22)
        for t, ref in enumerate(refs):
            scanned = list(group.table(t).scan(7))
            assert torch.equal(torch.cat([k for k, _ in scanned]), next(ref.scan(10**6))[0])
            assert torch.equal(torch.cat([r for _, r in scanned]), next(ref.scan(10**6))[1])


def test_rocksdb_group_answers_like_one_backend_per_table(tmp_path) -> None:
    """A group's RocksDB tables in one call (one fan-out over the shards): the same rows as calling
    each table's backend, the same keys in two tables kept apart, the last of a repeated pair kept."""
    from tieredemb.storage.backend import DictBackend
    from tieredemb.storage.rocksdb import RocksDBGroup

    group = te.storage.RocksDB(str(tmp_path / "db"), shards=3).open_group(["a", "b", "c"], 5,
                                                                         torch.device("cpu"))
    assert isinstance(group, RocksDBGroup)
    refs = [DictBackend(5) for _ in range(3)]
    gen = torch.Generator().manual_seed(9)
    try:
        for _ in range(5):
            _set_both(group, refs, gen, span=30, n=50)
            _compare(group, refs, span=32)
    finally:
        group.close()


def _set_both(group, refs, gen: torch.Generator, span: int, n: int) -> None:
    """The same upsert (keys in [-span, span), repeats included: the last row of a pair wins) to a
    group store and to one reference backend per table."""
    keys = torch.randint(-span, span, (n,), generator=gen)
    tables = torch.randint(0, len(refs), (n,), generator=gen)
    rows = torch.randn(n, refs[0].width, generator=gen)
    group.set(keys, tables, rows)
    for t, ref in enumerate(refs):
        ref.set(keys[tables == t], rows[tables == t])


def _compare(group, refs, span: int) -> None:
    """Every key in [-span, span) of every table answers as the table's reference does."""
    probe = torch.arange(-span, span).repeat(len(refs))
    ptables = torch.arange(len(refs)).repeat_interleave(2 * span)
    got = group.get(probe, ptables)
    for t, ref in enumerate(refs):
        want = ref.get(probe[ptables == t])
        assert torch.equal(got.found[ptables == t], want.found)
        assert torch.equal(got.rows[ptables == t], want.rows)
        assert group.table(t).size() == ref.size()
