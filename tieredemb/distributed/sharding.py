"""Row-wise sharding of a collection's tables over a process group (TorchRec's ``ShardedModule``
stages: ``input_dist``, ``compute``, ``output_dist``).

Each rank's tiers hold the keys it owns (``owner_of``: a hash of table and key). A step, per group:

    input_dist   this rank's distinct (table, key) pairs with their counts go to their owners (an
                 all-to-all of split sizes, then of the pairs); each owner resolves what it received
                 like a local batch (insert, fetch, lock)
    compute      the owner gathers the rows of the pairs it received
    output_dist  the rows go back to the ranks that asked (one all-to-all); the requester pools or
                 gathers them for its ids
    grad_dist    in the backward: the requester sums its gradients per distinct pair and sends them
                 to the owners (one all-to-all); each owner applies the fused update

The input dist's two device halves (the requester's checks, dedup and route counts; the owner's
dedup and probe of what it received) are replayed from CUDA graphs where the collection captures
(``capture_with``), each followed by its one host read. The unsharded placement
(``tieredemb.modules.placement.LocalPlacement``) has the same verbs; the sharded collection is
tested equal to it (``tests/distributed``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from tieredemb.distributed import (
    Route,
    RouteCounts,
    count_route,
    exchange,
    owner_of,
    plan,
    read_route,
    route,
    table_salts,
)
from tieredemb.keys import keep_where
from tieredemb.modules.batch import Batch, BatchInput, GroupBatch, Layout, StagedBatch
from tieredemb.modules.placement import resolve_eagerly
from tieredemb.ops.capture import CapturedStages, Slot, padded_size
from tieredemb.ops.reference import orders_by_table
from tieredemb.profiling import label
from tieredemb.storage.host import last_of_duplicates
from tieredemb.storage.row_store import RowStore
from tieredemb.storage.tiers.device import DeviceTier
from tieredemb.storage.tiers.parts import (
    GroupPrefetch,
    IdOrder,
    StagedPrefetch,
    TableRows,
    TableStats,
    unique_pairs,
)


class DistinctPairs(NamedTuple):
    """A group's distinct (key, table) pairs of a batch: keys, tables, ``inverse`` (n,) id -> pair,
    ``counts`` the ids of each, the ids' order (``unique_pairs``' tuple)."""

    keys: torch.Tensor
    tables: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    sorted_ids: IdOrder | None


@dataclass
class ShardedPrefetch:
    """A group of a batch after input dist. Requester side: this rank's distinct pairs
    (``unique_keys`` (u,)), ``inverse`` (n,) id -> pair, ``send_order`` (u,) the pairs in owner
    order (None: they are in it), the split sizes of the exchange; owner side: ``served``, what
    this rank resolved for the pairs it received (its ``inverse`` maps each received pair to the
    owner's distinct pairs)."""

    unique_keys: torch.Tensor
    inverse: torch.Tensor
    send_order: torch.Tensor | None
    send_splits: list[int]
    recv_splits: list[int]
    served: GroupPrefetch
    sorted_ids: IdOrder | None = None
    # the CUDA graphs whose outputs the part holds until the batch's release: (their stages, slot)
    held: list[tuple[CapturedStages, Slot]] = field(default_factory=list)


@dataclass
class Requested:
    """A requester's device half of one group's input dist (``RowWiseSharding._request``): the batch
    as staged (None where it was staged apart), its distinct pairs padded to its ids (the real ones
    first, as the route sends them), each id's pair, the ids' order by pair, the route's counts."""

    staged: StagedBatch | None
    keys: torch.Tensor
    tables: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    order: torch.Tensor
    route: RouteCounts
    plan: tuple | None  # the backward's reduction per pair (``reduce_plan``)

    def cut(self, n: int) -> Requested:
        """A replayed capture's (padded to a bucket of ids) for a batch of n ids."""
        return dataclasses.replace(self, staged=self.staged.cut(n), inverse=self.inverse[:n],
                                   order=self.order[:n])


class RowWiseSharding:
    """The placement of a collection whose tables are sharded row-wise over ``process_group``.

    Args:
        tiers: this rank's tier of each table group (its shard).
        kernels: the collection's kernel set.
        device: the compute device (NCCL exchanges CUDA tensors, gloo CPU ones).
        process_group: the group the tables are sharded over; every rank runs the same steps.
    """

    def __init__(self, tiers: list[DeviceTier], kernels, device: torch.device, process_group) -> None:
        self.tiers, self.kernels, self.device = tiers, kernels, device
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.salts = [table_salts(t.names, device) for t in tiers]
        self.received = [[0] * len(t.configs) for t in tiers]  # pairs received to serve, per table
        # per group: whether the dedup can sort a batch's ids by (owner, table) (``_routed``)
        self.cells_in_order = [orders_by_table(self.world * len(t.configs)) for t in tiers]
        # the input dist gets a group of its own: a prefetch on the pipeline's thread then never
        # races the forward's and backward's exchanges on one group (each group's collectives keep
        # one order on every rank). Every process of the default group takes part here.
        self.input_group = dist.new_group(dist.get_process_group_ranks(process_group))
        # the device halves of a training step as CUDA graphs (``capture_with``): the requester's, the owner's
        self.requests: CapturedStages | None = None
        self.serves: CapturedStages | None = None
        self.may_capture: Callable[[], bool] = lambda: False

    def capture_with(self, may_capture: Callable[[], bool]) -> None:
        """Replay the device halves of a training batch's input dist from CUDA graphs: the
        requester's (the checks, the dedup, the route's counts; by the batch's shape, or its ids
        padded to a bucket) and the owner's serve of the pairs it received (the dedup, the probe; by
        their count padded to a bucket). A graph is captured only where ``may_capture()`` (the
        thread that runs the forward)."""
        # inputs: values, lengths, weights, a padded batch's ids / the pairs received, step, their count
        self.requests = CapturedStages(self.device, (torch.int64, torch.int64, torch.float32, torch.int64),
                                       what="a shard's request")
        self.serves = CapturedStages(self.device, (torch.int64,) * 3, what="a shard's serve")
        self.may_capture = may_capture

    def release(self, parts: list, stream: torch.cuda.Stream | None) -> None:
        """A batch is done with its parts once ``stream``'s work so far is: their graphs' outputs
        may take another batch."""
        for part in parts:
            _give_back(part.held, stream)

    # ------------------------------------------------------------------------------- the step
    def resolve(self, layout: Layout, given: BatchInput, clock: int, training: bool) -> tuple[Batch, list]:
        """Every rank's checks' verdict travels in the step's first route (group 0's count exchange),
        so a bad batch on any rank raises on every rank before any of them changes anything or waits
        in an exchange the bad rank left. A batch of one group whose features are the batch's reads
        its verdict with that route (one host read for both; its device half replayed from a CUDA
        graph where one was captured); others read it first (``resolve_eagerly``; a bad one is
        ``refuse``d)."""
        if len(self.tiers) == 1 and given.order.identity[0] and given.values.numel() > 0:
            n = given.values.numel()
            slot = self._replay_request(layout, given)
            if slot is None:
                with label("## check_batch ##"):
                    staged = layout.put(given)
                with label("## group.prefetch ##"):
                    requested = self._request_checked(staged)
            else:
                requested = slot.outputs.cut(n)
            held = [] if slot is None else [(self.requests, slot)]
            try:
                with label("## group.prefetch ##"):
                    way, pairs = self._read(0, requested, n)
                batch = layout.finish(requested.staged, way.extra)  # this rank's bad batch raises here
                self._check_peers(way)
                with label("## group.prefetch ##"):
                    part = self._served_part(0, way, pairs, clock, training)
            except BaseException:  # the graph holds no batch
                _give_back(held, None)
                raise
            part.held = held + part.held
            return batch, [part]
        return resolve_eagerly(self, layout, given, clock, training)

    def _request_checked(self, staged: StagedBatch, id_count: torch.Tensor | None = None) -> Requested:
        """``_request`` of a staged batch of one group whose features are the batch's, with its
        checks' verdict and summary read along."""
        failed = (staged.guard() != 0).any().to(torch.int64)
        requested = self._request(0, staged.values, staged.tables, id_count, verdict=failed,
                                  extra=staged.summary)
        requested.staged = staged
        return requested

    def _replay_request(self, layout: Layout, given: BatchInput) -> Slot | None:
        """A batch's ``layout.stage_padded`` and ``_request_checked`` replayed from a CUDA graph of
        its shape, or of its shape padded to a bucket of ids; None: run them eagerly (capture off, a
        shape seen once, its slots in flight)."""
        if self.requests is None:
            return None
        shape = (tuple(given.keys), given.batch_size, given.weights is not None)

        def stage(values, per_feature, weights, id_count):
            return self._request_checked(layout.stage_padded(given, values, per_feature, weights, id_count),
                                         id_count)

        return self.requests.acquire_batch(shape, stage, given.values, given.per_feature, given.weights,
                                           capture=self.may_capture())

    def refuse(self) -> None:
        """This rank's batch failed its checks: an empty route of group 0 carries its verdict, so the
        other ranks raise at their step's first route too."""
        none = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._route_pairs(0, none, none, none, verdict=torch.ones(1, dtype=torch.int64, device=self.device))

    def input_dist(self, g: int, gb: GroupBatch, clock: int, training: bool) -> ShardedPrefetch:
        """Group g's ids to their owners; this rank resolves the pairs it received. The batch's
        distinct pairs are counted on the device and read with the route's split sizes (one host
        read for both). Group 0's route carries every rank's verdict of its checks (this rank's
        passed): a bad batch elsewhere raises here, before anything changes."""
        along = {"verdict": torch.zeros(1, dtype=torch.int64, device=self.device)} if g == 0 else {}
        if gb.ids.numel() == 0:
            pairs = DistinctPairs(*unique_pairs(gb.ids, gb.tables, len(self.tiers[g].configs), self.kernels))
            way = self._route_pairs(g, pairs.keys, pairs.tables, pairs.counts, **along)
        else:
            way, pairs = self._routed(g, gb.ids, gb.tables, **along)
        self._check_peers(way)
        return self._served_part(g, way, pairs, clock, training)

    @staticmethod
    def _check_peers(way: Route) -> None:
        """Raise where the route carried another rank's failed verdict (``way.verdicts``)."""
        bad = [r for r, v in enumerate(way.verdicts) if v]
        if bad:
            raise ValueError(f"the batch of rank {bad[0]} failed its checks (that rank raised the reason): "
                             f"this step's batch is refused on every rank, nothing changed")

    def _routed(self, g: int, ids: torch.Tensor, tables: torch.Tensor,
                **along) -> tuple[Route, DistinctPairs]:
        """Group g's distinct pairs of a batch's n > 0 ids and their route, one host read for both
        (``along``: ``route``'s ``verdict`` and ``extra``)."""
        return self._read(g, self._request(g, ids, tables, **along), ids.numel())

    def _request(self, g: int, ids: torch.Tensor, tables: torch.Tensor, id_count: torch.Tensor | None = None,
                 **along) -> Requested:
        """The device half of ``_routed`` (a CUDA graph may hold it; ``id_count``: int64 () where
        only that many ids are the batch's, the rest padding). The dedup sorts the ids by (owner,
        table) on top of its own key (each id's table given as its cell ``owner * t + table``), so
        its pairs come in the order the exchanges send them: neither they, the rows coming back nor
        the gradients going out are reordered."""
        t = len(self.tiers[g].configs)
        in_order = self.cells_in_order[g]  # (else over 2**16 cells: the route reorders the pairs)
        if in_order and self.world > 1:
            tables = owner_of(ids, self.salts[g][tables], self.world) * t + tables
        order, skeys, scells = self.kernels.id_order(ids, tables, self.world * t if in_order else t, id_count)
        keys, ucells, inverse, counts, count = self.kernels.sorted_runs_padded(skeys, scells, order, id_count)
        real = torch.arange(keys.numel(), device=keys.device) < count
        ucells = torch.where(real, ucells, 0)  # (past the count unspecified: no table out of range)
        if in_order:
            tables, owner = ucells % t, ucells // t
        else:
            tables, owner = ucells, owner_of(keys, self.salts[g][ucells], self.world)
        counted = count_route(owner, tables, counts, t, self.world, count, in_order=in_order, **along)
        plan = self.kernels.reduce_plan(counts, count)
        return Requested(None, keys, tables, inverse, counts, order, counted, plan)

    def _read(self, g: int, requested: Requested, n: int) -> tuple[Route, DistinctPairs]:
        """``_request``'s route exchanged and read (one host read), and its first n ids' distinct
        pairs (as many as the route sends)."""
        way = read_route(requested.route, len(self.tiers[g].configs), self.world, self.input_group)
        u = sum(way.send_splits)  # (every real pair goes to one rank)
        keys, tables, counts = requested.keys[:u], requested.tables[:u], requested.counts[:u]
        order = IdOrder(requested.order[:n], counts, plan=requested.plan)
        return way, DistinctPairs(keys, tables, requested.inverse[:n], counts, order)

    def _route_pairs(self, g: int, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                     **along) -> Route:
        """The route of group g's distinct pairs to their owners (``route``; ``along``: its
        ``verdict``)."""
        owner = owner_of(keys, self.salts[g][tables], self.world)
        return route(owner, tables, counts, len(self.tiers[g].configs), self.world, self.input_group, **along)

    def _served_part(self, g: int, way: Route, pairs: DistinctPairs, clock: int,
                     training: bool) -> ShardedPrefetch:
        """The routed pairs sent; this rank resolves those it received."""
        got = self.send_routed(g, way, pairs.keys, pairs.tables, pairs.counts)
        served, held = self._serve(self.tiers[g], got, way.ids_per_table, clock, training)
        return ShardedPrefetch(pairs.keys, pairs.inverse, way.order, way.send_splits, way.recv_splits, served,
                               pairs.sorted_ids, held)

    def _serve(self, tier: DeviceTier, got: torch.Tensor, ids_per_table: list[int], clock: int,
               training: bool) -> tuple[GroupPrefetch, list]:
        """The pairs this rank received (``got``: int64 (r, 3), each pair's key, table and the
        count of ids it stands for) resolved like a local batch: a training batch of a tier that
        stages its prefetch in one host read (the dedup of the pairs several ranks sent, the probe,
        the insertion's counts together), as the local step does, its device half replayed from a
        CUDA graph where one was captured (returned, as a part's ``held``: the batch holds it until
        its release); else ``prefetch`` (a read for the dedup, one for the probe)."""
        if not training or not tier.can_stage():
            keys, tables, counts = (got[:, i].contiguous() for i in range(3))
            return tier.prefetch(keys, tables, ids_per_table, clock, training, occurrences=counts), []
        tier.before_staging()
        slot = self._replay_serve(tier, got, clock)
        if slot is None:
            staged, read, plan = _stage_serve(tier, got, clock)
        else:
            staged, read, plan = slot.outputs
            staged = staged.cut(got.shape[0], clock)
        held = [] if slot is None else [(self.serves, slot)]
        try:
            served = tier.finish_prefetch(staged, read.tolist(), ids_per_table)  # (the one host read)
        except BaseException:  # a failing insertion: the slot holds no batch
            _give_back(held, None)
            raise
        # the update's reduction: each entry served is its own gradient's source (``grad_dist``)
        served.sorted_ids.sources, served.sorted_ids.plan = staged.order, plan
        return served, held

    def _replay_serve(self, tier: DeviceTier, got: torch.Tensor, clock: int) -> Slot | None:
        """``_stage_serve`` replayed from a CUDA graph of the pairs' count padded to a bucket; None:
        run it eagerly (capture off, a bucket seen once, its slots in flight)."""
        r = got.shape[0]
        if self.serves is None or r == 0:
            return None
        bucket = padded_size(r)
        key = ("serve", id(tier), tier.capture_key(), bucket)
        return self.serves.acquire(key, partial(_stage_serve, tier), got, clock, r, lengths=(bucket,),
                                   capture=self.may_capture())

    def send_pairs(self, g: int, keys: torch.Tensor, tables: torch.Tensor,
                   counts: torch.Tensor) -> tuple[Route, torch.Tensor]:
        """Distinct pairs of group g (keys, tables, counts: int64 (u,)) to their owners, counted in
        this rank's load: (their route, int64 (r, 3) the (key, table, count) triples received)."""
        way = self._route_pairs(g, keys, tables, counts)
        return way, self.send_routed(g, way, keys, tables, counts)

    def send_routed(self, g: int, way: Route, keys: torch.Tensor, tables: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
        """Group g's pairs sent as ``way`` routes them, counted in this rank's load: int64 (r, 3) the
        (key, table, count) triples received."""
        pairs = _in_order(torch.stack([keys, tables, counts], dim=1), way.order)
        got = exchange(pairs, way.send_splits, way.recv_splits, self.input_group)
        self.received[g] = [a + b for a, b in zip(self.received[g], way.pairs_per_table)]
        return got

    def served(self, part: ShardedPrefetch) -> GroupPrefetch:
        return part.served

    def compute(self, g: int, part: ShardedPrefetch) -> torch.Tensor:
        """(r, D) in the rows' dtype: the rows of the pairs this rank received, in the order received
        (16-bit rows travel as they are stored: half the bytes; the requester pools in float32)."""
        tier = self.tiers[g]
        return self.kernels.gather(tier.store, part.served.addresses_by_id(), tier.dim, dtype=tier.dtype)

    def output_dist(self, g: int, part: ShardedPrefetch, rows: torch.Tensor) -> tuple[RowStore, torch.Tensor]:
        """The rows back to the ranks that asked: this rank's distinct pairs' rows (a row store over
        them) and int64 (n,) the row of each of its ids."""
        back = exchange(rows, part.recv_splits, part.send_splits, self.group)
        if part.send_order is None:  # (the pairs were sent in their own order)
            return RowStore.over(back), part.inverse
        mine = torch.empty_like(back)
        mine[part.send_order] = back
        return RowStore.over(mine), part.inverse

    def output(self, g: int, part: ShardedPrefetch) -> tuple[RowStore, torch.Tensor]:
        return self.output_dist(g, part, self.compute(g, part))

    def absent_grad(self, g: int, rows: int) -> torch.Tensor:
        """A group whose output got no gradient still takes part in the exchange: zeros."""
        return torch.zeros(rows, self.tiers[g].dim, device=self.device)

    def grad_dist(self, g: int, part: ShardedPrefetch, grad: torch.Tensor, src: torch.Tensor,
                  scale: torch.Tensor | None):
        """This rank's gradients summed per distinct pair, sent to the owners: (the gradients this
        rank received, one per received pair, their sources, no scale, the part it serves)."""
        reduced = self.kernels.reduce_grads(grad.contiguous(), src, scale, part.inverse,
                                            part.unique_keys.numel(), part.sorted_ids)
        got = exchange(_in_order(reduced, part.send_order), part.send_splits, part.recv_splits, self.group)
        return got, torch.arange(got.shape[0], device=self.device), None, part.served

    # ------------------------------------------------------------------------ rows by key
    def _route(self, g: int, i: int, keys: torch.Tensor):
        """Send ``keys`` of table i of group g to their owners (a collective). Returns (the keys by
        owner, send and receive split sizes, the keys this rank received)."""
        owner = owner_of(keys, self.salts[g][i].expand(keys.numel()), self.world)
        order, send, recv = plan(owner, self.world, self.group)
        return order, send, recv, exchange(keys[order], send, recv, self.group)

    def read(self, g: int, i: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A collective: each rank's keys answered by their owners."""
        order, send, recv, rkeys = self._route(g, i, keys)
        weights, found = self.tiers[g].read(i, rkeys)
        back = exchange(torch.cat([weights, found[:, None].to(weights.dtype)], 1), recv, send, self.group)
        out = torch.empty_like(back)
        out[order] = back
        return out[:, :-1], out[:, -1] > 0.5

    def write(self, g: int, i: int, keys: torch.Tensor, weights: torch.Tensor, clock: int) -> None:
        """A collective: the rows go to their owners; a key two ranks write keeps the later rank's."""
        order, send, recv, keys = self._route(g, i, keys)
        weights = exchange(weights[order], send, recv, self.group)
        last = last_of_duplicates(keys)
        self.tiers[g].write(i, keys[last], weights[last], clock)

    def import_rows(self, g: int, i: int, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor,
                    admission: bool) -> None:
        """A collective: each saved row (or admission count, in ``scores``) to its owner; a key two
        ranks give keeps the later rank's (as ``write``), so the owner stores it once."""
        order, send, recv, keys = self._route(g, i, keys)
        rows = exchange(rows[order], send, recv, self.group)
        scores = exchange(scores[order], send, recv, self.group)
        last = last_of_duplicates(keys)
        keys, rows, scores = keys[last], rows[last], scores[last]
        if admission:
            self.tiers[g].import_admission(i, keys, scores)
        else:
            self.tiers[g].import_rows(i, keys, rows, scores)

    def delete_rows(self, g: int, i: int, keys: torch.Tensor) -> None:
        _, _, _, keys = self._route(g, i, keys)
        self.tiers[g].delete_rows(i, keys)

    def to_owners(self, g: int, i: int, keys: torch.Tensor,
                  payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A collective: ``keys`` of table i of group g, each with its ``payload`` (int64 (n,)), to
        their owners; the keys this rank owns, from every rank, and their payloads."""
        order, send, recv, keys = self._route(g, i, keys)
        return keys, exchange(payload[order], send, recv, self.group)

    def read_ahead(self, g: int, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """The pairs this rank owns read ahead into its host tier; no collective (a read ahead is a
        hint: the keys other ranks own are left to their own misses)."""
        keys, tables = keys.to(self.device), tables.to(self.device)
        mine = owner_of(keys, self.salts[g][tables], self.world) == self.rank
        self.tiers[g].read_ahead(*keep_where(mine, keys, tables))

    def export(self, g: int, i: int) -> TableRows:
        """The rows this rank owns."""
        return self.tiers[g].export(i)

    def export_chunks(self, g: int, i: int, rows: int):
        return self.tiers[g].export_chunks(i, rows)

    def stats(self, g: int, i: int) -> TableStats:
        """This rank's load of table i of group g: its shard's counters and the pairs it received."""
        return dataclasses.replace(self.tiers[g].stats(i), keys_received=self.received[g][i])

    def all_stats(self, mine: dict) -> list[dict]:
        """Every rank's stats (a collective)."""
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        return everyone


def _stage_serve(tier: DeviceTier, got: torch.Tensor, step: int | torch.Tensor,
                 count: torch.Tensor | None = None) -> tuple[StagedPrefetch, torch.Tensor, tuple | None]:
    """The device half of an owner's serve (``DeviceTier.stage_prefetch`` of the pairs received,
    ``got`` int64 (r, 3): key, table, ids), the int64 tensor its host half reads, and the plan of
    the update's reduction (``reduce_plan``). ``count``: int64 () where only that many pairs were
    received, the rest of the buffer padding (a graph of a bucket)."""
    keys, tables, counts = (got[:, i].contiguous() for i in range(3))
    if count is not None:
        real = torch.arange(keys.numel(), device=keys.device) < count
        tables, counts = torch.where(real, tables, 0), torch.where(real, counts, 0)
    guard = torch.zeros(1, dtype=torch.int64, device=keys.device)  # (the requesters checked their ids)
    staged, reads = tier.stage_prefetch(keys, tables, step, guard, id_count=count, occurrences=counts)
    plan = tier.kernels.reduce_plan(staged.entries, reads[0])
    return staged, torch.cat([r.reshape(-1) for r in reads]), plan


def _give_back(held, stream: torch.cuda.Stream | None) -> None:
    """The graphs in ``held`` ((stages, slot) pairs) free for another batch once ``stream`` is past
    here."""
    for stages, slot in held:
        stages.release(slot, stream)


def _in_order(rows: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """``rows`` in a route's ``order`` (None: they are in it already)."""
    return rows if order is None else rows[order]
