"""``DeviceTier``'s insertion of a batch's misses on the device, with no host read.

A group whose tables are all bounded or all unbounded, with no pair held back by an earlier batch,
inserts its misses on the device (``insert_rows``): each takes a victim's row or one of a pool of as
many free rows lent by the row store, initialized; the counts (rows taken, pairs without a way,
victims) reach the host later, in pinned memory. Replayed from a CUDA graph of the batch's padded
sizes where one is captured. What it leaves behind is settled before the index is used again: the
pools' unused rows go back to the store (``_take_back``), and an unbounded table's pairs whose bucket
was full are inserted with the rows their batch trained (``place_overflow``).
"""

from __future__ import annotations

import torch

from tieredemb.ops import to_host_later
from tieredemb.ops.capture import CapturedStages, Slot, padded_size
from tieredemb.storage.tiers.parts import CONFLICTS, EVICTIONS, GroupPrefetch, LentRows, Overflow


class DeviceInsertion:
    """The insertion on the device (``_inserted``, ``_insert_rows``, ``_insert_graph``) and the
    settling of what it leaves (``place_overflow``, ``_take_back``, ``_trim``).

    A mixin of ``DeviceTier`` (and so of ``CacheTier``) rather than a helper object, because its
    state is the tier's own: it inserts into the tier's index, pops rows from its row store and gives
    them back, initializes them with its initializers, adds to its counters and its count of batches
    holding locks, and replays the tier's insertion graphs (``_insert_graphs``, ``may_capture``). The
    state it keeps (``_lent``, ``_overflow``, ``_count_buffers``) is made by ``DeviceTier``'s
    constructor.
    """

    def _inserted(self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor, inverse: torch.Tensor,
                  step: int | torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                  per_region: torch.Tensor, info: list[int]) -> GroupPrefetch:
        """``_placed`` of a group whose tables are all bounded or all unbounded, with pairs at slot
        -1 (``info``: its read) and none held back: inserted on the device (``insert_rows``), their
        rows from a pool of as many free rows (the store's next), initialized; no host read.
        Counters on the device too. Unbounded regions grow first as ``complete`` grows them (before
        their load would pass the limit); a pair whose bucket is full all the same keeps its row
        from the pool and is inserted by ``place_overflow`` before the index is used again."""
        regions = len(self.configs)
        misses = sum(info[:regions])
        if self.index.bounded:
            self._take_back()
        else:
            self.index.reserve_regions([m + s for m, s in zip(info[:regions], info[regions : 2 * regions])])
        pool = self.store.peek(misses)
        self.store.pop(misses)
        kinds = self._insert_rows(keys, tables, counts, slots, values, misses, step, pool)
        self._count_probe(per_region, None)
        if not self.index.bounded:  # every row of the pool is a pair's now, none is lent
            self._overflow.append(Overflow(keys, tables, counts, slots, values, step, *self._to_host(kinds)))
            none = keys[:0]
            return GroupPrefetch(keys, tables, inverse, values, none, none, none, self.index.generation, none)
        self._counts[:, CONFLICTS : EVICTIONS + 1] += kinds[1:].T  # left without a way, victims
        self._holding += 1
        pf = GroupPrefetch(keys, tables, inverse, values, keys, tables, slots, self.index.generation,
                           keys[:0], holds_locks=True, lent=LentRows(pool, *self._to_host(kinds)))
        self._lent.append(pf.lent)
        return pf

    def _insert_rows(self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                     slots: torch.Tensor, values: torch.Tensor, misses: int, step: int | torch.Tensor,
                     pool: torch.Tensor) -> torch.Tensor:
        """``index.insert_rows`` and the new rows' initial values; its counts per region. Replayed
        from a CUDA graph of the batch's padded sizes where one is captured (``_insert_graph``);
        ``slots`` and ``values`` are written in place either way."""
        slot = self._insert_graph(keys, tables, counts, slots, values, misses, step, pool)
        if slot is None:
            pos, rows, kinds = self.index.insert_rows(keys, tables, counts, slots, values, misses, step, pool)
            self._initialize(keys[pos], tables[pos], rows)
            return kinds
        graph_slots, graph_values, kinds = slot.outputs
        u = keys.numel()
        slots.copy_(graph_slots[:u])
        values.copy_(graph_values[:u])
        kinds = kinds.clone()
        self._insert_graphs.release(slot, None)
        return kinds

    def _insert_graph(self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                      slots: torch.Tensor, values: torch.Tensor, misses: int, step: int | torch.Tensor,
                      pool: torch.Tensor) -> Slot | None:
        """The insertion replayed from a CUDA graph (``CapturedStages``; the slot held, None where it
        runs eagerly): the batch's u pairs padded to a bucket (``padded_size``) and its misses to a
        power of two, the pairs past u marked found, the misses counted on the device. A graph bakes
        in the index's tables (its key holds the rehashes so far) and the row store's segment table
        (its address). Only on the thread that may capture (``may_capture``, the collection's forward
        thread: a capture must not meet another thread's device-wide wait), with the step an int
        and one built-in initializer (several take a host read to split the keys)."""
        if self.may_capture is None or not isinstance(step, int) or self._inits[0][1] is not None or \
                type(self._inits[0][0]).__module__ != "tieredemb.init":
            return None
        if self._insert_graphs is None:
            dtypes = (keys.dtype, tables.dtype, counts.dtype, slots.dtype, values.dtype, pool.dtype,
                      torch.int64, torch.int64)
            self._insert_graphs = CapturedStages(self.device, dtypes, max_slots=8, what="the insertion")
        u = keys.numel()
        # the misses padded to a power of two: their count drifts from step to step (a table from
        # scratch finds fewer new keys each step), and each new bound is an eager run and a capture
        pairs = padded_size(u)
        bound = min(pairs, 1 << (misses - 1).bit_length())
        # the segment table taken on the stream the graph replays on: it waits there for a stash's
        # copy (a wait captured in the graph would invalidate the capture)
        key = (pairs, bound, self.index.generation, self.store.pointer_table().data_ptr())

        def insert(keys, tables, counts, slots, values, pool, step, u):
            slots.masked_fill_(torch.arange(pairs, device=self.device) >= u, 0)  # not a miss
            pos, rows, kinds = self.index.insert_rows(keys, tables, counts, slots, values, bound, step, pool,
                                                      padded=True)
            self._initialize(keys[pos], tables[pos], rows)
            return slots, values, kinds

        return self._insert_graphs.acquire(key, insert, keys, tables, counts, slots, values, pool, step, u,
                                           lengths=(pairs,) * 5 + (bound,), capture=self.may_capture())

    def _to_host(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """``counts`` (int64 (3, R) on the device) copied to the host behind the work queued (a pinned
        buffer kept from an earlier batch, or a new one) and the event after which the copy holds
        them (on the CPU: ``counts`` itself, None)."""
        return to_host_later(counts.view(-1), self._count_buffers)

    def place_overflow(self) -> None:
        """Insert the pairs of unbounded tables that the device insertion of earlier batches left
        without a slot (their bucket was full; rare below the load limit): a region with a full
        bucket doubles first, as ``complete`` doubles it, and each pair takes the row its batch
        trained (``insert_rows`` with its own rows; a pair whose bucket is full again comes round
        once more). Runs first in every verb that reads or changes the index (waiting for those
        batches' counts if they are not on the host yet), so nothing sees the index without them."""
        regions = len(self.configs)
        while self._overflow:
            batch = self._overflow.pop(0)
            if batch.ready is not None:
                batch.ready.synchronize()
            full = batch.counts.tolist()[regions : 2 * regions]
            if batch.ready is not None:  # its pinned buffer serves a later batch
                self._count_buffers.append(batch.counts)
            if not any(full):
                continue
            self.index.double([r for r, f in enumerate(full) if f])
            n = sum(full)
            pos = torch.nonzero_static(batch.slots == -1, size=n).squeeze(1)
            keys, tables = batch.keys[pos], batch.tables[pos]
            occurrences, rows = batch.occurrences[pos], batch.values[pos]
            slots, values = torch.full_like(pos, -1), rows.clone()
            kinds = self.index.insert_rows(keys, tables, occurrences, slots, values, n, batch.step, rows,
                                           own_rows=True)[2]
            self._overflow.append(Overflow(keys, tables, occurrences, slots, values, batch.step,
                                           *self._to_host(kinds)))

    def _take_back(self, wait: bool = False) -> None:
        """Give the store back the rows of lent pools that no table took: the unused ones of each
        pool whose counts have reached the host (waiting for those of released batches, with
        ``wait``), the scratch rows of released batches."""
        for lent in list(self._lent):
            if lent.counts is not None:
                if lent.ready is not None:
                    if wait and lent.released:
                        lent.ready.synchronize()
                    elif not lent.ready.query():  # not read yet: a later call takes it back
                        continue
                self._trim(lent)
            if lent.released:
                self.store.free(lent.pool)
                self._lent.remove(lent)

    def _trim(self, lent: LentRows) -> None:
        """``lent``'s unused rows back to the store, its pool cut to the batch's scratch rows."""
        unused, lent.pool = lent.split(len(self.configs))
        self.store.free(unused)
        if lent.ready is not None:  # its pinned buffer serves a later batch
            self._count_buffers.append(lent.counts)
        lent.counts = None
