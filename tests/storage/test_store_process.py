"""StoreProcess (``te.storage.RocksDB(process=True)``): a RocksDB store served by a process per shard.

Against a dict of (table, key) -> row over random calls, two groups of one spec sharing the
processes, 16-bit rows, errors raised in the caller with their type, a shard's process killed
mid-run (started again with every row it had acknowledged), a scan cut by that, a collection
trained over it equal to one over RocksDB in-process, the files opened in-process after, and the
processes leaving once their parent is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tieredemb as te
from tieredemb.storage.errors import BackendError, ExistingRowsError
from tieredemb.storage.store_process import StoreProcess

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


def _rows(n: int, width: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _scan(group, t: int) -> dict[int, torch.Tensor]:
    return {k: r for keys, rows in group.table(t).scan(3) for k, r in zip(keys.tolist(), rows)}


calls = st.lists(st.tuples(st.sampled_from(["set", "get", "delete", "flush"]),
                           st.lists(st.tuples(st.integers(0, 1), st.integers(0, 30)), max_size=8)),
                 min_size=1, max_size=20)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=calls)
def test_a_store_in_its_own_process_answers_as_a_dict(ops, tmp_path_factory) -> None:
    where = str(tmp_path_factory.mktemp("db"))
    group = te.storage.RocksDB(where, shards=2, process=True).open_group(["a", "b"], 5, CPU)
    assert isinstance(group, StoreProcess)
    ref: dict[tuple[int, int], torch.Tensor] = {}
    try:
        for n, (op, pairs) in enumerate(ops):
            tables = torch.tensor([t for t, _ in pairs], dtype=torch.int64)
            keys = torch.tensor([k for _, k in pairs], dtype=torch.int64)
            if op == "set":
                rows = _rows(len(pairs), 5, n)
                group.set(keys, tables, rows)
                ref.update({p: r for p, r in zip(pairs, rows)})
            elif op == "get":
                got = group.get(keys, tables)
                for i, p in enumerate(pairs):
                    assert bool(got.found[i]) == (p in ref)
                    assert torch.equal(got.rows[i], ref.get(p, torch.zeros(5)))
            elif op == "delete":
                group.delete(keys, tables)
                for p in pairs:
                    ref.pop(p, None)
            else:
                group.flush()
        for t in (0, 1):
            held = {k: r for (tt, k), r in ref.items() if tt == t}
            got = _scan(group, t)
            assert sorted(got) == sorted(held) and all(torch.equal(got[k], held[k]) for k in held)
            keys = [k for part in group.table(t).scan_keys(3) for k in part.tolist()]
            assert sorted(keys) == sorted(held)  # the keys alone, each once
            assert group.table(t).size() == len(held)
    finally:
        group.close()


def test_groups_of_one_spec_share_one_child_and_16_bit_rows_travel_exactly(tmp_path) -> None:
    spec = te.storage.RocksDB(str(tmp_path / "db"), shards=2, process=True)
    wide = spec.open_group(["w"], 9, CPU)
    half = spec.open_group(["h0", "h1"], 4, CPU, torch.bfloat16)
    shards = wide._shards
    assert wide._shards is half._shards is shards and len(shards.children) == 2
    assert all(c.process.poll() is None for c in shards.children)
    keys = torch.arange(50)
    wide.set(keys, torch.zeros_like(keys), _rows(50, 9, 1))
    rows = _rows(50, 4, 2, torch.bfloat16)
    half.set(keys, keys % 2, rows)
    got = half.get(keys, keys % 2)
    assert got.rows.dtype == torch.bfloat16 and torch.equal(got.rows, rows) and bool(got.found.all())
    assert torch.equal(wide.get(keys, torch.zeros_like(keys)).rows, _rows(50, 9, 1))
    wide.close()
    assert all(c.process.poll() is None for c in shards.children)  # the other group still uses them
    half.close()
    assert [c.process.wait(timeout=30) for c in shards.children] == [0, 0]
    # the same files in-process
    store = te.storage.RocksDB(str(tmp_path / "db"), shards=2, existing="reuse").open_group(
        ["h0", "h1"], 4, CPU, torch.bfloat16)
    assert torch.equal(store.get(keys, keys % 2).rows, rows)
    store.close()


def test_errors_in_the_child_are_raised_in_the_caller_with_their_type(tmp_path) -> None:
    path = str(tmp_path / "db")
    group = te.storage.RocksDB(path, shards=2, process=True).open_group(["a"], 3, CPU)
    group.set(torch.tensor([1]), torch.tensor([0]), torch.ones(1, 3))
    with pytest.raises(ValueError, match="no table verb"):
        group.everywhere(0, "compact")
    with pytest.raises(BackendError, match="get failed") as info:  # as in-process: RocksDB's errors
        group.get(torch.tensor([1]), torch.tensor([3]))  # a table the group does not have
    assert "in the store's process" in "".join(getattr(info.value, "__notes__", []))
    assert bool(group.get(torch.tensor([1]), torch.tensor([0])).found.all())  # still serving
    group.close()
    with pytest.raises(ExistingRowsError, match="already holds rows"):
        te.storage.RocksDB(path, shards=2, process=True).open_group(["a"], 3, CPU)
    with pytest.raises(ValueError, match="cache_rows"):
        te.storage.RocksDB(path, process=True, cache_rows=8)
    with pytest.raises(TypeError, match="process"):
        te.storage.RocksDB(path, process="yes")


def test_a_killed_child_is_started_again_with_every_row_it_acknowledged(tmp_path) -> None:
    group = te.storage.RocksDB(str(tmp_path / "db"), shards=2, process=True).open_group(["a", "b"], 4, CPU)
    keys = torch.arange(300)
    group.set(keys, keys % 2, _rows(300, 4, 3))
    scan = group.table(0).scan(16)
    next(scan)  # (shard 0's rows first)
    child = group._shards.children[0]
    first = child.process
    first.send_signal(signal.SIGKILL)
    first.wait()
    got = group.get(keys, keys % 2)  # the call finds shard 0's process gone, starts another, asks again
    assert child.process is not first and bool(got.found.all())
    assert torch.equal(got.rows, _rows(300, 4, 3))
    with pytest.raises(BackendError, match="started again"):
        next(scan)  # a scan of the dead process cannot go on
    assert len(_scan(group, 1)) == 150
    group.close()


def test_a_collection_over_a_store_process_trains_as_one_over_rocksdb_in_process(tmp_path) -> None:
    tables = [te.TableConfig("t", 4, ["f"], num_embeddings=400)]

    def train(process: bool):
        storage = te.StorageConfig(hbm_budget=8 * 12 * 4, host_budget=16 * 12 * 4, bucket_width=4,
                                   segment_rows=8, backing=te.storage.RocksDB(
                                       str(tmp_path / f"db{int(process)}"), shards=2, process=process))
        ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.Adagrad(lr=0.1), storage=storage, seed=1)
        gen = torch.Generator().manual_seed(0)
        for _ in range(15):
            kjt = te.KeyedJaggedTensor(["f"], torch.randint(0, 400, (24,), generator=gen),
                                       lengths=torch.full((6,), 4))
            ebc.read_ahead(kjt)
            ebc(kjt).values().pow(2).sum().backward()
        ebc.flush()
        rows = ebc.export("t")
        ebc.close()
        order = torch.argsort(rows.keys)
        return rows.keys[order], rows.weights[order], rows.optimizer_state[order]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)


PARENT = """
import sys, torch
import tieredemb as te
group = te.storage.RocksDB(sys.argv[1], shards=2, process=True).open_group(["t"], 4, torch.device("cpu"))
group.set(torch.arange(100), torch.zeros(100, dtype=torch.int64), torch.ones(100, 4))
print(*[c.process.pid for c in group._shards.children], flush=True)
sys.stdin.readline()
"""


def test_the_child_closes_the_store_and_leaves_when_its_parent_is_killed(tmp_path) -> None:
    path = str(tmp_path / "db")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    try:
        children = [int(pid) for pid in parent.stdout.readline().split()]
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert len(children) == 2
    deadline = time.monotonic() + 60
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, children)), "a store process outlived its parent"
    store = te.storage.RocksDB(path, shards=2, existing="reuse").open("t", 4, CPU)
    try:
        got = store.get(torch.arange(100))
        assert bool(got.found.all()) and torch.equal(got.rows, torch.ones(100, 4))
    finally:
        store.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) has left
        return f.read().split(")")[-1].split()[0] != "Z"


def test_a_call_interrupted_before_its_answer_leaves_the_next_call_its_own(tmp_path, monkeypatch) -> None:
    """A KeyboardInterrupt between a request and its answer: the connection owing the answer is
    dropped, so the next call does not read the old answer as its own."""
    import tieredemb.storage.store_process as module

    group = te.storage.RocksDB(str(tmp_path / "db"), shards=2, process=True).open_group(["a"], 3, CPU)
    keys = torch.arange(40)
    group.set(keys, torch.zeros_like(keys), _rows(40, 3, 5))
    real = module._recv

    def interrupted(sock):
        monkeypatch.setattr(module, "_recv", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "_recv", interrupted)
    with pytest.raises(KeyboardInterrupt):
        group.get(keys, torch.zeros_like(keys))
    got = group.get(keys[:7], torch.zeros(7, dtype=torch.int64))  # another call: its own answer
    assert got.rows.shape == (7, 3) and torch.equal(got.rows, _rows(40, 3, 5)[:7])
    group.close()
