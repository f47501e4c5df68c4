"""Crafted and mismatched checkpoints: paths that leave the checkpoint directory, an edited manifest,
files with a valid hash and wrong contents, pickles, checkpoints for another model. Each is refused
with ``CheckpointError`` naming the file or the mismatch, before anything is loaded: a failed load
leaves the model as it was, and a retry with a good checkpoint succeeds."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes
from torch import nn

import tieredemb as te
from tests.checkpoint.test_checkpoint import DIM, Model, rows_of, tables, train

CheckpointError = te.checkpoint.CheckpointError


# ------------------------------------------------------------------------------ helpers
def checksum(manifest: dict) -> str:
    """The manifest's own checksum: SHA-256 of its canonical JSON without the ``checksum`` field."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(version: Path) -> dict:
    return json.loads((version / "manifest.json").read_text())


def write_manifest(version: Path, manifest: dict, seal: bool = True) -> None:
    """Rewrite the manifest, with a checksum recomputed (``seal``): an edit made on purpose, which
    only the contents checks can catch."""
    if seal:
        manifest["checksum"] = checksum(manifest)
    (version / "manifest.json").write_text(json.dumps(manifest))


def entries(node) -> list[dict]:
    """Every file entry of a manifest (dicts with a ``file``), in document order."""
    if isinstance(node, dict):
        if "file" in node:
            return [node]
        return [e for v in node.values() for e in entries(v)]
    if isinstance(node, list):
        return [e for v in node for e in entries(v)]
    return []


def chunks_of(manifest: dict, table: str, kind: str = "rows") -> list[dict]:
    return manifest["files"]["ebc"][table][kind]


