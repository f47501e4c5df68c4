"""te.checkpoint: train N steps, save, load into a fresh model on another storage layout, train M
more: the same as an uninterrupted N+M run. Corrupted, truncated and half-written checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import tieredemb as te
from tests.storage.conftest import redis_factory, redis_server  # noqa: F401 (fixtures)

DIM = 4
ROWS = 200


def tables(bounded: bool) -> list[te.TableConfig]:
    """Admission, LFU, mean pooling, two groups; ``bounded``: "w" holds at most 32 rows (evicting by
    LRU score, so a resume must restore the scores exactly)."""
    return [te.TableConfig("t", DIM, ["a", "b"], num_embeddings=ROWS, admission=te.FrequencyAdmission(2),
                           initializer=te.init.Normal(0.0, 0.1)),
            te.TableConfig("u", DIM, ["c"], eviction="lfu", pooling="mean"),
            te.TableConfig("w", 3, ["d"], max_capacity=32 if bounded else None)]


class Model(nn.Module):
    def __init__(self, storage: te.StorageConfig | None, bounded: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = te.EmbeddingBagCollection(tables(bounded), optimizer=te.optim.Adam(lr=0.05),
                                             storage=storage, seed=7)
        self.top = nn.Linear(3 * DIM + 3, 1)

    def forward(self, kjt: te.KeyedJaggedTensor) -> torch.Tensor:
        return self.top(self.ebc(kjt).values()).square().mean()


def batch(step: int) -> te.KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (4 * 5,), generator=gen)
    n = int(lengths.sum())
    weights = 1.0 / torch.arange(1, ROWS + 1, dtype=torch.float64) ** 1.1
    ids = torch.multinomial(weights, n, replacement=True, generator=gen) * 7 % ROWS
    return te.KeyedJaggedTensor(["a", "b", "c", "d"], ids, lengths=lengths)


def train(model: Model, steps: range) -> list[float]:
    opt = torch.optim.SGD(model.top.parameters(), lr=0.1)
    losses = []
    for step in steps:
        loss = model(batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def storages(tmp_path, request) -> dict[str, te.StorageConfig | None]:
    row = (DIM + 2 * DIM) * 4
    return {
        "hbm": None,
        "cache-rocksdb": te.StorageConfig(hbm_budget=3 * 4 * row, bucket_width=4, segment_rows=8,
                                          backing=te.storage.RocksDB(str(tmp_path / "db"), shards=2)),
        "cache-redis": te.StorageConfig(hbm_budget=5 * 4 * row, bucket_width=4, segment_rows=8,
                                        backing=te.storage.Redis(request.getfixturevalue("redis_server"))),
        "hybrid": te.StorageConfig(hbm_budget=24 * row, caching=False, segment_rows=8),
        "cache-rocksdb-host_tier": te.StorageConfig(
            hbm_budget=3 * 4 * row, bucket_width=4, segment_rows=8, host_budget=6 * row,
            backing=te.storage.RocksDB(str(tmp_path / "db-host"), shards=2)),
    }


def rows_of(model: Model, table: str) -> tuple[torch.Tensor, torch.Tensor]:
    r = model.ebc.export(table)
    order = torch.argsort(r.keys)
    return r.keys[order], torch.cat([r.weights, r.optimizer_state], 1)[order]


@pytest.mark.parametrize("before, after", [("hbm", "cache-rocksdb"), ("cache-rocksdb", "cache-redis"),
                                           ("cache-redis", "hbm"), ("hbm", "hybrid"), ("hybrid", "hbm"),
                                           ("cache-rocksdb-host_tier", "hbm"),
                                           ("hbm", "cache-rocksdb-host_tier")])
@pytest.mark.slow
def test_resume_on_another_storage_layout_equals_an_uninterrupted_run(before, after, tmp_path, request):
    configs = storages(tmp_path, request)
    bounded, whole, want, first, got = first_half(configs, before, after)
    te.checkpoint.save(first, tmp_path / "ckpt", buffer_bytes=200)  # a few rows a chunk
    saved = {t: first.ebc.export(t) for t in ("t", "u", "w")}
    first.ebc.close()
    second = Model(configs[after], bounded)
    te.checkpoint.load(second, tmp_path / "ckpt")
    assert second.ebc.step == 6
    if bounded:  # the device tiers keep scores (LRU clock, LFU counts): restored exactly
        for t, rows in saved.items():
            back = second.ebc.export(t)
            assert dict(zip(back.keys.tolist(), back.scores.tolist())) == dict(
                zip(rows.keys.tolist(), rows.scores.tolist())), t
    assert_trains_on_like(whole, want, second, got)


def first_half(configs: dict, before: str, after: str):
    """(bounded, the uninterrupted 12-step model and its losses, the model trained 6 steps on the
    ``before`` layout and its losses). A bounded table keeps exactly what its buckets keep: only
    comparable at one bucket width (the cache layouts here use 4 ways a bucket, hbm_direct and
    hybrid 32), so tables are bounded unless a cache layout takes part."""
    bounded = "cache" not in before + after
    whole = Model(None, bounded)
    want = train(whole, range(12))
    first = Model(configs[before], bounded)
    return bounded, whole, want, first, train(first, range(6))


def assert_trains_on_like(whole: Model, want: list[float], resumed: Model, got: list[float]) -> None:
    """``resumed`` (6 steps before its resume, losses ``got``) trains steps 6..11 to the losses and rows
    of ``whole`` (12 steps without a break, losses ``want``)."""
    got = got + train(resumed, range(6, 12))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for t in ("t", "u", "w"):
        k, r = rows_of(resumed, t)
        wk, wr = rows_of(whole, t)
        assert torch.equal(k, wk), t
        torch.testing.assert_close(r, wr, rtol=1e-5, atol=1e-6)


def test_a_flipped_byte_and_a_truncated_file_are_refused(tmp_path) -> None:
    model = Model(None)
    train(model, range(3))
    out = te.checkpoint.save(model, tmp_path / "ckpt", buffer_bytes=64)
    chunk = sorted(out.glob("ebc-*/t-*/*.safetensors"))[0]  # collection and table names are encoded
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(te.checkpoint.CheckpointError, match="corrupted") as info:
        te.checkpoint.load(Model(None), tmp_path / "ckpt")
    assert chunk.name in str(info.value)
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data[:-10]))
    with pytest.raises(te.checkpoint.CheckpointError, match="truncated") as info:
        te.checkpoint.load(Model(None), tmp_path / "ckpt")
    assert chunk.name in str(info.value)


def test_load_refuses_another_model_or_a_collection_with_rows(tmp_path) -> None:
    model = Model(None)
    train(model, range(2))
    te.checkpoint.save(model, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="already holds rows"):
        te.checkpoint.load(model, tmp_path / "ckpt")
    other = nn.Module()
    other.ebc = te.EmbeddingBagCollection([te.TableConfig("t", 8, ["a"])], optimizer=te.optim.Adam())
    with pytest.raises(te.checkpoint.CheckpointError, match="tables"):
        te.checkpoint.load(other, tmp_path / "ckpt")
    with pytest.raises(te.checkpoint.CheckpointError, match="not a checkpoint"):
        te.checkpoint.load(Model(None), tmp_path / "nothing")


SAVER = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, {root!r})
    from tests.checkpoint.test_checkpoint import Model, train
    import tieredemb as te
    model = Model(None)
    train(model, range(int(sys.argv[2])))
    if sys.argv[3] == "hang":  # stop inside the save: after the first chunk file is written
        import tieredemb.checkpoint as ck
        real = ck._write
        def slow(path, data):
            out = real(path, data)
            print("written", flush=True)
            import time; time.sleep(60)
            return out
        ck._write = slow
    te.checkpoint.save(model, sys.argv[1], buffer_bytes=64)
    print("saved", flush=True)
""")


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path) -> None:
    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(root=os.getcwd()))
    ckpt = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, str(script), str(ckpt), "3", "ok"], capture_output=True,
                          text=True, timeout=120)
    assert "saved" in done.stdout, done.stderr
    proc = subprocess.Popen([sys.executable, str(script), str(ckpt), "5", "hang"], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "written"  # the second save is under way ...
    proc.send_signal(signal.SIGKILL)  # ... and dies
    proc.wait(timeout=30)
    restored = Model(None)
    te.checkpoint.load(restored, ckpt)
    assert restored.ebc.step == 3  # the first save, whole
    reference = Model(None)
    train(reference, range(3))
    for t in ("t", "u", "w"):
        k, r = rows_of(restored, t)
        wk, wr = rows_of(reference, t)
        assert torch.equal(k, wk)
        torch.testing.assert_close(r, wr)
    te.checkpoint.save(restored, ckpt)  # the next save cleans up the dead one's directory
    assert sorted(p.name for p in ckpt.glob("v-*")) == [(ckpt / "LATEST").read_text()]


RSS_PROBE = textwrap.dedent("""
    import sys, threading, time, torch
    sys.path.insert(0, {root!r})
    import tieredemb as te
    page = 4096
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page
    buffer = 8 << 20
    rows = 10 * buffer // ((64 + 2 * 64) * 4)  # a table 10x the buffer
    ebc = te.EmbeddingBagCollection([te.TableConfig("big", 64, ["x"])], optimizer=te.optim.Adam())
    model = torch.nn.Module(); model.ebc = ebc
    for lo in range(0, rows, 1 << 16):
        keys = torch.arange(lo, min(lo + (1 << 16), rows))
        ebc.write("big", keys, torch.randn(keys.numel(), 64))
    # warm-up: a save of a tiny model first, so imports and torch's thread pools (which grow RSS once,
    # by an amount that depends on the machine's cores) are not counted as the big save's growth
    small = torch.nn.Module()
    small.ebc = te.EmbeddingBagCollection([te.TableConfig("s", 64, ["x"])], optimizer=te.optim.Adam())
    small.ebc.write("s", torch.arange(1000), torch.randn(1000, 64))
    te.checkpoint.save(small, sys.argv[1] + "-warmup", buffer_bytes=buffer)
    before, peak, done = rss(), [0], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss()); time.sleep(0.0005)
    t = threading.Thread(target=sample); t.start()
    te.checkpoint.save(model, sys.argv[1], buffer_bytes=buffer)
    done.set(); t.join()
    print(rows * (64 + 2 * 64) * 4, buffer, peak[0] - before)
""")


@pytest.mark.slow
def test_saving_a_table_ten_times_the_buffer_stays_within_twice_the_buffer(tmp_path) -> None:
    """Peak RSS growth of the process during the save (sampled every 0.5 ms), in a fresh process.
    glibc's mmap threshold is fixed there: by default it rises to the size of the largest block freed,
    after which chunk-sized buffers come from the heap and their freed pages stay in RSS at times
    (a CI run once measured 18.4 MiB, 0.1 MiB in reruns): the bound is about the save's live memory."""
    script = tmp_path / "probe.py"
    script.write_text(RSS_PROBE.format(root=os.getcwd()))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True,
                         text=True, timeout=300, check=True, env=env).stdout
    table, buffer, growth = (int(x) for x in out.split())
    assert table >= 10 * buffer - 4096 * 1000
    assert growth < 2 * buffer, f"peak RSS grew by {growth / 2**20:.1f} MiB saving a " \
                                f"{table / 2**20:.0f} MiB table with a {buffer / 2**20:.0f} MiB buffer"


