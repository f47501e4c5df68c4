"""EmbeddingBagCollection and EmbeddingCollection: raw-ID tables with optimizers fused into backward.

The data path of one step (DESIGN section 3):

    prefetch(kjt)   check the batch, dedup ids per table, resolve every unique key to a row address
                    (insert, initialize, admit, lock)            -> InFlightBatch
    forward(kjt)    gather (and pool) rows by address; no hashing, no branching on storage
    backward        sum gradients per unique key, fused optimizer update of those rows, unlock

Tables of one embedding dim form a group (``DeviceTier``): one index, one row store, so each of these
steps is one set of kernels per group, not per table. Both collections share all of it; they differ
only in how a group's rows are looked up (pooled bags or one row per id) and how the outputs are
assembled.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from tieredemb.config import StorageConfig, TableConfig
from tieredemb.distributed import per_rank_backing
from tieredemb.distributed.replicated import check_hot_rows, sharded_placement
from tieredemb.index.key_index import bucket_loads
from tieredemb.jagged import JaggedTensor, KeyedTensor
from tieredemb.modules import state as table_state
from tieredemb.modules.batch import (
    GroupBatch,
    Layout,
    check_keys,
    check_tables,
    check_weights,
)
from tieredemb.modules.in_flight import (
    FailedRecord,
    InFlightBatch,
    InFlightQueue,
    StagedRecord,
    hand_over,
    same_batch,
)
from tieredemb.modules.placement import LocalPlacement
from tieredemb.modules.read_ahead import BatchKeys
from tieredemb.modules.staged import Collection as StagedCollection
from tieredemb.modules.staged import StagedPrefetcher
from tieredemb.ops import resolve_device, select_kernels
from tieredemb.ops.capture import CapturedStages, capture_default
from tieredemb.ops.reference import bag_ids, orders_by_table
from tieredemb.optim import SGD, EmbeddingOptimizer
from tieredemb.profiling import label
from tieredemb.storage.row_store import RowStore
from tieredemb.storage.tiers.device import DeviceTier
from tieredemb.storage.tiers.parts import TableRows
from tieredemb.storage.tiers.plan import build_tiers, group_tables, select_mode


class _Lookup(torch.autograd.Function):
    """Forward: per-group lookups by address. Backward: the fused optimizer step (returns no grads)."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, module: CollectionBase, state: InFlightBatch):
        ctx.module, ctx.state = module, state
        # forward without backward (graph dropped) must still release the batch's locks
        state.finalizer = weakref.finalize(ctx, module._release, state)
        outs = module._lookups(state)
        state.out_rows = [o.shape[0] for o in outs]
        if module.stash is not None:  # the rows are idle until this lookup's backward
            with module.mutating():
                module.stash.after_lookup(module)
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if ctx.module.stash is not None:  # at the latest: the update needs the rows
            ctx.module.stash.restore(ctx.module)
        ctx.module._backward(ctx.state, grads)
        return None, None, None


class _Interleave(torch.autograd.Function):
    """The groups' pooled outputs, (B, F_g * D_g) each, into their features' columns of the (B, sum
    of dims) output (``columns``: int64 per group); backward: each group's columns of the gradient.
    One copy per group each way, whatever the order of the features."""

    @staticmethod
    def forward(ctx, columns: list[torch.Tensor], *outs: torch.Tensor) -> torch.Tensor:
        ctx.columns = columns
        out = outs[0].new_empty(outs[0].shape[0], sum(c.numel() for c in columns))
        for c, o in zip(columns, outs):
            out.index_copy_(1, c, o)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, *(grad.index_select(1, c) for c in ctx.columns)


