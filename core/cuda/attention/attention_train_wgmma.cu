// The training attention backward on Hopper's warpgroup MMA (wgmma, sm_90a), for head dims that
// are whole 64-column sub-tiles (64: vision; 128: the decoder). Same contract and the same
// deterministic split as the mma.sync kernels of attention_train.cu, whose dsum kernel runs first:
// - dK/dV: a block (one warpgroup) owns 64 keys of one kv head, K and V in shared memory for the
//   whole block, and loops over the query heads of the GQA group and the query tiles of the
//   segment (Q and dO tiles double-buffered by cp.async): S^T = K Q^T and dP^T = V dO^T from
//   shared memory, P^T and dS^T = P^T (dP^T - dsum) in registers, then dV += P^T dO and
//   dK += dS^T Q with the probabilities as register A operands.
// - dQ: a block owns 64 query rows of one query head, Q and dO in shared memory, and streams the
//   K/V tiles of its keys: S = Q K^T, dP = dO V^T, dQ += dS K.
// Both kinds of block run in one grid (attn_bwd_wgmma_kernel).
// On an H200 (tools/attention_train_check.cu --bench, FLOPs as FlashAttention counts them), against
// the mma.sync kernels: decoder causal 16/8 heads of 128, 4096 rows 194 -> 260 TFLOP/s, 8192 rows
// 206 -> 274; vision 16 heads of 64, 16 x 1024 rows 190 -> 229, 4 x 4096 208 -> 252.
// Each gradient element is summed by one thread in a fixed order: no atomics.
// Tiles are 128-byte rows in the 128-byte swizzle, as the inference kernel (attention.cu) keeps
// them: one layout serves as the K-major operand of a score product and as the MN-major B
// operand of the products that follow.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda/attention/attention.h"
#include "core/cuda/attention/segment_tiles.cuh"
#include "core/cuda/attention/train_params.cuh"
#include "core/cuda/attention/wgmma.cuh"
#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/launch.cuh"

namespace iris::cuda {
namespace {

constexpr int kBwdRows = 64;  // query rows or keys per block: the wgmma M of one warpgroup
constexpr int kBwdThreads = 128;

// A tile of 64 rows x HD columns: HD / 64 sub-tiles of [64 rows][128 bytes], 128-byte swizzled.
template <int HD>
struct BwdTile {
  static_assert(HD % 64 == 0, "whole 64-column sub-tiles");
  static constexpr int kSub = HD / 64;
  static constexpr int kSubBytes = kBwdRows * 128;
  static constexpr int kBytes = kSub * kSubBytes;
  static constexpr size_t kSmem = 1024 /*alignment slack*/ + 6 * kBytes + 4 * kBwdRows * 4;
};

// Rows [row0, row0 + 64) of a head's columns (base, row stride `stride`) into a tile with
// cp.async; rows at or past row_end are zero-filled without being read. The caller commits.
template <int HD>
__device__ __forceinline__ void load_tile(unsigned char* tile, const uint16_t* base, int64_t stride,
                                          int64_t row0, int64_t row_end, int tid) {
  constexpr int kChunks = HD / 8;
  for (int i = tid; i < kBwdRows * kChunks; i += kBwdThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const int64_t row = row0 + r;
    const bool ok = row < row_end;
    cp_async16(tile + (c / 8) * BwdTile<HD>::kSubBytes + sw128_offset(r, c % 8),
               base + (ok ? row : 0) * stride + c * 8, ok ? 16 : 0);
  }
}

// acc[64 x 64] = A[64 x HD] B[64 x HD]^T, both tiles from shared memory (K-major).
template <int HD>
__device__ __forceinline__ void issue_scores(float (&acc)[32], const unsigned char* a,
                                             const unsigned char* b) {
#pragma unroll
  for (int kk = 0; kk < BwdTile<HD>::kSub * 4; ++kk)
    wgmma_m64n64k16_ss(acc, sw128_desc(a + (kk / 4) * BwdTile<HD>::kSubBytes) + 2 * (kk % 4),
                       sw128_desc(b + (kk / 4) * BwdTile<HD>::kSubBytes) + 2 * (kk % 4), kk > 0);
}

// acc[64 x HD] += A[64 x 64] B[64 x HD]: A from registers (bf16 fragments), B a tile read
// MN-major (its 64 rows are the reduction).
template <int HD>
__device__ __forceinline__ void issue_rows(float (&acc)[BwdTile<HD>::kSub][32],
                                           const uint32_t (&a)[4][4], const unsigned char* b) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int h = 0; h < BwdTile<HD>::kSub; ++h)
      wgmma_m64n64k16_rs_tb(acc[h], a[kk],
                            sw128_desc(b + h * BwdTile<HD>::kSubBytes) + kk * (2048 >> 4));
}

