"""Embedding memory stashing (DESIGN section 5): the tables' device rows go to pinned host memory after
the lookup and come back before the embedding backward, freeing their HBM while the dense part runs.

Timeline of one training step, for each collection with stashed groups::

    lookup      forward reads the rows                                  (training stream)
    stash       rows -> host buffers, in chunks                          (copy stream, after the lookup)
    free        the device segments go back to the caching allocator     (strategy, below)
    restore     host buffers -> fresh device segments, in chunks         (copy stream, at the restore site)
    backward    the fused update waits for the restore on the GPU        (training stream)

Between stash and restore the store's segments *are* the host buffers, reached through the pointer
table like hybrid mode's host segments: a prefetch, ``read``, ``export`` or checkpoint in that window
sees (and writes) the host copy, which is what comes back. The device memory is freed by one of
three strategies:

- ``blocking``: the host waits for the copy, then frees (the seed's prototype; the CPU stalls).
- ``record_stream``: freed at once, with the copy stream recorded on the memory; the caching allocator
  reuses it once it sees the copy done, at some later allocation (when is not deterministic).
- ``event``: freed at a later point of the forward (the free site), after the training stream waits
  for the copy's event: the memory is reusable from there in program order, with no host wait. The
  free site is a module name (its forward pre-hook), or, by default, calibrated: for the first steps
  the free happens at the end of the forward while CUDA events time the copy and the forward's
  saved-tensor points after the lookup; then the free moves to the first such point the GPU reaches
  after the copy should be done (1.1x the measured copy time), so the wait costs nothing.

The restore site is a module name (its backward pre-hook) or, by default, calibrated the same way:
the last saved-tensor point of the backward (a tensor unpacked) that the GPU reaches 1.1x the copy
time before the embedding backward, so the rows stay on the host as long as the copy back can still
be hidden. At the latest the collection's backward restores. On the CPU (nothing to time) the default
restore is at the backward's first point, and the same steps run (copies between ordinary tensors):
results are the same and the hooks are exercised; the memory figures mean nothing there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from tieredemb.config import parse_bytes

STRATEGIES = ("event", "record_stream", "blocking")
_CALIBRATION_STEPS = 2
_MARGIN = 1.1  # the free waits this much longer than the measured copy time


@dataclass
class StashConfig:
    """Which tables to stash and how (DESIGN section 5).

    Args:
        tables: table names; a table shares its row store with the other tables of its dim in its
            collection, so a group is stashed whole (listing part of one is an error). Default: every
            table of hbm_direct collections.
        strategy: how device memory is freed after the stash copy: ``"event"`` (default),
            ``"record_stream"`` or ``"blocking"`` (see ``tieredemb.pipeline.stash``).
        free_site: ``event`` only: the module (a name from ``model.named_modules()``) whose forward
            frees the stashed memory; ``None``: calibrated (see the module docstring).
        restore_site: the module whose backward starts the restore; ``None``: calibrated (the last
            point of the backward from which the copy back is still hidden); at the latest, the
            embedding backward.
        chunk_bytes: bytes per copy (so batch copies of the pipeline are not held up behind one
            large transfer); an int or a string like ``"32MiB"``.
    """

    tables: list[str] | None = None
    strategy: str = "event"
    free_site: str | None = None
    restore_site: str | None = None
    chunk_bytes: int | str = "32MiB"

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"StashConfig.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.free_site is not None and self.strategy != "event":
            raise ValueError(f"StashConfig.free_site applies to the 'event' strategy only, "
                             f"not {self.strategy!r}")
        self.chunk_bytes = parse_bytes(self.chunk_bytes)
        if self.chunk_bytes < 1:
            raise ValueError(f"StashConfig.chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.tables is not None:
            self.tables = list(self.tables)


class Stash:
    """Stashing of the selected tables of ``collections``, driven by hooks (what ``TrainPipeline(stash=)``
    builds; usable in a hand-written loop too).

    The collections call ``after_lookup`` at the end of a training forward and ``restore`` at the start
    of their backward (and of their next forward). For the default sites, run the model's forward
    inside ``tracking()``; ``free()`` and ``restore()`` can also be called directly. ``close()``
    restores and detaches.

    Args:
        collections: the embedding collections (each may be attached to one ``Stash``).
        config: a ``StashConfig``.
        model: the module whose submodules ``free_site`` / ``restore_site`` name.
    """

    def __init__(self, collections: list, config: StashConfig, model: nn.Module | None = None) -> None:
        if not isinstance(config, StashConfig):
            raise TypeError(f"stash must be a te.StashConfig, got {type(config).__name__}")
        self.config = config
        self._stores = _select(collections, config.tables)  # collection -> its row stores to stash
        if any(c.stash is not None for c in self._stores):
            raise ValueError("an embedding collection is already attached to a Stash; close() it first")
        devices = {c.device for c in self._stores}
        if len(devices) > 1:
            raise ValueError(f"stashed collections must share one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._handles = _site_hooks(model, config, self)
        self._pending: list[tuple[object, dict[int, torch.Tensor]]] = []  # (store, device segments)
        self._stashed_bytes = 0
        self._packs = 0  # saved tensors packed since this step's first stash
        self._unpacks = 0  # saved tensors unpacked while stashed
        self._restore_at: int | None = None  # calibrated restore site (unpack number); None: latest
        self._free_at: int | None = None  # calibrated free site (pack number); None: end of forward
        calibrate = self._cuda and (config.restore_site is None or
                                    (config.strategy == "event" and config.free_site is None))
        self._calibration: _Calibration | None = _Calibration() if calibrate else None
        self.stats = {"steps": 0, "stashed_bytes": 0, "free_site": config.free_site,
                      "restore_site": config.restore_site, "copy_ms": None, "window_ms": None}
        for c in self._stores:
            c.stash = self

    # --------------------------------------------------------------------------- lifecycle
    def after_lookup(self, collection) -> None:
        """Stash ``collection``'s selected rows (its forward is done with them). Called by the
        collection, holding its lock."""
        stores = self._stores.get(collection, [])
        if not stores or any(s.stashed for s in stores):
            return
        if not self._pending and not self._stashed_bytes:
            self._begin_step()
        for store in stores:
            self._stashed_bytes += store.device_bytes()
            self.stats["stashed_bytes"] = max(self.stats["stashed_bytes"], self._stashed_bytes)
            released = store.stash(self.stream, self._chunk_rows(store))
            if self._calibration is not None:
                self._calibration.copied(self.stream)
            self._release(store, released)

    def _begin_step(self) -> None:
        self.stats["steps"] += 1
        self._packs = self._unpacks = 0
        cal = self._calibration
        if cal is not None:
            if cal.ready():
                self._free_at, self._restore_at, copy_ms, window_ms = cal.choose()
                self.stats.update(copy_ms=copy_ms, window_ms=window_ms)
                if self.config.strategy == "event" and self.config.free_site is None:
                    self.stats["free_site"] = ("end of forward" if self._free_at is None
                                               else f"saved tensor {self._free_at} after the lookup")
                if self.config.restore_site is None:
                    self.stats["restore_site"] = ("embedding backward" if self._restore_at is None
                                                  else f"saved tensor {self._restore_at} of the backward")
                self._calibration = None if cal.steps >= _CALIBRATION_STEPS else cal
            if self._calibration is not None:
                self._calibration.start(self.device)

    def _release(self, store, released: dict[int, torch.Tensor]) -> None:
        strategy = self.config.strategy
        if strategy == "blocking":
            if store.ready is not None:
                store.ready.synchronize()
            released.clear()
        elif strategy == "record_stream":
            if self.stream is not None:
                for t in released.values():
                    t.record_stream(self.stream)
            released.clear()
        else:
            self._pending.append((store, released))

    def free(self) -> None:
        """Give the stashed device memory back (``event`` strategy; the others free at the stash):
        the current stream waits for the copies first, the host does not."""
        for store, released in self._pending:
            if released and store.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(store.ready)
            released.clear()
        self._pending.clear()

    def restore(self, collection=None) -> None:
        """Start copying the stashed rows back (of ``collection`` only, or of all). Idempotent."""
        colls = [collection] if collection is not None else list(self._stores)
        cal = self._calibration
        if cal is not None and collection is not None and self._stashed_bytes:
            cal.embedding_backward(self.device)  # the latest site: calibration times the backward to it
        for c in colls:
            stores = [s for s in self._stores.get(c, []) if s.stashed]
            if not stores:
                continue
            with c.mutating():  # after any prefetch that wrote the host copies
                for store in stores:
                    into = self._unfreed(store)
                    self._stashed_bytes -= store.rows_by_placement().get("stashed", 0) * store.row_bytes
                    store.restore(self.stream, self._chunk_rows(store), into)
        if not self._stashed_bytes:
            self._pending.clear()

    def _chunk_rows(self, store) -> int:
        return max(1, self.config.chunk_bytes // store.row_bytes)

    def _unfreed(self, store) -> dict[int, torch.Tensor]:
        """Device segments of ``store`` not freed yet (``event`` before its free site): the restore
        copies into them instead of allocating."""
        for i, (s, released) in enumerate(self._pending):
            if s is store:
                del self._pending[i]
                return released
        return {}

    def close(self) -> None:
        """Restore everything and detach from the collections and the model."""
        self.restore()
        for h in self._handles:
            h.remove()
        self._handles = []
        for c in self._stores:
            c.stash = None

    # ------------------------------------------------------------------------------ sites
    @contextlib.contextmanager
    def tracking(self):
        """Run the model's forward inside: its saved tensors mark the default free site (packed in the
        forward) and restore site (unpacked in the backward); the forward's end frees at the latest."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.free()  # the forward is over: the free site, at the latest

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._pending:
            self._packs += 1
            if self._calibration is not None:
                self._calibration.mark(self.device)
            elif self._free_at is not None and self._packs >= self._free_at:
                self.free()
        return t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        if self._stashed_bytes and self.config.restore_site is None:
            self._unpacks += 1
            if not self._cuda:  # nothing to time: restore at the backward's first point
                self.restore()
            elif self._calibration is not None:
                self._calibration.unpacked(self.device)
            elif self._restore_at is not None and self._unpacks >= self._restore_at:
                self.restore()
        return t


