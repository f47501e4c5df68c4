"""Criteo-format click logs: ``label \\t 13 ints \\t 26 hex ids`` per line, any field but the label empty.

Dense features: a missing value is 0, then ``log(1 + max(x, 0))`` (Criteo's counts are heavy-tailed and
a few are negative). Categorical ids: the hex string read as an unsigned 64-bit number and wrapped to
int64 (Criteo's are 8 hex digits); a missing id becomes ``missing_id(f) = -(f + 1)``, one dedicated id
per feature that no hex string of up to 16 digits maps to except ``ffff...`` patterns, and never
``te.RESERVED_KEY``.

``CriteoClicks`` reads a file into memory and serves the leading rows as training batches (cycling in
file order) and the trailing ``eval_fraction`` as the held-out eval set: Criteo logs are in time
order, so the tail is "the future".

Reading is vectorized: the file goes through numpy a block of lines at a time (``_parse_block``), at
about 25x the rate of the line-by-line parser (``parse_lines``, the reference). A block the fast path
does not take as it is (a blank or malformed line, a sign, ``\\r``, more digits than it reads) goes
through the reference, which reads it the same way or raises naming the line.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from tieredemb.data import (
    CLICK_FEATURES,
    NUM_DENSE,
    NUM_SPARSE,
    Baseline,
    ClickBatch,
    cat_batches,
    cyclic_batch,
)
from tieredemb.keys import RESERVED_KEY

logger = logging.getLogger(__name__)

NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1
_BLOCK_BYTES = 8 << 20  # text parsed at a time: ~30k lines, ~100 MB of numpy temporaries
_MAX_LINE = 64 << 20  # longer lines are not Criteo's (a binary file, a wrong file)
_MAX_DECIMAL = 18  # digits of a dense value the fast path reads (int64 holds 18 for sure)


def missing_id(feature: int) -> int:
    """The id standing for an empty field of categorical feature ``feature`` (0-based)."""
    return -(feature + 1)


def parse_hex_id(text: str, feature: int) -> int:
    """A hex id as int64 (unsigned 64-bit wrapped to signed); empty -> ``missing_id(feature)``."""
    if not text:
        return missing_id(feature)
    if len(text) > 16:
        raise ValueError(f"categorical feature {feature}: id {text!r} is longer than 16 hex digits")
    value = int(text, 16)
    if value > _I64_MAX:
        value -= _U64
    if value == RESERVED_KEY:
        raise ValueError(f"categorical feature {feature}: id {text!r} is te.RESERVED_KEY")
    return value


def parse_line(line: str) -> tuple[float, list[float], list[int]]:
    """One TSV line -> (label, 13 transformed dense values, 26 int64 ids)."""
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != NUM_FIELDS:
        raise ValueError(f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}")
    if fields[0] not in ("0", "1"):
        raise ValueError(f"label must be 0 or 1, got {fields[0]!r}")
    try:
        dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1 : 1 + NUM_DENSE]]
    except ValueError as e:
        raise ValueError(f"dense features must be integers: {e}") from None
    ids = [parse_hex_id(x, f) for f, x in enumerate(fields[1 + NUM_DENSE :])]
    return float(fields[0]), dense, ids


def parse_lines(lines: Iterable[str], first_line: int = 1) -> ClickBatch:
    """Parse Criteo TSV lines into one ClickBatch (``true_logits`` None). Blank lines are skipped.

    Raises ``ValueError`` naming the line number (counting from ``first_line``) of a malformed line.
    """
    labels: list[float] = []
    dense: list[list[float]] = []
    ids: list[list[int]] = []
    for number, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        try:
            label, row_dense, row_ids = parse_line(line)
        except ValueError as e:
            raise ValueError(f"Criteo line {number}: {e}") from e
        labels.append(label)
        dense.append(row_dense)
        ids.append(row_ids)
    return ClickBatch(
        dense=torch.tensor(dense, dtype=torch.float32).reshape(-1, NUM_DENSE),
        ids=torch.tensor(ids, dtype=torch.int64).reshape(-1, NUM_SPARSE).T.contiguous(),
        labels=torch.tensor(labels, dtype=torch.float32),
    )


_HEX = np.full(256, 255, dtype=np.uint8)  # byte -> its hex digit's value, 255 for any other byte
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


def _digits(text: np.ndarray, end: np.ndarray, width: np.ndarray, base: int,
            dtype: type) -> np.ndarray | None:
    """The numbers in fields ``text[end - width : end]`` (each of at most 16 digits of ``base``), or
    None if a byte there is not such a digit. Horner's rule over the fields right-aligned, one
    digit column of every field at a time (a short field's absent leading digits count as 0).
    text: uint8 (n_bytes,); end, width: int32 (m,) -> dtype (m,)."""
    w = int(width.max(initial=0))
    value = np.zeros(end.shape, dtype=dtype)
    bad = False
    for k in range(w):  # the column w - k digits before each field's end
        digit = _HEX[text[end - (w - k)]]  # a short field's column reads an earlier byte: zeroed
        digit *= width >= w - k
        bad |= bool((digit >= base).any())
        value *= dtype(base)
        value += digit
    return None if bad else value


def _parse_block(text: np.ndarray) -> ClickBatch | None:
    """Lines ``text`` (uint8, ending with ``\\n``, no blank line) parsed without a Python loop over
    lines, or None where the fast path does not take a byte of them (``parse_lines`` then decides)."""
    seps = np.flatnonzero((text == 9) | (text == 10))  # every tab and newline, in order
    if seps.size % NUM_FIELDS or (text == 13).any():
        return None
    seps = seps.reshape(-1, NUM_FIELDS)  # (n, 40): the byte ending each field
    if (text[seps[:, :-1]] != 9).any() or (text[seps[:, -1]] != 10).any():
        return None  # a line with another number of fields
    seps = seps.astype(np.int32)  # blocks are far below 2 GiB
    start = np.empty_like(seps)
    start[:, 0] = np.concatenate([[0], seps[:-1, -1] + 1])
    start[:, 1:] = seps[:, :-1] + 1
    width = seps - start  # (n, 40)
    label = text[start[:, 0]]
    if (width[:, 0] != 1).any() or ((label != 48) & (label != 49)).any():
        return None  # a label that is not 0 or 1
    dense_end, dense_w = seps[:, 1 : 1 + NUM_DENSE].ravel(), width[:, 1 : 1 + NUM_DENSE].ravel()
    negative = (dense_w > 1) & (text[dense_end - dense_w] == 45)  # "-12": a count below 0 reads as 0
    ids_end, ids_w = seps[:, 1 + NUM_DENSE :].ravel(), width[:, 1 + NUM_DENSE :].ravel()
    if dense_w.max(initial=0) > _MAX_DECIMAL or ids_w.max(initial=0) > 16:
        return None
    dense = _digits(text, dense_end, dense_w - negative, 10, np.int64)
    ids = _digits(text, ids_end, ids_w, 16, np.uint64)
    if dense is None or ids is None:
        return None
    dense[negative] = 0
    ids = ids.view(np.int64).reshape(-1, NUM_SPARSE)  # unsigned 64-bit wrapped to int64
    ids = np.where(ids_w.reshape(-1, NUM_SPARSE) == 0, np.arange(-1, -NUM_SPARSE - 1, -1), ids)
    if (ids == RESERVED_KEY).any():
        return None
    return ClickBatch(
        dense=torch.from_numpy(np.log1p(dense.reshape(-1, NUM_DENSE)).astype(np.float32)),
        ids=torch.from_numpy(np.ascontiguousarray(ids.T)),
        labels=torch.from_numpy((label == 49).astype(np.float32)),
    )


def _reference_block(block: bytes, first_line: int) -> ClickBatch:
    """``parse_lines`` over a block: the same rows, or a ``ValueError`` naming the line."""
    lines = block.split(b"\n")
    for number, raw in enumerate(lines, start=first_line):
        try:
            raw.decode("ascii")
        except UnicodeDecodeError as e:
            raise ValueError(f"Criteo line {number}: not ASCII text (byte 0x{raw[e.start]:02x} at "
                             f"column {e.start + 1})") from None
    return parse_lines((raw.decode("ascii") for raw in lines), first_line)


def _blocks(path: str | Path) -> Iterator[tuple[bytes, int]]:
    """The file as (block of whole lines ending with ``\\n``, the number of its first line)."""
    line = 1
    rest = b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_BLOCK_BYTES)
            if not chunk:
                break
            text = rest + chunk
            cut = text.rfind(b"\n") + 1
            if cut == 0:
                if len(text) > _MAX_LINE:
                    raise ValueError(f"{path}: line {line} is longer than {_MAX_LINE >> 20} MiB: "
                                     "not a Criteo TSV file")
                rest = text
                continue
            yield text[:cut], line
            line += text.count(b"\n", 0, cut)
            rest = text[cut:]
    if rest:
        yield rest + b"\n", line


def _parse(block: bytes, first_line: int, path: str | Path) -> ClickBatch:
    """One block's rows: the fast path, or the reference where it does not take the block."""
    blank = b"\n\n" in block or block.startswith(b"\n")  # blank lines: the reference skips them
    fast = None if blank else _parse_block(np.frombuffer(block, np.uint8))
    try:
        return fast if fast is not None else _reference_block(block, first_line)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def read_criteo_tsv(path: str | Path, max_rows: int | None = None, workers: int | None = None) -> ClickBatch:
    """Read (up to ``max_rows`` non-blank rows of) a Criteo-format TSV file into memory, its blocks
    parsed on ``workers`` threads (numpy releases the GIL; default: the CPU count, at most 8).

    Raises ``ValueError`` naming the file and the line of a malformed line."""
    workers = workers or min(8, os.cpu_count() or 1)
    parts: list[ClickBatch] = []
    rows = 0
    with ThreadPoolExecutor(workers, thread_name_prefix="tieredemb-criteo") as pool:
        pending: deque[Future] = deque()
        blocks = _blocks(path)
        while max_rows is None or rows < max_rows:
            while len(pending) < workers:  # read ahead by ``workers`` blocks, no further
                block = next(blocks, None)
                if block is None:
                    break
                pending.append(pool.submit(_parse, *block, path))
            if not pending:
                break
            parts.append(pending.popleft().result())
            rows += len(parts[-1])
        for future in pending:
            future.cancel()
    batch = cat_batches(parts) if parts else parse_lines([])
    return batch if max_rows is None else batch.slice(0, max_rows)


class CriteoClicks:
    """A Criteo TSV file as a click source: leading rows train, the trailing fraction evaluates.

    Args:
        path: the TSV file.
        eval_fraction: share of rows (at the end of the file) held out for eval.
        max_rows: read at most this many rows.
    """

    features = CLICK_FEATURES
    num_dense = NUM_DENSE

    def __init__(self, path: str | Path, eval_fraction: float = 0.1, max_rows: int | None = None) -> None:
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        rows = read_criteo_tsv(path, max_rows)
        n_eval = max(1, round(len(rows) * eval_fraction))
        if len(rows) - n_eval < 1:
            raise ValueError(f"{path}: {len(rows)} rows are too few to split into train and eval")
        self._train = rows.slice(0, len(rows) - n_eval)
        self._eval = rows.slice(len(rows) - n_eval, len(rows))
        logger.info("read %s: %d training rows, %d eval rows", path, len(self._train), n_eval)

    def train_batch(self, index: int, batch_size: int) -> ClickBatch:
        """Rows ``[index * batch_size, (index + 1) * batch_size)`` of the training rows, cyclically."""
        return cyclic_batch(self._train, index, batch_size)

    def eval_set(self) -> ClickBatch:
        """The trailing rows of the file."""
        return self._eval

    def baseline(self) -> Baseline | None:
        """None: Criteo's ids are anonymous, no one of them is the item."""
        return None


__all__ = ["CriteoClicks", "missing_id", "parse_hex_id", "parse_line", "parse_lines", "read_criteo_tsv"]
