// Training kernels of the CUDA backend (train_kernels.h): norm and RoPE forwards that save their
// statistics, the backwards, cross-entropy over a logits chunk and the multi-tensor optimizer.
// Every reduction runs in a fixed order (no float atomics), so the same inputs give the same
// bits; nothing allocates or synchronises.
#include <cfloat>
#include <cmath>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/train_kernels.h"
#include "core/cuda/train_scratch.h"

namespace iris::cuda {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops cap the grid: enough blocks to fill every SM several times over.
constexpr int64_t kMaxBlocks = 8192;

int grid_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

// ---- conversion -----------------------------------------------------------------------------

template <typename TD, typename TS>
__global__ void convert_kernel(TD* __restrict__ dst, const TS* __restrict__ src, int64_t n,
                               int64_t n_vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < n_vec; i += stride) {
    float f[8];
    ld8(src + i * 8, f);
    st8(dst + i * 8, f);
  }
  for (int64_t i = n_vec * 8 + tid; i < n; i += stride) st(dst, i, ld(src, i));
}

template <typename TD, typename TS>
void launch_convert(TD* dst, const TS* src, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  const int64_t n_vec = aligned16(dst) && aligned16(src) ? n / 8 : 0;
  convert_kernel<<<grid_for(n_vec > 0 ? n_vec : n), kThreads, 0, s>>>(dst, src, n, n_vec);
  IRIS_CUDA_LAUNCH_CHECK();
}

// ---- norm forwards: norm_rope.cu's kernels, also saving the statistics ----------------------
// The arithmetic (thread count, per-thread order, block reductions, dispatch) is a copy of
// norm_vec_kernel / norm_scalar_kernel, so y has the bits launch_layer_norm / launch_rms_norm
// give; keep the two in step.

constexpr int kNormThreads = 128;

template <int VPT, bool kLayer>
__global__ void __launch_bounds__(kNormThreads)
    norm_train_vec_kernel(uint16_t* y, float* mean_out, float* rstd_out, const uint16_t* x,
                          const uint16_t* w, const uint16_t* b, int64_t cols, float eps) {
  __shared__ float scratch[kNormThreads / kWarpSize];
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
  if (threadIdx.x == 0) {
    if (kLayer) mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
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

template <bool kLayer>
__global__ void __launch_bounds__(kNormThreads)
    norm_train_scalar_kernel(uint16_t* y, float* mean_out, float* rstd_out, const uint16_t* x,
                             const uint16_t* w, const uint16_t* b, int64_t cols, float eps) {
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
  if (threadIdx.x == 0) {
    if (kLayer) mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xv = bf16_to_float(xr[c]), wv = bf16_to_float(w[c]);
    yr[c] = kLayer ? float_to_bf16((xv - mean) * rstd * wv + bf16_to_float(b[c]))
                   : float_to_bf16(round_bf16(xv * rstd) * wv);
  }
}

template <bool kLayer>
void launch_norm_train(uint16_t* y, float* mean, float* rstd, const uint16_t* x, const uint16_t* w,
                       const uint16_t* b, int64_t rows, int64_t cols, float eps, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  const unsigned grid = static_cast<unsigned>(rows);
  // The dispatch of norm_rope.cu's launch_norm: the same shapes and alignments take the same
  // kernel, hence the same summation order.
  const bool vec =
      cols % 8 == 0 && aligned16(y) && aligned16(x) && aligned16(w) && (!kLayer || aligned16(b));
  const int64_t n_vec = cols / 8;
  if (vec && n_vec <= kNormThreads) {
    norm_train_vec_kernel<1, kLayer>
        <<<grid, kNormThreads, 0, s>>>(y, mean, rstd, x, w, b, cols, eps);
  } else if (vec && n_vec <= 2 * kNormThreads) {
    norm_train_vec_kernel<2, kLayer>
        <<<grid, kNormThreads, 0, s>>>(y, mean, rstd, x, w, b, cols, eps);
  } else if (vec && n_vec <= 4 * kNormThreads) {
    norm_train_vec_kernel<4, kLayer>
        <<<grid, kNormThreads, 0, s>>>(y, mean, rstd, x, w, b, cols, eps);
  } else if (vec && n_vec <= 8 * kNormThreads) {
    norm_train_vec_kernel<8, kLayer>
        <<<grid, kNormThreads, 0, s>>>(y, mean, rstd, x, w, b, cols, eps);
  } else {
    norm_train_scalar_kernel<kLayer>
        <<<grid, kNormThreads, 0, s>>>(y, mean, rstd, x, w, b, cols, eps);
  }
  IRIS_CUDA_LAUNCH_CHECK();
}

// ---- norm backwards ---------------------------------------------------------------------------

// dx += rstd * (g w - mean(g w) - xhat * mean(g w xhat)) with xhat = (x - mean) * rstd (LayerNorm)
// or x * rstd and no mean(g w) term (RMSNorm). One block per row; the second pass re-reads the
// row (L1/L2-resident).
template <typename TG, bool kLayer, bool kVec>
__global__ void __launch_bounds__(kThreads)
    norm_backward_dx_kernel(float* __restrict__ dx, const TG* __restrict__ dy,
                            const uint16_t* __restrict__ x, const float* __restrict__ mean,
                            const float* __restrict__ rstd, const uint16_t* __restrict__ w,
                            int64_t cols) {
  __shared__ float red[kThreads / kWarpSize];
  const int64_t row = blockIdx.x;
  const TG* g = dy + row * cols;
  const uint16_t* xr = x + row * cols;
  float* d = dx + row * cols;
  const float mu = kLayer ? mean[row] : 0.f, rs = rstd[row];
  float sg = 0.f, sgx = 0.f;
  if constexpr (kVec) {
    for (int64_t v = threadIdx.x; v < cols / 8; v += kThreads) {
      float gf[8], xf[8], wf[8];
      ld8(g + v * 8, gf);
      load8(xr + v * 8, xf);
      load8(w + v * 8, wf);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float gw = gf[e] * wf[e];
        sg += gw;
        sgx += gw * ((xf[e] - mu) * rs);
      }
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float gw = ld(g, c) * bf16_to_float(w[c]);
      sg += gw;
      sgx += gw * ((bf16_to_float(xr[c]) - mu) * rs);
    }
  }
  const float inv_cols = 1.f / static_cast<float>(cols);
  const float mg = kLayer ? block_sum(sg, red) * inv_cols : 0.f;
  const float mgx = block_sum(sgx, red) * inv_cols;
  if constexpr (kVec) {
    for (int64_t v = threadIdx.x; v < cols / 8; v += kThreads) {
      float gf[8], xf[8], wf[8], df[8];
      ld8(g + v * 8, gf);
      load8(xr + v * 8, xf);
      load8(w + v * 8, wf);
      ld8(d + v * 8, df);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float xh = (xf[e] - mu) * rs;
        df[e] += rs * (gf[e] * wf[e] - mg - xh * mgx);
      }
      st8(d + v * 8, df);
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += kThreads) {
      const float xh = (bf16_to_float(xr[c]) - mu) * rs;
      d[c] += rs * (ld(g, c) * bf16_to_float(w[c]) - mg - xh * mgx);
    }
  }
}

// Partial column sums over the row range [rows * p / P, rows * (p + 1) / P) of partial block p =
// blockIdx.y: part_w[p, c] = sum g * xhat, part_b[p, c] = sum g (each skipped when null).
template <typename TG, bool kLayer>
__global__ void __launch_bounds__(kThreads)
    norm_param_partial_kernel(float* __restrict__ part_w, float* __restrict__ part_b,
                              const TG* __restrict__ dy, const uint16_t* __restrict__ x,
                              const float* __restrict__ mean, const float* __restrict__ rstd,
                              int64_t rows, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  const int64_t p = blockIdx.y;
  const int64_t r0 = rows * p / kTrainReducePartials, r1 = rows * (p + 1) / kTrainReducePartials;
  float aw = 0.f, ab = 0.f;
#pragma unroll 4
  for (int64_t r = r0; r < r1; ++r) {
    const float g = ld(dy, r * cols + c);
    const float mu = kLayer ? mean[r] : 0.f;
    aw += g * ((bf16_to_float(x[r * cols + c]) - mu) * rstd[r]);
    ab += g;
  }
  if (part_w != nullptr) part_w[p * cols + c] = aw;
  if (part_b != nullptr) part_b[p * cols + c] = ab;
}

// out0[c] += sum over p < n_parts in order of part0[p * stride + c]; the same for out1 / part1
// (each skipped when out is null).
__global__ void reduce_partials_kernel(float* __restrict__ out0, const float* __restrict__ part0,
                                       float* __restrict__ out1, const float* __restrict__ part1,
                                       int n_parts, int64_t stride, int64_t cols) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (c >= cols) return;
  if (out0 != nullptr) {
    float acc = 0.f;
    for (int p = 0; p < n_parts; ++p) acc += part0[p * stride + c];
    out0[c] += acc;
  }
  if (out1 != nullptr) {
    float acc = 0.f;
    for (int p = 0; p < n_parts; ++p) acc += part1[p * stride + c];
    out1[c] += acc;
  }
}

