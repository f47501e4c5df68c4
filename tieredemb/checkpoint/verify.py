"""The checks a load makes before it changes anything: each file's size and SHA-256, its safetensors
contents (tensor names, dtypes, shapes, row counts, keys, finite rows), the dense state's names and
shapes, and whether the saved tables fit the model (names, dims, row width, optimizer, dtype,
``num_embeddings``, ``max_capacity``).

Every failure is a ``CheckpointError`` naming the file (or the collection and table) and what is wrong.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load as load_bytes

from tieredemb.checkpoint.errors import CheckpointError
from tieredemb.checkpoint.paths import inside
from tieredemb.config import RESERVED_KEY, TableConfig
from tieredemb.modules.collection import CollectionBase

# whole rows ([weights | optimizer state]) are saved in their table's dtype, named so in the manifest
ROW_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of a row dtype: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def read_file(out: Path, entry: dict) -> tuple[Path, bytes]:
    """(path, bytes) of a manifest entry's file inside version directory ``out``, its size and
    SHA-256 checked."""
    path = inside(out, entry["file"], f"checkpoint manifest {out / 'manifest.json'}")
    try:
        data = path.read_bytes()
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file {path} is missing") from e
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {e}") from e
    if len(data) != entry["bytes"]:
        raise CheckpointError(f"checkpoint file {path} has {len(data)} bytes, the manifest says "
                              f"{entry['bytes']}: truncated or overwritten")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupted (SHA-256 differs from the manifest)")
    return path, data


def parse(path: Path, data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (anything else, a pickle or a ``torch.save`` file
    included, is refused: nothing in a checkpoint runs code)."""
    try:
        return load_bytes(data)
    except Exception as e:  # safetensors raises its own error types for any malformed header
        raise CheckpointError(f"checkpoint file {path} is not a safetensors file ({e})") from e


