"""``state_dict`` / ``load_state_dict`` of the collections: table state as tensor-like handles read in
chunks (seed 001, "Persisting").

A table whose rows live in a key-value store cannot be handed out as one tensor. ``state_dict()``
gives, per table (``<table>.<entry>``):

- ``keys`` int64 (n,), ``scores`` int64 (n,): a snapshot taken by the call (16 bytes a row);
- ``weights`` (n, D) and ``optimizer_state`` (n, S), in the table's dtype: ``TableSlice`` handles. They
  have ``shape``, ``dtype``, ``numel()``, ``element_size()``, ``nbytes``, ``dim()``, ``size()``;
  ``narrow(0, start,
  length)`` reads those rows (in key order of the snapshot) from wherever they live, as a CPU tensor,
  without moving any score; ``materialize()`` reads all of them;
- ``admission_keys``, ``admission_counts``: keys counted toward admission and their counts;

and the collection's ``step`` and ``clock`` (int64 scalars). Like ``nn.Module.state_dict``, the
handles read the live table: consume them before training goes on. Sharded: this rank's shard, and
``load_state_dict`` is a collective (every rank calls it; rows go to their owners).

``load_state_dict`` consumes weights and optimizer state ``chunk_rows`` rows at a time (handles or
tensors alike), replacing the tables' rows (rows stored before and absent from the state are
removed). ``te.checkpoint`` streams the same rows to files itself; a model's ``state_dict`` there
holds the dense part only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tieredemb.distributed import owner_of, table_salts

CHUNK_ROWS = 65536
_ENTRIES = ("keys", "scores", "weights", "optimizer_state", "admission_keys", "admission_counts")


class TableSlice:
    """Tensor-like handle of a column range of a table's rows, read ``narrow`` by ``narrow``."""

    def __init__(self, collection, table: str, keys: torch.Tensor, cols: tuple[int, int]) -> None:
        self.collection, self._table, self._keys, self._cols = collection, table, keys, cols
        self._version = collection._rows_changed  # the rows as they were when the snapshot was taken
        self.shape = torch.Size([keys.numel(), cols[1] - cols[0]])
        self.dtype = next(t.dtype for t in collection.table_configs if t.name == table)
        self.device = torch.device("cpu")

    @property
    def table(self) -> str:
        return self._table

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return 2

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Rows ``start .. start + length`` of the snapshot's key order (dim 0 only), on the CPU."""
        if dim != 0:
            raise ValueError(f"TableSlice.narrow: only dim 0 (rows), got dim {dim}")
        n = self.shape[0]
        if start < 0 or length < 0 or start + length > n:
            raise ValueError(f"TableSlice.narrow: rows {start}..{start + length} out of 0..{n}")
        keys = self._keys[start : start + length]
        rows = self.collection.read_full_rows(self._table, keys)
        return rows[:, self._cols[0] : self._cols[1]].cpu()

    def is_current(self) -> bool:
        """Whether no row of the collection changed since the snapshot (no step, write or import)."""
        return self.collection._rows_changed == self._version

    def materialize(self) -> torch.Tensor:
        return self.narrow(0, 0, self.shape[0])

    def __repr__(self) -> str:
        return f"TableSlice(table={self._table!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def save(collection, destination: dict, prefix: str) -> None:
    """Put the collection's table state into ``destination`` under ``prefix``."""
    for t in collection.table_configs:
        save_table(collection, t.name, destination, f"{prefix}{t.name}.")
    destination[prefix + "step"] = torch.tensor(collection.step)
    destination[prefix + "clock"] = torch.tensor(collection.retired_clock())


def save_table(collection, table: str, destination: dict, p: str) -> None:
    """One table's entries (``keys``, ``scores``, the handles, admission) under ``p``, which is
    ``<prefix><table>.``."""
    keys, scores = [], []
    for k, _, s in collection.export_chunks(table, CHUNK_ROWS):
        keys.append(k)
        scores.append(s)
    keys = torch.cat(keys) if keys else torch.empty(0, dtype=torch.int64)
    dim = next(t.embedding_dim for t in collection.table_configs if t.name == table)
    width = dim + collection.optimizer.state_width(dim)
    adm_keys, adm_counts = collection.admission_counts(table)
    destination[p + "keys"] = keys
    destination[p + "scores"] = torch.cat(scores) if scores else torch.empty(0, dtype=torch.int64)
    destination[p + "weights"] = TableSlice(collection, table, keys, (0, dim))
    destination[p + "optimizer_state"] = TableSlice(collection, table, keys, (dim, width))
    destination[p + "admission_keys"] = adm_keys
    destination[p + "admission_counts"] = adm_counts


def expected_keys(collection, prefix: str) -> list[str]:
    return [f"{prefix}{t.name}.{e}" for t in collection.table_configs for e in _ENTRIES] + \
        [prefix + "step", prefix + "clock"]


