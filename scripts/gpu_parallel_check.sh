#!/usr/bin/env bash
# Multi-GPU training on a machine with 2 (or 4) GPUs: data parallelism, the sharded (ZeRO-1)
# optimizer and pipeline stages over NCCL, on the tiny shapes recipe from one fixed start, each
# run's logged losses compared with a reference run's:
#   dp2 vs 1 GPU             mpirun -np 2, parallel.data_parallel_size=2, the same global batch
#   dp2 overlap              small gradient buckets (dozens) started during the backward of the
#                            last micro-batch, against the same buckets summed after it
#                            (parallel.overlap_grad_reduce=false) and against dp2's one bucket:
#                            bit-identical; the summary row says how many started early
#   zero1 dp2 vs dp2         optimizer.distributed=true against the unsharded dp2 run
#   zero2 dp2                parallel.sharding=optimizer_grads: with one micro-batch per rank
#                            (global batch 2) against the unsharded dp2 run of that batch, eager
#                            and with graphs (bit-identical), and with the recipe's batch against
#                            zero1 (close: the layers' sums add micro-batch after micro-batch)
#   zero3 dp2                parallel.sharding=optimizer_grads_params: the same cases against
#                            zero2 (bit-identical: the gathered layers hold the same bits)
#   pp2 [1,3] / [2,2] vs 1   2 stages split before / after the second DeepStack injection layer
#   graphs: 1 GPU, dp2, pp2  cuda_graph local (decoder and vision) on; pp2 and dp2 against 1 GPU
#   pp2 x dp2 vs 1 GPU       4 GPUs only; also with optimizer.distributed (each stage's state
#                            sharded over its 2 replicas) against the unsharded pp2 x dp2, and
#                            with sharding by layer (one micro-batch per replica) against it
#   resume                   half the steps, a checkpoint, the rest under another layout (1 GPU,
#                            zero1 dp2, pp2) against the uninterrupted 1-GPU run
#   stall / kill             a rank stopped (SIGSTOP) or killed (SIGKILL) mid-run: every rank
#                            must exit non-zero within parallel.timeout_seconds (+ slack)
# Exactness: on the CPU backend dp2 is bit-identical to one process with 2 threads, but one GPU
# sums a step's micro-batches into one gradient buffer in order ((g0 + g1) + g2) + g3 where dp2
# sums (g0 + g2) + (g1 + g3), and the pipeline adds the tied embedding's two gradient parts in
# another order, so those differ in the last bits and drift through the bf16 weights; the table
# reports the largest relative loss difference, whether the runs are bit-identical and whether
# the first step (before any update) is: exact for runs that share the micro-batches' order
# (pipelines against one GPU, pp2 x dp2 against dp2); against data parallelism even the first
# loss is summed in another order (each rank's micro-batches, then the ranks). zero1 vs dp2 sums the gradients in the same order and is
# bit-identical unless the clip coefficient (from a norm summed in another order) rounds apart.
# PASS: largest relative difference <= TOL (default 1e-2), the first step exact where marked, both
# runs exited 0, and bit-identical where `expect` says exact (DIFF: within TOL but not identical).
#
# Results go to $OUT (or out/): one log and metrics file per run, summary.txt. Carry .deps
# (scripts/fetch_gpu_deps.sh) and tests/data/qwen3vl-tiny/tokenizer.json.
# Knobs: STEPS (20), TOL (1e-2), CASE_TIMEOUT (300 s per run), STALL_TIMEOUT (30 s:
# parallel.timeout_seconds of the stall and kill cases), SKIP_BUILD=1 (use build-gpu as it is), ONLY=stall or ONLY=zero2 (sharding
# by layer: zero2 and zero3).
source "$(dirname "$0")/gpu_env.sh"
set -u
steps=${STEPS:-20}
tol=${TOL:-1e-2}
case_timeout=${CASE_TIMEOUT:-300}
stall_timeout=${STALL_TIMEOUT:-30}
nvidia-smi -L
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "== $ngpu GPUs"
if [ "${SKIP_BUILD:-0}" != 1 ] || [ ! -x build-gpu/iris ]; then
  build_gpu iris training_nccl_test || exit 1
  echo "== build ok"
fi
echo "== training_nccl_test (NCCL world of one: exchange, optimizer modes, stall watchdog)"
timeout 600 build-gpu/training_nccl_test >"$out/training_nccl_test.txt" 2>&1
nccl_rc=$?
grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|Failure' "$out/training_nccl_test.txt" | head -20

