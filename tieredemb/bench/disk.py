"""The disk's own speed, measured on the file system of a directory (the ``ssd`` bench's store).

Three figures, all with ``O_DIRECT`` (around the page cache) on one file of ``file_bytes``:

    sequential write   ``block_bytes`` blocks from one thread, then ``fsync`` (timed with it)
    sequential read    the same file back in ``block_bytes`` blocks
    random reads       4 KiB reads at random 4 KiB-aligned offsets from ``threads`` threads for
                       ``read_s`` seconds: reads per second (IOPS) and bytes per second

``O_DIRECT`` needs buffers aligned to the device's block: they come from anonymous ``mmap`` (page
aligned), and every offset and size is a multiple of 4 KiB. Where the file system refuses
``O_DIRECT`` (``EINVAL``; some container and network file systems), the figures are taken with
buffered I/O instead, each phase's pages dropped from the page cache (``posix_fadvise``) before the
next, and ``DiskFigures.note`` says so: reads may then still come from memory.

The random reads are issued from Python threads (each ``preadv`` releases the GIL): the figure is
what this process reaches, a lower bound of the disk's.

A training step that misses ``m`` rows and writes ``w`` bytes down cannot take less than
``m / IOPS + w / sequential write`` on this disk (``step_floor``): each miss is a random read of a
block, the writes are appended (a log-structured store). How many reads reached the disk during a
run is counted by the kernel (``disk_io``: ``/proc/diskstats`` of the machine's disks): rows a block
cache or the page cache served are not among them.
"""

from __future__ import annotations

import errno
import mmap
import os
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np

FILE_BYTES = 4 << 30  # the file at full scale
BLOCK_BYTES = 4 << 20  # sequential I/O unit
READ_BYTES = 4096  # one random read
THREADS = 32
READ_S = 3.0  # random reads at full scale


@dataclass
class DiskFigures:
    """What ``measure_disk`` measured. ``direct``: with ``O_DIRECT`` (else ``note`` says why not)."""

    directory: str
    file_system: str | None
    direct: bool
    note: str | None
    file_bytes: int
    block_bytes: int
    seq_write_bytes_per_s: float
    seq_read_bytes_per_s: float
    random_read_threads: int
    random_read_bytes: int
    random_reads: int
    random_read_iops: float
    random_read_bytes_per_s: float

    def line(self) -> str:
        how = "O_DIRECT" if self.direct else "buffered (O_DIRECT refused)"
        return (f"disk ({how}, {self.file_system or 'file system unknown'} at {self.directory}, "
                f"file {self.file_bytes / 1e9:.3g} GB): sequential write "
                f"{self.seq_write_bytes_per_s / 1e9:.3g} GB/s, read {self.seq_read_bytes_per_s / 1e9:.3g} "
                f"GB/s in {self.block_bytes >> 20} MiB blocks; random {self.random_read_bytes >> 10} KiB "
                f"reads {self.random_read_iops:.3g} IOPS ({self.random_read_bytes_per_s / 1e9:.3g} GB/s) "
                f"from {self.random_read_threads} threads")


def step_floor(disk: DiskFigures, misses_per_step: float, written_bytes_per_step: float,
               step_ms: float | None) -> dict:
    """The least time a step with these misses and writes can take on ``disk`` (module docstring)."""
    reads_ms = misses_per_step / disk.random_read_iops * 1e3
    writes_ms = written_bytes_per_step / disk.seq_write_bytes_per_s * 1e3
    floor = reads_ms + writes_ms
    return {"floor_ms": floor, "reads_ms": reads_ms, "writes_ms": writes_ms,
            "misses_per_step": misses_per_step, "written_bytes_per_step": written_bytes_per_step,
            "step_ms": step_ms,  # (a floor under 0.05 ms: a step that moved next to nothing: no ratio)
            "step_over_floor": step_ms / floor if step_ms and floor >= 0.05 else None}


