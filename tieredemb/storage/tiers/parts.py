"""The records a tier answers with: per batch (``GroupPrefetch``, ``CachePrefetch``, the pools and
counts it leaves on the device: ``LentRows``, ``Overflow``; the dedup's sort, ``IdOrder``; a staged
prefetch's device state, ``StagedPrefetch``), per table (``TableRows``, ``TableStats``), the columns of
the per-table counters, and the dedup of a batch's ids into distinct (table, key) pairs."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from tieredemb.ops.reference import TorchKernels


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
class HostTierStats:
    """Counters of a table's host tier (``StorageConfig(host_budget=...)``) since construction.

    ``rows``: rows held in host memory (``dirty`` of them newer than the store's); ``capacity``: its
    slots; ``hits`` / ``misses``: the device cache's fetches answered from host memory / from the
    store; ``evictions``: rows pushed out of host memory; ``written_down``: rows written to the store
    (evicted dirty rows and ``flush``); ``read_ahead_rows``: rows brought in by reads ahead;
    ``read_ahead_hits``: of those, the ones a fetch then used; ``read_ahead_dropped``: rows a read
    ahead dropped because the key changed while it was in flight; ``read_ahead_late``: rows a fetch
    waited for, their read ahead still in flight when their batch came.
    """

    rows: int
    capacity: int
    dirty: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    written_down: int = 0
    read_ahead_rows: int = 0
    read_ahead_hits: int = 0
    read_ahead_dropped: int = 0
    read_ahead_late: int = 0


@dataclass
class TableStats:
    """Counters of one table since construction.

    ``rows``: tier -> rows stored there; ``bytes_moved``: "src->dst" -> bytes copied between tiers;
    ``memory_bytes``: tier -> bytes of the table's stored rows (weights and optimizer state);
    ``index_bytes``: where -> bytes of the key indexes the table's rows are found through (its part of
    each: the table's or device cache's, a capacity bound's, admission counts, a host-memory store's),
    "device" the compute device's memory (where a host-memory store keeps its index on CUDA),
    "host" host memory. ``keys_received``: sharded, the (table, key) pairs this rank received to
    serve (each requesting rank's distinct keys, summed over ranks and batches): the rows it sends
    back in the output dist and the gradients it receives; 0 unsharded. ``replicated``: sharded with
    ``StorageConfig(replicate_hot=...)``, the table's keys every rank keeps a copy of (their lookups
    are served where they occur, so they are not in ``keys_received``; ``rows`` counts the copies).
    ``host_tier``: the counters of the table's host tier, None without one.
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
    index_bytes: dict[str, int] = field(default_factory=dict)
    keys_received: int = 0
    host_tier: HostTierStats | None = None
    replicated: int = 0


@dataclass
class GroupPrefetch:
    """What prefetch resolved for one group of one batch.

    unique_keys, unique_tables: int64 (u,) the batch's distinct (table, key) pairs; inverse: int64
    (n,) id -> unique position; addresses: int64 (u,) row address per pair (-1: read as zeros, never
    updated: eval misses); locked, locked_tables: (l,) pairs whose slots this batch locked, at
    ``locked_slots`` while the index is at rehash ``generation``; scratch: int64 (s,) addresses to free.
    """

    unique_keys: torch.Tensor
    unique_tables: torch.Tensor
    inverse: torch.Tensor
    addresses: torch.Tensor
    locked: torch.Tensor
    locked_tables: torch.Tensor
    locked_slots: torch.Tensor
    generation: int
    scratch: torch.Tensor
    # bounded tables under a pipeline: misses whose bucket held rows of an earlier batch still in
    # flight, placed when that batch is released (as a plain loop would): (positions, step, counts)
    deferred: tuple[torch.Tensor, int, torch.Tensor] | None = None
    holds_locks: bool = False  # counted in its group's batches holding locks of a bounded index
    sorted_ids: IdOrder | None = None  # the dedup's sort, reused by the gradient reduction
    id_addresses: torch.Tensor | None = None  # int64 (n,) addresses[inverse], when made before the read
    lent: LentRows | None = None  # the rows of a pool this batch took its new rows from
    # int64 (u,) occurrences of each pair in the batch, where admission counted them (a checkpoint
    # taken while the batch is in flight leaves them out: its prefetch is redone after a resume)
    counts: torch.Tensor | None = None

    def addresses_by_id(self) -> torch.Tensor:
        """int64 (n,) the row address of each id (``id_addresses`` where the prefetch made them)."""
        return self.addresses[self.inverse] if self.id_addresses is None else self.id_addresses


