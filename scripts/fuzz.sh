#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang with ASan + UBSan) in build-fuzz and runs each for a
# bounded time from the seed corpora in tests/data/fuzz. A crash, a sanitizer report, a leak of
# another exception than iris::Error, a timeout or running out of memory fails the script and
# leaves the input under build-fuzz/artifacts/<target>/ (add it to the target's regression test).
#
#   FUZZ_SECONDS=30 scripts/fuzz.sh                 every target, 30 s each (the default)
#   FUZZ_SECONDS=1800 scripts/fuzz.sh safetensors   one target for 30 minutes
#
# The corpus each run grows is kept in build-fuzz/corpus/<target>/, so later runs start from it.
# FUZZ_BUILD_DIR names another tree (from the repository root), already configured with
# -DIRIS_FUZZ=ON: scripts/test.sh passes its sanitizer tree, build-sanitize, which holds the tests
# too. Only the fuzz targets are built there, and the corpora, logs and artifacts go under it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
seconds=${FUZZ_SECONDS:-30}
jobs=${IRIS_JOBS:-$(nproc)}
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(safetensors model_config tokenizer_json prompt image recipe jsonl chat_template)
command -v clang++ >/dev/null || { echo "fuzz.sh: clang++ is needed (apt-get install clang libclang-rt-dev libomp-dev)" >&2; exit 1; }
[ -s tests/data/qwen3vl-tiny/tokenizer.json ] || scripts/fetch_tokenizer.sh

build=${FUZZ_BUILD_DIR:-build-fuzz}
if [ -z "${FUZZ_BUILD_DIR:-}" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$build" -DIRIS_FUZZ=ON -DIRIS_BUILD_TESTS=OFF \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
elif ! grep -qiE '^IRIS_FUZZ:BOOL=(ON|1|TRUE|YES|Y)$' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "fuzz.sh: FUZZ_BUILD_DIR=$build is not a build tree configured with -DIRIS_FUZZ=ON" >&2
  exit 1
fi
cmake --build "$build" -j"$jobs" --target "${targets[@]/#/fuzz_}"

# Leaks: OpenMP's and OpenBLAS's pools are not ours, and a loader that throws leaks nothing of its
# own that ASan's leak check would find without also reporting those.
export ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export OMP_NUM_THREADS=1
# One target a core at a time: each still runs its full time, and CI waits the least.
fuzz_one() {
  local t=$1
  local corpus=$build/corpus/$t artifacts=$build/artifacts/$t
  mkdir -p "$corpus" "$artifacts"
  # Inputs larger than a few hundred KB only slow the search; 1 MB covers every seed.
  local log=$build/fuzz_$t.log runs cov
  if "$build"/fuzz_"$t" "$corpus" tests/data/fuzz/"$t" -max_total_time="$seconds" \
      -max_len=1048576 -timeout=20 -rss_limit_mb=3072 -print_final_stats=1 \
      -artifact_prefix="$artifacts/" >"$log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | grep -o '[0-9]*' || true)
    echo "fuzz $t: ${seconds}s, ${runs:-?} executions, coverage ${cov:-?} edges, no crash"
  else
    echo "fuzz $t: FAILED, see $log and $artifacts/" >&2
    tail -n 40 "$log" >&2
    return 1
  fi
}
status=0
pids=()
for t in "${targets[@]}"; do
  fuzz_one "$t" &
  pids+=($!)
  if [ ${#pids[@]} -ge "$jobs" ]; then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
done
for p in ${pids[@]+"${pids[@]}"}; do wait "$p" || status=1; done
exit $status
