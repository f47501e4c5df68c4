"""The device half of a staged training prefetch as a replayed CUDA graph.

A warm ``hbm`` step spends most of its host time launching (~0.95 ms of a ~1.4 ms step
in prefetch, for ~0.4 ms of GPU work): the batch checks, the dedup's sort and runs, the probe, each
id's row and bag, and the read's concatenation are ~25 launches and as many Python calls. They read
nothing on the host and their shapes follow from the batch's shape alone, so for a shape seen
before they are captured once (``torch.cuda.CUDAGraph``, over static input buffers) and replayed:
three copies into the static inputs, one replay.

A graph bakes in every pointer it reads: its static inputs and outputs, and the index's tables
unless it reads them through a device table of their addresses that a rehash rewrites in place (the
Triton probe does; the torch one does not, so the key holds the index's ``capture_key``: 0, or its
rehashes so far). A replay's outputs are the batch's tensors until its release, so each captured
shape has a few slots (one batch in flight on each); a shape whose slots are all in flight runs
eagerly, as does a shape seen for the first time.
A batch whose id count changes every step is padded to a bucket by the caller (an input may fill only
the front of its static buffer: ``lengths``). ``TIEREDEMB_CAPTURE=0`` turns capture off; a capture
that fails turns it off for the object, with a warning.

A capture is only safe while no other thread of the process synchronizes with the device: a
device-wide wait (a pinned allocation, a synchronize) from another thread during a capture invalidates
it, and that thread's own call fails too. So only the caller that owns the training loop captures
(``capture=True``: the collection passes it on the thread that runs its forward); a
``TrainPipeline(prefetch_in_thread=True)`` worker replays what that thread captured, never captures.
And the capture itself does not synchronize the device or empty the allocators' caches as
``torch.cuda.graph`` does on entry: a capture costs a few launches' worth of host time, not a sync.
Python's cyclic garbage collector is off while it runs: a collection there could run a finalizer (a
dropped batch's release) whose launches would land in the graph, or whose read would invalidate it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ENV = "TIEREDEMB_CAPTURE"
log = logging.getLogger(__name__)


def capture_default() -> bool:
    """A collection's ``capture`` when its constructor is given none: on unless ``TIEREDEMB_CAPTURE=0``."""
    return os.environ.get(ENV, "1") != "0"


def padded_size(n: int) -> int:
    """What a padded capture holds for a batch of n ids (or pairs): n rounded up to a sixteenth of
    the power of two below it (at most 1/16 of the padded work spent on padding)."""
    step = 1 << max(0, n.bit_length() - 5)
    return -(-n // step) * step


@dataclass
class Slot:
    """One captured graph, its static inputs and outputs, and whether a batch holds them."""

    key: tuple
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor | None, ...]
    outputs: Any
    busy: bool = False
    done: torch.cuda.Event | None = None  # recorded at the release of the last batch on it


