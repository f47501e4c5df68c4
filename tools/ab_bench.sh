#!/usr/bin/env bash
# Before/after on one machine: the same bench with an older copy of the package and with this checkout,
# alternating, in one call (machines differ by up to 30% on the same code, so only runs of one call
# compare). A throwaway run of the same length goes first: on the H200 machines the first bench process
# of a call ran 1.5-2x slow at times, the same code a minute later did not.
#
#   git archive REV tieredemb | (mkdir -p ab_old && tar -x -C ab_old)     # here, before the call
#   bash tools/ab_bench.sh ab_old [ROUNDS] -- cache --device cuda --scale 0.3 --steps 20 --reserve
#
# Prints each run's "ms/step" lines (ours and its peer) tagged old/new; reports go to $OUT/ab-{old,new}.
set -o pipefail
cd "$(dirname "$0")/.."
old="$1"
shift
rounds=2
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
    rounds="$1"
    shift
fi
[ "${1:-}" = "--" ] && shift
if [ ! -d "$old/tieredemb" ]; then
    echo "ab_bench.sh: $old/tieredemb not found (unpack the old package there first)" >&2
    exit 2
fi
OUT="${OUT:-./gpu_out}"
extra="${PYTHONPATH:+:$PYTHONPATH}"
run() {  # $1: tag, $2: package root, rest: bench arguments
    local tag="$1" root="$2"
    shift 2
    (cd /tmp && PYTHONPATH="$root$extra" python3 -m tieredemb.cli bench "$@" --out "$OUT/ab-$tag" 2>&1) \
        | grep -E "ms/step|x \(first" | sed "s/^/$tag  /"
    # the spread of its steps: on a noisy machine the median alone misleads
    python3 tools/step_spread.py "$(ls -t "$OUT/ab-$tag"/*.json | head -n 1)" "$tag"
}
echo "== throwaway run"
run warm "$PWD" "$@" >/dev/null
for ((i = 1; i <= rounds; i++)); do
    run new "$PWD" "$@"
    run old "$(cd "$old" && pwd)" "$@"
done
