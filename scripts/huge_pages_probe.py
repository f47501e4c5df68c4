"""Do random reads of pinned host rows through UVA depend on the pages under them? (issue 7)

Runs of the same `bench cache` differ by 0.5-1 ms a step, per process: every step of a run is fast
or every step slow (session 28). A guess: the 15.5 GB of pinned host rows land on 4 KiB pages in
some processes and on huge pages in others, and a GPU reading random 512-byte rows misses its
translation cache on nearly every row of the first kind. This probe allocates such a block one of two
ways and times one kernel reading random rows of it in address order, as the cache's fetch does:

- ``torch``: ``torch.empty(..., pin_memory=True)`` (``cudaHostAlloc``), as the host store does;
- ``huge``: anonymous memory advised for transparent huge pages (``MADV_HUGEPAGE``), touched, then
  page-locked with ``cudaHostRegister``.

    python3 scripts/huge_pages_probe.py --alloc torch|huge [--gib 15.5] [--n 45000] [--repeat 50]

``torch`` also takes torch's other way to pin: ``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:
True,pinned_num_register_threads:8`` (malloc, then ``cudaHostRegister`` in threads) with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc advises huge pages for its large blocks): the same
for the whole library without a change to it, if the guess holds (``bench cache`` under the same
variables).

Measured on an H100 machine (session 29, two processes a way): 16.1-16.7 GB/s in every way, on 4
KiB pages and on 2 MiB pages alike. The guess was wrong: the spread is the host's speed
(``benchmarks/results/2026-11-27-h200-session29.md``).

Prints one line: the allocation, the process's ``AnonHugePages`` after it, the kernel's median time
and GB/s of row bytes. Run it several times a mode, each in its own process (the guess is about what
a process gets when it allocates): ``for i in 1 2 3 4; do for a in torch huge; do python3
scripts/huge_pages_probe.py --alloc $a; done; done``.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

D = 128  # float32 row of 512 bytes, the cache workload's


@triton.jit
def _read_rows(base_ptr, addresses, out, n, D: tl.constexpr, ROWS: tl.constexpr):
    # out[i] = base[addresses[i]] for ROWS rows a program; base: the block's address, int64 (1,)
    base = tl.load(base_ptr).to(tl.pointer_type(tl.float32))
    i = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    live = i < n
    a = tl.load(addresses + i, mask=live, other=0)
    rows = tl.load(base + a[:, None] * D + cols[None, :], mask=live[:, None])
    tl.store(out + i[:, None] * D + cols[None, :], rows, mask=live[:, None])


def huge_page_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def allocate(kind: str, rows: int) -> tuple[torch.Tensor, object]:
    """A (rows, D) float32 block of page-locked host memory; the second value keeps it alive."""
    if kind == "torch":
        block = torch.empty(rows, D, dtype=torch.float32, pin_memory=True)
        block.zero_()
        return block, None
    buf = mmap.mmap(-1, rows * D * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    block = torch.frombuffer(buf, dtype=torch.float32).view(rows, D)
    block.zero_()  # fault the pages in (huge where the kernel can) before they are locked
    rc = int(torch.cuda.cudart().cudaHostRegister(block.data_ptr(), rows * D * 4, 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister failed: cudaError {rc}")
    return block, buf


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--alloc", choices=["torch", "huge"], required=True)
    p.add_argument("--gib", type=float, default=15.5, help="host block size")
    p.add_argument("--n", type=int, default=45_000, help="random rows read a call")
    p.add_argument("--repeat", type=int, default=50)
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = int(args.gib * 2**30) // (D * 4)
    t0 = time.perf_counter()
    block, keep = allocate(args.alloc, rows)
    alloc_s = time.perf_counter() - t0
    huge = huge_page_bytes()
    base = torch.tensor([block.data_ptr()], dtype=torch.int64, device=dev)
    out = torch.empty(args.n, D, dtype=torch.float32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    times = []
    for r in range(args.repeat + 3):
        addresses = torch.randint(0, rows, (args.n,), generator=gen, device=dev).sort().values
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        _read_rows[(triton.cdiv(args.n, 32),)](base, addresses, out, args.n, D=D, ROWS=32, num_warps=4)
        end.record()
        end.synchronize()
        if r >= 3:
            times.append(start.elapsed_time(end))
    assert torch.equal(out[:4].cpu(), block[addresses[:4].cpu()]), "the kernel read the wrong rows"
    ms = statistics.median(times)
    print(f"alloc {args.alloc}: {args.gib} GiB in {alloc_s:.1f} s, AnonHugePages {huge / 2**30:.2f} GiB, "
          f"{args.n} random rows in {ms * 1e3:.0f} us ({args.n * D * 4 / ms / 1e6:.1f} GB/s), "
          f"min {min(times) * 1e3:.0f} us")
    if keep is not None:  # the mapping itself goes with the process
        torch.cuda.cudart().cudaHostUnregister(block.data_ptr())


if __name__ == "__main__":
    main()
