"""KeyFilter: which (table, key) pairs a store may hold, a Bloom filter on the device.

A host tier asks its store below for the rows it lacks. Most of those misses are often keys no
store holds (a table's ids seen for the first time), and asking RocksDB for them costs as much as
reading a row (the per-key work of the call, not the disk). The tier adds every pair it writes down
to this filter and asks the store only for pairs the filter may hold: never a false "absent", about
``(1 - exp(-hashes / bits_per_key)) ** hashes`` false "may hold" (8 hashes at 16 bits a key: 0.06%;
at the 50 bits a key of a store that holds a third of the keys the filter was sized for, 2e-7). A
false "may hold" costs more than its store read: the batch's insertion takes the host path, which
waits for the device (under ``TrainPipeline``, for the dense model's backward), so the filter is
tuned for the keys seen for the first time each step (thousands) to almost never pass.

Bits are int64 words of 63 bits each (bit 63 unused, so ``1 << b`` stays positive); a batch sets its
bits with one ``index_add_`` of distinct bits not yet set, which is an OR.
"""

from __future__ import annotations

import torch

from tieredemb.keys import GOLDEN, splitmix64
from tieredemb.ops import triton_hashing

_BITS = 63


class KeyFilter:
    """A Bloom filter of ``bits`` bits (rounded up to whole words) on ``device``, ``hashes`` per pair.

    Example::

        f = KeyFilter(1 << 20, torch.device("cpu"))
        f.add(torch.tensor([7]), torch.tensor([0]))
        f.may_hold(torch.tensor([7, 8]), torch.tensor([0, 0]))   # tensor([True, False]) (likely)
    """

    def __init__(self, bits: int, device: torch.device, hashes: int = 8) -> None:
        if bits < 1 or hashes < 1:
            raise ValueError(f"KeyFilter needs bits >= 1 and hashes >= 1, got {bits}, {hashes}")
        self.words = torch.zeros(-(-bits // _BITS), dtype=torch.int64, device=device)
        self.bits = self.words.numel() * _BITS
        self.hashes = hashes

    def _positions(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """int64 (hashes, n): each pair's bits (double hashing of its splitmix64)."""
        h1 = splitmix64(keys.to(torch.int64) ^ (tables.to(torch.int64) * GOLDEN))
        h2 = splitmix64(h1) | 1
        i = torch.arange(self.hashes, dtype=torch.int64, device=keys.device).unsqueeze(1)
        return torch.remainder(h1.unsqueeze(0) + i * h2.unsqueeze(0), self.bits)

    def add(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """The pairs (int64 (n,) each, on the filter's device) marked as held."""
        if keys.numel() == 0:
            return
        pos = torch.unique(self._positions(keys, tables))
        word, bit = pos // _BITS, torch.ones_like(pos) << (pos % _BITS)
        unset = (self.words[word] & bit) == 0
        self.words.index_add_(0, word[unset], bit[unset])

    def may_hold(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """bool (n,): False where the store surely lacks the pair."""
        if keys.is_cuda and triton_hashing() is not None:  # the same answer in one kernel
            return triton_hashing().bloom_may_hold(self.words, keys, tables, self.bits, self.hashes)
        pos = self._positions(keys, tables)
        return ((self.words[pos // _BITS] >> (pos % _BITS)) & 1).bool().all(0)

    def nbytes(self) -> int:
        return self.words.numel() * 8