# mpirun as root on the GPU machine, oversubscribed where it counts cores as slots.
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none -x LD_LIBRARY_PATH -x OMP_NUM_THREADS
  -x NCCL_DEBUG)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
data=/tmp/iris_par_shapes
build-gpu/iris data shapes --out $data --n 2000 --seed 1 --force >/dev/null || exit 1
runs=/tmp/iris_par_runs
rm -rf $runs && mkdir -p $runs
# The recipe with a second vision block whose DeepStack features go in after decoder layer 1
# (layers 0 and 1 of 4 inject), so that a [1, 3] split sends one feature across the boundary and
# [2, 2] none.
common=(--recipe recipes/qwen3vl_tiny_shapes.yaml train.train_iters=$steps train.device=cuda
  "data.train_files=[$data/train.jsonl]" "data.eval_files=[$data/heldout.jsonl]"
  logging.log_interval=1 train.eval_interval=0 checkpoint.save_interval=0 checkpoint.resume=never
  schedule.warmup_iters=2 schedule.decay_iters=$steps
  model.config.vision_config.depth=2 "model.config.vision_config.deepstack_visual_indexes=[0,1]")
graphs=(cuda_graph.cuda_graph_impl=local cuda_graph.vision_cuda_graph_impl=local)

# run NAME NP [overrides...]: one training run, NP processes (1: no mpirun), time-limited; its
# exit status goes to $runs/NAME.rc for the table.
run() {
  local name=$1 np=$2
  shift 2
  local dir=$runs/$name cmd=() start rc
  # KEEP=1: a resume leg, which continues the run already in the folder.
  [ "${KEEP:-0}" = 1 ] || rm -rf "$dir"
  if [ "$np" -gt 1 ]; then cmd=("${mpi[@]}" -np "$np"); fi
  cmd+=(build-gpu/iris train "${common[@]}" checkpoint.dir="$dir" "$@")
  start=$(date +%s)
  timeout -k 10 "$case_timeout" "${cmd[@]}" >"$out/run_$name.log" 2>&1
  rc=$?
  echo $rc >"$runs/$name.rc"
  cp "$dir/metrics.jsonl" "$out/metrics_$name.jsonl" 2>/dev/null
  echo "   $name: exit $rc in $(($(date +%s) - start)) s"
  # The error a rank printed, else the log's end (mpirun's own report).
  [ $rc -ne 0 ] && { grep -m 3 'error' "$out/run_$name.log" || tail -n 5 "$out/run_$name.log"; } |
    sed 's/^/     /'
  return $rc
}

summary=$out/summary.txt
printf '%-30s %-6s %-6s %-10s %-9s %-8s %s\n' case result expect max_rel bit-ident step1 note \
  >"$summary"
