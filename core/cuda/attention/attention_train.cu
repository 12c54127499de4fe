// Training attention on bf16 tensor cores (mma.sync m16n8k16, f32 accumulation), FlashAttention-2
// style, for segments (vision, non-causal) and packed causal samples (decoder), with GQA.
//
// Forward (attn_fwd_kernel): a block owns a tile of query rows of one query head and streams the
// K/V tiles of its segment through shared memory (cp.async, two stages), online softmax in f32;
// it writes out and the log-sum-exp.
// Backward, deterministic (no atomics, each gradient element summed by one thread in a fixed
// order):
// - attn_bwd_pre_kernel: dsum = rowwise dout . out per head; rows the forward zeroed (past the
//   last segment, padding segments) get dsum 0 and an all-zero dqkv row.
// - attn_bwd_dkv_kernel: a block owns a tile of keys of one kv head; each warp holds 16 keys'
//   K and V fragments and dK/dV accumulators in registers, and loops over the query heads of the
//   GQA group and the query tiles of the segment (Q, dO, lse, dsum staged in shared memory),
//   recomputing P from lse: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q.
// - attn_bwd_dq_kernel: a block owns a tile of query rows of one query head; each warp holds Q and
//   dO fragments and the dQ accumulators in registers and loops over the K/V tiles:
//   S = Q K^T, dP = dO V^T, dQ += dS K.
// Both backward kernels work through their tiles 16 rows (one mma k-step) at a time, so the score
// and dP fragments never take more than 16 registers per m-tile.
// Head dims without a tensor-core instantiation (any up to 256) take simple warp-per-row kernels.
// On Hopper (sm_90a builds on compute capability 9.0) the forward at head_dim 64 and 72 (segments)
// and 128 (causal) runs on the inference path's warpgroup-MMA kernel (attention.cu, its train
// modes), and the backward at head_dim 64 (segments) and 128 (causal) on the wgmma kernels of
// attention_train_wgmma.cu; the kernels here serve every other shape and device.
//
// On an H100 (tools/attention_train_check.cu --bench; FLOPs as FlashAttention counts them: 4 hd
// per (query, key) pair for the forward, 2.5 times that for the backward): decoder, causal, 16/8
// heads of 128, 4096 rows: forward 280 us (245 TFLOP/s), backward 886 us (194); vision, 16 heads
// of 64, 16 x 1024 rows: 282 us (244), 922 us (186); 16 heads of 72: 487 us (159), 1197 us (161).
#include "core/cuda/attention/attention.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "core/cuda/attention/mma_sync.cuh"
#include "core/cuda/attention/segment_tiles.cuh"
#include "core/cuda/attention/train_params.cuh"
#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/launch.cuh"

namespace iris::cuda {
namespace {

constexpr float kTrainLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------------------------------------
// Shared set-up
// ---------------------------------------------------------------------------------------------

// Tile b of `rows` rows by segment_tiles.cuh's numbering: its segment and the tile's index in it
// (b is updated; a segment's spare block gets b >= n_tiles and leaves at once); false past the
// last segment, with b then counting tiles on from cu[n].
__device__ __forceinline__ bool find_tile(const TrainParams& p, int rows, int& b, int& seg_b,
                                          int& seg_e, int& n_tiles) {
  const SegmentTile t = find_segment_tile(p.cu, p.n_segments, rows, b);
  b = static_cast<int>(t.tile);
  if (t.segment >= p.n_segments) return false;
  seg_b = p.cu[t.segment];
  seg_e = p.cu[t.segment + 1];
  n_tiles = (seg_e - seg_b + rows - 1) / rows;
  return true;
}

__device__ __forceinline__ bool is_padding(const TrainParams& p, int seg_b) {
  return p.real_rows != nullptr && seg_b >= *p.real_rows;
}

// The segment of row r (cu[s] <= r < cu[s+1]) and whether the row is live (in a segment that is
// not padding). Zero-length segments are skipped by taking the last s with cu[s] <= r.
__device__ __forceinline__ bool row_segment(const TrainParams& p, int r, int& seg_b, int& seg_e) {
  int lo = 0, hi = p.n_segments;  // answer in [lo, hi]: largest s with cu[s] <= r
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.cu[mid] <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  if (lo >= p.n_segments) return false;
  seg_b = p.cu[lo];
  seg_e = p.cu[lo + 1];
  return !is_padding(p, seg_b);
}

template <int HD>
struct Dims {
  static constexpr int kPad = (HD + 15) / 16 * 16;  // k-steps of 16 over the head dim
  // +8 elements (16 bytes) per row: conflict-free ldmatrix rows, 16-byte aligned for cp.async.
  static constexpr int kLd = kPad + 8;
  static constexpr int kSteps = kPad / 16;
  static constexpr int kNt = HD / 8;      // n-tiles of 8 over the head dim
  static constexpr int kChunks = HD / 8;  // 16-byte chunks per row
};

// Rows [row0, row0 + R) of a head's columns (base, row stride `stride`) into tile [R][kLd] with
// cp.async; rows at or past row_end are zero-filled. The caller commits.
template <int HD, int R>
__device__ __forceinline__ void load_rows(uint16_t* tile, const uint16_t* base, int stride,
                                          int row0, int row_end, int tid, int threads) {
  using D = Dims<HD>;
  for (int i = tid; i < R * D::kChunks; i += threads) {
    const int r = i / D::kChunks, c = (i % D::kChunks) * 8;
    const int row = row0 + r;
    const bool ok = row < row_end;
    cp_async16(tile + r * D::kLd + c, base + (ok ? row : 0) * stride + c, ok ? 16 : 0);
  }
}

// Zeros columns [HD, kPad) of `rows` tile rows (cp.async never writes them; the k-steps read
// them).
template <int HD>
__device__ __forceinline__ void zero_pad_cols(uint16_t* tile, int rows, int tid, int threads) {
  using D = Dims<HD>;
  if constexpr (D::kPad != HD) {
    constexpr int kCols = D::kPad - HD;
    for (int i = tid; i < rows * kCols; i += threads)
      tile[(i / kCols) * D::kLd + HD + i % kCols] = 0;
  }
}

// A fragments (16 rows x kPad columns) of rows row_a, row_a + 8 straight from global memory;
// rows at or past row_end and the padding columns read as zeros.
template <int HD>
__device__ __forceinline__ void load_a_fragments(uint32_t (&f)[Dims<HD>::kSteps][4],
                                                 const uint16_t* base, int stride, int row_a,
                                                 int row_end, int t4) {
  const int row_b = row_a + 8;
#pragma unroll
  for (int ks = 0; ks < Dims<HD>::kSteps; ++ks) {
    const int c0 = ks * 16 + 2 * t4, c1 = c0 + 8;
    f[ks][0] = row_a < row_end && c0 < HD ? load_pair(base + row_a * stride + c0) : 0u;
    f[ks][1] = row_b < row_end && c0 < HD ? load_pair(base + row_b * stride + c0) : 0u;
    f[ks][2] = row_a < row_end && c1 < HD ? load_pair(base + row_a * stride + c1) : 0u;
    f[ks][3] = row_b < row_end && c1 < HD ? load_pair(base + row_b * stride + c1) : 0u;
  }
}

// acc[16 x HD] += A[16 x 16] B where B = tile rows [16][HD] (k = the tile's rows): B fragments
// through a transposing ldmatrix. `rows` points at the first of the 16 tile rows.
template <int HD>
__device__ __forceinline__ void mma_rows_t(float (&acc)[Dims<HD>::kNt][4], const uint32_t (&a)[4],
                                           const uint16_t* rows, int lane) {
  using D = Dims<HD>;
  const uint16_t* r = rows + (((lane / 8) % 2) * 8 + lane % 8) * D::kLd;
#pragma unroll
  for (int d = 0; d + 1 < D::kNt; d += 2) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, r + d * 8 + (lane / 16) * 8);
    mma_bf16_16816(acc[d], a, b[0], b[1]);
    mma_bf16_16816(acc[d + 1], a, b[2], b[3]);
  }
  if constexpr (D::kNt % 2 == 1) {
    uint32_t b[2];
    ldmatrix_x2_trans(b, r + (D::kNt - 1) * 8);
    mma_bf16_16816(acc[D::kNt - 1], a, b[0], b[1]);
  }
}

