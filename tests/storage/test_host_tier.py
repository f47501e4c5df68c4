"""HostTierGroup (a write-back host-memory tier in front of a store) against a dict of key -> row.

Random sequences of get / set / delete / flush / scan / size / read_ahead on a tier of 1 to 4 rows
(so nearly every call evicts), over the dict backend, RocksDB on disk and a real redis-server; then
the eviction order, the read-ahead race, failures of reads ahead and of write-downs, and a process
killed mid-training.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tieredemb as te
from tests.storage.conftest import redis_server  # noqa: F401 (fixture)
from tieredemb.storage.backend import DictBackend, Fetched, GroupStore
from tieredemb.storage.errors import BackendError
from tieredemb.storage.host_tier import HostTierGroup

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


def _open(kind: str, url: str | None, where: str, existing: str = "clear") -> GroupStore:
    if kind == "dict":
        return GroupStore([DictBackend(W)])
    if kind == "rocksdb":
        return te.storage.RocksDB(where, shards=2, existing=existing).open_group(["t"], W, CPU)
    return te.storage.Redis(url, existing=existing).open_group(["t"], W, CPU)


def _tier(below: GroupStore, capacity: int, eviction: str = "lru", device: str = "cpu") -> HostTierGroup:
    return HostTierGroup(below, [capacity], [eviction], device)


def _check_scan(table, ref: dict[int, torch.Tensor]) -> None:
    seen: dict[int, torch.Tensor] = {}
    for keys, rows in table.scan(chunk_rows=2):
        for k, row in zip(keys.tolist(), rows):
            assert k not in seen, f"scan gave key {k} twice"
            seen[k] = row
    assert sorted(seen) == sorted(ref)
    for k, row in ref.items():
        assert torch.equal(seen[k], row), k


def _held(tier: HostTierGroup) -> list[int]:
    return sorted(tier.rows.table_rows(0)[0].tolist())


def _run(tier: HostTierGroup, ops, ref: dict[int, torch.Tensor]) -> None:
    table = tier.table(0)
    for n, (op, keys) in enumerate(ops):
        k = torch.tensor(keys, dtype=torch.int64)
        if op == "set":
            rows = torch.arange(len(keys) * W, dtype=torch.float32).reshape(-1, W) + 100 * n
            table.set(k, rows)
            for key, row in zip(keys, rows):
                ref[key] = row.clone()
        elif op == "get":
            got = table.get(k)
            got = Fetched(got.rows.cpu(), got.found.cpu())
            for i, key in enumerate(keys):
                assert bool(got.found[i]) == (key in ref), key
                want = ref.get(key, torch.zeros(W))
                assert torch.equal(got.rows[i], want), (key, got.rows[i], want)
        elif op == "delete":
            table.delete(k)
            for key in keys:
                ref.pop(key, None)
        elif op == "read_ahead":
            table.read_ahead(k)
        elif op == "flush":
            table.flush()
        elif op == "scan":
            _check_scan(table, ref)
        else:
            assert table.size() == len(ref)


@pytest.mark.parametrize("kind", ["dict", "rocksdb", "redis"])
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_host_tier_matches_a_dict(kind, eviction, request) -> None:
    url = request.getfixturevalue("redis_server") if kind == "redis" else None

    @settings(max_examples=25 if kind == "dict" else 12, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(capacity=st.integers(1, 4), ops=st.lists(op_st, min_size=1, max_size=25))
    def check(capacity, ops) -> None:
        with tempfile.TemporaryDirectory() as where:
            below = _open(kind, url, where)
            tier = _tier(below, capacity, eviction)
            ref: dict[int, torch.Tensor] = {}
            try:
                _run(tier, ops, ref)
                _check_scan(tier.table(0), ref)
                assert tier.table(0).size() == len(ref)
                tier.close()  # writes every dirty row down: the store alone holds the table
                store = _open(kind, url, where, existing="reuse") if kind != "dict" else below
                got = {k: r for keys, rows in store.table(0).scan(4) for k, r in zip(keys.tolist(), rows)}
                assert sorted(got) == sorted(ref)
                assert all(torch.equal(got[k], ref[k]) for k in ref)
                store.close()
            finally:
                tier.close()

    check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_host_tier_on_the_gpu_matches_a_dict(eviction) -> None:
    """The index on the GPU, the rows pinned and moved by the Triton kernels."""

    @settings(max_examples=15, deadline=None)
    @given(capacity=st.integers(1, 4), ops=st.lists(op_st, min_size=1, max_size=25))
    def check(capacity, ops) -> None:
        below = _open("dict", None, "")
        tier = _tier(below, capacity, eviction, "cuda")
        assert tier.device.type == "cuda"
        ref: dict[int, torch.Tensor] = {}
        _run(tier, ops, ref)
        _check_scan(tier.table(0), ref)
        tier.close()
        got = {k: r for keys, rows in below.table(0).scan(4) for k, r in zip(keys.tolist(), rows)}
        assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)

    check()


@pytest.mark.parametrize("eviction, kept", [("lru", [0, 1, 2, 4, 5]), ("lfu", [0, 1, 2, 3, 4])])
def test_a_table_over_its_capacity_keeps_its_most_used_rows(eviction, kept) -> None:
    """Capacity 5: six rows held, the next call keeps five (the capacity less a sixteenth, rounded
    down). LRU drops the row used longest ago (3: read second, then 4 read again and 5 written); LFU
    the row used least (5 written once; 0 used five times, 1 four, 2 three, 3 and 4 twice)."""
    below = GroupStore([DictBackend(W)])
    tier = _tier(below, 5, eviction)
    table = tier.table(0)
    table.set(torch.arange(5), torch.ones(5, W))
    for keys in ([0, 1, 2, 3], [0, 1, 2], [0, 1], [0], [4]):
        table.get(torch.tensor(keys))
    table.set(torch.tensor([5]), 2 * torch.ones(1, W))
    assert _held(tier) == [0, 1, 2, 3, 4, 5]  # room is made at the next call, before it
    tier.flush()
    assert _held(tier) == kept
    assert len(below.backends[0]._rows) == 6  # the row that left was written down first
    s = table.tier_stats()
    assert (s.rows, s.capacity, s.evictions, s.dirty) == (5, 5, 1, 0)
    _check_scan(table, {**{k: torch.ones(W) for k in range(5)}, 5: 2 * torch.ones(W)})
    tier.close()


def test_clean_rows_leave_without_a_write() -> None:
    """Rows read ahead and never written are the store's: evicting them writes nothing."""
    store = _CountingStore()
    store.set(torch.arange(8), torch.ones(8, W))
    tier = _tier(GroupStore([store]), 4)
    tier.table(0).read_ahead(torch.arange(8))
    tier.maintain()
    tier.finish_reads()
    assert _held(tier) == list(range(8))
    writes = store.writes
    tier.maintain()  # over capacity: 4 go, all clean
    assert len(_held(tier)) == 4 and store.writes == writes
    tier.close()