class _Calibration:
    """CUDA events of the first stashed steps (which free at the end of the forward and restore at the
    embedding backward): the lookup's end, each stash copy's end, each saved-tensor point of the
    forward after the lookup and of the backward before the embedding backward, and the latter's
    start. The sites are then chosen so the copies fit: the free at the first forward point 1.1x the
    copy time after the lookup, the restore at the last backward point 1.1x the copy time before the
    embedding backward (the copy back moves the same bytes at about the same rate)."""

    def __init__(self) -> None:
        self.steps = 0
        self.lookup: torch.cuda.Event | None = None
        self.copies: list[torch.cuda.Event] = []
        self.packs: list[torch.cuda.Event] = []
        self.unpacks: list[torch.cuda.Event] = []
        self.backward: torch.cuda.Event | None = None

    def start(self, device: torch.device) -> None:
        self.steps += 1
        self.lookup = _timed(torch.cuda.current_stream(device))
        self.copies, self.packs, self.unpacks, self.backward = [], [], [], None

    def copied(self, stream: torch.cuda.Stream) -> None:
        self.copies.append(_timed(stream))

    def mark(self, device: torch.device) -> None:
        self.packs.append(_timed(torch.cuda.current_stream(device)))

    def unpacked(self, device: torch.device) -> None:
        self.unpacks.append(_timed(torch.cuda.current_stream(device)))

    def embedding_backward(self, device: torch.device) -> None:
        if self.backward is None:
            self.backward = _timed(torch.cuda.current_stream(device))

    def ready(self) -> bool:
        """Every event of the last calibrated step has run (a query, never a wait)."""
        events = [self.lookup, self.backward, *self.copies, *self.packs, *self.unpacks]
        return None not in events and all(e.query() for e in events)

    def choose(self) -> tuple[int | None, int | None, float, float]:
        """(free site: a forward point number or None for the forward's end; restore site: a
        backward point number or None for the embedding backward; copy ms; forward ms after the
        lookup)."""
        copy_ms = max((self.lookup.elapsed_time(e) for e in self.copies), default=0.0)
        fwd = [self.lookup.elapsed_time(e) for e in self.packs]
        free_at = next((k + 1 for k, t in enumerate(fwd) if t >= _MARGIN * copy_ms), None)
        backward = self.lookup.elapsed_time(self.backward)
        bwd = [backward - self.lookup.elapsed_time(e) for e in self.unpacks]
        fits = [k + 1 for k, t in enumerate(bwd) if t >= _MARGIN * copy_ms]
        restore_at = fits[-1] if fits else (1 if bwd else None)
        return free_at, restore_at, copy_ms, fwd[-1] if fwd else 0.0