def load(collection, state: dict, prefix: str, error_msgs: list[str]) -> None:
    """Replace the collection's tables with ``state`` (the entries ``save`` writes), chunk by chunk."""
    bad = _check(collection, state, prefix)
    if bad:
        error_msgs.append(bad)
        return
    for t in collection.table_configs:
        p = f"{prefix}{t.name}."
        keys, scores = state[p + "keys"], state[p + "scores"]
        weights, opt_state = state[p + "weights"], state[p + "optimizer_state"]
        if all(isinstance(h, TableSlice) and h.collection is collection and h.is_current()
               for h in (weights, opt_state)):
            continue  # its own current state (as a DCP load leaves it): nothing to change
        if any(isinstance(h, TableSlice) and h.collection is collection for h in (weights, opt_state)):
            weights, opt_state = _tensor(weights), _tensor(opt_state)  # its own state: read before clearing
        _clear(collection, t.name)
        for start in _chunk_starts(collection, keys.numel()):
            length = max(0, min(CHUNK_ROWS, keys.numel() - start))
            rows = torch.cat([weights.narrow(0, start, length), opt_state.narrow(0, start, length)], 1)
            collection.import_rows(t.name, keys[start : start + length], rows, scores[start : start + length])
        adm_keys = state[p + "admission_keys"]
        collection.import_admission(t.name, adm_keys, state[p + "admission_counts"])
    collection.restore_progress(int(state[prefix + "step"]), int(state[prefix + "clock"]))


def _tensor(x) -> torch.Tensor:
    return x.materialize() if isinstance(x, TableSlice) else x


def _check(collection, state: dict, prefix: str) -> str | None:
    """What is wrong with ``state`` for this collection (before anything changes), or None."""
    for t in collection.table_configs:
        p = f"{prefix}{t.name}."
        n = state[p + "keys"].numel()
        dim = t.embedding_dim
        want = {"weights": (n, dim), "optimizer_state": (n, collection.optimizer.state_width(dim)),
                "scores": (n,)}
        for entry, shape in want.items():
            got = tuple(state[p + entry].shape)
            if got != shape:
                return (f"{p}{entry}: shape {got}, expected {shape} (table {t.name!r}: dim {dim}, "
                        f"optimizer {type(collection.optimizer).__name__})")
        for entry in ("weights", "optimizer_state"):
            bad = _first_not_finite(state[p + entry], t.dtype)
            if bad is not None:
                return (f"{p}{entry}: row {bad} is not finite in the table's dtype {t.dtype} (NaN, inf "
                        "or beyond its range): nothing was loaded")
    return None


def _first_not_finite(rows, dtype: torch.dtype) -> int | None:
    """The first row of ``rows`` (a tensor or a handle read in chunks) with a value that is not
    finite once stored in ``dtype``, or None."""
    n = rows.shape[0]
    for start in range(0, n, CHUNK_ROWS):
        chunk = rows.narrow(0, start, min(CHUNK_ROWS, n - start))
        if chunk.numel() and chunk.is_floating_point():
            ok = torch.isfinite(chunk.to(dtype)).all(dim=1)
            if not bool(ok.all()):
                return start + int((~ok).nonzero()[0])
    return None


def _clear(collection, table: str) -> None:
    """Remove the table's stored rows (a collective when sharded)."""
    stored = [k for k, _, _ in collection.export_chunks(table, CHUNK_ROWS)]
    keys = torch.cat(stored) if stored else torch.empty(0, dtype=torch.int64)
    collection.delete_rows(table, keys)


def _chunk_starts(collection, n: int) -> range:
    """Chunk offsets; sharded, every rank runs as many (collective) chunks as the largest shard."""
    chunks = -(-n // CHUNK_ROWS)
    if collection.process_group is not None:
        count = torch.tensor([chunks], device=collection.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=collection.process_group)
        chunks = int(count)
    return range(0, chunks * CHUNK_ROWS, CHUNK_ROWS)


def clear(collection, table: str) -> None:
    """Remove the table's stored rows (a collective when sharded)."""
    _clear(collection, table)


def import_owned(collection, table: str, keys: torch.Tensor, rows: torch.Tensor | None, scores: torch.Tensor,
                 admission: bool = False) -> None:
    """Of saved rows (keys int64 (n,), whole rows float (n, W), scores int64 (n,); or, with
    ``admission``, keys and their counts in ``scores``), store those this rank owns, with no
    collective: a DCP load, where each rank reads its part of a checkpoint on its own schedule."""
    group = next(tier for tier in collection.tiers if table in tier.names)
    i = list(group.names).index(table)
    device = collection.device
    keys, scores = keys.to(device), scores.to(device)
    if collection.world > 1:
        salts = table_salts([table], device).expand(keys.numel())
        mine = owner_of(keys, salts, collection.world) == collection.rank
        keys, scores = keys[mine], scores[mine]
        rows = None if rows is None else rows[mine.cpu()]
    tier = group
    with collection.mutating():
        collection._rows_changed += 1
        if admission:
            tier.import_admission(i, keys, scores)
        else:
            tier.import_rows(i, keys, rows.to(device, torch.float32), scores)
