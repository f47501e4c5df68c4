"""The manifest of a checkpoint version: what it holds, every file's size and SHA-256, and its own
checksum (SHA-256 of its canonical JSON without the ``checksum`` field).

Format 2::

    {"format": 2, "world_size": 2, "base": null | "v-000003", "base_checksum": null | "<hex>",
     "dense": {"file": "dense.safetensors", "bytes": ..., "sha256": ...},
     "collections": {"<collection>": {"step": 6, "clock": 6, "seed": 7, "optimizer": "Adam",
         "tables": {"<table>": {"dim": 4, "width": 12, "dtype": "float32", "num_embeddings": 200,
                                "max_capacity": null, "rows": 180}}}},
     "files": {"<collection>": {"<table>": {"rows": [entry...], "deleted": [...], "admission": [...]}}},
     "checksum": "<hex>"}

    entry = {"file": "<relative path>", "rows": n, "bytes": ..., "sha256": ...}

Reading a manifest checks, before anything else is trusted: UTF-8 JSON, the format, the checksum,
then the type of every field; a delta's base must carry the checksum the delta recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from tieredemb.checkpoint.errors import CheckpointError
from tieredemb.checkpoint.paths import version_dir

FORMAT = 2
KINDS = ("rows", "deleted", "admission")
_BOUNDS = ("num_embeddings", "max_capacity")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def checksum(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: dict) -> bytes:
    """The manifest's bytes, its checksum added."""
    manifest = {**manifest, "checksum": checksum(manifest)}
    return json.dumps(manifest, indent=1).encode()


def read(out: Path) -> dict:
    """The checked manifest of version directory ``out``."""
    path = out / "manifest.json"
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint manifest {path} is missing") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint manifest {path} is not UTF-8 JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise CheckpointError(f"checkpoint manifest {path} is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint manifest {path}: format {manifest.get('format')!r}; this version "
                              f"of tieredemb reads format {FORMAT} only")
    if manifest.get("checksum") != checksum(manifest):
        raise CheckpointError(f"checkpoint manifest {path}: its checksum does not match its contents "
                              "(edited or corrupted)")
    _check_fields(manifest, path)
    return manifest


def chain(root: Path, out: Path) -> list[tuple[Path, dict]]:
    """The versions to apply for version directory ``out``: its full base first, then each delta;
    each base checked to be the one its delta was saved against (its checksum)."""
    versions = [(out, read(out))]
    while versions[-1][1]["base"] is not None:
        delta, manifest = versions[-1]
        base = version_dir(root, manifest["base"], str(delta / "manifest.json"))
        if any(base == v for v, _ in versions):
            raise CheckpointError(f"checkpoint manifest {delta / 'manifest.json'}: its chain of bases loops")
        base_manifest = read(base)
        if base_manifest["checksum"] != manifest["base_checksum"]:
            raise CheckpointError(f"checkpoint manifest {delta / 'manifest.json'}: its base {base} is not "
                                  "the version it was saved against (another manifest checksum)")
        versions.append((base, base_manifest))
    return versions[::-1]


def _is_int(x: object, low: int = 0) -> bool:
    return type(x) is int and x >= low


def _check_fields(manifest: dict, path: Path) -> None:
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"checkpoint manifest {path}: {what}")

    need(_is_int(manifest.get("world_size"), 1), "world_size must be an int >= 1")
    need((manifest.get("base") is None) == (manifest.get("base_checksum") is None),
         "base and base_checksum go together")
    _check_entry(manifest.get("dense"), need, "dense")
    collections, files = manifest.get("collections"), manifest.get("files")
    need(isinstance(collections, dict) and isinstance(files, dict), "collections and files must be objects")
    for name, meta in collections.items():
        need(isinstance(meta, dict) and _is_int(meta.get("step")) and _is_int(meta.get("clock"))
             and isinstance(meta.get("optimizer"), str) and isinstance(meta.get("tables"), dict),
             f"collection {name!r}: step, clock, optimizer or tables missing or mistyped")
        for table, spec in meta["tables"].items():
            need(isinstance(spec, dict) and _is_int(spec.get("dim"), 1) and _is_int(spec.get("width"), 1)
                 and isinstance(spec.get("dtype"), str) and _is_int(spec.get("rows"))
                 and all(spec.get(k) is None or _is_int(spec[k], 1) for k in _BOUNDS),
                 f"collection {name!r} table {table!r}: dim, width, dtype, rows or bounds mistyped")
    for name, by_table in files.items():
        need(name in collections and isinstance(by_table, dict), f"files of an unknown collection {name!r}")
        for table, by_kind in by_table.items():
            need(table in collections[name]["tables"] and isinstance(by_kind, dict)
                 and set(by_kind) <= set(KINDS), f"files of an unknown table {name!r}/{table!r}")
            for kind, entries in by_kind.items():
                need(isinstance(entries, list), f"files of {name!r}/{table!r}/{kind} must be a list")
                for entry in entries:
                    _check_entry(entry, need, f"a file of {name!r}/{table!r}")


def _check_entry(entry: object, need, what: str) -> None:
    need(isinstance(entry, dict) and isinstance(entry.get("file"), str) and _is_int(entry.get("bytes"))
         and isinstance(entry.get("sha256"), str) and _HEX64.fullmatch(entry["sha256"]) is not None
         and (what == "dense" or _is_int(entry.get("rows"))),
         f"{what}: an entry needs file, bytes, sha256 (and rows), got {entry!r}")


__all__ = ["FORMAT", "KINDS", "chain", "checksum", "read", "seal"]
