"""Criteo-format click logs: ``label \\t 13 ints \\t 26 hex ids`` per line, any field but the label empty.

Dense features: a missing value is 0, then ``log(1 + max(x, 0))`` (Criteo's counts are heavy-tailed and
a few are negative). Categorical ids: the hex string read as an unsigned 64-bit number and wrapped to
int64 (Criteo's are 8 hex digits); a missing id becomes ``missing_id(f) = -(f + 1)``, one dedicated id
per feature that no hex string of up to 16 digits maps to except ``ffff...`` patterns, and never
``te.RESERVED_KEY``.

``CriteoClicks`` reads a file into memory and serves the leading rows as training batches (cycling in
file order) and the trailing ``eval_fraction`` as the held-out eval set: Criteo logs are in time
order, so the tail is "the future".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path

import torch

from tieredemb.data import NUM_DENSE, NUM_SPARSE, ClickBatch
from tieredemb.keys import RESERVED_KEY

logger = logging.getLogger(__name__)

NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


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
    dense = [math.log1p(max(int(x), 0)) if x else 0.0 for x in fields[1 : 1 + NUM_DENSE]]
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


def read_criteo_tsv(path: str | Path, max_rows: int | None = None) -> ClickBatch:
    """Read (up to ``max_rows`` non-blank rows of) a Criteo-format TSV file into memory."""
    with open(path, encoding="ascii") as f:
        if max_rows is None:
            return parse_lines(f)
        lines = []
        for line in f:
            if line.strip():
                lines.append(line)
                if len(lines) == max_rows:
                    break
        return parse_lines(lines)


class CriteoClicks:
    """A Criteo TSV file as a click source: leading rows train, the trailing fraction evaluates.

    Args:
        path: the TSV file.
        eval_fraction: share of rows (at the end of the file) held out for eval.
        max_rows: read at most this many rows.
    """

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
        n = len(self._train)
        rows = (torch.arange(batch_size) + index * batch_size) % n
        t = self._train
        return ClickBatch(t.dense[rows], t.ids[:, rows], t.labels[rows])

    def eval_set(self) -> ClickBatch:
        """The trailing rows of the file."""
        return self._eval


__all__ = ["CriteoClicks", "missing_id", "parse_hex_id", "parse_line", "parse_lines", "read_criteo_tsv"]
