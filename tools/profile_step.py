"""Profile steady-state steps of the ``hbm`` workload: where the training thread spends its time and
how many host syncs a step makes. Writes the full table to $OUT/profile.txt; prints a summary.

    python3 tools/profile_step.py [--scale S] [--optimizer adam|sgd] [--steps N] [--python | --host]
                                    [--autograd-threads] [--device cpu]

``--device cpu`` runs the same steps on the CPU: no GPU's timings, but the paths a step takes, its
Python calls (``--python``) and a cache tier's insertions (``--time``) as on the GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import tieredemb as te
from tieredemb.bench.cache import cache_shape
from tieredemb.bench.cache_runs import RankBatches, prefill
from tieredemb.bench.cache_runs import table_configs as cache_table_configs
from tieredemb.bench.hbm import OPTIMIZERS, preinsert_rows, upstream_grad
from tieredemb.bench.workloads import HbmBatches, HbmShape

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "aten::item",
               "aten::_local_scalar_dense", "aten::nonzero", "aten::unique", "aten::_unique2")


_DEVICE = [torch.device("cuda")]  # the device of the run (main sets it)


def sync() -> None:
    """Wait for the device's queued work (on the CPU there is none)."""
    if _DEVICE[0].type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--workload", choices=["hbm", "cache", "ssd"], default="hbm",
                   help="ssd: a device cache of 1%% of the tables over RocksDB (O_DIRECT reads, in a "
                        "temporary directory) with a host tier of --host-budget of the tables")
    p.add_argument("--host-budget", type=float, default=0.1,
                   help="ssd: the host tier's share of the tables' bytes, or bytes if >= 1 (0: no host tier)")
    p.add_argument("--store-process", action="store_true",
                   help="ssd: RocksDB served by a child process (RocksDB(process=True))")
    p.add_argument("--budget-fraction", type=float, default=None,
                   help="cache/ssd: the device cache's share of the tables' bytes (default 0.1 / 0.01)")
    p.add_argument("--store-rows", type=float, default=0.0,
                   help="ssd: the share of each table's ranks written before timing (bench ssd --store-rows)")
    p.add_argument("--lookahead", type=int, default=0,
                   help="ssd: each step reads the rows of the batch this many ahead into the host tier "
                        "first (ebc.read_ahead, as bench ssd's plain loop)")
    p.add_argument("--sample", action="store_true",
                   help="sample every thread's Python stack each millisecond: where each thread is")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--python", action="store_true", help="cProfile the Python side instead")
    p.add_argument("--time", action="store_true", help="time the steps alone (no profiler): ms a step")
    p.add_argument("--host", action="store_true",
                   help="host time of each labelled stage, timed without a profiler")
    p.add_argument("--launches", action="store_true",
                   help="with --host: also each Triton kernel's launch and a few torch calls, by name")
    p.add_argument("--reserve", action="store_true", help="cache: page-lock the host store up front")
    p.add_argument("--sharded", action="store_true",
                   help="hbm: through the sharded path, on a process group of one rank (NCCL; gloo with "
                        "--device cpu)")
    p.add_argument("--overlap", choices=["forward", "backward", "deferred", "deferred-side"], default=None,
                   help="each step prefetches the next batch on a side stream after its forward or "
                        "backward (Overlapped)")
    p.add_argument("--dense-layers", type=int, default=0,
                   help="--pipeline: a dense MLP of this many layers in the model (the bench's DLRM: 16)")
    p.add_argument("--dense-width", type=int, default=1024, help="--dense-layers' width (the bench's: 8192)")
    p.add_argument("--pipeline", action="store_true",
                   help="each step is te.TrainPipeline's progress (no dense model; batches pinned on the "
                        "host as a loader yields them; --lookahead: TrainPipeline(lookahead=k))")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: the same steps on the CPU (the host's work without a GPU's launches)")
    p.add_argument("--autograd-threads", action="store_true",
                   help="backward on autograd's device threads (default: the calling thread, as the bench)")
    args = p.parse_args()
    if args.sharded:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method="tcp://127.0.0.1:29511",
                                rank=0, world_size=1)
    torch.autograd.set_multithreading_enabled(args.autograd_threads)
    dev = torch.device(args.device)
    _DEVICE[0] = dev
    ebc, shape, batches = build(args, dev)
    grad = upstream_grad(shape, dev, 0)

    kjts, step = make_step(args, ebc, grad, batches, dev)
    for i in range(args.warmup):
        step(i)
    sync()
    if args.time:
        tier_before = _tier_counters(ebc)
        t0 = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
        sync()
        ms = (time.perf_counter() - t0) / args.steps * 1e3
        tier = {k: (v - tier_before.get(k, 0)) / args.steps for k, v in _tier_counters(ebc).items()
                if k in ("hits", "misses", "read_ahead_rows", "read_ahead_late", "written_down")}
        if tier:
            print("host tier a step: " + ", ".join(f"{k} {v:.1f}" for k, v in tier.items()))
        paths = [getattr(t, "insertions", None) for t in ebc.tiers]  # (a cache's; an older package: none)
        paths = [sum(x) for x in zip(*[p for p in paths if p is not None])]
        where = f"; insertions from the start: on the device {paths[0]}, on the host path " \
            f"{sum(paths[1:])}" + (f" ({paths[1]} for the store's rows)" if len(paths) > 2 else "") \
            if paths else ""
        print(f"{ms:.2f} ms a step ({args.steps} steps, no profiler){where}")
    elif args.sample:
        sampled(step, args)
    elif args.python:
        python_profile(step, args)
    elif args.host:
        host_times(ebc, kjts, grad, args)
    else:
        torch_profile(step, args)


