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
chunk at a time: a chunk and its two serialized copies fit in ``buffer_bytes`` (256 MiB by default),
whatever the table size. A save goes
into a new version directory, every file fsynced, and only then does ``LATEST`` move to it (write,
fsync, ``os.replace``): a crash at any point leaves the previous version loadable. Versions the new
one does not build on are removed after. A file whose size or SHA-256 differs from the manifest is
refused with ``CheckpointError`` naming it.

``save(..., base=version)`` writes a delta: the rows changed since ``version`` (found by a hash of
each row and score) and ``r<rank>-deleted`` files of the keys lost since; its manifest names its
base, and ``load`` applies the chain from the full version on.

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

from tieredemb.init import splitmix64
from tieredemb.modules.collection import CollectionBase, dense_only

FORMAT = 1
DEFAULT_BUFFER = 256 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupted, truncated, or for another model."""


def _collections(model: torch.nn.Module) -> dict[str, CollectionBase]:
    found = {name or "model": m for name, m in model.named_modules() if isinstance(m, CollectionBase)}
    if not found:
        raise ValueError("the model has no te.EmbeddingBagCollection or te.EmbeddingCollection")
    return found


def _group(collections: dict[str, CollectionBase]):
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


def save(model: torch.nn.Module, path: str | os.PathLike, buffer_bytes: int = DEFAULT_BUFFER,
         base: str | os.PathLike | None = None) -> Path:
    """Save every collection of ``model`` and its dense ``state_dict`` under ``path``. Every rank
    of a sharded model calls it (a collective); ``path`` must be the same directory on every rank.
    Returns the version directory written.

    ``base``: a version directory an earlier ``save`` under ``path`` returned. Then only the rows
    that changed since it (weights, optimizer state or score) and the keys deleted since are
    written: a delta, O(rows touched) bytes. ``load`` applies the chain base + deltas. The world
    size must be the base's."""
    if buffer_bytes < 1:
        raise ValueError(f"buffer_bytes must be >= 1, got {buffer_bytes}")
    collections = _collections(model)
    group = _group(collections)
    rank, world = _rank_world(group)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    previous = _base_fingerprints(root, Path(base), rank, world) if base is not None else None
    version = None
    if rank == 0:
        version = _next_version(root)
    if group is not None:  # every rank writes into rank 0's new version directory
        box = [version]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        version = box[0]
    out = root / version
    files, prints = _save_rows(collections, out, rank, buffer_bytes, previous)
    (out / f"files-r{rank}.json").write_text(json.dumps(files))
    _barrier(group)
    if rank == 0:
        _publish(model, collections, root, out, world, None if base is None else Path(base).name)
    _barrier(group)
    _FINGERPRINTS[(str(out.resolve()), rank)] = prints
    return out


