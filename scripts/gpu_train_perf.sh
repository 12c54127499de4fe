#!/usr/bin/env bash
# The GPU machine's training performance batch: iris bench --train on the 2B (or BENCH_CONFIG)
# geometry beside the HF transformers peer, and an SFT recipe on a generated JSONL of real PNG
# images and text to 4096 tokens (tools/make_sft_data.py). Builds build-gpu first when it is
# missing. Results go to $OUT (or out/). Carry .deps and tests/data/qwen3vl-tiny/tokenizer.json.
#
# Environment: STEPS (bench --train --steps, 3), ACCUM (samples per step, 8), RECOMPUTE (none),
# PEER (1: run the HF peer), SFT (recipe name without .yaml, e.g. qwen3vl_2b_sft; empty: skip),
# SFT_ITERS (4), SFT_RECOMPUTE (none), SFT_SAMPLES (64), PROFILE (1: nsys summary of a bench step).
source "$(dirname "$0")/gpu_env.sh"
if [ ! -x build-gpu/iris ]; then
  build_gpu iris || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
config=${BENCH_CONFIG:-bench/configs/qwen3vl_2b.json}
accum=${ACCUM:-8}
if [ "${BENCH:-1}" = 1 ]; then
  echo "== iris bench --train ($config, one 896x896 image + text to 4096 tokens, $accum samples per step)"
  peer=()
  if [ "${PEER:-1}" = 1 ]; then
    peer=(--peer "python3 bench/peers/hf_transformers_train.py --config $config --text 3310 --accumulation $accum --steps 2")
  fi
  build-gpu/iris bench --train --config "$config" --accumulation "$accum" --steps "${STEPS:-3}" \
    --recompute "${RECOMPUTE:-none}" --json "$out/bench_train.json" "${peer[@]}" 2>&1 | tee "$out/bench_train.txt"
fi
if [ "${PROFILE:-0}" = 1 ] && command -v nsys >/dev/null; then
  echo "== nsys: kernel time of one bench step"
  nsys profile -o /tmp/bench_train -f true --stats=false build-gpu/iris bench --train --config "$config" \
    --accumulation 2 --steps 1 --warmup 1 >/dev/null 2>&1
  nsys stats -r cuda_gpu_kern_sum -f csv /tmp/bench_train.nsys-rep 2>/dev/null >"$out/kernels.csv"
  python3 - "$out/kernels.csv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if l.count(",") > 3)]
tot = sum(float(r["Total Time (ns)"]) for r in rows)
print(f"kernel time {tot/1e6:.1f} ms over {len(rows)} kernels")
for r in sorted(rows, key=lambda r: -float(r["Total Time (ns)"]))[:25]:
    print(f'{100*float(r["Total Time (ns)"])/tot:5.1f}%  {float(r["Total Time (ns)"])/1e6:8.1f} ms  x{r["Instances"]:>5}  {r["Name"][:110]}')
PY
fi
if [ -n "${SFT:-}" ]; then
  data=/tmp/sft_data
  if [ ! -f $data/train.jsonl ]; then
    python3 tools/make_sft_data.py --out $data --n "${SFT_SAMPLES:-64}" --tokens 4096 \
      --tokenizer tests/data/qwen3vl-tiny/tokenizer.json
  fi
  echo "== recipes/$SFT.yaml on the GPU (random init: no checkpoint is reachable from this machine)"
  rm -rf /tmp/run_sft
  build-gpu/iris train --recipe "recipes/$SFT.yaml" model.init=random \
    model.tokenizer=tests/data/qwen3vl-tiny/tokenizer.json "data.train_files=[$data/train.jsonl]" \
    train.train_iters="${SFT_ITERS:-4}" schedule.warmup_iters=1 checkpoint.save_interval=0 \
    checkpoint.save_final=false train.recompute="${SFT_RECOMPUTE:-none}" train.device=cuda \
    checkpoint.dir=/tmp/run_sft 2>&1 | tee "$out/sft.log" | grep -vE '^\s*$' | tail -n 14
fi
