"""Input checking and per-group layout of a KeyedJaggedTensor batch.

Every check runs before any state changes, and every error names the feature and the problem.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tieredemb.config import RESERVED_KEY, TableConfig
from tieredemb.jagged import KeyedJaggedTensor, as_kjt, offsets_from_lengths
from tieredemb.ops.reference import TorchKernels
from tieredemb.ops.reference import bad_ids as _bad_ids
from tieredemb.ops.reference import run_of as _run_of

_INT_DTYPES = (torch.int64, torch.int32)


@dataclass
class GroupBatch:
    """The ids of one table group of a batch: its tables in group order, each table's features in
    its ``feature_names`` order, each feature's ids sample by sample.

    ids: int64 (n,); tables: int64 (n,) position in the group of each id's table; lengths: int64
    (F_g * B,) ids per (feature, sample); offsets: int64 (F_g*B + 1,); weights: float32 (n,) or None;
    ids_per_feature: F_g ints (host); ids_per_table: ints (host).
    """

    ids: torch.Tensor
    tables: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None
    ids_per_feature: list[int]
    ids_per_table: list[int]


@dataclass
class Batch:
    batch_size: int
    groups: list[GroupBatch]


def check_tables(tables: list[TableConfig]) -> None:
    """A collection's table configs: unique table names, each feature in exactly one table."""
    if not tables:
        raise ValueError("a collection needs at least one TableConfig")
    names: set[str] = set()
    owner: dict[str, str] = {}
    for t in tables:
        if not isinstance(t, TableConfig):
            raise TypeError(f"tables must be te.TableConfig, got {type(t).__name__}")
        if t.name in names:
            raise ValueError(f"duplicate table name {t.name!r}")
        names.add(t.name)
        for f in t.feature_names:
            if f in owner:
                raise ValueError(f"feature {f!r} is in two tables: {owner[f]!r} and {t.name!r}")
            owner[f] = t.name


def check_device(what: str, t: torch.Tensor, device: torch.device) -> None:
    """``t`` is where a collection on ``device`` can read it: the CPU, a CUDA device, or ``device``'s
    kind (not the meta device, which holds no data)."""
    if t.device.type not in ("cpu", "cuda", device.type):
        raise ValueError(f"{what} is on device {t.device}, which a collection on {device} cannot read: give "
                         f"it on the CPU or on {device}")


def _check_structure(kjt: KeyedJaggedTensor, features: list[str],
                     device: torch.device) -> tuple[int, torch.Tensor]:
    """What can be checked without reading the device: names, devices, dtypes, shapes. Returns the
    batch size and int64 (F, B) lengths."""
    for name, t in (("values", kjt.values()), ("lengths", kjt.lengths()), ("weights", kjt.weights_or_none())):
        if t is not None:
            check_device(f"batch {name}", t, device)
    keys = kjt.keys()
    if len(set(keys)) != len(keys):
        raise ValueError(f"batch has duplicate feature names: {keys}")
    unknown = [k for k in keys if k not in features]
    if unknown:
        raise ValueError(f"batch has unknown features {unknown}; this collection has {features}")
    missing = [f for f in features if f not in keys]
    if missing:
        raise ValueError(f"batch is missing features {missing}")
    values, lengths = kjt.values(), kjt.lengths()
    if values.dtype not in _INT_DTYPES or values.dim() != 1:
        raise TypeError(f"batch values must be a 1-D int64 or int32 tensor of ids, got "
                        f"{values.dtype} with shape {tuple(values.shape)}")
    if lengths.dtype not in _INT_DTYPES or lengths.dim() != 1:
        raise TypeError(f"batch lengths must be a 1-D int64 or int32 tensor, got {lengths.dtype} "
                        f"with shape {tuple(lengths.shape)}")
    if lengths.numel() % len(keys):
        raise ValueError(f"batch lengths has {lengths.numel()} entries, not a multiple of its "
                         f"{len(keys)} features")
    batch_size = lengths.numel() // len(keys)
    weights = kjt.weights_or_none()
    if weights is not None:
        if not weights.is_floating_point() or weights.dim() != 1:
            raise TypeError(f"batch weights must be a 1-D float tensor, got {weights.dtype} with shape "
                            f"{tuple(weights.shape)}")
        if weights.numel() != values.numel():
            raise ValueError(f"batch weights has {weights.numel()} entries but values has "
                             f"{values.numel()}")
    return batch_size, lengths.view(len(keys), batch_size).to(torch.int64)


