"""The keys a read ahead hands each table group (``BatchKeys``), against the batch read by hand."""

from __future__ import annotations

import pytest
import torch

import tieredemb as te
from tieredemb.keys import RESERVED_KEY
from tieredemb.modules.read_ahead import BatchKeys

# three tables in two groups; table "b" reads two features
TABLES = [te.TableConfig("a", 4, ["fa"]), te.TableConfig("b", 8, ["fb1", "fb2"]),
          te.TableConfig("c", 4, ["fc"])]
WHERE = {"a": (0, 0), "b": (1, 0), "c": (0, 1)}


def by_hand(features: list[str], values: list[int], lengths: list[int]) -> dict[int, list[tuple[int, int]]]:
    """Each group's (key, position of its table) pairs, walking the jagged batch value by value."""
    of_feature = {f: WHERE[t.name] for t in TABLES for f in t.feature_names}
    per_feature = len(lengths) // len(features)
    out: dict[int, list[tuple[int, int]]] = {}
    at = 0
    for i, n in enumerate(lengths):
        g, pos = of_feature[features[i // per_feature]]
        out.setdefault(g, []).extend((v, pos) for v in values[at : at + n])
        at += n
    return out


def pairs(keys: torch.Tensor, tables: torch.Tensor) -> list[tuple[int, int]]:
    return sorted((k, t) for k, t in zip(keys.tolist(), tables.tolist()) if k != RESERVED_KEY)


# where the pairs are wanted: None (where the batch is), or a CUDA device for a CPU batch (copied)
WANTED = [pytest.param(None, id="where-it-is"),
          pytest.param(torch.device("cuda"), id="cuda",
                       marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", WANTED)
@pytest.mark.parametrize("order", [["fa", "fb1", "fb2", "fc"], ["fc", "fb2", "fa", "fb1"]])
def test_each_group_gets_its_tables_keys(order, device) -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 4, (len(order) * 5,), generator=gen, dtype=torch.int32)
    values = torch.randint(0, 1000, (int(lengths.sum()),), generator=gen)
    kjt = te.KeyedJaggedTensor(order, values, lengths=lengths)
    got = BatchKeys(TABLES, WHERE).by_group(kjt, device)
    want = by_hand(order, values.tolist(), lengths.tolist())
    assert set(got) == set(want) == {0, 1}
    for g, (keys, tables) in got.items():
        assert keys.device.type == tables.device.type == (device or values.device).type
        assert keys.dtype == tables.dtype == torch.int64
        assert pairs(keys, tables) == sorted(want[g])


def test_one_group_takes_the_values_as_they_are() -> None:
    tables = [te.TableConfig("a", 4, ["fa"]), te.TableConfig("c", 4, ["fc"])]
    kjt = te.KeyedJaggedTensor(["fc", "fa"], torch.tensor([5, 6, 7]), lengths=torch.tensor([2, 0, 1, 0]))
    (keys, positions), = BatchKeys(tables, {"a": (0, 0), "c": (0, 1)}).by_group(kjt).values()
    assert keys.tolist() == [5, 6, 7] and positions.tolist() == [1, 1, 0]


def test_a_batch_whose_lengths_do_not_sum_to_its_values_is_refused() -> None:
    kjt = te.KeyedJaggedTensor(["fa", "fb1", "fb2", "fc"], torch.tensor([1, 2]),
                               lengths=torch.tensor([1, 1, 1, 0]))
    with pytest.raises(ValueError, match="lengths sum to 3, values has 2"):
        BatchKeys(TABLES, WHERE).by_group(kjt)


def test_only_the_wanted_groups_pairs_are_made_and_every_batch_is_checked() -> None:
    order = ["fa", "fb1", "fb2", "fc"]
    kjt = te.KeyedJaggedTensor(order, torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2, 1, 1, 1]))
    every = BatchKeys(TABLES, WHERE).by_group(kjt)
    (g, (keys, tables)), = BatchKeys(TABLES, WHERE).by_group(kjt, wanted={1}).items()
    assert g == 1 and pairs(keys, tables) == pairs(*every[1]) == [(3, 0), (4, 0)]
    assert BatchKeys(TABLES, WHERE).by_group(kjt, wanted=set()) == {}
    bad = te.KeyedJaggedTensor(order, torch.tensor([1, 2]), lengths=torch.tensor([1, 1, 1, 0]))
    with pytest.raises(ValueError, match="lengths sum to 3, values has 2"):
        BatchKeys(TABLES, WHERE).by_group(bad, wanted=set())
