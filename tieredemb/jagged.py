"""Jagged batch types with TorchRec's layout, constructor keywords and method names.

``KeyedJaggedTensor`` is feature-major: for features ``f0, f1`` and batch size ``B``, ``lengths`` is
``[len(f0, b0) .. len(f0, b_{B-1}), len(f1, b0) ..]`` and ``values`` the ids in that order. A
``torchrec.KeyedJaggedTensor`` is accepted wherever ours is (``as_kjt``).

What a collection reads on every step (``keys()``, ``values()``, ``lengths()``, ``weights_or_none()``)
is stored, never computed, and no constructor reads device data unless it is given both lengths and
offsets (then they are checked to agree). The per-key figures (``length_per_key()``,
``offset_per_key()``) read the lengths once on the host, as TorchRec's do, and are cached.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

_VARIABLE_BATCH = ("variable batch sizes per feature (stride_per_key_per_rank, inverse_indices) are not "
                   "supported: give every feature the same batch size")


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """int64 (n + 1,) bag offsets of int (n,) ``lengths``: 0, then their running sum."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=out[1:])
    return out


def _offsets_like(lengths: torch.Tensor) -> torch.Tensor:
    """(n + 1,) offsets of (n,) ``lengths`` in the lengths' own dtype (TorchRec's ``offsets()``)."""
    out = lengths.new_zeros(lengths.numel() + 1)
    torch.cumsum(lengths.reshape(-1), dim=0, dtype=lengths.dtype, out=out[1:])
    return out


def _running(counts: Sequence[int]) -> list[int]:
    """0, then the running sum of ``counts``."""
    out = [0]
    for n in counts:
        out.append(out[-1] + n)
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


def _check_tensors(owner: str, **tensors: object) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{owner} {name} must be a tensor, got {type(t).__name__}")


