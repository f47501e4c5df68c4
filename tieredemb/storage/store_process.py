"""StoreProcess: a RocksDB store served by a process per shard.

``rocksdict`` holds Python's interpreter lock for the whole of a RocksDB write (about 2.5 us a row),
and the Python work around every call (keys encoded, rows decoded) holds it too. So in one process
the shards' writes run one at a time, however many threads call them, and the training thread,
which needs the same lock for every kernel launch, waits behind them. ``te.storage.RocksDB(
process=True)`` serves each shard's database from a child process of its own: each has its own
lock, the shards write side by side, and this process only splits each call by shard (the store's
own ``shard_of``), sends every shard its part, then gathers the answers, over Unix sockets whose
copies release the lock. The files are the same as in-process: a store opens either way.

A child is ``python -m tieredemb.storage.store_process``, started with this process's ``sys.path``
(it never imports the parent's ``__main__``) in a session of its own (a Ctrl-C reaches the parent
alone, which then closes the store). It reads its spec and shard from its stdin and serves each
connection on a thread; a call runs there as it would in-process, and what it raises is raised in
the caller, the child's traceback added as a note. A child closes its database and exits when its
stdin ends: when the parent closes it, or when the parent dies.

A call whose connection breaks because a child died starts a new child for that shard on the same
files (``existing="reuse"``) and sends its part once more: every write the old child acknowledged is
in the shard's write-ahead log, and ``set`` and ``delete`` may run twice. A scan that was reading that
shard raises ``BackendError``.

Messages: an 8-byte length and a pickle, whose tensors follow it as raw bytes (pickled as their
dtype and shape only), read straight into the tensors' memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import os
import pickle
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import torch

from tieredemb.storage.backend import Backend, Fetched, GroupStore, add_bytes
from tieredemb.storage.errors import BackendError

_LENGTH = struct.Struct("<Q")
_CPU = torch.device("cpu")
_GROUP_VERBS = frozenset({"get", "set", "delete", "flush"})
_TABLE_VERBS = frozenset({"get", "set", "delete", "size", "flush", "index_bytes"})


# ------------------------------------------------------------------------------------ messages
class _Pickler(pickle.Pickler):
    def __init__(self, file, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def persistent_id(self, obj: Any):
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to(_CPU).contiguous()
            self.tensors.append(t)
            return str(t.dtype).removeprefix("torch."), tuple(t.shape)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, sock: socket.socket) -> None:
        super().__init__(io.BytesIO(data))
        self.sock = sock

    def persistent_load(self, pid):
        dtype, shape = getattr(torch, pid[0]), pid[1]
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            _read_into(self.sock, memoryview(t.view(-1).view(torch.uint8).numpy()))
        return t


def _read_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the connection closed mid-message")
        got += n


def _send(sock: socket.socket, obj: Any) -> None:
    buffer, tensors = io.BytesIO(), []
    _Pickler(buffer, tensors).dump(obj)
    head = buffer.getvalue()
    sock.sendall(_LENGTH.pack(len(head)) + head)
    for t in tensors:
        if t.numel():
            sock.sendall(memoryview(t.view(-1).view(torch.uint8).numpy()))


def _recv(sock: socket.socket) -> Any:
    length = bytearray(_LENGTH.size)
    _read_into(sock, memoryview(length))
    head = bytearray(_LENGTH.unpack(length)[0])
    _read_into(sock, memoryview(head))
    return _Unpickler(bytes(head), sock).load()


def _portable(e: BaseException) -> BaseException:
    """``e`` as it can be raised in the parent: itself if it pickles, with the child's traceback as
    a note; else a ``BackendError`` saying what it was."""
    note = "in the store's process:\n" + "".join(traceback.format_exception(e))
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 - whatever does not pickle is described instead
        e = BackendError(f"{type(e).__name__}: {e}")
    e.add_note(note)
    return e


# --------------------------------------------------------------------------------------- child
class _Server:
    """A child's side: its shard's database (``RocksDBStore(only=shard)``), the groups open in it (by
    the ids the parent gave them) and the scans in progress."""

    def __init__(self, spec, shard: int) -> None:
        self.spec, self.shard = spec, shard
        self.store = None
        self.groups: dict[int, GroupStore] = {}
        self.scans: dict[int, Iterator] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()

    def open(self, tables: list[str], width: int, dtype: torch.dtype) -> GroupStore:
        from tieredemb.storage.rocksdb import RocksDBGroup, RocksDBStore

        spec = self.spec
        if self.store is None or self.store.closed:
            self.store = RocksDBStore(spec.path, spec.shards, spec.disk_options(), only=self.shard)
        opened = []
        try:
            for t in tables:
                opened.append(self.store.open_table(t, width, spec.existing, dtype))
        except BaseException:
            for backend in opened:
                backend.close()
            raise
        return RocksDBGroup(opened)

    def call(self, gid: int, target: int | None, verb: str, args: tuple) -> Any:
        """``verb`` of group ``gid`` (``target`` None), of its table ``target``, or of scan ``target``
        (``next``, ``drop``); ``open`` and ``close`` open and close the group."""
        if verb == "open":
            group = self.open(*args)
            with self.lock:
                self.groups[gid] = group
            return None
        with self.lock:
            group = self.groups[gid]
        if target is None:
            if verb == "close":
                with self.lock:
                    del self.groups[gid]
                group.close()
                return None
            if verb not in _GROUP_VERBS:
                raise ValueError(f"StoreProcess: no group verb {verb!r}")
            return getattr(group, verb)(*args)
        if verb in ("scan", "scan_keys"):
            it = iter(getattr(group.table(target), verb)(*args))
            with self.lock:
                sid = next(self.ids)
                self.scans[sid] = it
            return sid
        if verb == "next":
            with self.lock:
                it = self.scans.get(target)
            if it is None:
                raise BackendError("the scan was of a store process that was started again since: scan again")
            chunk = next(it, None)
            if chunk is None:
                self.drop(target)
            return chunk
        if verb == "drop":
            self.drop(target)
            return None
        if verb not in _TABLE_VERBS:
            raise ValueError(f"StoreProcess: no table verb {verb!r}")
        return getattr(group.table(target), verb)(*args)

    def drop(self, sid: int) -> None:
        with self.lock:
            self.scans.pop(sid, None)

    def session(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    request = _recv(conn)
                except (EOFError, OSError):
                    return
                try:
                    reply = ("ok", self.call(*request))
                except Exception as e:  # noqa: BLE001 - raised in the caller
                    reply = ("err", _portable(e))
                try:
                    _send(conn, reply)
                except OSError:
                    return

    def close(self) -> None:
        """Every group still open closed (the parent died, or left them)."""
        for group in list(self.groups.values()):
            group.close()


def _serve() -> None:
    """A child's main: serve the spec and shard its stdin gives on the socket it names, say so on
    stdout, until stdin ends; then close what is open."""
    spec, shard, path = pickle.load(sys.stdin.buffer)
    torch.set_num_threads(1)
    server = _Server(spec, shard)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=server.session, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.buffer.flush()
    sys.stdin.buffer.read()  # until the parent closes it, or dies
    code = 0
    try:
        server.close()
    except Exception:  # noqa: BLE001 - the exit code tells the parent
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)  # (the sessions' threads may still be blocked in a read)


# -------------------------------------------------------------------------------------- parent
class _Child:
    """One shard's process, with a connection per calling thread."""

    def __init__(self, shard: int, directory: str) -> None:
        self.shard, self.dir = shard, directory
        self.lock = threading.RLock()
        self.local = threading.local()
        self.sockets: list[socket.socket] = []
        self.generation = 0
        self.process: subprocess.Popen | None = None

    def spawn(self, spec) -> None:
        """Start it (``ready`` waits for it: children start side by side)."""
        self.generation += 1
        self.path = os.path.join(self.dir, f"shard-{self.shard}-{self.generation}")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.process = subprocess.Popen([sys.executable, "-m", "tieredemb.storage.store_process"], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        with contextlib.suppress(OSError):  # (a child that died at once: ``ready`` says so)
            self.process.stdin.write(pickle.dumps((spec, self.shard, self.path)))
            self.process.stdin.flush()

    def ready(self) -> None:
        try:
            ok = self.process.stdout.readline() == b"ready\n"
        except OSError:
            ok = False
        if not ok:
            self.stop()
            raise BackendError(f"the process of store shard {self.shard} did not start (exit code "
                               f"{self.process.returncode})")

    def stop(self) -> int:
        """Close its stdin (it closes what is open and exits) and wait: its exit code."""
        with self.lock:
            for sock in self.sockets:
                sock.close()
            self.sockets = []
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def forget(self) -> None:
        """This thread's connection closed (broken, or owing an answer no one will read)."""
        sock = getattr(self.local, "sock", None)
        if sock is not None:
            self.local.sock = None
            sock.close()

    def socket(self) -> socket.socket:
        """This thread's connection to the current process."""
        sock = getattr(self.local, "sock", None)
        if sock is None or self.local.generation != self.generation:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.path)
            self.local.sock, self.local.generation = sock, self.generation
            with self.lock:
                self.sockets.append(sock)
        return sock


