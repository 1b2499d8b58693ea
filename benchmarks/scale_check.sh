#!/usr/bin/env bash
# What a 2-core machine cannot run, in one command on a machine with cores to spare (the lent GPU
# machine's 16 cores and 128 GiB; CPU only), within a budget: each part gets its share of
# BUDGET_S (default 540 s, under the device tool's 600 s per command) and is stopped at it, what
# it wrote kept. Parts, in order (PARTS picks some, e.g. PARTS="speedup load"):
#
#   scale   benchmarks/bench_scale.py: 32 volunteers, a storm of 8 into 24, sync then DiLoCo
#   round   the N = 16 testbed run and the round model's check against it (needs root, tc, netns)
#   load    benchmarks/bench_coordinator_load.py at 200 viewers + 1,000 volunteers, the load
#           generator on its own cores (taskset), the coordinator on the rest
#   speedup benchmarks/bench_speedup.py: time to a held-out loss with 1, 2, 4 and 8 volunteers of
#           2 cores each, both modes
#
#   benchmarks/scale_check.sh                  # on the big machine: results under $OUT or benchmarks/results/scale_check-TIME/
#   SIZE=small benchmarks/scale_check.sh       # the same parts at a size this 2-core machine holds (a check of the script)
#
# The machine must have what `make install` installs (a virtual environment carried with the
# tree, or PYTHON pointing at one).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-benchmarks/results/scale_check-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-540}
PARTS=${PARTS:-"scale round load speedup"}
CORES=$(nproc)
read -r -a parts <<< "$PARTS"
share=$(( BUDGET_S / ${#parts[@]} ))
log="$OUT/scale_check.log"
echo "scale_check: $CORES cores, $(free -g | awk '/Mem:/ {print $2}') GiB, parts: $PARTS, ${share} s each, size ${SIZE:-full}" | tee "$log"

if [[ "${SIZE:-full}" == small ]]; then
    SCALE_ARGS=(--peers 4 --storm 1 --epochs-after 1 --stagger-s 3)
    LOAD_ARGS=(--viewers 5 --volunteers 20 --seconds 20 --baseline-seconds 10)
    SPEEDUP_ARGS=(--volunteers 1,2 --cores 1 --modes sync --budget-min 2 --target-loss 5.0)
    TESTBED_PEERS=2
else
    SCALE_ARGS=(--peers 32 --storm 8 --epochs-after 3)
    LOAD_ARGS=(--viewers 200 --volunteers 1000 --seconds 60)
    SPEEDUP_ARGS=(--volunteers 1,2,4,8 --cores 2 --modes sync,diloco)
    TESTBED_PEERS=16
fi

part() {  # NAME SECONDS COMMAND...: run it under the part's share, its output in the log
    local name=$1 seconds=$2
    shift 2
    echo "== $name ($seconds s): $*" | tee -a "$log"
    local t0=$SECONDS
    timeout --signal=INT --kill-after=20 "$seconds" "$@" >> "$log" 2>&1
    local rc=$?
    echo "== $name: exit $rc after $(( SECONDS - t0 )) s" | tee -a "$log"
}

for p in "${parts[@]}"; do
    case $p in
        scale)
            part scale-sync $(( share / 2 )) "$PY" benchmarks/bench_scale.py --mode sync "${SCALE_ARGS[@]}"
            part scale-diloco $(( share / 2 )) "$PY" benchmarks/bench_scale.py --mode diloco "${SCALE_ARGS[@]}"
            cp benchmarks/results/bench_scale_*.json "$OUT/" 2>/dev/null ;;
        round)
            if [[ $(id -u) -ne 0 ]]; then
                echo "== round: skipped, needs root (network namespaces and tc)" | tee -a "$log"
                continue
            fi
            part round-testbed $(( share * 3 / 4 )) "$PY" -m crowdtrain.cli testbed run --peers "$TESTBED_PEERS" \
                --rate 100mbit --minutes 3 --step-s 10 --target-batch-size 96 --out "$OUT/tb-r100-n$TESTBED_PEERS"
            part round-model $(( share / 4 )) "$PY" benchmarks/bench_round_model.py --runs "$OUT/tb-r100-n$TESTBED_PEERS" \
                --out "$OUT/bench_round_model.json" ;;
        load)
            # The generator on the last quarter of the cores, the coordinator on the rest, so the
            # coordinator's p99 is its own, not the generator's.
            gen=$(( CORES * 3 / 4 ))
            part load $share "$PY" benchmarks/bench_coordinator_load.py "${LOAD_ARGS[@]}" \
                --generator-cpus "$gen-$(( CORES - 1 ))" --out "$OUT/bench_coordinator_load.json" ;;
        speedup)
            part speedup $share "$PY" benchmarks/bench_speedup.py "${SPEEDUP_ARGS[@]}" --out "$OUT/bench_speedup.json" ;;
        *)
            echo "unknown part $p (scale, round, load, speedup)" | tee -a "$log"; exit 2 ;;
    esac
done
echo "results in $OUT" | tee -a "$log"
