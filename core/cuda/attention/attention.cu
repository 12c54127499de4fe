// Attention kernels: flash-attention style kernels on bf16 tensor cores (mma.sync m16n8k16, and
// Hopper's warpgroup MMA at head_dim 64, 72 and 128; f32 accumulation, online softmax in
// f32) for vision segments and causal prefill, and a split-K flash-decoding kernel for
// single-token causal steps. Every kernel reads past_len from device memory, so one captured
// graph serves every decode step.
#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "core/cuda/attention/attention.h"
#include "core/cuda/attention/mma_sync.cuh"
#include "core/cuda/attention/segment_tiles.cuh"
#include "core/cuda/attention/wgmma.cuh"
#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/launch.cuh"

namespace iris::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ----------------------------------------------------------------------------------------------
// Flash attention (prefill / vision)
// ----------------------------------------------------------------------------------------------

// Keys per K/V tile in shared memory. A warp holds 16 query rows (the mma M).
constexpr int kBc = 64;

template <int HD>
struct FlashShape {
  // The QK^T reduction runs in k-steps of 16; head_dim 72 is padded to 80 (zeros) in shared
  // memory only, while PV works in n-tiles of 8 and needs no padding.
  static constexpr int kPad = (HD + 15) / 16 * 16;
  // +8 elements (16 bytes) per row: row strides of 4 (mod 8) words make the fragment loads of
  // a warp hit 32 distinct banks, and keep every row 16-byte aligned for cp.async.
  static constexpr int kLd = kPad + 8;
  static constexpr int kTileElems = kBc * kLd;
};

struct FlashParams {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  uint16_t* out;
  int64_t q_stride, kv_stride, out_stride;  // elements per row
  int kv_group;                             // query heads per kv head
  const int32_t* cu_seqlens;                // segments mode
  const int32_t* real_rows;  // segments mode: segments from *real_rows on are padding (or null)
  int n_segments;
  const int32_t* past_len;  // causal mode
  int64_t tokens;
  int64_t max_len;   // cache rows: keys beyond are never read, whatever past_len says
  float scale_log2;  // softmax scale times log2(e): the kernel works with exp2
  // Training (flash_wgmma_kernel's train modes): the log-sum-exp out, [rows, lse_stride] f32,
  // and the rows of the whole tensor (those past the last segment get zeros).
  float* lse;
  int64_t lse_stride;
  int64_t total_rows;
};

// Query rows [q0, q_end) of this block and its keys [kv_begin, kv_end), for query tiles of BR
// rows; false for a surplus block. In causal mode query i sits at absolute position past + i
// and sees keys [0, past + i].
template <bool kCausal, int BR>
__device__ __forceinline__ bool block_range(const FlashParams& p, int64_t& q0, int64_t& q_end,
                                            int64_t& kv_begin, int64_t& kv_end, int& past) {
  if constexpr (kCausal) {
    past = *p.past_len;
    // The causal grid is (heads, query tiles) and blocks are dispatched x-fastest: the last
    // query tile (the most keys) of every head first, then the next one down. Longest blocks
    // first keeps the tail short; numbered head-major instead, the heaviest tiles of the last
    // heads would start when the GPU is nearly drained and run alone.
    q0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * BR;
    q_end = p.tokens;
    kv_begin = 0;
    kv_end = min(past + min(q0 + BR, q_end), p.max_len);
    return true;
  } else {
    // Query tiles by segment_tiles.cuh's numbering: a block finds its segment by binary search,
    // and spare blocks (one per segment at most, and those past the last) leave at once.
    const SegmentTile t = find_segment_tile(p.cu_seqlens, p.n_segments, BR, blockIdx.y);
    if (t.segment >= p.n_segments) return false;
    const int seg = t.segment;
    const int64_t b = t.tile;
    if (b * BR >= p.cu_seqlens[seg + 1] - p.cu_seqlens[seg]) return false;
    kv_begin = p.cu_seqlens[seg];
    kv_end = p.cu_seqlens[seg + 1];
    q0 = kv_begin + b * BR;
    q_end = kv_end;
    return true;
  }
}

// Segments mode: a block of a padding segment (one that starts at or past *real_rows) writes
// zeros to its query rows [q0, q_stop) of this head instead of attending; true when it did. The
// branch is uniform over the block (kv_begin and q0 are per block).
template <int HD>
__device__ __forceinline__ bool zero_padding_rows(const FlashParams& p, int head, int64_t kv_begin,
                                                  int64_t q0, int64_t q_stop, int tid,
                                                  int threads) {
  if (p.real_rows == nullptr || kv_begin < *p.real_rows) return false;
  uint16_t* out_head = p.out + static_cast<int64_t>(head) * HD;
  for (int64_t i = tid; i < (q_stop - q0) * HD; i += threads)
    out_head[(q0 + i / HD) * p.out_stride + i % HD] = 0;
  return true;
}

// The query rows and keys of this block (block_range), after a padding segment's block has
// written its zeros; false when the block has nothing to attend.
template <int HD, bool kCausal, int BR>
__device__ __forceinline__ bool attended_range(const FlashParams& p, int head, int threads,
                                               int64_t& q0, int64_t& q_end, int64_t& kv_begin,
                                               int64_t& kv_end, int& past) {
  if (!block_range<kCausal, BR>(p, q0, q_end, kv_begin, kv_end, past)) return false;
  if constexpr (!kCausal) {
    if (zero_padding_rows<HD>(p, head, kv_begin, q0, min(q0 + BR, q_end), threadIdx.x, threads))
      return false;
  }
  return true;
}

// Per-warp pieces of the 16-row flash kernel (flash_group_kernel): a
// warp holds 16 query rows as mma A-fragments and runs them against one kBc-key K/V tile in
// shared memory (row stride FlashShape<HD>::kLd) at a time.

// Copies keys [key0, key0 + kBc) of K and V into a tile pair (row stride FlashShape<HD>::kLd)
// with cp.async, threads first, first + step, ... sharing the 16-byte chunks; keys at or past
// kv_end are zero-filled without being read. The caller commits the group.
template <int HD>
__device__ __forceinline__ void copy_kv_tile(uint16_t* ks, uint16_t* vs, const uint16_t* k_base,
                                             const uint16_t* v_base, int64_t kv_stride,
                                             int64_t key0, int64_t kv_begin, int64_t kv_end,
                                             int first, int step) {
  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  for (int i = first; i < kBc * kChunks; i += step) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    const int64_t key = key0 + r;
    const bool valid = key < kv_end;
    const int64_t src_row = valid ? key : kv_begin;
    cp_async16(ks + r * FlashShape<HD>::kLd + c, k_base + src_row * kv_stride + c, valid ? 16 : 0);
    cp_async16(vs + r * FlashShape<HD>::kLd + c, v_base + src_row * kv_stride + c, valid ? 16 : 0);
  }
}

// Q fragments of rows row_a and row_a + 8 straight from global memory into registers; rows at or
// past q_end and head_dim 72's padding columns read as zeros.
template <int HD>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qf)[FlashShape<HD>::kPad / 16][4],
                                                 const uint16_t* q_head, int64_t stride,
                                                 int64_t row_a, int64_t q_end, int t4) {
  const int64_t row_b = row_a + 8;
#pragma unroll
  for (int ks = 0; ks < FlashShape<HD>::kPad / 16; ++ks) {
    const int c0 = ks * 16 + 2 * t4, c1 = c0 + 8;
    qf[ks][0] = row_a < q_end && c0 < HD ? load_pair(q_head + row_a * stride + c0) : 0u;
    qf[ks][1] = row_b < q_end && c0 < HD ? load_pair(q_head + row_b * stride + c0) : 0u;
    qf[ks][2] = row_a < q_end && c1 < HD ? load_pair(q_head + row_a * stride + c1) : 0u;
    qf[ks][3] = row_b < q_end && c1 < HD ? load_pair(q_head + row_b * stride + c1) : 0u;
  }
}

// S = Q K^T for the warp's 16 rows x kBc keys. One ldmatrix.x4 fetches the B fragments of two
// k-steps: lanes 8i..8i+7 address the 8 key rows of matrix i, at column 8i.
template <int HD>
__device__ __forceinline__ void tile_scores(float (&s)[kBc / 8][4],
                                            const uint32_t (&qf)[FlashShape<HD>::kPad / 16][4],
                                            const uint16_t* ks, int lane) {
  constexpr int kSteps = FlashShape<HD>::kPad / 16;
#pragma unroll
  for (int nt = 0; nt < kBc / 8; ++nt) {
    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    const uint16_t* krow = ks + (nt * 8 + lane % 8) * FlashShape<HD>::kLd;
#pragma unroll
    for (int kk = 0; kk + 1 < kSteps; kk += 2) {
      uint32_t b[4];
      ldmatrix_x4(b, krow + kk * 16 + (lane / 8) * 8);
      mma_bf16_16816(s[nt], qf[kk], b[0], b[1]);
      mma_bf16_16816(s[nt], qf[kk + 1], b[2], b[3]);
    }
    if constexpr (kSteps % 2 == 1) {
      uint32_t b[2];
      ldmatrix_x2(b, krow + (kSteps - 1) * 16 + ((lane / 8) % 2) * 8);
      mma_bf16_16816(s[nt], qf[kSteps - 1], b[0], b[1]);
    }
  }
}

// Online softmax over one tile of scaled, masked scores (log2 domain): updates the running
// maxima and sums of the warp's two rows per thread, rescales o, and leaves the probabilities in
// s. A row's kBc scores are spread over the 4 threads of a quad.
template <int HD>
__device__ __forceinline__ void softmax_tile(float (&s)[kBc / 8][4], float (&m_run)[2],
                                             float (&l_run)[2], float (&o)[HD / 8][4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kBc / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m_run[r], mx);
    // A row that has seen only masked keys keeps m = -inf; exponentiate against 0 then so
    // that no inf - inf appears.
    const float m_use = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = exp2_ftz(m_run[r] - m_use);
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kBc / 8; ++nt) {
      s[nt][2 * r] = exp2_ftz(s[nt][2 * r] - m_use);
      s[nt][2 * r + 1] = exp2_ftz(s[nt][2 * r + 1] - m_use);
      sum += s[nt][2 * r] + s[nt][2 * r + 1];
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    l_run[r] = l_run[r] * alpha + sum;
    m_run[r] = m_new;
#pragma unroll
    for (int d = 0; d < HD / 8; ++d) {
      o[d][2 * r] *= alpha;
      o[d][2 * r + 1] *= alpha;
    }
  }
}

// O += P V: the S accumulators of two adjacent key n-tiles form one A fragment (k = 16 keys).
// V's B fragments (two keys of one column per register) come from a transposing ldmatrix:
// matrix i covers keys 8*(i%2).. and columns 8*(i/2).. of a 16-key x 16-column block, i.e.
// b0/b1 of two adjacent n-tiles.
template <int HD>
__device__ __forceinline__ void tile_pv(float (&o)[HD / 8][4], const float (&s)[kBc / 8][4],
                                        const uint16_t* vs, int lane) {
#pragma unroll
  for (int kk = 0; kk < kBc / 16; ++kk) {
    const uint32_t pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]),
                            pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                            pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                            pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
    const uint16_t* vrow = vs + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * FlashShape<HD>::kLd;
#pragma unroll
    for (int d = 0; d + 1 < HD / 8; d += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, vrow + d * 8 + (lane / 16) * 8);
      mma_bf16_16816(o[d], pa, b[0], b[1]);
      mma_bf16_16816(o[d + 1], pa, b[2], b[3]);
    }
    if constexpr ((HD / 8) % 2 == 1) {  // head_dim 72: nine n-tiles
      uint32_t b[2];
      ldmatrix_x2_trans(b, vrow + (HD / 8 - 1) * 8);
      mma_bf16_16816(o[HD / 8 - 1], pa, b[0], b[1]);
    }
  }
}

