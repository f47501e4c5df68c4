"""Checkpoints: every embedding collection of a model (rows streamed in chunks) and its dense state.

    te.checkpoint.save(model, path)      # every rank calls it (sharded collections: each its shard)
    te.checkpoint.load(model, path)      # into freshly built collections, any storage or world size

Layout of ``path`` (a directory)::

    LATEST                      the name of the current version (replaced atomically)
    v-000003/
        manifest.json           format, world size, per collection: step, clock, optimizer, tables
                                (dim, width, dtype, bounds, rows) and their files; every file's size
                                and SHA-256; the manifest's own checksum (``manifest.py``)
        dense.safetensors       the model's state_dict (parameters and buffers: the dense part)
        <collection>/<table>/r<rank>-c<chunk>.safetensors   keys, rows ([weights | optimizer state]),
                                scores of one chunk of one rank's shard
        <collection>/<table>/r<rank>-admission.safetensors  keys and counts toward admission

where ``<collection>`` and ``<table>`` are encoded names (``paths.encode_name``): no name is used as
a path. Files are safetensors and JSON (no pickle anywhere: loading a checkpoint runs no code). Rows
are written one chunk at a time: a chunk and its two serialized copies fit in ``buffer_bytes``
(256 MiB by default), whatever the table size. A save goes into a new version directory, every file
fsynced, and only then does ``LATEST`` move to it (write, fsync, ``os.replace``): a crash at any point
leaves the previous version loadable. Versions the new one does not build on are removed after.

``load`` checks everything before it changes anything (``verify.py``): the manifest's checksum and
fields, every path (inside the version directory), every file's size, SHA-256 and contents, the dense
state's names and shapes, and that the saved tables fit the model; then, over all files of a table
(``table_keys.py``), that no key is in two files of one version and that a bounded table holds every
saved row in its buckets. Then it loads, reading each file again. A load that fails leaves the model
as it was.

``save(..., base=version)`` writes a delta: the rows changed since ``version`` (``deltas.py``) and
``r<rank>-deleted`` files of the keys lost since; its manifest names its base and the base manifest's
checksum, and ``load`` applies the chain from the full version on.

Loading routes every row to its owner under the loading collection's process group, so a checkpoint
saved by N ranks loads into M ranks, into another storage mode, cache size or backing store: each
rank reads every M-th file and the collective restore sends each row where it belongs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save as save_bytes

from tieredemb.checkpoint import manifest as manifests
from tieredemb.checkpoint import table_keys, verify
from tieredemb.checkpoint.deltas import EMPTY_PRINT, base_fingerprints, fingerprint, lookup, row_hash
from tieredemb.checkpoint.deltas import FINGERPRINTS as _FINGERPRINTS
from tieredemb.checkpoint.errors import CheckpointError
from tieredemb.checkpoint.manifest import FORMAT, KINDS
from tieredemb.checkpoint.paths import encode_name, read_latest
from tieredemb.modules.collection import CollectionBase, dense_only
from tieredemb.storage.errors import BackendError

log = logging.getLogger(__name__)
DEFAULT_BUFFER = 256 << 20


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
    """Write ``data`` durably, never through a symlink; its manifest entry (size, SHA-256)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as f:
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
    previous = base_fingerprints(root, Path(base), rank, world) if base is not None else None
    version = None
    if rank == 0:
        version = _next_version(root)
    if group is not None:  # every rank writes into rank 0's new version directory
        box = [version]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        version = box[0]
    out = root / version
    files, counts, prints = _save_rows(collections, out, rank, buffer_bytes, previous)
    _write(out / f"files-r{rank}.json", json.dumps({"files": files, "rows": counts}).encode())
    _barrier(group)
    if rank == 0:
        _publish(model, collections, root, out, world, None if base is None else root / Path(base).name)
    _barrier(group)
    _FINGERPRINTS[(str(out.resolve()), rank)] = prints
    return out


