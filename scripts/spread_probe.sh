#!/usr/bin/env bash
# Is the cache step's per-process spread the pages under the pinned host rows? (issue 7, session 29)
# Runs of one `bench cache` in one call differ by 0.5-1 ms a step, every step of a run alike.
#  1. scripts/huge_pages_probe.py, ROUNDS processes a way of pinning: torch's cudaHostAlloc ("torch"),
#     torch's malloc + cudaHostRegister with glibc advising huge pages ("torch+env", the variables in
#     HUGE_ENV: no code change), and memory advised MADV_HUGEPAGE then registered ("huge").
#  2. `bench cache` BENCH_ROUNDS times a side, alternating. SIDES (default "plain huge-env") lists them:
#     plain; huge-env (under HUGE_ENV); seq (ours and the peer one after the other, --interleave 0).
#     Last, each run's ratio and the host's speed (python_loop_ms).
#
#   OUT=... [SIDES=plain] bash scripts/spread_probe.sh [ROUNDS] [BENCH_ROUNDS] [-- MORE BENCH CACHE ARGS]
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="$(mkdir -p "${OUT:-./gpu_out}" && cd "${OUT:-./gpu_out}" && pwd)"
rounds="${1:-3}"
bench_rounds="${2:-2}"
shift 2 2>/dev/null
[ "${1:-}" = "--" ] && shift
HUGE_ENV=(PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8
          GLIBC_TUNABLES=glibc.malloc.hugetlb=1)

echo "== machine"
nvidia-smi -L
echo "THP enabled: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
echo "THP defrag:  $(cat /sys/kernel/mm/transparent_hugepage/defrag)"
grep -E "MemTotal|MemFree|HugePages_Total|Hugepagesize|AnonHugePages" /proc/meminfo

[ "$rounds" -gt 0 ] && echo "== huge_pages_probe.py, $rounds processes a way"
for ((i = 1; i <= rounds; i++)); do
    timeout 90 python3 scripts/huge_pages_probe.py --alloc torch 2>&1 | tail -n 1 | sed "s/^/torch      /"
    timeout 90 env "${HUGE_ENV[@]}" python3 scripts/huge_pages_probe.py --alloc torch 2>&1 | tail -n 1 \
        | sed "s/^/torch+env  /"
    timeout 90 python3 scripts/huge_pages_probe.py --alloc huge 2>&1 | tail -n 1 | sed "s/^/huge       /"
done | tee "$OUT/probe.log"

# the bench in a process that first times a fixed pure-Python loop on its main thread (is the spread
# the host's speed?) and says which CPU it ran on; nvidia-smi samples the GPU's clocks beside it
CPU_TIMED='import runpy, sys, time
t = time.perf_counter(); sum(i * i for i in range(2_000_000)); ms = (time.perf_counter() - t) * 1e3
cpu = open("/proc/self/stat").read().rsplit(")", 1)[1].split()[36]
print(f"python loop {ms:.1f} ms on cpu {cpu}", flush=True)
sys.argv = ["tieredemb"] + sys.argv[1:]
runpy.run_module("tieredemb.cli", run_name="__main__")'
bench() {  # $1: tag, rest: env assignments
    local tag="$1"
    shift
    nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader,nounits \
        -lms 500 >"$OUT/clocks-$tag.csv" 2>/dev/null &
    local smi=$!
    (cd /tmp && timeout 150 env "$@" python3 -c "$CPU_TIMED" bench cache --device cuda --scale 0.3 \
        --steps 30 --reserve "${side_args[@]}" "${bench_args[@]}" --out "$OUT/bench-$tag" 2>&1) | grep -E "ms/step|python loop" \
        | sed "s/^/$tag  /"
    kill "$smi" 2>/dev/null
    python3 scripts/step_spread.py "$(ls -t "$OUT/bench-$tag"/*.json | head -n 1)" "$tag"
    sort -t, -k1 -n "$OUT/clocks-$tag.csv" | awk -F, -v tag="$tag" '{c[NR] = $1; p += $3} END {
        if (NR) printf "%s  SM clock median %s MHz (min %s), power mean %.0f W, %d samples\n",
            tag, c[int((NR + 1) / 2)], c[1], p / NR, NR}'
}
bench_args=("$@")
echo "== bench cache, $bench_rounds runs a side (${SIDES:-plain huge-env}), alternating"
for ((i = 1; i <= bench_rounds; i++)); do
    for side in ${SIDES:-plain huge-env}; do
        side_args=()
        case "$side" in
            huge-env) bench huge-env "${HUGE_ENV[@]}" ;;
            seq) side_args=(--interleave 0); bench seq ;;  # ours, then the peer (before session 29)
            *) bench "$side" ;;
        esac
    done
done 2>&1 | tee "$OUT/bench.log"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
print("== ratio ours / all in HBM by run")
for f in sorted(pathlib.Path(sys.argv[1]).glob("bench-*/*-cache.json")):
    r = json.loads(f.read_text())
    loops = [x["extra"].get("python_loop_ms") for x in r["results"] if x.get("extra")]
    print(f"{f.parent.name:10s} {f.stem}: {r['ratio_vs_all_hbm'] or 0:.3f}x, "
          + ", ".join(f"{x['label']} {x['step_ms'] or 0:.3f} ms" for x in r["results"])
          + f"; python loop at start {r['machine'].get('python_loop_ms') or 0:.1f} ms, at the ends "
          + " / ".join(f"{v:.1f}" for v in loops if v))
PY
