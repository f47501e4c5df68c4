"""The one error a checkpoint raises."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupted, truncated, crafted, or for another model.
    The message names the file (or the table) and what is wrong."""


__all__ = ["CheckpointError"]
