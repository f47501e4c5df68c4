"""Can a cache's write-down to host memory run beside the step's HBM kernels (issue 7)?

The victims' rows (``--n`` rows of W=129 floats, sorted host addresses) written to a pinned host
RowStore by the UVA scatter kernel on ``programs`` programs, alone and on a side stream while the
main stream runs HBM gathers of ``--gather`` random rows (the forward's kind of kernel); and the
same bytes by the copy engine (one contiguous D2H). Prints ms of each, alone and together.

    python3 scripts/beside_bench.py [--n 44000] [--gather 1048576] [--repeat 10]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tieredemb.ops.triton.embedding import TritonKernels
from tieredemb.storage.row_store import RowStore

W = 129


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=44_000)
    p.add_argument("--host-rows", type=int, default=1 << 22)
    p.add_argument("--gather", type=int, default=1 << 20)
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    dev = torch.device("cuda")
    k = TritonKernels()
    host = RowStore(W, 1 << 18, dev, device_segments=0)
    host.reserve(args.host_rows)
    host.allocate(args.host_rows)
    hbm = RowStore(W, 1 << 20, dev)
    hbm.reserve(8 << 20)
    hbm.allocate(8 << 20)
    g = torch.Generator(device=dev).manual_seed(0)
    down = torch.sort(torch.randperm(args.host_rows, device=dev, generator=g)[: args.n]).values
    rows = torch.randn(args.n, W, device=dev)
    reads = torch.randint(0, 8 << 20, (args.gather,), device=dev, generator=g)
    staging = torch.empty(args.n, W, pin_memory=True)
    side = torch.cuda.Stream()
    main_s = torch.cuda.current_stream()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def timed(stream, fn):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            fn()
            b.record()
        return a, b

    def gathers():
        for _ in range(4):
            k.gather(hbm, reads, 128)

    def run(write, together: bool):
        ws, gs = [], []
        for _ in range(args.repeat + 1):
            torch.cuda.synchronize()
            if together:
                side.wait_stream(main_s)
                w = timed(side, write)
                gt = timed(main_s, gathers)
            else:
                w = timed(main_s, write)
                torch.cuda.synchronize()
                gt = timed(main_s, gathers)
            torch.cuda.synchronize()
            ws.append(w[0].elapsed_time(w[1]))
            gs.append(gt[0].elapsed_time(gt[1]))
        return statistics.median(ws[1:]), statistics.median(gs[1:])

    mb = args.n * W * 4 / 1e6
    print(f"write {args.n} rows ({mb:.1f} MB) to random sorted host rows; "
          f"4 HBM gathers of {args.gather} rows")
    print(f"{'write':28s} {'alone ms':>9s} {'GB/s':>6s} {'4 gathers ms':>13s} | together: {'write':>6s} "
          f"{'gathers':>8s}")
    writes = [(f"UVA scatter, {p} programs", lambda p=p: k.scatter(host, down, rows, p))
              for p in (4, 8, 16, 32, 66, sms, None)]
    writes.append(("copy engine D2H (contiguous)", lambda: staging.copy_(rows, non_blocking=True)))
    for name, write in writes:
        w_alone, g_alone = run(write, False)
        w_both, g_both = run(write, True)
        print(f"{name:28s} {w_alone:9.3f} {mb / w_alone:6.1f} {g_alone:13.3f} | {w_both:16.3f} {g_both:8.3f}")


if __name__ == "__main__":
    main()