// The accumulator layout of a 64 x 64 wgmma tile as bf16 A fragments of four k-steps of 16.
__device__ __forceinline__ void pack_fragments(uint32_t (&f)[4][4], const float (&acc)[32]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    f[kk][0] = pack_bf16x2(acc[8 * kk + 0], acc[8 * kk + 1]);
    f[kk][1] = pack_bf16x2(acc[8 * kk + 2], acc[8 * kk + 3]);
    f[kk][2] = pack_bf16x2(acc[8 * kk + 4], acc[8 * kk + 5]);
    f[kk][3] = pack_bf16x2(acc[8 * kk + 6], acc[8 * kk + 7]);
  }
}

// Writes rows row_a and row_a + 8 (those below row_end) of a [64 x HD] accumulator times `mul`.
template <int HD>
__device__ __forceinline__ void store_rows(uint16_t* base, int64_t stride,
                                           const float (&acc)[BwdTile<HD>::kSub][32], float mul,
                                           int64_t row_a, int64_t row_end, int t4) {
  const int64_t row_b = row_a + 8;
#pragma unroll
  for (int h = 0; h < BwdTile<HD>::kSub; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = h * 64 + j * 8 + 2 * t4;
      if (row_a < row_end)
        *reinterpret_cast<uint32_t*>(base + row_a * stride + col) =
            pack_bf16x2(acc[h][4 * j] * mul, acc[h][4 * j + 1] * mul);
      if (row_b < row_end)
        *reinterpret_cast<uint32_t*>(base + row_b * stride + col) =
            pack_bf16x2(acc[h][4 * j + 2] * mul, acc[h][4 * j + 3] * mul);
    }
}

__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + 1023) &
                                          ~uintptr_t{1023});
}

// The live segment [seg_b, seg_e) of tile blockIdx.y of 64 rows and the tile's index in it;
// false for spare blocks, padding segments and rows past the last segment (the dsum kernel
// zeroed those rows of dqkv).
__device__ __forceinline__ bool live_tile(const TrainParams& p, int64_t& seg_b, int64_t& seg_e,
                                          int64_t& tile, int64_t& n_tiles) {
  const SegmentTile t = find_segment_tile(p.cu, p.n_segments, kBwdRows, blockIdx.y);
  if (t.segment >= p.n_segments) return false;
  seg_b = p.cu[t.segment];
  seg_e = p.cu[t.segment + 1];
  n_tiles = (seg_e - seg_b + kBwdRows - 1) / kBwdRows;
  tile = t.tile;
  if (tile >= n_tiles) return false;
  return p.real_rows == nullptr || seg_b < *p.real_rows;
}

