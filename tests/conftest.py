"""Shared test helpers: batch builders, an independent dense reference trainer, and comparisons.

Everything here is written against the public API (DESIGN.md section 1) and the formulas of DESIGN.md
section 2; nothing imports the library's internals. The reference trainer is plain torch:
``F.embedding_bag``/``F.embedding`` for the forward, autograd for exact gradients, and the optimizer
formulas written out below, applied to the rows touched in the step.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

# Triton reads TRITON_INTERPRET when it is first imported: set it before anything can import triton,
# so that kernels="triton" runs the interpreter on CPU tensors when there is no GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import tieredemb as te  # noqa: E402

RTOL = 1e-5
ATOL = 1e-6

# Raw int64 ids an unbounded table must take: zero, negatives, the int64 extremes (but RESERVED_KEY).
INT64_MAX = 2**63 - 1
RAW_KEYS = [0, 1, -1, 7, 123456789012345, -987654321098765, INT64_MAX, te.RESERVED_KEY + 1, 2**40]


# --------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One batch as plain Python, the source both the library's KJT and the reference read.

    bags: feature -> B bags of raw ids (every feature has the same B).
    weights: feature -> B bags of per-id weights (same shape as ``bags``), or None (unweighted).
    key_order: order of the features in the KJT (defaults to the order of ``bags``).
    """

    bags: dict[str, list[list[int]]]
    weights: dict[str, list[list[float]]] | None = None
    key_order: list[str] | None = None

    @property
    def keys(self) -> list[str]:
        return list(self.key_order) if self.key_order is not None else list(self.bags)

    @property
    def batch_size(self) -> int:
        return len(next(iter(self.bags.values()))) if self.bags else 0

    def flat(self) -> tuple[list[int], list[int], list[float] | None]:
        """Feature-major (values, lengths, weights) in ``keys`` order."""
        values: list[int] = []
        lengths: list[int] = []
        weights: list[float] | None = [] if self.weights is not None else None
        for f in self.keys:
            for b, bag in enumerate(self.bags[f]):
                values.extend(bag)
                lengths.append(len(bag))
                if weights is not None:
                    weights.extend(self.weights[f][b])
        return values, lengths, weights

    def kjt(self, lengths_dtype: torch.dtype = torch.int64) -> te.KeyedJaggedTensor:
        values, lengths, weights = self.flat()
        return make_kjt(self.keys, values, lengths, weights, lengths_dtype)

    def torchrec_kjt(self):  # -> torchrec.KeyedJaggedTensor
        import torchrec

        values, lengths, weights = self.flat()
        return torchrec.KeyedJaggedTensor(
            keys=self.keys,
            values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int32),
            weights=None if weights is None else torch.tensor(weights, dtype=torch.float32),
        )


def make_kjt(
    keys: Sequence[str],
    values: Sequence[int] | torch.Tensor,
    lengths: Sequence[int] | torch.Tensor,
    weights: Sequence[float] | torch.Tensor | None = None,
    lengths_dtype: torch.dtype = torch.int64,
) -> te.KeyedJaggedTensor:
    """A te.KeyedJaggedTensor from Python lists (tensors pass through untouched, for bad-input tests)."""

    def tensor(x, dtype):
        return x if isinstance(x, torch.Tensor) else torch.tensor(list(x), dtype=dtype)

    return te.KeyedJaggedTensor(
        keys=list(keys),
        values=tensor(values, torch.int64),
        lengths=tensor(lengths, lengths_dtype),
        weights=None if weights is None else tensor(weights, torch.float32),
    )


def random_batch(
    gen: torch.Generator,
    features_keys: dict[str, Sequence[int]],
    batch_size: int,
    max_bag: int = 3,
    weighted: bool = False,
) -> Batch:
    """A random batch: per feature, ``batch_size`` bags of 0..max_bag ids drawn from that feature's
    key pool (small pools give duplicates within bags and across features of a shared table)."""
    bags: dict[str, list[list[int]]] = {}
    weights: dict[str, list[list[float]]] | None = {} if weighted else None
    for f, pool in features_keys.items():
        bags[f] = []
        if weights is not None:
            weights[f] = []
        for _ in range(batch_size):
            n = int(torch.randint(0, max_bag + 1, (1,), generator=gen))
            picks = torch.randint(0, len(pool), (n,), generator=gen).tolist()
            bags[f].append([pool[i] for i in picks])
            if weights is not None:
                weights[f].append((0.5 + 1.5 * torch.rand(n, generator=gen)).tolist())
    return Batch(bags, weights)