// Writes a warp's 16 normalised output rows (row_a and row_a + 8 per thread) as bf16.
template <int HD>
__device__ __forceinline__ void store_rows(uint16_t* out_head, int64_t out_stride,
                                           const float (&o)[HD / 8][4], const float (&l_run)[2],
                                           int64_t row_a, int64_t q_end, int t4) {
  const int64_t row_b = row_a + 8;
  const float inv_a = l_run[0] > 0.f ? 1.f / l_run[0] : 0.f;
  const float inv_b = l_run[1] > 0.f ? 1.f / l_run[1] : 0.f;
#pragma unroll
  for (int d = 0; d < HD / 8; ++d) {
    const int c = d * 8 + 2 * t4;
    if (row_a < q_end)
      *reinterpret_cast<uint32_t*>(out_head + row_a * out_stride + c) =
          pack_bf16x2(o[d][0] * inv_a, o[d][1] * inv_a);
    if (row_b < q_end)
      *reinterpret_cast<uint32_t*>(out_head + row_b * out_stride + c) =
          pack_bf16x2(o[d][2] * inv_b, o[d][3] * inv_b);
  }
}

// The head dims the flash kernels are compiled for: one list for dispatch, shared-memory set-up
// and the support query.
template <int... HDs>
struct HeadDimList {
  static bool contains(int head_dim) { return ((head_dim == HDs) || ...); }
  // Calls f(std::integral_constant<int, HD>) for the HD equal to head_dim.
  template <typename F>
  static void with(int head_dim, F&& f) {
    const bool found =
        ((head_dim == HDs ? (f(std::integral_constant<int, HDs>{}), true) : false) || ...);
    if (!found) {
      std::string names;
      ((names += (names.empty() ? "" : ", ") + std::to_string(HDs)), ...);
      IRIS_FAIL("attention: head_dim ", head_dim, " has no CUDA kernel (", names, ")");
    }
  }
  template <typename F>
  static void each(F&& f) {
    (f(std::integral_constant<int, HDs>{}), ...);
  }
};
using FlashHeadDims = HeadDimList<16, 64, 72, 80, 128>;

// ----------------------------------------------------------------------------------------------
// Grouped flash attention (vision segments, causal prefill below the wide kernel's range)
// ----------------------------------------------------------------------------------------------

// A block holds RG row groups of 16 query rows and KS key groups, one warp per (key group, row
// group): warp (kg, rg) runs its 16 rows against key tiles kg, kg + KS, ... of its keys. The RG
// warps of a key group share that group's K/V tiles (a STAGES-deep cp.async pipeline), and the
// KS partial softmax states of each row are merged through shared memory at the end. RG > 1
// loads each K/V tile once for more rows (key groups of 16 rows alone, the earlier key-split
// kernel, re-read a 784-patch image's K/V once per 16 rows and took 44-55 us on an H100 where
// the layouts below take 26-29); KS > 1 splits the keys when the query tiles alone would leave
// SMs idle.
template <int RG_, int KS_, int STAGES_>
struct GroupLayout {
  static constexpr int RG = RG_, KS = KS_, STAGES = STAGES_;
  static constexpr int kWarps = RG * KS;
  static constexpr int kThreads = kWarps * kWarpSize;
  static constexpr int kRows = 16 * RG;
};
// 64 rows, every key tile in one group, double-buffered: ~150 registers per thread at head_dim
// 128 and several blocks per SM. Causal prefill below the wide kernel, and vision calls of many
// short segments.
using Rows64 = GroupLayout<4, 1, 2>;
// Vision calls too small to fill the GPU (pick_segment_kernel says which).
using Rows128Keys2 = GroupLayout<8, 2, 2>;
using Rows32Keys4 = GroupLayout<2, 4, 1>;

template <int HD, typename L>
struct GroupShape {
  static constexpr int kPad = FlashShape<HD>::kPad;
  static constexpr int kTileElems = FlashShape<HD>::kTileElems;
  static constexpr size_t kTileBytes =
      static_cast<size_t>(L::KS) * L::STAGES * 2 /*K,V*/ * kTileElems * sizeof(uint16_t);
  // The merge reuses the tile memory for the f32 partials: o rows, then m and l.
  static constexpr size_t kMergeBytes = L::KS > 1 ? static_cast<size_t>(L::KS) * L::kRows*(HD + 2) *
                                                        sizeof(float)
                                                  : 0;
  static constexpr size_t kSmemBytes = kTileBytes > kMergeBytes ? kTileBytes : kMergeBytes;
};

// Barrier over `threads` threads (whole warps) that use the same id; id 0 is __syncthreads'.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int HD, typename L, bool kCausal>
__global__ void __launch_bounds__(L::kThreads) flash_group_kernel(FlashParams p) {
  static_assert(!kCausal || L::KS == 1, "a causal block runs all of its key tiles in one group");
  using S = GroupShape<HD, L>;
  constexpr int RG = L::RG, KS = L::KS, STAGES = L::STAGES;
  extern __shared__ __align__(16) uint16_t smem[];
  // Launched as a programmatic dependent: nothing an earlier kernel writes is read before this.
  pdl_launch_dependents();
  pdl_wait();
  const int head = blockIdx.x;
  const int kv_head = head / p.kv_group;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int kg = warp / RG, rg = warp % RG;
  const int g = lane / 4, t4 = lane % 4;  // mma fragment coordinates: row group, column pair
  int64_t q0, q_end, kv_begin, kv_end;
  int past = 0;
  if (!attended_range<HD, kCausal, L::kRows>(p, head, L::kThreads, q0, q_end, kv_begin, kv_end,
                                             past))
    return;
  const int n_tiles = static_cast<int>((kv_end - kv_begin + kBc - 1) / kBc);
  const int my_tiles = n_tiles > kg ? (n_tiles - kg + KS - 1) / KS : 0;

  uint16_t* k_tiles = smem + kg * STAGES * 2 * S::kTileElems;  // [STAGES][kBc][kLd]
  uint16_t* v_tiles = k_tiles + STAGES * S::kTileElems;        // [STAGES][kBc][kLd]
  const int group_tid = rg * kWarpSize + lane;
  constexpr int kGroupThreads = RG * kWarpSize;
  auto group_sync = [&] {
    if constexpr (KS == 1) {
      __syncthreads();
    } else if constexpr (RG == 1) {
      __syncwarp();
    } else {
      named_barrier(1 + kg, kGroupThreads);
    }
  };
  // Zero the K padding columns [HD, kPad) once; cp.async never writes them.
  if constexpr (S::kPad != HD) {
    constexpr int kPadCols = S::kPad - HD;
    for (int i = group_tid; i < STAGES * kBc * kPadCols; i += kGroupThreads)
      k_tiles[(i / kPadCols) * FlashShape<HD>::kLd + HD + i % kPadCols] = 0;
  }

  const uint16_t* k_base = p.k + static_cast<int64_t>(kv_head) * HD;
  const uint16_t* v_base = p.v + static_cast<int64_t>(kv_head) * HD;
  // Tile j of this key group is tile kg + j * KS of the block's keys.
  auto tile_key0 = [&](int j) { return kv_begin + static_cast<int64_t>(kg + j * KS) * kBc; };
  auto load_tile = [&](int stage, int j) {
    copy_kv_tile<HD>(k_tiles + stage * S::kTileElems, v_tiles + stage * S::kTileElems, k_base,
                     v_base, p.kv_stride, tile_key0(j), kv_begin, kv_end, group_tid, kGroupThreads);
    cp_async_commit();
  };
  for (int j = 0; j < STAGES - 1 && j < my_tiles; ++j) load_tile(j, j);

  // Q fragments straight from global memory into registers (read once per block).
  const int64_t warp_row0 = q0 + rg * 16, row_a = warp_row0 + g, row_b = row_a + 8;
  // A row group wholly past the last query still loads its share of the tiles and meets the
  // barriers, but computes nothing.
  const bool rows_idle = warp_row0 >= q_end;
  uint32_t qf[S::kPad / 16][4];
  load_q_fragments<HD>(qf, p.q + static_cast<int64_t>(head) * HD, p.q_stride, row_a, q_end, t4);
  float o[HD / 8][4];
#pragma unroll
  for (int d = 0; d < HD / 8; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  for (int j = 0; j < my_tiles; ++j) {
    const int stage = j % STAGES;
    // The stage loaded here was last read in iteration j - 1, which ended with a group barrier.
    if (j + STAGES - 1 < my_tiles) {
      load_tile((j + STAGES - 1) % STAGES, j + STAGES - 1);
      cp_async_wait<STAGES - 1>();
    } else {
      cp_async_wait<0>();
    }
    group_sync();
    if (!rows_idle) {
      const int64_t key0 = tile_key0(j);
      float s[kBc / 8][4];
      tile_scores<HD>(s, qf, k_tiles + stage * S::kTileElems, lane);
      // Scale into the log2 domain; mask keys past the end or (causal) past a row's diagonal,
      // where the tile reaches them. Query i sits at absolute position past + i.
      bool need_mask = key0 + kBc > kv_end;
      if constexpr (kCausal) need_mask = need_mask || key0 + (kBc - 1) > past + warp_row0;
#pragma unroll
      for (int nt = 0; nt < kBc / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = key0 + nt * 8 + 2 * t4 + (e & 1);
          bool ok = key < kv_end;
          if constexpr (kCausal) ok = ok && key <= past + (e < 2 ? row_a : row_b);
          s[nt][e] = !need_mask || ok ? s[nt][e] * p.scale_log2 : -INFINITY;
        }
      softmax_tile<HD>(s, m_run, l_run, o);
      tile_pv<HD>(o, s, v_tiles + stage * S::kTileElems, lane);
    }
    group_sync();
  }

  uint16_t* out_head = p.out + static_cast<int64_t>(head) * HD;
  if constexpr (KS == 1) {
    store_rows<HD>(out_head, p.out_stride, o, l_run, row_a, q_end, t4);
  } else {
    // out = sum_kg 2^(m_kg - M) o_kg / sum_kg 2^(m_kg - M) l_kg. A key group that got no tile
    // has m = -inf, l = 0 and o = 0 and weighs nothing.
    __syncthreads();  // every warp is done with its tiles before the memory is reused
    float* part = reinterpret_cast<float*>(smem);  // [KS][kRows][HD]
    float* ml = part + KS * L::kRows * HD;         // [KS][kRows][2]: m, l
    const int row0 = kg * L::kRows + rg * 16;
    float* mine = part + row0 * HD;
#pragma unroll
    for (int d = 0; d < HD / 8; ++d) {
      const int c = d * 8 + 2 * t4;
      mine[g * HD + c] = o[d][0];
      mine[g * HD + c + 1] = o[d][1];
      mine[(g + 8) * HD + c] = o[d][2];
      mine[(g + 8) * HD + c + 1] = o[d][3];
    }
    if (t4 == 0) {
      ml[(row0 + g) * 2] = m_run[0], ml[(row0 + g) * 2 + 1] = l_run[0];
      ml[(row0 + g + 8) * 2] = m_run[1], ml[(row0 + g + 8) * 2 + 1] = l_run[1];
    }
    __syncthreads();
    constexpr int kThreadsPerRow = L::kThreads / L::kRows;
    const int row = tid / kThreadsPerRow;
    const int64_t out_row = q0 + row;
    if (out_row >= q_end) return;
    float m_max = -INFINITY;
#pragma unroll
    for (int k = 0; k < KS; ++k) m_max = fmaxf(m_max, ml[(k * L::kRows + row) * 2]);
    float weight[KS], den = 0.f;
#pragma unroll
    for (int k = 0; k < KS; ++k) {
      const float m_k = ml[(k * L::kRows + row) * 2];
      weight[k] = m_k == -INFINITY ? 0.f : exp2_ftz(m_k - m_max);
      den += weight[k] * ml[(k * L::kRows + row) * 2 + 1];
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    uint16_t* out_row_ptr = out_head + out_row * p.out_stride;
    for (int c = tid % kThreadsPerRow; c < HD; c += kThreadsPerRow) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < KS; ++k) acc += weight[k] * part[(k * L::kRows + row) * HD + c];
      out_row_ptr[c] = float_to_bf16(acc * inv);
    }
  }
}