def floor_line(f: dict) -> str:
    over = f"; the step {f['step_ms']:.3f} ms is {f['step_over_floor']:.2f}x it" if f["step_over_floor"] \
        else ""
    return (f"disk floor of ours' step: {f['floor_ms']:.3f} ms ({f['misses_per_step']:.0f} misses / random "
            f"read IOPS = {f['reads_ms']:.3f} ms + {f['written_bytes_per_step'] / 1e6:.2f} MB written / "
            f"sequential write = {f['writes_ms']:.3f} ms){over}")


def disk_io(stats: str = "/proc/diskstats", blocks: str = "/sys/block") -> dict[str, int] | None:
    """The machine's disks' counters, summed (``/proc/diskstats``; whole disks, those ``/sys/block``
    lists, not their partitions, device-mapper, RAM or loop devices): reads and writes completed,
    bytes read and written. None where the kernel does not say (not Linux)."""
    try:
        disks = {d for d in os.listdir(blocks) if not d.startswith(_VIRTUAL)}
        with open(stats) as f:
            lines = [line.split() for line in f]
    except OSError:
        return None
    out = {"reads": 0, "read_bytes": 0, "writes": 0, "write_bytes": 0}
    for fields in lines:
        if len(fields) >= 10 and fields[2] in disks:  # sectors are 512 bytes in this file
            out["reads"] += int(fields[3])
            out["read_bytes"] += int(fields[5]) * 512
            out["writes"] += int(fields[7])
            out["write_bytes"] += int(fields[9]) * 512
    return out


def io_between(before: dict[str, int] | None, after: dict[str, int] | None, steps: int) -> dict | None:
    """``disk_io`` counters over ``steps`` steps: a step's share of each."""
    if before is None or after is None or steps <= 0:
        return None
    return {k: (after[k] - before[k]) / steps for k in before}


_VIRTUAL = ("loop", "ram", "zram", "dm-", "md", "sr", "nbd")


def measure_disk(directory: str, file_bytes: int = FILE_BYTES, threads: int = THREADS,
                 read_s: float = READ_S, block_bytes: int = BLOCK_BYTES, seed: int = 0) -> DiskFigures:
    """The disk under ``directory``: sequential write and read, random 4 KiB reads (module
    docstring). The file is made in ``directory`` and removed after."""
    _check(directory, file_bytes, threads, read_s, block_bytes)
    file_bytes -= file_bytes % block_bytes
    fd, path = tempfile.mkstemp(prefix=".tieredemb-disk-", dir=directory)
    os.close(fd)
    direct, note = hasattr(os, "O_DIRECT"), None
    try:
        try:
            write_s = _write(path, file_bytes, block_bytes, direct)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            direct = False
            note = (f"the file system of {directory} refuses O_DIRECT ({e.strerror}): buffered I/O, "
                    f"the page cache dropped between phases; reads may still come from memory")
            write_s = _write(path, file_bytes, block_bytes, direct)
        if note is None and not direct:
            note = "this OS has no O_DIRECT: buffered I/O, the page cache dropped between phases"
        read_s_seq = _read(path, block_bytes, direct)
        reads, secs = _random_reads(path, file_bytes, threads, read_s, direct, seed)
    finally:
        os.unlink(path)
    return DiskFigures(os.path.abspath(directory), _file_system(directory), direct, note, file_bytes,
                       block_bytes, file_bytes / write_s, file_bytes / read_s_seq, threads, READ_BYTES,
                       reads, reads / secs, reads * READ_BYTES / secs)


