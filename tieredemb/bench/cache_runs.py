"""The ``cache`` workload's parts: its options, batches (Zipf ranks used as ids), the configuration
runs it times in turns (``ConfigRun``: build, warm up, time, read back, free), its counters and its
row check. ``tieredemb.bench.cache`` drives them; ``tieredemb.bench.cache_tbe`` adds FBGEMM's TBE as
one more run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import tieredemb as te
from tieredemb.bench.report import (
    Measurement,
    host_rss_bytes,
    huge_page_bytes,
    peak_host_rss_bytes,
    python_loop_ms,
)
from tieredemb.bench.timing import (
    allocated_bytes,
    free_memory,
    peak_device_bytes,
    reset_peak,
    synchronize,
    time_ms,
)
from tieredemb.bench.workloads import HbmShape, ZipfSampler
from tieredemb.storage.backend import add_bytes
from tieredemb.storage.tiers.cache import CacheTier

CACHE_SHAPE = HbmShape(rows=10_000_000)
OPTIMIZER = "rowwise_adagrad"
LR = 0.05
CHECK_HOT, CHECK_RANDOM, CHECK_LAST = 2048, 8192, 8192
CHECK_RTOL, CHECK_ATOL = 1e-4, 1e-5



@dataclass
class CacheOptions:
    """What ``tieredemb bench cache|ssd`` runs."""

    workload: str = "cache"  # "cache" | "ssd"
    shape: HbmShape = field(default_factory=lambda: CACHE_SHAPE)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    steps: int = 20
    warmup: int = 20
    seed: int = 0
    budget_fraction: float = 0.1
    directory: str | None = None  # ssd: the RocksDB directory (default: a fresh one under /tmp)
    shards: int = 8
    prefill: bool = True
    raw_rows: int | None = None  # ssd baseline rows (default: scaled from 1M)
    # ssd: RocksDB reads the disk with O_DIRECT (RocksDB(direct_reads=True)), not the page cache,
    # where the directory's file system allows it
    direct_reads: bool = True
    # cache: the host store's rows page-locked and its index sized up front (HostMemory.reserve_rows),
    # and the all-in-HBM peer's rows and index (TableConfig.init_capacity)
    reserve: bool = False
    # ours and the all-in-HBM peer both built, then timed this many steps at a time in turns (0: one
    # configuration after the other, each built only while it runs: less device memory at once)
    interleave: int = 10
    # ssd: a host tier in front of RocksDB (a fraction < 1 of the tables' bytes, or bytes; None: those
    # runs are skipped), batches read ahead, and the DLRM-style dense model of the pipeline runs
    # (``tieredemb.bench.host_tier``)
    host_budget: float | int | None = None
    # ssd: the share of each table's ranks in the store before timing (their initial rows): misses
    # then read rows the store holds, from the disk; 0: the store starts with the cache's rows, and
    # most misses are keys no store holds yet
    store_rows: float = 0.0
    # ssd: RocksDB's block cache, one for the store (RocksDB(block_cache_bytes=)); None: RocksDB's
    # default, a cache per column family, which may hold a small store whole
    block_cache_bytes: int | None = None
    # ssd: RocksDB served by a child process of its own (RocksDB(process=True)): its writes no longer
    # hold the training process's interpreter lock
    store_process: bool = True
    lookahead: int = 2
    dense_width: int = 1024
    dense_layers: int = 4

    def __post_init__(self) -> None:
        if self.workload not in ("cache", "ssd"):
            raise ValueError(f"workload must be cache or ssd, got {self.workload!r}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"need steps >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")
        if self.interleave < 0:
            raise ValueError(f"interleave must be >= 0 steps, got {self.interleave}")
        if not 0 < self.budget_fraction < 1:
            raise ValueError(f"budget fraction must be in (0, 1), got {self.budget_fraction}")
        if self.host_budget is not None and self.workload != "ssd":
            raise ValueError("a host budget needs the ssd workload (a host tier in front of RocksDB)")
        if not 0 <= self.store_rows <= 1:
            raise ValueError(f"store_rows must be in [0, 1], got {self.store_rows}")
        if self.block_cache_bytes is not None and self.block_cache_bytes < 0:
            raise ValueError(f"block_cache_bytes must be >= 0, got {self.block_cache_bytes}")
        if self.lookahead < 0 or self.dense_width < 1 or self.dense_layers < 1:
            raise ValueError(f"need lookahead >= 0 and a dense model of >= 1 layer of >= 1 unit, got "
                             f"{self.lookahead}, {self.dense_layers} x {self.dense_width}")

    def rocksdb(self, path: str, direct_reads: bool) -> te.storage.RocksDB:
        """The store of an ssd run: RocksDB at ``path`` with this bench's shards and block cache."""
        return te.storage.RocksDB(path, shards=self.shards, direct_reads=direct_reads,
                                  block_cache_bytes=self.block_cache_bytes, process=self.store_process)

    @property
    def scale(self) -> float:
        """Rows against the full-scale workload's (sizes the ssd bench's disk file and baseline)."""
        return self.shape.rows / CACHE_SHAPE.rows

    @property
    def row_bytes(self) -> int:
        return (self.shape.dim + 1) * 4  # weights + RowWiseAdagrad's one state float

    @property
    def footprint_bytes(self) -> int:
        return self.shape.num_tables * self.shape.rows * self.row_bytes