# compare NAME A B FIRST EXPECT: losses of runs A and B, one table row. FIRST yes: step 1 (before
# any update) must be exact. EXPECT exact: PASS only when bit-identical, DIFF when within TOL but
# not (to look into), FAIL beyond TOL; close: PASS within TOL.
compare() {
  local name=$1 a=$2 b=$3 first=${4:-no} expect=${5:-close}
  python3 - "$runs" "$a" "$b" "$tol" "$first" "$name" "$steps" "$expect" >>"$summary" <<'EOF'
import json, sys
runs, ra, rb, tol, first, name, steps, expect = sys.argv[1:9]
def losses(run):
    out = {}
    try:
        for line in open(f"{runs}/{run}/metrics.jsonl"):
            r = json.loads(line)
            if "loss" in r and r.get("kind", "train") == "train" and "iteration" in r:
                out[r["iteration"]] = r["loss"]
    except OSError:
        pass
    return out
def rc(run):
    try:
        return int(open(f"{runs}/{run}.rc").read())
    except (OSError, ValueError):
        return None
row = "{:<30} {:<6} {:<6} {:<10} {:<9} {:<8} {}"
failed = [f"{r} exited {rc(r)}" for r in (ra, rb) if rc(r) != 0]
a, b = losses(ra), losses(rb)
common = sorted(set(a) & set(b))
if failed or len(common) < int(steps):
    print(row.format(name, "FAIL", expect, "-", "-", "-",
                     "; ".join(failed + [f"{len(a)} and {len(b)} logged steps"])))
    sys.exit()
rel = max(abs(a[s] - b[s]) / abs(b[s]) for s in common)
ident = all(a[s] == b[s] for s in common)
step1 = a[common[0]] == b[common[0]]
ok = rel <= float(tol) and (first != "yes" or step1)
result = "FAIL" if not ok else ("DIFF" if expect == "exact" and not ident else "PASS")
note = f"loss {b[common[-1]]:.5f} at step {common[-1]}"
if first == "yes" and not step1:
    note += "; step 1 should be exact"
print(row.format(name, result, expect, f"{rel:.3e}", "yes" if ident else "no",
                 "exact" if step1 else "differs", note))
EOF
}
row() { printf '%-30s %-6s %-6s %-10s %-9s %-8s %s\n' "$1" "$2" - - - - "$3" >>"$summary"; }
# ONLY=zero2: just the cases of sharding by layer (gradients, and weights too).
zero2_cases() {
  local one=(parallel.data_parallel_size=2 train.micro_batch_size=1 train.global_batch_size=2
    parallel.grad_bucket_elements=65536)
  run dp2_one 2 "${one[@]}"
  run zero2_dp2_one 2 "${one[@]}" parallel.sharding=optimizer_grads
  run dp2_one_graphs 2 "${one[@]}" "${graphs[@]}"
  run zero2_dp2_one_graphs 2 "${one[@]}" parallel.sharding=optimizer_grads "${graphs[@]}"
  run zero1_dp2_recipe 2 parallel.data_parallel_size=2 parallel.sharding=optimizer
  run zero2_dp2_recipe 2 parallel.data_parallel_size=2 parallel.sharding=optimizer_grads
  compare "zero2 vs dp2, 1 micro/rank" zero2_dp2_one dp2_one yes exact
  compare "zero2 vs dp2, graphs" zero2_dp2_one_graphs dp2_one_graphs yes exact
  compare "zero2 graphs vs zero2 eager" zero2_dp2_one_graphs zero2_dp2_one yes exact
  compare "zero2 vs zero1, recipe batch" zero2_dp2_recipe zero1_dp2_recipe yes
  run zero3_dp2_one 2 "${one[@]}" parallel.sharding=optimizer_grads_params
  run zero3_dp2_one_graphs 2 "${one[@]}" parallel.sharding=optimizer_grads_params "${graphs[@]}"
  run zero3_dp2_recipe 2 parallel.data_parallel_size=2 parallel.sharding=optimizer_grads_params
  compare "zero3 vs dp2, 1 micro/rank" zero3_dp2_one dp2_one yes exact
  compare "zero3 graphs vs zero3 eager" zero3_dp2_one_graphs zero3_dp2_one yes exact
  compare "zero3 vs zero2, recipe batch" zero3_dp2_recipe zero2_dp2_recipe yes exact
}
if [ "${ONLY:-}" = zero2 ]; then
  [ "$ngpu" -ge 2 ] && zero2_cases
  echo "== summary (max_rel: largest |a - b| / |b| over the logged losses; TOL $tol)"
  cat "$summary"
  exit 0
fi
# ONLY=stall: just the stall and kill cases (a fix of the watchdog, without the rest).
if [ "${ONLY:-}" != stall ]; then
if [ $nccl_rc -eq 0 ] && ! grep -q SKIPPED "$out/training_nccl_test.txt"; then
  row "training_nccl_test" PASS "NCCL world of one, optimizer modes, stall watchdog"
else
  row "training_nccl_test" FAIL "exit $nccl_rc or skipped: see training_nccl_test.txt"
fi

