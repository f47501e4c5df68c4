"""Row-wise sharding with the hottest rows on every rank (``StorageConfig(replicate_hot=HotRows(...))``).

Row-wise sharding sends each id to its key's owner, so the hot keys of a skewed batch all land on
their owners. Here a fixed set of hot (table, key) pairs is kept by every rank in its own tier (the
owner's copy is its ordinary row). A training step, per group:

    input_dist   this rank's distinct pairs split in two: cold pairs go to their owners as in
                 ``RowWiseSharding``; for hot pairs one all-reduce of a count per hot pair tells
                 every rank which hot pairs the step touches anywhere (and how often). Each rank
                 resolves the cold pairs it received plus every touched hot pair in its own tier
    output       cold rows come back from their owners; hot rows are read from this rank's copy
    grad_dist    cold gradients go to their owners; the hot pairs' gradients, summed per pair on
                 each rank, are summed over the ranks by one all-reduce ((touched hot pairs, D)
                 float32), and every rank applies them in the same fused update as the cold ones:
                 the same rows, step and rounding seeds give the same copies on every rank

An eval batch goes to the owners (their copies are current). ``write``, ``import_rows`` and
``delete_rows`` of a hot key change every rank's copy; ``export`` (and so checkpoints and
``state_dict``) gives each hot row once, from its owner.

With ``HotRows(per_table=n)`` the set is chosen at the training batch after the first ``window``:
each owner counted the occurrences of the keys it received, proposes its most used, and every rank
takes the same n most used of each table; the owners' current rows are copied to the other ranks
at that batch's forward (every earlier batch's backward has run by then).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tieredemb.config import HotRows, TableConfig
from tieredemb.distributed import exchange, exchange_splits, owner_of
from tieredemb.distributed.sharding import RowWiseSharding, ShardedPrefetch
from tieredemb.modules.batch import Batch, BatchInput, GroupBatch, Layout
from tieredemb.modules.placement import resolve_eagerly
from tieredemb.storage.host import last_of_duplicates
from tieredemb.storage.row_store import RowStore
from tieredemb.storage.tiers.device import DeviceTier
from tieredemb.storage.tiers.parts import TableRows, TableStats, unique_pairs


def check_hot_rows(spec: HotRows | None, tables: list[TableConfig], process_group, mode: str) -> None:
    """Refuse a ``replicate_hot`` the collection cannot honour (before anything is built)."""
    if spec is None:
        return
    if process_group is None:
        raise ValueError("StorageConfig(replicate_hot=...) needs a sharded collection (a process_group)")
    for t in tables:
        if t.admission is not None or t.max_capacity is not None:
            raise ValueError(f"StorageConfig(replicate_hot=...): table {t.name!r} has "
                             f"{'admission' if t.admission is not None else 'max_capacity'}, which "
                             "replicated rows do not support")
    if spec.per_table is not None and mode == "cache":
        raise ValueError("StorageConfig(replicate_hot=HotRows(per_table=...)) needs storage mode hbm_direct "
                         "or hybrid (this collection is in cache mode): give HotRows(keys=...) instead")
    by_name = {t.name: t for t in tables}
    for name, keys in (spec.keys or {}).items():
        if name not in by_name:
            raise ValueError(f"replicate_hot.keys: unknown table {name!r} (tables: {sorted(by_name)})")
        n = by_name[name].num_embeddings
        if n is not None and keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= n):
            raise ValueError(f"replicate_hot.keys[{name!r}]: keys out of [0, {n})")


class HotSet:
    """One group's replicated pairs: ``keys``, ``tables`` int64 (H,) device, sorted by (table, key),
    ``owners`` int64 (H,) the rank owning each."""

    def __init__(self, keys: torch.Tensor, tables: torch.Tensor, num_tables: int, salts: torch.Tensor,
                 world: int) -> None:
        order = torch.argsort(keys, stable=True)
        order = order[torch.argsort(tables[order], stable=True)]
        self.keys, self.tables = keys[order], tables[order]
        self.owners = owner_of(self.keys, salts[self.tables], world)
        counts = torch.bincount(self.tables, minlength=num_tables).tolist()
        self.per_table = counts
        self.starts = [sum(counts[:i]) for i in range(num_tables)]

    def __len__(self) -> int:
        return self.keys.numel()

    def position(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """int64 (n,): the index of each (table, key) pair in the set, -1 where it is not hot. Every
        pair searched in each table's keys and kept where its table is that one: no selection, so
        no host read (a table's pairs picked out first would read each count back)."""
        pos = torch.full_like(keys, -1)
        for i, count in enumerate(self.per_table):
            if not count:
                continue
            hot = self.keys[self.starts[i] : self.starts[i] + count]
            at = torch.searchsorted(hot, keys).clamp(max=count - 1)
            pos = torch.where((tables == i) & (hot[at] == keys), self.starts[i] + at, pos)
        return pos

    def of_table(self, i: int) -> torch.Tensor:
        """int64 (h,) the hot keys of table i."""
        return self.keys[self.starts[i] : self.starts[i] + self.per_table[i]]


@dataclass
class HotPart:
    """A training batch's hot pairs in one group. ``cold``: int64 (c,) positions of this rank's cold
    pairs among its distinct pairs (``send_order`` orders them); ``mine`` int64 (m,) positions of
    its hot pairs, ``entry`` int64 (m,) the place of each among the step's touched hot pairs;
    ``received`` cold pairs received (the served entries before the touched hot pairs)."""

    cold: torch.Tensor
    mine: torch.Tensor
    entry: torch.Tensor
    touched: int
    received: int


@dataclass
class ReplicatedPrefetch(ShardedPrefetch):
    hot: HotPart | None = None  # None: no hot pair is served locally (eval, no set yet)


def share(rows: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``rows`` ((n, ...) here) to every rank: their concatenation in rank order."""
    world = dist.get_world_size(group)
    counts = torch.full((world,), rows.shape[0], dtype=torch.int64, device=rows.device)
    recv = exchange_splits(counts, group)
    return exchange(rows.repeat(world, *[1] * (rows.dim() - 1)), counts.tolist(), recv, group)


class ReplicatedRowWiseSharding(RowWiseSharding):
    """``RowWiseSharding`` whose hot pairs every rank keeps and serves itself.

    Args:
        tiers, kernels, device, process_group: as ``RowWiseSharding``.
        spec: the ``te.HotRows`` of the collection's storage.
    """

    def __init__(self, tiers: list[DeviceTier], kernels, device: torch.device, process_group,
                 spec: HotRows) -> None:
        super().__init__(tiers, kernels, device, process_group)
        self.spec = spec
        self.rank = dist.get_rank(process_group)
        none = torch.empty(0, dtype=torch.int64, device=device)
        self.hot = [self._hot_set(g, none, none) for g in range(len(tiers))]
        self.seen = 0  # training batches counted toward the choice
        self.counted: list[list[torch.Tensor]] = [[] for _ in tiers]  # (3, r) keys, tables, counts received
        self.copy_due: int | None = None  # the clock at the choice, until the owners' rows are copied
        if spec.keys is not None:
            self._given(spec.keys)

    def _hot_set(self, g: int, keys: torch.Tensor, tables: torch.Tensor) -> HotSet:
        return HotSet(keys, tables, len(self.tiers[g].configs), self.salts[g], self.world)

    def _given(self, given: dict[str, torch.Tensor]) -> None:
        for g, tier in enumerate(self.tiers):
            parts = [(given[n].to(self.device), i) for i, n in enumerate(tier.names) if n in given]
            keys = torch.cat([k for k, _ in parts]) if parts else torch.empty(0, dtype=torch.int64)
            tables = torch.cat([torch.full_like(k, i) for k, i in parts]) if parts else keys
            mine = torch.stack([keys.to(self.device), tables.to(self.device)])
            if not all(torch.equal(mine, other) for other in _all_ranks(mine, self.group)):
                raise ValueError("replicate_hot.keys differ between ranks: every rank must give the "
                                 "same keys")
            self.hot[g] = self._hot_set(g, keys.to(self.device), tables.to(self.device))

    # ------------------------------------------------------------------------------- the step
    def resolve(self, layout: Layout, given: BatchInput, clock: int, training: bool) -> tuple[Batch, list]:
        """The batch checked first (its own read), then each group's ``input_dist`` (whose routes
        carry no verdict: a bad batch raises on its rank alone)."""
        return resolve_eagerly(self, layout, given, clock, training)

    def refuse(self) -> None:
        """Nothing sent: the other ranks' routes expect no verdict."""

    def input_dist(self, g: int, gb: GroupBatch, clock: int, training: bool) -> ReplicatedPrefetch:
        """Group g's cold pairs to their owners, the touched hot pairs agreed on; this rank resolves
        the cold pairs it received and every touched hot pair."""
        if training and g == 0 and self.spec.per_table is not None:
            self._count_or_choose(clock)
        tier, hot = self.tiers[g], self.hot[g]
        keys, tables, inverse, counts, sorted_ids = unique_pairs(gb.ids, gb.tables, len(tier.configs),
                                                                  self.kernels)
        served_locally = training and len(hot) > 0
        pos = hot.position(keys, tables) if served_locally else torch.full_like(keys, -1)
        cold = (pos < 0).nonzero().squeeze(1)
        way, got = self.send_pairs(g, keys[cold], tables[cold], counts[cold])
        if training and self.counted[g] is not None and self.spec.per_table is not None:
            self.counted[g].append(got)
        lookups = way.ids_per_table
        part = None
        if served_locally:
            mine = torch.nonzero_static(pos >= 0, size=keys.numel() - cold.numel()).squeeze(1)  # (no read)
            own = torch.zeros(len(lookups), dtype=torch.int64, device=self.device)
            own.index_add_(0, tables[mine], counts[mine])  # the ids served here, per table
            touched = torch.zeros(len(hot), dtype=torch.int64, device=self.device)
            touched.index_add_(0, pos[mine], counts[mine])
            dist.all_reduce(touched, group=self.input_group)  # every rank's occurrences of each hot pair
            *own, n_now = torch.cat([own, (touched > 0).sum().view(1)]).tolist()  # one host read
            lookups = [a + b for a, b in zip(lookups, own)]
            now = torch.nonzero_static(touched > 0, size=n_now).squeeze(1)
            place = torch.full_like(touched, -1)
            place[now] = torch.arange(now.numel(), device=self.device)
            part = HotPart(cold, mine, place[pos[mine]], now.numel(), got.shape[0])
            got = torch.cat([got, torch.stack([hot.keys[now], hot.tables[now], touched[now]], dim=1)])
        served, held = self._serve(tier, got, lookups, clock, training)
        return ReplicatedPrefetch(keys, inverse, way.order, way.send_splits, way.recv_splits, served,
                                  sorted_ids, held, hot=part)

    def output(self, g: int, part: ReplicatedPrefetch) -> tuple[RowStore, torch.Tensor]:
        if part.hot is None:
            return super().output(g, part)
        if self.copy_due is not None:
            self._copy_from_owners()
        h = part.hot
        rows = self.compute(g, part)  # (received + touched, D): the cold rows asked of this rank, the hot
        back = exchange(rows[: h.received], part.recv_splits, part.send_splits, self.group)
        mine = rows.new_empty(part.unique_keys.numel(), rows.shape[1])
        mine[h.cold[part.send_order]] = back
        mine[h.mine] = rows[h.received + h.entry]
        return RowStore.over(mine), part.inverse

    def grad_dist(self, g: int, part: ReplicatedPrefetch, grad: torch.Tensor, src: torch.Tensor,
                  scale: torch.Tensor | None):
        """Cold gradients to their owners; the hot ones summed over the ranks (an all-reduce):
        (the gradients this rank applies, one per served entry, their sources, no scale, the part)."""
        if part.hot is None:
            return super().grad_dist(g, part, grad, src, scale)
        h = part.hot
        reduced = self.kernels.reduce_grads(grad.contiguous(), src, scale, part.inverse,
                                            part.unique_keys.numel(), part.sorted_ids)
        got = exchange(reduced[h.cold[part.send_order]], part.send_splits, part.recv_splits, self.group)
        summed = reduced.new_zeros(h.touched, reduced.shape[1])
        summed[h.entry] = reduced[h.mine]
        dist.all_reduce(summed, group=self.group)
        grads = torch.cat([got, summed])
        return grads, torch.arange(grads.shape[0], device=self.device), None, part.served

    # ------------------------------------------------------------------- choosing the set
    def _count_or_choose(self, clock: int) -> None:
        """Count one more training batch; after ``window`` of them, choose the set (a collective)."""
        if self.counted[0] is None:
            return
        if self.seen < self.spec.window:
            self.seen += 1
            return
        for g in range(len(self.tiers)):
            keys, tables = self._choose(g)
            self.hot[g] = self._hot_set(g, keys, tables)
        self.counted = [None] * len(self.tiers)
        self.copy_due = clock

    def _choose(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``per_table`` most used keys of each table of group g over every rank's counts."""
        got = self.counted[g]
        pairs = torch.cat(got) if got else torch.empty(0, 3, dtype=torch.int64, device=self.device)
        n, tables = self.spec.per_table, range(len(self.tiers[g].configs))
        mine = [_most_used(pairs[pairs[:, 1] == i], n) for i in tables]
        everyone = share(torch.cat(mine), self.input_group)  # owners' keys are disjoint
        chosen = [_most_used(everyone[everyone[:, 1] == i], n) for i in tables]
        chosen = torch.cat(chosen)
        return chosen[:, 0].contiguous(), chosen[:, 1].contiguous()

    def _copy_from_owners(self) -> None:
        """Every hot row (weights and optimizer state) from its owner to the other ranks' tiers."""
        clock, self.copy_due = self.copy_due, None
        for g, tier in enumerate(self.tiers):
            for i in range(len(tier.configs)):
                keys = self.hot[g].of_table(i)
                owned = keys[owner_of(keys, self.salts[g][i].expand(keys.numel()), self.world) == self.rank]
                rows, found = tier.read(i, owned, cols=tier.width)
                keys, rows = share(owned[found], self.group), share(rows[found], self.group)
                others = owner_of(keys, self.salts[g][i].expand(keys.numel()), self.world) != self.rank
                keys, rows = keys[others], rows[others]
                tier.import_rows(i, keys, rows, torch.full_like(keys, clock))

    # ------------------------------------------------------------------------ rows by key
    def _hot_of(self, g: int, i: int, keys: torch.Tensor) -> torch.Tensor | None:
        """bool (n,) which of ``keys`` of table i are hot; None when the table has no hot key (the
        same answer on every rank)."""
        if not self.hot[g].per_table[i]:
            return None
        return self.hot[g].position(keys, torch.full_like(keys, i)) >= 0

    def write(self, g: int, i: int, keys: torch.Tensor, weights: torch.Tensor, clock: int) -> None:
        """A collective: cold rows to their owners, hot rows to every rank (the later rank's wins)."""
        hot = self._hot_of(g, i, keys)
        if hot is None:
            return super().write(g, i, keys, weights, clock)
        super().write(g, i, keys[~hot], weights[~hot], clock)
        keys, weights = share(keys[hot], self.group), share(weights[hot], self.group)
        last = last_of_duplicates(keys)
        self.tiers[g].write(i, keys[last], weights[last], clock)

    def import_rows(self, g: int, i: int, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor,
                    admission: bool) -> None:
        hot = self._hot_of(g, i, keys)
        if hot is None:
            return super().import_rows(g, i, keys, rows, scores, admission)
        super().import_rows(g, i, keys[~hot], rows[~hot], scores[~hot], admission)
        keys, rows, scores = (share(x[hot], self.group) for x in (keys, rows, scores))
        last = last_of_duplicates(keys)
        self.tiers[g].import_rows(i, keys[last], rows[last], scores[last])

    def delete_rows(self, g: int, i: int, keys: torch.Tensor) -> None:
        hot = self._hot_of(g, i, keys)
        if hot is None:
            return super().delete_rows(g, i, keys)
        super().delete_rows(g, i, keys[~hot])
        self.tiers[g].delete_rows(i, torch.unique(share(keys[hot], self.group)))

    def _copies(self, g: int, i: int, keys: torch.Tensor) -> torch.Tensor:
        """bool (n,): which of this rank's stored ``keys`` of table i are copies of another rank's rows."""
        hot = self._hot_of(g, i, keys)
        if hot is None:
            return torch.zeros_like(keys, dtype=torch.bool)
        return hot & (owner_of(keys, self.salts[g][i].expand(keys.numel()), self.world) != self.rank)

    def export(self, g: int, i: int) -> TableRows:
        """The rows this rank owns (its copies of other ranks' hot rows left out)."""
        rows = self.tiers[g].export(i)
        keep = ~self._copies(g, i, rows.keys)
        return TableRows(rows.keys[keep], rows.weights[keep], rows.optimizer_state[keep], rows.scores[keep])

    def export_chunks(self, g: int, i: int, rows: int):
        for keys, full, scores in self.tiers[g].export_chunks(i, rows):
            keep = ~self._copies(g, i, keys)
            yield keys[keep], full[keep], scores[keep]

    def stats(self, g: int, i: int) -> TableStats:
        return dataclasses.replace(super().stats(g, i), replicated=self.hot[g].per_table[i])


def _most_used(pairs: torch.Tensor, n: int) -> torch.Tensor:
    """(at most n, 3) of ``pairs`` ((m, 3) key, table, count; one table) summed per key, the most
    used first, ties by key: the same answer on every rank for the same pairs."""
    if not pairs.shape[0]:
        return pairs
    keys, inverse = torch.unique(pairs[:, 0], return_inverse=True)  # sorted by key
    counts = torch.zeros_like(keys).index_add_(0, inverse, pairs[:, 2])
    top = torch.argsort(-counts, stable=True)[:n]
    return torch.stack([keys[top], torch.full_like(keys[top], int(pairs[0, 1])), counts[top]], dim=1)


def _all_ranks(t: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``t`` (any shape; ranks' shapes may differ)."""
    objs = [None] * dist.get_world_size(group)
    dist.all_gather_object(objs, t.cpu(), group=group)
    return [o.to(t.device) for o in objs]


def sharded_placement(tiers: list[DeviceTier], kernels, device: torch.device, process_group,
                      spec: HotRows | None) -> RowWiseSharding:
    """The placement of a sharded collection: with hot rows on every rank or not."""
    if spec is None:
        return RowWiseSharding(tiers, kernels, device, process_group)
    return ReplicatedRowWiseSharding(tiers, kernels, device, process_group, spec)


__all__ = ["HotSet", "ReplicatedRowWiseSharding", "check_hot_rows", "sharded_placement", "share"]
