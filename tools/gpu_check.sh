#!/usr/bin/env bash
# The GPU check in one call (fits a ~10-minute limit): the CUDA test suite, the rest of the tests with
# CUDA present, then `tieredemb bench hbm`, `bench cache` and `bench ssd` on the GPU. Logs and the
# bench reports go under $OUT (./gpu_out when unset); the bench tables are printed again at the end.
# The cache benches run only while the script's 10-minute deadline leaves them time (each gets
# CACHE_TIMEOUT or what is left); --cache-only runs them alone. The hbm bench includes --pipeline and
# --capacity (bounded tables, 400k rows a table at scale 1).
#
#   tools/gpu_check.sh [--bench-only] [--tests-only] [--cache-only] [--no-cache] [--profile]
#                        [--dist] [--stash] [--tbe] [--check-launch] [--ssd-fit] [--ssd-tier] [--sharded-one] [--gpu-tests] [--ab OLD_DIR [--variant ARGS]... [--ab-args ARGS]]
#                        [--scale S] [--steps N]
#                        [--cache-scale S] [--cache-steps N] [-- MORE HBM BENCH ARGS]
#
# --ab OLD_DIR: tests/gpu (not with --bench-only), then `tools/kernel_bench.py` SGD and Adam with the package in OLD_DIR
# (unpack it first: git archive REV tieredemb | tar -x -C OLD_DIR) and with this checkout (also with
# each --variant's kernel_bench arguments, e.g. "--set _REDUCE_TILE=64" or "--no-early-lookup"),
# alternating, in one call (machine starts differ by up to 30%: only one call's runs compare); last,
# each kernel's GPU time in the Adam step, new and old. --ab-args: arguments for every kernel_bench
# run of both, e.g. "--overlap deferred" (TrainPipeline's loop, where the step is the GPU's).
#
# --stash: only the stashing tests (tests/gpu/test_cuda_stash.py, tests/pipeline/test_stash.py) and
# `bench stash` (with --long-steps 200); extra bench arguments after --.
#
# --tbe: only ours against FBGEMM's TBE (carry .peers: ../shared/peers/fbgemm), in turns: bench hbm at
# batch 10,486 and 1,311 (SGD, row-wise Adagrad, Adam; plain and TrainPipeline) and bench cache
# --reserve against MANAGED_CACHING; the TBE lines and row checks are printed, the reports go to $OUT.
#
# --check-launch: only the CUDA kernel, index and module suites with TIEREDEMB_FAST_LAUNCH=check (every
# launch through Triton, an error if one FastLaunch key stands for two compiled kernels): run it before
# adding a Triton version to tieredemb.ops.triton.launch.TESTED.
#
# --gpu-tests: only tests/gpu and the suites that run on CUDA where it is present (the kernels, the
# index, 16-bit rows, reads ahead, the host tier): a few minutes, where --tests-only takes ten.
#
# --ssd-fit: only the host tier with the tables in its reach: `bench ssd` at scale 0.1 with a 6 GiB
# tier (against the same cache over HostMemory, in turns), then tools/profile_step.py --time of the
# two alone, in turns (2 rounds): the cache over HostMemory and the device cache over the tier. With
# --ab OLD_DIR (carry it): no bench; the two profile_step runs, plain and under TrainPipeline, each
# with this checkout's package and OLD_DIR's in turns.
#
# --ssd-tier: only the host tier of 10% of the tables: `bench ssd` as benchmarks/results/ssd.md's
# command (plain loop, TrainPipeline with the 16 x 8192 dense model, the disk measured), then
# tools/profile_step.py --time of the TrainPipeline run (insertions by path, the tier's counters).
#
# --sharded-one: only the sharded step at world size one (NCCL, one GPU): its GPU tests, then
# tools/profile_step.py --sharded --time (hbm, Adam), with --ab OLD_DIR (carry it) in turns with
# OLD_DIR's package (3 rounds), the unsharded step, its host time by stage (--host), and the torch
# profile of the sharded step.
#
# --dist (a machine with 2 or more GPUs): only the sharded tests on NCCL (tests/distributed -k "cuda or nccl",
# and the distributed checkpoint tests) and `bench dist` over 1, 2 (and 4) GPUs.
#
# Runs from a plain checkout: the project is not installed there, so PYTHONPATH points at it.
set -o pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# FBGEMM's TBE, the benches' peer, where a packed copy travelled along (.peers/fbgemm: its setup.sh
# unpacks it) and fbgemm_gpu is not installed already
if [ -f .peers/fbgemm/setup.sh ] && ! python3 -c "import fbgemm_gpu" 2>/dev/null; then
    PYTHONPATH="$(bash .peers/fbgemm/setup.sh /tmp/fbgemm):$PYTHONPATH"