def _save_rows(collections: dict[str, CollectionBase], out: Path, rank: int, buffer_bytes: int,
               previous: dict | None) -> tuple[dict, dict, dict]:
    """This rank's rows of every table, chunk by chunk (against ``previous`` fingerprints: only the
    changed rows, and the deleted keys): its manifest entries by collection, table and kind, its row
    count by collection and table, and the rows' fingerprints."""
    files: dict[str, dict] = {}
    counts: dict[str, dict[str, int]] = {}
    prints = {}
    for cname, collection in collections.items():
        try:
            collection.flush()
        except BackendError as e:  # a failing store: the rows it has not taken are still exported
            log.warning("collection %r: %s; saving the rows from where they are", cname, e)
        for table, meta in collection.checkpoint_meta()["tables"].items():
            where = f"{encode_name(cname)}/{encode_name(table)}/r{rank}"
            entries = files.setdefault(cname, {})[table] = {kind: [] for kind in KINDS}
            # a chunk, safetensors' bytes copy of it and the serialized file are alive at once:
            # a third of the buffer each
            rows_per_chunk = max(1, buffer_bytes // (3 * (4 * meta["width"] + 16)))  # (float32 at most)
            base = None if previous is None else previous.get((cname, table), EMPTY_PRINT)
            seen = None if base is None else torch.zeros(base[0].numel(), dtype=torch.bool)
            all_keys, all_hashes = [], []
            for c, (keys, rows, scores) in enumerate(collection.export_chunks(table, rows_per_chunk)):
                hashes = row_hash(rows, scores)
                all_keys.append(keys)
                all_hashes.append(hashes)
                if base is not None:  # keep the rows that are new or differ from the base's
                    known, pos = lookup(base, keys)
                    seen[pos[known]] = True
                    same = known.clone()
                    same[known] = base[1][pos[known]] == hashes[known]
                    changed = (~same).nonzero().squeeze(1)
                    keys, rows, scores = keys[changed], rows[changed], scores[changed]
                    if keys.numel() == 0:
                        continue
                rel = f"{where}-c{c:05d}.safetensors"
                data = save_bytes({"keys": keys.contiguous(), "rows": rows.contiguous(),
                                   "scores": scores.contiguous()})
                entries["rows"].append({"file": rel, "rows": keys.numel(), **_write(out / rel, data)})
            prints[(cname, table)] = fingerprint(all_keys, all_hashes)
            counts.setdefault(cname, {})[table] = sum(k.numel() for k in all_keys)
            if base is not None and not bool(seen.all()):  # keys the base has and the table lost
                rel = f"{where}-deleted.safetensors"
                gone = base[0][~seen].contiguous()
                entries["deleted"].append(
                    {"file": rel, "rows": gone.numel(), **_write(out / rel, save_bytes({"keys": gone}))})
            keys, counted = collection.admission_counts(table)
            if keys.numel():
                rel = f"{where}-admission.safetensors"
                data = save_bytes({"keys": keys.contiguous(), "counts": counted.contiguous()})
                entries["admission"].append({"file": rel, "rows": keys.numel(), **_write(out / rel, data)})
    return files, counts, prints


def _publish(model: torch.nn.Module, collections: dict[str, CollectionBase], root: Path, out: Path,
             world: int, base: Path | None) -> None:
    """Rank 0: the dense state and the manifest, then ``LATEST`` moved to this version (the one
    atomic step), then the older versions removed."""
    files: dict[str, dict] = {}
    counts: dict[str, dict[str, int]] = {}
    for r in range(world):
        part = json.loads((out / f"files-r{r}.json").read_text())
        for cname, by_table in part["files"].items():
            for table, by_kind in by_table.items():
                merged = files.setdefault(cname, {}).setdefault(table, {kind: [] for kind in KINDS})
                for kind, entries in by_kind.items():
                    merged[kind].extend(entries)
        for cname, by_table in part["rows"].items():
            for table, n in by_table.items():
                counts.setdefault(cname, {})[table] = counts.get(cname, {}).get(table, 0) + n
    with dense_only(model):
        dense = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
    manifest = {
        "format": FORMAT, "world_size": world,
        "base": None if base is None else base.name,
        "base_checksum": None if base is None else manifests.read(base)["checksum"],
        "dense": {"file": "dense.safetensors", **_write(out / "dense.safetensors", save_bytes(dense))},
        "collections": {name: verify.table_meta(c, counts.get(name, {})) for name, c in collections.items()},
        "files": files,
    }
    _write(out / "manifest.json", manifests.seal(manifest))
    _fsync_dir(out)
    _write(root / "LATEST.tmp", out.name.encode())
    os.replace(root / "LATEST.tmp", root / "LATEST")  # the switch: atomic
    _fsync_dir(root)
    keep = {version.name for version, _ in manifests.chain(root, out)}
    for old in root.glob("v-*"):  # versions this one does not build on, leftovers of crashed saves
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def load(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load the checkpoint at ``path`` into ``model``, whose collections must be freshly built
    (no rows yet) with the saved tables' dims and optimizer; storage, cache sizes, backends and the
    world size may differ. Every rank of a sharded model calls it (a collective).

    Everything is checked first (every rank its share of the files, then the ranks agree); a
    ``CheckpointError`` (or ``ValueError``) then leaves the model as it was."""
    collections = _collections(model)
    group = _group(collections)
    rank, world = _rank_world(group)
    root = Path(path)
    problem, chain, dense, keys = None, [], {}, []
    try:
        chain = manifests.chain(root, read_latest(root))
        dense, keys = _verify(model, collections, chain, rank, world)
    except ValueError as e:  # CheckpointError, or a collection that already holds rows
        problem = e
    _agree(group, problem)
    _agree(group, table_keys.check(keys, [collections[t.collection] for t in keys]))
    with dense_only(model):
        model.load_state_dict(dense)
    out, last = chain[-1]
    for name, collection in collections.items():
        meta = last["collections"][name]
        configs = {c.name: c for c in collection.table_configs}
        for table, spec in meta["tables"].items():
            for version, manifest in chain:  # the full base, then each delta: deletions and upserts
                # (a delta deletes no key it stores: deleting first, a bounded table's buckets never
                # hold more than one version's keys, which they held when it was saved)
                for kind in ("deleted", "rows"):
                    _apply(collection, configs[table], spec, version,
                           _entries(manifest, name, table, kind), kind, rank, world)
            _apply(collection, configs[table], spec, out, _entries(last, name, table, "admission"),
                   "admission", rank, world)
        collection.restore_progress(meta["step"], meta["clock"])


def _entries(manifest: dict, collection: str, table: str, kind: str) -> list[dict]:
    return manifest["files"].get(collection, {}).get(table, {}).get(kind, [])


def _verify(model: torch.nn.Module, collections: dict[str, CollectionBase], chain: list, rank: int,
            world: int) -> tuple[dict[str, torch.Tensor], list[table_keys.TableKeys]]:
    """The checks of a load that each rank makes alone, before any change: the tables fit the
    model, the collections are empty, this rank's share of the files (read one at a time) is sound.
    Returns the dense state and the keys of every table's files this rank read."""
    out, last = chain[-1]
    extra = sorted(set(last["collections"]) - set(collections))
    if extra:
        raise CheckpointError(f"checkpoint {out} has collections {extra} the model lacks "
                              f"(the model has {sorted(collections)})")
    for name, collection in collections.items():
        verify.fit(name, collection, last["collections"].get(name), world, last["world_size"], out)
    for name, collection in collections.items():
        if not collection.is_empty():
            raise ValueError(f"collection {name!r} already holds rows: load a checkpoint into freshly built "
                             "collections")
    keys = _verify_files(collections, chain, rank, world)
    with dense_only(model):
        mine = model.state_dict()
    return verify.dense_state(*verify.read_file(out, last["dense"]), mine), keys


def _verify_files(collections: dict[str, CollectionBase], chain: list, rank: int,
                  world: int) -> list[table_keys.TableKeys]:
    """This rank's share of every table file of the chain (every ``world``-th, as ``_apply`` reads
    them), one at a time; the keys of each table's files."""
    out, last = chain[-1]
    for version, manifest in chain:
        for name, by_table in manifest["files"].items():
            if name not in collections or set(by_table) - set(last["collections"][name]["tables"]):
                raise CheckpointError(f"checkpoint {version} holds files of tables the model lacks "
                                      f"(collection {name!r}: {sorted(by_table)})")
    tables = []
    for name, collection in collections.items():
        for config in collection.table_configs:
            spec = last["collections"][name]["tables"][config.name]
            tables.append(table_keys.TableKeys(chain, name, config.name))
            for v, (version, manifest) in enumerate(chain):
                kinds = KINDS if version == out else ("rows", "deleted")  # admission: the last version's
                for kind in kinds:
                    entries = _entries(manifest, name, config.name, kind)
                    for i in range(rank, len(entries), world):
                        tensors = verify.table_file(version, entries[i], kind, config, spec["width"],
                                                    spec["dtype"])
                        tables[-1].add(tensors["keys"], v, kind, i)
    return tables


def _agree(group, problem: Exception | None) -> None:
    """Raise on every rank if any rank found a problem (each checked its share of the files)."""
    if group is not None:
        found = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, None if problem is None else str(problem), group=group)
        if problem is None:
            for r, message in enumerate(found):
                if message is not None:
                    raise CheckpointError(f"rank {r} refused the checkpoint: {message}")
    if problem is not None:
        raise problem


def _apply(collection: CollectionBase, config, spec: dict, out: Path, entries: list, kind: str, rank: int,
           world: int) -> None:
    """Each rank reads every ``world``-th file (checked again as it is read); every rank makes the
    same number of (collective) restores. ``spec``: the saved table's manifest entry."""
    for r in range(-(-len(entries) // world)):
        i = r * world + rank
        tensors = (verify.table_file(out, entries[i], kind, config, spec["width"], spec["dtype"])
                   if i < len(entries) else None)
        _restore(collection, config.name, spec["width"], tensors, kind)


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




def __getattr__(name: str):
    # the DCP planners import torch.distributed.checkpoint (~1 s): only when they are asked for
    if name in ("DCPSavePlanner", "DCPLoadPlanner"):
        from tieredemb.checkpoint import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CheckpointError", "DCPLoadPlanner", "DCPSavePlanner", "load", "row_hash", "save"]