template <int HD, bool kCausal>
__device__ __forceinline__ void dkv_block(const TrainParams& p, unsigned char* smem, int kv_head) {
  using T = BwdTile<HD>;
  unsigned char* k_tile = smem;
  unsigned char* v_tile = smem + T::kBytes;
  unsigned char* q_tiles = smem + 2 * T::kBytes;                  // [2 stages]
  unsigned char* do_tiles = smem + 4 * T::kBytes;                 // [2 stages]
  float* lse_s = reinterpret_cast<float*>(smem + 6 * T::kBytes);  // [2][64], times log2(e)
  float* dsum_s = lse_s + 2 * kBwdRows;                           // [2][64]
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t4 = lane % 4;
  int64_t seg_b, seg_e, tile, n_tiles;
  if (!live_tile(p, seg_b, seg_e, tile, n_tiles)) return;
  // Causal: the first key tile of a segment (the most queries) first.
  const int64_t k0 = seg_b + tile * kBwdRows, k_stop = min(k0 + kBwdRows, seg_e);
  const int64_t q_begin = kCausal ? k0 : seg_b, q_end = seg_e;
  const int n_qt = static_cast<int>((q_end - q_begin + kBwdRows - 1) / kBwdRows);
  const int n_it = n_qt * p.group;

  load_tile<HD>(k_tile, p.qkv + p.hidden + static_cast<int64_t>(kv_head) * HD, p.width, k0, k_stop,
                tid);
  load_tile<HD>(v_tile, p.qkv + p.v_col + static_cast<int64_t>(kv_head) * HD, p.width, k0, k_stop,
                tid);
  // Iteration it: query head kv_head * group + it / n_qt, query tile it % n_qt. Rows past the
  // segment get zero Q and dO rows, lse 0 and dsum 0, and are masked as well.
  auto load_stage = [&](int stage, int it) {
    const int head = kv_head * p.group + it / n_qt;
    const int64_t q0 = q_begin + static_cast<int64_t>(it % n_qt) * kBwdRows;
    load_tile<HD>(q_tiles + stage * T::kBytes, p.qkv + static_cast<int64_t>(head) * HD, p.width, q0,
                  q_end, tid);
    load_tile<HD>(do_tiles + stage * T::kBytes, p.dout + static_cast<int64_t>(head) * HD, p.hidden,
                  q0, q_end, tid);
    cp_async_commit();
    const int r = tid % kBwdRows;
    const int64_t row = q0 + r;
    const bool ok = row < q_end;
    if (tid < kBwdRows)
      lse_s[stage * kBwdRows + r] = ok ? p.lse[row * p.nq + head] * kTrainLog2e : 0.f;
    else
      dsum_s[stage * kBwdRows + r] = ok ? p.dsum[row * p.nq + head] : 0.f;
  };
  if (n_it > 0) load_stage(0, 0);

  const int64_t key_a = k0 + warp * 16 + g, key_b = key_a + 8;
  float dk[T::kSub][32], dv[T::kSub][32];
#pragma unroll
  for (int h = 0; h < T::kSub; ++h)
#pragma unroll
    for (int i = 0; i < 32; ++i) dk[h][i] = dv[h][i] = 0.f;
  const float c = p.scale_log2;
  for (int it = 0; it < n_it; ++it) {
    const int stage = it & 1;
    // The other stage was last read by iteration it - 1, whose products have completed.
    cp_async_wait<0>();
    fence_async_shared();  // cp.async writes are generic-proxy stores; wgmma reads async-proxy
    __syncthreads();
    if (it + 1 < n_it) load_stage(stage ^ 1, it + 1);
    const unsigned char* qs = q_tiles + stage * T::kBytes;
    const unsigned char* dos = do_tiles + stage * T::kBytes;
    const float* lt = lse_s + stage * kBwdRows;
    const float* dt = dsum_s + stage * kBwdRows;
    const int64_t q0 = q_begin + static_cast<int64_t>(it % n_qt) * kBwdRows;
    float st[32], dpt[32];
    wgmma_fence();
    issue_scores<HD>(st, k_tile, qs);
    issue_scores<HD>(dpt, v_tile, dos);
    wgmma_commit();
    wgmma_wait<0>();
    bool need_mask = q0 + kBwdRows > q_end;
    if constexpr (kCausal) need_mask = need_mask || q0 < k0 + (kBwdRows - 1);
      // Element e of column group j: key key_a (+ 8 for e >= 2), query q0 + 8 j + 2 t4 + (e & 1).
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * t4 + (e & 1);
        float pr = exp2_ftz(fmaf(st[4 * j + e], c, -lt[col]));
        if (need_mask) {
          bool ok = q0 + col < q_end;
          if constexpr (kCausal) ok = ok && q0 + col >= (e < 2 ? key_a : key_b);
          if (!ok) pr = 0.f;
        }
        st[4 * j + e] = pr;
        dpt[4 * j + e] = pr * (dpt[4 * j + e] - dt[col]);
      }
    uint32_t pa[4][4], da[4][4];
    pack_fragments(pa, st);
    pack_fragments(da, dpt);
    wgmma_fence();
    issue_rows<HD>(dv, pa, dos);  // dV += P^T dO
    issue_rows<HD>(dk, da, qs);   // dK += dS^T Q
    wgmma_commit();
    wgmma_wait<0>();
  }
  store_rows<HD>(p.dqkv + p.hidden + static_cast<int64_t>(kv_head) * HD, p.width, dk, p.scale,
                 key_a, k_stop, t4);
  store_rows<HD>(p.dqkv + p.v_col + static_cast<int64_t>(kv_head) * HD, p.width, dv, 1.f, key_a,
                 k_stop, t4);
}