def replace_file(version: Path, entry: dict, data: bytes) -> Path:
    """Put ``data`` in place of the file of ``entry`` and make the manifest agree (size, hash, checksum)."""
    manifest = read_manifest(version)
    target = next(e for e in entries(manifest) if e["file"] == entry["file"])
    path = version / entry["file"]
    path.write_bytes(data)
    target["bytes"], target["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    write_manifest(version, manifest)
    return path


def build(**changes) -> nn.Module:
    """``Model(None)`` with fields of its tables replaced: ``changes[table] = {field: value}``;
    ``optimizer`` replaces the embedding optimizer."""
    torch.manual_seed(0)
    model = nn.Module()
    configs = [dataclasses.replace(t, **changes.get(t.name, {})) for t in tables(True)]
    model.ebc = te.EmbeddingBagCollection(configs, optimizer=changes.get("optimizer", te.optim.Adam(lr=0.05)),
                                          seed=7)
    model.top = nn.Linear(3 * DIM + 3, 1)
    return model


def snapshot(model: nn.Module) -> dict:
    """Everything a load could change: dense state, rows, step, clock."""
    return {"dense": {k: v.clone() for k, v in model.top.state_dict().items()},
            "rows": {t: rows_of(model, t) for t in ("t", "u", "w")},
            "step": model.ebc.step, "clock": model.ebc.retired_clock(), "empty": model.ebc.is_empty()}


def assert_same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"] and a["clock"] == b["clock"] and a["empty"] == b["empty"]
    for k in a["dense"]:
        assert torch.equal(a["dense"][k], b["dense"][k]), k
    for t in a["rows"]:
        assert all(torch.equal(x, y) for x, y in zip(a["rows"][t], b["rows"][t])), t


@pytest.fixture
def saved(tmp_path) -> tuple[Path, Path, Model]:
    """(checkpoint directory, its version, the model saved): 6 steps, several chunks a table."""
    model = Model(None)
    train(model, range(6))
    version = te.checkpoint.save(model, tmp_path / "ckpt", buffer_bytes=400)
    return tmp_path / "ckpt", version, model


def assert_holds(target: Model, model: Model) -> None:
    """``target`` is at ``model``'s step and holds its rows, table by table."""
    assert target.ebc.step == model.ebc.step
    for t in ("t", "u", "w"):
        k, r = rows_of(target, t)
        wk, wr = rows_of(model, t)
        assert torch.equal(k, wk) and torch.equal(r, wr), t


def assert_loads_like(root: Path, model: Model) -> None:
    fresh = Model(None)
    te.checkpoint.load(fresh, root)
    assert_holds(fresh, model)


# ------------------------------------------------------------------------------ paths
def test_table_names_never_become_paths_on_save(tmp_path) -> None:
    """A table named ``../../../x`` (or absolute) is written under an encoded name inside the
    version directory, and loads back."""
    names = ["../../../escaped", "/tmp/absolute", "a/b:c"]
    configs = [te.TableConfig(n, 2, [f"f{i}"]) for i, n in enumerate(names)]

    def make() -> nn.Module:
        m = nn.Module()
        m.ebc = te.EmbeddingBagCollection(configs, optimizer=te.optim.SGD(), seed=1)
        return m

    model = make()
    for n in names:
        model.ebc.write(n, torch.arange(5), torch.randn(5, 2))
    root = tmp_path / "deep" / "ckpt"
    before = set(tmp_path.rglob("*"))
    te.checkpoint.save(model, root)
    created = set(tmp_path.rglob("*")) - before
    outside = [p for p in created if root not in p.parents and p != root and p not in root.parents]
    assert outside == []
    assert not Path("/tmp/absolute").exists()
    for p in created - {root, *root.parents}:
        assert ".." not in p.relative_to(root).parts
    fresh = make()
    te.checkpoint.load(fresh, root)
    for n in names:
        assert torch.equal(fresh.ebc.export(n).weights, model.ebc.export(n).weights)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_manifest_entry_outside_the_checkpoint_is_refused(where, saved, tmp_path) -> None:
    root, version, model = saved
    manifest = read_manifest(version)
    entry = chunks_of(manifest, "t")[0]
    outside = tmp_path / "outside.safetensors"
    shutil.copy(version / entry["file"], outside)  # the same bytes: size and hash agree
    entry["file"] = "../../outside.safetensors" if where == "relative" else str(outside)
    write_manifest(version, manifest)
    with pytest.raises(CheckpointError, match="outside") as info:
        te.checkpoint.load(Model(None), root)
    assert "outside.safetensors" in str(info.value)


@pytest.mark.parametrize("pointer", ["../other/v-000001", "absolute"])
def test_a_latest_pointing_outside_is_refused(pointer, saved, tmp_path) -> None:
    root, version, model = saved
    other = te.checkpoint.save(model, tmp_path / "other")
    (root / "LATEST").write_text(str(other) if pointer == "absolute" else pointer)
    with pytest.raises(CheckpointError, match="LATEST"):
        te.checkpoint.load(Model(None), root)


def test_a_symlink_out_of_the_checkpoint_is_refused(saved, tmp_path) -> None:
    root, version, model = saved
    entry = chunks_of(read_manifest(version), "u")[0]
    path = version / entry["file"]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(path, outside)
    os.symlink(outside, path)  # same bytes, but outside the directory
    with pytest.raises(CheckpointError, match="outside") as info:
        te.checkpoint.load(Model(None), root)
    assert path.name in str(info.value)


# ------------------------------------------------------------------------------ the manifest
def test_an_edited_manifest_is_refused(saved) -> None:
    root, version, model = saved
    manifest = read_manifest(version)
    manifest["collections"]["ebc"]["step"] = 99
    write_manifest(version, manifest, seal=False)
    with pytest.raises(CheckpointError, match="manifest.json.*checksum"):
        te.checkpoint.load(Model(None), root)


@pytest.mark.parametrize("bad", ["old", "unknown"])
def test_old_and_unknown_formats_are_refused(bad, saved) -> None:
    root, version, model = saved
    manifest = read_manifest(version)
    manifest["format"] = 1 if bad == "old" else 99
    write_manifest(version, manifest)
    with pytest.raises(CheckpointError, match="format"):
        te.checkpoint.load(Model(None), root)


def test_a_latest_or_manifest_that_is_not_utf8_is_refused(saved) -> None:
    root, version, model = saved
    good = (root / "LATEST").read_bytes()
    (root / "LATEST").write_bytes(b"\xff\xfe\x00v")
    with pytest.raises(CheckpointError, match="LATEST"):
        te.checkpoint.load(Model(None), root)
    (root / "LATEST").write_bytes(good)
    (version / "manifest.json").write_bytes(pickle.dumps({"format": 2}))
    with pytest.raises(CheckpointError, match="manifest.json"):
        te.checkpoint.load(Model(None), root)


# ------------------------------------------------------------------------------ contents
def _pickle(tensors: dict) -> bytes:
    return pickle.dumps({k: v.tolist() for k, v in tensors.items()})


def _torch_save(tensors: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [_pickle, _torch_save], ids=["pickle", "torch.save"])
@pytest.mark.parametrize("which", ["chunk", "dense"])
def test_a_pickle_in_a_data_files_place_is_refused_naming_it(fmt, which, saved) -> None:
    root, version, model = saved
    manifest = read_manifest(version)
    entry = chunks_of(manifest, "t")[-1] if which == "chunk" else manifest["dense"]
    tensors = load_bytes((version / entry["file"]).read_bytes())
    path = replace_file(version, entry, fmt(tensors))
    with pytest.raises(CheckpointError, match="safetensors") as info:
        te.checkpoint.load(Model(None), root)
    assert path.name in str(info.value)


def _edit(tensors: dict, what: str) -> dict:
    keys, rows, scores = tensors["keys"], tensors["rows"], tensors["scores"]
    if what == "fewer rows than the manifest":
        return {"keys": keys[1:], "rows": rows[1:], "scores": scores[1:]}
    if what == "narrower rows":  # weights only: the optimizer state would be zeros
        return {"keys": keys, "rows": rows[:, :DIM - 1].contiguous(), "scores": scores}
    if what == "float64 rows":
        return {"keys": keys, "rows": rows.double(), "scores": scores}
    if what == "non-finite rows":
        rows = rows.clone()
        rows[0, 0] = float("nan")
        return {"keys": keys, "rows": rows, "scores": scores}
    if what == "the reserved key":
        keys = torch.cat([keys[:-1], torch.tensor([te.RESERVED_KEY])])
        return {"keys": keys, "rows": rows, "scores": scores}
    if what == "a duplicate key":
        return {"keys": torch.cat([keys[:-1], keys[:1]]), "rows": rows, "scores": scores}
    if what == "no scores":
        return {"keys": keys, "rows": rows}
    raise AssertionError(what)


CONTENTS = ["truncated", "fewer rows than the manifest", "narrower rows", "float64 rows", "non-finite rows",
            "the reserved key", "a duplicate key", "no scores", "key past num_embeddings"]


@pytest.mark.parametrize("what", CONTENTS)
def test_a_load_failing_on_the_last_file_changes_nothing_and_can_be_retried(what, saved, tmp_path) -> None:
    """The last chunk of the last table is bad (a valid hash where the contents are wrong): refused
    naming it, the model exactly as before (dense state, rows, step), and a good checkpoint loads into
    it afterwards."""
    root, version, model = saved
    good = tmp_path / "good"
    shutil.copytree(root, good)
    manifest = read_manifest(version)
    table = "t" if what == "key past num_embeddings" else "w"
    entry = chunks_of(manifest, table)[-1]
    path = version / entry["file"]
    if what == "truncated":
        path.write_bytes(path.read_bytes()[:-7])
    else:
        tensors = load_bytes(path.read_bytes())
        if what == "key past num_embeddings":  # "t" has num_embeddings=200
            tensors = {**tensors, "keys": torch.cat([tensors["keys"][:-1], torch.tensor([200])])}
        else:
            tensors = _edit(tensors, what)
        replace_file(version, entry, save_bytes(tensors))
    target = Model(None)
    before = snapshot(target)
    with pytest.raises(CheckpointError) as info:
        te.checkpoint.load(target, root)
    assert path.name in str(info.value)
    assert_same(snapshot(target), before)
    te.checkpoint.load(target, good)  # the retry
    assert_holds(target, model)


def test_a_dense_state_of_another_shape_is_refused_before_any_change(saved) -> None:
    root, version, model = saved
    target = Model(None)
    target.top = nn.Linear(3 * DIM + 3, 2)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match="dense.safetensors.*top.weight"):
        te.checkpoint.load(target, root)
    assert_same(snapshot(target), before)