template <typename TG, bool kLayer>
void launch_norm_backward_t(float* dx, float* dw, float* db, const TG* dy, const uint16_t* x,
                            const float* mean, const float* rstd, const uint16_t* w, int64_t rows,
                            int64_t cols, float* scratch, int64_t scratch_floats, cudaStream_t s,
                            const char* op) {
  if (rows == 0 || cols == 0) return;
  if (dw != nullptr || db != nullptr) {
    check_scratch(scratch, scratch_floats, norm_backward_scratch_floats(cols), 16, op);
    float* part_w = dw != nullptr ? scratch : nullptr;
    float* part_b = db != nullptr ? scratch + kTrainReducePartials * cols : nullptr;
    const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads), kTrainReducePartials);
    norm_param_partial_kernel<TG, kLayer>
        <<<grid, kThreads, 0, s>>>(part_w, part_b, dy, x, mean, rstd, rows, cols);
    IRIS_CUDA_LAUNCH_CHECK();
    reduce_partials_kernel<<<static_cast<unsigned>((cols + kThreads - 1) / kThreads), kThreads, 0,
                             s>>>(dw, part_w, db, part_b, kTrainReducePartials, cols, cols);
    IRIS_CUDA_LAUNCH_CHECK();
  }
  if (dx != nullptr) {
    const bool vec =
        cols % 8 == 0 && aligned16(dx) && aligned16(dy) && aligned16(x) && aligned16(w);
    const unsigned grid = static_cast<unsigned>(rows);
    if (vec) {
      norm_backward_dx_kernel<TG, kLayer, true>
          <<<grid, kThreads, 0, s>>>(dx, dy, x, mean, rstd, w, cols);
    } else {
      norm_backward_dx_kernel<TG, kLayer, false>
          <<<grid, kThreads, 0, s>>>(dx, dy, x, mean, rstd, w, cols);
    }
    IRIS_CUDA_LAUNCH_CHECK();
  }
}

// ---- q/k norm + RoPE --------------------------------------------------------------------------
// The forwards copy norm_rope.cu's qkv_norm_rope_kernel / qkv_norm_rope_vec_kernel arithmetic
// (same per-thread order, same rounding points) out of place; keep them in step.

constexpr int kRopeWarps = 4;
constexpr int kRopeMaxPairsPerLane = 4;  // head_dim <= 256
constexpr int kMaxHeadDim = 2 * kWarpSize * kRopeMaxPairsPerLane;
static_assert(kMaxHeadDim == kQkvNormRopeMaxHeadDim, "the header states the kernels' limit");

// One warp per (token, head) over all n_q + 2 n_kv heads; v heads are copied.
__global__ void __launch_bounds__(kRopeWarps* kWarpSize)
    qkv_norm_rope_train_kernel(uint16_t* out, float* rstd, const uint16_t* in,
                               const uint16_t* q_norm_w, const uint16_t* k_norm_w, float eps,
                               const float* cos, const float* sin, int64_t tokens, int n_q_heads,
                               int n_kv_heads, int head_dim, bool round_tables) {
  const int heads = n_q_heads + 2 * n_kv_heads;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kRopeWarps + threadIdx.x / kWarpSize;
  if (item >= tokens * heads) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = item / heads;
  const int head = static_cast<int>(item % heads);
  const int half = head_dim / 2;
  const int64_t row_stride = static_cast<int64_t>(heads) * head_dim;
  const uint16_t* x = in + t * row_stride + static_cast<int64_t>(head) * head_dim;
  uint16_t* y = out + t * row_stride + static_cast<int64_t>(head) * head_dim;
  if (head >= n_q_heads + n_kv_heads) {  // a v head: copied
    for (int i = lane; i < head_dim; i += kWarpSize) y[i] = x[i];
    return;
  }
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
    const float r = rsqrtf(warp_sum(ss) / static_cast<float>(head_dim) + eps);
    if (rstd != nullptr && lane == 0) rstd[t * (n_q_heads + n_kv_heads) + head] = r;
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
      c1 = round_bf16(c1), c2 = round_bf16(c2), s1 = round_bf16(s1), s2 = round_bf16(s2);
      o1 = round_bf16(x1[k] * c1) + round_bf16(-x2[k] * s1);
      o2 = round_bf16(x2[k] * c2) + round_bf16(x1[k] * s2);
    } else {
      o1 = x1[k] * c1 - x2[k] * s1;
      o2 = x2[k] * c2 + x1[k] * s2;
    }
    y[i] = float_to_bf16(o1);
    y[i + half] = float_to_bf16(o2);
  }
}

constexpr int kRopeVecThreads = 256;

// TPH threads per (token, head), each owning four consecutive rotate-half pairs (head_dim / 8 ==
// TPH, a power of two up to 32); v heads are copied.
template <int TPH>
__global__ void __launch_bounds__(kRopeVecThreads)
    qkv_norm_rope_train_vec_kernel(uint16_t* out, float* rstd, const uint16_t* in,
                                   const uint16_t* q_norm_w, const uint16_t* k_norm_w, float eps,
                                   const float* cos, const float* sin, int64_t tokens,
                                   int n_q_heads, int n_kv_heads, int head_dim, bool round_tables) {
  const int heads = n_q_heads + 2 * n_kv_heads;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * kRopeVecThreads + threadIdx.x;
  const int64_t item = gid / TPH;
  // Whole groups of TPH lanes leave together, so the group's shuffles below stay well defined.
  if (item >= tokens * heads) return;
  const int lane = threadIdx.x % kWarpSize;
  const unsigned group_mask =
      (TPH == kWarpSize ? 0xffffffffu : ((1u << TPH) - 1u) << (lane & ~(TPH - 1)));
  const int i = static_cast<int>(gid % TPH) * 4;
  const int64_t t = item / heads;
  const int head = static_cast<int>(item % heads);
  const int half = head_dim / 2;
  const int64_t row_stride = static_cast<int64_t>(heads) * head_dim;
  const uint16_t* x = in + t * row_stride + static_cast<int64_t>(head) * head_dim;
  uint16_t* y = out + t * row_stride + static_cast<int64_t>(head) * head_dim;
  if (head >= n_q_heads + n_kv_heads) {  // a v head: copied
    *reinterpret_cast<uint2*>(y + i) = *reinterpret_cast<const uint2*>(x + i);
    *reinterpret_cast<uint2*>(y + i + half) = *reinterpret_cast<const uint2*>(x + i + half);
    return;
  }
  const uint16_t* norm_w = head < n_q_heads ? q_norm_w : k_norm_w;

  auto load4 = [](const uint16_t* p, float(&f)[4]) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    f[0] = bf16_to_float(static_cast<uint16_t>(u.x & 0xffffu));
    f[1] = bf16_to_float(static_cast<uint16_t>(u.x >> 16));
    f[2] = bf16_to_float(static_cast<uint16_t>(u.y & 0xffffu));
    f[3] = bf16_to_float(static_cast<uint16_t>(u.y >> 16));
  };
  float x1[4], x2[4];
  load4(x + i, x1);
  load4(x + i + half, x2);
  if (norm_w != nullptr) {
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) ss += x1[k] * x1[k] + x2[k] * x2[k];
#pragma unroll
    for (int o = TPH / 2; o > 0; o /= 2) ss += __shfl_xor_sync(group_mask, ss, o);
    const float r = rsqrtf(ss / static_cast<float>(head_dim) + eps);
    if (rstd != nullptr && i == 0) rstd[t * (n_q_heads + n_kv_heads) + head] = r;
    float w1[4], w2[4];
    load4(norm_w + i, w1);
    load4(norm_w + i + half, w2);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x1[k] = round_bf16(round_bf16(x1[k] * r) * w1[k]);
      x2[k] = round_bf16(round_bf16(x2[k] * r) * w2[k]);
    }
  }
  const float4 c1v = *reinterpret_cast<const float4*>(cos + t * head_dim + i);
  const float4 c2v = *reinterpret_cast<const float4*>(cos + t * head_dim + i + half);
  const float4 s1v = *reinterpret_cast<const float4*>(sin + t * head_dim + i);
  const float4 s2v = *reinterpret_cast<const float4*>(sin + t * head_dim + i + half);
  const float c1a[4] = {c1v.x, c1v.y, c1v.z, c1v.w}, c2a[4] = {c2v.x, c2v.y, c2v.z, c2v.w};
  const float s1a[4] = {s1v.x, s1v.y, s1v.z, s1v.w}, s2a[4] = {s2v.x, s2v.y, s2v.z, s2v.w};
  float o1[4], o2[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float c1 = c1a[k], c2 = c2a[k], s1 = s1a[k], s2 = s2a[k];
    if (round_tables) {
      c1 = round_bf16(c1), c2 = round_bf16(c2), s1 = round_bf16(s1), s2 = round_bf16(s2);
      o1[k] = round_bf16(x1[k] * c1) + round_bf16(-x2[k] * s1);
      o2[k] = round_bf16(x2[k] * c2) + round_bf16(x1[k] * s2);
    } else {
      o1[k] = x1[k] * c1 - x2[k] * s1;
      o2[k] = x2[k] * c2 + x1[k] * s2;
    }
  }
  *reinterpret_cast<uint2*>(y + i) =
      make_uint2(pack_bf16x2(o1[0], o1[1]), pack_bf16x2(o1[2], o1[3]));
  *reinterpret_cast<uint2*>(y + i + half) =
      make_uint2(pack_bf16x2(o2[0], o2[1]), pack_bf16x2(o2[2], o2[3]));
}

