#!/usr/bin/env bash
# The GPU machine's batch: build with CUDA, run every suite (GPU tests included), the greedy CLI
# checks on the GPU, and the 2B benchmark against HF transformers. Results go to $OUT (or out/).
# Dependencies missing there (yaml-cpp, CLI11, PCRE2, stb) come unpacked in .deps/.
source "$(dirname "$0")/gpu_env.sh"
build_gpu || exit 1
echo "== build ok"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  OMP_NUM_THREADS=2 ctest --test-dir build-gpu -j8 --output-on-failure ${CTEST_ARGS:-} >"$out/ctest.log" 2>&1
  tail -15 "$out/ctest.log"
  grep -E '^\s*[0-9]+/[0-9]+ Test.*(Failed|Exception|Timeout)' "$out/ctest.log" | head -20
  echo "GPU suites (skips would mean no GPU):"
  grep -c 'SKIPPED' "$out/ctest.log" || true
fi
fixture=tests/data/qwen3vl-tiny
echo "== generate on cuda (text prompt, greedy)"
build-gpu/iris generate -m $fixture -p "Write one sentence about CUDA graphs." -n 12 --temp 0 --json --device cuda
echo "== generate on cuda (two images, greedy, streamed)"
build-gpu/iris generate -m $fixture --image $fixture/images/image0.png --image $fixture/images/image1.png \
  -p "Describe these two pictures." -n 12 --temp 0 --device cuda
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench 2B"
  # --tune: the figures with timed GEMM algorithms, as they were measured before the tuning cache
  # (it also fills the cache for the commands after it).
  build-gpu/iris bench --config bench/configs/qwen3vl_2b.json --tune --json "$out/bench_2b.json" \
    --peer "python3 bench/peers/hf_transformers.py --config bench/configs/qwen3vl_2b.json" 2>&1 | tee "$out/bench_2b.txt"
fi
if [ "${SKIP_EXPORT:-0}" != 1 ]; then
  echo "== export parity with HF transformers"
  rm -rf /tmp/iris_export_check && mkdir -p /tmp/iris_export_check
  build-gpu/iris data shapes --out /tmp/iris_export_check/shapes --n 64 --seed 5 --force >/dev/null
  build-gpu/iris train --recipe recipes/qwen3vl_tiny_shapes.yaml train.train_iters=4 \
    data.train_files=[/tmp/iris_export_check/shapes/train.jsonl] \
    data.eval_files=[/tmp/iris_export_check/shapes/heldout.jsonl] \
    checkpoint.dir=/tmp/iris_export_check/run checkpoint.save_interval=4 schedule.warmup_iters=1 >/tmp/iris_export_check/train.log 2>&1 \
    || { tail -20 /tmp/iris_export_check/train.log; exit 1; }
  build-gpu/iris export /tmp/iris_export_check/run /tmp/iris_export_check/hf
  build-gpu/iris generate -m /tmp/iris_export_check/hf -p "Describe the image." -n 1 --temp 0 --device cpu \
    --logits-out /tmp/iris_export_check/logits.safetensors >/dev/null 2>&1
  python3 tools/hf_check_export.py /tmp/iris_export_check/hf /tmp/iris_export_check/logits.safetensors "Describe the image."
fi