fi
# the stores' Python packages where the machine lacks them and their wheels travelled along (.whl:
# rocksdict, redis; carry [".whl"])
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import rocksdict, redis" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # (absolute: some runs start from /tmp)

run_tests=1
run_dist=0
run_stash=0
run_tbe=0
run_check_launch=0
run_ssd_fit=0
run_ssd_tier=0
run_sharded_one=0
run_gpu_tests=0
ab_old=""
variants=()
ab_args=""
run_bench=1
run_profile=0
run_hbm=1
run_cache=1
scale=1
steps=50
cache_scale=0.3
cache_steps=20
bench_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bench-only) run_tests=0 ;;
        --tests-only) run_bench=0 ;;
        --profile) run_profile=1 ;;
        --dist) run_dist=1 ;;
        --stash) run_stash=1 ;;
        --tbe) run_tbe=1 ;;
        --check-launch) run_check_launch=1 ;;
        --ssd-fit) run_ssd_fit=1 ;;
        --ssd-tier) run_ssd_tier=1 ;;
        --sharded-one) run_sharded_one=1 ;;
        --gpu-tests) run_gpu_tests=1 ;;
        --ab) ab_old="$2"; shift ;;
        --variant) variants+=("$2"); shift ;;
        --ab-args) ab_args="$2"; shift ;;
        --cache-only) run_tests=0; run_hbm=0 ;;
        --no-cache) run_cache=0 ;;
        --cache-scale) cache_scale="$2"; shift ;;
        --cache-steps) cache_steps="$2"; shift ;;
        --scale) scale="$2"; shift ;;
        --steps) steps="$2"; shift ;;
        --) shift; bench_args=("$@"); break ;;
        *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

# wall-clock guards (seconds): together they stay under the 10-minute call
GPU_TESTS_TIMEOUT=240  # 36 s with Triton's cache warm; a fresh machine compiles the kernels first
OTHER_TESTS_TIMEOUT=330
BENCH_TIMEOUT=220
PROFILE_TIMEOUT=120
CACHE_TIMEOUT=200   # each of bench cache, bench ssd
DEADLINE=580        # seconds since the start: nothing is started that could run past it

echo "== machine"
nvidia-smi -L
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")'

if [ "$run_tests" = 1 ] && ! python3 -c 'import rocksdict' 2>/dev/null; then
    echo "gpu_check: rocksdict is missing (the RocksDB tests would fail on the import): install the" \
         "wheels in .whl first, as the device tool's README says" >&2
    exit 2
fi

if [ "$run_stash" = 1 ]; then
    echo "== stash tests"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_stash.py tests/pipeline/test_stash.py \
        2>&1 | tail -n 15
    echo "== bench stash"
    timeout 360 python3 -m tieredemb.cli bench stash --long-steps 200 --out "$OUT" "${bench_args[@]}" 2>&1 \
        | grep -v -i warn | tail -n 25
    exit 0
fi

if [ "$run_gpu_tests" = 1 ]; then
    echo "== tests/gpu"
    timeout "$GPU_TESTS_TIMEOUT" python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -n 15
    echo "== the suites that run on CUDA where it is present"
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/ops tests/index tests/modules/test_row_dtype.py \
        tests/modules/test_read_ahead.py tests/storage/test_host_tier.py 2>&1 | tail -n 8
    exit 0
fi

# the ssd workload of benchmarks/results/ssd.md (its host budget and dense model added per run)
ssd_bench=(python3 -m tieredemb.cli bench ssd --device cuda --scale 0.1 --budget-fraction 0.01 --store-rows 0.2
           --block-cache 64MiB --lookahead 2 --warmup 60 --steps 40 --out "$OUT")
