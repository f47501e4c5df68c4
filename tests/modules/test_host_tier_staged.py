"""A device cache over a host tier, its prefetch staged: the staged read counts the misses the tier
lacks (and its store may hold). Where it counts none the insertion runs on the device and asks the
store nothing (``HostTierGroup.from_below``, a host read, is not called); else it runs on the host,
the store read before anything changes. A pair that leaves the tier between the count and the
insertion is still read from the store; a failed read of the store changes nothing; rows whose
write-down failed go down before any newer row does.

References: the same tables trained in HBM alone (hbm_direct), on the same batches."""

from __future__ import annotations

import pytest
import torch

import tieredemb as te
from tests.modules.test_tiered_modes import DictStore, FlakyStore, sorted_rows, zipf_batches
from tieredemb.storage.host_tier import HostTierGroup
from tieredemb.storage.tiers.cache import CacheTier

DIM, ROWS = 4, 300
OPT = te.optim.Adam(lr=0.05)


def _tables(groups: int) -> list[te.TableConfig]:
    """Features a and b: of one table (one cache group), or of two tables of two dims (two groups,
    staged together: one dedup, one read)."""
    init = te.init.Normal(0.0, 0.1)
    if groups == 1:
        return [te.TableConfig("t", DIM, ["a", "b"], num_embeddings=ROWS, initializer=init)]
    return [te.TableConfig("t", DIM, ["a"], num_embeddings=ROWS, initializer=init),
            te.TableConfig("u", 2 * DIM, ["b"], num_embeddings=ROWS)]


def _pair(groups: int, cache_rows: int, host_rows: int):
    """A collection caching ``cache_rows`` rows a table over a host tier of ``host_rows`` over a
    dict store, and the same tables in HBM."""
    dim = groups * DIM  # (the wider table's)
    row_bytes = (dim + OPT.state_width(dim)) * 4
    storage = te.StorageConfig(hbm_budget=cache_rows * row_bytes * groups, backing=DictStore(),
                               bucket_width=4, segment_rows=8, host_budget=host_rows * row_bytes * groups)
    cached = te.EmbeddingBagCollection(_tables(groups), optimizer=OPT, storage=storage, seed=3)
    plain = te.EmbeddingBagCollection(_tables(groups), optimizer=OPT, seed=3)
    assert cached.storage_mode == "cache" and len(cached.tiers) == groups
    return cached, plain


def _batch(keys: list[int]) -> te.KeyedJaggedTensor:
    """Each key once in feature a and once in b."""
    return te.KeyedJaggedTensor(["a", "b"], torch.tensor(keys * 2), lengths=torch.ones(len(keys) * 2,
                                                                                        dtype=torch.int64))


def _spied(monkeypatch) -> dict[str, int]:
    """Calls of the cache's insertion (``_place``), of its insertion on the device and of the host
    tier's read of the store (``from_below``), counted."""
    calls = {"_place": 0, "_insert_on_device": 0, "from_below": 0}
    for cls, name in ((CacheTier, "_place"), (CacheTier, "_insert_on_device"), (HostTierGroup, "from_below")):
        method = getattr(cls, name)

        def spy(self, *args, _method=method, _name=name):
            calls[_name] += 1
            return _method(self, *args)

        monkeypatch.setattr(cls, name, spy)
    return calls


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("pipelined", [False, True])
def test_misses_the_host_tier_holds_ask_the_store_nothing(groups, pipelined, monkeypatch) -> None:
    """A tier that holds every row the cache evicts: no insertion asks the store (ids seen for the
    first time are not in it either), and the run is hbm_direct's."""
    calls = _spied(monkeypatch)
    cached, plain = _pair(groups, cache_rows=128, host_rows=ROWS)
    batches = zipf_batches(60, 6, seed=groups)
    grads = torch.Generator().manual_seed(1)
    for m in (cached, plain):
        m.prefetch(batches[0]) if pipelined else None
    for i, kjt in enumerate(batches):
        outs = []
        for m in (cached, plain):
            out = m(kjt).values()
            if pipelined and i + 1 < len(batches):
                m.prefetch_deferred(batches[i + 1])
            outs.append(out)
        g = torch.randn(outs[0].shape, generator=grads)
        for out in outs:
            (out * g).sum().backward()
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    stats = [cached.stats()[t.name] for t in _tables(groups)]
    assert all(s.misses > 0 and s.host_tier.hits > 0 for s in stats), stats  # the tier served misses
    assert calls["_insert_on_device"] > len(batches) // 2, calls  # (a conflict miss inserts on the host)
    # only the insertions on the host (a batch sharing a scratch pad of the one before) asked it
    assert calls["from_below"] <= calls["_place"] - calls["_insert_on_device"], calls
    cached.close()


