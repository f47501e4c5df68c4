"""``tieredemb bench checkpoint``: save and load throughput of ``te.checkpoint`` against the disk.

    tieredemb bench checkpoint [--rows N] [--dim D] [--dir DIR] [--buffer-mib M] [--device cpu|cuda]

Measures, in one run on the disk holding ``--dir``: the disk's sequential write speed (1 GiB in 8 MiB
blocks, fsync) and read speed (the same file, read back: the page cache may serve it), then saves and
loads one Adam table of ``rows`` x ``dim`` (rows of weights + two moments) held in device memory
(``hbm_direct``) and in a device cache over RocksDB on the same disk. Prints a table and writes a
JSON report.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

import tieredemb as te
from tieredemb.bench.report import machine_info, report_path, write_report


def _disk_speed(directory: Path, total: int = 1 << 30, block: int = 8 << 20) -> tuple[float, float]:
    """(write, read) bytes/s of a sequential file of ``total`` bytes under ``directory``."""
    path = directory / "disk-probe.bin"
    buf = os.urandom(block)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(total // block):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    write = total / (time.perf_counter() - start)
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(block):
            pass
    read = total / (time.perf_counter() - start)
    path.unlink()
    return write, read


class _Holder(torch.nn.Module):
    def __init__(self, ebc: te.EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc


def _table(rows: int, dim: int, storage, device: torch.device) -> _Holder:
    ebc = te.EmbeddingBagCollection([te.TableConfig("t", dim, ["x"])], optimizer=te.optim.Adam(),
                                    storage=storage, device=device)
    return _Holder(ebc)


def _fill(model: _Holder, rows: int, dim: int) -> None:
    for lo in range(0, rows, 1 << 17):
        keys = torch.arange(lo, min(lo + (1 << 17), rows), device=model.ebc.device)
        model.ebc.write("t", keys, torch.randn(keys.numel(), dim, device=model.ebc.device))
    model.ebc.flush()


def run(rows: int, dim: int, directory: str | None, buffer_mib: int, device: torch.device, out_dir: str,
        argv: list[str]) -> int:
    started = datetime.now()
    root = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="tieredemb-ckpt-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        write_bps, read_bps = _disk_speed(root)
        row_bytes = dim * 3 * 4
        budget = max(1, rows // 10) * row_bytes
        layouts = {
            "hbm_direct": lambda: None,
            "cache over RocksDB": lambda: te.StorageConfig(
                hbm_budget=budget, backing=te.storage.RocksDB(str(root / f"db-{time.time_ns()}"), shards=4)),
        }
        results = []
        for name, storage in layouts.items():
            model = _table(rows, dim, storage(), device)
            _fill(model, rows, dim)
            ckpt = root / f"ckpt-{name.split()[0]}"
            start = time.perf_counter()
            te.checkpoint.save(model, ckpt, buffer_bytes=buffer_mib << 20)
            save_s = time.perf_counter() - start
            size = sum(p.stat().st_size for p in ckpt.rglob("*.safetensors"))
            model.ebc.close()
            fresh = _table(rows, dim, storage(), device)
            start = time.perf_counter()
            te.checkpoint.load(fresh, ckpt)
            load_s = time.perf_counter() - start
            fresh.ebc.close()
            results.append({"layout": name, "bytes": size, "save_s": save_s, "load_s": load_s,
                            "save_bps": size / save_s, "load_bps": size / load_s})
            shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        if directory is None:
            shutil.rmtree(root, ignore_errors=True)
    lines = [f"checkpoint: one Adam table of {rows:,} x {dim} ({rows * row_bytes / 2**20:.0f} MiB of rows), "
             f"buffer {buffer_mib} MiB, on {device}; disk sequential write {write_bps / 1e6:.0f} MB/s, "
             f"read {read_bps / 1e6:.0f} MB/s",
             "layout             | file MB | save s | save MB/s | vs disk write | load s | load MB/s",
             "-------------------+---------+--------+-----------+---------------+--------+----------"]
    for r in results:
        lines.append(f"{r['layout']:<18} | {r['bytes'] / 1e6:7.0f} | {r['save_s']:6.2f} | "
                     f"{r['save_bps'] / 1e6:9.0f} | {r['save_bps'] / write_bps:13.2f} | {r['load_s']:6.2f} | "
                     f"{r['load_bps'] / 1e6:8.0f}")
    table = "\n".join(lines)
    print(table)
    path = report_path(out_dir, "checkpoint", started)
    write_report(path, {"workload": "checkpoint", "date": started.isoformat(timespec="seconds"),
                        "machine": machine_info(device), "argv": argv, "rows": rows, "dim": dim,
                        "disk_write_bps": write_bps, "disk_read_bps": read_bps, "results": results}, table)
    print(f"report: {path}")
    return 0
