#!/usr/bin/env bash
# The GPU machine's training batch: build with CUDA, the training kernels' standalone checks, the
# backward backend-op test, the CUDA golden gradients, and the tiny shapes recipe trained on the
# CPU and on CUDA from the same start (loss curves compared), with a kill -9 and resume on CUDA.
# Results go to $OUT (or out/). Carry .deps (scripts/fetch_gpu_deps.sh) and the fixture's
# tokenizer.json.
source "$(dirname "$0")/gpu_env.sh"
steps=${TRAIN_STEPS:-300}
nvidia-smi -L
build_gpu || exit 1
echo "== build ok"
nvcc=/usr/local/cuda/bin/nvcc
command -v nvcc >/dev/null && nvcc=nvcc
echo "== attention_train_check"
$nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I. \
  tools/attention_train_check.cu core/cuda/attention/attention_train.cu core/error.cpp -o build-gpu/attention_train_check \
  && build-gpu/attention_train_check 2>&1 | tee "$out/attention_train_check.txt" | tail -25
echo "== gemm_train_check"
$nvcc -std=c++20 -O2 -gencode=arch=compute_90a,code=sm_90a -I. tools/gemm_train_check.cu \
  core/cuda/gemm/gemm.cu core/cuda/gemm/gemm_tuning.cpp core/tuning_cache.cpp core/fs.cpp core/json_read.cpp \
  core/error.cpp -lcublasLt -lcublas -o build-gpu/gemm_train_check \
  && build-gpu/gemm_train_check 2>&1 | tee "$out/gemm_train_check.txt" | grep -E "FAIL|PASS|ALL" | tail -12
echo "== backward backend ops"
build-gpu/core_backward_ops_test >"$out/backward_ops.txt" 2>&1
grep -E '^\[  (PASSED|FAILED) |^\[  FAILED|Failure' "$out/backward_ops.txt" | head -30
echo "== CUDA golden gradients"
build-gpu/training_gradients_test --gtest_filter='Cuda*' 2>&1 | grep -E 'CUDA|relative L2|OK|FAILED|Failure|Expected' | head -40
if [ "${RUN_CTEST:-0}" = 1 ]; then
  OMP_NUM_THREADS=2 ctest --test-dir build-gpu -j8 >"$out/ctest.log" 2>&1
  tail -4 "$out/ctest.log"; grep -E '\(Failed\)|Timeout|Exception' "$out/ctest.log" | head
fi
data=/tmp/iris_shapes
build-gpu/iris data shapes --out $data --n 20000 --seed 1 --force >/dev/null
common=(--recipe recipes/qwen3vl_tiny_shapes.yaml train.train_iters=$steps
  data.train_files=[$data/train.jsonl] data.eval_files=[$data/heldout.jsonl]
  logging.log_interval=10 train.eval_interval=0 checkpoint.save_interval=0)
rm -rf /tmp/run_cpu /tmp/run_cuda /tmp/run_kill /tmp/run_ref
if [ "${RUN_CURVES:-1}" = 1 ]; then
echo "== tiny shapes recipe, $steps steps, CPU and CUDA"
( time build-gpu/iris train "${common[@]}" train.device=cpu checkpoint.dir=/tmp/run_cpu >"$out/train_cpu.log" 2>&1 ) 2>>"$out/train_cpu.log" &
( time build-gpu/iris train "${common[@]}" train.device=cuda checkpoint.dir=/tmp/run_cuda >"$out/train_cuda.log" 2>&1 ) 2>>"$out/train_cuda.log"
wait
tail -n 4 "$out/train_cuda.log"; tail -n 4 "$out/train_cpu.log"
cp /tmp/run_cpu/metrics.jsonl "$out/metrics_cpu.jsonl" 2>/dev/null
cp /tmp/run_cuda/metrics.jsonl "$out/metrics_cuda.jsonl" 2>/dev/null
python3 tools/compare_loss_curves.py /tmp/run_cpu/metrics.jsonl /tmp/run_cuda/metrics.jsonl
fi
echo "== kill -9 and resume on CUDA"
kill_steps=40
build-gpu/iris train "${common[@]}" train.train_iters=$kill_steps checkpoint.save_interval=10 \
  train.device=cuda checkpoint.dir=/tmp/run_ref logging.log_interval=1 >/dev/null 2>&1
build-gpu/iris train "${common[@]}" train.train_iters=$kill_steps checkpoint.save_interval=10 \
  train.device=cuda checkpoint.dir=/tmp/run_kill logging.log_interval=1 >/dev/null 2>&1 &
pid=$!
for i in $(seq 1 600); do
  [ -f /tmp/run_kill/latest ] && grep -q 0000020 /tmp/run_kill/latest 2>/dev/null && break
  sleep 0.05
done
kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
echo "killed at checkpoint $(cat /tmp/run_kill/latest 2>/dev/null)"
build-gpu/iris train "${common[@]}" train.train_iters=$kill_steps checkpoint.save_interval=10 \
  train.device=cuda checkpoint.dir=/tmp/run_kill logging.log_interval=1 >/dev/null 2>&1
python3 tools/compare_loss_curves.py --exact /tmp/run_ref/metrics.jsonl /tmp/run_kill/metrics.jsonl
if [ "${RUN_DEMO:-1}" = 1 ]; then
  echo "== the demo's training on CUDA (the recipe as it is), export, held-out accuracy"
  rm -rf /tmp/run_demo
  start=$(date +%s%N)
  build-gpu/iris train "${common[@]}" train.train_iters=2000 checkpoint.save_interval=500 \
    train.eval_interval=500 train.device=cuda checkpoint.dir=/tmp/run_demo >"$out/demo_train.log" 2>&1
  echo "training took $(( ($(date +%s%N) - start) / 1000000 )) ms"
  grep -E "eval at|done:" "$out/demo_train.log" | tail -n 6
  build-gpu/iris export /tmp/run_demo /tmp/run_demo/hf >/dev/null
  build-gpu/iris data shapes-eval -m /tmp/run_demo/hf --heldout $data/heldout.jsonl --limit 400 2>&1 | tail -n 4
fi
if [ "${RUN_2B:-1}" = 1 ]; then
  echo "== 2B geometry, full fine-tuning, one 896x896 image and 3072 text tokens per sample"
  build-gpu/iris train --recipe recipes/qwen3vl_2b_pretrain_mock.yaml train.device=cuda \
    'data.mock_image_sizes=[[896,896]]' data.mock_text_tokens=3072 train.freeze_vision_tower=false \
    train.freeze_language_model=false train.global_batch_size=${GLOBAL_2B:-4} train.train_iters=${ITERS_2B:-4} \
    checkpoint.dir=/tmp/run_2b 2>&1 | tee "$out/train_2b.log" | grep -vE '^\s*$' | tail -n 12
  if [ "${RUN_PEER:-1}" = 1 ]; then
    echo "== HF transformers training peer, same geometry and accumulation"
    PYTHONUNBUFFERED=1 timeout 300 python3 bench/peers/hf_transformers_train.py \
      --config recipes/configs/qwen3vl_2b.json --accumulation ${GLOBAL_2B:-4} --steps 2 2>&1 | tail -n 1
  fi
fi