def make_step(args, ebc, grad, batches, dev: torch.device):
    """The batches (made outside the profile; the reads ahead's on the host, as a loader yields
    them) and the step of the loop asked for: step(i) trains batch i."""
    kjts = [batches.batch(i).kjt for i in range(args.warmup + args.steps + 3 + args.lookahead)]
    ahead = [k.to(torch.device("cpu")) for k in kjts] if args.lookahead else None
    sync()
    if args.pipeline:
        model = _Loss(ebc, grad, args.dense_layers, args.dense_width)
        pipe = te.TrainPipeline(model, None, device=dev, lookahead=args.lookahead)
        data = iter([{"kjt": _pinned(k.to(torch.device("cpu")), dev)} for k in kjts])
        return kjts, lambda i: pipe.progress(data)
    if args.overlap:
        overlapped = Overlapped(ebc, grad, kjts[0], args.overlap)
        return kjts, lambda i: overlapped.step(kjts[i], kjts[i + 1])

    def step(i: int) -> None:
        kjt = kjts[i]
        if ahead is not None:
            ebc.read_ahead(ahead[i + args.lookahead])
        ebc.prefetch(kjt)
        ebc(kjt).values().backward(grad)

    return kjts, step


def _pinned(kjt, dev: torch.device):
    return kjt.pin_memory() if dev.type == "cuda" else kjt


def _tier_counters(ebc) -> dict[str, int]:
    """The host tiers' counters summed over tables ({} without one, or from an older package)."""
    try:
        from tieredemb.bench.host_tier import host_counters
    except ImportError:
        return {}
    return host_counters(ebc)


