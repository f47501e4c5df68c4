"""A batch in flight (prefetched, not yet retired by its backward) and the calls that touch rows
around it: a write, a checkpoint, a forward whose graph is dropped. Each is compared with what the
same calls give with no batch in flight, or with an exact value worked out by hand."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import tieredemb as te

DIM = 4


def collection(storage: te.StorageConfig | None, admission: int | None = None,
               optimizer: te.optim.EmbeddingOptimizer | None = None) -> te.EmbeddingBagCollection:
    adm = None if admission is None else te.FrequencyAdmission(admission)
    tables = [te.TableConfig("t", DIM, ["a"], num_embeddings=1000, admission=adm,
                             initializer=te.init.Normal(0.0, 0.1))]
    return te.EmbeddingBagCollection(tables, optimizer=optimizer or te.optim.SGD(lr=0.5),
                                     storage=storage, seed=1)


def cache_storage() -> te.StorageConfig:
    row = DIM * 4
    return te.StorageConfig(hbm_budget=8 * row, bucket_width=4, segment_rows=4)


def storage_of(name: str) -> te.StorageConfig | None:
    if name == "hbm":
        return None
    if name == "cache":
        return cache_storage()
    return te.StorageConfig(hbm_budget=8 * DIM * 4, caching=False, segment_rows=4)


@pytest.mark.parametrize("mode", ["hbm", "cache", "hybrid"])
@pytest.mark.parametrize("cached_before", [False, True], ids=["miss", "hit"])
@pytest.mark.parametrize("n", [1, 12], ids=["one-key", "more-keys-than-the-cache"])
def test_a_write_after_prefetch_is_what_the_forward_reads_and_the_backward_updates(mode, cached_before, n):
    """prefetch(batch), write(keys of the batch), forward, backward: the forward reads the written rows,
    and the update applies to them (SGD: w - lr * g, with g = 1 per element of a summed bag of one).
    With more keys than the cache holds, some of the batch's rows sit in a scratch pad."""
    ebc = collection(storage_of(mode))
    keys = torch.arange(n) * 5 + 7
    lengths = torch.ones(n, dtype=torch.int64)
    if cached_before:  # the keys already stored when the batch is prefetched
        ebc(te.KeyedJaggedTensor(["a"], keys, lengths=lengths)).values().sum().backward()
    kjt = te.KeyedJaggedTensor(["a"], keys, lengths=lengths)
    ebc.prefetch(kjt)
    written = torch.arange(n * DIM, dtype=torch.float32).view(n, DIM)
    ebc.write("t", keys, written)
    out = ebc(kjt).values()
    torch.testing.assert_close(out, written)
    out.sum().backward()
    rows, found = ebc.read("t", keys)
    assert bool(found.all())
    torch.testing.assert_close(rows, written - 0.5)
    ebc.flush()
    rows, _ = ebc.read("t", keys)
    torch.testing.assert_close(rows, written - 0.5)


