"""FBGEMM's TBE as a configuration of the ``cache`` workload: ``MANAGED_CACHING`` with its rows in
pinned host memory (``uvm_host_mapped=True``), an LRU device cache of ``budget_fraction`` of the rows
(``cache_load_factor``), RowWiseAdagrad (``EXACT_ROWWISE_ADAGRAD``) at ours' learning rate.

It takes turns with ours and the all-in-device-memory peer like any configuration (``ConfigRun``):
built, warmed up on the same batches, timed in turns. Its cache starts empty (ours' starts with the
hottest rows: ``prefill``); the warmup fills it. Its rows after training, at the keys the bench
checks, are held to the peer's: the same rows where the peer stores the key, the initial row where
no batch touched it (``compare_tbe``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tieredemb.bench.cache_runs import (
    CHECK_ATOL,
    CHECK_RTOL,
    LR,
    CacheOptions,
    CacheRowCheck,
    ConfigRun,
    RankBatch,
    RankBatches,
    check_keys,
    table_configs,
)
from tieredemb.bench.report import Measurement, host_rss_bytes
from tieredemb.bench.tbe import TbeSpec, TbeTables, unavailable
from tieredemb.bench.timing import allocated_bytes, reset_peak, synchronize, time_ms
from tieredemb.bench.workloads import HbmShape

TBE_CACHE_TARGET = 0.5  # ours' step at most half of TBE MANAGED_CACHING's


def tbe_cache_spec(opts: CacheOptions) -> TbeSpec:
    return TbeSpec("rowwise_adagrad", LR, 1e-8, "managed_caching", cache_load_factor=opts.budget_fraction)


def tbe_cache_unavailable(opts: CacheOptions) -> str | None:
    """Why TBE cannot be this bench's configuration, or None."""
    if opts.workload != "cache":
        return "FBGEMM's TBE skipped: it has no RocksDB tier (its SSD tier has no public kernels)"
    return unavailable(tbe_cache_spec(opts), opts.device)


class TbeCacheRun(ConfigRun):
    """TBE ``MANAGED_CACHING`` as one configuration of the ``cache`` bench (see the module)."""

    def __init__(self, opts: CacheOptions, batches: RankBatches, grad: torch.Tensor) -> None:
        spec = tbe_cache_spec(opts)
        super().__init__(opts, spec.label(opts.device), None, batches, grad, 0, "tbe")
        self.spec = spec
        self.m = Measurement("tbe", "rowwise_adagrad", self.label)
        self.tbe: TbeTables | None = None

    def _step(self, b: RankBatch) -> None:
        self.tbe.step(b.ranks, self.grad)

    def start(self, others: int = 0) -> None:
        opts, shape, dev = self.opts, self.opts.shape, self.opts.device
        reset_peak(dev)
        base = allocated_bytes(dev)
        configs = table_configs(shape)
        self.tbe = TbeTables(shape, dev, self.spec, lambda t, ranks: configs[t].initializer.rows(
            opts.seed, configs[t].name, ranks, shape.dim))
        for i in range(opts.warmup):
            b = self.batches.batch(i)
            time_ms(lambda b=b: self._step(b), dev)
        synchronize(dev)
        self.resident = allocated_bytes(dev) - base
        self._note_peak(others)

    def finish(self, log: Callable[[str], None] = lambda s: None) -> Measurement:
        shape, m = self.opts.shape, self.m
        synchronize(self.opts.device)
        m.set_times(self.times, shape.lookups)
        m.unique_keys_per_step = sum(self.unique) / len(self.unique)
        m.peak_device_bytes = self.peak
        m.host_rss_bytes = host_rss_bytes()
        m.extra = {"cache_load_factor": self.spec.cache_load_factor, "cache_algorithm": "LRU",
                   "uvm_host_mapped": True, "cache_starts": "empty (the warmup fills it)"}
        self.keys = check_keys(shape, self.last, self.opts.seed)
        self.rows = [self.tbe.rows(t, k) for t, k in enumerate(self.keys)]
        log(f"{self.label}: {m.step_ms:.3f} ms/step")
        return m

    def close(self) -> None:
        self.tbe = None
        self.resident = 0
        reset_peak(self.opts.device)


def compare_tbe(shape: HbmShape, keys: list[torch.Tensor], tbe: list[torch.Tensor], peer: list,
                seed: int) -> CacheRowCheck:
    """TBE's rows (float32 (k, D) per table) against the peer's ``(weights, found)`` at ``keys``:
    equal where the peer stores the key; the key's initial row where it does not (never touched)."""
    problems: list[str] = []
    compared = found_n = moved = 0
    max_diff = 0.0
    for t, config in enumerate(table_configs(shape)):
        (pw, pf), tw = peer[t], tbe[t]
        compared += pf.numel()
        found_n += int(pf.sum())
        init = config.initializer.rows(seed, config.name, keys[t], shape.dim)
        if pf.any():
            d = float((tw[pf] - pw[pf]).abs().max())
            max_diff = max(max_diff, d)
            if not torch.allclose(tw[pf], pw[pf], rtol=CHECK_RTOL, atol=CHECK_ATOL):
                problems.append(f"table {t}: TBE's rows differ from the peer's rows by up to {d:.3g}")
            moved += int(((tw[pf] - init[pf]).abs().amax(dim=1) > 0).sum())
        if not torch.equal(tw[~pf], init[~pf]):
            problems.append(f"table {t}: TBE's untouched rows are not their initial rows")
    if moved == 0:
        problems.append("no compared row moved from its initial value: the check proves nothing")
    return CacheRowCheck(not problems, compared, found_n, moved, max_diff, problems)


__all__ = ["TBE_CACHE_TARGET", "TbeCacheRun", "compare_tbe", "tbe_cache_unavailable"]
