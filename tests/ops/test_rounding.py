"""Rounding float32 to 16-bit rows (``tieredemb.ops.rounding``): stochastic rounding lands on one of
the two neighbouring 16-bit values, is unbiased, and depends on its draw alone; the Triton update
kernel rounds bit for bit as the reference does."""

from __future__ import annotations

import pytest
import torch

from tieredemb.ops.rounding import element_bits, round_rows, row_seeds, stochastic_round, table_bases

DTYPES = [torch.bfloat16, torch.float16]


def neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ``dtype`` values around float32 ``x`` (equal where x is one), found by stepping the
    16-bit pattern of torch's round-to-nearest by one: independent of the code under test."""
    near = x.to(dtype)
    bits = near.view(torch.int16).to(torch.int32)
    # one step of the magnitude away from zero (sign-magnitude pattern)
    up_mag = (bits + 1).to(torch.int16).view(dtype)
    down_mag = (bits - 1).to(torch.int16).view(dtype)
    away = near.float().abs() < x.abs()  # the nearest is below |x|: the other is one step out
    other = torch.where(away, up_mag, down_mag).float()
    other = torch.where(near.float() == x, near.float(), other)
    lo = torch.minimum(near.float(), other)
    hi = torch.maximum(near.float(), other)
    return lo, hi


@pytest.mark.parametrize("dtype", DTYPES)
def test_lands_on_a_neighbour(dtype):
    gen = torch.Generator().manual_seed(0)
    # normal values of every scale the table sees, and float16's subnormal range
    x = torch.cat([torch.randn(4000, generator=gen) * 10.0 ** torch.randint(-6, 3, (4000,), generator=gen),
                   torch.rand(1000, generator=gen) * 2e-5 - 1e-5]).view(-1, 1)
    lo, hi = neighbours(x, dtype)
    got = round_rows(x, dtype, torch.arange(x.shape[0])).float()
    assert bool(((got == lo) | (got == hi)).all())
    exact = x.to(dtype).float() == x
    assert torch.equal(got[exact], x[exact])  # a representable value stays


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [1.0 + 2.0**-12, -3.3e-3, 0.7071, 3e-6])
def test_unbiased(dtype, value):
    """Many roundings of one value, each with its own draw: the mean is within a few standard
    errors of the value (round-to-nearest is off by the whole distance to the nearest neighbour)."""
    n = 200_000
    x = torch.full((n, 1), value)
    lo, hi = (t[0, 0].item() for t in neighbours(x[:1], dtype))
    assert lo < value < hi  # not representable: rounding must choose
    got = round_rows(x, dtype, row_seeds(table_bases(7, ["t"], "cpu").expand(n), torch.arange(n), 1))
    p = (value - lo) / (hi - lo)
    stderr = (hi - lo) * (p * (1 - p) / n) ** 0.5
    mean = got.double().mean().item()
    assert abs(mean - value) < 5 * stderr
    nearest = x[:1].to(dtype).double().item()
    assert abs(nearest - value) > 20 * stderr  # the test can tell rounding to nearest apart


def test_draws_depend_on_seed_key_step_and_column_only():
    bases = table_bases(0, ["a", "b"], "cpu")
    keys = torch.tensor([5, 5, 9])
    tables = torch.tensor([0, 1, 0])
    s1 = row_seeds(bases[tables], keys, 3)
    assert torch.equal(s1, row_seeds(bases[tables], keys, 3))  # a pure function
    assert len(set(s1.tolist())) == 3  # table and key both count
    assert not torch.equal(s1, row_seeds(bases[tables], keys, 4))  # so does the step
    assert not torch.equal(bases, table_bases(1, ["a", "b"], "cpu"))  # and the seed
    bits = element_bits(s1, 6)
    assert bits.min() >= 0 and bits.max() < 2**32
    assert len(set(bits[0].tolist())) == 6  # each column its own draw
    # the order of the rows does not matter
    assert torch.equal(element_bits(s1.flip(0), 6), bits.flip(0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype):
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, 1.0, -2.0]])
    got = stochastic_round(x, dtype, element_bits(torch.tensor([123]), 6))
    assert bool(torch.isnan(got[0, 0]))
    assert got[0, 1:].float().tolist() == [float("inf"), -float("inf"), 0.0, 1.0, -2.0]


def test_float32_is_unchanged():
    x = torch.randn(5, 3)
    assert torch.equal(round_rows(x, torch.float32, torch.arange(5)), x)
