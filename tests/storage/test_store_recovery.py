"""Store faults clear, and no row is lost (DESIGN section 8); one writer per store.

Each fault test trains a collection in cache mode over a real store beside a reference that never
sees the fault (the same table in ``hbm_direct``: every configuration computes the same function),
until the store fails. While the fault lasts, training, ``flush`` and ``close`` raise ``BackendError``,
and ``read``, ``export`` and ``te.checkpoint.save`` to another disk return every row the process
holds. Then the fault is cleared: the next call succeeds, the failed step is retried, and after
``close`` the store alone holds every row of the reference.

Faults: a RocksDB disk that fills (a tmpfs of 2 MB) and then grows; RocksDB directories made
immutable (``chattr +i``: no new file, even for root) and then writable; a redis-server killed and
restarted (with its append-only file, so it comes back with its rows); a redis-server full
(``maxmemory`` with ``noeviction``) given more memory. Then the Redis namespace lease: a second live
collection on one namespace is refused, the lease is renewed while its holder lives, a killed
holder's lease expires after its TTL, and ``close`` releases only a lease it still holds.

Run alone: ``python -m pytest -m faults``. Mounting a tmpfs and ``chattr`` need root: without it
these tests skip on a laptop and fail in CI.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tieredemb as te
from tests.storage.conftest import immutable, remount
from tieredemb.storage.errors import BackendError

pytestmark = pytest.mark.faults

DIM = 64
WIDTH = DIM + 1  # RowWiseAdagrad: one accumulator a row
IDS = 20_000
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


def make(backing: te.storage.BackendSpec | None) -> te.EmbeddingBagCollection:
    """The collection under test (cache mode over ``backing``, ~250 rows on the device), or with
    ``backing=None`` the reference (every row on the device)."""
    storage = None if backing is None else te.StorageConfig(hbm_budget="64KiB", backing=backing)
    tables = [te.TableConfig("t", DIM, ["f"], initializer=te.init.Normal(0.0, 0.1))]
    return te.EmbeddingBagCollection(tables, optimizer=te.optim.RowWiseAdagrad(lr=0.1),
                                     storage=storage, seed=0)


def batches(n: int) -> list[te.KeyedJaggedTensor]:
    """Batches of 1,024 ids over 20,000 keys: each evicts (writes down) ~1,000 rows, ~270 KB."""
    gen = torch.Generator().manual_seed(0)
    return [te.KeyedJaggedTensor(["f"], torch.randint(0, IDS, (1024,), generator=gen),
                                 lengths=torch.full((256,), 4)) for _ in range(n)]


def step(ebc: te.EmbeddingBagCollection, kjt: te.KeyedJaggedTensor, i: int) -> None:
    """Training step i: the same gradient for the same step in every collection."""
    out = ebc(kjt).values()
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(i))).sum().backward()


def train(ebc, ref, data: list, start: int = 0, stop: int | None = None) -> None:
    for i in range(start, len(data) if stop is None else stop):
        step(ebc, data[i], i)
        step(ref, data[i], i)


def train_until_fault(ebc, ref, data: list, start: int = 0) -> int:
    """Train both from batch ``start`` until ``ebc`` raises; the index of the batch it failed on
    (which the reference has not taken: the failed step changed nothing)."""
    for i in range(start, len(data)):
        try:
            step(ebc, data[i], i)
        except BackendError:
            return i
        step(ref, data[i], i)
    raise AssertionError("the store never failed")


def full_rows(rows: te.TableRows) -> dict[int, torch.Tensor]:
    return dict(zip(rows.keys.tolist(), torch.cat([rows.weights, rows.optimizer_state], 1).cpu()))


def assert_same_rows(got: dict[int, torch.Tensor], want: dict[int, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), f"{len(set(want) - set(got))} rows missing"
    keys = sorted(want)
    torch.testing.assert_close(torch.stack([got[k] for k in keys]), torch.stack([want[k] for k in keys]))


def assert_holds_every_row(ebc, ref, ckpt: Path) -> None:
    """``read``, ``export`` and ``te.checkpoint.save`` (to another disk) give the reference's rows."""
    want = full_rows(ref.export("t"))
    keys = torch.tensor(sorted(want))
    weights, found = ebc.read("t", keys)
    assert bool(found.all()), f"{int((~found).sum())} of {keys.numel()} rows not found"
    torch.testing.assert_close(weights, torch.stack([want[k][:DIM] for k in keys.tolist()]))
    assert_same_rows(full_rows(ebc.export("t")), want)
    te.checkpoint.save(ebc, ckpt)
    loaded = make(None)
    te.checkpoint.load(loaded, ckpt)
    assert_same_rows(full_rows(loaded.export("t")), want)