# ---------------------------------------------------------------------------------- batches
@dataclass
class RankBatch:
    step: int
    ranks: torch.Tensor  # int64 (T, B, L) device
    kjt: te.KeyedJaggedTensor  # ids = ranks, features f0..f{T-1}
    unique_keys: int  # distinct ids summed over tables


class RankBatches:
    """The ``hbm`` workload's ranks (same sampler, same per-step seeds) used as ids directly."""

    def __init__(self, shape: HbmShape, device: torch.device, seed: int = 0) -> None:
        self.shape, self.device, self.seed = shape, torch.device(device), seed
        self.sampler = ZipfSampler(shape.rows, shape.alpha, self.device)

    def batch(self, step: int) -> RankBatch:
        s = self.shape
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + step)
        ranks = self.sampler.sample((s.num_tables, s.batch_size, s.bag_size), gen)
        lengths = torch.full((s.num_tables * s.batch_size,), s.bag_size, dtype=torch.int64,
                             device=self.device)
        kjt = te.KeyedJaggedTensor(keys=[s.feature_name(t) for t in range(s.num_tables)],
                                   values=ranks.reshape(-1), lengths=lengths)
        unique = sum(int(torch.unique(ranks[t]).numel()) for t in range(s.num_tables))
        return RankBatch(step, ranks, kjt, unique)


def table_configs(shape: HbmShape, init_capacity: int | None = None) -> list[te.TableConfig]:
    return [te.TableConfig(name=shape.table_name(t), embedding_dim=shape.dim,
                           feature_names=[shape.feature_name(t)], num_embeddings=shape.rows,
                           initializer=te.init.Uniform(-0.01, 0.01), init_capacity=init_capacity)
            for t in range(shape.num_tables)]


_COUNTERS = ("lookups", "unique_lookups", "hits", "misses", "conflict_misses", "evictions",
             "fetched_bytes", "written_bytes")


def counters(ebc: te.EmbeddingBagCollection) -> dict[str, int]:
    """Summed over tables, without the backend's row count (O(rows) in RocksDB)."""
    out = dict.fromkeys(_COUNTERS, 0)
    for group in ebc.tiers:
        for t in range(len(group.configs)):
            s = group.stats(t, backend_rows=False) if isinstance(group, CacheTier) else group.stats(t)
            for k in _COUNTERS[:6]:
                out[k] += int(getattr(s, k))
            out["fetched_bytes"] += s.bytes_moved.get("backend->device", 0)
            out["written_bytes"] += s.bytes_moved.get("device->backend", 0)
    return out


def prefill(ebc: te.EmbeddingBagCollection, shape: HbmShape, rows: int, device: torch.device,
            seed: int, hot: int | None = None, flush: bool = False) -> None:
    """Write ranks [0, rows) of every table with their initial rows: ranks [hot, rows) first, then
    the ``hot`` hottest (default: all in one pass), so that a cache of ``hot`` rows ends with them.
    ``flush``: then ``ebc.flush()``, so that a store holds them in its files (RocksDB's write buffers
    written out: its reads then come from its block cache or the disk, not from memory tables)."""
    hot = rows if hot is None else min(hot, rows)
    for config in table_configs(shape):
        for a, b in ((hot, rows), (0, hot)):
            for lo in range(a, b, 1 << 18):
                keys = torch.arange(lo, min(lo + (1 << 18), b), device=device)
                ebc.write(config.name, keys, config.initializer.rows(seed, config.name, keys, shape.dim))
    if flush:
        ebc.flush()


def prefill_rows(opts: CacheOptions, cache_rows: int) -> int:
    """Ranks a table of ours is written with before timing: the cache's, or ``store_rows`` of them."""
    return max(cache_rows, round(opts.store_rows * opts.shape.rows))


def rows_by_tier(ebc: te.EmbeddingBagCollection) -> dict[str, int]:
    """Rows in each tier, summed over the tables (``TableStats.rows``)."""
    out: dict[str, int] = {}
    for s in ebc.stats().values():
        for tier, n in s.rows.items():
            out[tier] = out.get(tier, 0) + n
    return out