echo "== training runs ($steps steps each)"
run gpu1 1
if [ "$ngpu" -ge 2 ]; then
  run dp2 2 parallel.data_parallel_size=2
  run dp2_buckets 2 parallel.data_parallel_size=2 parallel.grad_bucket_elements=65536
  run dp2_after 2 parallel.data_parallel_size=2 parallel.grad_bucket_elements=65536 \
    parallel.overlap_grad_reduce=false
  run zero1_dp2 2 parallel.data_parallel_size=2 optimizer.distributed=true
  run pp2_1_3 2 parallel.pipeline_parallel_size=2 "parallel.pipeline_layers=[1,3]"
  run pp2_2_2 2 parallel.pipeline_parallel_size=2 "parallel.pipeline_layers=[2,2]"
  run gpu1_graphs 1 "${graphs[@]}"
  run dp2_graphs 2 parallel.data_parallel_size=2 parallel.grad_bucket_elements=65536 "${graphs[@]}"
  run pp2_graphs 2 parallel.pipeline_parallel_size=2 "parallel.pipeline_layers=[1,3]" "${graphs[@]}"
  zero2_cases
  compare "dp2 vs 1 GPU" dp2 gpu1 no
  compare "zero1 dp2 vs dp2" zero1_dp2 dp2 yes exact
  compare "dp2 overlap vs after bwd" dp2_buckets dp2_after yes exact
  compare "dp2 overlap vs one bucket" dp2_buckets dp2 yes exact
  for r in dp2_buckets dp2_graphs; do
    early=$(grep -o 'gradient reduction: [0-9]* of [0-9]* buckets' "$out/run_$r.log" | head -1)
    n=$(echo "$early" | awk '{print $3}')
    if [ -n "$n" ] && [ "$n" -gt 0 ]; then
      row "overlap started: $r" PASS "${early#gradient reduction: } started during the backward"
    else
      row "overlap started: $r" FAIL "no bucket started during the backward (run_$r.log)"
    fi
  done
  compare "zero1 dp2 vs 1 GPU" zero1_dp2 gpu1 no
  compare "pp2 [1,3] vs 1 GPU" pp2_1_3 gpu1 yes
  compare "pp2 [2,2] vs 1 GPU" pp2_2_2 gpu1 yes
  compare "pp2 [1,3] vs pp2 [2,2]" pp2_1_3 pp2_2_2 yes exact
  compare "graphs: dp2 vs 1 GPU" dp2_graphs gpu1_graphs no
  compare "graphs: pp2 vs 1 GPU" pp2_graphs gpu1_graphs yes
  compare "graphs: pp2 vs eager pp2" pp2_graphs pp2_1_3
  compare "graphs vs eager, 1 GPU" gpu1_graphs gpu1
fi
# Checkpoints written under one layout and resumed under another (the sharded optimizer's state
# re-sharded or gathered), half the steps each: the losses of an uninterrupted run.
half=$((steps / 2))
resume() {
  local name=$1 np1=$2 np2=$3
  shift 3
  local first=() second=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do first+=("$1"); shift; done
  shift
  second=("$@")
  # A first leg that failed leaves its status for the table: the second would start afresh.
  run "$name" "$np1" train.train_iters=$half checkpoint.save_interval=$half checkpoint.resume=auto \
    ${first[@]+"${first[@]}"} || return
  KEEP=1 run "$name" "$np2" checkpoint.save_interval=$half checkpoint.resume=auto \
    ${second[@]+"${second[@]}"}
}
resume resume_gpu1 1 1 --
compare "resume: 1 GPU, split in two" resume_gpu1 gpu1 yes exact
if [ "$ngpu" -ge 2 ]; then
  resume resume_zero1_to_gpu1 2 1 parallel.data_parallel_size=2 optimizer.distributed=true --
  resume resume_gpu1_to_zero1 1 2 -- parallel.data_parallel_size=2 optimizer.distributed=true
  resume resume_pp2_to_gpu1 2 1 parallel.pipeline_parallel_size=2 "parallel.pipeline_layers=[1,3]" --
  compare "resume: zero1 dp2 -> 1 GPU" resume_zero1_to_gpu1 gpu1 no
  compare "resume: 1 GPU -> zero1 dp2" resume_gpu1_to_zero1 gpu1 yes
  compare "resume: pp2 -> 1 GPU" resume_pp2_to_gpu1 gpu1 yes
fi
if [ "$ngpu" -ge 4 ]; then
  run pp2_dp2 4 parallel.pipeline_parallel_size=2 parallel.data_parallel_size=2 \
    "parallel.pipeline_layers=[1,3]"
  run pp2_dp2_zero1 4 parallel.pipeline_parallel_size=2 parallel.data_parallel_size=2 \
    "parallel.pipeline_layers=[1,3]" optimizer.distributed=true
  run dp4 4 parallel.data_parallel_size=4
  # Sharding by layer per stage, one micro-batch per replica: the unsharded grid's bits.
  pp2_dp2_one=(parallel.pipeline_parallel_size=2 parallel.data_parallel_size=2
    "parallel.pipeline_layers=[1,3]" train.micro_batch_size=1 train.global_batch_size=2
    parallel.grad_bucket_elements=65536)
  run pp2_dp2_one 4 "${pp2_dp2_one[@]}"
  run pp2_dp2_zero2_one 4 "${pp2_dp2_one[@]}" parallel.sharding=optimizer_grads
  run pp2_dp2_zero3_one 4 "${pp2_dp2_one[@]}" parallel.sharding=optimizer_grads_params
  compare "pp2 x dp2 vs 1 GPU" pp2_dp2 gpu1 no
  compare "pp2 x dp2 vs dp2" pp2_dp2 dp2 yes
  compare "pp2 x dp2 zero1 vs pp2 x dp2" pp2_dp2_zero1 pp2_dp2 yes exact
  compare "pp2 x dp2 zero2 vs unsharded" pp2_dp2_zero2_one pp2_dp2_one yes exact
  compare "pp2 x dp2 zero3 vs unsharded" pp2_dp2_zero3_one pp2_dp2_one yes exact
  compare "dp4 vs 1 GPU" dp4 gpu1 no