// B fragments of 16 tile rows (two n-tiles of 8) at k-step kk: b[0], b[1] for rows 0-7, b[2],
// b[3] for rows 8-15. `rows` points at the first of the 16 rows.
template <int HD>
__device__ __forceinline__ void ldsm_b_pair(uint32_t (&b)[4], const uint16_t* rows, int kk,
                                            int lane) {
  ldmatrix_x4(b,
              rows + ((lane / 16) * 8 + lane % 8) * Dims<HD>::kLd + kk * 16 + ((lane / 8) % 2) * 8);
}

__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&c)[2][4]) {
  a[0] = pack_bf16x2(c[0][0], c[0][1]);
  a[1] = pack_bf16x2(c[0][2], c[0][3]);
  a[2] = pack_bf16x2(c[1][0], c[1][1]);
  a[3] = pack_bf16x2(c[1][2], c[1][3]);
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

// NW warps of MT m-tiles (16 rows each) of one query head; Q fragments in registers; BC keys per
// K/V tile, double-buffered.
template <int HD, int MT, int NW, int BC>
struct FwdCfg {
  static constexpr int kHd = HD, kMt = MT, kBc = BC;
  static constexpr int kThreads = NW * kWarpSize;
  static constexpr int kRows = 16 * MT * NW;
  static constexpr int kTileElems = BC * Dims<HD>::kLd;
  static constexpr size_t kSmem = 2 /*stages*/ * 2 /*K,V*/ * kTileElems * sizeof(uint16_t);
};

template <typename C, bool kCausal>
__global__ void __launch_bounds__(C::kThreads) attn_fwd_kernel(TrainParams p) {
  constexpr int HD = C::kHd, MT = C::kMt, BC = C::kBc, BR = C::kRows;
  using D = Dims<HD>;
  extern __shared__ __align__(16) uint16_t fwd_smem[];
  uint16_t* k_tiles = fwd_smem;                      // [2][BC][kLd]
  uint16_t* v_tiles = fwd_smem + 2 * C::kTileElems;  // [2][BC][kLd]
  pdl_launch_dependents();
  pdl_wait();
  const int head = blockIdx.x, kv_head = head / p.group;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t4 = lane % 4;

  int b = static_cast<int>(blockIdx.y), seg_b = 0, seg_e = 0, n_tiles = 0, q0, q_end;
  bool zero;
  if (find_tile(p, BR, b, seg_b, seg_e, n_tiles)) {
    if (b >= n_tiles) return;
    // Causal: the last tile of a segment (the most keys) first.
    q0 = seg_b + (kCausal ? n_tiles - 1 - b : b) * BR;
    q_end = seg_e;
    zero = is_padding(p, seg_b);
  } else {  // rows past the last segment
    q0 = p.cu[p.n_segments] + b * BR;
    q_end = p.total_rows;
    if (q0 >= q_end) return;
    zero = true;
  }
  const int q_stop = min(q0 + BR, q_end);
  if (zero) {
    uint16_t* o = p.out + static_cast<int64_t>(head) * HD;
    for (int i = tid; i < (q_stop - q0) * D::kChunks; i += C::kThreads)
      *reinterpret_cast<uint4*>(o + (q0 + i / D::kChunks) * p.hidden + (i % D::kChunks) * 8) =
          make_uint4(0, 0, 0, 0);
    for (int i = tid; i < q_stop - q0; i += C::kThreads) p.lse[(q0 + i) * p.nq + head] = 0.f;
    return;
  }
  const int kv_begin = seg_b, kv_end = kCausal ? q_stop : seg_e;
  const int n_kv = static_cast<int>((kv_end - kv_begin + BC - 1) / BC);

  zero_pad_cols<HD>(k_tiles, 2 * BC, tid, C::kThreads);
  const uint16_t* k_base = p.qkv + p.hidden + static_cast<int64_t>(kv_head) * HD;
  const uint16_t* v_base = p.qkv + p.v_col + static_cast<int64_t>(kv_head) * HD;
  auto load_tile = [&](int stage, int t) {
    const int key0 = kv_begin + t * BC;
    load_rows<HD, BC>(k_tiles + stage * C::kTileElems, k_base, p.width, key0, kv_end, tid,
                      C::kThreads);
    load_rows<HD, BC>(v_tiles + stage * C::kTileElems, v_base, p.width, key0, kv_end, tid,
                      C::kThreads);
    cp_async_commit();
  };
  if (n_kv > 0) load_tile(0, 0);

  const int warp_row0 = q0 + warp * 16 * MT;
  const bool warp_idle = warp_row0 >= q_end;
  uint32_t qf[MT][D::kSteps][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    load_a_fragments<HD>(qf[mt], p.qkv + static_cast<int64_t>(head) * HD, p.width,
                         warp_row0 + mt * 16 + g, q_end, t4);
  float o[MT][D::kNt][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int d = 0; d < D::kNt; ++d) o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    m_run[mt][0] = m_run[mt][1] = -INFINITY, l_run[mt][0] = l_run[mt][1] = 0.f;

  for (int it = 0; it < n_kv; ++it) {
    const int stage = it & 1;
    // The other stage was last read in iteration it - 1, which ended with a barrier.
    if (it + 1 < n_kv) {
      load_tile(stage ^ 1, it + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int key0 = kv_begin + it * BC;
    bool skip = warp_idle, need_mask = key0 + BC > kv_end;
    if constexpr (kCausal) {
      skip = skip || key0 > warp_row0 + 16 * MT - 1;
      need_mask = need_mask || key0 + (BC - 1) > warp_row0;
    }
    if (!skip) {
      const uint16_t* ks = k_tiles + stage * C::kTileElems;
      const uint16_t* vs = v_tiles + stage * C::kTileElems;
      float s[MT][BC / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < BC / 8; ++nt)
          s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D::kSteps; ++kk) {
#pragma unroll
        for (int np = 0; np < BC / 16; ++np) {
          uint32_t bk[4];
          ldsm_b_pair<HD>(bk, ks + np * 16 * D::kLd, kk, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16_16816(s[mt][2 * np], qf[mt][kk], bk[0], bk[1]);
            mma_bf16_16816(s[mt][2 * np + 1], qf[mt][kk], bk[2], bk[3]);
          }
        }
      }
      // Scale into the log2 domain (before the maximum: any sign of scale), then mask keys past
      // the end and, causal, past each row's diagonal.
      // Key key0 + nt * 8 + 2 t4 + (e & 1) is kept when nt * 8 + (e & 1) <= lim of its row.
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          int last = kv_end - 1;
          if constexpr (kCausal) last = min(last, warp_row0 + mt * 16 + g + 8 * r);
          const int lim = last - key0 - 2 * t4;
#pragma unroll
          for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
              float v = s[mt][nt][e] * p.scale_log2;
              if (need_mask && nt * 8 + (e & 1) > lim) v = -INFINITY;
              s[mt][nt][e] = v;
            }
        }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < BC / 8; ++nt)
            mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float m_new = fmaxf(m_run[mt][r], mx);
          // A row that has seen only masked keys keeps m = -inf: exponentiate against 0.
          const float m_use = m_new == -INFINITY ? 0.f : m_new;
          const float alpha = exp2_ftz(m_run[mt][r] - m_use);
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < BC / 8; ++nt) {
            s[mt][nt][2 * r] = exp2_ftz(s[mt][nt][2 * r] - m_use);
            s[mt][nt][2 * r + 1] = exp2_ftz(s[mt][nt][2 * r + 1] - m_use);
            sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
          }
          sum += __shfl_xor_sync(0xffffffffu, sum, 1);
          sum += __shfl_xor_sync(0xffffffffu, sum, 2);
          l_run[mt][r] = l_run[mt][r] * alpha + sum;
          m_run[mt][r] = m_new;
#pragma unroll
          for (int d = 0; d < D::kNt; ++d) {
            o[mt][d][2 * r] *= alpha;
            o[mt][d][2 * r + 1] *= alpha;
          }
        }
      }
      // O += P V, V's B fragments through a transposing ldmatrix, each used by all m-tiles.
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = pack_bf16x2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          pa[mt][1] = pack_bf16x2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          pa[mt][2] = pack_bf16x2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          pa[mt][3] = pack_bf16x2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
        const uint16_t* vrow = vs + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * D::kLd;
