"""RowStore: rows ``[weights | optimizer state]`` addressed by a stable int64 row address.

Rows live in fixed-size segments (``segment_rows x width`` of the rows' ``dtype``: float32,
bfloat16 or float16); address = segment * segment_rows
+ offset. Growth appends a segment, so there is never a 2x copy peak and an address stays valid for
the life of its row, whatever the index above does. A segment lives in device memory, or, past
``device_segments``, in (pinned) host memory: that is hybrid mode.
Kernels reach segments through ``pointer_table()``, so a segment may live anywhere the device can
address.

A free list hands out addresses: table rows, and scratch rows that live for one batch (keys not
admitted yet, conflict misses), come from the same address space.

Stashing (``stash``/``restore``) moves the device segments' rows to host buffers and back on a copy
stream. While stashed a segment is its host buffer (placement ``"stashed"``): every access, kernel or
not, reads and writes the host copy, as in hybrid mode, so rows written by a prefetch in that window
are copied back with the rest. ``ready`` is the copy's event: the pointer table and the row accessors
make their stream (or, for host rows read by the CPU, the host) wait for it, so nothing reads a copy
before it is complete.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch


class RowStore:
    """Segmented row storage with a free list.

    Args:
        width: elements per row (D + optimizer state).
        segment_rows: rows per segment.
        device: the compute device; segments are allocated there.
        device_segments: at most this many segments on ``device``; the next ones go to host memory
            (pinned when ``device`` is CUDA, so kernels read them through UVA). None: no limit.
        dtype: the rows' storage type (``TableConfig.dtype``). ``gather`` gives rows in it;
            ``scatter`` rounds what it is given to it (to the nearest value).
    """

    def __init__(self, width: int, segment_rows: int, device: torch.device,
                 device_segments: int | None = None, dtype: torch.dtype = torch.float32) -> None:
        self.width = width
        self.dtype = dtype
        self.segment_rows = segment_rows
        self.device = torch.device(device)
        self.device_segments = device_segments
        self.segments: list[torch.Tensor] = []
        self.placement: list[str] = []  # "device" or "host", per segment
        self._free = torch.empty(0, dtype=torch.int64, device=self.device)  # a stack of addresses
        self._free_count = 0
        self._pointers: torch.Tensor | None = None
        self._pointers_copied: torch.cuda.Event | None = None  # the table's copy to the device
        self._pointer_streams: set = set()  # the CUDA streams the current table was handed to
        self._pointers_lock = threading.Lock()  # a table is made and dropped whole (two threads)
        self._buffers: dict[int, torch.Tensor] = {}  # segment -> its stash buffer (allocated once)
        self._spares: list[torch.Tensor] = []  # host segments allocated, not added yet
        # the last copy or write of its rows on a stream of its own (a stash, a restore, a cache's
        # write-down beside the step): every access waits for it
        self.ready: torch.cuda.Event | None = None

    @classmethod
    def over(cls, rows: torch.Tensor) -> RowStore:
        """A read-only view of ``rows`` ((n, W) of a row dtype, contiguous) as one segment: address i
        is row i. Lets the row kernels pool rows that came from elsewhere (a shard owner)."""
        store = cls(rows.shape[1], max(1, rows.shape[0]), rows.device, dtype=rows.dtype)
        store.segments, store.placement = [rows.contiguous()], ["device"]
        return store

    # ------------------------------------------------------------------------------- allocation
    def allocate(self, n: int) -> torch.Tensor:
        """int64 (n,) addresses of rows now owned by the caller (contents undefined)."""
        out = self.peek(n)
        self.pop(n)
        return out

    def peek(self, n: int) -> torch.Tensor:
        """int64 (n,) the addresses the next ``allocate`` calls hand out, in order (a copy), still
        free: a kernel may take any first k of them, and ``pop(k)`` then gives them to the caller."""
        while self._free_count < n:
            self._add_segment()
        return self._free[self._free_count - n : self._free_count].flip(0)

    def pop(self, k: int) -> None:
        """The first ``k`` addresses of the last ``peek`` are now owned by the caller."""
        self._free_count -= k

    def reserve(self, rows: int) -> None:
        """Allocate segments now until ``rows`` rows exist (growth later finds them free). For pinned
        host segments, whose allocation (page-locking) is slow and holds up the device's work; the
        host ones come from one block."""
        missing = -(-(rows - self.rows_allocated()) // self.segment_rows)
        if missing <= 0:
            return
        on_device = missing if self.device_segments is None else \
            max(0, min(missing, self.device_segments - len(self.segments)))
        if missing > on_device + len(self._spares):
            self._spares += host_segments(missing - on_device - len(self._spares), self.segment_rows,
                                          self.width, self.device.type == "cuda", self.dtype)
        for _ in range(missing):
            self._add_segment()

    def free(self, addresses: torch.Tensor) -> None:
        """Give rows back. addresses: int64 (n,) allocated, distinct."""
        n = addresses.numel()
        if n == 0:
            return
        if self._free_count + n > self._free.numel():
            grown = torch.empty(max(2 * self._free.numel(), self._free_count + n),
                                dtype=torch.int64, device=self.device)
            grown[: self._free_count] = self._free[: self._free_count]
            self._free = grown
        self._free[self._free_count : self._free_count + n] = addresses.flip(0)
        self._free_count += n

    def _add_segment(self) -> None:
        if self.device_segments is None or len(self.segments) < self.device_segments:
            seg = torch.zeros(self.segment_rows, self.width, dtype=self.dtype, device=self.device)
            self.placement.append("device")
        else:
            self.placement.append("host")
            if not self._spares:  # pinned: a block of several segments (page-locking is slow)
                cuda = self.device.type == "cuda"
                count = max(1, min(64, _SLAB_BYTES // (self.segment_rows * self.row_bytes))) if cuda else 1
                self._spares = host_segments(count, self.segment_rows, self.width, cuda, self.dtype)
            seg = self._spares.pop(0)
        base = len(self.segments) * self.segment_rows
        self.segments.append(seg)
        self._segments_changed()
        # under the rows already free (they go first), lowest new address on top
        new = torch.arange(base + self.segment_rows - 1, base - 1, -1, dtype=torch.int64,
                           device=self.device)
        self._free = torch.cat([new, self._free[: self._free_count]])
        self._free_count = self._free.numel()

    def rows_allocated(self) -> int:
        return len(self.segments) * self.segment_rows

    def rows_in_use(self) -> int:
        return self.rows_allocated() - self._free_count

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return self.width * self.dtype.itemsize

    def nbytes(self) -> int:
        return self.rows_allocated() * self.row_bytes

    def rows_by_placement(self) -> dict[str, int]:
        """Allocated rows per placement: ``{"device": ..., "host": ...}``, and ``"stashed"`` while
        any are."""
        out = {"device": self.placement.count("device") * self.segment_rows,
               "host": self.placement.count("host") * self.segment_rows}
        if "stashed" in self.placement:
            out["stashed"] = self.placement.count("stashed") * self.segment_rows
        return out

    def pointer_table(self) -> torch.Tensor:
        """int64 (num_segments,) base addresses of the segments, on the store's device. The current
        stream waits for a stash or restore copy still running (kernels launched on it are safe).

        A table is replaced when the segments change, maybe by another thread while kernels queued on
        this stream still read it (TrainPipeline's prefetch thread grows the store beside the
        backward's update): each stream it is handed to is recorded on it, so its block is not
        reused before their work is done (a reused block made the update write rows to wild
        addresses), and waits for the copy that filled it, queued on the stream that made it (the
        prefetch thread's kernels read a table the training stream had not filled yet: an illegal
        address at scale 0.3, session 24). Inside a CUDA graph's capture there is no wait (it would
        invalidate the capture): the stream the graph replays on takes the table first."""
        self._await_copy(host=False)
        cuda = self.device.type == "cuda"
        capturing = cuda and torch.cuda.is_current_stream_capturing()
        with self._pointers_lock:  # the segments read and the table published as one step
            if self._pointers is None:
                pointers = torch.tensor([s.data_ptr() for s in self.segments] or [0], dtype=torch.int64)
                copied = None
                if cuda:  # a copy from pageable memory would make the host wait
                    pointers = pointers.pin_memory().to(self.device, non_blocking=True)
                    if not capturing:
                        copied = torch.cuda.Event()
                        copied.record()
                self._pointers, self._pointers_copied, self._pointer_streams = pointers, copied, set()
            pointers, copied = self._pointers, self._pointers_copied
            if cuda:
                stream = torch.cuda.current_stream(self.device)
                if stream not in self._pointer_streams:
                    pointers.record_stream(stream)
                    if copied is not None and not capturing:
                        stream.wait_event(copied)
                    self._pointer_streams.add(stream)
        return pointers

    def _segments_changed(self) -> None:
        """The next ``pointer_table`` makes a new table (after a change to ``segments``)."""
        with self._pointers_lock:
            self._pointers = None

    # --------------------------------------------------------------------------- row access
    def gather(self, addresses: torch.Tensor, cols: int | None = None) -> torch.Tensor:
        """Rows at ``addresses`` (int64 (n,)), first ``cols`` columns, in the store's dtype; address
        < 0 gives zeros."""
        cols = self.width if cols is None else cols
        out = torch.zeros(addresses.numel(), cols, dtype=self.dtype, device=self.device)
        for _, seg, idx, pos in self._by_segment(addresses):
            out[pos] = seg[idx.to(seg.device), :cols].to(self.device)
        return out

    def scatter(self, addresses: torch.Tensor, rows: torch.Tensor, col_start: int = 0) -> None:
        """rows[i] -> row addresses[i] from column ``col_start``; addresses distinct, >= 0. Rows of
        another float dtype are rounded to the store's (to the nearest value)."""
        cols = rows.shape[1]
        for _, seg, idx, pos in self._by_segment(addresses):
            seg[idx.to(seg.device), col_start : col_start + cols] = rows[pos].to(seg.device, self.dtype)

    def _by_segment(self, addresses: torch.Tensor):
        """Yield (segment number, segment, offsets in it, positions in ``addresses``)."""
        if addresses.numel() == 0:
            return
        self._await_copy(host=any(p != "device" for p in self.placement))  # the CPU may touch host rows
        seg_of = torch.div(addresses, self.segment_rows, rounding_mode="floor")
        offset = addresses - seg_of * self.segment_rows
        if len(self.segments) == 1:
            pos = (addresses >= 0).nonzero().squeeze(1)
            yield 0, self.segments[0], offset[pos], pos
            return
        # grouped by one sort and one read of the counts, not a search per segment (a host tier of
        # gigabytes has hundreds of segments, and each search on the device is a read)
        valid = (addresses >= 0).nonzero().squeeze(1)
        seg_sorted, order = torch.sort(seg_of[valid], stable=True)
        edges = torch.searchsorted(seg_sorted, torch.arange(len(self.segments) + 1, device=seg_sorted.device))
        counts = torch.diff(edges).tolist()  # (bincount would read its range first)
        by_segment = valid[order]
        start = 0
        for s, n in enumerate(counts):
            if n:
                pos = by_segment[start : start + n]
                yield s, self.segments[s], offset[pos], pos
                start += n

    # ------------------------------------------------------------------------------ stashing
    @property
    def stashed(self) -> bool:
        return "stashed" in self.placement

    def device_bytes(self) -> int:
        """Bytes of the segments in device memory (what ``stash`` would move)."""
        return self.placement.count("device") * self.segment_rows * self.row_bytes

    def stash(self, stream: torch.cuda.Stream | None, chunk_rows: int) -> dict[int, torch.Tensor]:
        """Copy every device segment to its host buffer (pinned on CUDA; allocated at the first stash,
        then reused) on ``stream``, in chunks of ``chunk_rows`` rows, after the current stream's work.
        From now on the segments are those buffers. Returns the device tensors by segment: the caller
        frees them, not before ``ready`` on any stream that may reuse their memory."""
        moved = [s for s, p in enumerate(self.placement) if p == "device"]
        new = [s for s in moved if s not in self._buffers]
        if new:  # one block for the segments without a buffer yet
            blocks = host_segments(len(new), self.segment_rows, self.width, self.device.type == "cuda",
                                   self.dtype)
            self._buffers.update(zip(new, blocks))
        released = {}
        with _on(stream, self.device):
            for s in moved:
                seg, buf = self.segments[s], self._buffers[s]
                _copy_chunks(buf, seg, chunk_rows)
                released[s] = seg
                self.segments[s], self.placement[s] = buf, "stashed"
            self._copied(stream)
        return released

    def restore(self, stream: torch.cuda.Stream | None, chunk_rows: int,
                into: dict[int, torch.Tensor] | None = None) -> None:
        """Copy the stashed segments back to device memory on ``stream`` (chunked), into the tensors of
        ``into`` (segment -> a device tensor not freed yet) or fresh allocations on the current stream,
        after the current stream's work. Kernels see the device rows from now on (``ready``)."""
        stashed = [s for s, p in enumerate(self.placement) if p == "stashed"]
        if not stashed:
            return
        into = into or {}
        fresh = [s for s in stashed if s not in into]
        # one allocation for all fresh segments: freed at the next stash as one block, which the
        # caching allocator can split for the activations (separate segment-sized blocks serve only
        # requests up to a segment's size)
        block = torch.empty(len(fresh) * self.segment_rows, self.width, dtype=self.dtype, device=self.device)
        targets = dict(into)
        targets.update({s: block[i * self.segment_rows : (i + 1) * self.segment_rows]
                        for i, s in enumerate(fresh)})
        with _on(stream, self.device):
            for s in stashed:
                _copy_chunks(targets[s], self.segments[s], chunk_rows)
                self.segments[s], self.placement[s] = targets[s], "device"
            self._copied(stream)

    def _copied(self, stream: torch.cuda.Stream | None) -> None:
        self._segments_changed()
        if stream is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(stream)

    def _await_copy(self, host: bool) -> None:
        """Order what comes next after ``ready`` (the last copy or write of rows on a stream of its
        own): the current stream waits for it, and with ``host`` (the CPU is about to touch host
        rows) the host does. Not inside a CUDA graph's capture: a captured wait for an event
        recorded outside it invalidates the capture, and the stream the graph is replayed on waits
        instead (the caller takes ``pointer_table`` on it first, as ``DeviceTier._insert_graph``
        and ``CacheTier._insert_on_device`` do for their keys)."""
        if self.ready is None or (not host and torch.cuda.is_current_stream_capturing()):
            return
        if host:
            self.ready.synchronize()
        else:
            torch.cuda.current_stream(self.device).wait_event(self.ready)


