"""Redis (or Redis Cluster) backing store, through ``redis-py``: a parameter server of binary rows.

Layout: one Redis string per row.

    key    <namespace>:<table>:<8 bytes>   the 8 bytes big-endian (key XOR 2**63)  (``codec``)
    value  W * 4 (float32) or W * 2 (bfloat16, float16) bytes, the row in the table's dtype

A table's keys are exactly ``len(prefix) + 8`` bytes, so the SCAN pattern ``<prefix>????????``
cannot match another table's keys even when one table's name extends another's (``a`` and ``a:b``).
No hash tags: in a cluster a table's rows spread over every slot.

Each call sends its keys as chunks of ``chunk_keys`` in one non-transactional pipeline (one round
trip for the whole call): MGET / MSET / UNLINK per chunk. In cluster mode ``mget_nonatomic`` /
``mset_nonatomic`` split the keys by slot and pipeline per node.

Faults. Socket connect and read timeouts are ``timeout_s``. A transient failure (connection
refused or dropped, timeout, server loading, cluster reconfiguring) retries the whole call, which is
idempotent, up to ``retries`` times with exponential backoff from ``backoff_s``; then ``BackendError``
chained to the last failure. Refused credentials and other server errors (``OOM``, wrong type) are
not retried. Worst case before the error: ``(retries + 1) * timeout_s`` plus the backoff sleeps.
redis-py's own retries are switched off (standalone) so this bound is the only one.

One writer per namespace (``NamespaceLease``): the key ``<namespace>:lease`` holds a random token of
the live collection writing there, with a TTL its holder renews; a second one is refused.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import redis
import torch
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    RedisError,
    TryAgainError,
)
from redis.retry import Retry

from tieredemb.storage.backend import Backend, Fetched
from tieredemb.storage.codec import decode_keys, decode_rows, encode_keys, row_bytes
from tieredemb.storage.errors import BackendError, ExistingRowsError
from tieredemb.storage.urls import redact

log = logging.getLogger(__name__)

TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, BusyLoadingError,
             ClusterDownError, TryAgainError)
_GLOB_SPECIAL = b"*?[]\\"


def connect(url: str, password: str | None, timeout_s: float, cluster: bool, retries: int) -> Any:
    """A ``redis.Redis`` (or ``RedisCluster``) client with our timeouts and redis-py's retries off."""
    common: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    if password is not None:
        common["password"] = password
    try:
        if cluster:
            from redis.cluster import RedisCluster

            # the cluster client needs attempts of its own to follow MOVED/ASK redirections
            return RedisCluster.from_url(url, retry=Retry(NoBackoff(), max(retries, 1)), **common)
        return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **common)
    except (RedisError, ValueError) as e:  # the cluster client connects here; a bad URL fails here
        raise BackendError(f"Redis at {redact(url)}: cannot connect: {e}") from e


def call(where: str, what: str, fn: Callable[[], Any], retries: int, backoff_s: float) -> Any:
    """fn(), retried on transient failures with backoff; else ``BackendError`` chained."""
    delay = backoff_s
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            return fn()
        except AuthenticationError as e:
            raise BackendError(
                f"{where}: {what}: the server refused the credentials ({e}); pass the right "
                f"te.storage.Redis(password=...) or put it in the URL"
            ) from e
        except TRANSIENT as e:
            last = e
            if attempt == retries:
                break
            log.warning("%s: %s failed (%s), retry %d of %d in %.2f s", where, what, e, attempt + 1, retries,
                        delay)
            time.sleep(delay)
            delay = min(2 * delay, 2.0)
        except RedisError as e:  # not transient: OOM, wrong type, read-only replica, ...
            raise BackendError(f"{where}: {what} failed: {_brief(e)}") from e
    raise BackendError(
        f"{where}: {what} failed after {retries + 1} attempts "
        f"({type(last).__name__}: {last}); is the server up, reachable and fast enough? "
        f"(timeout_s bounds each attempt, retries the attempts)"
    ) from last


