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

namespace {

// Elements per block of a checked copy: the block is checked while it is still in the cache.
int64_t finite_block(DType dtype) {
  return static_cast<int64_t>((size_t{256} << 10) / dtype_size(dtype));
}

int64_t copy_finite_block(void* dst, const void* src, DType dtype, int64_t begin, int64_t len) {
  const int64_t elem = static_cast<int64_t>(dtype_size(dtype));
  char* out = static_cast<char*>(dst) + begin * elem;
  std::memcpy(out, static_cast<const char*>(src) + begin * elem, static_cast<size_t>(len * elem));
  return first_non_finite(out, dtype, len);
}

}  // namespace

int64_t copy_finite_parallel(void* dst, const void* src, DType dtype, int64_t n) {
  const int64_t per_block = finite_block(dtype);
  const int64_t blocks = (n + per_block - 1) / per_block;
  int64_t first = n;
#pragma omp parallel for schedule(static) reduction(min : first) if (blocks >= 4)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * per_block;
    const int64_t bad = copy_finite_block(dst, src, dtype, begin, std::min(per_block, n - begin));
    if (bad >= 0) first = std::min(first, begin + bad);
  }
  return first == n ? -1 : first;
}

int64_t copy_finite(void* dst, const void* src, DType dtype, int64_t n) {
  const int64_t per_block = finite_block(dtype);
  for (int64_t begin = 0; begin < n; begin += per_block) {
    const int64_t bad = copy_finite_block(dst, src, dtype, begin, std::min(per_block, n - begin));
    if (bad >= 0) return begin + bad;
  }
  return -1;
}

int64_t convert_finite(void* dst, DType to, const void* src, DType from, int64_t n) {
  // In blocks, each below first_non_finite's threshold for a thread team of its own.
  const int64_t per_block = finite_block(from);
  for (int64_t begin = 0; begin < n; begin += per_block) {
    const int64_t bad =
        first_non_finite(static_cast<const char*>(src) + begin * int64_t(dtype_size(from)), from,
                         std::min(per_block, n - begin));
    if (bad >= 0) return begin + bad;
  }
  if (from == DType::f32 && to == DType::bf16) {
    auto* d = static_cast<uint16_t*>(dst);
    const auto* s = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) d[i] = to_bf16(s[i]);
  } else {
    convert_elements(dst, to, src, from, n);
  }
  return -1;
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
