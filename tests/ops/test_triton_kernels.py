"""TritonKernels against TorchKernels (the reference): gather, gather_pool, reduce_grads, fused update.

On CPU the kernels run in the Triton interpreter (sizes stay small: it runs program by program); on a
CUDA machine the same tests run on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tieredemb import optim  # noqa: E402
from tieredemb.ops.reference import TorchKernels  # noqa: E402
from tieredemb.ops.triton import TritonKernels  # noqa: E402
from tieredemb.storage.row_store import RowStore  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DIMS = [1, 3, 16, 33]
SEGMENT_ROWS = 8
RTOL, ATOL = 1e-5, 1e-6


def make_store(gen: torch.Generator, width: int, rows: int) -> tuple[RowStore, torch.Tensor]:
    """A store of ``rows`` allocated rows over several segments, random contents (state >= 0 is
    the caller's business); returns (store, int64 (rows,) addresses)."""
    store = RowStore(width, SEGMENT_ROWS, torch.device(DEVICE))
    addresses = store.allocate(rows)
    for seg in store.segments:
        seg.copy_(torch.randn(seg.shape, generator=gen))
    return store, addresses


def clone_store(store: RowStore) -> RowStore:
    twin = RowStore(store.width, store.segment_rows, store.device)
    twin.allocate(store.rows_allocated())
    for dst, src in zip(twin.segments, store.segments):
        dst.copy_(src)
    return twin


def pick(gen: torch.Generator, addresses: torch.Tensor, n: int, misses: bool = True) -> torch.Tensor:
    """int64 (n,) addresses drawn with repeats from ``addresses``, some -1 when ``misses``."""
    out = addresses.cpu()[torch.randint(0, addresses.numel(), (n,), generator=gen)]
    if misses:
        out[torch.rand(n, generator=gen) < 0.2] = -1
    return out.to(DEVICE)


def random_offsets(gen: torch.Generator, num_bags: int, max_bag: int) -> torch.Tensor:
    lengths = torch.randint(0, max_bag + 1, (num_bags,), generator=gen)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(DEVICE)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("programs", [None, 1, 2])  # fewer programs than blocks: each loops
def test_gather(gen, dim, programs):
    store, addresses = make_store(gen, dim + 2, 30)  # 2 state columns that must not be read
    addr = pick(gen, addresses, 40)
    got = TritonKernels().gather(store, addr, dim, programs)
    assert torch.equal(got, TorchKernels().gather(store, addr, dim))


@pytest.mark.parametrize("width", [1, 5, 33])
@pytest.mark.parametrize("programs", [None, 1])
@pytest.mark.parametrize("given", ["all", "some"])  # some: the rows' first columns, the rest zero
def test_scatter(gen, width, programs, given):
    store, addresses = make_store(gen, width, 30)
    twin = clone_store(store)
    addr = addresses[torch.randperm(30, generator=gen)[:17].to(DEVICE)]
    cols = width if given == "all" else (width + 1) // 2
    rows = torch.randn(17, cols, generator=gen).to(DEVICE)
    TritonKernels().scatter(store, addr, rows, programs)
    TorchKernels().scatter(twin, addr, rows)
    for got, want in zip(store.segments, twin.segments):
        assert torch.equal(got, want)
    full = torch.zeros(17, width, device=DEVICE)
    full[:, :cols] = rows
    assert torch.equal(store.gather(addr), full)


def rows_by_address(store: RowStore) -> torch.Tensor:
    """Every allocated row of ``store`` in address order (its segments end to end)."""
    return torch.cat(store.segments).cpu()[: store.rows_allocated()]


@pytest.mark.parametrize("width", [1, 5, 33])
@pytest.mark.parametrize("programs", [None, 1])
def test_scatter_from_source_rows(gen, width, programs):
    """``source``: row i of the write is ``rows[source[i]]`` (rows longer than the write, some taken
    twice); an address -1 writes nothing."""
    store, addresses = make_store(gen, width, 30)
    before = rows_by_address(store)
    addr = addresses[torch.randperm(30, generator=gen)[:17].to(DEVICE)]
    addr[::4] = -1
    rows = torch.randn(25, width, generator=gen)
    source = torch.randint(0, 25, (17,), generator=gen)
    TritonKernels().scatter(store, addr, rows.to(DEVICE), programs, source=source.to(DEVICE))
    want = before.clone()
    for a, src in zip(addr.tolist(), source.tolist()):
        if a >= 0:
            want[a] = rows[src]
    assert torch.equal(rows_by_address(store), want)
    twin = RowStore(width, SEGMENT_ROWS, torch.device(DEVICE))
    twin.allocate(30)
    for dst, seg in zip(twin.segments, before.split(SEGMENT_ROWS)):
        dst[: seg.shape[0]].copy_(seg)
    TorchKernels().scatter(twin, addr, rows.to(DEVICE), source=source.to(DEVICE))
    assert torch.equal(rows_by_address(twin), want)


@pytest.mark.parametrize("kernels", [TritonKernels, TorchKernels])
@pytest.mark.parametrize("programs", [None, 1])
def test_copy_rows_between_stores(gen, kernels, programs):
    """Rows of one store into rows of another (other segment sizes), where both addresses are >= 0;
    a repeated source row lands in each of its destinations; other rows stay."""
    src, src_rows = make_store(gen, 6, 30)
    dst = RowStore(6, 5, torch.device(DEVICE))
    dst.allocate(40)
    for seg in dst.segments:
        seg.copy_(torch.randn(seg.shape, generator=gen))
    before = rows_by_address(dst)
    src_addr = pick(gen, src_rows, 20)  # repeats and -1s
    dst_addr = torch.randperm(40, generator=gen)[:20]
    dst_addr[1::5] = -1
    kernels().copy_rows(src, src_addr, dst, dst_addr.to(DEVICE), programs)
    want, source = before.clone(), rows_by_address(src)
    for a, b in zip(src_addr.tolist(), dst_addr.tolist()):
        if a >= 0 and b >= 0:
            want[b] = source[a]
    assert torch.equal(rows_by_address(dst), want)
    with pytest.raises(ValueError, match="width 6 into rows of width 5"):
        kernels().copy_rows(src, src_addr, RowStore(5, 8, torch.device(DEVICE)), dst_addr.to(DEVICE))


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("scaled", [False, True])
def test_gather_pool(gen, dim, scaled):
    store, addresses = make_store(gen, dim + 1, 30)
    offsets = random_offsets(gen, 12, 5)
    n = int(offsets[-1])
    addr = pick(gen, addresses, n)
    scale = torch.rand(n, generator=gen).to(DEVICE) if scaled else None
    got = TritonKernels().gather_pool(store, addr, offsets, scale, dim)
    want = TorchKernels().gather_pool(store, addr, offsets, scale, dim)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    # 3 features of 4 bags, sample-major: bag f * 4 + i at row i * 3 + f
    got = TritonKernels().gather_pool(store, addr, offsets, scale, dim, features=3)
    torch.testing.assert_close(got.view(4, 3, dim).transpose(0, 1).reshape(12, dim), want,
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(TorchKernels().gather_pool(store, addr, offsets, scale, dim, features=3), got,
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dim", [64, 128, 300])
def test_gather_pool_of_bags_over_several_chunks(gen, dim):
    """Wide rows take fewer of a bag's ids a loop iteration (8 at D=64, 4 at D=128, 1 at D=300):
    bags of up to 20 ids pool over several iterations."""
    store, addresses = make_store(gen, dim, 40)
    offsets = random_offsets(gen, 10, 20)
    n = int(offsets[-1])
    addr = pick(gen, addresses, n)
    scale = torch.rand(n, generator=gen).to(DEVICE)
    got = TritonKernels().gather_pool(store, addr, offsets, scale, dim)
    torch.testing.assert_close(got, TorchKernels().gather_pool(store, addr, offsets, scale, dim),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("scaled", [False, True])
def test_reduce_grads(gen, dim, scaled):
    m, n, u = 10, 50, 9  # unique key 8 gets no id: its gradient is zero
    grad_src = torch.randn(m, dim, generator=gen).to(DEVICE)
    src_of_id = torch.randint(0, m, (n,), generator=gen).to(DEVICE)
    inverse = torch.randint(0, u - 1, (n,), generator=gen).to(DEVICE)
    scale = torch.rand(n, generator=gen).to(DEVICE) if scaled else None
    got = TritonKernels().reduce_grads(grad_src, src_of_id, scale, inverse, u)
    want = TorchKernels().reduce_grads(grad_src, src_of_id, scale, inverse, u)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("scaled", [False, True])
def test_reduce_grads_of_a_hot_key_in_several_pieces(gen, scaled):
    """Key 0 gets 3 pieces' worth of ids (summed per piece, then the pieces in order), key 1 exactly
    one piece, key 3 none; the ids come shuffled."""
    from tieredemb.ops.triton.embedding import _PIECE

    dim, u = 8, 4
    inverse = torch.cat([torch.zeros(2 * _PIECE + 37, dtype=torch.int64),
                         torch.ones(_PIECE, dtype=torch.int64), torch.full((5,), 2)])
    inverse = inverse[torch.randperm(inverse.numel(), generator=gen)].to(DEVICE)
    n = inverse.numel()
    grad_src = torch.randn(n, dim, generator=gen).to(DEVICE)
    src_of_id = torch.randperm(n, generator=gen).to(DEVICE)
    scale = torch.rand(n, generator=gen).to(DEVICE) if scaled else None
    got = TritonKernels().reduce_grads(grad_src, src_of_id, scale, inverse, u)
    g = grad_src.double()[src_of_id] * (1.0 if scale is None else scale.double()[:, None])
    want = torch.zeros(u, dim, dtype=torch.float64, device=DEVICE).index_add_(0, inverse, g)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3], torch.zeros(dim, device=DEVICE))


@pytest.mark.parametrize("max_programs", [None, 2])
def test_reduce_update_over_many_blocks_of_keys(gen, max_programs, monkeypatch):
    """Keys over several blocks of the plan's two passes (blocks of 64 here; with ``max_programs`` 2,
    programs that take several blocks each, as past 1M keys), hot keys over several pieces among them,
    keys without ids: the fused reduce + update equals the reference's reduce_grads + update."""
    from tieredemb.ops.triton import embedding

    monkeypatch.setattr(embedding, "_RUN_BLOCK", 64)
    if max_programs is not None:
        monkeypatch.setattr(embedding, "_MAX_RUN_PROGRAMS", max_programs)
    dim, u = 4, 300
    opt = make_optimizer("sgd")
    store, addresses = make_store(gen, dim, u)
    twin = clone_store(store)
    hot = torch.randint(0, u, (3,), generator=gen).repeat_interleave(embedding._PIECE + 40)
    inverse = torch.cat([torch.randint(0, u, (400,), generator=gen), hot])
    inverse = inverse[torch.randperm(inverse.numel(), generator=gen)].to(DEVICE)
    n = inverse.numel()
    grad_src = torch.randn(n, dim, generator=gen).to(DEVICE)
    src_of_id = torch.randperm(n, generator=gen).to(DEVICE)
    TritonKernels().reduce_update(grad_src, src_of_id, None, inverse, u, None, store, addresses, opt, 1)
    TorchKernels().reduce_update(grad_src, src_of_id, None, inverse, u, None, twin, addresses, opt, 1)
    for got, want in zip(store.segments, twin.segments):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # hot keys: sums in two orders


@pytest.mark.parametrize("features", [1, 3])
def test_bag_rows(gen, features):
    """Each id's output row: its bag, or sample-major (bag f * B + i -> row i * F + f); bags of up to
    40 ids (several chunks of a program), empty bags included."""
    offsets = random_offsets(gen, 12, 40)
    n = int(offsets[-1])
    lengths = torch.diff(offsets.cpu())
    bags = torch.arange(12)
    rows = bags % (12 // features) * features + bags // (12 // features)
    want = torch.repeat_interleave(rows, lengths)
    assert torch.equal(TritonKernels().bag_rows(offsets, n, features).cpu(), want)
    assert torch.equal(TorchKernels().bag_rows(offsets.cpu(), n, features), want)


@pytest.mark.parametrize("padding", [0, 37])
@pytest.mark.parametrize("weighted", [False, True])
def test_regroup_ids_lays_the_ids_out_group_by_group(gen, weighted, padding):
    """``regroup_ids`` against the layout built in plain Python: 9 features of 0-300 ids each (some
    empty, some of one id) in 3 groups, each group taking its features in a shuffled order; ids,
    tables, weights, pairs and pair values moved to their group-by-group place, tables and pairs
    counted from their group's first, sorted positions made positions within their group (the
    order crossing the features: a random permutation), the pairs' tables made their group's; the
    padding past the real ids keeps its place."""
    counts = torch.randint(0, 300, (9,), generator=gen)
    counts[2], counts[5] = 0, 1
    group = [0, 1, 2, 1, 0, 2, 2, 0, 1]
    positions = [[f for f in torch.randperm(9, generator=gen).tolist() if group[f] == g] for g in range(3)]
    first_table, first_pair = [0, 4, 6], [0, 30, 70]
    starts = [0] + counts.cumsum(0).tolist()
    real = starts[-1]
    n = real + padding
    layout = [p for g in range(3) for f in positions[g] for p in range(starts[f], starts[f + 1])]
    moved = {p: i for i, p in enumerate(layout)}  # batch position -> group-by-group position
    group_start = {g: sum(int(counts[f]) for h in range(g) for f in positions[h]) for g in range(3)}
    feature_of = [f for f in range(9) for _ in range(int(counts[f]))]
    shifts = torch.tensor([
        starts[1:],
        [moved[starts[f]] - starts[f] if counts[f] else 0 for f in range(9)],
        [moved[starts[f]] - group_start[group[f]] - starts[f] if counts[f] else 0 for f in range(9)],
        [first_table[group[f]] for f in range(9)],
        [first_pair[group[f]] for f in range(9)]])
    values = torch.randint(-2**62, 2**62, (n,), generator=gen)
    tables = torch.randint(0, 9, (n,), generator=gen)
    weights = torch.rand(n, generator=gen) if weighted else None
    inverse = torch.randint(0, n, (n,), generator=gen)
    pair_values = torch.randint(0, 10**6, (n,), generator=gen)
    order = torch.cat([torch.randperm(real, generator=gen), torch.arange(real, n)])
    count = n // 2
    pair_tables = torch.randint(0, 9, (n,), generator=gen)
    table_first = torch.tensor([0, 0, 0, 0, 4, 4, 6, 6, 6])
    want = [values.clone(), tables.clone(), None if weights is None else weights.clone(), inverse.clone(),
            pair_values[inverse], order.clone(), pair_tables.clone()]
    for p in range(real):
        g = group[feature_of[p]]
        for out, t, base in ((want[0], values, 0), (want[1], tables, first_table[g]),
                             (want[3], inverse, first_pair[g])):
            out[moved[p]] = t[p] - base
        if weights is not None:
            want[2][moved[p]] = weights[p]
        want[4][moved[p]] = pair_values[inverse[p]]
        q = int(order[p])
        want[5][p] = moved[q] - group_start[group[feature_of[q]]]
    want[6][:count] -= table_first[pair_tables[:count]]
    args = (shifts, values, tables, weights, inverse, pair_values, order, pair_tables, table_first,
            torch.tensor([count]))
    for kern, dev in ((TorchKernels(), "cpu"), (TritonKernels(), DEVICE)):
        got = kern.regroup_ids(*(a if a is None else a.to(dev) for a in args))
        for i, (g, w) in enumerate(zip(got, want)):
            if w is None:
                assert g is None
                continue
            cut = {4: real, 6: count}.get(i, n)  # unspecified: padding pair values, tables past the pairs
            assert torch.equal(g[:cut].cpu(), w[:cut]), f"{type(kern).__name__}: output {i}"


def test_sorted_runs_of_no_ids():
    """No ids: no runs, and the device count says 0 (a caller reads it with other values)."""
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    for kern in (TritonKernels(), TorchKernels()):
        *padded, u = kern.sorted_runs_padded(empty, empty, empty)
        assert all(t.numel() == 0 for t in kern.id_order(empty, empty, 1))
        assert u.tolist() == [0] and all(t.numel() == 0 for t in padded)


@pytest.mark.parametrize("n, max_programs", [(1, None), (2500, None), (5000, 2), (7300, 4)])
def test_sorted_runs(gen, n, max_programs, monkeypatch):
    """Runs of equal (key, table) pairs in ids sorted by key, across program blocks: equal to the torch
    reference, and to torch.unique over the pairs (the same key in two tables is two pairs).
    ``max_programs``: fewer programs than blocks (each takes several, as past 1M ids)."""
    if max_programs is not None:
        from tieredemb.ops.triton import embedding

        monkeypatch.setattr(embedding, "_MAX_RUN_PROGRAMS", max_programs)
    tables = torch.randint(0, 3, (n,), generator=gen)
    ids = torch.randint(-30, 30, (n,), generator=gen)
    ids[: n // 2] = torch.randint(-2**62, 2**62, (n // 2,), generator=gen)  # a spread of raw ids too
    by_table = torch.argsort(tables, stable=True)  # equal keys must come table-sorted
    order = by_table[torch.sort(ids[by_table], stable=True).indices]
    skeys, stables = ids[order], tables[order]
    got = TritonKernels().sorted_runs(skeys.to(DEVICE), stables.to(DEVICE), order.to(DEVICE))
    want = TorchKernels().sorted_runs(skeys, stables, order)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
    pairs, inverse, counts = torch.unique(torch.stack([ids, tables], 1), dim=0, return_inverse=True,
                                          return_counts=True)
    keys, utab, ginv, entries = (t.cpu() for t in got)
    assert keys.numel() == pairs.shape[0]
    assert torch.equal(torch.stack([keys[ginv], utab[ginv]], 1), torch.stack([ids, tables], 1))
    assert torch.equal(torch.sort(entries).values, torch.sort(counts).values)
    assert torch.equal(entries[ginv], counts[inverse])
    for kern in (TritonKernels(), TorchKernels()):  # padded to n, the count on the device
        *padded, u = kern.sorted_runs_padded(skeys.to(DEVICE), stables.to(DEVICE), order.to(DEVICE))
        assert u.tolist() == [keys.numel()]
        assert all(t.numel() == n for t in padded)
        for a, b in zip(padded, (keys, utab, ginv, entries)):
            assert torch.equal(a[: b.numel()].cpu(), b)


@pytest.mark.parametrize("grouped", [True, False])
def test_reduce_grads_with_the_dedups_order(gen, grouped):
    """The order unique_pairs sorted the ids in (what prefetch hands to the backward) gives the sums
    a fresh sort would; ids of 3 tables, grouped by table or not."""
    from tieredemb.storage.tiers.parts import unique_pairs

    n, dim = 600, 8
    tables = torch.randint(0, 3, (n,), generator=gen)
    if grouped:
        tables = torch.sort(tables).values
    ids = torch.randint(0, 40, (n,), generator=gen)
    keys, _, inverse, _, sorted_ids = unique_pairs(ids.to(DEVICE), tables.to(DEVICE), 3, TritonKernels())
    grad_src = torch.randn(n, dim, generator=gen).to(DEVICE)
    src_of_id = torch.arange(n, device=DEVICE)
    got = TritonKernels().reduce_grads(grad_src, src_of_id, None, inverse, keys.numel(), sorted_ids)
    fresh = TritonKernels().reduce_grads(grad_src, src_of_id, None, inverse, keys.numel())
    assert torch.equal(got, fresh)
    want = TorchKernels().reduce_grads(grad_src, src_of_id, None, inverse, keys.numel())
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kernels", [TorchKernels(), TritonKernels()], ids=["torch", "triton"])
def test_unique_pairs_of_keys_shared_across_tables(kernels):
    """One key in several tables, keys that differ only in their top bits, negative and extreme keys:
    each (table, key) pair comes out once, its ids together in position order, with the pairs and
    counts of a plain per-pair count."""
    from tieredemb.storage.tiers.parts import unique_pairs

    def i64(x: int) -> int:
        return (x + 2**63) % 2**64 - 2**63

    big = 2**63 - 1
    per_table = [[5, i64(5 ^ 1 << 62), 7, 5, -1, big],  # 5 and 5 ^ 1 << 62: only the top bits differ
                 [5, 7, 5, i64(-1 ^ 3 << 62), 5],
                 [i64(5 ^ 3 << 62), 5, big, -1, 5]]
    ids = torch.tensor([k for keys in per_table for k in keys], dtype=torch.int64)
    tables = torch.tensor([t for t, keys in enumerate(per_table) for _ in keys])
    keys, utab, inverse, counts, sorted_ids = unique_pairs(ids.to(DEVICE), tables.to(DEVICE), 3, kernels)
    pairs = list(zip(utab.tolist(), keys.tolist()))
    assert len(set(pairs)) == len(pairs)
    want = {}
    for pair in zip(tables.tolist(), ids.tolist()):
        want[pair] = want.get(pair, 0) + 1
    assert dict(zip(pairs, counts.tolist())) == want
    assert [pairs[i] for i in inverse.tolist()] == list(zip(tables.tolist(), ids.tolist()))
    # the order: each pair's ids adjacent, in position order
    order = sorted_ids.order.tolist()
    runs = [pairs[inverse[i]] for i in order]
    assert [p for i, p in enumerate(runs) if i == 0 or p != runs[i - 1]] == pairs
    for pair in pairs:
        at = [i for i in order if pairs[inverse[i]] == pair]
        assert at == sorted(at)


@pytest.mark.parametrize("bits, n, pad, num_tables", [
    (32, 900, 0, 3), (32, 900, 50, 1), (9, 1500, 0, 3), (4, 700, 20, 3), (1, 400, 0, 3),
    (12, 200_000 if DEVICE == "cuda" else 1500, 0, 5)])
@pytest.mark.slow
def test_id_order_groups_the_pairs_that_share_a_hash(gen, monkeypatch, bits, n, pad, num_tables):
    """The dedup's order, from its definition in plain Python: by the pair's sort key (table by
    table), then the pair's first position, then position; padding (past ``count``) last in its own
    order. Fewer bits make distinct pairs share a key (interleaved in the radix sort; hundreds in
    one key at 1 bit); Triton equal to the reference, across program blocks."""
    from tieredemb.ops import reference
    from tieredemb.ops.triton import embedding as E

    monkeypatch.setattr(reference, "DEDUP_HASH_BITS", bits)
    monkeypatch.setattr(E, "_RUN_BLOCK", 128 if n < 10_000 else 1024)
    tables = torch.randint(0, num_tables, (n + pad,), generator=gen)
    ids = torch.randint(0, max(8, n // 5), (n + pad,), generator=gen)
    ids[::3] = torch.randint(-2**63, 2**63 - 1, (len(ids[::3]),), generator=gen)  # raw 64-bit ids too
    h = reference.dedup_hash(ids[:n], tables[:n], num_tables).tolist()
    first = {}
    for i, pair in enumerate(zip(ids[:n].tolist(), tables[:n].tolist())):
        first.setdefault(pair, i)
    pairs = list(zip(ids.tolist(), tables.tolist()))
    want = sorted(range(n), key=lambda i: (h[i], first[pairs[i]], i)) + list(range(n, n + pad))
    assert tables[want[:n]].diff().min() >= 0  # table by table
    if bits == 32:  # and each table's keys in the order of the index's buckets
        from tieredemb.index.key_index import bucket_of

        t, b = tables[want[:n]], bucket_of(ids[want[:n]], 1024)
        assert ((t.diff() > 0) | (b.diff() >= 0)).all()
    if bits < 32:
        assert len(set(h)) < len(first)  # pairs do share keys
    count = None if pad == 0 else torch.tensor([n], device=DEVICE)
    for kern in (TritonKernels(), TorchKernels()):
        order, skeys, stables = kern.id_order(ids.to(DEVICE), tables.to(DEVICE), num_tables, count)
        assert order.tolist() == want, kern.name
        assert torch.equal(skeys.cpu(), ids[want]) and torch.equal(stables.cpu(), tables[want]), kern.name


@pytest.mark.parametrize("num_tables", [1, 1000, 2**17])
def test_dedup_hash_of_the_kernel_and_the_reference(num_tables):
    """The Triton hash kernel and ``dedup_hash`` give the same int32 for every pair, below the
    padding's; in table order up to 2**16 tables (past that the table is only hashed), and within
    a table in the order of the index's buckets."""
    from tieredemb.ops import reference
    from tieredemb.ops.triton import embedding as E

    gen = torch.Generator().manual_seed(3)
    ids = torch.cat([torch.randint(-2**63, 2**63 - 1, (500,), generator=gen),
                     torch.tensor([0, -1, 2**63 - 1, -2**63])])
    tables = torch.randint(0, num_tables, (ids.numel(),), generator=gen)
    tables[-4:] = num_tables - 1
    out = torch.empty(ids.numel(), dtype=torch.int32, device=DEVICE)
    table_bits, hash_bits = reference.dedup_key_bits(num_tables)
    assert table_bits + hash_bits == 32 and table_bits == (10 if num_tables == 1000 else 0)
    E._dedup_hash_kernel[(triton_cdiv(ids.numel(), 128),)](
        ids.to(DEVICE), tables.to(DEVICE), out, ids.numel(), out, TABLE_BITS=table_bits, HASH_BITS=hash_bits,
        PAD=reference.DEDUP_PAD_HASH, N_PTR=False, BLOCK=128)
    want = reference.dedup_hash(ids, tables, num_tables)
    assert torch.equal(out.cpu(), want)
    assert int(want.max()) < reference.DEDUP_PAD_HASH and len(set(want.tolist())) > 490
    if table_bits:  # table by table, each table's keys in the index's bucket order
        from tieredemb.index.key_index import bucket_of

        order = torch.argsort(want, stable=True)
        t, b = tables[order], bucket_of(ids[order], 1024)
        assert t.diff().min() >= 0
        assert ((t.diff() > 0) | (b.diff() >= 0)).all()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_optimizer(kind: str) -> optim.EmbeddingOptimizer:
    return {
        "sgd": lambda: optim.SGD(lr=0.1),
        "adagrad": lambda: optim.Adagrad(lr=0.1),
        "rowwise_adagrad": lambda: optim.RowWiseAdagrad(lr=0.1),
        "adam": lambda: optim.Adam(lr=0.01),
    }[kind]()


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("dim", DIMS)
def test_optimizer_update(gen, kind, dim):
    opt = make_optimizer(kind)
    store, addresses = make_store(gen, dim + opt.state_width(dim), 30)
    for seg in store.segments:  # accumulators (Adagrad s, Adam v) start >= 0
        seg[:, dim:].abs_()
    twin = clone_store(store)
    for step in range(1, 4):
        if step == 3:
            opt.lr *= 0.5  # a schedule may change lr between steps
        perm = torch.randperm(addresses.numel(), generator=gen)[:20]
        addr = addresses.cpu()[perm]  # distinct
        addr[torch.rand(20, generator=gen) < 0.2] = -1
        addr = addr.to(DEVICE)
        grads = torch.randn(20, dim, generator=gen).to(DEVICE)
        TritonKernels().optimizer_update(store, addr, grads, opt, step)
        TorchKernels().optimizer_update(twin, addr, grads, opt, step)
        for got, want in zip(store.segments, twin.segments):
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_empty_inputs(gen):
    store, addresses = make_store(gen, 4, 10)
    kern, ref = TritonKernels(), TorchKernels()
    none = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert kern.gather(store, none, 3).shape == (0, 3)
    # bags that are all empty, and no bags at all
    for offsets in (torch.zeros(4, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)):
        offsets = offsets.to(DEVICE)
        got = kern.gather_pool(store, none, offsets, None, 3)
        assert torch.equal(got, ref.gather_pool(store, none, offsets, None, 3))
    # no ids: unique keys (if any) get zero gradients
    grad_src = torch.randn(2, 3, generator=gen).to(DEVICE)
    for u in (0, 3):
        got = kern.reduce_grads(grad_src, none, None, none, u)
        assert torch.equal(got, ref.reduce_grads(grad_src, none, None, none, u))
    before = [s.clone() for s in store.segments]
    kern.optimizer_update(store, none, torch.empty(0, 2, device=DEVICE), optim.Adam(), 1)
    # every address a miss: nothing is written
    misses = torch.full((5,), -1, dtype=torch.int64, device=DEVICE)
    kern.optimizer_update(store, misses, torch.ones(5, 2, device=DEVICE), optim.Adagrad(), 1)
    assert all(torch.equal(a, b) for a, b in zip(before, store.segments))
    assert torch.equal(kern.gather(store, misses, 3), torch.zeros(5, 3, device=DEVICE))


def test_new_segment_seen(gen):
    """The pointer table follows growth: rows in a segment added after a first call are read."""
    store, addresses = make_store(gen, 3, 8)
    kern = TritonKernels()
    kern.gather(store, addresses, 3)
    more = store.allocate(8)
    store.segments[-1].copy_(torch.randn(8, 3, generator=gen))
    addr = torch.cat([addresses, more])
    assert torch.equal(kern.gather(store, addr, 3), TorchKernels().gather(store, addr, 3))


def test_hashes_equal_the_torch_ones(gen):
    """random_bits (initial rows) and the index's buckets: the same bits as the torch versions, on
    the int64 extremes too; several tables, and one."""
    from tieredemb.index.key_index import KeyIndex, Region
    from tieredemb.init import Uniform, _table_bases, random_bits
    from tieredemb.ops.triton import hashing
    from tieredemb.ops.triton.index import TritonKeyIndex

    keys = torch.cat([torch.tensor([0, -1, 2**63 - 1, -(2**63), 12345]),
                      torch.randint(-(2**62), 2**62, (60,), generator=gen)])
    tables = torch.randint(0, 3, (keys.numel(),), generator=gen)
    names = ["a", "b", "c"]
    for t, dim in ((tables, 5), (None, 130)):
        want = random_bits(7, names if t is not None else "a", keys, dim, stream=1, tables=t)
        bases = _table_bases(7, tuple(names) if t is not None else ("a",), 1, torch.device(DEVICE))
        got = hashing.random_bits(bases, keys.to(DEVICE), dim, None if t is None else t.to(DEVICE))
        assert torch.equal(got.cpu(), want)
        # Uniform's rows from those bits, in one kernel: the torch formula's bits exactly
        for low, high in ((-0.01, 0.01), (0.3, 7.9)):
            bases = _table_bases(7, tuple(names) if t is not None else ("a",), 0, torch.device(DEVICE))
            want = Uniform(low, high).rows(7, names if t is not None else "a", keys, dim, tables=t)
            got = hashing.uniform_rows(bases, keys.to(DEVICE), dim, None if t is None else t.to(DEVICE),
                                       low, high)
            assert torch.equal(got.cpu(), want)
    regions = [Region("lru", None, 64), Region("lfu", 40), Region("lru", None, 1024)]
    for kw in ({"regions": regions}, {"initial_slots": 4096}):
        ref, tri = KeyIndex(4, device=DEVICE, **kw), TritonKeyIndex(4, device=DEVICE, **kw)
        t = tables.to(DEVICE) if "regions" in kw else None
        assert torch.equal(tri._bucket(keys.to(DEVICE), t), ref._bucket(keys.to(DEVICE), t))


def _batch(gen, nf: int, b: int, limit: int | None):
    lengths = torch.randint(0, 40, (nf, b), generator=gen)
    lengths[0] = 0  # an empty feature
    n = int(lengths.sum())
    values = torch.randint(0, limit or 1 << 40, (n,), generator=gen)
    limits = None if limit is None else torch.full((nf,), limit)
    if limits is not None:
        limits[1] = -1  # a raw-id feature among bounded ones
    return lengths, values, limits


@pytest.mark.parametrize("limited", [False, True])
@pytest.mark.parametrize("fault", ["none", "bad id", "reserved key", "negative length", "short",
                                   "nan weight"])
def test_batch_checks(gen, monkeypatch, limited, fault):
    """The fused checks give the reference's summary (ids and negative lengths per feature, flags,
    the total's offset) and tables, on batches that pass and batches with each fault; the blocks of
    ids straddle features (lengths up to 39 over 1024-id programs), a feature's lengths span several
    programs."""
    from tieredemb.config import RESERVED_KEY
    from tieredemb.ops.triton import checks

    monkeypatch.setattr(checks, "_LENGTHS_BLOCK", 16)
    nf, b = 5, 70
    lengths, values, limits = _batch(gen, nf, b, 100 if limited else None)
    weights = torch.rand(values.numel(), generator=gen)
    at = values.numel() * 2 // 3  # in a later feature
    if fault == "bad id":
        values[at] = 100 if limited else RESERVED_KEY
    elif fault == "reserved key":
        values[at] = RESERVED_KEY
    elif fault == "negative length":
        lengths[3, 5] = -2
    elif fault == "short":
        values = values[:-3]
        weights = weights[:-3]
    elif fault == "nan weight":
        weights[at] = float("nan")
    table_of_feature = torch.tensor([0, 1, 1, 2, 0])
    args = [t.to(DEVICE) if t is not None else None
            for t in (values, lengths, limits, table_of_feature, weights)]
    got_summary, got_tables = TritonKernels().batch_checks(*args)
    want_summary, want_tables = TorchKernels().batch_checks(*args)
    assert got_summary.tolist() == want_summary.tolist()
    assert torch.equal(got_tables, want_tables)
    assert (want_summary[nf:] == 0).all().item() == (fault == "none")
    got_summary, got_tables = TritonKernels().batch_checks(*args[:3], None, None)  # no tables, weights
    assert got_tables is None
    assert got_summary.tolist()[: 2 * nf + 1] == want_summary.tolist()[: 2 * nf + 1]


def test_batch_checks_of_no_ids(gen):
    lengths = torch.zeros(3, 4, dtype=torch.int64, device=DEVICE)
    values = torch.empty(0, dtype=torch.int64, device=DEVICE)
    got, tables = TritonKernels().batch_checks(values, lengths, None, torch.arange(3, device=DEVICE), None)
    assert got.tolist() == TorchKernels().batch_checks(values, lengths, None, None, None)[0].tolist()
    assert got.tolist() == [0] * 9 and tables.numel() == 0


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("scaled", [False, True])
def test_reduce_update_is_reduce_then_update(gen, kind, scaled):
    """The fused backward (sums straight into the rows' update, in the reduction's kernels) against
    the reference's reduce_grads + optimizer_update; a hot key over several pieces (updated by the
    second pass), a key without ids (a zero-gradient update), a key without a row (address -1)."""
    from tieredemb.ops.triton.embedding import _PIECE

    dim, u = 8, 6
    opt = make_optimizer(kind)
    store, addresses = make_store(gen, dim + opt.state_width(dim), 12)
    for seg in store.segments:  # accumulators (Adagrad s, Adam v) start >= 0
        seg[:, dim:].abs_()
    twin = clone_store(store)
    addr = addresses.cpu()[torch.randperm(12, generator=gen)[:u]]
    addr[4] = -1
    addr = addr.to(DEVICE)
    inverse = torch.cat([torch.zeros(2 * _PIECE + 9, dtype=torch.int64),
                         torch.randint(1, u - 1, (40,), generator=gen)])
    inverse = inverse[inverse != 3]  # keys 3 and 5: no ids
    inverse = inverse[torch.randperm(inverse.numel(), generator=gen)].to(DEVICE)
    n = inverse.numel()
    grad_src = torch.randn(n // 2, dim, generator=gen).to(DEVICE)
    src_of_id = torch.randint(0, n // 2, (n,), generator=gen).to(DEVICE)
    scale = torch.rand(n, generator=gen).to(DEVICE) if scaled else None
    for step in (1, 2):
        TritonKernels().reduce_update(grad_src, src_of_id, scale, inverse, u, None, store, addr, opt, step)
        TorchKernels().reduce_update(grad_src, src_of_id, scale, inverse, u, None, twin, addr, opt, step)
    # the hot key sums 521 gradients (|sum| ~ 20): float32 sums of them in two orders (pieces here,
    # the reference's atomic index_add_ on CUDA, in no fixed order) differ by up to ~3e-5, which
    # Adam's m carries; 1e-5 failed on CUDA at times (2026-11-21). A lost piece moves a sum by ~16.
    for got, want in zip(store.segments, twin.segments):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("scaled", [False, True])
def test_reduction_reads_presorted_sources_as_it_reads_them_through_the_order(gen, scaled):
    """An ``IdOrder`` carrying each id's gradient source and scale in its own order (what the staged
    prefetch makes) gives the same bits as the reduction going through ``order`` for them: the same
    ids summed in the same order; sums and the fused update both."""
    from tieredemb.ops.triton.embedding import _PIECE
    from tieredemb.storage.tiers.parts import IdOrder

    dim, u = 8, 7
    inverse = torch.cat([torch.zeros(_PIECE + 5, dtype=torch.int64),  # a key over two pieces
                         torch.randint(1, u, (60,), generator=gen)])
    inverse = inverse[torch.randperm(inverse.numel(), generator=gen)].to(DEVICE)
    n = inverse.numel()
    order = torch.argsort(inverse, stable=True)
    entries = torch.bincount(inverse, minlength=u)
    grad_src = torch.randn(n // 3, dim, generator=gen).to(DEVICE)
    src_of_id = torch.randint(0, n // 3, (n,), generator=gen).to(DEVICE)
    scale = torch.rand(n, generator=gen).to(DEVICE) if scaled else None
    plain = IdOrder(order, entries)
    presorted = IdOrder(order, entries, src_of_id[order], None if scale is None else scale[order])
    tk = TritonKernels()
    want = tk.reduce_grads(grad_src, src_of_id, scale, inverse, u, plain)
    got = tk.reduce_grads(grad_src, src_of_id, scale, inverse, u, presorted)
    assert torch.equal(got, want)
    torch.testing.assert_close(want, TorchKernels().reduce_grads(grad_src, src_of_id, scale, inverse, u),
                               rtol=1e-5, atol=1e-5)
    opt = make_optimizer("adam")
    store, addresses = make_store(gen, dim + opt.state_width(dim), 12)
    for seg in store.segments:  # Adam's v starts >= 0
        seg[:, dim:].abs_()
    twin = clone_store(store)
    addr = addresses[:u].contiguous()
    tk.reduce_update(grad_src, src_of_id, scale, inverse, u, plain, store, addr, opt, 1)
    tk.reduce_update(grad_src, src_of_id, scale, inverse, u, presorted, twin, addr, opt, 1)
    for a, b in zip(store.segments, twin.segments):
        assert torch.equal(a, b)


def test_reduction_plan_made_ahead_from_a_device_count(gen):
    """``reduce_plan`` (made by the prefetch from the padded per-key counts and the count of keys on
    the device, entries past it garbage) gives the reduction the same bits as the plan it makes
    itself from the host count; the keys past the count never become pieces."""
    from tieredemb.ops.triton.embedding import _PIECE
    from tieredemb.storage.tiers.parts import IdOrder

    dim, u = 8, 9
    inverse = torch.cat([torch.zeros(2 * _PIECE + 3, dtype=torch.int64),  # a key over three pieces
                         torch.randint(1, u, (70,), generator=gen)])
    inverse = inverse[inverse != 4]  # a key without ids
    inverse = inverse[torch.randperm(inverse.numel(), generator=gen)].to(DEVICE)
    n = inverse.numel()
    order = torch.argsort(inverse, stable=True)
    entries = torch.bincount(inverse, minlength=u)
    padded = torch.cat([entries, torch.randint(1, 3 * _PIECE, (n - u,), generator=gen).to(DEVICE)])
    grad_src = torch.randn(n // 2, dim, generator=gen).to(DEVICE)
    src_of_id = torch.randint(0, n // 2, (n,), generator=gen).to(DEVICE)
    tk = TritonKernels()
    plan = tk.reduce_plan(padded, torch.tensor([u], device=DEVICE))
    want = tk.reduce_grads(grad_src, src_of_id, None, inverse, u, IdOrder(order, entries))
    got = tk.reduce_grads(grad_src, src_of_id, None, inverse, u, IdOrder(order, entries, plan=plan))
    assert torch.equal(got, want)
    starts, piece_first, piece_key, candidates = plan
    pieces = piece_key[: piece_key.numel() - candidates.numel()]
    real = pieces[pieces != 2**63 - 1]
    assert real.tolist() == sorted(real.tolist()) and set(real.tolist()) == set(range(u))
    assert torch.bincount(real, minlength=u)[0] == 3  # the hot key's pieces
    assert candidates[candidates != 2**63 - 1].tolist() == [0]
    opt = make_optimizer("rowwise_adagrad")
    store, addresses = make_store(gen, dim + opt.state_width(dim), 12)
    for seg in store.segments:
        seg[:, dim:].abs_()
    twin = clone_store(store)
    addr = addresses[:u].contiguous()
    tk.reduce_update(grad_src, src_of_id, None, inverse, u, IdOrder(order, entries), store, addr, opt, 1)
    tk.reduce_update(grad_src, src_of_id, None, inverse, u, IdOrder(order, entries, plan=plan), twin, addr,
                     opt, 1)
    for a, b in zip(store.segments, twin.segments):
        assert torch.equal(a, b)



@pytest.mark.parametrize("block", [32, 1024])
def test_reduction_plan_of_very_hot_keys(gen, monkeypatch, block):
    """The plan from its definition in plain Python, for keys of 0 to ~100 pieces: hot keys side by
    side in one block, one of more pieces than a block has keys (its pieces' keys stored a block at
    a time), keys without ids (one piece each), in programs over several blocks."""
    from tieredemb.ops.triton import embedding as E

    monkeypatch.setattr(E, "_RUN_BLOCK", block)
    monkeypatch.setattr(E, "_MAX_RUN_PROGRAMS", 4)
    u, piece = 300, E._PIECE
    counts = torch.randint(0, 4, (u,), generator=gen)
    counts[[5, 6, 7, 40, 299]] = torch.tensor([100 * piece + 3, 2 * piece, piece + 1, 37 * piece, 3 * piece])
    pieces = [max(1, -(-c // piece)) for c in counts.tolist()]
    starts = [0] + counts.cumsum(0).tolist()[:-1]
    piece_first = [0] + torch.tensor(pieces).cumsum(0).tolist()[:-1]
    piece_key = [k for k in range(u) for _ in range(pieces[k])]
    several = [k for k in range(u) if counts[k] > piece]
    n = int(counts.sum())
    got = TritonKernels()._plan(counts.to(DEVICE), n, u)
    assert got[0].tolist() == starts and got[1].tolist() == piece_first
    keys = got[2][: len(piece_key)].tolist()
    assert keys == piece_key
    assert got[2][len(piece_key) : got[2].numel() - got[3].numel()].eq(2**63 - 1).all()
    assert got[3][: len(several)].tolist() == several


@pytest.mark.parametrize("fault", ["none", "reserved key", "short"])
def test_checks_and_runs_of_a_padded_batch(gen, monkeypatch, fault):
    """A batch padded to a bucket (ids past ``count`` hold the largest key): the checks see only the
    first ``count`` ids, the dedup's order puts the padding last, the runs see only the real ids,
    and the padding's ``inverse`` is 0; everything else as the unpadded batch, Triton and reference."""
    from tieredemb.config import RESERVED_KEY
    from tieredemb.ops.triton import embedding as E

    monkeypatch.setattr(E, "_MAX_RUN_PROGRAMS", 4)  # programs over several blocks
    monkeypatch.setattr(E, "_RUN_BLOCK", 32)
    nf, b = 4, 30
    lengths, values, _ = _batch(gen, nf, b, None)
    values[::7] = 2**63 - 1  # real ids equal to the padding's key come first (a stable sort)
    if fault == "reserved key":
        values[-2] = RESERVED_KEY
    elif fault == "short":
        lengths[2, 3] += 1
    n, pad = values.numel(), 37
    table_of_feature = torch.tensor([0, 1, 1, 2])
    padded = torch.cat([values, torch.full((pad,), 2**63 - 1)]).to(DEVICE)
    count = torch.tensor([n], device=DEVICE)
    args = [t.to(DEVICE) for t in (lengths, )] + [None, table_of_feature.to(DEVICE), None]
    for kern in (TritonKernels(), TorchKernels()):
        want_summary, want_tables = kern.batch_checks(values.to(DEVICE), *args)
        got_summary, got_tables = kern.batch_checks(padded, *args, count)
        assert got_summary.tolist() == want_summary.tolist()
        assert torch.equal(got_tables[:n], want_tables)
        if fault != "none":
            continue
        ordered = kern.id_order(values.to(DEVICE), want_tables, 3)
        want = kern.sorted_runs_padded(*ordered[1:], ordered[0])
        porder, pkeys, ptables = kern.id_order(padded, got_tables, 3, count)
        assert torch.equal(porder[:n], ordered[0]) and porder[n:].tolist() == list(range(n, n + pad))
        assert torch.equal(pkeys[:n], ordered[1]) and torch.equal(ptables[:n], ordered[2])
        got = kern.sorted_runs_padded(pkeys, ptables, porder, count)
        u = int(want[4][0])
        assert int(got[4][0]) == u
        for g, w in zip(got[:2], want[:2]):  # keys, tables
            assert torch.equal(g[:u], w[:u])
        assert torch.equal(got[2][:n], want[2]) and (got[2][n:] == 0).all()  # inverse
        assert torch.equal(got[3][:u], want[3][:u])  # entries


@pytest.mark.parametrize("bits, hashes", [(63 * 4, 3), (1000, 2), (1 << 16, 8)])
def test_the_filters_kernel_answers_as_its_torch_version(gen, bits, hashes):
    """``KeyFilter.may_hold`` in one kernel: the torch version's answer for every pair (int64
    extremes, several tables), on filters nearly full and nearly empty; a pair added always held."""
    from tieredemb.ops.triton import hashing
    from tieredemb.storage.key_filter import KeyFilter

    keys = torch.cat([torch.tensor([0, -1, 2**63 - 1, -(2**63) + 1, 12345]),
                      torch.randint(-(2**62), 2**62, (3000,), generator=gen)])
    tables = torch.randint(0, 5, (keys.numel(),), generator=gen)
    f = KeyFilter(bits, torch.device("cpu"), hashes)  # (on the CPU: the torch version)
    f.add(keys[::7], tables[::7])
    want = f.may_hold(keys, tables)
    got = hashing.bloom_may_hold(f.words.to(DEVICE), keys.to(DEVICE), tables.to(DEVICE), f.bits, hashes)
    assert torch.equal(got.cpu(), want)
    assert bool(want[::7].all()) and not bool(want.all())  # (both answers occur)


def _owner_in_python(key: int, salt: int, world: int) -> int:
    """The owner rank by the routing's definition, in Python integers mod 2**64 (no torch)."""
    m = (1 << 64) - 1
    x = ((key ^ salt) + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    x ^= x >> 31
    return ((x & 0xFFFFFFFF) * world) >> 32


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_the_owners_kernel_routes_as_its_torch_version(gen, world):
    """``owner_of`` in one kernel: every key's rank as the torch version gives it (int64 extremes,
    several tables' salts), and both as the definition in Python integers."""
    from tieredemb.distributed import owner_of, table_salts
    from tieredemb.ops.triton import hashing

    keys = torch.cat([torch.tensor([0, -1, 2**63 - 1, -(2**63) + 1, 12345]),
                      torch.randint(-(2**62), 2**62, (3000,), generator=gen)])
    tables = torch.randint(0, 3, (keys.numel(),), generator=gen)
    salts = table_salts(["a", "b", "c"], torch.device("cpu"))[tables]
    want = owner_of(keys, salts, world)  # (on the CPU: the torch version)
    got = hashing.owner_of(keys.to(DEVICE), salts.to(DEVICE), world).cpu()
    assert torch.equal(got, want)
    mask = (1 << 64) - 1
    pairs = zip(keys[:200].tolist(), salts[:200].tolist())
    assert [_owner_in_python(k & mask, s & mask, world) for k, s in pairs] == want[:200].tolist()
    assert set(want.tolist()) == set(range(world))  # every rank owns some
