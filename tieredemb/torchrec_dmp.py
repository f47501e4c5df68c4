"""Sharders for TorchRec's ``DistributedModelParallel`` (DMP): tieredemb's TorchRec collections,
sharded row-wise over DMP's process group by tieredemb's own routing.

``DistributedModelParallel(model, sharders=[EmbeddingBagCollectionSharder()])`` asks TorchRec's
planner for a plan, then hands each ``tieredemb.torchrec.EmbeddingBagCollection`` of the model to
the sharder, which returns a ``ShardedEmbeddingBagCollection``: the same collection rebuilt over
``env.process_group`` (its rows moved to their owners), with TorchRec's ``ShardedModule`` stages on
top, so ``TrainPipelineSparseDist`` can run a batch's input dist while the step before it computes.

The stages, per batch:

    input_dist            this rank's distinct (table, id) pairs to their owners (an all-to-all of
                          split sizes, then one of the pairs); each owner resolves what it received
                          (insert, fetch from the backing store, lock): the collection's prefetch.
                          The batch itself stays on its rank (no KJT all-to-all): the awaitable
                          TorchRec's pipeline waits on returns it as it is
    compute_and_output_dist
                          the owners gather the rows, send them back (one all-to-all), the
                          requester pools them for its bags: the collection's forward
    backward              the gradient of each pair to its owner (one all-to-all), the fused
                          optimizer there

What the planner sees: each table as a ``(rows, dim)`` tensor on the ``meta`` device, ``rows`` the
rows the table may keep in device memory over all ranks (``num_embeddings``; under an
``hbm_budget`` too small for that, the budget's share of the table times the world size), sharding
type ``row_wise`` and compute kernel ``customized_kernel`` only. See ``docs/torchrec.md``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torchrec.optim as trec_optim
from torch import nn
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, KJTList
from torchrec.distributed.types import (
    LazyAwaitable,
    LazyNoWait,
    ModuleSharder,
    NoWait,
    ParameterSharding,
    ShardedModule,
    ShardingEnv,
    ShardingType,
)
from torchrec.streamable import Multistreamable

from tieredemb import optim
from tieredemb.torchrec import EmbeddingBagCollection, EmbeddingCollection

__all__ = ["EmbeddingBagCollectionSharder", "EmbeddingCollectionSharder", "ShardedEmbeddingBagCollection",
           "ShardedEmbeddingCollection"]

SHARDING_TYPE = ShardingType.ROW_WISE.value
COMPUTE_KERNEL = EmbeddingComputeKernel.FUSED.value  # the optimizer fused into the backward

# the torch optimizer whose state size TorchRec's planner knows, per te optimizer (its estimate of a
# table's memory adds the optimizer state: 0x for SGD, 1x for Adagrad, 2x for Adam, a column a row)
_PLANNER_OPTIMIZERS = {optim.SGD: torch.optim.SGD, optim.Adagrad: torch.optim.Adagrad,
                       optim.RowWiseAdagrad: trec_optim.RowWiseAdagrad, optim.Adam: torch.optim.Adam}


class ShardingContext(Multistreamable):
    """A batch's context between the stages: nothing to carry (the collection's queue of batches in
    flight holds what the input dist resolved)."""

    def record_stream(self, stream: torch.Stream) -> None:
        pass


class _Stages(ShardedModule):
    """TorchRec's ``ShardedModule`` stages over a tieredemb collection sharded by its own routing
    (a mixin: the class using it derives from the collection first)."""

    def create_context(self) -> ShardingContext:
        return ShardingContext()

    def input_dist(self, ctx: ShardingContext, features: Any) -> KJTListSplitsAwaitable:
        """The batch's pairs to their owners and resolved there (a collective), unless the batch was
        prefetched already (``te.TrainPipeline``); an awaitable of the batch as it is."""
        if not self.is_prefetched(features):
            self.prefetch(features)
        return KJTListSplitsAwaitable([NoWait(NoWait(features))], ctx)

    def compute(self, ctx: ShardingContext, dist_input: KJTList) -> Any:
        """The collection's forward on the batch its input dist resolved: the owners' gather, the
        rows' all-to-all back and the pooling (or the per-id rows)."""
        return self.unsharded_module_type.forward(self, dist_input[0])

    def output_dist(self, ctx: ShardingContext, output: Any) -> LazyAwaitable:
        return LazyNoWait(output)  # the rows came back in compute

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if inputs and isinstance(inputs[0], torch.fx.Proxy):  # a leaf in a traced graph, as unsharded
            return self.unsharded_module_type.forward(self, *inputs)
        return ShardedModule.forward(self, *inputs, **kwargs)

    def sharded_parameter_names(self, prefix: str = "") -> Iterator[str]:
        return iter(())  # the tables are not parameters; DDP never sees them


