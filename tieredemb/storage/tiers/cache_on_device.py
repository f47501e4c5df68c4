"""``CacheTier``'s insertion of a batch's misses on the device, over host memory.

Over host memory (no admission, no bounded table) the cache's prefetch happens on the device without
a host read, in another order than ``CacheTier._place``'s (``_insert_on_device``, replayed from a CUDA
graph): the misses are inserted first (victims' rows reused, a scratch row from a lent pool for a pair
without a way; a miss in a scratch row an earlier batch still owes shares that row), the victims
written down while the misses' rows are fetched into their new rows; the host learns the counts
(conflict misses, rows taken, pads shared) at the next prefetch (``_owe_conflicts``). ``arm`` does the
insertion's host work before the staged prefetch's read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tieredemb.config import RESERVED_KEY
from tieredemb.ops import to_host_later
from tieredemb.ops.capture import CapturedStages, Slot, padded_size
from tieredemb.profiling import label
from tieredemb.storage.tiers.parts import (
    CONFLICTS,
    EVICTIONS,
    MISSES,
    UNIQUE,
    CachePrefetch,
    LentRows,
    StagedPrefetch,
)


def per_table(tables: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """int64 (n,): how many of ``tables`` (int64 (m,), each < n) are ``mask``ed, per table: a
    histogram (no atomics of 10^4 entries on a few counters: ``index_add_`` took 47 us there)."""
    hist = torch.histc(torch.where(mask, tables, n).to(torch.float32), bins=n + 1, min=0, max=n + 1)
    return hist[:n].to(torch.int64)


class Beside:
    """Work queued on a side stream behind the current stream's work so far (``with beside:``);
    ``join()`` makes the current stream wait for it. Without a side stream (the CPU) it runs in
    place, in the order written."""

    def __init__(self, side: torch.cuda.Stream | None, current: torch.cuda.Stream | None = None) -> None:
        self.side, self.current = side, current

    def __enter__(self) -> Beside:
        if self.side is not None:
            self.side.wait_stream(self.current)
            self._on = torch.cuda.stream(self.side)
            self._on.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.side is not None:
            self._on.__exit__(*exc)

    def join(self) -> None:
        if self.side is not None:
            self.current.wait_stream(self.side)


class SideStreams:
    """The side streams of a tier's device insertion, one per priority and use, made on first use."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}

    def beside(self) -> Beside:
        """A side stream of the current one (its priority) for work that may overlap the current
        stream's (inside a capture: a branch of the graph); on the CPU, the current stream itself."""
        if self.device.type != "cuda":
            return Beside(None)
        current = torch.cuda.current_stream(self.device)
        return Beside(self._side(current.priority, 0), current)

    def write_stream(self) -> torch.cuda.Stream | None:
        """The stream of the victims' write-downs beside the current stream (of its priority; None
        on the CPU): not the capture's side stream (``beside``), as it runs outside the graphs."""
        if self.device.type != "cuda":
            return None
        return self._side(torch.cuda.current_stream(self.device).priority, 1)

    def _side(self, priority: int, use: int) -> torch.cuda.Stream:
        side = self._streams.get((priority, use))
        if side is None:
            side = self._streams[(priority, use)] = torch.cuda.Stream(self.device, priority=priority)
        return side


@dataclass
class Armed:
    """``CacheTier.arm``'s work for the insertion graph of ``key`` (``CacheTier._insert_key``): the
    free rows lent (the cache's, the host store's) and the graph slot taken, its inputs loaded."""

    key: tuple
    pool: torch.Tensor
    hpool: torch.Tensor
    slot: Slot | None


