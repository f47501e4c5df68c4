"""``torch.distributed.checkpoint`` (DCP) of models holding collections, with ``te.checkpoint``'s
two planners: a save loads into a freshly built model in any storage mode (rows, optimizer state,
scores, admission counts, step), training on equals an uninterrupted run, tables stream in chunks,
and 2 gloo ranks resume on 2 ranks (and on 1) like one process trained without a break."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tieredemb as te
from tests.checkpoint.test_distributed_checkpoint import STEPS, Holder, assert_equals_one_process
from tests.conftest import ATOL, RTOL, random_batch, sorted_export
from tests.distributed.test_sharded import _free_port, build, local_batch, step_losses
from tests.ranks import spawn_ranks
from tieredemb.checkpoint import dcp as te_dcp
from tieredemb.modules.state import TableSlice

TABLES = [te.TableConfig("t0", 4, ["f"]),
          te.TableConfig("t1", 3, ["g"], admission=te.FrequencyAdmission(2))]
MODES = ["hbm_direct", "cache_host", "cache_rocksdb", "cache_rocksdb_host_tier", "hybrid"]


def storage(mode: str, path) -> te.StorageConfig | None:
    small = {"hbm_budget": 2 * 4 * 12 * 4, "bucket_width": 4, "segment_rows": 8}
    if mode == "cache_host":
        return te.StorageConfig(**small, backing=te.storage.HostMemory())
    if mode == "cache_rocksdb":
        return te.StorageConfig(**small, backing=te.storage.RocksDB(str(path / "db"), shards=2))
    if mode == "cache_rocksdb_host_tier":  # 2 rows of host memory a table
        return te.StorageConfig(**small, backing=te.storage.RocksDB(str(path / "db"), shards=2),
                                host_budget=2 * 12 * 4 + 2 * 9 * 4)
    if mode == "hybrid":
        return te.StorageConfig(**small, caching=False)
    return None


class Model(torch.nn.Module):
    def __init__(self, mode: str = "hbm_direct", path=None) -> None:
        super().__init__()
        self.ebc = te.EmbeddingBagCollection(TABLES, optimizer=te.optim.Adam(lr=0.05),
                                             storage=storage(mode, path), seed=3)
        self.dense = torch.nn.Linear(7, 1)
        with torch.no_grad():
            self.dense.weight.copy_(torch.linspace(-1, 1, 7))
            self.dense.bias.fill_(0.25)


def train(model: Model, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        batch = random_batch(gen, {"f": range(40), "g": range(12)}, batch_size=4, max_bag=3)
        (model.dense(model.ebc(batch.kjt()).values()) ** 2).sum().backward()


def tables_of(ebc, scores: bool = True) -> dict:
    return {t.name: sorted_export(ebc, t.name)[: 4 if scores else 3] for t in TABLES}


def assert_same_rows(got: dict, want: dict, exact: bool) -> None:
    for name in want:
        for what, x, y in zip(("keys", "weights", "optimizer_state", "scores"), got[name], want[name]):
            if exact or what in ("keys", "scores"):
                assert torch.equal(x, y), f"table {name!r}: {what} differ"
            else:
                torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL,
                                           msg=lambda m, n=name, w=what: f"{n} {w}: {m}")


def save(model: Model, path, stateful: bool = False) -> None:
    with warnings.catch_warnings():  # single process: DCP warns that it loads without a group
        warnings.simplefilter("ignore", UserWarning)
        state = {"model": model} if stateful else model.state_dict()
        dcp.save(state, checkpoint_id=str(path), planner=te.checkpoint.DCPSavePlanner())


def load(model: Model, path, stateful: bool = False) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if stateful:
            dcp.load({"model": model}, checkpoint_id=str(path), planner=te.checkpoint.DCPLoadPlanner())
            return
        state = model.state_dict()
        dcp.load(state, checkpoint_id=str(path), planner=te.checkpoint.DCPLoadPlanner())
        model.load_state_dict(state)  # the usual pattern: changes nothing more


@pytest.mark.parametrize("mode", MODES)
def test_a_dcp_save_loads_into_a_fresh_model_of_any_storage_mode_and_resumes(mode, tmp_path):
    straight = Model()
    train(straight, range(6))
    first = Model()
    train(first, range(3))
    save(first, tmp_path / "ckpt", stateful=mode == "cache_host")  # {"model": model}: DCP's Stateful path
    fresh = Model(mode, tmp_path)
    assert fresh.ebc.storage_mode == {"hbm_direct": "hbm_direct", "hybrid": "hybrid"}.get(mode, "cache")
    load(fresh, tmp_path / "ckpt", stateful=mode == "cache_host")
    assert fresh.ebc.step == 3
    # a cache's export reports the rows of its backing store with score 0: scores compared in hbm_direct
    assert_same_rows(tables_of(fresh.ebc, mode == "hbm_direct"), tables_of(first.ebc, mode == "hbm_direct"),
                     exact=True)
    for t in TABLES:
        for got, want in zip(fresh.ebc.admission_counts(t.name), first.ebc.admission_counts(t.name)):
            assert torch.equal(got.sort().values, want.sort().values)
    assert torch.equal(fresh.dense.weight, first.dense.weight)
    train(fresh, range(3, 6))
    assert_same_rows(tables_of(fresh.ebc, False), tables_of(straight.ebc, False), exact=False)
    fresh.ebc.close()


@pytest.mark.parametrize("stateful", [False, True])
def test_a_dcp_save_from_a_host_tier_has_every_row(stateful, tmp_path):
    """Saved from a cache over RocksDB with a host tier of 2 rows a table (rows newer in host memory
    than in the store, others only in the store), loaded into hbm_direct: the rows of 3 steps."""
    straight = Model()
    train(straight, range(3))
    tiered = Model("cache_rocksdb_host_tier", tmp_path)
    train(tiered, range(3))
    assert any(s.host_tier.dirty for s in tiered.ebc.stats().values())  # not all written down yet
    save(tiered, tmp_path / "ckpt", stateful=stateful)
    fresh = Model()
    load(fresh, tmp_path / "ckpt", stateful=stateful)
    assert_same_rows(tables_of(fresh.ebc, False), tables_of(straight.ebc, False), exact=False)
    tiered.ebc.close()


def test_tables_are_written_and_read_one_chunk_at_a_time(tmp_path, monkeypatch):
    """Chunks of 5 rows: every read of a table by the save is 5 rows or fewer, and the load holds
    at most one chunk (its keys, scores, weights, optimizer state) between reads."""
    monkeypatch.setattr(te_dcp, "CHUNK_ROWS", 5)
    model = Model()
    train(model, range(4))
    rows = model.ebc.export("t0").keys.numel()
    assert rows > 15
    reads = []
    narrow = TableSlice.narrow
    monkeypatch.setattr(TableSlice, "narrow", lambda self, d, s, n: reads.append(n) or narrow(self, d, s, n))
    save(model, tmp_path / "ckpt")
    assert max(reads) <= 5 and sum(reads) == 2 * (rows + model.ebc.export("t1").keys.numel())

    held = []

    class Watching(te.checkpoint.DCPLoadPlanner):
        def commit_tensor(self, read_item, tensor):
            held.append(sum(p.shape[0] for parts in self._pending.values() for p in parts.values()))
            super().commit_tensor(read_item, tensor)

    fresh = Model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(fresh.state_dict(), checkpoint_id=str(tmp_path / "ckpt"), planner=Watching())
    assert max(held) <= 4 * 5
    assert_same_rows(tables_of(fresh.ebc), tables_of(model.ebc), exact=True)


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_changes(tmp_path):
    save(Model(), tmp_path / "ckpt")
    other = Model()
    other.ebc = te.EmbeddingBagCollection([te.TableConfig("t0", 5, ["f"]), TABLES[1]],
                                          optimizer=te.optim.Adam())
    other.ebc.write("t0", torch.tensor([1, 2]), torch.ones(2, 5))
    before = tables_of(other.ebc)
    with pytest.raises(CheckpointException) as refused:  # DCP's wrapping of the rank's error
        load(other, tmp_path / "ckpt")
    assert "ebc.t0.weights has shape (0, 4) in the checkpoint, the model's table has 5 columns" in \
        repr(refused.value.failures)
    assert_same_rows(tables_of(other.ebc), before, exact=True)


def test_without_the_planner_a_dcp_save_of_a_collection_fails(tmp_path):
    """The reason for the planner: DCP's default one cannot write the tables' handles."""
    with pytest.raises(CheckpointException) as failed, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(Model().state_dict(), checkpoint_id=str(tmp_path / "plain"))
    assert "cannot pickle" in repr(failed.value.failures)


# ----------------------------------------------------------------------------------- 2 gloo ranks
def _dcp_phase(rank: int, world: int, port: int, tmp: str, mode: str, first: bool) -> None:
    """As ``test_distributed_checkpoint._phase``, through ``dcp.save`` / ``dcp.load``."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = Holder(build(te.EmbeddingBagCollection, "adam", mode, os.path.join(tmp, f"db-{world}"),
                             dist.group.WORLD))
        if not first:
            state = model.state_dict()
            dcp.load(state, checkpoint_id=os.path.join(tmp, "dcp"), planner=te.checkpoint.DCPLoadPlanner())
            model.load_state_dict(state)
            assert model.ebc.step == STEPS
        for step in range(STEPS) if first else range(STEPS, 2 * STEPS):
            out = model.ebc(local_batch(step, rank)[0])
            step_losses(te.EmbeddingBagCollection, out, step, rank).backward()
        if first:
            dcp.save(model.state_dict(), checkpoint_id=os.path.join(tmp, "dcp"),
                     planner=te.checkpoint.DCPSavePlanner())
        else:
            rows = {t: model.ebc.export(t) for t in ("t0", "t1", "t2")}
            torch.save({t: (r.keys, torch.cat([r.weights, r.optimizer_state], 1)) for t, r in rows.items()},
                       os.path.join(tmp, f"rows-{rank}.pt"))
        model.ebc.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("after", [2, 1])