def _check_ids(feature: str, table: TableConfig, ids: torch.Tensor) -> None:
    if ids.numel() == 0:
        return
    if table.num_embeddings is not None:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= table.num_embeddings:
            bad = lo if lo < 0 else hi
            raise ValueError(f"feature {feature!r}: id {bad} out of range [0, {table.num_embeddings})"
                             f" of table {table.name!r}")
    elif bool((ids == RESERVED_KEY).any()):
        raise ValueError(f"feature {feature!r}: id {RESERVED_KEY} is te.RESERVED_KEY, which no table "
                         "accepts")


def _first_bad(bad: torch.Tensor, bounds: list[int], features: list[str]) -> tuple[int, str]:
    """(position, feature) of the first True of ``bad`` (n,) (an error path: reads the device)."""
    pos = int(bad.nonzero()[0])
    return pos, features[sum(1 for b in bounds[1:] if b <= pos)]


@dataclass
class BatchInput:
    """``Layout.check``'s result: a batch that passed the checks needing no device data, as given
    (values, lengths and weights where the caller put them)."""

    keys: list[str]
    order: _Order
    batch_size: int
    values: torch.Tensor  # int64 or int32 (n,)
    per_feature: torch.Tensor  # int64 (F, B) lengths
    weights: torch.Tensor | None


PADDING_ID = 2**63 - 1  # the id of a padded batch's padding: sorts after every real id (a stable sort)


@dataclass
class StagedBatch:
    """``Layout.stage``'s result: the batch on the device, not yet read on the host."""

    keys: list[str]
    order: _Order
    batch_size: int
    values: torch.Tensor  # int64 (n,)
    per_feature: torch.Tensor  # int64 (F, B) lengths
    weights: torch.Tensor | None
    # int64 (n,) each id's table, numbered across the groups, group by group (``Layout.first_table``:
    # the first group's are its own)
    tables: torch.Tensor
    summary: torch.Tensor  # int64 (2F + 3,): ``TorchKernels.batch_checks``' summary
    offsets: torch.Tensor | None = None  # int64 (F * B + 1,) the first group's bags, if ``identity``

    @property
    def feature_counts(self) -> torch.Tensor:
        """int64 (F,) ids per feature, on the device (the summary's first entries)."""
        return self.summary[: len(self.keys)]

    def cut(self, n: int) -> StagedBatch:
        """A replayed capture's batch (padded to a bucket of ids) cut to its n ids."""
        return replace(self, values=self.values[:n], tables=self.tables[:n],
                       weights=None if self.weights is None else self.weights[:n])

    def guard(self) -> torch.Tensor:
        """int64 (F + 3,) on the device: all zero when every check that needs the data passes."""
        return self.summary[len(self.keys):]

    def first_group(self) -> GroupBatch:
        """The device half of the first group's ``GroupBatch`` when its features are the batch's
        (``identity``), before the read: ids, tables, lengths, offsets and weights (the per-feature
        and per-table counts, which need the read, empty)."""
        return GroupBatch(self.values, self.tables, self.per_feature.view(-1), self.offsets, self.weights,
                          [], [])


@dataclass
class _Order:
    """What a batch layout needs to know about one order of the batch's features (device tensors
    built once per order, so laying out a batch copies nothing from the host)."""

    limits: torch.Tensor | None  # int64 (F,) per batch feature: num_embeddings or -1 (None: all -1)
    positions: list[list[int]]  # per group: batch positions of its features, in group order
    position_dev: list[torch.Tensor]  # the same, on the device
    table_of_feature: list[list[int]]  # per group: the table (in the group) of each of its features
    table_of_feature_dev: list[torch.Tensor]  # the same, on the device
    identity: list[bool]  # per group: its features are the batch's, in the batch's order
    tables_dev: torch.Tensor  # int64 (F,) per batch feature: its table, numbered across the groups
    grouped_dev: torch.Tensor  # int64 (F,) the batch's features group by group (``positions`` joined)
    group_of_dev: torch.Tensor  # int64 (F,) per batch feature: its group


