#!/usr/bin/env bash
# Configures and builds Iris into build/ (Release). CUDA is built when nvcc is found.
# Extra arguments go to cmake's configure step; IRIS_TARGETS limits what is built (default: all).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${IRIS_JOBS:-$(nproc)}
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake -S "$root" -B "$root/build" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
targets=()
for t in ${IRIS_TARGETS:-}; do targets+=(--target "$t"); done
cmake --build "$root/build" -j"$jobs" "${targets[@]}"
