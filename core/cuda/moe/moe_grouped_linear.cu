// The experts' projections over the rows moe_dispatch sorted (core/backend_ops.inc:
// moe_grouped_linear): a plain shared-memory tiled GEMM with f32 accumulation whose blocks find
// their expert and row tile from the offsets on the device, so that a graph captured for one
// routing replays correctly for any other. The grid covers the most row tiles any split of R rows
// over E experts can have (R / 64 + E); blocks past the split's tiles exit at once.
#include <cuda_runtime.h>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/moe/moe.h"

namespace iris::cuda {
namespace {

constexpr int kTile = 64;   // rows and columns of y a block computes
constexpr int kDepth = 16;  // the K slice a block stages at a time
constexpr int kThreads = 256;

__global__ void moe_grouped_linear_kernel(uint16_t* __restrict__ y, const uint16_t* __restrict__ x,
                                          const uint16_t* __restrict__ w,
                                          const int32_t* __restrict__ offsets, int E, int64_t N,
                                          int64_t K) {
  // This block's expert and row tile: tile blockIdx.y of the experts' tiles laid end to end.
  int64_t tile = blockIdx.y;
  int e = 0;
  int64_t row0 = 0, rows = 0;
  for (; e < E; ++e) {
    const int64_t b = offsets[e], n = offsets[e + 1] - b;
    const int64_t tiles = (n + kTile - 1) / kTile;
    if (tile < tiles) {
      row0 = b + tile * kTile;
      rows = min(static_cast<int64_t>(kTile), n - tile * kTile);
      break;
    }
    tile -= tiles;
  }
  if (e == E) return;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const uint16_t* we = w + static_cast<int64_t>(e) * N * K;
  __shared__ float xs[kDepth][kTile + 1];
  __shared__ float ws[kDepth][kTile + 1];
  const int tx = static_cast<int>(threadIdx.x % 16), ty = static_cast<int>(threadIdx.x / 16);
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    for (int i = static_cast<int>(threadIdx.x); i < kDepth * kTile; i += kThreads) {
      const int r = i / kDepth, kk = i % kDepth;
      const int64_t kg = k0 + kk;
      xs[kk][r] = r < rows && kg < K ? bf16_to_float(x[(row0 + r) * K + kg]) : 0.0f;
      const int64_t n = col0 + r;
      ws[kk][r] = n < N && kg < K ? bf16_to_float(we[n * K + kg]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kDepth; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = xs[kk][ty + 16 * i];
        b[i] = ws[kk][tx + 16 * i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = col0 + tx + 16 * j;
      if (n < N) y[(row0 + r) * N + n] = float_to_bf16(acc[i][j]);
    }
  }
}

}  // namespace

void launch_moe_grouped_linear(uint16_t* y, const uint16_t* x, const uint16_t* w,
                               const int32_t* offsets, int64_t R, int E, int64_t N, int64_t K,
                               cudaStream_t s) {
  if (R == 0 || N == 0) return;
  const dim3 grid(static_cast<unsigned>((N + kTile - 1) / kTile),
                  static_cast<unsigned>((R + kTile - 1) / kTile + E));
  moe_grouped_linear_kernel<<<grid, kThreads, 0, s>>>(y, x, w, offsets, E, N, K);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
