"""Checkpoints: every embedding collection of a model (rows streamed in chunks) and its dense state.

    te.checkpoint.save(model, path)      # every rank calls it (sharded collections: each its shard)
    te.checkpoint.load(model, path)      # into freshly built collections, any storage or world size

Layout of ``path`` (a directory)::

    LATEST                      the name of the current version (replaced atomically)
    v-000003/
        manifest.json           format, world size, per collection: step, clock, tables (dim, width)
                                and their files; every file's size and SHA-256; dense.safetensors
        dense.safetensors       the model's state_dict (parameters and buffers: the dense part)
        <collection>/<table>/r<rank>-c<chunk>.safetensors   keys, rows ([weights | optimizer state]),
                                scores of one chunk of one rank's shard
        <collection>/<table>/r<rank>-admission.safetensors  keys and counts toward admission

Files are safetensors (no pickle anywhere: loading a checkpoint runs no code). Rows are written one
chunk at a time: a chunk and its serialized copy fit in ``buffer_bytes`` (256 MiB by default),
whatever the table size. A save goes
into a new version directory, every file fsynced, and only then does ``LATEST`` move to it (write,
fsync, ``os.replace``): a crash at any point leaves the previous version loadable. The previous
version is removed after. A file whose size or SHA-256 differs from the manifest is refused with
``CheckpointError`` naming it.

Loading routes every row to its owner under the loading collection's process group, so a checkpoint
saved by N ranks loads into M ranks, into another storage mode, cache size or backing store: each
rank reads every M-th file and the collective restore sends each row where it belongs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from tieredemb.modules.collection import _Collection

FORMAT = 1
DEFAULT_BUFFER = 256 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupted, truncated, or for another model."""


def _collections(model: torch.nn.Module) -> dict[str, _Collection]:
    found = {name or "model": m for name, m in model.named_modules() if isinstance(m, _Collection)}
    if not found:
        raise ValueError("the model has no te.EmbeddingBagCollection or te.EmbeddingCollection")
    return found


def _group(collections: dict[str, _Collection]):
    groups = {id(c.process_group) for c in collections.values()}
    if len(groups) > 1:
        raise ValueError("all collections of a model must share one process group to be checkpointed")
    return next(iter(collections.values())).process_group


