"""Launching a compiled Triton kernel with less host time than ``kernel[grid](...)``.

``kernel[grid](*args)`` binds every argument to the kernel's signature, works out Triton's
specialization of each (dtype, 16-byte alignment of pointers, ints equal to 1 or divisible by 16),
looks the compiled kernel up and only then launches it: 26-43 us of host time a launch for the
kernels of the ``hbm`` step on the H200 machine, against ~5 us for the compiled kernel's own launcher
(``docs/kernels.md``). A step launches ~11 of them.

``fast_launch(kernel)`` keeps the compiled kernels it has seen under a key that separates at least
what Triton's specialization separates: the device, per argument its type, a tensor's dtype and
whether its data pointer is 16-byte aligned, an int's range class (i32 / i64 / u64) and whether it is
1 or divisible by 16 (finer than Triton for ``do_not_specialize`` ints, never coarser), the value of
anything else, and the keyword arguments (constexprs, ``num_warps``: runtime values must come
positionally, or the launch is left to Triton). The first launch of a key goes through
``kernel[grid]``, which compiles and launches; the later ones call the compiled kernel's launcher
directly. A finer key costs at most an extra cache entry; it never launches a kernel
compiled for other arguments.

The direct launch uses Triton internals (``CompiledKernel.run``, ``function``, ``packed_metadata``),
so it runs only for the Triton versions it was tested with on a GPU (``TESTED``: on 2026-11-21 the
whole CUDA suite passed with it but for one test whose tolerance was too tight for float sums in two
orders; it failed the same way with Triton's own launches and was fixed), never under the
interpreter (``TRITON_INTERPRET=1``), never while a launch hook is set (a profiler's), and not in
mode "0" (``set_mode("0")``: every launch is then ``kernel[grid](...)``). Mode "check" launches
through Triton and raises if one key ever stands for two compiled kernels: the way to vet a new
Triton version before adding it to ``TESTED`` (run the CUDA suite with it). The mode is the
process's, set by ``set_mode``; its default comes from ``TIEREDEMB_FAST_LAUNCH`` (read once, at
import) when that is set.
"""

from __future__ import annotations

import functools
import operator
import os

import torch
import triton

TESTED = ("3.6",)  # major.minor of the Triton versions whose internals the direct launch was tested on

_I32 = 1 << 31
_I64 = 1 << 63


MODES = ("1", "0", "check")


def _usable(mode: str) -> str:
    """``mode`` as it applies here: "0" under the interpreter or an untested Triton version."""
    if mode not in MODES:
        raise ValueError(f"the launch mode must be one of {MODES} (1: direct launches, 0: Triton's, "
                         f"check: Triton's, checking the keys), got {mode!r}")
    tested = ".".join(triton.__version__.split(".")[:2]) in TESTED
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or not tested:
        return "0"
    return mode


# the process's mode (``set_mode``); its default read from the environment once
_MODE = [_usable(os.environ.get("TIEREDEMB_FAST_LAUNCH", "1"))]


def set_mode(mode: str) -> str:
    """Choose how every ``fast_launch`` kernel launches from now on: "1" (the default: direct
    launches), "0" (Triton's launch) or "check" (Triton's launch, and a ``RuntimeError`` if one key
    ever stands for two compiled kernels). Under the interpreter or an untested Triton version it is
    "0" whatever is asked. The default comes from ``TIEREDEMB_FAST_LAUNCH`` when set. Returns the
    mode that was in force (to set it back)."""
    before, _MODE[0] = _MODE[0], _usable(mode)
    return before


def current_mode() -> str:
    """The launch mode in force (``set_mode``)."""
    return _MODE[0]


def _hooked() -> bool:
    """Whether a launch hook is set (None, or an empty ``HookChain`` in newer versions, is none)."""
    runtime = triton.knobs.runtime
    return any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _int_spec(arg: int) -> tuple[int, bool, bool]:
    size = 0 if -_I32 <= arg < _I32 else 1 if -_I64 <= arg < _I64 else 2
    return size, arg == 1, arg & 15 == 0


