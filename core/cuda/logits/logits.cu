// What is computed from rows of logits: the row argmax of greedy decoding, and the cross-entropy
// loss of a chunk of lm_head logits with its gradient. The loss is summed in a fixed order (no
// float atomics), so the same inputs give the same bits.
#include <cfloat>
#include <cmath>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/logits/logits.h"
#include "core/cuda/train_scratch.h"

namespace iris::cuda {
namespace {

constexpr int kThreads = 256;

// ---- argmax ----------------------------------------------------------------------------------

// torch.argmax order: NaN beats every number, then larger values, then the lower index.
__device__ __forceinline__ bool argmax_better(float v, int64_t i, float best, int64_t best_i) {
  const bool vn = v != v, bn = best != best;
  if (vn != bn) return vn;
  if (!vn && v != best) return v > best;
  return i < best_i;
}

constexpr int kArgmaxThreads = 512;

__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(int32_t* out, const uint16_t* x, int64_t cols, bool vec) {
  const uint16_t* row = x + static_cast<int64_t>(blockIdx.x) * cols;
  float best = -INFINITY;
  int64_t best_i = INT64_MAX;
  // Each thread visits increasing indices, so within a thread only a strictly better value may
  // replace the current best.
  if (vec) {
    for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x) {
      float f[8];
      load8(row + c * 8, f);
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (argmax_better(f[e], c * 8 + e, best, best_i)) best = f[e], best_i = c * 8 + e;
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float f = bf16_to_float(row[c]);
      if (argmax_better(f, c, best, best_i)) best = f, best_i = c;
    }
  }
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, best_i, o);
    if (argmax_better(ov, oi, best, best_i)) best = ov, best_i = oi;
  }
  __shared__ float s_val[kArgmaxThreads / kWarpSize];
  __shared__ int64_t s_idx[kArgmaxThreads / kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) s_val[warp] = best, s_idx[warp] = best_i;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxThreads / kWarpSize; ++w)
      if (argmax_better(s_val[w], s_idx[w], best, best_i)) best = s_val[w], best_i = s_idx[w];
    out[blockIdx.x] = static_cast<int32_t>(best_i == INT64_MAX ? 0 : best_i);
  }
}

// Long rows (a vocabulary of 152k logits) are split over many blocks; each block folds its best
// (value, index) into one 64-bit key per row with atomicMax. The key orders like torch.argmax:
// the high word maps floats to unsigned integers monotonically (NaN above everything), the low
// word is the complemented index so that the lower index wins ties.
constexpr int kArgmaxSplitThreads = 256;
constexpr int64_t kArgmaxColsPerBlock = 16384;

__device__ __forceinline__ unsigned long long argmax_key(float v, int64_t i) {
  uint32_t u;
  if (v != v) {
    u = 0xffffffffu;
  } else {
    u = __float_as_uint(v + 0.f);  // -0 -> +0: they tie, as in the CPU comparison
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  }
  return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}

__global__ void __launch_bounds__(kArgmaxSplitThreads)
    argmax_split_kernel(unsigned long long* keys, const uint16_t* x, int64_t cols) {
  const int64_t row = blockIdx.y;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kArgmaxColsPerBlock;
  const int64_t end = min(cols, begin + kArgmaxColsPerBlock);
  const uint16_t* r = x + row * cols;
  float best = -INFINITY;
  int64_t best_i = INT64_MAX;
  // 16384 columns = 256 threads x 8 vectors of 8: all loads of a thread are issued up front.
  constexpr int kVecs = kArgmaxColsPerBlock / (kArgmaxSplitThreads * 8);
  uint4 v[kVecs];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t c = begin + (static_cast<int64_t>(k) * kArgmaxSplitThreads + threadIdx.x) * 8;
    v[k] = c < end ? *reinterpret_cast<const uint4*>(r + c) : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int64_t c = begin + (static_cast<int64_t>(k) * kArgmaxSplitThreads + threadIdx.x) * 8;
    if (c >= end) continue;
    float f[8];
    unpack8(v[k], f);
#pragma unroll
    for (int e = 0; e < 8; ++e)
      if (argmax_better(f[e], c + e, best, best_i)) best = f[e], best_i = c + e;
  }
  unsigned long long key = best_i == INT64_MAX ? 0ull : argmax_key(best, best_i);
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
    key = other > key ? other : key;
  }
  __shared__ unsigned long long s_key[kArgmaxSplitThreads / kWarpSize];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  if (lane == 0) s_key[warp] = key;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kArgmaxSplitThreads / kWarpSize; ++w) key = s_key[w] > key ? s_key[w] : key;
    atomicMax(keys + row, key);
  }
}

__global__ void argmax_finish_kernel(int32_t* out, const unsigned long long* keys, int64_t rows) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row < rows) out[row] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(keys[row]));
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

}  // namespace

int64_t cross_entropy_scratch_floats(int64_t rows) {
  return rows;
}

void launch_argmax_rows(int32_t* out, const uint16_t* x, int64_t rows, int64_t cols,
                        unsigned long long* key_scratch, int64_t scratch_rows, cudaStream_t s) {
  if (rows == 0) return;
  const bool vec = cols % 8 == 0 && aligned16(x);
  const int64_t blocks_per_row = (cols + kArgmaxColsPerBlock - 1) / kArgmaxColsPerBlock;
  if (vec && blocks_per_row >= 2 && rows <= scratch_rows && rows <= 65535 &&
      cols < (int64_t{1} << 32)) {
    IRIS_CUDA_CHECK(cudaMemsetAsync(key_scratch, 0, static_cast<size_t>(rows) * 8, s));
    argmax_split_kernel<<<dim3(static_cast<unsigned>(blocks_per_row), static_cast<unsigned>(rows)),
                          kArgmaxSplitThreads, 0, s>>>(key_scratch, x, cols);
    IRIS_CUDA_LAUNCH_CHECK();
    argmax_finish_kernel<<<static_cast<unsigned>((rows + 255) / 256), 256, 0, s>>>(out, key_scratch,
                                                                                   rows);
    IRIS_CUDA_LAUNCH_CHECK();
    return;
  }
  argmax_rows_kernel<<<static_cast<unsigned>(rows), kArgmaxThreads, 0, s>>>(out, x, cols, vec);
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

}  // namespace iris::cuda
