"""HostTier: a write-back tier of rows in host memory between the device cache and a slower store.

``StorageConfig(host_budget=...)`` puts one in front of each table's RocksDB or Redis backend. It is a
``Backend`` itself, so the device cache (``CacheTier``) talks to it as to any store:

    get(keys)        hits from host memory; misses from the rows it is still writing down, else from
                     the store (and kept here, clean)
    set(keys, rows)  into host memory, dirty: the device cache's write-downs cost a copy
    read_ahead(keys) the store's rows of ``keys`` fetched on reader threads and kept here, clean

Layout: a fixed array of ``capacity`` slots (rows (capacity, W), pinned where CUDA is available), a
dict key -> slot, and per slot its key, score (LRU: the tick of its last use; LFU: its uses), dirty
flag and version. When a row must make room, the lowest-score slots go; the dirty ones among them are
written down to the store in one ``store.set`` a batch, on the tier's writer thread (an ``IOWorker``),
and answer ``get`` from their copy until the store has taken them (DESIGN section 4 rule 3: a read
never overtakes a write of the same key).

Every row has one authoritative place: its copy here if dirty, else the newest copy on its way down,
else the store's. ``scan`` and ``size`` see every key once; ``flush`` writes every dirty row down and
flushes the store; a crash loses the rows that were dirty here (and those on their way down) since the
last ``flush``.

Reads ahead never bring an old row back: each one records the keys it reads, and a ``set``, ``delete``
or dirty eviction of one of those keys before the read lands drops the read's row for that key. A read
ahead that fails (the store away) is logged once and dropped; the next real miss raises as usual.
A failed write-down keeps its rows (they still answer ``get`` and ``scan``) and is retried at the next
call, which raises ``BackendError`` while the store refuses them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from tieredemb.storage.backend import Backend, Fetched, GroupStore, add_bytes
from tieredemb.storage.errors import BackendError
from tieredemb.storage.io_worker import IOHandle, IOWorker
from tieredemb.storage.tiers.parts import HostTierStats

log = logging.getLogger(__name__)

_NEVER = torch.iinfo(torch.int64).max  # the score of a free slot: never a victim
EVICTIONS = ("lru", "lfu")


@dataclass(eq=False)
class _Evicted:
    """Dirty rows evicted together, on their way down (one ``store.set``): keys int64 (m,) cpu,
    rows (m, W); ``at`` key -> position; ``handle`` the writer's (None: to be written again)."""

    keys: torch.Tensor
    rows: torch.Tensor
    at: dict[int, int]
    handle: IOHandle | None = None


@dataclass
class Misses:
    """A ``look_up``: ``answer`` (rows (n, W), found (n,)) filled where held here; ``rest`` int64 (m,)
    the positions the store answers for; ``wanted`` their distinct keys (u,), ``inverse`` (m,)."""

    answer: Fetched
    rest: torch.Tensor
    wanted: torch.Tensor
    inverse: torch.Tensor


@dataclass(eq=False)
class _Reading:
    """A read ahead in flight: the keys it reads, those whose row it must drop (changed since)."""

    keys: set[int]
    dropped: set[int] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)


def _pinned_ok(pinned: bool) -> bool:
    return pinned and torch.cuda.is_available()