class _Layout:
    """Where a call's tensors, ints and other values are, for one tuple of argument types: the key is
    then made with C-level ``map`` calls, not a Python loop over every argument."""

    def __init__(self, types: tuple[type, ...]) -> None:
        tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
        ints = [i for i, t in enumerate(types) if t is int]
        others = [i for i, t in enumerate(types) if t is not float and i not in tensors and i not in ints]
        # values of other types go into the key as they are: only kinds with few values are kept
        self.cacheable = all(types[i] in (bool, str, type(None)) for i in others)
        self.tensors = _getter(tensors)
        self.ints = _getter(ints)
        self.others = _getter(others)


def _getter(positions: list[int]):
    """args -> tuple of the arguments at ``positions`` (itemgetter returns a bare item for one)."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


_data_ptr = torch.Tensor.data_ptr
_dtype = operator.attrgetter("dtype")


class FastLaunch:
    """``kernel[grid](*args, **kwargs)`` through the compiled kernel's launcher once seen (module
    docstring). Positional arguments are the kernel's leading parameters; the rest come by keyword."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.fn = getattr(kernel, "fn", None)
        params = getattr(kernel, "params", [])
        self._params = [p.name for p in params]
        self._runtime = {p.name for p in params if not p.is_constexpr}
        self._defaults = {p.name: p.default for p in params if p.has_default}
        self._layouts: dict[tuple[type, ...], _Layout] = {}
        self._cache: dict[tuple, tuple] = {}
        self._direct = hasattr(kernel, "device_caches")  # a jitted kernel (not an interpreted one)
        self._seen: dict[tuple, object] = {}  # check mode: key -> the compiled kernel Triton launched

    def __getitem__(self, grid: tuple[int, ...]):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def key(self, args: tuple, kwargs: dict) -> tuple | None:
        """The cache key of one call (module docstring): equal keys, equal specializations. None: an
        argument of a kind the key does not cover (the launch is left to Triton)."""
        types = tuple(map(type, args))
        layout = self._layouts.get(types)
        if layout is None:
            layout = self._layouts[types] = _Layout(types)
        if not layout.cacheable:
            return None
        tensors = layout.tensors(args)
        misaligned = functools.reduce(operator.or_, map(_data_ptr, tensors), 0) & 15
        aligned = True if not misaligned else tuple(p & 15 == 0 for p in map(_data_ptr, tensors))
        return (types, aligned, tuple(map(_dtype, tensors)), tuple(map(_int_spec, layout.ints(args))),
                layout.others(args), tuple(kwargs.items()))

    def launch(self, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        first = args[0] if args else None
        mode = _MODE[0]
        if mode == "0" or not self._direct or type(first) is not torch.Tensor or not first.is_cuda:
            self.kernel[grid](*args, **kwargs)
            return
        device = first.get_device()
        key = self.key(args, kwargs)
        if key is None:
            self.kernel[grid](*args, **kwargs)
            return
        key = (device, key)
        if mode == "check":
            self._verify(key, self.kernel[grid](*args, **kwargs))
            return
        hit = self._cache.get(key)
        if hit is None:
            self._first(key, grid, args, kwargs)
            return
        run, function, metadata, tail = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        stream = torch._C._cuda_getCurrentRawStream(device)
        run(grid[0], g1, g2, stream, function, metadata, None, None, None, *args, *tail)

    def _verify(self, key: tuple, compiled: object) -> None:
        """Check mode: one key, one compiled kernel (else the direct launch would run the wrong one)."""
        known = self._seen.setdefault(key, compiled)
        if known is not compiled:
            raise RuntimeError(f"FastLaunch: {self.fn.__name__}: one key for two compiled kernels "
                               f"({key}); the direct launch is not safe for these arguments")

    def _first(self, key: tuple, grid: tuple[int, ...], args: tuple, kwargs: dict) -> None:
        """Compile and launch through Triton; keep the compiled kernel unless a hook is set."""
        compiled = self.kernel[grid](*args, **kwargs)
        if _hooked():
            return
        names = self._params[len(args):]
        if any(name in self._runtime for name in kwargs) or \
                any(name not in kwargs and name not in self._defaults for name in names):
            return  # a runtime value by keyword (the key would hold it), or a parameter not given
        tail = tuple(kwargs[name] if name in kwargs else self._defaults[name] for name in names)
        self._cache[key] = (compiled.run, compiled.function, compiled.packed_metadata, tail)


def fast_launch(kernel) -> FastLaunch:
    """Decorator over ``@triton.jit``: the kernel launches as before (``kernel[grid](...)``), faster."""
    return FastLaunch(kernel)
