"""KeyIndex: a bucketed hash index from raw int64 keys to row addresses.

Layout (all on one device, CPU or CUDA): ``num_buckets x width`` slots, slot = bucket * width + way.

    keys:   int64 (C,)  RESERVED_KEY marks an empty slot
    values: int64 (C,)  the row address of the key in the RowStore (rows never move when the index does)
    scores: int64 (C,)  LRU: step of last use; LFU: use count
    locks:  int32 (C,)  batches holding the slot; a locked slot is never evicted

A key's bucket is a multiply-shift reduction of its splitmix64 hash, monotone in the hash, so
doubling the buckets splits each bucket in two and a rehash can never overflow one. Unbounded tables
grow by doubling; a table with ``max_slots`` is allocated at that size once and evicts the
lowest-score unlocked slot of the key's bucket when the bucket is full (exact LRU/LFU per bucket).

Insertion is deterministic: a bucket's misses, in ascending key order, take first its empty ways
(in way order), then, when eviction is allowed, its unlocked ways by ascending (score, way). The Triton
implementation (``tieredemb.ops.triton.index``) follows exactly these rules and is tested equal.

This module is the pure-torch reference; it is also the CPU path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tieredemb.config import RESERVED_KEY
from tieredemb.init import _shr, splitmix64

_INT64_MAX = 2**63 - 1
MAX_LOAD = 0.5  # unbounded indexes double before inserts would pass this load


def bucket_of(keys: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """int64 (n,) keys -> int64 (n,) bucket in [0, num_buckets)."""
    hi = _shr(splitmix64(keys), 32)  # [0, 2**32)
    return (hi * num_buckets) >> 32


@dataclass
class InsertResult:
    """Answer of ``find_or_insert`` for n unique keys (all tensors on the index device).

    slots:   int64 (n,) index slot, -1 where the bucket had no room (a conflict miss)
    found:   bool (n,)  the key was already present
    values:  int64 (n,) the key's row address; for a key inserted into an evicted slot, the victim's
             address (the caller reuses that row); -1 for a key inserted into an empty slot, until
             the caller calls ``assign``
    evicted_keys / evicted_values / evicted_scores: (e,) what eviction removed from the index
    """

    slots: torch.Tensor
    found: torch.Tensor
    values: torch.Tensor
    evicted_keys: torch.Tensor
    evicted_values: torch.Tensor
    evicted_scores: torch.Tensor
    any_miss: bool = True  # host-side: False when every key was found (nothing inserted or evicted)

    @property
    def inserted(self) -> torch.Tensor:
        """bool (n,): stored by this call."""
        return ~self.found & (self.slots >= 0)


class KeyIndex:
    """Bucketed key -> row-address index with scores and lock counts (pure torch).

    Args:
        width: slots per bucket.
        policy: ``"lru"`` or ``"lfu"``.
        device: where the index tensors live.
        max_slots: None for an unbounded index (grows by doubling); else the index is allocated with
            ``ceil(max_slots / width)`` buckets at once and evicts when a bucket is full.
        initial_slots: starting size of an unbounded index.
    """

    def __init__(self, width: int, policy: str, device: torch.device, max_slots: int | None = None,
                 initial_slots: int = 1024) -> None:
        if policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {policy!r}")
        self.width = width
        self.policy = policy
        self.device = torch.device(device)
        self.bounded = max_slots is not None
        if self.bounded:
            num_buckets = -(-max_slots // width)
        else:
            num_buckets = 1
            while num_buckets * width < initial_slots:
                num_buckets *= 2
        self._allocate(num_buckets)
        # the size lives on the device (no sync per insert); ``_size_bound`` is a host upper bound
        # that decides when to look at it
        self._size_dev = torch.zeros((), dtype=torch.int64, device=self.device)
        self._size_bound = 0
        self.generation = 0  # rehashes so far

    # ----------------------------------------------------------------------------------- layout
    def _allocate(self, num_buckets: int) -> None:
        c = num_buckets * self.width
        self.num_buckets = num_buckets
        self.keys = torch.full((c,), RESERVED_KEY, dtype=torch.int64, device=self.device)
        self.values = torch.full((c,), -1, dtype=torch.int64, device=self.device)
        self.scores = torch.zeros(c, dtype=torch.int64, device=self.device)
        self.locks = torch.zeros(c, dtype=torch.int32, device=self.device)

    def capacity(self) -> int:
        return self.num_buckets * self.width

    def size(self) -> int:
        return int(self._size_dev)

    def _reserve_for(self, n: int) -> None:
        """Grow if ``n`` more keys could pass the load limit (reads the size only when it might)."""
        if self._size_bound + n > MAX_LOAD * self.capacity():
            self._size_bound = self.size()
            self.reserve(self._size_bound + n)

    def _bucket(self, keys: torch.Tensor) -> torch.Tensor:
        return bucket_of(keys, self.num_buckets)

    # ------------------------------------------------------------------------------------ verbs
    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """keys: int64 (n,) -> slots: int64 (n,), -1 where absent. Scores and locks unchanged."""
        if keys.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        base = self._bucket(keys) * self.width  # (n,)
        ways = base[:, None] + torch.arange(self.width, device=self.device)[None, :]  # (n, W)
        hit = (self.keys[ways] == keys[:, None]) & (keys[:, None] != RESERVED_KEY)  # never the empty mark
        way = hit.to(torch.int8).argmax(dim=1)
        return torch.where(hit.any(dim=1), base + way, torch.full_like(base, -1))

    def find_or_insert(self, keys: torch.Tensor, step: int, counts: torch.Tensor | None = None,
                       lock: bool = False) -> InsertResult:
        """Find ``keys`` (unique int64 (n,)), inserting the absent ones.

        Every key that ends in a slot gets its score updated (LRU: ``step``; LFU: ``+= counts``, the
        occurrences in the batch, 1 each by default). With ``lock`` those slots' lock counts go up by
        one (release with ``unlock``). Keys present or inserted earlier in the same call are never
        evicted by it. Host syncs: the insertion's compaction, and one check for a full bucket in an
        unbounded index.
        """
        n = keys.numel()
        if counts is None:
            counts = torch.ones(n, dtype=torch.int64, device=self.device)
        if not self.bounded:
            self._reserve_for(n)  # before the lookup: a rehash moves slots
        slots = self.find(keys)
        found = slots >= 0
        miss = ~found
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        if not bool(miss.any()):  # the steady state of a warm table: every key found
            if lock:
                self.locks.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
            if self.policy == "lru":
                self.scores.index_fill_(0, slots, step)
            else:
                self.scores.index_add_(0, slots, counts)
            self._size_bound += n
            return InsertResult(slots, found, self.values[slots], empty, empty, empty, any_miss=False)
        # shield this batch's hits from its own evictions (slot 0 stands in for misses: they add 0)
        self.locks.index_add_(0, slots.clamp(min=0), found.to(torch.int32))
        ev_keys, ev_vals, ev_scores = self._insert(keys, slots, miss)
        if not self.bounded:
            failed = miss & (slots < 0)
            while bool(failed.any()):  # a full bucket: double, find this batch's slots again
                self._grow(2 * self.num_buckets)
                slots = torch.where(slots >= 0, self.find(keys), slots)
                self._insert(keys, slots, failed)
                failed = miss & (slots < 0)
        placed = slots >= 0
        safe = slots.clamp(min=0)
        values = torch.where(placed, self.values[safe], -1)
        self._touch(safe, placed, step, counts)
        if not lock:
            self.locks.index_add_(0, safe, -placed.to(torch.int32))
        self._size_dev += (miss & placed).sum() - ev_keys.numel()
        self._size_bound += n
        return InsertResult(slots, found, values, ev_keys, ev_vals, ev_scores)

    def _insert(self, keys: torch.Tensor, slots: torch.Tensor, todo: torch.Tensor):
        """Place keys[todo] in their buckets; writes slots in place, locks the new slots once.

        Returns the evicted (keys, values, scores).
        """
        idx = todo.nonzero().squeeze(1)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        if idx.numel() == 0:
            return empty, empty, empty
        mk = keys[idx]
        bucket = self._bucket(mk)
        # misses sorted by (bucket, key): the deterministic order in which they claim ways
        order = torch.argsort(mk, stable=True)
        order = order[torch.argsort(bucket[order], stable=True)]
        idx, mk, bucket = idx[order], mk[order], bucket[order]
        ubuckets, counts = torch.unique_consecutive(bucket, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(idx.numel(), device=self.device) - torch.repeat_interleave(starts, counts)
        cand = self._candidates(ubuckets)  # (u, W) ways in claim order, -1 = unavailable
        bpos = torch.repeat_interleave(torch.arange(ubuckets.numel(), device=self.device), counts)
        way = torch.where(rank < self.width, cand[bpos, rank.clamp(max=self.width - 1)], -1)
        ok = way >= 0
        slot = torch.where(ok, bucket * self.width + way, torch.full_like(way, -1))
        slots[idx] = slot
        s = slot[ok]
        victim = self.keys[s] != RESERVED_KEY
        ev = s[victim]
        evicted = (self.keys[ev].clone(), self.values[ev].clone(), self.scores[ev].clone())
        self.values[s[~victim]] = -1
        self.keys[s] = mk[ok]
        self.scores[s] = 0
        self.locks[s] = 1
        return evicted

    def _candidates(self, buckets: torch.Tensor) -> torch.Tensor:
        """Ways of each bucket in claim order: empty by way, then evictable by (score, way)."""
        ways = buckets[:, None] * self.width + torch.arange(self.width, device=self.device)[None, :]
        k, sc, lk = self.keys[ways], self.scores[ways], self.locks[ways]
        is_empty = k == RESERVED_KEY
        evictable = ~is_empty & (lk == 0) & self.bounded
        prio = torch.where(is_empty, torch.full_like(sc, -1), sc)
        prio = torch.where(is_empty | evictable, prio, torch.full_like(sc, _INT64_MAX))
        prio, order = torch.sort(prio, dim=1, stable=True)
        return torch.where(prio < _INT64_MAX, order, torch.full_like(order, -1))

    def _touch(self, safe: torch.Tensor, placed: torch.Tensor, step: int, counts: torch.Tensor) -> None:
        """Scores of the placed slots: LRU ``step``, LFU ``+= counts`` (new slots start at 0)."""
        if self.policy == "lru":
            delta = torch.where(placed, step - self.scores[safe], 0)
        else:
            delta = torch.where(placed, counts, 0)
        self.scores.index_add_(0, safe, delta)  # unplaced entries add 0 to slot 0

    def assign(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Set the row addresses of occupied ``slots``."""
        self.values[slots] = values

    def unlock_slots(self, slots: torch.Tensor, generation: int) -> bool:
        """Release one lock on each of ``slots`` (int64 (n,), distinct, occupied) if the index has
        not been rehashed since they were found (``generation``). Returns False (nothing done) if it
        has: then ``unlock`` the keys."""
        if generation != self.generation:
            return False
        self.locks.index_add_(0, slots, torch.full_like(slots, -1, dtype=torch.int32))
        return True

    def unlock(self, keys: torch.Tensor) -> None:
        """Release one lock on each present key (absent keys are ignored)."""
        slots = self.find(keys)
        self.locks.index_add_(0, slots.clamp(min=0), -(slots >= 0).to(torch.int32))
        self.locks.clamp_(min=0)

    def erase(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove keys. Returns the row addresses of the removed ones (int64 (r,))."""
        slots = self.find(keys)
        slots = slots[slots >= 0]
        values = self.values[slots].clone()
        self.keys[slots] = RESERVED_KEY
        self.values[slots] = -1
        self.scores[slots] = 0
        self.locks[slots] = 0
        self._size_dev -= slots.numel()
        self._size_bound = self.size()
        return values

    def export(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, scores) of every occupied slot, in slot order."""
        occupied = self.keys != RESERVED_KEY
        return self.keys[occupied], self.values[occupied], self.scores[occupied]

    def reserve(self, n: int) -> None:
        """Grow an unbounded index by doubling until ``n`` keys stay under the load limit."""
        if self.bounded:
            return
        num_buckets = self.num_buckets
        while n > MAX_LOAD * num_buckets * self.width:
            num_buckets *= 2
        if num_buckets != self.num_buckets:
            self._grow(num_buckets)

    def _grow(self, num_buckets: int) -> None:
        """Rehash into ``num_buckets`` (a power-of-two multiple: every old bucket splits cleanly)."""
        self.generation += 1  # slots found before now are stale
        occupied = self.keys != RESERVED_KEY
        keys, values = self.keys[occupied], self.values[occupied]
        scores, locks = self.scores[occupied], self.locks[occupied]
        self._allocate(num_buckets)
        bucket = self._bucket(keys)
        order = torch.argsort(bucket, stable=True)  # keep old relative order within a bucket
        keys, values, scores, locks, bucket = (t[order] for t in (keys, values, scores, locks, bucket))
        _, counts = torch.unique_consecutive(bucket, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        way = torch.arange(keys.numel(), device=self.device) - torch.repeat_interleave(starts, counts)
        slot = bucket * self.width + way
        self.keys[slot], self.values[slot], self.scores[slot], self.locks[slot] = (
            keys, values, scores, locks)