@pytest.mark.parametrize("mode", ["hbm", "cache"])
def test_a_write_after_a_pipelined_prefetch_is_not_lost(mode):
    """TrainPipeline keeps the next batch prefetched between steps: a write made there holds."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = collection(storage_of(mode))

        def forward(self, kjt):
            return self.ebc(kjt).values().sum()

    model = Model()
    n = 12  # more keys than the cache holds: some of batch 1's rows sit in a scratch pad
    ones = torch.ones(n, dtype=torch.int64)
    batches = [te.KeyedJaggedTensor(["a"], torch.arange(n) * 5 + 100 * b, lengths=ones) for b in range(3)]
    pipeline = te.TrainPipeline(model, None)
    it = iter(batches)
    pipeline.progress(it)  # step 0 trained, batch 1 prefetched
    written = torch.arange(n * DIM, dtype=torch.float32).view(n, DIM)
    keys = batches[1].values()
    model.ebc.write("t", keys, written)
    pipeline.progress(it)  # step 1: batch 1's rows read and updated
    pipeline.close()
    rows, _ = model.ebc.read("t", keys)
    torch.testing.assert_close(rows, written - 0.5)


def admission_batches() -> list[te.KeyedJaggedTensor]:
    """Keys seen once a batch, so that FrequencyAdmission(3) admits each in its third batch."""
    ids = [[1, 2], [1, 3], [2, 3], [1, 2, 3], [4, 1], [4, 2]]
    return [te.KeyedJaggedTensor(["a"], torch.tensor(b), lengths=torch.tensor([len(b)])) for b in ids]


def step(ebc: te.EmbeddingBagCollection, kjt: te.KeyedJaggedTensor) -> None:
    ebc(kjt).values().sum().backward()


def export_dict(ebc: te.EmbeddingBagCollection) -> dict[int, list[float]]:
    r = ebc.export("t")
    return {k: r.weights[i].tolist() for i, k in enumerate(r.keys.tolist())}


@pytest.mark.parametrize("mode", ["hbm", "cache"])
def test_a_checkpoint_saved_with_a_batch_in_flight_counts_its_admissions_once(mode, tmp_path):
    """Save between prefetch(batch 2) and its forward; a fresh collection loaded from it, trained on
    batches 2.., stores exactly the rows of the uninterrupted run (the in-flight batch's occurrences
    are not counted twice: key 3 is admitted in batch 3, not in batch 2)."""
    batches = admission_batches()
    whole = collection(storage_of(mode), admission=3)
    for kjt in batches:
        step(whole, kjt)

    first = collection(storage_of(mode), admission=3)
    for kjt in batches[:2]:
        step(first, kjt)
    first.prefetch(batches[2])
    te.checkpoint.save(first, tmp_path / "ckpt")
    for kjt in batches[2:]:  # the saving run goes on as if nothing happened
        step(first, kjt)
    assert export_dict(first) == export_dict(whole)

    resumed = collection(storage_of(mode), admission=3)
    te.checkpoint.load(resumed, tmp_path / "ckpt")
    assert resumed.step == 2
    for kjt in batches[2:]:
        step(resumed, kjt)
    assert export_dict(resumed) == export_dict(whole)


def test_a_state_dict_taken_with_a_batch_in_flight_counts_its_admissions_once():
    batches = admission_batches()
    whole = collection(None, admission=3)
    for kjt in batches:
        step(whole, kjt)
    first = collection(None, admission=3)
    for kjt in batches[:2]:
        step(first, kjt)
    first.prefetch(batches[2])
    state = {k: (v.materialize() if hasattr(v, "materialize") else v.clone())
             for k, v in first.state_dict().items()}
    resumed = collection(None, admission=3)
    resumed.load_state_dict(state)
    for kjt in batches[2:]:
        step(resumed, kjt)
    assert export_dict(resumed) == export_dict(whole)


def live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.parametrize("mode", ["hbm", "cache"])
@pytest.mark.parametrize("prefetched", [False, True], ids=["forward", "prefetch+forward"])
def test_a_forward_whose_output_is_dropped_leaks_nothing(mode, prefetched):
    """A skipped step (train-mode forward, output dropped, no backward) step after step: the number
    of live Python objects does not grow, and the skipped batches left no lock behind (the next
    backward updates the rows)."""
    ebc = collection(storage_of(mode))
    kjts = [te.KeyedJaggedTensor(["a"], torch.tensor([k % 11, k % 5]), lengths=torch.tensor([2]))
            for k in range(40)]

    def skipped(kjt):
        if prefetched:
            ebc.prefetch(kjt)
        ebc(kjt)  # output dropped: its graph goes with it

    for kjt in kjts[:20]:  # warm up (caches, lazily made buffers)
        skipped(kjt)
    grown = []  # two windows of 200 steps: a leak grows in both, another thread's passing objects in one
    for _ in range(2):
        before = live_objects()
        for _ in range(5):
            for kjt in kjts:
                skipped(kjt)
        grown.append(live_objects() - before)
    assert min(grown) < 50, f"{grown} more live objects after each 200 skipped steps"
    key = torch.tensor([3])
    old, _ = ebc.read("t", key)
    step(ebc, te.KeyedJaggedTensor(["a"], key, lengths=torch.tensor([1])))
    new, _ = ebc.read("t", key)
    torch.testing.assert_close(new, old - 0.5)