class CollectionBase(nn.Module):
    """Shared machinery of both collections (not public)."""

    def __init__(self, tables: list[TableConfig], optimizer: EmbeddingOptimizer | None = None,
                 storage: StorageConfig | None = None, device: torch.device | str | None = None,
                 seed: int = 0, process_group: object | None = None, kernels: str = "auto",
                 capture: bool | None = None) -> None:
        super().__init__()
        tables = list(tables)
        check_tables(tables)
        optimizer = SGD(lr=0.01) if optimizer is None else optimizer
        if not isinstance(optimizer, EmbeddingOptimizer):
            raise TypeError(f"optimizer must be one of te.optim's, got {type(optimizer).__name__}")
        storage = StorageConfig() if storage is None else storage
        self.process_group = process_group
        self.world, self.rank = 1, 0
        if process_group is not None:  # each rank's shard in a store of its own
            self.world = dist.get_world_size(process_group)
            self.rank = dist.get_rank(process_group)
            storage = dataclasses.replace(storage, backing=per_rank_backing(storage.backing, self.rank))
        self.device = resolve_device(device)
        self.table_configs = tables
        self.optimizer = optimizer
        self.storage = storage
        self.seed = int(seed)
        self.storage_mode = select_mode(tables, optimizer, storage, self.world)
        check_hot_rows(storage.replicate_hot, tables, process_group, self.storage_mode)
        self.kernels = select_kernels(kernels, self.device)
        self._table_names = [t.name for t in tables]
        members = group_tables(tables)
        self.tiers = build_tiers(self.storage_mode, tables, members, optimizer, storage, self.seed,
                                 self.device, self.kernels, self.world)
        # where the keys live: this process, or the ranks of the group (each rank's tiers its shard)
        self.placement = (LocalPlacement(self.tiers) if process_group is None else sharded_placement(
            self.tiers, self.kernels, self.device, process_group, storage.replicate_hot))
        # table name -> (group, position in the group)
        self._where = {tables[t].name: (g, i) for g, m in enumerate(members) for i, t in enumerate(m)}
        self._batch_keys = BatchKeys(tables, self._where)
        self._layout = Layout(tables, members, self.device, self._uses_weights, self.kernels)
        self.step = 0  # optimizer steps taken (backward passes)
        self._clock = 0  # prefetches taken: the LRU score of a use
        self._queue = InFlightQueue()  # batches prefetched, not yet taken by their forward
        # autograd needs an input that requires grad to call our backward
        self._dummy = torch.zeros(1, requires_grad=True)
        # prefetch may run on another thread and CUDA stream than forward/backward (TrainPipeline's
        # prefetch_in_thread): index and row-store changes take this lock, and on CUDA each one's
        # stream waits for the previous one's event, so they happen in one order on host and GPU
        self._lock = threading.RLock()
        self._mutated: torch.cuda.Event | None = None
        self._mutated_on: torch.cuda.Stream | None = None  # the stream of the last record
        self.stash = None  # a te.pipeline.stash.Stash moving this collection's rows, if any
        # CUDA graphs of the device halves of training batches, with Triton's kernels (the reference's
        # read the device): the staged prefetch's, or a shard owner's serve
        capture = (capture_default() if capture is None else bool(capture)) and self.device.type == "cuda" \
            and self.kernels.name == "triton"
        self._stager = self._choose_prefetch(capture)
        if capture and process_group is not None:
            self.placement.capture_with(self._on_forward_thread)
        # a staged prefetch that found every key looks the batch up right after its read, so that the
        # host's work until the backward runs beside that kernel; its output stands only if no row
        # changed before the forward (``_rows_changed``: backward updates, writes, restores). Once an
        # output had to be dropped (a pipeline prefetching batch i+1 before backward i) it stops.
        self._rows_changed = 0
        self._early_lookup = True
        self._forward_thread: int | None = None  # _on_forward_thread
        self._updated_on: torch.cuda.Stream | None = None  # the last backward's stream
        self._prepare_outputs()

    def _prepare_outputs(self) -> None:
        """Subclasses: precompute how outputs are assembled."""

    def _choose_prefetch(self, capture: bool) -> StagedPrefetcher | None:
        """The staged prefetch for training batches, where every tier takes it (no admission policy,
        no bounded table in a cache), the batch is not sharded and one dedup can sort the ids of all
        groups (the tables, numbered across the groups, are the top bits of its sort key: up to
        2**16 tables); None: the eager path. Its device half is replayed from CUDA graphs where
        ``capture``."""
        together = orders_by_table(len(self.table_configs))
        if self.process_group is not None or not together or not all(g.can_stage() for g in self.tiers):
            return None
        captured = None
        if capture:  # inputs: values, lengths, weights, step, a padded batch's ids
            captured = CapturedStages(self.device, (torch.int64,) * 2 + (torch.float32,) + (torch.int64,) * 2)
            for group in self.tiers:  # and the insertion of misses, by the thread that may capture
                group.may_capture = self._on_forward_thread

        def clock_to(step: int) -> None:
            self._clock = step

        of = StagedCollection(
            self._layout, self.tiers, self.kernels, self.device, len(self.table_configs), self._grad_sources,
            lambda store, addresses, gb, scale: self._lookup_rows(0, store, addresses, gb, scale),
            self._may_look_early, lambda: self._rows_changed, self._on_forward_thread, clock_to)
        return StagedPrefetcher(of, captured)

    @contextmanager
    def mutating(self, first=None):
        """The lock, the deferred prefetches finished, and the stream ordered after the last change:
        a change to the tables may start. ``first``: a change made before those prefetches finish."""
        with self._lock:
            if first is not None:
                first()
            self._settle()  # a deferred prefetch's host half comes before any other change
            if self.device.type != "cuda":
                yield
                return
            stream = torch.cuda.current_stream(self.device)
            if self._mutated is None:
                self._mutated = torch.cuda.Event()  # one event, recorded again after each mutation
            elif self._mutated_on != stream:  # on the same stream the order is already kept
                stream.wait_event(self._mutated)
            try:
                yield
            finally:
                self._mutated.record(stream)
                self._mutated_on = stream

    # ----------------------------------------------------------------------------- data path
    def prefetch(self, kjt: object) -> None:
        """Resolve ``kjt``'s rows now (checks, dedup, insert, lock); the next forward of the same
        batch object uses them."""
        with self.mutating():
            self._queue.push(kjt, self._resolve(kjt))

    def prefetch_deferred(self, kjt: object) -> None:
        """``prefetch`` without waiting for the device: where the batch's prefetch is staged (a
        training batch without admission policy, sharding or stashing; in cache mode without bounded
        tables), its device work is queued and its one host read (the checks' verdict, the distinct keys, the
        misses) waits until the batch is needed: its forward, or the next change to the tables. A
        bad batch then raises at its forward. Otherwise the same as ``prefetch``. Made for a loop
        that prefetches batch i+1 between forward i and backward i (``TrainPipeline``): backward i's
        launches then run while the device resolves batch i+1, and the host never waits for
        backward i's update."""
        with self.mutating():
            self._queue.push(kjt, self._resolve(kjt, defer=True))

    def _resolve(self, kjt: object, defer: bool = False) -> InFlightBatch | StagedRecord:
        if self.training:  # a scheduler's bad lr: refused before the batch changes anything
            self.optimizer.check()
        with label("## check_batch ##"):
            given = self._layout.check(kjt)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if self.training and self._stager is not None:
            # one group whose features are the batch's: its own path, with the backward's work before
            # the read and the lookup right after it; else every group in one (``_stage_all``)
            group = self.tiers[0] if len(self.tiers) == 1 and given.order.identity[0] else None
            staged = self._stager.stage(given, group, self._clock + 1, stream, defer and self.stash is None)
            return staged if staged.deferred else self._stager.finish(staged)
        training = self.training
        clock = self._clock + 1 if training else self._clock
        batch, groups = self.placement.resolve(self._layout, given, clock, training)
        self._clock = clock
        return InFlightBatch(batch, groups, training, stream=stream)

    def _settle(self) -> None:
        """Finish the deferred prefetches in the queue, oldest first, each on its own stream (ordered
        after the last change to the tables); one whose host half raises keeps its error for its
        forward (``FailedRecord``), so whatever settled it goes on."""
        with self._lock:
            self._queue.settle(self._settled)

    def _settled(self, record: StagedRecord) -> InFlightBatch | FailedRecord:
        """``record``'s host half on its stream, a change to the tables like any other (its event)."""
        stream = record.stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if stream is not None and self._mutated_on not in (None, stream):
                stream.wait_event(self._mutated)
            try:
                return self._stager.finish(record)
            except Exception as e:  # noqa: BLE001 (raised at the batch's forward)
                return FailedRecord(e)
            finally:
                if stream is not None:
                    self._mutated.record(stream)
                    self._mutated_on = stream

    def _may_look_early(self, stream: object) -> bool:
        """Whether a lookup launched now reads the rows as every change counted in ``_rows_changed``
        left them: on the thread of the forward and backward (their changes were launched before, in
        host order) and on the stream of the last backward (whose updates take no event; a write or
        a restore does, and the prefetch waits for it). A pipeline's worker prefetching batch i+1
        beside backward i on its own stream never looks early: its lookup could read rows before
        that backward's update, with the count already bumped."""
        return (self._early_lookup and self.stash is None and self._on_forward_thread()
                and self._updated_on in (None, stream))

    def _on_forward_thread(self) -> bool:
        """Whether this thread runs the forward (and so the backward's launches come before, in host
        order): the only one that captures a graph or looks a batch up early."""
        return threading.get_ident() == self._forward_thread

    def _addressed(self, g: int, state: InFlightBatch) -> tuple[RowStore, torch.Tensor]:
        """Where the rows of group g's ids are: a row store and an address per id (sharded: after
        the owners sent the rows of this rank's distinct keys back)."""
        return self.placement.output(g, state.groups[g])

    def _take_prefetched(self, kjt: object) -> InFlightBatch:
        """The oldest prefetched batch, which must be ``kjt`` (the same object, or equal): prefetch
        and forward see batches in the same order. Without a pending prefetch, resolve now."""
        state = self._take_ready(kjt)
        if state is not None:
            return state
        with self.mutating():
            state = self._take_prefetched_locked(kjt)
            for group, gpf in zip(self.tiers, state.groups):  # deferred insertions, if still due
                group.settle(self.placement.served(gpf))
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            if stream != state.stream:  # prefetched on another stream
                hand_over(state, stream)
                state.stream = stream  # used here from now on
        return state

    def _take_ready(self, kjt: object) -> InFlightBatch | None:
        """The oldest prefetched batch when taking it changes nothing: ``kjt`` itself, prefetched in
        this mode on this stream (the last change to the tables too), no insertion deferred; then no
        lock and no event (the step's path from its read to the backward: ~0.04 ms of host in
        a profile). None: take it under the lock."""
        if not self._queue:
            return None
        if isinstance(self._queue.oldest()[1], StagedRecord):
            self._settle()
        queued, state = self._queue.oldest()  # only this thread takes from the queue
        if queued is not kjt or state.training != self.training or isinstance(state, FailedRecord):
            return None
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            if state.stream != stream or self._mutated_on not in (None, stream):  # then the lock orders
                return None
        parts = [self.placement.served(part) for part in state.groups]
        if any(part.deferred is not None for part in parts):
            return None
        self._queue.pop_oldest()
        return state

    def finish_prefetch(self, kjt: object) -> None:
        """Finish the deferred prefetches queued up to ``kjt``'s and raise its error if its host half
        failed (``TrainPipeline``: a bad batch fails before the model sees it)."""
        with self._lock:
            self._settle()
            state = self._queue.record_of(kjt)
            if isinstance(state, FailedRecord):
                raise state.error

    def withdraw(self, kjt: object) -> None:
        """Drop ``kjt``'s queued prefetch (by identity) and release its locks and scratch rows
        (``TrainPipeline``: a batch its forward did not take, or in flight when it stops)."""
        with self._lock:
            self._settle()
            state = self._queue.remove(kjt)
            if isinstance(state, InFlightBatch):
                self._release(state)

    def _take_prefetched_locked(self, kjt: object) -> InFlightBatch:
        if not self._queue or (not self.training and self._queue.oldest()[1].training):
            return self._resolve(kjt)  # nothing prefetched, or an eval forward between training steps
        queued, state = self._queue.oldest()
        if queued is not kjt and not same_batch(queued, kjt):
            raise RuntimeError("forward got a batch other than the oldest prefetched one: prefetch "
                               "and forward must see the same batches in the same order")
        self._queue.pop_oldest()
        if isinstance(state, FailedRecord):
            raise state.error
        if state.training == self.training:
            return state
        self._release(state)  # prefetched in the other mode: resolve again
        return self._resolve(kjt)

    def _run(self, kjt: object) -> tuple[InFlightBatch, tuple[torch.Tensor, ...]]:
        self._forward_thread = threading.get_ident()
        if self.stash is not None:  # stashed by a forward whose backward never came
            self.stash.restore(self)
        state = self._take_prefetched(kjt)
        if state.training and torch.is_grad_enabled():
            return state, _Lookup.apply(self._dummy, self, state)
        try:
            return state, self._lookups(state)
        finally:
            self._release(state)  # no backward will come

    def _backward(self, state: InFlightBatch, grads: tuple[torch.Tensor | None, ...]) -> None:
        if state.released:
            raise RuntimeError("backward ran twice through one embedding lookup (retain_graph?): "
                               "the fused optimizer steps once per forward")
        self.optimizer.check()  # its hyperparameters may have changed since the forward
        self.step += 1
        self._rows_changed += 1
        self._updated_on = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for g, grad in enumerate(grads):
            group = self.tiers[g]
            if grad is None:  # sharded: still exchanged, as zeros
                grad = self.placement.absent_grad(g, state.out_rows[g])
                if grad is None:
                    continue
            if state.grad_sources is not None:
                src, scale = state.grad_sources[g]
            else:
                src, scale = self._grad_sources(g, state.batch.groups[g])
            with label("## grad_dist ##"):  # sharded: summed per distinct key, sent to the owners
                grad, src, scale, gpf = self.placement.grad_dist(g, state.groups[g], grad, src, scale)
            with label("## reduce+update ##"):  # the sums go straight into the rows' update
                self.kernels.reduce_update(grad.contiguous(), src, scale, gpf.inverse,
                                           gpf.unique_keys.numel(), gpf.sorted_ids, group.store,
                                           gpf.addresses, self.optimizer, self.step,
                                           group.rounding_seeds(gpf, self.step))
        with label("## release ##"):
            self._release(state)

    def _release(self, state: InFlightBatch) -> None:
        parts = [self.placement.served(part) for part in state.groups]
        held = [(group, part) for group, part in zip(self.tiers, parts) if group.holds(part)]
        # nothing to unlock or free (a warm hbm_direct batch): no lock to take, so no wait for the
        # prefetch thread resolving the next batch under it (0.9 ms a step)
        with self.mutating(self._unlock_first(state, held)) if held else nullcontext():
            if state.released:
                return
            state.released = True
            if state.finalizer is not None:
                state.finalizer.detach()
            for group, part in held:
                group.release(part)
            self.placement.release(state.groups, state.stream)
            if state.graph_slot is not None:  # its outputs take another batch once the stream is past here
                self._stager.captured.release(state.graph_slot, state.stream)

    def _unlock_first(self, state: InFlightBatch, held: list):
        """What ``_release`` does before the deferred prefetches of later batches finish: give the
        batch's locks back (``DeviceTier.release_locks``), so that their insertion of a bounded
        table's misses meets the buckets as a plain loop would, with no pair left to wait for
        ``settle``. Only where those prefetches were staged on this stream, after the last change
        (their probe is ordered before the unlock); else None, and the locks go with the release."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        staged = self._queue.staged()
        if not staged or any(r.stream != stream for r in staged) or self._mutated_on not in (None, stream):
            return None

        def unlock():
            if not state.released:
                for group, part in held:
                    group.release_locks(part)
        return unlock

    # Subclasses: how one group's rows are looked up and how gradients map back to ids.
    _uses_weights = False

    def _lookups(self, state: InFlightBatch) -> tuple[torch.Tensor, ...]:
        """Each group's lookup of the batch (the first group's made with the prefetch, if it was and
        no row changed since)."""
        # taken out of the record: the output gets this lookup's autograd node, which holds the
        # record (ctx.state), and a cycle through autograd's graph is never collected
        looked, state.looked = state.looked, None
        if looked is not None and state.looked_at != self._rows_changed:
            self._early_lookup = False  # made for nothing (rows changed since): not again
            looked = None
        return tuple(looked if g == 0 and looked is not None else self._lookup(g, state)
                     for g in range(len(self.tiers)))

    def _lookup(self, g: int, state: InFlightBatch) -> torch.Tensor:
        raise NotImplementedError

    def _lookup_rows(self, g: int, store: RowStore, addresses: torch.Tensor, gb: GroupBatch,
                     scale: torch.Tensor | None) -> torch.Tensor:
        """Group g's lookup of the ids at ``addresses``."""
        raise NotImplementedError

    def _grad_sources(self, g: int, gb: GroupBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    # ------------------------------------------------------------------------------ row access
    def _table(self, name: str) -> tuple[DeviceTier, int, TableConfig]:
        if name not in self._where:
            raise ValueError(f"unknown table {name!r}; tables are {self._table_names}")
        g, i = self._where[name]
        return self.tiers[g], i, self.tiers[g].configs[i]

    def read(self, table: str, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Current weights of ``keys`` ((n, D) in the table's dtype; zeros where not stored) and
        ``found`` (bool (n,)). Inserts nothing and moves no score. Sharded: a collective (every rank
        calls it, each with its own keys), answered by the keys' owners."""
        group, i, config = self._table(table)
        keys = check_keys(config, keys, self.device)
        with self.mutating():  # a cache-mode read may fetch from the backing store
            return self.placement.read(*self._where[table], keys)

    def write(self, table: str, keys: torch.Tensor, weights: torch.Tensor) -> None:
        """Upsert rows: keys int64 (n,) distinct, weights float (n, D), rounded to the nearest value
        of the table's dtype and finite there. Optimizer state of those rows is reset to zero.
        Sharded: a collective; the rows go to their owners (a key written by two ranks keeps the
        higher rank's row)."""
        group, i, config = self._table(table)
        keys = check_keys(config, keys, self.device)
        weights = check_weights(config, keys, weights, self.device)
        if torch.unique(keys).numel() != keys.numel():
            raise ValueError(f"table {table!r}: write keys must be distinct")
        with self.mutating():
            self._rows_changed += 1
            self.placement.write(*self._where[table], keys, weights, self._clock)

    # ------------------------------------------------------------------------------ state_dict
    _rows_in_state_dict = True  # off inside te.checkpoint (it streams the rows itself)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Table state as tensors and ``TableSlice`` handles read in chunks (``modules/state.py``)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._rows_in_state_dict:
            table_state.save(self, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if not self._rows_in_state_dict:
            return
        ours = table_state.expected_keys(self, prefix)
        unexpected_keys[:] = [k for k in unexpected_keys if k not in set(ours)]
        missing = [k for k in ours if k not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        table_state.load(self, state_dict, prefix, error_msgs)

    def read_full_rows(self, table: str, keys: torch.Tensor) -> torch.Tensor:
        """Whole rows ([weights | optimizer state]) of keys this rank stores; zeros where absent."""
        group, i, _ = self._table(table)
        with self.mutating():
            return group.read(i, keys.to(self.device), cols=group.width)[0]

    # ------------------------------------------------------------------------------ checkpoints
    def checkpoint_meta(self) -> dict:
        """What a checkpoint records of the collection besides its rows."""
        clock = self.retired_clock()  # the deferred prefetches settled first: their clock counts
        return {"step": self.step, "clock": clock, "seed": self.seed,
                "optimizer": type(self.optimizer).__name__,
                "tables": {t.name: {"dim": t.embedding_dim,
                                    "width": t.embedding_dim + self.optimizer.state_width(t.embedding_dim)}
                           for t in self.table_configs}}

    def export_chunks(self, table: str, rows: int):
        """This rank's rows of ``table`` in chunks: (keys, full rows, scores) on the CPU."""
        self._table(table)  # a known table
        with self.mutating():
            for keys, full, scores in self.placement.export_chunks(*self._where[table], rows):
                yield keys.cpu(), full.cpu(), scores.cpu()

    def admission_counts(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys counted toward admission and their counts as of the last step taken: the batches in
        flight counted theirs at prefetch, and a resumed run prefetches them again."""
        group, i, _ = self._table(table)
        g = self._where[table][0]
        with self.mutating():
            keys, counts = (t.cpu() for t in group.admission_counts(i))
            parts = [self.placement.served(r.groups[g]) for r in self._queue.resolved_training()]
            parts = [(pf.unique_keys[pf.unique_tables == i], pf.counts[pf.unique_tables == i])
                     for pf in parts if pf.counts is not None]
            if not parts:
                return keys, counts
            # each in-flight batch's occurrences taken off its keys' counts: a key it admitted is no
            # longer counted, so its sum falls to zero or below and it is left out
            all_keys = torch.cat([keys, *(k.cpu() for k, _ in parts)])
            all_counts = torch.cat([counts, *(-c.cpu() for _, c in parts)])
            unique, inverse = torch.unique(all_keys, return_inverse=True)
            total = torch.zeros(unique.numel(), dtype=all_counts.dtype).index_add_(0, inverse, all_counts)
            kept = total > 0
            return unique[kept], total[kept]

    def import_rows(self, table: str, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> None:
        """Store saved rows: keys int64 (n,), whole rows ([weights | optimizer state]) float (n, W),
        scores int64 (n,) (checkpoints, ``load_state_dict``). Sharded: a collective, each row sent
        to its owner."""
        self._import(table, keys, rows, scores, admission=False)

    def import_admission(self, table: str, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Restore the admission counts of keys not admitted yet. Sharded: a collective."""
        rows = torch.empty(keys.numel(), self._table(table)[0].width)
        self._import(table, keys, rows, counts, admission=True)

    def _import(self, table: str, keys: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor,
                admission: bool) -> None:
        dtype = self._table(table)[2].dtype  # a known table; its rows travel in its dtype
        keys = keys.to(self.device)
        rows, scores = rows.to(self.device, dtype), scores.to(self.device)
        with self.mutating():
            self._rows_changed += 1
            self.placement.import_rows(*self._where[table], keys, rows, scores, admission)

    def restore_progress(self, step: int, clock: int) -> None:
        """Set the optimizer steps taken and the LRU clock (prefetches taken) of a resumed run."""
        with self.mutating():
            self.step, self._clock = int(step), int(clock)

    def retired_clock(self) -> int:
        """The LRU clock as of the last step taken (what a checkpoint records): each training batch
        in flight advanced it by one at its prefetch, which a resumed run redoes."""
        with self.mutating():
            return self._clock - len(self._queue.resolved_training())

    def is_prefetched(self, kjt: object) -> bool:
        """Whether ``kjt`` (this very object) waits in the queue of prefetched batches."""
        return self._queue.holds(kjt)

    def read_ahead(self, kjt: object) -> None:
        """Start reading a coming batch's rows from the backing store into the host tier
        (``StorageConfig(host_budget=...)``) on I/O threads; returns at once. Nothing else moves
        (device cache, scores, admission counts); without a host tier, or while each host tier
        holds every row its store has, it only checks the batch."""
        wanted = {g for g, tier in enumerate(self.tiers) if tier.reads_ahead()}
        for g, (keys, tables) in self._batch_keys.by_group(kjt, self.device, wanted).items():
            self.placement.read_ahead(g, keys, tables)

    def delete_rows(self, table: str, keys: torch.Tensor) -> None:
        """Remove stored rows (a checkpoint delta's deletions); sharded: a collective."""
        self._table(table)  # a known table
        keys = keys.to(self.device)
        with self.mutating():
            self._rows_changed += 1
            self.placement.delete_rows(*self._where[table], keys)

    def to_owners(self, table: str, keys: torch.Tensor,
                  payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``keys`` of ``table`` (int64 (n,)), each with an int64 ``payload``, sent to the ranks that
        store them: the keys this rank stores, from every rank, and their payloads. Sharded: a collective."""
        self._table(table)  # a known table
        return self.placement.to_owners(*self._where[table], keys.to(self.device), payload.to(self.device))

    def bucket_loads(self, table: str, keys: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """A table with ``max_capacity``: int64 (buckets,) how many of ``keys`` (distinct, this rank's)
        each bucket of its index takes, and the bucket width (past it, rows are evicted); else None."""
        config = self._table(table)[2]
        if config.max_capacity is None:
            return None
        return bucket_loads(keys, config.max_capacity, self.storage.bucket_width), self.storage.bucket_width

    def is_empty(self) -> bool:
        with self.mutating():
            return all(group.is_empty() for group in self.tiers)

    def close(self) -> None:
        """Flush and close the backing stores (files, connections). The collection is unusable after."""
        with self.mutating():
            self.flush()
            for group in self.tiers:
                group.close()

    def flush(self) -> None:
        """Write every dirty cached row down to the backing store (in ``hbm_direct``: nothing to write;
        the free rows lent to released batches' insertions go back to the row store)."""
        with self.mutating():
            for group in self.tiers:
                group.flush()

    def export(self, table: str) -> TableRows:
        """Every stored row of ``table``: keys, weights, optimizer state and scores. Sharded: the
        rows this rank owns (the ranks' exports together hold each row once)."""
        self._table(table)  # a known table
        with self.mutating():
            return self.placement.export(*self._where[table])

    def stats(self, all_ranks: bool = False):
        """Per table: rows per tier, lookups, hits, misses, evictions, bytes. Sharded: this rank's
        shard, i.e. its load (lookups it served, rows it holds, bytes it moved). ``all_ranks``
        (a collective when sharded): a list with every rank's, so imbalance shows."""
        with self.mutating():
            mine = {name: self.placement.stats(g, i) for name, (g, i) in self._where.items()}
        return self.placement.all_stats(mine) if all_ranks else mine

    def extra_repr(self) -> str:
        dims = ", ".join(f"{t.name}:{t.embedding_dim}" for t in self.table_configs)
        return f"tables=[{dims}], optimizer={self.optimizer}, storage_mode={self.storage_mode!r}"


@contextmanager
def dense_only(model: nn.Module):
    """Within: the model's collections neither add nor expect table state in ``state_dict`` /
    ``load_state_dict`` (``te.checkpoint`` streams the rows itself)."""
    colls = [m for m in model.modules() if isinstance(m, CollectionBase)]
    for c in colls:
        c._rows_in_state_dict = False
    try:
        yield
    finally:
        for c in colls:
            c._rows_in_state_dict = True


class EmbeddingBagCollection(CollectionBase):
    """Pooled embedding lookups for several features over raw-ID tables, with a fused optimizer.

    Args:
        tables: the tables (``te.TableConfig``); each feature belongs to exactly one.
        optimizer: ``te.optim.SGD | Adagrad | RowWiseAdagrad | Adam`` (applied inside backward).
        storage: ``te.StorageConfig``; default: everything on ``device``.
        device: compute device (``"cpu"`` or ``"cuda"``); the same code and results on both.
        seed: seed of the initial rows (a pure function of seed, table name and key).
        process_group: a ``torch.distributed`` group: every table is sharded row-wise over its ranks
            (``docs/distributed.md``). Every rank runs the same steps; each trains on its own batch.
        kernels: ``"auto"`` (Triton on CUDA), ``"torch"`` (the reference) or ``"triton"``.
        capture: replay the training prefetch's device work from CUDA graphs (CUDA, Triton's kernels);
            None: on, unless the environment sets ``TIEREDEMB_CAPTURE=0``.

    ``forward(kjt)`` returns a ``te.KeyedTensor`` of shape (B, sum of dims), features in table-config
    order. ``loss.backward()`` updates the touched rows; the dense optimizer never sees them.

    Example::

        ebc = te.EmbeddingBagCollection(
            [te.TableConfig(name="user", embedding_dim=16, feature_names=["user_id"])],
            optimizer=te.optim.RowWiseAdagrad(lr=0.05))
        kjt = te.KeyedJaggedTensor(["user_id"], torch.tensor([3, 5, 5]), torch.tensor([2, 1]))
        ebc(kjt).values().sum().backward()
    """

    _uses_weights = True

    def _prepare_outputs(self) -> None:
        # per group: a float32 (F_g,) flag of its features under mean pooling, or None (none are)
        self._mean = []
        for group in self.tiers:
            flags = [float(c.pooling == "mean") for c in group.configs for _ in c.feature_names]
            self._mean.append(torch.tensor(flags, device=self.device) if any(flags) else None)
        self._keys = [f for t in self.table_configs for f in t.feature_names]
        self._dims = [t.embedding_dim for t in self.table_configs for _ in t.feature_names]
        # each group's lookup writes its bags sample-major, (B, F_g * D_g): the output's layout when
        # it is the only group; with several, ``_columns[g]`` are the output columns of its features
        # (in the group's order, which is the config order of its tables)
        self._sample_major = [sum(len(c.feature_names) for c in group.configs) for group in self.tiers]
        columns: list[list[torch.Tensor]] = [[] for _ in self.tiers]
        at = 0
        for t in self.table_configs:
            for _ in t.feature_names:
                columns[self._where[t.name][0]].append(torch.arange(at, at + t.embedding_dim))
                at += t.embedding_dim
        self._columns = [torch.cat(c).to(self.device) for c in columns]

    def forward(self, kjt: object) -> KeyedTensor:
        state, outs = self._run(kjt)
        b = state.batch.batch_size
        outs = [o.view(b, f * g.dim) for o, f, g in zip(outs, self._sample_major, self.tiers)]
        values = outs[0] if len(outs) == 1 else _Interleave.apply(self._columns, *outs)
        return KeyedTensor(self._keys, self._dims, values)

    def _lookup(self, g: int, state: InFlightBatch) -> torch.Tensor:
        gb = state.batch.groups[g]
        store, addresses = self._addressed(g, state)
        return self._lookup_rows(g, store, addresses, gb, self._scale(g, gb))

    def _lookup_rows(self, g: int, store: RowStore, addresses: torch.Tensor, gb: GroupBatch,
                     scale: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.gather_pool(store, addresses, gb.offsets, scale, self.tiers[g].dim,
                                        self._sample_major[g])

    def _scale(self, g: int, gb: GroupBatch) -> torch.Tensor | None:
        """float32 (n,) per-id factor: weight, divided by the bag length for mean pooling."""
        scale = gb.weights
        mean = self._mean[g]
        if mean is not None:
            bags = gb.lengths.numel()
            bag = bag_ids(gb.offsets, gb.ids.numel())
            per_bag = mean.repeat_interleave(bags // mean.numel())  # features are bag-major blocks
            factor = torch.where(per_bag > 0, 1.0 / gb.lengths.clamp(min=1).to(torch.float32), 1.0)
            scale = factor[bag] if scale is None else scale * factor[bag]
        return scale

    def _grad_sources(self, g: int, gb: GroupBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = self.kernels.bag_rows(gb.offsets, gb.ids.numel(), self._sample_major[g])
        return rows, self._scale(g, gb)


class EmbeddingCollection(CollectionBase):
    """Sequence (unpooled) embedding lookups: one row per id.

    Same arguments as ``EmbeddingBagCollection``. ``forward(kjt)`` returns ``dict[feature,
    te.JaggedTensor]`` with values (n_f, D) and the batch's lengths. Per-id weights are ignored and
    ``pooling`` does not apply.
    """

    def forward(self, kjt: object) -> dict[str, JaggedTensor]:
        state, outs = self._run(kjt)
        b = state.batch.batch_size
        result: dict[str, JaggedTensor] = {}
        for group, gb, out in zip(self.tiers, state.batch.groups, outs):
            features = [f for c in group.configs for f in c.feature_names]
            start = 0
            for i, (f, n) in enumerate(zip(features, gb.ids_per_feature)):
                result[f] = JaggedTensor(out[start : start + n], lengths=gb.lengths[i * b : (i + 1) * b])
                start += n
        return {f: result[f] for t in self.table_configs for f in t.feature_names}

    def _lookup(self, g: int, state: InFlightBatch) -> torch.Tensor:
        store, addresses = self._addressed(g, state)
        return self._lookup_rows(g, store, addresses, state.batch.groups[g], None)

    def _lookup_rows(self, g: int, store: RowStore, addresses: torch.Tensor, gb: GroupBatch,
                     scale: torch.Tensor | None) -> torch.Tensor:
        return self.kernels.gather(store, addresses, self.tiers[g].dim)

    def _grad_sources(self, g: int, gb: GroupBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.arange(gb.ids.numel(), device=self.device), None
