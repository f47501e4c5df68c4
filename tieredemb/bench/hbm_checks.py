"""The ``hbm`` workload's row checks: ours' rows after training against the peer's, the exact SGD rows,
or (bounded tables) the reference kernels' run of the same tables (``tieredemb.bench.hbm``'s
docstring says which is held to which).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import tieredemb as te
from tieredemb.bench.report import RowCheck
from tieredemb.bench.workloads import HbmShape, scramble

# rows compared after training: every row of tables up to this size, else the hottest ranks and a
# random sample of the rest
CHECK_ALL_ROWS = 1 << 18
CHECK_HOT_ROWS = 4096
CHECK_SAMPLE_ROWS = 1 << 18
CHECK_RTOL, CHECK_ATOL = 1e-4, 1e-5  # hot rows sum ~1e4 gradients a step, in a different order
# SGD, ours against the exact rows: ours rounds twice per key a step in fp32, summing its duplicates'
# gradients (~1e-6 of the sum) and adding that to the row (half an ulp, 6e-8 of the row), so its
# error stays ~5e-6 of the row at any step count (H200, full shape: 2.7e-4 of 58.8 after 60 steps,
# 1.0e-3 of 206 after 210). Rows move by at least lr * 0.005 = 5e-5 per occurrence, far over the atol.
EXACT_RTOL, EXACT_ATOL = 2e-5, 1e-6
# SGD, the peer against the exact rows: torch.optim.SGD adds every occurrence's update (~1e-4) to
# the fp32 row on its own, each add rounding to the row's grid (ulp 3.8e-6 at 58); with the same
# upstream gradient every step those errors add up rather than cancel, growing with the steps (H200:
# 0.0103 of 58.8 after 60 steps, 0.14 of 206 after 210). This bound only says it trained the same thing.
PEER_EXACT_RTOL = 1e-2


@dataclass
class RowSnapshot:
    """Ours' rows at the checked ranks after training, kept on the host once ours is freed.

    Per table: ranks int64 (k,), weights float32 (k, D) (zeros where not stored), found bool (k,),
    the number of rows the table stores in all, and its counters (``te.TableStats``): misses,
    evictions and the rows it may hold (``capacity``: None unbounded).
    """

    kernels: str
    ranks: list[torch.Tensor]
    weights: list[torch.Tensor]
    found: list[torch.Tensor]
    stored: list[int]
    misses: list[int] = field(default_factory=list)
    evictions: list[int] = field(default_factory=list)
    capacity: list[int | None] = field(default_factory=list)
    preinserted: bool = False
    table_rows: int = 0


@dataclass
class HbmRowCheck(RowCheck):
    """A ``RowCheck`` that names what ours was held to.

    reference: "exact" (SGD: the float64 rows of ``sgd_reference``) or "peer" (Adam); max_abs_diff is
    |ours - reference| and max_moved |reference - initial|, within rtol, atol. peer_max_abs_diff: the
    peer's own |peer - exact| (SGD, its fp32 rounding; None when the reference is the peer).
    """

    reference: str = "peer"
    rtol: float = CHECK_RTOL
    atol: float = CHECK_ATOL
    peer_max_abs_diff: float | None = None


def check_ranks(shape: HbmShape, seed: int) -> list[torch.Tensor]:
    """Per table, the ranks compared (int64 (k,) host, sorted): all of them in small tables, else
    the hottest and a random sample."""
    if shape.rows <= CHECK_ALL_ROWS:
        return [torch.arange(shape.rows) for _ in range(shape.num_tables)]
    gen = torch.Generator().manual_seed(seed + 23)
    out = []
    for _ in range(shape.num_tables):
        sample = torch.randint(0, shape.rows, (CHECK_SAMPLE_ROWS,), generator=gen)
        out.append(torch.unique(torch.cat([torch.arange(CHECK_HOT_ROWS), sample])))
    return out


def snapshot_rows(ebc: te.EmbeddingBagCollection, shape: HbmShape, device: torch.device, seed: int,
                  kernels: str) -> RowSnapshot:
    """Ours' rows at ``check_ranks``, copied to the host."""
    ranks = check_ranks(shape, seed)
    snap = RowSnapshot(kernels, ranks, [], [], [])
    for t, r in enumerate(ranks):
        w, f = ebc.read(shape.table_name(t), scramble(r.to(device), t))
        stats = ebc.stats()[shape.table_name(t)]
        snap.weights.append(w.detach().cpu())
        snap.found.append(f.cpu())
        snap.stored.append(stats.rows["device"])
        snap.misses.append(stats.misses)
        snap.evictions.append(stats.evictions)
        snap.capacity.append(stats.capacity)
    return snap


