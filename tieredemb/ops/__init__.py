"""Kernels: gather(+pool), gradient reduction, fused optimizer update; a torch reference and Triton."""

from __future__ import annotations

import torch

from tieredemb.ops.reference import TorchKernels


def select_kernels(kind: str, device: torch.device):
    """``"torch"``, ``"triton"`` or ``"auto"`` (Triton on CUDA when it imports, else torch)."""
    if kind not in ("auto", "torch", "triton"):
        raise ValueError(f"kernels must be 'auto', 'torch' or 'triton', got {kind!r}")
    if kind == "torch" or (kind == "auto" and device.type != "cuda"):
        return TorchKernels()
    try:
        from tieredemb.ops.triton import TritonKernels
    except ImportError as e:
        if kind == "triton":
            raise ImportError("kernels='triton' needs the triton package") from e
        return TorchKernels()
    return TritonKernels()


__all__ = ["TorchKernels", "select_kernels"]
