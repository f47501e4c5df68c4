"""Print one step of a torch profiler chrome trace as a timeline: the host's labels, launches and
syncs, and the device's kernels and copies with their streams, in microseconds from the step's start.
A step runs from one ``## check_batch ##`` label (the prefetch's first) to the next.

    python3 scripts/trace_timeline.py TRACE.json [--step K] [--min-us 2]
"""

from __future__ import annotations

import argparse
import json

HOST = ("cudaMemcpyAsync", "cudaGraphLaunch", "cuLaunchKernelEx", "cudaLaunchKernel", "cudaStreamSynchronize",
        "cudaEventSynchronize", "cudaStreamWaitEvent")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--step", type=int, default=-2, help="which step (python index; default the last but one)")
    p.add_argument("--min-us", type=float, default=2.0, help="leave out host calls shorter than this")
    args = p.parse_args()
    with open(args.trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    starts = sorted(e["ts"] for e in events
                    if e["name"] == "## check_batch ##" and e["cat"] == "user_annotation")
    k = args.step % (len(starts) - 1)
    t0, t1 = starts[k], starts[k + 1]
    rows = []
    for e in events:
        if not t0 <= e["ts"] < t1:
            continue
        cat, name = e["cat"], e["name"]
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            rows.append((e["ts"], e["dur"], f"  GPU s{e['args'].get('stream')}", name[:70]))
        elif (cat == "user_annotation" and name.startswith("##")) or (
                cat in ("cuda_runtime", "cuda_driver") and name in HOST and e["dur"] >= args.min_us):
            rows.append((e["ts"], e["dur"], "host", name))
    print(f"step {k}: {t1 - t0:.0f} us")
    busy = 0.0
    end = t0
    for ts, dur, who, name in sorted(rows):
        print(f"{ts - t0:8.1f} {dur:8.1f}  {who:8s} {name}")
        if who.startswith("  GPU"):
            busy += max(0.0, ts + dur - max(ts, end))
            end = max(end, ts + dur)
    print(f"GPU busy {busy:.0f} us of {t1 - t0:.0f}")


if __name__ == "__main__":
    main()
