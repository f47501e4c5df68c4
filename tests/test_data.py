"""Click data sources: the synthetic generator and the Criteo TSV reader."""

from __future__ import annotations

import math

import pytest
import torch

import tieredemb as te
from tests.conftest import TINY_RATINGS, write_movielens
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


# ------------------------------------------------------------------------- the fast Criteo reader
def _varied_lines(n: int, seed: int = 0) -> list[str]:
    """Criteo lines with every shape the reader takes: empty fields, negative and large counts,
    ids of 1 to 16 hex digits in both cases, ids that wrap to negative int64."""
    g = torch.Generator().manual_seed(seed)

    def r(k: int) -> int:
        return int(torch.randint(0, k, (1,), generator=g))

    lines = []
    for _ in range(n):
        ints = ["", "-1", "0", str(r(100)), str(r(10**9)), "123456789012345678"]
        ids = ["", "0", f"{r(2**31):08x}", "ffffffffffffffff", f"{r(2**31):X}", "7fffffffffffffff", "a"]
        lines.append(_line(str(r(2)), [ints[r(len(ints))] for _ in range(13)],
                           [ids[r(len(ids))] for _ in range(26)]))
    return lines


def test_fast_criteo_reader_equals_the_line_parser(tmp_path, monkeypatch) -> None:
    """The vectorized reader gives the reference parser's rows, over several blocks (a small block
    size), with a blank line, a sign and a CRLF line sending their blocks to the reference."""
    from tieredemb.data import criteo

    lines = _varied_lines(300)
    lines[100] = "\n"
    lines[150] = lines[150].replace("\t", "\t+", 1)  # "+5": int() reads it, the fast path does not
    lines[200] = lines[200].rstrip("\n") + "\r\n"
    path = tmp_path / "varied.tsv"
    path.write_text("".join(lines))
    monkeypatch.setattr(criteo, "_BLOCK_BYTES", 4096)  # ~25 lines a block
    want = parse_lines(lines)
    for workers in (1, 3):
        got = read_criteo_tsv(path, workers=workers)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.labels, want.labels)
        assert torch.equal(got.dense, want.dense)
    assert torch.equal(read_criteo_tsv(path, max_rows=77).ids, want.ids[:, :77])
    assert criteo._parse_block(torch.tensor(bytearray("".join(lines[:50]), "ascii")).numpy()) is not None


@pytest.mark.parametrize("bad, message", [
    ("0\t1\t2\n", "line 60: expected 40 tab-separated fields, got 3"),
    (_line("2", ["1"] * 13, ["a"] * 26), "line 60: label must be 0 or 1"),
    (_line("1", ["x"] * 13, ["a"] * 26), "line 60: dense features must be integers"),
    (_line("1", ["1"] * 13, ["g"] * 26), "line 60: invalid literal"),
    (_line("1", ["1"] * 13, ["8000000000000000"] * 26), "line 60: .*RESERVED_KEY"),
    (_line("1", ["1"] * 13, ["a" * 17] * 26), "line 60: .*longer than 16 hex digits"),
    (_line("1", ["1"] * 13, ["a"] * 26).replace("a", "\u00e9", 1), "line 60: not ASCII"),
])
def test_fast_criteo_reader_names_the_file_and_line(tmp_path, monkeypatch, bad, message) -> None:
    from tieredemb.data import criteo

    monkeypatch.setattr(criteo, "_BLOCK_BYTES", 2048)  # the bad line is in a later block
    lines = _varied_lines(80)
    lines[59] = bad
    path = tmp_path / "bad.tsv"
    path.write_text("".join(lines), encoding="utf-8")
    with pytest.raises(ValueError, match=f"^{path}: Criteo {message}"):
        read_criteo_tsv(path)


# ------------------------------------------------------------------------------------ MovieLens
def test_movielens_reader_features_labels_and_time_split(tmp_path) -> None:
    from tieredemb.data.movielens import MovieLensClicks

    write_movielens(tmp_path / "tiny", TINY_RATINGS)
    src = MovieLensClicks(tmp_path / "tiny", eval_fraction=0.3, seed=1)
    names = [f.name for f in src.features]
    assert names == ["user_id", "item_id", "age", "gender", "occupation", "release_year", "genre"]
    assert [f.num_embeddings for f in src.features] == [3, 4, 7, 2, 2, 67, 7]
    assert [f.bag for f in src.features] == [False] * 6 + [True]
    ev = src.eval_set()  # the latest 3 ratings by timestamp: 700, 800, 900
    assert ev.labels.tolist() == [1.0, 0.0, 1.0]  # rating >= 4 is a click
    assert ev.ids[0].tolist() == [1, 2, 0] and ev.ids[1].tolist() == [3, 0, 2]  # users, items
    assert ev.ids[2].tolist() == [5, 0, 1]  # age buckets of 53, 17, 24
    assert ev.ids[5].tolist() == [1, 66, 0]  # release years 1930, 1995 and unknown
    kjt = ev.kjt(names)
    assert kjt["genre"].lengths().tolist() == [2, 3, 1]  # Drama Romance / Animation Children's Comedy
    assert kjt["genre"].values().tolist() == [5, 6, 0, 1, 2, 4]
    assert torch.allclose(ev.dense[:, 0], torch.tensor([53.0, 17.0, 24.0]) / 50)
    train = src.train_batch(0, 7)  # every training rating once, shuffled
    assert sorted(train.ids[0].tolist()) == [0, 0, 0, 1, 1, 2, 2]
    assert torch.equal(src.train_batch(1, 7).ids, src.train_batch(1, 7).ids)
    baseline = src.baseline()  # items 4, 1, 3: rates 0/1, 2/2, 1/1 in the training part
    assert baseline.scores.tolist() == [0.0, 1.0, 1.0]


_INTER_HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"


def _inter(text: str):
    return lambda d: (d / "tiny.inter").write_text(_INTER_HEADER + text)


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "tiny.item").unlink(), "tiny.item: no such file"),
    (lambda d: (d / "tiny.inter").write_text("user_id:token\titem_id:token\n1\t2\n"),
     "tiny.inter, line 1: no column 'rating'"),
    (_inter("10\t1\t5\t100\n10\t1\n"), "tiny.inter, line 3: 2 tab-separated"),
    (_inter("10\t1\tgood\t100\n"), "tiny.inter, line 2: rating 'good'"),
    (_inter("10\t1\t5\t100\n99\t1\t5\t100\n"), "tiny.inter, line 3: user_id '99' is not in tiny.user"),
    (_inter("10\t1\t5\t100\n"), "1 ratings are too few"),
])
def test_movielens_reader_names_the_problem(tmp_path, edit, message) -> None:
    from tieredemb.data.movielens import MovieLensClicks

    write_movielens(tmp_path / "tiny", TINY_RATINGS)
    edit(tmp_path / "tiny")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        MovieLensClicks(tmp_path / "tiny")


def test_movielens_100k_from_recbole(movielens_dir) -> None:
    from tieredemb.data.movielens import MovieLensClicks

    src = MovieLensClicks(movielens_dir)
    assert [f.num_embeddings for f in src.features][:2] == [943, 1682]
    ev = src.eval_set()
    assert len(ev) == 10_000 and 0.5 < ev.labels.mean() < 0.6
    assert 0.70 < roc_auc(src.baseline().scores, ev.labels) < 0.71  # per-movie click rate: 0.706
