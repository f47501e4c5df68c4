"""Paths of a checkpoint: names encoded on save, every path read checked to lie inside its directory.

Nothing read from a checkpoint (a manifest entry, ``LATEST``, a delta's base) and no table or
collection name is used as a path as it stands: names go through ``encode_name``, version names
must read ``v-NNNNNN``, and a file's path must be relative, free of ``..`` and, with its symlinks
resolved, still inside the version directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import string
from pathlib import Path

from tieredemb.checkpoint.errors import CheckpointError

_SAFE = frozenset(string.ascii_letters + string.digits + "_-")
_VERSION = re.compile(r"v-[0-9]{6,}")


def encode_name(name: str) -> str:
    """A file name for a table or collection name: its safe characters (others as ``_``, at most 48)
    and 16 hex digits of its SHA-256, so that two names never share a directory and no name (``..``,
    ``/abs``, ``a/b``) becomes a path."""
    readable = "".join(ch if ch in _SAFE else "_" for ch in name)[:48]
    return f"{readable}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"


def version_dir(root: Path, name: object, source: str) -> Path:
    """``root / name`` for a version name read from ``source`` (``LATEST``, a manifest's base)."""
    if not isinstance(name, str) or not _VERSION.fullmatch(name):
        raise CheckpointError(f"{source} names {name!r}, not a version of the checkpoint at {root} "
                              "(v-NNNNNN): refused, it could lie outside the checkpoint directory")
    return inside(root, name, source)


def inside(directory: Path, rel: object, source: str) -> Path:
    """``directory / rel``, refused unless ``rel`` is a plain relative path that stays inside
    ``directory`` with every symlink resolved."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if (not parts or "\x00" in rel or "\\" in rel or os.path.isabs(rel)
            or any(p in ("", ".", "..") for p in parts)):
        raise CheckpointError(f"{source}: path {rel!r} lies outside {directory} (an absolute path or "
                              "'..' component): refused")
    path = directory.joinpath(*parts)
    real = path.resolve()
    if not real.is_relative_to(directory.resolve()):
        raise CheckpointError(f"{source}: {path} lies outside {directory} (it resolves to {real}): refused")
    return path


def read_latest(root: Path) -> Path:
    """The version directory ``root/LATEST`` names."""
    latest = root / "LATEST"
    if not latest.is_file():
        raise CheckpointError(f"{root} is not a checkpoint (no LATEST file)")
    try:
        name = latest.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{latest} is not UTF-8 text ({e.reason} at byte {e.start}): not a "
                              "checkpoint's LATEST pointer") from e
    return version_dir(root, name, str(latest))


__all__ = ["encode_name", "inside", "read_latest", "version_dir"]
