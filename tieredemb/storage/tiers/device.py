"""A group of tables in ``hbm_direct`` (or ``hybrid``) mode: one KeyIndex over one RowStore.

Tables of one row width and dtype are batched into a group (FBGEMM's table-batched embedding does
the same): one index with a region per table, one row store, so a step runs one dedup, one probe, one
gather, one gradient reduction and one optimizer update for the whole group instead of one per table.
The identity of a row is (table, key); a table's region gives it its own buckets, eviction policy and
bound, so batching changes no result.

Prefetch resolves: it turns the unique (table, key) pairs of a batch into row addresses (inserting,
initializing, admitting, locking). Forward and backward only use those addresses. A key that gets no
stored row (not admitted yet, or a conflict miss in a bounded table whose bucket is all locked) gets
a scratch row for the batch from the same RowStore; it is freed when the batch is released.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tieredemb.config import TableConfig
from tieredemb.index.key_index import CONTESTED, MAX_LOAD, InsertResult, KeyIndex, Region, region_counts
from tieredemb.ops.capture import CapturedStages
from tieredemb.ops.reference import TorchKernels
from tieredemb.ops.rounding import row_seeds, table_bases
from tieredemb.optim import EmbeddingOptimizer
from tieredemb.profiling import label
from tieredemb.storage.row_store import RowStore
from tieredemb.storage.tiers.device_insert import DeviceInsertion
from tieredemb.storage.tiers.parts import (
    CONFLICTS,
    EVICTIONS,
    REFUSED,
    UNIQUE,
    GroupPrefetch,
    IdOrder,
    LentRows,
    Overflow,
    StagedPrefetch,
    TableRows,
    TableStats,
    unique_pairs,
)


def _initial_slots(config: TableConfig) -> int:
    """Slots an unbounded table's index region starts with: its ``init_capacity`` under the load
    limit, else twice its bound, at most 131,072 (it doubles as keys arrive)."""
    if config.init_capacity is not None:
        return math.ceil(config.init_capacity / MAX_LOAD)
    return 2 * min(config.bounded_rows or 4096, 1 << 16)


class DeviceTier(DeviceInsertion):
    """Tables of one row width whose rows all live on the compute device (CPU or CUDA), or on
    the device first and in host memory after (hybrid).

    Args:
        configs: the tables (same ``embedding_dim``, ``dtype`` and rounding).
        optimizer: their fused optimizer (sets the row width D + state).
        seed: seed of the initial rows.
        device: compute device.
        kernels: the kernel set (its ``index_class`` builds the index).
        bucket_width, segment_rows: layout (StorageConfig).
        index_slots: per table, the bound of its region (default: the table's ``max_capacity``).
        device_rows: rows on the device before the next go to host memory (hybrid); None: all.
    """

    _contest = True  # the staged probe marks the contested pairs (``find_touch``)
    _rows_up_front = True  # the tables' ``init_capacity`` rows allocated by the constructor

    def __init__(self, configs: list[TableConfig], optimizer: EmbeddingOptimizer, seed: int,
                 device: torch.device, kernels: TorchKernels, bucket_width: int, segment_rows: int,
                 index_slots: list[int | None] | None = None, device_rows: int | None = None) -> None:
        self.configs = configs
        self.names = [c.name for c in configs]
        self.dim = configs[0].embedding_dim
        self.width = self.dim + optimizer.state_width(self.dim)
        self.seed = seed
        self.device = device
        self.kernels = kernels
        if index_slots is None:
            index_slots = [c.max_capacity for c in configs]
        # locks shield the rows of batches in flight from eviction: an index that never evicts keeps
        # none, and its batches' release has nothing to do (no lock, no device work)
        self.index = kernels.index_class(bucket_width, device=device, regions=[
            Region(c.eviction, slots, _initial_slots(c)) for c, slots in zip(configs, index_slots)],
            locking=any(slots is not None for slots in index_slots))
        bounded = [s if s is not None else c.bounded_rows for c, s in zip(configs, index_slots)]
        if all(b is not None for b in bounded):  # a group that can never fill a whole segment
            segment_rows = min(segment_rows, max(1, sum(bounded)))
        device_segments = None if device_rows is None else max(1, device_rows // segment_rows)
        self.dtype = configs[0].dtype  # the rows' storage type (one per group)
        self.store = RowStore(self.width, segment_rows, device, device_segments=device_segments,
                              dtype=self.dtype)
        # a 16-bit group's updates are rounded stochastically: each table's base of the draws
        self._rounding = (table_bases(seed, self.names, device) if configs[0].rounds_stochastically
                          else None)
        if self._rows_up_front:
            self.store.reserve(sum(c.init_capacity or 0 for c in configs))
        self.admission = None
        if any(c.admission is not None for c in configs):
            self.admission = kernels.index_class(bucket_width, device=device, regions=[
                Region("lfu", None, 1024) for _ in configs])
            self._threshold = torch.tensor(
                [c.admission.threshold if c.admission is not None else 0 for c in configs],
                dtype=torch.int64, device=device)
            self._admits = torch.tensor([c.admission is not None for c in configs], device=device)
        # initializers: one call per distinct initializer, over the tables that use it
        inits: dict[object, list[int]] = {}
        for t, c in enumerate(configs):
            inits.setdefault(c.initializer, []).append(t)
        self._inits = [(init, None if len(inits) == 1 else torch.tensor(ts, device=device))
                       for init, ts in inits.items()]
        self.lookups = [0] * len(configs)  # ids looked up, per table (known on the host)
        self._pending: list[GroupPrefetch] = []  # batches with deferred insertions, oldest first
        self._holding = 0  # batches placed whose locks of a bounded index are not given back yet
        # every table bounded, or none: a batch's misses are inserted on the device, rows from a
        # pool, no read
        self._inserts_rows = len({s is None for s in index_slots}) == 1
        self._lent: list[LentRows] = []  # pools of batches whose unused rows are not back yet
        self._overflow: list[Overflow] = []  # unbounded: batches whose full buckets are not read yet
        self._count_buffers: list[torch.Tensor] = []  # pinned host buffers for LentRows/Overflow.counts
        # the insertion's CUDA graphs (``_insert_graph``); ``may_capture``, set by the collection on
        # CUDA with Triton's kernels: whether the calling thread may capture one (None: never replay)
        self._insert_graphs: CapturedStages | None = None
        self.may_capture: Callable[[], bool] | None = None
        self._counts = torch.zeros(len(configs), 6, dtype=torch.int64, device=device)
        # the training probes' counts per table, summed (misses, pairs, contested pairs: one add a
        # batch; then the pairs refused admission); ``stats`` adds them to the columns they make
        self._probed = torch.zeros(4, len(configs), dtype=torch.int64, device=device)

    def _count(self, *entries: tuple[int, torch.Tensor, torch.Tensor | None]) -> None:
        """Per entry (column, tables, mask or None): add one to the table's counter in that column
        for each key (where ``mask``). A histogram (entries outside the mask land in a spare bin):
        no host sync, and no atomics of 10^5 keys on a few dozen counters (``index_add_`` there
        took 0.3 ms a step of the hbm workload). Empty entries launch nothing."""
        cells = self._counts.numel()
        parts = [t * 6 + col if m is None else torch.where(m, t * 6 + col, cells)
                 for col, t, m in entries if t.numel()]
        if not parts:
            return
        idx = torch.cat(parts) if len(parts) > 1 else parts[0]
        hist = torch.histc(idx.to(torch.float32), bins=cells + 1, min=0, max=cells + 1)
        self._counts.view(-1).add_(hist[:cells].to(torch.int64))

    # --------------------------------------------------------------------------------- prefetch
    def prefetch(self, ids: torch.Tensor, tables: torch.Tensor, ids_per_table: list[int], step: int,
                 training: bool, occurrences: torch.Tensor | None = None) -> GroupPrefetch:
        """Resolve one batch's ids (int64 (n,)) of the tables ``tables`` to row addresses.
        ``occurrences``: int64 (n,) how many lookups each entry stands for (a shard owner gets
        each requester's distinct ids with their counts)."""
        self.place_overflow()
        with label("## dedup ##"):
            unique, utab, inverse, counts, sorted_ids = unique_pairs(ids, tables, len(self.configs),
                                                                     self.kernels, occurrences)
        self.lookups = [a + b for a, b in zip(self.lookups, ids_per_table)]
        with label("## resolve ##"):
            pf = self._prefetch_pairs(unique, utab, inverse, counts, step, training)
        pf.sorted_ids = sorted_ids
        if training and self.admission is not None:
            pf.counts = counts
        return pf

    def can_stage(self) -> bool:
        """Whether a training prefetch can be staged (``stage_prefetch``): no table of the group
        admits keys (the admission decision reads the device before the insertion can)."""
        return self.admission is None

    def stage_prefetch(self, ids: torch.Tensor, tables: torch.Tensor, step: int | torch.Tensor,
                       guard: torch.Tensor, by_id: bool = True, id_count: torch.Tensor | None = None,
                       occurrences: torch.Tensor | None = None) -> tuple[StagedPrefetch, list[torch.Tensor]]:
        """The device half of a training ``prefetch`` (``can_stage`` groups):
        dedup on padded buffers, then the fused probe, which locks and touches the keys found unless
        ``guard`` (int64 (G,) on the device) is not all zero, and marks the contested ones (a bounded
        table's, ``find_touch``). Reads nothing on the host: returns the staged state and the int64
        tensors to read (1, R, R, R and ``below_reads`` long: the pairs, misses, sizes, contested pairs,
        ``stage_below``'s; read with the caller's own in one ``torch.cat``) whose values, in that
        order, ``finish_prefetch`` takes.
        ``by_id``: also each id's row as probed, the forward's addresses when every key is found
        (gathered while the host waits for its read, not after it). ``step``: an int, or int64 () on
        the device (a captured prefetch; the caller sets the host's in the result). ``id_count``:
        int64 () on the device, the batch's ids, the rest of ``ids`` padding that sorts after them (a
        captured prefetch of a batch shape padded to a bucket). ``occurrences``: int64 (n,), how many
        lookups each id stands for (a shard owner's received pairs: ``prefetch``'s). Device work
        only, captured in a CUDA graph: the caller ran ``before_staging`` first."""
        with label("## dedup ##"):
            order, skeys, stables = self.kernels.id_order(ids, tables, len(self.configs), id_count)
            keys, utab, inverse, entries, count = self.kernels.sorted_runs_padded(skeys, stables, order,
                                                                                  id_count)
            counts = entries if occurrences is None else \
                torch.zeros_like(entries).index_add_(0, inverse, occurrences)
        with label("## resolve ##"):
            slots, values, per_region = self.index.find_touch(keys, utab, step, counts, count, guard,
                                                              contest=self._contest)
        regions = len(self.configs)
        staged = StagedPrefetch(keys, utab, inverse, counts, order, slots, values, per_region, step,
                                values[inverse] if by_id else None,
                                entries=None if occurrences is None else entries)
        return staged, [count, per_region[:regions], self.index.sizes_on_device, per_region[2 * regions :],
                        *self.stage_below(keys, utab, slots, count)]

    def before_staging(self) -> None:
        """The host work a staged prefetch (``stage_prefetch``, device work only) needs done first:
        ``place_overflow``, before a graph is chosen by the index's shape."""
        self.place_overflow()

    below_reads = 0  # how many int64 values ``stage_below`` adds to the staged read

    def stage_below(self, keys: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor,
                    count: torch.Tensor) -> list[torch.Tensor]:
        """What the staged read takes for the insertion from the store below, after the probe
        (``keys``: the distinct pairs, padded, ``count`` of them, ``RESERVED_KEY`` where another
        group's; ``slots``: the probe's): ``below_reads`` int64 values, read after the others. Here
        none."""
        return []

    def capture_key(self) -> tuple:
        """What a CUDA graph of the staged prefetch bakes in of this tier: the index's rehashes."""
        return (self.index.capture_key,)

    def stage_probe(self, keys: torch.Tensor, tables: torch.Tensor, step: int | torch.Tensor,
                    counts: torch.Tensor, count: torch.Tensor, guard: torch.Tensor, first_table: int,
                    out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``stage_prefetch``'s probe after one dedup of several groups' ids (``keys``: their distinct
        pairs, padded, ``count`` of them; ``tables`` numbered across the groups, this group's from
        ``first_table``): this group's pairs probed, their slots and values written into ``out`` at
        their positions. Returns int64 (3R,): misses, pairs and contested pairs per region (the host
        reads them with the index's sizes, for ``finish_prefetch``). Device work only, captured in a
        CUDA graph: the caller ran ``before_staging`` first."""
        return self.index.find_touch(keys, tables, step, counts, count, guard, first_table, out,
                                     contest=self._contest)[2]

    def every_pair_found(self, info: list[int]) -> bool:
        """Whether ``stage_prefetch``'s read (``info``) says every pair of the batch was found (no
        miss, none contested): the probe's rows are then the forward's."""
        r = len(self.configs)
        return not any(info[1 : 1 + r]) and not any(info[1 + 2 * r : 1 + 3 * r])

    def arm(self, staged: StagedPrefetch, count: torch.Tensor) -> None:
        """Before the host reads ``stage_prefetch``'s result (``count``: its distinct pairs, int64 ()
        on the device): host work of ``finish_prefetch`` that needs no value of the read, done while
        the device still works towards it. Here none; ``disarm`` undoes it if no
        ``finish_prefetch`` follows (a bad batch)."""

    def disarm(self) -> None:
        """Undo an ``arm`` that no ``finish_prefetch`` took."""

    def finish_prefetch(self, staged: StagedPrefetch, info: list[int],
                        ids_per_table: list[int]) -> GroupPrefetch:
        """The host half: ``info`` is the host copy of ``stage_prefetch``'s second result."""
        u = info[0]
        self.lookups = [a + b for a, b in zip(self.lookups, ids_per_table)]
        pf = self._finish_staged(staged, u, info[1:])
        entries = staged.counts if staged.entries is None else staged.entries
        pf.sorted_ids = IdOrder(staged.order, entries[:u])
        return pf

    def _finish_staged(self, staged: StagedPrefetch, u: int, info: list[int]) -> GroupPrefetch:
        """The batch's ``u`` distinct pairs after the staged probe and its read (``info``: misses per
        region, the index's sizes, contested pairs per region): the insertion."""
        return self._placed(staged.keys[:u], staged.tables[:u], staged.counts[:u], staged.inverse,
                            staged.step, staged.slots[:u], staged.values[:u], staged.per_region, info,
                            staged.id_values)

    def _prefetch_pairs(self, unique: torch.Tensor, utab: torch.Tensor, inverse: torch.Tensor,
                        counts: torch.Tensor, step: int, training: bool) -> GroupPrefetch:
        if not training:
            self._count((UNIQUE, utab, None))
            slots = self.index.find(unique, utab)
            addresses = torch.where(slots >= 0, self.index.values[slots.clamp(min=0)], -1)
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return GroupPrefetch(unique, utab, inverse, addresses, empty, empty, empty,
                                 self.index.generation, empty)
        regions = len(self.configs)
        slots, values, per_region = self.index.find_touch(unique, utab, step, counts, contest=True)
        refused = None
        if self.admission is not None:  # the misses this batch does not bring to the threshold: out
            slots = torch.where(self._count_admission(unique, utab, counts, slots >= 0), slots, REFUSED)
            per_region = torch.cat([region_counts(utab, slots == -1, regions),
                                    per_region[regions : 2 * regions],
                                    region_counts(utab, slots == CONTESTED, regions)])
            refused = region_counts(utab, slots == REFUSED, regions)
        read = [per_region[:regions], self.index.sizes_on_device, per_region[2 * regions :]]
        if refused is not None:
            read.append(refused.sum().view(1))
        return self._placed(unique, utab, counts, inverse, step, slots, values, per_region,
                            torch.cat(read).tolist(), refused=refused)

    def _placed(self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor, inverse: torch.Tensor,
                step: int | torch.Tensor, slots: torch.Tensor, values: torch.Tensor, per_region: torch.Tensor,
                info: list[int], id_values: torch.Tensor | None = None,
                refused: torch.Tensor | None = None) -> GroupPrefetch:
        """A training batch's distinct pairs after the probe (``find_touch`` with ``contest``: slots,
        values, per_region; slots ``REFUSED`` where admission keeps a pair out, ``refused`` int64
        (R,) of them per table, not among ``per_region``'s misses and contested pairs) and its host
        read (``info``: misses per region, the index's sizes, contested pairs per region, then, after
        an admission, the pairs refused): the misses inserted, their rows given and initialized; a
        scratch row for the batch where a pair got none (a conflict miss; a contested pair, inserted
        when the batch holding its bucket goes, ``settle``; a refused one). ``id_values``: each id's
        row as probed, the forward's addresses when every pair was found."""
        regions = len(self.configs)
        if not self._holding and any(info[2 * regions : 3 * regions]):
            # the batches whose locks contested these pairs are gone: in with the misses, now, as in
            # a plain loop (a pipeline's batch finished after the release of the one before)
            slots = torch.where(slots == CONTESTED, -1, slots)
            info = [m + c for m, c in zip(info[:regions], info[2 * regions : 3 * regions])] + \
                info[regions : 2 * regions] + [0] * regions + info[3 * regions :]
        waiting, kept_out = sum(info[2 * regions : 3 * regions]), sum(info[3 * regions :])
        misses = sum(info[:regions])
        if self._inserts_rows and misses and not waiting and refused is None:
            return self._inserted(keys, tables, counts, inverse, step, slots, values, per_region, info)
        res = self.index.complete(keys, tables, step, counts, True, slots, values, per_region,
                                  info[: 2 * regions], given_order=True)  # claim in the dedup's order
        addresses = self._place_new(keys, tables, res)  # -1 where not placed
        self._count_probe(per_region, refused)
        if res.unplaced:
            self._count((CONFLICTS, tables, res.slots == -1))
        if res.evicted_tables.numel():
            self._count((EVICTIONS, res.evicted_tables, None))
        generation, empty = self.index.generation, torch.empty(0, dtype=torch.int64, device=self.device)
        lacking = res.unplaced + waiting + kept_out
        self._holding += self.index.bounded
        if not lacking:  # every pair placed (the common case)
            return GroupPrefetch(keys, tables, inverse, addresses, keys, tables, res.slots, generation, empty,
                                 id_addresses=None if res.any_miss else id_values,
                                 holds_locks=self.index.bounded)
        placed = torch.nonzero_static(addresses >= 0, size=keys.numel() - lacking).squeeze(1)
        without = torch.nonzero_static(addresses < 0, size=lacking).squeeze(1)
        scratch = self.store.allocate(lacking)
        addresses[without] = scratch
        self._initialize(keys[without], tables[without], scratch)
        pf = GroupPrefetch(keys, tables, inverse, addresses, keys[placed], tables[placed], res.slots[placed],
                           generation, scratch, holds_locks=self.index.bounded)
        if waiting:
            pos = torch.nonzero_static(res.slots == CONTESTED, size=waiting).squeeze(1)
            pf.deferred = (pos, step, counts[pos])
            self._pending.append(pf)
        return pf

    def _count_probe(self, per_region: torch.Tensor, refused: torch.Tensor | None) -> None:
        """Counters of one batch's probe (``per_region``: misses, pairs, contested pairs per table;
        a pair ``refused`` admission, int64 (R,) per table, is neither hit nor miss)."""
        self._probed[:3] += per_region.view(3, -1)
        if refused is not None:
            self._probed[3] += refused

    def settle(self, pf: GroupPrefetch) -> None:
        """Insert ``pf``'s deferred keys now: rows for them (a victim's or a fresh one) get the
        values of their scratch rows, and the batch's addresses move there. Keys still without
        room keep their scratch rows for the batch (conflict misses, as in a plain loop)."""
        taken = self._insert_deferred(pf, self.index)
        if taken is None:
            return
        pos, keys, tables, res, placed = taken
        if res.any_miss:
            self._give_rows(res)
        rows = self._slot_rows(res)[placed]
        scratch = pf.addresses[pos[placed]]
        self.kernels.scatter(self.store, rows, self.kernels.gather(self.store, scratch, self.width,
                                                                   dtype=self.dtype))
        pf.addresses[pos[placed]] = rows
        kept = pf.scratch.numel() - scratch.numel()  # the scratch rows still the batch's
        pf.scratch = pf.scratch[torch.nonzero_static(~torch.isin(pf.scratch, scratch), size=kept).squeeze(1)]
        self.store.free(scratch)
        pf.locked = torch.cat([pf.locked, keys[placed]])
        pf.locked_tables = torch.cat([pf.locked_tables, tables[placed]])
        pf.generation = -1  # slots of two moments: release unlocks by key

    def _insert_deferred(self, pf: GroupPrefetch, index):
        """Insert ``pf``'s deferred keys into ``index`` (locked, with the batch's step and counts)
        and forget they were deferred. Returns (positions in the batch, keys, tables, the insert
        result, positions of the placed ones among them), or None when none was placed."""
        if pf.deferred is None:
            return None
        pos, step, counts = pf.deferred
        pf.deferred = None
        self._pending.remove(pf)
        keys, tables = pf.unique_keys[pos], pf.unique_tables[pos]
        res = index.find_or_insert(keys, step, counts, lock=True, tables=tables, given_order=True)
        self._count((CONFLICTS, tables, res.slots < 0), (EVICTIONS, res.evicted_tables, None))
        if res.unplaced is None:
            placed = (res.slots >= 0).nonzero().squeeze(1)
        else:  # known on the host: no read
            placed = torch.nonzero_static(res.slots >= 0, size=keys.numel() - res.unplaced).squeeze(1)
        return (pos, keys, tables, res, placed) if placed.numel() else None

    def _place_new(self, keys: torch.Tensor, tables: torch.Tensor, res: InsertResult) -> torch.Tensor:
        """Rows for the keys ``res`` inserted (a victim's row when one was evicted, else a fresh
        one), initialized. Returns int64 (k,) the row address of each key, -1 where not placed."""
        if not res.any_miss:
            return res.values
        inserted = self._give_rows(res)
        addresses = self._slot_rows(res)
        self._initialize(keys[inserted], tables[inserted], addresses[inserted])
        return addresses

    def _give_rows(self, res: InsertResult, inserted: torch.Tensor | None = None) -> torch.Tensor:
        """Row addresses for the keys ``res`` inserted: the victim's row where one was evicted (its
        owner's row already written elsewhere by the caller), else a fresh row, assigned in the
        index. Returns int64 (i,) the positions of the inserted keys in ``res`` (``inserted``, when
        the caller knows them)."""
        if inserted is not None and res.new_rows is not None:
            if res.new_rows:  # some took an empty slot: -1, no victim's row to reuse
                fresh = torch.nonzero_static(res.values[inserted] < 0, size=res.new_rows).squeeze(1)
                self.index.assign(res.slots[inserted[fresh]], self.store.allocate(fresh.numel()))
            return inserted
        if res.new_rows == 0:  # every key inserted took a victim's row (a full cache)
            return torch.nonzero_static(res.inserted, size=res.inserted_count).squeeze(1)
        # -1: an empty slot, no victim's row to reuse
        if res.inserted_count is not None:  # the counts are known on the host: no reads
            inserted = torch.nonzero_static(res.inserted, size=res.inserted_count).squeeze(1)
            need = torch.nonzero_static(res.inserted & (res.values < 0), size=res.new_rows).squeeze(1)
        else:
            inserted = res.inserted.nonzero().squeeze(1)
            need = inserted[res.values[inserted] < 0]
        self.index.assign(res.slots[need], self.store.allocate(need.numel()))
        return inserted

    def _slot_rows(self, res: InsertResult) -> torch.Tensor:
        """int64 (n,) row address of each of ``res``'s keys, -1 where not placed."""
        if res.new_rows == 0:  # no row assigned since the insert: its values are current
            return res.values
        safe = res.slots.clamp(min=0)
        return torch.where(res.slots >= 0, self.index.values[safe], -1)

    def _count_admission(self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                         stored: torch.Tensor) -> torch.Tensor:
        """Count the occurrences of the keys not ``stored`` (bool (n,)) of tables with an admission
        policy; bool (n,): stored already, of a table without admission, or brought to the
        threshold by this batch (their counters are then dropped)."""
        cand = ~stored & self._admits[tables]
        ck, ct = keys[cand], tables[cand]
        res = self.admission.find_or_insert(ck, 0, counts[cand], tables=ct)
        admitted = self.admission.scores[res.slots] >= self._threshold[ct]
        self.admission.erase(ck[admitted], ct[admitted])
        out = ~cand
        out[cand] = admitted
        return out

    def _initial_rows(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """(n, W) in the rows' dtype: weights from each key's table's initializer (rounded to the
        nearest value), optimizer state zero."""
        weights = self._initial_weights(keys, tables).to(self.dtype)
        return torch.nn.functional.pad(weights, (0, self.width - self.dim))

    def _initial_weights(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """float32 (n, D): weights from each key's table's initializer."""
        init, members = self._inits[0]
        if members is None:  # one initializer
            return init.rows(self.seed, self.names, keys, self.dim, tables)
        weights = torch.empty(keys.numel(), self.dim, dtype=torch.float32, device=self.device)
        for init, members in self._inits:
            pos = torch.isin(tables, members).nonzero().squeeze(1)
            weights[pos] = init.rows(self.seed, self.names, keys[pos], self.dim, tables[pos])
        return weights

    def _initialize(self, keys: torch.Tensor, tables: torch.Tensor, addresses: torch.Tensor) -> None:
        """Initial rows at ``addresses`` (the optimizer state zero: the scatter fills what the
        weights leave)."""
        if keys.numel():
            self.kernels.scatter(self.store, addresses, self._initial_weights(keys, tables))

    def holds(self, pf: GroupPrefetch) -> bool:
        """Whether releasing ``pf`` changes anything: locks (an index that evicts), scratch rows,
        deferred insertions. False for a batch of unbounded tables without admission: its release
        then needs neither the collection's lock nor the device."""
        return self.index.locking or pf.scratch.numel() > 0 or pf.deferred is not None or bool(self._pending)

    def release(self, pf: GroupPrefetch) -> None:
        """Unlock the batch's slots and free its scratch rows; then the later batches' deferred
        insertions take place (their buckets no longer hold this batch's rows)."""
        self._release_own(pf)
        self._settle_pending()

    def release_locks(self, pf: GroupPrefetch) -> None:
        """``release``'s unlock, ahead of it: the collection gives a batch's locks back before it
        finishes the later batches' deferred prefetches, whose insertion then meets the buckets
        as in a plain loop (no pair contested by this batch waits for ``settle``)."""
        if pf.holds_locks:
            self._unlock(pf)

    def _unlock(self, pf: GroupPrefetch) -> None:
        if not self.index.unlock_slots(pf.locked_slots, pf.generation):
            self.index.unlock(pf.locked, pf.locked_tables)  # rehashed since: find the keys again
        if pf.holds_locks:
            pf.holds_locks = False
            self._holding -= 1
        pf.locked_slots = pf.locked = pf.locked_tables = pf.locked_slots[:0]  # given back

    def _release_own(self, pf: GroupPrefetch) -> None:
        if pf.deferred is not None:  # never forwarded: nothing to insert
            pf.deferred = None
            self._pending.remove(pf)
        self._unlock(pf)
        self.store.free(pf.scratch)
        if pf.lent is not None:
            pf.lent.released = True
            self._take_back()

    def _settle_pending(self) -> None:
        for later in list(self._pending):
            self.settle(later)

    def rounding_seeds(self, pf: GroupPrefetch, step: int) -> torch.Tensor | None:
        """int64 (u,) the seeds of the stochastic rounding of ``pf``'s rows updated at ``step``
        (``rounding.row_seeds``: from the table, the key and the step alone), or None: the group's
        rows are float32, or rounded to the nearest value."""
        if self._rounding is None:
            return None
        return row_seeds(self._rounding[pf.unique_tables], pf.unique_keys, step)

    # ------------------------------------------------------------------------------ row access
    def _tables_of(self, table: int, keys: torch.Tensor) -> torch.Tensor:
        return torch.full_like(keys, table)

    def read(self, table: int, keys: torch.Tensor,
             cols: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of ``keys``: the first ``cols`` columns, default the weights; zeros where absent,
        found). Moves no score."""
        self.place_overflow()
        slots = self.index.find(keys, self._tables_of(table, keys))
        found = slots >= 0
        addresses = torch.where(found, self.index.values[slots.clamp(min=0)], -1)
        return self.store.gather(addresses, self.dim if cols is None else cols), found

    def write(self, table: int, keys: torch.Tensor, weights: torch.Tensor, step: int) -> None:
        """Upsert rows; their optimizer state is reset to zero."""
        self.place_overflow()
        tables = self._tables_of(table, keys)
        res = self.index.find_or_insert(keys, step, tables=tables)
        addresses = self._place_new(keys, tables, res)
        if bool((res.slots < 0).any()):
            raise RuntimeError(f"table {self.names[table]!r}: no room for {int((res.slots < 0).sum())} "
                               "keys (their buckets are full of rows locked by in-flight batches)")
        rows = torch.zeros(keys.numel(), self.width, dtype=self.dtype, device=self.device)
        rows[:, : self.dim] = weights
        self.kernels.scatter(self.store, addresses, rows)
        self._count((EVICTIONS, res.evicted_tables, None))

    def export(self, table: int) -> TableRows:
        self.place_overflow()
        keys, addresses, scores = self.index.export(table)
        rows = self.store.gather(addresses)
        return TableRows(keys, rows[:, : self.dim], rows[:, self.dim :], scores)

    # ------------------------------------------------------------------------------ checkpoints
    def export_chunks(self, table: int, rows: int):
        """Every stored row of ``table`` in chunks of at most ``rows``: (keys, full rows [weights |
        state], scores). Only one chunk of rows is materialized at a time."""
        self.place_overflow()
        keys, addresses, scores = self.index.export(table)
        for start in range(0, keys.numel(), rows):
            part = slice(start, start + rows)
            yield keys[part], self.store.gather(addresses[part]), scores[part]

    def import_rows(self, table: int, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> None:
        """Store whole rows (weights and optimizer state) with their scores, as saved. A bounded
        table smaller than the saved one keeps what its buckets hold (rows past it are dropped,
        as its bound drops rows)."""
        self.place_overflow()
        if keys.numel() == 0:
            return
        tables = self._tables_of(table, keys)
        res = self.index.find_or_insert(keys, 0, tables=tables)
        if res.any_miss:  # rows for the new keys, not initialized: the saved rows go there
            self._give_rows(res)
        addresses = self._slot_rows(res)
        placed = (res.slots >= 0).nonzero().squeeze(1)
        self.kernels.scatter(self.store, addresses[placed], rows[placed].to(self.device))
        self.index.scores[res.slots[placed]] = scores[placed].to(self.device)

    def delete_rows(self, table: int, keys: torch.Tensor) -> None:
        """Remove rows (absent keys are ignored); their row addresses go back to the store."""
        self.place_overflow()
        if keys.numel():
            self.store.free(self.index.erase(keys, self._tables_of(table, keys)))

    def admission_counts(self, table: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, occurrences) of the keys counted toward admission and not admitted yet."""
        if self.admission is None:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return empty, empty
        keys, _, counts = self.admission.export(table)
        return keys, counts

    def import_admission(self, table: int, keys: torch.Tensor, counts: torch.Tensor) -> None:
        if self.admission is not None and keys.numel():
            self.admission.find_or_insert(keys, 0, counts, tables=self._tables_of(table, keys))

    def is_empty(self) -> bool:
        self.place_overflow()
        return self.index.size() == 0

    def stats(self, table: int) -> TableStats:
        self.place_overflow()
        unique, hits, misses, conflicts, evictions, not_admitted = self._counts[table].tolist()
        probe_misses, pairs, contested, refused = self._probed[:, table].tolist()
        unique += pairs
        hits += pairs - probe_misses - contested - refused
        misses += probe_misses + contested
        not_admitted += refused
        _, addresses, _ = self.index.export(table)
        per_segment = torch.bincount(addresses // self.store.segment_rows,
                                     minlength=len(self.store.segments)).tolist()
        rows = {"device": 0}
        for placement, n in zip(self.store.placement, per_segment):
            rows[placement] = rows.get(placement, 0) + n
        return TableStats(
            rows=rows, capacity=self.configs[table].max_capacity,
            lookups=self.lookups[table], unique_lookups=unique, hits=hits, misses=misses,
            conflict_misses=conflicts, evictions=evictions, not_admitted=not_admitted,
            bytes_moved={}, memory_bytes={k: v * self.store.row_bytes for k, v in rows.items()},
            index_bytes=self.index_bytes(table),
        )

    def index_bytes(self, table: int) -> dict[str, int]:
        """``TableStats.index_bytes`` of ``table``."""
        return {"device": sum(index.nbytes(table) for index in self._indexes())}

    def _indexes(self) -> list[KeyIndex]:
        """Every key index of the group (a region per table in each)."""
        return [self.index] + ([self.admission] if self.admission is not None else [])

    def flush(self) -> None:
        """Nothing to write down (every row already lives in its only tier): the rows lent to
        released batches go back to the store."""
        self.place_overflow()
        self._take_back(wait=True)

    def reads_ahead(self) -> bool:
        """Whether ``read_ahead`` may bring rows in now: never here (a cache over a host tier's may)."""
        return False

    def read_ahead(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """Nothing: every row already lives in this tier (a cache over a host tier reads ahead)."""

    def close(self) -> None:
        """Nothing to release beyond the tensors."""
