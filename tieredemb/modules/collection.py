"""EmbeddingBagCollection and EmbeddingCollection: raw-ID tables with optimizers fused into backward.

The data path of one step (DESIGN section 3):

    prefetch(kjt)   check the batch, dedup ids per table, resolve every unique key to a row address
                    (insert, initialize, admit, lock)            -> CollectionPrefetch
    forward(kjt)    gather (and pool) rows by address; no hashing, no branching on storage
    backward        sum gradients per unique key, fused optimizer update of those rows, unlock

Both collections share all of it; they differ only in how a table's rows are looked up (pooled bags or
one row per id) and how the outputs are assembled.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
from torch import nn
from torch.profiler import record_function

from tieredemb.config import StorageConfig, TableConfig
from tieredemb.jagged import JaggedTensor, KeyedTensor, as_kjt
from tieredemb.modules.batch import Batch, TableBatch, check_keys, check_tables, layout_batch
from tieredemb.modules.cache_table import CacheTable
from tieredemb.modules.table import HbmTable, TablePrefetch, TableRows, TableStats
from tieredemb.ops import select_kernels
from tieredemb.ops.reference import bag_ids
from tieredemb.optim import SGD, EmbeddingOptimizer
from tieredemb.storage.backends import HostMemory


@dataclass
class CollectionPrefetch:
    """A batch resolved by prefetch: its layout and each table's addresses."""

    batch: Batch
    tables: dict[str, TablePrefetch]
    training: bool
    released: bool = False
    finalizer: weakref.finalize | None = field(default=None, repr=False)


class _Lookup(torch.autograd.Function):
    """Forward: per-table lookups by address. Backward: the fused optimizer step (returns no grads)."""

    @staticmethod
    def forward(ctx, dummy: torch.Tensor, module: _Collection, state: CollectionPrefetch):
        ctx.module, ctx.state = module, state
        # forward without backward (graph dropped) must still release the batch's locks
        state.finalizer = weakref.finalize(ctx, module._release, state)
        return tuple(module._lookup(name, state) for name in module._table_names)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.module._backward(ctx.state, grads)
        return None, None, None