def build(args, dev: torch.device):
    """The collection of the workload, its shape and its batches."""
    if args.workload == "hbm":
        shape = HbmShape().scaled(args.scale)
        ebc = te.EmbeddingBagCollection(shape.table_configs(), optimizer=OPTIMIZERS[args.optimizer][0](),
                                        device=dev, process_group=dist.group.WORLD if args.sharded else None)
        t0 = time.perf_counter()
        preinsert_rows(ebc, shape, dev, 0)
        sync()
        print(f"preinsert {shape.num_tables} x {shape.rows} rows: {time.perf_counter() - t0:.1f} s")
        batches = HbmBatches(shape, dev, 0)
    elif args.workload == "ssd":  # 1% of the footprint on the device over RocksDB, a host tier between
        import tempfile

        shape = cache_shape(args.scale)
        configs = cache_table_configs(shape)
        footprint = sum(t.num_embeddings * (t.embedding_dim + 1) * 4 for t in configs)
        backing = te.storage.RocksDB(tempfile.mkdtemp(prefix="profile-ssd-"), shards=8, direct_reads=True,
                                     process=args.store_process)
        host = int(footprint * args.host_budget if args.host_budget < 1 else args.host_budget) or None
        budget = int(footprint * (args.budget_fraction or 0.01))
        storage = te.StorageConfig(hbm_budget=budget, backing=backing, host_budget=host)
        ebc = te.EmbeddingBagCollection(configs, optimizer=te.optim.RowWiseAdagrad(lr=0.05),
                                        storage=storage, device=dev)
        hot = shape.rows // 100
        prefill(ebc, shape, max(hot, round(args.store_rows * shape.rows)), dev, 0, hot)
        batches = RankBatches(shape, dev, 0)
    else:  # cache mode over host memory, 10% of the footprint on the device
        shape = cache_shape(args.scale)
        configs = cache_table_configs(shape)
        footprint = sum(t.num_embeddings * (t.embedding_dim + 1) * 4 for t in configs)
        backing = te.storage.HostMemory(reserve_rows=shape.rows if args.reserve else 0)
        storage = te.StorageConfig(hbm_budget=int(footprint * (args.budget_fraction or 0.1)), backing=backing)
        ebc = te.EmbeddingBagCollection(configs, optimizer=te.optim.RowWiseAdagrad(lr=0.05),
                                        storage=storage, device=dev)
        prefill(ebc, shape, round(shape.rows * (args.budget_fraction or 0.1)), dev, 0)  # the cache full
        batches = RankBatches(shape, dev, 0)
    return ebc, shape, batches


def torch_profile(step, args) -> None:
    """The torch profiler over the timed steps: syncs, stages, top GPU and CPU ops."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=False) as prof:
        t0 = time.perf_counter()
        for i in range(args.warmup, args.warmup + args.steps):
            step(i)
        sync()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
    avg = prof.key_averages()
    out = os.environ.get("OUT", ".")
    prof.export_chrome_trace(os.path.join(out, f"trace-{args.workload}.json"))
    busy = gpu_busy_ms(prof.events())
    with open(os.path.join(out, "profile.txt"), "w") as f:
        f.write(avg.table(sort_by="self_cpu_time_total", row_limit=60))
        f.write("\n\n")
        f.write(avg.table(sort_by="self_cuda_time_total", row_limit=40))
    print(f"{args.optimizer}: {wall:.2f} ms a step (wall, {args.steps} steps under the profiler), "
          f"GPU busy {busy / args.steps:.2f} ms a step (union of kernel and copy intervals)")
    print("per step:  event | count | self CPU ms")
    for e in avg:
        if e.key in SYNC_EVENTS:
            ms = e.self_cpu_time_total / 1e3 / args.steps
            print(f"  {e.key:32s} {e.count / args.steps:8.1f} {ms:8.2f}")
    print("labelled stages per step (CPU total ms):")
    for e in sorted(avg, key=lambda e: -e.cpu_time_total):
        if e.key.startswith("##"):
            print(f"  {e.key:32s} {e.count / args.steps:8.1f} {e.cpu_time_total / 1e3 / args.steps:8.2f}")
    print_top_gpu(avg, args.steps)
    print_stage_ops(prof.events(), args.steps)
    print_gaps(prof.events(), args.steps)
    top = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:25]
    print("top self-CPU ops per step (ms):")
    for e in top:
        ms = e.self_cpu_time_total / 1e3 / args.steps
        print(f"  {e.key[:48]:48s} {e.count / args.steps:8.1f} {ms:8.2f}")


def print_top_gpu(avg, steps: int, title: str = "top GPU time per step (ms):", top: int = 15) -> None:
    """The ``top`` entries of ``avg`` (the profiler's ``key_averages()``) by GPU time, per step."""
    attr = "self_device_time_total" if hasattr(avg[0], "self_device_time_total") else "self_cuda_time_total"
    print(title)
    for e in sorted(avg, key=lambda e: -getattr(e, attr))[:top]:
        print(f"  {e.key[:60]:60s} {e.count / steps:6.1f} {getattr(e, attr) / 1e3 / steps:8.3f}")


class _Loss(torch.nn.Module):
    """The collection's output against a fixed upstream gradient: TrainPipeline's model; with
    ``layers``, a dense MLP of that many ``width`` x ``width`` layers over a fixed input of the
    batch's rows as well (the GPU's work a step, which the pipeline hides the prefetch behind)."""

    def __init__(self, ebc, grad, layers: int = 0, width: int = 1024) -> None:
        super().__init__()
        self.ebc, self.grad = ebc, grad
        dev = grad.device
        self.mlp = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                                         for _ in range(layers)]).to(dev)
        self.x = torch.randn(grad.shape[0], width, device=dev) if layers else None

    def forward(self, batch: dict) -> torch.Tensor:
        loss = (self.ebc(batch["kjt"]).values() * self.grad).sum()
        return loss if self.x is None else loss + self.mlp(self.x).square().mean()


