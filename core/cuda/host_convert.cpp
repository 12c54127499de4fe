#include "core/cuda/host_convert.h"

#include <algorithm>
#include <cstring>

namespace iris::cuda {
namespace {

// Below this many elements a conversion is cheaper than waking the thread team.
constexpr int64_t kParallelMin = int64_t{1} << 18;

// iris::f32_to_bf16 without the early return, so that the loop vectorises.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

inline float to_f32(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

void copy_bytes_parallel(void* dst, const void* src, size_t bytes) {
  constexpr size_t kBlock = size_t{256} << 10;
  // A team of every core pays off on a weight's 8 MB staging chunks, not on a call's few MB of
  // image bytes: on an H200 host with a spinning thread per core, a 2.4 MB image copied by the
  // team took 12 ms (its barrier waits for the last thread the scheduler runs), one thread's
  // memcpy a fraction of a millisecond.
  constexpr size_t kParallelBytes = size_t{8} << 20;
  const int64_t blocks = static_cast<int64_t>((bytes + kBlock - 1) / kBlock);
#pragma omp parallel for schedule(static) if (bytes >= kParallelBytes)
  for (int64_t b = 0; b < blocks; ++b) {
    const size_t off = static_cast<size_t>(b) * kBlock;
    std::memcpy(static_cast<char*>(dst) + off, static_cast<const char*>(src) + off,
                std::min(kBlock, bytes - off));
  }
}

int64_t copy_finite_parallel(void* dst, const void* src, DType dtype, int64_t n) {
  const size_t elem = dtype_size(dtype);
  const int64_t per_block = static_cast<int64_t>((size_t{256} << 10) / elem);
  const int64_t blocks = (n + per_block - 1) / per_block;
  int64_t first = n;
#pragma omp parallel for schedule(static) reduction(min : first) if (blocks >= 4)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * per_block, len = std::min(per_block, n - begin);
    char* out = static_cast<char*>(dst) + begin * static_cast<int64_t>(elem);
    std::memcpy(out, static_cast<const char*>(src) + begin * static_cast<int64_t>(elem),
                static_cast<size_t>(len) * elem);
    const int64_t bad = first_non_finite(out, dtype, len);
    if (bad >= 0) first = std::min(first, begin + bad);
  }
  return first == n ? -1 : first;
}

void convert_f32_to_bf16(uint16_t* dst, const float* src, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}

void convert_bf16_to_f32(float* dst, const uint16_t* src, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src[i]);
}

}  // namespace iris::cuda