def _check(directory: str, file_bytes: int, threads: int, read_s: float, block_bytes: int) -> None:
    if not os.path.isdir(directory):
        raise ValueError(f"disk measurement: {directory!r} is not a directory")
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0 \
            or block_bytes % READ_BYTES:
        raise ValueError(f"disk measurement: block_bytes must be a positive multiple of {READ_BYTES}, "
                         f"got {block_bytes!r}")
    if isinstance(file_bytes, bool) or not isinstance(file_bytes, int) or file_bytes < block_bytes:
        raise ValueError(f"disk measurement: file_bytes must be an int >= block_bytes ({block_bytes}), "
                         f"got {file_bytes!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 256:
        raise ValueError(f"disk measurement: threads must be an int in [1, 256], got {threads!r}")
    if not isinstance(read_s, (int, float)) or isinstance(read_s, bool) or not read_s > 0:
        raise ValueError(f"disk measurement: read_s must be a number > 0, got {read_s!r}")


def _open(path: str, flags: int, direct: bool) -> int:
    return os.open(path, flags | (os.O_DIRECT if direct else 0))


def _drop_cached(fd: int, direct: bool) -> None:
    """Buffered I/O: the file's pages out of the page cache, so the next phase reads the disk."""
    if not direct and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _write(path: str, file_bytes: int, block_bytes: int, direct: bool) -> float:
    """Seconds to write ``file_bytes`` of random bytes in blocks, fsync included."""
    buf = mmap.mmap(-1, block_bytes)  # page aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(1).bytes(block_bytes))  # incompressible
    fd = _open(path, os.O_WRONLY | os.O_TRUNC, direct)
    try:
        t0 = time.perf_counter()
        for _ in range(file_bytes // block_bytes):
            if os.write(fd, buf) != block_bytes:
                raise OSError(errno.EIO, f"short write to {path}")
        os.fsync(fd)
        elapsed = time.perf_counter() - t0
        _drop_cached(fd, direct)
        return elapsed
    finally:
        os.close(fd)
        buf.close()


def _read(path: str, block_bytes: int, direct: bool) -> float:
    """Seconds to read the file from start to end in blocks."""
    buf = mmap.mmap(-1, block_bytes)
    fd = _open(path, os.O_RDONLY, direct)
    try:
        t0 = time.perf_counter()
        while os.readv(fd, [buf]) == block_bytes:
            pass
        elapsed = time.perf_counter() - t0
        _drop_cached(fd, direct)
        return elapsed
    finally:
        os.close(fd)
        buf.close()


def _random_reads(path: str, file_bytes: int, threads: int, read_s: float, direct: bool,
                  seed: int) -> tuple[int, float]:
    """(reads done, seconds) of ``threads`` threads reading random 4 KiB blocks for ``read_s``."""
    fd = _open(path, os.O_RDONLY, direct)
    blocks = file_bytes // READ_BYTES
    counts = [0] * threads
    errors: list[BaseException] = []
    start = threading.Barrier(threads + 1)
    deadline = [0.0]

    def reader(i: int) -> None:
        buf = mmap.mmap(-1, READ_BYTES)
        rng = np.random.default_rng(seed * 1009 + i)
        try:
            start.wait()
            while time.perf_counter() < deadline[0]:
                for offset in (rng.integers(0, blocks, 64) * READ_BYTES).tolist():
                    os.preadv(fd, [buf], offset)
                counts[i] += 64
        except BaseException as e:  # noqa: BLE001 - raised by the caller below
            errors.append(e)
        finally:
            buf.close()

    pool = [threading.Thread(target=reader, args=(i,), name=f"tieredemb-disk-{i}") for i in range(threads)]
    try:
        for t in pool:
            t.start()
        t0 = time.perf_counter()
        deadline[0] = t0 + read_s
        start.wait()
        for t in pool:
            t.join()
        elapsed = time.perf_counter() - t0
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return sum(counts), elapsed


def _file_system(directory: str) -> str | None:
    """The type of the file system holding ``directory`` (from /proc/mounts; None elsewhere)."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        return None
    real = os.path.realpath(directory)
    best = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best[1] if best else None


__all__ = ["DiskFigures", "floor_line", "measure_disk", "step_floor"]
