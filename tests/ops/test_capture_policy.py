"""Which batches ``CapturedStages`` replays, captures or leaves to the eager path (its bookkeeping
alone: capturing and replaying need CUDA, ``tests/gpu/test_cuda_capture.py``)."""

from __future__ import annotations

import torch

import tieredemb as te
from tieredemb.ops.capture import CapturedStages, Slot, capture_default


def stages(**kw) -> CapturedStages:
    return CapturedStages(torch.device("cpu"), (torch.int64,), **kw)


def add(st: CapturedStages, key, busy: bool) -> Slot:
    slot = Slot(key, None, (), None, busy=busy)
    st._slots.append(slot)
    return slot


def test_a_shape_is_captured_after_it_ran_eagerly_once():
    st = stages(after=1)
    assert st._take("a") == (None, False)  # first sight: eager
    assert st._take("a") == (None, True)  # second: capture
    assert st._take("b") == (None, False)


def test_a_free_slot_of_the_shape_is_taken_and_held():
    st = stages()
    slot = add(st, "a", busy=False)
    add(st, "b", busy=False)
    assert st._take("a") == (slot, False) and slot.busy
    assert st._slots[-1] is slot  # most recently used last


def test_no_capture_past_the_slots_of_a_shape_or_of_all():
    st = stages(per_key=2, max_slots=3, after=0)
    add(st, "a", busy=True)
    add(st, "a", busy=True)
    assert st._take("a") == (None, False)  # both of a's slots in flight: eager
    add(st, "b", busy=True)
    assert st._take("c") == (None, False)  # every slot in flight: eager
    st._slots[-1].busy = False
    assert st._take("c") == (None, True)  # b's free slot can go


def test_shapes_that_keep_changing_are_forgotten():
    st = stages(after=1)
    for n in range(200):
        assert st._take(n) == (None, False)
    assert len(st._seen) <= 65


def test_capture_is_for_cuda_with_triton_and_can_be_turned_off(monkeypatch):
    """The default comes from TIEREDEMB_CAPTURE; an explicit ``capture`` wins; a CPU collection never
    captures (it still takes the staged path)."""
    monkeypatch.delenv("TIEREDEMB_CAPTURE", raising=False)
    assert capture_default()
    monkeypatch.setenv("TIEREDEMB_CAPTURE", "0")
    assert not capture_default()
    monkeypatch.setenv("TIEREDEMB_CAPTURE", "1")
    assert capture_default()
    tables = [te.TableConfig("t", 4, ["f"])]
    cpu = te.EmbeddingBagCollection(tables, device="cpu", capture=True)
    assert cpu._stager is not None and cpu._stager.captured is None


def test_buckets_of_a_padded_capture_hold_the_batch_with_little_padding():
    from tieredemb.ops.capture import padded_size as _bucket

    buckets = [_bucket(n) for n in range(1, 5000)]
    assert all(b >= n and b - n <= max(1, n // 16) for n, b in zip(range(1, 5000), buckets))
    assert buckets == sorted(buckets)  # a bucket holds a range of counts
    assert len(set(buckets[2999:3009])) == 1  # 3000 .. 3009: one graph
    assert _bucket(1048600) == 1048576 + 65536


class _Recording(CapturedStages):
    """Its bookkeeping with the copies into a slot recorded and no replay (both need CUDA)."""

    def load(self, slot: Slot, *inputs) -> None:
        self.loaded = inputs

    def replay(self, slot: Slot) -> None:
        pass


def test_a_batch_takes_the_graph_of_its_shape_else_of_its_bucket_of_ids():
    """``acquire_batch``: the slot captured for the batch's shape and its n ids; else the one for its
    ids padded to their bucket (``padded_size``), loaded with the real count; else eager (None),
    each key seen once more."""
    values, lengths = torch.arange(101), torch.ones(2, 3, dtype=torch.int64)

    def stage(*static):
        raise AssertionError("nothing is captured here")

    st = _Recording(torch.device("cpu"), (torch.int64,) * 4, after=2)
    exact = add(st, ("f", 101), busy=False)
    assert st.acquire_batch(("f",), stage, values, lengths, None, 7) is exact
    assert st.loaded == (values, lengths, None, 7, None) and exact.busy

    st = _Recording(torch.device("cpu"), (torch.int64,) * 4, after=2)
    padded = add(st, ("f", "padded", 104), busy=False)
    assert st.acquire_batch(("f",), stage, values, lengths, None, 7) is padded
    assert st.loaded == (values, lengths, None, 7, 101)

    st = _Recording(torch.device("cpu"), (torch.int64,) * 4, after=2)
    assert st.acquire_batch(("f",), stage, values, lengths, None) is None
    assert st._seen == {("f", 101): 1, ("f", "padded", 104): 1}