@pytest.mark.parametrize("caching", [None, True], ids=["hbm", "cache"])
def test_save_in_the_middle_of_a_pipelined_run(caching, tmp_path) -> None:
    """A save between TrainPipeline steps (the next batch already prefetched, its slots locked)
    holds the rows of the steps taken so far: a fresh model loaded from it and trained on the rest
    ends where an uninterrupted run does."""
    from tests.pipeline.test_train_pipeline import Model as ClickModel
    from tests.pipeline.test_train_pipeline import make_batches, make_tables, plain_loop

    storage = None if caching is None else te.StorageConfig(hbm_budget=8 * 12 * 4, bucket_width=4,
                                                            segment_rows=4)

    def build():
        torch.manual_seed(0)
        ebc = te.EmbeddingBagCollection(make_tables("sparse", limited=False),
                                        optimizer=te.optim.Adam(lr=0.01), storage=storage, seed=0)
        model = ClickModel([("sparse", ebc)])
        return model, torch.optim.SGD(model.parameters(), lr=0.05)  # stateless: not in the checkpoint

    batches = make_batches(12)
    want_model, want_opt = build()
    plain_loop(want_model, want_opt, batches)
    model, opt = build()
    pipeline = te.TrainPipeline(model, opt)
    it = iter(batches)
    for _ in range(6):
        pipeline.progress(it)  # batch 6 is now prefetched
    te.checkpoint.save(model, tmp_path / "ckpt")
    resumed, resumed_opt = build()
    te.checkpoint.load(resumed, tmp_path / "ckpt")
    plain_loop(resumed, resumed_opt, batches[6:])
    for got_p, want_p in zip(resumed.parameters(), want_model.parameters()):
        torch.testing.assert_close(got_p, want_p)
    for t in ("sparse_a", "sparse_b"):
        got, want = resumed.collections[0].export(t), want_model.collections[0].export(t)
        go, wo = torch.argsort(got.keys), torch.argsort(want.keys)
        assert torch.equal(got.keys[go], want.keys[wo]), t
        torch.testing.assert_close(got.weights[go], want.weights[wo])
        torch.testing.assert_close(got.optimizer_state[go], want.optimizer_state[wo])


