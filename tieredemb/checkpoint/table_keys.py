"""The checks of a load that need a table's keys from all its files together (after each file's own
checks, ``verify.py``):

- no key is in two files of one version (two chunks, or a chunk and the deletions): which row a
  load kept would depend on the order it read them;
- a bounded table of the model holds every version's keys in its buckets. A load applies the chain
  version by version (each version's deletions, then its rows), so the keys stored after each
  version must fit: a bucket given more keys than its ways would evict saved rows.

Each rank reads its share of the files; the keys then go to the rank that stores them in the model
(``to_owners``), which checks them. Every rank runs the same collectives, table by table, whatever it
finds, and the ranks agree on the verdict afterwards.

Memory: 16 bytes a key read (the key and the number of its file), all of a table's versions at once.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tieredemb.checkpoint.errors import CheckpointError
from tieredemb.checkpoint.manifest import KINDS


class TableKeys:
    """One table's files in a chain, numbered alike on every rank (version by version, kind by kind,
    in manifest order), and the keys this rank read from them.

    Args:
        chain: (version directory, manifest) pairs, the full base first.
        collection, table: the names in the manifests.
    """

    def __init__(self, chain: list[tuple[Path, dict]], collection: str, table: str) -> None:
        self.collection, self.table = collection, table
        self.versions = [out for out, _ in chain]
        self.paths: list[Path] = []  # by file number
        version, kind = [], []  # by file number: its version, its kind (position in KINDS)
        self.first: dict[tuple[int, str], int] = {}  # (version, kind) -> number of its first file
        for v, (out, manifest) in enumerate(chain):
            for k, name in enumerate(KINDS):
                self.first[v, name] = len(self.paths)
                entries = manifest["files"].get(collection, {}).get(table, {}).get(name, [])
                self.paths += [out / e["file"] for e in entries]
                version += [v] * len(entries)
                kind += [k] * len(entries)
        self.version = torch.tensor(version, dtype=torch.int64)
        self.kind = torch.tensor(kind, dtype=torch.int64)
        self.keys: list[torch.Tensor] = []
        self.numbers: list[torch.Tensor] = []

    def add(self, keys: torch.Tensor, version: int, kind: str, entry: int) -> None:
        """``keys`` (int64 (n,)) read from the ``entry``-th file of ``kind`` of the version."""
        self.keys.append(keys)
        self.numbers.append(torch.full_like(keys, self.first[version, kind] + entry))

    def problem(self, model) -> str | None:
        """What keeps the keys of every rank's files from loading into ``model`` (a collection;
        sharded: a collective), or None."""
        keys = torch.cat(self.keys) if self.keys else torch.empty(0, dtype=torch.int64)
        numbers = torch.cat(self.numbers) if self.numbers else torch.empty(0, dtype=torch.int64)
        keys, numbers = (t.cpu() for t in model.to_owners(self.table, keys, numbers))
        return self._twice(keys, numbers) or self._overflow(model, keys, numbers)

    def _twice(self, keys: torch.Tensor, numbers: torch.Tensor) -> str | None:
        """A key in two files of one version: of its rows and deletions, or of its admission counts."""
        group = (self.version * 2 + (self.kind == KINDS.index("admission")))[numbers]
        order = torch.sort(keys, stable=True).indices
        order = order[torch.sort(group[order], stable=True).indices]  # by group, then by key
        k, g = keys[order], group[order]
        twice = ((k[1:] == k[:-1]) & (g[1:] == g[:-1])).nonzero()
        if twice.numel() == 0:
            return None
        i = int(twice[0])
        a, b = (self.paths[int(numbers[order[j]])] for j in (i, i + 1))
        return (f"collection {self.collection!r} table {self.table!r}: key {int(k[i])} is in two files of "
                f"one version, {a} and {b}")

    def _overflow(self, model, keys: torch.Tensor, numbers: torch.Tensor) -> str | None:
        """A bounded table of ``model`` that cannot hold the keys stored after some version."""
        if model.bucket_loads(self.table, keys[:0]) is None:  # unbounded: it grows to hold them
            return None
        version, kind = self.version[numbers], self.kind[numbers]
        held = keys[:0]
        for v, out in enumerate(self.versions):
            held = held[~torch.isin(held, keys[(version == v) & (kind == KINDS.index("deleted"))])]
            held = torch.unique(torch.cat([held, keys[(version == v) & (kind == KINDS.index("rows"))]]))
            loads, width = model.bucket_loads(self.table, held)
            if bool((loads > width).any()):
                rank = "" if model.process_group is None else f" on rank {dist.get_rank(model.process_group)}"
                dropped = int((loads - width).clamp(min=0).sum())
                return (f"collection {self.collection!r} table {self.table!r}: the model's table holds at "
                        f"most {width} rows a bucket (its max_capacity and bucket_width make its buckets); "
                        f"{int(loads.max())} of the keys checkpoint {out} stores{rank} fall in one bucket, "
                        f"and loading would drop {dropped} rows. Load into the saved layout, or a larger "
                        "max_capacity")
        return None


def check(tables: list[TableKeys], models: list) -> CheckpointError | None:
    """The first problem of ``tables`` (each with the collection it loads into, ``models``), or
    None. Every rank runs every table's collectives, whatever it finds."""
    problems = [t.problem(m) for t, m in zip(tables, models)]
    found = next((p for p in problems if p is not None), None)
    return None if found is None else CheckpointError(found)


__all__ = ["TableKeys", "check"]
