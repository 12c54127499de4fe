// Elementwise kernels of the CUDA backend: add, the activations (GELU tanh and erf, QuickGELU,
// SwiGLU) and their backwards, and the f32 <-> bf16 conversions. All arithmetic runs in f32 on
// bf16 storage and rounds once per materialised bf16 tensor, matching torch's opmath.
#include <cfloat>
#include <cmath>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/elementwise/elementwise.h"
#include "core/dropout_draw.h"

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

// f32 operands (gradients): one rounding per element, as the CPU backend's add.
__global__ void add_f32_kernel(float* y, const float* a, const float* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __fadd_rn(a[i], b[i]);
}

template <typename T>
__global__ void dropout_kernel(T* y, const T* x, int64_t n, uint32_t threshold, float scale,
                               const int64_t* seed, uint64_t stream) {
  const int64_t s = *seed;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = ld(x, i);
    const bool keep = s < 0 || iris::dropout_draw(static_cast<uint64_t>(s), stream,
                                                  static_cast<uint64_t>(i)) >= threshold;
    st(y, i, keep ? (s < 0 ? v : __fmul_rn(v, scale)) : 0.0f);
  }
}

// One thread per element of the block; the columns are few (an adapter's output rows), so no
// vector loads: the GEMMs around it dominate.
template <typename TD, typename TS>
__global__ void add_column_block_kernel(TD* dst, int64_t dst_ld, int64_t dst_col, const TS* src,
                                        int64_t src_ld, int64_t src_col, int64_t rows, int64_t cols,
                                        float scale, bool accumulate) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    const int64_t d = r * dst_ld + dst_col + c;
    const float v = __fmul_rn(scale, ld(src, r * src_ld + src_col + c));
    st(dst, d, accumulate ? __fadd_rn(ld(dst, d), v) : v);
  }
}

// The same, 8 elements a thread (16-byte loads and stores): every row's block starts at a
// multiple of 8 elements of 16-byte aligned buffers, and cols is a multiple of 8. A LoRA
// adapter's block of a projection's output (widths of 128 and more) always is.
template <typename TD, typename TS>
__global__ void add_column_block_x8_kernel(TD* dst, int64_t dst_ld, int64_t dst_col, const TS* src,
                                           int64_t src_ld, int64_t src_col, int64_t rows,
                                           int64_t cols8, float scale, bool accumulate) {
  const int64_t n = rows * cols8;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols8, c = (i % cols8) * 8;
    TD* d = dst + r * dst_ld + dst_col + c;
    float v[8], out[8];
    ld8(src + r * src_ld + src_col + c, v);
    if (accumulate) ld8(d, out);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float x = __fmul_rn(scale, v[k]);
      out[k] = accumulate ? __fadd_rn(out[k], x) : x;
    }
    st8(d, out);
  }
}

template <typename TD, typename TS>
void launch_column_block_t(TD* dst, int64_t dst_ld, int64_t dst_col, const TS* src, int64_t src_ld,
                           int64_t src_col, int64_t rows, int64_t cols, float scale,
                           bool accumulate, cudaStream_t s) {
  const bool by8 = cols % 8 == 0 && dst_ld % 8 == 0 && dst_col % 8 == 0 && src_ld % 8 == 0 &&
                   src_col % 8 == 0 && aligned16(dst) && aligned16(src);
  if (by8)
    add_column_block_x8_kernel<TD, TS><<<grid_for(rows * cols / 8), kThreads, 0, s>>>(
        dst, dst_ld, dst_col, src, src_ld, src_col, rows, cols / 8, scale, accumulate);
  else
    add_column_block_kernel<TD, TS><<<grid_for(rows * cols), kThreads, 0, s>>>(
        dst, dst_ld, dst_col, src, src_ld, src_col, rows, cols, scale, accumulate);
  IRIS_CUDA_LAUNCH_CHECK();
}