template <int HD, bool kCausal>
__device__ __forceinline__ void dq_block(const TrainParams& p, unsigned char* smem, int head) {
  using T = BwdTile<HD>;
  unsigned char* q_tile = smem;
  unsigned char* do_tile = smem + T::kBytes;
  unsigned char* k_tiles = smem + 2 * T::kBytes;  // [2 stages]
  unsigned char* v_tiles = smem + 4 * T::kBytes;  // [2 stages]
  const int kv_head = head / p.group;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t4 = lane % 4;
  int64_t seg_b, seg_e, tile, n_tiles;
  if (!live_tile(p, seg_b, seg_e, tile, n_tiles)) return;
  // Causal: the last query tile of a segment (the most keys) first.
  const int64_t q0 = seg_b + (kCausal ? n_tiles - 1 - tile : tile) * kBwdRows;
  const int64_t q_end = seg_e, q_stop = min(q0 + kBwdRows, q_end);
  const int64_t kv_begin = seg_b, kv_end = kCausal ? q_stop : seg_e;
  const int n_kv = static_cast<int>((kv_end - kv_begin + kBwdRows - 1) / kBwdRows);

  load_tile<HD>(q_tile, p.qkv + static_cast<int64_t>(head) * HD, p.width, q0, q_end, tid);
  load_tile<HD>(do_tile, p.dout + static_cast<int64_t>(head) * HD, p.hidden, q0, q_end, tid);
  const uint16_t* k_base = p.qkv + p.hidden + static_cast<int64_t>(kv_head) * HD;
  const uint16_t* v_base = p.qkv + p.v_col + static_cast<int64_t>(kv_head) * HD;
  auto load_kv = [&](int stage, int t) {
    const int64_t key0 = kv_begin + static_cast<int64_t>(t) * kBwdRows;
    load_tile<HD>(k_tiles + stage * T::kBytes, k_base, p.width, key0, kv_end, tid);
    load_tile<HD>(v_tiles + stage * T::kBytes, v_base, p.width, key0, kv_end, tid);
    cp_async_commit();
  };
  load_kv(0, 0);

  const int64_t row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  const int64_t rows[2] = {row_a, row_b};
  float lse2[2], dsum[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool ok = rows[r] < q_end;
    lse2[r] = ok ? p.lse[rows[r] * p.nq + head] * kTrainLog2e : 0.f;
    dsum[r] = ok ? p.dsum[rows[r] * p.nq + head] : 0.f;
  }
  float dq[T::kSub][32];
#pragma unroll
  for (int h = 0; h < T::kSub; ++h)
#pragma unroll
    for (int i = 0; i < 32; ++i) dq[h][i] = 0.f;
  const float c = p.scale_log2;
  for (int it = 0; it < n_kv; ++it) {
    const int stage = it & 1;
    cp_async_wait<0>();
    fence_async_shared();
    __syncthreads();
    if (it + 1 < n_kv) load_kv(stage ^ 1, it + 1);
    const unsigned char* ks = k_tiles + stage * T::kBytes;
    const unsigned char* vs = v_tiles + stage * T::kBytes;
    const int64_t key0 = kv_begin + static_cast<int64_t>(it) * kBwdRows;
    float s[32], dp[32];
    wgmma_fence();
    issue_scores<HD>(s, q_tile, ks);
    issue_scores<HD>(dp, do_tile, vs);
    wgmma_commit();
    wgmma_wait<0>();
    bool need_mask = key0 + kBwdRows > kv_end;
    if constexpr (kCausal) need_mask = need_mask || key0 + (kBwdRows - 1) > q0;
      // Element e of column group j: row rows[e >> 1], key key0 + 8 j + 2 t4 + (e & 1).
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        float pr = exp2_ftz(fmaf(s[4 * j + e], c, -lse2[r]));
        if (need_mask) {
          const int64_t key = key0 + 8 * j + 2 * t4 + (e & 1);
          bool ok = key < kv_end;
          if constexpr (kCausal) ok = ok && key <= rows[r];
          if (!ok) pr = 0.f;
        }
        s[4 * j + e] = pr * (dp[4 * j + e] - dsum[r]);
      }
    uint32_t ds[4][4];
    pack_fragments(ds, s);
    wgmma_fence();
    issue_rows<HD>(dq, ds, ks);  // dQ += dS K
    wgmma_commit();
    wgmma_wait<0>();
  }
  store_rows<HD>(p.dqkv + static_cast<int64_t>(head) * HD, p.width, dq, p.scale, row_a, q_end, t4);
}