def test_a_row_whose_version_wraps_is_still_dirty_and_written_down() -> None:
    """Versions are 32 bits, compared for equality: a write past the largest wraps it, and the row
    still reads as dirty (not as the store's) and goes down at flush."""
    below = GroupStore([DictBackend(W)])
    tier = _tier(below, 4)
    table = tier.table(0)
    table.set(torch.tensor([1]), torch.ones(1, W))
    tier.flush()
    addresses, _ = tier.rows.where(torch.tensor([1]), torch.tensor([0]))
    tier.rows.version[addresses] = tier.rows.clean[addresses] = 2**31 - 1  # clean, at the top
    assert not bool(tier.rows.dirty(addresses).any())
    table.set(torch.tensor([1]), 2 * torch.ones(1, W))
    assert int(tier.rows.version[addresses]) == -(2**31) and bool(tier.rows.dirty(addresses).all())
    tier.flush()
    assert torch.equal(below.backends[0].get(torch.tensor([1])).rows, 2 * torch.ones(1, W))
    tier.close()


def test_the_store_is_not_asked_for_keys_it_never_held() -> None:
    """Ids seen for the first time miss everywhere: the filter of the store's pairs answers for it."""
    store = _CountingStore()
    store.set(torch.tensor([100]), torch.ones(1, W))  # held before the tier opens
    tier = _tier(GroupStore([store]), 2)
    table = tier.table(0)
    got = table.get(torch.arange(10))
    assert not bool(got.found.any()) and store.asked == 0
    table.set(torch.arange(4), torch.ones(4, W))
    tier.maintain()  # over capacity: written down, then they are the store's
    tier.flush()
    got = table.get(torch.tensor([0, 1, 2, 3, 100, 7]))
    assert got.found.tolist() == [True] * 5 + [False]
    # 100 and the two rows that left host memory, and 7 only as the filter's rare false positive
    assert 3 <= store.asked <= 4
    tier.close()