def while_the_fault_lasts(ebc, ref, data: list, failed: int, ckpt: Path) -> None:
    with pytest.raises(BackendError):  # the training thread keeps seeing the fault
        step(ebc, data[failed], failed)
    with pytest.raises(BackendError):
        ebc.flush()
    with pytest.raises(BackendError):  # nothing is released while rows are still owed to the store
        ebc.close()
    assert_holds_every_row(ebc, ref, ckpt)


def once_it_clears(ebc, ref, data: list, failed: int, reopen: te.storage.BackendSpec) -> None:
    """The next call succeeds; the failed step and the rest train on; after ``close`` the store
    alone, opened again, holds every row."""
    ebc.flush()
    assert_same_rows(full_rows(ebc.export("t")), full_rows(ref.export("t")))
    train(ebc, ref, data, failed)
    ebc.close()
    backend = reopen.open("t", WIDTH, CPU)
    try:
        stored = {k: r for keys, rows in backend.scan(4096) for k, r in zip(keys.tolist(), rows)}
    finally:
        backend.close()
    assert_same_rows(stored, full_rows(ref.export("t")))


# ------------------------------------------------------------------------------------------ RocksDB
def test_rocksdb_backend_disk_full_then_grown(tmpfs):
    """The store on its own: a disk that fills fails the write that needs room; once it has room,
    the failed write succeeds, and every row written is there after a reopen."""
    disk = tmpfs("2m")
    spec = te.storage.RocksDB(os.path.join(disk, "db"), shards=2)
    backend = spec.open("t", WIDTH, CPU)
    written: dict[int, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(0)
    failed = None
    for i in range(40):  # 40 x 4,000 rows x 260 bytes: 41 MB, far more than the disk
        keys, rows = torch.arange(i * 4000, (i + 1) * 4000), torch.randn(4000, WIDTH, generator=gen)
        try:
            backend.set(keys, rows)
            backend.flush()
        except BackendError as e:
            assert "No space left" in str(e)
            failed = keys, rows
            break
        written.update(zip(keys.tolist(), rows))
    assert failed is not None, "the disk never filled"
    with pytest.raises(BackendError):
        backend.set(*failed)
    remount(disk, "size=64m")
    backend.set(*failed)  # the store took writes again without being reopened by hand
    backend.flush()
    written.update(zip(failed[0].tolist(), failed[1]))
    backend.close()
    backend = te.storage.RocksDB(os.path.join(disk, "db"), shards=2, existing="reuse").open("t", WIDTH, CPU)
    stored = {k: r for keys, rows in backend.scan(8192) for k, r in zip(keys.tolist(), rows)}
    backend.close()
    assert_same_rows(stored, written)


def test_rocksdb_disk_full_clears_once_the_disk_grows(tmpfs, tmp_path):
    disk = tmpfs("2m")
    path = os.path.join(disk, "db")
    ebc, ref = make(te.storage.RocksDB(path, shards=2)), make(None)
    data = batches(30)
    failed = train_until_fault(ebc, ref, data)
    while_the_fault_lasts(ebc, ref, data, failed, tmp_path / "ckpt")
    remount(disk, "size=64m")
    once_it_clears(ebc, ref, data, failed, te.storage.RocksDB(path, shards=2, existing="reuse"))


def test_rocksdb_unwritable_directory_clears_once_writable(tmpfs, tmp_path):
    path = os.path.join(tmpfs("64m"), "db")
    ebc, ref = make(te.storage.RocksDB(path, shards=2)), make(None)
    data = batches(20)
    train(ebc, ref, data, 0, 4)
    dirs = [path, os.path.join(path, "shard-00"), os.path.join(path, "shard-01")]
    try:
        for d in dirs:
            immutable(d, True)
        with pytest.raises(BackendError):  # a flush needs new files
            ebc.flush()
        failed = train_until_fault(ebc, ref, data, 4)
        while_the_fault_lasts(ebc, ref, data, failed, tmp_path / "ckpt")
    finally:
        for d in dirs:
            immutable(d, False)
    once_it_clears(ebc, ref, data, failed, te.storage.RocksDB(path, shards=2, existing="reuse"))


# -------------------------------------------------------------------------------------------- Redis
def test_redis_down_then_restarted_loses_no_row(redis_factory, tmp_path):
    """A server with an append-only file (it comes back with its rows) killed mid-run: training
    fails while it is down, rows written meanwhile are read back from the process, and once it is
    back every row lands."""
    server = redis_factory("--appendonly", "yes", "--appendfsync", "always")
    spec = te.storage.Redis(server.url, timeout_s=0.2, retries=1, backoff_s=0.01)
    ebc, ref = make(spec), make(None)
    data = batches(12)
    train(ebc, ref, data, 0, 4)
    server.stop()
    failed = train_until_fault(ebc, ref, data, 4)
    with pytest.raises(BackendError):
        ebc.flush()
    keys, weights = torch.arange(IDS, IDS + 100), torch.randn(100, DIM)
    ebc.write("t", keys, weights)
    ref.write("t", keys, weights)
    got, found = ebc.read("t", keys)
    assert bool(found.all())
    torch.testing.assert_close(got, weights)
    server.start()
    once_it_clears(ebc, ref, data, failed, te.storage.Redis(server.url, existing="reuse"))


def test_redis_full_clears_once_it_has_memory(redis_factory, tmp_path):
    server = redis_factory("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    ebc, ref = make(te.storage.Redis(server.url)), make(None)
    data = batches(30)
    failed = train_until_fault(ebc, ref, data)
    while_the_fault_lasts(ebc, ref, data, failed, tmp_path / "ckpt")
    server.cli("CONFIG", "SET", "maxmemory", "0")
    once_it_clears(ebc, ref, data, failed, te.storage.Redis(server.url, existing="reuse"))


# -------------------------------------------------------------------------------- one writer: Redis
HOLDER = """
import sys, torch, tieredemb as te
from tieredemb.storage.errors import BackendError
backend = te.storage.Redis(sys.argv[1], lease_ttl_s=float(sys.argv[2])).open("t", 4, torch.device("cpu"))
print("holding", flush=True)
for line in sys.stdin:
    if line.strip() == "write":
        try:
            backend.set(torch.tensor([1]), torch.ones(1, 4))
            print("written", flush=True)
        except BackendError as e:
            print("refused:", e, flush=True)
    if line.strip() == "close":
        backend.close()
        print("closed", flush=True)
"""


def holder(url: str, ttl_s: float) -> subprocess.Popen:
    """A process holding the namespace ``tieredemb`` of ``url`` (table "t"), lease TTL ``ttl_s``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, url, str(ttl_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def tell(proc: subprocess.Popen, command: str) -> str:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def open_table(url: str, table: str = "u", **kwargs):
    return te.storage.Redis(url, **kwargs).open(table, 4, CPU)


def test_redis_namespace_held_by_a_live_collection_is_refused(redis_server):
    first = make(te.storage.Redis(redis_server))
    with pytest.raises(BackendError) as info:
        make(te.storage.Redis(redis_server))
    assert "'tieredemb'" in str(info.value) and "held" in str(info.value)
    other = make(te.storage.Redis(redis_server, namespace="other"))  # another namespace: another store
    other.close()
    first.close()  # releases it
    make(te.storage.Redis(redis_server)).close()


def test_redis_lease_is_renewed_while_its_holder_lives(redis_server):
    first = open_table(redis_server, lease_ttl_s=1.0)
    time.sleep(2.5)  # two and a half TTLs
    with pytest.raises(BackendError, match="held"):
        open_table(redis_server, "v", lease_ttl_s=1.0)
    first.close()
    open_table(redis_server, "v").close()


def test_redis_lease_of_a_killed_holder_expires(redis_server):
    proc = holder(redis_server, 1.0)
    try:
        with pytest.raises(BackendError, match="held"):
            open_table(redis_server)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with pytest.raises(BackendError, match="held"):  # until its TTL runs out
            open_table(redis_server)
        time.sleep(1.1)
        open_table(redis_server).close()
    finally:
        proc.kill()
        proc.wait()


def test_redis_close_releases_only_its_own_lease(redis_server):
    """A holder stopped past its TTL loses the namespace to another collection: once resumed, its
    writes are refused and its close leaves the new holder's lease alone."""
    proc = holder(redis_server, 0.5)
    try:
        proc.send_signal(signal.SIGSTOP)  # renews nothing now
        time.sleep(0.8)
        mine = open_table(redis_server)  # the lease expired: the namespace is free
        proc.send_signal(signal.SIGCONT)
        assert tell(proc, "write").startswith("refused:")
        assert tell(proc, "close") == "closed"
        with pytest.raises(BackendError, match="held"):  # still mine
            open_table(redis_server, "v")
        mine.close()
    finally:
        proc.kill()
        proc.wait()


def test_redis_lease_renewal_during_an_outage_warns_once(redis_factory, caplog):
    """The renewal thread retries every TTL/3 while the server is away, warning once for the outage
    (not at every try), and says when renewing works again; the lease holds on after it."""
    server = redis_factory()
    table = open_table(server.url, lease_ttl_s=0.3)
    with caplog.at_level(logging.WARNING, logger="tieredemb.storage.redis"):
        server.stop()
        time.sleep(0.8)  # about 8 renewals fail
        server.start()
        time.sleep(0.4)  # a renewal succeeds
    messages = [r.getMessage() for r in caplog.records]
    assert sum("renewing the lease failed" in m for m in messages) == 1, messages
    assert sum("renewing the lease works again" in m for m in messages) == 1, messages
    with pytest.raises(BackendError, match="held"):  # renewed: still this table's namespace
        open_table(server.url, "v")
    table.close()