// ---- conversion -----------------------------------------------------------------------------

template <typename TD, typename TS>
__global__ void convert_kernel(TD* __restrict__ dst, const TS* __restrict__ src, int64_t n,
                               int64_t n_vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < n_vec; i += stride) {
    float f[8];
    ld8(src + i * 8, f);
    st8(dst + i * 8, f);
  }
  for (int64_t i = n_vec * 8 + tid; i < n; i += stride) st(dst, i, ld(src, i));
}

template <typename TD, typename TS>
void launch_convert(TD* dst, const TS* src, int64_t n, cudaStream_t s) {
  if (n <= 0) return;
  const int64_t n_vec = aligned16(dst) && aligned16(src) ? n / 8 : 0;
  convert_kernel<<<grid_for(n_vec > 0 ? n_vec : n), kThreads, 0, s>>>(dst, src, n, n_vec);
  IRIS_CUDA_LAUNCH_CHECK();
}

// ---- the activations' backwards ---------------------------------------------------------------

struct GeluTanhGrad {
  __device__ float operator()(float v) const {
    const float k = 0.7978845608028654f, c = 0.044715f;
    const float t = tanhf(k * (v + c * v * v * v));
    const float du = k * (1.f + 3.f * c * v * v);
    return 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du;
  }
};

struct GeluErfGrad {
  __device__ float operator()(float v) const {
    const float cdf = 0.5f * (1.f + erff(v * 0.7071067811865476f));
    const float pdf = 0.3989422804014327f * expf(-0.5f * v * v);
    return cdf + v * pdf;
  }
};

struct QuickGeluGrad {
  __device__ float operator()(float v) const {
    const float s = 1.f / (1.f + expf(-1.702f * v));
    return s + 1.702f * v * s * (1.f - s);
  }
};

// dx = dy * f'(x); every element is read before it is written by the same thread.
template <class Op>
__global__ void act_backward_kernel(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                                    int64_t n_vec, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < n_vec; i += stride) {
    float g[8], v[8];
    load8(dy + i * 8, g);
    load8(x + i * 8, v);
#pragma unroll
    for (int k = 0; k < 8; ++k) g[k] *= op(v[k]);
    store8(dx + i * 8, g);
  }
  for (int64_t i = n_vec * 8 + tid; i < n; i += stride)
    dx[i] = float_to_bf16(bf16_to_float(dy[i]) * op(bf16_to_float(x[i])));
}

template <class Op>
void launch_act_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                         cudaStream_t s) {
  if (n <= 0) return;
  const int64_t n_vec = aligned16(dx) && aligned16(dy) && aligned16(x) ? n / 8 : 0;
  act_backward_kernel<<<grid_for(n_vec > 0 ? n_vec : n), kThreads, 0, s>>>(dx, dy, x, n, n_vec,
                                                                           Op{});
  IRIS_CUDA_LAUNCH_CHECK();
}

__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
  const float sig = 1.f / (1.f + expf(-g));
  dg = d * u * sig * (1.f + g * (1.f - sig));
  du = d * g * sig;
}

// Reads gate and up of an element before writing both: dgate_up may alias gate_up.
__global__ void swiglu_backward_kernel(uint16_t* dgu, const uint16_t* dy, const uint16_t* gu,
                                       int64_t rows, int64_t inter, bool vec) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (vec) {
    const int64_t per_row = inter / 8, total = rows * per_row;
    for (int64_t i = tid; i < total; i += stride) {
      const int64_t r = i / per_row, c = (i % per_row) * 8;
      float d[8], g[8], u[8], dg[8], du[8];
      load8(dy + r * inter + c, d);
      load8(gu + r * 2 * inter + c, g);
      load8(gu + r * 2 * inter + inter + c, u);
#pragma unroll
      for (int k = 0; k < 8; ++k) swiglu_grad(d[k], g[k], u[k], dg[k], du[k]);
      store8(dgu + r * 2 * inter + c, dg);
      store8(dgu + r * 2 * inter + inter + c, du);
    }
  } else {
    const int64_t total = rows * inter;
    for (int64_t i = tid; i < total; i += stride) {
      const int64_t r = i / inter, c = i % inter;
      float dg, du;
      swiglu_grad(bf16_to_float(dy[i]), bf16_to_float(gu[r * 2 * inter + c]),
                  bf16_to_float(gu[r * 2 * inter + inter + c]), dg, du);
      dgu[r * 2 * inter + c] = float_to_bf16(dg);
      dgu[r * 2 * inter + inter + c] = float_to_bf16(du);
    }
  }
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

