"""Batches in flight: the record a prefetch makes of one batch and the queue that holds the records
until their forward takes them.

A record is born at ``prefetch`` (``InFlightBatch``; ``StagedRecord`` while a staged prefetch's host
half is still to come, ``FailedRecord`` when that host half raised) and retired by the batch's
backward, an eval or no-grad forward, a ``withdraw``, or the finalizer of a forward whose graph was
dropped. ``docs/design.md`` follows one through its life.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from tieredemb.jagged import as_kjt
from tieredemb.modules.batch import Batch, GroupMajor
from tieredemb.ops.capture import Slot
from tieredemb.storage.tiers.device import DeviceTier


@dataclass
class InFlightBatch:
    """A batch resolved by prefetch: its layout and each group's addresses (or, sharded, what the
    input dist resolved)."""

    batch: Batch
    groups: list[object]  # each group's part, as the placement resolved it
    training: bool
    released: bool = False
    finalizer: weakref.finalize | None = field(default=None, repr=False)
    out_rows: list[int] = field(default_factory=list)  # rows of each group's output (forward)
    stream: object | None = None  # the CUDA stream the batch was resolved on, then the one using it
    # each group's (gradient source of each id, scale), when made before the host read
    grad_sources: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
    graph_slot: Slot | None = None  # the captured prefetch whose outputs hold the batch, if one does
    # the first group's lookup, made right after the prefetch's read (every key found), while the rows
    # were as of ``looked_at`` (``CollectionBase._rows_changed``)
    looked: torch.Tensor | None = None
    looked_at: int = -1


@dataclass
class StagedRecord:
    """A staged prefetch, its device half launched; ``deferred``: its host half is still to come
    (``CollectionBase.prefetch_deferred``), its one read copied behind it (``host``: pinned memory on
    CUDA, ready at ``done``). ``outputs``: (staged batch, staged prefetch, gradient sources, the
    backward's, the read). ``group``: the one group staged, or None: every group together
    (``_stage_all``; no gradient sources or backward's made before the read)."""

    group: DeviceTier | None
    step: int
    slot: Slot | None
    outputs: tuple
    stream: object
    deferred: bool = False
    host: torch.Tensor | None = None
    done: torch.cuda.Event | None = None
    training: bool = True


@dataclass
class StagedAll:
    """The device half of a staged prefetch of every group at once (``CollectionBase._stage_all``),
    padded to the batch's n ids. One dedup of all the ids (tables numbered across the groups, so the
    distinct pairs and the sorted ids come group by group), each group's probe written into ``slots``
    and ``values`` at its own pairs; then in each group's own numbering: ``tables`` of the pairs,
    ``inverse`` and ``id_values`` of its ids (laid out group by group: ``grouped``), ``order``
    (the sorted ids, positions among the group's). ``per_region``: each group's counts (misses,
    pairs and contested pairs per region); ``plans``: each group's reduction plan (``reduce_plan``)."""

    keys: torch.Tensor
    tables: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    order: torch.Tensor
    slots: torch.Tensor
    values: torch.Tensor
    id_values: torch.Tensor
    grouped: GroupMajor
    per_region: list[torch.Tensor]
    plans: list[tuple[torch.Tensor, ...] | None]
    step: int


@dataclass
class FailedRecord:
    """A deferred prefetch whose host half raised: the error waits for the batch's forward."""

    error: BaseException
    training: bool = True


def hand_over(state: InFlightBatch, stream: torch.cuda.Stream) -> None:
    """A prefetched batch's tensors may have been allocated on the prefetch stream; forward, backward
    and release read them on ``stream``. record_stream keeps the caching allocator from handing their
    blocks to the prefetch stream again before ``stream``'s use is done (the per-batch tensors are
    small and freed at unpredictable times by autograd, which rules out an event per buffer here).
    Every device tensor the batch holds, found by walking it (a list of fields had missed the lent
    pool and the deferred misses). A captured prefetch's outputs are the graph's own
    (``graph_slot``, released on ``stream``) and are not walked."""
    seen: set[int] = set()
    pending: list[object] = [state.batch, state.groups, state.grad_sources, state.looked]
    while pending:
        obj = pending.pop()
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda and id(obj) not in seen:
                seen.add(id(obj))
                obj.record_stream(stream)
        elif isinstance(obj, (list, tuple)):
            pending.extend(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, (type, Slot)) and id(obj) not in seen:
            seen.add(id(obj))
            pending.extend(getattr(obj, f.name) for f in fields(obj))


def same_batch(a: object, b: object) -> bool:
    """Two batches with the same features, ids, lengths and weights."""
    a, b = as_kjt(a), as_kjt(b)
    if a.keys() != b.keys():
        return False
    pairs = [(a.values(), b.values()), (a.lengths(), b.lengths())]
    wa, wb = a.weights_or_none(), b.weights_or_none()
    if (wa is None) != (wb is None):
        return False
    if wa is not None:
        pairs.append((wa, wb))
    return all(x.shape == y.shape and torch.equal(x, y.to(x.device)) for x, y in pairs)


Record = InFlightBatch | StagedRecord | FailedRecord


class InFlightQueue:
    """The batches prefetched and not yet taken by their forward, oldest first, each with the batch
    object it was prefetched for (matched by identity). The one place a collection keeps them:
    whatever touches rows asks this queue what is in flight. Taken under the collection's lock,
    except ``oldest`` and ``pop_oldest`` by the forward's thread (the only one that takes)."""

    def __init__(self) -> None:
        self._entries: list[tuple[object, Record]] = []

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, kjt: object, record: Record) -> None:
        self._entries.append((kjt, record))

    def oldest(self) -> tuple[object, Record] | None:
        return self._entries[0] if self._entries else None

    def newest(self) -> Record | None:
        return self._entries[-1][1] if self._entries else None

    def pop_oldest(self) -> None:
        del self._entries[0]

    def holds(self, kjt: object) -> bool:
        """Whether ``kjt`` (this very object) was prefetched and not yet taken."""
        return any(queued is kjt for queued, _ in self._entries)

    def record_of(self, kjt: object) -> Record | None:
        return next((record for queued, record in self._entries if queued is kjt), None)

    def remove(self, kjt: object) -> Record | None:
        """Take ``kjt``'s record out of the queue (by identity); None if it is not there."""
        for i, (queued, record) in enumerate(self._entries):
            if queued is kjt:
                del self._entries[i]
                return record
        return None

    def staged(self) -> list[StagedRecord]:
        return [record for _, record in self._entries if isinstance(record, StagedRecord)]

    def settle(self, finish: Callable[[StagedRecord], InFlightBatch | FailedRecord]) -> None:
        """Replace each staged record, oldest first, by ``finish(record)``. An interrupt leaves no
        half-finished record queued: it becomes a failed one, and the interrupt goes on."""
        for i, (kjt, record) in enumerate(self._entries):
            if isinstance(record, StagedRecord):
                try:
                    self._entries[i] = (kjt, finish(record))
                except BaseException as e:
                    self._entries[i] = (kjt, FailedRecord(e))
                    raise

    def resolved_training(self) -> list[InFlightBatch]:
        """The training batches resolved and not yet retired: their prefetch changed the tables
        (admission counts, the LRU clock) before their step."""
        return [record for _, record in self._entries
                if isinstance(record, InFlightBatch) and record.training and not record.released]
