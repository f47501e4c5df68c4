"""The interface of a backing store below the device cache: copy-based, one table per instance.

Every backend (host memory, RocksDB, Redis) answers the same verbs with the same shapes:

    get(keys: int64 (n,))                -> Fetched(rows: (n, W), found: bool (n,))
    set(keys: int64 (n,), rows: (n, W))                   upsert

Rows are in the backend's ``dtype`` (the table's: float32, bfloat16 or float16); ``set`` rounds rows
of another float dtype to it (to the nearest value).

Keys and rows are on ``backend.device``: the CPU for RocksDB and Redis; the GPU for host memory
under a CUDA collection (its index is on the GPU, its rows in pinned host memory).
    delete(keys: int64 (n,) cpu)
    scan(chunk_rows: int) -> iterator of (keys (m,), rows (m, W)), every stored row once
    size() -> int; flush() (durable/visible to a new reader); close()

Rows absent from the store come back as zeros with ``found`` False; the caller initializes them.
Calls on one backend are made from one I/O worker thread at a time, in submission order (DESIGN
section 4 rule 3), so a backend needs no locking of its own against reordering.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class Fetched:
    """Answer of ``Backend.get``: rows (n, W) in the backend's dtype (zeros where absent), found bool
    (n,), on the backend's device."""

    rows: torch.Tensor
    found: torch.Tensor


def add_bytes(*parts: dict[str, int]) -> dict[str, int]:
    """The sum of byte counts by place ("device", "host", ...)."""
    out: dict[str, int] = {}
    for part in parts:
        for where, n in part.items():
            out[where] = out.get(where, 0) + n
    return out