def compare_rows(optimizer: str, snap: RowSnapshot, peer_rows: list[torch.Tensor],
                 initial: list[torch.Tensor], seen: list[torch.Tensor], seen_total: list[int],
                 exact: list[torch.Tensor] | None = None) -> HbmRowCheck:
    """Ours' snapshot against the reference, per table (all tensors host, aligned with ``snap.ranks``):

    - ours stores exactly the keys the batches touched (``seen``), as many as the peer's touched
      rows; or, when the rows were pre-inserted, every key;
    - with ``exact`` (SGD: float64 (k, D) per table, ``sgd_reference``) a touched row of ours equals
      it (EXACT_RTOL, EXACT_ATOL) and the peer's is within PEER_EXACT_RTOL of it; without, a touched
      row of ours equals the peer's (CHECK_RTOL, CHECK_ATOL);
    - an untouched row is still its initial row in the peer, and in ours its initial row when
      pre-inserted, else not stored (zeros).
    """
    if exact is None:
        check = HbmRowCheck(optimizer, snap.kernels, False, 0, 0, 0.0, 0.0)
    else:
        check = HbmRowCheck(optimizer, snap.kernels, False, 0, 0, 0.0, 0.0, reference="exact",
                            rtol=EXACT_RTOL, atol=EXACT_ATOL, peer_max_abs_diff=0.0)
    for t in range(len(snap.ranks)):
        found, touched = snap.found[t], seen[t]
        check.rows_compared += found.numel()
        check.rows_trained += int(touched.sum())
        want_found = torch.ones_like(touched) if snap.preinserted else touched
        if not torch.equal(found, want_found):
            check.problems.append(f"table {t}: ours stores {int(found.sum())} of the checked keys, "
                                  f"expected {int(want_found.sum())}")
            continue
        want_stored = snap.table_rows if snap.preinserted else seen_total[t]
        if snap.stored[t] != want_stored:
            check.problems.append(f"table {t}: ours stores {snap.stored[t]} rows, expected {want_stored}")
        if touched.any():
            _compare_trained(check, t, snap.weights[t][touched], peer_rows[t][touched],
                             initial[t][touched], None if exact is None else exact[t][touched])
        idle = ~touched
        ours, peer = snap.weights[t][idle], peer_rows[t][idle]
        ours_idle = initial[t][idle] if snap.preinserted else torch.zeros_like(ours)
        if not torch.equal(peer, initial[t][idle]) or not torch.equal(ours, ours_idle):
            check.problems.append(f"table {t}: untouched rows are not their initial rows / zeros")
    return _concluded(check, "trained")


def compare_bounded(optimizer: str, snap: RowSnapshot, reference: RowSnapshot,
                    initial: list[torch.Tensor]) -> HbmRowCheck:
    """A bounded run's snapshot against the reference kernels' run of the same bounded tables and
    batches (``initial``: float32 (k, D) host per table, the initial rows at ``snap.ranks``):

    - every table missed and evicted as many keys as the reference's, and evicted some (a run that
      never evicts checks nothing a dense table would not);
    - it stores as many rows, no more than its ``max_capacity`` rounded up to whole buckets, and the
      same keys of the checked ones;
    - a stored row equals the reference's (CHECK_RTOL, CHECK_ATOL: their reductions may sum a key's
      gradients in another order).
    """
    check = HbmRowCheck(optimizer, snap.kernels, False, 0, 0, 0.0, 0.0, reference=reference.kernels)
    width = te.StorageConfig().bucket_width
    for t in range(len(snap.ranks)):
        counters = (snap.misses[t], snap.evictions[t], snap.stored[t])
        expected = (reference.misses[t], reference.evictions[t], reference.stored[t])
        if counters != expected:
            check.problems.append(f"table {t}: (misses, evictions, rows stored) {counters}, the "
                                  f"reference's {expected}")
        if not snap.evictions[t]:
            check.problems.append(f"table {t}: no row was evicted")
        if snap.stored[t] > -(-snap.capacity[t] // width) * width:
            check.problems.append(f"table {t}: {snap.stored[t]} rows stored, over max_capacity "
                                  f"{snap.capacity[t]}")
        found = snap.found[t]
        if not torch.equal(found, reference.found[t]):
            check.problems.append(f"table {t}: stores {int(found.sum())} of the checked keys, the "
                                  f"reference {int(reference.found[t].sum())}")
            continue
        check.rows_compared += found.numel()
        check.rows_trained += int(found.sum())
        if found.any():
            _compare_trained(check, t, snap.weights[t][found], reference.weights[t][found],
                             initial[t][found], None)
    return _concluded(check, "stored")


def _concluded(check: HbmRowCheck, rows: str) -> HbmRowCheck:
    """``check`` passed or not; a check that compared no ``rows`` row, or none that moved from its
    initial value, proves nothing and fails."""
    if check.rows_trained and check.max_moved == 0.0:
        check.problems.append(f"no {rows} row moved from its initial value: the comparison proves nothing")
    if not check.rows_trained:
        check.problems.append(f"no {rows} row was compared")
    check.passed = not check.problems
    return check


def _compare_trained(check: HbmRowCheck, t: int, ours: torch.Tensor, peer: torch.Tensor,
                     initial: torch.Tensor, exact: torch.Tensor | None) -> None:
    """Table ``t``'s touched rows (float32 (n, D) each; exact float64 (n, D) or None) into ``check``:
    ours against the reference (the exact rows, else the peer's), and the peer against the exact rows."""
    reference = (peer if exact is None else exact).double()
    diff = float((ours.double() - reference).abs().max())
    check.max_abs_diff = max(check.max_abs_diff, diff)
    check.max_moved = max(check.max_moved, float((reference - initial.double()).abs().max()))
    if not torch.allclose(ours.double(), reference, rtol=check.rtol, atol=check.atol):
        check.problems.append(f"table {t}: trained rows differ from the {check.reference} rows by up "
                              f"to {diff:.3g}")
    if exact is None:
        return
    peer_diff = float((peer.double() - exact).abs().max())
    check.peer_max_abs_diff = max(check.peer_max_abs_diff, peer_diff)
    if not torch.allclose(peer.double(), exact, rtol=PEER_EXACT_RTOL, atol=CHECK_ATOL):
        check.problems.append(f"table {t}: the peer's trained rows differ from the exact rows by up to "
                              f"{peer_diff:.3g}, more than its fp32 rounding")
