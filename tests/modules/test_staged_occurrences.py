"""A shard owner's received pairs carry how many ids each stands for (``occurrences``): resolved
through the staged prefetch (``stage_prefetch(occurrences=...)``, one host read) they leave the same
rows, scores and lookups as through ``prefetch`` (a read for the dedup, one for the probe)."""

from __future__ import annotations

import pytest
import torch

import tieredemb as te

DIM = 4


def _tier(storage):
    tables = [te.TableConfig(name, DIM, [f], eviction="lfu") for name, f in (("t", "a"), ("u", "b"))]
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.SGD(lr=0.1), storage=storage, seed=5)
    assert len(ebc.tiers) == 1
    return ebc, ebc.tiers[0]


@pytest.mark.parametrize("mode", ["hbm_direct", "cache"])
def test_staged_occurrences_score_as_the_unstaged_prefetch(mode) -> None:
    storage = None if mode == "hbm_direct" else te.StorageConfig(hbm_budget=2 * 24 * DIM * 2 * 4,
                                                                bucket_width=4, segment_rows=8)
    (plain_ebc, plain), (staged_ebc, staged) = _tier(storage), _tier(storage)
    assert plain_ebc.storage_mode == mode and staged.can_stage()
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 9):
        # received pairs: repeats across senders, each with its own count of ids
        keys = torch.randint(0, 60, (40,), generator=gen)
        tables = torch.randint(0, 2, (40,), generator=gen)
        occurrences = torch.randint(1, 6, (40,), generator=gen)
        ids_per_table = [int(occurrences[tables == t].sum()) for t in range(2)]
        a = plain.prefetch(keys, tables, ids_per_table, step, True, occurrences=occurrences)
        staged.before_staging()
        guard = torch.zeros(1, dtype=torch.int64)
        pending, reads = staged.stage_prefetch(keys, tables, step, guard, occurrences=occurrences)
        b = staged.finish_prefetch(pending, torch.cat([r.reshape(-1) for r in reads]).tolist(), ids_per_table)
        for pf, tier in ((a, plain), (b, staged)):
            assert pf.sorted_ids is not None
            assert torch.equal(pf.sorted_ids.entries.sum(), torch.tensor(40))  # ids, not occurrences
            tier.release(pf)
    for table in ("t", "u"):
        want, got = plain_ebc.export(table), staged_ebc.export(table)
        order_w, order_g = torch.argsort(want.keys), torch.argsort(got.keys)
        assert torch.equal(want.keys[order_w], got.keys[order_g])
        assert torch.equal(want.scores[order_w], got.scores[order_g])
        assert torch.equal(want.weights[order_w], got.weights[order_g])
        assert plain_ebc.stats()[table].lookups == staged_ebc.stats()[table].lookups > 0
