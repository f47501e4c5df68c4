"""Bad input to ``tieredemb bench`` ends before anything runs, in one line naming the option: argparse's
error (exit status 2) for a number out of range, an exception the command line prints for a path it
cannot write to, a device it does not have, or a value the bench rejects."""

from __future__ import annotations

import pytest
import torch

from tieredemb.bench import main

# a run as small as each bench goes, before the bad option: should the check ever go, the test still
# ends in seconds
SMALL = {"hbm": ["--scale", "0.0005", "--steps", "1", "--warmup", "0", "--optimizers", "sgd"],
         "cache": ["--scale", "0.0005", "--steps", "1", "--warmup", "0"],
         "ssd": ["--scale", "0.0005", "--steps", "1", "--warmup", "0", "--raw-rows", "100"],
         "dist": ["--scale", "0.001", "--steps", "1", "--warmup", "0", "--device", "cpu"],
         "stash": ["--scale", "0.001", "--steps", "1", "--warmup", "0", "--width", "8", "--layers", "1"],
         "checkpoint": ["--rows", "100", "--dim", "4", "--buffer-mib", "1"]}


@pytest.mark.parametrize(("args", "message"), [
    (["hbm", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["hbm", "--scale", "nan"], "argument --scale: must be a finite number > 0, got nan"),
    (["hbm", "--threads", "two"], "argument --threads: not an integer: 'two'"),
    (["cache", "--budget-fraction", "1"], "argument --budget-fraction: must be below 1, got 1"),
    (["ssd", "--shards", "0"], "argument --shards: must be at least 1, got 0"),
    (["dist", "--gpus", "1,x"], "argument --gpus: not an integer: 'x'"),
    (["stash", "--width", "-4"], "argument --width: must be at least 1, got -4"),
    (["checkpoint", "--rows", "0"], "argument --rows: must be at least 1, got 0"),
])
def test_a_number_out_of_range_is_an_argparse_error(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main([args[0], *SMALL[args[0]], "--device", "cpu", "--out", str(tmp_path), *args[1:]])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"tieredemb bench {args[0]}: error: {message}"


@pytest.mark.parametrize("case", ["out is a file", "out under a file", "dir is a file", "kernels",
                                  "too many processes", "cuda"])
def test_a_bad_path_device_or_value_raises_a_one_line_error(case, tmp_path):
    a_file = tmp_path / "results.txt"
    a_file.write_text("")
    args, match = {
        "out is a file": (["hbm", "--out", str(a_file)], f"--out {a_file}: {a_file} is not a directory"),
        "out under a file": (["cache", "--out", str(a_file / "x")], f"{a_file} is not a directory"),
        "dir is a file": (["ssd", "--dir", str(a_file)], f"--dir {a_file}: {a_file} is not a directory"),
        "kernels": (["hbm", "--kernels", "cuda"], "--kernels: unknown kernels 'cuda'"),
        "too many processes": (["dist", "--device", "cpu", "--gpus", "1,4096"],
                               "--gpus 1,4096: asked for up to 4096 processes"),
        "cuda": (["hbm", "--device", "cuda"], "--device cuda, but CUDA is not available"),
    }[case]
    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError) as caught:
        main([args[0], *SMALL[args[0]], "--device", "cpu", "--out", str(tmp_path / "out"), *args[1:]])
    assert match in str(caught.value) and "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]  # nothing written


@pytest.mark.parametrize("flag, want",
                         [([], True), (["--direct-reads"], True), (["--no-direct-reads"], False)])
def test_ssd_reads_with_o_direct_unless_told_not_to(flag, want, tmp_path, monkeypatch):
    from tieredemb.bench import cache

    seen = {}

    class Built(Exception):
        pass

    def capture(self, options, log=None):
        seen["options"] = options
        raise Built

    monkeypatch.setattr(cache.CacheBench, "__init__", capture)
    with pytest.raises(Built):
        main(["ssd", "--scale", "0.0005", "--device", "cpu", "--out", str(tmp_path), *flag])
    assert seen["options"].direct_reads is want