if [ "$run_ssd_tier" = 1 ]; then
    echo "== bench ssd, a host tier of 10% of the tables"
    (cd /tmp && timeout 380 "${ssd_bench[@]}" --host-budget 0.1 --dense-width 8192 --dense-layers 16) 2>&1 | \
        tee "$OUT/ssd-tier.log" | grep -E "ms/step|ratio|host_tier|floor|counters|disk \(|check"
    echo "== profile_step --time, TrainPipeline with the dense model"
    timeout 150 python3 tools/profile_step.py --workload ssd --scale 0.1 --budget-fraction 0.01 --host-budget 0.1 \
        --store-rows 0.2 --store-process --lookahead 2 --warmup 40 --steps 20 --pipeline --dense-layers 16 \
        --dense-width 8192 --time 2>&1 | tail -n 2
    exit 0
fi

if [ "$run_sharded_one" = 1 ]; then
    echo "== the sharded step's GPU tests (its host reads, the owners' captured serve)"
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_syncs.py tests/gpu/test_cuda_capture.py \
        -k shard 2>&1 | tail -n 25
    one() {  # package root, more profile_step arguments: its ms a step
        PYTHONPATH="$1:$PYTHONPATH" timeout 90 python3 tools/profile_step.py --steps 40 --warmup 8 --time "${@:2}" \
            2>&1 | grep "ms a step"
    }
    echo "== profile_step --sharded --time${ab_old:+ (this checkout, then $ab_old, in turns)}"
    for round in 1 2 3; do
        echo "round $round: $(one "$PWD" --sharded)${ab_old:+ | old: $(one "$(cd "$ab_old" && pwd)" --sharded)}"
    done
    echo "unsharded: $(one "$PWD")"
    echo "== host ms a step of the sharded step (this checkout; median per step)"
    timeout 90 python3 tools/profile_step.py --sharded --host --steps 30 2>&1 | grep -E "^  (prefetch|forward|backward) "
    echo "== torch profile of the sharded step"
    (mkdir -p "$OUT/sharded" && OUT="$OUT/sharded" timeout 120 python3 tools/profile_step.py --sharded --steps 5 \
        2>&1 | grep -v -i warn | head -n 45)
    exit 0
fi

if [ "$run_ssd_fit" = 1 ]; then
    common=(--scale 0.1 --budget-fraction 0.01 --lookahead 2 --warmup 60 --steps 40 --time)
    tier="--workload ssd --store-rows 0.2 --store-process --host-budget 6442450944"
    fit() {  # tag, package root, profile_step arguments: its ms a step, tagged
        # shellcheck disable=SC2068 (the arguments are words)
        echo "$1 ${*:3}: $(PYTHONPATH="$2:$PYTHONPATH" timeout 90 python3 tools/profile_step.py \
            "${common[@]}" ${@:3} 2>&1 | tail -n 1)"
    }
    if [ -n "$ab_old" ]; then  # with --ab OLD_DIR: this checkout and OLD_DIR's package in turns, plain
        old_root="$(cd "$ab_old" && pwd)"  # loop and TrainPipeline, no bench
        for args in "--workload cache" "$tier" "--workload cache --pipeline" "$tier --pipeline"; do
            fit new "$PWD" "$args"
            fit old "$old_root" "$args"
        done
        exit 0
    fi
    echo "== bench ssd, a host tier that holds the tables"
    timeout 240 "${ssd_bench[@]}" --host-budget 6GiB 2>&1 | grep -E "ms/step|ratio|host_tier:|passed|equal|rows of"
    for round in 1 2; do
        fit "round $round, HostMemory:" "$PWD" --workload cache
        fit "round $round, host tier:" "$PWD" "$tier"
    done
    exit 0
fi

if [ "$run_check_launch" = 1 ]; then
    echo "== CUDA suites with TIEREDEMB_FAST_LAUNCH=check"
    TIEREDEMB_FAST_LAUNCH=check timeout 500 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/ops \
        tests/index tests/modules 2>&1 | tail -n 15
    exit "${PIPESTATUS[0]}"
fi

