// LayerNorm, RMSNorm and the fused per-head q/k RMSNorm + RoPE. Statistics in f32; the bf16
// rounding points follow HF (spec section 10, items 3 and 4).
#include <cmath>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/kernels.h"
#include "core/cuda/launch.cuh"

namespace iris::cuda {
namespace {

constexpr int kNormThreads = 128;

// One block per row, the row held in registers (VPT 16-byte vectors per thread), so x is read
// once and the two-pass variance costs no second trip to memory. y may alias x.
template <int VPT, bool kLayer>
__global__ void __launch_bounds__(kNormThreads)
    norm_vec_kernel(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* b,
                    int64_t cols, float eps) {
  __shared__ float scratch[kNormThreads / kWarpSize];
  // A GEMV that reads this output (the lm_head after the final norm) may launch now and start
  // streaming its weights; it waits for this kernel before it reads y.
  pdl_launch_dependents();
  const int64_t n_vec = cols / 8;
  const uint16_t* xr = x + static_cast<int64_t>(blockIdx.x) * cols;
  uint16_t* yr = y + static_cast<int64_t>(blockIdx.x) * cols;
  float v[VPT][8];
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t vi = threadIdx.x + static_cast<int64_t>(k) * kNormThreads;
    if (vi < n_vec) {
      load8(xr + vi * 8, v[k]);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[k][e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += kLayer ? v[k][e] : v[k][e] * v[k][e];
  }
  const float inv_cols = 1.f / static_cast<float>(cols);
  float mean = 0.f, rstd;
  if constexpr (kLayer) {
    mean = block_sum(sum, scratch) * inv_cols;
    float sq = 0.f;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
      const int64_t vi = threadIdx.x + static_cast<int64_t>(k) * kNormThreads;
      if (vi < n_vec) {
#pragma unroll
        for (int e = 0; e < 8; ++e) sq += (v[k][e] - mean) * (v[k][e] - mean);
      }
    }
    rstd = rsqrtf(block_sum(sq, scratch) * inv_cols + eps);
  } else {
    rstd = rsqrtf(block_sum(sum, scratch) * inv_cols + eps);
  }
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int64_t vi = threadIdx.x + static_cast<int64_t>(k) * kNormThreads;
    if (vi >= n_vec) continue;
    float wv[8], out[8];
    load8(w + vi * 8, wv);
    if constexpr (kLayer) {
      float bv[8];
      load8(b + vi * 8, bv);
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = (v[k][e] - mean) * rstd * wv[e] + bv[e];
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = round_bf16(v[k][e] * rstd) * wv[e];
    }
    store8(yr + vi * 8, out);
  }
}

// Any row length or alignment: re-reads the row from global memory (L1/L2-resident) per pass.
template <bool kLayer>
__global__ void __launch_bounds__(kNormThreads)
    norm_scalar_kernel(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* b,
                       int64_t cols, float eps) {
  __shared__ float scratch[kNormThreads / kWarpSize];
  const uint16_t* xr = x + static_cast<int64_t>(blockIdx.x) * cols;
  uint16_t* yr = y + static_cast<int64_t>(blockIdx.x) * cols;
  const float inv_cols = 1.f / static_cast<float>(cols);
  float mean = 0.f, acc = 0.f;
  if constexpr (kLayer) {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) acc += bf16_to_float(xr[c]);
    mean = block_sum(acc, scratch) * inv_cols;
    acc = 0.f;
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = bf16_to_float(xr[c]) - mean;
    acc += d * d;
  }
  const float rstd = rsqrtf(block_sum(acc, scratch) * inv_cols + eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xv = bf16_to_float(xr[c]), wv = bf16_to_float(w[c]);
    yr[c] = kLayer ? float_to_bf16((xv - mean) * rstd * wv + bf16_to_float(b[c]))
                   : float_to_bf16(round_bf16(xv * rstd) * wv);
  }
}

template <bool kLayer>
void launch_norm(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* b, int64_t rows,
                 int64_t cols, float eps, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  const unsigned grid = static_cast<unsigned>(rows);
  const bool vec =
      cols % 8 == 0 && aligned16(y) && aligned16(x) && aligned16(w) && (!kLayer || aligned16(b));
  const int64_t n_vec = cols / 8;
  if (vec && n_vec <= kNormThreads) {
    norm_vec_kernel<1, kLayer><<<grid, kNormThreads, 0, s>>>(y, x, w, b, cols, eps);
  } else if (vec && n_vec <= 2 * kNormThreads) {
    norm_vec_kernel<2, kLayer><<<grid, kNormThreads, 0, s>>>(y, x, w, b, cols, eps);
  } else if (vec && n_vec <= 4 * kNormThreads) {
    norm_vec_kernel<4, kLayer><<<grid, kNormThreads, 0, s>>>(y, x, w, b, cols, eps);
  } else if (vec && n_vec <= 8 * kNormThreads) {
    norm_vec_kernel<8, kLayer><<<grid, kNormThreads, 0, s>>>(y, x, w, b, cols, eps);
  } else {
    norm_scalar_kernel<kLayer><<<grid, kNormThreads, 0, s>>>(y, x, w, b, cols, eps);
  }
  IRIS_CUDA_LAUNCH_CHECK();
}

