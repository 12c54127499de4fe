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

}  // namespace iris::cuda
