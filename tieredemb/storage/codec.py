"""Byte formats shared by the RocksDB and Redis backends (vectorized with numpy).

    key   8 bytes: big-endian uint64 of (key XOR 2**63), so byte order is numeric order of the
          signed key (RocksDB iterates a table by ascending key)
    row   4 * W bytes: the row's float32 values, little-endian, no header

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


def row_bytes(rows: torch.Tensor) -> list[bytes]:
    """float32 (n, W) -> n ``bytes`` of 4 * W each."""
    r = np.ascontiguousarray(rows.detach().to(device="cpu", dtype=torch.float32).numpy(), dtype="<f4")
    if r.shape[0] == 0:
        return []
    return r.view(f"V{r.shape[1] * 4}").reshape(-1).tolist()


def decode_rows(values: list[bytes | None], width: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """n values (``None``: absent) -> (rows float32 (n, W), zeros where absent; found bool (n,)).

    A stored value of another length than 4 * W (a store written with another row width) raises
    ``BackendError`` naming ``where``.
    """
    n = len(values)
    found = np.fromiter((v is not None for v in values), dtype=bool, count=n)
    rows = np.zeros((n, width), dtype=np.float32)
    present = [v for v in values if v is not None]
    if present:
        lengths = np.fromiter(map(len, present), dtype=np.int64, count=len(present))
        if bool((lengths != 4 * width).any()):
            bad = int(lengths[lengths != 4 * width][0])
            raise BackendError(
                f"{where}: a stored row has {bad} bytes, this table's rows have {4 * width} "
                f"(width {width}): the store was written with another embedding_dim or optimizer"
            )
        rows[found] = np.frombuffer(b"".join(present), dtype="<f4").reshape(-1, width)
    return torch.from_numpy(rows), torch.from_numpy(found)
