// The experts' projections over the rows moe_dispatch sorted (core/backend_ops.inc:
// moe_grouped_linear): up to 16 rows (a decode step) a kernel that streams each row's expert
// weights once; beyond, a plain shared-memory tiled GEMM with f32 accumulation whose blocks find
// their expert and row tile from the offsets on the device, so that a graph captured for one
// routing replays correctly for any other. The grid covers the most row tiles any split of R rows
// over E experts can have (R / 64 + E); blocks past the split's tiles exit at once.
#include <cuda_runtime.h>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/moe/moe.h"

namespace iris::cuda {
namespace {

constexpr int kTile = 64;   // rows and columns of y a block computes
constexpr int kDepth = 16;  // the K slice a block stages at a time
constexpr int kThreads = 256;

// y[r, n] = sum over i < K of x[r, i] * w[e][i * in_stride + n * out_stride]: the forward with
// w[e] [K, N] (in_stride N, out_stride 1), the input gradient with its transpose. kNContiguous:
// the weights are staged with consecutive threads on consecutive n (the forward's contiguous
// axis), else on consecutive i (the transpose's), so that each warp's loads are coalesced.
template <bool kNContiguous>
__global__ void moe_grouped_linear_kernel(uint16_t* __restrict__ y, const uint16_t* __restrict__ x,
                                          const uint16_t* __restrict__ w,
                                          const int32_t* __restrict__ offsets, int E, int64_t N,
                                          int64_t K, int64_t in_stride, int64_t out_stride) {
  // This block's expert and row tile: tile blockIdx.y of the experts' tiles laid end to end.
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
  const uint16_t* we = w + static_cast<int64_t>(e) * N * K;
  __shared__ float xs[kDepth][kTile + 1];
  __shared__ float ws[kDepth][kTile + 1];
  const int tx = static_cast<int>(threadIdx.x % 16), ty = static_cast<int>(threadIdx.x / 16);
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    for (int i = static_cast<int>(threadIdx.x); i < kDepth * kTile; i += kThreads) {
      const int r = i / kDepth, kk = i % kDepth;
      const int64_t kg = k0 + kk;
      xs[kk][r] = r < rows && kg < K ? bf16_to_float(x[(row0 + r) * K + kg]) : 0.0f;
      const int c = kNContiguous ? i % kTile : r, kw = kNContiguous ? i / kTile : kk;
      const int64_t n = col0 + c, kgw = k0 + kw;
      ws[kw][c] = n < N && kgw < K ? bf16_to_float(we[kgw * in_stride + n * out_stride]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kDepth; ++kk) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = xs[kk][ty + 16 * i];
        b[i] = ws[kk][tx + 16 * i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = ty + 16 * i;
    if (r >= rows) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = col0 + tx + 16 * j;
      if (n < N) y[(row0 + r) * N + n] = float_to_bf16(acc[i][j]);
    }
  }
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

// dw[e] [K, N] += x[rows of e]^T . dy[rows of e]: one block a 64 x 64 tile of one expert's
// gradient, its rows taken 16 at a time in order, so each element has one owner and one order.
__global__ void moe_grouped_weight_grad_kernel(float* __restrict__ dw,
                                               const uint16_t* __restrict__ dy,
                                               const uint16_t* __restrict__ x,
                                               const int32_t* __restrict__ offsets, int64_t K,
                                               int64_t N) {
  const int e = static_cast<int>(blockIdx.z);
  const int64_t begin = offsets[e], rows = offsets[e + 1] - begin;
  if (rows <= 0) return;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kTile,
                k0 = static_cast<int64_t>(blockIdx.y) * kTile;
  __shared__ float xs[kDepth][kTile + 1];
  __shared__ float gs[kDepth][kTile + 1];
  const int tx = static_cast<int>(threadIdx.x % 16), ty = static_cast<int>(threadIdx.x / 16);
  float acc[4][4] = {};
  for (int64_t r0 = 0; r0 < rows; r0 += kDepth) {
    for (int i = static_cast<int>(threadIdx.x); i < kDepth * kTile; i += kThreads) {
      const int c = i % kTile, rr = i / kTile;
      const int64_t r = r0 + rr;
      xs[rr][c] = r < rows && k0 + c < K ? bf16_to_float(x[(begin + r) * K + k0 + c]) : 0.0f;
      gs[rr][c] = r < rows && n0 + c < N ? bf16_to_float(dy[(begin + r) * N + n0 + c]) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kDepth; ++rr) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = xs[rr][ty + 16 * i];
        b[i] = gs[rr][tx + 16 * i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
  float* out = dw + static_cast<int64_t>(e) * K * N;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t k = k0 + ty + 16 * i;
    if (k >= K) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tx + 16 * j;
      if (n < N) out[k * N + n] += acc[i][j];
    }
  }
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
  moe_grouped_linear_kernel<true><<<grid, kThreads, 0, s>>>(y, x, w, offsets, E, N, K, N, 1);
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
  moe_grouped_linear_kernel<false><<<grid, kThreads, 0, s>>>(dx, dy, w, offsets, E, K, N, 1, N);
  IRIS_CUDA_LAUNCH_CHECK();
  if (dw == nullptr) return;
  const dim3 wgrid(static_cast<unsigned>((N + kTile - 1) / kTile),
                   static_cast<unsigned>((K + kTile - 1) / kTile), static_cast<unsigned>(E));
  moe_grouped_weight_grad_kernel<<<wgrid, kThreads, 0, s>>>(dw, dy, x, offsets, K, N);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
