"""Host reads of a steady-state training step on CUDA (DESIGN section 4, rule 1), counted with torch's
sync debug mode: every operation that makes the host wait for the device warns once. The staged
prefetch of one table group reads the device once a step (the batch checks, the number of distinct
keys and the misses together); forward and backward read nothing. (torch calls the mode a
prototype that does not see every synchronizing operation; the profiler's count agrees here:
`benchmarks/results/2026-11-21-hbm-h200-profile-sgd-staged.txt`.)"""

from __future__ import annotations

import warnings

import pytest
import torch

import tieredemb as te

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run through scripts/gpu_check.sh)", allow_module_level=True)

DEV = torch.device("cuda")


def host_reads(fn) -> list[str]:
    """The synchronizing operations ``fn`` runs (torch.cuda.set_sync_debug_mode's warnings)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


@pytest.mark.parametrize("optimizer", [te.optim.SGD(lr=0.1), te.optim.Adam(lr=0.01)], ids=["sgd", "adam"])
@pytest.mark.parametrize("module", [te.EmbeddingBagCollection, te.EmbeddingCollection], ids=["ebc", "ec"])
def test_a_warm_step_reads_the_device_once(module, optimizer):
    tables = [te.TableConfig(f"t{i}", 16, [f"f{i}"]) for i in range(3)]  # one group, raw ids
    collection = module(tables, optimizer=optimizer, device=DEV)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 5, (3 * 64,), generator=gen)
    ids = torch.randint(0, 500, (int(lengths.sum()),), generator=gen)
    kjt = te.KeyedJaggedTensor([f"f{i}" for i in range(3)], ids, lengths).to(DEV)

    def step():
        collection.prefetch(kjt)
        out = collection(kjt)
        loss = out.values().sum() if module is te.EmbeddingBagCollection else \
            sum(jt.values().sum() for jt in out.values())
        loss.backward()

    for _ in range(2):  # the batch's keys are stored: the next steps find every key
        step()
    reads = host_reads(step)
    assert len(reads) == 1, f"{len(reads)} host reads in a warm step: {reads}"
