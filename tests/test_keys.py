"""The bottom layer ``tieredemb.keys``: the reserved key where users find it, reference values of the
hashes, and no import of the package (everything else may import it)."""

from __future__ import annotations

import ast
import pathlib

import torch

import tieredemb as te
import tieredemb.config
import tieredemb.keys as keys


def test_reserved_key_is_one_value_everywhere():
    assert keys.RESERVED_KEY == -(2**63)
    assert te.RESERVED_KEY == tieredemb.config.RESERVED_KEY == keys.RESERVED_KEY


def test_imports_nothing_of_the_package():
    tree = ast.parse(pathlib.Path(keys.__file__).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
    assert not [m for m in imported if m == "tieredemb" or m.startswith("tieredemb.")]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]


def test_shr_is_logical():
    x = torch.tensor([-1, -(2**63), 2**62], dtype=torch.int64)
    assert keys.shr(x, 60).tolist() == [15, 8, 4]


def test_splitmix64_reference_values():
    # splitmix64's first outputs from state 0 (Vigna's reference), as int64: the finalizer applied to
    # golden, 2 golden, ... (the increment is inside ``splitmix64``: inputs 0, golden, ...)
    seq = torch.tensor([0, keys.GOLDEN], dtype=torch.int64)
    expect = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    assert keys.splitmix64(seq).tolist() == [e - 2**64 if e >= 2**63 else e for e in expect]


def test_bucket_of_is_in_range_and_monotone_in_the_hash():
    k = torch.arange(-5000, 5000, dtype=torch.int64)
    b8, b16 = keys.bucket_of(k, 8), keys.bucket_of(k, 16)
    assert int(b8.min()) >= 0 and int(b8.max()) < 8
    assert torch.equal(b16 // 2, b8)  # doubling the buckets splits each in two


def test_stable_name_hash_is_fixed():
    assert keys.stable_name_hash("user") == keys.stable_name_hash("user")
    assert keys.stable_name_hash("user") != keys.stable_name_hash("item")
