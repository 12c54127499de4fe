// Rows moved by index: the embedding lookup, scatter_rows, the interpolated position-embedding
// rows and gather_rows, and the backwards of the lookups. The forwards round once per
// materialised bf16 tensor, as torch does; the backwards add the rows that meet in one output row
// in a fixed order (no float atomics), so the same inputs give the same bits.
#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/rows/rows.h"

namespace iris::cuda {
namespace {

constexpr int kThreads = 256;

// One block per output row; `vec` when the row length and the pointers allow 16-byte access.
__global__ void embedding_kernel(uint16_t* y, const uint16_t* table, const int32_t* ids,
                                 int64_t vocab, int64_t cols, bool vec) {
  const int64_t row = blockIdx.x;
  const int32_t id = ids[row];
  const bool valid = id >= 0 && id < vocab;
  const uint16_t* src = table + static_cast<int64_t>(valid ? id : 0) * cols;
  uint16_t* dst = y + row * cols;
  if (vec) {
    for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x) {
      const uint4 v = valid ? reinterpret_cast<const uint4*>(src)[c] : make_uint4(0, 0, 0, 0);
      reinterpret_cast<uint4*>(dst)[c] = v;
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = valid ? src[c] : 0;
  }
}

__global__ void scatter_rows_kernel(uint16_t* dst, const uint16_t* src, const int32_t* index,
                                    int64_t dst_rows, int64_t cols, bool accumulate, bool vec) {
  const int64_t row = blockIdx.x;
  const int32_t to = index[row];
  if (to < 0 || to >= dst_rows) return;
  const uint16_t* s = src + row * cols;
  uint16_t* d = dst + static_cast<int64_t>(to) * cols;
  if (vec) {
    for (int64_t c = threadIdx.x; c < cols / 8; c += blockDim.x) {
      if (!accumulate) {
        reinterpret_cast<uint4*>(d)[c] = reinterpret_cast<const uint4*>(s)[c];
      } else {
        float a[8], b[8];
        load8(d + c * 8, a);
        load8(s + c * 8, b);
#pragma unroll
        for (int k = 0; k < 8; ++k) a[k] += b[k];
        store8(d + c * 8, a);
      }
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
      d[c] = accumulate ? float_to_bf16(bf16_to_float(d[c]) + bf16_to_float(s[c])) : s[c];
  }
}

// y += bf16(sum_k w_k * table[idx_k]): the weighted sum stays in f32 and is rounded once, then
// added in bf16 (spec 3.2).
__global__ void add_interpolated_rows_kernel(uint16_t* y, const uint16_t* table,
                                             const int32_t* index, const float* weight,
                                             int64_t table_rows, int64_t cols, bool vec) {
  const int64_t row = blockIdx.x;
  const uint16_t* src[4];
  float w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int32_t idx = index[row * 4 + k];
    const bool valid = idx >= 0 && idx < table_rows;
    src[k] = table + static_cast<int64_t>(valid ? idx : 0) * cols;
    w[k] = valid ? weight[row * 4 + k] : 0.f;
  }
  uint16_t* dst = y + row * cols;
  if (vec) {
    for (int64_t c = threadIdx.x * 8; c < cols; c += blockDim.x * 8) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, t[8], out[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        load8(src[k] + c, t);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += w[k] * t[e];
      }
      load8(dst + c, out);
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] += round_bf16(acc[e]);
      store8(dst + c, out);
    }
  } else {
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < 4; ++k) acc += w[k] * bf16_to_float(src[k][c]);
      dst[c] = float_to_bf16(bf16_to_float(dst[c]) + round_bf16(acc));
    }
  }
}

int row_threads(int64_t cols_per_thread_unit) {
  // Enough threads to cover a row of 1024-4096 elements in one 16-byte pass, no more.
  if (cols_per_thread_unit >= 256) return 256;
  if (cols_per_thread_unit >= 128) return 128;
  if (cols_per_thread_unit >= 64) return 64;
  return 32;
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

}  // namespace

void launch_embedding(uint16_t* y, const uint16_t* table, const int32_t* ids, int64_t n_ids,
                      int64_t vocab, int64_t cols, cudaStream_t s) {
  if (n_ids == 0 || cols == 0) return;
  const bool vec = cols % 8 == 0 && aligned16(y) && aligned16(table);
  embedding_kernel<<<static_cast<unsigned>(n_ids), row_threads(vec ? cols / 8 : cols), 0, s>>>(
      y, table, ids, vocab, cols, vec);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_scatter_rows(uint16_t* dst, const uint16_t* src, const int32_t* index, int64_t n,
                         int64_t dst_rows, int64_t cols, bool accumulate, cudaStream_t s) {
  if (n == 0 || cols == 0) return;
  const bool vec = cols % 8 == 0 && aligned16(dst) && aligned16(src);
  scatter_rows_kernel<<<static_cast<unsigned>(n), row_threads(vec ? cols / 8 : cols), 0, s>>>(
      dst, src, index, dst_rows, cols, accumulate, vec);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_add_interpolated_rows(uint16_t* y, const uint16_t* table, const int32_t* index,
                                  const float* weight, int64_t rows, int64_t table_rows,
                                  int64_t cols, cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  const bool vec = cols % 8 == 0 && aligned16(y) && aligned16(table);
  add_interpolated_rows_kernel<<<static_cast<unsigned>(rows), row_threads(vec ? cols / 8 : cols), 0,
                                 s>>>(y, table, index, weight, table_rows, cols, vec);
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

}  // namespace iris::cuda
