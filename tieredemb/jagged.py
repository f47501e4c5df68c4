"""Jagged batch types with TorchRec's layout and method names.

``KeyedJaggedTensor`` is feature-major: for features ``f0, f1`` and batch size ``B``, ``lengths`` is
``[len(f0, b0) .. len(f0, b_{B-1}), len(f1, b0) ..]`` and ``values`` the ids in that order. A
``torchrec.KeyedJaggedTensor`` is accepted wherever ours is (``as_kjt``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=out[1:])
    return out


def _check_agree(owner: str, lengths: torch.Tensor, offsets: torch.Tensor) -> None:
    """Lengths and offsets given together must describe the same bags: offsets (n + 1,) are 0, then
    the running sum of lengths (n,). Reads them (on CUDA a sync: only when both are given)."""
    if lengths.dim() != 1 or offsets.dim() != 1 or offsets.numel() != lengths.numel() + 1:
        raise ValueError(f"{owner}: offsets has {offsets.numel()} entries and lengths has {lengths.numel()}: "
                         "given both, offsets needs one entry more than lengths")
    if "meta" in (lengths.device.type, offsets.device.type):
        return  # no data to compare (a collection refuses such a batch)
    want = offsets_from_lengths(lengths)
    wrong = (offsets.to(want.device, torch.int64) != want).nonzero()
    if wrong.numel():
        i = int(wrong[0])
        raise ValueError(f"{owner}: lengths and offsets disagree: offsets[{i}] is {int(offsets[i])}, the "
                         f"lengths before it sum to {int(want[i])}")


class JaggedTensor:
    """One feature's jagged values. values: (n, ...) ; lengths: int (B,)."""

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor | None = None,
                 offsets: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> None:
        if lengths is None and offsets is None:
            raise ValueError("JaggedTensor needs lengths or offsets")
        if lengths is not None and offsets is not None:
            _check_agree("JaggedTensor", lengths, offsets)
        self._values = values
        self._lengths = lengths if lengths is not None else offsets[1:] - offsets[:-1]
        self._offsets = offsets
        self._weights = weights

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = offsets_from_lengths(self._lengths)
        return self._offsets

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("this JaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def to_dense(self) -> list[torch.Tensor]:
        return list(torch.split(self._values, self._lengths.tolist()))

    def __repr__(self) -> str:
        return f"JaggedTensor(values={tuple(self._values.shape)}, lengths={self._lengths.tolist()})"


class KeyedJaggedTensor:
    """Several features' ids in one feature-major jagged batch.

    Args:
        keys: feature names.
        values: int64 (n,) ids, feature-major.
        lengths: int (len(keys) * B,) ids per (feature, sample); or ``offsets`` (len(keys) * B + 1,).
        weights: float (n,) per-id weights or None.

    Example::

        kjt = te.KeyedJaggedTensor(keys=["user_id", "item_id"], values=torch.tensor([7, 8, 9]),
                                   lengths=torch.tensor([1, 1, 1, 0]))  # B = 2
    """

    def __init__(self, keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor | None = None,
                 offsets: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                 stride: int | None = None) -> None:
        if isinstance(keys, str):
            raise TypeError("KeyedJaggedTensor keys must be a list of feature names, not a string")
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"KeyedJaggedTensor values must be a tensor, got {type(values).__name__}")
        if lengths is None and offsets is None:
            raise ValueError("KeyedJaggedTensor needs lengths or offsets")
        for name, t in (("lengths", lengths), ("offsets", offsets), ("weights", weights)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"KeyedJaggedTensor {name} must be a tensor, got {type(t).__name__}")
        if lengths is not None and offsets is not None:
            _check_agree("KeyedJaggedTensor", lengths, offsets)
        self._keys = list(keys)
        self._values = values
        self._lengths = lengths
        self._offsets = offsets
        self._weights = weights
        self._stride = stride

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        if self._lengths is None:
            self._lengths = self._offsets[1:] - self._offsets[:-1]
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = offsets_from_lengths(self._lengths)
        return self._offsets

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def stride(self) -> int:
        """Batch size B."""
        if self._stride is None:
            n = self.lengths().numel()
            self._stride = n // len(self._keys) if self._keys else 0
        return self._stride

    def length_per_key(self) -> list[int]:
        b = self.stride()
        return self.lengths().view(len(self._keys), b).sum(dim=1).tolist() if self._keys else []

    def __getitem__(self, key: str) -> JaggedTensor:
        i = self._keys.index(key)
        b = self.stride()
        offsets = self.offsets()
        start, end = int(offsets[i * b]), int(offsets[(i + 1) * b])
        w = self._weights[start:end] if self._weights is not None else None
        return JaggedTensor(self._values[start:end], self.lengths()[i * b : (i + 1) * b], weights=w)

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: self[k] for k in self._keys}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedTensor:
        return self._copy(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> KeyedJaggedTensor:
        return self._copy(lambda t: t.pin_memory())

    def _copy(self, fn) -> KeyedJaggedTensor:
        """This batch with ``fn`` applied to each of its tensors."""
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        out = KeyedJaggedTensor(self._keys, mv(self._values), lengths=mv(self._lengths),
                                offsets=None if self._lengths is not None else mv(self._offsets),
                                weights=mv(self._weights), stride=self._stride)
        if self._lengths is not None:  # a pair checked when this batch was made: not again (no sync)
            out._offsets = mv(self._offsets)
        return out

    @staticmethod
    def from_lengths_sync(keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor,
                          weights: torch.Tensor | None = None) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys, values, lengths=lengths, weights=weights)

    def __repr__(self) -> str:
        return (f"KeyedJaggedTensor(keys={self._keys}, values={tuple(self._values.shape)}, "
                f"stride={self.stride()}, weighted={self._weights is not None})")


def as_kjt(batch: object) -> KeyedJaggedTensor:
    """Our KeyedJaggedTensor, or a ``torchrec.KeyedJaggedTensor`` converted (sharing its tensors)."""
    if isinstance(batch, KeyedJaggedTensor):
        return batch
    cls = type(batch)
    if cls.__name__ == "KeyedJaggedTensor" and cls.__module__.startswith("torchrec"):
        return KeyedJaggedTensor(list(batch.keys()), batch.values(), lengths=batch.lengths(),
                                 weights=batch.weights_or_none(), stride=batch.stride())
    raise TypeError(f"expected a te.KeyedJaggedTensor or torchrec.KeyedJaggedTensor, "
                    f"got {cls.__module__}.{cls.__name__}")


class KeyedTensor:
    """Pooled embeddings of several features side by side: values (B, sum(dims)).

    ``kt["feature"]`` is that feature's (B, D) block; ``to_dict()`` gives all of them.
    """

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor,
                 key_dim: int = 1) -> None:
        self._keys = list(keys)
        self._length_per_key = list(length_per_key)
        self._values = values
        self._key_dim = key_dim

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        out = [0]
        for n in self._length_per_key:
            out.append(out[-1] + n)
        return out

    def key_dim(self) -> int:
        return self._key_dim

    def to_dict(self) -> dict[str, torch.Tensor]:
        parts = torch.split(self._values, self._length_per_key, dim=self._key_dim)
        return dict(zip(self._keys, parts))

    def __getitem__(self, key: str) -> torch.Tensor:
        i = self._keys.index(key)
        start = sum(self._length_per_key[:i])
        return self._values.narrow(self._key_dim, start, self._length_per_key[i])

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, values={tuple(self._values.shape)})"
