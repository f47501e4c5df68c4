"""One table in ``cache`` mode: a bounded device tier, write-back, over a backing store.

Prefetch does all the moving; forward and backward see row addresses like in ``hbm_direct``:

    unique keys ─► find in the cache ─┬─ hit: lock
                                      ├─ in an earlier batch's scratch pad: share that row
                                      └─ miss: get from the backend ─► admission (new keys only)
                                           ─► find_or_insert: victims written down first, then the
                                              fetched (or initial) rows written into their slots
                                           ─► no way free in the bucket (conflict miss), or not
                                              admitted: a scratch row for the batch

At release (after backward) the batch's slots are unlocked and its scratch rows are written down to
the backend (conflict misses; the last batch sharing a row writes it) or dropped (not admitted).
Evicted rows are always written down: the cache never loses a row. Backend calls run in order on the
caller's thread (one FIFO), so a fetch always sees every earlier write-back; rows whose write-down
failed are kept on the host, read in their place, retried at the next call, and the failure raised
there, chained to the backend's exception.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.profiler import record_function

from tieredemb.config import TableConfig
from tieredemb.index.key_index import KeyIndex
from tieredemb.modules.table import HbmTable, TablePrefetch, TableRows, TableStats
from tieredemb.ops.reference import TorchKernels
from tieredemb.optim import EmbeddingOptimizer
from tieredemb.storage.backend import Backend
from tieredemb.storage.errors import BackendError


@dataclass
class CachePrefetch(TablePrefetch):
    """A cache batch: besides the hbm fields, the shared scratch keys it must write down at
    release (``write_back``: int64 (w,)) and its private scratch rows (``scratch``, dropped)."""

    write_back: torch.Tensor | None = None


class CacheTable(HbmTable):
    """A device cache of ``cache_rows`` rows over ``backend``.

    Args: as ``HbmTable``, plus ``cache_rows`` (slots of the device index, whole buckets) and the
    table's ``backend``.
    """

    def __init__(self, config: TableConfig, optimizer: EmbeddingOptimizer, seed: int,
                 device: torch.device, kernels: TorchKernels, bucket_width: int,
                 segment_rows: int, cache_rows: int, backend: Backend) -> None:
        super().__init__(config, optimizer, seed, device, kernels, bucket_width,
                         min(segment_rows, cache_rows), index_slots=cache_rows)
        self.backend = backend
        # keys whose rows are in a scratch pad and still owed to the backend: value = scratch
        # address, lock = batches sharing it
        self.in_flight = KeyIndex(bucket_width, "lru", device, initial_slots=256)
        self.bytes_fetched = 0
        self.bytes_written = 0
        self._unwritten: list[tuple[torch.Tensor, torch.Tensor]] = []  # rows not yet in the backend
        self._write_error: Exception | None = None

    # --------------------------------------------------------------------------------- prefetch
    def prefetch(self, ids: torch.Tensor, step: int, training: bool) -> TablePrefetch:
        unique, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        self.counters.lookups += ids.numel()
        self.counters.unique_lookups += unique.numel()
        if not training:
            return self._prefetch_eval(unique, inverse)
        addresses = torch.full((unique.numel(),), -1, dtype=torch.int64, device=self.device)
        shared = self.in_flight.find(unique)
        in_pad = shared >= 0
        rest = (~in_pad).nonzero().squeeze(1)
        in_cache = self.index.find(unique[rest]) >= 0
        miss = rest[~in_cache]
        with record_function("## cache.fetch ##"):
            fetched = self._fetch(unique[miss])  # (m, W) rows: backend's, else initial. May
            # raise: nothing has changed yet
        addresses[in_pad] = self.in_flight.values[shared[in_pad]]
        self.in_flight.locks[shared[in_pad]] += 1
        store = torch.ones(rest.numel(), dtype=torch.bool, device=self.device)
        admit = self._admit_new(unique[miss], counts[miss], fetched.found)
        store[(~in_cache).nonzero().squeeze(1)] = admit
        keep = rest[store]
        with record_function("## cache.insert ##"):
            res = self.index.find_or_insert(unique[keep], step, counts[keep], lock=True)
        with record_function("## cache.write_down ##"):
            self._write_down(res.evicted_keys, res.evicted_values)
        placed = res.slots >= 0
        row_of = torch.full((unique.numel(),), -1, dtype=torch.int64, device=self.device)
        row_of[miss] = torch.arange(miss.numel(), device=self.device)
        self._fill_inserted(unique[keep], res, fetched.rows, row_of[keep])
        addresses[keep[placed]] = self._slot_rows(res)[placed]
        # scratch: conflict misses (owed to the backend) and keys not admitted (dropped)
        conflict = keep[~placed]
        dropped = rest[~store]
        owed = self._scratch(unique[conflict], fetched.rows[row_of[conflict]], addresses, conflict)
        private = self._scratch(unique[dropped], fetched.rows[row_of[dropped]], addresses, dropped)
        self._register_owed(unique[conflict], owed)
        self.counters.hits += unique.numel() - miss.numel()  # in the cache or a scratch pad
        self._device_counts[1] += miss.numel()
        self._device_counts[2] += conflict.numel()
        self.counters.evictions += res.evicted_keys.numel()
        self.counters.not_admitted += dropped.numel()
        locked = unique[keep][placed]
        return CachePrefetch(unique, inverse, addresses, locked, res.slots[placed],
                             self.index.generation, private,
                             write_back=torch.cat([unique[in_pad], unique[conflict]]))

    def _prefetch_eval(self, unique: torch.Tensor, inverse: torch.Tensor) -> TablePrefetch:
        """Read-only: cached rows by address, others fetched into private scratch rows (keys the
        backend does not hold read as zeros). Nothing is inserted and no score moves."""
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        addresses, found = self._locate(unique)
        missing = (~found).nonzero().squeeze(1)
        got = self._get(unique[missing])
        have = missing[got.found.to(self.device)]
        private = self.store.allocate(have.numel())
        self.kernels.scatter(self.store, private, got.rows.to(self.device)[got.found.to(self.device)])
        addresses[have] = private
        return CachePrefetch(unique, inverse, addresses, empty, empty, self.index.generation, private,
                             write_back=empty)

    def _locate(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Device addresses of keys in the cache or in flight in a scratch pad (-1 elsewhere)."""
        slots = self.index.find(keys)
        addresses = torch.where(slots >= 0, self.index.values[slots.clamp(min=0)], -1)
        shared = self.in_flight.find(keys)
        addresses = torch.where(shared >= 0, self.in_flight.values[shared.clamp(min=0)], addresses)
        return addresses, addresses >= 0

    def _get(self, keys: torch.Tensor):
        """Backend rows of ``keys``, with the rows still waiting to be written down laid over them
        (they are newer). Raises a pending write-down failure first, before anything changes."""
        self._raise_write_failure()
        keys = keys.to(self.backend.device)
        got = self.backend.get(keys)
        self.bytes_fetched += int(got.found.sum()) * self.width * 4
        if self._unwritten:
            pkeys = torch.cat([k for k, _ in self._unwritten])
            prows = torch.cat([r for _, r in self._unwritten])
            # the last write of a key wins: scan the pending rows in order
            match = (keys[:, None] == pkeys[None, :]).nonzero()
            if match.numel():
                got.rows[match[:, 0]] = prows[match[:, 1]]
                got.found[match[:, 0]] = True
        return got

    def _fetch(self, keys: torch.Tensor):
        """Rows of missed keys on the device: the backend's where it has them, else initial rows.
        Returns an object with ``rows`` float32 (m, W) device and ``found`` bool (m,) device."""
        got = self._get(keys)
        rows = got.rows.to(self.device)
        found = got.found.to(self.device)
        new = (~found).nonzero().squeeze(1)
        if new.numel():
            rows[new] = self._initial_rows(keys[new])
        got.rows, got.found = rows, found
        return got

    def _admit_new(self, keys: torch.Tensor, counts: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        """bool (m,) for missed keys: stored in the backend already, or admitted by this batch."""
        if self.admission is None:
            return torch.ones(keys.numel(), dtype=torch.bool, device=self.device)
        return self._count_admission(keys, counts, found)

    def _fill_inserted(self, keys: torch.Tensor, res, rows: torch.Tensor, row_of: torch.Tensor) -> None:
        """Rows of the keys ``res`` inserted: a victim's row (already written down) or a fresh one,
        filled with the fetched or initial row."""
        if not res.any_miss:
            return
        inserted = self._give_rows(res)
        self.kernels.scatter(self.store, self._slot_rows(res)[inserted], rows[row_of[inserted]])

    def _scratch(self, keys: torch.Tensor, rows: torch.Tensor, addresses: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """Scratch rows for ``keys`` holding ``rows``; their addresses go to ``addresses[positions]``."""
        scratch = self.store.allocate(keys.numel())
        self.kernels.scatter(self.store, scratch, rows)
        addresses[positions] = scratch
        return scratch

    def _register_owed(self, keys: torch.Tensor, scratch: torch.Tensor) -> None:
        if keys.numel() == 0:
            return
        res = self.in_flight.find_or_insert(keys, 0, lock=True)
        self.in_flight.assign(res.slots, scratch)

    def _write_down(self, keys: torch.Tensor, addresses: torch.Tensor) -> None:
        """Copy rows at ``addresses`` to the backend under ``keys``. The host copies are kept until
        the backend has taken them: a failed write loses no row. The failure is raised at the next
        call that needs the backend (never in the middle of a prefetch), and the rows are retried
        then, in order."""
        if keys.numel() == 0:
            return
        bdev = self.backend.device
        rows = self.kernels.gather(self.store, addresses, self.width)
        self._unwritten.append((keys.to(bdev), rows.to(bdev)))
        self._try_write()

    def _try_write(self) -> None:
        if not self._unwritten:
            return
        keys = torch.cat([k for k, _ in self._unwritten])
        rows = torch.cat([r for _, r in self._unwritten])
        try:
            self.backend.set(keys, rows)
        except Exception as e:  # noqa: BLE001 - any backend failure: keep the rows, report later
            self._write_error = e
            return
        self._unwritten.clear()
        self.bytes_written += keys.numel() * self.width * 4

    def _raise_write_failure(self) -> None:
        """Retry the rows a failed write-down kept; if that fails too, raise, chained to the cause."""
        if self._write_error is None:
            return
        self._write_error = None
        self._try_write()
        if self._write_error is not None:
            cause, self._write_error = self._write_error, None
            n = sum(k.numel() for k, _ in self._unwritten)
            raise BackendError(f"table {self.name!r}: writing {n} rows down to the backing store failed; "
                               "they are kept and retried at the next call") from cause

    # ---------------------------------------------------------------------------------- release
    def release(self, pf: TablePrefetch) -> None:
        """Unlock the batch's slots; write down the scratch rows no later batch still shares; drop
        the private ones."""
        if not self.index.unlock_slots(pf.locked_slots, pf.generation):
            self.index.unlock(pf.locked)
        self.store.free(pf.scratch)
        owed = pf.write_back
        if owed is None or owed.numel() == 0:
            return
        slots = self.in_flight.find(owed)
        self.in_flight.locks[slots] -= 1
        done = owed[self.in_flight.locks[slots] == 0]
        if done.numel():
            addresses = self.in_flight.erase(done)
            self._write_down(done, addresses)
            self.store.free(addresses)

    # ------------------------------------------------------------------------------ row access
    def read(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        addresses, found = self._locate(keys)
        out = self.store.gather(addresses, self.dim)
        missing = (~found).nonzero().squeeze(1)
        got = self._get(keys[missing])
        out[missing] = got.rows[:, : self.dim].to(self.device)
        found[missing] = got.found.to(self.device)
        return out, found

    def write(self, keys: torch.Tensor, weights: torch.Tensor, step: int) -> None:
        """Upsert through the cache: rows land in the cache (victims written down), or straight
        in the backend where the bucket has no room."""
        rows = torch.zeros(keys.numel(), self.width, dtype=torch.float32, device=self.device)
        rows[:, : self.dim] = weights
        res = self.index.find_or_insert(keys, step)
        self._write_down(res.evicted_keys, res.evicted_values)
        if res.any_miss:
            self._give_rows(res)
        placed = (res.slots >= 0).nonzero().squeeze(1)
        self.kernels.scatter(self.store, self._slot_rows(res)[placed], rows[placed])
        spill = (res.slots < 0).nonzero().squeeze(1)
        if spill.numel():
            self._unwritten.append((keys[spill].to(self.backend.device), rows[spill].to(self.backend.device)))
            self._try_write()
        self.counters.evictions += res.evicted_keys.numel()

    def flush(self) -> None:
        """Write every cached row down (the backend alone then holds the table) and flush it."""
        self._raise_write_failure()
        keys, addresses, _ = self.index.export()
        self._write_down(keys, addresses)
        self._raise_write_failure()
        self.backend.flush()

    def export(self) -> TableRows:
        """Cached rows, and the backend's rows of keys not cached (scores of those: 0)."""
        self._raise_write_failure()
        self._try_write()
        keys, addresses, scores = self.index.export()
        parts = [(keys, self.store.gather(addresses), scores)]
        for bkeys, brows in self.backend.scan():
            bkeys = bkeys.to(self.device)
            fresh = ~torch.isin(bkeys, keys)
            parts.append((bkeys[fresh], brows.to(self.device)[fresh],
                          torch.zeros(int(fresh.sum()), dtype=torch.int64, device=self.device)))
        k, rows, sc = (torch.cat(p) for p in zip(*parts))
        return TableRows(k, rows[:, : self.dim], rows[:, self.dim :], sc)

    def stats(self) -> TableStats:
        out = super().stats()
        out.rows = {"device": self.index.size(), "backend": self.backend.size()}
        out.capacity = self.index.capacity()
        out.bytes_moved = {"backend->device": self.bytes_fetched, "device->backend": self.bytes_written}
        return out

    def close(self) -> None:
        self.backend.close()