template <int TPH = kWarpSize>
bool launch_rope_train_vec_for(int tph, uint16_t* out, float* rstd, const uint16_t* in,
                               const uint16_t* q_norm_w, const uint16_t* k_norm_w, float eps,
                               const float* cos, const float* sin, int64_t tokens, int n_q_heads,
                               int n_kv_heads, int head_dim, bool round_tables, cudaStream_t s) {
  if (tph == TPH) {
    const int64_t threads = tokens * (n_q_heads + 2 * n_kv_heads) * TPH;
    const unsigned grid = static_cast<unsigned>((threads + kRopeVecThreads - 1) / kRopeVecThreads);
    qkv_norm_rope_train_vec_kernel<TPH>
        <<<grid, kRopeVecThreads, 0, s>>>(out, rstd, in, q_norm_w, k_norm_w, eps, cos, sin, tokens,
                                          n_q_heads, n_kv_heads, head_dim, round_tables);
    IRIS_CUDA_LAUNCH_CHECK();
    return true;
  }
  if constexpr (TPH > 1) {
    return launch_rope_train_vec_for<TPH / 2>(tph, out, rstd, in, q_norm_w, k_norm_w, eps, cos, sin,
                                              tokens, n_q_heads, n_kv_heads, head_dim, round_tables,
                                              s);
  }
  return false;
}

// The rope tables of one pair (i, i + half), rounded through bf16 when the forward did.
struct RopePair {
  float c1, c2, s1, s2;
};
__device__ __forceinline__ RopePair rope_pair(const float* ct, const float* st, int i, int half,
                                              bool round_tables) {
  RopePair p{ct[i], ct[i + half], st[i], st[i + half]};
  if (round_tables) {
    p.c1 = round_bf16(p.c1), p.c2 = round_bf16(p.c2);
    p.s1 = round_bf16(p.s1), p.s2 = round_bf16(p.s2);
  }
  return p;
}

// Partial norm-weight gradients over the token range of partial block p = blockIdx.x:
// part[p, i] (q) and part[p, hd + i] (k) = sum over tokens and heads of g_i * x_i * rstd, where g
// is the un-rotated gradient. Thread (i, l): pair i = tid % half, heads l, l + L, ...; the L
// lanes of a pair are then summed in lane order.
__global__ void __launch_bounds__(kThreads)
    qk_norm_param_partial_kernel(float* __restrict__ part, const uint16_t* __restrict__ dout,
                                 const uint16_t* __restrict__ in, const float* __restrict__ rstd,
                                 const float* __restrict__ cos, const float* __restrict__ sin,
                                 int64_t tokens, int n_q_heads, int n_kv_heads, int head_dim,
                                 bool round_tables, bool want_q, bool want_k) {
  __shared__ float red[4][kThreads];
  const int half = head_dim / 2;
  const int lanes = blockDim.x / half;
  const int i = threadIdx.x % half, l = threadIdx.x / half;
  const int64_t p = blockIdx.x;
  const int64_t t0 = tokens * p / kQkNormPartials, t1 = tokens * (p + 1) / kQkNormPartials;
  const int nh = n_q_heads + n_kv_heads;
  const int64_t width = static_cast<int64_t>(n_q_heads + 2 * n_kv_heads) * head_dim;
  float aq1 = 0.f, aq2 = 0.f, ak1 = 0.f, ak2 = 0.f;
  for (int64_t t = t0; t < t1; ++t) {
    const RopePair rp = rope_pair(cos + t * head_dim, sin + t * head_dim, i, half, round_tables);
    for (int h = l; h < nh; h += lanes) {
      const bool is_q = h < n_q_heads;
      if (is_q ? !want_q : !want_k) continue;
      const int64_t o = t * width + static_cast<int64_t>(h) * head_dim;
      const float d1 = bf16_to_float(dout[o + i]), d2 = bf16_to_float(dout[o + i + half]);
      const float g1 = d1 * rp.c1 + d2 * rp.s2, g2 = d2 * rp.c2 - d1 * rp.s1;
      const float rs = rstd[t * nh + h];
      const float v1 = g1 * (bf16_to_float(in[o + i]) * rs);
      const float v2 = g2 * (bf16_to_float(in[o + i + half]) * rs);
      if (is_q) {
        aq1 += v1, aq2 += v2;
      } else {
        ak1 += v1, ak2 += v2;
      }
    }
  }
  red[0][threadIdx.x] = aq1, red[1][threadIdx.x] = aq2;
  red[2][threadIdx.x] = ak1, red[3][threadIdx.x] = ak2;
  __syncthreads();
  if (l != 0) return;
  float s[4] = {0.f, 0.f, 0.f, 0.f};
  for (int ll = 0; ll < lanes; ++ll)
#pragma unroll
    for (int k = 0; k < 4; ++k) s[k] += red[k][ll * half + i];
  float* pp = part + p * 2 * head_dim;
  pp[i] = s[0], pp[i + half] = s[1], pp[head_dim + i] = s[2], pp[head_dim + i + half] = s[3];
}

// din for one (token, head) per warp: the rotation's adjoint, then the per-head RMSNorm's
// (weights present) or nothing; v heads copied. Each lane reads exactly the elements it writes,
// so din may alias dout.
__global__ void __launch_bounds__(kRopeWarps* kWarpSize)
    qkv_norm_rope_backward_kernel(uint16_t* din, const uint16_t* dout, const uint16_t* in,
                                  const float* rstd, const uint16_t* q_norm_w,
                                  const uint16_t* k_norm_w, const float* cos, const float* sin,
                                  int64_t tokens, int n_q_heads, int n_kv_heads, int head_dim,
                                  bool round_tables) {
  const int heads = n_q_heads + 2 * n_kv_heads;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kRopeWarps + threadIdx.x / kWarpSize;
  if (item >= tokens * heads) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t t = item / heads;
  const int head = static_cast<int>(item % heads);
  const int half = head_dim / 2;
  const int64_t o =
      t * heads * static_cast<int64_t>(head_dim) + static_cast<int64_t>(head) * head_dim;
  if (head >= n_q_heads + n_kv_heads) {
    if (din != dout)
      for (int i = lane; i < head_dim; i += kWarpSize) din[o + i] = dout[o + i];
    return;
  }
  const uint16_t* norm_w = head < n_q_heads ? q_norm_w : k_norm_w;
  float g1[kRopeMaxPairsPerLane], g2[kRopeMaxPairsPerLane];
#pragma unroll
  for (int k = 0; k < kRopeMaxPairsPerLane; ++k) {
    const int i = lane + k * kWarpSize;
    g1[k] = g2[k] = 0.f;
    if (i < half) {
      const RopePair rp = rope_pair(cos + t * head_dim, sin + t * head_dim, i, half, round_tables);
      const float d1 = bf16_to_float(dout[o + i]), d2 = bf16_to_float(dout[o + i + half]);
      g1[k] = d1 * rp.c1 + d2 * rp.s2;
      g2[k] = d2 * rp.c2 - d1 * rp.s1;
    }
  }
  if (norm_w != nullptr) {
    const float rs = rstd[t * (n_q_heads + n_kv_heads) + head];
    float x1[kRopeMaxPairsPerLane], x2[kRopeMaxPairsPerLane];
    float sgx = 0.f;
#pragma unroll
    for (int k = 0; k < kRopeMaxPairsPerLane; ++k) {
      const int i = lane + k * kWarpSize;
      x1[k] = x2[k] = 0.f;
      if (i < half) {
        x1[k] = bf16_to_float(in[o + i]) * rs;
        x2[k] = bf16_to_float(in[o + i + half]) * rs;
        g1[k] *= bf16_to_float(norm_w[i]);
        g2[k] *= bf16_to_float(norm_w[i + half]);
        sgx += g1[k] * x1[k] + g2[k] * x2[k];
      }
    }
    const float mgx = warp_sum(sgx) / static_cast<float>(head_dim);
#pragma unroll
    for (int k = 0; k < kRopeMaxPairsPerLane; ++k) {
      g1[k] = rs * (g1[k] - x1[k] * mgx);
      g2[k] = rs * (g2[k] - x2[k] * mgx);
    }
  }
#pragma unroll
  for (int k = 0; k < kRopeMaxPairsPerLane; ++k) {
    const int i = lane + k * kWarpSize;
    if (i >= half) continue;
    din[o + i] = float_to_bf16(g1[k]);
    din[o + i + half] = float_to_bf16(g2[k]);
  }
}

