"""MovieLens ratings as click data, from RecBole's atomic files (``<name>.inter``, ``.user``, ``.item``).

RecBole ships MovieLens-100k in its package (``recbole/dataset_example/ml-100k/``: 100,000 ratings of
1,682 movies by 943 users, 1997-1998); ``pip install --no-deps recbole`` installs the files without
RecBole's own dependencies, and ``find_movielens()`` finds them without importing RecBole.

The files are tab-separated with a header of ``name:type`` columns. A rating of 4 or 5 (out of 5) is a
click: the movies a user liked, 55% of the ratings. The latest ``eval_fraction`` of the ratings by
timestamp is the eval set (the future, as in a deployed recommender); the rest, shuffled once from the
seed, trains, served in batches that cycle through it.

Features (each an index into its vocabulary, so every table is bounded: ``Feature.num_embeddings``):

    user_id, item_id             the raw tokens, numbered in their file's order
    age                          bucket: under 18, 18-24, 25-34, 35-44, 45-49, 50-55, 56 and over
    gender, occupation           the user's
    release_year                 the movie's (0: unknown)
    genre                        a bag: the movie's genres (1 to 6 of 19), mean-pooled

and 2 dense features: the user's age / 50 and (release year - 1990) / 10 (0 when unknown).

The baseline it reports is each movie's click rate in the training part (the global rate for a movie
not seen there), scored on the eval part.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tieredemb.data import Baseline, ClickBatch, Feature, cyclic_batch, mean_rate_scores

logger = logging.getLogger(__name__)

AGE_BUCKETS = (18, 25, 35, 45, 50, 56)  # bucket b holds ages in [AGE_BUCKETS[b-1], AGE_BUCKETS[b])
_GENRE_COLUMNS = ("class", "genre")  # RecBole's ml-100k calls the genres "class", its ml-1m "genre"
CLICK_RATING = 4.0


def find_movielens() -> Path | None:
    """The ml-100k directory of the installed ``recbole`` package (not imported), or None."""
    try:
        spec = importlib.util.find_spec("recbole")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "dataset_example" / "ml-100k"
        if path.is_dir():
            return path
    return None


@dataclass
class AtomicFile:
    """The columns of one atomic file: ``columns[name]`` is the list of that column's strings."""

    path: Path
    columns: dict[str, list[str]]
    first_line: int = 2  # the line of the first row (after the header)

    def where(self, row: int) -> str:
        return f"{self.path}, line {row + self.first_line}"


def read_atomic(path: Path, wanted: tuple[str, ...]) -> AtomicFile:
    """The ``wanted`` columns of a RecBole atomic file (tab-separated, a ``name:type`` header; a column
    given as alternatives ``"a|b"`` takes the first present). Raises ``ValueError`` naming the file
    and line of a missing column or a row with another number of fields."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte offset {e.start})") from None
    lines = text.splitlines()
    if not lines:
        raise ValueError(f"{path}: empty file (expected a header of name:type columns)")
    header = [field.split(":")[0] for field in lines[0].split("\t")]
    index = {}
    for name in wanted:
        found = [alt for alt in name.split("|") if alt in header]
        if not found:
            raise ValueError(f"{path}, line 1: no column {name!r} in the header {header}")
        index[name] = header.index(found[0])
    columns: dict[str, list[str]] = {name: [] for name in wanted}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(header):
            raise ValueError(f"{path}, line {number}: {len(fields)} tab-separated fields, the header "
                             f"has {len(header)}")
        for name, i in index.items():
            columns[name].append(fields[i])
    return AtomicFile(path, columns)


def _numbers(file: AtomicFile, column: str, kind: type = float) -> list:
    """A column's values as numbers, or a ``ValueError`` naming the file and line of one that is not."""
    out = []
    for row, text in enumerate(file.columns[column]):
        try:
            out.append(kind(text))
        except ValueError:
            raise ValueError(f"{file.where(row)}: {column} {text!r} is not a number") from None
    return out


def _vocabulary(values: list[str]) -> dict[str, int]:
    """Each distinct value numbered from 0, in order of first appearance."""
    return {v: i for i, v in enumerate(dict.fromkeys(values))}


def _age_bucket(age: int) -> int:
    return sum(age >= edge for edge in AGE_BUCKETS)


