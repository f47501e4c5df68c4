"""``TritonKernels``: the embedding data path's Triton kernels behind ``TorchKernels``' interface, with
the tile sizes and grids they are launched with. The kernels live one family a file: ``gather.py``
(scatter, copy, gather, gather+pool), ``reduce.py`` (gradient reduction), ``update.py`` (fused
optimizer update), ``dedup.py`` (dedup and runs), ``checks.py``, ``groups.py``; ``rows.py`` addresses
rows through the RowStore's segment pointer table (an address < 0 reads as a zero row and is never
written).

Tables have mixed widths: ``D`` (embedding dim) and ``W`` (row width, D + optimizer state) are runtime
arguments; column tiles are ``BLOCK_D = next_power_of_2(D)`` wide with masks.

``TritonKernels`` has exactly ``TorchKernels``' methods and meaning (``tieredemb.ops.reference``); the
two are tested equal in ``tests/ops/test_triton_kernels.py``. No method reads a device value on the
host: grids and buffers come from tensor shapes only. ``docs/kernels.md`` lists the tuning knobs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tieredemb.ops import reference
from tieredemb.ops.triton.checks import batch_checks
from tieredemb.ops.triton.dedup import (
    _dedup_hash_kernel,
    _pairs_in_order_kernel,
    _regroup_kernel,
    _run_counts_kernel,
    _run_scatter_kernel,
)
from tieredemb.ops.triton.gather import (
    _bag_rows_kernel,
    _copy_rows_kernel,
    _gather_kernel,
    _gather_pool_kernel,
    _scatter_kernel,
)
from tieredemb.ops.triton.groups import regroup_ids
from tieredemb.ops.triton.index import TritonKeyIndex
from tieredemb.ops.triton.reduce import (
    _plan_counts_kernel,
    _plan_pieces_kernel,
    _reduce_keys_kernel,
    _reduce_pieces_kernel,
)
from tieredemb.ops.triton.rounding import ROUND_BF16, ROUND_FP16, ROUND_NEAREST
from tieredemb.ops.triton.update import _optimizer_kernel
from tieredemb.optim import EmbeddingOptimizer
from tieredemb.storage.row_store import RowStore

# Tiles measured on the H200 (D=128, ~100k random rows; docs/kernels.md): a [rows x BLOCK_D] tile of
# 1024 fp32 over 4 warps (8 registers a thread per live tile) beat 2k-16k tiles, which spill in the
# Adam update (four live tiles: w, m, v, g) and run up to 10x slower.
_TILE_ELEMS = 1024
_MAX_ROWS = 128  # rows per program in gather / reduce_grads / optimizer_update
# elements of one bag's ids a loop iteration of gather_pool (8 ids at most): at D=128 4 ids pooled the
# `hbm` batch in 0.166-0.170 ms, 8 ids in 0.204-0.207, 2 in 0.163-0.166 (H200, 2026-11-21)
_BAG_ELEMS = 512
_RUN_BLOCK = 1024  # sorted ids per program in the dedup's passes
_NO_KEY = 2**63 - 1  # the reduction plan's key of a program past the last piece
_MAX_RUN_PROGRAMS = 1024  # the dedup's runs: programs of consecutive blocks, counts summed in one load
_REGROUP_PROGRAMS = 64  # programs over the hashes two pairs share (each takes one at a time)
_OPTIMIZER_KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
_ROW_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_STOCHASTIC = {torch.bfloat16: ROUND_BF16, torch.float16: ROUND_FP16}


def _rounding(store: RowStore, seeds: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
    """The update's ROUND for ``store``'s rows and its seeds (None: no stochastic rounding)."""
    if seeds is None or store.dtype not in _STOCHASTIC:
        return ROUND_NEAREST, None
    return _STOCHASTIC[store.dtype], seeds.contiguous()


def _block_d(dim: int) -> int:
    return triton.next_power_of_2(max(dim, 1))


def _block_rows(block_d: int) -> int:
    return max(1, min(_MAX_ROWS, _TILE_ELEMS // block_d))


def _programs(n: int, block_n: int, cap: int | None) -> int:
    """A row kernel's grid: one program a block of ``block_n`` rows, at most ``cap``."""
    blocks = triton.cdiv(n, block_n)
    return blocks if cap is None else max(1, min(blocks, cap))


def _num_warps(tile_elems: int) -> int:
    return 4 if tile_elems <= 2048 else 8