// The vision encoders' head dims (Qwen2/2.5-VL 80, Qwen3-VL 64 and 72; 16 for tiny test models).
using VisionHeadDims = HeadDimList<16, 64, 72, 80>;

template <int HD, typename L, bool kCausal>
void launch_group(const FlashParams& p, dim3 grid, cudaStream_t s) {
  launch_programmatic(flash_group_kernel<HD, L, kCausal>, grid, dim3(L::kThreads),
                      GroupShape<HD, L>::kSmemBytes, s, p);
  IRIS_CUDA_LAUNCH_CHECK();
}

template <int HD, typename L, bool kCausal>
void set_group_smem() {
  IRIS_CUDA_CHECK(cudaFuncSetAttribute(flash_group_kernel<HD, L, kCausal>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(GroupShape<HD, L>::kSmemBytes)));
}

// launch_group for the head dim among Dims.
template <typename Dims, typename L, bool kCausal>
void dispatch_group(int head_dim, const FlashParams& p, dim3 grid, cudaStream_t s) {
  Dims::with(head_dim, [&](auto hd) { launch_group<decltype(hd)::value, L, kCausal>(p, grid, s); });
}

// Segments mode: heads by an upper bound on the query tiles of all segments (segment_tiles.cuh;
// spare blocks leave at once).
dim3 segment_grid(int64_t rows, int rows_per_block, int n_segments, int n_heads) {
  return dim3(n_heads,
              static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block + n_segments));
}

// ----------------------------------------------------------------------------------------------
// Wide flash attention (long prefill, large vision batches)
// ----------------------------------------------------------------------------------------------

// 128 query rows per block, 32 per warp: each warp runs two m16 row tiles against every K and V
// fragment it loads, so a K/V tile in shared memory feeds twice the MMAs per ldmatrix of the
// grouped kernel's 16-row warps, and the two independent accumulator chains hide the MMA latency. Q
// is staged in shared memory (fragments of 32 rows would not fit in registers beside the 32 x
// head_dim f32 output). Only tiles that cross the causal diagonal or the segment end pay for
// masking; a warp skips tiles that lie wholly past its rows' diagonal and query rows past the
// segment end. Used where there are enough 128-row tiles to fill the GPU twice over.
constexpr int kWideBr = 128;
constexpr int kWideRows = 32;  // per warp
constexpr int kWideWarps = kWideBr / kWideRows;
constexpr int kWideThreads = kWideWarps * kWarpSize;

template <int HD, int BC>
struct WideShape {
  static constexpr int kPad = (HD + 15) / 16 * 16;
  static constexpr int kLd = kPad + 8;  // as FlashShape: conflict-free ldmatrix rows
  static constexpr int kQElems = kWideBr * kLd;
  static constexpr int kTileElems = BC * kLd;
  static constexpr size_t kSmemBytes =
      (kQElems + 2 /*stages*/ * 2 /*K,V*/ * kTileElems) * sizeof(uint16_t);
};

template <int HD, int BC, bool kCausal>
__global__ void __launch_bounds__(kWideThreads) flash_wide_kernel(FlashParams p) {
  using S = WideShape<HD, BC>;
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* q_tile = smem;                          // [kWideBr][kLd]
  uint16_t* k_tiles = smem + S::kQElems;            // [2][BC][kLd]
  uint16_t* v_tiles = k_tiles + 2 * S::kTileElems;  // [2][BC][kLd]
  pdl_launch_dependents();
  pdl_wait();

  const int head = blockIdx.x;
  const int kv_head = head / p.kv_group;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t4 = lane % 4;

  int64_t q0, q_end, kv_begin, kv_end;
  int past = 0;
  if (!attended_range<HD, kCausal, kWideBr>(p, head, kWideThreads, q0, q_end, kv_begin, kv_end,
                                            past))
    return;
  const int n_tiles = static_cast<int>((kv_end - kv_begin + BC - 1) / BC);

  // Zero the padding columns [HD, kPad) of Q and K once; cp.async never writes them.
  if constexpr (S::kPad != HD) {
    constexpr int kPadCols = S::kPad - HD;
    for (int i = tid; i < kWideBr * kPadCols; i += kWideThreads)
      q_tile[(i / kPadCols) * S::kLd + HD + i % kPadCols] = 0;
    for (int i = tid; i < 2 * BC * kPadCols; i += kWideThreads)
      k_tiles[(i / kPadCols) * S::kLd + HD + i % kPadCols] = 0;
  }

  constexpr int kChunks = HD / 8;  // 16-byte chunks per row
  {
    const uint16_t* q_head = p.q + static_cast<int64_t>(head) * HD;
    for (int i = tid; i < kWideBr * kChunks; i += kWideThreads) {
      const int r = i / kChunks, c = (i % kChunks) * 8;
      const int64_t row = q0 + r;
      const bool valid = row < q_end;
      cp_async16(q_tile + r * S::kLd + c, q_head + (valid ? row : q0) * p.q_stride + c,
                 valid ? 16 : 0);
    }
    cp_async_commit();
  }
  const uint16_t* k_base = p.k + static_cast<int64_t>(kv_head) * HD;
  const uint16_t* v_base = p.v + static_cast<int64_t>(kv_head) * HD;
  auto load_tile = [&](int stage, int tile) {
    const int64_t key0 = kv_begin + static_cast<int64_t>(tile) * BC;
    uint16_t* ks = k_tiles + stage * S::kTileElems;
    uint16_t* vs = v_tiles + stage * S::kTileElems;
    for (int i = tid; i < BC * kChunks; i += kWideThreads) {
      const int r = i / kChunks, c = (i % kChunks) * 8;
      const int64_t key = key0 + r;
      const bool valid = key < kv_end;
      const int64_t src_row = valid ? key : kv_begin;
      cp_async16(ks + r * S::kLd + c, k_base + src_row * p.kv_stride + c, valid ? 16 : 0);
      cp_async16(vs + r * S::kLd + c, v_base + src_row * p.kv_stride + c, valid ? 16 : 0);
    }
    cp_async_commit();
  };
  if (n_tiles > 0) load_tile(0, 0);

  // This warp's query rows: warp_row0 + mt * 16 + g (+ 8) for its two m-tiles mt.
  const int64_t warp_row0 = q0 + warp * kWideRows;
  const bool warp_idle = warp_row0 >= q_end;  // a segment's last tile may not reach this warp
  constexpr int kSteps = S::kPad / 16;
  constexpr int kNt = BC / 8;
  // ldmatrix.x4 row addresses of the Q A-fragments: lanes 0-15 rows 0-15 at column k, lanes
  // 16-31 the same rows at k + 8 (a0..a3 = rows 0-7/8-15 x columns k/k+8, the mma A layout).
  const uint16_t* q_frag = q_tile + (warp * kWideRows + lane % 16) * S::kLd + (lane / 16) * 8;

  float o[2][HD / 8][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int d = 0; d < HD / 8; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
  float m_run[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}};
  float l_run[2][2] = {{0.f, 0.f}, {0.f, 0.f}};

  for (int it = 0; it < n_tiles; ++it) {
    const int stage = it & 1;
    // The other stage was last read in iteration it-1, which ended with a barrier.
    if (it + 1 < n_tiles) {
      load_tile(stage ^ 1, it + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int64_t key0 = kv_begin + static_cast<int64_t>(it) * BC;
    bool skip = warp_idle, need_mask = key0 + BC > kv_end;
    if constexpr (kCausal) {
      skip = skip || key0 > past + warp_row0 + (kWideRows - 1);
      need_mask = need_mask || key0 + (BC - 1) > past + warp_row0;
    }
    if (!skip) {
      const uint16_t* ks = k_tiles + stage * S::kTileElems;
      const uint16_t* vs = v_tiles + stage * S::kTileElems;

      // S = Q K^T: 32 rows x BC keys. One ldmatrix.x4 of K gives the B fragments of two k-steps
      // of one key n-tile (lanes 8i..8i+7 address its 8 key rows at column 8i), used by both
      // m-tiles.
      float s[2][kNt][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt)
          s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk + 1 < kSteps; kk += 2) {
        uint32_t qa[2][2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          ldmatrix_x4(qa[mt][0], q_frag + mt * 16 * S::kLd + kk * 16);
          ldmatrix_x4(qa[mt][1], q_frag + mt * 16 * S::kLd + (kk + 1) * 16);
        }
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          uint32_t b[4];
          ldmatrix_x4(b, ks + (nt * 8 + lane % 8) * S::kLd + kk * 16 + (lane / 8) * 8);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma_bf16_16816(s[mt][nt], qa[mt][0], b[0], b[1]);
            mma_bf16_16816(s[mt][nt], qa[mt][1], b[2], b[3]);
          }
        }
      }
      if constexpr (kSteps % 2 == 1) {
        uint32_t qa[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
          ldmatrix_x4(qa[mt], q_frag + mt * 16 * S::kLd + (kSteps - 1) * 16);
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          uint32_t b[2];
          ldmatrix_x2(b,
                      ks + (nt * 8 + lane % 8) * S::kLd + (kSteps - 1) * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) mma_bf16_16816(s[mt][nt], qa[mt], b[0], b[1]);
        }
      }

      if (need_mask) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int64_t key = key0 + nt * 8 + 2 * t4 + (e & 1);
              bool ok = key < kv_end;
              if constexpr (kCausal)
                ok = ok && key <= past + warp_row0 + mt * 16 + g + (e < 2 ? 0 : 8);
              if (!ok) s[mt][nt][e] = -INFINITY;
            }
      }

      // Online softmax in the log2 domain; the scale is folded into the exponent's FMA (the
      // launcher only takes this kernel for a positive scale, so the raw maximum is the scaled
      // one). A row's BC scores are spread over the 4 threads of a quad.
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < kNt; ++nt)
            mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[mt][r], mx * p.scale_log2);
          // A row that has seen only masked keys keeps m = -inf; exponentiate against 0 then so
          // that no inf - inf appears.
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          const float alpha = exp2_ftz(m_run[mt][r] - m_use);
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < kNt; ++nt) {
            s[mt][nt][2 * r] = exp2_ftz(fmaf(s[mt][nt][2 * r], p.scale_log2, -m_use));
            s[mt][nt][2 * r + 1] = exp2_ftz(fmaf(s[mt][nt][2 * r + 1], p.scale_log2, -m_use));
            sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
          }
          sum += __shfl_xor_sync(0xffffffffu, sum, 1);
          sum += __shfl_xor_sync(0xffffffffu, sum, 2);
          l_run[mt][r] = l_run[mt][r] * alpha + sum;
          m_run[mt][r] = m_new;