class Overlapped:
    """Steps that prefetch the next batch on a high-priority side stream that waits only for this
    step's forward, right after the forward (``after="forward"``: TrainPipeline's order, the
    prefetch's device work beside the forward's, its read before the backward's launches) or after
    the backward (the prefetch beside the backward's update); ``"deferred"``: ``prefetch_deferred``
    right after the forward on the one stream (TrainPipeline's inline prefetch: the read waits for
    the next forward); ``"deferred-side"``: the same on the side stream (its device work beside the
    backward's). ``first``: the first batch, prefetched now; each ``step(kjt, next_kjt)`` trains
    ``kjt`` and prefetches ``next_kjt`` (None: nothing)."""

    def __init__(self, ebc, grad, first, after: str = "backward",
                 device: torch.device | str = "cuda") -> None:
        self.ebc, self.grad, self.after = ebc, grad, after
        self.side = torch.cuda.Stream(device, priority=-100) if after != "deferred" else None
        self.main = torch.cuda.current_stream(device)
        self.ready = None
        self._prefetch(first, None)

    def _prefetch(self, kjt, after) -> None:
        if self.side is None:
            self.ebc.prefetch_deferred(kjt)
            return
        if after is not None:
            self.side.wait_event(after)
        with torch.cuda.stream(self.side):
            if self.after == "deferred-side":  # the collection orders its use on the main stream
                self.ebc.prefetch_deferred(kjt)
                return
            self.ebc.prefetch(kjt)
        self.ready = self.side.record_event()

    def step(self, kjt, next_kjt) -> None:
        if self.ready is not None:
            self.main.wait_event(self.ready)
        out = self.ebc(kjt).values()
        after_forward = self.main.record_event()
        if next_kjt is not None and self.after in ("forward", "deferred", "deferred-side"):
            self._prefetch(next_kjt, after_forward)
        out.backward(self.grad)
        if next_kjt is not None and self.after == "backward":
            self._prefetch(next_kjt, after_forward)


