"""TrainPipeline: one training step per call, with the next batches' copy and prefetch overlapped.

TorchRec's ``progress(dataloader_iter)`` convention (DESIGN sections 1, 3, 4): each call trains one batch
and returns the model's output; it raises ``StopIteration`` once the iterator is exhausted and every
batch it gave has been trained.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch
from torch import nn

from tieredemb.modules.collection import CollectionBase
from tieredemb.ops import resolve_device
from tieredemb.pipeline.batches import is_kjt, move_batch, named_fields, pin_batch
from tieredemb.pipeline.stash import Stash
from tieredemb.profiling import label

logger = logging.getLogger(__name__)

_DRAINED = object()  # _step's answer when there is nothing left to train
_ENDED = object()  # in the batches read ahead: the iterator ended there


@dataclass
class _Failed:
    """In the batches read ahead: the iterator raised ``error`` there."""

    error: Exception


@dataclass
class _InFlight:
    """One batch between its host-to-device copy and its training step.

    batch: the batch on the device (its copy may still be running on the copy stream until ``copied``).
    plan: (collection, KJT) pairs to prefetch; each KJT is the very object the model will pass on.
    copied / prefetched: CUDA events recorded after the copy / the prefetch (None on CPU, or when the
    work ran on the training stream itself).
    prefetch: done once every pair of the plan is prefetched; holds the prefetch's exception if any.
    error: what went wrong reading, moving or planning this batch; raised when the batch is due.
    """

    batch: object
    plan: list[tuple[CollectionBase, object]] = field(default_factory=list)
    copied: torch.cuda.Event | None = None
    prefetch: Future | None = None
    prefetched: torch.cuda.Event | None = None
    error: Exception | None = None


class TrainPipeline:
    """Trains ``model`` one batch per ``progress`` call, the next batches' copy and prefetch overlapped.

    Each call trains batch i; the stages, in the order they are issued::

        wait_for_batch  batch i:   its copy and prefetch are complete          (training stream waits)
        forward         batch i:   output = model(batch); loss = output or output[0]
        prefetch        batch i+1: each collection resolves its rows           (before backward i;
                                   inline, its host read waits for wait_for_batch i+1)
        backward        batch i:   loss.backward(): the fused embedding optimizers update their rows
        optimizer       batch i:   optimizer.step() on the dense parameters
        copy_batch      batch i+2: next(iterator), pin, host-to-device copy    (overlaps step i+1)
                        (with ``lookahead=k``: batch i+2+k read from the iterator, its rows read
                        ahead into the host tiers on I/O threads)

    The first call fills the pipeline (copy batch 0, prefetch it, copy batch 1). No batch is
    dropped: after the iterator ends, calls go on training what is in flight, then raise
    ``StopIteration``. A later call with a new iterator starts filling again (a new epoch).

    Streams (CUDA; on CPU every stage runs in order on the calling thread):

    - copy stream: ``.to(device, non_blocking=True)`` from pinned memory. It starts batch i+2's copy only
      after the training stream's work of step i (an event, not ``record_stream``: batch i+2's buffers
      may reuse the blocks batch i just freed), and the training stream waits on the copy's event.
    - training stream (the caller's current stream): forward, backward, optimizer; by default also the
      prefetch, between forward i and backward i, through ``prefetch_deferred``: where the batch's
      prefetch is staged (one table group, no admission or bounded tables, no stashing) its device
      work is queued there and its one host read comes at ``wait_for_batch`` i+1, so the host
      launches backward i without waiting for the device (``docs/pipeline.md``).
    - prefetch stream, with ``prefetch_in_thread=True``: prefetch i+1 runs on a single worker thread
      (its host syncs - ``torch.unique``, miss checks, backend calls - leave the training thread) on
      its own stream, after an event recorded behind forward i; forward i+1 waits for the thread and
      then for the prefetch's event. The collections serialize their index and row-store changes
      (a lock, and an event chain between streams) and hand prefetched tensors over with
      ``record_stream``, so backward i's release beside prefetch i+1 is safe. Faster than inline for
      a cache-mode collection under a heavy dense model (its fetch's host work leaves the training
      thread); slower in ``hbm_direct``.

    Args:
        model: called as ``model(batch)``; returns the loss (a scalar tensor) or ``(loss, output)``.
        optimizer: steps the dense parameters (``None``: the model has only embedding collections).
        device: where batches go; default: the device of the model's first parameter, else of its
            first embedding collection, else the CPU.
        stash: embedding memory stashing (``te.StashConfig``; ``None``: off): the tables' device rows
            go to pinned host memory after the lookup and come back for the embedding backward; the
            model's forward runs inside ``Stash.tracking()`` (``docs/stashing.md``). ``close()``
            brings them back.
        prefetch_in_thread: run each prefetch on a background thread and the prefetch stream (see
            above; default False).
        autograd_threads: run each backward on autograd's per-device worker threads (torch's own
            default). False (the default) runs it on the training thread
            (``torch.autograd.set_multithreading_enabled(False)`` around ``loss.backward()`` only):
            the hand-over to a worker and back cost ~0.5 ms of a 2.2 ms all-in-HBM embedding step on
            the H200 host measured (``docs/performance.md``).
        lookahead: batches read from the iterator ahead of those the pipeline copies and prefetches
            (default 0). Each one's keys are handed to ``collection.read_ahead`` as soon as it is
            read: a collection with a host tier (``StorageConfig(host_budget=...)``) fetches their
            rows from its backing store on I/O threads, so the prefetch ``lookahead`` steps later
            finds them in host memory. Without a host tier it costs only the batches held.

    Batches: any object with ``.to(device, non_blocking=True)`` returning the moved batch (as
    TorchRec's ``Batch``), or a dict, list, tuple or dataclass of tensors and KeyedJaggedTensors (moved
    field by field). On CUDA, the CPU tensors and KJTs of a dict, list, tuple or dataclass batch are
    pinned first (pin them in the data loader to keep that copy off the training thread; a batch that
    moves itself is not pinned by the pipeline). Every KeyedJaggedTensor among the batch's top-level fields,
    attributes or dict values (or the batch itself) is prefetched into each embedding collection of
    the model whose features are exactly its keys, and the model must pass that same object (or an
    equal one) to that collection. A KJT that matches no collection is a ``ValueError``. The pipeline
    puts the model in train mode.

    Errors: a batch that cannot be read, moved or prefetched raises when its turn comes (the steps
    before it complete and return). Any error fails the pipeline: its in-flight prefetches are
    released (the model stays usable for a plain loop or a new pipeline) and later calls raise
    ``RuntimeError``. Call ``close()`` to stop early; do not run another forward of the model's
    collections while batches are in flight (their prefetches are queued in the collections, FIFO).

    Example::

        pipeline = te.TrainPipeline(model, torch.optim.Adam(model.parameters()), device=device)
        batches = iter(loader)
        while True:
            try:
                loss = pipeline.progress(batches)
            except StopIteration:
                break
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device | str | None = None,
        stash: object | None = None,
        *,
        prefetch_in_thread: bool = False,
        autograd_threads: bool = False,
        lookahead: int = 0,
    ) -> None:
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"lookahead must be an int >= 0 (batches read ahead), got {lookahead!r}")
        self._lookahead = lookahead
        self._ahead: deque[object] = deque()  # batches read from the iterator, not yet copied
        self._model = model
        self._optimizer = optimizer
        self._autograd_threads = autograd_threads
        self.device = resolve_device(device) if device is not None else _default_device(model)
        self._collections = [(m, _features(m)) for m in model.modules() if isinstance(m, CollectionBase)]
        self._stash = (Stash([c for c, _ in self._collections], stash, model)
                       if stash is not None else None)
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        # the prefetch stream at the highest priority (torch maps -100 to the device's highest): its
        # small kernels, and the host syncs waiting on them, go ahead of the dense model's queued
        # blocks instead of behind whole GEMMs
        self._prefetch_stream = (torch.cuda.Stream(self.device, priority=-100)
                                 if cuda and prefetch_in_thread else None)
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredemb-prefetch")
            if prefetch_in_thread
            else None
        )
        self._batches: deque[_InFlight] = deque()  # batch i (copied, prefetched), batch i+1 (copied)
        self._exhausted = False  # the iterator ended (or failed): read no more until drained
        self._unfed_warned = False
        self._failure: BaseException | None = None
        self._closed = False

    # ------------------------------------------------------------------------------------ public
    def progress(self, batch_iterator: Iterator[object]) -> object:
        """Train the next batch; returns the model's output (the loss, or ``(loss, output)``).

        Raises ``StopIteration`` when ``batch_iterator`` is exhausted and every batch is trained.
        """
        if self._failure is not None:
            raise RuntimeError(
                "TrainPipeline failed in an earlier step (see the cause); its in-flight "
                "batches were released: build a new pipeline"
            ) from self._failure
        if self._closed:
            raise RuntimeError("TrainPipeline is closed")
        if not hasattr(batch_iterator, "__next__"):
            raise TypeError(
                f"progress() takes an iterator (e.g. iter(loader)), got {type(batch_iterator).__name__}"
            )
        self._model.train()
        try:
            output = self._step(batch_iterator)
        except BaseException as exc:
            self._failure = exc
            self._abandon()
            raise
        if output is _DRAINED:
            raise StopIteration
        return output

    def close(self) -> None:
        """Drop the batches in flight (untrained), release their prefetches, stop the worker thread;
        with stashing, bring the rows back and detach it from the collections."""
        self._closed = True
        self._abandon()

    # ---------------------------------------------------------------------------------- timeline
    def _step(self, batches: Iterator[object]) -> object:
        if not self._batches:
            self._fill(batches)
            if not self._batches:
                return _DRAINED
        current = self._batches[0]
        self._wait_for_batch(current)  # batch i
        output = self._forward(current)  # batch i
        if len(self._batches) > 1:
            self._start_prefetch(self._batches[1])  # batch i+1: beside batch i's backward
        self._backward(_loss_of(output))  # batch i
        self._optimizer_step()  # batch i
        self._batches.popleft()
        self._copy_batch(batches)  # batch i+2: beside step i+1
        return output

    def _fill(self, batches: Iterator[object]) -> None:
        """Batch 0: copy and prefetch; batch 1: copy."""
        self._exhausted = False
        self._copy_batch(batches)
        if self._batches:
            self._start_prefetch(self._batches[0])
        self._copy_batch(batches)

    def _copy_batch(self, batches: Iterator[object]) -> None:
        """Read the next batch and start its host-to-device copy; plan its prefetch."""
        if self._exhausted:
            return
        with label("## copy_batch ##"):
            try:
                batch = self._next_batch(batches)
            except StopIteration:
                self._exhausted = True
                return
            except Exception as exc:  # the loader's error: raised when this batch is due
                self._exhausted = True
                self._batches.append(_InFlight(None, error=exc))
                return
            try:
                record = self._place(batch)
            except Exception as exc:
                self._exhausted = True
                record = _InFlight(None, error=exc)
            self._batches.append(record)

    def _next_batch(self, batches: Iterator[object]) -> object:
        """The next batch; with ``lookahead``, ``lookahead`` more read from the iterator behind it
        and their rows read ahead (an iterator's end or error kept for its turn)."""
        if self._lookahead == 0:
            return next(batches)
        while len(self._ahead) <= self._lookahead and not (self._ahead and self._ahead[-1] is _ENDED):
            try:
                batch = next(batches)
            except StopIteration:
                self._ahead.append(_ENDED)
                break
            except Exception as exc:  # the loader's error: raised at its turn
                self._ahead.append(_Failed(exc))
                self._ahead.append(_ENDED)
                break
            self._read_ahead(batch)
            self._ahead.append(batch)
        batch = self._ahead.popleft()
        if batch is _ENDED:
            raise StopIteration
        if isinstance(batch, _Failed):
            raise batch.error
        return batch

    def _read_ahead(self, batch: object) -> None:
        """batch i+2+lookahead: each KJT's rows read ahead by the collections it feeds."""
        with label("## read_ahead ##"):
            for _, value in named_fields(batch):
                if not is_kjt(value):
                    continue
                for collection, features in self._collections:
                    if features == set(value.keys()):
                        try:
                            collection.read_ahead(value)
                        except Exception:  # a hint only: the batch's own turn reports it
                            logger.debug("read ahead skipped", exc_info=True)

    def _place(self, batch: object) -> _InFlight:
        if self._copy_stream is None:
            moved = move_batch(batch, self.device)
            return _InFlight(moved, self._plan(moved))
        # Batch i+2's buffers come from the copy stream's pool, where batch i's were just freed: copy
        # only after everything the training stream has been given (step i), so a reused block is
        # never overwritten while step i still reads it (an event wait, not record_stream: DESIGN
        # section 4 rule 2). The copy then runs beside step i+1.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            # non_blocking from pinned memory: the host does not wait, and the caching host allocator
            # keeps each pinned source block until the copy reading it has run
            moved = move_batch(pin_batch(batch), self.device)
        return _InFlight(moved, self._plan(moved), copied=_record(self._copy_stream))

    def _start_prefetch(self, record: _InFlight) -> None:
        """Issue the batch's prefetch: inline on the training stream, or on the worker thread."""
        if record.error is not None:
            return  # raised when the batch is due
        if self._executor is None:
            record.prefetch = _run_now(self._prefetch, record, None)
            return
        # The prefetch stream starts behind forward i: a block the host has freed by now was last read
        # by the training stream before this event. Not covered (one of the reasons this mode is off by
        # default): the collection's per-batch tensors that prefetch i allocated on the prefetch
        # stream and backward i reads on the training stream, if the host frees them before backward
        # i has run; the collections must record_stream them or keep them until an event
        # (TorchRec's prefetch(forward_stream=...)).
        after_forward = _record(_current_stream(self.device))
        record.prefetch = self._executor.submit(self._prefetch, record, after_forward)

    def _prefetch(self, record: _InFlight, after: torch.cuda.Event | None) -> None:
        """Every (collection, KJT) of the batch's plan, on the prefetch stream if there is one."""
        stream = self._prefetch_stream
        with label("## prefetch ##"), _stream_context(stream):
            ready = stream if stream is not None else _current_stream(self.device)
            _wait(ready, after)
            _wait(ready, record.copied)
            for collection, kjt in record.plan:
                if self._executor is None and self._stash is None:  # its read waits for forward i+1
                    collection.prefetch_deferred(kjt)
                else:
                    collection.prefetch(kjt)
            record.prefetched = _record(stream)

    def _wait_for_batch(self, record: _InFlight) -> None:
        with label("## wait_for_batch ##"):
            if record.error is not None:
                raise record.error
            if record.prefetch is not None:
                record.prefetch.result()  # the worker's host work; raises the prefetch's error
            for collection, kjt in record.plan:  # an inline prefetch's read, deferred until now
                collection.finish_prefetch(kjt)
            training = _current_stream(self.device)
            _wait(training, record.copied)
            _wait(training, record.prefetched)

    def _forward(self, record: _InFlight) -> object:
        with label("## forward ##"), self._stash_tracking():
            output = self._model(record.batch)
        unused = [(c, kjt) for c, kjt in record.plan if c.is_prefetched(kjt)]
        if unused:
            for c, kjt in unused:
                c.withdraw(kjt)
            raise RuntimeError(
                f"the model's forward did not pass the batch's KeyedJaggedTensor with features "
                f"{list(unused[0][1].keys())} to the embedding collection with those features; the "
                "pipeline prefetched it there, so it must (the same object or an equal one)"
            )
        return output

    def _stash_tracking(self):
        return self._stash.tracking() if self._stash is not None else contextlib.nullcontext()

    def _backward(self, loss: torch.Tensor) -> None:
        with label("## backward ##"):
            if self._optimizer is not None:
                self._optimizer.zero_grad(set_to_none=True)
            with torch.autograd.set_multithreading_enabled(self._autograd_threads):
                loss.backward()

    def _optimizer_step(self) -> None:
        with label("## optimizer ##"):
            if self._optimizer is not None:
                self._optimizer.step()

    # ----------------------------------------------------------------------------------- helpers
    def _plan(self, batch: object) -> list[tuple[CollectionBase, object]]:
        """(collection, KJT) for each top-level KJT of ``batch`` and each collection with its features."""
        plan: list[tuple[CollectionBase, object]] = []
        seen: set[tuple[int, int]] = set()
        for name, value in named_fields(batch):
            if not is_kjt(value):
                continue
            keys = set(value.keys())
            targets = [c for c, features in self._collections if features == keys]
            if not targets:
                known = [sorted(features) for _, features in self._collections]
                raise ValueError(
                    f"batch field {name!r}: a KeyedJaggedTensor with features "
                    f"{list(value.keys())} matches no embedding collection of the model "
                    f"(their features: {known}); the pipeline prefetches a KJT into the "
                    "collection whose features are exactly its keys"
                )
            for c in targets:
                if (id(c), id(value)) not in seen:
                    seen.add((id(c), id(value)))
                    plan.append((c, value))
        fed = {id(c) for c, _ in plan}
        unfed = [sorted(f) for c, f in self._collections if id(c) not in fed]
        if unfed and not self._unfed_warned:
            self._unfed_warned = True
            logger.warning(
                "no KeyedJaggedTensor in the batch for the embedding collections with "
                "features %s: they resolve their rows in forward, not ahead",
                unfed,
            )
        return plan

    def _abandon(self) -> None:
        """Release every in-flight batch's prefetches (after a running one finishes) and stop."""
        for record in self._batches:
            if record.prefetch is not None:
                wait_futures([record.prefetch])  # let a running prefetch end before cancelling it
            for collection, kjt in record.plan:
                collection.withdraw(kjt)
        self._batches.clear()
        self._ahead.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._stash is not None:
            self._stash.close()
            self._stash = None


# ----------------------------------------------------------------------------- batches and KJTs
def _default_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for m in model.modules():
        if isinstance(m, CollectionBase):
            return m.device
    return torch.device("cpu")


def _features(collection: CollectionBase) -> frozenset[str]:
    return frozenset(f for t in collection.table_configs for f in t.feature_names)


def _loss_of(output: object) -> torch.Tensor:
    loss = output[0] if isinstance(output, (tuple, list)) and output else output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"the model must return the loss (a tensor) or (loss, output), got {type(output).__name__}"
        )
    return loss


# ------------------------------------------------------------------------------ streams and events
def _current_stream(device: torch.device) -> torch.cuda.Stream | None:
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _stream_context(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


def _run_now(fn, *args) -> Future:
    """``fn(*args)`` now, as a done Future: its exception waits for ``result()`` like a worker's."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:
        future.set_exception(exc)
    return future


__all__ = ["TrainPipeline"]