// qkv_norm_rope_backward_kernel with TPH threads per (token, head), each owning four consecutive
// rotate-half pairs (head_dim / 8 == TPH): 8-byte loads of the bf16 data, 16-byte loads of the
// tables. Each thread reads exactly the elements it writes, so din may alias dout.
template <int TPH>
__global__ void __launch_bounds__(kRopeVecThreads)
    qkv_norm_rope_backward_vec_kernel(uint16_t* din, const uint16_t* dout, const uint16_t* in,
                                      const float* rstd, const uint16_t* q_norm_w,
                                      const uint16_t* k_norm_w, const float* cos, const float* sin,
                                      int64_t tokens, int n_q_heads, int n_kv_heads, int head_dim,
                                      bool round_tables) {
  const int heads = n_q_heads + 2 * n_kv_heads;
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * kRopeVecThreads + threadIdx.x;
  const int64_t item = gid / TPH;
  if (item >= tokens * heads) return;  // whole groups of TPH lanes leave together
  const int lane = threadIdx.x % kWarpSize;
  const unsigned group_mask =
      (TPH == kWarpSize ? 0xffffffffu : ((1u << TPH) - 1u) << (lane & ~(TPH - 1)));
  const int i = static_cast<int>(gid % TPH) * 4;
  const int64_t t = item / heads;
  const int head = static_cast<int>(item % heads);
  const int half = head_dim / 2;
  const int64_t o =
      t * heads * static_cast<int64_t>(head_dim) + static_cast<int64_t>(head) * head_dim;
  if (head >= n_q_heads + n_kv_heads) {  // a v head: copied
    if (din != dout) {
      *reinterpret_cast<uint2*>(din + o + i) = *reinterpret_cast<const uint2*>(dout + o + i);
      *reinterpret_cast<uint2*>(din + o + i + half) =
          *reinterpret_cast<const uint2*>(dout + o + i + half);
    }
    return;
  }
  const uint16_t* norm_w = head < n_q_heads ? q_norm_w : k_norm_w;
  const float4 d1 = ld4(dout + o + i), d2 = ld4(dout + o + i + half);
  const float4 c1 = *reinterpret_cast<const float4*>(cos + t * head_dim + i);
  const float4 c2 = *reinterpret_cast<const float4*>(cos + t * head_dim + i + half);
  const float4 s1 = *reinterpret_cast<const float4*>(sin + t * head_dim + i);
  const float4 s2 = *reinterpret_cast<const float4*>(sin + t * head_dim + i + half);
  const float d1a[4] = {d1.x, d1.y, d1.z, d1.w}, d2a[4] = {d2.x, d2.y, d2.z, d2.w};
  float c1a[4] = {c1.x, c1.y, c1.z, c1.w}, c2a[4] = {c2.x, c2.y, c2.z, c2.w};
  float s1a[4] = {s1.x, s1.y, s1.z, s1.w}, s2a[4] = {s2.x, s2.y, s2.z, s2.w};
  float g1[4], g2[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (round_tables) {
      c1a[k] = round_bf16(c1a[k]), c2a[k] = round_bf16(c2a[k]);
      s1a[k] = round_bf16(s1a[k]), s2a[k] = round_bf16(s2a[k]);
    }
    g1[k] = d1a[k] * c1a[k] + d2a[k] * s2a[k];
    g2[k] = d2a[k] * c2a[k] - d1a[k] * s1a[k];
  }
  if (norm_w != nullptr) {
    const float rs = rstd[t * (n_q_heads + n_kv_heads) + head];
    const float4 x1v = ld4(in + o + i), x2v = ld4(in + o + i + half);
    const float4 w1v = ld4(norm_w + i), w2v = ld4(norm_w + i + half);
    const float x1[4] = {x1v.x * rs, x1v.y * rs, x1v.z * rs, x1v.w * rs};
    const float x2[4] = {x2v.x * rs, x2v.y * rs, x2v.z * rs, x2v.w * rs};
    const float w1[4] = {w1v.x, w1v.y, w1v.z, w1v.w}, w2[4] = {w2v.x, w2v.y, w2v.z, w2v.w};
    float sgx = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      g1[k] *= w1[k];
      g2[k] *= w2[k];
      sgx += g1[k] * x1[k] + g2[k] * x2[k];
    }
#pragma unroll
    for (int off = TPH / 2; off > 0; off /= 2) sgx += __shfl_xor_sync(group_mask, sgx, off);
    const float mgx = sgx / static_cast<float>(head_dim);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      g1[k] = rs * (g1[k] - x1[k] * mgx);
      g2[k] = rs * (g2[k] - x2[k] * mgx);
    }
  }
  *reinterpret_cast<uint2*>(din + o + i) =
      make_uint2(pack_bf16x2(g1[0], g1[1]), pack_bf16x2(g1[2], g1[3]));
  *reinterpret_cast<uint2*>(din + o + i + half) =
      make_uint2(pack_bf16x2(g2[0], g2[1]), pack_bf16x2(g2[2], g2[3]));
}

template <int TPH = kWarpSize>
bool launch_rope_backward_vec_for(int tph, uint16_t* din, const uint16_t* dout, const uint16_t* in,
                                  const float* rstd, const uint16_t* q_norm_w,
                                  const uint16_t* k_norm_w, const float* cos, const float* sin,
                                  int64_t tokens, int n_q_heads, int n_kv_heads, int head_dim,
                                  bool round_tables, cudaStream_t s) {
  if (tph == TPH) {
    const int64_t threads = tokens * (n_q_heads + 2 * n_kv_heads) * TPH;
    const unsigned grid = static_cast<unsigned>((threads + kRopeVecThreads - 1) / kRopeVecThreads);
    qkv_norm_rope_backward_vec_kernel<TPH>
        <<<grid, kRopeVecThreads, 0, s>>>(din, dout, in, rstd, q_norm_w, k_norm_w, cos, sin, tokens,
                                          n_q_heads, n_kv_heads, head_dim, round_tables);
    IRIS_CUDA_LAUNCH_CHECK();
    return true;
  }
  if constexpr (TPH > 1) {
    return launch_rope_backward_vec_for<TPH / 2>(tph, din, dout, in, rstd, q_norm_w, k_norm_w, cos,
                                                 sin, tokens, n_q_heads, n_kv_heads, head_dim,
                                                 round_tables, s);
  }
  return false;
}

// ---- activations ------------------------------------------------------------------------------

struct GeluTanhGrad {
  __device__ float operator()(float v) const {
    const float k = 0.7978845608028654f, c = 0.044715f;
    const float t = tanhf(k * (v + c * v * v * v));
    const float du = k * (1.f + 3.f * c * v * v);
    return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du;
  }
};

struct GeluErfGrad {
  __device__ float operator()(float v) const {
    const float cdf = 0.5f * (1.f + erff(v * 0.7071067811865476f));
    const float pdf = 0.3989422804014327f * expf(-0.5f * v * v);
    return cdf + v * pdf;
  }
};

struct QuickGeluGrad {
  __device__ float operator()(float v) const {
    const float s = 1.f / (1.f + expf(-1.702f * v));
    return s + 1.702f * v * s * (1.f - s);
  }
};

// dx = dy * f'(x); every element is read before it is written by the same thread.
template <class Op>
__global__ void act_backward_kernel(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                                    int64_t n_vec, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < n_vec; i += stride) {
    float g[8], v[8];
    load8(dy + i * 8, g);
    load8(x + i * 8, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] *= op(v[k]);
    store8(dx + i * 8, g);
  }
  for (int64_t i = n_vec * 8 + tid; i < n; i += stride)
    dx[i] = float_to_bf16(bf16_to_float(dy[i]) * op(bf16_to_float(x[i])));
}

template <class Op>
void launch_act_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                         cudaStream_t s) {
  if (n <= 0) return;
  const int64_t n_vec = aligned16(dx) && aligned16(dy) && aligned16(x) ? n / 8 : 0;
  act_backward_kernel<<<grid_for(n_vec > 0 ? n_vec : n), kThreads, 0, s>>>(dx, dy, x, n, n_vec,
                                                                           Op{});
  IRIS_CUDA_LAUNCH_CHECK();
}

__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
  const float sig = 1.f / (1.f + expf(-g));
  dg = d * u * sig * (1.f + g * (1.f - sig));
  du = d * g * sig;
}

// Reads gate and up of an element before writing both: dgate_up may alias gate_up.
__global__ void swiglu_backward_kernel(uint16_t* dgu, const uint16_t* dy, const uint16_t* gu,
                                       int64_t rows, int64_t inter, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    const int64_t per_row = inter / 8, total = rows * per_row;
    for (int64_t i = tid; i < total; i += stride) {
      const int64_t r = i / per_row, c = (i % per_row) * 8;
      float d[8], g[8], u[8], dg[8], du[8];
      load8(dy + r * inter + c, d);
      load8(gu + r * 2 * inter + c, g);
      load8(gu + r * 2 * inter + inter + c, u);
#pragma unroll
      for (int k = 0; k < 8; ++k) swiglu_grad(d[k], g[k], u[k], dg[k], du[k]);
      store8(dgu + r * 2 * inter + c, dg);
      store8(dgu + r * 2 * inter + inter + c, du);
    }
  } else {
    const int64_t total = rows * inter;
    for (int64_t i = tid; i < total; i += stride) {
      const int64_t r = i / inter, c = i % inter;
      float dg, du;
      swiglu_grad(bf16_to_float(dy[i]), bf16_to_float(gu[r * 2 * inter + c]),
                  bf16_to_float(gu[r * 2 * inter + inter + c]), dg, du);
      dgu[r * 2 * inter + c] = float_to_bf16(dg);
      dgu[r * 2 * inter + inter + c] = float_to_bf16(du);
    }
  }
}

// ---- row scatters with a fixed order ----------------------------------------------------------

constexpr int kScanThreads = 256;
constexpr int kScanWarps = kScanThreads / kWarpSize;
constexpr int kScanPer = 8;  // entries tested per thread and tile, kScanThreads apart
constexpr int kScanTile = kScanThreads * kScanPer;
constexpr int kRowBatch = 8;
// The scans are latency-bound: at most 64 registers, so that 4 blocks share an SM.
constexpr int kScanMinBlocks = 4;  // rows whose loads are in flight before they are added in order

