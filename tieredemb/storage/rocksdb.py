"""RocksDB backing store on local disk, through ``rocksdict`` in raw (bytes) mode.

Layout of a store at ``path``::

    path/tieredemb-store.json    {"format": 1, "shards": S}: a store is reopened with its own S
    path/shard-00 .. shard-{S-1}  one RocksDB database per shard
        column family "t:<table>" one per table: tables never see each other's keys, and dropping
                                  a table (existing="clear") is one call, not a delete per row
        key   8 bytes, big-endian (key XOR 2**63): byte order is numeric order  (``codec``)
        value W * 4 (float32) or W * 2 (bfloat16, float16) bytes, the row in the table's dtype

A key lives in shard ``((splitmix64(key) & 0xFFFFFFFF) * S) >> 32``: the low half of the hash, so
shards do not follow the device index's buckets (which use the high half). Each call splits its keys
by shard, sorts each shard's keys (RocksDB's multi-get and write batches are fastest in key order),
and hands each shard to a worker of a pool with one thread per shard.

Writes go through the write-ahead log (not synced: they survive the process, not the machine): a
``set`` that returned is in the log, and a reopened database replays it. That is what lets a store
recover from a failed write. After one (disk full, a directory that refuses new files) RocksDB refuses
every later write, even once the cause is gone, until the database is reopened; so the next write
reopens the databases first (``RocksDBStore.reopen``), and the caller retries the rows of the failed
write (it still holds them). While the fault lasts the reopen fails, and the databases are opened
read-only instead: reads go on, every write raises.

How the databases use the disk is a ``DiskOptions`` (``te.storage.RocksDB``'s ``direct_reads``,
``direct_writes``, ``block_cache_bytes``, ``bloom_bits_per_key``, ``tuning``): every shard and column
family gets the same options, and a bounded block cache is one cache shared by all of them.

Every RocksDB or OS error comes out as ``BackendError`` naming the store's path and the table,
chained to the original.
"""

from __future__ import annotations

import json
import os
import threading
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from rocksdict import (
    AccessType,
    BlockBasedOptions,
    Cache,
    DataBlockIndexType,
    DBCompressionType,
    Options,
    Rdict,
    WriteBatch,
    WriteOptions,
)

from tieredemb.keys import splitmix64
from tieredemb.storage.backend import Backend, Fetched, GroupStore
from tieredemb.storage.codec import decode_keys, decode_rows, encode_keys, key_bytes, row_bytes
from tieredemb.storage.errors import BackendError, ExistingRowsError

FORMAT = 1
META_FILE = "tieredemb-store.json"


def shard_of(keys: torch.Tensor, shards: int) -> np.ndarray:
    """int64 (n,) -> int64 (n,) shard in [0, shards). Part of the on-disk format: never change."""
    low = splitmix64(keys.reshape(-1).to(torch.int64)) & 0xFFFFFFFF
    return ((low * shards) >> 32).numpy()


def _column_family(table: str) -> str:
    return f"t:{table}"


def _count_keys(family: Rdict) -> int:
    keys = family.keys()  # an iterator over the column family (``iter(family)`` is not)
    return sum(1 for _ in keys)


TUNINGS = ("default", "point_lookup")