#pragma unroll
          for (int d = 0; d < HD / 8; ++d) {
            o[mt][d][2 * r] *= alpha;
            o[mt][d][2 * r + 1] *= alpha;
          }
        }
      }

      // O += P V, V's B fragments from a transposing ldmatrix (as in the grouped kernel), each
      // used by both m-tiles.
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t pa[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          pa[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          pa[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          pa[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          pa[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
        const uint16_t* vrow = vs + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * S::kLd;
#pragma unroll
        for (int d = 0; d + 1 < HD / 8; d += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, vrow + d * 8 + (lane / 16) * 8);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma_bf16_16816(o[mt][d], pa[mt], b[0], b[1]);
            mma_bf16_16816(o[mt][d + 1], pa[mt], b[2], b[3]);
          }
        }
        if constexpr ((HD / 8) % 2 == 1) {  // head_dim 72: nine n-tiles
          uint32_t b[2];
          ldmatrix_x2_trans(b, vrow + (HD / 8 - 1) * 8);
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) mma_bf16_16816(o[mt][HD / 8 - 1], pa[mt], b[0], b[1]);
        }
      }
    }
    __syncthreads();
  }

  uint16_t* out_head = p.out + static_cast<int64_t>(head) * HD;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int64_t row_a = warp_row0 + mt * 16 + g, row_b = row_a + 8;
    const float inv_a = l_run[mt][0] > 0.f ? 1.f / l_run[mt][0] : 0.f;
    const float inv_b = l_run[mt][1] > 0.f ? 1.f / l_run[mt][1] : 0.f;
#pragma unroll
    for (int d = 0; d < HD / 8; ++d) {
      const int c = d * 8 + 2 * t4;
      if (row_a < q_end)
        *reinterpret_cast<uint32_t*>(out_head + row_a * p.out_stride + c) =
            pack_bf16x2(o[mt][d][0] * inv_a, o[mt][d][1] * inv_a);
      if (row_b < q_end)
        *reinterpret_cast<uint32_t*>(out_head + row_b * p.out_stride + c) =
            pack_bf16x2(o[mt][d][2] * inv_b, o[mt][d][3] * inv_b);
    }
  }
}

// Key tile of the wide kernel, from H100 timings; larger tiles mean fewer barriers, rescales and
// softmax rounds per key, at the price of spills where the score tile outgrows the registers
// (ptxas, sm_90):
// - 64 keys by default. At head_dim 128 this spills ~140 bytes and still ran 10% faster than 32
//   keys (causal, 4096 tokens).
// - Vision at head_dim 64: 128 keys (~90 bytes of spills). One 7056-patch image's attention
//   851 -> 705-715 us, 3136 patches 193 -> 180-183, 8 x 784 112 -> 110.
// - Vision at head_dim 72: 64 keys. 7056 patches 1235 -> 937 us (against 32 keys), 3136
//   282 -> 225, 8 x 784 154 -> 126-129; 128 keys were slower again.
// - 32 keys for causal head_dim 72 and for head_dim 80 (unmeasured with more), where 64-key tiles
//   spill tens of bytes.
template <int HD, bool kCausal>
constexpr int wide_bc() {
  if (!kCausal && HD == 64) return 128;
  if (HD == 80 || (kCausal && HD == 72)) return 32;
  return 64;
}

template <int HD, bool kCausal>
void launch_wide(const FlashParams& p, dim3 grid, cudaStream_t s) {
  constexpr int BC = wide_bc<HD, kCausal>();
  launch_programmatic(flash_wide_kernel<HD, BC, kCausal>, grid, dim3(kWideThreads),
                      WideShape<HD, BC>::kSmemBytes, s, p);
  IRIS_CUDA_LAUNCH_CHECK();
}

template <bool kCausal>
void dispatch_wide(int head_dim, const FlashParams& p, dim3 grid, cudaStream_t s) {
  FlashHeadDims::with(head_dim,
                      [&](auto hd) { launch_wide<decltype(hd)::value, kCausal>(p, grid, s); });
}

template <int HD, bool kCausal>
void set_wide_smem() {
  constexpr int BC = wide_bc<HD, kCausal>();
  IRIS_CUDA_CHECK(cudaFuncSetAttribute(flash_wide_kernel<HD, BC, kCausal>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(WideShape<HD, BC>::kSmemBytes)));
}

// ----------------------------------------------------------------------------------------------
// Hopper flash attention (wgmma): head_dim 64/72 vision segments, head_dim 128 causal prefill
// ----------------------------------------------------------------------------------------------

// One warpgroup per block runs 64 query rows against 64-key tiles with warpgroup MMAs: S = Q K^T
// with Q and K from shared memory, O += P V with P from registers. The scores of tile j are
// issued together with the PV product of tile j - 1, and the softmax of tile j runs while that
// product is on the tensor cores (FlashAttention-3's intra-warpgroup overlap). Tiles are 128-byte
// rows in the 128-byte swizzle that wgmma reads, filled by cp.async; three stages, because tile
// j's K and tile j - 1's V are read together. On an H100 (16 heads): one 3136-patch image
// 182 -> 128 us against the wide mma.sync kernel, 7056 patches 717 -> 622, 8 x 784 110 -> 96, a
// 1000-patch image padded to a 1024-row bucket 33 -> 17 (with 128-key tiles and two blocks per
// SM at head_dim 64, before TMA). Head_dim 128 (the causal decoder prefill) has two 64-column
// sub-tiles per row; head_dim 72 (Qwen3-VL-4B/8B vision) one sub-tile plus a 16-column tail.
// Needs code compiled for sm_90a (CMakeLists.txt turns 90 into 90a).

constexpr int kWgBr = 64;  // query rows per block: one warpgroup
constexpr int kWgThreads = 128;
constexpr int kWgStages = 3;

// Head dims 64 and 72 (vision) and 128 (the decoder). A row of Q, K or V is HD / 64 swizzled
// sub-tiles of 64 columns (128 bytes), then for head_dim 72 a tail of 16 columns (72..79 zero) in
// unswizzled core matrices: row r, chunk c at (r / 8) * 256 + c * 128 + (r % 8) * 16.
// Head_dim 64 fits three blocks in an SM's shared memory, 128 two; a third block hides more of
// each block's latency between its dependent steps than wider tiles do. 8 x 784 patches at
// head_dim 64 took 87 us with 128-key tiles and two blocks per SM, 76 with 64-key tiles and three
// (H100, `iris bench --only attention`); 3136 patches 106 -> 101, 7056 498 -> 496. Head_dim 72
// (cp.async tiles) timed the same at three blocks as at two, 8 x 784 in 124-129 us either way
// (the 8B config), and stays at two.
template <int HD>
struct WgShape {
  static constexpr int kSub = HD / 64;
  static constexpr bool kTail = HD % 64 != 0;
  static_assert(HD % 64 == 0 || HD % 64 == 8,
                "64-column sub-tiles plus at most one 16-column tail");
  static constexpr int kBc = 64;
  static constexpr int kBlocksPerSm = HD == 64 ? 3 : 2;
  static constexpr int kRowBytes = kSub * 128 + (kTail ? 32 : 0);
  static constexpr int kLoadChunks = kRowBytes / 16;  // including the tail's zero chunk
  static constexpr int kQBytes = kWgBr * kRowBytes;
  static constexpr int kTileBytes = kBc * kRowBytes;
  static constexpr size_t kPipeBytes = kQBytes + 2 /*K,V*/ * kWgStages * kTileBytes;
  // The TMA variant's mbarriers live in the alignment slack (flash_wgmma_kernel): at head_dim
  // 128 another 48 bytes would leave room for one block per SM instead of two.
  static constexpr size_t kSmemBytes = 1024 /*alignment slack*/ + kPipeBytes;
  // Byte offset of 16-byte chunk c (0 .. kLoadChunks - 1) of row r in a tile of `rows` rows.
  __device__ static int chunk_offset(int rows, int r, int c) {
    if (c < kSub * 8) return (c / 8) * rows * 128 + sw128_offset(r, c % 8);
    return kSub * rows * 128 + (r / 8) * 256 + (c - kSub * 8) * 128 + (r % 8) * 16;
  }
};

// Inference: vision segments and the causal prefill against the KV cache (past_len). Training
// (Backend::attention_train): segments, non-causal or causal within each segment, with the
// log-sum-exp written beside the output for the backward.
enum class WgMode { segments, cache_causal, train_segments, train_causal };

// Training modes: the block's query rows and keys by segment_tiles.cuh's numbering (a causal
// segment's last tile, which has the most keys, first). A block of a padding segment (one that
// starts at or past *real_rows) or past the last segment writes zero output and lse to its rows
// instead; false when the block has nothing to attend.
template <int HD, bool kCausal>
__device__ __forceinline__ bool train_range(const FlashParams& p, int head, int64_t& q0,
                                            int64_t& q_end, int64_t& kv_begin, int64_t& kv_end) {
  const SegmentTile t = find_segment_tile(p.cu_seqlens, p.n_segments, kWgBr, blockIdx.y);
  bool zero;
  if (t.segment < p.n_segments) {
    const int64_t seg_b = p.cu_seqlens[t.segment], seg_e = p.cu_seqlens[t.segment + 1];
    const int64_t n_tiles = (seg_e - seg_b + kWgBr - 1) / kWgBr;
    if (t.tile >= n_tiles) return false;
    q0 = seg_b + (kCausal ? n_tiles - 1 - t.tile : t.tile) * kWgBr;
    q_end = seg_e;
    kv_begin = seg_b;
    kv_end = kCausal ? min(q0 + kWgBr, seg_e) : seg_e;
    zero = p.real_rows != nullptr && seg_b >= *p.real_rows;
  } else {
    q0 = p.cu_seqlens[p.n_segments] + t.tile * kWgBr;
    q_end = p.total_rows;
    if (q0 >= q_end) return false;
    zero = true;
  }
  if (!zero) return true;
  const int64_t q_stop = min(q0 + kWgBr, q_end);
  uint16_t* out_head = p.out + static_cast<int64_t>(head) * HD;
  for (int64_t i = threadIdx.x; i < (q_stop - q0) * HD; i += kWgThreads)
    out_head[(q0 + i / HD) * p.out_stride + i % HD] = 0;
  for (int64_t r = q0 + threadIdx.x; r < q_stop; r += kWgThreads)
    p.lse[r * p.lse_stride + head] = 0.f;
  return false;
}

