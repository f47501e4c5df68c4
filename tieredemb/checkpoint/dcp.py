"""``torch.distributed.checkpoint`` (DCP) of models holding embedding collections: two planners.

    dcp.save(model.state_dict(), checkpoint_id=path, planner=te.checkpoint.DCPSavePlanner())
    dcp.load(fresh.state_dict(), checkpoint_id=path, planner=te.checkpoint.DCPLoadPlanner())

A collection's ``state_dict`` holds its tables as ``TableSlice`` handles (``modules/state.py``), not
tensors, and a freshly built collection's tables are empty: DCP's default planners can neither write
the handles nor size a table they have not seen. These planners do both, and pass every other entry
(dense parameters, buffers, the collections' ``step`` and ``clock``) to DCP's default behaviour.

Save: every entry of a table (``keys``, ``scores``, ``weights``, ``optimizer_state``; ``admission_*``)
is one global tensor of the rows of all ranks, rank r's rows at an offset after those of ranks < r
(one all-gather of the row counts per table), written in chunks of ``CHUNK_ROWS`` rows: the writer
asks for a chunk (``resolve_data``) only when it writes it, so one chunk is read from the table at a
time. Each rank's row range is recorded in the metadata's ``planner_data``.

Load: the fresh collection's tables are cleared, then the saved chunks are read (a sharded
collection at the saved world size: each rank the rows it saved; otherwise every chunk, each rank
keeping the keys it owns), and each chunk is stored as soon as its keys, scores, weights and
optimizer state have arrived. With DCP's ``FileSystemWriter`` (one file per rank by default) those
four arrive one after another, so a load holds one chunk; a writer that spreads a chunk's entries
over several files makes the load hold each chunk until its last entry comes. The step count and
the LRU clock are restored after the last read, and the state dict given to ``dcp.load`` then holds
the loaded collection's own entries: a ``model.load_state_dict`` of it afterwards (DCP does that
for a ``Stateful`` model, ``dcp.load({"model": model}, ...)``) changes nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from tieredemb.modules import state as table_state
from tieredemb.modules.state import CHUNK_ROWS, TableSlice

ROWS = ("keys", "scores", "weights", "optimizer_state")  # entries with one row per stored key
ADMISSION = ("admission_keys", "admission_counts")


def _tables(flat: dict) -> dict[str, TableSlice]:
    """``"<prefix><table>."`` -> the table's weights handle, for every collection table in ``flat``."""
    return {fqn[: -len("weights")]: v for fqn, v in flat.items()
            if isinstance(v, TableSlice) and fqn.endswith(".weights")}


def _shard_key(base: str, rank: int) -> str:
    return f"tieredemb.dcp.rows:{base}:{rank}"