def check_keys(shape: HbmShape, last: RankBatch, seed: int) -> list[torch.Tensor]:
    """Per table, ranks compared (int64 host, sorted): hottest, random, and the last batch's."""
    gen = torch.Generator().manual_seed(seed + 29)
    out = []
    for t in range(shape.num_tables):
        hot = torch.arange(min(CHECK_HOT, shape.rows))
        rand = torch.randint(0, shape.rows, (min(CHECK_RANDOM, shape.rows),), generator=gen)
        lastb = last.ranks[t].reshape(-1).cpu()[:CHECK_LAST]
        out.append(torch.unique(torch.cat([hot, rand, lastb])))
    return out


@dataclass
class CacheRowCheck:
    passed: bool
    rows_compared: int
    rows_found: int
    rows_moved: int
    max_abs_diff: float
    problems: list[str] = field(default_factory=list)


def read_rows(ebc: te.EmbeddingBagCollection, shape: HbmShape, keys: list[torch.Tensor],
              device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for t, k in enumerate(keys):
        w, f = ebc.read(shape.table_name(t), k.to(device))
        out.append((w.detach().cpu(), f.cpu()))
    return out


def compare(shape: HbmShape, keys: list[torch.Tensor], ours: list, peer: list,
            seed: int) -> CacheRowCheck:
    problems: list[str] = []
    compared = found_n = moved = 0
    max_diff = 0.0
    for t, config in enumerate(table_configs(shape)):
        (ow, of), (pw, pf) = ours[t], peer[t]
        compared += of.numel()
        if not torch.equal(of, pf):
            problems.append(f"table {t}: ours finds {int(of.sum())} of the checked keys, the "
                            f"peer {int(pf.sum())}")
            continue
        found_n += int(of.sum())
        if of.any():
            d = float((ow[of] - pw[of]).abs().max())
            max_diff = max(max_diff, d)
            if not torch.allclose(ow[of], pw[of], rtol=CHECK_RTOL, atol=CHECK_ATOL):
                problems.append(f"table {t}: rows differ from the peer's rows by up to {d:.3g}")
            init = config.initializer.rows(seed, config.name, keys[t][of], shape.dim)
            moved += int(((pw[of] - init).abs().amax(dim=1) > 0).sum())
        if not torch.equal(ow[~of], torch.zeros_like(ow[~of])):
            problems.append(f"table {t}: keys not stored do not read as zeros")
    if moved == 0:
        problems.append("no compared row moved from its initial value: the check proves nothing")
    return CacheRowCheck(not problems, compared, found_n, moved, max_diff, problems)


# ------------------------------------------------------------------------------------ runs
class ConfigRun:
    """One configuration of the bench: ``start`` builds, prefills and warms it up, ``time_steps``
    times its next steps, ``finish`` reads its counters and (after flush) the checked keys' rows
    into ``keys`` and ``rows``, ``close`` frees it. Two of them timed in turns
    (``CacheOptions.interleave``) see the same machine: the host's speed on the device machines
    was measured to move by up to 2x between processes and within one.

    Peak device memory is its own: the allocator's peak in each of its phases less what the other
    configurations held meanwhile (``others``: their ``resident`` bytes, held between their steps).
    """

    def __init__(self, opts: CacheOptions, label: str, storage: te.StorageConfig,
                 batches: RankBatches, grad: torch.Tensor, prefill_rows: int,
                 configuration: str = "ours", hot_rows: int | None = None) -> None:
        self.opts, self.label, self.storage = opts, label, storage
        self.batches, self.grad, self.prefill_rows = batches, grad, prefill_rows
        self.hot_rows = hot_rows  # of the prefill, written last (``prefill``)
        self.configuration = configuration
        self.m = Measurement(configuration, OPTIMIZER, label)
        self.ebc: te.EmbeddingBagCollection | None = None
        self.times: list[float] = []
        self.unique: list[int] = []
        self.last: RankBatch | None = None
        self.keys: list[torch.Tensor] = []  # after ``finish``: the keys checked (``check_keys``)
        self.rows: list | None = None  # and their rows (host)
        self.before: dict[str, int] = {}
        self.resident = 0
        self.peak: int | None = None
        self.prefill_s = 0.0
        self.rows_after_prefill: dict[str, int] | None = None

    @property
    def left(self) -> int:
        return self.opts.steps - len(self.times)

    def _step(self, b: RankBatch) -> None:
        self.ebc.prefetch(b.kjt)
        self.ebc(b.kjt).values().backward(self.grad)

    def _note_peak(self, others: int) -> None:
        peak = peak_device_bytes(self.opts.device)
        if peak is not None:
            self.peak = max(self.peak or 0, peak - others)

    def start(self, others: int = 0) -> None:
        opts, shape, dev = self.opts, self.opts.shape, self.opts.device
        reset_peak(dev)
        base = allocated_bytes(dev)
        # ``reserve``: everything sized up front, the host store's rows and index for ours, the
        # tables' rows and index for the peer (without, they grow as keys arrive: a rehash at times)
        sized = shape.rows if opts.reserve and self.configuration == "peer" else None
        self.ebc = te.EmbeddingBagCollection(table_configs(shape, sized),
                                             optimizer=te.optim.RowWiseAdagrad(lr=LR),
                                             storage=self.storage, device=dev, seed=opts.seed)
        t0 = time.perf_counter()
        if self.prefill_rows and opts.prefill:
            prefill(self.ebc, shape, self.prefill_rows, dev, opts.seed, self.hot_rows,
                    flush=bool(opts.store_rows))
        synchronize(dev)
        self.prefill_s = time.perf_counter() - t0
        if opts.store_rows:  # counts the store's keys: once, untimed
            self.rows_after_prefill = rows_by_tier(self.ebc)
        for i in range(opts.warmup):
            b = self.batches.batch(i)
            time_ms(lambda b=b: self._step(b), dev)
        synchronize(dev)
        self.before = counters(self.ebc)
        self.resident = allocated_bytes(dev) - base
        self._note_peak(others)

    def time_steps(self, steps: int, others: int = 0) -> None:
        dev = self.opts.device
        if dev.type == "cuda":  # not reset_peak: emptying the allocator's cache would slow the next steps
            torch.cuda.reset_peak_memory_stats(dev)
        for _ in range(min(steps, self.left)):
            b = self.batches.batch(self.opts.warmup + len(self.times))
            self.times.append(time_ms(lambda b=b: self._step(b), dev))
            self.unique.append(b.unique_keys)
            self.last = b
        self._note_peak(others)

    def finish(self, log: Callable[[str], None] = lambda s: None) -> Measurement:
        """The measurement; the keys checked (from the last batch, the same for every
        configuration) and their rows go in ``keys`` and ``rows``."""
        shape, dev, m, ebc = self.opts.shape, self.opts.device, self.m, self.ebc
        synchronize(dev)
        after = counters(ebc)
        m.set_times(self.times, shape.lookups)
        m.unique_keys_per_step = statistics.mean(self.unique)
        m.peak_device_bytes = self.peak
        m.host_rss_bytes = host_rss_bytes()
        delta = {k: after[k] - self.before[k] for k in _COUNTERS}
        n = self.opts.steps
        fetched, written = delta["fetched_bytes"] / n, delta["written_bytes"] / n
        sec = m.step_ms * 1e-3
        m.new_keys_per_step = delta["misses"] / n
        m.extra = {
            "storage_mode": ebc.storage_mode,
            "prefill_rows_per_table": self.prefill_rows if self.opts.prefill else 0,
            "prefill_s": self.prefill_s,
            "rows_after_prefill": self.rows_after_prefill,
            "timed_counters": delta,
            "hit_rate": delta["hits"] / delta["unique_lookups"] if delta["unique_lookups"] else None,
            "misses_per_step": delta["misses"] / n,
            "conflict_misses_per_step": delta["conflict_misses"] / n,
            "evictions_per_step": delta["evictions"] / n,
            "bytes_moved_per_step": {"backend->device": fetched, "device->backend": written},
            "achieved_bytes_per_s": {"backend->device": fetched / sec, "device->backend": written / sec,
                                     "both": (fetched + written) / sec},
            "rows_device": after_rows(ebc),
            "index_bytes": index_bytes(ebc),
            "peak_host_rss_bytes": peak_host_rss_bytes(),
            "huge_page_bytes": huge_page_bytes(),
            "python_loop_ms": python_loop_ms(),  # the host's speed as the run ends
        }
        t0 = time.perf_counter()
        ebc.flush()
        synchronize(dev)
        m.extra["flush_s"] = time.perf_counter() - t0
        self.keys = check_keys(shape, self.last, self.opts.seed)
        self.rows = read_rows(ebc, shape, self.keys, dev)
        log(f"{self.label}: {m.step_ms:.3f} ms/step" + (
            f", hit rate {m.extra['hit_rate']:.4f}" if m.extra["hit_rate"] is not None else ""))
        return m

    def close(self) -> None:
        ebc, self.ebc = self.ebc, None  # the tables' memory goes before the next configuration is built
        self.resident = 0
        if ebc is not None:
            ebc.close()
        free_memory(self.opts.device)


def after_rows(ebc: te.EmbeddingBagCollection) -> int:
    return sum(group.index.size() for group in ebc.tiers)


def index_bytes(ebc: te.EmbeddingBagCollection) -> dict[str, int]:
    """Bytes of every table's key indexes, by where they live (``TableStats.index_bytes``; without
    ``stats()``, which counts a RocksDB store's rows by a scan)."""
    return add_bytes(*(group.index_bytes(t) for group in ebc.tiers for t in range(len(group.configs))))