class CapturedStages:
    """Graphs of staging functions, by batch shape (``key``: one function per key), with ``per_key``
    slots each and ``max_slots`` in all; a shape is captured once it was run eagerly ``after`` times.
    The inputs have ``dtypes``."""

    def __init__(self, device: torch.device, dtypes: tuple[torch.dtype, ...], per_key: int = 2,
                 max_slots: int = 4, after: int = 1, what: str = "the prefetch") -> None:
        self.device = device
        self.what = what  # what the graphs run, for the warning of a failed capture
        self.dtypes = dtypes
        self.per_key = per_key
        self.max_slots = max_slots
        self.after = after
        self._slots: list[Slot] = []  # least recently used first
        self._seen: dict[tuple, int] = {}
        self._lock = threading.Lock()  # never held across a capture (its gc may release a slot)
        self.captures = 0
        self.replays = 0
        self.failed: str | None = None  # why a capture failed: none is tried again
        self._stream: torch.cuda.Stream | None = None  # where graphs are captured

    def acquire(self, key: tuple, fn: Callable[..., Any], *inputs: torch.Tensor | int | None,
                lengths: tuple[int | None, ...] = (), capture: bool = True) -> Slot | None:
        """Copy ``inputs`` (tensors of the shapes ``key`` stands for, on any device and of any
        dtype that copies to ``dtypes``; an int fills a 0-dim input) into a free slot of ``key``,
        captured now if need be, replay it on the current stream and hold it for the batch
        (``release``). None: the caller runs the work eagerly. ``lengths``: per input, the first
        dimension of its static buffer when longer than the input's (a batch padded to a bucket: the
        input fills its first rows, the rest keeps what it held). ``capture``: whether this call may
        capture a graph (False: only a slot captured before is replayed).

        ``fn(*inputs)`` (called only to capture) takes device tensors of ``dtypes`` (None where the
        input is None) and returns any structure of tensors, the slot's ``outputs``; it must launch
        device work only (no host reads, no allocation whose size depends on values)."""
        if self.failed is not None:
            return None
        with self._lock:
            slot, wanted = self._take(key)
        if wanted and capture:
            try:
                slot = self._capture(key, fn, inputs, lengths)
            except Exception as e:  # noqa: BLE001 (any capture failure: the eager path still works)
                self.failed = f"{type(e).__name__}: {e}"
                log.debug("capturing %s failed", self.what, exc_info=True)
                warnings.warn(f"tieredemb: capturing {self.what} in a CUDA graph failed ({self.failed}); "
                              "it runs eagerly from now on", RuntimeWarning, stacklevel=3)
                return None
            with self._lock:
                free = [s for s in self._slots if not s.busy]
                if len(self._slots) >= self.max_slots and free:  # the least recently used free one goes
                    self._slots.remove(free[0])
                self._slots.append(slot)
        if slot is None:
            return None
        self.load(slot, *inputs)
        self.replay(slot)
        return slot

    def acquire_batch(self, shape: tuple, fn: Callable[..., Any], values: torch.Tensor,
                      per_feature: torch.Tensor, weights: torch.Tensor | None, *rest: torch.Tensor | int,
                      capture: bool = True) -> Slot | None:
        """``acquire`` for a batch (inputs: its values, lengths, weights, ``rest``, then a padded
        batch's id count, None for an exact one): the graph of its exact shape (``shape`` and its n
        ids), else the graph of its ids padded to a bucket (``padded_size``: batches whose id count
        changes every step)."""
        n = values.numel()
        inputs = (values, per_feature, weights, *rest)
        slot = self.acquire((*shape, n), fn, *inputs, None, capture=capture)
        if slot is None:
            bucket = padded_size(n)
            slot = self.acquire((*shape, "padded", bucket), fn, *inputs, n, lengths=(bucket, None, bucket),
                                capture=capture)
        return slot

    def take(self, key: tuple) -> Slot | None:
        """A free slot captured for ``key`` before, now held (None: none is free, or none was
        captured; nothing counted towards a capture): for a caller that loads a slot's inputs
        ahead of its replay (``load``, ``replay``; ``cancel`` if it is not replayed after all)."""
        if self.failed is not None:
            return None
        with self._lock:
            for i, slot in enumerate(self._slots):
                if slot.key == key and not slot.busy:
                    self._slots.append(self._slots.pop(i))
                    slot.busy = True
                    return slot
        return None

    def load(self, slot: Slot, *inputs: torch.Tensor | int | None) -> None:
        """Copy ``inputs`` into ``slot``'s static inputs on the current stream, after the last batch
        on it is done (``acquire``'s inputs; a 0-dim tensor fills a 0-dim input from the device)."""
        stream = torch.cuda.current_stream(self.device)
        if slot.done is not None:  # the last batch's readers (on another stream, perhaps) are done
            stream.wait_event(slot.done)
        for static, given in zip(slot.inputs, inputs):
            if isinstance(given, int):
                static.fill_(given)
            elif static is not None and given.dim() == 0:
                static.copy_(given)
            elif static is not None:
                static[: given.shape[0]].copy_(given)

    def replay(self, slot: Slot) -> None:
        """Replay ``slot`` (held, its inputs loaded) on the current stream."""
        slot.graph.replay()
        self.replays += 1

    def cancel(self, slot: Slot) -> None:
        """Give back a slot taken (``take``) and not replayed, once the copies ``load`` queued on
        the current stream are done: it holds no batch."""
        self.release(slot, None)

    def release(self, slot: Slot, stream: torch.cuda.Stream | None) -> None:
        """The batch on ``slot`` is done once ``stream``'s work queued so far is (default: the
        current stream)."""
        done = torch.cuda.Event()
        done.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        with self._lock:
            slot.done = done
            slot.busy = False

    def _take(self, key: tuple) -> tuple[Slot | None, bool]:
        """(a free slot of ``key``, now held; or None) and whether to capture a new one."""
        for i, slot in enumerate(self._slots):
            if slot.key == key and not slot.busy:
                self._slots.append(self._slots.pop(i))  # most recently used last
                slot.busy = True
                return slot, False
        seen = self._seen.get(key, 0)
        if seen < self.after:
            if len(self._seen) > 64:  # shapes that keep changing: forget them
                self._seen.clear()
            self._seen[key] = seen + 1
            return None, False
        room = len(self._slots) < self.max_slots or any(not s.busy for s in self._slots)
        # every slot of the shape holds a batch in flight, or every slot does
        return None, room and sum(s.key == key for s in self._slots) < self.per_key

    def _capture(self, key: tuple, fn: Callable[..., Any], inputs: tuple, lengths: tuple) -> Slot:
        lengths = lengths + (None,) * (len(inputs) - len(lengths))

        def buffer(t: torch.Tensor | int | None, dtype: torch.dtype, rows: int | None) -> torch.Tensor | None:
            if t is None:
                return None
            shape = () if isinstance(t, int) else (t.shape[0] if rows is None else rows, *t.shape[1:])
            return torch.zeros(shape, dtype=dtype, device=self.device)

        static = tuple(buffer(*args) for args in zip(inputs, self.dtypes, lengths))
        graph = torch.cuda.CUDAGraph()
        if self._stream is None:  # a side stream: the legacy default stream cannot capture
            self._stream = torch.cuda.Stream(self.device)
        pool = torch.cuda.graph_pool_handle()  # the graph's own memory pool, named here (_hand_back)
        # thread_local: only this thread's unsafe calls invalidate the capture (module docstring);
        # the cyclic garbage collector stays off during it: a collection could run a finalizer (a
        # dropped batch's release) that launches onto, or reads, the capturing stream
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    outputs = fn(*static)
                finally:
                    try:
                        graph.capture_end()
                    except BaseException:
                        self._hand_back(pool)
                        raise
        finally:
            if collecting:
                gc.enable()
        self.captures += 1
        return Slot(key, graph, static, outputs, busy=True)

    def _hand_back(self, pool: tuple[int, int]) -> None:
        """After a capture that failed: torch's ``capture_end`` raises at ``cudaStreamEndCapture``,
        before it ends the allocation to the graph's pool, and the graph never releases a pool it did
        not finish; left so, the caching allocator would go on as if a capture were under way (events
        of freed blocks deferred for good). End and release it here; each call may find it done."""
        device = self.device.index if self.device.index is not None else torch.cuda.current_device()
        for hand_back in (torch._C._cuda_endAllocateToPool, torch._C._cuda_releasePool):
            with contextlib.suppress(Exception):  # already done by torch: nothing to undo
                hand_back(device, pool)


__all__ = ["CapturedStages", "Slot", "capture_default", "padded_size"]
