"""Errors of the backing stores.

A backend raises ``BackendError`` chained (``raise ... from cause``) to what the store or the
operating system said, so the training thread sees one exception type with the original beneath it.
"""

from __future__ import annotations


class BackendError(RuntimeError):
    """A backing-store operation failed (I/O error, store unreachable or refusing, timeout).

    ``__cause__`` holds the original exception (an ``OSError``, a RocksDB status, a ``redis``
    exception). Rows handed to a failed ``set`` are still the caller's: retry with the same rows.
    """


class ExistingRowsError(BackendError):
    """The store already holds rows of the table and the spec says ``existing="error"``."""