#pragma unroll
        for (int d = 0; d + 1 < D::kNt; d += 2) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, vrow + d * 8 + (lane / 16) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16_16816(o[mt][d], pa[mt], bv[0], bv[1]);
            mma_bf16_16816(o[mt][d + 1], pa[mt], bv[2], bv[3]);
          }
        }
        if constexpr (D::kNt % 2 == 1) {
          uint32_t bv[2];
          ldmatrix_x2_trans(bv, vrow + (D::kNt - 1) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma_bf16_16816(o[mt][D::kNt - 1], pa[mt], bv[0], bv[1]);
        }
      }
    }
    __syncthreads();
  }

  uint16_t* out_head = p.out + static_cast<int64_t>(head) * HD;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + mt * 16 + g + 8 * r;
      if (row >= q_end) continue;
      const float l = l_run[mt][r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int d = 0; d < D::kNt; ++d)
        *reinterpret_cast<uint32_t*>(out_head + row * p.hidden + d * 8 + 2 * t4) =
            pack_bf16x2(o[mt][d][2 * r] * inv, o[mt][d][2 * r + 1] * inv);
      if (t4 == 0)
        p.lse[row * p.nq + head] = l > 0.f ? (m_run[mt][r] + __log2f(l)) * kTrainLn2 : 0.f;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dsum and the zero rows
// ---------------------------------------------------------------------------------------------

