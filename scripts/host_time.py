"""Host time of the prefetch's pieces in scripts/groups_bench.py's loops: each function below wrapped
with a wall clock, and the median and the mean of its last 30 calls printed at exit (the last loop's:
the deferred one; the mean for rare calls such as a rehash). No profiler, so no per-call overhead
beyond two clock reads; the first calls (Triton compilations, graph captures) fall out of the median.

    PYTHONPATH=. python3 scripts/host_time.py [groups_bench.py's arguments]
    PYTHONPATH=. python3 scripts/host_time.py scripts/insertion_profile.py [its arguments]
"""

from __future__ import annotations

import atexit
import runpy
import sys
import time

from tieredemb.modules.batch import Layout
from tieredemb.modules.collection import _Collection
from tieredemb.modules.table import TableGroup
from tieredemb.ops.triton.embedding import TritonKernels
from tieredemb.ops.triton.index import TritonKeyIndex
from tieredemb.storage.row_store import RowStore

TIMED = {
    _Collection: ("_stage", "_finish_staged", "_run", "_backward", "_release"),
    Layout: ("finish",),
    TableGroup: ("_placed", "_inserted", "_initialize", "_initial_weights", "_count_probe", "_take_back",
                 "_to_host", "release", "place_overflow"),
    TritonKeyIndex: ("insert_rows", "_launch_insert", "reserve_regions", "_grow"),
    TritonKernels: ("scatter",),
    RowStore: ("peek", "_add_segment", "pointer_table"),
}
seconds: dict[str, list[float]] = {}


def timed(name: str, f):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            seconds.setdefault(name, []).append(time.perf_counter() - start)
    return call


def report() -> None:
    for name, runs in seconds.items():
        last = sorted(runs[-30:])
        print(f"  {name:16s} {len(runs):5d} calls, median of the last {len(last)}: "
              f"{1e3 * last[len(last) // 2]:.3f} ms, mean {1e3 * sum(last) / len(last):.3f} ms")


if __name__ == "__main__":
    for cls, names in TIMED.items():
        for name in names:
            setattr(cls, name, timed(f"{cls.__name__}.{name}", getattr(cls, name)))
    atexit.register(report)
    args = sys.argv[1:]
    script = args.pop(0) if args and args[0].endswith(".py") else "scripts/groups_bench.py"
    sys.argv = [script, *args]
    sys.path.insert(0, "scripts")
    runpy.run_path(script, run_name="__main__")
