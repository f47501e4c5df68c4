"""Table and storage configuration: the objects a user builds before a collection exists."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tieredemb.keys import RESERVED_KEY as RESERVED_KEY  # re-exported: tieredemb.config.RESERVED_KEY

if TYPE_CHECKING:
    from tieredemb.init import Initializer
    from tieredemb.storage.backends import BackendSpec


_POOLINGS = ("sum", "mean")
_EVICTIONS = ("lru", "lfu")
ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The storage types a table's rows may have (``TableConfig.dtype``)."""


@dataclass(frozen=True)
class FrequencyAdmission:
    """Store a key only once it has occurred ``threshold`` times (counted over batches).

    Before the batch that brings its count to ``threshold`` a key's forward value is its initial row
    and it receives no update; from that batch on it is stored and trained like any other key.
    """

    threshold: int

    def __post_init__(self) -> None:
        if not isinstance(self.threshold, int) or self.threshold < 1:
            raise ValueError(f"FrequencyAdmission threshold must be an int >= 1, got {self.threshold!r}")


@dataclass
class TableConfig:
    """One embedding table.

    Args:
        name: unique table name; it also seeds the table's initial rows.
        embedding_dim: row width D.
        feature_names: the KeyedJaggedTensor features looked up in this table (several may share it).
        num_embeddings: ``None``: any int64 id except ``te.RESERVED_KEY``; ``n``: ids in ``[0, n)``.
        pooling: ``"sum"`` or ``"mean"`` (EmbeddingBagCollection only).
        initializer: initial rows, a pure function of (seed, table name, key).
        eviction: ``"lru"`` (last step used) or ``"lfu"`` (use count): the score of every cache and
            bounded table.
        admission: ``FrequencyAdmission(k)`` or ``None`` (every key is stored on first use).
        max_capacity: rows the table may hold in all tiers (per shard); ``None``: unbounded. A bounded
            table holds ``max_capacity`` rounded up to whole index buckets.
        init_capacity: rows allocated up front (per shard), so that a table trained from scratch does
            not grow on its way there: its index sized to hold them under its load limit and, where
            the rows live on the device (``hbm_direct``, ``hybrid``), the rows themselves. An
            unbounded table still grows past it by doubling. ``None``: start small (at most 65,536
            rows of index) and grow as keys arrive. At most ``max_capacity`` and ``num_embeddings``.

    Example::

        te.TableConfig(name="user", embedding_dim=64, feature_names=["user_id"])
    """

    name: str
    embedding_dim: int
    feature_names: list[str]
    num_embeddings: int | None = None
    pooling: str = "sum"
    initializer: Initializer | None = None
    eviction: str = "lru"
    admission: FrequencyAdmission | None = None
    max_capacity: int | None = None
    init_capacity: int | None = None
    dtype: torch.dtype = torch.float32
    stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableConfig name must be a non-empty string, got {self.name!r}")
        where = f"table {self.name!r}"
        if not isinstance(self.embedding_dim, int) or self.embedding_dim < 1:
            raise ValueError(f"{where}: embedding_dim must be an int >= 1, got {self.embedding_dim!r}")
        if isinstance(self.feature_names, str):
            raise TypeError(f"{where}: feature_names must be a list of names, not a string")
        self.feature_names = list(self.feature_names)
        if not self.feature_names or not all(isinstance(f, str) and f for f in self.feature_names):
            raise ValueError(f"{where}: feature_names must be non-empty strings")
        if len(set(self.feature_names)) != len(self.feature_names):
            raise ValueError(f"{where}: feature_names has duplicates: {self.feature_names}")
        if self.num_embeddings is not None and (
            not isinstance(self.num_embeddings, int) or self.num_embeddings < 1
        ):
            raise ValueError(f"{where}: num_embeddings must be None or an int >= 1")
        if self.pooling not in _POOLINGS:
            raise ValueError(f"{where}: pooling must be one of {_POOLINGS}, got {self.pooling!r}")
        if self.eviction not in _EVICTIONS:
            raise ValueError(f"{where}: eviction must be one of {_EVICTIONS}, got {self.eviction!r}")
        self._check_capacities(where)
        self._check_policies(where)
        if not isinstance(self.dtype, torch.dtype) or self.dtype not in ROW_DTYPES:
            raise ValueError(f"{where}: dtype must be torch.float32, torch.bfloat16 or torch.float16, "
                             f"got {self.dtype!r}")
        if not isinstance(self.stochastic_rounding, bool):
            raise TypeError(f"{where}: stochastic_rounding must be True or False, "
                            f"got {self.stochastic_rounding!r}")

    def _check_capacities(self, where: str) -> None:
        if self.max_capacity is not None and (
            not isinstance(self.max_capacity, int) or self.max_capacity < 1
        ):
            raise ValueError(f"{where}: max_capacity must be None or an int >= 1")
        if self.init_capacity is not None:
            if not isinstance(self.init_capacity, int) or self.init_capacity < 1:
                raise ValueError(f"{where}: init_capacity must be None or an int >= 1")
            if self.bounded_rows is not None and self.init_capacity > self.bounded_rows:
                bound = "max_capacity" if self.max_capacity is not None else "num_embeddings"
                raise ValueError(f"{where}: init_capacity {self.init_capacity} is more than its "
                                 f"{bound} {self.bounded_rows}")

    def _check_policies(self, where: str) -> None:
        from tieredemb.init import Initializer, Uniform

        if self.admission is not None and not isinstance(self.admission, FrequencyAdmission):
            raise TypeError(f"{where}: admission must be a FrequencyAdmission or None")
        if self.initializer is None:
            self.initializer = Uniform(-0.01, 0.01)
        if not isinstance(self.initializer, Initializer):
            raise TypeError(f"{where}: initializer must be one of te.init's initializers")

    @property
    def bounded_rows(self) -> int | None:
        """Rows this table can hold at most: ``max_capacity``, else ``num_embeddings``, else None."""
        if self.max_capacity is not None:
            return self.max_capacity
        return self.num_embeddings

    @property
    def rounds_stochastically(self) -> bool:
        """Whether updated rows are rounded stochastically (a 16-bit table with the option on)."""
        return self.stochastic_rounding and self.dtype != torch.float32