// kTma (head_dim 64 segments, head_dim 128 causal): K and V tiles arrive by TMA (k_map, v_map:
// boxes of 64 columns x 64 keys of the K and V columns, in the 128-byte swizzle), each stage on
// its own mbarrier, so that two tiles are in flight while one is multiplied; with cp.async a wait
// covers every copy in flight, which kept only one tile ahead. Keys past the block's end are then
// the next segment's (or zeros past the tensor): their scores are masked to -inf and their V rows
// zeroed in shared memory, so the result is the same bits as with zero-filled copies. On an H100
// (16 heads, `iris bench --only attention`): 3136 patches 132 -> 108 us, 7056 639 -> 516, 8 x 784
// 97 -> 87. The causal head_dim-128 prefill loads K and V (two 64-column boxes per tile) from
// the KV cache the same way: there the keys past the limit are cache rows that may hold anything,
// which the masked scores and zeroed V rows keep out as well.
template <int HD, WgMode M, bool kTma>
__global__ void __launch_bounds__(kWgThreads, WgShape<HD>::kBlocksPerSm)
    flash_wgmma_kernel(const __grid_constant__ CUtensorMap k_map,
                       const __grid_constant__ CUtensorMap v_map, FlashParams p) {
  constexpr bool kCausal = M == WgMode::cache_causal || M == WgMode::train_causal;
  constexpr bool kTrain = M == WgMode::train_segments || M == WgMode::train_causal;
  static_assert(!kTma || (HD == 64 && !kCausal) || (HD == 128 && kCausal),
                "TMA tiles: head_dim 64 segments and the head_dim 128 causal prefill");
  using S = WgShape<HD>;
  constexpr int BC = S::kBc, kSub = S::kSub, kChunks = S::kLoadChunks, kRealChunks = HD / 8;
  extern __shared__ __align__(16) unsigned char wg_smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(wg_smem_raw) + 1023) & ~uintptr_t{1023});
  // Each tile is its kSub sub-tiles [rows][64 columns] and tail, one after the other.
  unsigned char* q_tile = smem;
  unsigned char* k_tiles = smem + S::kQBytes;                    // [3 stages]
  unsigned char* v_tiles = k_tiles + kWgStages * S::kTileBytes;  // [3 stages]
  // kTma: a barrier per K and per V stage, in the slack before the aligned tiles where it has
  // room for them (it is 16-byte aligned at least), else in the slack after them.
  constexpr int kBarrierBytes = 2 * kWgStages * sizeof(uint64_t);
  uint64_t* k_full = reinterpret_cast<uint64_t*>(
      smem - wg_smem_raw >= kBarrierBytes ? smem - kBarrierBytes : smem + S::kPipeBytes);
  uint64_t* v_full = k_full + kWgStages;
  pdl_launch_dependents();
  pdl_wait();
  const int head = blockIdx.x;
  const int kv_head = head / p.kv_group;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t4 = lane % 4;
  int64_t q0, q_end, kv_begin, kv_end;
  int past = 0;
  if constexpr (kTrain) {
    if (!train_range<HD, kCausal>(p, head, q0, q_end, kv_begin, kv_end)) return;
  } else {
    if (!attended_range<HD, M == WgMode::cache_causal, kWgBr>(p, head, kWgThreads, q0, q_end,
                                                              kv_begin, kv_end, past))
      return;
  }
  const int n_tiles = static_cast<int>((kv_end - kv_begin + BC - 1) / BC);

  {
    const uint16_t* q_head = p.q + static_cast<int64_t>(head) * HD;
    for (int i = tid; i < kWgBr * kChunks; i += kWgThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const int64_t row = q0 + r;
      const bool valid = row < q_end && c < kRealChunks;
      cp_async16(q_tile + S::chunk_offset(kWgBr, r, c),
                 q_head + (valid ? row : q0) * p.q_stride + c * 8, valid ? 16 : 0);
    }
  }
  const uint16_t* k_base = p.k + static_cast<int64_t>(kv_head) * HD;
  const uint16_t* v_base = p.v + static_cast<int64_t>(kv_head) * HD;
  // K of tile tile_k and V of tile tile_v (each if >= 0) into their stages, as one commit group;
  // keys past the block's end are zero-filled.
  auto load_tiles = [&](int tile_k, int tile_v) {
    for (int i = tid; i < BC * kChunks; i += kWgThreads) {
      const int r = i / kChunks, c = i % kChunks;
      if (tile_k >= 0) {
        const int64_t key = kv_begin + static_cast<int64_t>(tile_k) * BC + r;
        const bool valid = key < kv_end && c < kRealChunks;
        cp_async16(k_tiles + (tile_k % kWgStages) * S::kTileBytes + S::chunk_offset(BC, r, c),
                   k_base + (valid ? key : kv_begin) * p.kv_stride + c * 8, valid ? 16 : 0);
      }
      if (tile_v >= 0) {
        const int64_t key = kv_begin + static_cast<int64_t>(tile_v) * BC + r;
        const bool valid = key < kv_end && c < kRealChunks;
        cp_async16(v_tiles + (tile_v % kWgStages) * S::kTileBytes + S::chunk_offset(BC, r, c),
                   v_base + (valid ? key : kv_begin) * p.kv_stride + c * 8, valid ? 16 : 0);
      }
    }
    cp_async_commit();
  };
  // kTma: tile t's K (or V) lands in stage t % 3 and completes phase (t / 3) % 2 of its barrier.
  // A tile is its kSub boxes of 64 columns, one per sub-tile.
  auto load_tma = [&](unsigned char* tiles, const CUtensorMap& map, uint64_t* full, int t) {
    mbarrier_arrive_expect_tx(&full[t % kWgStages], S::kTileBytes);
#pragma unroll
    for (int h = 0; h < kSub; ++h)
      tma_load_2d(tiles + (t % kWgStages) * S::kTileBytes + h * BC * 128, &map,
                  &full[t % kWgStages], kv_head * HD + h * 64, static_cast<int>(kv_begin) + t * BC);
  };
  auto load_k_tma = [&](int t) { load_tma(k_tiles, k_map, k_full, t); };
  auto load_v_tma = [&](int t) { load_tma(v_tiles, v_map, v_full, t); };
  if constexpr (kTma) {
    cp_async_commit();  // Q
    if (tid == 0) {
      for (int st = 0; st < kWgStages; ++st) {
        mbarrier_init(&k_full[st], 1);
        mbarrier_init(&v_full[st], 1);
      }
      mbarrier_init_fence();
      load_k_tma(0);
      if (n_tiles > 1) load_k_tma(1);
      load_v_tma(0);
    }
    __syncthreads();  // no thread polls a barrier before it is initialised
  } else {
    load_tiles(0, -1);  // commits Q too
  }

  float o[kSub][32];
  float o_tail[4] = {0.f, 0.f, 0.f, 0.f};  // head_dim 72: columns 64..71
#pragma unroll
  for (int h = 0; h < kSub; ++h)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[h][i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float s[BC / 2];
  // S = Q K^T of tile it into s, and O += P V of tile it: issued, not waited for. A k-step of 16
  // columns is 32 bytes along a swizzled row of Q and K (descriptor +2) within sub-tile kk / 4,
  // and 16 rows of V (+2048 bytes); each 64-column half of O takes its own V sub-tile.
  auto issue_scores = [&](int it) {
    const unsigned char* ks = k_tiles + (it % kWgStages) * S::kTileBytes;
#pragma unroll
    for (int kk = 0; kk < kSub * 4; ++kk)
      wgmma_m64n64k16_ss(s, sw128_desc(q_tile + (kk / 4) * kWgBr * 128) + 2 * (kk % 4),
                         sw128_desc(ks + (kk / 4) * BC * 128) + 2 * (kk % 4), kk > 0);
    if constexpr (S::kTail)
      wgmma_m64n64k16_ss(s, interleave_desc(q_tile + kSub * kWgBr * 128, 128, 256),
                         interleave_desc(ks + kSub * BC * 128, 128, 256), 1);
    wgmma_commit();
  };
  auto issue_pv = [&](int it, const uint32_t(&pa)[BC / 16][4]) {
    const unsigned char* vs = v_tiles + (it % kWgStages) * S::kTileBytes;
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
#pragma unroll
      for (int h = 0; h < kSub; ++h)
        wgmma_m64n64k16_rs_tb(o[h], pa[kk], sw128_desc(vs + h * BC * 128) + kk * (2048 >> 4));
      // The tail's 16 keys of this k-step are two core matrices 256 bytes apart.
      if constexpr (S::kTail)
        wgmma_m64n8k16_rs_tb(o_tail, pa[kk],
                             interleave_desc(vs + kSub * BC * 128 + kk * 512, 256, 256));
    }
    wgmma_commit();
  };
  // This thread's rows within the block's queries; query i sits at absolute position past + i.
  const int64_t row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  // Online softmax of tile it's scores in s (raw, unscaled): running max and sum, the rescale
  // factor of the output so far (alpha), and the probabilities as bf16 A fragments in pn.
  float alpha[2];
  const float c = p.scale_log2;
  auto softmax = [&](int it, uint32_t(&pn)[BC / 16][4]) {
    const int64_t key0 = kv_begin + static_cast<int64_t>(it) * BC;
    bool need_mask = key0 + BC > kv_end;
    if constexpr (kCausal) need_mask = need_mask || key0 + (BC - 1) > past + q0;
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < BC / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = key0 + j * 8 + 2 * t4 + (e & 1);
          bool ok = key < kv_end;
          if constexpr (kCausal) ok = ok && key <= past + (e < 2 ? row_a : row_b);
          if (!ok) s[4 * j + e] = -INFINITY;
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < BC / 8; ++j)
        mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_run[r], mx);
      const float m_scaled = m_new == -INFINITY ? 0.f : m_new * c;
      alpha[r] = exp2_ftz(m_run[r] * c - m_scaled);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < BC / 8; ++j) {
        s[4 * j + 2 * r] = exp2_ftz(fmaf(s[4 * j + 2 * r], c, -m_scaled));
        s[4 * j + 2 * r + 1] = exp2_ftz(fmaf(s[4 * j + 2 * r + 1], c, -m_scaled));
        sum += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l_run[r] = l_run[r] * alpha[r] + sum;
      m_run[r] = m_new;
    }
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      pn[kk][0] = pack_bf16x2(s[8 * kk + 0], s[8 * kk + 1]);
      pn[kk][1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
      pn[kk][2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
      pn[kk][3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  // Waits for tile it and starts loading tile it + 1 into stage (it + 1) % 3, which last held
  // tile it - 2: its scores completed in iteration it - 2 and its PV product in it - 1. cp.async
  // writes are generic-proxy stores, so they are fenced before wgmma reads them.
  // kTma: waits for K of tile it and V of tile it - 1 (the PV product issued with it); then
  // stage (it - 1) % 3 of K (its scores completed in iteration it - 1) takes tile it + 2, and
  // stage (it - 2) % 3 of V (its product completed in iteration it - 1) takes tile it + 1.
  auto next_tile_ready = [&](int it) {
    if constexpr (kTma) {
      if (it == 0) {
        cp_async_wait<0>();  // Q
        fence_async_shared();
      }
      if (it < n_tiles) mbarrier_wait(&k_full[it % kWgStages], (it / kWgStages) & 1);
      if (it > 0) {
        const int t = it - 1;
        mbarrier_wait(&v_full[t % kWgStages], (t / kWgStages) & 1);
        // Keys past the segment in its last tile are weighted by 0, but 0 * inf is NaN: their
        // V rows are zeroed (whole 128-byte rows, whatever the swizzle), so that a non-finite
        // value in another image's rows cannot reach this one.
        const int valid = static_cast<int>(kv_end - (kv_begin + static_cast<int64_t>(t) * BC));
        if (valid < BC) {
          uint4* vs = reinterpret_cast<uint4*>(v_tiles + (t % kWgStages) * S::kTileBytes);
          const int per_sub = (BC - valid) * 8;  // 16-byte chunks past the end, per sub-tile
          for (int i = tid; i < kSub * per_sub; i += kWgThreads)
            vs[(i / per_sub) * BC * 8 + valid * 8 + i % per_sub] = make_uint4(0, 0, 0, 0);
          fence_async_shared();  // generic stores, read by wgmma through the async proxy
        }
      }
      __syncthreads();
      if (tid == 0) {
        if (it + 2 < n_tiles) load_k_tma(it + 2);
        if (it + 1 < n_tiles) load_v_tma(it + 1);
      }
    } else {
      cp_async_wait<0>();
      fence_async_shared();
      __syncthreads();
      if (it == 0) load_tiles(-1, 0);
      if (it + 1 < n_tiles) load_tiles(it + 1, it + 1);
    }
  };
  // Tile it: its scores run on the tensor cores together with the previous tile's PV product
  // (probabilities p_prev), and its softmax overlaps that product. The probabilities alternate
  // between two register sets so that the ones in flight are never rewritten.
  auto step = [&](int it, const uint32_t(&p_prev)[BC / 16][4], uint32_t(&p_next)[BC / 16][4]) {
    next_tile_ready(it);
    wgmma_fence();
    issue_scores(it);
    issue_pv(it - 1, p_prev);
    wgmma_wait<1>();
    softmax(it, p_next);
    wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < kSub; ++h)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        o[h][4 * j] *= alpha[0];
        o[h][4 * j + 1] *= alpha[0];
        o[h][4 * j + 2] *= alpha[1];
        o[h][4 * j + 3] *= alpha[1];
      }
    o_tail[0] *= alpha[0], o_tail[1] *= alpha[0], o_tail[2] *= alpha[1], o_tail[3] *= alpha[1];
  };
  uint32_t p_even[BC / 16][4], p_odd[BC / 16][4];
  next_tile_ready(0);
  wgmma_fence();
  issue_scores(0);
  wgmma_wait<0>();
  softmax(0, p_even);
  int it = 1;
  for (; it + 1 < n_tiles; it += 2) {
    step(it, p_even, p_odd);
    step(it + 1, p_odd, p_even);
  }
  if (it < n_tiles) {
    step(it, p_even, p_odd);
    next_tile_ready(n_tiles);
    wgmma_fence();
    issue_pv(it, p_odd);
  } else {
    next_tile_ready(n_tiles);
    wgmma_fence();
    issue_pv(it - 1, p_even);
  }
  wgmma_wait<0>();
  const float inv_a = l_run[0] > 0.f ? 1.f / l_run[0] : 0.f;
  const float inv_b = l_run[1] > 0.f ? 1.f / l_run[1] : 0.f;
  uint16_t* out_head = p.out + static_cast<int64_t>(head) * HD;
#pragma unroll
  for (int h = 0; h < kSub; ++h)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int col = h * 64 + j * 8 + 2 * t4;
      if (row_a < q_end)
        *reinterpret_cast<uint32_t*>(out_head + row_a * p.out_stride + col) =
            pack_bf16x2(o[h][4 * j] * inv_a, o[h][4 * j + 1] * inv_a);
      if (row_b < q_end)
        *reinterpret_cast<uint32_t*>(out_head + row_b * p.out_stride + col) =
            pack_bf16x2(o[h][4 * j + 2] * inv_b, o[h][4 * j + 3] * inv_b);
    }
  if constexpr (S::kTail) {
    const int col = kSub * 64 + 2 * t4;
    if (row_a < q_end)
      *reinterpret_cast<uint32_t*>(out_head + row_a * p.out_stride + col) =
          pack_bf16x2(o_tail[0] * inv_a, o_tail[1] * inv_a);
    if (row_b < q_end)
      *reinterpret_cast<uint32_t*>(out_head + row_b * p.out_stride + col) =
          pack_bf16x2(o_tail[2] * inv_b, o_tail[3] * inv_b);
  }
  if constexpr (kTrain) {
    // Natural-log log-sum-exp of the scaled scores; m_run is the raw (unscaled) maximum.
    if (t4 == 0) {
      if (row_a < q_end)
        p.lse[row_a * p.lse_stride + head] =
            l_run[0] > 0.f ? (m_run[0] * c + __log2f(l_run[0])) * kLn2 : 0.f;
      if (row_b < q_end)
        p.lse[row_b * p.lse_stride + head] =
            l_run[1] > 0.f ? (m_run[1] * c + __log2f(l_run[1])) * kLn2 : 0.f;
    }
  }
}

