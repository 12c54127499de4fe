#!/usr/bin/env bash
# Training graphs on the GPU machine (issue acceptance):
#  1. STEPS (50) training steps of the 2B geometry (random init, the vision tower trained) on the
#     same data, one 448x448 image and about 128 text tokens per sample: eagerly, then with each
#     graph setting. Every logged loss must be bit-identical to the eager run's. Graphs replay
#     padded micro-batches, so the eager reference runs the same padded micro-batches: graphs on
#     with a warm-up longer than the run, which never captures (every shape stays eager).
#     full_iteration captures the loss too, so it also pads the loss's label slots to a power of
#     two (the local modes run the loss eagerly over the real labels): its reference is the eager
#     run of those micro-batches, and its distance from the first reference is printed as well
#     (the lm_head GEMMs then have other row counts, so cuBLAS may pick other kernels).
#  2. EXIT_RUNS (20) consecutive runs of the tiny shapes recipe with vision and decoder graphs on,
#     each under a timeout, to catch a hang at exit.
# RECIPE (recipes/qwen3vl_2b_sft.yaml), SIDE (448), TEXT (128), SEQ (1024) and EXTRA (overrides;
# train.freeze_vision_tower=false) pick the run of part 1, ONLY (e.g. "eager (padded),vision +
# decoder per-layer") its variants; e.g. the 8B LoRA recipe: RECIPE=recipes/qwen3vl_8b_lora.yaml
# SIDE=896 TEXT=3000 SEQ=4096 EXTRA= EXIT_RUNS=0.
# Results go to $OUT (or out/). Carry .deps and tests/data/qwen3vl-tiny/tokenizer.json.
source "$(dirname "$0")/gpu_env.sh"
if [ ! -x build-gpu/iris ]; then
  build_gpu iris || exit 1
fi
steps=${STEPS:-50}
tok=tests/data/qwen3vl-tiny/tokenizer.json
recipe=${RECIPE:-recipes/qwen3vl_2b_sft.yaml}
side=${SIDE:-448}
text=${TEXT:-128}
read -r -a extra <<<"${EXTRA-train.freeze_vision_tower=false}"
data=/tmp/graphs_${side}_$text
if [ ! -f $data/train.jsonl ]; then
  python3 tools/make_sft_data.py --out $data --n 64 --side "$side" --text "$text" --tokenizer $tok
fi
common=(--recipe "$recipe" model.init=random model.tokenizer=$tok
  "data.train_files=[$data/train.jsonl]" train.train_iters=$steps train.micro_batch_size=1
  train.global_batch_size=4 train.seq_length=${SEQ:-1024} "${extra[@]}"
  schedule.warmup_iters=5 checkpoint.save_interval=0 checkpoint.save_final=false
  logging.log_interval=1 train.device=cuda)
# name|overrides|reference: a row with no reference becomes one, under its own name
never_capture=cuda_graph.cuda_graph_warmup_steps=100000
variants=(
  "eager (padded)|cuda_graph.cuda_graph_impl=local cuda_graph.vision_cuda_graph_impl=local $never_capture|"
  "eager (padded, loss slots)|cuda_graph.cuda_graph_impl=full_iteration $never_capture|"
  "vision graphs|cuda_graph.vision_cuda_graph_impl=local|eager (padded)"
  "decoder per-layer graphs|cuda_graph.cuda_graph_impl=local|eager (padded)"
  "vision + decoder per-layer|cuda_graph.cuda_graph_impl=local cuda_graph.vision_cuda_graph_impl=local|eager (padded)"
  "full_iteration|cuda_graph.cuda_graph_impl=full_iteration|eager (padded, loss slots)"
  "attn,mlp modules (both)|cuda_graph.cuda_graph_impl=local cuda_graph.cuda_graph_modules=[attn,mlp] cuda_graph.vision_cuda_graph_impl=local cuda_graph.vision_cuda_graph_modules=[attn,mlp]|eager (padded)"
)
if [ "${EXIT_ONLY:-0}" != 1 ]; then
echo "== $steps steps of $recipe (random init), ${side}x$side + ~$text tokens, micro-batch 1, 4 per step"
declare -A refs
first_ref=""
max_rel_diff() {
  python3 -c 'import sys; a=[float(x) for x in sys.argv[1].split()]; b=[float(x) for x in sys.argv[2].split()]
print("%.3g" % max((abs(x-y)/abs(y) for x,y in zip(a,b)), default=float("nan")))' "$1" "$2"
}
for v in "${variants[@]}"; do
  IFS='|' read -r name overrides against <<<"$v"
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then continue; fi
  read -r -a over <<<"$overrides"
  dir=/tmp/graphs_run_$(echo "$name" | tr -c 'a-z0-9' '_')
  rm -rf "$dir"
  start=$SECONDS
  build-gpu/iris train "${common[@]}" "${over[@]}" checkpoint.dir="$dir" >"$dir.log" 2>&1
  rc=$?
  secs=$((SECONDS - start))
  # Training records only (kind "train", or no kind): every record names "evaluations", so the
  # kind, not a substring, tells them from evaluation records.
  losses=$(python3 -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]
