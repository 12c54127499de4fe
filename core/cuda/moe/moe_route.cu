// The router of a mixture-of-experts layer (core/backend_ops.inc, moe_route): one warp a row.
// The experts are ranked by logit, as the CPU oracle ranks them, so that both pick the same ids
// whatever their exp rounding; the probabilities are then the softmax's, in f32.
#include <cuda_runtime.h>

#include <cmath>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/moe/moe.h"

namespace iris::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

// The better of two (logit, expert) candidates: the larger logit, the lower expert among equals.
__device__ __forceinline__ bool beats(float v, int e, float best_v, int best_e) {
  return v > best_v || (v == best_v && e < best_e);
}

template <int kPerLane>
__global__ void moe_route_kernel(int32_t* __restrict__ ids, uint16_t* __restrict__ weights,
                                 float* __restrict__ probs, const uint16_t* __restrict__ logits,
                                 int64_t T, int E, int k, const int32_t* __restrict__ real_rows) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= T) return;
  const int64_t real = real_rows != nullptr ? *real_rows : T;
  if (t >= real) {
    for (int j = lane; j < k; j += 32) {
      ids[t * k + j] = -1;
      weights[t * k + j] = 0;
    }
    if (probs != nullptr)
      for (int e = lane; e < E; e += 32) probs[t * E + e] = 0.0f;
    return;
  }
  const uint16_t* row = logits + t * E;
  float v[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    v[i] = e < E ? bf16_to_float(row[e]) : -INFINITY;
  }
  float max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) max = fmaxf(max, v[i]);
  for (int o = 16; o > 0; o >>= 1) max = fmaxf(max, __shfl_xor_sync(0xffffffffu, max, o));
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) sum += expf(v[i] - max);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if (probs != nullptr) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E) probs[t * E + e] = expf(v[i] - max) / sum;
    }
  }
  // k rounds of a warp-wide argmax over the experts not yet taken; lane j keeps pick j.
  unsigned taken = 0;
  int my_id = -1;
  float my_p = 0.0f;
  for (int j = 0; j < k; ++j) {
    float best_v = -INFINITY;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + 32 * i;
      if (e < E && !(taken & (1u << i)) && beats(v[i], e, best_v, best_e)) {
        best_v = v[i];
        best_e = e;
      }
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (beats(ov, oe, best_v, best_e)) {
        best_v = ov;
        best_e = oe;
      }
    }
    if (best_e % 32 == lane) taken |= 1u << (best_e / 32);
    if (lane == j) {
      my_id = best_e;
      my_p = expf(best_v - max) / sum;
    }
  }
  // The picks' sum in pick order, as the CPU adds them.
  float chosen = 0.0f;
  for (int j = 0; j < k; ++j) chosen += __shfl_sync(0xffffffffu, my_p, j);
  if (lane < k) {
    ids[t * k + lane] = my_id;
    weights[t * k + lane] = float_to_bf16(my_p / chosen);
  }
}

}  // namespace

void launch_moe_route(int32_t* ids, uint16_t* weights, float* probs, const uint16_t* logits,
                      int64_t T, int E, int k, const int32_t* real_rows, cudaStream_t s) {
  if (T == 0) return;
  const dim3 grid(static_cast<unsigned>((T + kWarpsPerBlock - 1) / kWarpsPerBlock));
  const dim3 block(32 * kWarpsPerBlock);
  if (E <= 128)
    moe_route_kernel<4><<<grid, block, 0, s>>>(ids, weights, probs, logits, T, E, k, real_rows);
  else
    moe_route_kernel<16><<<grid, block, 0, s>>>(ids, weights, probs, logits, T, E, k, real_rows);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