def _rows(count: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``count`` int64 (n,) buffers from one allocation (each ~4-7 us of host on its own), every
    one starting 16-byte aligned (what Triton specializes on)."""
    return tuple(torch.empty(count, n + (n & 1), dtype=torch.int64, device=device)[:, :n].unbind(0))


def _scan_grid(n: int) -> tuple[int, int]:
    """A two-pass scan's grid over n items in blocks of ``_RUN_BLOCK``: (consecutive blocks a
    program, programs), at most ``_MAX_RUN_PROGRAMS`` programs (their sums are read in one load)."""
    blocks = triton.cdiv(triton.cdiv(n, _RUN_BLOCK), _MAX_RUN_PROGRAMS)
    return blocks, triton.cdiv(triton.cdiv(n, _RUN_BLOCK), blocks)


def _bag_warps(tile_elems: int) -> int:
    """One warp per 1024 elements of a tile of one bag's (or one key's) ids, 1 to 8: D=128 pools and
    reduces fastest with a single warp."""
    return max(1, min(8, tile_elems // 1024))


def _bag_chunk(block_d: int) -> int:
    """gather_pool's ids of one bag a loop iteration: ``_BAG_ELEMS`` elements, 1 to 8 ids."""
    return max(1, min(8, _BAG_ELEMS // block_d))


# ids a piece of the reduction (``reduce.py``): a hot key's ids spread over many programs
_PIECE = 256


def _optimizer_args(optimizer: EmbeddingOptimizer, step: int) -> tuple[float, ...]:
    """The fused update's runtime arguments: lr, eps, betas, Adam's bias-corrected step size, KIND."""
    if optimizer.kind not in _OPTIMIZER_KINDS:
        raise ValueError(f"no Triton kernel for optimizer kind {optimizer.kind!r}")
    beta1, beta2 = getattr(optimizer, "betas", (0.0, 0.0))
    step_size = optimizer.step_size(step) if optimizer.kind == "adam" else 0.0
    return (float(optimizer.lr), float(getattr(optimizer, "eps", 0.0)), float(beta1), float(beta2),
            float(step_size), _OPTIMIZER_KINDS.index(optimizer.kind))


# --------------------------------------------------------------------------------------- wrapper
class TritonKernels:
    """Triton implementation of the kernel interface (``tieredemb.ops.reference.TorchKernels``).

    Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (``TRITON_INTERPRET=1``).
    """

    name = "triton"
    index_class = TritonKeyIndex

    def gather(self, store: RowStore, addresses: torch.Tensor, dim: int,
               programs: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The first ``dim`` columns of rows. addresses: int64 (n,) -> (n, dim) in ``dtype`` (float32
        by default). ``programs``: at most that many programs (each loops over its share): rows in
        host memory need a few loads in flight, not the whole device."""
        n = addresses.numel()
        out = torch.empty(n, dim, dtype=dtype, device=addresses.device)
        if n == 0 or dim == 0:
            return out
        block_d = _block_d(dim)
        block_n = _block_rows(block_d)
        _gather_kernel[(_programs(n, block_n, programs),)](
            store.pointer_table(),
            addresses.contiguous(),
            out,
            n,
            dim,
            store.width,
            store.segment_rows,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            ROW_DTYPE=_ROW_DTYPES[store.dtype],
            num_warps=_num_warps(block_n * block_d),
        )
        return out

    def scatter(self, store: RowStore, addresses: torch.Tensor, rows: torch.Tensor,
                programs: int | None = None, source: torch.Tensor | None = None) -> None:
        """Whole rows in place. addresses: int64 (n,) distinct (-1: none); rows: float (n, C),
        C <= W, the rows' first C columns (the others are set to zero), rounded to the store's dtype
        (to the nearest value). ``programs``: as ``gather``.
        ``source``: int64 (n,), row i takes ``rows[source[i]]`` (rows then (m, C))."""
        n = addresses.numel()
        if n == 0:
            return
        block_w = _block_d(store.width)
        block_n = _block_rows(block_w)
        _scatter_kernel[(_programs(n, block_n, programs),)](
            store.pointer_table(),
            addresses.contiguous(),
            rows.contiguous(),
            addresses if source is None else source.contiguous(),
            n,
            rows.shape[1],
            store.width,
            store.segment_rows,
            HAS_SOURCE=source is not None,
            BLOCK_N=block_n,
            BLOCK_W=block_w,
            ROW_DTYPE=_ROW_DTYPES[store.dtype],
            num_warps=_num_warps(block_n * block_w),
        )

    def copy_rows(self, src: RowStore, src_addresses: torch.Tensor, dst: RowStore,
                  dst_addresses: torch.Tensor, programs: int | None = None) -> None:
        """Rows ``src_addresses`` (int64 (n,)) of ``src`` to rows ``dst_addresses`` (int64 (n,),
        distinct) of ``dst``, of the same width and dtype, where both are >= 0. ``programs``: as
        ``gather``."""
        n = src_addresses.numel()
        if n == 0:
            return
        reference.check_same_rows(src, dst)
        block_w = _block_d(src.width)
        block_n = _block_rows(block_w)
        _copy_rows_kernel[(_programs(n, block_n, programs),)](
            src.pointer_table(),
            src_addresses.contiguous(),
            dst.pointer_table(),
            dst_addresses.contiguous(),
            n,
            src.width,
            src.segment_rows,
            dst.segment_rows,
            BLOCK_N=block_n,
            BLOCK_W=block_w,
            ROW_DTYPE=_ROW_DTYPES[src.dtype],
            num_warps=_num_warps(block_n * block_w),
        )

    def gather_pool(
        self,
        store: RowStore,
        addresses: torch.Tensor,
        offsets: torch.Tensor,
        scale: torch.Tensor | None,
        dim: int,
        features: int = 1,
    ) -> torch.Tensor:
        """Pooled bags. addresses: int64 (n,) one per id; offsets: int64 (b+1,) bag boundaries;
        scale: float32 (n,) per-id factor (weights, 1/len for mean) or None -> float32 (b, dim).
        ``features``: the bags are that many features' blocks of B bags; bag f * B + i goes to row
        i * features + f (the rows are then (B, features * dim), sample-major)."""
        num_bags = offsets.numel() - 1
        out = torch.empty(num_bags, dim, dtype=torch.float32, device=offsets.device)
        if num_bags <= 0 or dim == 0:
            return out
        addresses = addresses.contiguous()
        block_d = _block_d(dim)
        chunk = _bag_chunk(block_d)
        _gather_pool_kernel[(num_bags,)](
            store.pointer_table(),
            addresses,
            offsets.contiguous(),
            addresses if scale is None else scale.contiguous(),
            out,
            dim,
            store.width,
            store.segment_rows,
            num_bags // features,
            features,
            HAS_SCALE=scale is not None,
            BLOCK_I=chunk,
            BLOCK_D=block_d,
            ROW_DTYPE=_ROW_DTYPES[store.dtype],
            num_warps=_bag_warps(chunk * block_d),
        )
        return out

    def id_order(self, ids: torch.Tensor, tables: torch.Tensor, num_tables: int,
                 count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's ``id_order`` without a host sync: a radix sort of the int32 sort keys
        (``dedup_hash``: 4 passes on 12 bytes an id; the int64 ids took 8 on 16), then one pass
        that writes each position's id and table and finds the sort keys two pairs share (~20 a
        batch of 335k distinct pairs), and one that lays each such key's pairs out one after
        another, as the reference orders them."""
        n, dev = ids.numel(), ids.device
        if n == 0:
            return ids, ids, tables
        hashes = torch.empty(n, dtype=torch.int32, device=dev)
        real = hashes if count is None else count  # (a dummy pointer without padding)
        grid = (triton.cdiv(n, _RUN_BLOCK),)
        table_bits, hash_bits = reference.dedup_key_bits(num_tables)
        _dedup_hash_kernel[grid](ids, tables, hashes, n, real, TABLE_BITS=table_bits, HASH_BITS=hash_bits,
                                 PAD=reference.DEDUP_PAD_HASH, N_PTR=count is not None, BLOCK=_RUN_BLOCK)
        shash, order = torch.sort(hashes, stable=True)
        even = n + (n & 1)
        claims = torch.zeros(even + 2, dtype=torch.int32, device=dev)  # + the number found (int64)
        found = claims[even:].view(torch.int64)
        skeys, stables, groups, *scratch = _rows(5, n, dev)  # (scratch: 2n from its first row on)
        _pairs_in_order_kernel[grid](shash, order, ids, tables, skeys, stables, claims, groups, found, n,
                                     real, N_PTR=count is not None, BLOCK=_RUN_BLOCK)
        _regroup_kernel[(_REGROUP_PROGRAMS,)](shash, order, ids, tables, skeys, stables, groups, found,
                                              scratch[0], n, real, N_PTR=count is not None, BLOCK=_RUN_BLOCK)
        return order, skeys, stables

    def sorted_runs(
        self, skeys: torch.Tensor, stables: torch.Tensor, order: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's ``sorted_runs``; one host sync (the number of runs)."""
        keys, runs_tables, inverse, entries, count = self.sorted_runs_padded(skeys, stables, order)
        u = int(count)
        return keys[:u], runs_tables[:u], inverse, entries[:u]

    def sorted_runs_padded(
        self, skeys: torch.Tensor, stables: torch.Tensor, order: torch.Tensor,
        count: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference's ``sorted_runs_padded`` in two launches, no host sync: each program counts
        the runs starting in its blocks, then each adds the counts of the programs before it (at most
        ``_MAX_RUN_PROGRAMS``, one load) to a prefix sum of its own heads and scatters. (A ``cumsum``
        between two kernels before: CUB's scan allocates its scratch, 25-44 us of host a call.)"""
        n, dev = skeys.numel(), skeys.device
        if n == 0:
            return skeys, stables, skeys, skeys, torch.zeros(1, dtype=torch.int64, device=dev)
        blocks, programs = _scan_grid(n)
        counts = torch.empty(_MAX_RUN_PROGRAMS + 1, dtype=torch.int64, device=dev)  # + the total
        real = counts if count is None else count  # (a dummy pointer without padding)
        _run_counts_kernel[(programs,)](skeys, stables, counts, n, real, blocks, BLOCK=_RUN_BLOCK,
                                        N_PTR=count is not None)
        keys, runs_tables, inverse, starts, ends = _rows(5, n, dev)
        _run_scatter_kernel[(programs,)](skeys, stables, order, counts, keys, runs_tables, inverse, starts,
                                         ends, n, real, blocks, programs, BLOCK=_RUN_BLOCK,
                                         MAX_PROGRAMS=_MAX_RUN_PROGRAMS, N_PTR=count is not None)
        return keys, runs_tables, inverse, ends.sub_(starts), counts[_MAX_RUN_PROGRAMS:]

    def batch_checks(self, values: torch.Tensor, per_feature: torch.Tensor, limits: torch.Tensor | None,
                     table_of_feature: torch.Tensor | None, weights: torch.Tensor | None,
                     count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reference's ``batch_checks`` in two kernels (``checks.py``)."""
        return batch_checks(values, per_feature, limits, table_of_feature, weights, count)

    def regroup_ids(self, shifts: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                    weights: torch.Tensor | None, inverse: torch.Tensor, pair_values: torch.Tensor,
                    order: torch.Tensor, pair_tables: torch.Tensor, table_first: torch.Tensor,
                    count: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The reference's ``regroup_ids`` in one kernel (``groups.py``)."""
        return regroup_ids(shifts, values, tables, weights, inverse, pair_values, order, pair_tables,
                           table_first, count)

    def bag_rows(self, offsets: torch.Tensor, n: int, features: int = 1) -> torch.Tensor:
        """The reference's ``bag_rows``: a binary search a position (one program a bag was 4x
        slower: 164k programs of a few ids)."""
        out = torch.empty(n, dtype=torch.int64, device=offsets.device)
        num_bags = offsets.numel() - 1
        if n and num_bags > 0:
            _bag_rows_kernel[(triton.cdiv(n, _RUN_BLOCK),)](
                offsets, out, n, num_bags, num_bags // features, features,
                STEPS=max(1, num_bags.bit_length()), BLOCK=_RUN_BLOCK)
        return out

    def reduce_grads(
        self,
        grad_src: torch.Tensor,
        src_of_id: torch.Tensor,
        scale: torch.Tensor | None,
        inverse: torch.Tensor,
        num_unique: int,
        sorted_ids: object | None = None,
    ) -> torch.Tensor:
        """Gradient per unique key: sum over ids i of grad_src[src_of_id[i]] * scale[i], grouped by
        inverse[i]. grad_src: float32 (m, D); src_of_id, inverse: int64 (n,) -> float32 (u, D).

        Deterministic (no atomics): each key's ids are summed in their batch order, in pieces of
        ``_PIECE`` ids added in order; equal to the reference within fp32 rounding.
        ``sorted_ids`` (the dedup's ``IdOrder``: ``order``, ``entries``) spares that sort; with its
        ``sources`` (and ``scales``: ``src_of_id[order]``, ``scale[order]``) the kernel reads those
        instead of going through ``order`` (one dependent load an id fewer).
        """
        n, dim = inverse.numel(), grad_src.shape[1]
        if n == 0 or num_unique == 0 or dim == 0:
            return torch.zeros(num_unique, dim, dtype=torch.float32, device=grad_src.device)
        return self._reduce(grad_src, src_of_id, scale, inverse, num_unique, sorted_ids, None)

    def reduce_plan(self, counts: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The reduction's plan for the ``count`` (int64 (1,) on the device) keys of ``counts``
        (int64 (n,), ids per key; entries past the count unspecified), made before the count is
        known on the host (``IdOrder.plan``): buffers sized for any count up to n. None for no ids."""
        if counts.numel() == 0:
            return None
        return self._plan(counts, counts.numel(), count)

    def _plan(self, counts: torch.Tensor, n: int, keys: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(starts, piece_first, piece_key, candidates): each key's first id (in the sort), its first
        piece of _PIECE ids (a key without ids still gets one: its program stores the zero row), the
        key of every piece (past the last piece ``_NO_KEY``) and the keys of several pieces (at most
        n // _PIECE; they need a second pass). Two passes over the keys, as ``sorted_runs_padded``'s.
        n: the ids; ``keys``: their number of keys, an int, or int64 (1,) on the device (then the
        buffers hold as many keys as ``counts`` has entries)."""
        dev = counts.device
        on_device = isinstance(keys, torch.Tensor)
        bound = counts.numel() if on_device else keys
        blocks, programs = _scan_grid(bound)
        sums = torch.empty(3, _MAX_RUN_PROGRAMS, dtype=torch.int64, device=dev)
        u, u_ptr = (0, keys) if on_device else (keys, sums)  # (sums: a pointer not read)
        _plan_counts_kernel[(programs,)](counts, sums, u, u_ptr, blocks, PIECE=_PIECE, BLOCK=_RUN_BLOCK,
                                         MAX_PROGRAMS=_MAX_RUN_PROGRAMS, U_PTR=on_device)
        starts, piece_first = _rows(2, bound, dev)
        pieces = bound + n // _PIECE + 1
        piece_key = torch.full((pieces + min(bound, n // _PIECE + 1),), _NO_KEY, dtype=torch.int64,
                               device=dev)
        candidates = piece_key[pieces:]
        _plan_pieces_kernel[(programs,)](counts, sums, starts, piece_first, piece_key, candidates, u, u_ptr,
                                         blocks, PIECE=_PIECE, BLOCK=_RUN_BLOCK,
                                         MAX_PROGRAMS=_MAX_RUN_PROGRAMS, U_PTR=on_device)
        return starts, piece_first, piece_key, candidates

    def reduce_update(self, grad_src: torch.Tensor, src_of_id: torch.Tensor, scale: torch.Tensor | None,
                      inverse: torch.Tensor, num_unique: int, sorted_ids: object | None, store: RowStore,
                      addresses: torch.Tensor, optimizer: EmbeddingOptimizer, step: int,
                      seeds: torch.Tensor | None = None) -> None:
        """``optimizer_update(store, addresses, reduce_grads(...), optimizer, step, seeds)`` in the
        reduction's kernels: each key's row is updated by the program that finishes its sum, and the
        (u, D) sums are never written (~0.1 ms and u x D x 4 bytes of device memory on ``hbm``)."""
        n, dim = inverse.numel(), grad_src.shape[1]
        if n == 0 or num_unique == 0 or dim == 0:
            grads = self.reduce_grads(grad_src, src_of_id, scale, inverse, num_unique, sorted_ids)
            self.optimizer_update(store, addresses, grads, optimizer, step, seeds)
            return
        self._reduce(grad_src, src_of_id, scale, inverse, num_unique, sorted_ids,
                     (store, addresses.contiguous(), optimizer, step, seeds))

    def _reduce(self, grad_src, src_of_id, scale, inverse, num_unique, sorted_ids, update):
        """``reduce_grads`` (``update`` None: returns the sums) or ``reduce_update`` (``update``:
        store, addresses, optimizer, step, seeds; returns None)."""
        n, dim = inverse.numel(), grad_src.shape[1]
        dev = grad_src.device
        if sorted_ids is None:
            order = torch.argsort(inverse, stable=True)
            counts = torch.bincount(inverse, minlength=num_unique)[:num_unique]
        else:
            order, counts = sorted_ids.order, sorted_ids.entries
        presorted = getattr(sorted_ids, "sources", None) is not None
        if presorted:  # the sources (and scales) in ``order``'s order, made by the prefetch
            src_of_id, scale = sorted_ids.sources, sorted_ids.scales
        plan = getattr(sorted_ids, "plan", None)  # made by the prefetch, or now
        if plan is None:
            plan = self._plan(counts, n, num_unique)
        starts, piece_first, piece_key, candidates = plan
        # grid: an upper bound of the pieces, known without a host sync (programs past the last
        # piece find a key >= num_unique and do nothing); k: a bound of the keys of several pieces
        grid = num_unique + n // _PIECE + 1
        k = min(num_unique, n // _PIECE + 1)
        out = None if update else torch.empty(num_unique, dim, dtype=torch.float32, device=dev)
        partial = torch.empty(grid, dim, dtype=torch.float32, device=dev)
        if update:
            store, addresses, optimizer, step, seeds = update
            table, width, seg_rows = store.pointer_table(), store.width, store.segment_rows
            lr, eps, beta1, beta2, step_size, kind = _optimizer_args(optimizer, step)
            row_dtype, (rounding, seeds) = _ROW_DTYPES[store.dtype], _rounding(store, seeds)
        else:  # unused: the update's arguments
            table, addresses, width, seg_rows = partial, partial, dim, 1
            lr, eps, beta1, beta2, step_size, kind = 0.0, 0.0, 0.0, 0.0, 0.0, 0
            row_dtype, rounding, seeds = tl.float32, ROUND_NEAREST, None
        seeds = addresses if seeds is None else seeds  # (a pointer not read)
        block_d = _block_d(dim)
        chunk = max(1, min(32, _TILE_ELEMS // block_d))
        _reduce_pieces_kernel[(grid,)](
            grad_src.contiguous(), src_of_id.contiguous(), inverse if scale is None else scale.contiguous(),
            order, starts, counts, piece_key, piece_first, partial if out is None else out, partial,
            num_unique, dim, table, addresses, seeds, width, seg_rows, lr, eps, beta1, beta2, step_size,
            HAS_SCALE=scale is not None, PIECE=_PIECE, CHUNK=chunk, BLOCK_D=block_d, UPDATE=bool(update),
            KIND=kind, PRESORTED=presorted, ROW_DTYPE=row_dtype, ROUND=rounding,
            num_warps=_bag_warps(chunk * block_d),
        )
        _reduce_keys_kernel[(k,)](
            partial, counts, piece_first, candidates, partial if out is None else out, num_unique, dim, table,
            addresses, seeds, width, seg_rows, lr, eps, beta1, beta2, step_size, PIECE=_PIECE,
            BLOCK_D=block_d, UPDATE=bool(update), KIND=kind, ROW_DTYPE=row_dtype, ROUND=rounding, num_warps=1,
        )
        return out

    def optimizer_update(
        self,
        store: RowStore,
        addresses: torch.Tensor,
        grads: torch.Tensor,
        optimizer: EmbeddingOptimizer,
        step: int,
        seeds: torch.Tensor | None = None,
    ) -> None:
        """Fused update in place of the rows at ``addresses`` (int64 (u,), distinct; < 0 skipped)
        with their summed gradients ``grads`` float32 (u, D). Computed in float32; a 16-bit store's
        rows are rounded stochastically with ``seeds`` (int64 (u,)), or to the nearest value without."""
        n, dim = addresses.numel(), grads.shape[1]
        if n == 0 or dim == 0:
            return
        lr, eps, beta1, beta2, step_size, kind = _optimizer_args(optimizer, step)
        rounding, seeds = _rounding(store, seeds)
        block_d = _block_d(dim)
        block_n = _block_rows(block_d)
        _optimizer_kernel[(triton.cdiv(n, block_n),)](
            store.pointer_table(),
            addresses.contiguous(),
            addresses if seeds is None else seeds,
            grads.contiguous(),
            n,
            dim,
            store.width,
            store.segment_rows,
            lr,
            eps,
            beta1,
            beta2,
            step_size,
            KIND=kind,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            ROW_DTYPE=_ROW_DTYPES[store.dtype],
            ROUND=rounding,
            num_warps=_num_warps(block_n * block_d),
        )