// One block per row. dsum[row, h] = sum_d dout * out (bf16 inputs, f32 sums in a fixed order);
// a row outside every live segment gets dsum 0 and an all-zero dqkv row. kVec: 16-byte accesses
// (head_dim % 8 == 0 and aligned pointers) with per-chunk partial sums in shared memory.
template <bool kVec>
__global__ void __launch_bounds__(128) attn_bwd_pre_kernel(TrainParams p, int hd) {
  extern __shared__ float pre_part[];  // kVec: [nq * hd / 8]
  pdl_launch_dependents();
  pdl_wait();
  const int row = blockIdx.x;
  const int tid = threadIdx.x, threads = blockDim.x;
  int seg_b, seg_e;
  if (!row_segment(p, row, seg_b, seg_e)) {
    uint16_t* d = p.dqkv + row * p.width;
    if constexpr (kVec) {
      for (int c = tid; c < p.width / 8; c += threads)
        reinterpret_cast<uint4*>(d)[c] = make_uint4(0, 0, 0, 0);
    } else {
      for (int c = tid; c < p.width; c += threads) d[c] = 0;
    }
    for (int h = tid; h < p.nq; h += threads) p.dsum[row * p.nq + h] = 0.f;
    return;
  }
  const uint16_t* go = p.dout + row * p.hidden;
  const uint16_t* o = p.out + row * p.hidden;
  if constexpr (kVec) {
    const int chunks = static_cast<int>(p.hidden / 8), per_head = hd / 8;
    for (int c = tid; c < chunks; c += threads) {
      float a[8], b[8];
      load8(go + c * 8, a);
      load8(o + c * 8, b);
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) s = fmaf(a[i], b[i], s);
      pre_part[c] = s;
    }
    __syncthreads();
    for (int h = tid; h < p.nq; h += threads) {
      float s = 0.f;
      for (int j = 0; j < per_head; ++j) s += pre_part[h * per_head + j];
      p.dsum[row * p.nq + h] = s;
    }
  } else {
    for (int h = tid; h < p.nq; h += threads) {
      float s = 0.f;
      for (int d = 0; d < hd; ++d)
        s = fmaf(bf16_to_float(go[h * hd + d]), bf16_to_float(o[h * hd + d]), s);
      p.dsum[row * p.nq + h] = s;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dK, dV
// ---------------------------------------------------------------------------------------------

// NW warps of 16 keys each (BK = 16 NW keys of one kv head per block); query tiles of BQ rows,
// double-buffered.
template <int HD, int NW, int BQ>
struct DkvCfg {
  static constexpr int kHd = HD, kBq = BQ;
  static constexpr int kThreads = NW * kWarpSize;
  static constexpr int kKeys = 16 * NW;
  static constexpr int kKvElems = kKeys * Dims<HD>::kLd;
  static constexpr int kQElems = BQ * Dims<HD>::kLd;
  // K, V tiles; then per stage Q, dO; then per stage lse, dsum.
  static constexpr size_t kSmem =
      (2 * kKvElems + 2 * 2 * kQElems) * sizeof(uint16_t) + 2 * 2 * BQ * sizeof(float);
};

template <typename C, bool kCausal>
__global__ void __launch_bounds__(C::kThreads) attn_bwd_dkv_kernel(TrainParams p) {
  constexpr int HD = C::kHd, BQ = C::kBq, BK = C::kKeys;
  using D = Dims<HD>;
  extern __shared__ __align__(16) uint16_t dkv_smem[];
  uint16_t* k_s = dkv_smem;                                        // [BK][kLd]
  uint16_t* v_s = k_s + C::kKvElems;                               // [BK][kLd]
  uint16_t* q_s = v_s + C::kKvElems;                               // [2][BQ][kLd]
  uint16_t* do_s = q_s + 2 * C::kQElems;                           // [2][BQ][kLd]
  float* lse_s = reinterpret_cast<float*>(do_s + 2 * C::kQElems);  // [2][BQ]
  float* dsum_s = lse_s + 2 * BQ;                                  // [2][BQ]
  pdl_launch_dependents();
  pdl_wait();
  const int kv_head = blockIdx.x;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t4 = lane % 4;

  int b = static_cast<int>(blockIdx.y), seg_b, seg_e, n_tiles;
  if (!find_tile(p, BK, b, seg_b, seg_e, n_tiles) || b >= n_tiles) return;
  if (is_padding(p, seg_b)) return;  // the pre kernel zeroed these rows
  // Causal: the first key tile of a segment (the most queries) first.
  const int k0 = seg_b + b * BK, k_stop = min(k0 + BK, seg_e);
  const int q_begin = kCausal ? k0 : seg_b, q_end = seg_e;
  const int n_qt = static_cast<int>((q_end - q_begin + BQ - 1) / BQ);
  const int n_it = n_qt * p.group;

  zero_pad_cols<HD>(k_s, 2 * BK + 4 * BQ, tid, C::kThreads);  // K, V, and both Q, dO stages
  load_rows<HD, BK>(k_s, p.qkv + p.hidden + static_cast<int64_t>(kv_head) * HD, p.width, k0, k_stop,
                    tid, C::kThreads);
  load_rows<HD, BK>(v_s, p.qkv + p.v_col + static_cast<int64_t>(kv_head) * HD, p.width, k0, k_stop,
                    tid, C::kThreads);
  cp_async_commit();
  // Iteration it: query head kv_head * group + it / n_qt, query tile it % n_qt.
  auto load_stage = [&](int stage, int it) {
    const int head = kv_head * p.group + it / n_qt;
    const int q0 = q_begin + (it % n_qt) * BQ;
    load_rows<HD, BQ>(q_s + stage * C::kQElems, p.qkv + static_cast<int64_t>(head) * HD, p.width,
                      q0, q_end, tid, C::kThreads);
    load_rows<HD, BQ>(do_s + stage * C::kQElems, p.dout + static_cast<int64_t>(head) * HD, p.hidden,
                      q0, q_end, tid, C::kThreads);
    // Rows past the segment read lse 0, dsum 0: with their zero Q and dO rows every term they
    // add is an exact 0 (and they are masked as well).
    for (int i = tid; i < 2 * BQ; i += C::kThreads) {
      const int r = i % BQ;
      const int row = q0 + r;
      const bool ok = row < q_end;
      const float* src = (i < BQ ? p.lse : p.dsum) + (ok ? row * p.nq + head : 0);
      cp_async4((i < BQ ? lse_s : dsum_s) + stage * BQ + r, src, ok ? 4 : 0);
    }
    cp_async_commit();
  };
  if (n_it > 0) load_stage(0, 0);
  if (n_it > 0) {
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();

  // This warp's 16 keys: K and V as A fragments, for the whole block.
  const int wk0 = k0 + warp * 16;
  const bool warp_idle = wk0 >= k_stop;
  uint32_t kf[D::kSteps][4], vf[D::kSteps][4];
#pragma unroll
  for (int kk = 0; kk < D::kSteps; ++kk) {
    ldmatrix_x4(kf[kk], k_s + (warp * 16 + lane % 16) * D::kLd + kk * 16 + (lane / 16) * 8);
    ldmatrix_x4(vf[kk], v_s + (warp * 16 + lane % 16) * D::kLd + kk * 16 + (lane / 16) * 8);
  }
  float dk[D::kNt][4], dv[D::kNt][4];
#pragma unroll
  for (int d = 0; d < D::kNt; ++d)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[d][e] = dv[d][e] = 0.f;

  for (int it = 0; it < n_it; ++it) {
    const int stage = it & 1;
    if (it + 1 < n_it) {
      load_stage(stage ^ 1, it + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int q0 = q_begin + (it % n_qt) * BQ;
    if (!warp_idle) {
      const uint16_t* qt = q_s + stage * C::kQElems;
      const uint16_t* dot = do_s + stage * C::kQElems;
      const float* lt = lse_s + stage * BQ;
      const float* dt = dsum_s + stage * BQ;
#pragma unroll 1
      for (int c = 0; c < BQ / 16; ++c) {
        const int c0 = q0 + c * 16;
        if (c0 >= q_end) break;
        if (kCausal && c0 + 15 < wk0) continue;  // every query before every key of the warp
        // S^T = K Q^T and dP^T = V dO^T for 16 keys x 16 queries (two n-tiles of 8 queries).
        float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < D::kSteps; ++kk) {
          uint32_t bq[4], bd[4];
          ldsm_b_pair<HD>(bq, qt + c * 16 * D::kLd, kk, lane);
          ldsm_b_pair<HD>(bd, dot + c * 16 * D::kLd, kk, lane);
          mma_bf16_16816(s[0], kf[kk], bq[0], bq[1]);
          mma_bf16_16816(s[1], kf[kk], bq[2], bq[3]);
          mma_bf16_16816(dp[0], vf[kk], bd[0], bd[1]);
          mma_bf16_16816(dp[1], vf[kk], bd[2], bd[3]);
        }
        bool need_mask = c0 + 16 > q_end;
        if constexpr (kCausal) need_mask = need_mask || c0 < wk0 + 15;
        // P^T = exp(scale s - lse[q]); dS^T = P^T (dP^T - dsum[q]). Element e of n-tile nt: key
        // wk0 + g (+ 8 for e >= 2), query c0 + j with j = nt * 8 + 2 t4 + (e & 1); kept when
        // j < q_end - c0 and (causal) j >= key - c0.
        const int j_end = q_end - c0 - 2 * t4;
        const int j_first = wk0 + g - c0 - 2 * t4;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float2 l2 = *reinterpret_cast<const float2*>(lt + c * 16 + nt * 8 + 2 * t4);
          const float2 d2 = *reinterpret_cast<const float2*>(dt + c * 16 + nt * 8 + 2 * t4);
          const float lse2[2] = {l2.x * kTrainLog2e, l2.y * kTrainLog2e};
          const float ds0[2] = {d2.x, d2.y};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float pr = exp2_ftz(fmaf(s[nt][e], p.scale_log2, -lse2[e & 1]));
            if (need_mask) {
              const int j = nt * 8 + (e & 1);
              bool ok = j < j_end;
              if constexpr (kCausal) ok = ok && j >= j_first + (e < 2 ? 0 : 8);
              if (!ok) pr = 0.f;
            }
            s[nt][e] = pr;
            dp[nt][e] = pr * (dp[nt][e] - ds0[e & 1]);
          }
        }
        uint32_t pa[4], da[4];
        pack_a(pa, s);
        pack_a(da, dp);
        mma_rows_t<HD>(dv, pa, dot + c * 16 * D::kLd, lane);  // dV += P^T dO
        mma_rows_t<HD>(dk, da, qt + c * 16 * D::kLd, lane);   // dK += dS^T Q
      }
    }
    __syncthreads();
  }

  if (warp_idle) return;
  uint16_t* dk_base = p.dqkv + p.hidden + static_cast<int64_t>(kv_head) * HD;
  uint16_t* dv_base = p.dqkv + p.v_col + static_cast<int64_t>(kv_head) * HD;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = wk0 + g + 8 * r;
    if (key >= k_stop) continue;
#pragma unroll
    for (int d = 0; d < D::kNt; ++d) {
      const int c = d * 8 + 2 * t4;
      *reinterpret_cast<uint32_t*>(dk_base + key * p.width + c) =
          pack_bf16x2(dk[d][2 * r] * p.scale, dk[d][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dv_base + key * p.width + c) =
          pack_bf16x2(dv[d][2 * r], dv[d][2 * r + 1]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward: dQ
// ---------------------------------------------------------------------------------------------

// NW warps of MQ m-tiles (16 query rows each) of one query head; BKV keys per K/V tile,
// double-buffered.
template <int HD, int MQ, int NW, int BKV>
struct DqCfg {
  static constexpr int kHd = HD, kMq = MQ, kBkv = BKV;
  static constexpr int kThreads = NW * kWarpSize;
  static constexpr int kRows = 16 * MQ * NW;
  static constexpr int kTileElems = BKV * Dims<HD>::kLd;
  static constexpr size_t kSmem = 2 /*stages*/ * 2 /*K,V*/ * kTileElems * sizeof(uint16_t);
};

template <typename C, bool kCausal>
__global__ void __launch_bounds__(C::kThreads) attn_bwd_dq_kernel(TrainParams p) {
  constexpr int HD = C::kHd, MQ = C::kMq, BKV = C::kBkv, BQ = C::kRows;
  using D = Dims<HD>;
  extern __shared__ __align__(16) uint16_t dq_smem[];
  uint16_t* k_tiles = dq_smem;                      // [2][BKV][kLd]
  uint16_t* v_tiles = dq_smem + 2 * C::kTileElems;  // [2][BKV][kLd]
  pdl_launch_dependents();
  pdl_wait();
  const int head = blockIdx.x, kv_head = head / p.group;
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int g = lane / 4, t4 = lane % 4;

  int b = static_cast<int>(blockIdx.y), seg_b, seg_e, n_tiles;
  if (!find_tile(p, BQ, b, seg_b, seg_e, n_tiles) || b >= n_tiles) return;
  if (is_padding(p, seg_b)) return;
  const int q0 = seg_b + (kCausal ? n_tiles - 1 - b : b) * BQ;
  const int q_end = seg_e, q_stop = min(q0 + BQ, q_end);
  const int kv_begin = seg_b, kv_end = kCausal ? q_stop : seg_e;
  const int n_kv = static_cast<int>((kv_end - kv_begin + BKV - 1) / BKV);

  zero_pad_cols<HD>(k_tiles, 4 * BKV, tid, C::kThreads);  // K and V, both stages
  const uint16_t* k_base = p.qkv + p.hidden + static_cast<int64_t>(kv_head) * HD;
  const uint16_t* v_base = p.qkv + p.v_col + static_cast<int64_t>(kv_head) * HD;
  auto load_tile = [&](int stage, int t) {
    const int key0 = kv_begin + t * BKV;
    load_rows<HD, BKV>(k_tiles + stage * C::kTileElems, k_base, p.width, key0, kv_end, tid,
                       C::kThreads);
    load_rows<HD, BKV>(v_tiles + stage * C::kTileElems, v_base, p.width, key0, kv_end, tid,
                       C::kThreads);
    cp_async_commit();
  };
  if (n_kv > 0) load_tile(0, 0);

  const int warp_row0 = q0 + warp * 16 * MQ;
  const bool warp_idle = warp_row0 >= q_end;
  uint32_t qf[MQ][D::kSteps][4], of[MQ][D::kSteps][4];
  float lse2[MQ][2], ds0[MQ][2];
#pragma unroll
  for (int mt = 0; mt < MQ; ++mt) {
    const int row_a = warp_row0 + mt * 16 + g;
    load_a_fragments<HD>(qf[mt], p.qkv + static_cast<int64_t>(head) * HD, p.width, row_a, q_end,
                         t4);
    load_a_fragments<HD>(of[mt], p.dout + static_cast<int64_t>(head) * HD, p.hidden, row_a, q_end,
                         t4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_a + 8 * r;
      lse2[mt][r] = row < q_end ? p.lse[row * p.nq + head] * kTrainLog2e : 0.f;
      ds0[mt][r] = row < q_end ? p.dsum[row * p.nq + head] : 0.f;
    }
  }
  float dq[MQ][D::kNt][4];
#pragma unroll
  for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
    for (int d = 0; d < D::kNt; ++d)
      dq[mt][d][0] = dq[mt][d][1] = dq[mt][d][2] = dq[mt][d][3] = 0.f;

  for (int it = 0; it < n_kv; ++it) {
    const int stage = it & 1;
    if (it + 1 < n_kv) {
      load_tile(stage ^ 1, it + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (!warp_idle) {
      const uint16_t* ks = k_tiles + stage * C::kTileElems;
      const uint16_t* vs = v_tiles + stage * C::kTileElems;
      const int tile0 = kv_begin + it * BKV;
#pragma unroll 1
      for (int c = 0; c < BKV / 16; ++c) {
        const int c0 = tile0 + c * 16;
        if (c0 >= kv_end) break;
        if (kCausal && c0 > warp_row0 + 16 * MQ - 1) break;  // keys past all rows of the warp
        float s[MQ][2][4] = {}, dp[MQ][2][4] = {};
#pragma unroll
        for (int kk = 0; kk < D::kSteps; ++kk) {
          uint32_t bk[4], bv[4];
          ldsm_b_pair<HD>(bk, ks + c * 16 * D::kLd, kk, lane);
          ldsm_b_pair<HD>(bv, vs + c * 16 * D::kLd, kk, lane);
#pragma unroll
          for (int mt = 0; mt < MQ; ++mt) {
            mma_bf16_16816(s[mt][0], qf[mt][kk], bk[0], bk[1]);
            mma_bf16_16816(s[mt][1], qf[mt][kk], bk[2], bk[3]);
            mma_bf16_16816(dp[mt][0], of[mt][kk], bv[0], bv[1]);
            mma_bf16_16816(dp[mt][1], of[mt][kk], bv[2], bv[3]);
          }
        }
        bool need_mask = c0 + 16 > kv_end;
        if constexpr (kCausal) need_mask = need_mask || c0 + 15 > warp_row0;
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt) {
          // Key c0 + nt * 8 + 2 t4 + (e & 1) is kept when nt * 8 + (e & 1) <= lim of its row.
          int lim[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            int last = kv_end - 1;
            if constexpr (kCausal) last = min(last, warp_row0 + mt * 16 + g + 8 * r);
            lim[r] = last - c0 - 2 * t4;
          }
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int r = e / 2;
              float pr = exp2_ftz(fmaf(s[mt][nt][e], p.scale_log2, -lse2[mt][r]));
              if (need_mask && nt * 8 + (e & 1) > lim[r]) pr = 0.f;
              dp[mt][nt][e] = pr * (dp[mt][nt][e] - ds0[mt][r]);
            }
          uint32_t da[4];
          pack_a(da, dp[mt]);
          mma_rows_t<HD>(dq[mt], da, ks + c * 16 * D::kLd, lane);  // dQ += dS K
        }
      }
    }
    __syncthreads();
  }

  if (warp_idle) return;
  uint16_t* dq_base = p.dqkv + static_cast<int64_t>(head) * HD;
#pragma unroll
  for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + mt * 16 + g + 8 * r;
      if (row >= q_end) continue;
#pragma unroll
      for (int d = 0; d < D::kNt; ++d)
        *reinterpret_cast<uint32_t*>(dq_base + row * p.width + d * 8 + 2 * t4) =
            pack_bf16x2(dq[mt][d][2 * r] * p.scale, dq[mt][d][2 * r + 1] * p.scale);
    }
}

// ---------------------------------------------------------------------------------------------
// Simple kernels for any head_dim up to 256: a warp per (row, head), lane l holding dims
// l, l + 32, ...; dot products by warp_sum (butterfly: every lane gets the same bits).
// ---------------------------------------------------------------------------------------------

constexpr int kSimpleWarps = 4;
constexpr int kSimpleDims = kAttentionTrainMaxHeadDim / kWarpSize;

__device__ __forceinline__ void load_dims(float (&x)[kSimpleDims], const uint16_t* p, int hd,
                                          int lane) {
#pragma unroll
  for (int j = 0; j < kSimpleDims; ++j) {
    const int d = lane + j * kWarpSize;
    x[j] = d < hd ? bf16_to_float(p[d]) : 0.f;
  }
}

__device__ __forceinline__ float dot_dims(const float (&a)[kSimpleDims], const uint16_t* p, int hd,
                                          int lane) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < kSimpleDims; ++j) {
    const int d = lane + j * kWarpSize;
    if (d < hd) s = fmaf(a[j], bf16_to_float(p[d]), s);
  }
  return warp_sum(s);
}

template <bool kCausal>
__global__ void __launch_bounds__(kSimpleWarps* kWarpSize)
    attn_fwd_simple_kernel(TrainParams p, int hd) {
  pdl_launch_dependents();
  pdl_wait();
  const int lane = threadIdx.x % kWarpSize;
  const int row =
      static_cast<int>(blockIdx.x) * kSimpleWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  const int head = blockIdx.y, kv_head = head / p.group;
  if (row >= p.total_rows) return;
  uint16_t* o = p.out + row * p.hidden + static_cast<int64_t>(head) * hd;
  int seg_b, seg_e;
  if (!row_segment(p, row, seg_b, seg_e)) {
    for (int d = lane; d < hd; d += kWarpSize) o[d] = 0;
    if (lane == 0) p.lse[row * p.nq + head] = 0.f;
    return;
  }
  const int kv_end = kCausal ? row + 1 : seg_e;
  float q[kSimpleDims], acc[kSimpleDims] = {};
  load_dims(q, p.qkv + row * p.width + static_cast<int64_t>(head) * hd, hd, lane);
  const uint16_t* k_base = p.qkv + p.hidden + static_cast<int64_t>(kv_head) * hd;
  const uint16_t* v_base = p.qkv + p.v_col + static_cast<int64_t>(kv_head) * hd;
  float m = -INFINITY, l = 0.f;
  for (int j = seg_b; j < kv_end; ++j) {
    const float s = dot_dims(q, k_base + j * p.width, hd, lane) * p.scale_log2;
    const float m_new = fmaxf(m, s);
    const float alpha = exp2_ftz(m - m_new), pr = exp2_ftz(s - m_new);
    l = l * alpha + pr;
    m = m_new;
#pragma unroll
    for (int jj = 0; jj < kSimpleDims; ++jj) {
      const int d = lane + jj * kWarpSize;
      acc[jj] = fmaf(pr, d < hd ? bf16_to_float(v_base[j * p.width + d]) : 0.f, acc[jj] * alpha);
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int jj = 0; jj < kSimpleDims; ++jj) {
    const int d = lane + jj * kWarpSize;
    if (d < hd) o[d] = float_to_bf16(acc[jj] * inv);
  }
  if (lane == 0) p.lse[row * p.nq + head] = l > 0.f ? (m + __log2f(l)) * kTrainLn2 : 0.f;
}

template <bool kCausal>
__global__ void __launch_bounds__(kSimpleWarps* kWarpSize)
    attn_bwd_dq_simple_kernel(TrainParams p, int hd) {
  pdl_launch_dependents();
  pdl_wait();
  const int lane = threadIdx.x % kWarpSize;
  const int row =
      static_cast<int>(blockIdx.x) * kSimpleWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  const int head = blockIdx.y, kv_head = head / p.group;
  if (row >= p.total_rows) return;
  int seg_b, seg_e;
  if (!row_segment(p, row, seg_b, seg_e)) return;  // zeroed by the pre kernel
  const int kv_end = kCausal ? row + 1 : seg_e;
  float q[kSimpleDims], go[kSimpleDims], dq[kSimpleDims] = {};
  load_dims(q, p.qkv + row * p.width + static_cast<int64_t>(head) * hd, hd, lane);
  load_dims(go, p.dout + row * p.hidden + static_cast<int64_t>(head) * hd, hd, lane);
  const float lse2 = p.lse[row * p.nq + head] * kTrainLog2e, ds0 = p.dsum[row * p.nq + head];
  const uint16_t* k_base = p.qkv + p.hidden + static_cast<int64_t>(kv_head) * hd;
  const uint16_t* v_base = p.qkv + p.v_col + static_cast<int64_t>(kv_head) * hd;
  for (int j = seg_b; j < kv_end; ++j) {
    const float s = dot_dims(q, k_base + j * p.width, hd, lane);
    const float pr = exp2_ftz(fmaf(s, p.scale_log2, -lse2));
    const float ds = pr * (dot_dims(go, v_base + j * p.width, hd, lane) - ds0);
#pragma unroll
    for (int jj = 0; jj < kSimpleDims; ++jj) {
      const int d = lane + jj * kWarpSize;
      if (d < hd) dq[jj] = fmaf(ds, bf16_to_float(k_base[j * p.width + d]), dq[jj]);
    }
  }
  uint16_t* out = p.dqkv + row * p.width + static_cast<int64_t>(head) * hd;
#pragma unroll
  for (int jj = 0; jj < kSimpleDims; ++jj) {
    const int d = lane + jj * kWarpSize;
    if (d < hd) out[d] = float_to_bf16(dq[jj] * p.scale);
  }
}

template <bool kCausal>
__global__ void __launch_bounds__(kSimpleWarps* kWarpSize)
    attn_bwd_dkv_simple_kernel(TrainParams p, int hd) {
  pdl_launch_dependents();
  pdl_wait();
  const int lane = threadIdx.x % kWarpSize;
  const int key =
      static_cast<int>(blockIdx.x) * kSimpleWarps + static_cast<int>(threadIdx.x) / kWarpSize;
  const int kv_head = blockIdx.y;
  if (key >= p.total_rows) return;
  int seg_b, seg_e;
  if (!row_segment(p, key, seg_b, seg_e)) return;  // zeroed by the pre kernel
  const int q_begin = kCausal ? key : seg_b;
  float k[kSimpleDims], v[kSimpleDims], dk[kSimpleDims] = {}, dv[kSimpleDims] = {};
  load_dims(k, p.qkv + key * p.width + p.hidden + static_cast<int64_t>(kv_head) * hd, hd, lane);
  load_dims(v, p.qkv + key * p.width + p.v_col + static_cast<int64_t>(kv_head) * hd, hd, lane);
  for (int h = kv_head * p.group; h < (kv_head + 1) * p.group; ++h) {
    for (int i = q_begin; i < seg_e; ++i) {
      const uint16_t* q = p.qkv + i * p.width + static_cast<int64_t>(h) * hd;
      const uint16_t* go = p.dout + i * p.hidden + static_cast<int64_t>(h) * hd;
      const float s = dot_dims(k, q, hd, lane);
      const float pr = exp2_ftz(fmaf(s, p.scale_log2, -p.lse[i * p.nq + h] * kTrainLog2e));
      const float ds = pr * (dot_dims(v, go, hd, lane) - p.dsum[i * p.nq + h]);
#pragma unroll
      for (int jj = 0; jj < kSimpleDims; ++jj) {
        const int d = lane + jj * kWarpSize;
        if (d < hd) {
          dv[jj] = fmaf(pr, bf16_to_float(go[d]), dv[jj]);
          dk[jj] = fmaf(ds, bf16_to_float(q[d]), dk[jj]);
        }
      }
    }
  }
  uint16_t* dk_out = p.dqkv + key * p.width + p.hidden + static_cast<int64_t>(kv_head) * hd;
  uint16_t* dv_out = p.dqkv + key * p.width + p.v_col + static_cast<int64_t>(kv_head) * hd;
#pragma unroll
  for (int jj = 0; jj < kSimpleDims; ++jj) {
    const int d = lane + jj * kWarpSize;
    if (d < hd) {
      dk_out[d] = float_to_bf16(dk[jj] * p.scale);
      dv_out[d] = float_to_bf16(dv[jj]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Configurations and dispatch
// ---------------------------------------------------------------------------------------------

template <int... HDs>
struct TrainHeadDims {
  static bool contains(int hd) { return ((hd == HDs) || ...); }
  template <typename F>
  static void with(int hd, F&& f) {
    const bool found = ((hd == HDs ? (f(std::integral_constant<int, HDs>{}), true) : false) || ...);
    if (!found) IRIS_FAIL("attention_train: no tensor-core kernel for head_dim ", hd);
  }
  template <typename F>
  static void each(F&& f) {
    (f(std::integral_constant<int, HDs>{}), ...);
  }
};
using FastHeadDims = TrainHeadDims<16, 32, 64, 72, 80, 128>;

// Tile shapes per head dim, from H100 timings (tools/attention_train_check.cu --bench; 16 query
// heads; "decoder" is causal 16/8 heads of 128 over 4096 rows, "vision" 16 x 1024-row segments):
// - Forward: up to head_dim 64 four warps of two m-tiles (each K/V fragment feeds two MMAs) over
//   64-key tiles: vision hd 64 in 283 us, where eight warps of one m-tile took 460. Above 64 eight
//   warps of one m-tile (two m-tiles' f32 output and scores would not fit in registers), 128-key
//   tiles: decoder 315 -> 281 us and vision hd 72 547 -> 481 against 64-key tiles (hd 64 went
//   283 -> 300 with them).
// - dK/dV: query tiles of 64 rows (32: 5-15% slower). Four warps (64 keys) up to head_dim 80,
//   as two independent blocks per SM wait less at their barriers: vision hd 64 1046 -> 954 us of
//   backward, hd 72 1433 -> 1295; eight warps (128 keys) at 128, where four measured 885 -> 912.
// - dQ: 128 query rows per block; 128-key tiles at head_dim 64 and 128 (decoder backward
//   886 -> 859 us against 64), four warps of 64-key tiles at 72 and 80 (hd 72 1257 -> 1194).
template <int HD>
using FwdFor = std::conditional_t<(HD <= 64), FwdCfg<HD, 2, 4, 64>, FwdCfg<HD, 1, 8, 128>>;
template <int HD>
using DkvFor = std::conditional_t<(HD <= 80), DkvCfg<HD, 4, 64>, DkvCfg<HD, 8, 64>>;
template <int HD>
using DqFor =
    std::conditional_t<(HD <= 64), DqCfg<HD, 2, 4, 128>,
                       std::conditional_t<(HD <= 80), DqCfg<HD, 1, 4, 64>, DqCfg<HD, 1, 8, 128>>>;

template <typename K>
void set_smem(K kernel, size_t bytes) {
  IRIS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(bytes)));
}

// Upper bound on the tiles of `rows` rows over all segments (each segment rounds up once).
unsigned tile_bound(int64_t total_rows, int rows, int n_segments) {
  const int64_t n = (total_rows + rows - 1) / rows + n_segments + 1;
  IRIS_CHECK(n <= 65535, "attention_train: ", total_rows, " rows in ", n_segments,
             " segments need more than 65535 tiles");
  return static_cast<unsigned>(n);
}

}  // namespace

bool attention_train_fast_head_dim(int head_dim) {
  return FastHeadDims::contains(head_dim);
}

void attention_train_init() {
  attention_train_wgmma_init();
  FastHeadDims::each([](auto hd) {
    constexpr int HD = decltype(hd)::value;
    set_smem(attn_fwd_kernel<FwdFor<HD>, false>, FwdFor<HD>::kSmem);
    set_smem(attn_fwd_kernel<FwdFor<HD>, true>, FwdFor<HD>::kSmem);
    set_smem(attn_bwd_dkv_kernel<DkvFor<HD>, false>, DkvFor<HD>::kSmem);
    set_smem(attn_bwd_dkv_kernel<DkvFor<HD>, true>, DkvFor<HD>::kSmem);
    set_smem(attn_bwd_dq_kernel<DqFor<HD>, false>, DqFor<HD>::kSmem);
    set_smem(attn_bwd_dq_kernel<DqFor<HD>, true>, DqFor<HD>::kSmem);
  });
}

void launch_attention_train_forward(uint16_t* out, float* lse, const uint16_t* qkv,
                                    const int32_t* cu_seqlens, const int32_t* real_rows,
                                    int n_segments, int64_t total_rows, int n_q_heads,
                                    int n_kv_heads, int head_dim, float scale, bool causal,
                                    int num_sms, cudaStream_t s) {
  (void)num_sms;
  if (total_rows <= 0) return;
  TrainParams p = make_params(qkv, cu_seqlens, real_rows, n_segments, total_rows, n_q_heads,
                              n_kv_heads, head_dim, scale);
  p.out = out;
  p.lse = lse;
  if (aligned16(qkv) && aligned16(out) &&
      launch_attention_train_forward_wgmma(out, lse, qkv, cu_seqlens, real_rows, n_segments,
                                           total_rows, n_q_heads, n_kv_heads, head_dim, scale,
                                           causal, s))
    return;
  const bool fast = FastHeadDims::contains(head_dim) && aligned16(qkv) && aligned16(out);
  if (fast) {
    FastHeadDims::with(head_dim, [&](auto hd) {
      using C = FwdFor<decltype(hd)::value>;
      const dim3 grid(n_q_heads, tile_bound(total_rows, C::kRows, n_segments));
      launch_programmatic(causal ? attn_fwd_kernel<C, true> : attn_fwd_kernel<C, false>, grid,
                          dim3(C::kThreads), C::kSmem, s, p);
      IRIS_CUDA_LAUNCH_CHECK();
    });
    return;
  }
  const dim3 grid(static_cast<unsigned>((total_rows + kSimpleWarps - 1) / kSimpleWarps), n_q_heads);
  launch_programmatic(causal ? attn_fwd_simple_kernel<true> : attn_fwd_simple_kernel<false>, grid,
                      dim3(kSimpleWarps * kWarpSize), 0, s, p, head_dim);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_attention_train_backward(uint16_t* dqkv, float* dsum, const uint16_t* dout,
                                     const uint16_t* out, const float* lse, const uint16_t* qkv,
                                     const int32_t* cu_seqlens, const int32_t* real_rows,
                                     int n_segments, int64_t total_rows, int n_q_heads,
                                     int n_kv_heads, int head_dim, float scale, bool causal,
                                     int num_sms, cudaStream_t s) {
  (void)num_sms;
  if (total_rows <= 0) return;
  TrainParams p = make_params(qkv, cu_seqlens, real_rows, n_segments, total_rows, n_q_heads,
                              n_kv_heads, head_dim, scale);
  p.out = const_cast<uint16_t*>(out);  // read only
  p.lse = const_cast<float*>(lse);     // read only
  p.dout = dout;
  p.dsum = dsum;
  p.dqkv = dqkv;

  const bool vec = head_dim % 8 == 0 && aligned16(dqkv) && aligned16(dout) && aligned16(out);
  const size_t pre_smem = vec ? static_cast<size_t>(p.hidden / 8) * sizeof(float) : 0;
  IRIS_CHECK(pre_smem <= 48 * 1024, "attention_train: ", n_q_heads, " heads of ", head_dim,
             " are too wide for the dsum kernel");
  launch_programmatic(vec ? attn_bwd_pre_kernel<true> : attn_bwd_pre_kernel<false>,
                      dim3(static_cast<unsigned>(total_rows)), dim3(128), pre_smem, s, p, head_dim);
  IRIS_CUDA_LAUNCH_CHECK();
  if (launch_train_backward_wgmma(p, head_dim, causal, s)) return;

  const bool fast =
      FastHeadDims::contains(head_dim) && aligned16(qkv) && aligned16(dout) && aligned16(dqkv);
  if (fast) {
    FastHeadDims::with(head_dim, [&](auto hd) {
      constexpr int HD = decltype(hd)::value;
      using K = DkvFor<HD>;
      launch_programmatic(causal ? attn_bwd_dkv_kernel<K, true> : attn_bwd_dkv_kernel<K, false>,
                          dim3(n_kv_heads, tile_bound(total_rows, K::kKeys, n_segments)),
                          dim3(K::kThreads), K::kSmem, s, p);
      IRIS_CUDA_LAUNCH_CHECK();
      using Q = DqFor<HD>;
      launch_programmatic(causal ? attn_bwd_dq_kernel<Q, true> : attn_bwd_dq_kernel<Q, false>,
                          dim3(n_q_heads, tile_bound(total_rows, Q::kRows, n_segments)),
                          dim3(Q::kThreads), Q::kSmem, s, p);
      IRIS_CUDA_LAUNCH_CHECK();
    });
    return;
  }
  const unsigned row_blocks = static_cast<unsigned>((total_rows + kSimpleWarps - 1) / kSimpleWarps);
  launch_programmatic(causal ? attn_bwd_dkv_simple_kernel<true> : attn_bwd_dkv_simple_kernel<false>,
                      dim3(row_blocks, n_kv_heads), dim3(kSimpleWarps * kWarpSize), 0, s, p,
                      head_dim);
  IRIS_CUDA_LAUNCH_CHECK();
  launch_programmatic(causal ? attn_bwd_dq_simple_kernel<true> : attn_bwd_dq_simple_kernel<false>,
                      dim3(row_blocks, n_q_heads), dim3(kSimpleWarps * kWarpSize), 0, s, p,
                      head_dim);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
