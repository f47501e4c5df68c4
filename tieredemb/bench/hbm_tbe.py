"""The ``hbm`` workload against FBGEMM's TBE, timed in turns.

Ours (one collection, every row stored first) and TBE (``EmbeddingLocation.DEVICE``, rows = ours'
initial rows of the same keys) are built side by side and train the same batches in the same order:
batch ``i`` of ours and batch ``i`` of TBE are the same ids (raw keys for ours, their Zipf ranks for
TBE) with the same upstream gradient. The batches go in blocks of ``turn`` steps; each block is
trained by ours, then by TBE, back to back (the host free to run ahead; the queue drained at the
block's ends), so both see the same machine at the same time. With ``pipeline``, ours' blocks
alternate between the plain loop (prefetch, forward, backward) and ``te.TrainPipeline``'s order
(batch i+1's prefetch beside step i); TBE's step is forward + backward in both. A configuration's
figure is the median over its timed blocks of the block's mean step.

After the last block both hold the rows of every batch trained: ours' rows are checked against
TBE's (and, for SGD, against the exact float64 rows), as ``hbm``'s peer check does.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import tieredemb as te
from tieredemb.bench.hbm_checks import HbmRowCheck, snapshot_rows
from tieredemb.bench.report import Measurement, Target, host_rss_bytes
from tieredemb.bench.tbe import TbeSpec, TbeTables
from tieredemb.bench.timing import free_memory, peak_device_bytes, reset_peak, synchronize
from tieredemb.bench.workloads import HbmBatch, HbmBatches

TBE_TARGET = 1.0  # ours' step at most TBE's


@dataclass
class Contestant:
    """One configuration in the race: ``train`` runs a block of batches in order."""

    measurement: Measurement
    train: Callable[[list[HbmBatch]], None]
    block_ms: list[float] = field(default_factory=list)

    def timed(self, block: list[HbmBatch], device: torch.device) -> None:
        synchronize(device)
        t0 = time.perf_counter()
        self.train(block)
        synchronize(device)
        self.block_ms.append((time.perf_counter() - t0) / len(block) * 1e3)

    def finish(self, lookups: int, unique: float) -> Measurement:
        m = self.measurement
        m.set_times(self.block_ms, lookups)
        m.back_to_back_ms = statistics.mean(self.block_ms)
        m.unique_keys_per_step = unique
        m.extra["block_ms"] = self.block_ms
        return m


def blocks(first: int, last: int, turn: int) -> list[range]:
    """``[first, last)`` cut into consecutive ranges of ``turn`` steps (the last one may be shorter)."""
    return [range(lo, min(lo + turn, last)) for lo in range(first, last, turn)]


class HbmTbeRace:
    """Ours (plain, and under ``TrainPipeline`` when ``pipeline``) and TBE on the same batches.

    Args:
        opts: the ``hbm`` options (shape, device, steps, warmup, seed, kernels[0] for ours).
        optimizer: our optimizer's name (``hbm.OPTIMIZERS``).
        spec: TBE's configuration (its optimizer the same as ours, its hyperparameters ours').
        build_ours: builds ours' collection with every row stored (``hbm.build_ours``).
        initial: ``initial(t, ranks)`` -> float32 (k, D) initial rows (TBE's rows start as ours').
        check: ``check(snapshot, tbe_weights)`` -> the row check of ours against TBE (None: no check;
            none either where TBE's rows are fp16).
        turn: steps a block.
    """

    def __init__(self, opts, optimizer: str, spec: TbeSpec,
                 build_ours: Callable[[], te.EmbeddingBagCollection],
                 initial: Callable[[int, torch.Tensor], torch.Tensor],
                 check: Callable[[object, list[torch.Tensor]], HbmRowCheck] | None,
                 turn: int = 10) -> None:
        self.opts, self.optimizer, self.spec, self.turn = opts, optimizer, spec, turn
        self.build_ours, self.initial, self.check = build_ours, initial, check

    def run(self, batches: HbmBatches, grad: torch.Tensor,
            upstream_model: Callable[[te.EmbeddingBagCollection, torch.Tensor], torch.nn.Module],
            ) -> tuple[list[Measurement], HbmRowCheck | None]:
        opts, dev = self.opts, self.opts.device
        reset_peak(dev)
        ebc = self.build_ours()
        tbe = TbeTables(opts.shape, dev, self.spec, self.initial)
        try:
            ours = self._ours(ebc, grad, upstream_model)
            theirs = Contestant(Measurement("tbe", self.optimizer, self.spec.label(dev)),
                                lambda block: [tbe.step(b.ranks, grad) for b in block])
            last = opts.warmup + 2 * opts.steps  # as many batches as the other hbm runs train
            unique: list[int] = []
            for j, steps in enumerate(blocks(0, opts.warmup, self.turn)
                                      + blocks(opts.warmup, last, self.turn)):
                block = [batches.batch(i) for i in steps]
                mine = ours[j % len(ours)]
                if steps.start < opts.warmup:
                    mine.train(block)
                    theirs.train(block)
                    continue
                mine.timed(block, dev)
                theirs.timed(block, dev)
                unique += [sum(b.unique_keys) for b in block]
            synchronize(dev)
            peak = peak_device_bytes(dev)
            results = [c.finish(opts.shape.lookups, statistics.mean(unique)) for c in (*ours, theirs)]
            for m in results:
                m.peak_device_bytes, m.host_rss_bytes = peak, host_rss_bytes()
                m.extra["in_turns_of"] = self.turn
            check = None
            if self.check is not None and self.spec.precision == "fp32":
                snap = snapshot_rows(ebc, opts.shape, dev, opts.seed, "in turns with TBE")
                snap.preinserted, snap.table_rows = opts.preinsert, opts.shape.rows
                check = self.check(snap, tbe.weights())
            return results, check
        finally:
            ebc = tbe = None  # the tables' memory goes before the next configuration is built
            free_memory(dev)

    def _ours(self, ebc: te.EmbeddingBagCollection, grad: torch.Tensor,
              upstream_model: Callable[[te.EmbeddingBagCollection, torch.Tensor], torch.nn.Module],
              ) -> list[Contestant]:
        kernels = getattr(ebc.kernels, "name", type(ebc.kernels).__name__)

        def plain(block: list[HbmBatch]) -> None:
            for b in block:
                ebc.prefetch(b.kjt)
                ebc(b.kjt).values().backward(grad)

        out = [Contestant(Measurement("ours", self.optimizer, f"ours ({kernels} kernels), in turns "
                                      "with TBE", kernels=kernels), plain)]
        if self.opts.pipeline:
            model = upstream_model(ebc, grad)
            pipe = te.TrainPipeline(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                    device=self.opts.device)

            def pipelined(block: list[HbmBatch]) -> None:
                it = iter([{"kjt": b.kjt} for b in block])
                with contextlib.suppress(StopIteration):
                    while True:
                        pipe.progress(it)

            out.append(Contestant(Measurement("ours", self.optimizer, f"ours ({kernels} kernels, "
                                              "TrainPipeline), in turns with TBE",
                                              kernels=kernels + "+pipeline"), pipelined))
        return out


def tbe_targets(results: list[Measurement]) -> list[Target]:
    """Per optimizer, each of ours' configurations in turns with TBE against TBE's step."""
    out = []
    for tbe in (r for r in results if r.configuration == "tbe" and r.step_ms):
        for r in results:
            if (r.configuration == "ours" and r.optimizer == tbe.optimizer and r.step_ms
                    and "in_turns_of" in r.extra):
                out.append(Target(f"{r.optimizer}: {r.label} / {tbe.label}", r.step_ms / tbe.step_ms,
                                  "<=", TBE_TARGET))
    return out


__all__ = ["HbmTbeRace", "TBE_TARGET", "blocks", "tbe_targets"]
