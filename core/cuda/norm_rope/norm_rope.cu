// LayerNorm, RMSNorm and the fused per-head q/k RMSNorm + RoPE, for inference and training.
// Statistics in f32; the bf16 rounding points follow HF (spec section 10, items 3 and 4). The
// training forwards also save the statistics their backwards read; every reduction of the
// backwards runs in a fixed order (no float atomics), so the same inputs give the same bits.
#include <cmath>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/launch.cuh"
#include "core/cuda/norm_rope/norm_rope.h"
#include "core/cuda/train_scratch.h"

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
  pdl_wait();
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
  pdl_launch_dependents();
  pdl_wait();
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
  // Programmatic launches: a block's launch overlaps the tail of the kernel before it (the
  // vision encoder's graph is a chain of ~200 short kernels whose gaps add up).
  const dim3 block(kNormThreads);
  if (vec && n_vec <= kNormThreads) {
    launch_programmatic(norm_vec_kernel<1, kLayer>, dim3(grid), block, 0, s, y, x, w, b, cols, eps);
  } else if (vec && n_vec <= 2 * kNormThreads) {
    launch_programmatic(norm_vec_kernel<2, kLayer>, dim3(grid), block, 0, s, y, x, w, b, cols, eps);
  } else if (vec && n_vec <= 4 * kNormThreads) {
    launch_programmatic(norm_vec_kernel<4, kLayer>, dim3(grid), block, 0, s, y, x, w, b, cols, eps);
  } else if (vec && n_vec <= 8 * kNormThreads) {
    launch_programmatic(norm_vec_kernel<8, kLayer>, dim3(grid), block, 0, s, y, x, w, b, cols, eps);
  } else {
    launch_programmatic(norm_scalar_kernel<kLayer>, dim3(grid), block, 0, s, y, x, w, b, cols, eps);
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

constexpr int kRopeVecThreads = 256;

// Where the fused kernel also appends k and v to the caches (k_cache null: it does not).
struct CacheStore {
  uint16_t* k_cache = nullptr;
  uint16_t* v_cache = nullptr;
  const int32_t* past_len = nullptr;
  int64_t max_len = 0;
  // Heads per token the fused kernel visits: with a store, the v heads too (copied, not
  // rotated). Kernel and launcher both size the work from this.
  __host__ __device__ int heads_per_token(int n_q_heads, int n_kv_heads) const {
    return n_q_heads + n_kv_heads + (k_cache != nullptr ? n_kv_heads : 0);
  }
};

// The same arithmetic as qkv_norm_rope_kernel with TPH threads per (token, head), each owning
// four consecutive rotate-half pairs: 8-byte loads of x, 16-byte loads of the tables, and many
// more loads in flight than one warp per head with scalar loads (which left the vision encoder's
// RoPE pass at a third of the memory bandwidth). For head_dim / 8 a power of two up to 32.
template <int TPH>
__global__ void __launch_bounds__(kRopeVecThreads)
    qkv_norm_rope_vec_kernel(uint16_t* qkv, const uint16_t* q_norm_w, const uint16_t* k_norm_w,
                             float eps, const float* cos, const float* sin, int64_t tokens,
                             int n_q_heads, int n_kv_heads, int head_dim, bool round_tables,
                             CacheStore store) {
  pdl_launch_dependents();
  pdl_wait();
  const int heads = store.heads_per_token(n_q_heads, n_kv_heads);
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
  const int64_t row_stride = static_cast<int64_t>(n_q_heads + 2 * n_kv_heads) * head_dim;
  uint16_t* x = qkv + t * row_stride + static_cast<int64_t>(head) * head_dim;
  const uint16_t* norm_w = head < n_q_heads ? q_norm_w : k_norm_w;
  // The cache row of this token and the head's column there (k and v heads with a store).
  uint16_t* cache_head = nullptr;
  if (store.k_cache != nullptr && head >= n_q_heads) {
    const int64_t row = static_cast<int64_t>(*store.past_len) + t;
    const int kv_head = (head - n_q_heads) % n_kv_heads;
    if (row >= 0 && row < store.max_len)
      cache_head = (head < n_q_heads + n_kv_heads ? store.k_cache : store.v_cache) +
                   row * n_kv_heads * head_dim + static_cast<int64_t>(kv_head) * head_dim;
    if (head >= n_q_heads + n_kv_heads) {  // a v head: stored as it is
      if (cache_head != nullptr) {
        *reinterpret_cast<uint2*>(cache_head + i) = *reinterpret_cast<const uint2*>(x + i);
        *reinterpret_cast<uint2*>(cache_head + i + half) =
            *reinterpret_cast<const uint2*>(x + i + half);
      }
      return;
    }
  }

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
    // Qwen3RMSNorm: normalise in f32, cast to bf16, multiply by the bf16 weight (bf16 result).
    const float r = rsqrtf(ss / static_cast<float>(head_dim) + eps);
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
  const uint2 lo = make_uint2(pack_bf16x2(o1[0], o1[1]), pack_bf16x2(o1[2], o1[3]));
  const uint2 hi = make_uint2(pack_bf16x2(o2[0], o2[1]), pack_bf16x2(o2[2], o2[3]));
  *reinterpret_cast<uint2*>(x + i) = lo;
  *reinterpret_cast<uint2*>(x + i + half) = hi;
  if (cache_head != nullptr) {  // a k head with a store: the rotated bf16 values
    *reinterpret_cast<uint2*>(cache_head + i) = lo;
    *reinterpret_cast<uint2*>(cache_head + i + half) = hi;
  }
}

template <int TPH>
void launch_rope_vec(uint16_t* qkv, const uint16_t* q_norm_w, const uint16_t* k_norm_w, float eps,
                     const float* cos, const float* sin, int64_t tokens, int n_q_heads,
                     int n_kv_heads, int head_dim, bool round_tables, const CacheStore& store,
                     cudaStream_t s) {
  const int64_t threads = tokens * store.heads_per_token(n_q_heads, n_kv_heads) * TPH;
  const unsigned grid = static_cast<unsigned>((threads + kRopeVecThreads - 1) / kRopeVecThreads);
  launch_programmatic(qkv_norm_rope_vec_kernel<TPH>, dim3(grid), dim3(kRopeVecThreads), 0, s, qkv,
                      q_norm_w, k_norm_w, eps, cos, sin, tokens, n_q_heads, n_kv_heads, head_dim,
                      round_tables, store);
}

// launch_rope_vec<tph> for a run-time tph among TPH, TPH / 2, ..., 1; false for any other.
template <int TPH = kWarpSize>
bool launch_rope_vec_for(int tph, uint16_t* qkv, const uint16_t* q_norm_w, const uint16_t* k_norm_w,
                         float eps, const float* cos, const float* sin, int64_t tokens,
                         int n_q_heads, int n_kv_heads, int head_dim, bool round_tables,
                         const CacheStore& store, cudaStream_t s) {
  if (tph == TPH) {
    launch_rope_vec<TPH>(qkv, q_norm_w, k_norm_w, eps, cos, sin, tokens, n_q_heads, n_kv_heads,
                         head_dim, round_tables, store, s);
    return true;
  }
  if constexpr (TPH > 1) {
    return launch_rope_vec_for<TPH / 2>(tph, qkv, q_norm_w, k_norm_w, eps, cos, sin, tokens,
                                        n_q_heads, n_kv_heads, head_dim, round_tables, store, s);
  }
  return false;
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

namespace {

bool rope_vec_suits(const uint16_t* qkv, const uint16_t* q_norm_w, const uint16_t* k_norm_w,
                    const float* cos, const float* sin, int head_dim) {
  return head_dim % 8 == 0 && aligned(qkv, 8) && aligned(cos, 16) && aligned(sin, 16) &&
         (q_norm_w == nullptr || aligned(q_norm_w, 8)) &&
         (k_norm_w == nullptr || aligned(k_norm_w, 8));
}

}  // namespace

void launch_qkv_norm_rope(uint16_t* qkv, const uint16_t* q_norm_w, const uint16_t* k_norm_w,
                          float eps, const float* cos, const float* sin, int64_t tokens,
                          int n_q_heads, int n_kv_heads, int head_dim, bool round_tables,
                          cudaStream_t s) {
  const int64_t items = tokens * (n_q_heads + n_kv_heads);
  if (items == 0) return;
  if (rope_vec_suits(qkv, q_norm_w, k_norm_w, cos, sin, head_dim) &&
      launch_rope_vec_for(head_dim / 8, qkv, q_norm_w, k_norm_w, eps, cos, sin, tokens, n_q_heads,
                          n_kv_heads, head_dim, round_tables, CacheStore{}, s))
    return;
  const unsigned grid = static_cast<unsigned>((items + kRopeWarps - 1) / kRopeWarps);
  launch_programmatic(qkv_norm_rope_kernel, dim3(grid), dim3(kRopeWarps * kWarpSize), 0, s, qkv,
                      q_norm_w, k_norm_w, eps, cos, sin, tokens, n_q_heads, n_kv_heads, head_dim,
                      round_tables);
}

bool launch_qkv_norm_rope_kv_store(uint16_t* qkv, const uint16_t* q_norm_w,
                                   const uint16_t* k_norm_w, float eps, const float* cos,
                                   const float* sin, int64_t tokens, int n_q_heads, int n_kv_heads,
                                   int head_dim, bool round_tables, uint16_t* k_cache,
                                   uint16_t* v_cache, const int32_t* past_len, int64_t max_len,
                                   cudaStream_t s) {
  if (tokens == 0) return true;
  if (!rope_vec_suits(qkv, q_norm_w, k_norm_w, cos, sin, head_dim) || !aligned(k_cache, 8) ||
      !aligned(v_cache, 8))
    return false;
  CacheStore store;
  store.k_cache = k_cache;
  store.v_cache = v_cache;
  store.past_len = past_len;
  store.max_len = max_len;
  return launch_rope_vec_for(head_dim / 8, qkv, q_norm_w, k_norm_w, eps, cos, sin, tokens,
                             n_q_heads, n_kv_heads, head_dim, round_tables, store, s);
}

namespace {

constexpr int kThreads = 256;

// ---- norm forwards that also save the statistics (training) ----------------------------------
// The arithmetic (thread count, per-thread order, block reductions, dispatch) is a copy of
// norm_vec_kernel / norm_scalar_kernel above, so y has the bits launch_layer_norm /
// launch_rms_norm give; keep the two in step.

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
  // The dispatch of launch_norm: the same shapes and alignments take the same
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

// ---- q/k norm + RoPE, training forwards and backward -------------------------------------------
// The forwards copy the arithmetic of qkv_norm_rope_kernel / qkv_norm_rope_vec_kernel above (same
// per-thread order, same rounding points) out of place; keep them in step.

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

}  // namespace

// ---- scratch sizes ----------------------------------------------------------------------------

int64_t norm_backward_scratch_floats(int64_t cols) {
  return 2 * static_cast<int64_t>(kTrainReducePartials) * cols;
}
int64_t qkv_norm_rope_backward_scratch_floats(int head_dim) {
  return 2 * static_cast<int64_t>(kQkNormPartials) * head_dim;
}
// ---- launchers --------------------------------------------------------------------------------

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
  // launch_qkv_norm_rope's choice between its vector and warp kernels (rope_vec_suits), so that
  // each head's sum of squares runs in the same order as the inference op's.
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

}  // namespace iris::cuda
