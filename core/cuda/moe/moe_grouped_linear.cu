// The experts' projections over the rows moe_dispatch sorted (core/backend_ops.inc:
// moe_grouped_linear): up to 16 rows (a decode step) a kernel that streams each row's expert
// weights once; beyond, tensor-core tiles (WMMA) with f32 accumulation whose blocks find their
// expert and row tile from the offsets on the device, so that a graph captured for one routing
// replays correctly for any other. The grid covers the most row tiles any split of R rows over E
// experts can have (R / 128 + E); blocks past the split's tiles exit at once.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <type_traits>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/moe/moe.h"

namespace iris::cuda {
namespace {

namespace wmma = nvcuda::wmma;

// Tensor-core tiles (WMMA, bf16 in, f32 accumulators): a block computes a 128 x 128 tile of the
// output with 8 warps of 64 x 32 each, staging 64-deep slices of both operands in shared memory;
// each thread fetches the next slice into registers while the warps multiply the current one.
constexpr int kTile = 128;
constexpr int kDepth = 64;
constexpr int kThreads = 256;
constexpr int kPad = 8;  // bf16 per staged row: keeps fragment rows 32-byte aligned, spreads banks
constexpr int kDeepLd = kDepth + kPad;                  // a staged [128, 64] slice's row length
constexpr int kWideLd = kTile + kPad;                   // a staged [64, 128] slice's row length
constexpr int kChunks = kTile * kDepth / 8 / kThreads;  // 16-byte chunks a thread moves a slice
using Frag16 = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// `count` (<= 8) consecutive bf16 from src, zeros after them: one 16-byte load when all 8 are
// there and src is 16-byte aligned.
__device__ __forceinline__ uint4 load8(const uint16_t* src, int64_t count) {
  if (count >= 8 && (reinterpret_cast<uintptr_t>(src) & 15) == 0)
    return *reinterpret_cast<const uint4*>(src);
  uint16_t v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = i < count ? src[i] : uint16_t{0};
  uint4 out;
  memcpy(&out, v, sizeof(out));
  return out;
}

// A slice of a row-major matrix (row length ld) whose rows from `rows` on and columns from
// `cols` on read as zeros: kDeep, [128 rows, 64 columns] into smem rows of kDeepLd; else [64
// rows, 128 columns] into rows of kWideLd. fetch() loads this thread's chunks into registers,
// put() stores them.
template <bool kDeep>
struct Slice {
  static constexpr int kCols = kDeep ? kDepth : kTile;
  static constexpr int kLd = kDeep ? kDeepLd : kWideLd;
  uint4 v[kChunks];
  __device__ __forceinline__ void fetch(const uint16_t* src, int64_t ld, int64_t rows,
                                        int64_t cols) {
#pragma unroll
    for (int q = 0; q < kChunks; ++q) {
      const int i = static_cast<int>(threadIdx.x) + q * kThreads;
      const int r = i / (kCols / 8), c = (i % (kCols / 8)) * 8;
      v[q] = load8(src + r * ld + c, r < rows ? cols - c : 0);
    }
  }
  __device__ __forceinline__ void put(uint16_t* smem) const {
#pragma unroll
    for (int q = 0; q < kChunks; ++q) {
      const int i = static_cast<int>(threadIdx.x) + q * kThreads;
      const int r = i / (kCols / 8), c = (i % (kCols / 8)) * 8;
      *reinterpret_cast<uint4*>(smem + r * kLd + c) = v[q];
    }
  }
};

// Each warp's 4 x 2 accumulators out through a 16 x 16 staging square: out(row, col) gets the
// value for the tile's rows below `rows` and columns below `cols`.
template <class Out>
__device__ __forceinline__ void drain(Frag16 (&acc)[4][2], float* stage, int warp_row, int warp_col,
                                      int64_t rows, int64_t cols, Out out) {
  const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      wmma::store_matrix_sync(stage, acc[i][j], 16, wmma::mem_row_major);
      __syncwarp();
      for (int v = lane; v < 256; v += 32) {
        const int r = warp_row + i * 16 + v / 16, c = warp_col + j * 16 + v % 16;
        if (r < rows && c < cols) out(r, c, stage[v]);
      }
      __syncwarp();
    }
}

// y[r, o] = sum over c < C of a[r, c] * B[c, o] for the rows r of one expert: the forward
// (a = x [R, K], B = w[e] [K, N] as stored) and, kBTransposed, the input gradient (a = dy [R, N],
// B = w[e]^T, w[e] [K, N] read along its rows). The block's expert and row tile: tile blockIdx.y
// of the experts' tiles laid end to end.
template <bool kBTransposed>
__global__ void __launch_bounds__(kThreads)
    moe_grouped_mma_kernel(uint16_t* __restrict__ y, const uint16_t* __restrict__ a,
                           const uint16_t* __restrict__ w, const int32_t* __restrict__ offsets,
                           int E, int64_t O, int64_t C) {
  int64_t tile = blockIdx.y;
  int e = 0;
  int64_t row0 = 0, rows = 0;
  for (; e < E; ++e) {
    const int64_t b = offsets[e], n = offsets[e + 1] - b;
    const int64_t tiles = (n + kTile - 1) / kTile;
    if (tile < tiles) {
      row0 = b + tile * kTile;
      rows = min(static_cast<int64_t>(kTile), n - tile * kTile);
      break;
    }
    tile -= tiles;
  }
  if (e == E) return;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const uint16_t* we = w + static_cast<int64_t>(e) * O * C;
  __shared__ __align__(32) uint16_t as[kTile * kDeepLd];
  __shared__ __align__(32)
      uint16_t bs[kTile * kDeepLd > kDepth * kWideLd ? kTile * kDeepLd : kDepth * kWideLd];
  __shared__ __align__(32) float stage[kThreads / 32][256];
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int warp_row = (warp / 4) * 64, warp_col = (warp % 4) * 32;
  Frag16 acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  using BLayout = std::conditional_t<kBTransposed, wmma::col_major, wmma::row_major>;
  Slice<true> sa;
  Slice<kBTransposed> sb;
  // B[c, o] = w[o * C + c] when transposed: rows of w[e] are the tile's columns.
  auto fetch = [&](int64_t c0) {
    sa.fetch(a + row0 * C + c0, C, rows, C - c0);
    if constexpr (kBTransposed)
      sb.fetch(we + col0 * C + c0, C, O - col0, C - c0);
    else
      sb.fetch(we + c0 * O + col0, O, C - c0, O - col0);
  };
  fetch(0);
  for (int64_t c0 = 0; c0 < C; c0 += kDepth) {
    sa.put(as);
    sb.put(bs);
    __syncthreads();
    if (c0 + kDepth < C) fetch(c0 + kDepth);
#pragma unroll
    for (int kk = 0; kk < kDepth; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, BLayout> fb[2];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        wmma::load_matrix_sync(
            fa[i], reinterpret_cast<const __nv_bfloat16*>(as + (warp_row + i * 16) * kDeepLd + kk),
            kDeepLd);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint16_t* p = kBTransposed ? bs + (warp_col + j * 16) * kDeepLd + kk
                                         : bs + kk * kWideLd + warp_col + j * 16;
        wmma::load_matrix_sync(fb[j], reinterpret_cast<const __nv_bfloat16*>(p),
                               kBTransposed ? kDeepLd : kWideLd);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
  drain(acc, stage[warp], warp_row, warp_col, rows, O - col0,
        [&](int r, int c, float v) { y[(row0 + r) * O + col0 + c] = float_to_bf16(v); });
}

// The few-rows path (a decode step's k slots, each row most often its own expert): what bounds it
// is streaming each row's expert weights once, so a block takes one row and a strip of kVec * 32
// columns, its warps split K and their partial sums are added in warp order (one order, the
// same bits every run), and each thread loads kVec consecutive weights at a time.
constexpr int kFewRowsWarps = 16;
constexpr int64_t kFewRowsMax = 16;  // rows up to which the few-rows kernel serves the forward

template <int kVec>
__global__ void __launch_bounds__(kFewRowsWarps * 32)
    moe_grouped_linear_few_rows_kernel(uint16_t* __restrict__ y, const uint16_t* __restrict__ x,
                                       const uint16_t* __restrict__ w,
                                       const int32_t* __restrict__ offsets, int E, int64_t N,
                                       int64_t K) {
  const int64_t r = blockIdx.y;
  if (r >= offsets[E]) return;
  // The row's expert: the last e with offsets[e] <= r.
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  const uint16_t* we = w + static_cast<int64_t>(lo) * K * N;
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * 32 * kVec + lane * kVec;
  const int64_t k_per_warp = (K + kFewRowsWarps - 1) / kFewRowsWarps;
  const int64_t k_begin = warp * k_per_warp, k_end = min(K, k_begin + k_per_warp);
  const uint16_t* xr = x + r * K;
  float acc[kVec] = {};
  if (n0 < N) {
#pragma unroll 4
    for (int64_t k = k_begin; k < k_end; ++k) {
      const float xv = bf16_to_float(xr[k]);
      const uint16_t* wk = we + k * N + n0;
      if constexpr (kVec == 4) {
        const uint2 u = *reinterpret_cast<const uint2*>(wk);
        acc[0] = fmaf(xv, bf16_to_float(static_cast<uint16_t>(u.x & 0xffffu)), acc[0]);
        acc[1] = fmaf(xv, bf16_to_float(static_cast<uint16_t>(u.x >> 16)), acc[1]);
        acc[2] = fmaf(xv, bf16_to_float(static_cast<uint16_t>(u.y & 0xffffu)), acc[2]);
        acc[3] = fmaf(xv, bf16_to_float(static_cast<uint16_t>(u.y >> 16)), acc[3]);
      } else {
        acc[0] = fmaf(xv, bf16_to_float(wk[0]), acc[0]);
      }
    }
  }
  __shared__ float partial[kFewRowsWarps][32 * kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) partial[warp][lane * kVec + j] = acc[j];
  __syncthreads();
  for (int c = static_cast<int>(threadIdx.x); c < 32 * kVec; c += kFewRowsWarps * 32) {
    const int64_t n = static_cast<int64_t>(blockIdx.x) * 32 * kVec + c;
    if (n >= N) continue;
    float sum = 0.0f;
    for (int v = 0; v < kFewRowsWarps; ++v) sum += partial[v][c];
    y[r * N + n] = float_to_bf16(sum);
  }
}

// dw[e] [K, N] += x[rows of e]^T . dy[rows of e]: one block a 128 x 128 tile of one expert's
// gradient, the expert's rows taken 64 at a time in order, so each element has one owner and one
// order. x's slice is staged as [rows, K columns] and read as the column-major x^T.
__global__ void __launch_bounds__(kThreads)
    moe_grouped_weight_grad_kernel(float* __restrict__ dw, const uint16_t* __restrict__ dy,
                                   const uint16_t* __restrict__ x,
                                   const int32_t* __restrict__ offsets, int64_t K, int64_t N) {
  const int e = static_cast<int>(blockIdx.z);
  const int64_t begin = offsets[e], rows = offsets[e + 1] - begin;
  if (rows <= 0) return;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTile,
                k0 = static_cast<int64_t>(blockIdx.y) * kTile;
  __shared__ __align__(32) uint16_t xs[kDepth * kWideLd];
  __shared__ __align__(32) uint16_t gs[kDepth * kWideLd];
  __shared__ __align__(32) float stage[kThreads / 32][256];
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int warp_row = (warp / 4) * 64, warp_col = (warp % 4) * 32;
  Frag16 acc[4][2];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  Slice<false> sx, sg;
  auto fetch = [&](int64_t r0) {
    sx.fetch(x + (begin + r0) * K + k0, K, rows - r0, K - k0);
    sg.fetch(dy + (begin + r0) * N + n0, N, rows - r0, N - n0);
  };
  fetch(0);
  for (int64_t r0 = 0; r0 < rows; r0 += kDepth) {
    sx.put(xs);
    sg.put(gs);
    __syncthreads();
    if (r0 + kDepth < rows) fetch(r0 + kDepth);
#pragma unroll
    for (int kk = 0; kk < kDepth; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major> fa[4];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb[2];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        wmma::load_matrix_sync(
            fa[i], reinterpret_cast<const __nv_bfloat16*>(xs + kk * kWideLd + warp_row + i * 16),
            kWideLd);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::load_matrix_sync(
            fb[j], reinterpret_cast<const __nv_bfloat16*>(gs + kk * kWideLd + warp_col + j * 16),
            kWideLd);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();
  }
  float* out = dw + static_cast<int64_t>(e) * K * N;
  drain(acc, stage[warp], warp_row, warp_col, K - k0, N - n0,
        [&](int r, int c, float v) { out[(k0 + r) * N + n0 + c] += v; });
}

}  // namespace

void launch_moe_grouped_linear(uint16_t* y, const uint16_t* x, const uint16_t* w,
                               const int32_t* offsets, int64_t R, int E, int64_t N, int64_t K,
                               cudaStream_t s) {
  if (R == 0 || N == 0) return;
  if (R <= kFewRowsMax) {
    // 8-byte weight loads need every row of w[e] to start 8-byte aligned.
    if (N % 4 == 0 && reinterpret_cast<uintptr_t>(w) % 8 == 0) {
      const dim3 grid(static_cast<unsigned>((N + 127) / 128), static_cast<unsigned>(R));
      moe_grouped_linear_few_rows_kernel<4>
          <<<grid, kFewRowsWarps * 32, 0, s>>>(y, x, w, offsets, E, N, K);
    } else {
      const dim3 grid(static_cast<unsigned>((N + 31) / 32), static_cast<unsigned>(R));
      moe_grouped_linear_few_rows_kernel<1>
          <<<grid, kFewRowsWarps * 32, 0, s>>>(y, x, w, offsets, E, N, K);
    }
    IRIS_CUDA_LAUNCH_CHECK();
    return;
  }
  const dim3 grid(static_cast<unsigned>((N + kTile - 1) / kTile),
                  static_cast<unsigned>((R + kTile - 1) / kTile + E));
  moe_grouped_mma_kernel<false><<<grid, kThreads, 0, s>>>(y, x, w, offsets, E, N, K);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_moe_grouped_linear_backward(uint16_t* dx, float* dw, const uint16_t* dy,
                                        const uint16_t* x, const uint16_t* w,
                                        const int32_t* offsets, int64_t R, int E, int64_t K,
                                        int64_t N, cudaStream_t s) {
  if (R == 0) return;
  // dx [R, K] = dy [R, N] . w[e]^T: the forward's kernel reading w[e] transposed.
  const dim3 grid(static_cast<unsigned>((K + kTile - 1) / kTile),
                  static_cast<unsigned>((R + kTile - 1) / kTile + E));
  moe_grouped_mma_kernel<true><<<grid, kThreads, 0, s>>>(dx, dy, w, offsets, E, K, N);
  IRIS_CUDA_LAUNCH_CHECK();
  if (dw == nullptr) return;
  const dim3 wgrid(static_cast<unsigned>((N + kTile - 1) / kTile),
                   static_cast<unsigned>((K + kTile - 1) / kTile), static_cast<unsigned>(E));
  moe_grouped_weight_grad_kernel<<<wgrid, kThreads, 0, s>>>(dw, dy, x, offsets, K, N);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
