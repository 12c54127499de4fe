// CPU time the calling thread has used, for telling a call that worked from one that slept while
// waiting (a CUDA launch blocked by a full launch queue, say): wall time minus this is the wait.
#pragma once

#include <ctime>

namespace iris {

inline double thread_cpu_seconds() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0;
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace iris