def _apply(t: torch.Tensor | None, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    return None if t is None else fn(t)


def _record(stream: torch.Stream, *tensors: torch.Tensor | None) -> None:
    for t in tensors:
        if t is not None:
            t.record_stream(stream)


class JaggedTensor:
    """One feature's jagged batch: ``B`` bags of values, bag after bag.

    Args:
        values: (n, ...) the bags' values.
        weights: (n,) per-value weights, or None.
        lengths: int (B,) values per bag; or ``offsets``: int (B + 1,) where each bag starts, then n.
            Given both, they must agree.

    Everything after ``values`` is keyword-only (TorchRec's positional order is ``values, weights,
    lengths, offsets``; a positional call is refused rather than read another way).

    Example::

        jt = te.JaggedTensor(torch.tensor([5, 6, 7]), lengths=torch.tensor([2, 0, 1]))
        jt.to_dense()  # [tensor([5, 6]), tensor([], dtype=torch.int64), tensor([7])]
    """

    def __init__(self, values: torch.Tensor, *, weights: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None) -> None:
        _check_tensors("JaggedTensor", values=values, weights=weights, lengths=lengths, offsets=offsets)
        if values is None:
            raise TypeError("JaggedTensor values must be a tensor, got None")
        if lengths is None and offsets is None:
            raise ValueError("JaggedTensor needs lengths or offsets")
        if lengths is not None and offsets is not None:
            _check_agree("JaggedTensor", lengths, offsets)
        self._set(values, weights, lengths, offsets)

    def _set(self, values: torch.Tensor, weights: torch.Tensor | None, lengths: torch.Tensor | None,
             offsets: torch.Tensor | None) -> JaggedTensor:
        self._values, self._weights, self._lengths, self._offsets = values, weights, lengths, offsets
        return self

    @classmethod
    def _of(cls, values: torch.Tensor, weights: torch.Tensor | None, lengths: torch.Tensor | None,
            offsets: torch.Tensor | None) -> JaggedTensor:
        """One made from parts already known to agree (no check, no device read)."""
        return cls.__new__(cls)._set(values, weights, lengths, offsets)

    @staticmethod
    def empty(is_weighted: bool = False, device: torch.device | str | None = None,
              values_dtype: torch.dtype | None = None, weights_dtype: torch.dtype | None = None,
              lengths_dtype: torch.dtype = torch.int32) -> JaggedTensor:
        """No bags at all (its offsets are ``[0]``)."""
        weights = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        return JaggedTensor._of(torch.empty(0, dtype=values_dtype, device=device), weights,
                                torch.empty(0, dtype=lengths_dtype, device=device), None)

    @staticmethod
    def from_dense(values: Sequence[torch.Tensor],
                   weights: Sequence[torch.Tensor] | None = None) -> JaggedTensor:
        """One bag per tensor of ``values`` (and of ``weights``); int32 lengths, like TorchRec's."""
        if len(values) == 0:
            raise ValueError("JaggedTensor.from_dense needs at least one bag")
        if weights is not None and len(weights) != len(values):
            raise ValueError(f"JaggedTensor.from_dense: {len(weights)} weight bags for {len(values)} bags")
        flat = torch.cat(list(values), dim=0)
        lengths = torch.tensor([v.size(0) for v in values], dtype=torch.int32, device=flat.device)
        w = None if weights is None else torch.cat(list(weights), dim=0)
        return JaggedTensor._of(flat, w, lengths, None)

    @staticmethod
    def from_dense_lengths(values: torch.Tensor, lengths: torch.Tensor,
                           weights: torch.Tensor | None = None) -> JaggedTensor:
        """Bags from the rows of padded (B, N, ...) ``values``: the first ``lengths[b]`` of row b."""
        keep = torch.arange(values.size(1), device=values.device) < lengths.unsqueeze(-1)
        return JaggedTensor._of(values[keep], None if weights is None else weights[keep], lengths, None)

    def device(self) -> torch.device:
        return self._values.device

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        if self._lengths is None:
            self._lengths = torch.diff(self._offsets)
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        if self._offsets is None:
            self._offsets = _offsets_like(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("this JaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def to_dense(self) -> list[torch.Tensor]:
        """One tensor per bag (reads the offsets on the host)."""
        o = self.offsets().tolist()
        return [self._values[o[i] : o[i + 1]] for i in range(len(o) - 1)]

    def to_dense_weights(self) -> list[torch.Tensor] | None:
        if self._weights is None:
            return None
        o = self.offsets().tolist()
        return [self._weights[o[i] : o[i + 1]] for i in range(len(o) - 1)]

    def to_padded_dense(self, desired_length: int | None = None, padding_value: float = 0.0) -> torch.Tensor:
        """(B, N, ...) with bag b in row b, cut or padded with ``padding_value`` to N: ``desired_length``,
        else the longest bag (read on the host)."""
        return self._padded(self._values, desired_length, padding_value)

    def to_padded_dense_weights(self, desired_length: int | None = None,
                                padding_value: float = 0.0) -> torch.Tensor | None:
        return None if self._weights is None else self._padded(self._weights, desired_length, padding_value)

    def _padded(self, data: torch.Tensor, desired_length: int | None, padding_value: float) -> torch.Tensor:
        lengths = self.lengths().to(torch.int64)
        starts = self.offsets()[:-1].to(torch.int64)
        bags = lengths.numel()
        if desired_length is None:
            desired_length = int(lengths.max()) if bags else 0
        out = data.new_full((bags, desired_length, *data.shape[1:]), padding_value)
        row = torch.repeat_interleave(torch.arange(bags, device=data.device), lengths)  # bag of each value
        pos = torch.arange(row.numel(), device=data.device) - (torch.cumsum(lengths, 0) - lengths)[row]
        keep = pos < desired_length
        out[row[keep], pos[keep]] = data[(starts[row] + pos)[keep]]
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return JaggedTensor._of(move(self._values), _apply(self._weights, move), _apply(self._lengths, move),
                                _apply(self._offsets, move))

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor of this batch as used on ``stream`` (see ``torch.Tensor.record_stream``)."""
        _record(stream, self._values, self._weights, self._lengths, self._offsets)

    def __repr__(self) -> str:
        bags = "?" if self._lengths is None else self._lengths.numel()
        return (f"JaggedTensor(values={tuple(self._values.shape)}, bags={bags}, "
                f"weighted={self._weights is not None})")


class KeyedJaggedTensor:
    """Several features' ids in one feature-major jagged batch, TorchRec's layout.

    Args:
        keys: feature names.
        values: int64 or int32 (n,) ids, feature-major.
        weights: float (n,) per-id weights, or None.
        lengths: int (len(keys) * B,) ids per (feature, sample); or ``offsets`` (len(keys) * B + 1,).
            Given both, they must agree.
        stride: the batch size B (else ``lengths.numel() // len(keys)``).
        length_per_key, offset_per_key, index_per_key: the per-key figures, when already known (they
            are then not read from the lengths).

    Everything after ``values`` is keyword-only: TorchRec's positional order is ``keys, values,
    weights, lengths``, and a positional call is refused rather than read another way. Every feature
    has the same batch size (TorchRec's variable batch, ``stride_per_key_per_rank`` and
    ``inverse_indices``, is refused).

    Example::

        kjt = te.KeyedJaggedTensor(keys=["user_id", "item_id"], values=torch.tensor([7, 8, 9]),
                                   lengths=torch.tensor([1, 1, 1, 0]))  # B = 2
        kjt["item_id"].to_dense()  # [tensor([9]), tensor([], dtype=torch.int64)]
    """

    def __init__(self, keys: Sequence[str], values: torch.Tensor, *, weights: torch.Tensor | None = None,
                 lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                 stride: int | None = None, stride_per_key_per_rank: object = None,
                 length_per_key: Sequence[int] | None = None, offset_per_key: Sequence[int] | None = None,
                 index_per_key: Mapping[str, int] | None = None, inverse_indices: object = None) -> None:
        if isinstance(keys, str):
            raise TypeError("KeyedJaggedTensor keys must be a list of feature names, not a string")
        keys = list(keys)
        bad = [k for k in keys if not isinstance(k, str)]
        if bad:
            raise TypeError(f"KeyedJaggedTensor keys must be feature names (str), got {bad[0]!r}")
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"KeyedJaggedTensor values must be a tensor, got {type(values).__name__}")
        if lengths is None and offsets is None:
            raise ValueError("KeyedJaggedTensor needs lengths or offsets")
        _check_tensors("KeyedJaggedTensor", lengths=lengths, offsets=offsets, weights=weights)
        if stride_per_key_per_rank is not None or inverse_indices is not None:
            raise ValueError(f"KeyedJaggedTensor: {_VARIABLE_BATCH}")
        if lengths is not None and offsets is not None:
            _check_agree("KeyedJaggedTensor", lengths, offsets)
        _check_stride(keys, lengths, offsets, stride)
        known = _check_per_key(keys, values, length_per_key, offset_per_key, index_per_key)
        self._set(keys, values, weights, lengths, offsets, stride, *known)

    def _set(self, keys: list[str], values: torch.Tensor, weights: torch.Tensor | None,
             lengths: torch.Tensor | None, offsets: torch.Tensor | None, stride: int | None,
             length_per_key: list[int] | None = None, offset_per_key: list[int] | None = None,
             index_per_key: dict[str, int] | None = None) -> KeyedJaggedTensor:
        self._keys, self._values, self._weights = keys, values, weights
        self._lengths, self._offsets, self._stride = lengths, offsets, stride
        self._length_per_key, self._offset_per_key = length_per_key, offset_per_key
        self._index_per_key = index_per_key
        self._jt_dict: dict[str, JaggedTensor] | None = None
        return self

    @classmethod
    def _of(cls, keys: list[str], values: torch.Tensor, weights: torch.Tensor | None,
            lengths: torch.Tensor | None, offsets: torch.Tensor | None, stride: int | None,
            length_per_key: list[int] | None = None, offset_per_key: list[int] | None = None,
            index_per_key: dict[str, int] | None = None) -> KeyedJaggedTensor:
        """One made from parts already known to agree (no check, no device read)."""
        return cls.__new__(cls)._set(keys, values, weights, lengths, offsets, stride, length_per_key,
                                     offset_per_key, index_per_key)

    # ---------------------------------------------------------------------------------- constructors

    @staticmethod
    def from_lengths_sync(keys: Sequence[str], values: torch.Tensor, lengths: torch.Tensor,
                          weights: torch.Tensor | None = None, stride: int | None = None,
                          stride_per_key_per_rank: object = None,
                          inverse_indices: object = None) -> KeyedJaggedTensor:
        """A batch from lengths with its per-key figures read now (``sync()``)."""
        return KeyedJaggedTensor(keys, values, weights=weights, lengths=lengths, stride=stride,
                                 stride_per_key_per_rank=stride_per_key_per_rank,
                                 inverse_indices=inverse_indices).sync()

    @staticmethod
    def from_offsets_sync(keys: Sequence[str], values: torch.Tensor, offsets: torch.Tensor,
                          weights: torch.Tensor | None = None, stride: int | None = None,
                          stride_per_key_per_rank: object = None,
                          inverse_indices: object = None) -> KeyedJaggedTensor:
        """A batch from offsets with its per-key figures read now (``sync()``)."""
        return KeyedJaggedTensor(keys, values, weights=weights, offsets=offsets, stride=stride,
                                 stride_per_key_per_rank=stride_per_key_per_rank,
                                 inverse_indices=inverse_indices).sync()

    @staticmethod
    def from_jt_dict(jt_dict: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
        """A batch of one feature per entry, in the dict's order; every entry has the same number of
        bags (an absent bag is an empty one, not a missing one)."""
        if not jt_dict:
            raise ValueError("KeyedJaggedTensor.from_jt_dict needs at least one feature")
        jts = list(jt_dict.values())
        bags = {k: jt.lengths().numel() for k, jt in jt_dict.items()}
        if len(set(bags.values())) > 1:
            raise ValueError(f"KeyedJaggedTensor.from_jt_dict: features have different batch sizes {bags}; "
                             f"{_VARIABLE_BATCH}")
        weighted = [jt.weights_or_none() is not None for jt in jts]
        if any(weighted) and not all(weighted):
            raise ValueError("KeyedJaggedTensor.from_jt_dict: some features have weights and some not")
        weights = torch.cat([jt.weights() for jt in jts]) if all(weighted) else None
        return KeyedJaggedTensor(list(jt_dict), torch.cat([jt.values() for jt in jts]), weights=weights,
                                 lengths=torch.cat([jt.lengths() for jt in jts]),
                                 stride=next(iter(bags.values()))).sync()

    @staticmethod
    def empty(is_weighted: bool = False, device: torch.device | str | None = None,
              values_dtype: torch.dtype | None = None, weights_dtype: torch.dtype | None = None,
              lengths_dtype: torch.dtype = torch.int32) -> KeyedJaggedTensor:
        """No features at all (stride 0)."""
        weights = torch.empty(0, dtype=weights_dtype, device=device) if is_weighted else None
        return KeyedJaggedTensor._of([], torch.empty(0, dtype=values_dtype, device=device), weights,
                                     torch.empty(0, dtype=lengths_dtype, device=device), None, 0)

    @staticmethod
    def concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """The features of every batch side by side, in order (same batch size, all weighted or none)."""
        if len(kjt_list) == 0:
            raise ValueError("KeyedJaggedTensor.concat needs at least one batch")
        weighted = kjt_list[0].weights_or_none() is not None
        if any((k.weights_or_none() is not None) != weighted for k in kjt_list):
            raise ValueError("KeyedJaggedTensor.concat: can't mix weighted and unweighted batches")
        strides = [k.stride() for k in kjt_list]
        if len(set(strides)) > 1:
            raise ValueError(f"KeyedJaggedTensor.concat: batch sizes differ: {strides}")
        keys = sum((k.keys() for k in kjt_list), [])
        known = [k.length_per_key_or_none() for k in kjt_list]
        return KeyedJaggedTensor._of(
            keys, torch.cat([k.values() for k in kjt_list]),
            torch.cat([k.weights() for k in kjt_list]) if weighted else None,
            torch.cat([k.lengths() for k in kjt_list]), None, strides[0],
            None if any(n is None for n in known) else [n for lpk in known for n in lpk])

    # ------------------------------------------------------------------------ what a step reads

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        if self._lengths is None:
            self._lengths = torch.diff(self._offsets)
        return self._lengths

    def lengths_or_none(self) -> torch.Tensor | None:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        """(len(keys) * B + 1,) offsets, in the lengths' dtype (made from them when not given)."""
        if self._offsets is None:
            self._offsets = _offsets_like(self._lengths)
        return self._offsets

    def offsets_or_none(self) -> torch.Tensor | None:
        return self._offsets

    def device(self) -> torch.device:
        return self._values.device

    def stride(self) -> int:
        """The batch size B (from the tensors' sizes: no device read)."""
        if self._stride is None:
            n = len(self._keys)
            if n == 0:
                self._stride = 0
            elif self._offsets is not None and self._offsets.numel() > 0:
                self._stride = (self._offsets.numel() - 1) // n
            else:
                self._stride = self._lengths.numel() // n if self._lengths is not None else 0
        return self._stride

    def stride_per_key(self) -> list[int]:
        return [self.stride()] * len(self._keys)

    def stride_per_key_per_rank(self) -> list[list[int]]:
        """Empty: every feature has the same batch size (TorchRec's answer for such a batch)."""
        return []

    def variable_stride_per_key(self) -> bool:
        return False

    def inverse_indices_or_none(self) -> None:
        return None

    def inverse_indices(self) -> tuple[list[str], torch.Tensor]:
        raise ValueError("this KeyedJaggedTensor has no inverse indices (it is not a variable batch)")

    def index_per_key(self) -> dict[str, int]:
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        return self._index_per_key

    def lengths_offset_per_key(self) -> list[int]:
        """Where each feature's lengths start in ``lengths()``, then their count."""
        return _running(self.stride_per_key())

    def length_per_key(self) -> list[int]:
        """Ids per feature (reads the lengths on the host once; cached)."""
        if self._length_per_key is None:
            n, b, lengths = len(self._keys), self.stride(), self.lengths()
            if lengths.numel() != n * b:
                raise ValueError(f"KeyedJaggedTensor: lengths has {lengths.numel()} entries, not {n} "
                                 f"features x batch size {b}")
            if not self._keys:
                self._length_per_key = []
            else:
                per_bag = lengths.reshape(n, b)
                self._length_per_key = [int(x) for x in per_bag.sum(dim=1).tolist()]
        return self._length_per_key

    def length_per_key_or_none(self) -> list[int] | None:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        """Where each feature's ids start in ``values()``, then their count (cached)."""
        if self._offset_per_key is None:
            self._offset_per_key = _running(self.length_per_key())
        return self._offset_per_key

    def offset_per_key_or_none(self) -> list[int] | None:
        return self._offset_per_key

    def sync(self) -> KeyedJaggedTensor:
        """Read the per-key figures now (one host read), so later calls don't."""
        self.offset_per_key()
        return self

    def unsync(self) -> KeyedJaggedTensor:
        """Forget the per-key figures (the next call that needs them reads them again)."""
        self._length_per_key = self._offset_per_key = None
        return self

    def size_in_bytes(self) -> int:
        return sum(t.element_size() * t.numel()
                   for t in (self._values, self._weights, self._lengths, self._offsets) if t is not None)

    # ------------------------------------------------------------------------ views and re-layouts

    def __getitem__(self, key: str) -> JaggedTensor:
        """Feature ``key``'s bags (views of this batch's tensors)."""
        index = self.index_per_key().get(key)
        if index is None:
            raise KeyError(f"feature {key!r} is not in this batch; it has {self._keys}")
        start, end = self.offset_per_key()[index], self.offset_per_key()[index + 1]
        b = self.stride()
        return JaggedTensor._of(self._values[start:end], _apply(self._weights, lambda w: w[start:end]),
                                self.lengths()[index * b : (index + 1) * b], None)

    def to_dict(self) -> dict[str, JaggedTensor]:
        """Every feature's ``JaggedTensor`` (with lengths and offsets from 0), in key order; cached."""
        if self._jt_dict is None:
            lpk, n, b = self.length_per_key(), len(self._keys), self.stride()
            values = torch.split(self._values, lpk)
            weights = None if self._weights is None else torch.split(self._weights, lpk)
            per_bag = self.lengths().reshape(n, b)
            offsets = torch.cat([per_bag.new_zeros(n, 1), torch.cumsum(per_bag, 1, dtype=per_bag.dtype)], 1)
            self._jt_dict = {k: JaggedTensor._of(values[i], None if weights is None else weights[i],
                                                 per_bag[i], offsets[i]) for i, k in enumerate(self._keys)}
        return self._jt_dict

    def permute(self, indices: Sequence[int],
                indices_tensor: torch.Tensor | None = None) -> KeyedJaggedTensor:
        """A batch of features ``keys()[i] for i in indices`` (an index may repeat or be left out).
        ``indices_tensor`` is accepted for TorchRec's signature; ``indices`` decides."""
        n = len(self._keys)
        bad = [i for i in indices if not isinstance(i, int) or not -n <= i < n]
        if bad:
            raise ValueError(f"KeyedJaggedTensor.permute: index {bad[0]!r} is not a feature index in "
                             f"[0, {n})")
        idx = [i % n for i in indices]
        lpk, b = self.length_per_key(), self.stride()
        per_bag = self.lengths().reshape(n, b)
        values = torch.split(self._values, lpk)
        weights = None if self._weights is None else torch.split(self._weights, lpk)

        def pick(parts: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
            return torch.cat([parts[i] for i in idx]) if idx else like[:0]

        return KeyedJaggedTensor._of(
            [self._keys[i] for i in idx], pick(values, self._values),
            None if weights is None else pick(weights, self._weights),
            pick(per_bag, per_bag).reshape(-1), None, b, [lpk[i] for i in idx] if idx else None)

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """Consecutive batches of ``segments[0]``, ``segments[1]``, ... features each (views). A segment
        of every feature is this batch itself."""
        if any(not isinstance(s, int) or s < 0 for s in segments) or sum(segments) > len(self._keys):
            raise ValueError(f"KeyedJaggedTensor.split: segments {list(segments)} must be counts >= 0 adding "
                             f"up to at most its {len(self._keys)} features")
        out, start = [], 0
        lpk, opk, b = self.length_per_key(), self.offset_per_key(), self.stride()
        for segment in segments:
            end = start + segment
            if segment == len(self._keys):
                out.append(self)
            elif segment == 0:
                out.append(self._none_like())
            else:
                ids = slice(opk[start], opk[end])
                weights = None if self._weights is None else self._weights[ids]
                lengths = self.lengths()[start * b : end * b]
                out.append(KeyedJaggedTensor._of(self._keys[start:end], self._values[ids], weights, lengths,
                                                 None, b, lpk[start:end]))
            start = end
        return out

    def _none_like(self) -> KeyedJaggedTensor:
        """No features, this batch's size, dtypes and device (``split``'s empty segments)."""
        def empty(dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(0, dtype=dtype, device=self.device())

        weights = _apply(self._weights, lambda w: empty(w.dtype))
        return KeyedJaggedTensor._of([], empty(self._values.dtype), weights, empty(torch.int32),
                                     empty(torch.int32), self.stride())

    def flatten_lengths(self) -> KeyedJaggedTensor:
        """The same batch with 1-D lengths and its per-key figures read."""
        return KeyedJaggedTensor._of(self._keys, self._values, self._weights, self.lengths().reshape(-1),
                                     None, self._stride, self.length_per_key())

    # ------------------------------------------------------------------------ devices and streams

    def to(self, device: torch.device | str, non_blocking: bool = False,
           dtype: torch.dtype | None = None) -> KeyedJaggedTensor:
        """This batch on ``device``; ``dtype`` converts the weights only (TorchRec's ``to``)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        weights = _apply(self._weights, lambda w: w.to(device=device, dtype=dtype, non_blocking=non_blocking))
        return self._moved(move, weights)

    def pin_memory(self) -> KeyedJaggedTensor:
        """This batch in pinned host memory."""
        return self._moved(torch.Tensor.pin_memory, _apply(self._weights, torch.Tensor.pin_memory))

    def _moved(self, fn: Callable[[torch.Tensor], torch.Tensor],
               weights: torch.Tensor | None) -> KeyedJaggedTensor:
        # lengths and offsets given together were checked when this batch was made: not again (no sync)
        return KeyedJaggedTensor._of(self._keys, fn(self._values), weights, _apply(self._lengths, fn),
                                     _apply(self._offsets, fn), self._stride, self._length_per_key,
                                     self._offset_per_key, self._index_per_key)

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark every tensor of this batch as used on ``stream`` (see ``torch.Tensor.record_stream``)."""
        _record(stream, self._values, self._weights, self._lengths, self._offsets)

    # ------------------------------------------------------------------------ TorchRec's input_dist

    def dist_labels(self) -> list[str]:
        return ["lengths", "values"] + (["weights"] if self._weights is not None else [])

    def dist_splits(self, key_splits: Sequence[int]) -> list[list[int]]:
        """Per group of ``key_splits`` features: its lengths entries, its ids (and its weights)."""
        bounds = _running(key_splits)
        lpk, b = self.length_per_key(), self.stride()
        ids = [sum(lpk[bounds[i] : bounds[i + 1]]) for i in range(len(key_splits))]
        return [[b * n for n in key_splits], ids] + ([ids] if self._weights is not None else [])

    def dist_tensors(self) -> list[torch.Tensor]:
        return [self.lengths(), self._values] + ([self._weights] if self._weights is not None else [])

    def __repr__(self) -> str:
        return (f"KeyedJaggedTensor(keys={self._keys}, values={tuple(self._values.shape)}, "
                f"stride={self.stride()}, weighted={self._weights is not None})")


def _check_stride(keys: list[str], lengths: torch.Tensor | None, offsets: torch.Tensor | None,
                  stride: int | None) -> None:
    """A given stride must be a batch size the tensors have room for (sizes only: no device read)."""
    if stride is None:
        return
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
        raise TypeError(f"KeyedJaggedTensor stride must be an int >= 0 (the batch size), got {stride!r}")
    entries = lengths.numel() if lengths is not None else max(offsets.numel() - 1, 0)
    if entries != stride * len(keys):
        raise ValueError(f"KeyedJaggedTensor: stride {stride} with {len(keys)} features needs "
                         f"{stride * len(keys)} lengths, got {entries}")


def _check_per_key(keys: list[str], values: torch.Tensor, length_per_key: Sequence[int] | None,
                   offset_per_key: Sequence[int] | None, index_per_key: Mapping[str, int] | None,
                   ) -> tuple[list[int] | None, list[int] | None, dict[str, int] | None]:
    """Per-key figures given to the constructor, checked against the sizes (no device read)."""
    n, total = len(keys), values.numel()
    lpk = None if length_per_key is None else [int(x) for x in length_per_key]
    opk = None if offset_per_key is None else [int(x) for x in offset_per_key]
    if lpk is not None and (len(lpk) != n or sum(lpk) != total or min(lpk, default=0) < 0):
        raise ValueError(f"KeyedJaggedTensor length_per_key {lpk} must be {n} counts adding up to the "
                         f"{total} values")
    if opk is not None and (len(opk) != n + 1 or opk[0] != 0 or opk[-1] != total
                            or (lpk is not None and opk != _running(lpk))):
        raise ValueError(f"KeyedJaggedTensor offset_per_key {opk} must be 0, the running sum of the "
                         f"{n} features' ids, ending at the {total} values")
    if index_per_key is not None and dict(index_per_key) != {k: i for i, k in enumerate(keys)}:
        raise ValueError(f"KeyedJaggedTensor index_per_key {dict(index_per_key)} must map each key to its "
                         "position in keys")
    return lpk, opk, None if index_per_key is None else dict(index_per_key)


def as_kjt(batch: object) -> KeyedJaggedTensor:
    """Our KeyedJaggedTensor, or a ``torchrec.KeyedJaggedTensor`` converted (sharing its tensors)."""
    if isinstance(batch, KeyedJaggedTensor):
        return batch
    cls = type(batch)
    if cls.__name__ == "KeyedJaggedTensor" and cls.__module__.startswith("torchrec"):
        if batch.variable_stride_per_key():
            raise ValueError(f"torchrec.KeyedJaggedTensor with {_VARIABLE_BATCH}")
        return KeyedJaggedTensor._of(list(batch.keys()), batch.values(), batch.weights_or_none(),
                                     batch.lengths(), None, batch.stride())
    raise TypeError(f"expected a te.KeyedJaggedTensor or torchrec.KeyedJaggedTensor, "
                    f"got {cls.__module__}.{cls.__name__}")


class KeyedTensor:
    """Pooled embeddings of several features side by side: values (B, sum(dims)).

    Args:
        keys: feature names.
        length_per_key: each feature's width along ``key_dim``.
        values: the features' blocks concatenated along ``key_dim`` (1: values is (B, sum(dims))).

    ``kt["feature"]`` is that feature's (B, D) block; ``to_dict()`` gives all of them;
    ``KeyedTensor.regroup`` gathers blocks of several KeyedTensors into new groups.
    """

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor,
                 key_dim: int = 1, offset_per_key: Sequence[int] | None = None,
                 index_per_key: Mapping[str, int] | None = None) -> None:
        if isinstance(keys, str):
            raise TypeError("KeyedTensor keys must be a list of names, not a string")
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"KeyedTensor values must be a tensor, got {type(values).__name__}")
        self._keys, self._length_per_key = list(keys), list(length_per_key)
        if len(self._keys) != len(self._length_per_key):
            raise ValueError(f"KeyedTensor has {len(self._keys)} keys but {len(self._length_per_key)} "
                             "lengths")
        if not -values.dim() <= key_dim < values.dim():
            raise ValueError(f"KeyedTensor key_dim {key_dim} is not a dimension of values "
                             f"{tuple(values.shape)}")
        if sum(self._length_per_key) != values.size(key_dim):
            raise ValueError(f"KeyedTensor lengths {self._length_per_key} add up to "
                             f"{sum(self._length_per_key)}, but values has {values.size(key_dim)} along "
                             f"dim {key_dim}")
        self._values, self._key_dim = values, key_dim
        self._offset_per_key = None if offset_per_key is None else list(offset_per_key)
        self._index_per_key = None if index_per_key is None else dict(index_per_key)

    @staticmethod
    def from_tensor_list(keys: Sequence[str], tensors: Sequence[torch.Tensor], key_dim: int = 1,
                         cat_dim: int = 1) -> KeyedTensor:
        """One key per tensor, concatenated along ``cat_dim``."""
        return KeyedTensor(keys, [t.shape[key_dim] for t in tensors], torch.cat(list(tensors), dim=cat_dim),
                           key_dim)

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def device(self) -> torch.device:
        return self._values.device

    def length_per_key(self) -> list[int]:
        return self._length_per_key

    def offset_per_key(self) -> list[int]:
        if self._offset_per_key is None:
            self._offset_per_key = _running(self._length_per_key)
        return self._offset_per_key

    def _index(self, key: str) -> int:
        if self._index_per_key is None:
            self._index_per_key = {k: i for i, k in enumerate(self._keys)}
        if key not in self._index_per_key:
            raise KeyError(f"{key!r} is not a key of this KeyedTensor; it has {self._keys}")
        return self._index_per_key[key]

    def __getitem__(self, key: str) -> torch.Tensor:
        i = self._index(key)
        return self._values.narrow(self._key_dim, self.offset_per_key()[i], self._length_per_key[i])

    def to_dict(self) -> dict[str, torch.Tensor]:
        parts = torch.split(self._values, self._length_per_key, dim=self._key_dim)
        return dict(zip(self._keys, parts))

    @staticmethod
    def regroup(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]]) -> list[torch.Tensor]:
        """One tensor per group: its keys' blocks, in order, concatenated along the key dimension (a
        key may appear in several groups; each key must belong to one KeyedTensor)."""
        if len(keyed_tensors) == 0:
            raise ValueError("KeyedTensor.regroup needs at least one KeyedTensor")
        owner: dict[str, KeyedTensor] = {}
        for kt in keyed_tensors:
            names = kt.keys()
            for key in names:
                if owner.setdefault(key, kt) is not kt:
                    raise ValueError(f"KeyedTensor.regroup: key {key!r} is in more than one KeyedTensor")
        missing = [key for group in groups for key in group if key not in owner]
        if missing:
            raise ValueError(f"KeyedTensor.regroup: key {missing[0]!r} is in no KeyedTensor")
        dim = keyed_tensors[0].key_dim()
        return [torch.cat([owner[key][key] for key in group], dim=dim) for group in groups]

    @staticmethod
    def regroup_as_dict(keyed_tensors: Sequence[KeyedTensor], groups: Sequence[Sequence[str]],
                        keys: Sequence[str]) -> dict[str, torch.Tensor]:
        """``regroup``, each group's tensor under the name at its position in ``keys``."""
        if len(groups) != len(keys):
            raise ValueError(f"KeyedTensor.regroup_as_dict: {len(groups)} groups but {len(keys)} names")
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups)))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedTensor:
        values = self._values.to(device, non_blocking=non_blocking)
        return KeyedTensor(self._keys, self._length_per_key, values, self._key_dim, self._offset_per_key,
                           self._index_per_key)

    def record_stream(self, stream: torch.Stream) -> None:
        self._values.record_stream(stream)

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, values={tuple(self._values.shape)})"