// Tile position of a thread's q-th entry: coalesced loads, and (q, warp, lane) order is position
// order.
__device__ __forceinline__ int tile_pos(int q) {
  return q * kScanThreads + static_cast<int>(threadIdx.x);
}

// Writes the tile positions whose flag is set to list[], in increasing order, and returns their
// count (the same in every thread). counts holds kCompactSlots + 1 ints. The caller synchronises
// the block before the next call (list and counts are reused).
constexpr int kCompactSlots = kScanPer * kScanWarps;  // one count per (q, warp), in position order
static_assert(kCompactSlots % kWarpSize == 0, "the prefix scan gives each lane whole slots");
__device__ int compact_tile(const bool (&flag)[kScanPer], int* list, int* counts) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  unsigned ballot[kScanPer];
#pragma unroll
  for (int q = 0; q < kScanPer; ++q) {
    ballot[q] = __ballot_sync(0xffffffffu, flag[q]);
    if (lane == 0) counts[q * kScanWarps + warp] = __popc(ballot[q]);
  }
  __syncthreads();
  if (warp == 0) {  // exclusive prefix over the slots, in place; the total after them
    constexpr int kPerLane = kCompactSlots / kWarpSize;
    int v[kPerLane], sum = 0;
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) sum += v[u] = counts[lane * kPerLane + u];
    int incl = sum;
#pragma unroll
    for (int o = 1; o < kWarpSize; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    int run = incl - sum;
#pragma unroll
    for (int u = 0; u < kPerLane; ++u) {
      counts[lane * kPerLane + u] = run;
      run += v[u];
    }
    if (lane == kWarpSize - 1) counts[kCompactSlots] = incl;
  }
  __syncthreads();
  const unsigned lower = (1u << lane) - 1u;
#pragma unroll
  for (int q = 0; q < kScanPer; ++q)
    if (flag[q]) list[counts[q * kScanWarps + warp] + __popc(ballot[q] & lower)] = tile_pos(q);
  const int total = counts[kCompactSlots];
  __syncthreads();
  return total;
}

// d[c] += sum over m < n, in order, of (weighted ? weight[base + list[m]] : 1) * g[row_m, c], where
// row_m = (base + list[m]) / row_div. Each thread owns fixed columns and accumulates in a
// register; the loads of kRowBatch rows are issued before their adds.
template <typename TG, bool kWeighted>
__device__ void accumulate_rows(float* __restrict__ d, const TG* __restrict__ g,
                                const float* __restrict__ weight, int64_t base, const int* list,
                                int n, int row_div, int64_t cols, bool vec) {
  if (vec) {
    for (int64_t c = threadIdx.x * 4; c < cols; c += kScanThreads * 4) {
      float4 acc = *reinterpret_cast<const float4*>(d + c);
      for (int m0 = 0; m0 < n; m0 += kRowBatch) {
        float4 v[kRowBatch];
        float wt[kRowBatch];
#pragma unroll
        for (int u = 0; u < kRowBatch; ++u) {
          if (m0 + u < n) {
            const int64_t e = base + list[m0 + u];
            v[u] = ld4(g + (e / row_div) * cols + c);
            wt[u] = kWeighted ? weight[e] : 1.f;
          }
        }
#pragma unroll
        for (int u = 0; u < kRowBatch; ++u) {
          if (m0 + u >= n) break;
          if (kWeighted) {
            acc.x += wt[u] * v[u].x, acc.y += wt[u] * v[u].y;
            acc.z += wt[u] * v[u].z, acc.w += wt[u] * v[u].w;
          } else {
            acc.x += v[u].x, acc.y += v[u].y, acc.z += v[u].z, acc.w += v[u].w;
          }
        }
      }
      *reinterpret_cast<float4*>(d + c) = acc;
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += kScanThreads) {
      float acc = d[c];
      for (int m0 = 0; m0 < n; m0 += kRowBatch) {
        float v[kRowBatch], wt[kRowBatch];
#pragma unroll
        for (int u = 0; u < kRowBatch; ++u) {
          if (m0 + u < n) {
            const int64_t e = base + list[m0 + u];
            v[u] = ld(g, (e / row_div) * cols + c);
            wt[u] = kWeighted ? weight[e] : 1.f;
          }
        }
#pragma unroll
        for (int u = 0; u < kRowBatch; ++u) {
          if (m0 + u >= n) break;
          acc += kWeighted ? wt[u] * v[u] : v[u];
        }
      }
      d[c] = acc;
    }
  }
}

// One block per token t; only the first occurrence of its id works: it adds the dy rows of all
// occurrences, in token order, to the id's row.
template <typename TG>
__global__ void __launch_bounds__(kScanThreads, kScanMinBlocks)
    embedding_backward_kernel(float* __restrict__ dtable, const TG* __restrict__ dy,
                              const int32_t* __restrict__ ids, int64_t tokens, int64_t vocab,
                              int64_t cols, int32_t skip_id, bool vec) {
  __shared__ int list[kScanTile];
  __shared__ int counts[kCompactSlots + 1];
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  if (id == skip_id || id < 0 || id >= vocab) return;
  for (int64_t base = 0; base < t; base += kScanTile) {
    bool dup = false;
#pragma unroll
    for (int q = 0; q < kScanPer; ++q) {
      const int64_t j = base + tile_pos(q);
      dup |= j < t && ids[j] == id;
    }
    if (__syncthreads_or(dup)) return;  // the same answer in every thread
  }
  float* d = dtable + static_cast<int64_t>(id) * cols;
  for (int64_t base = t; base < tokens; base += kScanTile) {
    bool flag[kScanPer];
#pragma unroll
    for (int q = 0; q < kScanPer; ++q) {
      const int64_t j = base + tile_pos(q);
      flag[q] = j < tokens && ids[j] == id;
    }
    const int n = compact_tile(flag, list, counts);
    if (n > 0) accumulate_rows<TG, false>(d, dy, nullptr, base, list, n, 1, cols, vec);
    __syncthreads();
  }
}

// One block per table row: scans the rows * 4 (index, weight) entries in order.
template <typename TG>
__global__ void __launch_bounds__(kScanThreads, kScanMinBlocks)
    interpolated_rows_backward_kernel(float* __restrict__ dtable, const TG* __restrict__ dy,
                                      const int32_t* __restrict__ index,
                                      const float* __restrict__ weight, int64_t rows, int64_t cols,
                                      bool vec) {
  __shared__ int list[kScanTile];
  __shared__ int counts[kCompactSlots + 1];
  const int32_t row = static_cast<int32_t>(blockIdx.x);
  const int64_t entries = rows * 4;
  float* d = dtable + static_cast<int64_t>(row) * cols;
  for (int64_t base = 0; base < entries; base += kScanTile) {
    bool flag[kScanPer];
#pragma unroll
    for (int q = 0; q < kScanPer; ++q) {
      const int64_t e = base + tile_pos(q);
      flag[q] = e < entries && index[e] == row;
    }
    const int n = compact_tile(flag, list, counts);
    if (n > 0) accumulate_rows<TG, true>(d, dy, weight, base, list, n, 4, cols, vec);
    __syncthreads();
  }
}

template <typename TD, typename TS>
__global__ void gather_rows_kernel(TD* __restrict__ dst, const TS* __restrict__ src,
                                   const int32_t* __restrict__ index, int64_t src_rows,
                                   int64_t cols, bool vec) {
  const int64_t row = blockIdx.x;
  const int32_t from = index[row];
  const bool valid = from >= 0 && from < src_rows;
  const TS* s = src + static_cast<int64_t>(valid ? from : 0) * cols;
  TD* d = dst + row * cols;
  if (vec) {
    for (int64_t c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
      float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      if (valid) ld8(s + c, f);
      st8(d + c, f);
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) st(d, c, valid ? ld(s, c) : 0.f);
  }
}

template <typename TD, typename TS>
void launch_gather_t(TD* dst, const TS* src, const int32_t* index, int64_t rows, int64_t src_rows,
                     int64_t cols, cudaStream_t s) {
  const bool vec = cols % 8 == 0 && aligned16(dst) && aligned16(src);
  gather_rows_kernel<TD, TS>
      <<<static_cast<unsigned>(rows), kThreads, 0, s>>>(dst, src, index, src_rows, cols, vec);
  IRIS_CUDA_LAUNCH_CHECK();
}

// ---- cross-entropy ----------------------------------------------------------------------------

constexpr int kCeThreads = 512;

// Merges the running (max, sum of exp(x - max)) pair (m, s) with (mo, so).
__device__ __forceinline__ void lse_merge(float& m, float& s, float mo, float so) {
  const float mn = fmaxf(m, mo);
  if (mn == -INFINITY) return;  // both empty
  s = s * expf(m - mn) + so * expf(mo - mn);
  m = mn;
}

