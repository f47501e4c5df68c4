"""HostTier (a write-back host-memory tier in front of a store) against a dict of key -> row.

Random sequences of get / set / delete / flush / scan / size / read_ahead on a tier of 1 to 4 slots
(so nearly every call evicts), over the dict backend, RocksDB on disk and a real redis-server; then
the read-ahead race, failures of reads ahead and of write-downs, and a process killed mid-training.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tieredemb as te
from tests.storage.conftest import redis_server  # noqa: F401 (fixture)
from tieredemb.storage.backend import DictBackend, Fetched
from tieredemb.storage.errors import BackendError
from tieredemb.storage.host_tier import HostTier

W = 3
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]

keys_st = st.lists(st.integers(0, 9), min_size=0, max_size=6)
op_st = st.one_of(
    st.tuples(st.just("set"), keys_st),
    st.tuples(st.just("get"), keys_st),
    st.tuples(st.just("delete"), keys_st),
    st.tuples(st.just("read_ahead"), keys_st),
    st.tuples(st.just("flush"), st.just([])),
    st.tuples(st.just("scan"), st.just([])),
    st.tuples(st.just("size"), st.just([])),
)


def _open(kind: str, url: str | None, where: str, existing: str = "clear"):
    if kind == "dict":
        return DictBackend(W)
    if kind == "rocksdb":
        return te.storage.RocksDB(where, shards=2, existing=existing).open("t", W, CPU)
    return te.storage.Redis(url, existing=existing).open("t", W, CPU)


def _check_scan(tier: HostTier, ref: dict[int, torch.Tensor]) -> None:
    seen: dict[int, torch.Tensor] = {}
    for keys, rows in tier.scan(chunk_rows=2):
        for k, row in zip(keys.tolist(), rows):
            assert k not in seen, f"scan gave key {k} twice"
            seen[k] = row
    assert sorted(seen) == sorted(ref)
    for k, row in ref.items():
        assert torch.equal(seen[k], row), k


def _run(tier: HostTier, ops, ref: dict[int, torch.Tensor]) -> None:
    for n, (op, keys) in enumerate(ops):
        k = torch.tensor(keys, dtype=torch.int64)
        if op == "set":
            rows = torch.arange(len(keys) * W, dtype=torch.float32).reshape(-1, W) + 100 * n
            tier.set(k, rows)
            for key, row in zip(keys, rows):
                ref[key] = row.clone()
        elif op == "get":
            got = tier.get(k)
            for i, key in enumerate(keys):
                assert bool(got.found[i]) == (key in ref), key
                want = ref.get(key, torch.zeros(W))
                assert torch.equal(got.rows[i], want), (key, got.rows[i], want)
        elif op == "delete":
            tier.delete(k)
            for key in keys:
                ref.pop(key, None)
        elif op == "read_ahead":
            tier.read_ahead(k)
        elif op == "flush":
            tier.flush()
        elif op == "scan":
            _check_scan(tier, ref)
        else:
            assert tier.size() == len(ref)


@pytest.mark.parametrize("kind", ["dict", "rocksdb", "redis"])
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_host_tier_matches_a_dict(kind, eviction, request) -> None:
    url = request.getfixturevalue("redis_server") if kind == "redis" else None

    @settings(max_examples=25 if kind == "dict" else 12, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(capacity=st.integers(1, 4), ops=st.lists(op_st, min_size=1, max_size=25))
    def check(capacity, ops) -> None:
        with tempfile.TemporaryDirectory() as where:
            tier = HostTier(_open(kind, url, where), capacity, eviction)
            ref: dict[int, torch.Tensor] = {}
            try:
                _run(tier, ops, ref)
                _check_scan(tier, ref)
                assert tier.size() == len(ref)
                tier.close()  # writes every dirty row down: the store alone holds the table
                store = _open(kind, url, where, existing="reuse") if kind != "dict" else tier.store
                got = {k: r for keys, rows in store.scan(4) for k, r in zip(keys.tolist(), rows)}
                assert sorted(got) == sorted(ref)
                assert all(torch.equal(got[k], ref[k]) for k in ref)
                store.close()
            finally:
                tier.close()

    check()


class GatedStore(DictBackend):
    """A dict backend whose ``get`` waits for ``gate`` while ``gated`` (a read ahead held in flight)."""

    def __init__(self) -> None:
        super().__init__(W)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.gated = False

    def get(self, keys: torch.Tensor) -> Fetched:
        got = super().get(keys)  # the row as it is when the read is issued
        if self.gated:
            self.entered.set()
            self.gate.wait(10)
        return got


def test_a_read_ahead_racing_a_write_never_brings_the_old_row_back() -> None:
    """Read ahead of key 5 in flight (holding the old row); meanwhile 5 is set, evicted and written
    down to the store, and the tier's slot goes to another key. The read then lands: its row of 5 is
    dropped, and a get answers with the new row."""
    store = GatedStore()
    store.set(torch.tensor([5]), torch.full((1, W), 1.0))  # the old row
    tier = HostTier(store, capacity_rows=1)
    store.gated = True
    tier.read_ahead(torch.tensor([5]))
    assert store.entered.wait(10)
    store.gated = False
    tier.set(torch.tensor([5]), torch.full((1, W), 2.0))  # the new row
    tier.set(torch.tensor([6]), torch.full((1, W), 3.0))  # evicts 5 (dirty): written down
    tier.flush()
    assert torch.equal(store.get(torch.tensor([5])).rows, torch.full((1, W), 2.0))
    store.gate.set()  # the read lands (get waits for it)
    got = tier.get(torch.tensor([5]))
    assert bool(got.found[0]) and torch.equal(got.rows, torch.full((1, W), 2.0))
    assert tier.tier_stats().read_ahead_dropped == 1 and tier.tier_stats().read_ahead_rows == 0
    _check_scan(tier, {5: torch.full((W,), 2.0), 6: torch.full((W,), 3.0)})
    tier.close()


def test_a_read_ahead_of_a_deleted_key_does_not_bring_it_back() -> None:
    store = GatedStore()
    store.set(torch.tensor([5]), torch.full((1, W), 1.0))
    tier = HostTier(store, capacity_rows=2)
    store.gated = True
    tier.read_ahead(torch.tensor([5]))
    assert store.entered.wait(10)
    store.gated = False
    tier.delete(torch.tensor([5]))
    store.gate.set()
    assert not bool(tier.get(torch.tensor([5])).found[0])
    assert tier.size() == 0
    tier.close()


def test_reads_ahead_are_served_from_host_memory() -> None:
    store = DictBackend(W)
    store.set(torch.arange(8), torch.arange(8 * W, dtype=torch.float32).reshape(8, W))
    tier = HostTier(store, capacity_rows=8)
    tier.read_ahead(torch.arange(4))
    got = tier.get(torch.arange(4))  # waits for the read ahead, then answers from host memory
    assert torch.equal(got.rows, store.get(torch.arange(4)).rows)
    s = tier.tier_stats()
    assert (s.read_ahead_rows, s.read_ahead_hits, s.hits, s.misses) == (4, 4, 4, 0)
    tier.close()


class FailingStore(DictBackend):
    """A dict backend whose calls raise while ``down``."""

    def __init__(self) -> None:
        super().__init__(W)
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise OSError("store down")

    def get(self, keys):
        self._check()
        return super().get(keys)

    def set(self, keys, rows):
        self._check()
        super().set(keys, rows)


def test_a_failed_read_ahead_is_logged_once_and_the_real_miss_raises(caplog) -> None:
    store = FailingStore()
    tier = HostTier(store, capacity_rows=4)
    store.down = True
    with caplog.at_level(logging.WARNING):
        tier.read_ahead(torch.tensor([1]))
        tier.read_ahead(torch.tensor([2]))
        tier._wait_reads(None)
    assert sum("read ahead" in r.message for r in caplog.records) == 1
    with pytest.raises(OSError, match="store down"):
        tier.get(torch.tensor([1]))
    store.down = False
    assert not bool(tier.get(torch.tensor([1])).found[0])
    tier.close()


def test_a_failed_write_down_keeps_its_rows_and_is_retried() -> None:
    store = FailingStore()
    tier = HostTier(store, capacity_rows=1)
    store.down = True
    tier.set(torch.tensor([1]), torch.ones(1, W))
    tier.set(torch.tensor([2]), 2 * torch.ones(1, W))  # evicts 1: its write-down fails
    # scan answers with the kept copy (checkpoints, export); calls that need the store raise
    _check_scan(tier, {1: torch.ones(W), 2: 2 * torch.ones(W)})
    with pytest.raises(BackendError, match="kept"):
        tier.get(torch.tensor([1, 2]))
    with pytest.raises(BackendError, match="kept"):
        tier.set(torch.tensor([3]), 3 * torch.ones(1, W))
    assert tier.tier_stats().rows == 1 and 3 not in tier._slot  # refused before any change
    store.down = False
    tier.set(torch.tensor([3]), 3 * torch.ones(1, W))  # the retry goes through first
    tier.flush()
    assert sorted(store._rows) == [1, 2, 3]
    assert all(torch.equal(store._rows[k], float(k) * torch.ones(W)) for k in (1, 2, 3))
    tier.close()


@pytest.mark.parametrize("bad, error", [
    (0, ValueError), (-5, ValueError), ("lots", ValueError), (True, TypeError), (1.5, TypeError)])
def test_bad_host_budgets_are_refused(bad, error, tmp_path) -> None:
    with pytest.raises(error, match="host_budget"):
        te.StorageConfig(hbm_budget=1000, backing=te.storage.RocksDB(str(tmp_path / "db")), host_budget=bad)


def test_host_budget_where_there_is_no_store_below_is_refused(tmp_path) -> None:
    spec = te.storage.RocksDB(str(tmp_path / "db"))
    with pytest.raises(ValueError, match="host_budget.*HostMemory"):
        te.StorageConfig(hbm_budget=1000, backing=te.storage.HostMemory(), host_budget=1000)
    with pytest.raises(ValueError, match="host_budget.*hybrid"):
        te.StorageConfig(hbm_budget=1000, caching=False, backing=spec, host_budget=1000)
    with pytest.raises(ValueError, match="host_budget.*hbm_direct"):
        te.StorageConfig(backing=spec, host_budget=1000)
    tables = [te.TableConfig("t", 4, ["f"], num_embeddings=10)]
    fits = te.StorageConfig(hbm_budget=10**6, backing=spec, host_budget=1000)
    with pytest.raises(ValueError, match="host_budget.*hbm_direct"):
        te.EmbeddingBagCollection(tables, storage=fits)
    assert not (tmp_path / "db").exists()  # refused before the store was opened


@pytest.mark.parametrize("bad", [-1, 1.0, True, "2"])
def test_bad_lookahead_is_refused(bad) -> None:
    ebc = te.EmbeddingBagCollection([te.TableConfig("t", 4, ["f"], num_embeddings=10)])
    with pytest.raises(ValueError, match="lookahead"):
        te.TrainPipeline(ebc, None, lookahead=bad)


def test_read_ahead_refuses_a_batch_of_other_features(tmp_path) -> None:
    ebc = te.EmbeddingBagCollection([te.TableConfig("t", 4, ["f"], num_embeddings=10)])
    with pytest.raises(ValueError, match="unknown: \\['g'\\]"):
        ebc.read_ahead(te.KeyedJaggedTensor(["g"], torch.tensor([1]), lengths=torch.tensor([1])))
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        ebc.read_ahead(torch.tensor([1]))


TRAINER = r"""
import sys, torch, tieredemb as te
from safetensors.torch import save_file
path, out = sys.argv[1], sys.argv[2]
tables = [te.TableConfig("t", 4, ["f"], num_embeddings=400)]
storage = te.StorageConfig(hbm_budget=8 * 4 * 4, backing=te.storage.RocksDB(path, shards=2),
                           host_budget=16 * 4 * 4, bucket_width=4, segment_rows=8)
ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1), storage=storage)
gen = torch.Generator().manual_seed(0)
def step():
    ids = torch.randint(0, 400, (24,), generator=gen)
    kjt = te.KeyedJaggedTensor(["f"], ids, lengths=torch.full((6,), 4))
    ebc(kjt).values().sum().backward()
for _ in range(20):
    step()
ebc.flush()
rows = ebc.export("t")
save_file({"keys": rows.keys, "weights": rows.weights}, out)
for _ in range(int(sys.argv[3])):
    step()
print("flushed", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("steps_after_flush", [0, 10])
def test_a_killed_process_keeps_every_row_flush_wrote(tmp_path, steps_after_flush) -> None:
    """SIGKILL after flush (and more steps): reopened with existing="reuse", the store has every key
    flush wrote; with no step after it, exactly the rows it wrote."""
    from safetensors.torch import load_file

    path, out = str(tmp_path / "db"), str(tmp_path / "rows.safetensors")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, path, out, str(steps_after_flush)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "flushed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    want = load_file(out)
    store = te.storage.RocksDB(path, shards=2, existing="reuse").open("t", 4, CPU)
    try:
        got = store.get(want["keys"])
        assert bool(got.found.all()) and want["keys"].numel() > 16  # more rows than host and device hold
        if steps_after_flush == 0:
            torch.testing.assert_close(got.rows, want["weights"])
    finally:
        store.close()
