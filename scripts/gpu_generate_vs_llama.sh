#!/usr/bin/env bash
# iris generate against llama-mtmd-cli on the GPU machine, one-shot, as a user runs them: the
# whole command's wall time (load, the images, 64 greedy tokens) on the same random-weight
# Qwen-VL checkpoint (tools/make_random_checkpoint.py; llama.cpp gets it as bf16 GGUF through
# its own convert_hf_to_gguf.py) and the same images, for one 448, 896 and 1344 pixel square and
# eight 448 squares. Iris runs with its GEMM tuning cache empty, then filled by `iris generate
# --tune` on the same command. Each timed command runs RUNS times (3) after one untimed run that
# puts the files in the page cache; the table has the median.
#
# Iris's warm figures come from one chat process that sends the same message four times with
# /clear between: the vision encode and prefill of turns two and three (the fastest of the two,
# before the vision graph's capture at the fourth use) are what a warm process takes.
#
# The peer is not part of Iris (without it the script measures Iris alone): LLAMA_MTMD_CLI is a llama-mtmd-cli built on the GPU machine
# (CUDA, architecture 90) and LLAMA_DIR the llama.cpp source it was built from, whose
# convert_hf_to_gguf.py (with gguf-py) writes the bf16 GGUF and the mmproj GGUF. Carry .deps and
# tests/data/qwen3vl-tiny/tokenizer.json. Results go to $OUT (or out/).
# LLAMA_PEER_TARBALL instead of the two: a .tar.xz whose llama/ folder holds bin/llama-mtmd-cli
# and that source's convert_hf_to_gguf.py, conversion/ and gguf-py/ (a peer built elsewhere for
# CUDA architecture 90, carried to the GPU machine); it is unpacked into /tmp. The tarball (41 MB)
# and the tracked tree (30 MB) exceed one call's carry, so it travels in two parts over two calls
# of one warm machine: `split -b 26000000 -d .peer/llama-peer.tar.xz`, part 00 in .peer/a (the
# first call copies it to /tmp and builds), part 01 and an xz of the tokenizer in .peer/b (the
# second joins the parts and runs this script).
#
# CONFIG (recipes/configs/qwen3vl_2b.json) picks the geometry and family, FIXTURE (the tiny
# fixture of that family, tests/data/qwen3vl-tiny) its preprocessor and chat template, ROWS the
# inputs (1x448 1x896 1x1344 8x448); e.g. CONFIG=bench/configs/qwen2_5_vl_7b.json
# FIXTURE=tests/data/qwen25vl-tiny ROWS=1x896 for Qwen2.5-VL-7B.
source "$(dirname "$0")/gpu_env.sh"
runs=${RUNS:-3}
tok=tests/data/qwen3vl-tiny/tokenizer.json
config=${CONFIG:-recipes/configs/qwen3vl_2b.json}
fixture=${FIXTURE:-tests/data/qwen3vl-tiny}
model=${MODEL_DIR:-/tmp/$(basename "$config" .json)-random}
work=/tmp/generate_vs_llama_$(basename "$config" .json)
mkdir -p "$work"
export NCCL_NVLS_ENABLE=0

if [ ! -x build-gpu/iris ]; then build_gpu iris || exit 1; fi

if [ ! -f "$model/config.json" ]; then
  python3 tools/make_random_checkpoint.py --config "$config" --tokenizer $tok --out "$model" || exit 1
  cp $fixture/preprocessor_config.json $fixture/tokenizer_config.json "$model/"
fi
# Without LLAMA_MTMD_CLI only Iris runs (its first-call and warm figures, the wall times without
# the peer's column).
if [ -n "${LLAMA_PEER_TARBALL:-}" ]; then
  tar -xJf "$LLAMA_PEER_TARBALL" -C /tmp || exit 1
  LLAMA_MTMD_CLI=/tmp/llama/bin/llama-mtmd-cli LLAMA_DIR=/tmp/llama
fi
llama=${LLAMA_MTMD_CLI:-}
llama_dir=${LLAMA_DIR:-}
if [ -n "$llama" ] && [ -z "$llama_dir" ]; then
  echo "set LLAMA_DIR to the llama.cpp source of $llama" >&2
  exit 2
fi
if [ -n "$llama" ] && [ ! -f $work/model.gguf ]; then
  (export PYTHONPATH=$llama_dir/gguf-py:$llama_dir &&
    python3 $llama_dir/convert_hf_to_gguf.py "$model" --outtype bf16 --outfile $work/model.gguf &&
    python3 $llama_dir/convert_hf_to_gguf.py "$model" --outtype bf16 --mmproj \
      --outfile $work/mmproj.gguf) >"$out/convert.log" 2>&1 || { tail -30 "$out/convert.log"; exit 1; }
fi
python3 - "$work" <<'EOF' || exit 1
import sys, numpy as np
from PIL import Image
work = sys.argv[1]
rng = np.random.default_rng(7)
for side in (448, 896, 1344):
    for k in range(8 if side == 448 else 1):
        y, x = np.mgrid[0:side, 0:side] / side
        img = np.stack([x, y, (x + y) / 2], -1) * 200 + rng.integers(0, 55, (side, side, 3))
        Image.fromarray(img.astype(np.uint8)).save(f"{work}/img{side}_{k}.png")
EOF
prompt="Describe the picture."
declare -A images=(
  [1x448]="$work/img448_0.png" [1x896]="$work/img896_0.png" [1x1344]="$work/img1344_0.png"
  [8x448]="$(ls $work/img448_*.png | tr '\n' ' ')")
read -r -a rows <<<"${ROWS:-1x448 1x896 1x1344 8x448}"