@dataclass
class GroupMajor:
    """A staged batch's ids laid out group by group, each group's in its ``GroupBatch`` order, made
    on the device before the read (``CollectionBase._stage_all``; a padded batch's padding stays last):
    ids, tables (each group's own numbering) and weights, the batch's moved there; lengths and
    offsets, per group, its bags' (as ``GroupBatch``'s)."""

    ids: torch.Tensor
    tables: torch.Tensor
    weights: torch.Tensor | None
    lengths: list[torch.Tensor]
    offsets: list[torch.Tensor]

    def cut(self, n: int) -> GroupMajor:
        """The layout of a padded batch's first n ids (its real ones)."""
        return GroupMajor(self.ids[:n], self.tables[:n], None if self.weights is None else self.weights[:n],
                          self.lengths, self.offsets)


class Layout:
    """Checks batches against a collection's tables and cuts them into per-group id lists.

    Args: the tables, the groups (lists of table positions), the device, whether per-id weights
    are used (``EmbeddingBagCollection``), the kernels (``batch_checks``; default the torch ones)."""

    def __init__(self, tables: list[TableConfig], groups: list[list[int]], device: torch.device,
                 use_weights: bool, kernels: object | None = None) -> None:
        self.kernels = TorchKernels() if kernels is None else kernels
        self.tables = tables
        self.groups = groups
        self.device = device
        self.use_weights = use_weights
        self.table_of = {f: t for t in tables for f in t.feature_names}
        # each group's first table in a numbering of all the tables, group by group
        self.first_table = [sum(len(m) for m in groups[:g]) for g in range(len(groups))]
        self.first_table_dev = torch.tensor(self.first_table, dtype=torch.int64, device=device)
        # per table (in that numbering): its group's first table
        self.table_first_dev = torch.tensor([first for first, m in zip(self.first_table, groups) for _ in m],
                                            dtype=torch.int64, device=device)
        self._orders: dict[tuple[str, ...], _Order] = {}

    def _order(self, keys: list[str]) -> _Order:
        order = self._orders.get(tuple(keys))
        if order is None:
            position = {f: i for i, f in enumerate(keys)}
            limits = [self.table_of[f].num_embeddings or -1 for f in keys]
            limits_dev = (None if all(lim < 0 for lim in limits)
                          else torch.tensor(limits, dtype=torch.int64, device=self.device))
            positions, tables_of = [], []
            numbered = [0] * len(keys)
            for g, first in zip(self.groups, self.first_table):
                pos, tab = [], []
                for local, t in enumerate(g):
                    pos += [position[f] for f in self.tables[t].feature_names]
                    tab += [local] * len(self.tables[t].feature_names)
                for p, local in zip(pos, tab):
                    numbered[p] = first + local
                positions.append(pos)
                tables_of.append(tab)
            dev = self.device
            group_of = [0] * len(keys)
            for g, pos in enumerate(positions):
                for p in pos:
                    group_of[p] = g
            order = _Order(limits_dev, positions,
                           [torch.tensor(p, dtype=torch.int64, device=dev) for p in positions],
                           tables_of, [torch.tensor(t, dtype=torch.int64, device=dev) for t in tables_of],
                           [p == list(range(len(keys))) for p in positions],
                           *(torch.tensor(t, dtype=torch.int64, device=dev)
                             for t in (numbered, [p for pos in positions for p in pos], group_of)))
            self._orders[tuple(keys)] = order
        return order

    def __call__(self, batch: object) -> Batch:
        staged = self.stage(batch)
        return self.finish(staged, staged.summary.tolist())

    def stage(self, batch: object) -> StagedBatch:
        """What can be checked without reading the device, and the device half of the rest: one
        int64 ``summary`` (``TorchKernels.batch_checks``) for ``finish`` to read, and each id's table
        (numbered across the groups)."""
        return self.put(self.check(batch))

    def put(self, given: BatchInput) -> StagedBatch:
        """``stage`` of a checked batch: its tensors copied to the device, then the device half."""
        weights = given.weights
        if weights is not None:
            weights = weights.to(device=self.device, dtype=torch.float32)
        values = given.values.to(device=self.device, dtype=torch.int64).contiguous()
        return self.stage_on_device(given, values, given.per_feature.to(self.device), weights)

    def check(self, batch: object) -> BatchInput:
        """The checks that need no device data (names, dtypes, shapes); nothing is copied."""
        kjt = as_kjt(batch)
        keys = kjt.keys()
        batch_size, per_feature = _check_structure(kjt, list(self.table_of), self.device)
        weights = kjt.weights_or_none() if self.use_weights else None
        return BatchInput(keys, self._order(keys), batch_size, kjt.values(), per_feature, weights)

    def stage_on_device(self, given: BatchInput, values: torch.Tensor, per_feature: torch.Tensor,
                        weights: torch.Tensor | None, count: torch.Tensor | None = None) -> StagedBatch:
        """``stage`` of a checked batch whose values (int64 (n,)), lengths (int64 (F, B)) and weights
        (float32 (n,) or None) are on the device already: device work only (a CUDA graph may hold
        it). ``count``: int64 () on the device, the batch's ids; the rest of ``values`` is padding."""
        order = given.order
        summary, tables = self.kernels.batch_checks(values, per_feature, order.limits, order.tables_dev,
                                                    weights, count)
        # the first group's bag offsets now, on the device: the host read need not wait for them
        offsets = offsets_from_lengths(per_feature.view(-1)) if order.identity[0] else None
        return StagedBatch(given.keys, order, given.batch_size, values, per_feature, weights, tables, summary,
                           offsets)

    def stage_padded(self, given: BatchInput, values: torch.Tensor, per_feature: torch.Tensor,
                     weights: torch.Tensor | None, count: torch.Tensor | None) -> StagedBatch:
        """``stage_on_device`` over a CUDA graph's static inputs: where ``count`` (int64 () on the
        device) is given, the batch fills only that many of the ids (and weights), and the rest
        becomes padding here (an id that sorts after every real one, weight 0)."""
        if count is not None:
            real = torch.arange(values.numel(), device=values.device) < count
            values = torch.where(real, values, PADDING_ID)
            weights = None if weights is None else torch.where(real, weights, 0.0)
        return self.stage_on_device(given, values, per_feature, weights, count)

    def finish(self, staged: StagedBatch, summary: list[int], grouped: GroupMajor | None = None) -> Batch:
        """Raise on what ``summary`` (the host copy of ``staged.summary``) finds wrong, else cut the
        batch into its groups (slices of ``grouped`` where the device laid them out already)."""
        keys, order, values, weights = staged.keys, staged.order, staged.values, staged.weights
        nf = len(keys)
        counts, negative, bad = summary[:nf], summary[nf : 2 * nf], summary[2 * nf : 2 * nf + 2]
        if any(negative):
            raise ValueError(f"feature {keys[[n > 0 for n in negative].index(True)]!r}: negative lengths")
        if sum(counts) != values.numel():
            raise ValueError(f"batch lengths sum to {sum(counts)} but values has {values.numel()} ids")
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + c)
        if bad[0]:
            feature = _run_of(staged.feature_counts, torch.arange(values.numel(), device=self.device))
            i = keys.index(_first_bad(_bad_ids(values, order.limits, feature), bounds, keys)[1])
            _check_ids(keys[i], self.table_of[keys[i]], values[bounds[i] : bounds[i + 1]])
        if weights is not None and bad[1]:
            pos, feature = _first_bad(~torch.isfinite(weights), bounds, keys)
            raise ValueError(f"feature {feature!r}: non-finite weight {float(weights[pos])}")
        groups, start = [], 0
        for g, (members, first, pos, pos_dev, local, local_dev, identity) in enumerate(zip(
                self.groups, self.first_table, order.positions, order.position_dev, order.table_of_feature,
                order.table_of_feature_dev, order.identity)):
            n = sum(counts[i] for i in pos)
            if grouped is not None:
                ids, tables = grouped.ids[start : start + n], grouped.tables[start : start + n]
                w = None if grouped.weights is None else grouped.weights[start : start + n]
                lengths, offsets = grouped.lengths[g], grouped.offsets[g]
            else:
                if identity and first == 0:  # (numbered across the groups, the first group's are its own)
                    ids, w, tables = values, weights, staged.tables
                else:
                    ids = torch.cat([values[bounds[i] : bounds[i + 1]] for i in pos])
                    w = None if weights is None else torch.cat([weights[bounds[i] : bounds[i + 1]]
                                                                for i in pos])
                    ends = staged.feature_counts[pos_dev]
                    tables = local_dev[_run_of(ends, torch.arange(n, device=self.device))]
                lengths = staged.per_feature.view(-1) if identity else staged.per_feature[pos_dev].reshape(-1)
                offsets = staged.offsets if identity else None
                if offsets is None:  # not made with the staged batch
                    offsets = offsets_from_lengths(lengths)
            start += n
            per_table = [0] * len(members)
            for i, t in zip(pos, local):
                per_table[t] += counts[i]
            groups.append(GroupBatch(ids, tables, lengths, offsets, w, [counts[i] for i in pos], per_table))
        return Batch(staged.batch_size, groups)

    def group_shifts(self, staged: StagedBatch, pair_starts: torch.Tensor) -> torch.Tensor:
        """int64 (5, F), ``kernels.regroup_ids``' ``shifts`` for ``staged``: per batch feature the end
        of its ids, their shift to the group-by-group layout and to their place in their group, its
        group's first table and (``pair_starts`` int64 (G,)) first distinct pair. Device only."""
        order = staged.order
        counts = staged.feature_counts
        ends = counts.cumsum(0)
        grouped = counts[order.grouped_dev]
        shift = torch.empty_like(counts)
        shift[order.grouped_dev] = grouped.cumsum(0) - grouped
        per_group = counts.new_zeros(len(self.groups)).index_add_(0, order.group_of_dev, counts)
        group = order.group_of_dev
        local = shift - (per_group.cumsum(0) - per_group)[group]
        shift -= ends - counts
        local -= ends - counts
        return torch.stack([ends, shift, local, self.first_table_dev[group], pair_starts[group]])

    def group_bags(self, staged: StagedBatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each group's bag lengths and offsets (``GroupBatch``'s), on the device."""
        order = staged.order
        lengths = [staged.per_feature.view(-1) if identity else staged.per_feature[pos].reshape(-1)
                   for pos, identity in zip(order.position_dev, order.identity)]
        return lengths, [offsets_from_lengths(t) for t in lengths]


def check_keys(table: TableConfig, keys: object, device: torch.device) -> torch.Tensor:
    """Keys given to read/write/erase: a 1-D integer tensor of valid ids -> int64 on ``device``."""
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"table {table.name!r}: keys must be a tensor, got {type(keys).__name__}")
    if keys.dtype not in _INT_DTYPES or keys.dim() != 1:
        raise TypeError(f"table {table.name!r}: keys must be a 1-D int64 tensor, got {keys.dtype} "
                        f"with shape {tuple(keys.shape)}")
    check_device(f"table {table.name!r}: keys", keys, device)
    keys = keys.to(device=device, dtype=torch.int64)
    _check_ids(f"<keys of table {table.name}>", table, keys)
    return keys


def check_weights(table: TableConfig, keys: torch.Tensor, weights: object,
                  device: torch.device) -> torch.Tensor:
    """Rows given to ``write``: a float tensor (n, D) on the collection's device, finite once rounded
    to the table's dtype (to the nearest value) -> the rows in that dtype on ``device``."""
    where = f"table {table.name!r}"
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        raise TypeError(f"{where}: weights must be a float tensor")
    check_device(f"{where}: weights", weights, device)
    if tuple(weights.shape) != (keys.numel(), table.embedding_dim):
        raise ValueError(f"{where}: weights must have shape ({keys.numel()}, {table.embedding_dim}), "
                         f"got {tuple(weights.shape)}")
    weights = weights.to(device=device, dtype=table.dtype)
    if not bool(torch.isfinite(weights).all()):
        raise ValueError(f"{where}: weights must be finite in the rows' dtype {table.dtype} (NaN, inf or "
                         "beyond its range)")
    return weights
