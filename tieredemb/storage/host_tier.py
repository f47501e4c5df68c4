"""HostTierGroup: a write-back tier of rows in host memory between a device cache and a slower store.

``StorageConfig(host_budget=...)`` puts one between each table group's device cache and its RocksDB
or Redis store. Its rows are a ``HostMemoryBackend``'s (pinned segments, the key index on the GPU
under a CUDA collection), so the device cache moves rows to and from it as it does with
``HostMemory``: on the device, inside its insertion graph, with no host work per key
(``GroupStore.device_rows``). What the tier adds to host memory:

- **The store below.** A ``get`` reads the pairs the tier does not hold from the store in one call
  (``from_below``). A filter of the pairs the store holds (``KeyFilter``: those it held when the tier
  opened, and every pair written down since) keeps the keys it surely lacks (ids seen for the first
  time) from the call. The device cache's staged prefetch counts on the device the misses the tier
  lacks and the store may hold (``lacking``): where none (the tables in the tier's reach, nearly
  always) its insertion runs on the device; else on the host, through ``get``, the store read before
  anything changes (a failed read raises ``BackendError`` and changes nothing).
- **Upkeep.** ``maintain`` (the device cache calls it before each batch is staged; every verb of
  the store's calls it first) settles the write-downs, lands the reads ahead, starts the queued
  ones and evicts; ``settle`` only reads back the device's upserts (a batch's release calls it, and
  must not raise).
- **A bound.** Each table holds at most its capacity of rows. When a table is over it (checked at
  every call, before anything else moves), its least recently used rows go, down to the capacity
  less a sixteenth of it, rounded down (rows read ahead and not used yet go last): the clean ones
  (the store's copy is the same) at once, the dirty ones after the tier's writer thread has written
  them down, and only if nothing wrote them meanwhile. Until then they stay and answer like any
  other row, so the store is never asked for a row on its way down (DESIGN section 4, rule 3).
  Rows on their way down stay within an eighth of the capacities: beyond that a call waits for the
  store (the step then runs at its write rate). LFU tables order by uses instead.
- **Reads ahead.** ``read_ahead(keys, tables)`` queues the pairs; the next call locates them and
  hands those the tier lacks to reader threads, which read them from the store; a later call puts
  the rows read in where the pair is still absent. A read that was in flight while the tier dropped
  one of its pairs after writing it down drops that pair's row (it may be older than the row written).
  While the tier holds every pair the store has (the store was empty at open and no pair has left
  host memory since), nothing is read ahead and no miss asks the store (``reads_ahead``).

Per row address the tier keeps ``version`` (one more at each write into the tier), ``clean`` (the
version the store holds), ``used`` (the tick of the last read or write, or the uses under LFU) and
``ahead`` (read ahead, not used since), on the rows' device: the device cache's insertion updates
them in its graph (``TieredRows.upsert_keys``, ``locate``; ``tiered_rows.py``).

Every row has one authoritative place: the tier's copy where it holds the pair, else the store's.
``scan`` and ``size`` see every key once; ``flush`` writes every dirty row down and flushes the store;
a crash loses the rows written into the tier since the last ``flush`` (and not yet evicted).

A write-down that fails keeps its rows in the tier (dirty) and is retried, in order, at the next
call, which raises ``BackendError`` while the store refuses them, before anything changes. A read
ahead that fails is logged once and dropped; the pairs are then read when a batch misses them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tieredemb.keys import RESERVED_KEY
from tieredemb.ops import to_device_at_once, to_host_later
from tieredemb.storage.backend import Backend, DeviceRows, Fetched, GroupStore, add_bytes
from tieredemb.storage.errors import BackendError
from tieredemb.storage.host import last_of_duplicates
from tieredemb.storage.io_worker import IOHandle, IOWorker
from tieredemb.storage.key_filter import KeyFilter
from tieredemb.storage.tiered_rows import TieredRows
from tieredemb.storage.tiers.parts import HostTierStats

log = logging.getLogger(__name__)

EVICTIONS = ("lru", "lfu")
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)  # a pair's table mixed into its key (``_pair_ids``)


@dataclass(eq=False)
class _Eviction:
    """Dirty rows on their way down (one ``store.set``): the pairs and addresses on the rows'
    device, their versions and use marks when read, the pairs and rows on the host (the rows copied
    there behind the device's work: complete once ``ready`` has passed), the writer's handle."""

    keys: torch.Tensor
    tables: torch.Tensor
    addresses: torch.Tensor
    versions: torch.Tensor
    used: torch.Tensor
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ready: torch.cuda.Event | None
    handle: IOHandle | None


@dataclass(eq=False)
class _Read:
    """A read ahead on a reader thread: the erasures it must respect (from round ``since`` on), the
    reader's future (``HostTierGroup._read``: the pairs read and the store's rows of them), and what
    it was given (the pairs, int64 (2, n) on the host, and which of them it reads, complete once
    ``ready`` has passed)."""

    since: int
    future: Future
    pairs: torch.Tensor
    lack: torch.Tensor
    ready: torch.cuda.Event | None

    def reads_any(self, ids: torch.Tensor) -> bool:
        """Whether it reads any of the pairs ``ids`` (``_pair_ids``, on the host)."""
        if self.ready is not None:
            self.ready.synchronize()
        asked = self.pairs[:, self.lack.bool()]
        return bool(torch.isin(ids, _pair_ids(asked[0], asked[1])).any())


_SLACK = 16  # a table over its capacity keeps it less 1/_SLACK of it (``_evict``)
_COUNTS = ("misses", "evictions", "written_down", "read_ahead_rows", "read_ahead_dropped", "read_ahead_late")


def _pair_ids(keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """One int64 per (table, key) pair for membership tests (a collision only drops a read ahead)."""
    return keys + tables * _MIX


class HostTierGroup(GroupStore, DeviceRows):
    """A table group's hot rows in host memory, write-back over ``below`` (owned: closed with it).

    Args:
        below: the group's store (RocksDB, Redis).
        capacities: rows in host memory per table (each >= 1).
        evictions: ``"lru"`` / ``"lfu"`` per table.
        device: the collection's device (CUDA: the index on it, the rows pinned and moved by it).
        expected_keys: about how many pairs the store will hold (the tables' ``num_embeddings``;
            None: 64 times the capacities): the size of the filter of the pairs it holds, 16 bits a
            pair (between 8 KiB and 1 GiB).
        readers: threads reading ahead.

    Example::

        tier = HostTierGroup(rocksdb_group, capacities=[1 << 20] * 2, evictions=["lru"] * 2)
        tier.read_ahead(next_keys, next_tables)   # returns at once
        got = tier.get(keys, tables)              # hits from host memory, the rest from RocksDB
    """

    io_bound = False  # its calls are device work; the store's I/O runs on its own threads

    def __init__(self, below: GroupStore, capacities: list[int], evictions: list[str],
                 device: torch.device | str = "cpu", expected_keys: int | None = None,
                 readers: int = 4) -> None:
        for c in capacities:
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise ValueError(f"host tier capacities must be ints >= 1, got {capacities!r}")
        for e in evictions:
            if e not in EVICTIONS:
                raise ValueError(f"host tier eviction must be one of {EVICTIONS}, got {e!r}")
        device = torch.device(device)
        on_gpu = device.type == "cuda" and torch.cuda.is_available()
        self.rows = TieredRows(below.width, [e == "lfu" for e in evictions], pinned=on_gpu,
                               device=device if on_gpu else None,
                               reserve_rows=sum(capacities) + sum(capacities) // 4, dtype=below.dtype)
        self.below = below
        self.capacities = list(capacities)
        self.device, self.width, self.dtype = self.rows.device, below.width, below.dtype
        self.device_rows = self
        self.backends = [_TierTable(self, t) for t in range(len(capacities))]
        self._writer = IOWorker(name="host-tier/write-down")
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="tieredemb-read-ahead")
        self._evicting: list[_Eviction] = []  # oldest first
        self._queued: list[tuple[torch.Tensor, torch.Tensor]] = []  # reads ahead not yet located
        self._reading: list[_Read] = []
        self._erased: list[tuple[int, torch.Tensor]] = []  # (round, pair ids) dropped after a write
        self._round = 0  # erasures so far (``_erased_now``), on the host
        self._erasures = torch.zeros(1, dtype=torch.int64, device=self.device)  # the same, on the device
        self._read_failed_logged = False
        self._counts = torch.zeros(len(_COUNTS), len(capacities), dtype=torch.int64)
        self._landed = torch.zeros(len(capacities), dtype=torch.int64, device=self.device)  # rows read ahead
        self._closed = False
        # the pairs the store may hold: those it holds now, and every pair written down from here
        expected = expected_keys if expected_keys is not None else 64 * sum(capacities)
        self.filter = KeyFilter(min(max(16 * expected, 1 << 16), 1 << 33), self.device)
        # every pair the store holds is in host memory too: the store was empty at open and no pair
        # has left host memory for it since (a deletion leaves both). Reads ahead then bring nothing,
        # and a pair the tier lacks is none of the store's, whatever the filter's false positives say
        self._holds_below = True
        for t in range(len(capacities)):
            for keys in below.table(t).scan_keys(1 << 16):
                keys = keys.to(self.device)
                self.filter.add(keys, torch.full_like(keys, t))
                self._holds_below = self._holds_below and keys.numel() == 0

    # ------------------------------------------------------------------------ the store's verbs
    def get(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        self._maintain()
        keys, tables = keys.reshape(-1).to(self.device), tables.reshape(-1).to(self.device)
        self.rows.settle()
        addresses, found = self.rows.locate(keys, tables)
        rows = self.rows.read_rows(addresses)  # address -1 reads zeros
        lacking = self.from_below(keys, tables, found)
        if lacking is not None:
            pos, below = lacking
            rows[pos], found[pos] = below, True
        return Fetched(rows, found)

    def set(self, keys: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
            distinct: bool = False) -> None:
        self._maintain()
        keys, tables = keys.to(self.device), tables.to(self.device)
        rows = rows.to(self.device)
        if distinct:
            self.rows.set_distinct(keys, rows, tables)
        else:
            self.rows.set(keys, rows, tables)

    def delete(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        self._maintain()
        self._finish_writes(wait=True)  # a write-down queued before must not bring a key back after
        keys, tables = keys.to(self.device), tables.to(self.device)
        self.rows.delete(keys, tables)
        self._erased_now(keys, tables)
        self.below.delete(keys.cpu(), tables.cpu())

    def reads_ahead(self) -> bool:
        """Whether the store may hold pairs host memory lacks (a read ahead may bring rows in)."""
        return not self._closed and not self._holds_below

    def read_ahead(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """Queue the pairs' rows to be read from the store into host memory (see the module
        docstring); returns at once."""
        if self.reads_ahead() and keys.numel():  # (where they are: no host read of a device's keys)
            self._queued.append((keys.reshape(-1).to(torch.int64), tables.reshape(-1).to(torch.int64)))

    def flush(self) -> None:
        """Every dirty row written down to the store, then the store flushed."""
        self._maintain()
        self._finish_writes(wait=True)
        for t in range(len(self.capacities)):
            keys, addresses = self.rows.table_rows(t)
            dirty = self.rows.dirty(addresses).nonzero().squeeze(1)
            if dirty.numel() == 0:
                continue
            keys, addresses = keys[dirty], addresses[dirty]
            versions = self.rows.version[addresses].clone()
            rows = self.rows.read_rows(addresses).cpu()
            self.filter.add(keys, torch.full_like(keys, t))
            try:
                self.below.set(keys.cpu(), torch.full((keys.numel(),), t, dtype=torch.int64), rows, True)
            except Exception as e:
                raise BackendError(f"host tier: flushing {keys.numel()} rows to the store failed; they "
                                   "are kept in host memory and written at the next flush") from e
            self.rows.clean[addresses] = versions
            self._counts[_COUNTS.index("written_down"), t] += keys.numel()
        self.below.flush()

    def close(self) -> None:
        """Wait for the reads ahead, write every dirty row down, close the store."""
        if self._closed:
            return
        self._closed = True
        try:
            self._readers.shutdown(wait=True)
            self.flush()
        finally:
            try:
                self._writer.close()
            finally:
                self.below.close()
                self.rows.close()

    # ------------------------------------------------------------- the device cache's verbs
    def settle(self, wait: bool = True) -> None:
        self.rows.settle(wait)  # (only: a batch's release settles too, and must not raise)

    def maintain(self) -> None:
        self._maintain()

    def room_for(self, n: int) -> torch.Tensor:
        return self.rows.room_for(n)

    def give_back(self, pool: torch.Tensor) -> None:
        self.rows.give_back(pool)

    def locate(self, keys: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.locate(keys, tables)

    def address_order(self, addresses: torch.Tensor) -> torch.Tensor:
        return self.rows.address_order(addresses)

    def read_into(self, addresses: torch.Tensor, store, to: torch.Tensor) -> None:
        self.rows.read_into(addresses, store, to)

    def upsert_keys(self, keys: torch.Tensor, tables: torch.Tensor,
                    pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows.upsert_keys(keys, tables, pool)

    def scatter_beside(self, addresses, rows, source, stream, keep: bool = True) -> None:
        self.rows.scatter_beside(addresses, rows, source, stream, keep)

    def upserted(self, keys, tables, rows, addresses, counts, pool, settled=None) -> None:
        self.rows.upserted(keys, tables, rows, addresses, counts, pool, settled)

    def capture_key(self) -> tuple[int, ...]:
        return (*self.rows.capture_key(), self._holds_below)  # (``lacking`` bakes it in)

    def from_below(self, keys: torch.Tensor, tables: torch.Tensor,
                   found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The store's rows of the pairs host memory lacked (``found`` False; ``keys``
        ``RESERVED_KEY`` where no pair): their positions and rows, on the device; None if none. Pairs
        a read ahead in flight is reading take its rows once it has landed (``_land_reads_of``). A
        failed read raises ``BackendError`` chained to the store's error and changes nothing a step
        sees (a read ahead landed meanwhile stays)."""
        if self._holds_below:  # the store lacks what host memory lacks
            return None
        need = ((~found) & (keys != RESERVED_KEY) & self.filter.may_hold(keys, tables)).nonzero().squeeze(1)
        if need.numel() == 0:
            return None
        hkeys, htables = torch.stack([keys[need], tables[need]]).cpu()  # (one copy)
        pos, rows = [], []
        if self._land_reads_of(_pair_ids(hkeys, htables)):  # those reads' rows answer from here now
            addresses, here = self.rows.locate(keys[need], tables[need])
            on_host = here.cpu()
            self._counts[_COUNTS.index("read_ahead_late")].index_add_(0, htables, on_host.to(torch.int64))
            pos.append(need[here])
            rows.append(self.rows.read_rows(addresses[here]))
            need, hkeys, htables = need[~here], hkeys[~on_host], htables[~on_host]
        if need.numel():
            try:
                got = self.below.get(hkeys, htables)
            except Exception as e:
                raise BackendError(f"host tier: reading {hkeys.numel()} rows from the store failed") from e
            self._counts[_COUNTS.index("misses")].index_add_(0, htables, torch.ones_like(htables))
            hit = got.found.cpu().nonzero().squeeze(1)
            pos.append(need[hit.to(need.device)])
            rows.append(got.rows[hit].to(self.device, self.dtype))
        if sum(p.numel() for p in pos) == 0:
            return None
        return torch.cat(pos), torch.cat(rows)

    def _land_reads_of(self, ids: torch.Tensor) -> bool:
        """The reads ahead in flight that read any of the pairs ``ids`` waited for and put in (with
        those started before them): a batch that comes before its read ahead has landed waits for it
        rather than asking the store for the same rows again. Returns whether there were any."""
        last = max((i for i, r in enumerate(self._reading) if r.reads_any(ids)), default=-1)
        self._land_reads(wait=True, count=last + 1)
        return last >= 0

    lacking_reads = 2

    def lacking(self, keys: torch.Tensor, tables: torch.Tensor, missed: torch.Tensor) -> torch.Tensor:
        before = self._erasures.clone()  # first: a deletion after the count below is not counted
        if self._holds_below:  # (no pair the tier lacks is in the store; ``capture_key`` has it)
            return torch.cat([before, torch.zeros_like(before)])
        need = missed & self._lacking(keys, tables)
        return torch.cat([before, need.sum().view(1)])

    def erasures(self) -> int:
        return self._round

    # ------------------------------------------------------------------------------- internals

    def _maintain(self) -> None:
        """Before each call: the write-downs the store took settled (raises while it refuses them),
        the reads ahead that are done put in, those queued located and started, and the tables over
        their capacity made room in."""
        self._finish_writes(wait=False)
        self._land_reads(wait=False)
        self._start_reads()
        self._evict()

    def _evict(self) -> None:
        """Tables over their capacity (not counting their rows on the way down) keep it less a
        sixteenth (``_SLACK``): the others leave, the clean ones now, the dirty ones once written down
        (one write for all). A sixteenth, not more: a larger eviction is a burst of writes that the
        bound on rows on their way down (an eighth) makes the training thread wait for, while the
        writer idles between bursts; a smaller one runs the pass over the index that picks the rows
        more often."""
        sizes = self.rows.sizes()
        for ev in self._evicting:
            for t, n in enumerate(torch.bincount(ev.host[1], minlength=len(sizes)).tolist()):
                sizes[t] -= n
        over = [held - (cap - cap // _SLACK) if held > cap else 0
                for held, cap in zip(sizes, self.capacities)]
        if not any(over):
            return
        busy = torch.cat([self.rows.version[:0]] + [ev.addresses for ev in self._evicting])
        keys, addresses, tables = self.rows.oldest(over, busy)
        self._counts[_COUNTS.index("evictions")] += torch.bincount(tables.cpu(), minlength=len(over))
        dirty = self.rows.dirty(addresses)
        clean = (~dirty).nonzero().squeeze(1)
        if clean.numel():  # the store has these rows: they go now
            self._holds_below = False
            self.rows.delete(keys[clean], tables[clean])
            self._erased_now(keys[clean], tables[clean])
        down = dirty.nonzero().squeeze(1)
        if down.numel():
            keys, tables, addresses = keys[down], tables[down], addresses[down]
            versions, used = self.rows.version[addresses].clone(), self.rows.used[addresses].clone()
            self.filter.add(keys, tables)
            rows, ready = to_host_later(self.rows.read_rows(addresses), [])  # (the writer waits for it)
            ev = _Eviction(keys, tables, addresses, versions, used, (keys.cpu(), tables.cpu(), rows), ready,
                           None)
            self._evicting.append(ev)
            if not any(e.handle is None for e in self._evicting[:-1]):  # none waits for a retry
                ev.handle = self._submit(ev)

    def _submit(self, ev: _Eviction) -> IOHandle | None:
        try:
            return self._writer.submit(self._write_down, ev)
        except BackendError:  # an earlier write-down failed: this one waits for the retry
            return None

    def _write_down(self, ev: _Eviction) -> None:
        """An eviction's rows into the store, once their copy to the host is complete."""
        if ev.ready is not None:
            ev.ready.synchronize()
        self.below.set(*ev.host, True)

    def _finish_writes(self, wait: bool) -> None:
        """The write-downs done, oldest first (``wait``: all of them; else also as many as keep the
        rows on their way down within an eighth of the capacities, so that host memory stays bounded
        when the store writes slower than the tables evict): their rows dropped unless written since.
        Those that failed are written again here, in order; raises ``BackendError`` while the store
        refuses them (nothing changed: the rows stay in host memory)."""
        most = max(1, sum(self.capacities) // 8)
        while self._evicting:
            ev = self._evicting[0]
            if ev.handle is not None:
                on_way = sum(e.host[0].numel() for e in self._evicting)
                if not wait and not ev.handle.done() and on_way <= most:
                    return
                try:
                    ev.handle.result()
                except BackendError:
                    ev.handle = None
            if ev.handle is None:  # failed, or refused behind a failure: again, here
                try:
                    self._write_down(ev)
                except Exception as e:
                    n = sum(x.keys.numel() for x in self._evicting)
                    raise BackendError(f"host tier: writing {n} evicted rows down to the store failed; "
                                       "they are kept in host memory and retried at the next call") from e
            self._evicting.pop(0)
            self._dropped(ev)
            for later in self._evicting:  # those held back behind the failure go now
                if later.handle is None:
                    later.handle = self._submit(later)

    def _dropped(self, ev: _Eviction) -> None:
        """An eviction the store has taken: the rows not written since are clean, and those not used
        since either leave host memory. (A row used since, by a batch or a read ahead that found it
        here, stays: its batch would otherwise read it back from the store on its critical path.)"""
        addresses, found = self.rows.where(ev.keys, ev.tables)
        at = addresses.clamp(min=0)
        same = found & (addresses == ev.addresses) & (self.rows.version[at] == ev.versions)
        written = same.nonzero().squeeze(1)
        self.rows.clean[ev.addresses[written]] = ev.versions[written]
        go = (same & (self.rows.used[at] == ev.used)).nonzero().squeeze(1)
        self._counts[_COUNTS.index("written_down")].index_add_(0, ev.host[1], torch.ones_like(ev.host[1]))
        if go.numel():
            self._holds_below = False
            self.rows.delete(ev.keys[go], ev.tables[go])
            self._erased_now(ev.keys[go], ev.tables[go])

    def _erased_now(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """Pairs dropped from host memory: a read ahead in flight since may hold an older row."""
        if self._reading:
            self._erased.append((self._round, _pair_ids(keys.cpu(), tables.cpu())))
        self._round += 1
        self._erasures += 1  # (after the deletion, in the device's order: ``lacking`` reads it)

    def finish_reads(self) -> None:
        """Wait for the reads ahead started so far and put their rows in."""
        self._land_reads(wait=True)

    def _start_reads(self) -> None:
        """The queued reads ahead handed to a reader thread, with which of their pairs host memory
        lacks and the store may hold (found on the device and copied to the host behind its work:
        the reader waits for it, this thread never does). Pairs given on the host go to the device
        in one copy from pinned memory (from pageable memory the copy would wait for the device)."""
        if not self._queued or not self.reads_ahead():
            self._queued = []
            return
        queued, self._queued = self._queued, []  # (``read_ahead`` may append from another thread)
        if self.device.type == "cuda" and all(k.device.type == "cpu" for k, _ in queued):
            on_host, (keys, tables) = to_device_at_once([list(x) for x in zip(*queued)], self.device)
            pairs = torch.stack(on_host)  # (the reader's, on the host)
            lack, ready = to_host_later(self._lacking(keys, tables, ahead=True), [])
        else:
            keys, tables = (torch.cat([t.to(self.device, non_blocking=True) for t in x])
                            for x in zip(*queued))
            lack = self._lacking(keys, tables, ahead=True)
            both, ready = to_host_later(torch.stack([keys, tables, lack.long()]), [])
            pairs, lack = both[:2], both[2]
        future = self._readers.submit(self._read, pairs, lack, ready)
        self._reading.append(_Read(self._round, future, pairs, lack, ready))

    def _lacking(self, keys: torch.Tensor, tables: torch.Tensor, ahead: bool = False) -> torch.Tensor:
        """bool: which pairs host memory lacks and the store may hold (device work only). ``ahead``:
        for a read ahead, whose pairs held are marked used now (``TieredRows.wanted``): evicted in
        the steps before their batch, they would be read from the store again on its critical path."""
        held = self.rows.wanted(keys, tables) if ahead else self.rows.held(keys, tables)
        return (keys != RESERVED_KEY) & ~held & self.filter.may_hold(keys, tables)

    def _read(self, pairs: torch.Tensor, lack: torch.Tensor, ready: torch.cuda.Event | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """On a reader thread: of ``pairs`` (keys, tables: int64 (2, n) on the host), the distinct
        ones ``lack`` marks (n on the host, complete once ``ready`` has passed) read from the store;
        returns those it has and their rows (pinned where the device will copy them)."""
        if ready is not None:
            ready.synchronize()
        lack = lack.nonzero().squeeze(1)
        keys, tables = pairs[0, lack], pairs[1, lack]
        if keys.numel() == 0:  # host memory holds them all (the tables in its reach: nearly always)
            return keys, tables, torch.empty(0, self.width, dtype=self.dtype)
        last = last_of_duplicates(keys, tables)
        keys, tables = keys[last], tables[last]
        got = self.below.get(keys, tables)
        hit = got.found.cpu().nonzero().squeeze(1)
        rows = got.rows[hit].cpu()
        return keys[hit], tables[hit], rows.pin_memory() if self.device.type == "cuda" else rows

    def _land_reads(self, wait: bool, count: int | None = None) -> None:
        """The reads ahead done (``wait``: all, or the oldest ``count``), oldest first: their rows put
        in where the pair is absent and was not dropped since the read began (on the device, no host
        read)."""
        landed = 0
        while self._reading and (wait or self._reading[0].future.done()) and landed != count:
            landed += 1
            read = self._reading.pop(0)
            try:
                keys, tables, rows = read.future.result()
            except Exception as e:  # noqa: BLE001 - a read ahead is a hint: a batch's miss reads again
                if not self._read_failed_logged:
                    self._read_failed_logged = True
                    log.warning("a read ahead from the store failed (dropped; the misses read the store "
                                "themselves): %s", e)
                continue
            erased = [ids for r, ids in self._erased if r >= read.since]
            if erased and keys.numel():
                stale = torch.isin(_pair_ids(keys, tables), torch.cat(erased))
                self._counts[_COUNTS.index("read_ahead_dropped")].index_add_(0, tables, stale.to(torch.int64))
                keep = (~stale).nonzero().squeeze(1)
                keys, tables, rows = keys[keep], tables[keep], rows[keep]
            if keys.numel():
                tables = tables.to(self.device, non_blocking=True)
                new = self.rows.insert_absent(keys, tables, rows)
                self._landed.index_add_(0, tables, new.to(torch.int64))
        since = min((r.since for r in self._reading), default=self._round)
        self._erased = [(r, ids) for r, ids in self._erased if r >= since]

    def scan_table(self, table: int, chunk_rows: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row of ``table`` once: host memory's, then the store's others (keys and rows on the host)."""
        self._maintain()
        keys, addresses = self.rows.table_rows(table)
        for start in range(0, keys.numel(), chunk_rows):
            part = slice(start, start + chunk_rows)
            yield keys[part].cpu(), self.rows.read_rows(addresses[part]).cpu()
        held = keys.cpu()
        for skeys, srows in self.below.table(table).scan(chunk_rows):
            if held.numel():
                new = ~torch.isin(skeys, held)
                skeys, srows = skeys[new], srows[new]
            if skeys.numel():
                yield skeys, srows

    def table_size(self, table: int) -> int:
        self._maintain()
        self._finish_writes(wait=True)  # the store's count and its answer below agree
        keys, _ = self.rows.table_rows(table)
        only_here = 0
        if keys.numel():
            tables = torch.full((keys.numel(),), table, dtype=torch.int64)
            only_here = int((~self.below.get(keys.cpu(), tables).found).sum())
        return self.below.table(table).size() + only_here

    def tier_stats(self, table: int) -> HostTierStats:
        _, addresses = self.rows.table_rows(table)
        counts = dict(zip(_COUNTS, self._counts[:, table].tolist()))
        counts["read_ahead_rows"] = int(self._landed[table])
        return HostTierStats(rows=addresses.numel(), capacity=self.capacities[table],
                             dirty=int(self.rows.dirty(addresses).sum()), hits=int(self.rows.hits[table]),
                             read_ahead_hits=int(self.rows.ahead_hits[table]), **counts)


class _TierTable(Backend):
    """Table ``t`` of a ``HostTierGroup``, as a one-table backend."""

    def __init__(self, group: HostTierGroup, t: int) -> None:
        self.group, self.t = group, t
        self.width, self.device, self.dtype = group.width, group.device, group.dtype

    def _tables(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.full((keys.numel(),), self.t, dtype=torch.int64, device=keys.device)

    def get(self, keys: torch.Tensor) -> Fetched:
        keys = keys.reshape(-1).to(torch.int64)
        return self.group.get(keys, self._tables(keys))

    def set(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        keys = keys.reshape(-1).to(torch.int64)
        self.group.set(keys, self._tables(keys), rows.reshape(-1, self.width))

    def delete(self, keys: torch.Tensor) -> None:
        keys = keys.reshape(-1).to(torch.int64)
        self.group.delete(keys, self._tables(keys))

    def read_ahead(self, keys: torch.Tensor) -> None:
        keys = keys.reshape(-1).to(torch.int64)
        self.group.read_ahead(keys, self._tables(keys))

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.group.scan_table(self.t, chunk_rows)

    def size(self) -> int:
        return self.group.table_size(self.t)

    def flush(self) -> None:
        self.group.flush()

    def index_bytes(self) -> dict[str, int]:
        """The tier's index (its part), its share of the group's filter and of the rows' marks, the
        store's."""
        where = "device" if self.device.type == "cuda" else "host"
        share = (self.group.filter.nbytes() + self.group.rows.marks_nbytes()) // len(self.group.backends)
        own = add_bytes(self.group.rows.index_bytes(self.t), {where: share})
        return add_bytes(own, self.group.below.table(self.t).index_bytes())

    def tier_stats(self) -> HostTierStats:
        return self.group.tier_stats(self.t)