// One grid for both: blocks x < nkv compute dK/dV of kv head x, the others dQ of query head
// x - nkv. As two kernels, the first one's last wave ran with idle SMs beside it.
// Head_dim 64 at three blocks per SM (168 registers, where dK/dV took 176 at two): vision
// 16 x 1024 rows 200 -> 225 TFLOP/s, 4 x 4096 214 -> 248 (H200, tools/attention_train_check.cu
// --bench). Overlapping the elementwise steps with the next product (four commit groups instead
// of two) measured 2-4% slower at both head dims.
template <int HD, bool kCausal>
__global__ void __launch_bounds__(kBwdThreads, HD == 64 ? 3 : 1)
    attn_bwd_wgmma_kernel(TrainParams p) {
  extern __shared__ __align__(16) unsigned char bwd_wg_raw[];
  unsigned char* smem = aligned_smem(bwd_wg_raw);
  pdl_launch_dependents();
  pdl_wait();
  if (static_cast<int>(blockIdx.x) < p.nkv)
    dkv_block<HD, kCausal>(p, smem, blockIdx.x);
  else
    dq_block<HD, kCausal>(p, smem, blockIdx.x - p.nkv);
}

template <typename K>
void set_smem(K kernel, size_t bytes) {
  IRIS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)));
}

template <int HD, bool kCausal>
void launch_backward(const TrainParams& p, cudaStream_t s) {
  // One spare tile per segment, and one for the rows past the last (segment_tiles.cuh).
  const unsigned tiles =
      static_cast<unsigned>((p.total_rows + kBwdRows - 1) / kBwdRows + p.n_segments + 1);
  launch_programmatic(attn_bwd_wgmma_kernel<HD, kCausal>, dim3(p.nkv + p.nq, tiles),
                      dim3(kBwdThreads), BwdTile<HD>::kSmem, s, p);
  IRIS_CUDA_LAUNCH_CHECK();
}

// Set once by attention_train_wgmma_init: an sm_90a build on a compute capability 9.0 device.
bool g_wgmma_backward = false;

}  // namespace

void attention_train_wgmma_init() {
#if defined(IRIS_CUDA_SM90A)
  int device = 0;
  cudaDeviceProp prop{};
  IRIS_CUDA_CHECK(cudaGetDevice(&device));
  IRIS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  g_wgmma_backward = prop.major == 9 && prop.minor == 0;
  if (!g_wgmma_backward) return;
  set_smem(attn_bwd_wgmma_kernel<64, false>, BwdTile<64>::kSmem);
  set_smem(attn_bwd_wgmma_kernel<128, true>, BwdTile<128>::kSmem);
#endif
}

bool launch_train_backward_wgmma(const TrainParams& p, int head_dim, bool causal, cudaStream_t s) {
  const bool served = causal ? head_dim == 128 : head_dim == 64;
  if (!g_wgmma_backward || !served || !aligned16(p.qkv) || !aligned16(p.dout) || !aligned16(p.dqkv))
    return false;
  if (head_dim == 128)
    launch_backward<128, true>(p, s);
  else
    launch_backward<64, false>(p, s);
  return true;
}

}  // namespace iris::cuda
