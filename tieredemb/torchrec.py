"""TorchRec's embedding modules, backed by tieredemb's tables: change one import, add ``optimizer=``.

``EmbeddingBagCollection`` and ``EmbeddingCollection`` here take TorchRec's own config lists
(``torchrec.EmbeddingBagConfig`` / ``torchrec.EmbeddingConfig``) and answer like TorchRec's modules:
a ``torchrec.KeyedTensor`` or a ``dict[str, torchrec.JaggedTensor]`` named as TorchRec names them
(``feature@table`` for a feature several tables read), ``embedding_bag_configs()`` /
``embedding_configs()``, ``is_weighted()``, ``device``; batch features no table reads are ignored.
Underneath they are ``te.EmbeddingBagCollection`` / ``te.EmbeddingCollection``: rows keyed by id in
tiers, the optimizer fused into the backward (so the tables are not parameters and the dense
optimizer never sees them), ``read``/``write``/``flush``/``stats``/checkpoints as there.

Example::

    import tieredemb as te
    from tieredemb.torchrec import EmbeddingBagCollection   # was: from torchrec import ...

    ebc = EmbeddingBagCollection(
        tables=[torchrec.EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=1000,
                                            feature_names=["f1"])],
        optimizer=te.optim.Adam(lr=0.01))
    model = torchrec.models.dlrm.DLRM(ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8],
                                      over_arch_layer_sizes=[16, 1])

TorchRec is optional for tieredemb but needed here (see ``docs/torchrec.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Mapping, Sequence

import torch

from tieredemb.config import StorageConfig, TableConfig
from tieredemb.init import Initializer, Uniform
from tieredemb.jagged import KeyedJaggedTensor, as_kjt
from tieredemb.modules import EmbeddingBagCollection as _OurEBC
from tieredemb.modules import EmbeddingCollection as _OurEC
from tieredemb.optim import EmbeddingOptimizer

try:
    import torchrec
    from torchrec.modules.embedding_configs import (
        BaseEmbeddingConfig,
        DataType,
        EmbeddingBagConfig,
        EmbeddingConfig,
        PoolingType,
    )
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "tieredemb.torchrec needs TorchRec. It pins a torch of its own, so install it without its "
        "dependencies: pip install fbgemm-gpu-cpu==1.8.0 (or fbgemm-gpu on CUDA), then "
        "pip install --no-deps torchrec==1.8.0 (see README, 'TorchRec / FBGEMM interop')"
    ) from exc

__all__ = ["EmbeddingBagCollection", "EmbeddingCollection"]

# ``EmbeddingBagCollectionSharder`` and ``EmbeddingCollectionSharder``, for TorchRec's
# DistributedModelParallel, are in ``tieredemb/torchrec_dmp.py``, which imports this module: they are
# loaded on first use of their names here rather than at import
_SHARDERS = frozenset({"EmbeddingBagCollectionSharder", "EmbeddingCollectionSharder"})


def __getattr__(name: str) -> object:
    if name in _SHARDERS:
        return getattr(importlib.import_module("tieredemb.torchrec_dmp"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# the config fields translated into a te.TableConfig; every other field must keep its default
_MAPPED = frozenset({"name", "embedding_dim", "num_embeddings", "feature_names", "pooling", "data_type",
                     "weight_init_min", "weight_init_max", "init_fn"})
_POOLING = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


# --------------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------------


def _field_default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _check_fields(config: BaseEmbeddingConfig, where: str) -> None:
    """Every field tieredemb does not translate is at its default: a ValueError names the first that
    is not."""
    for f in dataclasses.fields(config):
        if f.name in _MAPPED:
            continue
        value, default = getattr(config, f.name), _field_default(f)
        if default is dataclasses.MISSING or value != default:
            raise ValueError(f"{where}: {type(config).__name__}.{f.name}={value!r} is not supported by "
                             f"tieredemb.torchrec (only its default, {default!r})")


def _row_dtype(config: BaseEmbeddingConfig, where: str) -> torch.dtype:
    """The rows' dtype for TorchRec's ``data_type``: FP32, FP16 and BF16 (weights and optimizer
    state stored so, the math in float32, stochastic rounding: ``te.TableConfig.dtype``)."""
    dtypes = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
    if config.data_type in dtypes:
        return dtypes[config.data_type]
    given = f"data_type=DataType.{getattr(config.data_type, 'name', config.data_type)}"
    raise ValueError(f"{where}: {given} is not supported: use DataType.FP32, FP16 or BF16")


def _initializer(config: BaseEmbeddingConfig, where: str) -> Initializer:
    """TorchRec's uniform initializer (``weight_init_min``/``weight_init_max``, which TorchRec turns
    into ``init_fn=partial(torch.nn.init.uniform_, a=..., b=...)``) as ``te.init.Uniform``."""
    fn = config.init_fn
    if fn is None:
        return Uniform(config.get_weight_init_min(), config.get_weight_init_max())
    if (isinstance(fn, functools.partial) and fn.func is torch.nn.init.uniform_ and not fn.args
            and set(fn.keywords) <= {"a", "b"}):
        return Uniform(float(fn.keywords.get("a", 0.0)), float(fn.keywords.get("b", 1.0)))
    raise ValueError(
        f"{where}: init_fn={fn!r} is not supported: tieredemb draws a row's initial value from (seed, "
        "table, id) when the id is first seen, not from a function over a whole weight tensor. Use "
        "weight_init_min/weight_init_max (uniform), or pass initializers={table name: te.init...}"
    )


def _table(config: BaseEmbeddingConfig, kind: type, names: list[str],
           initializer: Initializer | None) -> TableConfig:
    """One TorchRec config as a ``te.TableConfig`` whose features are the TorchRec output names."""
    where = f"table {config.name!r}"
    _check_fields(config, where)
    dtype = _row_dtype(config, where)
    pooling = "sum"
    if kind is EmbeddingBagConfig:
        if config.pooling not in _POOLING:
            extra = " (no pooling: use tieredemb.torchrec.EmbeddingCollection)" \
                if config.pooling == PoolingType.NONE else ""
            given = f"pooling=PoolingType.{getattr(config.pooling, 'name', config.pooling)}"
            raise ValueError(f"{where}: {given} is not supported{extra}; use "
                             "PoolingType.SUM or PoolingType.MEAN")
        pooling = _POOLING[config.pooling]
    init = initializer if initializer is not None else _initializer(config, where)
    return TableConfig(name=config.name, embedding_dim=config.embedding_dim, feature_names=names,
                       num_embeddings=config.num_embeddings, pooling=pooling, initializer=init,
                       dtype=dtype)


def _features_of(config: BaseEmbeddingConfig) -> list[str]:
    """A table's features; none: its own name (TorchRec's rule)."""
    return list(config.feature_names) if config.feature_names else [config.name]


def _output_names(configs: Sequence[BaseEmbeddingConfig]) -> list[list[str]]:
    """Per table, the output name of each of its features: the feature's own name, or
    ``feature@table`` where several tables read that feature (TorchRec's naming)."""
    readers: dict[str, int] = {}
    for c in configs:
        for f in _features_of(c):
            readers[f] = readers.get(f, 0) + 1
    return [[f if readers[f] == 1 else f"{f}@{c.name}" for f in _features_of(c)] for c in configs]


def _tables(configs: Sequence[BaseEmbeddingConfig], kind: type,
            initializers: Mapping[str, Initializer] | None) -> tuple[list[TableConfig], list[str]]:
    """The te tables of ``configs`` and, per output feature in table order, the batch feature it reads."""
    if isinstance(configs, BaseEmbeddingConfig) or not isinstance(configs, Sequence):
        raise TypeError(f"tables must be a list of torchrec {kind.__name__}")
    for c in configs:
        if type(c) is not kind:
            hint = " (te.TableConfig goes to te.EmbeddingBagCollection/te.EmbeddingCollection)" \
                if isinstance(c, TableConfig) else ""
            raise TypeError(f"tables must be torchrec {kind.__name__}, got {type(c).__name__}{hint}")
    initializers = dict(initializers or {})
    known = {c.name for c in configs}
    unknown = sorted(set(initializers) - known)
    if unknown:
        raise ValueError(f"initializers names tables {unknown} that are not in tables")
    tables = [_table(c, kind, names, initializers.get(c.name))
              for c, names in zip(configs, _output_names(configs))]
    return tables, [f for c in configs for f in _features_of(c)]


def _adopt_feature_names(configs: Sequence[BaseEmbeddingConfig]) -> None:
    """A config without features gets its own name as its feature, as TorchRec's collections set it
    (a model reading the configs then finds it); done once the collection is built."""
    for c in configs:
        c.feature_names = _features_of(c)


def _check_device(device: object) -> None:
    if isinstance(device, bool):
        raise TypeError("device got a bool: TorchRec's second positional argument is is_weighted, which "
                        "tieredemb.torchrec takes by keyword only (is_weighted=...)")
    if device is not None and torch.device(device).type == "meta":
        raise ValueError("device 'meta' holds no rows: tieredemb.torchrec builds its tables on 'cpu' or "
                         "'cuda' (TorchRec's meta-then-shard flow does not apply)")


# --------------------------------------------------------------------------------------------------
# batches
# --------------------------------------------------------------------------------------------------


class _Features:
    """A TorchRec batch as the te collection's batch: the features the tables read, in table order,
    a feature several tables read once per table (under its output name); the others dropped.

    A batch whose features are exactly the tables' (the common case) goes through as it is, so a
    pipeline's prefetch finds it by identity. Otherwise a new batch is built (its per-feature sizes
    read on the host); a prefetched one is remembered until its forward takes it or it is withdrawn.
    """

    def __init__(self, names: list[str], sources: list[str]) -> None:
        self.names = names  # the te collection's features (TorchRec's output names)
        self.sources = sources  # the batch feature each reads
        self.as_is = sorted(names) if names == sources else None  # no feature read twice
        self._prefetched: dict[int, tuple[object, object]] = {}

    def convert(self, batch: object) -> object:
        _check_batch_type(batch)
        keys = list(batch.keys())
        if self.as_is is not None and sorted(keys) == self.as_is:
            return batch
        missing = [f for f in dict.fromkeys(self.sources) if f not in keys]
        if missing:
            raise ValueError(f"batch is missing features {missing}; it has {keys}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"batch has duplicate feature names: {keys}")
        return _select(as_kjt(batch), keys, self.names, self.sources)

    def remember(self, batch: object) -> object:
        """``convert`` for a prefetch: the same converted batch is found again by ``find``."""
        ours = self.convert(batch)
        if ours is not batch:
            self._prefetched[id(batch)] = (batch, ours)
        return ours

    def find(self, batch: object, forget: bool = False) -> object:
        """The batch ``remember`` converted (dropped from memory with ``forget``), else ``convert``."""
        entry = self._prefetched.get(id(batch))
        if entry is None or entry[0] is not batch:
            return self.convert(batch)
        if forget:
            del self._prefetched[id(batch)]
        return entry[1]


def _check_batch_type(batch: object) -> None:
    if isinstance(batch, KeyedJaggedTensor):
        return
    if not isinstance(batch, torchrec.KeyedJaggedTensor):
        raise TypeError(f"expected a torchrec.KeyedJaggedTensor or te.KeyedJaggedTensor, got "
                        f"{type(batch).__module__}.{type(batch).__name__}")
    if batch.variable_stride_per_key() or batch.inverse_indices_or_none() is not None:
        raise ValueError("batches with a variable batch size per feature (TorchRec's VBE: "
                         "stride_per_key_per_rank, inverse_indices) are not supported")


def _select(kjt: KeyedJaggedTensor, keys: list[str], names: list[str],
            sources: list[str]) -> KeyedJaggedTensor:
    """The features ``sources`` of ``kjt`` (keys ``keys``) in that order, as features ``names``."""
    values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
    if values.dim() != 1 or lengths.dim() != 1 or lengths.numel() % len(keys):
        raise ValueError(f"batch values {tuple(values.shape)} and lengths {tuple(lengths.shape)} do not "
                         f"make {len(keys)} features of one batch size")
    per_feature = lengths.view(len(keys), -1)
    sizes = per_feature.sum(dim=1).tolist()  # ids per batch feature: one host read
    if sum(sizes) != values.numel():
        raise ValueError(f"batch lengths sum to {sum(sizes)} but values has {values.numel()} ids")
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    pick = [keys.index(s) for s in sources]

    def take(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[starts[i] : starts[i + 1]] for i in pick])

    return KeyedJaggedTensor(names, take(values), lengths=per_feature[pick].reshape(-1),
                             weights=None if weights is None else take(weights))


def _traced(module: torch.nn.Module, features: torch.fx.Proxy) -> torch.fx.Proxy:
    """Under ``torch.fx`` (``torchrec.fx.symbolic_trace`` too) the collection is one call of itself
    in the graph, a leaf: its lookups depend on the ids and cannot be traced through."""
    tracer = features.tracer
    return tracer.create_proxy("call_module", tracer.path_of_module(module), (features,), {})


class _TorchRecBatches:
    """What both collections add to a te collection: TorchRec batches converted on the way in, in
    forward and in every prefetch verb, so a prefetch and its forward see the same converted batch."""

    _features: _Features

    def prefetch(self, kjt: object) -> None:
        super().prefetch(self._features.remember(kjt))

    def prefetch_deferred(self, kjt: object) -> None:
        super().prefetch_deferred(self._features.remember(kjt))

    def finish_prefetch(self, kjt: object) -> None:
        super().finish_prefetch(self._features.find(kjt))

    def is_prefetched(self, kjt: object) -> bool:
        return super().is_prefetched(self._features.find(kjt))

    def withdraw(self, kjt: object) -> None:
        super().withdraw(self._features.find(kjt, forget=True))

    def init_arguments(self) -> dict[str, object]:
        """The keyword arguments the collection was built with, but ``device`` and
        ``process_group`` (a sharder for ``DistributedModelParallel`` rebuilds it from them)."""
        return dict(self._arguments)


# --------------------------------------------------------------------------------------------------
# the collections
# --------------------------------------------------------------------------------------------------


class EmbeddingBagCollection(_TorchRecBatches, _OurEBC):
    """TorchRec's ``EmbeddingBagCollection`` over tieredemb's tables (pooled lookups).

    Args:
        tables: ``torchrec.EmbeddingBagConfig`` list. Read: ``name``, ``embedding_dim``,
            ``num_embeddings`` (ids in ``[0, num_embeddings)``; only the ids used take memory),
            ``feature_names``, ``pooling`` (``SUM`` or ``MEAN``), ``data_type`` (``FP32``, ``FP16``,
            ``BF16``: the rows' dtype), ``weight_init_min``/``weight_init_max`` (uniform initial
            rows). Any other field at a value other than its default, or a custom ``init_fn``, is
            refused naming it.
        device: compute device, ``"cpu"`` (default) or ``"cuda"``.
        optimizer: ``te.optim.SGD | Adagrad | RowWiseAdagrad | Adam``, applied to the touched rows
            inside ``loss.backward()``.
        storage: ``te.StorageConfig`` (default: every row on ``device``).
        seed: seed of the initial rows (a pure function of seed, table name and id).
        process_group: a ``torch.distributed`` group to shard the tables row-wise over.
        is_weighted: per-id weights of the batch multiply the rows before pooling (TorchRec's
            ``is_weighted``; keyword-only here). When False a batch's weights are ignored.
        initializers: ``{table name: te.init.*}``: initial rows other than TorchRec's uniform.
        kernels, capture: as for ``te.EmbeddingBagCollection``.

    ``forward(features)`` takes a ``torchrec.KeyedJaggedTensor`` (or ours) holding at least the
    tables' features and returns a ``torchrec.KeyedTensor`` (B, sum of dims), keys in table order.
    """

    def __init__(self, tables: list[EmbeddingBagConfig], device: torch.device | str | None = None, *,
                 optimizer: EmbeddingOptimizer, storage: StorageConfig | None = None, seed: int = 0,
                 process_group: object | None = None, is_weighted: bool = False,
                 initializers: Mapping[str, Initializer] | None = None, kernels: str = "auto",
                 capture: bool | None = None) -> None:
        _check_device(device)
        ours, sources = _tables(tables, EmbeddingBagConfig, initializers)
        if is_weighted and any(t.pooling == "mean" for t in ours):
            mean = [t.name for t in ours if t.pooling == "mean"]
            raise ValueError(f"is_weighted=True with PoolingType.MEAN tables {mean}: per-id weights "
                             "apply to SUM pooling only (as in torch.nn.EmbeddingBag)")
        self._weighted = bool(is_weighted)  # read by the te collection's constructor (_uses_weights)
        super().__init__(ours, optimizer=optimizer, storage=storage, device=device, seed=seed,
                         process_group=process_group, kernels=kernels, capture=capture)
        _adopt_feature_names(tables)
        self._configs = tables
        self._arguments = dict(optimizer=optimizer, storage=storage, seed=seed, is_weighted=is_weighted,
                               initializers=initializers, kernels=kernels, capture=capture)
        self._features = _Features([f for t in ours for f in t.feature_names], sources)

    @property
    def _uses_weights(self) -> bool:  # a batch's weights count only in a weighted collection
        return self._weighted

    def forward(self, features: object) -> torchrec.KeyedTensor:
        if isinstance(features, torch.fx.Proxy):
            return _traced(self, features)
        batch = self._features.find(features, forget=True)
        if self._weighted and batch.weights_or_none() is None:
            raise ValueError("this EmbeddingBagCollection is weighted (is_weighted=True) but the batch "
                             "has no weights")
        kt = super().forward(batch)
        return torchrec.KeyedTensor(keys=kt.keys(), length_per_key=kt.length_per_key(), values=kt.values())

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._weighted


class EmbeddingCollection(_TorchRecBatches, _OurEC):
    """TorchRec's ``EmbeddingCollection`` over tieredemb's tables (one row per id, no pooling).

    Args:
        tables: ``torchrec.EmbeddingConfig`` list, all of one ``embedding_dim`` (as TorchRec requires);
            the fields read are those of ``EmbeddingBagCollection`` but ``pooling``.
        need_indices: each output ``JaggedTensor`` carries its ids as ``weights()`` (TorchRec's option).
        device, optimizer, storage, seed, process_group, initializers, kernels, capture: as for
            ``EmbeddingBagCollection``.

    ``forward(features)`` returns ``dict[str, torchrec.JaggedTensor]``: per output name (the
    feature, or ``feature@table`` where several tables read it), values (ids, D) and the lengths.
    Per-id weights of the batch are ignored.
    """

    def __init__(self, tables: list[EmbeddingConfig], device: torch.device | str | None = None, *,
                 optimizer: EmbeddingOptimizer, storage: StorageConfig | None = None, seed: int = 0,
                 process_group: object | None = None, need_indices: bool = False,
                 initializers: Mapping[str, Initializer] | None = None, kernels: str = "auto",
                 capture: bool | None = None) -> None:
        _check_device(device)
        ours, sources = _tables(tables, EmbeddingConfig, initializers)
        dims = {t.embedding_dim for t in ours}
        if len(dims) > 1:
            raise ValueError(f"all tables of an EmbeddingCollection need one embedding_dim (as in "
                             f"TorchRec), got {[(t.name, t.embedding_dim) for t in ours]}")
        super().__init__(ours, optimizer=optimizer, storage=storage, device=device, seed=seed,
                         process_group=process_group, kernels=kernels, capture=capture)
        _adopt_feature_names(tables)
        self._configs = tables
        self._arguments = dict(optimizer=optimizer, storage=storage, seed=seed, need_indices=need_indices,
                               initializers=initializers, kernels=kernels, capture=capture)
        self._need_indices = bool(need_indices)
        self._names_by_table = [list(t.feature_names) for t in ours]
        self._features = _Features([f for t in ours for f in t.feature_names], sources)

    def forward(self, features: object) -> dict[str, torchrec.JaggedTensor]:
        if isinstance(features, torch.fx.Proxy):
            return _traced(self, features)
        batch = self._features.find(features, forget=True)
        out = super().forward(batch)
        ids = as_kjt(batch).to_dict() if self._need_indices else {}
        return {name: torchrec.JaggedTensor(values=jt.values(), lengths=jt.lengths(),
                                            weights=ids[name].values() if ids else None)
                for name, jt in out.items()}

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._configs

    def embedding_dim(self) -> int:
        return self.table_configs[0].embedding_dim

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_names_by_table(self) -> list[list[str]]:
        return [list(n) for n in self._names_by_table]