@dataclass
class LentRows:
    """A pool of free rows (``pool``: int64 (m,) addresses, popped from the store) that an insertion
    on the device took rows from without telling the host how many: ``counts`` (int64 (3R,), host
    memory: ``insert_rows``'s counts per region, valid once ``ready`` has passed; ``ready`` None on
    the CPU) says it. Those taken from its start now belong to the table, the last ones of the
    misses' part (a pool padded for a CUDA graph is longer: ``insert_rows`` takes a scratch row from
    the end of the misses it counts, not of the pool) are the batch's scratch rows, the others were
    not used: they go back to the store as soon as the counts are read (``pool`` is then the scratch
    rows, ``counts`` None), the scratch rows once the batch is released."""

    pool: torch.Tensor
    counts: torch.Tensor | None
    ready: torch.cuda.Event | None
    released: bool = False

    def split(self, regions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the rows no table took, the batch's scratch rows), from the counts read."""
        counts = self.counts.tolist()
        taken, lacking, victims = (sum(counts[k * regions : (k + 1) * regions]) for k in range(3))
        end = taken + lacking + victims  # the misses: each took a pool row from one end or a victim's
        unused = torch.cat([self.pool[taken : end - lacking], self.pool[end:]])
        return unused, self.pool[end - lacking : end]


@dataclass
class Overflow:
    """A batch of unbounded tables whose misses were inserted on the device (``DeviceTier._inserted``),
    until ``DeviceTier.place_overflow`` has read ``counts``: a pair whose bucket was full has its row
    in ``values`` and slot -1 in ``slots`` (of the batch's ``keys``, ``tables``, ``occurrences``, int64
    (u,)); ``counts`` (int64 (3R,), host memory) is ``insert_rows``'s count per region, valid once
    ``ready`` has passed (None on the CPU)."""

    keys: torch.Tensor
    tables: torch.Tensor
    occurrences: torch.Tensor
    slots: torch.Tensor
    values: torch.Tensor
    step: int | torch.Tensor
    counts: torch.Tensor
    ready: torch.cuda.Event | None


@dataclass
class IdOrder:
    """The dedup's sort of a batch's ids: ``order`` int64 (n,) the ids grouped by distinct pair (the
    kernels' ``id_order``), ``entries`` int64 (u,) ids per pair. Lets the gradient reduction sum each
    pair's ids in one fixed order without sorting again."""

    order: torch.Tensor
    entries: torch.Tensor
    # the backward's gradient source (int64 (n,)) and scale (float32 (n,) or None) of each id, in
    # ``order``'s order (``src_of_id[order]``), when made with the prefetch: the reduction then reads
    # them directly, one dependent load an id fewer
    sources: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    plan: tuple[torch.Tensor, ...] | None = None  # the kernels' reduction plan (``reduce_plan``)


@dataclass
class StagedPrefetch:
    """``DeviceTier.stage_prefetch``'s device state, padded to the batch's n ids: the first u
    entries of keys, tables, counts, slots and values are the batch's distinct pairs."""

    keys: torch.Tensor
    tables: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    order: torch.Tensor  # the dedup's sort of the ids (``IdOrder.order``)
    slots: torch.Tensor
    values: torch.Tensor
    per_region: torch.Tensor
    step: int
    id_values: torch.Tensor | None = None  # int64 (n,) values[inverse]: each id's row if it was found
    # ids per pair where ``counts`` sums occurrences the entries carry (a shard owner's), else None
    entries: torch.Tensor | None = None

    def cut(self, n: int, step: int) -> StagedPrefetch:
        """A replayed capture's state (padded to a bucket of ids) for a batch of n ids, with the
        host's step: its per-id entries cut to n (``finish_prefetch`` cuts the pairs' to u)."""
        return replace(self, step=step, inverse=self.inverse[:n], order=self.order[:n],
                       id_values=None if self.id_values is None else self.id_values[:n])


# columns of the per-table device counters
UNIQUE, HITS, MISSES, CONFLICTS, EVICTIONS, NOT_ADMITTED = range(6)
REFUSED = -3  # the slot of a pair an admission policy keeps out (below -1: ``complete`` leaves it out)


def unique_pairs(ids: torch.Tensor, tables: torch.Tensor, num_tables: int, kernels: TorchKernels,
                 occurrences: torch.Tensor | None = None):
    """Distinct (table, key) pairs of ``ids`` (int64 (n,)) -> keys (u,), tables (u,), inverse (n,),
    counts (u,): the occurrences of each pair (the sum of ``occurrences`` where the entries carry
    counts of their own), and the sort (``IdOrder``). The pairs come in the kernels' ``id_order``
    (table by table, by a hash of the pair: deterministic, not by key). One host sync (the count)."""
    order, skeys, stables = kernels.id_order(ids, tables, num_tables)
    if ids.numel() == 0:
        return ids, tables, ids, ids, IdOrder(order, ids)
    keys, utab, inverse, entries = kernels.sorted_runs(skeys, stables, order)
    if occurrences is None:
        counts = entries
    else:
        counts = torch.zeros(keys.numel(), dtype=torch.int64, device=ids.device)
        counts.index_add_(0, inverse, occurrences)
    return keys, utab, inverse, counts, IdOrder(order, entries)


@dataclass
class CachePrefetch(GroupPrefetch):
    """A cache batch: besides the hbm fields, the shared scratch pairs it must write down at
    release (``write_back``, ``write_back_tables``: int64 (w,)) and its private scratch rows
    (``scratch``, dropped)."""

    write_back: torch.Tensor | None = None
    write_back_tables: torch.Tensor | None = None
    bound: GroupPrefetch | None = None  # bounded tables: the pairs locked in the capacity index
    # inserted on the device: how many of its pairs share an earlier batch's scratch pad (int64
    # (1,), on the host once its counts are: ``LentRows.ready``); None: none could
    shared_pads: torch.Tensor | None = None
