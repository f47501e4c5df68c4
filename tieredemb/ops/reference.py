"""Pure-torch reference of every hot operation; also the CPU path.

The Triton kernels in ``tieredemb.ops.triton`` implement the same four operations with the same
signatures and are tested equal to these. Addresses are RowStore row addresses; an address < 0 reads
as a zero row and is never updated.
"""

from __future__ import annotations

import torch

from tieredemb.index.key_index import KeyIndex
from tieredemb.keys import GOLDEN, RESERVED_KEY, shr, splitmix64
from tieredemb.ops.rounding import round_rows
from tieredemb.optim import EmbeddingOptimizer
from tieredemb.storage.row_store import RowStore

# The dedup sorts each id by a 32-bit key of its (key, table) pair (half the radix passes of the
# 64-bit key, on 12 bytes an id instead of 16): the table in the top bits (the ids of one table
# together: their bag gradients stay in L2 while the reduction reads them), the top bits of the
# key's splitmix64 below (the index's bucket order, ``bucket_of``: the probe then sweeps each
# region's buckets in order); then it makes the pairs of one sort key adjacent again. Tests lower
# the bits so that many pairs share a key.
DEDUP_HASH_BITS = 32
DEDUP_PAD_HASH = 2**31 - 1  # padding's sort key (a pair's is at most one less): it sorts last
_DEDUP_MAX_TABLE_BITS = 16  # more tables than 2**16 in a group: the table only inside the hash


def dedup_key_bits(num_tables: int) -> tuple[int, int]:
    """(table bits, hash bits) of the dedup's sort key for a group of ``num_tables`` tables."""
    table_bits = max(num_tables - 1, 0).bit_length()
    if table_bits > _DEDUP_MAX_TABLE_BITS:
        table_bits = 0
    return table_bits, max(DEDUP_HASH_BITS - table_bits, 0)


def orders_by_table(num_tables: int) -> bool:
    """Whether ``id_order`` sorts the pairs of ``num_tables`` tables table by table (the table on top
    of the sort key; past 2**16 tables it is only inside the hash)."""
    return num_tables == 1 or dedup_key_bits(num_tables)[0] > 0


def dedup_hash(ids: torch.Tensor, tables: torch.Tensor, num_tables: int) -> torch.Tensor:
    """int32 (n,) the dedup's sort key of each (id, table) pair (int64 (n,) each; ``num_tables``
    tables): ``table << hash_bits | the top hash_bits bits of splitmix64(id)`` (``dedup_key_bits``;
    without table bits, of ``splitmix64(id ^ table * golden)``), offset into int32 and below
    ``DEDUP_PAD_HASH``."""
    table_bits, hash_bits = dedup_key_bits(num_tables)
    mixed = splitmix64(ids if table_bits else ids ^ (tables * GOLDEN))
    key = shr(mixed, 64 - hash_bits) if hash_bits else torch.zeros_like(ids)
    if table_bits:
        key = key + (tables << hash_bits)
    return (key - 2**31).clamp_(max=DEDUP_PAD_HASH - 1).to(torch.int32)