# ------------------------------------------------------------------------------ fit to the model
def test_another_optimizer_of_the_same_row_width_is_refused(tmp_path) -> None:
    """Adagrad and RowWiseAdagrad both keep 1 state element a row at dim 1."""

    def make(optimizer) -> nn.Module:
        m = nn.Module()
        m.ebc = te.EmbeddingBagCollection([te.TableConfig("x", 1, ["f"])], optimizer=optimizer)
        return m

    model = make(te.optim.Adagrad())
    model.ebc.write("x", torch.arange(4), torch.randn(4, 1))
    te.checkpoint.save(model, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="optimizer.*Adagrad"):
        te.checkpoint.load(make(te.optim.RowWiseAdagrad()), tmp_path / "ckpt")
    te.checkpoint.load(make(te.optim.Adagrad()), tmp_path / "ckpt")


def test_a_smaller_num_embeddings_than_the_saved_keys_need_is_refused(saved) -> None:
    root, version, model = saved
    counted = model.ebc.admission_counts("t")[0]  # keys counted toward admission need room too
    biggest = int(torch.cat([model.ebc.export("t").keys, counted]).max())
    target = build(t={"num_embeddings": biggest})  # the largest saved key falls outside
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=f"num_embeddings.*{biggest}"):
        te.checkpoint.load(target, root)
    assert_same(snapshot(target), before)
    te.checkpoint.load(build(t={"num_embeddings": biggest + 1}), root)  # still holds every key