class ShardedEmbeddingBagCollection(EmbeddingBagCollection, _Stages):
    """``tieredemb.torchrec.EmbeddingBagCollection`` sharded row-wise over a process group, with
    TorchRec's ``ShardedModule`` stages (what ``EmbeddingBagCollectionSharder`` returns). Everything
    of the collection is there (``read``, ``write``, ``stats``, ``state_dict``, ``te.checkpoint``);
    ``forward`` returns a ``LazyAwaitable`` of the ``torchrec.KeyedTensor``, as TorchRec's does."""

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return EmbeddingBagCollection


class ShardedEmbeddingCollection(EmbeddingCollection, _Stages):
    """``tieredemb.torchrec.EmbeddingCollection`` sharded row-wise over a process group, with
    TorchRec's ``ShardedModule`` stages (what ``EmbeddingCollectionSharder`` returns); ``forward``
    returns a ``LazyAwaitable`` of the ``dict[str, torchrec.JaggedTensor]``."""

    @property
    def unsharded_module_type(self) -> type[nn.Module]:
        return EmbeddingCollection


# --------------------------------------------------------------------------------------------------
# the sharders
# --------------------------------------------------------------------------------------------------


class _Sharder(ModuleSharder):
    """What both sharders share; ``_unsharded`` and ``_sharded`` name the two classes."""

    _unsharded: type
    _sharded: type

    @property
    def module_type(self) -> type:
        return self._unsharded

    @property
    def fused_params(self) -> None:
        """None: the optimizer is the collection's own (older planners read this of every sharder)."""
        return None

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [SHARDING_TYPE]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [COMPUTE_KERNEL]

    def shardable_parameters(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Per table, the tensor TorchRec's planner sizes: ``(rows, dim)`` on ``meta``, ``rows`` what
        the table may keep in device memory over all ranks (``planner_rows``)."""
        rows = planner_rows(module, _planner_world())
        out = {}
        for t in module.table_configs:
            meta = torch.empty((rows[t.name], t.embedding_dim), dtype=t.dtype, device="meta")
            meta._optimizer_classes = [_PLANNER_OPTIMIZERS.get(type(module.optimizer))]
            out[t.name] = meta
        return out

    def shard(self, module: nn.Module, params: dict[str, ParameterSharding], env: ShardingEnv,
              device: torch.device | None = None, module_fqn: str | None = None) -> ShardedModule:
        """The collection rebuilt over ``env.process_group`` on ``device`` (DMP's), the rows rank 0's
        copy held moved to their owners (a collective, as DDP takes rank 0's dense parameters); the
        given one is closed."""
        check_plan(module, params, env, module_fqn)
        configs = (module.embedding_bag_configs() if isinstance(module, EmbeddingBagCollection)
                   else module.embedding_configs())
        sharded = self._sharded(configs, module.device if device is None else device,
                                process_group=env.process_group, **module.init_arguments())
        rank = torch.distributed.get_rank(env.process_group)
        sharded.load_state_dict(rows_of_rank0(module.state_dict(), rank))  # each row to its owner
        module.close()
        return sharded


class EmbeddingBagCollectionSharder(_Sharder):
    """Shards ``tieredemb.torchrec.EmbeddingBagCollection`` for ``DistributedModelParallel``: its
    tables row-wise over DMP's process group by tieredemb's routing (a hash of table and id).

    Example::

        model = DLRM(tieredemb.torchrec.EmbeddingBagCollection(configs, optimizer=te.optim.Adam()), ...)
        model = DistributedModelParallel(model, device=device,
                                         sharders=[EmbeddingBagCollectionSharder(),
                                                   *torchrec.distributed.sharding_plan.get_default_sharders()])

    The planner gets sharding type ``row_wise`` and compute kernel ``customized_kernel`` for every
    table (the only ones offered); a plan with any other is refused when sharding.
    """

    _unsharded = EmbeddingBagCollection
    _sharded = ShardedEmbeddingBagCollection


class EmbeddingCollectionSharder(_Sharder):
    """Shards ``tieredemb.torchrec.EmbeddingCollection`` for ``DistributedModelParallel``, as
    ``EmbeddingBagCollectionSharder`` does the pooled collection."""

    _unsharded = EmbeddingCollection
    _sharded = ShardedEmbeddingCollection


# --------------------------------------------------------------------------------------------------
# the plan
# --------------------------------------------------------------------------------------------------


def check_plan(module: nn.Module, params: dict[str, ParameterSharding], env: ShardingEnv,
               path: str | None = None) -> None:
    """A ValueError naming what is wrong, before anything changes: a module sharded already, a
    sharding environment without a process group, a table the plan leaves out or a plan entry that is
    no table, a sharding type or compute kernel other than ours, or ranks other than all of them."""
    where = f"module {path!r}" if path else type(module).__name__
    if module.process_group is not None:
        raise ValueError(f"{where} was built with process_group=: it is sharded already; give "
                         "DistributedModelParallel a collection built without one")
    if env.process_group is None:
        raise ValueError(f"{where}: tieredemb's sharder needs a process group (ShardingEnv"
                         ".from_process_group); ShardingEnv.from_local has none")
    names = [t.name for t in module.table_configs]
    missing = [n for n in names if n not in params]
    extra = sorted(set(params) - set(names))
    if missing or extra:
        raise ValueError(f"{where}: the sharding plan must name exactly its tables {names}; "
                         f"missing {missing}, not tables {extra}")
    for name in names:
        ps = params[name]
        if ps.sharding_type != SHARDING_TYPE:
            raise ValueError(f"{where}, table {name!r}: sharding type {ps.sharding_type!r} is not "
                             f"supported by tieredemb's sharder, only {SHARDING_TYPE!r} (rows spread "
                             "over every rank by a hash of table and id)")
        if ps.compute_kernel != COMPUTE_KERNEL:
            raise ValueError(f"{where}, table {name!r}: compute kernel {ps.compute_kernel!r} is not "
                             f"supported by tieredemb's sharder, only {COMPUTE_KERNEL!r}")
        if ps.ranks is not None and sorted(ps.ranks) != list(range(env.world_size)):
            raise ValueError(f"{where}, table {name!r}: planned on ranks {ps.ranks}; tieredemb shards a "
                             f"table over all {env.world_size} ranks of the process group")


def rows_of_rank0(state: dict, rank: int) -> dict:
    """A collection's ``state_dict`` as this rank offers it to the sharded collection's (collective)
    ``load_state_dict``: rank 0 all its rows, the others none (a row offered by two ranks would be
    imported twice), every rank its own ``step`` and ``clock``."""
    if rank == 0:
        return state
    return {k: torch.empty((0, *v.shape[1:]), dtype=v.dtype) if k.rsplit(".", 1)[-1] in _ROW_ENTRIES else v
            for k, v in state.items()}


_ROW_ENTRIES = frozenset({"keys", "scores", "weights", "optimizer_state", "admission_keys",
                          "admission_counts"})


def _planner_world() -> int:
    """The world size the planner plans for: ``shardable_parameters`` is not told, so the default
    group's (DMP plans over it unless given an env); 1 without torch.distributed."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def planner_rows(module: nn.Module, world: int) -> dict[str, int]:
    """Per table, the rows it may keep in device memory over ``world`` ranks: ``num_embeddings``
    when every shard fits the per-rank ``hbm_budget`` (or there is none); else each rank's budget
    shared over the tables in proportion to their shards' bytes, times ``world``."""
    tables, opt, budget = module.table_configs, module.optimizer, module.storage.hbm_budget
    row_bytes = {t.name: (t.embedding_dim + opt.state_width(t.embedding_dim)) * t.dtype.itemsize
                 for t in tables}
    full = {t.name: t.num_embeddings if t.num_embeddings is not None else (t.max_capacity or 1) * world
            for t in tables}
    shard_bytes = {t.name: -(-full[t.name] // world) * row_bytes[t.name] for t in tables}
    if budget is None or sum(shard_bytes.values()) <= budget:
        return full
    total = sum(shard_bytes.values())
    return {n: min(full[n], max(world, int(budget * shard_bytes[n] / total) // row_bytes[n] * world))
            for n in full}