def table_file(out: Path, entry: dict, kind: str, config: TableConfig, width: int,
               saved_dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The checked tensors of one chunk file of ``kind`` (rows, deleted, admission) of a table of
    the model (``config``, row ``width``), its rows saved in ``saved_dtype`` (the manifest's name).
    Rows come back in the model table's dtype: converted from the saved one (to the nearest value),
    and refused if a value is not finite there (a float32 row beyond float16's range)."""
    if saved_dtype not in ROW_DTYPES:
        raise CheckpointError(f"checkpoint {out}: table {config.name!r} has rows of dtype {saved_dtype!r}, "
                              f"not one of {sorted(ROW_DTYPES)}")
    path, data = read_file(out, entry)
    tensors = parse(path, data)
    n = entry["rows"]
    expect = {"rows": {"keys": (n,), "rows": (n, width), "scores": (n,)},
              "deleted": {"keys": (n,)},
              "admission": {"keys": (n,), "counts": (n,)}}[kind]
    if set(tensors) != set(expect):
        raise CheckpointError(f"checkpoint file {path}: tensors {sorted(tensors)}, a {kind} file holds "
                              f"{sorted(expect)}")
    for name, shape in expect.items():
        dtype = ROW_DTYPES[saved_dtype] if name == "rows" else torch.int64
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise CheckpointError(f"checkpoint file {path}: {name!r} is {t.dtype} {tuple(t.shape)}, expected "
                                  f"{dtype} {shape} ({n} rows by the manifest, table {config.name!r} rows of "
                                  f"width {width})")
    _check_keys(path, tensors["keys"], config)
    if kind == "rows":
        tensors["rows"] = tensors["rows"].to(config.dtype)
        if not bool(torch.isfinite(tensors["rows"]).all()):
            raise CheckpointError(f"checkpoint file {path}: rows that are not finite (NaN or inf) in the "
                                  f"table's dtype {dtype_name(config.dtype)}")
    if kind == "admission" and n and int(tensors["counts"].min()) < 1:
        raise CheckpointError(f"checkpoint file {path}: admission counts below 1")
    return tensors


def _check_keys(path: Path, keys: torch.Tensor, config: TableConfig) -> None:
    if keys.numel() == 0:
        return
    if bool((keys == RESERVED_KEY).any()):
        raise CheckpointError(f"checkpoint file {path}: key {RESERVED_KEY} is te.RESERVED_KEY, which no "
                              "table stores")
    low, high = int(keys.min()), int(keys.max())
    if config.num_embeddings is not None and (low < 0 or high >= config.num_embeddings):
        bad = low if low < 0 else high
        raise CheckpointError(f"checkpoint file {path}: key {bad} is outside the model's table "
                              f"{config.name!r} (num_embeddings={config.num_embeddings}, keys in [0, "
                              f"{config.num_embeddings})): the model's num_embeddings is too small")
    if torch.unique(keys).numel() != keys.numel():
        raise CheckpointError(f"checkpoint file {path}: a key appears twice")


def dense_state(path: Path, data: bytes, model_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The saved dense state, checked to have exactly the model's names, shapes and dtypes."""
    saved = parse(path, data)
    missing, unexpected = sorted(set(model_state) - set(saved)), sorted(set(saved) - set(model_state))
    if missing or unexpected:
        raise CheckpointError(f"checkpoint file {path}: the model's dense state has {missing} that the "
                              f"checkpoint lacks, the checkpoint has {unexpected} that the model lacks")
    for name, mine in model_state.items():
        theirs = saved[name]
        if tuple(theirs.shape) != tuple(mine.shape) or theirs.dtype != mine.dtype:
            raise CheckpointError(f"checkpoint file {path}: {name} is {theirs.dtype} {tuple(theirs.shape)}, "
                                  f"the model's is {mine.dtype} {tuple(mine.shape)}")
    return saved


def table_meta(collection: CollectionBase, rows: dict[str, int] | None = None) -> dict:
    """What the manifest records of a collection: step, clock, optimizer and, per table, what a load
    checks against the model (``rows``: the table's stored rows, all ranks together)."""
    meta = collection.checkpoint_meta()
    for config in collection.table_configs:
        meta["tables"][config.name].update(
            dtype=dtype_name(config.dtype), num_embeddings=config.num_embeddings,
            max_capacity=config.max_capacity, rows=None if rows is None else rows.get(config.name, 0))
    return meta


def fit(name: str, collection: CollectionBase, saved: dict | None, world: int, saved_world: int,
        where: Path) -> None:
    """Refuse a checkpoint (``saved``: its meta of collection ``name``) whose tables do not fit the
    model's collection, naming the mismatch."""
    if saved is None:
        raise CheckpointError(f"checkpoint {where} has no collection {name!r}")
    mine = table_meta(collection)
    if set(mine["tables"]) != set(saved["tables"]):
        raise CheckpointError(f"collection {name!r}: tables {sorted(mine['tables'])}, the checkpoint {where} "
                              f"has {sorted(saved['tables'])}")
    if mine["optimizer"] != saved["optimizer"]:
        raise CheckpointError(f"collection {name!r}: the model's embedding optimizer is {mine['optimizer']}, "
                              f"the checkpoint {where} holds rows of a {saved['optimizer']} optimizer")
    configs = {c.name: c for c in collection.table_configs}
    for table, spec in saved["tables"].items():
        ours, where_t = mine["tables"][table], f"collection {name!r} table {table!r}"
        for field in ("dim", "width"):  # (a table of another dtype converts the saved rows)
            if ours[field] != spec[field]:
                raise CheckpointError(f"{where_t}: {field} {ours[field]} in the model, {spec[field]} in the "
                                      f"checkpoint {where}")
        _fit_capacity(where_t, configs[table], spec, world, saved_world, where)


def _fit_capacity(where_t: str, config: TableConfig, spec: dict, world: int, saved_world: int,
                  where: Path) -> None:
    """Refuse a bound smaller than the saved rows need: the model's shards together
    (``max_capacity`` each) hold fewer rows than the checkpoint has, and fewer than the saved bound
    did (a bounded table may hold up to its bound rounded up to whole buckets, so a model bounded
    as the saved one was still loads what it saved)."""
    if config.max_capacity is None:
        return
    room = config.max_capacity * world
    saved_room = None if spec["max_capacity"] is None else spec["max_capacity"] * saved_world
    if spec["rows"] > room and (saved_room is None or saved_room > room):
        raise CheckpointError(
            f"{where_t}: max_capacity={config.max_capacity} x {world} rank(s) holds {room} rows, the "
            f"checkpoint {where} has {spec['rows']} rows (saved with max_capacity={spec['max_capacity']} x "
            f"{saved_world}): loading would drop rows")


__all__ = ["ROW_DTYPES", "dense_state", "dtype_name", "fit", "parse", "read_file", "table_file", "table_meta"]
