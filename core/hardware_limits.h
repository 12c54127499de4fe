// The rates a measured time is held against: a square GEMM's FLOP rate and a copy's byte rate,
// measured through a backend in the same run (the benchmarks and the step profile's floors).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#include "core/backend.h"

namespace iris {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Median of `iters` timed runs of fn, in seconds. The warm-up repeats fn for at least 100 ms: a
// GPU left idle (during graph capture, say) can drop its clocks and take a while to raise them;
// with one warm-up call of a 1 ms phase, an H100 run timed graphs vision 1x256 at 5.49 ms while
// its device span, taken next, was 1.34 ms.
template <typename F>
double time_median(Backend& be, int iters, F&& fn) {
  const auto warm0 = Clock::now();
  do {
    fn();
    be.synchronize();
  } while (seconds_since(warm0) < 0.1);
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    fn();
    be.synchronize();
    t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct HardwareLimits {
  double gemm_tflops = 0;  // a square GEMM of side gemm_n in the compute dtype, through the backend
  int64_t gemm_n = 0;
  double copy_gbps = 0;  // bytes read + written per second / 1e9
};
// Allocates its operands (on a GPU 3 x 8192^2 (quick: 4096^2) compute-dtype matrices and 2 GiB of
// copy buffers) and frees them before it returns.
HardwareLimits measure_limits(Backend& be, bool quick, int iters);

}  // namespace iris
