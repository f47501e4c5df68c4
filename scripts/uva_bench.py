"""Host-row transfers (issue 7, build item 4): how fast do random rows of pinned host memory move to
and from the GPU? Rows of 512 B (D=128 float32) at random addresses of a host RowStore, against the
pinned copy ceiling:

- UVA gather / scatter: the Triton row kernels reading or writing host rows in place, at several tile
  shapes (rows in flight per program) and warp counts;
- copy engine: rows compacted on the host (``index_select`` into pinned staging) then one
  ``cudaMemcpyAsync``, and the reverse (copy down, then ``index_copy_`` on the host);
- both directions at once: a UVA gather and a UVA scatter on two streams.

    python3 scripts/uva_bench.py [--rows 4194304] [--n 262144] [--repeat 20]

Prints one table (GB/s of row bytes moved) and writes $OUT/uva.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

from tieredemb.ops.triton.embedding import _gather_kernel, _scatter_kernel
from tieredemb.storage.row_store import RowStore

D = 128


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn`` (synchronized), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_engine(store: RowStore, addresses: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, record,
                repeat: int) -> None:
    """Rows compacted on the host (``index_select`` per segment into pinned staging) then one copy up;
    and one copy down, then ``index_copy_`` into the segments."""
    n = addresses.numel()
    segs = list(store.segments)
    cpu_addr = addresses.cpu()
    seg_of, off = cpu_addr // store.segment_rows, cpu_addr % store.segment_rows
    staging = torch.empty(n, D, pin_memory=True)
    order = torch.argsort(seg_of)
    bounds = torch.searchsorted(seg_of[order], torch.arange(len(segs) + 1)).tolist()
    parts = [(s, order[bounds[s] : bounds[s + 1]]) for s in range(len(segs)) if bounds[s + 1] > bounds[s]]

    def compact_and_copy():
        for s, part in parts:
            staging[part] = segs[s].index_select(0, off[part])
        out.copy_(staging, non_blocking=True)

    def copy_and_spread():
        staging.copy_(rows, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        for s, part in parts:
            segs[s].index_copy_(0, off[part], staging[part])

    record(f"copy engine: host index_select + H2D ({torch.get_num_threads()} threads)",
           timed(compact_and_copy, repeat))
    record("copy engine: D2H + host index_copy_", timed(copy_and_spread, repeat))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1 << 22)
    p.add_argument("--n", type=int, default=1 << 18)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    dev = torch.device("cuda")
    store = RowStore(D, 1 << 18, dev, device_segments=0)  # every segment in pinned host memory
    store.reserve(args.rows)
    store.allocate(args.rows)
    ptrs = store.pointer_table()
    gen = torch.Generator().manual_seed(0)
    addresses = torch.randperm(args.rows, generator=gen)[: args.n].to(dev)  # distinct: scatter is safe
    rows = torch.randn(args.n, D, device=dev)
    out = torch.empty(args.n, D, device=dev)
    nbytes = args.n * D * 4
    results = []

    def record(name: str, seconds: float) -> None:
        results.append({"method": name, "gb_per_s": nbytes / seconds / 1e9, "ms": seconds * 1e3})
        print(f"  {name:58s} {nbytes / seconds / 1e9:7.1f} GB/s", flush=True)

    # the pinned copy ceiling: one contiguous buffer of the same bytes, each way
    host = torch.empty(args.n, D, pin_memory=True)
    record("pinned copy H2D (contiguous, the ceiling)", timed(lambda: out.copy_(host, non_blocking=True),
                                                              args.repeat))
    record("pinned copy D2H (contiguous, the ceiling)", timed(lambda: host.copy_(rows, non_blocking=True),
                                                              args.repeat))
    for rows_per_program, warps in ((8, 4), (32, 4), (32, 8), (64, 8), (128, 8), (128, 16)):
        grid = (triton.cdiv(args.n, rows_per_program),)

        def gather(rp=rows_per_program, w=warps, g=grid):
            _gather_kernel[g](ptrs, addresses, out, args.n, D, D, store.segment_rows, BLOCK_N=rp,
                              BLOCK_D=D, num_warps=w)

        def scatter(rp=rows_per_program, w=warps, g=grid):
            _scatter_kernel[g](ptrs, addresses, rows, args.n, D, store.segment_rows, BLOCK_N=rp,
                               BLOCK_W=D, num_warps=w)

        record(f"UVA gather, {rows_per_program} rows x {warps} warps a program", timed(gather, args.repeat))
        record(f"UVA scatter, {rows_per_program} rows x {warps} warps a program", timed(scatter, args.repeat))

    # what limits the random case: the same kernel over sorted random rows, and over consecutive rows
    for name, addr in (("sorted random rows", torch.sort(addresses).values),
                       ("consecutive rows", torch.arange(args.n, device=dev))):
        grid = (triton.cdiv(args.n, 64),)

        def gather_of(a=addr, g=grid):
            _gather_kernel[g](ptrs, a, out, args.n, D, D, store.segment_rows, BLOCK_N=64, BLOCK_D=D,
                              num_warps=8)

        record(f"UVA gather, 64 rows x 8 warps, {name}", timed(gather_of, args.repeat))

    copy_engine(store, addresses, rows, out, record, args.repeat)

    # both directions at once: gather on one stream, scatter of other rows on another
    others = torch.randperm(args.rows, generator=gen)[: args.n].to(dev)
    side = torch.cuda.Stream()
    grid = (triton.cdiv(args.n, 64),)

    def both():
        _gather_kernel[grid](ptrs, addresses, out, args.n, D, D, store.segment_rows, BLOCK_N=64, BLOCK_D=D,
                             num_warps=8)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _scatter_kernel[grid](ptrs, others, rows, args.n, D, store.segment_rows, BLOCK_N=64, BLOCK_W=D,
                                  num_warps=8)
        torch.cuda.current_stream().wait_stream(side)

    record("UVA gather + scatter at once (GB/s each way)", timed(both, args.repeat))
    addresses, others = torch.sort(addresses).values, torch.sort(others).values
    record("UVA gather + scatter at once, sorted rows (each way)", timed(both, args.repeat))
    report = {"rows": args.rows, "n": args.n, "row_bytes": D * 4, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "results": results}
    path = os.path.join(os.environ.get("OUT", "."), "uva.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"report: {path}")


if __name__ == "__main__":
    main()