# the lease's renewal: extend it if it still holds our token, take it again if it expired and nobody
# took it meanwhile (a server restarted without its data); 0 if another collection holds it
_RENEW = """
local held = redis.call('get', KEYS[1])
if held == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if not held then redis.call('set', KEYS[1], ARGV[1], 'px', ARGV[2]); return 1 end
return 0
"""
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class NamespaceLease:
    """One writer per Redis namespace: the key ``<namespace>:lease`` holds this lease's random token.

    Taken with SET NX and a TTL, refused (``BackendError``) while another live collection holds it.
    A daemon thread renews it every TTL/3, whatever the training thread is doing. Its release (when
    the last table held ``drop``s it at its ``close``, or when the garbage collector or the
    interpreter's exit takes the lease) deletes the key only if it still holds this token; a holder
    killed outright leaves it to expire after the TTL. A renewal that finds another token (this
    process stopped past its TTL and another collection took the namespace) loses the lease: writes
    are refused from then on.

    Args:
        client: a connection of its own (``connect``), closed at release.
        namespace: the namespace held.
        url: the server's (for messages; redacted).
        ttl_s: the lease's time to live.
        retries, backoff_s: the taking's retries of transient failures (``call``).
    """

    def __init__(self, client: Any, namespace: str, url: str, ttl_s: float, retries: int = 3,
                 backoff_s: float = 0.1) -> None:
        self.client = client
        self.key = f"{namespace}:lease".encode()
        self.where = f"Redis namespace {namespace!r} at {redact(url)}"
        self.ttl_s = ttl_s
        self.token = secrets.token_hex(16).encode()
        self.tables: set[str] = set()
        self.lost = False
        self.failing = False  # the last renewal failed (the server away): logged once an outage
        ttl_ms = max(1, round(ttl_s * 1000))
        try:  # a reply lost after the SET took: the key holds our token
            taken = call(self.where, "lease", lambda: client.set(self.key, self.token, nx=True, px=ttl_ms)
                         or client.get(self.key) == self.token, retries, backoff_s)
        except BaseException:
            client.close()
            raise
        if not taken:
            client.close()
            raise BackendError(
                f"{self.where} is held by another live collection (its lease, key {self.key!r}, is "
                f"renewed every {ttl_s / 3:.3g} s): one writer per store. Close that collection, wait "
                f"{ttl_s:g} s (lease_ttl_s) if its process died, or use another namespace"
            )
        self.renewed_at = time.monotonic()
        stop = threading.Event()
        self._release = weakref.finalize(self, _release, client, self.key, self.token, stop)
        threading.Thread(target=_renew_while_held, args=(weakref.ref(self), stop, ttl_s / 3),
                         name=f"tieredemb-lease-{namespace}", daemon=True).start()

    @property
    def released(self) -> bool:
        return not self._release.alive

    def hold(self, table: str) -> None:
        """A table opened under the lease (the tables of one spec share it)."""
        if table in self.tables:
            raise ValueError(f"table {table!r} of {self.where} is already open")
        self.tables.add(table)

    def drop(self, table: str) -> None:
        """A table closed; the last one releases the lease."""
        self.tables.discard(table)
        if not self.tables:
            self._release()

    def renew(self) -> None:
        if self.lost:
            return
        try:
            held = self.client.eval(_RENEW, 1, self.key, self.token, max(1, round(self.ttl_s * 1000)))
        except RedisError as e:  # the server is away: the lease lasts its TTL, the next renewal retries
            if not self.failing:  # once an outage, not every TTL/3 while it lasts
                log.warning("%s: renewing the lease failed (retried every %.3g s, quietly): %s",
                            self.where, self.ttl_s / 3, e)
            self.failing = True
            return
        if self.failing:
            log.warning("%s: renewing the lease works again", self.where)
            self.failing = False
        if held:
            self.renewed_at = time.monotonic()
            return
        self.lost = True
        log.error("%s: the lease was lost to another collection (nothing renewed it for longer than its "
                  "TTL): this one's writes are refused", self.where)

    def check(self) -> None:
        """Before a write: ``BackendError`` if another collection holds the namespace now. A lease not
        renewed for a TTL (this process was stopped) is renewed first, to know."""
        if time.monotonic() - self.renewed_at > self.ttl_s:
            self.renew()
        if self.lost:
            raise BackendError(f"{self.where}: this collection lost its lease to another one (nothing "
                               f"renewed it for longer than lease_ttl_s): writes are refused")


