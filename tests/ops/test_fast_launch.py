"""``tieredemb.ops.triton.launch``: the key that picks a compiled kernel separates everything Triton's
specialization separates, and a kernel launched through ``FastLaunch`` computes what the same kernel
launched by Triton computes (on CUDA: through the direct launcher, aligned and misaligned pointers,
ints specialized and not; on CPU: through the interpreter, which it leaves alone)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported anywhere
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tieredemb.ops.triton import launch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit(do_not_specialize=["m"])
def _axpb(x, out, n, m, a, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + offs, mask=mask, other=0.0)
    tl.store(out + offs, v * a + m + n + SHIFT, mask=mask)


def expected(x: torch.Tensor, n: int, m: int, a: float, shift: int) -> torch.Tensor:
    return (x.double()[:n] * a + m + n + shift).float()


def test_the_key_separates_alignment_dtype_and_int_classes():
    kernel = launch.FastLaunch(_axpb)

    def key(*args, **kwargs):
        return kernel.key(args, kwargs)

    base = torch.zeros(64, dtype=torch.float32)
    out = torch.zeros(64, dtype=torch.float32)
    assert key(base, out, 5) != key(base[1:], out, 5)  # 4 bytes off a 16-byte boundary
    assert key(base, out, 5) != key(base, out[3:], 5)
    assert key(base[1:], out, 5) != key(base, out[1:], 5)  # which one is misaligned counts
    assert key(base, out, 5) == key(base[4:], out[8:], 5)  # 16 and 32 bytes: aligned again
    assert key(base, out, 5) != key(base.to(torch.int64), out, 5)
    # int classes: 1 | other i32 | i32 divisible by 16 | i64 divisible | i64 not | u64
    classes = [[1], [2, 3, -1, 2**31 - 1], [16, 32, 0, 2**31 - 16], [2**31, 2**63 - 16], [2**31 + 1],
               [2**63, 2**64 - 16]]
    keys = [{key(base, v) for v in values} for values in classes]
    assert all(len(k) == 1 for k in keys), keys
    assert len(set().union(*keys)) == len(classes)
    assert key(base, True) != key(base, 1) and key(base, None) != key(base, 0)
    assert key(base, 0.5) == key(base, 2.0) and key(base, 0.5) != key(base, 1)
    assert key(base, 5, BLOCK=64) != key(base, 5, BLOCK=128)
    assert key(base, 5, num_warps=1) != key(base, 5, num_warps=4)
    assert key(base, torch.tensor(3).numpy()) is None  # a value of a kind not covered: Triton's launch


@pytest.fixture
def mode():
    """Sets the launch mode for a test and puts the process's back after it."""
    before = launch.current_mode()
    yield launch.set_mode
    launch.set_mode(before)


@pytest.fixture
def direct(mode):
    """FastLaunch in its direct mode; under the interpreter or an untested Triton it stays Triton's."""
    mode("1")
    return launch.FastLaunch(_axpb)


@pytest.mark.parametrize("n", [1, 16, 37, 1000])
def test_a_launch_computes_what_triton_computes(n, direct):
    kernel = direct
    x = torch.randn(1100, device=DEVICE)
    for view in (x, x[1:], x[3:], x[4:]):  # aligned and misaligned data pointers
        for m in (1, 16, 5):
            out = torch.full((n,), float("nan"), device=DEVICE)
            kernel[(triton.cdiv(n, 256),)](view, out, n, m, 0.5, SHIFT=3, BLOCK=256)
            torch.testing.assert_close(out.cpu(), expected(view.cpu(), n, m, 0.5, 3), rtol=1e-6, atol=1e-5)
    if DEVICE == "cpu":
        assert not kernel._cache  # the interpreter: every launch is Triton's own
    else:
        # aligned (x, x[4:]) and misaligned (x[1:], x[3:]) pointers, m = 1 / 16 / other: 2 x 3 keys
        # 6: a tested Triton
        assert len(kernel._cache) == 6 if launch.current_mode() != "0" else not kernel._cache


@pytest.mark.skipif(DEVICE != "cuda", reason="the direct launch runs on CUDA only")
def test_the_direct_launch_follows_the_current_stream_and_a_new_constexpr(direct):
    kernel = direct
    x = torch.randn(512, device=DEVICE)
    out = torch.empty(512, device=DEVICE)
    kernel[(2,)](x, out, 512, 7, 2.0, SHIFT=0, BLOCK=256)  # compiled, launched by Triton
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for shift in (0, 9):  # the same key again (direct), then a new constexpr (Triton's launch)
            kernel[(2,)](x, out, 512, 7, 2.0, SHIFT=shift, BLOCK=256)
            side.synchronize()
            torch.testing.assert_close(out.cpu(), expected(x.cpu(), 512, 7, 2.0, shift), rtol=1e-6, atol=1e-5)
    if launch.current_mode() != "0":
        assert len(kernel._cache) == 2


def test_a_runtime_value_by_keyword_is_left_to_triton(direct):
    kernel = direct
    x = torch.randn(64, device=DEVICE)
    for m in (3, 5):
        out = torch.empty(64, device=DEVICE)
        kernel[(1,)](x, out, 64, m=m, a=1.5, SHIFT=1, BLOCK=64)
        torch.testing.assert_close(out.cpu(), expected(x.cpu(), 64, m, 1.5, 1), rtol=1e-6, atol=1e-5)
    assert not kernel._cache


def test_the_modes_and_a_bad_mode_is_an_error(mode):
    tested = ".".join(triton.__version__.split(".")[:2]) in launch.TESTED
    usable = tested and os.environ.get("TRITON_INTERPRET", "0") != "1"  # never under the interpreter
    assert mode("1") in launch.MODES
    assert launch.current_mode() == ("1" if usable else "0")
    assert mode("0") == ("1" if usable else "0")  # the mode it replaced
    assert launch.current_mode() == "0"
    x = torch.randn(64, device=DEVICE)
    kernel = launch.FastLaunch(_axpb)
    out = torch.empty(64, device=DEVICE)
    kernel[(1,)](x, out, 64, 3, 1.0, SHIFT=0, BLOCK=64)  # mode 0: Triton's launch, nothing kept
    torch.testing.assert_close(out.cpu(), expected(x.cpu(), 64, 3, 1.0, 0), rtol=1e-6, atol=1e-5)
    assert not kernel._cache
    with pytest.raises(ValueError, match="launch mode must be one of"):
        mode("yes")
    assert launch.current_mode() == "0"  # a bad mode changes nothing


@pytest.mark.skipif(DEVICE != "cuda", reason="check mode runs on CUDA only")
def test_check_mode_raises_when_one_key_stands_for_two_kernels(mode, monkeypatch):
    mode("check")
    if launch.current_mode() != "check":
        pytest.skip("check mode needs a tested Triton version")
    kernel = launch.FastLaunch(_axpb)
    x, out = torch.randn(64, device=DEVICE), torch.empty(64, device=DEVICE)
    for _ in range(2):  # the same key and kernel twice: fine
        kernel[(1,)](x, out, 64, 3, 1.0, SHIFT=0, BLOCK=64)
    monkeypatch.setattr(kernel, "key", lambda args, kwargs: "one key for every call")
    kernel[(1,)](x, out, 64, 3, 1.0, SHIFT=0, BLOCK=64)  # the key's first kernel
    with pytest.raises(RuntimeError, match="one key for two compiled kernels"):
        kernel[(1,)](x, out, 64, 3, 1.0, SHIFT=5, BLOCK=64)  # another constexpr: another kernel