// One block per row: an online (max, sum) pass, then, with dlogits, a second pass writing
// grad_scale * (softmax - onehot). loss[row] = logsumexp - logits[target].
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_kernel(float* __restrict__ loss, uint16_t* __restrict__ dlogits,
                         const float* __restrict__ logits, const int32_t* __restrict__ targets,
                         const float* __restrict__ grad_scale, int64_t vocab, bool vec_in,
                         bool vec_out) {
  __shared__ float sm[kCeThreads / kWarpSize], ss[kCeThreads / kWarpSize];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * vocab;
  float m = -INFINITY, s = 0.f;
  if (vec_in) {
    for (int64_t v = threadIdx.x; v < vocab / 4; v += kCeThreads) {
      const float4 q = reinterpret_cast<const float4*>(x)[v];
      const float mn = fmaxf(fmaxf(m, fmaxf(q.x, q.y)), fmaxf(q.z, q.w));
      if (mn == -INFINITY) continue;
      s = s * expf(m - mn) + (expf(q.x - mn) + expf(q.y - mn)) + (expf(q.z - mn) + expf(q.w - mn));
      m = mn;
    }
  } else {
    for (int64_t v = threadIdx.x; v < vocab; v += kCeThreads) lse_merge(m, s, x[v], 1.f);
  }
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, o), so = __shfl_xor_sync(0xffffffffu, s, o);
    lse_merge(m, s, mo, so);
  }
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) sm[warp] = m, ss[warp] = s;
  __syncthreads();
  m = -INFINITY, s = 0.f;
  for (int w = 0; w < kCeThreads / kWarpSize; ++w) lse_merge(m, s, sm[w], ss[w]);
  const int32_t target = targets[row];
  const bool valid = target >= 0 && target < vocab;
  if (threadIdx.x == 0)
    loss[row] = valid ? static_cast<float>(static_cast<double>(m) + log(static_cast<double>(s)) -
                                           static_cast<double>(x[target]))
                      : 0.f;
  if (dlogits == nullptr) return;
  uint16_t* d = dlogits + row * vocab;
  const float gs = valid ? *grad_scale : 0.f;
  const float k = __fdiv_rn(gs, s);
  if (vec_out) {
    for (int64_t v = threadIdx.x; v < vocab / 8; v += kCeThreads) {
      float f[8];
      ld8(x + v * 8, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        f[e] = expf(f[e] - m) * k;
        if (v * 8 + e == target) f[e] -= gs;
      }
      store8(d + v * 8, f);
    }
  } else {
    for (int64_t v = threadIdx.x; v < vocab; v += kCeThreads) {
      float f = expf(x[v] - m) * k;
      if (v == target) f -= gs;
      d[v] = float_to_bf16(f);
    }
  }
}

// out[0] += float(sum of the n values in a fixed order, in f64). One block of kThreads.
__global__ void __launch_bounds__(kThreads)
    sum_rows_kernel(float* __restrict__ out, const float* __restrict__ vals, int64_t n) {
  __shared__ double sh[kThreads];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) acc += static_cast<double>(vals[i]);
  const double total = block_sum_f64(acc, sh);
  if (threadIdx.x == 0) out[0] += static_cast<float>(total);
}

// ---- optimizer --------------------------------------------------------------------------------
// The flat buffers are cut into chunks of kOptThreads * PER elements; chunk c belongs to block
// c % kOptimizerBlocks, whatever tensor it falls in, so tensors of any size spread evenly and the
// assignment (hence the norm's summation order) depends only on the spans.

constexpr int kOptThreads = 256;
constexpr int kOptPerThread = 4;    // adamw: elements per thread and chunk
constexpr int kNormPerThread = 16;  // grad norm: elements per thread and chunk
constexpr int64_t kOptChunk = kOptThreads * kOptPerThread;
constexpr int64_t kNormChunk = kOptThreads * kNormPerThread;
constexpr int kOptBatch = kOptThreads;  // tensor descriptors staged in shared memory at a time

// The first chunk (of CHUNK elements) at or after the one holding `off` that this block owns.
template <int64_t CHUNK>
__device__ __forceinline__ int64_t first_owned_chunk(int64_t off) {
  const int64_t c = off / CHUNK;
  const int64_t r = c % kOptimizerBlocks;
  return c + (static_cast<int64_t>(blockIdx.x) - r + kOptimizerBlocks) % kOptimizerBlocks;
}

__global__ void __launch_bounds__(kOptThreads)
    grad_sumsq_kernel(double* __restrict__ partials, const float* __restrict__ grads,
                      const int64_t* __restrict__ spans, const float* __restrict__ hyper,
                      int64_t n_tensors) {
  __shared__ int64_t s_off[kOptBatch], s_n[kOptBatch];
  __shared__ double sh[kOptThreads];
  double acc[kNormPerThread] = {};
  for (int64_t i0 = 0; i0 < n_tensors; i0 += kOptBatch) {
    __syncthreads();
    const int64_t i = i0 + threadIdx.x;
    if (i < n_tensors) {
      const bool frozen = hyper[2 * i + 1] == 0.f;
      s_off[threadIdx.x] = spans[3 * i];
      s_n[threadIdx.x] = frozen ? 0 : spans[3 * i + 1];
    }
    __syncthreads();
    const int nb = static_cast<int>(n_tensors - i0 < kOptBatch ? n_tensors - i0 : kOptBatch);
    for (int k = 0; k < nb; ++k) {
      const int64_t off = s_off[k], end = off + s_n[k];
      if (end <= off) continue;
      for (int64_t c = first_owned_chunk<kNormChunk>(off); c * kNormChunk < end;
           c += kOptimizerBlocks) {
        float g[kNormPerThread];
#pragma unroll
        for (int q = 0; q < kNormPerThread; ++q) {
          const int64_t j = c * kNormChunk + q * kOptThreads + threadIdx.x;
          g[q] = j >= off && j < end ? grads[j] : 0.f;
        }
#pragma unroll
        for (int q = 0; q < kNormPerThread; ++q)
          acc[q] += static_cast<double>(g[q]) * static_cast<double>(g[q]);
      }
    }
  }
  double total = 0.0;
#pragma unroll
  for (int q = 0; q < kNormPerThread; ++q) total += acc[q];
  total = block_sum_f64(total, sh);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void __launch_bounds__(kOptThreads)
    grad_norm_finish_kernel(float* __restrict__ grad_stats, const double* __restrict__ partials,
                            float max_norm) {
  __shared__ double sh[kOptThreads];
  double acc = 0.0;
  for (int b = threadIdx.x; b < kOptimizerBlocks; b += kOptThreads) acc += partials[b];
  const double total = block_sum_f64(acc, sh);
  if (threadIdx.x != 0) return;
  const float norm = static_cast<float>(sqrt(total));
  // torch: clip_coef = max_norm / (total_norm + 1e-6) in f32, clamped to 1.
  float coef = 1.f;
  if (max_norm > 0.f) {
    const float c = max_norm / (norm + 1e-6f);
    if (c < 1.f) coef = c;
  }
  grad_stats[0] = norm;
  grad_stats[1] = coef;
}

__global__ void __launch_bounds__(kOptThreads)
    span_sumsq_kernel(double* __restrict__ sums, const float* __restrict__ grads,
                      const int64_t* __restrict__ spans, const float* __restrict__ hyper) {
  __shared__ double sh[kOptThreads];
  const int64_t i = blockIdx.x;
  double acc = 0.0;
  if (hyper[2 * i + 1] != 0.f) {
    const int64_t off = spans[3 * i], n = spans[3 * i + 1];
    for (int64_t j = threadIdx.x; j < n; j += kOptThreads) {
      const double g = grads[off + j];
      acc += g * g;
    }
  }
  const double total = block_sum_f64(acc, sh);
  if (threadIdx.x == 0) sums[i] = total;
}

// Per tensor: bumps the step count and forms torch's scalars (doubles cast to f32):
// scal[i] = {decay, neg_step_size, bc2_sqrt, 1} or all zeros when frozen.
__global__ void adamw_prepare_kernel(float4* __restrict__ scal, int64_t* __restrict__ steps,
                                     const float* __restrict__ hyper, const float* __restrict__ lr,
                                     const float* __restrict__ grad_stats, int64_t n_tensors,
                                     float beta1, float beta2) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_tensors) return;
  const float scale = hyper[2 * i + 1];
  // A non-finite gradient norm skips the whole step, as if every tensor were frozen.
  if (scale == 0.f || !isfinite(grad_stats[0])) {
    scal[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    return;
  }
  const int64_t t = steps[i] + 1;
  steps[i] = t;
  // A scale of exactly 1 keeps the f32 learning rate bit for bit.
  const float lr_t = scale == 1.f ? *lr : static_cast<float>(static_cast<double>(*lr) * scale);
  const double wd = static_cast<double>(hyper[2 * i]);
  const float decay = static_cast<float>(1.0 - static_cast<double>(lr_t) * wd);
  const double bc1 = 1.0 - pow(static_cast<double>(beta1), static_cast<double>(t));
  const double bc2 = 1.0 - pow(static_cast<double>(beta2), static_cast<double>(t));
  const float neg_step_size = static_cast<float>(-(static_cast<double>(lr_t) / bc1));
  const float bc2_sqrt = static_cast<float>(sqrt(bc2));
  scal[i] = make_float4(decay, neg_step_size, bc2_sqrt, 1.f);
}

struct AdamWConsts {
  float one_minus_b1, one_minus_one_minus_b1, b2, one_minus_b2, eps;
};