print(" ".join(repr(x["loss"]) for x in r if x.get("kind", "train") == "train" and "loss" in x))' "$dir/metrics.jsonl" 2>/dev/null)
  n=$(echo "$losses" | wc -w)
  if [ -z "$against" ]; then
    refs[$name]=$losses
    verdict="reference"
    [ -z "$first_ref" ] && first_ref=$name
  elif [ -z "${refs[$against]:-}" ]; then
    verdict="NO REFERENCE"
  elif [ "$n" -eq "$steps" ] && [ "$losses" = "${refs[$against]}" ]; then
    verdict="bit-identical to $against"
  else
    verdict="DIFFERS from $against"
  fi
  if [ "$name" != "$first_ref" ] && [ "$against" != "$first_ref" ] && [ "$n" -gt 0 ]; then
    verdict="$verdict; max rel. diff from $first_ref $(max_rel_diff "$losses" "${refs[$first_ref]}")"
  fi
  printf '%-28s exit %d  %3d losses  %4d s  %s\n    %s\n' "$name" $rc "$n" "$secs" "$verdict" \
    "$(grep -E '^graphs: ' "$dir.log" | head -1)" | tee -a "$out/graphs_bit_identity.txt"
  [ $rc -ne 0 ] && tail -5 "$dir.log"
  cp "$dir.log" "$out/graphs_$(basename "$dir").log"
done
echo "first and last losses of $first_ref: $(echo "${refs[$first_ref]}" | awk '{print $1, $NF}')"
fi

runs=${EXIT_RUNS:-20}
[ "$runs" -gt 0 ] || exit 0
echo "== $runs consecutive runs with graphs on (tiny shapes recipe, CUDA), each under a 120 s timeout"
shapes=/tmp/iris_shapes_exit
build-gpu/iris data shapes --out $shapes --n 2000 --seed 1 --force >/dev/null
ok=0
hung=0
for i in $(seq 1 "$runs"); do
  rm -rf /tmp/graphs_exit
  timeout 120 build-gpu/iris train --recipe recipes/qwen3vl_tiny_shapes.yaml train.train_iters=6 \
    "data.train_files=[$shapes/train.jsonl]" data.eval_files=[] train.eval_interval=0 \
    schedule.warmup_iters=1 checkpoint.save_interval=0 train.device=cuda cuda_graph.cuda_graph_impl=local \
    cuda_graph.vision_cuda_graph_impl=local cuda_graph.cuda_graph_warmup_steps=1 \
    checkpoint.dir=/tmp/graphs_exit >/tmp/graphs_exit.log 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then ok=$((ok + 1)); elif [ $rc -eq 124 ]; then hung=$((hung + 1)); else
    echo "run $i exit $rc"; tail -3 /tmp/graphs_exit.log; fi
done
echo "exit check: $ok of $runs runs exited 0, $hung hung (timeout)"
grep -E '^graphs: ' /tmp/graphs_exit.log | tail -1