def test_two_gloo_ranks_resume_through_dcp_like_one_process(after, tmp_path):
    spawn_ranks(_dcp_phase, args=(2, _free_port(), str(tmp_path), "hbm_direct", True), nprocs=2)
    spawn_ranks(_dcp_phase, args=(after, _free_port(), str(tmp_path), "cache", False), nprocs=after)
    assert_equals_one_process(tmp_path, 2, after)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_tables_round_trip(tmp_path, dtype) -> None:
    """Rows stored in 16 bits save and load through DCP in their dtype, bit for bit, into a fresh
    model in cache mode; a float32 table takes them exactly (every 16-bit value is a float32 one),
    as ``te.checkpoint`` does."""
    def model(mode: str = "hbm_direct", rows: torch.dtype = dtype) -> torch.nn.Module:
        m = torch.nn.Module()
        m.ebc = te.EmbeddingBagCollection([te.TableConfig("t0", 4, ["f"], dtype=rows)],
                                          optimizer=te.optim.Adam(lr=0.05), storage=storage(mode, tmp_path),
                                          seed=3)
        return m

    trained = model()
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        kjt = random_batch(gen, {"f": range(40)}, batch_size=4, max_bag=3).kjt()
        trained.ebc(kjt).values().sum().backward()
    save(trained, tmp_path / "ckpt")
    fresh = model("cache_host")
    load(fresh, tmp_path / "ckpt")
    got, want = sorted_export(fresh.ebc, "t0"), sorted_export(trained.ebc, "t0")
    assert want[1].dtype == dtype and want[0].numel() > 10
    for x, y in zip(got[:3], want[:3]):
        assert x.dtype == y.dtype and torch.equal(x, y)
    wide = model(rows=torch.float32)
    load(wide, tmp_path / "ckpt")
    got = sorted_export(wide.ebc, "t0")
    assert got[1].dtype == torch.float32 and torch.equal(got[1], want[1].float())
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2].float())
