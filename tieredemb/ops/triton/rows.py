"""Row addressing shared by the row kernels (``gather.py``, ``reduce.py``, ``update.py``).

Each kernel reaches rows through the RowStore's segment pointer table: a row address ``a`` lives in
segment ``a // segment_rows`` at offset ``a % segment_rows``, and the kernel loads that segment's int64
base pointer and casts it to a pointer of the rows' type. Segments may therefore live anywhere the device can
address (device memory, pinned host memory). An address < 0 reads as a zero row and is never written.
``ROW_DTYPE`` is the rows' element type (``tl.float32``, ``tl.bfloat16`` or ``tl.float16``: the
table's ``dtype``); kernels compute in float32 whatever it is.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_pointers(ptr_table, addr, valid, segment_rows, row_width, ROW_DTYPE: tl.constexpr):
    """ROW_DTYPE pointers to column 0 of the rows at ``addr`` (int64 (R,)); rows where not ``valid``
    point at segment 0, offset 0 and must be masked by the caller."""
    addr = tl.where(valid, addr, 0)
    seg = addr // segment_rows
    offset = addr - seg * segment_rows
    base = tl.load(ptr_table + seg, mask=valid, other=0).to(tl.pointer_type(ROW_DTYPE))
    return base + offset * row_width


@triton.jit
def _block_of_rows(ptr_table, addresses, block, n, segment_rows, row_width, BLOCK_N: tl.constexpr,
                   ROW_DTYPE: tl.constexpr):
    """Block ``block`` of a row kernel's ``n`` rows: their positions, which are in range, which
    have an address (>= 0), and pointers to those rows (``_row_pointers``)."""
    rows = (tl.zeros([BLOCK_N], dtype=tl.int64) + block) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = rows < n
    addr = tl.load(addresses + rows, mask=in_range, other=-1)
    valid = addr >= 0
    return rows, in_range, valid, _row_pointers(ptr_table, addr, valid, segment_rows, row_width, ROW_DTYPE)