class OnDeviceInsertion:
    """``CacheTier``'s insertion on the device over host memory (``_insert_on_device``), its arming
    before the staged read (``arm``, ``disarm``) and the reading of its counts (``_owe_conflicts``).

    A mixin of ``CacheTier`` rather than a helper object, because its state is the tier's own: it
    inserts into the tier's index, takes rows from its row store and lends pools of them, adds to its
    counters and moved-rows counts, registers owed scratch rows in its ``in_flight`` index, and
    replays the tier's insertion graphs (``_insert_graphs``, ``may_capture``) in the same step as the
    host path of ``CacheTier._place``. Its own state (``_init_insertion``): the batches whose counts
    the host has not read, the last graph's sizes, the armed insertion, the side streams.
    """

    def _init_insertion(self) -> None:
        # batches inserted on the device (``_insert_on_device``) whose counts the host has not read
        self._inserting: list[CachePrefetch] = []
        self._last_insert: tuple[int, int] | None = None  # the last graph's padded pairs and misses
        self._armed: Armed | None = None  # the next insertion's host work, done (``arm``)
        self._pad_counts: list[torch.Tensor] = []  # pinned buffers of read pad counts, reused
        self.arms = [0, 0]  # arms replayed, arms given back (other sizes, no free slot, a bad batch)
        # training batches inserted: on the device; on the host path for rows of the store below (a
        # host tier's count of the misses it lacks); on the host path for another reason
        self.insertions = [0, 0, 0]
        self._streams = SideStreams(self.device)  # side streams by priority and use
        # the backing store's rows as this device moves them (host memory's), else None
        self._rows_below = self.below.device_rows if self.backend_device == self.device else None

    def arm(self, staged: StagedPrefetch, count: torch.Tensor) -> None:
        """The device insertion's host work before the staged read, where its graph is replayed:
        the pools of free rows lent, a captured slot taken and its inputs copied (the pairs as the
        staged graph left them, padded; their count from the device), for the padded pairs and
        misses of the last insertion (they change every few steps). ``_insert_on_device`` replays it
        at once if the read says the same sizes; else it gives everything back and goes on as
        without. What it moves off the path from the read to the replay (H200, ``cache`` bench):
        ~0.2 ms of host a step with the device idle."""
        self.disarm()
        last = self._last_insert
        if last is None or not self._inserts_on_device() or not self._device_graphs_for(staged.step):
            return
        if self._owing:  # the pairs in pads are found after the read, and the graph's inputs
            return  # loaded now would miss them
        if self.below_reads:  # over a host tier: the read may send the batch to the host
            return  # path (``_needs_below``), and an arm is never followed by that path
        pairs, bound = last
        pool, hpool = self._lend(bound)
        key = self._insert_key(pairs, bound)
        armed = Armed(key, pool, hpool, self._insert_graphs.take(key))
        if armed.slot is None:  # none captured for these sizes, or every one in flight
            self._give_back(armed)
            return
        pairs_of = (staged.keys, staged.tables, staged.counts, staged.slots, staged.values)
        self._insert_graphs.load(armed.slot, *(t[:pairs] for t in pairs_of), pool, hpool, staged.step, count)
        self._armed = armed

    def _lend(self, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device insertion's pools of ``bound`` free rows, the cache's and the host store's,
        after the host store's earlier upserts are read back (the fetch then sees every row written
        down before; keys they left out go in now)."""
        self._rows_below.settle()
        pool = self.store.peek(bound)
        self.store.pop(bound)
        return pool, self._rows_below.room_for(bound)

    def disarm(self) -> None:
        armed, self._armed = self._armed, None
        if armed is not None:
            self._give_back(armed)

    def _give_back(self, armed: Armed) -> None:
        """An arm's pools back where they came from, in their order; its slot free."""
        self.arms[1] += 1
        self.store.free(armed.pool)
        self._rows_below.give_back(armed.hpool)
        if armed.slot is not None:
            self._insert_graphs.cancel(armed.slot)

    def _insert_key(self, pairs: int, bound: int) -> tuple:
        """The insertion graph's key: the sizes and what it bakes in (the indexes' rehashes, the row
        stores' segment tables)."""
        return (pairs, bound, self.index.generation, self.store.pointer_table().data_ptr(),
                *self._rows_below.capture_key())

    def _inserts_on_device(self) -> bool:
        """Whether this batch's insertion runs on the device without a host read: every pair gets a
        cache row or a scratch row (no bounded table, no admission), the backing store takes padded
        write-downs on this device (``GroupStore.device_rows``: host memory's), and no write-down
        that failed is kept (``writes.unwritten``: the device's victims would go down before it,
        and it after them). Scratch rows owed by earlier batches are shared on the device too."""
        return self.can_stage() and self._rows_below is not None and not self.writes.unwritten

    def _insert_on_device(self, unique: torch.Tensor, utab: torch.Tensor, inverse: torch.Tensor,
                          counts: torch.Tensor, step: int, slots: torch.Tensor, values: torch.Tensor,
                          per_region: torch.Tensor, info: list[int]) -> CachePrefetch:
        """``_place`` reading nothing on the host, as ``hbm_direct``'s bounded tables insert: after
        the probe (``slots``, ``values``: the pairs found, locked and touched), the misses
        (``info``'s count of ``slots`` -1) inserted in the dedup's order (``insert_rows``), each
        taking a victim's row or one of a pool of as many free rows (from its end: a scratch row,
        where its bucket had no free way); the victims (padded to the misses: ``RESERVED_KEY`` where
        a pair evicted none) gathered and written down to the host store while the misses' rows
        are fetched from it (initial rows where it has none) into their rows, through the store's
        ``DeviceRows``. Replayed from a CUDA graph where one is captured (``_device_insert``). How
        many of the pool's rows were taken, and which pairs got none (conflict misses, owed to the
        store at release), the host learns later (``_owe_conflicts``)."""
        regions = len(self.configs)
        misses = sum(info[:regions])  # (counting the pairs in pads: a bound of the insertion's)
        graphs = self._device_graphs_for(step)
        u = unique.numel()
        pairs = padded_size(u) if graphs else u
        bound = min(pairs, 1 << (misses - 1).bit_length()) if graphs and misses else misses
        probed = slots
        pads = self._shared_pads(unique, utab, slots) if self._owing else None
        if pads is not None:  # no miss for the insertion (slot -2: claims no way; given back as -1)
            slots = torch.where(pads[0], -2, slots)
        armed, self._armed = self._armed, None
        if armed is not None and (pads is not None or armed.key != self._insert_key(pairs, bound)):
            self._give_back(armed)  # armed for other sizes (or segment tables, or a rehash since),
            armed = None  # or loaded before a pad was owed
        if armed is None:
            try:
                pool, hpool = self._lend(bound)
            except BaseException:  # nothing changed but the probe's locks
                self.index.unlock_slots(probed, self.index.generation)
                raise
        else:  # lent before the read (``arm``), the slot loaded
            pool, hpool = armed.pool, armed.hpool
        with label("## cache.insert ##"):
            slot = None
            if armed is not None:
                slot = armed.slot
                self._insert_graphs.replay(slot)
                self.arms[0] += 1
            elif graphs:
                def insert(*inputs):  # the pairs' keys, tables, counts, slots, values, the pools, step, u
                    return self._device_insert(*inputs, bound)

                key = self._insert_key(pairs, bound)
                slot = self._insert_graphs.acquire(key, insert, unique, utab, counts, slots, values, pool,
                                                   hpool, step, u, lengths=(pairs,) * 5,
                                                   capture=self.may_capture())
            # the next batch is armed for these sizes only where a graph of them replayed (a thread
            # that may not capture runs a shape no one captured eagerly: no arm would find a slot)
            self._last_insert = None if slot is None else (pairs, bound)
            write = self._streams.write_stream()
            if slot is None:  # eagerly, with the misses' exact count (the pools sized for a graph: cut)
                if pads is not None:  # (a host read: the eager path only, free on the CPU)
                    misses -= int(pads[0].sum())
                self.store.free(pool[misses:])
                pool = pool[:misses]
                pairs_of = (unique, utab, counts, slots, values)
                out = self._device_insert(*pairs_of, pool, hpool, step, None, misses)
                settled = None
            else:
                out = slot.outputs
                settled = functools.partial(self._graph_settled, slot, write)
            slots, values, kinds, written, (down_at, down_order) = out
            if slot is not None:  # the batch's own copies: the slot serves the next batch
                slots, values, kinds = slots[:u].clone(), values[:u].clone(), kinds.clone()
            if pads is not None:  # the pairs in pads: no slot, the pad's row
                slots = torch.where(pads[0], -1, slots)
                values = torch.where(pads[0], pads[1], values)
            self._rows_below.upserted(*written, hpool, settled)
            # the victims' rows go down to the host store beside the rest of the step: nothing of this
            # batch waits for them, what reads the store next does (a graph's slot: kept by ``settled``)
            self._rows_below.scatter_beside(down_at, written[2], down_order, write, keep=slot is None)
        return self._inserted(unique, utab, inverse, slots, values, per_region, kinds, pool,
                              None if pads is None else pads[0])

    def _inserted(self, unique: torch.Tensor, utab: torch.Tensor, inverse: torch.Tensor, slots: torch.Tensor,
                  values: torch.Tensor, per_region: torch.Tensor, kinds: torch.Tensor, pool: torch.Tensor,
                  pads: torch.Tensor | None) -> CachePrefetch:
        """The batch ``_insert_on_device`` inserted, counted (a pair in a pad is a hit, as on the
        host path), its counts on their way to the host (``_owe_conflicts`` reads them)."""
        regions = len(self.configs)
        pairs_in, missed = per_region[regions : 2 * regions], per_region[:regions]
        shared = None
        if pads is not None:
            missed = missed - per_table(utab, pads, regions)
            # (copied before the counts: read once their event has passed)
            shared = to_host_later(pads.sum().view(1), self._pad_counts)[0]
        self._counts[:, UNIQUE : MISSES + 1] += torch.stack([pairs_in, pairs_in - missed, missed], dim=1)
        self._counts[:, CONFLICTS : EVICTIONS + 1] += kinds[1:].T  # left without a way, victims
        empty = unique[:0]
        pf = CachePrefetch(unique, utab, inverse, values, unique, utab, slots, self.index.generation, empty,
                           write_back=empty, write_back_tables=empty,
                           lent=LentRows(pool, *self._to_host(kinds)), shared_pads=shared)
        self._inserting.append(pf)
        return pf

    def _shared_pads(self, keys: torch.Tensor, tables: torch.Tensor,
                     slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The misses in a scratch pad an earlier batch owes (``in_flight``): they share its row, as
        on the host path (``_split_pads``). (bool (u,) which, int64 (u,) the pad's row there), on
        the device; the pads' locks go up when the host reads the batch's counts
        (``_owe_conflicts``, before any release can write a pad down)."""
        found = self.in_flight.find(keys, tables)
        return (slots == -1) & (found >= 0), self.in_flight.values[found.clamp(min=0)]

    def _device_graphs_for(self, step: int) -> bool:
        """Whether the device insertion may replay a CUDA graph (as ``DeviceTier._insert_graph``: on
        the thread that may capture, the step an int, one built-in initializer)."""
        if self.may_capture is None or not isinstance(step, int) or self._inits[0][1] is not None or \
                type(self._inits[0][0]).__module__ != "tieredemb.init":
            return False
        if self._insert_graphs is None:
            self._insert_graphs = CapturedStages(self.device, (torch.int64,) * 9, max_slots=8,
                                                 what="the cache's insertion")
        return True

    def _device_insert(self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                       slots: torch.Tensor, values: torch.Tensor, pool: torch.Tensor, hpool: torch.Tensor,
                       step: int | torch.Tensor, u: torch.Tensor | None, bound: int):
        """``_insert_on_device``'s device work: ``keys``, ``tables``, ``counts`` the batch's pairs and
        ``slots``, ``values`` their probe's (the first ``u``, int64 () on the device, of them when
        padded for a graph; None: all), ``bound``
        the misses (padded: at least them), ``pool`` and ``hpool`` that many free rows of the cache
        and of the host store. Returns (slots, values, kinds), each pair's slot (-1: a conflict miss)
        and row, and ``insert_rows``'s counts; and the host store's upsert (keys, tables, rows, their
        addresses, its counts) for ``written``."""
        if u is not None:
            padding = torch.arange(keys.numel(), device=self.device) >= u
            slots = slots.masked_fill(padding, 0)  # no miss
            # and of a valid table: an armed insertion's padding is what the staged graph left there
            # (``arm``), and the insertion's sort reads each pair's region by its table
            tables = tables.masked_fill(padding, 0)
        evicted = torch.empty(bound, dtype=torch.int64, device=self.device)
        padded = {} if u is None else {"padded": True}  # (the Triton index's: a graph's)
        pos, rows, kinds = self.index.insert_rows(keys, tables, counts, slots, values, bound, step, pool,
                                                  evicted=evicted, **padded)
        # the victims' rows go down to the host store while the misses' rows come up from it
        # (opposite PCIe directions; different host rows: a victim was cached, a miss was not), each
        # in the order of its host rows (the order they move fastest). First, on this stream: the
        # misses located (the upsert then changes the host index), the victims' rows gathered (the
        # fetch then overwrites them). The read then runs beside the initial rows and the upsert: the
        # two directions share one limit of host access (~52 GB/s together on an H200),
        # so the link is best kept busy from the read's start; and the victims' write slows every
        # kernel beside it (x10-x25: its stores to host memory hold the SMs' memory pipes).
        vtables, victim = tables[pos], evicted != RESERVED_KEY
        wanted = torch.where(rows >= 0, keys[pos], RESERVED_KEY)
        below = self._rows_below
        located, found = below.locate(wanted, vtables)
        down = self.kernels.gather(self.store, torch.where(victim, rows, -1), self.width, dtype=self.dtype)
        # (what the side stream reads from this one stays referenced to the join)
        with self._streams.beside() as fetching:
            fetch = below.address_order(located)
            below.read_into(located[fetch], self.store, rows[fetch])
        # the misses the store lacks take initial rows (HBM work: beside the read, not the write)
        self.kernels.scatter(self.store, torch.where(found, -1, rows), self._initial_weights(wanted, vtables))
        addresses, hcounts = below.upsert_keys(evicted, vtables, hpool)
        order = below.address_order(addresses)
        fetching.join()
        # rows moved per table: victims (``insert_rows``'s count), misses the store had
        self._moved[1] += kinds[2]
        self._moved[0] += per_table(vtables, found, len(self.configs))
        return slots, values, kinds, (evicted, vtables, down, addresses, hcounts), (addresses[order], order)

    def _needs_below(self, below: list[int]) -> bool:
        """Whether a batch's misses may need rows of the store below a host tier: its insertion then
        runs on the host, the store read before anything changes (a failed read changes nothing).
        Not where the staged read (``below``: the tier's ``lacking``, erasures and count) counted
        none the tier lacks and no pair left the tier since."""
        if not self.below_reads:
            return False
        return not below or below[1] > 0 or below[0] != self._rows_below.erasures()

    def _graph_settled(self, slot, write: torch.cuda.Stream | None) -> None:
        """The host store has read the counts of the insertion replayed on ``slot``: the slot serves
        another batch once the current stream's work so far and the victims' write-down (queued on
        ``write`` at the insertion, maybe by another thread) are done."""
        if write is not None:
            write.wait_stream(torch.cuda.current_stream(self.device))
        self._insert_graphs.release(slot, write)

    def _owe_conflicts(self) -> None:
        """Read the counts of the batches inserted on the device, oldest first (waiting for them; by
        the next prefetch they are long done): the pool rows a batch did not take go back to the
        store; its conflict misses' scratch rows become owed to the backing store as an earlier
        path's are (``in_flight``: shared by later batches, written down at the last release), and
        the pads of earlier batches it shares take one more lock each (one release more before
        they go down)."""
        regions = len(self.configs)
        if self._inserting:
            self._rows_below.settle()  # the host store's upserts first: they may hold a graph's slot
        while self._inserting:
            pf = self._inserting.pop(0)
            lent, pf.lent = pf.lent, None
            if lent.ready is not None:
                lent.ready.synchronize()
            unused, scratch = lent.split(regions)
            if lent.ready is not None:  # its pinned buffer serves a later batch
                self._count_buffers.append(lent.counts)
            self.store.free(unused)
            # slot -1: the conflict misses (a scratch row each) and the pairs in an earlier pad
            lacking = scratch.numel() + (0 if pf.shared_pads is None else int(pf.shared_pads[0]))
            if pf.shared_pads is not None and pf.shared_pads.is_pinned():
                self._pad_counts.append(pf.shared_pads)
            pf.shared_pads = None
            if lacking:
                conflict = torch.nonzero_static(pf.locked_slots < 0, size=lacking).squeeze(1)
                keys, tables = pf.unique_keys[conflict], pf.unique_tables[conflict]
                self._register_owed(keys, tables, pf.addresses[conflict])
                pf.write_back, pf.write_back_tables = keys, tables
                self._owing += 1
