// The multi-tensor optimizer over flat f32 buffers: the gradient norm and clip coefficient, the
// per-tensor sums of squares and the AdamW step. Every reduction runs in a fixed order (no float
// atomics), so the same inputs give the same bits; nothing allocates or synchronises.
#include <cmath>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/optimizer/optimizer.h"
#include "core/cuda/train_scratch.h"

namespace iris::cuda {
namespace {

constexpr int kThreads = 256;

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

int64_t grad_norm_scratch_floats() {
  return 2 * static_cast<int64_t>(kOptimizerBlocks);
}
int64_t adamw_scratch_floats(int64_t n_tensors) {
  return 4 * n_tensors;
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
