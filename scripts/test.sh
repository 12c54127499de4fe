#!/usr/bin/env bash
# Installs the dependencies, builds Iris and runs every test suite: the Release build (GPU tests
# skip cleanly without a GPU), then the CPU suites again under AddressSanitizer and
# UndefinedBehaviorSanitizer, then each fuzz target for FUZZ_SECONDS (20 by default; 0 skips).
# The sanitizer suites and the fuzz targets share one clang tree, build-sanitize
# (-DIRIS_SANITIZE=ON -DIRIS_FUZZ=ON), so the instrumented libraries are compiled once.
# IRIS_SKIP_SANITIZERS=1 skips the sanitizer suites; the fuzz targets then build in build-fuzz.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
jobs=${IRIS_JOBS:-$(nproc)}
scripts/setup.sh
# ON builds the CUDA backend wherever nvcc is found (the demo may have cached OFF in build/).
scripts/build.sh -DIRIS_CUDA=ON
# One thread per test process and one process per core: the suites are many small processes.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ctest --test-dir build --output-on-failure -j"$jobs"
fuzz_tree=""  # fuzz.sh's own tree, build-fuzz, unless the sanitizer tree holds the targets
if [ "${IRIS_SKIP_SANITIZERS:-0}" != 1 ]; then
  # A build tree keeps the compiler it was configured with: one left by the gcc sanitizer build
  # of before is started again.
  if [ -f build-sanitize/CMakeCache.txt ] &&
      ! grep -qx 'IRIS_FUZZ:BOOL=ON' build-sanitize/CMakeCache.txt; then
    rm -rf build-sanitize
  fi
  # The tests, and the fuzz targets (libFuzzer's coverage on every library), in one clang tree.
  CC=clang CXX=clang++ cmake -S . -B build-sanitize -DIRIS_SANITIZE=ON -DIRIS_FUZZ=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build build-sanitize -j"$jobs"
  # OpenBLAS's and OpenMP's thread pools are not leaks of ours.
  ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir build-sanitize --output-on-failure -j"$jobs"
  fuzz_tree=build-sanitize
fi
# A short run of every fuzz target (the seeds and what the fuzzer reaches from them); a longer
# campaign is FUZZ_SECONDS=1800 scripts/fuzz.sh.
if [ "${FUZZ_SECONDS:-20}" != 0 ]; then
  FUZZ_BUILD_DIR=$fuzz_tree FUZZ_SECONDS=${FUZZ_SECONDS:-20} scripts/fuzz.sh
fi