if [ -n "$ab_old" ]; then
    if [ "$run_tests" = 1 ]; then
        echo "== tests/gpu"
        timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tail -n 15 | tee "$OUT/pytest.log"
    fi
    here="$PWD"
    old_root="$(cd "$ab_old" && pwd)"
    kb() {  # tag, package root, optimizer, more kernel_bench arguments: the step's line and the
            # reduction's (and a profile's kernel lines), tagged
        # shellcheck disable=SC2086 (ab_args is a list of arguments)
        (cd /tmp && PYTHONPATH="$2" timeout 90 python3 "$here/tools/kernel_bench.py" --optimizer "$3" \
            --repeats 10 $ab_args "${@:4}" 2>&1) | grep -E "^step|^reduce_update|Error|^  " | sed "s/^/$1 $3 /"
    }
    echo "== kernel_bench, new ($here) / new with each variant / old ($old_root)"
    kb warm "$here" sgd >/dev/null
    kb warm "$here" adam >/dev/null
    for optimizer in sgd adam sgd adam; do
        kb new "$here" "$optimizer"
        for variant in "${variants[@]}"; do
            # shellcheck disable=SC2086 (a variant is a list of arguments)
            kb "new[$variant]" "$here" "$optimizer" $variant
        done
        kb old "$old_root" "$optimizer"
    done 2>&1 | tee "$OUT/ab.log"
    echo "== GPU time per kernel, Adam, new / old"
    kb new "$here" adam --profile 2>&1 | grep -v -E " (step|reduce_update) " | tee -a "$OUT/ab.log"
    kb old "$old_root" adam --profile 2>&1 | grep -v -E " (step|reduce_update) " | tee -a "$OUT/ab.log"
    exit 0
fi

if [ "$run_tbe" = 1 ]; then
    # ours against FBGEMM's TBE, in turns (benchmarks/results/hbm.md, cache.md): both batch sizes,
    # every optimizer TBE trains on fp32 rows, then the cache over pinned host memory
    python3 -c "import fbgemm_gpu" 2>/dev/null || { echo "gpu_check --tbe: fbgemm_gpu does not import" \
        "(carry .peers: cp -r ../shared/peers/fbgemm .peers/)" >&2; exit 2; }
    bench=(python3 -m tieredemb.bench)
    for batch in 10486 1311; do
        echo "== bench hbm --batch-size $batch"
        timeout 200 "${bench[@]}" hbm --device cuda --optimizers sgd,rowwise_adagrad,adam --pipeline \
            --steps 30 --warmup 10 --batch-size "$batch" --out "$OUT/tbe-$batch" "${bench_args[@]}" \
            2>"$OUT/tbe-$batch.log" | grep -E "TBE|^check" | cut -c1-160
    done
    echo "== bench cache --reserve"
    timeout 200 "${bench[@]}" cache --device cuda --scale "$cache_scale" --reserve --out "$OUT/tbe-cache" \
        2>"$OUT/tbe-cache.log" | grep -E "TBE|ours / all|^check" | cut -c1-160
    exit 0
fi

if [ "$run_dist" = 1 ]; then
    gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
    echo "== tests/distributed on NCCL ($gpus GPUs)"
    # TorchRec (where its wheels travelled along) imports over the FBGEMM peer with this shim
    PYTHONPATH="$PWD/tools/torchrec_on_peer:$PYTHONPATH" timeout 300 python3 -m pytest -q -p no:cacheprovider \
        tests/distributed -k "cuda or nccl" 2>&1 | tail -n 3
    worlds=1,2
    [ "$gpus" -ge 4 ] && worlds=1,2,4
    echo "== bench dist --gpus $worlds"
    timeout 240 python3 -m tieredemb.cli bench dist --gpus "$worlds" --scale 0.25 --steps 30 \
        --out "$OUT" 2>&1 | grep -v -i warn | tail -n 8
    exit 0
fi

