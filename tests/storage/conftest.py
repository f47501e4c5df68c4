"""Private redis-server processes for the storage tests.

``redis_server`` yields the URL of a fresh server on a free port (``--save '' --appendonly no``,
its own temp dir) and kills it afterwards; ``redis_factory`` starts more, with extra arguments
(a password, a memory limit), and gives the ``RedisServer`` handles (stop / start again on the same
port); ``redis_cluster`` yields the URL of one node of a 3-node Redis Cluster.

Without ``redis-server`` on PATH the Redis tests are skipped on a laptop and FAIL in CI (env ``CI``
set): ``.ci/run`` must install it (``apt-get install -y redis-server``).

``tmpfs`` mounts small tmpfs file systems (a disk that fills up, then grows; made read-only or
immutable, then writable again) and unmounts them at teardown, also when the test failed. It needs
root (CAP_SYS_ADMIN): without it the tests skip on a laptop and FAIL in CI, which runs as root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skip_or_fail(message: str) -> None:
    """Skip on a laptop; in CI (env ``CI`` set) a missing capability is a failure, never a skip."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        _skip_or_fail("redis-server is not installed: .ci/run must install it "
                      "(apt-get install -y redis-server) for the Redis backend tests")
    return path


class RedisServer:
    """One redis-server subprocess on 127.0.0.1; ``stop()`` and ``start()`` keep its port."""

    def __init__(self, binary: str, workdir: str, args: tuple[str, ...] = ()) -> None:
        self.binary = binary
        self.port = _free_port()
        self.workdir = os.path.join(workdir, f"redis-{self.port}")
        os.makedirs(self.workdir, exist_ok=True)
        self.args = args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--dir", self.workdir, *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {' '.join(cmd)}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"redis-server did not listen on port {self.port} within {timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cli(self, *command: str | int) -> object:
        """Run one command on a client of its own (with the server's password if it has one)."""
        import redis

        password = None
        if "--requirepass" in self.args:
            password = self.args[self.args.index("--requirepass") + 1]
        client = redis.Redis(port=self.port, password=password, socket_timeout=5)
        try:
            return client.execute_command(*command)
        finally:
            client.close()


class _Servers:
    """Starts RedisServers under one directory and kills them all on ``stop_all``."""

    def __init__(self, workdir: str) -> None:
        self.binary = _redis_binary()
        self.workdir = workdir
        self.servers: list[RedisServer] = []

    def start(self, *args: str) -> RedisServer:
        server = RedisServer(self.binary, self.workdir, tuple(args))
        self.servers.append(server)
        server.start()
        return server

    def stop_all(self) -> None:
        for server in self.servers:
            server.stop()


@pytest.fixture
def redis_factory(tmp_path) -> Iterator:
    """start(*args) -> a running RedisServer; every one is killed at teardown."""
    servers = _Servers(str(tmp_path))
    yield servers.start
    servers.stop_all()


@pytest.fixture
def redis_server(redis_factory) -> str:
    """The URL of a fresh private redis-server."""
    return redis_factory().url


@pytest.fixture(scope="module")
def _cluster_nodes(tmp_path_factory) -> Iterator[list[RedisServer]]:
    """A 3-node Redis Cluster (slots split evenly, no replicas), shared by a test module: forming
    one takes about 2 s of gossip."""
    servers = _Servers(str(tmp_path_factory.mktemp("cluster")))
    bus_ports = [_free_port() for _ in range(3)]  # the cluster bus: not port + 10000, may be taken
    nodes = [servers.start("--cluster-enabled", "yes", "--cluster-port", str(bus),
                           "--cluster-node-timeout", "2000") for bus in bus_ports]
    bounds = [0, 5461, 10923, 16384]
    for node, lo, hi in zip(nodes, bounds[:-1], bounds[1:]):
        node.cli("CLUSTER", "ADDSLOTSRANGE", lo, hi - 1)
    for node, bus in zip(nodes[1:], bus_ports[1:]):
        nodes[0].cli("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
    deadline = time.monotonic() + 20
    while True:
        infos = [node.cli("CLUSTER", "INFO") for node in nodes]
        infos = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
        if all("cluster_state:ok" in i and "cluster_known_nodes:3" in i for i in infos):
            break
        if time.monotonic() > deadline:
            servers.stop_all()
            pytest.fail("the 3-node Redis Cluster did not reach cluster_state:ok within 20 s")
        time.sleep(0.05)
    yield nodes
    servers.stop_all()


@pytest.fixture
def redis_cluster(_cluster_nodes) -> str:
    """The URL of one node of the module's 3-node Redis Cluster, emptied for this test."""
    for node in _cluster_nodes:
        node.cli("FLUSHALL")
    return _cluster_nodes[0].url


# ------------------------------------------------------------------------------------------- tmpfs
def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


def remount(where: str, options: str) -> None:
    """Change a mounted tmpfs in place: ``"size=64m"`` (the disk grows), ``"ro"``, ``"rw"``."""
    done = _run("mount", "-o", f"remount,{options}", where)
    assert done.returncode == 0, f"remount {options} of {where}: {done.stderr.strip()}"


def immutable(path: str, on: bool) -> None:
    """``chattr +i`` / ``-i``: an immutable directory refuses new files, also to root."""
    done = _run("chattr", "+i" if on else "-i", path)
    if done.returncode != 0:
        _skip_or_fail(f"chattr {'+' if on else '-'}i {path} failed: {done.stderr.strip()}")


@pytest.fixture
def tmpfs(tmp_path) -> Iterator:
    """mount(size, read_only=False) -> the path of a fresh tmpfs of ``size`` ("2m"); every one is
    unmounted at teardown (its files are gone with it, immutable ones too)."""
    mounted: list[str] = []

    def mount(size: str, read_only: bool = False) -> str:
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        done = _run("mount", "-t", "tmpfs", "-o", f"size={size}" + (",ro" if read_only else ""),
                    "tmpfs", str(where))
        if done.returncode != 0:
            _skip_or_fail(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        mounted.append(str(where))
        return str(where)

    yield mount
    for where in reversed(mounted):
        _run("umount", "-l", where)
