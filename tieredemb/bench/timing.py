"""Timing a call on a device, the device's copy bandwidth, and its memory: what every bench measures with.

On CUDA a call is timed by events with the queue drained before it; on CPU by ``perf_counter``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call with the device queue empty before and after it."""
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None,
                           repeats: int = 10) -> dict:
    """(bytes read + bytes written) / time of a large copy on ``device``, median of ``repeats``."""
    if nbytes is None:  # far over any cache
        nbytes = (1 << 30) if device.type == "cuda" else (128 << 20)
    ms = _copy_ms(nbytes, device, repeats)
    free_memory(device)
    return {"bytes_per_s": 2 * nbytes / (ms * 1e-3), "buffer_bytes": nbytes, "copy_ms": ms}


def _copy_ms(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return statistics.median(time_ms(lambda: dst.copy_(src), device) for _ in range(repeats))


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    free_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_device_bytes(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def allocated_bytes(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0
