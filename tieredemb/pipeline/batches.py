"""Walking a batch of any shape: the KJTs in it, and its tensors moved to a device or pinned.

A batch is a KJT (ours or TorchRec's), a tensor, or a dict, list, tuple, namedtuple or dataclass of
them (nested); ``TrainPipeline`` copies batches with these, and the benches pin theirs the same way.
"""

from __future__ import annotations

import dataclasses

import torch

from tieredemb.jagged import KeyedJaggedTensor


def is_kjt(value: object) -> bool:
    """Ours, or a ``torchrec.KeyedJaggedTensor`` (not imported: torchrec is optional)."""
    cls = type(value)
    return isinstance(value, KeyedJaggedTensor) or (
        cls.__name__ == "KeyedJaggedTensor" and cls.__module__.startswith("torchrec")
    )


def _is_dataclass_instance(value: object) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def named_fields(batch: object) -> list[tuple[str, object]]:
    """The batch's top-level values by name: the batch itself if a KJT, dict values, tuple items,
    dataclass fields, or attributes (``sparse_features`` included even as a property)."""
    if is_kjt(batch):
        return [("<batch>", batch)]
    if isinstance(batch, dict):
        return [(str(k), v) for k, v in batch.items()]
    if isinstance(batch, (list, tuple)):
        names = getattr(batch, "_fields", None) or [str(i) for i in range(len(batch))]
        return list(zip(names, batch))
    if _is_dataclass_instance(batch):
        values = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    else:
        values = dict(vars(batch)) if hasattr(batch, "__dict__") else {}
    if "sparse_features" not in values and hasattr(batch, "sparse_features"):
        values["sparse_features"] = batch.sparse_features
    return list(values.items())


def move_batch(obj: object, device: torch.device) -> object:
    """``obj`` on ``device``: tensors and objects with ``.to`` (KJTs, TorchRec batches) are moved with
    ``non_blocking=True``; dicts, lists, tuples and dataclasses field by field; anything else as is."""
    if isinstance(obj, torch.Tensor) or (callable(getattr(obj, "to", None)) and not isinstance(obj, type)):
        data = obj if isinstance(obj, torch.Tensor) else getattr(obj, "values", None)
        data = data() if callable(data) else data
        to_meta = torch.device(device).type == "meta"
        if isinstance(data, torch.Tensor) and data.device.type == "meta" and not to_meta:
            raise ValueError(f"a batch on the meta device holds no data to move to {device}: give the "
                             "pipeline batches with their ids")
        return obj.to(device, non_blocking=True)
    return _map_fields(obj, lambda v: move_batch(v, device))


def pin_batch(obj: object) -> object:
    """CPU tensors of ``obj`` (a tensor, KJT, or a container or dataclass of them) in pinned memory.

    Other objects are left as they are: a batch type that moves itself is pinned by its loader
    (TorchRec's ``DataLoader(pin_memory=True)``)."""
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory() if obj.device.type == "cpu" and not obj.is_pinned() else obj
    if is_kjt(obj):
        values = obj.values()
        return obj.pin_memory() if values.device.type == "cpu" and not values.is_pinned() else obj
    return _map_fields(obj, pin_batch)


def _map_fields(obj: object, fn) -> object:
    if isinstance(obj, dict):
        return {k: fn(v) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(fn(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(fn(v) for v in obj)
    if _is_dataclass_instance(obj):
        return dataclasses.replace(
            obj, **{f.name: fn(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        )
    return obj