def _save_rows(collections: dict[str, CollectionBase], out: Path, rank: int, buffer_bytes: int,
               previous: dict | None) -> tuple[dict, dict]:
    """This rank's rows of every table, chunk by chunk (against ``previous`` fingerprints: only the
    changed rows, and the deleted keys); its manifest entries by table, and the rows' fingerprints."""
    files: dict[str, list] = {}
    prints: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for cname, collection in collections.items():
        collection.flush()
        for table, meta in collection.checkpoint_meta()["tables"].items():
            name = f"{cname}/{table}"
            # a chunk, safetensors' bytes copy of it and the serialized file are alive at once:
            # a third of the buffer each
            rows_per_chunk = max(1, buffer_bytes // (3 * (4 * meta["width"] + 16)))
            base = None if previous is None else previous.get(name, _EMPTY_PRINT)
            seen = None if base is None else torch.zeros(base[0].numel(), dtype=torch.bool)
            entries, all_keys, all_hashes = files.setdefault(name, []), [], []
            for c, (keys, rows, scores) in enumerate(collection.export_chunks(table, rows_per_chunk)):
                hashes = row_hash(rows, scores)
                all_keys.append(keys)
                all_hashes.append(hashes)
                if base is not None:  # keep the rows that are new or differ from the base's
                    known, pos = _lookup(base, keys)
                    seen[pos[known]] = True
                    same = known.clone()
                    same[known] = base[1][pos[known]] == hashes[known]
                    changed = (~same).nonzero().squeeze(1)
                    keys, rows, scores = keys[changed], rows[changed], scores[changed]
                    if keys.numel() == 0:
                        continue
                rel = f"{name}/r{rank}-c{c:05d}.safetensors"
                data = save_bytes({"keys": keys.contiguous(), "rows": rows.contiguous(),
                                   "scores": scores.contiguous()})
                entries.append({"file": rel, "rows": keys.numel(), **_write(out / rel, data)})
            prints[name] = _fingerprint(all_keys, all_hashes)
            if base is not None and not bool(seen.all()):  # keys the base has and the table lost
                rel = f"{name}/r{rank}-deleted.safetensors"
                gone = base[0][~seen].contiguous()
                files.setdefault(f"{name}:deleted", []).append(
                    {"file": rel, "rows": gone.numel(), **_write(out / rel, save_bytes({"keys": gone}))})
            keys, counts = collection.admission_counts(table)
            if keys.numel():
                rel = f"{name}/r{rank}-admission.safetensors"
                data = save_bytes({"keys": keys.contiguous(), "counts": counts.contiguous()})
                files.setdefault(f"{name}:admission", []).append(
                    {"file": rel, "rows": keys.numel(), **_write(out / rel, data)})
    return files, prints


# fingerprints of the rows each save wrote, by (version directory, rank): what a delta compares with
_FINGERPRINTS: dict[tuple[str, int], dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
_EMPTY_PRINT = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


def row_hash(rows: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """int64 (n,): a 64-bit hash of each row's float32 bits and its score (a changed row is missed
    with probability ~2**-64)."""
    rows = rows.contiguous()
    weights = splitmix64(torch.arange(1, rows.shape[1] + 1, dtype=torch.int64, device=rows.device))
    mixed = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
    # in blocks of rows: the int64 widening of a whole chunk would take 4x the chunk's own bytes (a
    # save's memory is the chunk and its serialized copy; a 4 MB chunk's hash briefly held 16 MB more)
    step = max(1, (1 << 17) // max(1, rows.shape[1]))
    for lo in range(0, rows.shape[0], step):
        bits = rows[lo : lo + step].view(torch.int32).to(torch.int64)
        mixed[lo : lo + step] = (bits * weights).sum(1)
    return splitmix64(mixed ^ splitmix64(scores.to(torch.int64)))


def _fingerprint(keys: list[torch.Tensor], hashes: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys sorted, their hashes): 16 bytes a row, looked up by binary search."""
    if not keys:
        return _EMPTY_PRINT
    k, h = torch.cat(keys), torch.cat(hashes)
    order = torch.argsort(k)
    return k[order], h[order]


def _lookup(base: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(known: bool (n,), position in ``base`` where known)."""
    if base[0].numel() == 0:
        return torch.zeros(keys.numel(), dtype=torch.bool), torch.zeros(keys.numel(), dtype=torch.int64)
    pos = torch.searchsorted(base[0], keys).clamp(max=base[0].numel() - 1)
    return base[0][pos] == keys, pos


def _base_fingerprints(root: Path, base: Path, rank: int, world: int) -> dict:
    """The fingerprints of the rows as of version ``base``: kept from the save that wrote it, or
    rebuilt from its files (this rank's shard files of the chain)."""
    if base.parent.resolve() != root.resolve():
        raise ValueError(f"base {base} is not a version of the checkpoint at {root}")
    cached = _FINGERPRINTS.get((str(base.resolve()), rank))
    if cached is not None:
        return cached
    state: dict[str, dict[int, int]] = {}
    for version, manifest in _chain(root, base.name):
        if manifest["world_size"] != world:
            raise ValueError(f"a delta needs the base's world size ({manifest['world_size']}), this "
                             f"process group has {world}")
        for name, entries in manifest["files"].items():
            table, _, kind = name.partition(":")
            rows = state.setdefault(table, {})
            for entry in entries:
                if not entry["file"].split("/")[-1].startswith(f"r{rank}-") or kind == "admission":
                    continue
                tensors = load_bytes(_read(version, entry))
                if kind == "deleted":
                    for k in tensors["keys"].tolist():
                        rows.pop(k, None)
                else:
                    hashes = row_hash(tensors["rows"], tensors["scores"])
                    rows.update(zip(tensors["keys"].tolist(), hashes.tolist()))
    return {name: _fingerprint([torch.tensor(list(rows), dtype=torch.int64)],
                               [torch.tensor(list(rows.values()), dtype=torch.int64)])
            for name, rows in state.items()}


def _chain(root: Path, name: str) -> list[tuple[Path, dict]]:
    """The versions to apply for version ``name``: its full base first, then each delta."""
    chain = []
    while name is not None:
        out, manifest = _manifest_of(root / name)
        chain.append((out, manifest))
        name = manifest.get("base")
    return chain[::-1]


def _publish(model: torch.nn.Module, collections: dict[str, CollectionBase], root: Path, out: Path,
             world: int, base: str | None) -> None:
    """Rank 0: the dense state and the manifest, then ``LATEST`` moved to this version (the one
    atomic step), then the older versions removed."""
    merged: dict[str, list] = {}
    for r in range(world):
        for key, entries in json.loads((out / f"files-r{r}.json").read_text()).items():
            merged.setdefault(key, []).extend(entries)
    with dense_only(model):
        dense = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
    manifest = {
        "format": FORMAT, "world_size": world, "base": base,
        "dense": {"file": "dense.safetensors", **_write(out / "dense.safetensors", save_bytes(dense))},
        "collections": {name: c.checkpoint_meta() for name, c in collections.items()},
        "files": merged,
    }
    _write(out / "manifest.json", json.dumps(manifest, indent=1).encode())
    _fsync_dir(out)
    _write(root / "LATEST.tmp", out.name.encode())
    os.replace(root / "LATEST.tmp", root / "LATEST")  # the switch: atomic
    _fsync_dir(root)
    keep = {version.name for version, _ in _chain(root, out.name)}
    for old in root.glob("v-*"):  # versions this one does not build on, leftovers of crashed saves
        if old.name not in keep:
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


def _manifest_of(out: Path) -> tuple[Path, dict]:
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {out}: manifest.json missing or unreadable") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {out}: format {manifest.get('format')!r}, expected {FORMAT}")
    return out, manifest


def _latest(root: Path) -> str:
    latest = root / "LATEST"
    if not latest.is_file():
        raise CheckpointError(f"{root} is not a checkpoint (no LATEST file)")
    return latest.read_text().strip()


def load(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load the checkpoint at ``path`` into ``model``, whose collections must be freshly built
    (no rows yet) with the saved tables' dims and optimizer; storage, cache sizes, backends and the
    world size may differ. Every rank of a sharded model calls it (a collective)."""
    collections = _collections(model)
    group = _group(collections)
    rank, world = _rank_world(group)
    root = Path(path)
    chain = _chain(root, _latest(root))
    out, manifest = chain[-1]
    saved = manifest["collections"]
    for name, collection in collections.items():
        _check_compatible(name, collection, saved.get(name), out)
    with dense_only(model):
        model.load_state_dict(load_bytes(_read(out, manifest["dense"])))
    for name, collection in collections.items():
        meta = saved[name]
        for table in meta["tables"]:
            width = meta["tables"][table]["width"]
            for version, vmanifest in chain:  # the full base, then each delta: upserts and deletions
                for kind in ("rows", "deleted"):
                    key = f"{name}/{table}" + ("" if kind == "rows" else ":deleted")
                    _apply(collection, table, width, version, vmanifest["files"].get(key, []), kind, rank,
                           world)
            _apply(collection, table, width, out, manifest["files"].get(f"{name}/{table}:admission", []),
                   "admission", rank, world)
        collection.restore_progress(meta["step"], meta["clock"])


def _apply(collection: CollectionBase, table: str, width: int, out: Path, entries: list, kind: str, rank: int,
           world: int) -> None:
    """Each rank reads every ``world``-th file; every rank makes the same number of (collective)
    restores."""
    for r in range(-(-len(entries) // world)):
        i = r * world + rank
        tensors = load_bytes(_read(out, entries[i])) if i < len(entries) else None
        _restore(collection, table, width, tensors, kind)


def _restore(collection: CollectionBase, table: str, width: int, tensors: dict | None, kind: str) -> None:
    keys = torch.empty(0, dtype=torch.int64) if tensors is None else tensors["keys"]
    if kind == "deleted":
        collection.delete_rows(table, keys)
        return
    if kind == "admission":
        counts = torch.empty(0, dtype=torch.int64) if tensors is None else tensors["counts"]
        collection.import_admission(table, keys, counts)
        return
    rows, scores = torch.empty(keys.numel(), width), torch.empty(0, dtype=torch.int64)
    if tensors is not None:
        rows, scores = tensors["rows"], tensors["scores"]
    collection.import_rows(table, keys, rows, scores)


def _check_compatible(name: str, collection: CollectionBase, meta: dict | None, out: Path) -> None:
    if meta is None:
        raise CheckpointError(f"checkpoint {out} has no collection {name!r}")
    mine = collection.checkpoint_meta()
    if set(mine["tables"]) != set(meta["tables"]):
        raise CheckpointError(f"collection {name!r}: tables {sorted(mine['tables'])}, the checkpoint has "
                              f"{sorted(meta['tables'])}")
    for table, spec in meta["tables"].items():
        if mine["tables"][table] != spec:
            raise CheckpointError(f"collection {name!r} table {table!r}: dim and row width "
                                  f"{mine['tables'][table]}, the checkpoint has {spec} (another "
                                  "embedding_dim or optimizer)")
    if not collection.is_empty():
        raise ValueError(f"collection {name!r} already holds rows: load a checkpoint into freshly built "
                         "collections")


__all__ = ["CheckpointError", "load", "save"]