class _Collection(nn.Module):
    """Shared machinery of both collections (not public)."""

    def __init__(self, tables: list[TableConfig], optimizer: EmbeddingOptimizer | None = None,
                 storage: StorageConfig | None = None, device: torch.device | str | None = None,
                 seed: int = 0, process_group: object | None = None, kernels: str = "auto") -> None:
        super().__init__()
        tables = list(tables)
        check_tables(tables)
        optimizer = SGD(lr=0.01) if optimizer is None else optimizer
        if not isinstance(optimizer, EmbeddingOptimizer):
            raise TypeError(f"optimizer must be one of te.optim's, got {type(optimizer).__name__}")
        storage = StorageConfig() if storage is None else storage
        if process_group is not None:
            raise NotImplementedError("process_group: row-wise sharding arrives with the sharding "
                                      "issue (#5, 'Row-wise sharding over torch.distributed')")
        self.device = torch.device(device if device is not None else "cpu")
        self.table_configs = tables
        self.optimizer = optimizer
        self.storage = storage
        self.seed = int(seed)
        self.storage_mode = _select_mode(tables, optimizer, storage)
        self.kernels = select_kernels(kernels, self.device)
        self._table_names = [t.name for t in tables]
        self._tables = _build_tables(self.storage_mode, tables, optimizer, storage, self.seed,
                                     self.device, self.kernels)
        self.step = 0  # optimizer steps taken (backward passes)
        self._clock = 0  # prefetches taken: the LRU score of a use
        self._queued: list[tuple[object, CollectionPrefetch]] = []
        # autograd needs an input that requires grad to call our backward
        self._dummy = torch.zeros(1, requires_grad=True)
        # prefetch may run on another thread and CUDA stream than forward/backward (TrainPipeline's
        # prefetch_in_thread): index and row-store changes take this lock, and on CUDA each one's
        # stream waits for the previous one's event, so they happen in one order on host and GPU
        self._lock = threading.RLock()
        self._mutated: torch.cuda.Event | None = None

    @contextmanager
    def _mutating(self):
        with self._lock:
            cuda = self.device.type == "cuda"
            if cuda and self._mutated is not None:
                torch.cuda.current_stream(self.device).wait_event(self._mutated)
            try:
                yield
            finally:
                if cuda:
                    self._mutated = torch.cuda.Event()
                    self._mutated.record(torch.cuda.current_stream(self.device))

    # ----------------------------------------------------------------------------- data path
    def prefetch(self, kjt: object) -> None:
        """Resolve ``kjt``'s rows now (checks, dedup, insert, lock); the next forward of the same
        batch object uses them."""
        with self._mutating():
            self._queued.append((kjt, self._resolve(kjt)))

    def _resolve(self, kjt: object) -> CollectionPrefetch:
        with record_function("## check_batch ##"):
            batch = layout_batch(kjt, self.table_configs, self.device, self._uses_weights)
        training = self.training
        if training:
            self._clock += 1
        tables = {}
        for name, tb in batch.tables.items():
            with record_function("## table.prefetch ##"):
                tables[name] = self._tables[name].prefetch(tb.ids, self._clock, training)
        return CollectionPrefetch(batch, tables, training)

    def _take_prefetched(self, kjt: object) -> CollectionPrefetch:
        """The oldest prefetched batch, which must be ``kjt`` (the same object, or equal): prefetch
        and forward see batches in the same order. Without a pending prefetch, resolve now."""
        with self._mutating():
            state = self._take_prefetched_locked(kjt)
        if self.device.type == "cuda":
            _hand_over(state, torch.cuda.current_stream(self.device))
        return state

    def _take_prefetched_locked(self, kjt: object) -> CollectionPrefetch:
        if not self._queued or (not self.training and self._queued[0][1].training):
            return self._resolve(kjt)  # nothing prefetched, or an eval forward between training steps
        queued, state = self._queued[0]
        if queued is not kjt and not _same_batch(queued, kjt):
            raise RuntimeError("forward got a batch other than the oldest prefetched one: prefetch "
                               "and forward must see the same batches in the same order")
        del self._queued[0]
        if state.training == self.training:
            return state
        self._release(state)  # prefetched in the other mode: resolve again
        return self._resolve(kjt)

    def _run(self, kjt: object) -> tuple[CollectionPrefetch, tuple[torch.Tensor, ...]]:
        state = self._take_prefetched(kjt)
        if state.training and torch.is_grad_enabled():
            return state, _Lookup.apply(self._dummy, self, state)
        try:
            return state, tuple(self._lookup(name, state) for name in self._table_names)
        finally:
            self._release(state)  # no backward will come

    def _backward(self, state: CollectionPrefetch, grads: tuple[torch.Tensor | None, ...]) -> None:
        if state.released:
            raise RuntimeError("backward ran twice through one embedding lookup (retain_graph?): "
                               "the fused optimizer steps once per forward")
        self.step += 1
        for name, grad in zip(self._table_names, grads):
            if grad is None:
                continue
            table, tpf = self._tables[name], state.tables[name]
            src, scale = self._grad_sources(state.batch.tables[name], name)
            g = self.kernels.reduce_grads(grad.contiguous(), src, scale, tpf.inverse,
                                          tpf.unique_keys.numel())
            self.kernels.optimizer_update(table.store, tpf.addresses, g, self.optimizer, self.step)
        self._release(state)

    def _release(self, state: CollectionPrefetch) -> None:
        with self._mutating():
            if state.released:
                return
            state.released = True
            if state.finalizer is not None:
                state.finalizer.detach()
            for name, tpf in state.tables.items():
                self._tables[name].release(tpf)

    # Subclasses: how one table's rows are looked up and how gradients map back to ids.
    _uses_weights = False

    def _lookup(self, name: str, state: CollectionPrefetch) -> torch.Tensor:
        raise NotImplementedError

    def _grad_sources(self, tb: TableBatch, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    # ------------------------------------------------------------------------------ row access
    def _table(self, name: str) -> HbmTable:
        if name not in self._tables:
            raise ValueError(f"unknown table {name!r}; tables are {self._table_names}")
        return self._tables[name]

    def read(self, table: str, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Current weights of ``keys`` (float32 (n, D); zeros where not stored) and ``found`` (bool
        (n,)). Inserts nothing and moves no score."""
        t = self._table(table)
        keys = check_keys(t.config, keys, self.device)
        with self._mutating():  # a cache-mode read may fetch from the backing store
            return t.read(keys)

    def write(self, table: str, keys: torch.Tensor, weights: torch.Tensor) -> None:
        """Upsert rows: keys int64 (n,) distinct, weights float (n, D). Optimizer state of those rows
        is reset to zero."""
        t = self._table(table)
        keys = check_keys(t.config, keys, self.device)
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
            raise TypeError(f"table {table!r}: weights must be a float tensor")
        if tuple(weights.shape) != (keys.numel(), t.dim):
            raise ValueError(f"table {table!r}: weights must have shape ({keys.numel()}, {t.dim}), "
                             f"got {tuple(weights.shape)}")
        if not bool(torch.isfinite(weights).all()):
            raise ValueError(f"table {table!r}: weights must be finite")
        if torch.unique(keys).numel() != keys.numel():
            raise ValueError(f"table {table!r}: write keys must be distinct")
        with self._mutating():
            t.write(keys, weights.to(device=self.device, dtype=torch.float32), self._clock)

    def close(self) -> None:
        """Flush and close the backing stores (files, connections). The collection is unusable after."""
        with self._mutating():
            self.flush()
            for t in self._tables.values():
                t.close()

    def flush(self) -> None:
        """Write every dirty cached row down to the backing store (a no-op in ``hbm_direct``)."""
        with self._mutating():
            for t in self._tables.values():
                t.flush()

    def export(self, table: str) -> TableRows:
        """Every stored row of ``table``: keys, weights, optimizer state and scores."""
        t = self._table(table)
        with self._mutating():
            return t.export()

    def stats(self) -> dict[str, TableStats]:
        """Per table: rows per tier, lookups, hits, misses, evictions, bytes."""
        with self._mutating():
            return {name: t.stats() for name, t in self._tables.items()}

    def extra_repr(self) -> str:
        dims = ", ".join(f"{t.name}:{t.embedding_dim}" for t in self.table_configs)
        return f"tables=[{dims}], optimizer={self.optimizer}, storage_mode={self.storage_mode!r}"


def _hand_over(state: CollectionPrefetch, stream: torch.cuda.Stream) -> None:
    """A prefetched batch's tensors may have been allocated on the prefetch stream; forward and
    backward read them on ``stream``. record_stream keeps the caching allocator from handing their
    blocks to the prefetch stream again before ``stream``'s use is done (the per-batch tensors are
    small and freed at unpredictable times by autograd, which rules out an event per buffer here)."""
    tensors = [t for tb in state.batch.tables.values()
               for t in (tb.ids, tb.lengths, tb.offsets, tb.weights) if t is not None]
    for tpf in state.tables.values():
        tensors += [getattr(tpf, f.name) for f in fields(tpf)
                    if isinstance(getattr(tpf, f.name), torch.Tensor)]
    for t in tensors:
        if t.is_cuda:
            t.record_stream(stream)


def _same_batch(a: object, b: object) -> bool:
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


def _row_bytes(t: TableConfig, optimizer: EmbeddingOptimizer) -> int:
    return (t.embedding_dim + optimizer.state_width(t.embedding_dim)) * 4


def _select_mode(tables: list[TableConfig], optimizer: EmbeddingOptimizer,
                 storage: StorageConfig) -> str:
    """``hbm_direct`` when there is no budget or the footprint fits it; over it, ``cache`` or
    ``hybrid`` by ``storage.caching`` (DESIGN section 3)."""
    if storage.hbm_budget is None:
        return "hbm_direct"
    footprint = sum(float("inf") if t.bounded_rows is None else t.bounded_rows * _row_bytes(t, optimizer)
                    for t in tables)
    if footprint <= storage.hbm_budget:
        return "hbm_direct"
    if not storage.caching and not isinstance(storage.backing, HostMemory):
        raise ValueError("hybrid mode (caching=False) keeps its overflow rows in host memory: its "
                         f"backing must be te.storage.HostMemory(), got {storage.backing!r}")
    return "cache" if storage.caching else "hybrid"


def _budget_rows(tables: list[TableConfig], optimizer: EmbeddingOptimizer, budget: int) -> list[int]:
    """Rows of each table on the device under ``budget`` bytes: shared in proportion to the tables'
    footprints when every table is bounded, else in equal bytes."""
    sizes = [t.bounded_rows for t in tables]
    if all(s is not None for s in sizes):
        total = sum(s * _row_bytes(t, optimizer) for s, t in zip(sizes, tables))
        shares = [s * _row_bytes(t, optimizer) / total for s, t in zip(sizes, tables)]
    else:
        shares = [1.0 / len(tables)] * len(tables)
    return [max(1, int(budget * f) // _row_bytes(t, optimizer)) for f, t in zip(shares, tables)]


def _build_tables(mode: str, tables: list[TableConfig], optimizer: EmbeddingOptimizer,
                  storage: StorageConfig, seed: int, device: torch.device, kernels) -> dict:
    """One storage object per table, of the mode's class."""
    common = dict(optimizer=optimizer, seed=seed, device=device, kernels=kernels,
                  bucket_width=storage.bucket_width, segment_rows=storage.segment_rows)
    if mode == "hbm_direct":
        return {t.name: HbmTable(t, **common) for t in tables}
    rows = _budget_rows(tables, optimizer, storage.hbm_budget)
    if mode == "hybrid":
        return {t.name: HbmTable(t, **common, device_segments=max(1, r // storage.segment_rows))
                for t, r in zip(tables, rows)}
    out = {}
    for t, r in zip(tables, rows):
        if t.max_capacity is not None:
            raise NotImplementedError(f"table {t.name!r}: max_capacity in cache mode (a bound over all "
                                      "tiers) is not built yet; use hbm_direct or hybrid mode")
        width = t.embedding_dim + optimizer.state_width(t.embedding_dim)
        backend = storage.backing.open(t.name, width, device)
        out[t.name] = CacheTable(t, **common, cache_rows=r, backend=backend)
    return out


class EmbeddingBagCollection(_Collection):
    """Pooled embedding lookups for several features over raw-ID tables, with a fused optimizer.

    Args:
        tables: the tables (``te.TableConfig``); each feature belongs to exactly one.
        optimizer: ``te.optim.SGD | Adagrad | RowWiseAdagrad | Adam`` (applied inside backward).
        storage: ``te.StorageConfig``; default: everything on ``device``.
        device: compute device (``"cpu"`` or ``"cuda"``); the same code and results on both.
        seed: seed of the initial rows (a pure function of seed, table name and key).
        process_group: ``torch.distributed`` group to shard the tables over (sharding issue).
        kernels: ``"auto"`` (Triton on CUDA), ``"torch"`` (the reference) or ``"triton"``.

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

    def forward(self, kjt: object) -> KeyedTensor:
        state, outs = self._run(kjt)
        b = state.batch.batch_size
        keys, dims, blocks = [], [], []
        for t, out in zip(self.table_configs, outs):
            # (F_t * B, D) feature-major -> F_t blocks of (B, D)
            for i, f in enumerate(t.feature_names):
                keys.append(f)
                dims.append(t.embedding_dim)
                blocks.append(out[i * b : (i + 1) * b])
        return KeyedTensor(keys, dims, torch.cat(blocks, dim=1))

    def _lookup(self, name: str, state: CollectionPrefetch) -> torch.Tensor:
        tb, tpf = state.batch.tables[name], state.tables[name]
        scale = self._scale(tb, name)
        return self.kernels.gather_pool(self._tables[name].store, tpf.addresses[tpf.inverse],
                                        tb.offsets, scale, self._tables[name].dim)

    def _scale(self, tb: TableBatch, name: str) -> torch.Tensor | None:
        """float32 (n,) per-id factor: weight, divided by the bag length for mean pooling."""
        scale = tb.weights
        if self._tables[name].config.pooling == "mean":
            bag = bag_ids(tb.offsets, tb.ids.numel())
            inv_len = 1.0 / tb.lengths.clamp(min=1).to(torch.float32)
            scale = inv_len[bag] if scale is None else scale * inv_len[bag]
        return scale

    def _grad_sources(self, tb: TableBatch, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return bag_ids(tb.offsets, tb.ids.numel()), self._scale(tb, name)


class EmbeddingCollection(_Collection):
    """Sequence (unpooled) embedding lookups: one row per id.

    Same arguments as ``EmbeddingBagCollection``. ``forward(kjt)`` returns ``dict[feature,
    te.JaggedTensor]`` with values (n_f, D) and the batch's lengths. Per-id weights are ignored and
    ``pooling`` does not apply.
    """

    def forward(self, kjt: object) -> dict[str, JaggedTensor]:
        state, outs = self._run(kjt)
        b = state.batch.batch_size
        result: dict[str, JaggedTensor] = {}
        for t, out in zip(self.table_configs, outs):
            tb = state.batch.tables[t.name]
            start = 0
            for i, (f, n) in enumerate(zip(t.feature_names, tb.ids_per_feature)):
                result[f] = JaggedTensor(out[start : start + n], tb.lengths[i * b : (i + 1) * b])
                start += n
        return result

    def _lookup(self, name: str, state: CollectionPrefetch) -> torch.Tensor:
        tpf = state.tables[name]
        return self.kernels.gather(self._tables[name].store, tpf.addresses[tpf.inverse],
                                   self._tables[name].dim)

    def _grad_sources(self, tb: TableBatch, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch.arange(tb.ids.numel(), device=self.device), None