def gpu_busy_ms(events) -> float:
    """Time in ms during which at least one kernel or copy ran on the device (union of intervals;
    the labels' device ranges left out)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("##"))
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if a > end:
            busy, end = busy + (b - a), b
        elif b > end:
            busy, end = busy + (b - end), b
    return busy / 1e3


def print_gaps(events, steps: int, top: int = 12) -> None:
    """Where the GPU waits: idle gaps between kernels/copies (over 3 us), summed by the kernel that
    ended each gap (what the device waited for the host to issue), per step."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("##"))
    waits: dict[str, list[float]] = {}
    end = None
    for a, b, name in spans:
        if end is not None and a - end > 3:
            cell = waits.setdefault(name[:56], [0.0, 0])
            cell[0] += a - end
            cell[1] += 1
        end = b if end is None else max(end, b)
    total = sum(v[0] for v in waits.values()) / 1e3 / steps
    print(f"GPU idle gaps over 3 us: {total:.3f} ms a step; by the kernel that ended the gap:")
    for name, (us, count) in sorted(waits.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {name:56s} {count / steps:6.1f} {us / 1e3 / steps:8.3f}")


def print_summary(prof, steps: int) -> None:
    """A profiled loop of ``steps`` steps, a step: its host syncs, the GPU's idle gaps and its top
    kernels (after the caller's first line)."""
    for e in prof.key_averages():
        if e.key in SYNC_EVENTS:
            ms = e.self_cpu_time_total / 1e3 / steps
            print(f"  {e.key:32s} {e.count / steps:6.1f} a step, {ms:6.3f} ms")
    print_gaps(prof.events(), steps, top=6)
    print_top_gpu(prof.key_averages(), steps, top=14)


def sampled(step, args, interval: float = 1e-3, top: int = 12) -> None:
    """Every thread's Python stack sampled each ``interval`` s over the timed steps: for each thread,
    the share of samples in which each function was anywhere on its stack (inclusive) and the
    innermost frames it sat in (where it waits or works)."""
    import collections
    import sys
    import threading

    names = {}
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    samples: collections.Counter = collections.Counter()
    done = threading.Event()

    def where(frame) -> str:
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"

    def sampler() -> None:
        me = threading.get_ident()  # its own stack left out
        while not done.wait(interval):
            for t in threading.enumerate():
                names[t.ident] = t.name
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, str(ident))
                samples[name] += 1
                leaf[name][where(frame)] += 1
                seen = set()
                while frame is not None:
                    w = where(frame)
                    if w not in seen:
                        seen.add(w)
                        inclusive[name][w] += 1
                    frame = frame.f_back

    thread = threading.Thread(target=sampler, name="sampler", daemon=True)
    thread.start()
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    sync()
    done.set()
    thread.join()
    print(f"{(time.perf_counter() - t0) / args.steps * 1e3:.2f} ms a step while sampled")
    for name, n in samples.most_common():
        # waiting: a lock or queue (an I/O worker's loop sits in its queue's C-level get: ``_run``)
        busy = n - sum(c for w, c in leaf[name].items()
                       if w.endswith((":wait", ":_worker", ":get")) or w == "io_worker.py:_run")
        print(f"thread {name}: {n} samples ({busy} not in a wait)")
        print("  innermost:", ", ".join(f"{w} {c / n:.0%}" for w, c in leaf[name].most_common(top)))
        print("  inclusive:", ", ".join(f"{w} {c / n:.0%}" for w, c in inclusive[name].most_common(3 * top)))