constexpr int kRopeWarps = 4;
constexpr int kRopeMaxPairsPerLane = 4;  // head_dim <= 256

// One warp per (token, q-or-k head). Lane l owns the rotate-half pairs (i, i + hd/2) for
// i = l, l + 32, ...: RoPE mixes exactly those two elements, so no data crosses lanes except the
// norm's sum of squares.
__global__ void __launch_bounds__(kRopeWarps* kWarpSize)
    qkv_norm_rope_kernel(uint16_t* qkv, const uint16_t* q_norm_w, const uint16_t* k_norm_w,
                         float eps, const float* cos, const float* sin, int64_t tokens,
                         int n_q_heads, int n_kv_heads, int head_dim, bool round_tables) {
  // A programmatic dependent (launch.cuh): nothing is read before the kernels before it finish.
  pdl_launch_dependents();
  pdl_wait();
  const int heads = n_q_heads + n_kv_heads;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kRopeWarps + threadIdx.x / kWarpSize;
  if (item >= tokens * heads) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = item / heads;
  const int head = static_cast<int>(item % heads);
  const int half = head_dim / 2;
  const int64_t row_stride = static_cast<int64_t>(n_q_heads + 2 * n_kv_heads) * head_dim;
  uint16_t* x = qkv + t * row_stride + static_cast<int64_t>(head) * head_dim;
  const uint16_t* norm_w = head < n_q_heads ? q_norm_w : k_norm_w;

  float x1[kRopeMaxPairsPerLane], x2[kRopeMaxPairsPerLane];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < kRopeMaxPairsPerLane; ++k) {
    const int i = lane + k * kWarpSize;
    x1[k] = i < half ? bf16_to_float(x[i]) : 0.f;
    x2[k] = i < half ? bf16_to_float(x[i + half]) : 0.f;
    ss += x1[k] * x1[k] + x2[k] * x2[k];
  }
  if (norm_w != nullptr) {
    // Qwen3RMSNorm: normalise in f32, cast to bf16, multiply by the bf16 weight (bf16 result).
    const float r = rsqrtf(warp_sum(ss) / static_cast<float>(head_dim) + eps);
#pragma unroll
    for (int k = 0; k < kRopeMaxPairsPerLane; ++k) {
      const int i = lane + k * kWarpSize;
      if (i < half) {
        x1[k] = round_bf16(round_bf16(x1[k] * r) * bf16_to_float(norm_w[i]));
        x2[k] = round_bf16(round_bf16(x2[k] * r) * bf16_to_float(norm_w[i + half]));
      }
    }
  }
  const float* ct = cos + t * head_dim;
  const float* st = sin + t * head_dim;
#pragma unroll
  for (int k = 0; k < kRopeMaxPairsPerLane; ++k) {
    const int i = lane + k * kWarpSize;
    if (i >= half) continue;
    float c1 = ct[i], c2 = ct[i + half], s1 = st[i], s2 = st[i + half];
    float o1, o2;
    if (round_tables) {
      // Text M-RoPE as HF runs it: bf16 tables, and q*cos, rotate_half(q)*sin and their sum
      // each materialised as a bf16 tensor.
      c1 = round_bf16(c1), c2 = round_bf16(c2), s1 = round_bf16(s1), s2 = round_bf16(s2);
      o1 = round_bf16(x1[k] * c1) + round_bf16(-x2[k] * s1);
      o2 = round_bf16(x2[k] * c2) + round_bf16(x1[k] * s2);
    } else {
      // Vision RoPE: f32 throughout, rounded once on the store.
      o1 = x1[k] * c1 - x2[k] * s1;
      o2 = x2[k] * c2 + x1[k] * s2;
    }
    x[i] = float_to_bf16(o1);
    x[i + half] = float_to_bf16(o2);
  }
}

}  // namespace

void launch_layer_norm(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* b,
                       int64_t rows, int64_t cols, float eps, cudaStream_t s) {
  launch_norm<true>(y, x, w, b, rows, cols, eps, s);
}

void launch_rms_norm(uint16_t* y, const uint16_t* x, const uint16_t* w, int64_t rows, int64_t cols,
                     float eps, cudaStream_t s) {
  launch_norm<false>(y, x, w, nullptr, rows, cols, eps, s);
}

void launch_qkv_norm_rope(uint16_t* qkv, const uint16_t* q_norm_w, const uint16_t* k_norm_w,
                          float eps, const float* cos, const float* sin, int64_t tokens,
                          int n_q_heads, int n_kv_heads, int head_dim, bool round_tables,
                          cudaStream_t s) {
  const int64_t items = tokens * (n_q_heads + n_kv_heads);
  if (items == 0) return;
  const unsigned grid = static_cast<unsigned>((items + kRopeWarps - 1) / kRopeWarps);
  launch_programmatic(qkv_norm_rope_kernel, dim3(grid), dim3(kRopeWarps * kWarpSize), 0, s, qkv,
                      q_norm_w, k_norm_w, eps, cos, sin, tokens, n_q_heads, n_kv_heads, head_dim,
                      round_tables);
}

}  // namespace iris::cuda