void launch_add_column_block(void* dst, bool dst_f32, int64_t dst_ld, int64_t dst_col,
                             const void* src, bool src_f32, int64_t src_ld, int64_t src_col,
                             int64_t rows, int64_t cols, float scale, bool accumulate,
                             cudaStream_t s) {
  if (rows == 0 || cols == 0) return;
  auto* df = static_cast<float*>(dst);
  auto* db = static_cast<uint16_t*>(dst);
  const auto* sf = static_cast<const float*>(src);
  const auto* sb = static_cast<const uint16_t*>(src);
  if (dst_f32 && src_f32)
    launch_column_block_t(df, dst_ld, dst_col, sf, src_ld, src_col, rows, cols, scale, accumulate,
                          s);
  else if (dst_f32)
    launch_column_block_t(df, dst_ld, dst_col, sb, src_ld, src_col, rows, cols, scale, accumulate,
                          s);
  else if (src_f32)
    launch_column_block_t(db, dst_ld, dst_col, sf, src_ld, src_col, rows, cols, scale, accumulate,
                          s);
  else
    launch_column_block_t(db, dst_ld, dst_col, sb, src_ld, src_col, rows, cols, scale, accumulate,
                          s);
}

void launch_dropout(void* y, const void* x, bool f32, int64_t n, uint32_t threshold, float scale,
                    const int64_t* seed, uint64_t stream, cudaStream_t s) {
  if (n == 0) return;
  if (f32)
    dropout_kernel<<<grid_for(n), kThreads, 0, s>>>(
        static_cast<float*>(y), static_cast<const float*>(x), n, threshold, scale, seed, stream);
  else
    dropout_kernel<<<grid_for(n), kThreads, 0, s>>>(static_cast<uint16_t*>(y),
                                                    static_cast<const uint16_t*>(x), n, threshold,
                                                    scale, seed, stream);
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

void launch_convert_f32_to_bf16(uint16_t* dst, const float* src, int64_t n, cudaStream_t s) {
  launch_convert(dst, src, n, s);
}
void launch_convert_bf16_to_f32(float* dst, const uint16_t* src, int64_t n, cudaStream_t s) {
  launch_convert(dst, src, n, s);
}

void launch_gelu_tanh_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                               cudaStream_t s) {
  launch_act_backward<GeluTanhGrad>(dx, dy, x, n, s);
}

void launch_gelu_erf_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                              cudaStream_t s) {
  launch_act_backward<GeluErfGrad>(dx, dy, x, n, s);
}

void launch_quick_gelu_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                                cudaStream_t s) {
  launch_act_backward<QuickGeluGrad>(dx, dy, x, n, s);
}

void launch_swiglu_backward(uint16_t* dgate_up, const uint16_t* dy, const uint16_t* gate_up,
                            int64_t rows, int64_t inter, cudaStream_t s) {
  if (rows == 0 || inter == 0) return;
  const bool vec = inter % 8 == 0 && aligned16(dgate_up) && aligned16(dy) && aligned16(gate_up);
  const int64_t work = vec ? rows * inter / 8 : rows * inter;
  swiglu_backward_kernel<<<grid_for(work), kThreads, 0, s>>>(dgate_up, dy, gate_up, rows, inter,
                                                             vec);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
