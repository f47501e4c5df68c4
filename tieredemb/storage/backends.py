"""Backing-store specifications: what a user names in ``StorageConfig(backing=...)``.

A spec is plain configuration; the collection calls ``spec.open(table, width, device, dtype)`` once per
table and gets that table's ``Backend`` (copy-based ``get``/``set``/``delete``/``scan``/``flush``/
``close``, see ``tieredemb.storage.backend``). In ``hbm_direct`` mode the backing store is never
opened. ``docs/backends.md`` describes each store's layout, knobs and faults.

``existing`` (RocksDB, Redis): what to do when the store already holds rows of the table being
opened. ``"error"`` (default) refuses with ``ExistingRowsError``, so a new run never trains on a
stale run's rows by accident; ``"reuse"`` keeps them (their width must match); ``"clear"`` deletes
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from tieredemb.storage.backend import Backend, GroupStore
from tieredemb.storage.urls import redact

_EXISTING = ("error", "reuse", "clear")
_TUNINGS = ("default", "point_lookup")  # tieredemb.storage.rocksdb.TUNINGS (not imported: rocksdict)


class BackendSpec:
    """Base class of backing-store specs."""

    def open(self, table: str, width: int, device: torch.device,
             dtype: torch.dtype = torch.float32) -> Backend:
        """The backend holding ``table``'s rows of ``width`` values in ``dtype`` (the table's
        storage type) for a collection on ``device``."""
        raise NotImplementedError

    def open_group(self, tables: list[str], width: int, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> GroupStore:
        """The store of a table group (tables of one row width and dtype): by default each table's
        ``open`` (given ``dtype`` only for 16-bit rows: a spec written for float32 rows still opens)."""
        extra = () if dtype == torch.float32 else (dtype,)
        return GroupStore([self.open(t, width, device, *extra) for t in tables])


def _pinned(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _check_int(owner: str, name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner} {name} must be an int >= {low}, got {value!r}")


def _check_existing(owner: str, existing: str) -> None:
    if existing not in _EXISTING:
        raise ValueError(f"{owner} existing must be one of {_EXISTING}, got {existing!r}")


# The backends are imported inside ``open``: a collection that never opens a store (hbm_direct) does
# not load rocksdict or redis-py.


def _with_cache(backend: Backend, cache_rows: int, device: torch.device | str) -> Backend:
    if cache_rows == 0:
        return backend
    from tieredemb.storage.host import CachedBackend

    return CachedBackend(backend, cache_rows, pinned=_pinned(device))


@dataclass(frozen=True)
class HostMemory(BackendSpec):
    """Rows in host memory (pinned when the device is CUDA): a host ``KeyIndex`` over host segments.

    Args:
        segment_rows: rows per host segment (the unit of growth).
        reserve_rows: rows to allocate up front, per table (0: grow as rows arrive). On a CUDA device
            the segments are page-locked, and page-locking runs at ~1.7 GB/s and holds up the
            device's work while it runs: a store that grows by 23 MB a step (the ``cache`` workload
            at 3M rows a table) loses ~13 ms a step to it. Reserving the rows the tables will hold
            moves that cost to the start. The store's index (in the device's memory on CUDA) is then
            made at its final size, 53 bytes a reserved row (16 a slot, a key and a row address;
            buckets of 32 slots 30% full), and does not rehash on the way.

    Example::

        te.StorageConfig(hbm_budget="8GiB", backing=te.storage.HostMemory())
    """

    segment_rows: int = 65536
    reserve_rows: int = 0

    def __post_init__(self) -> None:
        _check_int("HostMemory", "segment_rows", self.segment_rows, 1)
        _check_int("HostMemory", "reserve_rows", self.reserve_rows, 0)

    def open(self, table: str, width: int, device: torch.device,
             dtype: torch.dtype = torch.float32) -> Backend:
        from tieredemb.storage.host import HostMemoryBackend

        return HostMemoryBackend(width, pinned=_pinned(device), segment_rows=self.segment_rows,
                                 device=device if _pinned(device) else None,
                                 reserve_rows=self.reserve_rows, dtype=dtype)

    def open_group(self, tables: list[str], width: int, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> GroupStore:
        """One host-memory store for all the group's tables (a region each in one index), so a
        fetch or write-down is one call whatever the number of tables."""
        from tieredemb.storage.host import HostMemoryBackend, HostMemoryGroup

        rows = HostMemoryBackend(width, pinned=_pinned(device), segment_rows=self.segment_rows,
                                 device=device if _pinned(device) else None, tables=len(tables),
                                 reserve_rows=self.reserve_rows * len(tables), dtype=dtype)
        return HostMemoryGroup(rows)


@dataclass(frozen=True)
class RocksDB(BackendSpec):
    """Rows in RocksDB on local disk (through ``rocksdict``), sharded by key hash.

    One database per shard under ``path``, a column family per table, writes through the
    write-ahead log (not synced). All tables opened from one spec share its databases and worker
    threads.

    Args:
        path: the store's directory (created if missing). One process at a time: give each rank of a
            sharded collection its own path.
        shards: databases, each with one worker thread. A store reopens with the count it was
            created with.
        existing: ``"error"`` | ``"reuse"`` | ``"clear"`` (module docstring).
        cache_rows: rows of a write-through DRAM cache in front, per table (0: none).
        direct_reads: read table files with O_DIRECT, around the OS page cache: reads then cost
            what the disk costs, and only RocksDB's block cache (``block_cache_bytes``) keeps
            blocks in memory. The file system must accept O_DIRECT (else ``BackendError`` at open).
        direct_writes: write flushes and compactions with O_DIRECT (the write-ahead log stays
            buffered): they no longer fill the page cache with rows nobody reads back.
        block_cache_bytes: RocksDB's cache of table blocks. ``None``: RocksDB's default, a cache of
            its own per column family (shards x tables of them); ``0``: none; ``n``: one LRU cache
            of ``n`` bytes shared by every shard and table of the store, index and filter blocks
            counted in it.
        bloom_bits_per_key: bloom filter bits a key in each table file (0: no filter): a get of an
            absent key (a first-time id) reads no data block. 10 bits: about 1% false positives.
        tuning: ``"default"`` (RocksDB's defaults) or ``"point_lookup"``: rows uncompressed, a hash
            index in each data block, a bloom filter on the memtable, dynamic level sizes and
            writes synced every MiB in the background (``docs/backends.md``).
        process: serve each shard from a child process of its own (``StoreProcess``): in one
            process RocksDB's writes hold Python's interpreter lock, so the shards write one at a
            time and the training thread waits behind them; a process per shard writes side by
            side. Costs the processes' start (importing torch: a second or two) and a copy of
            each call's keys and rows over Unix sockets. Worth it where writes are many (a host
            tier evicting to the store); only without ``cache_rows``. The files are the same.

    Example::

        te.StorageConfig(hbm_budget="8GiB", backing=te.storage.RocksDB("/tmp/emb", shards=8))
        te.storage.RocksDB("/mnt/nvme/emb", direct_reads=True, block_cache_bytes=4 << 30)
        te.storage.RocksDB("/mnt/nvme/emb", direct_reads=True, process=True)
    """

    path: str
    shards: int = 8
    existing: str = "error"
    cache_rows: int = 0
    direct_reads: bool = False
    direct_writes: bool = False
    block_cache_bytes: int | None = None
    bloom_bits_per_key: int = 10
    tuning: str = "default"
    process: bool = False
    # the open store, shared by every table opened from this spec (RocksDB allows one handle per
    # database in a process); not configuration: excluded from init, repr and equality
    _open: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_existing("RocksDB", self.existing)
        _check_int("RocksDB", "shards", self.shards, 1)
        _check_int("RocksDB", "cache_rows", self.cache_rows, 0)
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"RocksDB path must be a non-empty string, got {self.path!r}")
        for name in ("direct_reads", "direct_writes"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RocksDB {name} must be True or False, got {getattr(self, name)!r}")
        if self.block_cache_bytes is not None:
            _check_int("RocksDB", "block_cache_bytes", self.block_cache_bytes, 0)
        _check_int("RocksDB", "bloom_bits_per_key", self.bloom_bits_per_key, 0)
        if self.tuning not in _TUNINGS:
            raise ValueError(f"RocksDB tuning must be one of {_TUNINGS}, got {self.tuning!r}")
        if not isinstance(self.process, bool):
            raise TypeError(f"RocksDB process must be True or False, got {self.process!r}")
        if self.process and self.cache_rows:
            raise ValueError(f"RocksDB process=True takes no cache_rows (got {self.cache_rows}): a host "
                             "tier, StorageConfig(host_budget=...), is the cache in front of it")

    def disk_options(self):
        """The ``DiskOptions`` of the store (``tieredemb.storage.rocksdb``)."""
        from tieredemb.storage.rocksdb import DiskOptions

        return DiskOptions(self.direct_reads, self.direct_writes, self.block_cache_bytes,
                           self.bloom_bits_per_key, self.tuning)

    def open(self, table: str, width: int, device: torch.device,
             dtype: torch.dtype = torch.float32) -> Backend:
        from tieredemb.storage.rocksdb import RocksDBStore

        store = self._open.get("store")
        if store is None or store.closed:
            store = RocksDBStore(self.path, self.shards, self.disk_options())
            self._open["store"] = store
        return _with_cache(store.open_table(table, width, self.existing, dtype), self.cache_rows, device)

    def open_group(self, tables: list[str], width: int, device: torch.device,
                   dtype: torch.dtype = torch.float32) -> GroupStore:
        """Without a DRAM cache in front: one fan-out to the shard threads per call for the whole
        group (``RocksDBGroup``); with one, table by table through the caches."""
        if self.process:
            from tieredemb.storage.store_process import StoreProcess

            return StoreProcess(self, tables, width, dtype, shared=self._open)
        if self.cache_rows:
            return super().open_group(tables, width, device, dtype)
        from tieredemb.storage.rocksdb import RocksDBGroup

        return RocksDBGroup([self.open(t, width, device, dtype) for t in tables])


@dataclass(frozen=True)
class Redis(BackendSpec):
    """Rows in Redis (or Redis Cluster) as binary values, one key namespace per table.

    Args:
        url: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS).
        password: overrides the URL's.
        existing: ``"error"`` | ``"reuse"`` | ``"clear"`` (module docstring).
        namespace: first part of every key: ``<namespace>:<table>:<8-byte key>``.
        timeout_s: socket connect and read timeout of one attempt.
        retries: retries of a call after a transient error (refused, dropped, timed out).
        backoff_s: first sleep between attempts (doubles, at most 2 s).
        cluster: the URL names a node of a Redis Cluster (``redis.cluster.RedisCluster``).
        chunk_keys: keys per MGET/MSET command in a pipeline.
        cache_rows: rows of a write-through DRAM cache in front, per table (0: none).
        lease_ttl_s: one writer per namespace: the tables opened from this spec hold the lease key
            ``<namespace>:lease``, renewed every ``lease_ttl_s / 3``, released at the last table's
            ``close``. Another spec (another collection, another process) opening the namespace
            meanwhile is refused with ``BackendError``; a killed holder's lease expires after
            ``lease_ttl_s``.

    Example::

        te.StorageConfig(hbm_budget="8GiB", backing=te.storage.Redis("redis://10.0.0.5:6379/0"))
    """

    url: str = "redis://127.0.0.1:6379/0"
    password: str | None = field(default=None, repr=False)
    existing: str = "error"
    namespace: str = "tieredemb"
    timeout_s: float = 5.0
    retries: int = 3
    backoff_s: float = 0.1
    cluster: bool = False
    chunk_keys: int = 1024
    cache_rows: int = 0
    lease_ttl_s: float = 30.0
    # the namespace's lease, shared by the tables opened from this spec: not configuration
    _open: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_existing("Redis", self.existing)
        _check_int("Redis", "retries", self.retries, 0)
        _check_int("Redis", "chunk_keys", self.chunk_keys, 1)
        _check_int("Redis", "cache_rows", self.cache_rows, 0)
        for name, low in (("timeout_s", 1e-3), ("backoff_s", 0.0), ("lease_ttl_s", 1e-2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
                raise ValueError(f"Redis {name} must be a number >= {low}, got {value!r}")

    def __repr__(self) -> str:  # the URL's password redacted (``password`` is not shown at all)
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        shown["url"] = redact(self.url)
        return f"Redis({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def open(self, table: str, width: int, device: torch.device,
             dtype: torch.dtype = torch.float32) -> Backend:
        from tieredemb.storage.redis import NamespaceLease, RedisBackend

        lease = self._open.get("lease")
        if lease is None or lease.released:  # before any row is touched (existing="clear")
            lease = NamespaceLease(self._connect(), self.namespace, self.url, self.lease_ttl_s,
                                   self.retries, self.backoff_s)
            self._open["lease"] = lease
        lease.hold(table)
        try:
            backend = RedisBackend(self._connect(), table, width, self.url, namespace=self.namespace,
                                   retries=self.retries, backoff_s=self.backoff_s,
                                   chunk_keys=self.chunk_keys, cluster=self.cluster, lease=lease,
                                   dtype=dtype)
        except BaseException:
            lease.drop(table)
            raise
        try:
            backend.check_existing(self.existing)
        except BaseException:
            backend.close()
            raise
        return _with_cache(backend, self.cache_rows, device)

    def _connect(self):
        from tieredemb.storage.redis import connect

        return connect(self.url, self.password, self.timeout_s, self.cluster, self.retries)