def _rank_world(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _barrier(group) -> None:
    if group is not None:
        dist.barrier(group=group)


def _write(path: Path, data: bytes) -> dict:
    """Write ``data`` durably; its manifest entry (size, SHA-256)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _next_version(root: Path) -> str:
    versions = [int(p.name[2:]) for p in root.glob("v-*") if p.name[2:].isdigit()]
    return f"v-{max(versions, default=0) + 1:06d}"


def save(model: torch.nn.Module, path: str | os.PathLike, buffer_bytes: int = DEFAULT_BUFFER) -> Path:
    """Save every collection of ``model`` and its dense ``state_dict`` under ``path``. Every rank
    of a sharded model calls it (a collective); ``path`` must be the same directory on every rank.
    Returns the version directory written."""
    if buffer_bytes < 1:
        raise ValueError(f"buffer_bytes must be >= 1, got {buffer_bytes}")
    collections = _collections(model)
    group = _group(collections)
    rank, world = _rank_world(group)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    version = None
    if rank == 0:
        version = _next_version(root)
    if group is not None:  # every rank writes into rank 0's new version directory
        box = [version]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        version = box[0]
    out = root / version
    files = _save_rows(collections, out, rank, buffer_bytes)
    (out / f"files-r{rank}.json").write_text(json.dumps(files))
    _barrier(group)
    if rank == 0:
        _publish(model, collections, root, out, world)
    _barrier(group)
    return out


def _save_rows(collections: dict[str, _Collection], out: Path, rank: int, buffer_bytes: int) -> dict:
    """This rank's rows of every table, chunk by chunk; its manifest entries by table."""
    files: dict[str, list] = {}
    for cname, collection in collections.items():
        collection.flush()
        for table, meta in collection._checkpoint_meta()["tables"].items():
            # a chunk and its serialized copy are alive at once: half the buffer each
            rows_per_chunk = max(1, buffer_bytes // (2 * (4 * meta["width"] + 16)))
            entries = files.setdefault(f"{cname}/{table}", [])
            for c, (keys, rows, scores) in enumerate(collection._checkpoint_chunks(table, rows_per_chunk)):
                rel = f"{cname}/{table}/r{rank}-c{c:05d}.safetensors"
                data = save_bytes({"keys": keys.contiguous(), "rows": rows.contiguous(),
                                   "scores": scores.contiguous()})
                entries.append({"file": rel, "rows": keys.numel(), **_write(out / rel, data)})
            keys, counts = collection._checkpoint_admission(table)
            if keys.numel():
                rel = f"{cname}/{table}/r{rank}-admission.safetensors"
                data = save_bytes({"keys": keys.contiguous(), "counts": counts.contiguous()})
                files.setdefault(f"{cname}/{table}:admission", []).append(
                    {"file": rel, "rows": keys.numel(), **_write(out / rel, data)})
    return files


def _publish(model: torch.nn.Module, collections: dict[str, _Collection], root: Path, out: Path,
             world: int) -> None:
    """Rank 0: the dense state and the manifest, then ``LATEST`` moved to this version (the one
    atomic step), then the older versions removed."""
    merged: dict[str, list] = {}
    for r in range(world):
        for key, entries in json.loads((out / f"files-r{r}.json").read_text()).items():
            merged.setdefault(key, []).extend(entries)
    dense = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
    manifest = {
        "format": FORMAT, "world_size": world,
        "dense": {"file": "dense.safetensors", **_write(out / "dense.safetensors", save_bytes(dense))},
        "collections": {name: c._checkpoint_meta() for name, c in collections.items()},
        "files": merged,
    }
    _write(out / "manifest.json", json.dumps(manifest, indent=1).encode())
    _fsync_dir(out)
    _write(root / "LATEST.tmp", out.name.encode())
    os.replace(root / "LATEST.tmp", root / "LATEST")  # the switch: atomic
    _fsync_dir(root)
    for old in root.glob("v-*"):  # older versions, and leftovers of saves that crashed
        if old != out:
            shutil.rmtree(old, ignore_errors=True)


def _read(out: Path, entry: dict) -> bytes:
    path = out / entry["file"]
    try:
        data = path.read_bytes()
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file {path} is missing") from e
    if len(data) != entry["bytes"]:
        raise CheckpointError(f"checkpoint file {path} has {len(data)} bytes, the manifest says "
                              f"{entry['bytes']}: truncated or overwritten")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupted (SHA-256 differs from the manifest)")
    return data


def _manifest(root: Path) -> tuple[Path, dict]:
    latest = root / "LATEST"
    if not latest.is_file():
        raise CheckpointError(f"{root} is not a checkpoint (no LATEST file)")
    out = root / latest.read_text().strip()
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {out}: manifest.json missing or unreadable") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {out}: format {manifest.get('format')!r}, expected {FORMAT}")
    return out, manifest


def load(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load the checkpoint at ``path`` into ``model``, whose collections must be freshly built
    (no rows yet) with the saved tables' dims and optimizer; storage, cache sizes, backends and the
    world size may differ. Every rank of a sharded model calls it (a collective)."""
    collections = _collections(model)
    group = _group(collections)
    rank, world = _rank_world(group)
    out, manifest = _manifest(Path(path))
    saved = manifest["collections"]
    for name, collection in collections.items():
        _check_compatible(name, collection, saved.get(name), out)
    dense = load_bytes(_read(out, manifest["dense"]))
    model.load_state_dict(dense)
    for name, collection in collections.items():
        meta = saved[name]
        for table in meta["tables"]:
            for key, admission in ((f"{name}/{table}", False), (f"{name}/{table}:admission", True)):
                entries = manifest["files"].get(key, [])
                rounds = -(-len(entries) // world)
                for r in range(rounds):  # every rank the same number of (collective) restores
                    i = r * world + rank
                    tensors = load_bytes(_read(out, entries[i])) if i < len(entries) else None
                    _restore(collection, table, meta["tables"][table]["width"], tensors, admission)
        collection.step, collection._clock = meta["step"], meta["clock"]


def _restore(collection: _Collection, table: str, width: int, tensors: dict | None, admission: bool) -> None:
    if tensors is None:
        keys = torch.empty(0, dtype=torch.int64)
        rows, scores = torch.empty(0, width), torch.empty(0, dtype=torch.int64)
    elif admission:
        keys, scores = tensors["keys"], tensors["counts"]
        rows = torch.empty(keys.numel(), width)
    else:
        keys, rows, scores = tensors["keys"], tensors["rows"], tensors["scores"]
    collection._restore_rows(table, keys, rows, scores, admission=admission)


def _check_compatible(name: str, collection: _Collection, meta: dict | None, out: Path) -> None:
    if meta is None:
        raise CheckpointError(f"checkpoint {out} has no collection {name!r}")
    mine = collection._checkpoint_meta()
    if set(mine["tables"]) != set(meta["tables"]):
        raise CheckpointError(f"collection {name!r}: tables {sorted(mine['tables'])}, the checkpoint has "
                              f"{sorted(meta['tables'])}")
    for table, spec in meta["tables"].items():
        if mine["tables"][table] != spec:
            raise CheckpointError(f"collection {name!r} table {table!r}: dim and row width "
                                  f"{mine['tables'][table]}, the checkpoint has {spec} (another "
                                  "embedding_dim or optimizer)")
    if not collection._is_empty():
        raise ValueError(f"collection {name!r} already holds rows: load a checkpoint into freshly built "
                         "collections")


__all__ = ["CheckpointError", "load", "save"]