class _SlowStore(DictBackend):
    """A dict backend whose ``set`` waits for ``gate`` (a store writing slower than the tier evicts)."""

    def __init__(self) -> None:
        super().__init__(W)
        self.gate = threading.Event()

    def set(self, keys, rows) -> None:
        self.gate.wait(10)
        super().set(keys, rows)


def test_a_call_waits_for_a_slow_store_rather_than_hold_more_rows() -> None:
    """Capacity 8: at most 1 row on its way down. Four go down and the store does not take them:
    the next call waits until it does, then drops them."""
    store = _SlowStore()
    tier = _tier(GroupStore([store]), 8)
    table = tier.table(0)
    table.set(torch.arange(12), torch.ones(12, W))
    tier.maintain()  # 12 held: 4 go down (to the capacity), the writer waits at the gate
    assert _held(tier) == list(range(12)) and len(store._rows) == 0
    threading.Timer(0.3, store.gate.set).start()
    t0 = time.perf_counter()
    tier.maintain()
    assert time.perf_counter() - t0 > 0.2  # it waited for the store
    assert len(_held(tier)) == 8 and len(store._rows) == 4
    _check_scan(table, {k: torch.ones(W) for k in range(12)})
    tier.close()


class _CountingStore(DictBackend):
    def __init__(self) -> None:
        super().__init__(W)
        self.writes = 0
        self.asked = 0

    def get(self, keys):
        self.asked += keys.numel()
        return super().get(keys)

    def set(self, keys, rows) -> None:
        self.writes += keys.numel()
        super().set(keys, rows)


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
    """Read ahead of key 5 in flight (holding the old row); meanwhile 5 is set, evicted, written
    down to the store and dropped from host memory. The read then lands: its row of 5 is dropped,
    and a get answers with the new row."""
    store = GatedStore()
    store.set(torch.tensor([5]), torch.full((1, W), 1.0))  # the old row
    tier = _tier(GroupStore([store]), 1)
    table = tier.table(0)
    store.gated = True
    table.read_ahead(torch.tensor([5]))
    tier.maintain()  # the read starts
    assert store.entered.wait(10)
    store.gated = False
    table.set(torch.tensor([5]), torch.full((1, W), 2.0))  # the new row
    table.set(torch.tensor([6]), torch.full((1, W), 3.0))
    tier.flush()  # 5 evicted (dirty): written down, then dropped; 6 written down by the flush
    assert _held(tier) == [6] and torch.equal(store.get(torch.tensor([5])).rows, torch.full((1, W), 2.0))
    store.gate.set()
    tier.finish_reads()
    assert _held(tier) == [6]
    got = table.get(torch.tensor([5]))
    assert bool(got.found[0]) and torch.equal(got.rows, torch.full((1, W), 2.0))
    s = table.tier_stats()
    assert (s.read_ahead_dropped, s.read_ahead_rows) == (1, 0)
    _check_scan(table, {5: torch.full((W,), 2.0), 6: torch.full((W,), 3.0)})
    tier.close()


def test_a_read_ahead_of_a_deleted_key_does_not_bring_it_back() -> None:
    store = GatedStore()
    store.set(torch.tensor([5]), torch.full((1, W), 1.0))
    tier = _tier(GroupStore([store]), 2)
    table = tier.table(0)
    store.gated = True
    table.read_ahead(torch.tensor([5]))
    tier.maintain()
    assert store.entered.wait(10)
    store.gated = False
    table.delete(torch.tensor([5]))
    store.gate.set()
    tier.finish_reads()
    assert not bool(table.get(torch.tensor([5])).found[0])
    assert table.size() == 0
    tier.close()


def test_reads_ahead_are_served_from_host_memory() -> None:
    store = DictBackend(W)
    store.set(torch.arange(8), torch.arange(8 * W, dtype=torch.float32).reshape(8, W))
    tier = _tier(GroupStore([store]), 8)
    table = tier.table(0)
    table.read_ahead(torch.arange(4))
    tier.maintain()  # located, read on a reader thread
    tier.finish_reads()
    got = table.get(torch.arange(4))
    assert torch.equal(got.rows, store.get(torch.arange(4)).rows)
    s = table.tier_stats()
    assert (s.read_ahead_rows, s.read_ahead_hits, s.hits, s.misses, s.dirty) == (4, 4, 4, 0, 0)
    table.read_ahead(torch.arange(6))  # only the two it lacks are read
    tier.maintain()
    tier.finish_reads()
    assert table.tier_stats().read_ahead_rows == 6
    tier.close()


