"""The staged prefetch of a training batch: the device half (checks, dedup, probe, the backward's
work that needs only the batch) launched with one host read at its end instead of one each, then the
host half (the read, the insertion of the misses). A collection uses it when every tier can take it
(no admission policy, no bounded table in a cache) and the batch is not sharded; the eager path
(``CollectionBase._resolve``) is the reference it is tested equal to.

On CUDA with Triton's kernels the device half is replayed from a CUDA graph (``capture.py``) when the
batch's shape, or its shape padded to a bucket of ids, was seen before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tieredemb.keys import RESERVED_KEY
from tieredemb.modules.batch import Batch, BatchInput, GroupBatch, GroupMajor, Layout, StagedBatch
from tieredemb.modules.in_flight import InFlightBatch, StagedAll, StagedRecord
from tieredemb.ops.capture import CapturedStages, Slot
from tieredemb.profiling import label
from tieredemb.storage.row_store import RowStore
from tieredemb.storage.tiers.device import DeviceTier
from tieredemb.storage.tiers.parts import GroupPrefetch, StagedPrefetch


@dataclass
class Collection:
    """What the staged prefetch uses of the collection it serves."""

    layout: Layout
    tiers: list[DeviceTier]
    kernels: object
    device: torch.device
    num_tables: int
    # (g, group g's ids) -> (the gradient source of each id, its scale): the backward's, made early
    grad_sources: Callable[[int, GroupBatch], tuple[torch.Tensor, torch.Tensor | None]]
    # (group 0's row store, an address per id, its ids, their scale) -> the forward's lookup
    lookup: Callable[[RowStore, torch.Tensor, GroupBatch, torch.Tensor | None], torch.Tensor]
    # (the stream resolving) -> whether a lookup launched now reads the rows the forward would
    may_look_early: Callable[[object], bool]
    rows_changed: Callable[[], int]  # the count of changes to the rows (an early lookup's stamp)
    may_capture: Callable[[], bool]  # whether this thread may capture a CUDA graph
    clock_to: Callable[[int], None]  # the batch's checks passed: the LRU clock moves to its step


class StagedPrefetcher:
    """The staged prefetch of one collection (``of``), the CUDA graphs of its device half
    (``captured``: None where capture is off), and the pinned buffers its deferred reads land in
    (allocated once, kept and reused)."""

    def __init__(self, of: Collection, captured: CapturedStages | None) -> None:
        self.of = of
        self.layout, self.tiers, self.kernels, self.device = of.layout, of.tiers, of.kernels, of.device
        self.captured = captured
        self._read_buffers: list[torch.Tensor] = []  # pinned, for deferred reads

    def stage(self, given: BatchInput, group: DeviceTier | None, step: int, stream: object,
              defer: bool) -> StagedRecord:
        """The device half of a staged prefetch (a training batch of stageable groups, with one host
        read for the checks, the dedup and the probe together instead of one each; ``group``: the
        only one, or None for every group together): a replayed CUDA graph when the batch's shape was
        seen before (``capture.py``). ``defer``: its read copied now into pinned memory behind it,
        for ``finish`` to take later."""
        for g in self.tiers if group is None else [group]:
            g.before_staging()  # host work, before a graph is chosen by the index's shape
        slot = self._replay_staged(given, group, step)
        if slot is None:
            with label("## check_batch ##"):
                staged = self.layout.put(given)
            with label("## group.prefetch ##"):
                outputs = (staged, *self._stage_device(staged, group, step))
        else:
            outputs = _trimmed(slot.outputs, given.values.numel(), step)
        record = StagedRecord(group, step, slot, outputs, stream, deferred=defer)
        read = outputs[-1]
        if defer and stream is not None:
            record.host = self._read_buffer(read)
            record.host.copy_(read, non_blocking=True)
            record.done = torch.cuda.Event()
            record.done.record(stream)
        return record


    def finish(self, record: StagedRecord) -> InFlightBatch:
        """The host half of a staged prefetch: its read, then the insertion. The probe changed
        nothing unless the checks passed, so a bad batch raises here with no state changed."""
        staged, pending, sources, backward, read = record.outputs
        group, slot, stream = record.group, record.slot, record.stream
        try:
            if len(self.tiers) == 1:  # its host work that waits for no value of the read, before it
                self.tiers[0].arm(pending, read[staged.summary.numel()])
            with label("## group.prefetch ##"):
                if record.done is not None:
                    record.done.synchronize()
                host = (read if record.host is None else record.host).tolist()
                if record.done is not None:  # its copy is done and read: the next one may take it
                    self._read_buffers.append(record.host)
            checks = staged.summary.numel()
            grouped = pending.grouped if group is None else None
            batch = self.layout.finish(staged, host[:checks], grouped)  # raises on a bad batch
            self.of.clock_to(record.step)
            if group is None:
                with label("## group.prefetch ##"):
                    groups = self._finish_all(pending, batch, host[checks:])
                return InFlightBatch(batch, groups, True, stream=stream, graph_slot=slot)
            looked, looked_at = None, self.of.rows_changed()
            if self.of.may_look_early(stream) and pending.id_values is not None and \
                    group.every_pair_found(host[checks:]):
                looked = self.of.lookup(group.store, pending.id_values, batch.groups[0], sources[1])
            with label("## group.prefetch ##"):
                gpf = group.finish_prefetch(pending, host[checks:], batch.groups[0].ids_per_table)
        except BaseException:  # a bad batch, a failing insertion: the slot holds no batch
            if len(self.tiers) == 1:
                self.tiers[0].disarm()
            if slot is not None:
                self.captured.release(slot, stream)
            raise
        gpf.sorted_ids.sources, gpf.sorted_ids.scales, gpf.sorted_ids.plan = backward
        return InFlightBatch(batch, [gpf], True, stream=stream, grad_sources=[sources], graph_slot=slot,
                                  looked=looked, looked_at=looked_at)


    def _read_buffer(self, read: torch.Tensor) -> torch.Tensor:
        """Pinned host memory for a deferred read of ``read``'s size: one kept from an earlier read
        (allocated once, DESIGN section 4 rule 2), or a new one."""
        for k, buffer in enumerate(self._read_buffers):
            if buffer.shape == read.shape:
                return self._read_buffers.pop(k)
        return torch.empty(read.shape, dtype=read.dtype, pin_memory=True)


    def _replay_staged(self, given: BatchInput, group: DeviceTier | None, step: int) -> Slot | None:
        """The device half of a staged prefetch replayed from a CUDA graph of the batch's shape, or
        of its shape padded to a bucket of ids (batches whose id count changes every step); None:
        run it eagerly (capture off, a shape seen once, every slot of it in flight)."""
        n = given.values.numel()
        if self.captured is None or n == 0:
            return None
        indexes = tuple(g.capture_key() for g in (self.tiers if group is None else [group]))
        shape = (tuple(given.keys), given.batch_size, given.weights is not None, indexes)

        def stage(*static):
            return self._captured_stage(given, group, *static)

        return self.captured.acquire_batch(shape, stage, given.values, given.per_feature, given.weights, step,
                                           capture=self.of.may_capture())


    def _stage_device(self, staged: StagedBatch, group: DeviceTier | None, step: int | torch.Tensor,
                      id_count: torch.Tensor | None = None):
        """The device half of a staged prefetch: (the group's ``StagedPrefetch``, the backward's
        gradient sources and scales, the same in the dedup's order and the reduction's plan, the int64
        tensor to read: the checks' summary and the probe's counts). ``id_count``: the batch's ids
        (int64 () on the device), the rest padding. ``group`` None: every group (``_stage_all``)."""
        if group is None:
            return self._stage_all(staged, step, id_count)
        pending, info = group.stage_prefetch(staged.values, staged.tables, step, staged.guard(),
                                             id_count=id_count)
        # the backward's work that needs only the batch, queued before the read
        sources = self.of.grad_sources(0, staged.first_group())
        src, scale = sources
        backward = (src[pending.order], None if scale is None else scale[pending.order],
                    self.kernels.reduce_plan(pending.counts, info[0]))
        return pending, sources, backward, torch.cat([staged.summary, *info])


    def _stage_all(self, staged: StagedBatch, step: int | torch.Tensor, id_count: torch.Tensor | None):
        """``_stage_device`` of every group at once: one dedup of the batch's ids, whose sort key has
        the table (numbered across the groups) on top, so it orders them group by group; each group's
        probe of its own pairs among them into one pair of outputs; then, still on the device, the
        ids laid out group by group and every index renumbered within its group, and each group's
        reduction plan, so that the host half only slices."""
        kernels, n, layout = self.kernels, staged.values.numel(), self.layout
        with label("## dedup ##"):
            order, skeys, stables = kernels.id_order(staged.values, staged.tables, self.of.num_tables,
                                                     id_count)
            keys, tables, inverse, counts, count = kernels.sorted_runs_padded(skeys, stables, order, id_count)
        out = torch.empty(2, n, dtype=torch.int64, device=self.device).unbind(0)
        per_region, read = [], [staged.summary, count]
        with label("## resolve ##"):
            for group, first in zip(self.tiers, layout.first_table):
                per_region.append(group.stage_probe(keys, tables, step, counts, count, staged.guard(), first,
                                                    out))
                read += [per_region[-1], group.index.sizes_on_device]
                if group.below_reads:  # its pairs alone, numbered within it
                    mine = (tables >= first) & (tables < first + len(group.configs))
                    read += group.stage_below(torch.where(mine, keys, RESERVED_KEY),
                                              torch.where(mine, tables - first, 0), out[0], count)
        with label("## group.prefetch ##"):
            # each group's pairs come together, group by group: the first pair of each
            pairs = torch.stack([p[len(g.configs) : 2 * len(g.configs)].sum()
                                 for g, p in zip(self.tiers, per_region)])
            pair_starts = pairs.cumsum(0) - pairs
            ids, id_tables, weights, inverse, id_values, order, tables = kernels.regroup_ids(
                layout.group_shifts(staged, pair_starts), staged.values, staged.tables, staged.weights,
                inverse, out[1], order, tables, layout.table_first_dev, count)
            arange = torch.arange(n, device=self.device)
            plans = [kernels.reduce_plan(counts[(start + arange).clamp_(max=n - 1)], pairs[g : g + 1])
                     for g, start in enumerate(pair_starts)]
            grouped = GroupMajor(ids, id_tables, weights, *layout.group_bags(staged))
            pending = StagedAll(keys, tables, inverse, counts, order, *out, id_values, grouped, per_region,
                                 plans, step)
        return pending, None, None, torch.cat(read)


    def _finish_all(self, pending: StagedAll, batch: Batch, info: list[int]) -> list[GroupPrefetch]:
        """The host half of ``_stage_all`` (``info``: the host copy of its read after the checks):
        each group finishes its slice of the pairs and ids as if it had been staged alone."""
        groups, pairs, ids, at = [], 0, 0, 1
        for g, (group, gb) in enumerate(zip(self.tiers, batch.groups)):
            r = len(group.configs)
            misses, present, contested, sizes = (info[at + i * r : at + (i + 1) * r] for i in range(4))
            below = info[at + 4 * r : at + 4 * r + group.below_reads]
            at += 4 * r + group.below_reads
            u, m = sum(present), gb.ids.numel()
            mine, its = slice(pairs, pairs + u), slice(ids, ids + m)
            part = StagedPrefetch(pending.keys[mine], pending.tables[mine], pending.inverse[its],
                                  pending.counts[mine], pending.order[its], pending.slots[mine],
                                  pending.values[mine], pending.per_region[g], pending.step,
                                  pending.id_values[its])
            gpf = group.finish_prefetch(part, [u, *misses, *sizes, *contested, *below], gb.ids_per_table)
            gpf.sorted_ids.plan = pending.plans[g]
            groups.append(gpf)
            pairs, ids = pairs + u, ids + m
        if pairs != info[0]:
            raise RuntimeError(f"internal error: the groups' probes found {pairs} distinct pairs, the dedup "
                               f"{info[0]}")
        return groups


    def _captured_stage(self, given: BatchInput, group: DeviceTier | None, values: torch.Tensor,
                        per_feature: torch.Tensor, weights: torch.Tensor | None, step: torch.Tensor,
                        id_count: torch.Tensor | None):
        """What ``_stage`` runs eagerly, over a CUDA graph's static inputs; ``id_count``: the
        batch fills only that many of the static ids (and weights), the rest becomes padding."""
        staged = self.layout.stage_padded(given, values, per_feature, weights, id_count)
        return (staged, *self._stage_device(staged, group, step, id_count))


def _trimmed(outputs: tuple, n: int, step: int) -> tuple:
    """A replayed staged prefetch's outputs for a batch of n ids (a padded graph's are longer), with
    the host's step: (staged batch, staged prefetch, gradient sources, the backward's, the read)."""
    staged, pending, sources, backward, read = outputs

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:n]

    staged = staged.cut(n)
    if isinstance(pending, StagedAll):
        pending = dataclasses.replace(pending, step=step, inverse=cut(pending.inverse),
                                      order=cut(pending.order), id_values=cut(pending.id_values),
                                      grouped=pending.grouped.cut(n))
        return staged, pending, None, None, read
    pending = pending.cut(n, step)
    (src, scale), (src_sorted, scale_sorted, plan) = sources, backward
    return staged, pending, (cut(src), cut(scale)), (cut(src_sorted), cut(scale_sorted), plan), read
