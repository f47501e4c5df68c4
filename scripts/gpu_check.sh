#!/usr/bin/env bash
# The GPU check in one call (fits a ~10-minute limit): the CUDA test suite, the rest of the tests with
# CUDA present, then `tieredemb bench hbm` on the GPU. Logs and the bench report go under $OUT
# (./gpu_out when unset); the bench table is printed again as the last lines.
#
#   scripts/gpu_check.sh [--bench-only] [--tests-only] [--profile] [--scale S] [--steps N]
#                        [-- MORE BENCH ARGS]
#
# Runs from a plain checkout: the project is not installed there, so PYTHONPATH points at it.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"

run_tests=1
run_bench=1
run_profile=0
scale=1
steps=50
bench_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bench-only) run_tests=0 ;;
        --tests-only) run_bench=0 ;;
        --profile) run_profile=1 ;;
        --scale) scale="$2"; shift ;;
        --steps) steps="$2"; shift ;;
        --) shift; bench_args=("$@"); break ;;
        *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

# wall-clock guards (seconds): together they stay under the 10-minute call
GPU_TESTS_TIMEOUT=150
OTHER_TESTS_TIMEOUT=200
BENCH_TIMEOUT=220
PROFILE_TIMEOUT=120

echo "== machine"
nvidia-smi -L
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")'

status=0
gpu_rc=skipped
other_rc=skipped
bench_rc=skipped
if [ "$run_tests" = 1 ]; then
    echo "== tests/gpu"
    timeout "$GPU_TESTS_TIMEOUT" python3 -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 \
        | tee "$OUT/pytest.log"
    gpu_rc=$?
    echo "== tests (CUDA present: suites parametrized over devices run on cuda too)"
    timeout "$OTHER_TESTS_TIMEOUT" python3 -m pytest -q -p no:cacheprovider tests \
        --ignore=tests/gpu -k "not interop" 2>&1 | tee -a "$OUT/pytest.log"
    other_rc=$?
    [ "$gpu_rc" = 0 ] || status=1
    [ "$other_rc" = 0 ] || status=1
fi

if [ "$run_bench" = 1 ]; then
    echo "== bench hbm (scale $scale)"
    # the command line's entry point when it has `bench`, else the bench module itself
    if python3 -m tieredemb.cli bench hbm --help >/dev/null 2>&1; then
        bench=(python3 -m tieredemb.cli bench)
    else
        bench=(python3 -m tieredemb.bench)
    fi
    timeout "$BENCH_TIMEOUT" "${bench[@]}" hbm --device cuda --scale "$scale" --steps "$steps" \
        --out "$OUT" "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log"
    bench_rc=$?
    [ "$bench_rc" = 0 ] || status=1
fi

if [ "$run_profile" = 1 ]; then
    echo "== profile of steady-state steps (adam, scale $scale)"
    timeout "$PROFILE_TIMEOUT" python3 scripts/profile_step.py --scale "$scale" 2>&1 | tee "$OUT/profile.log"
fi

echo
echo "== summary: tests/gpu rc=$gpu_rc, other tests rc=$other_rc, bench rc=$bench_rc" \
     "(124: timed out)"
if [ "$run_tests" = 1 ]; then
    grep -E "[0-9]+ (passed|failed|errors?|skipped)" "$OUT/pytest.log" | tail -n 2
fi
table=$(ls -t "$OUT"/*-hbm.txt 2>/dev/null | head -n 1)
if [ -n "$table" ]; then
    cat "$table"
    grep -E "^check " "$OUT/bench.log" || true
fi
exit "$status"
