"""RocksDB's disk options (direct I/O, block cache, bloom filters, tuning) against a dict: the same
rows as the default store, after a reopen too; the options reach RocksDB (its OPTIONS file); bad
values are refused before anything is created."""

from __future__ import annotations

import glob
import os

import pytest
import torch

import tieredemb as te
from tieredemb.storage.backend import DictBackend

W = 6
CPU = torch.device("cpu")

OPTIONS = {
    "direct": dict(direct_reads=True, direct_writes=True),
    "bounded_cache": dict(block_cache_bytes=1 << 20),
    "no_cache_no_bloom": dict(block_cache_bytes=0, bloom_bits_per_key=0),
    "point_lookup": dict(tuning="point_lookup", bloom_bits_per_key=16),
    "all": dict(direct_reads=True, direct_writes=True, block_cache_bytes=256 << 10,
                bloom_bits_per_key=12, tuning="point_lookup"),
}


def _keys(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(-500, 500, (n,), generator=gen) * 7_777_777  # repeats within and across calls


def _drive(backend, ref: DictBackend, gen: torch.Generator, steps: int) -> None:
    """Random sets (with repeated keys), deletes and flushes on both; every get compared."""
    for step in range(steps):
        keys = _keys(gen, int(torch.randint(1, 300, (1,), generator=gen)))
        if step % 3 == 2:
            backend.delete(keys)
            ref.delete(keys)
        else:
            rows = torch.randn(keys.numel(), W, generator=gen)
            backend.set(keys, rows)
            ref.set(keys, rows)
        if step % 5 == 4:
            backend.flush()  # table files: later gets read them (through direct I/O where on)
        probe = torch.cat([keys, _keys(gen, 50)])
        got, want = backend.get(probe), ref.get(probe)
        assert torch.equal(got.found, want.found) and torch.equal(got.rows, want.rows), f"step {step}"


def _same_as_dict(backend, ref: DictBackend) -> None:
    assert backend.size() == ref.size()
    got = {k: tuple(r) for ks, rs in backend.scan(97) for k, r in zip(ks.tolist(), rs.tolist())}
    want = {k: tuple(r) for ks, rs in ref.scan(97) for k, r in zip(ks.tolist(), rs.tolist())}
    assert got == want


@pytest.mark.parametrize("name", list(OPTIONS))
def test_options_store_the_dicts_rows_and_reopen(tmp_path, name):
    kw = OPTIONS[name]
    ref = DictBackend(W)
    gen = torch.Generator().manual_seed(len(name))
    backend = te.storage.RocksDB(str(tmp_path), shards=3, **kw).open("user", W, CPU)
    _drive(backend, ref, gen, 30)
    _same_as_dict(backend, ref)
    backend.close()
    for again_kw in (kw, {}):  # the options are no part of the format: a default open reads them too
        again = te.storage.RocksDB(str(tmp_path), shards=3, existing="reuse", **again_kw).open("user", W, CPU)
        _same_as_dict(again, ref)
        _drive(again, ref, gen, 6)
        again.close()


def test_default_and_tuned_stores_answer_alike(tmp_path):
    """The same calls on a default store and on one with every option give the same answers."""
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    plain = te.storage.RocksDB(str(tmp_path / "a"), shards=2).open("t", W, CPU)
    tuned = te.storage.RocksDB(str(tmp_path / "b"), shards=2, **OPTIONS["all"]).open("t", W, CPU)
    ref_a, ref_b = DictBackend(W), DictBackend(W)
    _drive(plain, ref_a, gen_a, 20)
    _drive(tuned, ref_b, gen_b, 20)
    probe = torch.arange(-500, 500) * 7_777_777
    a, b = plain.get(probe), tuned.get(probe)
    assert a.found.any() and torch.equal(a.found, b.found) and torch.equal(a.rows, b.rows)
    plain.close()
    tuned.close()


def test_group_of_tables_with_options(tmp_path):
    """A table group (one fan-out for all its tables) over a tuned store keeps the tables apart."""
    spec = te.storage.RocksDB(str(tmp_path), shards=2, **OPTIONS["all"])
    group = spec.open_group(["a", "b"], W, CPU)
    keys = torch.arange(400) % 250  # repeats: the last row of a key wins
    tables = torch.arange(400) % 2
    rows = torch.randn(400, W)
    group.set(keys, tables, rows)
    refs = [DictBackend(W), DictBackend(W)]
    for t in (0, 1):
        refs[t].set(keys[tables == t], rows[tables == t])
    group.flush()
    probe = torch.arange(300)
    for t in (0, 1):
        got, want = group.get(probe, torch.full((300,), t)), refs[t].get(probe)
        assert torch.equal(got.found, want.found) and torch.equal(got.rows, want.rows)
    group.close()


def _options_file(shard_dir: str) -> str:
    files = sorted(glob.glob(os.path.join(shard_dir, "OPTIONS-*")))
    assert files, f"no OPTIONS file in {shard_dir}"
    with open(files[-1]) as f:
        return f.read()


def test_options_reach_rocksdb(tmp_path):
    """RocksDB writes the options it runs with to each database's OPTIONS file."""
    tuned = te.storage.RocksDB(str(tmp_path / "t"), shards=2, **OPTIONS["all"]).open("u", W, CPU)
    plain = te.storage.RocksDB(str(tmp_path / "p"), shards=2).open("u", W, CPU)
    bare = te.storage.RocksDB(str(tmp_path / "b"), shards=2, **OPTIONS["no_cache_no_bloom"]).open("u", W, CPU)
    for backend in (tuned, plain, bare):
        backend.close()
    for shard in ("shard-00", "shard-01"):
        text = _options_file(str(tmp_path / "t" / shard))
        assert "use_direct_reads=true" in text
        assert "use_direct_io_for_flush_and_compaction=true" in text
        assert "compression=kNoCompression" in text
        assert "data_block_index_type=kDataBlockBinaryAndHash" in text
        assert "cache_index_and_filter_blocks=true" in text
        assert "filter_policy=bloomfilter" in text and "no_block_cache=false" in text
        default = _options_file(str(tmp_path / "p" / shard))
        assert "use_direct_reads=false" in default
        assert "use_direct_io_for_flush_and_compaction=false" in default
        assert "filter_policy=bloomfilter" in default
        assert "data_block_index_type=kDataBlockBinarySearch" in default
        assert "cache_index_and_filter_blocks=false" in default
        bare_text = _options_file(str(tmp_path / "b" / shard))
        assert "filter_policy=nullptr" in bare_text and "no_block_cache=true" in bare_text


def test_a_bounded_block_cache_is_one_cache_for_the_store(tmp_path):
    spec = te.storage.RocksDB(str(tmp_path), shards=3, direct_reads=True, block_cache_bytes=4 << 20)
    a, b = spec.open("a", W, CPU), spec.open("b", W, CPU)
    keys = torch.arange(3000)
    a.set(keys, torch.randn(3000, W))
    b.set(keys, torch.randn(3000, W))
    a.flush()
    b.flush()
    cache = a.store.block_cache
    assert cache is b.store.block_cache and cache is not None
    assert a.get(keys).found.all() and b.get(keys).found.all()
    assert 0 < cache.get_usage() <= 4 << 20  # the reads went through it, within its bound
    a.close()
    b.close()


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(direct_reads=1), TypeError, "direct_reads must be True or False"),
        (dict(direct_writes="yes"), TypeError, "direct_writes must be True or False"),
        (dict(block_cache_bytes=-1), ValueError, "block_cache_bytes must be an int >= 0"),
        (dict(block_cache_bytes="1GiB"), ValueError, "block_cache_bytes must be an int >= 0"),
        (dict(block_cache_bytes=1.5e9), ValueError, "block_cache_bytes must be an int >= 0"),
        (dict(bloom_bits_per_key=-2), ValueError, "bloom_bits_per_key must be an int >= 0"),
        (dict(bloom_bits_per_key=True), ValueError, "bloom_bits_per_key must be an int >= 0"),
        (dict(tuning="fast"), ValueError, "tuning must be one of"),
    ],
)
def test_bad_options_are_refused_before_anything_is_made(tmp_path, kw, error, match):
    path = tmp_path / "store"
    with pytest.raises(error, match=match):
        te.storage.RocksDB(str(path), **kw)
    assert not path.exists()