# --------------------------------------------------------------------------------------------------
# Collections
# --------------------------------------------------------------------------------------------------


def feature_order(tables: Sequence[te.TableConfig]) -> list[str]:
    """The contract's output order: tables in order, features in each table's feature_names order."""
    return [f for t in tables for f in t.feature_names]


def feature_dims(tables: Sequence[te.TableConfig]) -> dict[str, int]:
    return {f: t.embedding_dim for t in tables for f in t.feature_names}


def make_optimizer(name: str) -> te.optim.EmbeddingOptimizer:
    """The four fused optimizers at learning rates that move rows visibly in a few steps."""
    return {
        "sgd": lambda: te.optim.SGD(lr=0.1),
        "adagrad": lambda: te.optim.Adagrad(lr=0.1),
        "rowwise_adagrad": lambda: te.optim.RowWiseAdagrad(lr=0.1),
        "adam": lambda: te.optim.Adam(lr=0.01),
    }[name]()


OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]


def initial_rows(
    table: te.TableConfig, keys: Sequence[int], seed: int = 0, module: type | None = None, **kwargs
) -> torch.Tensor:
    """float32 (n, D): the library's initial rows of ``keys`` in ``table``.

    Read from a fresh one-table probe collection after a train step with a zero gradient (SGD), so
    the rows are inserted but unchanged. test_init.py checks separately that these rows are a pure function of
    (seed, table name, key), which is what makes the probe a valid source for the reference.
    """
    module = module or te.EmbeddingBagCollection
    keys = list(keys)
    if not keys:
        return torch.zeros(0, table.embedding_dim)
    probe_table = dataclasses.replace(table, admission=None, max_capacity=None)
    probe = module([probe_table], optimizer=te.optim.SGD(lr=1.0), seed=seed, **kwargs)
    feature = table.feature_names[0]
    bags = {f: [[]] for f in table.feature_names}
    bags[feature] = [keys]
    out = probe(Batch(bags).kjt())
    (loss_of(out) * 0).backward()
    rows, found = probe.read(table.name, torch.tensor(keys, dtype=torch.int64))
    assert bool(found.all()), "probe collection did not store the keys it was trained on"
    return rows.detach().clone()


def probed_init(
    tables: Sequence[te.TableConfig], keys: dict[str, Sequence[int]], seed: int = 0, **kwargs
) -> Callable[[te.TableConfig, list[int]], torch.Tensor]:
    """The reference's ``init``: initial rows of every table's possible keys, probed once up front."""
    cache: dict[str, dict[int, torch.Tensor]] = {}
    for t in tables:
        pool = sorted(set(keys.get(t.name, ())))
        cache[t.name] = dict(zip(pool, initial_rows(t, pool, seed, **kwargs)))

    def init(table: te.TableConfig, ks: list[int]) -> torch.Tensor:
        return torch.stack([cache[table.name][k] for k in ks])

    return init


def loss_of(out) -> torch.Tensor:
    """A scalar whose backward reaches every output (EBC: KeyedTensor, EC: dict of JaggedTensor)."""
    if isinstance(out, dict):
        return sum((jt.values().sum() for jt in out.values()), torch.zeros(()))
    return out.values().sum()


def weighted_loss(out, upstream) -> torch.Tensor:
    """sum(out * upstream): its gradient w.r.t. the output is exactly ``upstream``."""
    if isinstance(out, dict):
        return sum(((out[f].values() * upstream[f]).sum() for f in out), torch.zeros(()))
    return (out.values() * upstream).sum()


def random_upstream(gen: torch.Generator, batch: Batch, tables, pooled: bool):
    """A fixed random dL/d(output) for one step: (B, sum dims) pooled, else feature -> (n_f, D)."""
    dims = feature_dims(tables)
    if pooled:
        total = sum(dims[f] for f in feature_order(tables))
        return torch.randn(batch.batch_size, total, generator=gen)
    return {
        f: torch.randn(sum(len(b) for b in batch.bags[f]), dims[f], generator=gen)
        for f in feature_order(tables)
    }


# --------------------------------------------------------------------------------------------------
# The reference (DESIGN.md section 2)
# --------------------------------------------------------------------------------------------------


@dataclass
class _RefTable:
    config: te.TableConfig
    state_width: int
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # key -> float32 (D,)
    state: dict[int, torch.Tensor] = field(default_factory=dict)  # key -> float32 (S,)
    counts: dict[int, int] = field(default_factory=dict)  # admission: occurrences so far