@dataclass(frozen=True)
class DiskOptions:
    """How a store's databases use the disk (validated by ``te.storage.RocksDB``, which documents
    each field; ``docs/backends.md`` says what each costs)."""

    direct_reads: bool = False  # O_DIRECT reads: no page cache under the block cache
    direct_writes: bool = False  # O_DIRECT flushes and compactions
    block_cache_bytes: int | None = None  # None: RocksDB's own cache per column family; 0: none
    bloom_bits_per_key: int = 10  # 0: no bloom filter
    tuning: str = "default"  # "default" | "point_lookup"

    @property
    def direct(self) -> bool:
        return self.direct_reads or self.direct_writes

    def shared_cache(self) -> Cache | None:
        """The one block cache of a bounded store (None: each column family's own, or none)."""
        return Cache(self.block_cache_bytes) if self.block_cache_bytes else None

    def build(self, cache: Cache | None) -> Options:
        """The options of one database or column family; ``cache`` from ``shared_cache``."""
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        table = BlockBasedOptions()
        if self.bloom_bits_per_key:  # most first-time keys are absent: skip their disk reads
            table.set_bloom_filter(self.bloom_bits_per_key, False)
        if self.block_cache_bytes == 0:
            table.disable_cache()
        elif cache is not None:
            # the bound covers index and filter blocks too; level 0's stay pinned (read by every get)
            table.set_block_cache(cache)
            table.set_cache_index_and_filter_blocks(True)
            table.set_pin_l0_filter_and_index_blocks_in_cache(True)
        if self.tuning == "point_lookup":
            table.set_data_block_index_type(DataBlockIndexType.binary_and_hash())
            table.set_data_block_hash_ratio(0.75)
            opts.set_compression_type(DBCompressionType.none())  # float rows hardly compress
            opts.set_memtable_prefix_bloom_ratio(0.02)
            opts.set_memtable_whole_key_filtering(True)
            opts.set_level_compaction_dynamic_level_bytes(True)
            opts.set_bytes_per_sync(1 << 20)
        opts.set_block_based_table_factory(table)
        opts.set_use_direct_reads(self.direct_reads)
        opts.set_use_direct_io_for_flush_and_compaction(self.direct_writes)
        return opts


def check_meta(path: str, shards: int) -> None:
    """The store at ``path`` (a directory that exists) is of this format and shard count; a new one
    (an empty directory) is made so."""
    meta_path = os.path.join(path, META_FILE)
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT or meta.get("shards") != shards:
            raise ValueError(
                f"RocksDB store {path} was created with {meta.get('shards')} shards "
                f"(format {meta.get('format')}); open it with RocksDB(path, shards="
                f"{meta.get('shards')}) or use another path"
            )
        return
    if os.listdir(path):  # never scatter shard directories over someone else's files
        raise ValueError(
            f"RocksDB path {path} is a non-empty directory without {META_FILE}: not a "
            f"tieredemb store; give an empty or new directory"
        )
    with open(meta_path, "w") as f:
        json.dump({"format": FORMAT, "shards": shards}, f)