@dataclass
class HotRows:
    """Keep the hottest rows of each table on every rank of a sharded collection
    (``StorageConfig(replicate_hot=...)``; ``docs/distributed.md``).

    A row-wise sharded table sends every id to the rank that owns its key, so the keys of a skewed
    (Zipf) batch pile up on their owners. A replicated row is served by every rank from its own copy:
    its lookups never leave the rank, and its gradients are summed over the ranks by one all-reduce
    a step, after which every rank applies the same update to its copy. The result is the same as
    without replication (up to summation order).

    Args:
        per_table: how many of each table's most used keys to replicate, counted over the first
            ``window`` training batches of all ranks; the set is chosen once at the next batch and
            then stays fixed. Needs ``hbm_direct`` or ``hybrid`` storage.
        keys: table name -> the keys to replicate (int64, any length), fixed from the start; instead
            of ``per_table``. Every rank must give the same keys.
        window: training batches counted before ``per_table``'s choice.

    Example::

        te.StorageConfig(replicate_hot=te.HotRows(per_table=1000, window=50))
    """

    per_table: int | None = None
    keys: dict[str, torch.Tensor] | None = None
    window: int = 100

    def __post_init__(self) -> None:
        if (self.per_table is None) == (self.keys is None):
            raise ValueError("replicate_hot: give exactly one of per_table and keys")
        n = self.per_table
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"replicate_hot.per_table must be an int >= 1, got {self.per_table!r}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"replicate_hot.window must be an int >= 1, got {self.window!r}")
        if self.keys is not None:
            if not isinstance(self.keys, dict):
                raise TypeError("replicate_hot.keys must be a dict: table name -> keys")
            self.keys = {name: _hot_keys(name, keys) for name, keys in self.keys.items()}


