"""Where a training step makes the host wait for the device: a step of tests/gpu/test_cuda_syncs.py's
bounded (or cache) scenario, or of unbounded tables trained from scratch (``scratch``: every step
inserts keys first seen, the index and the row store grow), under torch's sync debug mode, the Python
stack of each synchronizing call printed (the warning is shown where the call returns).

    python3 scripts/sync_trace.py [bounded|cache|scratch] [plain|pipelined]
"""

from __future__ import annotations

import sys
import traceback
import warnings

import torch

import tieredemb as te


def scenario(kind: str):
    dev = torch.device("cuda")
    if kind == "bounded":
        tables = [te.TableConfig(f"t{i}", 16, [f"f{i}"], max_capacity=128) for i in range(3)]
        storage = te.StorageConfig(bucket_width=8)
    elif kind == "scratch":  # small first allocations: the index and the store grow every few steps
        tables = [te.TableConfig(f"t{i}", 16, [f"f{i}"]) for i in range(3)]
        storage = te.StorageConfig(bucket_width=8, segment_rows=1024)
    else:
        tables = [te.TableConfig(f"t{i}", 16, [f"f{i}"]) for i in range(3)]
        storage = te.StorageConfig(hbm_budget=3 * 128 * 16 * 4 * 3, backing=te.storage.HostMemory(),
                                   bucket_width=8)
    ebc = te.EmbeddingBagCollection(tables, optimizer=te.optim.Adam(lr=0.01), device=dev, storage=storage)
    gen = torch.Generator().manual_seed(0)
    kjts = []
    for _ in range(17):
        lengths = torch.randint(1, 6, (3 * 64,), generator=gen)
        ids = torch.randint(0, 1 << 40 if kind == "scratch" else 640, (int(lengths.sum()),), generator=gen)
        kjts.append(te.KeyedJaggedTensor([f"f{i}" for i in range(3)], ids, lengths).to(dev))
    return ebc, kjts


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "bounded"
    loop = sys.argv[2] if len(sys.argv) > 2 else "plain"
    ebc, kjts = scenario(kind)
    if loop == "pipelined":
        ebc.prefetch_deferred(kjts[0])
    def show(message, *args, **kwargs):
        if "called a synchronizing" in str(message):
            print("--- a synchronizing call")
            traceback.print_stack(limit=12)

    for i, kjt in enumerate(kjts[:-1]):
        if i == 12:
            torch.cuda.synchronize()
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
        if loop == "plain":
            ebc.prefetch(kjt)
        out = ebc(kjt).values()
        if loop == "pipelined":
            ebc.prefetch_deferred(kjts[i + 1])
        out.sum().backward()
        if i == 12:
            torch.cuda.set_sync_debug_mode(0)
            break


if __name__ == "__main__":
    main()