def _timed(stream: torch.cuda.Stream) -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)
    e.record(stream)
    return e


def _select(collections: list, tables: list[str] | None) -> dict:
    """collection -> the row stores to stash; whole groups only."""
    out, wanted = {}, None if tables is None else set(tables)
    known = set()
    for c in collections:
        known.update(t.name for t in c.table_configs)
        stores = []
        for group in c.tiers:
            names = set(group.names)
            if wanted is None:
                take = c.storage_mode == "hbm_direct"
            else:
                take = bool(names & wanted)
                if take and not names <= wanted:
                    raise ValueError(
                        f"StashConfig.tables: tables {sorted(names)} share one row store (same dim, "
                        f"same collection) and are stashed together; list all of them or none")
            if take:
                stores.append(group.store)
        if stores:
            out[c] = stores
    if wanted is not None and wanted - known:
        raise ValueError(f"StashConfig.tables: unknown tables {sorted(wanted - known)}; "
                         f"tables are {sorted(known)}")
    return out


def _site_hooks(model: nn.Module | None, config: StashConfig, stash: Stash) -> list:
    """Hooks for named free / restore sites."""
    handles = []
    for site, what in ((config.free_site, "free_site"), (config.restore_site, "restore_site")):
        if site is None:
            continue
        if model is None:
            raise ValueError(f"StashConfig.{what} names a module: give the model too")
        try:
            module = model.get_submodule(site)
        except AttributeError as e:
            raise ValueError(f"StashConfig.{what}: the model has no module {site!r}") from e
        if what == "free_site":
            handles.append(module.register_forward_pre_hook(lambda m, args: stash.free()))
        else:
            handles.append(module.register_full_backward_pre_hook(lambda m, grad: stash.restore()))
    return handles