fi

fi
# stall TAG LABEL SIGNAL [overrides...]: a long run of 2 ranks; once it has logged 3 steps, rank 1
# gets SIGNAL. Every rank must then exit, mpirun non-zero, within parallel.timeout_seconds plus
# slack (a stopped rank is ended by mpirun once the other one exits).
stall() {
  local tag=$1 name=$2 sig=$3
  shift 3
  local dir=$runs/$tag
  rm -rf "$dir"
  "${mpi[@]}" -np 2 build-gpu/iris train "${common[@]}" checkpoint.dir="$dir" \
    train.train_iters=100000 parallel.timeout_seconds="$stall_timeout" "$@" \
    >"$out/run_$tag.log" 2>&1 &
  local pid=$! victim="" t logged
  for t in $(seq 1 1200); do
    logged=$(grep -c '"loss"' "$dir/metrics.jsonl" 2>/dev/null)
    [ "${logged:-0}" -ge 3 ] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.25
  done
  # Rank 1: the iris process whose launcher environment says so (checkpoint.dir names the run).
  local p
  for p in $(pgrep -f "checkpoint.dir=$dir" || true); do
    [ "$(cat /proc/$p/comm 2>/dev/null)" = iris ] || continue
    if tr '\0' '\n' </proc/$p/environ 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1'; then
      victim=$p
    fi
  done
  if [ -z "$victim" ]; then
    kill -9 $pid 2>/dev/null
    wait $pid 2>/dev/null
    row "$name" FAIL "rank 1 not found (did the run reach step 3? see run_$tag.log)"
    return
  fi
  local start=$(date +%s)
  kill -"$sig" "$victim"
  local limit=$((stall_timeout + 90)) rc=
  for t in $(seq 1 $((limit * 4))); do
    kill -0 $pid 2>/dev/null || break
    sleep 0.25
  done
  if kill -0 $pid 2>/dev/null; then
    kill -9 $pid 2>/dev/null
    kill -9 "$victim" 2>/dev/null
    wait $pid 2>/dev/null
    row "$name" FAIL "still running $limit s after SIGKILL/SIGSTOP of rank 1"
    return
  fi
  wait $pid
  rc=$?
  local took=$(($(date +%s) - start)) left
  sleep 2  # ranks the launcher ended may take a moment to go
  left=$(pgrep -f "checkpoint.dir=$dir" | while read -r q; do
    [ "$(cat /proc/$q/comm 2>/dev/null)" = iris ] && echo "$q"; done)
  if [ -n "$left" ]; then
    kill -9 $left 2>/dev/null
    row "$name" FAIL "mpirun exited $rc after $took s but iris processes were left: $left"
  elif [ $rc -ne 0 ]; then
    row "$name" PASS "every rank ended, mpirun exit $rc, $took s after SIG$sig (timeout $stall_timeout s)"
  else
    row "$name" FAIL "mpirun exited 0 after SIG$sig of rank 1"
  fi
}
if [ "$ngpu" -ge 2 ]; then
  echo "== a rank stopped or killed mid-run (parallel.timeout_seconds=$stall_timeout)"
  stall stall_pp2 "stall pp2 (SIGSTOP rank 1)" STOP parallel.pipeline_parallel_size=2 \
    "parallel.pipeline_layers=[1,3]"
  stall stall_dp2 "stall dp2 (SIGSTOP rank 1)" STOP parallel.data_parallel_size=2
  stall kill_pp2 "kill pp2 (SIGKILL rank 1)" KILL parallel.pipeline_parallel_size=2 \
    "parallel.pipeline_layers=[1,3]"
  grep -h "parallel.timeout_seconds\|error" "$out"/run_stall*.log 2>/dev/null | head -4
fi
echo "== summary (max_rel: largest |a - b| / |b| over the logged losses; TOL $tol)"
cat "$summary"
