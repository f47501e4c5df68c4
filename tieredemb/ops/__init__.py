"""Kernels: gather(+pool), gradient reduction, fused optimizer update; a torch reference and Triton."""

from __future__ import annotations

import functools
import os

import torch

from tieredemb.ops.reference import TorchKernels


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``torch.device(device)`` (the CPU for None); a CUDA device without an index gets the current
    one's, as its tensors report it. ``torch.cuda.current_stream`` and its like then take it as it
    is, where for a bare "cuda" they look the current device up (several microseconds of Python a
    call, and the training step makes several)."""
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def to_host_later(values: torch.Tensor,
                  buffers: list[torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``values`` (a tensor on the device) copied to the host behind the work queued, into a
    pinned buffer taken from ``buffers`` (kept by the caller, all of its shape and dtype) or a new one, and
    the event after which the copy holds them; on the CPU: ``values`` itself, None. The caller gives
    the buffer back to ``buffers`` once it has read it."""
    if values.device.type != "cuda":
        return values, None
    host = buffers.pop() if buffers else torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def to_device_at_once(parts: list[list[torch.Tensor]],
                      device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each part (CPU tensors, concatenated) as int64 on ``device``, all in one copy from pinned
    memory (from pageable memory the copy would wait for the device's work): (the parts in that
    pinned memory, the parts on the device)."""
    sizes = [sum(t.numel() for t in part) for part in parts]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    at = 0
    for part in parts:
        for t in part:
            host[at : at + t.numel()].copy_(t.reshape(-1))
            at += t.numel()
    return list(host.split(sizes)), list(host.to(device, non_blocking=True).split(sizes))


@functools.cache
def triton_hashing():
    """``tieredemb.ops.triton.hashing`` (the key hashes in one kernel each), or None without triton."""
    try:
        from tieredemb.ops.triton import hashing
    except ImportError:
        return None
    return hashing


def select_kernels(kind: str, device: torch.device):
    """``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA when it imports, else torch)."""
    if kind not in ("auto", "torch", "triton"):
        raise ValueError(f"kernels must be 'auto', 'torch' or 'triton', got {kind!r}")
    if kind == "torch" or (kind == "auto" and device.type != "cuda"):
        return TorchKernels()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        if kind == "triton":
            raise ValueError("kernels='triton' on a CPU device needs TRITON_INTERPRET=1 set before "
                             "triton is imported (Triton's interpreter, for tests)")
        return TorchKernels()
    try:
        from tieredemb.ops.triton import TritonKernels
    except ImportError as e:
        if kind == "triton":
            raise ImportError("kernels='triton' needs the triton package") from e
        return TorchKernels()
    return TritonKernels()


__all__ = ["TorchKernels", "resolve_device", "select_kernels", "to_host_later"]