class RocksDBStore:
    """The open databases of one store path, shared by the tables opened from one ``RocksDB`` spec.

    RocksDB lets one handle per process open a database, so every table of a store goes through this
    object; it closes the databases when the last table closes. Calls on the databases (``using``)
    take ``lock``, so that a reopen never runs beside another call (two table groups over one store
    call it from two I/O workers).

    Args:
        path: the store's directory (created if missing).
        shards: databases (and worker threads). A store is always reopened with the count it was
            created with; another count is an error.
        disk: how the databases use the disk (``DiskOptions``; default: RocksDB's defaults with
            bloom filters of 10 bits a key).
        only: open this shard's database alone (None: every shard's); the others are None in
            ``dbs`` and ``families``, and a key of theirs is an error. A store served by a process
            per shard (``StoreProcess``) opens one in each.
    """

    def __init__(self, path: str, shards: int, disk: DiskOptions | None = None,
                 only: int | None = None) -> None:
        self.path = os.path.abspath(path)
        self.shards = shards
        self.mine = list(range(shards)) if only is None else [only]
        self.disk = disk or DiskOptions()
        self.block_cache = self.disk.shared_cache()
        self.tables: dict[str, RocksDBBackend] = {}
        self.closed = False
        self.failed = False  # a write failed: the databases refuse writes until reopened
        self.lock = threading.RLock()
        self.dbs: list[Rdict | None] = []
        self.families: list[set[str] | None] = []  # column families of each shard
        with self._errors("open"):
            os.makedirs(self.path, exist_ok=True)
            check_meta(self.path, self.shards)
            try:
                self._open_dbs()
            except Exception as e:
                said = str(e).lower()
                if self.disk.direct and ("direct" in said or "invalid argument" in said):
                    raise RuntimeError(f"{e} (direct I/O is on: the file system of {self.path} "
                                       f"must accept O_DIRECT; pass direct_reads=False and "
                                       f"direct_writes=False where it does not)") from e
                raise
        self.pool = ThreadPoolExecutor(max_workers=len(self.mine), thread_name_prefix="tieredemb-rocksdb")
        self.write_options = WriteOptions()  # through the write-ahead log (module docstring)

    @contextmanager
    def _errors(self, what: str, table: str | None = None):
        """Re-raise anything as ``BackendError`` naming the path (and table), chained."""
        try:
            yield
        except (BackendError, ValueError):
            raise
        except Exception as e:
            # A traceback keeps its frames' locals alive, and a column-family handle in one keeps
            # its database open (and locked) after close: drop the locals of the finished frames.
            # Where a frame still runs (the caller's), the code keeps no handle in a local.
            traceback.clear_frames(e.__traceback__)
            on = f"table {table!r} of " if table is not None else ""
            raise BackendError(f"RocksDB {what} failed on {on}store {self.path}: {e}") from e

    @contextmanager
    def using(self, what: str, table: str | None = None, writes: bool = False):
        """One call on the databases, under ``lock``, errors as ``_errors``. A write (``writes``)
        first reopens the databases if an earlier write failed, and marks them failed if it fails."""
        with self.lock, self._errors(what, table):
            if writes and self.failed:
                self.reopen()
            try:
                yield
            except Exception:
                self.failed = self.failed or writes
                raise

    def reopen(self) -> None:
        """Close and reopen the databases after a failed write (the module docstring says why). If
        that fails (the fault lasts), open them read-only, so that reads go on, and raise."""
        with self.lock, self._errors("reopen after a failed write"):
            for backend in self.tables.values():  # a handle left would keep its database open
                backend.drop_handles()
            self._close_dbs()
            try:
                self._open_dbs()
                self.failed = False
            except Exception:
                self._open_dbs(read_only=True)
                raise
            finally:
                for backend in self.tables.values():
                    backend.attach()

    def _open_dbs(self, read_only: bool = False) -> None:
        """Open every shard's database (and list its column families), or none."""
        access = AccessType.read_only() if read_only else AccessType.read_write()
        try:
            for shard in range(self.shards):
                if shard not in self.mine:
                    self.dbs.append(None)
                    self.families.append(None)
                    continue
                shard_path = os.path.join(self.path, f"shard-{shard:02d}")
                names: list[str] = []
                if os.path.exists(os.path.join(shard_path, "CURRENT")):
                    names = [n for n in Rdict.list_cf(shard_path, Options(raw_mode=True)) if n != "default"]
                self.dbs.append(Rdict(shard_path, self.options(),
                                      column_families={n: self.options() for n in names},
                                      access_type=access))
                self.families.append(set(names))
        except BaseException:
            self._close_dbs()  # release the shards' locks: the path may be retried
            raise

    def check_mine(self, per_shard: np.ndarray) -> None:
        """Keys counted per shard (``per_shard``) are all of the shards this store opened."""
        if len(self.mine) < self.shards and per_shard.sum() != per_shard[self.mine].sum():
            raise ValueError(f"RocksDB store {self.path}: keys of shards this process did not open "
                             f"(it opened {self.mine})")

    def options(self) -> Options:
        """Options of a database or column family of this store."""
        return self.disk.build(self.block_cache)

    def _close_dbs(self) -> Exception | None:
        """Close every database, popped first (no reference left keeps one open, even if its close
        fails); the first failure, if any."""
        first_error: Exception | None = None
        while self.dbs:
            if self.dbs[-1] is None:  # a shard this process did not open
                self.dbs.pop()
                continue
            try:
                self.dbs.pop().close()  # (no database in a local: a traceback would keep it open)
            except Exception as e:  # a database in RocksDB's error state fails to close cleanly
                first_error = first_error or e
        self.families = []
        return first_error

    def open_table(self, table: str, width: int, existing: str,
                   dtype: torch.dtype = torch.float32) -> RocksDBBackend:
        """The backend of ``table`` (rows of ``width`` values in ``dtype``), creating its column
        families."""
        if self.closed:
            raise BackendError(f"RocksDB store {self.path} is closed")
        if table in self.tables:
            raise ValueError(f"table {table!r} of RocksDB store {self.path} is already open")
        name = _column_family(table)
        backend = None
        try:
            with self._errors("open", table):
                for shard, families in enumerate(self.families):  # no database in a local
                    if families is None:
                        continue
                    if existing == "clear" and name in families:
                        self.dbs[shard].drop_column_family(name)
                        families.discard(name)
                    if name not in families:
                        self.dbs[shard].create_column_family(name, self.options())
                        families.add(name)
                backend = RocksDBBackend(self, table, width, dtype)
                backend.check_existing(existing)
        except BaseException:
            if backend is not None:  # its column-family handles would keep the databases open
                backend.drop_handles()
            self.release(table)  # a store with no table open closes (another spec may open it)
            raise
        self.tables[table] = backend
        return backend

    def release(self, table: str) -> None:
        """A table's backend closed; the last one closes the databases."""
        self.tables.pop(table, None)
        if self.tables or self.closed:
            return
        self.closed = True
        self.pool.shutdown(wait=True)
        first_error = self._close_dbs()
        if first_error is not None:
            with self._errors("close"):
                raise first_error