def test_a_row_that_leaves_the_tier_after_the_count_is_read_from_the_store(monkeypatch) -> None:
    """Batch i+1's prefetch is staged while key 1's row is in the tier (so the staged read counts no
    miss the tier lacks); then, before batch i+1's insertion, rows of other keys fill the tier past
    its capacity and key 1's row, the oldest, leaves it for the store. The insertion must not trust
    the count (the tier erased rows since): it runs on the host and reads key 1 from the store, its
    trained row, not a fresh initial row."""
    calls = _spied(monkeypatch)
    cached, plain = _pair(1, cache_rows=4, host_rows=12)
    steps = [_batch(keys) for keys in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16],
                                                [1])]
    tier = cached.tiers[0].below
    for m in (cached, plain):
        for kjt in steps[:3]:
            m(kjt).values().sum().backward()
    one = (torch.tensor([1]), torch.tensor([0]))
    got = {}
    for m in (cached, plain):
        out = m(steps[3]).values()
        m.prefetch_deferred(steps[4])  # staged: its read counts key 1 as held by the tier
        if m is cached:
            assert bool(tier.rows.held(*one)), "key 1 should be in the host tier at the staged read"
            asked = dict(calls)
            others = torch.arange(100, 104)
            tier.set(others, torch.zeros_like(others), torch.zeros(4, tier.width))
            tier.flush()  # over its capacity: the oldest rows (keys 1 to 4) leave for the store
            assert not bool(tier.rows.held(*one))
        out.sum().backward()
        got[m is plain] = m(steps[4]).values().detach()
    torch.testing.assert_close(got[False], got[True], rtol=1e-5, atol=1e-6)
    # batch i+1's insertion ran on the host, which asked the store for key 1
    assert calls["from_below"] > asked["from_below"], calls
    assert calls["_insert_on_device"] == asked["_insert_on_device"], calls
    cached.close()


def test_a_failed_read_of_the_store_changes_nothing() -> None:
    """Key 1's row is in the store alone (the tier dropped it, the cache evicted it); the store's
    reads fail while batch [1] is prefetched: the prefetch raises ``BackendError`` chained to the
    store's error, and once the store answers again the same batch trains as hbm_direct (key 1's
    row is the trained one, not an initial row an insertion left in the cache)."""
    store, sgd = FlakyStore(), te.optim.SGD(lr=0.3)
    storage = te.StorageConfig(hbm_budget=4 * DIM * 4, backing=store, bucket_width=4, segment_rows=8,
                               host_budget=8 * DIM * 4)
    cached = te.EmbeddingBagCollection(_tables(1), optimizer=sgd, storage=storage, seed=3)
    plain = te.EmbeddingBagCollection(_tables(1), optimizer=sgd, seed=3)
    steps = [_batch(keys) for keys in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16])]
    for kjt in steps + steps[2:]:  # the tier keeps the newest 8 (its rows used again last)
        for m in (cached, plain):
            m(kjt).values().sum().backward()
    cached.flush()
    tier = cached.tiers[0].below
    one = (torch.tensor([1]), torch.tensor([0]))
    assert not bool(tier.rows.held(*one)), "key 1 should be in the store alone"
    store.failing["get"] = True
    with pytest.raises(te.storage.BackendError) as info:
        cached(_batch([1]))
    assert isinstance(info.value.__cause__, ConnectionError), info.value
    store.failing["get"] = False
    for kjt in [_batch([1])] + steps:
        got, want = (m(kjt).values() for m in (cached, plain))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for out in (got, want):
            out.sum().backward()
    cached.close()


def test_rows_a_failed_write_down_kept_are_not_overwritten_by_newer_ones(monkeypatch) -> None:
    """The cache's flush into the host tier fails (the tier's ``set`` raises, twice): the cache keeps
    those rows, copies of rows it still holds, to write them down at the next call that needs the
    store. Training goes on and evicts some of them, newer, into the tier. Those kept copies must
    be written before any newer row goes down (an insertion on the device writes victims straight
    into the tier, so it waits while rows are kept): else the next flush puts the old copies back
    over the trained rows."""
    calls = _spied(monkeypatch)
    cached, plain = _pair(1, cache_rows=4, host_rows=ROWS)
    batches = zipf_batches(16, 6, seed=5)
    for m in (cached, plain):
        for kjt in batches[:6]:
            m(kjt).values().sum().backward()
    tier = cached.tiers[0].below
    set_rows, refusals = tier.set, [2]  # the write-down and flush's retry of it

    def refuse(*args, **kwargs):
        refusals[0] -= 1
        if refusals[0] == 0:
            tier.set = set_rows
        raise te.storage.BackendError("injected: the tier refuses the write-down")

    tier.set = refuse
    with pytest.raises(te.storage.BackendError):
        cached.flush()
    on_device = calls["_insert_on_device"]
    for m in (cached, plain):
        for kjt in batches[6:]:
            m(kjt).values().sum().backward()
    cached.flush()
    want, got = (sorted_rows(m.export("t")) for m in (plain, cached))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    # the first insertion after the failure ran on the host (it wrote the kept rows), later ones on
    # the device again
    assert calls["_insert_on_device"] > on_device, calls
    cached.close()
