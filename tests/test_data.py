"""Click data sources: the synthetic generator and the Criteo TSV reader."""

from __future__ import annotations

import math

import pytest
import torch

import tieredemb as te
from tieredemb.data import NUM_DENSE, NUM_SPARSE, SPARSE_FEATURES, cat_batches
from tieredemb.data.criteo import (
    CriteoClicks,
    missing_id,
    parse_hex_id,
    parse_lines,
    read_criteo_tsv,
)
from tieredemb.data.synthetic import SyntheticClicks, SyntheticConfig
from tieredemb.train import roc_auc

SMALL = SyntheticConfig(seed=3, min_vocab=100, max_vocab=2_000, eval_size=4_096)


@pytest.fixture(scope="module")
def synthetic() -> SyntheticClicks:
    return SyntheticClicks(SMALL)


def test_synthetic_batch_shapes(synthetic: SyntheticClicks) -> None:
    b = synthetic.train_batch(0, 64)
    assert b.dense.shape == (64, NUM_DENSE) and b.dense.dtype == torch.float32
    assert b.ids.shape == (NUM_SPARSE, 64) and b.ids.dtype == torch.int64
    assert b.labels.shape == (64,) and set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert b.true_logits is not None and b.true_logits.shape == (64,)
    kjt = b.kjt()
    assert kjt.keys() == SPARSE_FEATURES
    assert kjt.values().shape == (NUM_SPARSE * 64,) and kjt.lengths().sum() == NUM_SPARSE * 64
    assert torch.equal(kjt["c1"].values(), b.ids[1])


def test_synthetic_is_a_pure_function_of_seed_and_index(synthetic: SyntheticClicks) -> None:
    again = SyntheticClicks(SMALL)
    for index in (5, 0, 5):  # order of generation does not matter
        a, b = synthetic.train_batch(index, 32), again.train_batch(index, 32)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.dense, b.dense)
        assert torch.equal(a.labels, b.labels)
    assert not torch.equal(synthetic.train_batch(1, 32).ids, synthetic.train_batch(2, 32).ids)
    other = SyntheticClicks(SyntheticConfig(seed=4, min_vocab=100, max_vocab=2_000))
    assert not torch.equal(other.train_batch(0, 32).ids, synthetic.train_batch(0, 32).ids)


def test_synthetic_ids_are_raw_64_bit(synthetic: SyntheticClicks) -> None:
    ids = synthetic.train_batch(0, 4_096).ids
    assert not (ids == te.RESERVED_KEY).any()
    assert ids.abs().float().median() > 2**40  # scrambled, not small contiguous ints
    assert (ids < 0).any() and (ids > 0).any()
    # Zipf: a feature's most common id covers a good share of samples, and many ids occur.
    _, counts = ids[0].unique(return_counts=True)
    assert counts.max() > 4_096 * 0.02 and counts.numel() > 50


def test_synthetic_eval_set_is_fixed_and_learnable(synthetic: SyntheticClicks) -> None:
    ev = synthetic.eval_set()
    assert len(ev) == SMALL.eval_size
    assert synthetic.eval_set() is ev
    assert 0.1 < ev.labels.mean() < 0.6
    auc_best = roc_auc(ev.true_logits, ev.labels)
    assert 0.7 < auc_best < 0.95
    # The eval stream is not a training batch.
    assert not torch.equal(ev.ids[:, :64], synthetic.train_batch(0, 64).ids)


def test_cat_and_slice_round_trip(synthetic: SyntheticClicks) -> None:
    b = synthetic.train_batch(0, 10)
    joined = cat_batches([b.slice(0, 4), b.slice(4, 10)])
    assert torch.equal(joined.ids, b.ids) and torch.equal(joined.true_logits, b.true_logits)


def _line(label: str, ints: list[str], ids: list[str]) -> str:
    return "\t".join([label, *ints, *ids]) + "\n"


def test_parse_hex_id() -> None:
    assert parse_hex_id("68fd1e64", 0) == 0x68FD1E64
    assert parse_hex_id("ffffffffffffffff", 0) == -1  # unsigned 64-bit wraps to int64
    assert parse_hex_id("", 3) == missing_id(3) == -4
    with pytest.raises(ValueError, match="RESERVED_KEY"):
        parse_hex_id("8000000000000000", 0)
    with pytest.raises(ValueError, match="16 hex digits"):
        parse_hex_id("1" * 17, 0)


def test_criteo_reader_parses_empty_fields(tmp_path) -> None:
    ints = ["1", "", "-3", "10", "", "0", "2", "", "", "7", "", "", "100"]
    ids = ["68fd1e64", "", "80e26c9b"] + [""] * 20 + ["fb936136", "7b4723c4", ""]
    path = tmp_path / "day_0.tsv"
    path.write_text(_line("1", ints, ids) + "\n" + _line("0", [""] * 13, [""] * 26))
    batch = read_criteo_tsv(path)
    assert len(batch) == 2 and batch.true_logits is None
    assert batch.labels.tolist() == [1.0, 0.0]
    expected = [math.log1p(max(int(x), 0)) if x else 0.0 for x in ints]
    assert torch.allclose(batch.dense[0], torch.tensor(expected))
    assert torch.equal(batch.dense[1], torch.zeros(NUM_DENSE))
    assert batch.ids[0, 0] == 0x68FD1E64 and batch.ids[2, 0] == 0x80E26C9B
    assert batch.ids[1, 0] == missing_id(1) and batch.ids[25, 0] == missing_id(25)
    assert batch.ids[:, 1].tolist() == [missing_id(f) for f in range(NUM_SPARSE)]
    assert not (batch.ids == te.RESERVED_KEY).any()


def test_criteo_reader_rejects_malformed_lines() -> None:
    good = _line("0", ["1"] * 13, ["a"] * 26)
    with pytest.raises(ValueError, match="line 2: expected 40"):
        parse_lines([good, "0\t1\t2\n"])
    with pytest.raises(ValueError, match="label"):
        parse_lines([_line("", ["1"] * 13, ["a"] * 26)])
    with pytest.raises(ValueError, match="line 1"):
        parse_lines([_line("1", ["x"] * 13, ["a"] * 26)])


def test_criteo_source_splits_tail_for_eval(tmp_path) -> None:
    lines = [_line(str(i % 2), [str(i)] * 13, [f"{i:x}"] * 26) for i in range(20)]
    path = tmp_path / "small.tsv"
    path.write_text("".join(lines))
    src = CriteoClicks(path, eval_fraction=0.25)
    assert len(src.eval_set()) == 5
    assert src.eval_set().ids[0].tolist() == [15, 16, 17, 18, 19]
    b = src.train_batch(3, 6)  # rows 18..23 of 15 training rows, cyclic
    assert b.ids[0].tolist() == [3, 4, 5, 6, 7, 8]
    assert len(CriteoClicks(path, max_rows=10).eval_set()) == 1
