"""KeyFilter (a Bloom filter of the pairs a store holds) against a Python set."""

from __future__ import annotations

import math

import pytest
import torch

from tieredemb.storage.key_filter import KeyFilter


def test_a_pair_added_is_always_held_and_others_rarely() -> None:
    gen = torch.Generator().manual_seed(0)
    f = KeyFilter(16 * 20_000, torch.device("cpu"))
    held = set()
    for _ in range(4):  # in batches, with repeats inside and across them
        keys = torch.randint(-(2**62), 2**62, (5_000,), generator=gen)
        keys[:100] = keys[100:200]
        tables = torch.randint(0, 3, (5_000,), generator=gen)
        f.add(keys, tables)
        held |= set(zip(keys.tolist(), tables.tolist()))
    pairs = list(held)
    keys = torch.tensor([k for k, _ in pairs])
    tables = torch.tensor([t for _, t in pairs])
    assert bool(f.may_hold(keys, tables).all())  # no false "absent"
    # fresh keys (the same keys in other tables, new ones): at 16 bits a pair about
    # (1 - e^(-8/16))^8 = 0.057% may hold (with 3 hashes it would be 0.5%)
    n = len(pairs)
    expected = (1 - math.exp(-f.hashes * n / f.bits)) ** f.hashes
    others = [(k, (t + d) % 3) for k, t in pairs for d in (1, 2) if (k, (t + d) % 3) not in held]
    other = f.may_hold(torch.tensor([k for k, _ in others]), torch.tensor([t for _, t in others]))
    new = torch.randint(-(2**62), 2**62, (400_000,), generator=gen)
    fresh = torch.cat([other, f.may_hold(new, torch.zeros_like(new))])
    rate = float(fresh.float().mean())
    assert 0.0002 < rate < 0.001 and expected / 2 < rate < expected * 2, (rate, expected)


def test_an_empty_filter_holds_nothing_and_bad_sizes_are_refused() -> None:
    f = KeyFilter(1000, torch.device("cpu"))
    assert not bool(f.may_hold(torch.arange(100), torch.zeros(100, dtype=torch.int64)).any())
    f.add(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert f.nbytes() == 16 * 8 and f.bits == 16 * 63
    with pytest.raises(ValueError, match="bits >= 1"):
        KeyFilter(0, torch.device("cpu"))
