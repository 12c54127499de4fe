// The router's backward and the load-balancing loss (core/backend_ops.inc: moe_route_backward,
// moe_route_stats, moe_aux_loss). The statistics and the loss sum in the CPU oracle's order (one
// thread an expert, rows ascending), so that they are bit-identical on both backends.
#include <cuda_runtime.h>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/moe/moe.h"

namespace iris::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

// One warp a row; lane j < k holds pick j.
__global__ void moe_route_backward_kernel(uint16_t* __restrict__ dlogits,
                                          const float* __restrict__ dweights,
                                          const float* __restrict__ probs,
                                          const int32_t* __restrict__ ids,
                                          const float* __restrict__ aux_dprob, int64_t T, int E,
                                          int k) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (t >= T) return;
  uint16_t* dl = dlogits + t * E;
  const int32_t* id = ids + t * k;
  if (id[0] < 0) {
    for (int e = lane; e < E; e += 32) dl[e] = 0;
    return;
  }
  const float* p = probs + t * E;
  const int my_id = lane < k ? id[lane] : -1;
  const float my_s = my_id >= 0 ? p[my_id] : 0.0f;
  const float my_dw = lane < k ? dweights[t * k + lane] : 0.0f;
  // The sums in pick order, as the CPU adds them.
  float S = 0.0f;
  for (int j = 0; j < k; ++j) S += __shfl_sync(0xffffffffu, my_s, j);
  float g = 0.0f;
  for (int j = 0; j < k; ++j)
    g += __shfl_sync(0xffffffffu, my_dw, j) * (__shfl_sync(0xffffffffu, my_s, j) / S);
  // The picks' ids and gradients, for every lane's experts.
  __shared__ int pick_id[kWarpsPerBlock][32];
  __shared__ float pick_ds[kWarpsPerBlock][32];
  const int w = static_cast<int>(threadIdx.x / 32);
  pick_id[w][lane] = my_id;
  pick_ds[w][lane] = (my_dw - g) / S;
  __syncwarp();
  auto dp_of = [&](int e) {
    float dp = aux_dprob != nullptr ? aux_dprob[e] : 0.0f;
    for (int j = 0; j < k; ++j)
      if (pick_id[w][j] == e) dp += pick_ds[w][j];
    return dp;
  };
  float dot = 0.0f;
  for (int e = lane; e < E; e += 32) dot += p[e] * dp_of(e);
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  for (int e = lane; e < E; e += 32) dl[e] = float_to_bf16(p[e] * (dp_of(e) - dot));
}

__global__ void moe_route_stats_kernel(float* __restrict__ load, float* __restrict__ prob_sum,
                                       const int32_t* __restrict__ ids,
                                       const float* __restrict__ probs, int64_t T, int E, int k) {
  const int e = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= E) return;
  float count = 0.0f, sum = prob_sum[e];
  for (int64_t s = 0; s < T * k; ++s) count += ids[s] == e ? 1.0f : 0.0f;
  for (int64_t t = 0; t < T; ++t) sum += probs[t * E + e];
  load[e] += count;
  prob_sum[e] = sum;
}

__global__ void moe_aux_loss_kernel(float* __restrict__ aux_sum, float* __restrict__ dprob,
                                    const float* __restrict__ load,
                                    const float* __restrict__ prob_sum,
                                    const int32_t* __restrict__ real_rows, int E, int layers,
                                    float grad_scale) {
  const float N = static_cast<float>(*real_rows) * static_cast<float>(layers);
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    dprob[e] = N > 0.0f ? __fmul_rn(__fmul_rn(grad_scale, static_cast<float>(E)), load[e]) /
                              __fmul_rn(N, N)
                        : 0.0f;
  if (threadIdx.x == 0 && N > 0.0f) {
    float aux = 0.0f;
    // Rounded as the CPU rounds each step (no fused multiply-add), for the same bits.
    for (int e = 0; e < E; ++e) aux = __fadd_rn(aux, __fmul_rn(load[e] / N, prob_sum[e] / N));
    aux_sum[0] = __fadd_rn(aux_sum[0], __fmul_rn(static_cast<float>(E), aux));
  }
}

}  // namespace

void launch_moe_route_backward(uint16_t* dlogits, const float* dweights, const float* probs,
                               const int32_t* ids, const float* aux_dprob, int64_t T, int E, int k,
                               cudaStream_t s) {
  if (T == 0) return;
  const dim3 grid(static_cast<unsigned>((T + kWarpsPerBlock - 1) / kWarpsPerBlock));
  moe_route_backward_kernel<<<grid, 32 * kWarpsPerBlock, 0, s>>>(dlogits, dweights, probs, ids,
                                                                 aux_dprob, T, E, k);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_moe_route_stats(float* load, float* prob_sum, const int32_t* ids, const float* probs,
                            int64_t T, int E, int k, cudaStream_t s) {
  moe_route_stats_kernel<<<(E + 127) / 128, 128, 0, s>>>(load, prob_sum, ids, probs, T, E, k);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_moe_aux_loss(float* aux_sum, float* dprob, const float* load, const float* prob_sum,
                         const int32_t* real_rows, int E, int layers, float grad_scale,
                         cudaStream_t s) {
  moe_aux_loss_kernel<<<1, 256, 0, s>>>(aux_sum, dprob, load, prob_sum, real_rows, E, layers,
                                        grad_scale);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