_SLAB_BYTES = 256 << 20  # pinned host segments are made this many bytes at a time (at most 64)


def host_segments(count: int, rows: int, width: int, pinned: bool,
                  dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """At least ``count`` zeroed host segments of (rows, width) ``dtype``, views of one block. torch's
    pinned allocator rounds a block up to a power of two bytes (measured on the H200 machine: ten
    33.8 MB blocks took 671 MB, one 15.5 GB block 17.2 GB), so a pinned block is cut into as many
    segments as its rounded size holds."""
    seg_bytes = rows * width * dtype.itemsize
    if pinned and seg_bytes:
        count = (1 << (count * seg_bytes - 1).bit_length()) // seg_bytes
    block = torch.zeros(count * rows, width, dtype=dtype, pin_memory=pinned)
    return list(block.split(rows))


@contextmanager
def _on(stream: torch.cuda.Stream | None, device: torch.device):
    """Run on ``stream`` after everything the current stream has been given (no-op without one)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


def _copy_chunks(dst: torch.Tensor, src: torch.Tensor, chunk_rows: int) -> None:
    """dst <- src, ``chunk_rows`` rows per copy (non-blocking between pinned host and device)."""
    for start in range(0, src.shape[0], chunk_rows):
        dst[start : start + chunk_rows].copy_(src[start : start + chunk_rows], non_blocking=True)
