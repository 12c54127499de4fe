// Backend::text_rope_tables on the device: the M-RoPE tables of a text call from its tokens'
// positions in device memory, so that a captured graph computes the tables of each replay's
// positions and the host uploads three ints a token instead of two head_dim rows.
#include <algorithm>

#include "core/cuda/cuda_check.h"
#include "core/cuda/tables/tables.h"

namespace iris::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4096;

// Kernel arguments are copied at launch (and frozen in a captured graph), which is what a
// per-model constant needs.
struct RopePairs {
  float inv_freq[kTextRopeMaxPairs];
  int axis[kTextRopeMaxPairs];
};

// One thread per (token, frequency pair j): writes columns j and j + half of cos and sin.
__global__ void text_rope_tables_kernel(float* cos, float* sin, const int32_t* positions,
                                        int64_t rows, int half, RopePairs pairs) {
  const int64_t n = rows * half;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / half;
    const int j = static_cast<int>(i % half);
    const float f =
        __fmul_rn(static_cast<float>(positions[t * 3 + pairs.axis[j]]), pairs.inv_freq[j]);
    // Rounded from double: the correctly rounded float in all but rare cases, where glibc's
    // cosf and sinf (the CPU oracle) are off by an ulp.
    double s, co;
    ::sincos(static_cast<double>(f), &s, &co);
    const int64_t at = t * 2 * half + j;
    cos[at] = cos[at + half] = static_cast<float>(co);
    sin[at] = sin[at + half] = static_cast<float>(s);
  }
}

}  // namespace

void launch_text_rope_tables(float* cos, float* sin, const int32_t* positions, int64_t rows,
                             int half, const float* inv_freq, const int* axis, cudaStream_t s) {
  if (rows == 0) return;
  RopePairs pairs{};
  std::copy(inv_freq, inv_freq + half, pairs.inv_freq);
  std::copy(axis, axis + half, pairs.axis);
  const int64_t work = rows * half;
  const int64_t blocks = std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks);
  text_rope_tables_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(cos, sin, positions,
                                                                             rows, half, pairs);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
