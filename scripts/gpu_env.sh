# Sourced by the GPU machine's batches (gpu_check.sh, gpu_train_check.sh, gpu_train_perf.sh):
# the repository root as the working directory, $out for results ($OUT, or out/), the unpacked
# .deps libraries (scripts/fetch_gpu_deps.sh) on the library path, and build_gpu [targets...],
# which configures build-gpu for the H100/H200 and builds it, printing only errors.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
out=${OUT:-$root/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$root/.deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
jobs=$(nproc)

build_gpu() {
  local targets=()
  for t in "$@"; do targets+=(--target "$t"); done
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DIRIS_DEPS_PREFIX="$root/.deps" >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; return 1; }
  cmake --build build-gpu -j"$jobs" "${targets[@]}" >"$out/build.log" 2>&1 ||
    { grep -E 'error' -A3 "$out/build.log" | head -40; return 1; }
}
