"""FBGEMM's table-batched embedding (TBE) as a peer: ``SplitTableBatchedEmbeddingBagsCodegen``.

What TorchRec users run for the same tables: all rows in device memory (``EmbeddingLocation.DEVICE``)
for ``hbm``, or an LRU cache in device memory over pinned host memory (``MANAGED_CACHING`` with
``uvm_host_mapped=True``, ``cache_load_factor`` = the budget fraction) for ``cache``. Its optimizer
runs inside the backward like ours. TBE indexes rows ``[0, rows)`` of each table: it is fed the
Zipf ranks of the bench's batches, the rows that ours' raw ids scramble to, and its row ``r`` of table
``t`` starts as ours' initial row of that rank's key (``initial(t, ranks)``).

On a CPU, ``fbgemm-gpu-cpu`` runs TBE with its rows in host memory (``EmbeddingLocation.HOST``): SGD
and both Adagrads, not Adam. Where ``fbgemm_gpu`` cannot be imported, or a case is out of FBGEMM's
reach, ``unavailable`` says why and the bench prints that note instead of TBE's row.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tieredemb.bench.workloads import HbmShape

# our optimizer names -> FBGEMM's EmbOptimType names
TBE_OPTIMIZERS = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD",
                  "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adam": "ADAM"}
LOCATIONS = ("device", "managed_caching")
PRECISIONS = ("fp32", "fp16")


@dataclass(frozen=True)
class TbeSpec:
    """One TBE configuration: the optimizer (our name) and its hyperparameters, where the rows live,
    the rows' precision, and (``managed_caching``) the fraction of rows its device cache holds."""

    optimizer: str
    lr: float
    eps: float = 1e-8
    location: str = "device"
    precision: str = "fp32"
    cache_load_factor: float = 0.2

    def __post_init__(self) -> None:
        if self.optimizer not in TBE_OPTIMIZERS:
            raise ValueError(f"TBE: no optimizer {self.optimizer!r}; choose from {sorted(TBE_OPTIMIZERS)}")
        if self.location not in LOCATIONS:
            raise ValueError(f"TBE: location must be one of {LOCATIONS}, got {self.location!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TBE: precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not 0 < self.cache_load_factor <= 1:
            raise ValueError(f"TBE: cache_load_factor must be in (0, 1], got {self.cache_load_factor}")

    def label(self, device: torch.device) -> str:
        where = {"device": "DEVICE" if device.type == "cuda" else "HOST",
                 "managed_caching": f"MANAGED_CACHING {self.cache_load_factor:g}"}[self.location]
        return f"FBGEMM TBE ({where}, {self.precision})"


def unavailable(spec: TbeSpec, device: torch.device) -> str | None:
    """Why TBE cannot run ``spec`` on ``device`` (a note for the report), or None when it can."""
    try:
        _fbgemm()
    except Exception as e:  # noqa: BLE001 - any import failure is a note, not a crash
        return f"FBGEMM's TBE skipped: fbgemm_gpu cannot be imported ({type(e).__name__}: {e})"
    if device.type != "cuda":
        if spec.location != "device":
            return "FBGEMM's TBE skipped: MANAGED_CACHING needs CUDA"
        if spec.optimizer == "adam":
            return "FBGEMM's TBE skipped: its CPU build has no Adam"
    if spec.optimizer == "adam" and spec.precision == "fp16":
        return "FBGEMM's TBE skipped: its Adam refuses fp16 rows"
    return None


def _fbgemm():
    """FBGEMM's modules (it warns on import when its version is missing from its own table)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    return (EmbOptimType, SparseType, CacheAlgorithm, EmbeddingLocation, ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen)


class TbeTables:
    """TBE over ``shape``'s tables (one per feature, ``rows`` x ``dim``, sum pooling).

    Args:
        shape: the workload's tables and batch.
        device: where it computes (CUDA; a CPU runs FBGEMM's CPU kernels over host rows).
        spec: optimizer, location, precision.
        initial: ``initial(t, ranks)`` -> float32 (k, D): the initial rows of ``ranks`` in table ``t``.
    """

    WRITE_CHUNK = 1 << 18

    def __init__(self, shape: HbmShape, device: torch.device, spec: TbeSpec,
                 initial: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
        why = unavailable(spec, device)
        if why is not None:
            raise RuntimeError(why)
        optim_type, sparse_type, cache_algorithm, location, compute, tbe_class = _fbgemm()
        cuda = device.type == "cuda"
        where = {"device": location.DEVICE if cuda else location.HOST,
                 "managed_caching": location.MANAGED_CACHING}[spec.location]
        extra = {}
        if spec.location == "managed_caching":
            extra = {"cache_load_factor": spec.cache_load_factor, "cache_algorithm": cache_algorithm.LRU,
                     "uvm_host_mapped": True}
        if cuda:
            extra["device"] = device
        precision = {"fp32": sparse_type.FP32, "fp16": sparse_type.FP16}[spec.precision]
        self.shape, self.device, self.spec = shape, device, spec
        self.tbe = tbe_class(
            [(shape.rows, shape.dim, where, compute.CUDA if cuda else compute.CPU)] * shape.num_tables,
            optimizer=getattr(optim_type, TBE_OPTIMIZERS[spec.optimizer]), learning_rate=spec.lr,
            eps=spec.eps, weights_precision=precision, output_dtype=sparse_type.FP32, **extra)
        with torch.no_grad():
            for t, weight in enumerate(self.tbe.split_embedding_weights()):
                for lo in range(0, shape.rows, self.WRITE_CHUNK):
                    ranks = torch.arange(lo, min(lo + self.WRITE_CHUNK, shape.rows), device=device)
                    weight[lo : lo + ranks.numel()].copy_(initial(t, ranks).to(weight.device))
        self._offsets: torch.Tensor | None = None

    def offsets(self, bags: int, bag_size: int) -> torch.Tensor:
        """``bags + 1`` offsets of bags of ``bag_size`` ids each (kept: every step has the same)."""
        if self._offsets is None or self._offsets.numel() != bags + 1:
            self._offsets = torch.arange(0, bags * bag_size + 1, bag_size, device=self.device)
        return self._offsets

    def step(self, ranks: torch.Tensor, grad: torch.Tensor) -> None:
        """One training step: forward of ``ranks`` (int64 (T, B, L), table-major, as TBE wants its
        indices) and backward of the upstream gradient ``grad`` (B, T*D), the update fused into it."""
        t, b, length = ranks.shape
        self.tbe(ranks.reshape(-1), self.offsets(t * b, length)).backward(grad)

    def weights(self) -> list[torch.Tensor]:
        """Each table's rows (rows, D), as trained (the device cache written back first)."""
        if self.spec.location == "managed_caching":
            self.tbe.flush()
        return [w.detach() for w in self.tbe.split_embedding_weights()]

    def rows(self, t: int, ranks: torch.Tensor) -> torch.Tensor:
        """float32 (k, D) host: table ``t``'s rows at ``ranks`` (int64 (k,))."""
        weight = self.weights()[t]
        return weight[ranks.to(weight.device)].float().cpu()


__all__ = ["LOCATIONS", "PRECISIONS", "TBE_OPTIMIZERS", "TbeSpec", "TbeTables", "unavailable"]
