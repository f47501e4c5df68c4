"""Deltas: which rows changed since a base version, by a 64-bit hash of each row and its score.

The fingerprints of a save (keys sorted, their hashes: 16 bytes a row) are kept in
``FINGERPRINTS`` by (version directory, rank) for the next delta, or rebuilt from the base chain's
files (their paths, sizes and hashes checked) in another process.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tieredemb.checkpoint import manifest as manifests
from tieredemb.checkpoint.paths import version_dir
from tieredemb.checkpoint.verify import parse, read_file
from tieredemb.init import splitmix64

Prints = dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]  # (collection, table) -> (keys, hashes)

# fingerprints of the rows each save wrote, by (version directory, rank): what a delta compares with
FINGERPRINTS: dict[tuple[str, int], Prints] = {}
EMPTY_PRINT = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


def row_hash(rows: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """int64 (n,): a 64-bit hash of each row's bits (float32 or 16-bit values) and its score (a
    changed row is missed with probability ~2**-64)."""
    rows = rows.contiguous()
    weights = splitmix64(torch.arange(1, rows.shape[1] + 1, dtype=torch.int64, device=rows.device))
    mixed = torch.empty(rows.shape[0], dtype=torch.int64, device=rows.device)
    # in blocks of rows: the int64 widening of a whole chunk would take 4x the chunk's own bytes (a
    # save's memory is the chunk and its serialized copy; a 4 MB chunk's hash briefly held 16 MB more)
    step = max(1, (1 << 17) // max(1, rows.shape[1]))
    for lo in range(0, rows.shape[0], step):
        part = rows[lo : lo + step]
        bits = part.view(torch.int32 if part.element_size() == 4 else torch.int16).to(torch.int64)
        mixed[lo : lo + step] = (bits * weights).sum(1)
    return splitmix64(mixed ^ splitmix64(scores.to(torch.int64)))


def fingerprint(keys: list[torch.Tensor], hashes: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys sorted, their hashes): 16 bytes a row, looked up by binary search."""
    if not keys:
        return EMPTY_PRINT
    k, h = torch.cat(keys), torch.cat(hashes)
    order = torch.argsort(k)
    return k[order], h[order]


def lookup(base: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(known: bool (n,), position in ``base`` where known)."""
    if base[0].numel() == 0:
        return torch.zeros(keys.numel(), dtype=torch.bool), torch.zeros(keys.numel(), dtype=torch.int64)
    pos = torch.searchsorted(base[0], keys).clamp(max=base[0].numel() - 1)
    return base[0][pos] == keys, pos


def base_fingerprints(root: Path, base: Path, rank: int, world: int) -> Prints:
    """The fingerprints of the rows as of version ``base``: kept from the save that wrote it, or
    rebuilt from its files (this rank's shard files of the chain)."""
    if base.parent.resolve() != root.resolve():
        raise ValueError(f"base {base} is not a version of the checkpoint at {root}")
    base = version_dir(root, base.name, "base")
    cached = FINGERPRINTS.get((str(base.resolve()), rank))
    if cached is not None:
        return cached
    state: dict[tuple[str, str], dict[int, int]] = {}
    for version, manifest in manifests.chain(root, base):
        if manifest["world_size"] != world:
            raise ValueError(f"a delta needs the base's world size ({manifest['world_size']}), this "
                             f"process group has {world}")
        for cname, by_table in manifest["files"].items():
            for table, by_kind in by_table.items():
                rows = state.setdefault((cname, table), {})
                for kind in ("rows", "deleted"):
                    for entry in by_kind.get(kind, []):
                        if entry["file"].split("/")[-1].startswith(f"r{rank}-"):
                            _replay(rows, parse(*read_file(version, entry)), kind)
    return {name: fingerprint([torch.tensor(list(rows), dtype=torch.int64)],
                              [torch.tensor(list(rows.values()), dtype=torch.int64)])
            for name, rows in state.items()}


def _replay(rows: dict[int, int], tensors: dict[str, torch.Tensor], kind: str) -> None:
    if kind == "deleted":
        for k in tensors["keys"].tolist():
            rows.pop(k, None)
    else:
        hashes = row_hash(tensors["rows"], tensors["scores"])
        rows.update(zip(tensors["keys"].tolist(), hashes.tolist()))


__all__ = ["EMPTY_PRINT", "FINGERPRINTS", "base_fingerprints", "fingerprint", "lookup", "row_hash"]
