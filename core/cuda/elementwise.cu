// Elementwise and reduction kernels of the CUDA backend. All arithmetic runs in f32 on bf16
// storage and rounds once per materialised bf16 tensor, matching torch's opmath.
#include <cfloat>
#include <cmath>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/kernels.h"

namespace iris::cuda {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops cap the grid: enough blocks to fill every SM several times over.
constexpr int64_t kMaxBlocks = 8192;

int grid_for(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

struct AddOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};

struct GeluTanhOp {
  __device__ float operator()(float x) const {
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * x * (1.f + tanhf(k * (x + 0.044715f * x * x * x)));
  }
};

struct GeluErfOp {
  __device__ float operator()(float x) const {
    return 0.5f * x * (1.f + erff(x * 0.7071067811865476f));
  }
};

struct QuickGeluOp {
  __device__ float operator()(float x) const { return x / (1.f + __expf(-1.702f * x)); }
};

// n_vec 16-byte vectors first, then the n % 8 tail (or everything, when unaligned) one by one.
template <class Op>
__global__ void unary_kernel(uint16_t* y, const uint16_t* x, int64_t n, int64_t n_vec, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < n_vec; i += stride) {
    float f[8];
    load8(x + i * 8, f);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = op(f[k]);
    store8(y + i * 8, f);
  }
  for (int64_t i = n_vec * 8 + tid; i < n; i += stride)
    y[i] = float_to_bf16(op(bf16_to_float(x[i])));
}

template <class Op>
__global__ void binary_kernel(uint16_t* y, const uint16_t* a, const uint16_t* b, int64_t n,
                              int64_t n_vec, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < n_vec; i += stride) {
    float fa[8], fb[8];
    load8(a + i * 8, fa);
    load8(b + i * 8, fb);
#pragma unroll
    for (int k = 0; k < 8; ++k) fa[k] = op(fa[k], fb[k]);
    store8(y + i * 8, fa);
  }
  for (int64_t i = n_vec * 8 + tid; i < n; i += stride)
    y[i] = float_to_bf16(op(bf16_to_float(a[i]), bf16_to_float(b[i])));
}

template <class Op>
void launch_unary(uint16_t* y, const uint16_t* x, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  const int64_t n_vec = aligned16(x) && aligned16(y) ? n / 8 : 0;
  const int64_t work = n_vec > 0 ? n_vec : n;
  unary_kernel<<<grid_for(work), kThreads, 0, s>>>(y, x, n, n_vec, Op{});
  IRIS_CUDA_LAUNCH_CHECK();
}

// HF: act_fn(gate) * up, two bf16 tensors: silu is rounded before the product.
__global__ void swiglu_kernel(uint16_t* y, const uint16_t* gu, int64_t rows, int64_t inter,
                              bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    const int64_t per_row = inter / 8, total = rows * per_row;
    for (int64_t i = tid; i < total; i += stride) {
      const int64_t r = i / per_row, c = (i % per_row) * 8;
      float g[8], u[8];
      load8(gu + r * 2 * inter + c, g);
      load8(gu + r * 2 * inter + inter + c, u);
#pragma unroll
      for (int k = 0; k < 8; ++k) g[k] = round_bf16(silu(g[k])) * u[k];
      store8(y + r * inter + c, g);
    }
  } else {
    const int64_t total = rows * inter;
    for (int64_t i = tid; i < total; i += stride) {
      const int64_t r = i / inter, c = i % inter;
      const float g = bf16_to_float(gu[r * 2 * inter + c]);
      const float u = bf16_to_float(gu[r * 2 * inter + inter + c]);
      y[i] = float_to_bf16(round_bf16(silu(g)) * u);
    }
  }
}

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

// f32 operands (gradients): one rounding per element, as the CPU backend's add.
__global__ void add_f32_kernel(float* y, const float* a, const float* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __fadd_rn(a[i], b[i]);
}

}  // namespace

void launch_add(uint16_t* y, const uint16_t* a, const uint16_t* b, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  const int64_t n_vec = aligned16(y) && aligned16(a) && aligned16(b) ? n / 8 : 0;
  binary_kernel<<<grid_for(n_vec > 0 ? n_vec : n), kThreads, 0, s>>>(y, a, b, n, n_vec, AddOp{});
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_add_f32(float* y, const float* a, const float* b, int64_t n, cudaStream_t s) {
  if (n == 0) return;
  add_f32_kernel<<<grid_for(n), kThreads, 0, s>>>(y, a, b, n);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_gelu_tanh(uint16_t* y, const uint16_t* x, int64_t n, cudaStream_t s) {
  launch_unary<GeluTanhOp>(y, x, n, s);
}

void launch_gelu_erf(uint16_t* y, const uint16_t* x, int64_t n, cudaStream_t s) {
  launch_unary<GeluErfOp>(y, x, n, s);
}

void launch_quick_gelu(uint16_t* y, const uint16_t* x, int64_t n, cudaStream_t s) {
  launch_unary<QuickGeluOp>(y, x, n, s);
}

void launch_swiglu(uint16_t* y, const uint16_t* gate_up, int64_t rows, int64_t inter,
                   cudaStream_t s) {
  if (rows == 0 || inter == 0) return;
  const bool vec = inter % 8 == 0 && aligned16(y) && aligned16(gate_up);
  const int64_t work = vec ? rows * inter / 8 : rows * inter;
  swiglu_kernel<<<grid_for(work), kThreads, 0, s>>>(y, gate_up, rows, inter, vec);
  IRIS_CUDA_LAUNCH_CHECK();
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

}  // namespace iris::cuda
