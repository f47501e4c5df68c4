"""The disk measurement of the ``ssd`` bench (``tieredemb.bench.disk``): sane figures on a real
directory, the buffered fallback where O_DIRECT is refused, refusals of bad arguments, the floor."""

from __future__ import annotations

import errno
import math
import os

import pytest

from tieredemb.bench import disk
from tieredemb.bench.disk import DiskFigures, measure_disk, step_floor

MiB = 1 << 20


def _sane(f: DiskFigures) -> None:
    for name in ("seq_write_bytes_per_s", "seq_read_bytes_per_s", "random_read_iops",
                 "random_read_bytes_per_s"):
        x = getattr(f, name)
        assert math.isfinite(x) and 0 < x < 1e12, f"{name} = {x}"  # below 1 TB/s: units right
    assert f.random_reads > 0 and f.random_read_bytes == 4096
    assert f.random_read_bytes_per_s == pytest.approx(f.random_read_iops * 4096)
    assert f.file_bytes % f.block_bytes == 0


def test_figures_on_a_directory(tmp_path):
    f = measure_disk(str(tmp_path), 8 * MiB, threads=16, read_s=0.3, block_bytes=MiB)
    _sane(f)
    assert f.file_bytes == 8 * MiB and f.random_read_threads == 16
    assert f.directory == str(tmp_path)
    assert (f.note is None) == f.direct  # a fallback always says so
    assert os.listdir(tmp_path) == []  # the file is removed
    assert "GB/s" in f.line() and "IOPS" in f.line()


def test_random_reads_are_aligned_4k_reads_over_the_whole_file(tmp_path, monkeypatch):
    offsets: list[int] = []
    preadv = os.preadv

    def recording(fd, buffers, offset):
        assert [len(b) for b in buffers] == [4096]
        offsets.append(offset)
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "preadv", recording)
    f = measure_disk(str(tmp_path), 4 * MiB, threads=4, read_s=0.2, block_bytes=MiB)
    assert len(offsets) == f.random_reads
    assert all(o % 4096 == 0 and 0 <= o < 4 * MiB for o in offsets)
    assert len(set(offsets)) > 200  # spread over the file's 1024 blocks, not one block again


@pytest.mark.parametrize("where", ["open", "write"])
def test_refused_o_direct_falls_back_to_buffered_io_with_a_note(tmp_path, monkeypatch, where):
    """What a file system without O_DIRECT does: EINVAL at the open, or (some) at the first write."""
    real_open, real_write, real_close = os.open, os.write, os.close
    direct_fds: set[int] = set()  # open with O_DIRECT (a number closed is given out again)

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT and where == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def refusing_write(fd, data):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    def close(fd):
        direct_fds.discard(fd)
        real_close(fd)

    monkeypatch.setattr(disk.os, "open", refusing_open)
    monkeypatch.setattr(disk.os, "write", refusing_write)
    monkeypatch.setattr(disk.os, "close", close)
    f = measure_disk(str(tmp_path), 4 * MiB, threads=4, read_s=0.2, block_bytes=MiB)
    assert not f.direct
    assert "refuses O_DIRECT" in f.note and str(tmp_path) in f.note
    assert "buffered" in f.line()
    _sane(f)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_a_memory_file_system_answers_too():
    """tmpfs: O_DIRECT is refused on older kernels (the note) and accepted on newer ones."""
    f = measure_disk("/dev/shm", 4 * MiB, threads=4, read_s=0.2, block_bytes=MiB)
    _sane(f)
    assert f.file_system == "tmpfs"
    assert (f.note is None) == f.direct


def test_other_errors_are_raised_and_the_file_removed(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        measure_disk(str(tmp_path), 4 * MiB, threads=2, read_s=0.1, block_bytes=MiB)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(file_bytes=MiB // 2), "file_bytes must be an int >= block_bytes"),
        (dict(block_bytes=1000), "block_bytes must be a positive multiple of 4096"),
        (dict(threads=0), r"threads must be an int in \[1, 256\]"),
        (dict(threads=True), r"threads must be an int in \[1, 256\]"),
        (dict(read_s=0), "read_s must be a number > 0"),
    ],
)
def test_bad_arguments_are_refused_before_any_file(tmp_path, kw, match):
    args = dict(file_bytes=4 * MiB, threads=2, read_s=0.1, block_bytes=MiB) | kw
    with pytest.raises(ValueError, match=match):
        measure_disk(str(tmp_path), **args)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="is not a directory"):
        measure_disk(str(tmp_path / "missing"))


def test_step_floor_is_reads_over_iops_plus_writes_over_bandwidth():
    f = DiskFigures("/d", "ext4", True, None, 1 << 30, 4 * MiB, seq_write_bytes_per_s=2e9,
                    seq_read_bytes_per_s=3e9, random_read_threads=32, random_read_bytes=4096,
                    random_reads=1000, random_read_iops=250_000.0, random_read_bytes_per_s=1.024e9)
    floor = step_floor(f, misses_per_step=50_000, written_bytes_per_step=100e6, step_ms=1000.0)
    assert floor["reads_ms"] == pytest.approx(200.0)  # 50k reads at 250k/s
    assert floor["writes_ms"] == pytest.approx(50.0)  # 100 MB at 2 GB/s
    assert floor["floor_ms"] == pytest.approx(250.0) and floor["step_over_floor"] == pytest.approx(4.0)
    assert "250.000 ms" in disk.floor_line(floor) and "4.00x" in disk.floor_line(floor)


def test_disk_io_sums_whole_disks_only(tmp_path) -> None:
    """``disk_io`` reads the kernel's counters of the disks ``/sys/block`` lists (here a fake of both):
    partitions, loop and device-mapper devices are left out; sectors are 512 bytes."""
    from tieredemb.bench.disk import disk_io, io_between

    blocks = tmp_path / "block"
    for name in ("vda", "nvme0n1", "loop0", "dm-0"):
        (blocks / name).mkdir(parents=True)
    stats = tmp_path / "diskstats"
    rows = {"vda": (10, 3, 80, 7, 5, 2, 40, 9), "vda1": (99,) * 8, "nvme0n1": (1, 0, 8, 1, 2, 0, 16, 1),
            "loop0": (50,) * 8, "dm-0": (70,) * 8}
    stats.write_text("".join(f"   8       0 {name} {' '.join(map(str, v))} 0 0 0 0\n"
                             for name, v in rows.items()))
    got = disk_io(str(stats), str(blocks))
    assert got == {"reads": 11, "read_bytes": 88 * 512, "writes": 7, "write_bytes": 56 * 512}
    assert io_between(got, {k: v + 4 for k, v in got.items()}, 2) == {k: 2.0 for k in got}
    assert io_between(None, got, 2) is None
    assert disk_io(str(tmp_path / "absent"), str(blocks)) is None