@pytest.mark.faults
def test_a_tuned_store_recovers_from_a_full_disk(tmpfs):
    """The reopen after a failed write keeps the options and the shared block cache: a full disk
    fails the write; once the disk grows, the same write succeeds, and every row is there."""
    from tests.storage.conftest import remount
    from tieredemb.storage.errors import BackendError

    disk = tmpfs("2m")
    probe = os.path.join(disk, "probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600))
    except OSError as e:
        pytest.skip(f"this kernel's tmpfs refuses O_DIRECT: {e}")
    os.unlink(probe)
    spec = te.storage.RocksDB(os.path.join(disk, "db"), shards=2, **OPTIONS["all"])
    backend = spec.open("t", W, CPU)
    cache = backend.store.block_cache
    ref = DictBackend(W)
    gen = torch.Generator().manual_seed(1)
    failed = None
    for i in range(60):  # 60 x 4,000 rows x 32 bytes: 7.7 MB, more than the disk
        keys, rows = torch.arange(i * 4000, (i + 1) * 4000), torch.randn(4000, W, generator=gen)
        try:
            backend.set(keys, rows)
            backend.flush()
        except BackendError as e:
            assert "No space left" in str(e)
            failed = keys, rows
            break
        ref.set(keys, rows)
    assert failed is not None, "the disk never filled"
    remount(disk, "size=64m")
    backend.set(*failed)  # reopened inside, with the same options
    ref.set(*failed)
    assert backend.store.block_cache is cache and not backend.store.failed
    backend.flush()
    _same_as_dict(backend, ref)
    backend.close()
    again = te.storage.RocksDB(os.path.join(disk, "db"), shards=2, existing="reuse", **OPTIONS["all"])
    reopened = again.open("t", W, CPU)
    _same_as_dict(reopened, ref)
    reopened.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_refused_direct_open_says_what_to_do(tmp_path, monkeypatch, direct):
    """What RocksDB answers on a file system without O_DIRECT (simulated: no such file system here)
    comes out as a BackendError that names the option to turn off, only when direct I/O is on."""
    from tieredemb.storage.errors import BackendError
    from tieredemb.storage.rocksdb import RocksDBStore

    def refused(self, read_only=False):
        raise RuntimeError("Invalid argument: Direct I/O is not supported by the specified DB.")

    monkeypatch.setattr(RocksDBStore, "_open_dbs", refused)
    with pytest.raises(BackendError) as info:
        te.storage.RocksDB(str(tmp_path / "s"), direct_reads=direct).open("t", W, CPU)
    assert str(tmp_path / "s") in str(info.value) and "Direct I/O is not supported" in str(info.value)
    assert ("pass direct_reads=False" in str(info.value)) is direct