// training/optimizer.cpp's adamw_element with explicitly rounded IEEE operations (no FMA
// contraction), in the same order.
__global__ void __launch_bounds__(kOptThreads)
    adamw_kernel(float* __restrict__ params, const float* __restrict__ grads,
                 float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                 uint16_t* __restrict__ weights, const int64_t* __restrict__ spans,
                 const float4* __restrict__ scal, const float* __restrict__ grad_stats,
                 int64_t n_tensors, AdamWConsts k) {
  __shared__ int64_t s_off[kOptBatch], s_n[kOptBatch], s_w[kOptBatch];
  __shared__ float4 s_sc[kOptBatch];
  const float coef = grad_stats[1];
  const bool clip = coef < 1.f;
  const bool low = k.one_minus_b1 < 0.5f;
  for (int64_t i0 = 0; i0 < n_tensors; i0 += kOptBatch) {
    __syncthreads();
    const int64_t i = i0 + threadIdx.x;
    if (i < n_tensors) {
      const float4 sc = scal[i];
      s_sc[threadIdx.x] = sc;
      s_off[threadIdx.x] = spans[3 * i];
      s_n[threadIdx.x] = sc.w == 0.f ? 0 : spans[3 * i + 1];
      s_w[threadIdx.x] = spans[3 * i + 2];
    }
    __syncthreads();
    const int nb = static_cast<int>(n_tensors - i0 < kOptBatch ? n_tensors - i0 : kOptBatch);
    for (int b = 0; b < nb; ++b) {
      const int64_t off = s_off[b], end = off + s_n[b];
      if (end <= off) continue;
      const float4 sc = s_sc[b];
      const float decay = sc.x, neg_step_size = sc.y, bc2_sqrt = sc.z;
      const int64_t w_shift = s_w[b] - off;  // weights index = flat index + w_shift
      for (int64_t c = first_owned_chunk<kOptChunk>(off); c * kOptChunk < end;
           c += kOptimizerBlocks) {
        float p[kOptPerThread], g[kOptPerThread], m[kOptPerThread], v[kOptPerThread];
        bool ok[kOptPerThread];
#pragma unroll
        for (int q = 0; q < kOptPerThread; ++q) {
          const int64_t j = c * kOptChunk + q * kOptThreads + threadIdx.x;
          ok[q] = j >= off && j < end;
          if (ok[q]) p[q] = params[j], g[q] = grads[j], m[q] = exp_avg[j], v[q] = exp_avg_sq[j];
        }
#pragma unroll
        for (int q = 0; q < kOptPerThread; ++q) {
          if (!ok[q]) continue;
          const int64_t j = c * kOptChunk + q * kOptThreads + threadIdx.x;
          const float gk = clip ? __fmul_rn(g[q], coef) : g[q];
          const float mk =
              low ? __fadd_rn(m[q], __fmul_rn(k.one_minus_b1, __fsub_rn(gk, m[q])))
                  : __fsub_rn(gk, __fmul_rn(__fsub_rn(gk, m[q]), k.one_minus_one_minus_b1));
          const float vk =
              __fadd_rn(__fmul_rn(v[q], k.b2), __fmul_rn(k.one_minus_b2, __fmul_rn(gk, gk)));
          const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vk), bc2_sqrt), k.eps);
          const float pk =
              __fadd_rn(__fmul_rn(p[q], decay), __fmul_rn(neg_step_size, __fdiv_rn(mk, denom)));
          params[j] = pk;
          exp_avg[j] = mk;
          exp_avg_sq[j] = vk;
          if (weights != nullptr) weights[j + w_shift] = float_to_bf16(pk);
        }
      }
    }
  }
}

}  // namespace

// ---- scratch sizes ----------------------------------------------------------------------------

int64_t norm_backward_scratch_floats(int64_t cols) {
  return 2 * static_cast<int64_t>(kTrainReducePartials) * cols;
}
int64_t qkv_norm_rope_backward_scratch_floats(int head_dim) {
  return 2 * static_cast<int64_t>(kQkNormPartials) * head_dim;
}
int64_t grad_norm_scratch_floats() {
  return 2 * static_cast<int64_t>(kOptimizerBlocks);
}
int64_t adamw_scratch_floats(int64_t n_tensors) {
  return 4 * n_tensors;
}
int64_t cross_entropy_scratch_floats(int64_t rows) {
  return rows;
}
// ---- launchers --------------------------------------------------------------------------------

void launch_convert_f32_to_bf16(uint16_t* dst, const float* src, int64_t n, cudaStream_t s) {
  launch_convert(dst, src, n, s);
}
void launch_convert_bf16_to_f32(float* dst, const uint16_t* src, int64_t n, cudaStream_t s) {
  launch_convert(dst, src, n, s);
}

void launch_layer_norm_train(uint16_t* y, float* mean, float* rstd, const uint16_t* x,
                             const uint16_t* w, const uint16_t* b, int64_t rows, int64_t cols,
                             float eps, cudaStream_t s) {
  launch_norm_train<true>(y, mean, rstd, x, w, b, rows, cols, eps, s);
}

void launch_rms_norm_train(uint16_t* y, float* rstd, const uint16_t* x, const uint16_t* w,
                           int64_t rows, int64_t cols, float eps, cudaStream_t s) {
  launch_norm_train<false>(y, nullptr, rstd, x, w, nullptr, rows, cols, eps, s);
}

void launch_layer_norm_backward(float* dx, float* dw, float* db, const void* dy, bool dy_f32,
                                const uint16_t* x, const float* mean, const float* rstd,
                                const uint16_t* w, int64_t rows, int64_t cols, float* scratch,
                                int64_t scratch_floats, cudaStream_t s) {
  if (dy_f32)
    launch_norm_backward_t<float, true>(dx, dw, db, static_cast<const float*>(dy), x, mean, rstd, w,
                                        rows, cols, scratch, scratch_floats, s,
                                        "layer_norm_backward");
  else
    launch_norm_backward_t<uint16_t, true>(dx, dw, db, static_cast<const uint16_t*>(dy), x, mean,
                                           rstd, w, rows, cols, scratch, scratch_floats, s,
                                           "layer_norm_backward");
}

void launch_rms_norm_backward(float* dx, float* dw, const void* dy, bool dy_f32, const uint16_t* x,
                              const float* rstd, const uint16_t* w, int64_t rows, int64_t cols,
                              float* scratch, int64_t scratch_floats, cudaStream_t s) {
  if (dy_f32)
    launch_norm_backward_t<float, false>(dx, dw, nullptr, static_cast<const float*>(dy), x, nullptr,
                                         rstd, w, rows, cols, scratch, scratch_floats, s,
                                         "rms_norm_backward");
  else
    launch_norm_backward_t<uint16_t, false>(dx, dw, nullptr, static_cast<const uint16_t*>(dy), x,
                                            nullptr, rstd, w, rows, cols, scratch, scratch_floats,
                                            s, "rms_norm_backward");
}

void launch_qkv_norm_rope_train(uint16_t* out, float* rstd, const uint16_t* in,
                                const uint16_t* q_norm_w, const uint16_t* k_norm_w, float eps,
                                const float* cos, const float* sin, int64_t tokens, int n_q_heads,
                                int n_kv_heads, int head_dim, bool round_tables, cudaStream_t s) {
  IRIS_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim,
             "qkv_norm_rope_train: head_dim ", head_dim, " must be even and at most ", kMaxHeadDim);
  const int64_t items = tokens * (n_q_heads + 2 * n_kv_heads);
  if (items == 0) return;
  // norm_rope.cu's choice between its vector and warp kernels (rope_vec_suits), so that each
  // head's sum of squares runs in the same order as the inference op's.
  const bool vec_suits = head_dim % 8 == 0 && aligned(in, 8) && aligned(out, 8) &&
                         aligned(cos, 16) && aligned(sin, 16) &&
                         (q_norm_w == nullptr || aligned(q_norm_w, 8)) &&
                         (k_norm_w == nullptr || aligned(k_norm_w, 8));
  if (vec_suits &&
      launch_rope_train_vec_for(head_dim / 8, out, rstd, in, q_norm_w, k_norm_w, eps, cos, sin,
                                tokens, n_q_heads, n_kv_heads, head_dim, round_tables, s))
    return;
  const unsigned grid = static_cast<unsigned>((items + kRopeWarps - 1) / kRopeWarps);
  qkv_norm_rope_train_kernel<<<grid, kRopeWarps * kWarpSize, 0, s>>>(
      out, rstd, in, q_norm_w, k_norm_w, eps, cos, sin, tokens, n_q_heads, n_kv_heads, head_dim,
      round_tables);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_qkv_norm_rope_backward(uint16_t* din, float* dq_norm_w, float* dk_norm_w,
                                   const uint16_t* dout, const uint16_t* in, const float* rstd,
                                   const uint16_t* q_norm_w, const uint16_t* k_norm_w,
                                   const float* cos, const float* sin, int64_t tokens,
                                   int n_q_heads, int n_kv_heads, int head_dim, bool round_tables,
                                   float* scratch, int64_t scratch_floats, cudaStream_t s) {
  IRIS_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim,
             "qkv_norm_rope_backward: head_dim ", head_dim, " must be even and at most ",
             kMaxHeadDim);
  const int64_t items = tokens * (n_q_heads + 2 * n_kv_heads);
  if (items == 0) return;
  const bool want_q = dq_norm_w != nullptr && q_norm_w != nullptr && n_q_heads > 0;
  const bool want_k = dk_norm_w != nullptr && k_norm_w != nullptr && n_kv_heads > 0;
  // The weight gradients first: they read dout, which din may overwrite.
  if (want_q || want_k) {
    check_scratch(scratch, scratch_floats, qkv_norm_rope_backward_scratch_floats(head_dim), 16,
                  "qkv_norm_rope_backward");
    const int half = head_dim / 2;
    const int lanes = kThreads / half;
    qk_norm_param_partial_kernel<<<kQkNormPartials, lanes * half, 0, s>>>(
        scratch, dout, in, rstd, cos, sin, tokens, n_q_heads, n_kv_heads, head_dim, round_tables,
        want_q, want_k);
    IRIS_CUDA_LAUNCH_CHECK();
    reduce_partials_kernel<<<static_cast<unsigned>((head_dim + kThreads - 1) / kThreads), kThreads,
                             0, s>>>(want_q ? dq_norm_w : nullptr, scratch,
                                     want_k ? dk_norm_w : nullptr, scratch + head_dim,
                                     kQkNormPartials, 2 * head_dim, head_dim);
    IRIS_CUDA_LAUNCH_CHECK();
  }
  const bool vec_suits = head_dim % 8 == 0 && aligned(din, 8) && aligned(dout, 8) &&
                         aligned(cos, 16) && aligned(sin, 16) &&
                         (q_norm_w == nullptr || (aligned(q_norm_w, 8) && aligned(in, 8))) &&
                         (k_norm_w == nullptr || (aligned(k_norm_w, 8) && aligned(in, 8)));
  if (vec_suits &&
      launch_rope_backward_vec_for(head_dim / 8, din, dout, in, rstd, q_norm_w, k_norm_w, cos, sin,
                                   tokens, n_q_heads, n_kv_heads, head_dim, round_tables, s))
    return;
  const unsigned grid = static_cast<unsigned>((items + kRopeWarps - 1) / kRopeWarps);
  qkv_norm_rope_backward_kernel<<<grid, kRopeWarps * kWarpSize, 0, s>>>(
      din, dout, in, rstd, q_norm_w, k_norm_w, cos, sin, tokens, n_q_heads, n_kv_heads, head_dim,
      round_tables);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_gelu_tanh_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                               cudaStream_t s) {
  launch_act_backward<GeluTanhGrad>(dx, dy, x, n, s);
}