class TorchKernels:
    """The reference implementation of the kernel interface."""

    name = "torch"
    index_class = KeyIndex

    def gather(self, store: RowStore, addresses: torch.Tensor, dim: int,
               programs: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The first ``dim`` columns of rows. addresses: int64 (n,) -> (n, dim) in ``dtype``
        (float32, the lookups' type, by default; the store's own to move rows unchanged).
        ``programs``: a bound on a kernel's grid (the Triton kernels'; nothing here)."""
        return store.gather(addresses, dim).to(dtype)

    def scatter(self, store: RowStore, addresses: torch.Tensor, rows: torch.Tensor,
                programs: int | None = None, source: torch.Tensor | None = None) -> None:
        """Whole rows in place. addresses: int64 (n,) distinct (-1: none); rows: float (n, C),
        C <= W, the rows' first C columns (the others are set to zero), rounded to the store's dtype
        (to the nearest value). ``source``: int64 (n,), row i takes ``rows[source[i]]`` (rows then
        (m, C))."""
        if source is not None:
            rows = rows[source]
        if rows.shape[1] < store.width:
            rows = torch.nn.functional.pad(rows, (0, store.width - rows.shape[1]))
        store.scatter(addresses, rows)

    def copy_rows(self, src: RowStore, src_addresses: torch.Tensor, dst: RowStore,
                  dst_addresses: torch.Tensor, programs: int | None = None) -> None:
        """Rows ``src_addresses`` (int64 (n,)) of ``src`` to rows ``dst_addresses`` (int64 (n,),
        distinct) of ``dst``, of the same width and dtype, where both are >= 0."""
        check_same_rows(src, dst)
        both = (src_addresses >= 0) & (dst_addresses >= 0)
        dst.scatter(torch.where(both, dst_addresses, -1), src.gather(src_addresses).to(dst.device))

    def gather_pool(self, store: RowStore, addresses: torch.Tensor, offsets: torch.Tensor,
                    scale: torch.Tensor | None, dim: int, features: int = 1) -> torch.Tensor:
        """Pooled bags. addresses: int64 (n,) one per id; offsets: int64 (b+1,) bag boundaries;
        scale: float32 (n,) per-id factor (weights, 1/len for mean) or None -> float32 (b, dim).
        ``features``: the bags are that many features' blocks of B bags; bag f * B + i goes to row
        i * features + f (the rows are then (B, features * dim), sample-major)."""
        rows = store.gather(addresses, dim).to(torch.float32)  # (n, dim): pooled in float32
        if scale is not None:
            rows = rows * scale[:, None]
        num_bags = offsets.numel() - 1
        bag_of = bag_ids(offsets, addresses.numel())
        out = torch.zeros(num_bags, dim, dtype=torch.float32, device=rows.device)
        out.index_add_(0, bag_of, rows)
        if features == 1:
            return out
        return out.view(features, num_bags // features, dim).transpose(0, 1).reshape(num_bags, dim)

    def id_order(self, ids: torch.Tensor, tables: torch.Tensor, num_tables: int,
                 count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The dedup's order of a batch's ids (int64 (n,), with their tables int64 (n,) of
        ``num_tables``): int64 (n,) batch positions, sorted by ``dedup_hash`` (so table by table);
        within one hash the pairs by their first position in the batch; each pair's ids in batch
        order. Returns (order, ids[order], tables[order]). ``count``: int64 (1,), the batch's ids;
        the rest is padding, which comes last in its own order."""
        n = ids.numel()
        real = n if count is None else int(count)
        all_ids, all_tables = ids, tables
        ids, tables = ids[:real], tables[:real]
        h = dedup_hash(ids, tables, num_tables)
        sh, order = torch.sort(h, stable=True)
        sk, st = ids[order], tables[order]
        shared = bool(((sh[1:] == sh[:-1]) & ((sk[1:] != sk[:-1]) | (st[1:] != st[:-1]))).any())
        if not shared and real == n:  # (the common case)
            return order, sk, st
        if shared:
            # two pairs share a hash: order by (hash, the pair's first position, position)
            by_pair = torch.argsort(tables, stable=True)
            by_pair = by_pair[torch.sort(ids[by_pair], stable=True).indices]
            pk, pt = ids[by_pair], tables[by_pair]
            head = torch.ones(real, dtype=torch.bool, device=ids.device)
            head[1:] = (pk[1:] != pk[:-1]) | (pt[1:] != pt[:-1])
            starts = head.nonzero().squeeze(1)
            first = torch.empty_like(by_pair)  # a stable sort puts a pair's first position first
            first[by_pair] = by_pair[starts[torch.cumsum(head, 0) - 1]]
            order = torch.sort(first, stable=True).indices
            order = order[torch.sort(h[order], stable=True).indices]
        order = torch.cat([order, torch.arange(real, n, device=order.device)])
        return order, all_ids[order], all_tables[order]

    def sorted_runs(self, skeys: torch.Tensor, stables: torch.Tensor,
                    order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The runs of equal (key, table) pairs in a batch's ids ordered with each pair's ids
        adjacent (``id_order``'s result): skeys, stables int64 (n,) the keys and tables in that
        order, order int64 (n,) their batch positions. Returns the distinct keys (u,), their
        tables (u,), inverse int64 (n,) batch position -> run, and each run's length (u,)."""
        head = torch.ones_like(skeys, dtype=torch.bool)
        head[1:] = (skeys[1:] != skeys[:-1]) | (stables[1:] != stables[:-1])
        pair = torch.cumsum(head, 0) - 1
        inverse = torch.empty_like(pair)
        inverse[order] = pair
        starts = head.nonzero().squeeze(1)
        entries = torch.diff(starts, append=torch.full((1,), skeys.numel(), device=skeys.device))
        return skeys[starts], stables[starts], inverse, entries

    def batch_checks(self, values: torch.Tensor, per_feature: torch.Tensor, limits: torch.Tensor | None,
                     table_of_feature: torch.Tensor | None, weights: torch.Tensor | None,
                     count: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device half of a batch's checks. values: int64 (n,) ids, feature-major; per_feature:
        int64 (F, B) lengths; limits: int64 (F,) each feature's num_embeddings or -1 (None: all -1);
        table_of_feature: int64 (F,) or None; weights: float32 (n,) or None. Returns ``summary`` int64
        (2F + 3,): ids per feature, negative lengths per feature, a bad-id flag (out of range, or
        the reserved key), a non-finite-weight flag, the lengths' total minus n (everything after
        the first F entries is zero when the batch passes), and each id's table
        (``table_of_feature`` of its feature; None without it). ``count``: int64 (1,), only the first
        ``count`` ids are the batch's, the rest padding (not checked; their table 0)."""
        if count is not None:  # the reference reads it (Triton's kernels read it on the device)
            real = int(count)
            summary, tables = self.batch_checks(values[:real], per_feature, limits, table_of_feature,
                                                None if weights is None else weights[:real])
            pad = values.numel() - real
            return summary, None if tables is None else torch.cat([tables, tables.new_zeros(pad)])
        counts = per_feature.sum(dim=1)
        feature = run_of(counts, torch.arange(values.numel(), device=values.device))
        nonfinite = (~torch.isfinite(weights).all() if weights is not None
                     else torch.zeros((), dtype=torch.bool, device=values.device))
        summary = torch.cat([counts, (per_feature < 0).sum(dim=1),
                             torch.stack([bad_ids(values, limits, feature).any(), nonfinite]).to(torch.int64),
                             (counts.sum() - values.numel()).view(1)])
        return summary, (table_of_feature[feature] if table_of_feature is not None else None)

    def bag_rows(self, offsets: torch.Tensor, n: int, features: int = 1) -> torch.Tensor:
        """int64 (n,) the output row of each id's bag (offsets int64 (b+1,)): the bag itself, or with
        ``features`` (see ``gather_pool``) bag f * B + i -> row i * features + f."""
        bag = bag_ids(offsets, n)
        if features == 1:
            return bag
        per_feature = (offsets.numel() - 1) // features
        return bag % per_feature * features + bag // per_feature

    def regroup_ids(self, shifts: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                    weights: torch.Tensor | None, inverse: torch.Tensor, pair_values: torch.Tensor,
                    order: torch.Tensor, pair_tables: torch.Tensor, table_first: torch.Tensor,
                    count: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """A batch of several table groups deduped together, laid out group by group and renumbered
        within each group. ``shifts`` int64 (5, F), per batch feature: the end of its ids in the batch
        (the last one the real ids' count; the rest of the n ids are padding, which keeps its place),
        the shift of its ids to the group-by-group layout, the shift to their position among their
        group's ids, its group's first table and first distinct pair. Per id (int64 (n,) each, in the
        batch's order): ``values``, ``tables`` (numbered across the groups), ``weights`` (float32 or
        None), ``inverse`` (its distinct pair); ``pair_values`` (n,) a value per pair; ``order`` the
        sorted ids' positions (``id_order``); ``pair_tables`` the pairs' tables (across the groups,
        the first ``count`` (int64 (1,)) real), ``table_first`` (T,) each table's group's first table.

        Returns, laid out group by group: the ids, their tables and pairs within their group, their
        weights and ``pair_values[inverse]`` (unspecified for the padding); then ``order`` as positions
        within each group's ids and the pairs' tables within their group (past ``count``
        unspecified)."""
        n = values.numel()
        ends, shift, local_shift, table_base, pair_base = shifts
        real = int(ends[-1])
        pos = torch.arange(n, device=values.device)
        feature = torch.searchsorted(ends, pos, right=True).clamp_(max=ends.numel() - 1)
        mine = pos < real

        def per_id(t: torch.Tensor) -> torch.Tensor:  # a per-feature value for each position (0: padding)
            return torch.where(mine, t[feature], 0)

        moved = pos + per_id(shift)

        def put(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.empty_like(t).index_copy_(0, moved, t)

        local_order = order + torch.where(order < real, local_shift[feature[order]], 0)
        u = int(count)
        local_pairs = pair_tables.clone()
        local_pairs[:u] -= table_first[pair_tables[:u]]
        return (put(values), put(tables - per_id(table_base)), put(weights), put(inverse - per_id(pair_base)),
                put(pair_values[inverse]), local_order, local_pairs)

    def sorted_runs_padded(self, skeys: torch.Tensor, stables: torch.Tensor, order: torch.Tensor,
                           count: torch.Tensor | None = None):
        """``sorted_runs`` without reading the number of runs u on the host: keys, tables and lengths
        come padded to n (entries past u unspecified), with u as int64 (1,) on the device.
        ``count``: int64 (1,), the batch's ids (the rest padding, which ``id_order`` puts after them;
        it makes no run and its ``inverse`` is 0)."""
        if count is not None:
            real = int(count)
            keys, runs_tables, inverse, entries, u = self.sorted_runs_padded(skeys[:real], stables[:real],
                                                                             order[:real])
            pad = skeys.numel() - real
            return (*(torch.cat([t, t.new_zeros(pad)]) for t in (keys, runs_tables, inverse, entries)), u)
        keys, runs_tables, inverse, entries = self.sorted_runs(skeys, stables, order)
        pad = skeys.numel() - keys.numel()
        keys, runs_tables, entries = (torch.cat([t, t.new_zeros(pad)]) for t in (keys, runs_tables, entries))
        return keys, runs_tables, inverse, entries, torch.tensor([skeys.numel() - pad], device=skeys.device)

    def reduce_grads(self, grad_src: torch.Tensor, src_of_id: torch.Tensor,
                     scale: torch.Tensor | None, inverse: torch.Tensor, num_unique: int,
                     sorted_ids: object | None = None) -> torch.Tensor:
        """Gradient per unique key: sum over ids i of grad_src[src_of_id[i]] * scale[i], grouped by
        inverse[i]. grad_src: float32 (m, D); src_of_id, inverse: int64 (n,) -> float32 (u, D).
        ``sorted_ids``: the dedup's ``IdOrder`` of these ids, if known (kernels that sort use it)."""
        g = grad_src.index_select(0, src_of_id)
        if scale is not None:
            g = g * scale[:, None]
        out = torch.zeros(num_unique, grad_src.shape[1], dtype=torch.float32, device=g.device)
        return out.index_add_(0, inverse, g)

    def reduce_plan(self, counts: torch.Tensor, count: torch.Tensor) -> None:
        """Kernels that plan their reduction may make the plan ahead of the backward (``IdOrder.plan``)
        from ``counts`` (int64 (n,), ids per key, past ``count`` (int64 (1,), on the device)
        unspecified); the reference needs none."""
        return None

    def reduce_update(self, grad_src: torch.Tensor, src_of_id: torch.Tensor, scale: torch.Tensor | None,
                      inverse: torch.Tensor, num_unique: int, sorted_ids: object | None, store: RowStore,
                      addresses: torch.Tensor, optimizer: EmbeddingOptimizer, step: int,
                      seeds: torch.Tensor | None = None) -> None:
        """The backward's two steps in one call: ``reduce_grads`` then ``optimizer_update`` of the
        rows at ``addresses`` (int64 (u,), one per unique key) with the sums (kernels may fuse them)."""
        grads = self.reduce_grads(grad_src, src_of_id, scale, inverse, num_unique, sorted_ids)
        self.optimizer_update(store, addresses, grads, optimizer, step, seeds)

    def optimizer_update(self, store: RowStore, addresses: torch.Tensor, grads: torch.Tensor,
                         optimizer: EmbeddingOptimizer, step: int, seeds: torch.Tensor | None = None) -> None:
        """Fused update in place of the rows at ``addresses`` (int64 (u,), distinct; < 0 skipped)
        with their summed gradients ``grads`` float32 (u, D). Computed in float32; a 16-bit store's
        rows are rounded stochastically with ``seeds`` (int64 (u,), ``rounding.row_seeds``), or to
        the nearest value without."""
        keep = addresses >= 0
        addresses, grads = addresses[keep], grads[keep]
        rows = optimizer.update(store.gather(addresses).to(torch.float32), grads, step)
        store.scatter(addresses, round_rows(rows, store.dtype, None if seeds is None else seeds[keep]))


def check_same_rows(src: RowStore, dst: RowStore) -> None:
    """``copy_rows``'s stores must hold rows of one width and dtype."""
    if src.width != dst.width:
        raise ValueError(f"copy_rows: rows of width {src.width} into rows of width {dst.width}")
    if src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: rows of {src.dtype} into rows of {dst.dtype}")


def bag_ids(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """int64 (n,) bag of each id, from offsets (b+1,)."""
    return run_ids(offsets[1:], n)


def run_ids(ends: torch.Tensor, n: int) -> torch.Tensor:
    """int64 (n,) the run of each position, for runs ending (exclusive) at ``ends`` (int64 (r,),
    non-decreasing, last == n): ``repeat_interleave(arange(r), lengths)`` in three flat passes (a
    mark where each run ends, a prefix sum), without a data-dependent output size. Ends not checked
    yet (a batch whose lengths are read later) give runs in [0, r) whatever they hold."""
    marks = torch.zeros(n + 1, dtype=torch.int64, device=ends.device)
    marks.index_add_(0, ends.clamp(0, n), torch.ones_like(ends))
    return torch.cumsum(marks[:n], 0).clamp_(max=max(ends.numel() - 1, 0))


def run_of(counts: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 (n,) the run (feature) of each of ``positions`` (0 .. n-1) for runs of ``counts`` (int64
    (F,), not checked yet: the result stays in [0, F) whatever they hold)."""
    ends = torch.cumsum(counts, 0)
    return torch.searchsorted(ends, positions, right=True).clamp_(max=counts.numel() - 1)


def bad_ids(values: torch.Tensor, limits: torch.Tensor | None, feature: torch.Tensor) -> torch.Tensor:
    """bool (n,): ids out of their feature's [0, num_embeddings), or the reserved key. values: int64
    (n,) feature-major; limits: int64 (F,) num_embeddings or -1 (None: all -1); feature: int64 (n,)
    each id's feature."""
    if limits is None:  # raw ids only: the reserved key is the one bad value
        return values == RESERVED_KEY
    limit = limits[feature]
    return torch.where(limit >= 0, (values < 0) | (values >= limit), values == RESERVED_KEY)