def _hot_keys(name: object, keys: object) -> torch.Tensor:
    """int64 (n,) CPU: the distinct keys of ``replicate_hot.keys[name]``, checked."""
    if not isinstance(name, str):
        raise TypeError(f"replicate_hot.keys: table names must be strings, got {name!r}")
    keys = torch.as_tensor(keys)
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"replicate_hot.keys[{name!r}]: keys must be a 1-D int64 tensor, got "
                         f"{keys.dtype} of shape {tuple(keys.shape)}")
    if bool((keys == RESERVED_KEY).any()):
        raise ValueError(f"replicate_hot.keys[{name!r}]: the reserved key te.RESERVED_KEY is not a key")
    return torch.unique(keys.cpu())


def _default_backing() -> BackendSpec:
    from tieredemb.storage.backends import HostMemory

    return HostMemory()


@dataclass
class StorageConfig:
    """Where a collection keeps its rows (weights and optimizer state together).

    Args:
        hbm_budget: bytes (int or a string like ``"8GiB"``) for rows on the compute device; ``None``:
            everything on the device.
        caching: over budget, ``True`` gives ``"cache"`` mode, ``False`` gives ``"hybrid"``.
        backing: the tier below the device cache: ``te.storage.HostMemory()``,
            ``te.storage.RocksDB(path)`` or ``te.storage.Redis(url)``.
        bucket_width: slots per index bucket (eviction of bounded tables is exact within a bucket).
        segment_rows: rows per row-store segment (the unit of growth, placement and stashing).
        replicate_hot: ``te.HotRows(...)``: sharded collections only, keep the hottest rows on
            every rank (``docs/distributed.md``); ``None``: each row lives on its owner alone.
        host_budget: bytes (int or a string like ``"4GiB"``) of host memory for a write-back tier of
            rows between the device cache and a RocksDB or Redis ``backing`` (``cache`` mode only),
            shared by the tables like ``hbm_budget``; ``None``: none, every miss of the device cache
            goes to the store. ``docs/backends.md`` says what it holds and what a crash loses.
    """

    hbm_budget: int | str | None = None
    caching: bool = True
    backing: BackendSpec = field(default_factory=_default_backing)
    bucket_width: int = 32
    segment_rows: int = 65536
    replicate_hot: HotRows | None = None
    host_budget: int | str | None = None

    def __post_init__(self) -> None:
        self.hbm_budget = parse_bytes(self.hbm_budget)
        if self.replicate_hot is not None and not isinstance(self.replicate_hot, HotRows):
            raise TypeError("replicate_hot must be a te.HotRows or None, "
                            f"got {type(self.replicate_hot).__name__}")
        self.host_budget = _check_host_budget(self)
        if not isinstance(self.bucket_width, int) or self.bucket_width < 1:
            raise ValueError(f"bucket_width must be an int >= 1, got {self.bucket_width!r}")
        if not isinstance(self.segment_rows, int) or self.segment_rows < 1:
            raise ValueError(f"segment_rows must be an int >= 1, got {self.segment_rows!r}")


def _check_host_budget(storage: StorageConfig) -> int | None:
    """``host_budget`` in bytes; refused where there is no store for it to stand in front of."""
    try:
        budget = parse_bytes(storage.host_budget)
    except (TypeError, ValueError) as e:
        raise type(e)(f"host_budget: {e}") from None
    if budget is None:
        return None
    if budget == 0:
        raise ValueError("host_budget must be > 0 bytes (None: no host tier)")
    if storage.hbm_budget is None or not storage.caching:
        raise ValueError("host_budget needs cache mode (an hbm_budget and caching=True): in hbm_direct "
                         "and hybrid modes no backing store sits below the device")
    from tieredemb.storage.backends import HostMemory

    if isinstance(storage.backing, HostMemory):
        raise ValueError("host_budget puts a host-memory tier in front of RocksDB or Redis; the "
                         "backing te.storage.HostMemory() already keeps every row in host memory")
    return budget


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str | None) -> int | None:
    """``"8GiB"`` -> 8589934592; ints pass through; None stays None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"a byte size must be an int or a string like '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a byte size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        raise ValueError(f"cannot read byte size {value!r}: use an int or e.g. '512MiB', '8GiB'")
    raise TypeError(f"a byte size must be an int or a string like '8GiB', got {type(value).__name__}")