class Backend(ABC):
    """One table's rows in a backing store. ``width`` is the row width W (weights + state), ``dtype``
    the rows' storage type."""

    width: int
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")  # where get/set take and give keys and rows

    @abstractmethod
    def get(self, keys: torch.Tensor) -> Fetched: ...

    @abstractmethod
    def set(self, keys: torch.Tensor, rows: torch.Tensor) -> None: ...

    @abstractmethod
    def delete(self, keys: torch.Tensor) -> None: ...

    @abstractmethod
    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def scan_keys(self, chunk_rows: int = 65536) -> Iterator[torch.Tensor]:
        """``scan``'s keys alone (a store that can skip reading the rows does)."""
        for keys, _ in self.scan(chunk_rows):
            yield keys

    @abstractmethod
    def size(self) -> int: ...

    def flush(self) -> None:  # noqa: B027 - optional: most stores are durable after set
        """Make every ``set`` durable / visible to a new reader (no-op where it already is)."""

    def index_bytes(self) -> dict[str, int]:
        """Bytes of the key index this process keeps to find the table's rows, by where it lives:
        "device" (a CUDA device's memory) or "host". Empty here: the store indexes its own rows
        (RocksDB, Redis)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional: nothing to release for in-memory stores
        """Release files, connections and memory."""

    def read_ahead(self, keys: torch.Tensor) -> None:  # noqa: B027 - optional: a tier in front reads
        """Start reading the rows of ``keys`` (int64 (n,) on ``device``) into a faster tier in front,
        without waiting (a host tier); nothing here: a store without one answers ``get`` itself."""

    def tier_stats(self):
        """The counters of a tier in front of the store (``HostTierStats``), None without one."""
        return None


class DeviceRows(ABC):
    """A backing store's rows as the device moves them, by address, with no host read: the verbs of
    a cache's insertion on the device (``CacheTier._insert_on_device``, replayed from a CUDA graph),
    which writes its victims down while it reads its misses up. A store whose rows the device
    reaches (host memory, pinned, under a CUDA collection) offers them as ``GroupStore.device_rows``.

    Keys and tables are int64 on the store's device, ``RESERVED_KEY`` a padding entry (no pair).
    ``locate``, ``read_into``, ``upsert_keys``, ``address_order`` and ``scatter_beside`` launch
    device work only (a CUDA graph may hold them); ``room_for``, ``give_back``, ``settle`` and
    ``upserted`` are the host's bookkeeping around them. An upsert is: ``room_for(n)`` (a pool of
    n free rows), ``upsert_keys`` (each key's row), the rows written (``scatter_beside``), then
    ``upserted`` (its counts, read back at the next ``settle``)."""

    @abstractmethod
    def settle(self, wait: bool = True) -> None:
        """Read back the earlier upserts' counts (without ``wait``: those done): the pool rows they
        did not take go back, the keys they left out go in."""

    @abstractmethod
    def room_for(self, n: int) -> torch.Tensor:
        """Room for an upsert of n keys: int64 (n,) free row addresses lent to it."""

    @abstractmethod
    def give_back(self, pool: torch.Tensor) -> None:
        """A pool ``room_for`` lent and no upsert took, back (in its order)."""

    @abstractmethod
    def locate(self, keys: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each key's row address (-1: absent) and found bool; no score moves."""

    @abstractmethod
    def address_order(self, addresses: torch.Tensor) -> torch.Tensor:
        """The permutation that sorts ``addresses`` (the order rows move fastest in)."""

    @abstractmethod
    def read_into(self, addresses: torch.Tensor, store, to: torch.Tensor) -> None:
        """The rows at ``addresses`` (sorted, -1 copies nothing) into rows ``to`` of ``store`` (a
        ``RowStore`` on the device: a cache's rows), with no buffer between."""

    @abstractmethod
    def upsert_keys(self, keys: torch.Tensor, tables: torch.Tensor,
                    pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The upsert's index: each key's row address (-1: left out, or padding) and its counts
        (int64 on the device, for ``upserted``)."""

    @abstractmethod
    def scatter_beside(self, addresses: torch.Tensor, rows: torch.Tensor, source: torch.Tensor | None,
                       stream, keep: bool = True) -> None:
        """Rows written to ``addresses`` (sorted, -1 writes nothing; row i is ``rows[source[i]]``)
        on ``stream`` beside the current one (None: in place); whatever reads the rows next waits
        for it. ``keep``: the tensors stay allocated until it is done."""

    @abstractmethod
    def upserted(self, keys: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor, addresses: torch.Tensor,
                 counts: torch.Tensor, pool: torch.Tensor, settled=None) -> None:
        """Record an upsert whose rows are written, for ``settle``. ``settled``: called once its
        counts are read (the tensors given are not needed after it)."""

    @abstractmethod
    def capture_key(self) -> tuple[int, ...]:
        """What a CUDA graph of the device verbs bakes in (the index's rehashes, the row segments'
        table): a graph is replayed only while this is unchanged."""

    def maintain(self) -> None:
        """The store's own upkeep, before a batch is staged (a host tier: its evictions, the
        write-downs and reads ahead that are done); raises ``BackendError`` while the store refuses
        its write-downs. Nothing here."""
        return None

    # how many int64 values ``lacking`` returns (0: it returns None, nothing is below these rows)
    lacking_reads = 0

    def lacking(self, keys: torch.Tensor, tables: torch.Tensor, missed: torch.Tensor) -> torch.Tensor | None:
        """Where these rows are a tier over a slower store: int64 (2,) on the device, this tier's
        ``erasures`` so far in the device's order of work, then how many pairs ``missed`` marks (bool,
        ``keys`` ``RESERVED_KEY`` where no pair) it lacks and the store may hold. Device work only (a
        CUDA graph may hold it). While ``erasures`` stays what it read, a count of 0 says that the
        store has no row of those pairs for the tier to give. None: nothing is below these rows."""
        return None

    def erasures(self) -> int:
        """How many times pairs have left these rows (``lacking``'s count holds while unchanged)."""
        return 0


class GroupStore:
    """The backing store of a table group: several tables' rows, addressed by (table, key).

    ``get(keys, tables)`` / ``set(keys, tables, rows)`` take the position of each key's table in the
    group; ``table(t)`` is table t's own ``Backend`` (``scan``, ``size``, ``delete``). This one calls
    each table's backend in turn (one host sync to split a call by table); a store that can answer
    for all tables in one call (``HostMemory``) provides its own.
    """

    io_bound = True  # its calls do host I/O: the cache hands its write-downs to an I/O worker
    # its rows as the device moves them (``DeviceRows``), where the device reaches them; else the
    # cache reads and writes through ``get`` / ``set``
    device_rows: DeviceRows | None = None

    def __init__(self, backends: list[Backend]) -> None:
        self.backends = backends
        self.device = backends[0].device
        self.width = backends[0].width
        self.dtype = backends[0].dtype

    def _by_table(self, tables: torch.Tensor):
        """Yield (table, positions) for each table present in ``tables``."""
        if tables.numel() == 0:
            return
        order = torch.argsort(tables, stable=True)
        start = 0
        for t, n in enumerate(torch.bincount(tables, minlength=len(self.backends)).tolist()):
            if n:
                yield t, order[start : start + n]
            start += n

    def get(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        rows = torch.zeros(keys.numel(), self.width, dtype=self.dtype, device=self.device)
        found = torch.zeros(keys.numel(), dtype=torch.bool, device=self.device)
        for t, pos in self._by_table(tables):
            got = self.backends[t].get(keys[pos])
            rows[pos] = got.rows.to(self.device, self.dtype)
            found[pos] = got.found.to(self.device)
        return Fetched(rows, found)

    def set(self, keys: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
            distinct: bool = False) -> None:
        """Upsert (``distinct``: the caller knows the pairs are distinct and valid). On failure some
        tables may have taken their rows: calling again with the same rows is safe."""
        for t, pos in self._by_table(tables):
            self.backends[t].set(keys[pos], rows[pos])

    def delete(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        for t, pos in self._by_table(tables):
            self.backends[t].delete(keys[pos])

    def table(self, t: int) -> Backend:
        return self.backends[t]

    def reads_ahead(self) -> bool:
        """Whether ``read_ahead`` may bring rows in now (False: a call would do nothing, and the
        caller may skip the work of making its pairs)."""
        return not all(type(b).read_ahead is Backend.read_ahead for b in self.backends)

    def read_ahead(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """Start reading the pairs' rows into the tier in front of each table, without waiting
        (``Backend.read_ahead``: nothing where there is none, and the pairs not split)."""
        if not self.reads_ahead():
            return
        for t, pos in self._by_table(tables):
            self.backends[t].read_ahead(keys[pos])

    def flush(self) -> None:
        for b in self.backends:
            b.flush()

    def close(self) -> None:
        for b in self.backends:
            b.close()


class DictBackend(Backend):
    """The simplest backend: a Python dict of key -> row. The reference the others are tested
    against, and the storage of the equivalence tests (DynamicEmb's test storage does the same)."""

    def __init__(self, width: int, dtype: torch.dtype = torch.float32) -> None:
        self.width = width
        self.dtype = dtype
        self._rows: dict[int, torch.Tensor] = {}

    def get(self, keys: torch.Tensor) -> Fetched:
        rows = torch.zeros(keys.numel(), self.width, dtype=self.dtype)
        found = torch.zeros(keys.numel(), dtype=torch.bool)
        for i, k in enumerate(keys.tolist()):
            row = self._rows.get(k)
            if row is not None:
                rows[i] = row
                found[i] = True
        return Fetched(rows, found)

    def set(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        for k, row in zip(keys.tolist(), rows.to(self.dtype).cpu()):
            self._rows[k] = row.clone()

    def delete(self, keys: torch.Tensor) -> None:
        for k in keys.tolist():
            self._rows.pop(k, None)

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        items = sorted(self._rows.items())
        for start in range(0, len(items), chunk_rows):
            part = items[start : start + chunk_rows]
            yield (torch.tensor([k for k, _ in part], dtype=torch.int64),
                   torch.stack([r for _, r in part]))

    def size(self) -> int:
        return len(self._rows)