def _full_with_0_to_3_oldest(store: DictBackend, capacity: int):
    """An LRU tier of ``capacity`` rows over ``store`` (given rows of its own first: reads ahead run),
    holding keys 0..capacity-1 dirty, 0-3 the least recently used. Returns the tier, its table and
    ``capacity + 4`` distinct rows (the first ``capacity`` held)."""
    store.set(torch.arange(100, 104), torch.zeros(4, W))
    tier = _tier(GroupStore([store]), capacity)
    table = tier.table(0)
    rows = torch.arange((capacity + 4) * W, dtype=torch.float32).reshape(capacity + 4, W)
    table.set(torch.arange(capacity), rows[:capacity])
    table.get(torch.arange(4, capacity))
    return tier, table, rows


def test_rows_a_read_ahead_finds_held_are_evicted_last() -> None:
    """LRU: rows 0-3 are the least recently used of the 16 held when a read ahead asks for them;
    it marks them used, so the eviction that follows takes others, and their batch finds them in
    host memory without reading the store (unmarked, they would leave first and the batch read them
    back from the store on its own path)."""
    store = CountingStore()
    tier, table, rows = _full_with_0_to_3_oldest(store, 16)
    table.read_ahead(torch.arange(4))
    tier.maintain()  # located: all held, nothing to read
    tier.finish_reads()
    table.set(torch.arange(16, 20), rows[16:])  # 20 held: the next call keeps 15
    tier.maintain()
    tier.flush()
    assert len(_held(tier)) == 15 and all(k in _held(tier) for k in range(4)), _held(tier)
    gets = store.gets
    got = table.get(torch.arange(4))
    assert store.gets == gets and torch.equal(got.rows, rows[:4])
    tier.close()


def test_a_tier_that_holds_every_row_of_its_store_reads_nothing_ahead(monkeypatch) -> None:
    """Over a store empty at open, every row the store gets (a flush) stays in host memory: a read
    ahead has nothing to bring (``reads_ahead`` False): its pairs are not even located, nor a
    reader thread started. Once a row has left host memory for the store (an eviction), reads ahead
    bring it back. A store that held rows at open is read ahead from the start."""
    located = []
    lacking = HostTierGroup._lacking
    monkeypatch.setattr(HostTierGroup, "_lacking",
                        lambda self, *a, **k: located.append(1) or lacking(self, *a, **k))
    store = CountingStore()
    tier = _tier(GroupStore([store]), 4)
    table = tier.table(0)
    table.set(torch.arange(4), torch.ones(4, W))
    tier.flush()  # the store holds rows 0-3 now; so does host memory
    assert not tier.reads_ahead() and store.gets == 0
    table.read_ahead(torch.arange(6))
    tier.maintain()
    tier.finish_reads()
    assert store.gets == 0 and not located
    assert torch.equal(table.get(torch.arange(4)).rows, torch.ones(4, W)) and store.gets == 0
    table.set(torch.arange(4, 8), torch.full((4, W), 2.0))  # over capacity: rows 0-3 leave
    tier.maintain()
    tier.settle()
    tier.flush()
    assert tier.reads_ahead()
    gone = [k for k in range(8) if k not in _held(tier)]
    assert gone, _held(tier)
    table.read_ahead(torch.tensor(gone))
    tier.maintain()
    tier.finish_reads()
    assert located and store.gets > 0 and table.tier_stats().read_ahead_rows == len(gone)
    tier.close()
    reopened = _tier(GroupStore([store]), 4)  # the store holds rows at open
    assert reopened.reads_ahead()
    reopened.close()


class CountingStore(DictBackend):
    """A dict backend that counts its reads."""

    def __init__(self) -> None:
        super().__init__(W)
        self.gets = 0

    def get(self, keys):
        self.gets += 1
        return super().get(keys)