wall() {  # wall time in seconds of "$@", output to $log
  local t0 t1
  t0=$(date +%s%N)
  "$@" >"$log" 2>&1 || { echo "FAILED: $*" >&2; tail -5 "$log" >&2; }
  t1=$(date +%s%N)
  awk -v ns=$((t1 - t0)) 'BEGIN { printf "%.3f\n", ns / 1e9 }'
}
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR + 1) / 2)]}'; }

results=$out/generate_vs_llama.tsv
printf 'row\tllama_s\tiris_empty_s\tiris_filled_s\n' >"$results"
for row in "${rows[@]}"; do
  llama_args=(-m $work/model.gguf --mmproj $work/mmproj.gguf -ngl 99 -c 8192 -n 64 --temp 0
    --ignore-eos -p "$prompt")
  iris_args=(generate -m "$model" -c 8192 -n 64 --temp 0 --ignore-eos -p "$prompt" --device cuda)
  for f in ${images[$row]}; do llama_args+=(--image "$f"); iris_args+=(--image "$f"); done
  log=$out/llama_$row.log
  l=() e=() f=()
  if [ -n "$llama" ]; then
    wall $llama "${llama_args[@]}" >/dev/null
    for i in $(seq $runs); do l+=("$(wall $llama "${llama_args[@]}")"); done
  else
    l=(nan)
  fi
  log=$out/iris_empty_$row.log
  for i in $(seq $((runs + 1))); do
    rm -rf $work/cache_empty
    s=$(IRIS_CACHE_DIR=$work/cache_empty wall build-gpu/iris "${iris_args[@]}")
    [ "$i" -gt 1 ] && e+=("$s")
  done
  cp "$log" "$out/iris_empty_$row.txt"
  rm -rf $work/cache_filled
  log=$out/iris_tune_$row.log
  IRIS_CACHE_DIR=$work/cache_filled wall build-gpu/iris "${iris_args[@]}" --tune >/dev/null
  log=$out/iris_filled_$row.log
  for i in $(seq $runs); do f+=("$(IRIS_CACHE_DIR=$work/cache_filled wall build-gpu/iris "${iris_args[@]}")"); done
  cp "$log" "$out/iris_filled_$row.txt"
  printf '%s\t%s\t%s\t%s\n' "$row" "$(median "${l[@]}")" "$(median "${e[@]}")" \
    "$(median "${f[@]}")" | tee -a "$results"
  # Warm: one chat process, the same message four times.
  chat=""
  for k in 1 2 3 4; do
    for img in ${images[$row]}; do chat+="/image $img"$'\n'; done
    chat+="$prompt"$'\n/clear\n'
  done
  printf '%s' "$chat" | IRIS_CACHE_DIR=$work/cache_filled build-gpu/iris generate -m "$model" \
    -c 8192 -n 64 --temp 0 --ignore-eos --device cuda --json >"$out/iris_chat_$row.jsonl" 2>"$out/iris_chat_$row.err"
  IRIS_CACHE_DIR=$work/cache_filled build-gpu/iris "${iris_args[@]}" --json \
    >"$out/iris_oneshot_filled_$row.json" 2>/dev/null
  rm -rf $work/cache_empty
  IRIS_CACHE_DIR=$work/cache_empty build-gpu/iris "${iris_args[@]}" --json \
    >"$out/iris_oneshot_empty_$row.json" 2>/dev/null
done
python3 - "$out" "${rows[@]}" <<'EOF'
import json, sys, csv
out, rows = sys.argv[1], sys.argv[2:]
table = {r["row"]: r for r in csv.DictReader(open(f"{out}/generate_vs_llama.tsv"), delimiter="\t")}
print("\n| input | llama-mtmd-cli s | iris, cache empty s (ratio) | iris, cache filled s (ratio) |")
print("|---|---|---|---|")
for row in rows:
    t = table[row]; l = float(t["llama_s"]); e = float(t["iris_empty_s"]); f = float(t["iris_filled_s"])
    if l != l:  # no peer in this run
        print(f"| {row} | - | {e:.2f} | {f:.2f} |")
    else:
        print(f"| {row} | {l:.2f} | {e:.2f} ({e / l:.2f}x) | {f:.2f} ({f / l:.2f}x) |")
print("\n| input | load ms (read / upload) | first vision ms, empty / filled | warm vision ms | bar 1.5x+50 | first prefill ms, empty / filled | warm prefill ms | bar |")
print("|---|---|---|---|---|---|---|---|")
for row in rows:
    turns = [json.loads(l) for l in open(f"{out}/iris_chat_{row}.jsonl") if l.startswith("{")]
    warm_v = min(t["timings"]["vision_encode_ms"] for t in turns[1:3])
    warm_p = min(t["timings"]["prefill_ms"] for t in turns[1:3])
    e = json.load(open(f"{out}/iris_oneshot_empty_{row}.json"))["timings"]
    f = json.load(open(f"{out}/iris_oneshot_filled_{row}.json"))["timings"]
    load = f"{f['load_ms']:.0f} ({f.get('weights_read_ms', 0):.0f} / {f.get('weights_upload_ms', 0):.0f})"
    bv, bp = 1.5 * warm_v + 50, 1.5 * warm_p + 50
    print(f"| {row} | {load} | {e['vision_encode_ms']:.1f} / {f['vision_encode_ms']:.1f} | {warm_v:.1f} | {bv:.1f} | "
          f"{e['prefill_ms']:.1f} / {f['prefill_ms']:.1f} | {warm_p:.1f} | {bp:.1f} |")
EOF
# The per-run logs in one file: the device machine returns a bounded number of files.
tar -czf "$out/generate_vs_llama_logs.tar.gz" -C "$out" --remove-files \
  $(cd "$out" && ls llama_*.log iris_*.log iris_*.txt iris_*.json iris_*.jsonl iris_*.err 2>/dev/null)