void launch_gelu_erf_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                              cudaStream_t s) {
  launch_act_backward<GeluErfGrad>(dx, dy, x, n, s);
}

void launch_quick_gelu_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                                cudaStream_t s) {
  launch_act_backward<QuickGeluGrad>(dx, dy, x, n, s);
}

void launch_swiglu_backward(uint16_t* dgate_up, const uint16_t* dy, const uint16_t* gate_up,
                            int64_t rows, int64_t inter, cudaStream_t s) {
  if (rows == 0 || inter == 0) return;
  const bool vec = inter % 8 == 0 && aligned16(dgate_up) && aligned16(dy) && aligned16(gate_up);
  const int64_t work = vec ? rows * inter / 8 : rows * inter;
  swiglu_backward_kernel<<<grid_for(work), kThreads, 0, s>>>(dgate_up, dy, gate_up, rows, inter,
                                                             vec);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_embedding_backward(float* dtable, const void* dy, bool dy_f32, const int32_t* ids,
                               int64_t tokens, int64_t vocab, int64_t cols, int32_t skip_id,
                               cudaStream_t s) {
  if (tokens == 0 || cols == 0) return;
  const unsigned grid = static_cast<unsigned>(tokens);
  if (dy_f32) {
    const bool vec = cols % 4 == 0 && aligned16(dtable) && aligned16(dy);
    embedding_backward_kernel<float><<<grid, kScanThreads, 0, s>>>(
        dtable, static_cast<const float*>(dy), ids, tokens, vocab, cols, skip_id, vec);
  } else {
    const bool vec = cols % 4 == 0 && aligned16(dtable) && aligned(dy, 8);
    embedding_backward_kernel<uint16_t><<<grid, kScanThreads, 0, s>>>(
        dtable, static_cast<const uint16_t*>(dy), ids, tokens, vocab, cols, skip_id, vec);
  }
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_gather_rows(void* dst, bool dst_f32, const void* src, bool src_f32,
                        const int32_t* index, int64_t rows, int64_t src_rows, int64_t cols,
                        cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  if (dst_f32 && src_f32)
    launch_gather_t(static_cast<float*>(dst), static_cast<const float*>(src), index, rows, src_rows,
                    cols, s);
  else if (dst_f32)
    launch_gather_t(static_cast<float*>(dst), static_cast<const uint16_t*>(src), index, rows,
                    src_rows, cols, s);
  else if (src_f32)
    launch_gather_t(static_cast<uint16_t*>(dst), static_cast<const float*>(src), index, rows,
                    src_rows, cols, s);
  else
    launch_gather_t(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), index, rows,
                    src_rows, cols, s);
}

void launch_add_interpolated_rows_backward(float* dtable, const void* dy, bool dy_f32,
                                           const int32_t* index, const float* weight, int64_t rows,
                                           int64_t table_rows, int64_t cols, cudaStream_t s) {
  if (rows == 0 || table_rows == 0 || cols == 0) return;
  const unsigned grid = static_cast<unsigned>(table_rows);
  if (dy_f32) {
    const bool vec = cols % 4 == 0 && aligned16(dtable) && aligned16(dy);
    interpolated_rows_backward_kernel<float><<<grid, kScanThreads, 0, s>>>(
        dtable, static_cast<const float*>(dy), index, weight, rows, cols, vec);
  } else {
    const bool vec = cols % 4 == 0 && aligned16(dtable) && aligned(dy, 8);
    interpolated_rows_backward_kernel<uint16_t><<<grid, kScanThreads, 0, s>>>(
        dtable, static_cast<const uint16_t*>(dy), index, weight, rows, cols, vec);
  }
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_cross_entropy(float* loss_sum, uint16_t* dlogits, const float* logits,
                          const int32_t* targets, const float* grad_scale, int64_t rows,
                          int64_t vocab, float* scratch, int64_t scratch_floats, cudaStream_t s) {
  if (rows == 0) return;
  IRIS_CHECK(vocab > 0, "cross_entropy: empty vocabulary");
  check_scratch(scratch, scratch_floats, cross_entropy_scratch_floats(rows), 4, "cross_entropy");
  const bool vec_in = vocab % 4 == 0 && aligned16(logits);
  const bool vec_out =
      dlogits != nullptr && vocab % 8 == 0 && aligned16(logits) && aligned16(dlogits);
  cross_entropy_kernel<<<static_cast<unsigned>(rows), kCeThreads, 0, s>>>(
      scratch, dlogits, logits, targets, grad_scale, vocab, vec_in, vec_out);
  IRIS_CUDA_LAUNCH_CHECK();
  sum_rows_kernel<<<1, kThreads, 0, s>>>(loss_sum, scratch, rows);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_grad_norm_clip(float* grad_stats, const float* grads, const int64_t* spans,
                           const float* hyper, int64_t n_tensors, float max_norm, float* scratch,
                           int64_t scratch_floats, cudaStream_t s) {
  check_scratch(scratch, scratch_floats, grad_norm_scratch_floats(), 8, "grad_norm_clip");
  double* partials = reinterpret_cast<double*>(scratch);
  grad_sumsq_kernel<<<kOptimizerBlocks, kOptThreads, 0, s>>>(partials, grads, spans, hyper,
                                                             n_tensors);
  IRIS_CUDA_LAUNCH_CHECK();
  grad_norm_finish_kernel<<<1, kOptThreads, 0, s>>>(grad_stats, partials, max_norm);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_grad_sum_squares(double* sums, const float* grads, const int64_t* spans,
                             const float* hyper, int64_t n_tensors, cudaStream_t s) {
  if (n_tensors == 0) return;
  span_sumsq_kernel<<<static_cast<unsigned>(n_tensors), kOptThreads, 0, s>>>(sums, grads, spans,
                                                                             hyper);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_adamw_step(float* params, const float* grads, float* exp_avg, float* exp_avg_sq,
                       uint16_t* weights, const int64_t* spans, const float* hyper, int64_t* steps,
                       const float* lr, const float* grad_stats, int64_t n_tensors, float beta1,
                       float beta2, float eps, float* scratch, int64_t scratch_floats,
                       cudaStream_t s) {
  if (n_tensors == 0) return;
  check_scratch(scratch, scratch_floats, adamw_scratch_floats(n_tensors), 16, "adamw_step");
  float4* scal = reinterpret_cast<float4*>(scratch);
  adamw_prepare_kernel<<<static_cast<unsigned>((n_tensors + kThreads - 1) / kThreads), kThreads, 0,
                         s>>>(scal, steps, hyper, lr, grad_stats, n_tensors, beta1, beta2);
  IRIS_CUDA_LAUNCH_CHECK();
  AdamWConsts k;
  // As torch forms them: Python doubles, cast to f32.
  k.one_minus_b1 = static_cast<float>(1.0 - static_cast<double>(beta1));
  k.one_minus_one_minus_b1 = 1.0f - k.one_minus_b1;
  k.b2 = beta2;
  k.one_minus_b2 = static_cast<float>(1.0 - static_cast<double>(beta2));
  k.eps = eps;
  adamw_kernel<<<kOptimizerBlocks, kOptThreads, 0, s>>>(params, grads, exp_avg, exp_avg_sq, weights,
                                                        spans, scal, grad_stats, n_tensors, k);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