class _Shards:
    """A spec's store as its shards' processes, shared by the groups opened from the spec (one
    process may open a RocksDB database); the open groups' ``open`` arguments, to open them again."""

    def __init__(self, spec) -> None:
        from tieredemb.storage.rocksdb import check_meta

        self.spec = dataclasses.replace(spec, process=False)
        self.groups: dict[int, tuple] = {}
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.dir = tempfile.mkdtemp(prefix="tieredemb-store-")
        self.children = [_Child(s, self.dir) for s in range(spec.shards)]
        try:
            os.makedirs(spec.path, exist_ok=True)
            check_meta(os.path.abspath(spec.path), spec.shards)  # before the shards (no race to make it)
            for child in self.children:
                child.spawn(self.spec)
            for child in self.children:
                child.ready()
        except BaseException:
            self.shut_down()
            raise

    def fan(self, parts: dict[int, tuple], again: bool = True) -> dict[int, Any]:
        """Each shard's request (gid, target, verb, args) sent, then every answer read: the shards
        work side by side. The first error raised once all have answered; a shard whose process is
        gone is started again and asked once more (``again``)."""
        owing: dict[int, tuple[socket.socket, int]] = {}  # sent, answer not read yet
        answers, errors, gone = {}, [], []
        try:
            for s, request in parts.items():
                child, generation = self.children[s], self.children[s].generation
                try:
                    sock = child.socket()
                    _send(sock, request)
                    owing[s] = (sock, generation)
                except OSError as e:
                    child.forget()
                    gone.append((s, generation, e))
            for s in list(owing):
                sock, generation = owing[s]
                try:
                    status, value = _recv(sock)
                except (OSError, EOFError) as e:
                    status, value = "gone", e
                del owing[s]
                if status == "gone":
                    self.children[s].forget()
                    gone.append((s, generation, value))
                elif status == "err":
                    errors.append(value)
                else:
                    answers[s] = value
        finally:  # interrupted (a KeyboardInterrupt): the connections owing an answer are dropped
            for s in owing:
                self.children[s].forget()
        for s, generation, e in gone:
            if not again:
                errors.append(BackendError(f"the process of store shard {s} is gone ({e}; exit code "
                                           f"{self.children[s].process.poll()})"))
                continue
            try:
                self._restart(s, generation, e)
                answers.update(self.fan({s: parts[s]}, again=False))
            except BaseException as err:  # noqa: BLE001 - raised below, after the others
                errors.append(err)
        if errors:
            raise errors[0]
        return answers

    def everywhere(self, gid: int, target, verb: str, *args: Any, again: bool = True) -> list:
        """``verb`` on every shard, the answers in shard order."""
        answers = self.fan({s: (gid, target, verb, args) for s in range(len(self.children))}, again)
        return [answers[s] for s in range(len(self.children))]

    def open_group(self, tables: list[str], width: int, dtype: torch.dtype) -> int:
        gid = next(self.ids)
        args = (list(tables), width, dtype)
        try:
            self.everywhere(gid, None, "open", *args)
        except BaseException:
            with contextlib.suppress(Exception):  # the shards that opened it close it again
                self.fan({s: (gid, None, "close", ()) for s in range(len(self.children))}, again=False)
            raise
        with self.lock:
            self.groups[gid] = args
        return gid

    def close_group(self, gid: int) -> None:
        """The group closed in every shard; the processes gone once no group is left."""
        try:
            self.everywhere(gid, None, "close", again=False)
        finally:
            with self.lock:
                self.groups.pop(gid, None)
                last = not self.groups
            if last:
                self.shut_down()

    def shut_down(self) -> None:
        try:
            codes = [child.stop() for child in self.children if child.process is not None]
            if any(codes):
                raise BackendError(f"store processes failed while closing the store (exit codes {codes})")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _restart(self, s: int, generation: int, cause: BaseException) -> None:
        """Shard ``s``'s process started again with the open groups (its rows as the old one left
        them), unless another thread started one since ``generation``."""
        child = self.children[s]
        with child.lock:
            if child.generation != generation:
                return
            child.stop()
            # the rows are there: never "clear" them, never refuse them
            self.spec = dataclasses.replace(self.spec, existing="reuse")
            try:
                child.spawn(self.spec)
                child.ready()
                for gid, args in list(self.groups.items()):
                    sock = child.socket()
                    _send(sock, (gid, None, "open", args))
                    status, value = _recv(sock)
                    if status == "err":
                        raise value
            except Exception as e:
                raise BackendError(f"the process of store shard {s} died ({cause}) and could not be "
                                   f"started again: {e}") from e


