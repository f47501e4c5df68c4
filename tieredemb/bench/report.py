"""Benchmark results: one row per (configuration, optimizer), the printed table, the JSON file."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import torch

from tieredemb.storage.urls import redact_text


@dataclass
class Measurement:
    """One configuration of one workload.

    configuration: "ours" | "peer" | "floor"; label: how the table names it; step_ms: median step
    time over the timed steps (step_ms_all); ratios are filled in by ``fill_ratios``.
    """

    configuration: str
    optimizer: str
    label: str
    kernels: str | None = None
    step_ms: float | None = None
    step_ms_all: list[float] = field(default_factory=list)
    back_to_back_ms: float | None = None  # mean of steps run back to back (where the bench runs them)
    lookups_per_s: float | None = None
    unique_keys_per_step: float | None = None
    new_keys_per_step: float | None = None
    peak_device_bytes: int | None = None
    host_rss_bytes: int | None = None
    speedup_vs_peer: float | None = None
    x_floor: float | None = None
    extra: dict = field(default_factory=dict)
    error: str | None = None

    def set_times(self, times_ms: list[float], lookups: int) -> None:
        self.step_ms_all = [float(t) for t in times_ms]
        self.step_ms = statistics.median(self.step_ms_all)
        self.lookups_per_s = lookups / (self.step_ms * 1e-3) if self.step_ms > 0 else None


@dataclass
class RowCheck:
    """Ours and the peer trained the same rows: the comparison after the timed steps.

    rows_compared: rows looked at (all, or a sample at full scale); rows_trained: of those, rows the
    batches touched; max_abs_diff: largest |ours - reference| over compared weights (the peer, or
    exact rows); max_moved: largest |reference - initial| (a check over rows that never moved would
    prove nothing).
    """

    optimizer: str
    kernels: str
    passed: bool
    rows_compared: int
    rows_trained: int
    max_abs_diff: float
    max_moved: float
    problems: list[str] = field(default_factory=list)


@dataclass
class Target:
    """A figure held to a bound, and the verdict: ``met`` when ``figure op bound`` holds.

    op: "<=" or ">="; unit: "x" (a ratio, printed 1.23x) or "%" (a fraction, printed 92%).
    """

    what: str
    figure: float
    op: str
    bound: float
    unit: str = "x"
    met: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.op not in ("<=", ">="):
            raise ValueError(f"op must be '<=' or '>=', got {self.op!r}")
        self.met = self.figure <= self.bound if self.op == "<=" else self.figure >= self.bound

    def line(self) -> str:
        """``what: figure (target: op bound): met`` (or ``NOT met``)."""
        def fmt(x: float) -> str:
            return f"{x:.2f}x" if self.unit == "x" else f"{x:.0%}"

        return (f"{self.what}: {fmt(self.figure)} (target: {self.op} {fmt(self.bound)}): "
                f"{'met' if self.met else 'NOT met'}")


def memory_name(device: torch.device) -> str:
    """What a report calls the device's memory: "HBM" on a GPU, "device memory" elsewhere (a CPU
    run's "device" is host memory)."""
    return "HBM" if device.type == "cuda" else "device memory"