// Set once by attention_init (sm_90a builds on a compute capability 9.0 device).
PFN_cuTensorMapEncodeTiled_v12000 g_encode_tiled = nullptr;

// Columns [0, cols) of `rows` rows `stride` elements apart, read in boxes of 64 columns (128
// bytes) x box_rows rows in the 128-byte swizzle; rows past the end read as zeros.
CUtensorMap tile_map(const uint16_t* base, int64_t rows, int64_t cols, int64_t stride,
                     int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * sizeof(uint16_t)};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = g_encode_tiled(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  IRIS_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (CUresult ", static_cast<int>(r),
             ") for a ", rows, " x ", cols, " bf16 matrix with row stride ", stride);
  return map;
}

// Whether K and V can be read by TMA: an encoder, and 16-byte aligned bases and rows (the
// tensor-map rules).
bool tma_tiles_possible(const FlashParams& p) {
  return g_encode_tiled != nullptr && aligned16(p.k) && aligned16(p.v) && p.kv_stride % 8 == 0;
}

template <int HD, WgMode M, bool kTma = false>
void launch_wgmma(const FlashParams& p, dim3 grid, cudaStream_t s, int64_t kv_rows = 0,
                  int kv_cols = 0) {
  CUtensorMap k_map{}, v_map{};
  if constexpr (kTma) {
    k_map = tile_map(p.k, kv_rows, kv_cols, p.kv_stride, WgShape<HD>::kBc);
    v_map = tile_map(p.v, kv_rows, kv_cols, p.kv_stride, WgShape<HD>::kBc);
  }
  launch_programmatic(flash_wgmma_kernel<HD, M, kTma>, grid, dim3(kWgThreads),
                      WgShape<HD>::kSmemBytes, s, k_map, v_map, p);
  IRIS_CUDA_LAUNCH_CHECK();
}

template <int HD, WgMode M, bool kTma = false>
void set_wgmma_smem() {
  IRIS_CUDA_CHECK(cudaFuncSetAttribute(flash_wgmma_kernel<HD, M, kTma>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(WgShape<HD>::kSmemBytes)));
}

// Causal prefill: the wide kernel wins once its 128-row tiles fill every SM about twice; below
// that the grouped kernel's 64-row blocks (twice as many) keep more SMs busy.
bool use_wide(int64_t wide_blocks, int64_t rows_per_segment, float scale, int num_sms) {
  return scale > 0.f && wide_blocks >= 2 * static_cast<int64_t>(num_sms) && rows_per_segment >= 256;
}

enum class SegmentKernel { group_rows128, group_rows32, wide, rows64, wgmma };

// Set once by attention_init: this build has sm_90a code and the device is compute capability 9.0.
bool g_wgmma_attention = false;

// Vision segments, from timings on an H100 (head_dim 64 and 72, 16 heads). Calls whose 128-row
// tiles do not reach one per SM take the grouped kernel: 128 rows x 2 key groups above 512 rows
// (one 784- or 1024-patch image, or one padded to a 1024-row graph bucket: 26-29 us against
// 29-38 for the wide and 64-row kernels), 32 rows x 4 key groups up to 512 (a 256-patch image:
// 7.0 us against 9.3-10.4). The choice looks at the rows, not at rows per segment: a captured
// graph's call passes the segment capacity (mostly empty segments), and it must choose as the
// eager call on the same input does. Larger calls take the wide kernel where segments average
// 256 rows or more (2 x 784 patches: 30 against 40 us, 1600: 53 against 74); shorter segments
// would leave its 128-row tiles half empty. On sm_90a builds head_dim 64 takes the wgmma kernel
// for every call: 16 heads, 256 rows 6.7 us (as the 32-row grouped kernel), a 256-row graph call
// 7.2 (7.8), 512 rows 9.9 (17.4-18.4 for the others), 784 15.4 (25.3), 8 x 256 14.0 (13.9 wide);
// head_dim 72 for segments of 2048 rows and more.
SegmentKernel pick_segment_kernel(int64_t rows, int n_segments, int n_heads, int head_dim,
                                  float scale, int num_sms) {
  // The softmax of the wgmma kernel takes the row maximum of unscaled scores: scale > 0.
  if (g_wgmma_attention && scale > 0.f) {
    if (head_dim == 64) return SegmentKernel::wgmma;
    // At head_dim 72 its 64-key tiles win on large images only: 3136 patches 225 -> 187 us,
    // 7056 913 -> 928 (even); 8 x 256 16 -> 23, 4 x 1024 86 -> 95, 784 29 -> 29.
    if (head_dim == 72 && rows / n_segments >= 2048) return SegmentKernel::wgmma;
  }
  const int64_t blocks_128 = (rows + kWideBr - 1) / kWideBr * n_heads;
  if (VisionHeadDims::contains(head_dim) && blocks_128 <= num_sms)
    return rows > 512 ? SegmentKernel::group_rows128 : SegmentKernel::group_rows32;
  if (scale > 0.f && rows / n_segments >= 256) return SegmentKernel::wide;
  return SegmentKernel::rows64;
}

// ----------------------------------------------------------------------------------------------
// Split-K decoding (one new token)
// ----------------------------------------------------------------------------------------------

constexpr int kDecodeThreads = 256;
constexpr int kDecodeWarps = kDecodeThreads / kWarpSize;
constexpr int kDecodeLoads = 4;      // K rows and V rows in flight per lane
constexpr int kDecodeMinChunk = 64;  // fewest keys worth a split of their own
constexpr int kDecodeMaxSplits = 128;

struct DecodeParams {
  const uint16_t* q;  // qkv row 0
  const uint16_t* k_cache;
  const uint16_t* v_cache;
  const int32_t* past_len;
  uint16_t* out;
  float* part_out;    // [n_q][n_splits][HD]
  float* part_max;    // [n_q][n_splits]
  float* part_sum;    // [n_q][n_splits]
  unsigned* tickets;  // [n_kv]: splits of the kv head done so far; zero between launches
  int64_t kv_stride;
  int64_t max_len;
  int n_q_heads, group, n_splits;
  float scale_log2;
};

// How many splits the current length uses and how long each is.
__device__ __forceinline__ void decode_split(int length, int n_splits, int& used, int& chunk) {
  used = min(n_splits, max(1, (length + kDecodeMinChunk - 1) / kDecodeMinChunk));
  chunk = (length + used - 1) / used;
}