class StoreProcess(GroupStore):
    """A table group of a RocksDB store served by a process per shard (module docstring); calls from
    any thread. Opened by ``te.storage.RocksDB(process=True)``: the groups of one spec share its
    processes (kept in ``shared``, the spec's)."""

    def __init__(self, spec, tables: list[str], width: int, dtype: torch.dtype = torch.float32,
                 shared: dict | None = None) -> None:
        shared = {} if shared is None else shared
        shards = shared.get("process")
        if shards is None or not shards.groups:
            shards = _Shards(spec)
        self._shards = shards
        try:
            self._gid = shards.open_group(tables, width, dtype)
        except BaseException:
            if not shards.groups:
                shards.shut_down()
            raise
        shared["process"] = shards
        self._closed = False
        super().__init__([_RemoteTable(self, t, width, dtype) for t in range(len(tables))])

    def split(self, target: int | None, verb: str, keys: torch.Tensor,
              *per_key: torch.Tensor) -> tuple[list[tuple[int, torch.Tensor]], dict[int, Any]]:
        """``verb`` of each shard's keys (and their rows of ``per_key``): [(shard, positions)] and
        the answers by shard."""
        from tieredemb.storage.rocksdb import shard_of

        if self._closed:
            raise BackendError("this store is closed")
        keys = keys.reshape(-1).to(torch.int64).cpu()
        per_key = tuple(t.cpu() for t in per_key)
        shard = torch.from_numpy(shard_of(keys, len(self._shards.children)))
        order = torch.argsort(shard, stable=True)
        counts = torch.bincount(shard, minlength=len(self._shards.children)).tolist()
        where = [(s, pos) for s, pos in enumerate(torch.split(order, counts)) if pos.numel()]
        parts = {s: (self._gid, target, verb, (keys[pos], *(t[pos] for t in per_key))) for s, pos in where}
        return where, self._shards.fan(parts)

    def gathered(self, target: int | None, keys: torch.Tensor, *per_key: torch.Tensor) -> Fetched:
        """``get`` split by shard and put back in the keys' order."""
        where, answers = self.split(target, "get", keys, *per_key)
        n = keys.numel()
        rows = torch.zeros(n, self.width, dtype=self.dtype)
        found = torch.zeros(n, dtype=torch.bool)
        for s, pos in where:
            rows[pos], found[pos] = answers[s].rows, answers[s].found
        return Fetched(rows, found)

    def everywhere(self, target, verb: str, *args: Any) -> list:
        if self._closed:
            raise BackendError("this store is closed")
        return self._shards.everywhere(self._gid, target, verb, *args)

    def get(self, keys: torch.Tensor, tables: torch.Tensor) -> Fetched:
        return self.gathered(None, keys, tables)

    def set(self, keys: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
            distinct: bool = False) -> None:
        self.split(None, "set", keys, tables, rows.reshape(-1, self.width))

    def delete(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        self.split(None, "delete", keys, tables)

    def read_ahead(self, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """Nothing: no tier in front of the store to read into."""

    def flush(self) -> None:
        self.everywhere(None, "flush")

    def close(self) -> None:
        """The group closed in every shard (what that raises is raised here); the processes gone
        with the spec's last group."""
        if not self._closed:
            self._closed = True
            self._shards.close_group(self._gid)


class _RemoteTable(Backend):
    """Table ``t`` of a ``StoreProcess``."""

    def __init__(self, group: StoreProcess, t: int, width: int, dtype: torch.dtype) -> None:
        self.group, self.t = group, t
        self.width, self.dtype, self.device = width, dtype, torch.device("cpu")

    def get(self, keys: torch.Tensor) -> Fetched:
        return self.group.gathered(self.t, keys)

    def set(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        self.group.split(self.t, "set", keys, rows.reshape(-1, self.width))

    def delete(self, keys: torch.Tensor) -> None:
        self.group.split(self.t, "delete", keys)

    def scan(self, chunk_rows: int = 65536) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self._chunks("scan", chunk_rows)

    def scan_keys(self, chunk_rows: int = 65536) -> Iterator[torch.Tensor]:
        return self._chunks("scan_keys", chunk_rows)

    def _chunks(self, verb: str, chunk_rows: int) -> Iterator:
        """Shard after shard, each through its process's ``verb`` (``scan`` or ``scan_keys``)."""
        shards, gid = self.group._shards, self.group._gid
        for s in range(len(shards.children)):
            sid = shards.fan({s: (gid, self.t, verb, (chunk_rows,))})[s]
            done = False
            try:
                while (chunk := shards.fan({s: (gid, sid, "next", ())}, again=False)[s]) is not None:
                    yield chunk
                done = True
            finally:
                if not done:  # left early: the process drops it
                    with contextlib.suppress(BackendError):
                        shards.fan({s: (gid, sid, "drop", ())}, again=False)

    def size(self) -> int:
        return sum(self.group.everywhere(self.t, "size"))

    def flush(self) -> None:
        self.group.everywhere(self.t, "flush")

    def index_bytes(self) -> dict[str, int]:
        return add_bytes(*self.group.everywhere(self.t, "index_bytes"))


if __name__ == "__main__":
    _serve()