class GatedWrites(CountingStore):
    """A counting dict backend whose ``set`` waits for ``gate`` while ``gated`` (a write-down held
    on its way)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.gated = False

    def set(self, keys, rows) -> None:
        if self.gated:
            self.gate.wait(10)
        super().set(keys, rows)


def test_a_row_on_its_way_down_that_a_read_ahead_wants_stays() -> None:
    """LRU, 64 rows a table: 68 dirty rows held, 0-3 the least recently used; the eviction takes 8,
    0-3 among them, and while their write-down is on its way a read ahead asks for 0-3. Once
    written, 0-3 stay in host memory (clean) and the others go: their batch reads no store (before,
    every row of the write-down left once written, and the batch read 0-3 back from the store)."""
    store = GatedWrites()
    tier, table, rows = _full_with_0_to_3_oldest(store, 64)
    store.gated = True
    table.set(torch.arange(64, 68), rows[64:])
    tier.maintain()  # 68 held: 8 evicted (dirty: on their way down, the writer held at the gate)
    assert len(_held(tier)) == 68
    table.read_ahead(torch.arange(4))
    tier.maintain()  # located: all held (marked used), nothing to read
    store.gated = False
    store.gate.set()
    tier.flush()
    held = _held(tier)
    assert len(held) == 64 and all(k in held for k in range(4)), held
    assert torch.equal(store.get(torch.arange(4)).rows, rows[:4])  # written down all the same
    gets = store.gets
    got = table.get(torch.arange(4))
    assert store.gets == gets and torch.equal(got.rows, rows[:4])
    _check_scan(table, dict(zip(range(68), rows)) | {k: torch.zeros(W) for k in range(100, 104)})
    tier.close()


def test_a_batch_before_its_read_ahead_has_landed_waits_for_it() -> None:
    """A read ahead of 0-3 is still in flight when their batch asks for them: the batch waits for it
    and takes its rows, rather than asking the store for the same rows again (a store as slow as a
    disk reads the same rows twice, and the reads ahead fall further behind)."""
    store = GatedStore()
    rows = torch.arange(8 * W, dtype=torch.float32).reshape(8, W)
    store.set(torch.arange(8), rows)
    tier = _tier(GroupStore([store]), 16)
    table = tier.table(0)
    asked = []
    get = store.get
    store.get = lambda keys: asked.append(keys.tolist()) or get(keys)  # the keys of each store read
    store.gated = True
    table.read_ahead(torch.arange(4))
    tier.maintain()  # the read starts, held at the gate
    assert store.entered.wait(10)
    store.gated = False
    threading.Timer(0.2, store.gate.set).start()
    got = table.get(torch.tensor([2, 0, 6]))  # 6 was not read ahead: the store's
    assert torch.equal(got.rows, rows[[2, 0, 6]]) and bool(got.found.all())
    assert sorted(map(sorted, asked)) == [[0, 1, 2, 3], [6]], asked
    s = table.tier_stats()
    assert (s.misses, s.read_ahead_rows, s.read_ahead_hits, s.read_ahead_late) == (1, 4, 2, 2), s
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
    store.set(torch.tensor([1, 2]), torch.ones(2, W))  # before the tier opens: its filter learns them
    tier = _tier(GroupStore([store]), 4)
    table = tier.table(0)
    store.down = True
    with caplog.at_level(logging.WARNING):
        for key in (1, 2):
            table.read_ahead(torch.tensor([key]))
            tier.maintain()
        tier.finish_reads()
    assert sum("read ahead" in r.message for r in caplog.records) == 1
    with pytest.raises(BackendError, match="reading 1 rows from the store failed") as info:
        table.get(torch.tensor([1]))
    assert isinstance(info.value.__cause__, OSError) and "store down" in str(info.value.__cause__)
    store.down = False
    got = table.get(torch.tensor([1, 3]))
    assert got.found.tolist() == [True, False] and torch.equal(got.rows[0], torch.ones(W))
    tier.close()


def test_a_failed_write_down_keeps_its_rows_and_is_retried() -> None:
    store = FailingStore()
    tier = _tier(GroupStore([store]), 1)
    table = tier.table(0)
    store.down = True
    table.set(torch.tensor([1]), torch.ones(1, W))
    table.set(torch.tensor([2]), 2 * torch.ones(1, W))  # over capacity: 1 and 2 go down at the next call
    # scan answers from host memory (checkpoints, export): the rows stay until the store takes them
    _check_scan(table, {1: torch.ones(W), 2: 2 * torch.ones(W)})
    with pytest.raises(BackendError, match="kept in host memory"):
        tier.flush()
    with pytest.raises(BackendError, match="kept in host memory"):
        table.get(torch.tensor([1, 2]))
    with pytest.raises(BackendError, match="kept in host memory"):
        table.set(torch.tensor([3]), 3 * torch.ones(1, W))
    assert _held(tier) == [1, 2]  # refused before any change
    store.down = False
    table.set(torch.tensor([3]), 3 * torch.ones(1, W))  # the retry goes through first
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
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
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