def _state(model: Model) -> dict[str, dict[int, tuple]]:
    """table -> key -> (row values, score): everything a checkpoint must restore."""
    out = {}
    for t in ("t", "u", "w"):
        r = model.ebc.export(t)
        full = torch.cat([r.weights, r.optimizer_state], 1)
        out[t] = {k: (tuple(full[i].tolist()), int(r.scores[i])) for i, k in enumerate(r.keys.tolist())}
    return out


def _manifest_rows(version, kind: str = "rows") -> dict[str, int]:
    import json

    files = json.loads((version / "manifest.json").read_text())["files"]
    return {t: sum(e["rows"] for e in files["ebc"][t][kind]) for t in ("t", "u", "w")}


def test_deltas_write_only_what_changed_and_base_plus_deltas_restore_exactly(tmp_path) -> None:
    from tieredemb.checkpoint import _FINGERPRINTS

    model = Model(None)  # "w" is bounded: steps evict rows, which a delta must record as deleted
    train(model, range(6))
    base = te.checkpoint.save(model, tmp_path / "ckpt", buffer_bytes=512)
    versions, evicted = [base], 0
    for steps in (range(6, 7), range(7, 12)):
        before = _state(model)
        train(model, steps)
        after = _state(model)
        delta = te.checkpoint.save(model, tmp_path / "ckpt", buffer_bytes=512, base=versions[-1])
        versions.append(delta)
        changed = {t: sum(1 for k, v in after[t].items() if before[t].get(k) != v) for t in after}
        deleted = {t: len(set(before[t]) - set(after[t])) for t in after}
        assert _manifest_rows(delta) == changed  # O(rows touched): exactly the changed rows
        assert _manifest_rows(delta, "deleted") == deleted
        assert sum(changed.values()) < sum(len(v) for v in after.values())  # a delta, not a full save
        evicted += sum(deleted.values())
    assert evicted > 0  # the bounded table evicted: deletions were exercised
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("v-*")) == [v.name for v in versions]
    # restored into an unbounded "w": the keys it lost must go by the deltas' deletions (a bounded
    # one would evict them again by itself)
    restored = Model(None, bounded=False)
    te.checkpoint.load(restored, tmp_path / "ckpt")
    assert _state(restored) == _state(model)  # base + deltas: the exact state
    bounded = Model(None)  # as saved: each version's keys fit its buckets (deletions go first)
    te.checkpoint.load(bounded, tmp_path / "ckpt")
    assert _state(bounded) == _state(model)
    full = Model(None, bounded=False)
    te.checkpoint.save(model, tmp_path / "full")
    te.checkpoint.load(full, tmp_path / "full")
    assert _state(full) == _state(restored)  # ... equal to a full save
    _FINGERPRINTS.clear()  # another process: the base's fingerprints are rebuilt from its files
    again = te.checkpoint.save(model, tmp_path / "ckpt", base=versions[-1])
    assert _manifest_rows(again) == {"t": 0, "u": 0, "w": 0}
    assert _manifest_rows(again, "deleted") == {"t": 0, "u": 0, "w": 0}
