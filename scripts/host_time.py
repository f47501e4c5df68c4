import atexit
import runpy
import sys
import time

from tieredemb.modules import collection as C
from tieredemb.modules.table import TableGroup as T

acc = {}
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc.setdefault(name, []).append(time.perf_counter() - t)
    setattr(cls, name, g)
for n in ("_inserted", "_initialize", "_count_probe", "_take_back", "_lend", "release"):
    wrap(T, n)
for n in ("_finish_staged", "_stage", "_release", "_backward", "_run"):
    wrap(C._Collection, n)


def report():
    for k, v in acc.items():
        print(f"  {k:16s} {len(v):5d} calls, median of the last 30: {1e3 * sorted(v[-30:])[15]:.3f} ms")


atexit.register(report)
sys.argv = ["groups_bench.py"] + sys.argv[1:]
runpy.run_path("scripts/groups_bench.py", run_name="__main__")