def test_a_smaller_max_capacity_than_the_saved_rows_need_is_refused(saved) -> None:
    root, version, model = saved
    held = model.ebc.export("w").keys.numel()
    assert held > 8
    target = build(w={"max_capacity": 8})
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=f"max_capacity.*{held}"):
        te.checkpoint.load(target, root)
    assert_same(snapshot(target), before)
    unbounded = build(w={"max_capacity": None})
    te.checkpoint.load(unbounded, root)
    assert unbounded.ebc.export("w").keys.numel() == held


# ------------------------------------------------------------------------------ keys across files
def test_a_key_in_two_chunk_files_of_a_table_is_refused_naming_both(saved) -> None:
    """Each file holds distinct keys (checked file by file); a key in two of them, which one loading
    would silently overwrite with the other, is refused before anything loads."""
    root, version, model = saved
    first, second = chunks_of(read_manifest(version), "u")[:2]
    copied = int(load_bytes((version / first["file"]).read_bytes())["keys"][0])
    tensors = load_bytes((version / second["file"]).read_bytes())
    tensors["keys"][-1] = copied
    replace_file(version, second, save_bytes(tensors))
    target = Model(None)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=rf"table 'u'.*key {copied}") as info:
        te.checkpoint.load(target, root)
    for entry in (first, second):
        assert Path(entry["file"]).name in str(info.value)
    assert_same(snapshot(target), before)


def _bounded_target(bucket_width: int, max_capacity: int, cached: bool) -> nn.Module:
    """``Model(None)`` whose bounded table "w" has another index layout."""
    torch.manual_seed(0)
    model = nn.Module()
    configs = [dataclasses.replace(t, max_capacity=max_capacity) if t.name == "w" else t
               for t in tables(True)]
    storage = te.StorageConfig(hbm_budget=2048 if cached else None, bucket_width=bucket_width)
    model.ebc = te.EmbeddingBagCollection(configs, optimizer=te.optim.Adam(lr=0.05), storage=storage, seed=7)
    model.top = nn.Linear(3 * DIM + 3, 1)
    return model


# (bucket width, max_capacity) of "w", saved as (32, 32): one bucket of 32 ways
LAYOUTS = [(32, 32), (4, 32), (4, 40), (8, 32), (2, 64), (4, 256), (1, 32)]


@pytest.mark.parametrize("cached", [False, True], ids=["hbm_direct", "cache"])
def test_a_bounded_table_in_another_layout_loads_every_row_or_is_refused(cached, saved) -> None:
    """In buckets of another width or count the saved keys may crowd one bucket past its ways, and
    the load would evict some of them: the load either keeps every saved row of the bounded table or
    is refused naming it, before any change."""
    root, version, model = saved
    want = rows_of(model, "w")
    outcomes = {}
    for width, capacity in LAYOUTS:
        target = _bounded_target(width, capacity, cached)
        before = snapshot(target)
        try:
            te.checkpoint.load(target, root)
        except CheckpointError as e:
            assert "table 'w'" in str(e) and "bucket" in str(e), str(e)
            assert_same(snapshot(target), before)
            outcomes[width, capacity] = "refused"
            continue
        got = rows_of(target, "w")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (width, capacity)
        outcomes[width, capacity] = "loaded"
    assert outcomes[32, 32] == "loaded"  # the saved layout holds what it saved
    assert "refused" in outcomes.values(), outcomes  # some layout here cannot hold them


def test_a_key_both_stored_and_deleted_by_one_delta_is_refused(tmp_path) -> None:
    """A delta stores the rows present at its save and deletes the base's keys absent then: never
    one key both ways. Which would win depends on the order of applying them."""
    model = Model(None)  # "w" is bounded: its evictions make deletions
    train(model, range(6))
    base = te.checkpoint.save(model, tmp_path / "ckpt", buffer_bytes=512)
    train(model, range(6, 12))
    delta = te.checkpoint.save(model, tmp_path / "ckpt", buffer_bytes=512, base=base)
    manifest = read_manifest(delta)
    deleted, stored = chunks_of(manifest, "w", "deleted")[0], chunks_of(manifest, "w")[0]
    key = int(load_bytes((delta / stored["file"]).read_bytes())["keys"][0])
    tensors = load_bytes((delta / deleted["file"]).read_bytes())
    tensors["keys"][0] = key
    replace_file(delta, deleted, save_bytes(tensors))
    target = Model(None, bounded=False)
    before = snapshot(target)
    with pytest.raises(CheckpointError, match=rf"table 'w'.*key {key}") as info:
        te.checkpoint.load(target, tmp_path / "ckpt")
    for entry in (deleted, stored):
        assert Path(entry["file"]).name in str(info.value)
    assert_same(snapshot(target), before)
