"""Byte formats shared by the RocksDB and Redis backends (vectorized with numpy).

    key   8 bytes: big-endian uint64 of (key XOR 2**63), so byte order is numeric order of the
          signed key (RocksDB iterates a table by ascending key)
    row   W * 2 or W * 4 bytes: the row's values in the table's dtype (float32, bfloat16 or
          float16), little-endian, no header

This format is what the stores hold: changing it makes existing stores unreadable.
"""

from __future__ import annotations

import numpy as np
import torch

from tieredemb.storage.errors import BackendError

_SIGN = np.uint64(1 << 63)


def encode_keys(keys: torch.Tensor) -> np.ndarray:
    """int64 (n,) cpu -> big-endian uint64 (n,) of key XOR 2**63 (numeric order = byte order)."""
    k = np.ascontiguousarray(keys.reshape(-1).to(torch.int64).numpy())
    return (k.view(np.uint64) ^ _SIGN).astype(">u8")


def key_bytes(encoded: np.ndarray) -> list[bytes]:
    """Encoded keys (n,) -> n 8-byte ``bytes`` (the one list the stores' APIs take)."""
    return np.ascontiguousarray(encoded, dtype=">u8").view("V8").tolist()


def decode_keys(raw: list[bytes]) -> torch.Tensor:
    """n 8-byte ``bytes`` (as ``key_bytes`` made them) -> int64 (n,)."""
    enc = np.frombuffer(b"".join(raw), dtype=">u8")
    return torch.from_numpy((enc.astype(np.uint64) ^ _SIGN).view(np.int64).copy())


def row_bytes(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> list[bytes]:
    """(n, W) rows -> n ``bytes`` of ``W * dtype.itemsize`` each: the rows in ``dtype`` (rounded to
    it, to the nearest value, if they are of another float type), little-endian."""
    r = rows.detach().to(device="cpu", dtype=dtype).contiguous()
    if r.shape[0] == 0:
        return []
    raw = np.ascontiguousarray(r.view(torch.uint8).numpy())  # (n, W * itemsize), this machine's order
    if _BIG_ENDIAN and dtype.itemsize > 1:
        raw = raw.reshape(r.shape[0], -1, dtype.itemsize)[..., ::-1].reshape(r.shape[0], -1).copy()
    return raw.view(f"V{raw.shape[1]}").reshape(-1).tolist()


def decode_rows(values: list[bytes | None], width: int, where: str,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """n values (``None``: absent) -> (rows (n, W) in ``dtype``, zeros where absent; found bool (n,)).

    A stored value of another length than ``W * dtype.itemsize`` (a store written with another row
    width or dtype) raises ``BackendError`` naming ``where``.
    """
    n = len(values)
    size = width * dtype.itemsize
    found = np.fromiter((v is not None for v in values), dtype=bool, count=n)
    every = bool(found.all())
    present = values if every else [v for v in values if v is not None]
    raw = None if every and n else np.zeros((n, size), dtype=np.uint8)
    if present:
        lengths = np.fromiter(map(len, present), dtype=np.int64, count=len(present))
        if bool((lengths != size).any()):
            bad = int(lengths[lengths != size][0])
            raise BackendError(
                f"{where}: a stored row has {bad} bytes, this table's rows have {size} "
                f"(width {width} of {str(dtype).removeprefix('torch.')}): the store was written with "
                "another embedding_dim, optimizer or dtype"
            )
        got = np.frombuffer(bytearray().join(present), dtype=np.uint8).reshape(-1, size)  # writable
        if _BIG_ENDIAN and dtype.itemsize > 1:
            got = got.reshape(got.shape[0], -1, dtype.itemsize)[..., ::-1].reshape(got.shape[0], -1).copy()
        if raw is None:  # every key found: the joined bytes are the rows
            raw = got
        else:
            raw[found] = got
    if n == 0:  # (an empty byte tensor has no stride to view another type through)
        return torch.zeros(0, width, dtype=dtype), torch.from_numpy(found)
    return torch.from_numpy(raw).view(dtype), torch.from_numpy(found)


_BIG_ENDIAN = np.little_endian is False  # the stored bytes are little-endian on every machine