def fill_ratios(results: list[Measurement]) -> None:
    """speedup vs peer (peer ms / ms) and x floor (ms / floor ms), per optimizer."""
    def ms_of(configuration: str, optimizer: str) -> float | None:
        for r in results:
            if r.configuration == configuration and r.optimizer == optimizer and r.step_ms:
                return r.step_ms
        return None

    for r in results:
        if not r.step_ms:
            continue
        peer, floor = ms_of("peer", r.optimizer), ms_of("floor", r.optimizer)
        r.speedup_vs_peer = peer / r.step_ms if peer else None
        r.x_floor = r.step_ms / floor if floor else None


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _gib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def format_table(title: str, results: list[Measurement]) -> str:
    """The benchmark's one table, as text."""
    evicting = any("evictions_per_step" in r.extra for r in results)  # a column only where measured
    head = ["configuration", "optimizer", "step ms", "b2b ms", "lookups/s", "speedup vs peer", "x floor",
            "unique/step", "new/step", *(["evicted/step"] if evicting else []), "peak dev GiB",
            "host RSS GiB"]
    rows = []
    for r in results:
        if r.error is not None:
            rows.append([r.label, r.optimizer, "FAILED: " + r.error.splitlines()[0][:60]]
                        + [""] * (len(head) - 3))
            continue
        evicted = [_fmt(r.extra.get("evictions_per_step"), ".1f")] if evicting else []
        rows.append([r.label, r.optimizer, _fmt(r.step_ms, ".3f"), _fmt(r.back_to_back_ms, ".3f"),
                     _fmt(r.lookups_per_s, ".3e"),
                     _fmt(r.speedup_vs_peer, ".2f"), _fmt(r.x_floor, ".2f"),
                     _fmt(r.unique_keys_per_step, ".0f"), _fmt(r.new_keys_per_step, ".1f"), *evicted,
                     _gib(r.peak_device_bytes), _gib(r.host_rss_bytes)])
    widths = [max(len(head[i]), *(len(row[i]) for row in rows)) if rows else len(head[i])
              for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(w) if i < 2 else c.rjust(w)
                          for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    sep = "-+-".join("-" * w for w in widths)
    return redact_text("\n".join([title, line(head), sep, *(line(r) for r in rows)]))


def host_rss_bytes() -> int | None:
    """Resident set size of this process now (psutil, else /proc/self/status)."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_host_rss_bytes() -> int | None:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    except (ImportError, OSError):
        return None


def python_loop_ms(n: int = 200_000) -> float:
    """The best of three timings of a fixed pure-Python loop on this thread: the host's speed, which
    on the device machines moved by 2x between processes and within one (session 29: the same loop
    101-219 ms at 2M), with the step times of host-bound configurations."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        sum(i * i for i in range(n))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def huge_page_bytes() -> int | None:
    """Bytes of this process's memory in transparent huge pages now (``AnonHugePages``). Recorded
    to test a guess for why runs of the same cache bench differ (random UVA reads of host rows on
    4 KiB pages missing the GPU's translation cache): wrong, as measured in session 29 (the same
    16.3-16.7 GB/s on 4 KiB and on 2 MiB pages)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _transparent_huge_pages() -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``), None where it does not say."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.find("[") + 1 : text.find("]")] if "[" in text else None


def _cpu_name() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``), None where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def device_name(machine: dict) -> str:
    """The device a report's ``machine`` ran on, by name: the GPU's, else the CPU's."""
    return machine.get("gpu") or machine.get("cpu") or machine.get("device") or "unknown device"


def machine_info(device: torch.device) -> dict:
    """What ran the benchmark: device, library versions, host."""
    info = {
        "device": str(device),
        "cpu": _cpu_name(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # False: backward ran on the calling thread (the bench's default, as in TrainPipeline)
        "autograd_multithreading": torch._C._is_multithreading_enabled(),
        "transparent_hugepage": _transparent_huge_pages(),
        "python_loop_ms": python_loop_ms(),
        "git_commit": _git_commit(),
        # the code that ran, where the commit does not say it (a copy of a working tree, edits)
        "source_hash": source_hash(Path(__file__).resolve().parents[1]),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_bytes"] = int(props.total_memory)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def source_hash(root: Path) -> str:
    """16 hex digits of a sha256 over the Python files below ``root``: each one's path (relative)
    and contents, in path order."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def report_path(out_dir: str | Path, workload: str, when: datetime) -> Path:
    """``<out_dir>/<YYYYmmdd-HHMMSS>-<workload>.json``."""
    return Path(out_dir) / f"{when:%Y%m%d-%H%M%S}-{workload}.json"


def check_directory(option: str, path: str | Path) -> None:
    """A ValueError naming ``option`` where ``path`` cannot be a directory this process writes into:
    a file in the way, or a folder it may not write to. Nothing is created."""
    full = Path(path).absolute()
    existing = next(p for p in (full, *full.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{option} {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: {existing} is not writable")


def write_report(path: Path, report: dict, table: str) -> None:
    """The JSON report and, beside it (same stem, ``.txt``), the printed table; in both, the
    passwords of any URL redacted."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_plain(report), indent=2, allow_nan=False) + "\n")
    tmp.replace(path)  # a reader (or a timeout) never sees half a file
    path.with_suffix(".txt").write_text(redact_text(table) + "\n")


def _plain(x: object) -> object:
    """Dataclasses to dicts, non-finite floats to None (JSON has no NaN), URLs in strings redacted."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _plain(dataclasses.asdict(x))
    if isinstance(x, str):
        return redact_text(x)
    if isinstance(x, dict):
        return {redact_text(str(k)): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


__all__ = ["Measurement", "RowCheck", "Target", "check_directory", "device_name", "fill_ratios",
           "format_table", "host_rss_bytes", "machine_info", "memory_name", "peak_host_rss_bytes",
           "report_path", "write_report"]