// One block per (split, kv head) scores its key range for all `group` query heads of that kv
// head, so each K/V row is read from memory once per step; the last block of a kv head to finish
// merges the splits (an atomic ticket), so a step is one kernel with one dependency wait. Within
// a block every warp runs its own online softmax over interleaved key slices with no barrier:
// a row is HD/8 lanes of 16 bytes, a warp load covers 256/HD rows, and each lane keeps
// kDecodeLoads K and V rows in flight. The warps' states meet once, in shared memory. On an
// H100 (Qwen3-VL-2B's 16/8 heads of 128, 1k context) this takes 7.8 us per layer where a
// partial kernel plus a combine kernel took 10.9; with the merge as a plain loop over splits
// it was 14 (each read waited for the one before).
template <int HD, int MAXG>
__global__ void __launch_bounds__(kDecodeThreads) decode_attention_kernel(DecodeParams p) {
  constexpr int kLanesPerRow = HD / 8;
  constexpr int kRowsPerLoad = kWarpSize / kLanesPerRow;
  constexpr int kWarpKeys = kRowsPerLoad * kDecodeLoads;  // keys per warp pass
  static_assert(kLanesPerRow <= kWarpSize && kWarpSize % kLanesPerRow == 0, "rows tile a warp");
  // The split merge reads float4 columns of the partial rows, kMergeRows rows at a time.
  constexpr int kCol4 = HD / 4;
  constexpr int kMergeRows = kDecodeThreads / kCol4;
  static_assert(kDecodeThreads % kCol4 == 0, "merge columns tile the block");
  // Per warp and head (HD floats) after the key loop; per merge row and head later.
  constexpr int kBufPerHead =
      (kDecodeWarps * HD > kMergeRows * HD) ? kDecodeWarps * HD : kMergeRows * HD;
  __shared__ __align__(16) float s_buf[MAXG * kBufPerHead];
  __shared__ float s_ml[kDecodeWarps][MAXG][2];
  __shared__ float s_w[MAXG][kDecodeMaxSplits], s_l[MAXG][kDecodeMaxSplits];
  __shared__ float s_den[MAXG];
  __shared__ bool s_last;

  const int split = blockIdx.x, kv_head = blockIdx.y;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int row = lane / kLanesPerRow, c = (lane % kLanesPerRow) * 8;
  // The output projection may launch now.
  pdl_launch_dependents();
  // Read before pdl_wait(): past_len and the cache rows below it (Backend::attention_causal's
  // contract: a decode step uploads past_len by a copy that precedes all of its kernels, and
  // earlier steps stored those rows; the chain of early starts reaches back only to the qkv
  // GEMV, which lets its successor start after its own wait). Only the query and the new row
  // `past`, which RoPE and kv_store have just written, wait. On an H100 (2B shapes, 1k context)
  // graphs decode went from 565-568 to 572-578 tokens/s.
  const int past = *p.past_len;
  const int group = p.group;
  const int length = static_cast<int>(min(static_cast<int64_t>(past) + 1, p.max_len));
  int used, chunk;
  decode_split(length, p.n_splits, used, chunk);
  if (split >= used) return;  // uniform over the block, before its first barrier
  const int begin = split * chunk, end = min(length, begin + chunk);
  const int64_t qh0 = static_cast<int64_t>(kv_head) * group;  // first query head
  const uint16_t* k_base = p.k_cache + static_cast<int64_t>(kv_head) * HD + c;
  const uint16_t* v_base = p.v_cache + static_cast<int64_t>(kv_head) * HD + c;

  // Row u of a pass starting at key k0 sits in kv[u] and vv[u]; keys past `limit` load zeros.
  uint4 kv[kDecodeLoads], vv[kDecodeLoads];
  auto load_row = [&](int u, int key, int limit) {
    const int64_t off = static_cast<int64_t>(key) * p.kv_stride;
    const bool valid = key < limit;
    kv[u] = valid ? *reinterpret_cast<const uint4*>(k_base + off) : make_uint4(0, 0, 0, 0);
    vv[u] = valid ? *reinterpret_cast<const uint4*>(v_base + off) : make_uint4(0, 0, 0, 0);
  };
  auto load_pass = [&](int k0, int limit) {
#pragma unroll
    for (int u = 0; u < kDecodeLoads; ++u) load_row(u, k0 + u * kRowsPerLoad + row, limit);
  };
  int k0 = begin + warp * kWarpKeys;
  load_pass(k0, min(end, past));
  pdl_wait();
#pragma unroll
  for (int u = 0; u < kDecodeLoads; ++u)
    if (k0 + u * kRowsPerLoad + row == past) load_row(u, past, end);

  float qf[MAXG][8];
#pragma unroll
  for (int j = 0; j < MAXG; ++j) {
    if (j >= group) break;
    load8(p.q + (qh0 + j) * HD + c, qf[j]);
#pragma unroll
    for (int e = 0; e < 8; ++e) qf[j][e] *= p.scale_log2;
  }
  // m is uniform over the warp; l and acc are this lane's share (its rows' keys, its 8 columns)
  // until the rows are summed after the loop.
  float m[MAXG], l[MAXG], acc[MAXG][8];
#pragma unroll
  for (int j = 0; j < MAXG; ++j) {
    m[j] = -INFINITY, l[j] = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[j][e] = 0.f;
  }
  for (; k0 < end; k0 += kDecodeWarps * kWarpKeys) {
    // This pass's rows are in kv and vv: the first pass's from before the wait, later ones from
    // the end of the pass before.
    float s[kDecodeLoads][MAXG];
#pragma unroll
    for (int u = 0; u < kDecodeLoads; ++u) {
      float kf[8];
      unpack8(kv[u], kf);
      const bool valid = k0 + u * kRowsPerLoad + row < end;
#pragma unroll
      for (int j = 0; j < MAXG; ++j) {
        if (j >= group) break;
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d = fmaf(kf[e], qf[j][e], d);
#pragma unroll
        for (int o = kLanesPerRow / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        s[u][j] = valid ? d : -INFINITY;
      }
    }
#pragma unroll
    for (int j = 0; j < MAXG; ++j) {
      if (j >= group) break;
      float mx = s[0][j];
#pragma unroll
      for (int u = 1; u < kDecodeLoads; ++u) mx = fmaxf(mx, s[u][j]);
#pragma unroll
      for (int o = kLanesPerRow; o < kWarpSize; o <<= 1)
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      // Finite: key k0 (row 0 of load 0) is in range.
      const float m_new = fmaxf(m[j], mx);
      const float alpha = exp2_ftz(m[j] - m_new);
      l[j] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[j][e] *= alpha;
#pragma unroll
      for (int u = 0; u < kDecodeLoads; ++u) {
        const float pu = exp2_ftz(s[u][j] - m_new);
        float vf[8];
        unpack8(vv[u], vf);
        l[j] += pu;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[j][e] = fmaf(pu, vf[e], acc[j][e]);
      }
      m[j] = m_new;
    }
    if (k0 + kDecodeWarps * kWarpKeys < end) load_pass(k0 + kDecodeWarps * kWarpKeys, end);
  }

  // Sum the rows of the warp (lanes that share c); every lane of a row holds the same l.
#pragma unroll
  for (int j = 0; j < MAXG; ++j) {
    if (j >= group) break;
#pragma unroll
    for (int o = kLanesPerRow; o < kWarpSize; o <<= 1) {
      l[j] += __shfl_xor_sync(0xffffffffu, l[j], o);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[j][e] += __shfl_xor_sync(0xffffffffu, acc[j][e], o);
    }
    if (row == 0) {
#pragma unroll
      for (int e = 0; e < 8; ++e) s_buf[(j * kDecodeWarps + warp) * HD + c + e] = acc[j][e];
      if (c == 0) s_ml[warp][j][0] = m[j], s_ml[warp][j][1] = l[j];
    }
  }
  __syncthreads();

  // The block's split: warps merged (a warp that got no keys has m = -inf and weighs nothing).
  // With a single split in use this is the answer.
  for (int i = tid; i < group * HD; i += kDecodeThreads) {
    const int j = i / HD, d = i % HD;
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) mb = fmaxf(mb, s_ml[w][j][0]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float wt = s_ml[w][j][0] == -INFINITY ? 0.f : exp2_ftz(s_ml[w][j][0] - mb);
      num += wt * s_buf[(j * kDecodeWarps + w) * HD + d];
      den += wt * s_ml[w][j][1];
    }
    if (used == 1) {
      p.out[(qh0 + j) * HD + d] = float_to_bf16(num * (den > 0.f ? 1.f / den : 0.f));
      continue;
    }
    p.part_out[((qh0 + j) * p.n_splits + split) * HD + d] = num;
    if (d == 0) {
      p.part_max[(qh0 + j) * p.n_splits + split] = mb;
      p.part_sum[(qh0 + j) * p.n_splits + split] = den;
    }
  }
  if (used == 1) return;

  // Publish this split, then take a ticket: the block that draws the last one sees every split.
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&p.tickets[kv_head], 1u) == static_cast<unsigned>(used - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // out = sum_s 2^(m_s - M) o_s / sum_s 2^(m_s - M) l_s, with everything read past L1 (other
  // SMs wrote it) and each kind of read issued at once: the maxima and sums, then the partial
  // rows of every head.
  for (int i = tid; i < group * used; i += kDecodeThreads) {
    const int j = i / used, sp = i % used;
    s_w[j][sp] = __ldcg(p.part_max + (qh0 + j) * p.n_splits + sp);
    s_l[j][sp] = __ldcg(p.part_sum + (qh0 + j) * p.n_splits + sp);
  }
  __syncthreads();
  for (int j = warp; j < group; j += kDecodeWarps) {  // one warp per head
    float mx = -INFINITY;
    for (int sp = lane; sp < used; sp += kWarpSize) mx = fmaxf(mx, s_w[j][sp]);
    mx = warp_max(mx);
    float den = 0.f;
    for (int sp = lane; sp < used; sp += kWarpSize) {
      const float wt = exp2_ftz(s_w[j][sp] - mx);
      s_w[j][sp] = wt;
      den += wt * s_l[j][sp];
    }
    den = warp_sum(den);
    if (lane == 0) s_den[j] = den;
  }
  __syncthreads();
  // Thread (merge row r, float4 column c4) sums rows r, r + kMergeRows, ... of each head; a
  // pass loads kBatch such rows of every head (8 float4 per thread) before using them.
  constexpr int kBatch = MAXG >= 8 ? 1 : 8 / MAXG;
  const int c4 = tid % kCol4, r0 = tid / kCol4;
  float4 a[MAXG];
#pragma unroll
  for (int j = 0; j < MAXG; ++j) a[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int base = r0; base < used; base += kBatch * kMergeRows) {
    float4 v[MAXG][kBatch];
#pragma unroll
    for (int j = 0; j < MAXG; ++j)
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int sp = base + b * kMergeRows;
        v[j][b] = j < group && sp < used
                      ? __ldcg(reinterpret_cast<const float4*>(p.part_out +
                                                               ((qh0 + j) * p.n_splits + sp) * HD) +
                               c4)
                      : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
    for (int j = 0; j < MAXG; ++j)
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        const int sp = base + b * kMergeRows;
        const float wt = j < group && sp < used ? s_w[j][sp] : 0.f;
        a[j].x = fmaf(wt, v[j][b].x, a[j].x), a[j].y = fmaf(wt, v[j][b].y, a[j].y);
        a[j].z = fmaf(wt, v[j][b].z, a[j].z), a[j].w = fmaf(wt, v[j][b].w, a[j].w);
      }
  }
#pragma unroll
  for (int j = 0; j < MAXG; ++j)
    if (j < group) reinterpret_cast<float4*>(s_buf)[(j * kMergeRows + r0) * kCol4 + c4] = a[j];
  __syncthreads();
  for (int i = tid; i < group * HD; i += kDecodeThreads) {
    const int j = i / HD, d = i % HD;
    float num = 0.f;
#pragma unroll
    for (int r = 0; r < kMergeRows; ++r) num += s_buf[(j * kMergeRows + r) * HD + d];
    const float den = s_den[j];
    p.out[(qh0 + j) * HD + d] = float_to_bf16(num * (den > 0.f ? 1.f / den : 0.f));
  }
  // Ready for the next launch, which reads it only after this kernel has completed.
  if (tid == 0) p.tickets[kv_head] = 0;
}

template <int HD, int MAXG>
void launch_decode(const DecodeParams& p, int n_kv_heads, cudaStream_t s) {
  launch_programmatic(decode_attention_kernel<HD, MAXG>, dim3(p.n_splits, n_kv_heads),
                      dim3(kDecodeThreads), 0, s, p);
}

template <int HD>
void dispatch_decode_group(const DecodeParams& p, int n_kv_heads, cudaStream_t s) {
  if (p.group <= 1) return launch_decode<HD, 1>(p, n_kv_heads, s);
  if (p.group <= 2) return launch_decode<HD, 2>(p, n_kv_heads, s);
  if (p.group <= 4) return launch_decode<HD, 4>(p, n_kv_heads, s);
  return launch_decode<HD, 8>(p, n_kv_heads, s);
}

// ----------------------------------------------------------------------------------------------
// KV cache append
// ----------------------------------------------------------------------------------------------

__global__ void kv_store_kernel(uint16_t* k_cache, uint16_t* v_cache, const uint16_t* qkv,
                                const int32_t* past_len, int64_t max_len, int64_t row_stride,
                                int64_t k_offset, int64_t v_offset, int64_t width, bool vec) {
  // A programmatic dependent (launch.cuh): nothing is read before the kernels before it finish.
  pdl_launch_dependents();
  pdl_wait();
  const int64_t t = blockIdx.x;
  const int64_t dst_row = *past_len + t;
  // Rows past the cache end are dropped: the device cannot throw, and the host cannot see
  // past_len without a sync. The model sizes max_len for its longest sequence.
  if (dst_row < 0 || dst_row >= max_len) return;
  const uint16_t* ks = qkv + t * row_stride + k_offset;
  const uint16_t* vs = qkv + t * row_stride + v_offset;
  uint16_t* kd = k_cache + dst_row * width;
  uint16_t* vd = v_cache + dst_row * width;
  if (vec) {
    for (int64_t i = threadIdx.x; i < width / 8; i += blockDim.x) {
      reinterpret_cast<uint4*>(kd)[i] = reinterpret_cast<const uint4*>(ks)[i];
      reinterpret_cast<uint4*>(vd)[i] = reinterpret_cast<const uint4*>(vs)[i];
    }
  } else {
    for (int64_t i = threadIdx.x; i < width; i += blockDim.x) kd[i] = ks[i], vd[i] = vs[i];
  }
}

}  // namespace

