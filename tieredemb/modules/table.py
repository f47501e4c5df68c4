"""One table's storage in ``hbm_direct`` mode: a KeyIndex over a RowStore on the compute device.

Prefetch resolves: it turns the unique keys of a batch into row addresses (inserting, initializing,
admitting, locking). Forward and backward only use those addresses. A key that gets no stored row
(not admitted yet, or a conflict miss in a bounded table whose bucket is all locked) gets a scratch
row for the batch from the same RowStore; it is freed when the batch is released.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tieredemb.config import TableConfig
from tieredemb.index.key_index import InsertResult
from tieredemb.ops.reference import TorchKernels
from tieredemb.optim import EmbeddingOptimizer
from tieredemb.storage.row_store import RowStore


@dataclass
class TableRows:
    """A table's stored rows (``export``). Row order is unspecified.

    keys: int64 (n,); weights: float32 (n, D); optimizer_state: float32 (n, S); scores: int64 (n,)
    """

    keys: torch.Tensor
    weights: torch.Tensor
    optimizer_state: torch.Tensor
    scores: torch.Tensor


@dataclass
class TableStats:
    """Counters of one table since construction.

    ``rows``: tier -> rows stored there; ``bytes_moved``: "src->dst" -> bytes copied between tiers;
    ``memory_bytes``: tier -> bytes allocated for rows (weights and optimizer state).
    """

    rows: dict[str, int]
    capacity: int | None
    lookups: int = 0
    unique_lookups: int = 0
    hits: int = 0
    misses: int = 0
    conflict_misses: int = 0
    evictions: int = 0
    not_admitted: int = 0
    bytes_moved: dict[str, int] = field(default_factory=dict)
    memory_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class TablePrefetch:
    """What prefetch resolved for one table of one batch.

    unique_keys: int64 (u,); inverse: int64 (n,) id -> unique position; counts: int64 (u,) occurrences;
    addresses: int64 (u,) row address per unique key (-1: read as zeros, never updated: eval misses);
    locked: int64 (l,) keys whose slots this batch locked, at ``locked_slots`` while the index is at
    rehash ``generation``; scratch: int64 (s,) addresses to free.
    """

    unique_keys: torch.Tensor
    inverse: torch.Tensor
    addresses: torch.Tensor
    locked: torch.Tensor
    locked_slots: torch.Tensor
    generation: int
    scratch: torch.Tensor


@dataclass
class _Counters:
    """Counters known on the host; hits, misses and conflict misses are counted on the device."""

    lookups: int = 0
    unique_lookups: int = 0
    hits: int = 0  # batches with no miss count here; the others on the device
    evictions: int = 0
    not_admitted: int = 0


class HbmTable:
    """A table whose rows all live on the compute device (CPU or CUDA).

    Args:
        config: the table.
        optimizer: its fused optimizer (sets the row width D + state).
        seed: seed of the initial rows.
        device: compute device.
        kernels: the kernel set (its ``index_class`` builds the index).
        bucket_width, segment_rows: layout (StorageConfig).
        index_slots: bound of the index (default: the table's ``max_capacity``).
        device_segments: row segments on the device before the next go to host memory (hybrid).
    """

    def __init__(self, config: TableConfig, optimizer: EmbeddingOptimizer, seed: int,
                 device: torch.device, kernels: TorchKernels, bucket_width: int,
                 segment_rows: int, index_slots: int | None = None,
                 device_segments: int | None = None) -> None:
        self.config = config
        self.name = config.name
        self.dim = config.embedding_dim
        self.width = self.dim + optimizer.state_width(self.dim)
        self.seed = seed
        self.device = device
        self.kernels = kernels
        index_slots = config.max_capacity if index_slots is None else index_slots
        initial = min(config.bounded_rows or 4096, 1 << 16)
        self.index = kernels.index_class(bucket_width, config.eviction, device,
                                         max_slots=index_slots, initial_slots=2 * initial)
        # a table that can never fill a whole segment gets one of its own size
        self.store = RowStore(self.width, min(segment_rows, config.bounded_rows or segment_rows), device,
                              device_segments=device_segments)
        self.admission = None
        if config.admission is not None:
            self.admission = kernels.index_class(bucket_width, "lfu", device, initial_slots=1024)
        self.counters = _Counters()
        self._device_counts = torch.zeros(3, dtype=torch.int64, device=device)  # hits, misses, conflicts

    # --------------------------------------------------------------------------------- prefetch
    def prefetch(self, ids: torch.Tensor, step: int, training: bool) -> TablePrefetch:
        """Resolve ids (int64 (n,)) of one batch to row addresses."""
        unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        c = self.counters
        c.lookups += ids.numel()
        c.unique_lookups += unique.numel()
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        if not training:
            slots = self.index.find(unique)
            addresses = torch.where(slots >= 0, self.index.values[slots.clamp(min=0)], -1)
            return TablePrefetch(unique, inverse, addresses, empty, empty, self.index.generation, empty)
        store = self._admit(unique, counts)  # bool (u,), or None: every key is stored
        keys = unique if store is None else unique[store]
        res = self.index.find_or_insert(keys, step, counts if store is None else counts[store],
                                        lock=True)
        addresses = self._place_new(keys, res)  # (k,), -1 for conflict misses
        placed = res.slots >= 0
        if res.any_miss:
            self._device_counts += torch.stack([res.found.sum(), (~res.found).sum(), (~placed).sum()])
        else:
            c.hits += keys.numel()
        c.evictions += res.evicted_keys.numel()
        generation = self.index.generation
        if store is None and not self.index.bounded:  # every key got a row: no scratch
            return TablePrefetch(unique, inverse, addresses, keys, res.slots, generation, empty)
        # scratch rows for the batch: keys not admitted, conflict misses of a bounded table
        all_addr = torch.empty(unique.numel(), dtype=torch.int64, device=self.device)
        stored_pos = torch.arange(unique.numel(), device=self.device)
        if store is not None:
            stored_pos = store.nonzero().squeeze(1)
            c.not_admitted += unique.numel() - stored_pos.numel()
        all_addr[stored_pos] = addresses
        scratch_pos = stored_pos[~placed]
        if store is not None:
            scratch_pos = torch.cat([(~store).nonzero().squeeze(1), scratch_pos])
        scratch = self.store.allocate(scratch_pos.numel())
        all_addr[scratch_pos] = scratch
        self._initialize(unique[scratch_pos], scratch)
        return TablePrefetch(unique, inverse, all_addr, keys[placed], res.slots[placed], generation,
                             scratch)

    def _place_new(self, keys: torch.Tensor, res: InsertResult) -> torch.Tensor:
        """Rows for the keys ``res`` inserted (a victim's row when one was evicted, else a fresh
        one), initialized. Returns int64 (k,) the row address of each key, -1 where not placed."""
        if not res.any_miss:
            return res.values
        inserted = self._give_rows(res)
        addresses = self._slot_rows(res)
        self._initialize(keys[inserted], addresses[inserted])
        return addresses

    def _give_rows(self, res: InsertResult) -> torch.Tensor:
        """Row addresses for the keys ``res`` inserted: the victim's row where one was evicted (its
        owner's row already written elsewhere by the caller), else a fresh row, assigned in the
        index. Returns int64 (i,) the positions of the inserted keys in ``res``."""
        inserted = res.inserted.nonzero().squeeze(1)
        # an unbounded index never evicts: every inserted key needs a fresh row
        need = inserted[res.values[inserted] < 0] if self.index.bounded else inserted
        self.index.assign(res.slots[need], self.store.allocate(need.numel()))
        return inserted

    def _slot_rows(self, res: InsertResult) -> torch.Tensor:
        """int64 (n,) row address of each of ``res``'s keys, -1 where not placed."""
        safe = res.slots.clamp(min=0)
        return torch.where(res.slots >= 0, self.index.values[safe], -1)

    def _admit(self, unique: torch.Tensor, counts: torch.Tensor) -> torch.Tensor | None:
        """bool (u,): keys to store (already stored, or admitted by this batch's occurrences);
        None when the table has no admission policy (every key is stored)."""
        if self.admission is None:
            return None
        return self._count_admission(unique, counts, self.index.find(unique) >= 0)

    def _count_admission(self, keys: torch.Tensor, counts: torch.Tensor,
                         stored: torch.Tensor) -> torch.Tensor:
        """Count the occurrences of the keys not ``stored`` (bool (n,)); bool (n,): stored already,
        or brought to the admission threshold by this batch (their counters are then dropped)."""
        cand = ~stored
        res = self.admission.find_or_insert(keys[cand], 0, counts[cand])
        admitted = self.admission.scores[res.slots] >= self.config.admission.threshold
        self.admission.erase(keys[cand][admitted])
        out = stored.clone()
        out[cand] = admitted
        return out

    def _initial_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """float32 (n, W): weights from the initializer, optimizer state zero."""
        rows = torch.zeros(keys.numel(), self.width, dtype=torch.float32, device=self.device)
        rows[:, : self.dim] = self.config.initializer.rows(self.seed, self.name, keys, self.dim)
        return rows

    def _initialize(self, keys: torch.Tensor, addresses: torch.Tensor) -> None:
        """Initial rows at ``addresses``."""
        if keys.numel():
            self.kernels.scatter(self.store, addresses, self._initial_rows(keys))

    def release(self, pf: TablePrefetch) -> None:
        """Unlock the batch's slots and free its scratch rows."""
        if not self.index.unlock_slots(pf.locked_slots, pf.generation):
            self.index.unlock(pf.locked)  # the index was rehashed since: find the keys again
        self.store.free(pf.scratch)

    # ------------------------------------------------------------------------------ row access
    def read(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.index.find(keys)
        found = slots >= 0
        addresses = torch.where(found, self.index.values[slots.clamp(min=0)], -1)
        return self.store.gather(addresses, self.dim), found

    def write(self, keys: torch.Tensor, weights: torch.Tensor, step: int) -> None:
        """Upsert rows; their optimizer state is reset to zero."""
        res = self.index.find_or_insert(keys, step)
        addresses = self._place_new(keys, res)
        if bool((res.slots < 0).any()):
            raise RuntimeError(f"table {self.name!r}: no room for {int((res.slots < 0).sum())} keys "
                               "(their buckets are full of rows locked by in-flight batches)")
        rows = torch.zeros(keys.numel(), self.width, dtype=torch.float32, device=self.device)
        rows[:, : self.dim] = weights
        self.kernels.scatter(self.store, addresses, rows)
        self.counters.evictions += res.evicted_keys.numel()

    def export(self) -> TableRows:
        keys, addresses, scores = self.index.export()
        rows = self.store.gather(addresses)
        return TableRows(keys, rows[:, : self.dim], rows[:, self.dim :], scores)

    def stats(self) -> TableStats:
        c = self.counters
        hits, misses, conflicts = self._device_counts.tolist()
        hits += c.hits
        return TableStats(
            rows={"device": self.index.size()}, capacity=self.config.max_capacity,
            lookups=c.lookups, unique_lookups=c.unique_lookups, hits=hits, misses=misses,
            conflict_misses=conflicts, evictions=c.evictions, not_admitted=c.not_admitted,
            bytes_moved={}, memory_bytes={k: v * self.width * 4
                                          for k, v in self.store.rows_by_placement().items()},
        )

    def flush(self) -> None:
        """Nothing to write down: every row already lives in its only tier."""

    def close(self) -> None:
        """Nothing to release beyond the tensors."""
