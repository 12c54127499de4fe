#!/usr/bin/env bash
# One device call's worth of the training-graph acceptance (issue 21): the sweep of each workload
# in WORKLOAD (448, 896, or both: "896 448"), and with CHECKS=1 the bit-identity and exit checks
# and the vision host enqueue bench. Each part is time-boxed (SWEEP_SECONDS per workload) so that
# the rest still runs and the results come back: each sweep's reports are packed into one archive
# in $OUT.
source "$(dirname "$0")/gpu_env.sh"
build_gpu iris || exit 1
for w in ${WORKLOAD:-448}; do
  ITERS=${ITERS:-20} WORKLOADS=$w timeout "${SWEEP_SECONDS:-300}" scripts/gpu_train_sweep.sh >"$out/sweep_${w}_run.txt" 2>&1
  tail -12 "$out/sweep_${w}_run.txt"
  tar -czf "$out/sweep_${w}.tgz" -C "$out" $(cd "$out" && find "sweep_$w" -name report.txt -o -name run_summary.json -o -name train.log -o -name sweep.json) 2>/dev/null
  rm -rf "$out/sweep_$w"
done
if [ "${CHECKS:-0}" = 1 ]; then
  timeout "${CHECK_SECONDS:-200}" scripts/gpu_train_graphs_check.sh >"$out/graphs_check.txt" 2>&1
  tail -25 "$out/graphs_check.txt"
  timeout 120 build-gpu/iris bench --config bench/configs/qwen3vl_2b.json --only vision --json "$out/bench_vision.json" >"$out/bench_vision.txt" 2>&1
  grep -E "host enqueue|target|device held|graph launch" "$out/bench_vision.txt"
fi