void attention_init() {
  FlashHeadDims::each([](auto hd) {
    constexpr int HD = decltype(hd)::value;
    set_group_smem<HD, Rows64, false>();
    set_group_smem<HD, Rows64, true>();
    set_wide_smem<HD, false>();
    set_wide_smem<HD, true>();
  });
  VisionHeadDims::each([](auto hd) {
    set_group_smem<decltype(hd)::value, Rows128Keys2, false>();
    set_group_smem<decltype(hd)::value, Rows32Keys4, false>();
  });
#if defined(IRIS_CUDA_SM90A)
  int device = 0;
  cudaDeviceProp prop{};
  IRIS_CUDA_CHECK(cudaGetDevice(&device));
  IRIS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  g_wgmma_attention = prop.major == 9 && prop.minor == 0;
  if (g_wgmma_attention) {
    set_wgmma_smem<64, WgMode::segments>();
    set_wgmma_smem<64, WgMode::segments, true>();
    set_wgmma_smem<72, WgMode::segments>();
    set_wgmma_smem<128, WgMode::cache_causal>();
    set_wgmma_smem<128, WgMode::cache_causal, true>();
    set_wgmma_smem<64, WgMode::train_segments>();
    set_wgmma_smem<64, WgMode::train_segments, true>();
    set_wgmma_smem<72, WgMode::train_segments>();
    set_wgmma_smem<128, WgMode::train_causal>();
    set_wgmma_smem<128, WgMode::train_causal, true>();
    // The tensor-map encoder is a driver entry point that the runtime hands out, so Iris needs
    // no link against libcuda.
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    IRIS_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                     cudaEnableDefault, &found));
    if (found == cudaDriverEntryPointSuccess)
      g_encode_tiled = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
#endif
}

bool attention_head_dim_supported(int head_dim) {
  return FlashHeadDims::contains(head_dim);
}

void launch_attention_segments(uint16_t* out, const uint16_t* qkv, const int32_t* cu_seqlens,
                               const int32_t* real_rows, int n_segments, int64_t total_rows,
                               int n_heads, int head_dim, float scale, int num_sms,
                               cudaStream_t s) {
  if (total_rows == 0 || n_segments == 0) return;
  const int64_t hidden = static_cast<int64_t>(n_heads) * head_dim;
  FlashParams p{};
  p.q = qkv;
  p.k = qkv + hidden;
  p.v = qkv + 2 * hidden;
  p.out = out;
  p.q_stride = p.kv_stride = 3 * hidden;
  p.out_stride = hidden;
  p.kv_group = 1;
  p.cu_seqlens = cu_seqlens;
  p.real_rows = real_rows;
  p.n_segments = n_segments;
  p.scale_log2 = scale * kLog2e;
  switch (pick_segment_kernel(total_rows, n_segments, n_heads, head_dim, scale, num_sms)) {
    case SegmentKernel::group_rows128:
      return dispatch_group<VisionHeadDims, Rows128Keys2, false>(
          head_dim, p, segment_grid(total_rows, Rows128Keys2::kRows, n_segments, n_heads), s);
    case SegmentKernel::group_rows32:
      return dispatch_group<VisionHeadDims, Rows32Keys4, false>(
          head_dim, p, segment_grid(total_rows, Rows32Keys4::kRows, n_segments, n_heads), s);
    case SegmentKernel::wide:
      return dispatch_wide<false>(head_dim, p,
                                  segment_grid(total_rows, kWideBr, n_segments, n_heads), s);
    case SegmentKernel::rows64:
      return dispatch_group<FlashHeadDims, Rows64, false>(
          head_dim, p, segment_grid(total_rows, Rows64::kRows, n_segments, n_heads), s);
    case SegmentKernel::wgmma: {
      const dim3 grid = segment_grid(total_rows, kWgBr, n_segments, n_heads);
      if (head_dim != 64) return launch_wgmma<72, WgMode::segments>(p, grid, s);
      if (tma_tiles_possible(p))
        return launch_wgmma<64, WgMode::segments, true>(p, grid, s, total_rows, hidden);
      return launch_wgmma<64, WgMode::segments>(p, grid, s);
    }
  }
}

void launch_kv_store(uint16_t* k_cache, uint16_t* v_cache, const uint16_t* qkv,
                     const int32_t* past_len, int64_t tokens, int64_t max_len, int n_q_heads,
                     int n_kv_heads, int head_dim, cudaStream_t s) {
  if (tokens == 0) return;
  const int64_t width = static_cast<int64_t>(n_kv_heads) * head_dim;
  const int64_t row_stride = static_cast<int64_t>(n_q_heads + 2 * n_kv_heads) * head_dim;
  const int64_t k_offset = static_cast<int64_t>(n_q_heads) * head_dim;
  const int64_t v_offset = k_offset + width;
  const bool vec = head_dim % 8 == 0 && aligned16(qkv) && aligned16(k_cache) && aligned16(v_cache);
  launch_programmatic(kv_store_kernel, dim3(static_cast<unsigned>(tokens)), dim3(128), 0, s,
                      k_cache, v_cache, qkv, past_len, max_len, row_stride, k_offset, v_offset,
                      width, vec);
}

void launch_attention_causal(uint16_t* out, const uint16_t* qkv, const uint16_t* k_cache,
                             const uint16_t* v_cache, const int32_t* past_len, int64_t tokens,
                             int64_t max_len, int n_q_heads, int n_kv_heads, int head_dim,
                             float scale, const DecodeScratch& scratch, int num_sms,
                             cudaStream_t s) {
  if (tokens == 0) return;
  const int group = n_q_heads / n_kv_heads;
  const bool decode_shape = head_dim == 16 || head_dim == 64 || head_dim == 128;
  if (tokens == 1 && decode_shape && group <= 8 && n_kv_heads <= scratch.capacity_tickets) {
    // About four blocks per SM at long context; never more splits than the scratch holds or
    // than max_len could fill.
    int n_splits = std::max(1, (4 * num_sms + n_kv_heads - 1) / n_kv_heads);
    n_splits = std::min<int64_t>(n_splits, kDecodeMaxSplits);
    n_splits = std::min<int64_t>(n_splits, (max_len + kDecodeMinChunk - 1) / kDecodeMinChunk);
    n_splits = std::min<int64_t>(n_splits, scratch.capacity_rows / n_q_heads);
    n_splits =
        std::min<int64_t>(n_splits, scratch.capacity_floats / (int64_t{n_q_heads} * head_dim));
    if (n_splits >= 1) {
      DecodeParams p{};
      p.q = qkv;
      p.k_cache = k_cache;
      p.v_cache = v_cache;
      p.past_len = past_len;
      p.out = out;
      p.part_out = scratch.partial_out;
      p.part_max = scratch.partial_max;
      p.part_sum = scratch.partial_sum;
      p.tickets = scratch.tickets;
      p.kv_stride = static_cast<int64_t>(n_kv_heads) * head_dim;
      p.max_len = max_len;
      p.n_q_heads = n_q_heads;
      p.group = group;
      p.n_splits = n_splits;
      p.scale_log2 = scale * kLog2e;
      switch (head_dim) {
        case 16:
          return dispatch_decode_group<16>(p, n_kv_heads, s);
        case 64:
          return dispatch_decode_group<64>(p, n_kv_heads, s);
        default:
          return dispatch_decode_group<128>(p, n_kv_heads, s);
      }
    }
  }
  const int64_t row_stride = static_cast<int64_t>(n_q_heads + 2 * n_kv_heads) * head_dim;
  FlashParams p{};
  p.q = qkv;
  p.k = k_cache;
  p.v = v_cache;
  p.out = out;
  p.q_stride = row_stride;
  p.kv_stride = static_cast<int64_t>(n_kv_heads) * head_dim;
  p.out_stride = static_cast<int64_t>(n_q_heads) * head_dim;
  p.kv_group = group;
  p.past_len = past_len;
  p.tokens = tokens;
  p.max_len = max_len;
  p.scale_log2 = scale * kLog2e;
  // The wgmma kernel at head_dim 128 (16 query / 8 kv heads on an H100): 4096 tokens 250 -> 205
  // us against the wide kernel, 2000 after 2000 cached 234 -> 153, 830 tokens 40 -> 23 and 512
  // 26 -> 16 against the 64-row kernel, 33 tokens 5.2 -> 4.8.
  if (g_wgmma_attention && head_dim == 128 && scale > 0.f) {
    const int64_t q_tiles = (tokens + kWgBr - 1) / kWgBr;
    const dim3 grid(n_q_heads, static_cast<unsigned>(q_tiles));
    if (tma_tiles_possible(p))
      return launch_wgmma<128, WgMode::cache_causal, true>(p, grid, s, max_len, p.kv_stride);
    return launch_wgmma<128, WgMode::cache_causal>(p, grid, s);
  }
  const int64_t wide_tiles = (tokens + kWideBr - 1) / kWideBr;
  if (use_wide(wide_tiles * n_q_heads, tokens, scale, num_sms))
    return dispatch_wide<true>(head_dim, p, dim3(n_q_heads, static_cast<unsigned>(wide_tiles)), s);
  const int64_t q_tiles = (tokens + Rows64::kRows - 1) / Rows64::kRows;
  dispatch_group<FlashHeadDims, Rows64, true>(head_dim, p,
                                              dim3(n_q_heads, static_cast<unsigned>(q_tiles)), s);
}

bool launch_attention_train_forward_wgmma(uint16_t* out, float* lse, const uint16_t* qkv,
                                          const int32_t* cu_seqlens, const int32_t* real_rows,
                                          int n_segments, int64_t total_rows, int n_q_heads,
                                          int n_kv_heads, int head_dim, float scale, bool causal,
                                          cudaStream_t s) {
  const bool served = causal ? head_dim == 128 : head_dim == 64 || head_dim == 72;
  if (!g_wgmma_attention || !served || scale <= 0.f || n_kv_heads <= 0 ||
      n_q_heads % n_kv_heads != 0)
    return false;
  const int64_t hidden = static_cast<int64_t>(n_q_heads) * head_dim;
  const int64_t kv_width = static_cast<int64_t>(n_kv_heads) * head_dim;
  FlashParams p{};
  p.q = qkv;
  p.k = qkv + hidden;
  p.v = qkv + hidden + kv_width;
  p.out = out;
  p.q_stride = p.kv_stride = hidden + 2 * kv_width;
  p.out_stride = hidden;
  p.kv_group = n_q_heads / n_kv_heads;
  p.cu_seqlens = cu_seqlens;
  p.real_rows = real_rows;
  p.n_segments = n_segments;
  p.scale_log2 = scale * kLog2e;
  p.lse = lse;
  p.lse_stride = n_q_heads;
  p.total_rows = total_rows;
  // One spare tile per segment, and one for the rows past the last (segment_tiles.cuh).
  const dim3 grid(n_q_heads,
                  static_cast<unsigned>((total_rows + kWgBr - 1) / kWgBr + n_segments + 1));
  const bool tma = tma_tiles_possible(p);
  if (head_dim == 128) {
    if (tma)
      launch_wgmma<128, WgMode::train_causal, true>(p, grid, s, total_rows, kv_width);
    else
      launch_wgmma<128, WgMode::train_causal>(p, grid, s);
  } else if (head_dim == 64) {
    if (tma)
      launch_wgmma<64, WgMode::train_segments, true>(p, grid, s, total_rows, kv_width);
    else
      launch_wgmma<64, WgMode::train_segments>(p, grid, s);
  } else {
    launch_wgmma<72, WgMode::train_segments>(p, grid, s);
  }
  return true;
}

}  // namespace iris::cuda