def _renew_while_held(lease_ref: weakref.ref, stop: threading.Event, period_s: float) -> None:
    """The renewal thread: holds the lease only weakly, so that an unclosed collection's lease is
    still released when the collection is collected."""
    while not stop.wait(period_s):
        lease = lease_ref()
        if lease is None:
            return
        lease.renew()
        del lease


def _release(client: Any, key: bytes, token: bytes, stop: threading.Event) -> None:
    """Stop the renewals; delete ``key`` if it still holds ``token``; close the client."""
    stop.set()
    try:
        client.eval(_RELEASE, 1, key, token)
    except RedisError as e:
        log.info("releasing the Redis lease %r failed (it expires by itself): %s", key, e)
    finally:
        client.close()


def _brief(error: Exception) -> str:
    """The server's words without the pipeline's echo of the command (binary keys and rows)."""
    text = str(error)
    _, sep, said = text.partition("caused error: ")
    return said if sep else text[:300]


class RedisBackend(Backend):
    """One table's rows in Redis, under the key prefix ``<namespace>:<table>:``.

    Opened by ``te.storage.Redis(url).open(table, width, device)``; used from one I/O worker.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` (see ``connect``).
        table: the table name (part of the key prefix).
        width: elements per row.
        url: for messages (redacted).
        namespace: first part of every key.
        retries: retries of a call after a transient failure.
        backoff_s: first sleep between attempts (doubles, at most 2 s).
        chunk_keys: keys per MGET/MSET command.
        cluster: ``client`` is a ``RedisCluster``.
        lease: the namespace's lease the table is opened under (``NamespaceLease.hold``): writes
            are refused once it is lost, and ``close`` drops the table from it.
        dtype: the rows' storage type (``TableConfig.dtype``).
    """

    def __init__(self, client: Any, table: str, width: int, url: str, namespace: str = "tieredemb",
                 retries: int = 3, backoff_s: float = 0.1, chunk_keys: int = 1024,
                 cluster: bool = False, lease: NamespaceLease | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.client = client
        self.dtype = dtype
        self.lease = lease
        self.table = table
        self.width = width
        self.url = redact(url)
        self.retries = retries
        self.backoff_s = backoff_s
        self.chunk_keys = chunk_keys
        self.cluster = cluster
        self.prefix = f"{namespace}:{table}:".encode()
        escaped = b"".join(b"\\" + bytes([c]) if c in _GLOB_SPECIAL else bytes([c]) for c in self.prefix)
        self.pattern = escaped + b"?" * 8
        self._where = f"Redis table {table!r} at {self.url}"

    def check_existing(self, existing: str) -> None:
        """Reach the server (clear error now if it is down or refuses us), then apply ``existing``."""
        self._call("ping", self.client.ping)
        first = next(self._scan_keys(1), None)
        if first is None:
            return
        if existing == "clear":
            for chunk in self._scan_chunks(self.chunk_keys):
                self._call("clear", self._unlink, chunk)
            return
        if existing == "error":
            raise ExistingRowsError(
                f"Redis at {self.url} already holds rows of table {self.table!r} (keys "
                f"{self.prefix!r}...): pass existing='reuse' to train on from them or "
                f"existing='clear' to delete them"
            )
        value = self._call("get", self.client.get, first)
        if value is not None and len(value) != self.width * self.dtype.itemsize:
            raise ValueError(
                f"{self._where} holds rows of {len(value)} bytes, this table's rows have "
                f"{self.width * self.dtype.itemsize} ({self.width} values of {self.dtype}: embedding_dim "
                f"+ optimizer state): reuse it with the same embedding_dim, optimizer and dtype, or pass "
                f"existing='clear'"
            )

    # ------------------------------------------------------------------------------------ verbs
    def get(self, keys: torch.Tensor) -> Fetched:
        names = self._names(keys)
        values = self._call("get", self._mget, names) if names else []
        rows, found = decode_rows(values, self.width, self._where, self.dtype)
        return Fetched(rows, found)

    def set(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Upsert; a key given twice keeps its last row."""
        names = self._names(keys)
        if names:
            self._writable()
            self._call("set", self._mset, names, row_bytes(rows.reshape(-1, self.width), self.dtype))

    def delete(self, keys: torch.Tensor) -> None:
        names = self._names(keys)
        if names:
            self._writable()
            self._call("delete", self._unlink, names)

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every row once (SCAN may repeat a key: repeats are dropped), in no particular order.

        A row deleted during the scan may be missing; one set during it may or may not appear.
        """
        for names in self._scan_chunks(chunk_rows):
            values = self._call("scan", self._mget, names)
            present = [i for i, v in enumerate(values) if v is not None]
            if not present:
                continue
            rows, _ = decode_rows([values[i] for i in present], self.width, self._where, self.dtype)
            yield decode_keys([names[i][len(self.prefix):] for i in present]), rows

    def size(self) -> int:
        """Rows stored (SCANs the table's keys: O(rows), for stats and tests)."""
        return sum(len(chunk) for chunk in self._scan_chunks(self.chunk_keys))

    def flush(self) -> None:
        """Nothing to do: a reply to MSET means every client reads the rows. Durability across a
        server restart is the server's persistence configuration (RDB/AOF)."""

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self.lease is not None:
                self.lease.drop(self.table)

    # ------------------------------------------------------------------------------- internals
    def _names(self, keys: torch.Tensor) -> list[bytes]:
        """int64 (n,) -> n Redis keys, prefix + 8-byte key, built in one numpy pass."""
        enc = encode_keys(keys)
        if enc.size == 0:
            return []
        p = len(self.prefix)
        packed = np.empty(enc.size, dtype=np.dtype([("p", f"V{p}"), ("k", ">u8")]))
        packed["p"] = np.frombuffer(self.prefix, dtype=f"V{p}")[0]
        packed["k"] = enc
        return packed.view(f"V{p + 8}").tolist()

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), retried on transient failures with backoff; else ``BackendError`` chained."""
        return call(self._where, what, lambda: fn(*args), self.retries, self.backoff_s)

    def _writable(self) -> None:
        if self.lease is not None:
            self.lease.check()

    def _chunks(self, items: list) -> Iterator[list]:
        for start in range(0, len(items), self.chunk_keys):
            yield items[start : start + self.chunk_keys]

    def _mget(self, names: list[bytes]) -> list[bytes | None]:
        if self.cluster:
            return self.client.mget_nonatomic(names)
        pipe = self.client.pipeline(transaction=False)
        for chunk in self._chunks(names):
            pipe.mget(chunk)
        return [v for part in pipe.execute() for v in part]

    def _mset(self, names: list[bytes], values: list[bytes]) -> None:
        if self.cluster:
            self.client.mset_nonatomic(dict(zip(names, values)))
            return
        pipe = self.client.pipeline(transaction=False)
        for start in range(0, len(names), self.chunk_keys):
            end = start + self.chunk_keys
            pipe.mset(dict(zip(names[start:end], values[start:end])))  # dict: the last row wins
        pipe.execute()

    def _unlink(self, names: list[bytes]) -> None:
        if self.cluster:
            for chunk in self._chunks(names):
                self.client.unlink(*chunk)
            return
        pipe = self.client.pipeline(transaction=False)
        for chunk in self._chunks(names):
            pipe.unlink(*chunk)
        pipe.execute()

    def _scan_keys(self, count: int) -> Iterator[bytes]:
        """The table's keys (possibly repeated), SCAN page by page, each page call retried."""
        if self.cluster:  # scan_iter walks every primary; a failure mid-walk is not retried
            try:
                yield from self.client.scan_iter(match=self.pattern, count=count)
            except RedisError as e:
                raise BackendError(f"{self._where}: scan failed: {e}") from e
            return
        cursor = 0
        while True:
            cursor, page = self._call("scan", self.client.scan, cursor, self.pattern, max(count, 10))
            yield from page
            if cursor == 0:
                return

    def _scan_chunks(self, chunk_rows: int) -> Iterator[list[bytes]]:
        """The table's keys once each, in lists of ``chunk_rows``."""
        seen: set[bytes] = set()
        chunk: list[bytes] = []
        for name in self._scan_keys(chunk_rows):
            if name in seen:
                continue
            seen.add(name)
            chunk.append(name)
            if len(chunk) == chunk_rows:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