status=0
gpu_rc=skipped
other_rc=skipped
bench_rc=skipped
cache_rc=skipped
ssd_rc=skipped
if [ "$run_tests" = 1 ]; then
    echo "== tests/gpu"
    timeout "$GPU_TESTS_TIMEOUT" python3 -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 \
        | tee "$OUT/pytest.log"
    gpu_rc=$?
    # four shards side by side, 4 CPU threads each (one suite after another ran past 330 s on the
    # H200 machine; four with torch's 16 threads each did too)
    echo "== tests (CUDA present: suites parametrized over devices run on cuda too), 4 shards"
    shards=("tests/modules tests/ops" "tests/storage tests/index tests/checkpoint"
            "tests/pipeline tests/distributed tests/bench" "$(ls tests/test_*.py | tr '\n' ' ')")
    pids=()
    for i in "${!shards[@]}"; do
        # shellcheck disable=SC2086 (a shard is a list of paths)
        OMP_NUM_THREADS=4 timeout "$OTHER_TESTS_TIMEOUT" python3 -m pytest -q -p no:cacheprovider ${shards[$i]} \
            -k "not interop" >"$OUT/pytest-$i.log" 2>&1 &
        pids+=($!)
    done
    other_rc=0
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || other_rc=$?
        { echo "shard $i (${shards[$i]}): $(grep -E "[0-9]+ (passed|failed)" "$OUT/pytest-$i.log" | tail -n 1)"
          grep -E "^(FAILED|ERROR) " "$OUT/pytest-$i.log" | head -n 20; } | tee -a "$OUT/pytest.log"
    done
    [ "$gpu_rc" = 0 ] || status=1
    [ "$other_rc" = 0 ] || status=1
fi

# the command line's entry point when it has `bench`, else the bench module itself
if python3 -m tieredemb.cli bench hbm --help >/dev/null 2>&1; then
    bench=(python3 -m tieredemb.cli bench)
else
    bench=(python3 -m tieredemb.bench)
fi

if [ "$run_bench" = 1 ] && [ "$run_hbm" = 1 ]; then
    echo "== bench hbm (scale $scale)"
    # with the bounded tables of DynamicEmb's case (10k misses and evictions a table a step); 30 warmup
    # steps fill them (the timed steps evict)
    timeout "$BENCH_TIMEOUT" "${bench[@]}" hbm --device cuda --pipeline --scale "$scale" --steps "$steps" \
        --capacity "$(python3 -c "print(max(64, round(400000 * $scale)))")" --warmup 30 \
        --out "$OUT" "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log"
    bench_rc=$?
    [ "$bench_rc" = 0 ] || status=1
fi

# bench cache / bench ssd: 10 tables x (10M x cache_scale) rows, HBM budget 10% of the footprint
if [ "$run_bench" = 1 ] && [ "$run_cache" = 1 ]; then
    for workload in cache ssd; do
        left=$((DEADLINE - SECONDS))
        limit=$(( left < CACHE_TIMEOUT ? left : CACHE_TIMEOUT ))
        if [ "$limit" -lt 60 ]; then
            echo "== bench $workload skipped: ${left}s left before the deadline"
            continue
        fi
        echo "== bench $workload (scale $cache_scale, ${limit}s)"
        extra=()
        [ "$workload" = cache ] && extra=(--reserve)  # the host store page-locked up front
        timeout "$limit" "${bench[@]}" "$workload" --device cuda --scale "$cache_scale" \
            --steps "$cache_steps" --out "$OUT" "${extra[@]}" 2>&1 | tee "$OUT/bench-$workload.log"
        rc=$?
        [ "$rc" = 0 ] || status=1
        if [ "$workload" = cache ]; then cache_rc=$rc; else ssd_rc=$rc; fi
    done
fi

if [ "$run_profile" = 1 ]; then
    echo "== profile of steady-state steps (adam, scale $scale)"
    timeout "$PROFILE_TIMEOUT" python3 tools/profile_step.py --scale "$scale" 2>&1 | tee "$OUT/profile.log"
fi

echo
echo "== summary: tests/gpu rc=$gpu_rc, other tests rc=$other_rc, bench rc=$bench_rc," \
     "bench cache rc=$cache_rc, bench ssd rc=$ssd_rc (124: timed out)"
if [ "$run_tests" = 1 ]; then
    grep -E "[0-9]+ (passed|failed|errors?|skipped)" "$OUT/pytest.log" | tail -n 2
fi
table=$(ls -t "$OUT"/*-hbm.txt 2>/dev/null | head -n 1)
if [ -n "$table" ]; then
    cat "$table"
    grep -E "^check " "$OUT/bench.log" || true
fi
for workload in cache ssd; do
    table=$(ls -t "$OUT"/*-"$workload".txt 2>/dev/null | head -n 1)
    if [ -n "$table" ]; then
        echo
        cat "$table"
    fi
done
exit "$status"