class RocksDBBackend(Backend):
    """One table's rows in a sharded RocksDB store (see the module docstring for the layout).

    Opened by ``te.storage.RocksDB(path).open(table, width, device)``; used from one I/O worker.
    """

    def __init__(self, store: RocksDBStore, table: str, width: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.store = store
        self.table = table
        self.width = width
        self.dtype = dtype
        self.attach()
        self._where = f"RocksDB table {table!r} of {store.path}"

    def attach(self) -> None:
        """Take the table's column families in the store's databases (opened, or reopened)."""
        name = _column_family(self.table)
        dbs = self.store.dbs
        self._families = [None if db is None else db.get_column_family(name) for db in dbs]
        self._handles = [None if db is None else db.get_column_family_handle(name) for db in dbs]

    def check_existing(self, existing: str) -> None:
        """Refuse (``existing="error"``) or check the width of (``"reuse"``) rows already stored."""
        first = next((v for shard in self._open_shards() for v in self._families[shard].values()), None)
        if first is None or existing == "clear":
            return
        if existing == "error":
            raise ExistingRowsError(
                f"RocksDB store {self.store.path} already holds rows of table {self.table!r}: pass "
                f"existing='reuse' to train on from them or existing='clear' to delete them"
            )
        if len(first) != self.width * self.dtype.itemsize:
            raise ValueError(
                f"{self._where} holds rows of {len(first)} bytes, this table's rows have "
                f"{self.width * self.dtype.itemsize} ({self.width} values of {self.dtype}: embedding_dim "
                f"+ optimizer state): reuse it with the same embedding_dim, optimizer and dtype, or pass "
                f"existing='clear'"
            )

    # ------------------------------------------------------------------------------------ verbs
    def get(self, keys: torch.Tensor) -> Fetched:
        keys = keys.reshape(-1).to(torch.int64)
        n = keys.numel()
        if n == 0:
            return Fetched(torch.zeros(0, self.width, dtype=self.dtype), torch.zeros(0, dtype=torch.bool))
        order, groups = self._by_shard(keys)
        with self.store.using("get", self.table):
            parts = self._each_shard(self._get_shard, groups)
            rows_sorted, found_sorted = decode_rows([v for p in parts for v in p], self.width, self._where,
                                                    self.dtype)
        rows = torch.empty(n, self.width, dtype=self.dtype)
        found = torch.empty(n, dtype=torch.bool)
        idx = torch.from_numpy(order)
        rows[idx], found[idx] = rows_sorted, found_sorted
        return Fetched(rows, found)

    def set(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Upsert; a key given twice keeps its last row (shard order is stable)."""
        keys = keys.reshape(-1).to(torch.int64)
        if keys.numel() == 0:
            return
        order, groups = self._by_shard(keys)
        values = row_bytes(rows.reshape(-1, self.width)[torch.from_numpy(order)], self.dtype)
        starts = np.cumsum([0] + [len(g) for _, g in groups])
        batches = [(s, g, values[a:b]) for (s, g), a, b in zip(groups, starts[:-1], starts[1:])]
        with self.store.using("set", self.table, writes=True):
            self._each_shard(self._set_shard, batches)

    def delete(self, keys: torch.Tensor) -> None:
        keys = keys.reshape(-1).to(torch.int64)
        if keys.numel() == 0:
            return
        _, groups = self._by_shard(keys)
        with self.store.using("delete", self.table, writes=True):
            self._each_shard(self._delete_shard, groups)

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row once: shard after shard, ascending key within a shard, ``chunk_rows`` a chunk.

        Each shard is read through one iterator, a consistent view of that shard at its start. Not
        under the store's lock (the iterators span the caller's chunks): an iterator keeps its
        database open, so a reopen meanwhile (another table group's write after a failed one)
        fails and is tried again at the next write.
        """
        keys: list[bytes] = []
        values: list[bytes] = []
        with self.store._errors("scan", self.table):
            for shard in self._open_shards():
                for k, v in self._families[shard].items():
                    keys.append(k)
                    values.append(v)
                    if len(keys) == chunk_rows:
                        yield self._chunk(keys, values)
                        keys, values = [], []
            if keys:
                yield self._chunk(keys, values)

    def scan_keys(self, chunk_rows: int = 65536) -> Iterator[torch.Tensor]:
        """``scan``'s keys alone, without the rows: their bytes are never made Python objects (2.8x
        faster on the 2-core box, 400k rows of 129 floats)."""
        keys: list[bytes] = []
        with self.store._errors("scan", self.table):
            for shard in self._open_shards():
                for k in self._families[shard].keys():  # noqa: SIM118 (an Rdict is not iterable)
                    keys.append(k)
                    if len(keys) == chunk_rows:
                        yield decode_keys(keys)
                        keys = []
            if keys:
                yield decode_keys(keys)

    def size(self) -> int:
        """Rows stored (counts every key: O(rows), for stats and tests, not the training step)."""
        with self.store.using("size", self.table):
            return sum(_count_keys(self._families[shard]) for shard in self._open_shards())

    def flush(self) -> None:
        """Write every memtable of this table to disk (waits)."""
        with self.store.using("flush", self.table, writes=True):
            for shard in self._open_shards():  # (no column family in a local: see ``_errors``)
                self._families[shard].flush(True)

    def close(self) -> None:
        if self.store.closed or self.store.tables.get(self.table) is not self:
            return
        try:
            self.flush()
        finally:
            self.drop_handles()
            self.store.release(self.table)

    def drop_handles(self) -> None:
        """Forget the column families (RocksDB closes only when no handle is left)."""
        self._families, self._handles = [], []

    # ------------------------------------------------------------------------------- internals
    def _open_shards(self) -> list[int]:
        """The shards whose column families this backend holds (none after ``drop_handles``)."""
        return [s for s in range(len(self._families)) if self._families[s] is not None]

    def _by_shard(self, keys: torch.Tensor) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """(order: positions of ``keys`` sorted by (shard, key), [(shard, encoded keys in order)])."""
        enc = encode_keys(keys)
        shard = shard_of(keys, self.store.shards)
        order = np.lexsort((enc, shard))  # stable: a repeated key keeps its order
        counts = np.bincount(shard, minlength=self.store.shards)
        self.store.check_mine(counts)
        ends = np.cumsum(counts)
        sorted_enc = enc[order]
        groups = [(s, sorted_enc[e - c : e]) for s, (c, e) in enumerate(zip(counts, ends)) if c]
        return order, groups

    def _each_shard(self, fn, items: list) -> list:
        """fn(*item) for each shard's item on the pool (one thread per shard); results in order."""
        if len(items) == 1:
            return [fn(*items[0])]
        futures = [self.store.pool.submit(fn, *item) for item in items]
        return [f.result() for f in futures]

    def _get_shard(self, shard: int, enc: np.ndarray) -> list[bytes | None]:
        return self._families[shard].get(key_bytes(enc))

    def _set_shard(self, shard: int, enc: np.ndarray, values: list[bytes]) -> None:
        batch = WriteBatch(raw_mode=True)
        handle = self._handles[shard]
        for k, v in zip(key_bytes(enc), values):
            batch.put(k, v, handle)
        self.store.dbs[shard].write(batch, self.store.write_options)

    def _delete_shard(self, shard: int, enc: np.ndarray) -> None:
        batch = WriteBatch(raw_mode=True)
        handle = self._handles[shard]
        for k in key_bytes(enc):
            batch.delete(k, handle)
        self.store.dbs[shard].write(batch, self.store.write_options)

    def _chunk(self, keys: list[bytes], values: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        rows, _ = decode_rows(values, self.width, self._where, self.dtype)
        return decode_keys(keys), rows


class RocksDBGroup(GroupStore):
    """A table group's RocksDB tables (column families of one store) answered together: a ``get`` or
    ``set`` is one fan-out to the shard threads for all the group's tables (a multi-get per column
    family, one write batch per shard across them), not one per table."""

    def __init__(self, backends: list[RocksDBBackend]) -> None:
        super().__init__(backends)
        self.store = backends[0].store
        self._where = f"RocksDB tables {[b.table for b in backends]} of {self.store.path}"

    def _plan(self, keys: torch.Tensor, tables: torch.Tensor):
        """(order: positions sorted by (shard, table, key), per shard [(table, encoded keys)])."""
        enc = encode_keys(keys)
        tabs = tables.numpy()
        shard = shard_of(keys, self.store.shards)
        self.store.check_mine(np.bincount(shard, minlength=self.store.shards))
        order = np.lexsort((enc, tabs, shard))
        sorted_enc, sorted_tab, sorted_shard = enc[order], tabs[order], shard[order]
        # runs of one (shard, table)
        cut = np.flatnonzero((np.diff(sorted_shard) != 0) | (np.diff(sorted_tab) != 0)) + 1
        bounds = np.concatenate([[0], cut, [len(order)]])
        plan: dict[int, list[tuple[int, np.ndarray, int, int]]] = {}
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                plan.setdefault(int(sorted_shard[a]), []).append((int(sorted_tab[a]), sorted_enc[a:b], a, b))
        return order, plan

    def _fan_out(self, fn, plan: dict) -> list:
        futures = [self.store.pool.submit(fn, shard, runs) for shard, runs in plan.items()]
        return [f.result() for f in futures]

    def get(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        keys, tables = keys.reshape(-1).to(torch.int64).cpu(), tables.reshape(-1).to(torch.int64).cpu()
        n = keys.numel()
        rows = torch.zeros(n, self.width, dtype=self.dtype)
        found = torch.zeros(n, dtype=torch.bool)
        if n == 0:
            return Fetched(rows, found)
        order, plan = self._plan(keys, tables)

        def read(shard: int, runs) -> list:
            return [(a, b, self.backends[t]._families[shard].get(key_bytes(enc))) for t, enc, a, b in runs]

        with self.store.using("get"):
            # the runs cover the sorted positions in order: one decode, one scatter
            values = [v for shard_parts in self._fan_out(read, plan) for _, _, part in shard_parts
                      for v in part]
            got, hit = decode_rows(values, self.width, self._where, self.dtype)
        idx = torch.from_numpy(order)
        rows[idx], found[idx] = got, hit
        return Fetched(rows, found)

    def set(self, keys: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
            distinct: bool = False) -> None:
        keys, tables = keys.reshape(-1).to(torch.int64).cpu(), tables.reshape(-1).to(torch.int64).cpu()
        if keys.numel() == 0:
            return
        order, plan = self._plan(keys, tables)
        values = row_bytes(rows.reshape(-1, self.width)[torch.from_numpy(order)], self.dtype)

        def write(shard: int, runs) -> None:
            batch = WriteBatch(raw_mode=True)
            for t, enc, a, b in runs:  # a key given twice keeps its last row: lexsort is stable
                handle = self.backends[t]._handles[shard]
                for k, v in zip(key_bytes(enc), values[a:b]):
                    batch.put(k, v, handle)
            self.store.dbs[shard].write(batch, self.store.write_options)

        with self.store.using("set", writes=True):
            self._fan_out(write, plan)