class MovieLensTables:
    """The users and items of a MovieLens directory, as feature ids and dense values per row."""

    def __init__(self, users: AtomicFile, items: AtomicFile) -> None:
        cols = users.columns
        self.users = _vocabulary(cols["user_id"])
        if len(self.users) != len(cols["user_id"]):
            raise ValueError(f"{users.path}: a user_id appears twice")
        ages = _numbers(users, "age", int)
        genders, occupations = _vocabulary(cols["gender"]), _vocabulary(cols["occupation"])
        self.user_ids = torch.tensor([[_age_bucket(a) for a in ages],
                                      [genders[g] for g in cols["gender"]],
                                      [occupations[o] for o in cols["occupation"]]])  # (3, n_users)
        self.user_dense = torch.tensor(ages, dtype=torch.float32) / 50
        cols = items.columns
        self.items = _vocabulary(cols["item_id"])
        if len(self.items) != len(cols["item_id"]):
            raise ValueError(f"{items.path}: an item_id appears twice")
        years = [int(y) if y.strip().isdigit() else 0 for y in cols["release_year"]]
        first = min((y for y in years if y), default=0)
        self.item_year = torch.tensor([y - first + 1 if y else 0 for y in years])  # 0: unknown
        self.item_dense = torch.tensor([(y - 1990) / 10 if y else 0.0 for y in years])
        genre_lists = [g.split() for g in cols["class|genre"]]
        genres = _vocabulary([g for gs in genre_lists for g in gs])
        width = max(1, max(map(len, genre_lists), default=1))
        self.item_genres = torch.zeros(len(years), width, dtype=torch.int64)  # (n_items, K), padded
        self.item_genre_count = torch.tensor([len(gs) for gs in genre_lists])
        for i, gs in enumerate(genre_lists):
            self.item_genres[i, : len(gs)] = torch.tensor([genres[g] for g in gs], dtype=torch.int64)
        self.features = [
            Feature("user_id", len(self.users)),
            Feature("item_id", len(self.items)),
            Feature("age", len(AGE_BUCKETS) + 1),
            Feature("gender", max(1, len(genders))),
            Feature("occupation", max(1, len(occupations))),
            Feature("release_year", int(self.item_year.max().item()) + 1 if years else 1),
            Feature("genre", max(1, len(genres)), bag=True),
        ]

    def rows(self, user: torch.Tensor, item: torch.Tensor, labels: torch.Tensor) -> ClickBatch:
        """The samples of (user, item) index pairs (int64 (n,)) with their labels (float32 (n,))."""
        ids = torch.stack([user, item, *self.user_ids[:, user], self.item_year[item]])  # (6, n)
        dense = torch.stack([self.user_dense[user], self.item_dense[item]], dim=1)  # (n, 2)
        return ClickBatch(dense=dense, ids=ids, labels=labels,
                          bags=self.item_genres[item].unsqueeze(0),  # (1, n, K)
                          bag_lengths=self.item_genre_count[item].unsqueeze(0))  # (1, n)


def _indices(file: AtomicFile, column: str, vocabulary: dict[str, int], other: Path) -> torch.Tensor:
    out = []
    for row, token in enumerate(file.columns[column]):
        if token not in vocabulary:
            raise ValueError(f"{file.where(row)}: {column} {token!r} is not in {other.name}")
        out.append(vocabulary[token])
    return torch.tensor(out, dtype=torch.int64)


def atomic_files(directory: str | Path) -> tuple[Path, Path, Path]:
    """The ``.inter``, ``.user`` and ``.item`` files of a RecBole dataset directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: no such directory (expected MovieLens's "
                                "<name>.inter, .user and .item files in it)")
    inters = sorted(directory.glob("*.inter"))
    if len(inters) != 1:
        raise ValueError(f"{directory}: expected one <name>.inter file, found {len(inters)}")
    paths = tuple(inters[0].with_suffix(ext) for ext in (".inter", ".user", ".item"))
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (MovieLens needs the .inter, .user and "
                                    ".item files)")
    return paths


class MovieLensClicks:
    """MovieLens ratings as a click source: the earlier ratings train, the latest evaluate.

    Args:
        directory: the dataset's directory (RecBole's atomic files); ``find_movielens()`` gives
            the one in the installed ``recbole`` package.
        eval_fraction: share of the ratings, the latest by timestamp, held out for eval.
        seed: shuffles the training ratings.
        max_rows: read at most this many ratings (the first in the file).
    """

    num_dense = 2

    def __init__(self, directory: str | Path, eval_fraction: float = 0.1, seed: int = 0,
                 max_rows: int | None = None) -> None:
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        inter_path, user_path, item_path = atomic_files(directory)
        tables = MovieLensTables(read_atomic(user_path, ("user_id", "age", "gender", "occupation")),
                                 read_atomic(item_path, ("item_id", "release_year", "class|genre")))
        self.features = tables.features
        inter = read_atomic(inter_path, ("user_id", "item_id", "rating", "timestamp"))
        if max_rows is not None:
            inter.columns = {k: v[:max_rows] for k, v in inter.columns.items()}
        labels = (torch.tensor(_numbers(inter, "rating")) >= CLICK_RATING).float()
        times = torch.tensor(_numbers(inter, "timestamp"), dtype=torch.float64)
        rows = tables.rows(_indices(inter, "user_id", tables.users, user_path),
                           _indices(inter, "item_id", tables.items, item_path), labels)
        n = len(rows)
        n_eval = round(n * eval_fraction)
        if n_eval < 1 or n - n_eval < 1:
            raise ValueError(f"{inter_path}: {n} ratings are too few to hold out {eval_fraction:.0%} "
                             "for eval and train on the rest")
        rows = rows.take(torch.sort(times, stable=True)[1])  # oldest first
        shuffle = torch.randperm(n - n_eval, generator=torch.Generator().manual_seed(seed))
        self._train = rows.slice(0, n - n_eval).take(shuffle)
        self._eval = rows.slice(n - n_eval, n)
        logger.info("read %s: %d training ratings, %d eval ratings (the latest)", inter_path,
                    n - n_eval, n_eval)

    def train_batch(self, index: int, batch_size: int) -> ClickBatch:
        """Samples ``[index * batch_size, (index + 1) * batch_size)`` of the shuffled training
        ratings, cyclically."""
        return cyclic_batch(self._train, index, batch_size)

    def eval_set(self) -> ClickBatch:
        """The latest ratings."""
        return self._eval

    def baseline(self) -> Baseline:
        """Each movie's click rate in the training part (the overall rate for a movie not seen)."""
        item = 1  # the item_id row of ``ids``
        scores = mean_rate_scores(self._train.ids[item], self._train.labels, self._eval.ids[item])
        return Baseline("per-movie click rate of the training ratings", scores)


__all__ = ["AGE_BUCKETS", "MovieLensClicks", "atomic_files", "find_movielens", "read_atomic"]