class DCPSavePlanner(DefaultSavePlanner):
    """``dcp.save``'s planner for state dicts holding embedding collections: their tables are written
    chunk by chunk, each rank's shard at its offset in one global tensor per entry."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        # fqn -> (first global row of this rank, this rank's rows, rows of all ranks)
        self._spans: dict[str, tuple[int, int, int]] = {}
        self._shards: dict[str, tuple] = {}
        for base, handle in _tables(self.state_dict).items():
            coll = handle.collection
            counts = torch.tensor([[self.state_dict[base + "keys"].numel(),
                                    self.state_dict[base + "admission_keys"].numel()]])
            if coll.process_group is not None:  # every rank's counts (ranks set up in one order)
                every = [torch.zeros_like(counts) for _ in range(coll.world)]
                dist.all_gather(every, counts, group=coll.process_group)
                counts = torch.cat(every)
            rank = coll.rank if coll.process_group is not None else 0
            starts = torch.cumsum(counts, 0) - counts
            for names, col in ((ROWS, 0), (ADMISSION, 1)):
                for name in names:
                    self._spans[base + name] = (int(starts[rank, col]), int(counts[rank, col]),
                                                int(counts[:, col].sum()))
            self._shards[_shard_key(base, rank)] = (counts.shape[0], int(starts[rank, 0]),
                                                    int(counts[rank, 0]))

    def create_local_plan(self) -> SavePlan:
        rest = {k: v for k, v in self.state_dict.items() if k not in self._spans}
        items = create_default_local_save_plan(rest, self.is_coordinator).items
        for fqn, (start, n, total) in self._spans.items():
            items += self._chunks(fqn, start, n, total)
        data = {**self.mappings, **self._shards} if self.flatten_state_dict else self._shards
        self.plan = SavePlan(items, planner_data=data)
        return self.plan

    def _chunks(self, fqn: str, start: int, n: int, total: int) -> list[WriteItem]:
        obj = self.state_dict[fqn]
        tail = list(obj.shape[1:])
        size = torch.Size([total, *tail])
        # an empty table: one empty chunk, so that the load finds the entry
        pieces = [(s, min(CHUNK_ROWS, n - s)) for s in range(0, n, CHUNK_ROWS)]
        if total == 0 and self.is_coordinator:
            pieces = [(0, 0)]
        return [WriteItem(index=MetadataIndex(fqn, [start + s, *[0] * len(tail)]), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size([start + s, *[0] * len(tail)]),
                                                         sizes=torch.Size([length, *tail])),
                              properties=TensorProperties(dtype=obj.dtype), size=size))
                for s, length in pieces]

    def resolve_data(self, write_item: WriteItem):
        fqn = write_item.index.fqn
        if fqn not in self._spans:
            return super().resolve_data(write_item)
        start = self._spans[fqn][0]
        obj = self.state_dict[fqn]
        rows = obj.narrow(0, write_item.index.offset[0] - start, write_item.tensor_data.chunk.sizes[0])
        return rows.contiguous()  # a chunk of its own (a tensor's narrow shares the whole storage)


class DCPLoadPlanner(DefaultLoadPlanner):
    """``dcp.load``'s planner for state dicts holding embedding collections (freshly built ones too,
    in any storage mode): each saved chunk is stored in its table as soon as it is read."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # found first: DCP's set-up replaces objects it does not know (the handles) with None
        self._bases = _tables(flatten_state_dict(state_dict)[0] if self.flatten_state_dict else state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for base, handle in self._bases.items():
            self._check(base, handle)
        for handle in self._bases.values():  # a collective when sharded: every rank, one order
            table_state.clear(handle.collection, handle.table)
        self._pending: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._left = 0

    def _check(self, base: str, handle: TableSlice) -> None:
        """Refuse (before anything changes) a checkpoint without this table or with other widths."""
        coll = handle.collection
        dim = next(t.embedding_dim for t in coll.table_configs if t.name == handle.table)
        dims = {"weights": dim, "optimizer_state": coll.optimizer.state_width(dim)}
        for name in ROWS + ADMISSION:
            md = self.metadata.state_dict_metadata.get(base + name)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"DCP load: the checkpoint has no tensor {base + name!r}")
            if name in dims and (len(md.size) != 2 or md.size[1] != dims[name]):
                raise ValueError(f"DCP load: {base + name} has shape {tuple(md.size)} in the checkpoint, "
                                 f"the model's table has {dims[name]} columns")

    def create_local_plan(self) -> LoadPlan:
        ours = {base + name for base in self._bases for name in ROWS + ADMISSION}
        rest = {k: v for k, v in self.state_dict.items() if k not in ours}
        items = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load).items
        for base, handle in self._bases.items():
            span = self._saved_span(base, handle.collection)
            for names in (ROWS, ADMISSION):
                chunks = [self._saved_chunks(base + name, span if names is ROWS else None) for name in names]
                if len({tuple(c) for c in chunks}) != 1:
                    raise ValueError(f"DCP load: the entries of {base[:-1]!r} ({', '.join(names)}) are "
                                     "chunked differently (not saved with DCPSavePlanner)")
                for row in chunks[0]:
                    # a chunk's entries one after another: they come in this order from one file
                    items += [self._read(base + name, row) for name in names]
        self.plan = LoadPlan(items)
        return self.plan

    def _saved_span(self, base: str, coll) -> tuple[int, int] | None:
        """The rows this rank saved (a sharded collection at the saved world size), or None: all."""
        data = self.metadata.planner_data or {}
        shard = data.get(_shard_key(base, coll.rank)) if coll.process_group is not None else None
        if shard is None or shard[0] != coll.world:
            return None
        return shard[1], shard[2]

    def _saved_chunks(self, fqn: str, span: tuple[int, int] | None) -> list[tuple[int, int]]:
        """(first row, rows) of each saved chunk of ``fqn`` with rows (of ``span`` only, if given)."""
        rows = sorted((c.offsets[0], c.sizes[0]) for c in self.metadata.state_dict_metadata[fqn].chunks)
        rows = [r for r in rows if r[1] > 0]
        if span is not None:
            rows = [r for r in rows if span[0] <= r[0] < span[0] + span[1]]
        return rows

    def _read(self, fqn: str, row: tuple[int, int]) -> ReadItem:
        tail = list(self.metadata.state_dict_metadata[fqn].size[1:])
        chunk = ChunkStorageMetadata(offsets=torch.Size([row[0], *[0] * len(tail)]),
                                     sizes=torch.Size([row[1], *tail]))
        zeros = torch.Size([0] * len(chunk.offsets))
        return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, chunk.offsets),
                        dest_offsets=zeros, storage_index=MetadataIndex(fqn, chunk.offsets),
                        storage_offsets=zeros, lengths=chunk.sizes)

    def finish_plan(self, new_plan: LoadPlan) -> LoadPlan:
        plan = super().finish_plan(new_plan)
        self._left = sum(item.type == LoadItemType.TENSOR for item in plan.items)
        if self._left == 0:
            self._finish()
        return plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        fqn = read_item.dest_index.fqn
        base, name = self._ours(fqn)
        if base is None:
            return super().resolve_tensor(read_item)
        dtype = self.metadata.state_dict_metadata[fqn].properties.dtype
        buffer = torch.empty(read_item.lengths, dtype=dtype)
        kind = "rows" if name in ROWS else "admission"
        self._pending.setdefault((base + kind, read_item.dest_index.offset[0]), {})[name] = buffer
        return buffer

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        base, name = self._ours(read_item.dest_index.fqn)
        if base is None:
            super().commit_tensor(read_item, tensor)
        else:
            self._store(base, name, read_item.dest_index.offset[0])
        self._left -= 1
        if self._left == 0:
            self._finish()

    def _ours(self, fqn: str) -> tuple[str | None, str]:
        base, _, name = fqn.rpartition(".")
        base += "."
        if base in self._bases and name in ROWS + ADMISSION:
            return base, name
        return None, name

    def _store(self, base: str, name: str, row: int) -> None:
        """Store a chunk once all its entries have arrived."""
        kind = "rows" if name in ROWS else "admission"
        parts = self._pending[(base + kind, row)]
        names = ROWS if kind == "rows" else ADMISSION
        if any(n not in parts for n in names):
            return
        del self._pending[(base + kind, row)]
        handle = self._bases[base]
        if kind == "rows":
            rows = torch.cat([parts["weights"], parts["optimizer_state"]], dim=1)
            table_state.import_owned(handle.collection, handle.table, parts["keys"], rows, parts["scores"])
        else:
            table_state.import_owned(handle.collection, handle.table, parts["admission_keys"], None,
                                     parts["admission_counts"], admission=True)

    def _finish(self) -> None:
        """After the last read: each collection's step and clock, and its own entries in the state
        dict (so that loading that state dict into the model afterwards changes nothing)."""
        done = set()
        for base, handle in self._bases.items():
            coll = handle.collection
            prefix = base[: -len(handle.table) - 1]
            if id(coll) not in done:
                done.add(id(coll))
                coll.restore_progress(int(self.state_dict[prefix + "step"]),
                                      int(self.state_dict[prefix + "clock"]))
            fresh: dict = {}
            table_state.save_table(coll, handle.table, fresh, base)
            for fqn, value in fresh.items():
                self._replace(fqn, value)

    def _replace(self, fqn: str, value) -> None:
        self.state_dict[fqn] = value
        if self.flatten_state_dict and fqn in self.mappings:
            set_element(self.original_state_dict, self.mappings[fqn], value)
