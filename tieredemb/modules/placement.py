"""Where a collection's keys live: all of them in this process (``LocalPlacement``, here), or spread
over the ranks of a process group (``tieredemb.distributed.sharding.RowWiseSharding``). The
collection picks one at construction and runs every step through it; both have the same verbs:

    resolve(layout, given, clock, training)      a checked batch's device half, its checks' verdict
        -> (batch, parts)                        read, each group's ids resolved (input_dist)
    refuse()                                     this process's batch failed its checks (sharded:
                                                 the other ranks learn of it, and raise too)
    input_dist(g, gb, clock, training) -> part   resolve group g's ids of a batch (sharded: their
                                                 owners resolve them)
    output(g, part) -> (store, addresses)        where each id's row is, for the lookup
    grad_dist(g, part, grad, src, scale)         the gradient as the owner applies it
    served(part)                                 what this process's tier resolved (to settle, release)
    release(parts, stream)                       a batch is done with its parts once ``stream`` is
    read / write / import_rows / delete_rows     row access by key (sharded: collectives)
    read_ahead(g, keys, tables)                  rows read ahead into a host tier (sharded: this
                                                 rank's own keys only; no collective)
    export(g, i) / export_chunks(g, i, rows)     the rows this process owns
    to_owners(g, i, keys, payload)               keys (and an int64 each) to their owners
    stats(g, i) / all_stats(mine)                this process's load of a table / every process's
"""

from __future__ import annotations

import torch

from tieredemb.modules.batch import Batch, BatchInput, GroupBatch, Layout
from tieredemb.profiling import label
from tieredemb.storage.row_store import RowStore
from tieredemb.storage.tiers.device import DeviceTier
from tieredemb.storage.tiers.parts import GroupPrefetch, TableRows, TableStats


def resolve_eagerly(placement, layout: Layout, given: BatchInput, clock: int,
                    training: bool) -> tuple[Batch, list]:
    """``given`` on the device and checked (one host read: a bad batch raises, nothing changed, after
    ``placement.refuse()``), cut into its groups, each group's ids resolved by
    ``placement.input_dist`` at ``clock``."""
    with label("## check_batch ##"):
        staged = layout.put(given)
    try:
        batch = layout.finish(staged, staged.summary.tolist())
    except Exception:
        placement.refuse()
        raise
    parts = []
    try:
        for g, gb in enumerate(batch.groups):
            with label("## group.prefetch ##"):
                parts.append(placement.input_dist(g, gb, clock, training))
    except BaseException:  # the groups resolved so far hold nothing for a batch that will not run
        placement.release(parts, None)
        raise
    return batch, parts


class LocalPlacement:
    """Every key of every table is this process's: each tier resolves, serves and updates its own."""

    def __init__(self, tiers: list[DeviceTier]) -> None:
        self.tiers = tiers

    def resolve(self, layout: Layout, given: BatchInput, clock: int, training: bool) -> tuple[Batch, list]:
        return resolve_eagerly(self, layout, given, clock, training)

    def refuse(self) -> None:
        """This process's batch failed its checks: no other process waits for it."""

    def input_dist(self, g: int, gb: GroupBatch, clock: int, training: bool) -> GroupPrefetch:
        return self.tiers[g].prefetch(gb.ids, gb.tables, gb.ids_per_table, clock, training)

    def served(self, part: GroupPrefetch) -> GroupPrefetch:
        return part

    def release(self, parts: list, stream: torch.cuda.Stream | None) -> None:
        """Nothing held beyond what the tiers release."""

    def output(self, g: int, part: GroupPrefetch) -> tuple[RowStore, torch.Tensor]:
        """The tier's row store and int64 (n,) the row address of each id."""
        return self.tiers[g].store, part.addresses_by_id()

    def absent_grad(self, g: int, rows: int) -> torch.Tensor | None:
        """The gradient of a group whose output got none: nothing to update."""
        return None

    def grad_dist(self, g: int, part: GroupPrefetch, grad: torch.Tensor, src: torch.Tensor,
                  scale: torch.Tensor | None):
        """(grad, gradient source of each id, its scale, the part the update applies to)."""
        return grad, src, scale, part

    def read(self, g: int, i: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tiers[g].read(i, keys)

    def write(self, g: int, i: int, keys: torch.Tensor, weights: torch.Tensor, clock: int) -> None:
        self.tiers[g].write(i, keys, weights, clock)

    def import_rows(self, g: int, i: int, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor,
                    admission: bool) -> None:
        if admission:
            self.tiers[g].import_admission(i, keys, scores)
        else:
            self.tiers[g].import_rows(i, keys, rows, scores)

    def delete_rows(self, g: int, i: int, keys: torch.Tensor) -> None:
        self.tiers[g].delete_rows(i, keys)

    def read_ahead(self, g: int, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """Group g reads the (table in the group, key) pairs' rows ahead into its host tier (none:
        nothing)."""
        self.tiers[g].read_ahead(keys, tables)

    def to_owners(self, g: int, i: int, keys: torch.Tensor,
                  payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and a payload each to the process that owns them: this one."""
        return keys, payload

    def export(self, g: int, i: int) -> TableRows:
        return self.tiers[g].export(i)

    def export_chunks(self, g: int, i: int, rows: int):
        return self.tiers[g].export_chunks(i, rows)

    def stats(self, g: int, i: int) -> TableStats:
        return self.tiers[g].stats(i)

    def all_stats(self, mine: dict) -> list[dict]:
        return [mine]