class HostTier(Backend):
    """A table's hot rows in host memory, write-back over ``store`` (owned: closed with this one).

    Args:
        store: the table's backend below (RocksDB, Redis).
        capacity_rows: slots (rows) in host memory, >= 1.
        eviction: ``"lru"`` or ``"lfu"`` (the table's ``eviction``).
        pinned: page-lock the rows (when a CUDA device copies them; ignored without CUDA).
        readers: the thread pool running reads ahead (shared by a group's tables); None: one of its own.

    Example::

        tier = HostTier(rocksdb_backend, capacity_rows=1 << 20)
        tier.read_ahead(next_batch_keys)       # returns at once
        got = tier.get(keys)                    # hits from host memory
    """

    def __init__(self, store: Backend, capacity_rows: int, eviction: str = "lru", pinned: bool = False,
                 readers: ThreadPoolExecutor | None = None) -> None:
        if isinstance(capacity_rows, bool) or not isinstance(capacity_rows, int) or capacity_rows < 1:
            raise ValueError(f"HostTier capacity_rows must be an int >= 1, got {capacity_rows!r}")
        if eviction not in EVICTIONS:
            raise ValueError(f"HostTier eviction must be one of {EVICTIONS}, got {eviction!r}")
        self.store = store
        self.width, self.dtype, self.device = store.width, store.dtype, torch.device("cpu")
        self.capacity = capacity_rows
        self.eviction = eviction
        rows = torch.zeros(capacity_rows, self.width, dtype=self.dtype)
        self._rows = rows.pin_memory() if _pinned_ok(pinned) else rows  # (C, W) host
        self._slot: dict[int, int] = {}  # key -> slot
        self._key = torch.zeros(capacity_rows, dtype=torch.int64)  # slot -> key (where occupied)
        self._score = torch.full((capacity_rows,), _NEVER, dtype=torch.int64)  # free: _NEVER
        self._dirty = torch.zeros(capacity_rows, dtype=torch.bool)
        self._ahead = torch.zeros(capacity_rows, dtype=torch.bool)  # read ahead, not used yet
        self._version = torch.zeros(capacity_rows, dtype=torch.int64)
        self._free = list(range(capacity_rows - 1, -1, -1))
        self._tick = 0
        self._lock = threading.RLock()
        self._evicted: list[_Evicted] = []  # oldest first
        self._reading: list[_Reading] = []
        self._writer = IOWorker(name="host-tier/write-down")
        self._own_readers = readers is None
        self._readers = readers or ThreadPoolExecutor(2, thread_name_prefix="tieredemb-read-ahead")
        self._read_failed_logged = False
        self._write_failed = False  # a write-down failed: the next call retries them all, in order
        self._counts = dict(hits=0, misses=0, evictions=0, written_down=0, read_ahead_rows=0,
                            read_ahead_hits=0, read_ahead_dropped=0)
        self._closed = False

    # ----------------------------------------------------------------------------------- verbs
    def get(self, keys: torch.Tensor) -> Fetched:
        keys = keys.reshape(-1).to(torch.int64).cpu()
        miss = self.look_up(keys)
        if miss.wanted.numel():
            self.fetched(miss, self.store.get(miss.wanted))
        return miss.answer

    def look_up(self, keys: torch.Tensor) -> Misses:
        """The first half of ``get``: the rows held here (or on their way down) of ``keys`` (int64
        (n,) cpu), and the distinct keys the store must answer for (``fetched`` completes it)."""
        self._settle_writes()
        n = keys.numel()
        rows = torch.zeros(n, self.width, dtype=self.dtype)
        found = torch.zeros(n, dtype=torch.bool)
        klist = keys.tolist()
        self._wait_reads(klist)
        with self._lock:
            slots = self._find(klist)
            hit = slots >= 0
            at = slots[hit]
            rows[hit], found[hit] = self._rows[at], True
            self._touch(at)
            self._counts["hits"] += int(hit.sum())
            self._counts["read_ahead_hits"] += int(self._ahead[at].sum())
            self._ahead[at] = False
            miss = (~hit).nonzero().squeeze(1)
            rest = self._from_evicted(klist, miss, rows, found)
        self._counts["misses"] += rest.numel()
        wanted, inverse = torch.unique(keys[rest], return_inverse=True)
        return Misses(Fetched(rows, found), rest, wanted, inverse)

    def fetched(self, miss: Misses, got: Fetched) -> None:
        """The second half of ``get``: the store's answer for ``miss.wanted`` filled in and kept here
        (clean). The key is not here, nor on its way down, so the store's row is the newest: only the
        thread calling ``get`` (the cache's I/O worker) changes rows."""
        rows, found = got.rows.to(self.dtype), got.found.cpu()
        miss.answer.rows[miss.rest] = rows[miss.inverse]
        miss.answer.found[miss.rest] = found[miss.inverse]
        with self._lock:  # a read ahead may have brought some in meanwhile (the same rows)
            kept = [i for i, (k, f) in enumerate(zip(miss.wanted.tolist(), found.tolist()))
                    if f and k not in self._slot]
            if kept:
                at = _int64(kept)
                self._insert(miss.wanted[at].tolist(), rows[at], dirty=False)

    def set(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Upsert into host memory (dirty); a key given twice keeps its last row."""
        keys = keys.reshape(-1).to(torch.int64).cpu()
        rows = rows.reshape(-1, self.width).cpu().to(self.dtype)
        self._settle_writes()
        if keys.numel() == 0:
            return
        keys, rows = _last_of_each(keys, rows)
        klist = keys.tolist()
        with self._lock:
            self._changed(klist)
            slots = self._find(klist)
            hit = slots >= 0
            at = slots[hit]
            self._rows[at] = rows[hit]
            self._dirty[at] = True
            self._ahead[at] = False
            self._version[at] += 1
            self._touch(at)
            new = (~hit).nonzero().squeeze(1)
            if new.numel():
                self._insert([klist[i] for i in new.tolist()], rows[new], dirty=True)

    def delete(self, keys: torch.Tensor) -> None:
        keys = keys.reshape(-1).to(torch.int64).cpu()
        self._settle_writes()
        if keys.numel() == 0:
            return
        klist = keys.tolist()
        self._drop(klist)
        self._drain_writes()  # a queued write-down of a key must not bring it back after the delete
        self.store.delete(keys)
        self._drop(klist)  # a read ahead that landed meanwhile: dropped again (clean, never newer)

    def read_ahead(self, keys: torch.Tensor) -> None:
        """Fetch the store's rows of ``keys`` (int64 (n,)) into host memory on a reader thread,
        clean; returns at once. Keys held here (or on their way down) are skipped."""
        claim = self.claim_reads(keys)
        if claim is not None:
            self._readers.submit(self._read, *claim)

    def claim_reads(self, keys: torch.Tensor) -> tuple[_Reading, torch.Tensor] | None:
        """The first half of ``read_ahead``: the distinct keys (int64 (u,) cpu) not held here nor on
        their way down, registered as read (a change to one of them from now on drops the read's
        row); None if there are none. ``land`` and ``release`` complete it."""
        if self._closed:
            return None
        klist = torch.unique(keys.reshape(-1).to(torch.int64).cpu()).tolist()
        with self._lock:
            todo = [k for k in klist if k not in self._slot and self._newest_evicted(k) is None]
            if not todo:
                return None
            reading = _Reading(set(todo))
            self._reading.append(reading)
        return reading, _int64(todo)

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row once: the dirty rows here and those on their way down first, then the store's
        others (the clean rows here are the store's)."""
        self._drain_writes(quiet=True)
        keys, rows = self._kept()
        for start in range(0, keys.numel(), chunk_rows):
            yield keys[start : start + chunk_rows], rows[start : start + chunk_rows]
        for skeys, srows in self.store.scan(chunk_rows):
            if keys.numel():
                new = ~torch.isin(skeys, keys)
                skeys, srows = skeys[new], srows[new]
            if skeys.numel():
                yield skeys, srows

    def size(self) -> int:
        self._drain_writes(quiet=True)
        keys, _ = self._kept()
        only_here = 0 if keys.numel() == 0 else int((~self.store.get(keys).found).sum())
        return self.store.size() + only_here

    def flush(self) -> None:
        """Every dirty row written down to the store, then the store flushed."""
        self._settle_writes()
        self._drain_writes()
        with self._lock:
            at = self._dirty.nonzero().squeeze(1)
            keys, rows, versions = self._key[at], self._rows[at].clone(), self._version[at].clone()
        if at.numel():
            self.store.set(keys, rows)
            with self._lock:  # clean unless set again meanwhile
                same = self._version[at] == versions
                self._dirty[at[same]] = False
                self._counts["written_down"] += at.numel()
        self.store.flush()

    def index_bytes(self) -> dict[str, int]:
        # the slot columns, and the dict at ~100 bytes an entry (CPython's, with its int objects)
        own = self.capacity * (8 + 8 + 8 + 1 + 1) + 100 * len(self._slot)
        return add_bytes({"host": own}, self.store.index_bytes())

    def tier_stats(self) -> HostTierStats:
        with self._lock:
            return HostTierStats(rows=len(self._slot), capacity=self.capacity,
                                 dirty=int(self._dirty.sum()), **self._counts)

    def close(self) -> None:
        """Wait for the reads ahead, write every dirty row down, close the store."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._own_readers:
                self._readers.shutdown(wait=True)
            else:
                self._wait_reads(None)
            self.flush()
        finally:
            try:
                self._writer.close()
            finally:
                self.store.close()

    # ------------------------------------------------------------------------------- internals
    def _find(self, klist: list[int]) -> torch.Tensor:
        """int64 (n,) each key's slot, -1 where absent (under the lock)."""
        get = self._slot.get
        return _int64([get(k, -1) for k in klist])

    def _touch(self, at: torch.Tensor) -> None:
        self._tick += 1
        if self.eviction == "lru":
            self._score[at] = self._tick
        else:
            self._score.index_add_(0, at, torch.ones_like(at))

    def _insert(self, klist: list[int], rows: torch.Tensor, dirty: bool, ahead: bool = False) -> None:
        """Put distinct keys absent from the tier in, evicting the lowest scores (under the lock)."""
        for start in range(0, len(klist), self.capacity):
            part = klist[start : start + self.capacity]
            m = len(part)
            short = m - len(self._free)
            if short > 0:
                self._evict(short)
            taken = self._free[len(self._free) - m :]
            del self._free[len(self._free) - m :]
            at = _int64(taken)
            self._slot.update(zip(part, taken))
            self._key[at] = _int64(part)
            self._rows[at] = rows[start : start + m]
            self._dirty[at] = dirty
            self._ahead[at] = ahead
            self._version[at] += 1
            self._score[at] = 0
            self._touch(at)

    def _evict(self, r: int) -> None:
        """Free the ``r`` lowest-score slots; their dirty rows go down in one write (under the lock)."""
        at = torch.topk(self._score, r, largest=False).indices
        keys = self._key[at]
        dirty = self._dirty[at]
        for k in keys.tolist():
            del self._slot[k]
        if bool(dirty.any()):
            down = at[dirty]
            batch = _Evicted(keys[dirty], self._rows[down].clone(), {})
            batch.at = dict(zip(batch.keys.tolist(), range(batch.keys.numel())))
            self._changed(batch.at)  # the store gets a newer row: a read ahead of it is stale
            self._evicted.append(batch)
            if not self._write_failed:  # after a failure, nothing new goes down before the retry
                try:
                    batch.handle = self._writer.submit(self.store.set, batch.keys, batch.rows)
                except BackendError:  # an earlier write-down failed: this one waits for the retry
                    self._write_failed = True
        self._score[at] = _NEVER
        self._dirty[at] = False
        self._ahead[at] = False
        self._free.extend(at.tolist())
        self._counts["evictions"] += r

    def _drop(self, klist: list[int]) -> None:
        """Remove keys from the tier and from the rows on their way down (under the lock)."""
        with self._lock:
            self._changed(klist)
            at = [s for s in (self._slot.pop(k, None) for k in klist) if s is not None]
            if at:
                slots = _int64(at)
                self._score[slots] = _NEVER
                self._dirty[slots] = False
                self._ahead[slots] = False
                self._free.extend(at)

    def _changed(self, keys) -> None:
        """Keys set, deleted or written down: reads ahead in flight drop their rows (under the lock)."""
        for reading in self._reading:
            reading.dropped.update(reading.keys.intersection(keys))

    def _newest_evicted(self, key: int) -> tuple[_Evicted, int] | None:
        for batch in reversed(self._evicted):
            pos = batch.at.get(key)
            if pos is not None:
                return batch, pos
        return None

    def _from_evicted(self, klist: list[int], miss: torch.Tensor, rows: torch.Tensor,
                      found: torch.Tensor) -> torch.Tensor:
        """Fill the misses that are on their way down from their newest copy; the rest's positions."""
        if not self._evicted or miss.numel() == 0:
            return miss
        rest = []
        for i in miss.tolist():
            hit = self._newest_evicted(klist[i])
            if hit is None:
                rest.append(i)
            else:
                rows[i], found[i] = hit[0].rows[hit[1]], True
        self._counts["hits"] += miss.numel() - len(rest)
        return _int64(rest)

    def _kept(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows only this tier may hold: dirty rows here and the newest of those on their way
        down, keys int64 (k,) distinct, rows (k, W)."""
        with self._lock:
            at = self._dirty.nonzero().squeeze(1)
            parts_k, parts_r = [self._key[at]], [self._rows[at].clone()]
            for batch in reversed(self._evicted):  # newest first: a key's first copy wins
                parts_k.append(batch.keys)
                parts_r.append(batch.rows)
        keys, rows = torch.cat(parts_k), torch.cat(parts_r)
        uniq, inverse = torch.unique(keys, return_inverse=True)
        first = torch.full((uniq.numel(),), keys.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, inverse, torch.arange(keys.numel()), "amin")
        return uniq, rows[first]

    def _read(self, reading: _Reading, keys: torch.Tensor) -> None:
        """A read ahead, on a reader thread: never raises (a failure is logged once)."""
        try:
            self.land(reading, keys, self.store.get(keys))
        except Exception as e:  # noqa: BLE001 - a read ahead is a hint: the real miss reports errors
            self.read_failed(e)
        finally:
            self.release(reading)

    def land(self, reading: _Reading, keys: torch.Tensor, got: Fetched) -> None:
        """The store's rows of a claimed read kept here, clean, but for the keys changed since."""
        found = got.found.tolist()
        with self._lock:
            keep = [i for i, k in enumerate(keys.tolist())
                    if found[i] and k not in reading.dropped and k not in self._slot
                    and self._newest_evicted(k) is None]
            self._counts["read_ahead_dropped"] += len(reading.dropped)
            if keep:
                pos = _int64(keep)
                self._insert(keys[pos].tolist(), got.rows.to(self.dtype)[pos], dirty=False, ahead=True)
                self._counts["read_ahead_rows"] += len(keep)

    def read_failed(self, error: Exception) -> None:
        """A read ahead failed: logged the first time, dropped."""
        if not self._read_failed_logged:
            self._read_failed_logged = True
            log.warning("a read ahead from the store failed (dropped; later misses read the store "
                        "themselves): %s", error)

    def release(self, reading: _Reading) -> None:
        """A claimed read is over (landed or failed): fetches of its keys stop waiting for it."""
        with self._lock:
            self._reading.remove(reading)
        reading.done.set()

    def _wait_reads(self, klist: list[int] | None) -> None:
        """Wait for the reads ahead of any of ``klist`` (None: all): their rows answer the misses."""
        with self._lock:
            if klist is None:
                waiting = list(self._reading)
            else:
                wanted = set(klist)
                waiting = [r for r in self._reading if not r.keys.isdisjoint(wanted)]
        for reading in waiting:
            reading.done.wait()

    def _settle_writes(self) -> None:
        """Forget the write-downs the store has taken; after a failure, write the others again in
        order, here; raise ``BackendError`` while the store refuses them (nothing changed, rows kept)."""
        with self._lock:
            for batch in list(self._evicted):
                if batch.handle is None or not batch.handle.done():
                    continue
                if self._taken(batch) is False:
                    self._write_failed = True
            if self._write_failed:
                self._retry()

    def _taken(self, batch: _Evicted) -> bool:
        """Whether the writer wrote ``batch`` (its handle done): forgotten if so (under the lock)."""
        handle, batch.handle = batch.handle, None
        try:
            handle.result()
        except BackendError:  # failed, or refused behind a failure (and then newer than it)
            return False
        self._evicted.remove(batch)
        self._counts["written_down"] += batch.keys.numel()
        return True

    def _retry(self) -> None:
        """Every write-down not taken, written again in submission order (under the lock: nothing
        new is queued meanwhile). Those the writer did take were submitted before the failure, so
        they are older than the rows written here."""
        for batch in list(self._evicted):
            if batch.handle is not None:
                batch.handle.wait()
                if self._taken(batch):
                    continue
            try:
                self.store.set(batch.keys, batch.rows)
            except Exception as e:
                n = sum(b.keys.numel() for b in self._evicted)
                raise BackendError(f"host tier: writing {n} evicted rows down to the store failed; they "
                                   "are kept and retried at the next call") from e
            self._evicted.remove(batch)
            self._counts["written_down"] += batch.keys.numel()
        self._write_failed = False

    def _drain_writes(self, quiet: bool = False) -> None:
        """Wait until the store has taken every write-down (``quiet``: a failure keeps its rows here
        and does not raise: ``scan`` and ``size`` answer with them)."""
        with self._lock:
            handles = [b.handle for b in self._evicted if b.handle is not None]
        for handle in handles:
            handle.wait()
        try:
            self._settle_writes()
        except BackendError:
            if not quiet:
                raise
            log.warning("host tier: the store refuses the evicted rows; answering with the copies kept here")


def _int64(values: list[int]) -> torch.Tensor:
    """A list of ints as int64 (n,) cpu (through numpy: several times faster than ``torch.tensor``)."""
    return torch.from_numpy(np.array(values, dtype=np.int64).reshape(-1))


def _last_of_each(keys: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct keys, each with its last row."""
    uniq, inverse = torch.unique(keys, return_inverse=True)
    if uniq.numel() == keys.numel():
        return keys, rows
    last = torch.full((uniq.numel(),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, torch.arange(keys.numel()), "amax")
    return uniq, rows[last]


class HostTierGroup(GroupStore):
    """A table group's store with a ``HostTier`` in front of each table's backend. A ``get`` asks the
    group's own store once for every table's misses (one fan-out to RocksDB's shards); the tiers
    share one pool of reader threads for their reads ahead.

    Args:
        below: the group's store (RocksDB, Redis); its backends are owned by the tiers.
        capacities: host-memory rows of each table.
        evictions: ``"lru"`` / ``"lfu"`` of each table.
        pinned: page-lock the rows (a CUDA collection).
        readers: threads reading ahead for the group.
    """

    def __init__(self, below: GroupStore, capacities: list[int], evictions: list[str], pinned: bool,
                 readers: int = 4) -> None:
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="tieredemb-read-ahead")
        self.stores = below
        super().__init__([HostTier(b, c, e, pinned, self._pool)
                          for b, c, e in zip(below.backends, capacities, evictions)])

    def get(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        keys, tables = keys.cpu(), tables.cpu()
        rows = torch.zeros(keys.numel(), self.width, dtype=self.dtype)
        found = torch.zeros(keys.numel(), dtype=torch.bool)
        looked = [(t, pos, self.backends[t].look_up(keys[pos])) for t, pos in self._by_table(tables)]
        wanted = [(t, m.wanted) for t, _, m in looked if m.wanted.numel()]
        if wanted:
            got = self.stores.get(torch.cat([w for _, w in wanted]),
                                  torch.cat([torch.full_like(w, t) for t, w in wanted]))
            parts = iter(zip(got.rows.split([w.numel() for _, w in wanted]),
                             got.found.split([w.numel() for _, w in wanted])))
        for t, pos, m in looked:
            if m.wanted.numel():
                self.backends[t].fetched(m, Fetched(*next(parts)))
            rows[pos], found[pos] = m.answer.rows, m.answer.found
        return Fetched(rows, found)

    def read_ahead(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """Every table's keys read ahead (``HostTier.read_ahead``) in one call to the group's store, on
        a reader thread; returns at once."""
        keys, tables = keys.cpu(), tables.cpu()
        claims = [(t, claim) for t, pos in self._by_table(tables)
                  if (claim := self.backends[t].claim_reads(keys[pos])) is not None]
        if claims:
            self._pool.submit(self._read, claims)

    def _read(self, claims: list) -> None:
        """On a reader thread: never raises (a failure is logged once by each tier)."""
        try:
            got = self.stores.get(torch.cat([k for _, (_, k) in claims]),
                                  torch.cat([torch.full_like(k, t) for t, (_, k) in claims]))
            sizes = [k.numel() for _, (_, k) in claims]
            for (t, (reading, k)), rows, found in zip(claims, got.rows.split(sizes), got.found.split(sizes)):
                self.backends[t].land(reading, k, Fetched(rows, found))
        except Exception as e:  # noqa: BLE001 - a read ahead is a hint: the real miss reports errors
            for t, _ in claims:
                self.backends[t].read_failed(e)
        finally:
            for t, (reading, _) in claims:
                self.backends[t].release(reading)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        super().close()