def python_profile(step, args) -> None:
    """Where the training thread's Python time goes (syncs show as time in item/tolist)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(args.warmup, args.warmup + args.steps):
        step(i)
    sync()
    prof.disable()
    print(f"{args.optimizer}: {(time.perf_counter() - t0) / args.steps * 1e3:.2f} ms a step under cProfile")
    prof.dump_stats(os.path.join(os.environ.get("OUT", "."), f"pyprof-{args.workload}.pstats"))
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumtime").print_stats(45)


def host_times(ebc, kjts, grad, args) -> None:
    """Wall time of the training thread in prefetch, forward and backward, and in each ``## stage ##``
    label inside them, timed with perf_counter (``label`` swapped for a timer): what the
    host spends where when no profiler slows each call down."""
    import contextlib

    from tieredemb.modules import collection
    from tieredemb.storage.tiers import cache as cache_table
    from tieredemb.storage.tiers import cache_on_device
    from tieredemb.storage.tiers import device as table

    if args.overlap not in (None, "deferred"):
        raise SystemExit("--host times the plain loop, or with --overlap deferred TrainPipeline's order")
    deferred = args.overlap == "deferred"
    spent: dict[str, float] = {}
    calls: dict[str, int] = {}

    @contextlib.contextmanager
    def timer(name):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            calls[name] = calls.get(name, 0) + 1

    for mod in (collection, table, cache_table, cache_on_device):
        mod.label = timer

    def timed(owner, attr, label, static=False):
        fn = getattr(owner, attr, None)
        if fn is None:  # an older checkout's package (an A/B run) may lack it
            return

        def wrapper(*a, **k):
            with timer(label):
                return fn(*a, **k)

        setattr(owner, attr, staticmethod(wrapper) if static else wrapper)

    marks: dict[str, float] = {}
    inner = collection._Lookup.backward

    def lookup_backward(*a):  # engine latency: backward() call -> here, and here -> return
        marks["in"] = time.perf_counter()
        try:
            return inner(*a)
        finally:
            marks["out"] = time.perf_counter()

    collection._Lookup.backward = staticmethod(lookup_backward)
    timed(collection.CollectionBase, "_backward", "  CollectionBase._backward")
    timed(type(ebc), "_grad_sources", "  _grad_sources")
    timed(collection.CollectionBase, "_take_prefetched", "  _take_prefetched")
    timed(type(ebc), "_lookup", "  _lookup")
    timed(ebc._layout, "finish", "  layout.finish")
    timed(torch.Tensor, "tolist", "  tolist (host read)")
    extra_timers(ebc, args, timed, timer)
    sync()
    t0 = time.perf_counter()
    per_step: list[dict[str, float]] = []  # each step's own times: the median step leaves out rare ones
    for i in range(args.warmup, args.warmup + args.steps):
        before = dict(spent)
        t_step = time.perf_counter()
        kjt = kjts[i]
        if deferred:  # TrainPipeline's order: batch i was prefetched during step i - 1
            with timer("forward"):
                out = ebc(kjt).values()
            with timer("prefetch"):
                ebc.prefetch_deferred(kjts[i + 1])
        else:
            with timer("prefetch"):
                ebc.prefetch(kjt)
            with timer("forward"):
                out = ebc(kjt).values()
        t_call = time.perf_counter()
        with timer("backward"):
            out.backward(grad)
        t_back = time.perf_counter()
        for name, took in (("  engine: call -> Function", marks["in"] - t_call),
                           ("  _Lookup.backward", marks["out"] - marks["in"]),
                           ("  engine: Function -> return", t_back - marks["out"])):
            spent[name] = spent.get(name, 0.0) + took
        del out
        per_step.append({k: v - before.get(k, 0.0) for k, v in spent.items()})
        per_step[-1]["step (host)"] = time.perf_counter() - t_step
    with timer("final sync"):
        sync()
    wall = (time.perf_counter() - t0) / args.steps * 1e3
    print(f"{args.optimizer}: {wall:.2f} ms a step (wall, {args.steps} steps, timers only)")
    print("host ms a step: mean, median over the steps (labels nest inside prefetch/forward/backward), "
          "calls a step:")
    for name, s in spent.items():
        median = statistics.median(p.get(name, 0.0) for p in per_step) * 1e3
        mean, n = s / args.steps * 1e3, calls.get(name, 0) / args.steps
        print(f"  {name:40s} {mean:8.3f} {median:8.3f} {n:6.1f}")
    print("host ms of each step:", " ".join(f"{p['step (host)'] * 1e3:.2f}" for p in per_step))


def extra_timers(ebc, args, timed, timer) -> None:
    """The cache's and the index's own calls (cache workload); each launch with ``--launches``."""
    from tieredemb.storage.tiers import cache as cache_table

    if args.workload == "cache":
        for name in ("_write_down", "_fetch", "_fill_inserted", "_bound_members", "_count", "_register_owed"):
            timed(cache_table.CacheTier, name, f"    cache {name}")
        for name in ("find_touch", "complete", "_insert", "find"):
            timed(ebc.tiers[0].index.__class__, name, f"    index {name}")
        # the release and the device insertion, call by call
        for name in ("release", "_owe_conflicts", "_release_own", "_settle_pending", "_take_back", "_unlock",
                     "_to_host", "_device_graphs_for", "_place", "_insert_on_device", "arm"):
            timed(cache_table.CacheTier, name, f"    cache {name}")
        from tieredemb.ops.capture import CapturedStages
        from tieredemb.storage import host
        from tieredemb.storage.row_store import RowStore
        for name in ("acquire", "release"):
            timed(CapturedStages, name, f"    graphs {name}")
        timed(torch.cuda.CUDAGraph, "replay", "    graph replay")
        from tieredemb.modules.staged import StagedPrefetcher
        for name in ("finish", "stage", "_replay_staged"):
            timed(StagedPrefetcher, name, f"    staged {name}")
        timed(type(ebc.tiers[0]), "finish_prefetch", "    group finish_prefetch")
        for name in ("peek", "free"):
            timed(RowStore, name, f"    rows {name}")
        for name in ("settle", "room_for", "upserted"):
            timed(host.HostMemoryBackend, name, f"    host store {name}")
    if args.launches:
        time_launches(timer)


def time_launches(timer) -> None:
    """Time every Triton launch (by kernel) and a few torch calls on the host (``--launches``)."""
    try:  # every kernel launches through FastLaunch.launch (direct or not); older checkouts: Triton's run
        from tieredemb.ops.triton.launch import FastLaunch as owner
        attr = "launch"
    except ImportError:
        from triton.runtime.jit import JITFunction as owner
        attr = "run"
    run = getattr(owner, attr)

    def timed_run(self, *a, **k):
        with timer(f"    launch {self.fn.__name__}"):
            return run(self, *a, **k)

    setattr(owner, attr, timed_run)
    for name in ("sort", "argsort", "cumsum", "cat", "empty", "full", "zeros", "arange"):
        fn = getattr(torch, name)

        def wrapper(*a, _fn=fn, _name=name, **k):
            with timer(f"    torch.{_name}"):
                return _fn(*a, **k)

        setattr(torch, name, wrapper)


def print_stage_ops(events, steps: int, top: int = 12) -> None:
    """Per labelled stage (``## name ##``), the ops under it by GPU time per step (self time of each
    op and its descendants' kernels), and how many host syncs happened inside it."""
    stages: dict[str, dict[str, list[float]]] = {}

    def walk(e, acc):
        cell = acc.setdefault(e.name, [0.0, 0])
        cell[0] += getattr(e, "self_device_time_total", 0) or 0
        cell[1] += 1
        for c in e.cpu_children:
            if not c.name.startswith("##"):
                walk(c, acc)

    for e in events:
        if e.name.startswith("##"):
            acc = stages.setdefault(e.name, {})
            for c in e.cpu_children:
                if not c.name.startswith("##"):
                    walk(c, acc)
    for name, acc in stages.items():
        total = sum(v[0] for v in acc.values()) / 1e3 / steps
        syncs = sum(v[1] for k, v in acc.items() if k in ("cudaStreamSynchronize", "aten::item",
                                                           "aten::_local_scalar_dense")) / steps
        print(f"stage {name}: {total:.3f} ms GPU a step, {syncs:.1f} sync-ish calls a step")
        for k, v in sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]:
            if v[0] > 0:
                print(f"    {k[:56]:56s} {v[1] / steps:6.1f} {v[0] / 1e3 / steps:8.3f}")


if __name__ == "__main__":
    main()
