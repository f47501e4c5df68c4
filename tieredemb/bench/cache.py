"""The ``cache`` and ``ssd`` workloads (DESIGN section 7): a device cache of 10% of the footprint.

10 tables x 10M rows x D=128 fp32 with RowWiseAdagrad (rows of 129 float32, 51.6 GB in all), batch
10,486 with one 10-id bag per table, Zipf alpha 1.05 (the ``hbm`` workload's sampler and seeds). The
tables are bounded (``num_embeddings=rows``), so an id is the Zipf *rank* itself (rank 0 hottest; the
device index hashes them, so hot ids still spread over its buckets). In one process, on the same
batches:

    ours    te.EmbeddingBagCollection in ``cache`` mode: hbm_budget = budget_fraction x footprint,
            backing te.storage.HostMemory() (``cache``) or te.storage.RocksDB(dir, shards) (``ssd``)
    peer    the same collection with no budget (``hbm_direct``: every row in device memory)

Both start from the same state: the hottest ``cache_rows`` ranks of each table written with their
initial rows (``prefill``; the cache's rows, what a long run converges to), every other row absent
(its initial row on first use). ``warmup`` untimed steps then churn the cache (misses, evictions,
write-backs) before ``steps`` timed ones (CUDA events, queue drained around each step). Reported per
configuration: median step ms; for ours also the hit rate of unique keys, misses, evictions, bytes
moved each way per step and the achieved host<->device bandwidth (bytes moved / step time) against
the pinned copy bandwidth measured at the start. After the steps ours is flushed and its rows of a
sample of keys (hot, random, and the last batch's) are compared with the peer's.

``ssd`` first measures the disk itself on the store directory's file system
(``tieredemb.bench.disk``: sequential write and read, random 4 KiB reads from many threads, all with
O_DIRECT) and prints beside ours' step the least time the disk allows it (misses / random-read IOPS +
bytes written / sequential write). RocksDB reads with O_DIRECT (``direct_reads``, on by default) so
that the page cache does not stand in for the disk. It then adds raw ``rocksdict`` rates on the same
disk (``raw_rocksdb_rates``): multi-get and write-batch put of 516-byte rows, one thread per shard,
next to ``RocksDBBackend.get``/``set`` on the same keys, rows and call sizes.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace

import torch

import tieredemb as te
from tieredemb.bench.cache_runs import (
    CACHE_SHAPE,
    LR,
    OPTIMIZER,
    CacheOptions,
    CacheRowCheck,
    ConfigRun,
    RankBatches,
    compare,
    prefill_rows,
)
from tieredemb.bench.cache_tbe import TBE_CACHE_TARGET, TbeCacheRun, compare_tbe, tbe_cache_unavailable
from tieredemb.bench.disk import DiskFigures, floor_line, measure_disk, step_floor
from tieredemb.bench.hbm import upstream_grad
from tieredemb.bench.host_tier import host_tier_floor, host_tier_floor_line, run_host_tier
from tieredemb.bench.report import (
    Measurement,
    Target,
    fill_ratios,
    memory_name,
)
from tieredemb.bench.timing import (
    free_memory,
    time_ms,
)
from tieredemb.bench.workloads import HbmShape

CACHE_TARGET = 1.5  # ours' step at most this many times the all-in-HBM step
ROCKSDB_TARGET = 0.8  # RocksDBBackend's get and set rates at least this fraction of raw rocksdict's


# ------------------------------------------------------------------------------ measurements
def measure_pinned_bandwidth(device: torch.device, nbytes: int | None = None,
                             repeats: int = 5) -> dict:
    """Bytes / time of one-way copies between pinned host memory and ``device`` (CUDA); on CPU a
    host memcpy stands in (so CPU smoke runs have a finite number)."""
    if device.type != "cuda":
        nbytes = nbytes or (64 << 20)
        a = torch.ones(nbytes, dtype=torch.uint8)
        b = torch.empty_like(a)
        ms = statistics.median(time_ms(lambda: b.copy_(a), device) for _ in range(repeats))
        bw = nbytes / (ms * 1e-3)
        return {"kind": "host memcpy (no CUDA)", "buffer_bytes": nbytes,
                "host_to_device_bytes_per_s": bw, "device_to_host_bytes_per_s": bw}
    nbytes = nbytes or (1 << 30)
    h2d, d2h = _pinned_copy_ms(nbytes, device, repeats)
    free_memory(device)
    return {"kind": "pinned", "buffer_bytes": nbytes,
            "host_to_device_bytes_per_s": nbytes / (h2d * 1e-3),
            "device_to_host_bytes_per_s": nbytes / (d2h * 1e-3)}


def _pinned_copy_ms(nbytes: int, device: torch.device, repeats: int) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    h2d = statistics.median(time_ms(lambda: dev.copy_(host, non_blocking=True), device)
                            for _ in range(repeats))
    d2h = statistics.median(time_ms(lambda: host.copy_(dev, non_blocking=True), device)
                            for _ in range(repeats))
    return h2d, d2h


# --------------------------------------------------------------------------- raw rocksdict
class _RawStores:
    """``shards`` raw rocksdict DBs, each written and read by a thread of its own: a ``WriteBatch``
    (through the write-ahead log, as the backend writes) and one multi-get a shard a call, the calls
    ``calls`` ranges of ``kb``/``vb``; reads with O_DIRECT where ``direct_reads``."""

    def __init__(self, directory: str, shards: int, kb: list[bytes], vb: list[bytes],
                 calls: list[tuple[int, int]], direct_reads: bool = False) -> None:
        from rocksdict import Options, Rdict, WriteOptions

        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.set_use_direct_reads(direct_reads)
        self.dbs = [Rdict(os.path.join(directory, f"shard-{s:02d}"), opts) for s in range(shards)]
        self.write_options = WriteOptions()
        self.pool = ThreadPoolExecutor(max_workers=shards)
        self.kb, self.vb, self.calls = kb, vb, calls

    def _put(self, shard: int, a: int, b: int) -> int:
        from rocksdict import WriteBatch

        batch = WriteBatch(raw_mode=True)
        for i in range(a + shard, b, len(self.dbs)):
            batch.put(self.kb[i], self.vb[i])
        self.dbs[shard].write(batch, self.write_options)
        return 0

    def _get(self, shard: int, a: int, b: int) -> int:
        got = self.dbs[shard].get(self.kb[a + shard : b : len(self.dbs)])  # one multi-get
        return sum(v is not None for v in got)

    def _each(self, fn: Callable[[int, int, int], int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = 0
        for a, b in self.calls:
            out += sum(f.result() for f in [self.pool.submit(fn, s, a, b) for s in range(len(self.dbs))])
        return time.perf_counter() - t0, out

    def put_all(self) -> tuple[float, int]:
        return self._each(self._put)

    def get_all(self) -> tuple[float, int]:
        """Seconds, rows found."""
        return self._each(self._get)

    def flush(self) -> None:
        for db in self.dbs:
            db.flush(True)

    def close(self) -> None:
        self.pool.shutdown()
        for db in self.dbs:
            db.close()


def raw_rocksdb_rates(directory: str, rows: int, width: int, shards: int, call_rows: int,
                      seed: int, rounds: int = 3, direct_reads: bool = False) -> dict:
    """Raw rocksdict put and multi-get rates of ``rows`` random keys in calls of ``call_rows`` keys
    (``_RawStores``) against ``RocksDBBackend.set``/``get`` on the same keys, rows and calls in a
    store beside it. The two are timed in turns, ``rounds`` times each (a later round's puts
    overwrite the keys), and each rate is the median round's: the host's speed moves between one
    measurement and the next on the device machines. Both read with O_DIRECT where
    ``direct_reads``."""
    gen = torch.Generator().manual_seed(seed + 31)
    keys = torch.unique(torch.randint(0, 1 << 62, (rows,), generator=gen))
    keys = keys[torch.randperm(keys.numel(), generator=gen)]
    n = keys.numel()
    vals = torch.rand(n, width, generator=gen)
    row_nbytes = width * 4
    calls = [(a, min(a + call_rows, n)) for a in range(0, n, call_rows)]
    raw = _RawStores(os.path.join(directory, "raw"), shards,
                     [int(k).to_bytes(8, "big") for k in keys.tolist()],
                     [bytes(v) for v in vals.numpy()], calls, direct_reads)  # numpy rows: width * 4 B
    backend = te.storage.RocksDB(os.path.join(directory, "backend"), shards=shards,
                                 direct_reads=direct_reads).open("bench", width, torch.device("cpu"))

    def backend_set() -> tuple[float, int]:
        t0 = time.perf_counter()
        for a, b in calls:
            backend.set(keys[a:b], vals[a:b])
        return time.perf_counter() - t0, 0

    def backend_get() -> tuple[float, int]:
        t0 = time.perf_counter()
        found = sum(int(backend.get(keys[a:b]).found.sum()) for a, b in calls)
        return time.perf_counter() - t0, found

    secs: dict[str, list[float]] = {"raw_put": [], "backend_set": [], "raw_get": [], "backend_get": []}
    found: dict[str, int] = {}

    def timed(turns: dict[str, Callable[[], tuple[float, int]]]) -> None:
        for _ in range(rounds):
            for name, fn in turns.items():
                t, found[name] = fn()
                secs[name].append(t)

    try:
        timed({"raw_put": raw.put_all, "backend_set": backend_set})
        raw.flush()
        backend.flush()
        timed({"raw_get": raw.get_all, "backend_get": backend_get})
    finally:
        raw.close()
        backend.close()
    result = {"rows": n, "row_bytes": row_nbytes, "call_rows": call_rows, "threads": shards,
              "direct_reads": direct_reads,
              "rounds": rounds, "raw_get_found": found["raw_get"], "backend_get_found": found["backend_get"]}
    for name, times in secs.items():
        t = statistics.median(times)
        result[f"{name}_rows_per_s"] = n / t
        result[f"{name}_bytes_per_s"] = n * row_nbytes / t
    return result


# ------------------------------------------------------------------------------------ driver
class CacheBench:
    """Runs ours (cache mode) and the all-in-device-memory peer; ``results`` fill as it goes."""

    def __init__(self, options: CacheOptions, log: Callable[[str], None] = lambda s: None) -> None:
        self.options = options
        self.log = log
        self.results: list[Measurement] = []
        self.check: CacheRowCheck | None = None
        self.tbe_check: CacheRowCheck | None = None  # FBGEMM's TBE against the peer, where it ran
        self.notes: list[str] = []  # configurations skipped, and why
        self.bandwidth: dict = {}
        self.raw: dict | None = None
        self.disk: DiskFigures | dict | None = None  # ssd: the disk's own figures, or {"error": ...}
        self.cache_rows: list[int] = []
        self.directory: str | None = None
        self._live: list[ConfigRun] = []  # configurations built and not yet finished or failed
        self.host_check: CacheRowCheck | None = None  # --host-budget: its rows against the peer's
        self.pipeline_check: dict | None = None  # --host-budget: the pipeline runs' losses

    def run(self, on_update: Callable[[], None] = lambda: None) -> None:
        opts = self.options
        s = opts.shape
        self.log(f"{opts.workload}: {s} on {opts.device}, budget {opts.budget_fraction:.0%} of "
                 f"{opts.footprint_bytes / 1e9:.2f} GB, {opts.warmup} warmup + {opts.steps} steps")
        self.bandwidth = measure_pinned_bandwidth(opts.device)
        self.log(f"copy bandwidth h2d {self.bandwidth['host_to_device_bytes_per_s'] / 1e9:.1f} GB/s, "
                 f"d2h {self.bandwidth['device_to_host_bytes_per_s'] / 1e9:.1f} GB/s "
                 f"({self.bandwidth['kind']})")
        batches = RankBatches(s, opts.device, opts.seed)
        grad = upstream_grad(s, opts.device, opts.seed)
        made_dir = opts.workload == "ssd" and opts.directory is None
        if opts.workload == "ssd":
            self.directory = opts.directory or tempfile.mkdtemp(prefix="tieredemb-ssd-", dir="/tmp")
            os.makedirs(self.directory, exist_ok=True)
        try:
            if opts.workload == "ssd":
                self._measure_disk(on_update)
            self._run(batches, grad, on_update)
        finally:
            if made_dir and self.directory:
                shutil.rmtree(self.directory, ignore_errors=True)

    def _run(self, batches: RankBatches, grad: torch.Tensor, on_update: Callable[[], None]) -> None:
        opts, s = self.options, self.options.shape
        budget = int(opts.budget_fraction * opts.footprint_bytes)
        if opts.workload == "ssd":
            store_dir = os.path.join(self.directory, "store")
            shutil.rmtree(store_dir, ignore_errors=True)
            backing = opts.rocksdb(store_dir, self.direct_reads)
            label = f"ours (cache, RocksDB x{opts.shards}{', O_DIRECT reads' if self.direct_reads else ''})"
        else:
            backing = te.storage.HostMemory(reserve_rows=s.rows if opts.reserve else 0)
            label = "ours (cache, host memory" + (", reserved)" if opts.reserve else ")")
        storage = te.StorageConfig(hbm_budget=budget, backing=backing)
        cache_rows = max(1, int(budget // s.num_tables) // opts.row_bytes)
        self.cache_rows = [cache_rows] * s.num_tables
        # both hold the same rows at the start (so they end with the same rows)
        start_rows = prefill_rows(opts, cache_rows) if opts.workload == "ssd" else cache_rows
        ours = ConfigRun(opts, label, storage, batches, grad, start_rows, hot_rows=cache_rows)
        peer = ConfigRun(opts, f"{self.all_on_device} (hbm_direct)", te.StorageConfig(), batches, grad,
                         start_rows, "peer")
        runs = [ours, peer]
        why = tbe_cache_unavailable(opts)
        if why is None:
            runs.append(TbeCacheRun(opts, batches, grad))
        else:
            self.notes.append(why)
            self.log(why)
        self._measure(runs, on_update)
        if ours.rows is not None and peer.rows is not None:
            self.check = compare(s, ours.keys, ours.rows, peer.rows, opts.seed)
            verdict = "passed" if self.check.passed else "FAILED: " + "; ".join(self.check.problems)
            self.log(f"rows of ours vs {self.all_on_device}: {verdict}")
            on_update()
        if len(runs) > 2 and runs[2].rows is not None and peer.rows is not None:
            c = self.tbe_check = compare_tbe(s, peer.keys, runs[2].rows, peer.rows, opts.seed)
            self.log(f"rows of FBGEMM's TBE vs {self.all_on_device}: "
                     + ("passed" if c.passed else "FAILED: " + "; ".join(c.problems)))
            on_update()
        if opts.host_budget is not None:
            self._host_tier_runs(batches, grad, peer, on_update)
        if opts.workload == "ssd":
            n = opts.raw_rows or max(1000, min(1_000_000, round(1_000_000 * s.rows / CACHE_SHAPE.rows)))
            call = max(64, min(65536, n // 8))
            rates_dir = os.path.join(self.directory, "rates")
            shutil.rmtree(rates_dir, ignore_errors=True)  # a reused --dir: start from empty stores
            try:
                self.raw = raw_rocksdb_rates(rates_dir, n, s.dim + 1, opts.shards, call, opts.seed,
                                             direct_reads=self.direct_reads)
                self.log(f"raw rocksdict: get {self.raw['raw_get_rows_per_s']:.3g} rows/s, put "
                         f"{self.raw['raw_put_rows_per_s']:.3g} rows/s; RocksDBBackend get "
                         f"{self.raw['backend_get_rows_per_s']:.3g}, set "
                         f"{self.raw['backend_set_rows_per_s']:.3g} rows/s")
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                self.log(traceback.format_exc())
                self.raw = {"error": f"{type(e).__name__}: {e}"}
            on_update()

    def _host_tier_runs(self, batches: RankBatches, grad: torch.Tensor, peer: ConfigRun,
                        on_update: Callable[[], None]) -> None:
        """``--host-budget``: the runs of ``tieredemb.bench.host_tier``, the host tier's rows checked
        against the peer's."""
        def on_result(m, run) -> None:
            self.results.append(m)
            if run is not None and run.rows is not None and peer.rows is not None:
                c = self.host_check = compare(self.options.shape, run.keys, run.rows, peer.rows,
                                              self.options.seed)
                self.log("rows with the host tier vs all in device memory: "
                         + ("passed" if c.passed else "FAILED: " + "; ".join(c.problems)))
            on_update()

        self.pipeline_check = run_host_tier(self.options, self.directory, self.direct_reads, batches, grad,
                                            self.cache_rows[0], self.log, on_result)
        self.log("pipeline losses: " + ("equal" if self.pipeline_check["passed"]
                                        else "; ".join(self.pipeline_check["problems"])))
        on_update()

    def _measure_disk(self, on_update: Callable[[], None]) -> None:
        """The disk's figures on the store directory's file system; a file of 4 GiB x scale (at
        least 16 MiB), random reads for 3 s x scale (at least 0.5 s)."""
        scale = self.options.scale
        file_bytes = max(16 << 20, int((4 << 30) * scale))
        try:
            self.disk = measure_disk(self.directory, file_bytes, read_s=min(3.0, max(0.5, 3.0 * scale)),
                                     seed=self.options.seed)
            self.log(self.disk.line())
            if self.disk.note:
                self.log(self.disk.note)
                if self.options.direct_reads:
                    self.notes.append(f"RocksDB reads through the page cache: {self.disk.note}")
        except Exception as e:  # noqa: BLE001 - reported in the JSON
            self.log(traceback.format_exc())
            self.disk = {"error": f"{type(e).__name__}: {e}"}
        on_update()

    @property
    def direct_reads(self) -> bool:
        """RocksDB reads with O_DIRECT: asked for, and the disk measurement found it accepted."""
        return self.options.direct_reads and isinstance(self.disk, DiskFigures) and self.disk.direct

    def disk_floor(self) -> dict | None:
        """The least step time the disk allows ours' misses and writes (``step_floor``); the table's
        "x floor" of ours is its step over it."""
        ours = next((r for r in self.results if r.configuration == "ours" and r.error is None and r.extra),
                    None)
        if ours is None or not isinstance(self.disk, DiskFigures):
            return None
        x = ours.extra
        floor = step_floor(self.disk, x["misses_per_step"], x["bytes_moved_per_step"]["device->backend"],
                           ours.step_ms)
        ours.x_floor = floor["step_over_floor"]
        return floor

    def _measure(self, runs: list[ConfigRun], on_update: Callable[[], None]) -> None:
        """Each run measured, its checked rows in ``rows`` (None where it failed; its error goes in
        the results). With ``interleave``, every run is started before any is timed and they take
        turns of that many steps; without, each runs from start to finish before the next is built."""
        turn = self.options.interleave
        self._live = []
        for run in runs:
            self._start(run, on_update)
            if (not turn and run in self._live
                    and self._attempt(run, lambda run=run: run.time_steps(run.left), on_update)):
                self._finish(run, on_update)
        while any(r.left for r in self._live):
            for run in list(self._live):
                self._attempt(run, lambda run=run: run.time_steps(turn, self._others(run)), on_update)
        for run in runs:
            if run in self._live:
                self._finish(run, on_update)

    def _others(self, run: ConfigRun) -> int:
        """Device bytes the other live configurations hold."""
        return sum(r.resident for r in self._live if r is not run)

    def _start(self, run: ConfigRun, on_update: Callable[[], None]) -> None:
        self.log(f"{run.label} ...")
        if self._attempt(run, lambda: run.start(self._others(run)), on_update):
            self._live.append(run)

    def _finish(self, run: ConfigRun, on_update: Callable[[], None]) -> None:
        def phase() -> None:
            m = run.finish(self.log)
            self._live.remove(run)
            run.close()
            self.results.append(m)

        if self._attempt(run, phase, on_update):
            fill_ratios(self.results)
            self.disk_floor()  # ssd: ours' x floor, against the disk's
            on_update()

    def _attempt(self, run: ConfigRun, phase: Callable[[], None], on_update: Callable[[], None]) -> bool:
        """Runs one phase of ``run``; a failure is logged, closes the run and reports its error."""
        try:
            phase()
            return True
        except Exception as e:  # noqa: BLE001 - reported in the table and the JSON
            self.log(traceback.format_exc())
            run.m.error = f"{type(e).__name__}: {e}"
            run.rows = None
            if run in self._live:
                self._live.remove(run)
            run.close()
            self.results.append(run.m)
            on_update()
            return False

    @property
    def ok(self) -> bool:
        return (all(r.error is None for r in self.results) and self.check is not None
                and self.check.passed and not (self.raw or {}).get("error")
                and not isinstance(self.disk, dict)
                and (self.tbe_check is None or self.tbe_check.passed)
                and (self.options.host_budget is None
                     or (self.host_check is not None and self.host_check.passed
                         and bool(self.pipeline_check and self.pipeline_check["passed"]))))

    @property
    def all_on_device(self) -> str:
        """How the reports name the peer: "all in HBM" on a GPU, "all in device memory" on a CPU."""
        return f"all in {memory_name(self.options.device)}"

    def _step_ms(self, configuration: str) -> float | None:
        return next((r.step_ms for r in self.results if r.configuration == configuration and r.step_ms),
                    None)

    def ratio_vs_hbm(self) -> float | None:
        ours, peer = self._step_ms("ours"), self._step_ms("peer")
        return ours / peer if ours and peer else None

    def ratio_vs_tbe(self) -> float | None:
        """Ours' step over FBGEMM TBE MANAGED_CACHING's, where both ran."""
        ours, tbe = self._step_ms("ours"), self._step_ms("tbe")
        return ours / tbe if ours and tbe else None

    def _ours_lines(self, x: dict) -> list[str]:
        """Ours' lines: its start, hit rate, indexes and traffic (``x``: its ``Measurement.extra``)."""
        bw, lines = self.bandwidth, []
        moved, rate = x["bytes_moved_per_step"], x["achieved_bytes_per_s"]
        hr = x["hit_rate"]
        lines.append(
            f"hit rate {hr:.4f} of unique keys; misses/step {x['misses_per_step']:.0f} "
            f"(conflict {x['conflict_misses_per_step']:.0f}), evictions/step "
            f"{x['evictions_per_step']:.0f}; cache rows/table {self.cache_rows[0]}"
            if hr is not None else "hit rate -")
        if x.get("rows_after_prefill"):
            lines.append(f"before timing ({x['prefill_rows_per_table']} ranks a table written, "
                         f"{x['prefill_s']:.1f} s), rows by tier: " + ", ".join(
                             f"{t} {n}" for t, n in sorted(x["rows_after_prefill"].items())))
        lines.append("key indexes: " + ", ".join(
            f"{where} {n / 1e9:.3g} GB" for where, n in sorted(x.get("index_bytes", {}).items())))
        lines.append(
            f"bytes moved/step: backend->device {moved['backend->device'] / 1e6:.2f} MB, "
            f"device->backend {moved['device->backend'] / 1e6:.2f} MB; achieved "
            f"{rate['backend->device'] / 1e9:.2f} / {rate['device->backend'] / 1e9:.2f} GB/s "
            f"vs {bw['kind']} copy {bw['host_to_device_bytes_per_s'] / 1e9:.1f} / "
            f"{bw['device_to_host_bytes_per_s'] / 1e9:.1f} GB/s "
            f"({rate['backend->device'] / bw['host_to_device_bytes_per_s']:.1%} / "
            f"{rate['device->backend'] / bw['device_to_host_bytes_per_s']:.1%})")
        return lines

    def details(self) -> str:
        """Lines under the table: hit rate, traffic and bandwidth, the ratio, raw RocksDB rates."""
        lines = []
        ratio, targets, ssd = self.ratio_vs_hbm(), self.targets(), self.options.workload == "ssd"
        if ratio is not None:  # a target for cache; none for ssd, where RocksDB's rate sets the step
            lines.append(f"ours / {self.all_on_device} step time: {ratio:.2f}x" if ssd else targets[0].line())
        lines += [t.line() for t in targets if t.what.startswith("ours / FBGEMM")] + self.notes
        if isinstance(self.disk, DiskFigures):
            lines.append(self.disk.line())
        elif self.disk:
            lines.append(f"disk measurement FAILED: {self.disk['error']}")
        if (floor := self.disk_floor()) is not None:
            lines.append(floor_line(floor))
        for r in self.results:
            if r.configuration == "ours" and r.error is None and r.extra:
                lines += self._ours_lines(r.extra)
        if self.check is not None:
            c = self.check
            lines.append(f"check ours vs {self.all_on_device} after flush: "
                         f"{'same rows' if c.passed else 'DIFFERENT ROWS: ' + '; '.join(c.problems)} "
                         f"(max |diff| {c.max_abs_diff:.3g}; {c.rows_compared} keys, {c.rows_found} "
                         f"stored, {c.rows_moved} trained)")
        if self.tbe_check is not None:
            c = self.tbe_check
            lines.append(f"check FBGEMM's TBE vs {self.all_on_device} after flush: "
                         f"{'same rows' if c.passed else 'DIFFERENT ROWS: ' + '; '.join(c.problems)} "
                         f"(max |diff| {c.max_abs_diff:.3g}; {c.rows_compared} keys, {c.rows_moved} trained)")
        if self.options.host_budget is not None:
            lines += self._host_tier_lines()
        if self.raw and "error" not in self.raw:
            r = self.raw
            lines.append(
                f"RocksDB x{r['threads']} threads, {r['rows']} rows of {r['row_bytes']} B in calls of "
                f"{r['call_rows']}: raw rocksdict get {r['raw_get_rows_per_s']:.3g} rows/s "
                f"({r['raw_get_bytes_per_s'] / 1e6:.0f} MB/s), put {r['raw_put_rows_per_s']:.3g} rows/s "
                f"({r['raw_put_bytes_per_s'] / 1e6:.0f} MB/s); RocksDBBackend get "
                f"{r['backend_get_rows_per_s']:.3g} rows/s ({r['backend_get_bytes_per_s'] / 1e6:.0f} "
                f"MB/s), set {r['backend_set_rows_per_s']:.3g} rows/s "
                f"({r['backend_set_bytes_per_s'] / 1e6:.0f} MB/s); medians of {r['rounds']} rounds in turns")
            lines += [t.line() for t in targets]
        elif self.raw:
            lines.append(f"raw RocksDB rates FAILED: {self.raw['error']}")
        return "\n".join(lines)

    def _host_tier_lines(self) -> list[str]:
        lines = [f"step ratio {name}: {x:.2f}x" for name, x in self._host_tier_steps().items() if "/" in name]
        for r in self.results:
            if r.error is None and "host_tier" in r.extra:
                h = r.extra["host_tier"]
                lines.append(f"{r.configuration}: host tier hits {h.get('hits', 0):.0f}, misses "
                             f"{h.get('misses', 0):.0f}, read ahead {h.get('read_ahead_rows', 0):.0f} "
                             f"(used {h.get('read_ahead_hits', 0):.0f}, waited for "
                             f"{h.get('read_ahead_late', 0):.0f}), written down "
                             f"{h.get('written_down', 0):.0f}"
                             + (" a step" if r.configuration == "host_tier" else " in all"))
                if (floor := self._host_tier_floor(r)) is not None:
                    lines.append(host_tier_floor_line(floor))
        if self.host_check is not None:
            c = self.host_check
            lines.append(f"check host tier vs {self.all_on_device} after flush: "
                         f"{'same rows' if c.passed else 'DIFFERENT ROWS: ' + '; '.join(c.problems)}")
        if self.pipeline_check is not None:
            c = self.pipeline_check
            lines.append("check TrainPipeline losses (RocksDB, host tier + lookahead, all in device memory): "
                         + ("equal" if c["passed"] else "; ".join(c["problems"])))
        return lines

    def targets(self) -> list[Target]:
        """The figures held to a bound: ``cache``, its step against the peer's; ``ssd``, our RocksDB
        backend's rates against raw rocksdict's."""
        ratio, raw, tbe = self.ratio_vs_hbm(), self.raw, self.ratio_vs_tbe()
        if self.options.workload == "cache":
            return ([] if ratio is None else [
                Target(f"ours / {self.all_on_device} step time", ratio, "<=", CACHE_TARGET)]) + (
                [] if tbe is None else [Target("ours / FBGEMM TBE MANAGED_CACHING step time", tbe, "<=",
                                               TBE_CACHE_TARGET)])
        if not raw or "error" in raw:
            return []
        return [Target(f"RocksDBBackend / raw rocksdict {ours}", raw[f"backend_{ours}_rows_per_s"]
                       / raw[f"raw_{theirs}_rows_per_s"], ">=", ROCKSDB_TARGET, "%")
                for ours, theirs in (("get", "get"), ("set", "put"))]

    def summary(self) -> dict:
        opts = self.options
        return {
            "shape": asdict(opts.shape),
            "lookups_per_step": opts.shape.lookups,
            "options": {"device": str(opts.device), "steps": opts.steps, "warmup": opts.warmup,
                        "seed": opts.seed, "budget_fraction": opts.budget_fraction,
                        "shards": opts.shards, "prefill": opts.prefill, "optimizer": OPTIMIZER,
                        "store_rows": opts.store_rows, "block_cache_bytes": opts.block_cache_bytes,
                        "store_process": opts.store_process,
                        "interleave": opts.interleave, "direct_reads": self.direct_reads,
                        "lr": LR, "directory": self.directory},
            "footprint_bytes": opts.footprint_bytes,
            "hbm_budget_bytes": int(opts.budget_fraction * opts.footprint_bytes),
            "cache_rows_per_table": self.cache_rows,
            "bandwidth": self.bandwidth,
            "ratio_vs_all_hbm": self.ratio_vs_hbm(),
            "targets": self.targets(),
            "results": self.results,
            "check": self.check,
            "tbe_check": self.tbe_check,
            "notes": self.notes,
            "rocksdb_rates": self.raw,
            "disk": self.disk,
            "disk_floor": self.disk_floor(),
            "host_tier": None if opts.host_budget is None else {
                "host_budget": opts.host_budget, "lookahead": opts.lookahead,
                "dense_model": f"{opts.dense_layers} x {opts.dense_width}",
                "check": self.host_check, "pipeline_losses": self.pipeline_check,
                "step_ms": self._host_tier_steps(),
                "disk_floor": next((f for r in self.results if (f := self._host_tier_floor(r))), None)},
        }

    def _host_tier_floor(self, r: Measurement) -> dict | None:
        """The plain host-tier run's disk floor (``host_tier_floor``); None for other runs."""
        if r.configuration != "host_tier" or r.error is not None or not isinstance(self.disk, DiskFigures):
            return None
        return host_tier_floor(self.disk, r)

    def _host_tier_steps(self) -> dict:
        """``--host-budget``: each configuration's step, and the ratios the targets speak of."""
        ms = {r.configuration: r.step_ms for r in self.results if r.step_ms}
        out: dict = {"step_ms": ms}
        for a, b in (("host_tier", "ours"), ("host_tier", "host_memory"),
                     ("pipeline_host_tier", "pipeline"),
                     ("pipeline_host_tier", "pipeline_peer"), ("pipeline", "pipeline_peer")):
            if ms.get(a) and ms.get(b):
                out[f"{a} / {b}"] = ms[a] / ms[b]
        return out


def cache_shape(scale: float) -> HbmShape:
    """The cache workload's shape at ``scale`` (rows and batch)."""
    return replace(CACHE_SHAPE).scaled(scale)


__all__ = ["CacheBench", "cache_shape", "measure_pinned_bandwidth", "raw_rocksdb_rates"]