def _state_width(optimizer: te.optim.EmbeddingOptimizer, dim: int) -> int:
    if isinstance(optimizer, te.optim.SGD):
        return 0
    if isinstance(optimizer, te.optim.Adagrad):
        return dim
    if isinstance(optimizer, te.optim.RowWiseAdagrad):
        return 1
    if isinstance(optimizer, te.optim.Adam):
        return 2 * dim
    raise TypeError(f"no reference for {optimizer!r}")


def reference_update(
    optimizer: te.optim.EmbeddingOptimizer,
    w: torch.Tensor,
    s: torch.Tensor,
    g: torch.Tensor,
    t: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DESIGN section 2's update of touched rows. w, g: (n, D); s: (n, S); t: step (1 on the first)."""
    lr = optimizer.lr
    if isinstance(optimizer, te.optim.SGD):
        return w - lr * g, s
    if isinstance(optimizer, te.optim.Adagrad):
        s = s + g * g
        return w - lr * g / (s.sqrt() + optimizer.eps), s
    if isinstance(optimizer, te.optim.RowWiseAdagrad):
        s = s + (g * g).mean(dim=1, keepdim=True)
        return w - lr * g / (s.sqrt() + optimizer.eps), s
    if isinstance(optimizer, te.optim.Adam):
        b1, b2 = optimizer.betas
        d = g.shape[1]
        m, v = s[:, :d], s[:, d:]
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        step_size = lr * (1 - b2**t) ** 0.5 / (1 - b1**t)
        return w - step_size * m / (v.sqrt() + optimizer.eps), torch.cat([m, v], dim=1)
    raise TypeError(f"no reference for {optimizer!r}")


class DenseReference:
    """The reference trainer of DESIGN section 2, keyed by raw ids.

    A dict of rows per table stands in for the dense table (raw int64 keys cannot index a tensor);
    each step gathers the batch's rows into a small dense leaf tensor, runs ``F.embedding_bag``
    (pooled) or ``F.embedding`` (sequence), takes the exact gradient by autograd and applies
    ``reference_update`` to the rows touched in the step. Admission follows section 2: occurrences are
    counted before the forward; a key not yet admitted reads its initial row and gets no update.

    Args:
        tables: the collection's table configs.
        optimizer: the collection's optimizer config (only its hyperparameters are read).
        pooled: True for EmbeddingBagCollection, False for EmbeddingCollection.
        init: (table config, keys) -> float32 (n, D) initial rows of keys never written.
    """

    def __init__(
        self,
        tables: Sequence[te.TableConfig],
        optimizer: te.optim.EmbeddingOptimizer,
        pooled: bool,
        init: Callable[[te.TableConfig, list[int]], torch.Tensor],
    ) -> None:
        self.configs = list(tables)
        self.optimizer = optimizer
        self.pooled = pooled
        self.init = init
        self.tables = {t.name: _RefTable(t, _state_width(optimizer, t.embedding_dim)) for t in tables}
        self.table_of = {f: t.name for t in tables for f in t.feature_names}
        self.step = 0

    def write(self, table: str, keys: Sequence[int], weights: torch.Tensor) -> None:
        ref = self.tables[table]
        for k, row in zip(keys, weights):
            ref.rows[int(k)] = row.clone().float()
            ref.state[int(k)] = torch.zeros(ref.state_width)

    def forward(self, batch: Batch, train: bool = True):
        """The output without any update (eval semantics when ``train`` is False)."""
        out, _ = self._forward(batch, stored_only=not train)
        return out.detach() if isinstance(out, torch.Tensor) else {f: o.detach() for f, o in out.items()}

    def train_step(self, batch: Batch, upstream) -> object:
        """One step: count admissions, forward, backward of sum(out * upstream), update."""
        self.step += 1
        self._count_occurrences(batch)
        out, leaves = self._forward(batch, stored_only=False)
        loss = weighted_loss_plain(out, upstream)
        if loss.requires_grad:  # False only when no table has a single id in the batch
            loss.backward()
        for table, (keys, leaf) in leaves.items():
            ref = self.tables[table]
            stored = [i for i, k in enumerate(keys) if self._admitted(ref, k)]
            for k in (keys[i] for i in stored):  # first touch of an admitted key stores it
                if k not in ref.rows:
                    self.write(table, [k], self.init(ref.config, [k]))
            if not stored:
                continue
            idx = torch.tensor(stored)
            w = torch.stack([ref.rows[keys[i]] for i in stored])
            s = torch.stack([ref.state[keys[i]] for i in stored])
            w, s = reference_update(self.optimizer, w, s, leaf.grad[idx], self.step)
            for j, i in enumerate(stored):
                ref.rows[keys[i]], ref.state[keys[i]] = w[j], s[j]
        return out.detach() if isinstance(out, torch.Tensor) else {f: o.detach() for f, o in out.items()}

    def export(self, table: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys int64 (n,), weights (n, D), state (n, S)) sorted by key."""
        ref = self.tables[table]
        keys = sorted(ref.rows)
        d = ref.config.embedding_dim
        if not keys:
            return torch.zeros(0, dtype=torch.int64), torch.zeros(0, d), torch.zeros(0, ref.state_width)
        return (
            torch.tensor(keys, dtype=torch.int64),
            torch.stack([ref.rows[k] for k in keys]),
            torch.stack([ref.state[k] for k in keys]),
        )

    # -- internals ---------------------------------------------------------------------------------

    def _admitted(self, ref: _RefTable, key: int) -> bool:
        adm = ref.config.admission
        return adm is None or key in ref.rows or ref.counts.get(key, 0) >= adm.threshold

    def _count_occurrences(self, batch: Batch) -> None:
        for f, bags in batch.bags.items():
            ref = self.tables[self.table_of[f]]
            for bag in bags:
                for k in bag:
                    ref.counts[k] = ref.counts.get(k, 0) + 1

    def _forward(self, batch: Batch, stored_only: bool):
        """Gather each table's batch rows into a leaf (U, D), look every feature up in it."""
        leaves: dict[str, tuple[list[int], torch.Tensor]] = {}
        for t in self.configs:
            ref = self.tables[t.name]
            keys = sorted({k for f in t.feature_names for bag in batch.bags[f] for k in bag})
            rows = []
            for k in keys:
                if k in ref.rows:
                    rows.append(ref.rows[k])
                elif stored_only:  # eval: keys not stored read as zeros
                    rows.append(torch.zeros(t.embedding_dim))
                else:  # not stored (yet): the initial row
                    rows.append(self.init(t, [k])[0])
            leaf = torch.stack(rows) if rows else torch.zeros(0, t.embedding_dim)
            leaves[t.name] = (keys, leaf.clone().requires_grad_(True))
        outs = {}
        for t in self.configs:
            keys, leaf = leaves[t.name]
            pos = {k: i for i, k in enumerate(keys)}
            for f in t.feature_names:
                outs[f] = self._lookup(batch, f, t, leaf, pos)
        order = feature_order(self.configs)
        if self.pooled:
            return torch.cat([outs[f] for f in order], dim=1), leaves
        return {f: outs[f] for f in order}, leaves

    def _lookup(self, batch: Batch, f: str, t: te.TableConfig, leaf, pos) -> torch.Tensor:
        bags = batch.bags[f]
        idx = torch.tensor([pos[k] for bag in bags for k in bag], dtype=torch.int64)
        if not self.pooled:
            return F.embedding(idx, leaf) if idx.numel() else torch.zeros(0, t.embedding_dim)
        offsets = torch.tensor([0] + [len(b) for b in bags[:-1]], dtype=torch.int64).cumsum(0)
        offsets = offsets[: len(bags)]
        if idx.numel() == 0:  # every bag empty: pooled zeros (still a function of leaf for autograd)
            return leaf.sum() * 0 + torch.zeros(len(bags), t.embedding_dim)
        if batch.weights is None:
            return F.embedding_bag(idx, leaf, offsets, mode=t.pooling)
        # Weights multiply before pooling; mean divides the weighted sum by the bag's id count.
        w = [x for bag in batch.weights[f] for x in bag]
        if t.pooling == "mean":
            w = [x / len(bag) for bag in batch.weights[f] for x in bag]
        psw = torch.tensor(w, dtype=torch.float32)
        return F.embedding_bag(idx, leaf, offsets, mode="sum", per_sample_weights=psw)


def weighted_loss_plain(out, upstream) -> torch.Tensor:
    """sum(out * upstream) for the reference's plain tensors (pooled) or dict of tensors."""
    if isinstance(out, dict):
        return sum(((out[f] * upstream[f]).sum() for f in out), torch.zeros(()))
    return (out * upstream).sum()


# --------------------------------------------------------------------------------------------------
# Comparisons
# --------------------------------------------------------------------------------------------------


def output_tensors(out) -> dict[str, torch.Tensor]:
    """feature -> output tensor, for a KeyedTensor, a dict of JaggedTensor, or the reference's."""

    def plain(o) -> torch.Tensor:
        return o if isinstance(o, torch.Tensor) else o.values()

    if isinstance(out, dict):
        return {f: plain(o) for f, o in out.items()}
    return {"pooled": plain(out)}


def assert_outputs_close(got, want, msg: str = "") -> None:
    got_t, want_t = output_tensors(got), output_tensors(want)
    assert list(got_t) == list(want_t), f"{msg}: features {list(got_t)} != {list(want_t)}"
    for f in want_t:
        torch.testing.assert_close(
            got_t[f].detach(), want_t[f], rtol=RTOL, atol=ATOL, msg=lambda m, f=f: f"{msg} [{f}]: {m}"
        )


def sorted_export(collection, table: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys, weights, optimizer_state, scores) of ``collection.export(table)`` sorted by key."""
    rows = collection.export(table)
    order = torch.argsort(rows.keys)
    return (
        rows.keys[order],
        rows.weights[order].detach(),
        rows.optimizer_state[order].detach(),
        rows.scores[order],
    )


def assert_tables_match_reference(collection, reference: DenseReference, msg: str = "") -> None:
    """Every table's stored keys, rows and optimizer state equal the reference's; read agrees."""
    for name in reference.tables:
        keys, w, s, _ = sorted_export(collection, name)
        want_keys, want_w, want_s = reference.export(name)
        assert keys.tolist() == want_keys.tolist(), f"{msg} table {name!r}: stored keys differ"
        torch.testing.assert_close(
            w, want_w, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{msg} table {n!r} weights: {m}"
        )
        torch.testing.assert_close(
            s, want_s, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{msg} table {n!r} optimizer state: {m}"
        )
        got_w, found = collection.read(name, want_keys)
        assert bool(found.all()), f"{msg} table {name!r}: read() misses stored keys"
        torch.testing.assert_close(got_w.detach(), want_w, rtol=RTOL, atol=ATOL)


def snapshot(collection, tables: Sequence[te.TableConfig]) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every table's sorted export, cloned: compare with ``assert_snapshot_equal`` later."""
    return {t.name: tuple(x.clone() for x in sorted_export(collection, t.name)) for t in tables}


def assert_snapshot_equal(before, after) -> None:
    assert before.keys() == after.keys()
    for name in before:
        for what, x, y in zip(("keys", "weights", "optimizer_state", "scores"), before[name], after[name]):
            assert torch.equal(x, y), f"table {name!r}: {what} changed"


# --------------------------------------------------------------------------------------------------
# MovieLens: a tiny dataset in RecBole's format, and MovieLens-100k from the recbole package
# --------------------------------------------------------------------------------------------------


def write_movielens(directory, ratings: list[tuple[str, str, float, int]]) -> None:
    """A small dataset in RecBole's atomic format: 3 users, 4 items, ``ratings`` (user, item,
    rating, timestamp)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiny.user").write_text(
        "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
        "10\t24\tM\twriter\t11111\n20\t53\tF\tother\t22222\n30\t17\tF\twriter\t33333\n")
    (directory / "tiny.item").write_text(
        "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
        "1\tToy Story\t1995\tAnimation Children's Comedy\n2\tGoldenEye\t1995\tAction\n"
        "3\tFour Rooms\t\tThriller\n4\tOld One\t1930\tDrama Romance\n")
    (directory / "tiny.inter").write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
        + "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ratings))


TINY_RATINGS = [("10", "1", 5, 100), ("20", "2", 1, 50), ("30", "3", 4, 300), ("10", "4", 2, 200),
                ("20", "1", 4, 400), ("30", "2", 3, 600), ("10", "2", 5, 500), ("20", "4", 5, 700),
                ("30", "1", 2, 800), ("10", "3", 4, 900)]


@pytest.fixture(scope="session")
def movielens_dir():
    """The ml-100k files of the installed ``recbole`` package. Without it the tests skip on a laptop
    and FAIL in CI (env ``CI`` set): CI installs it with ``pip install --no-deps recbole``."""
    from tieredemb.data.movielens import find_movielens

    path = find_movielens()
    if path is None:
        message = "MovieLens-100k needs recbole's files: pip install --no-deps recbole"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path
