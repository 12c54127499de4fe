#!/usr/bin/env bash
# The demo: installs the dependencies, builds iris, makes a synthetic captioning set of coloured
# shapes, trains a small randomly initialised Qwen3-VL on it from recipes/qwen3vl_tiny_shapes.yaml
# (the real Qwen tokenizer, on the CPU), exports the result as a Hugging Face directory, then
# captions the held-out images with it and prints the accuracy on colour and shape words.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
# Training runs on the CPU: without a GPU to run it, the CUDA backend is not worth its build time.
cuda=()
nvidia-smi -L >/dev/null 2>&1 || cuda=(-DIRIS_CUDA=OFF)
IRIS_TARGETS=iris scripts/build.sh "${cuda[@]}"
start=$(date +%s)
run=runs/qwen3vl_tiny_shapes
build/iris data shapes --out data/shapes --n 20000 --seed 1 --force
# A fresh run each time: the recipe resumes from its checkpoints otherwise.
rm -rf "$run"
build/iris train --recipe recipes/qwen3vl_tiny_shapes.yaml
build/iris export "$run" "$run/hf"
build/iris data shapes-eval -m "$run/hf" --heldout data/shapes/heldout.jsonl --limit 400
echo "example:"
build/iris generate -m "$run/hf" --image data/shapes/images/019999.png -p "Describe the image." \
  --temp 0 -n 16
echo "data + training + evaluation took $(( $(date +%s) - start )) s; loss plot: $run/training_curves.svg"
