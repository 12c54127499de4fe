// Host-side launchers of the elementwise kernels (elementwise.cu): add, the activations and their
// backwards, and the f32 <-> bf16 conversions. bf16 travels as uint16_t bits; every launcher
// enqueues on `s` without synchronising or allocating (graph-capturable).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace iris::cuda {

// ---- forwards ----
void launch_add(uint16_t* y, const uint16_t* a, const uint16_t* b, int64_t n, cudaStream_t s);
void launch_add_f32(float* y, const float* a, const float* b, int64_t n, cudaStream_t s);
void launch_gelu_tanh(uint16_t* y, const uint16_t* x, int64_t n, cudaStream_t s);
void launch_gelu_erf(uint16_t* y, const uint16_t* x, int64_t n, cudaStream_t s);
void launch_quick_gelu(uint16_t* y, const uint16_t* x, int64_t n, cudaStream_t s);
void launch_swiglu(uint16_t* y, const uint16_t* gate_up, int64_t rows, int64_t inter,
                   cudaStream_t s);

// dst[:, dst_col + c] = scale * src[:, src_col + c] (+ dst when accumulate), c < cols, rows
// rows; dst_ld and src_ld are the matrices' widths; f32 math, one rounding.
void launch_add_column_block(void* dst, bool dst_f32, int64_t dst_ld, int64_t dst_col,
                             const void* src, bool src_f32, int64_t src_ld, int64_t src_col,
                             int64_t rows, int64_t cols, float scale, bool accumulate,
                             cudaStream_t s);

// y = x / (1 - p) where dropout_draw(*seed, stream, i) >= threshold, else 0; *seed < 0: y = x.
void launch_dropout(void* y, const void* x, bool f32, int64_t n, uint32_t threshold, float scale,
                    const int64_t* seed, uint64_t stream, cudaStream_t s);

// ---- conversion ----
void launch_convert_f32_to_bf16(uint16_t* dst, const float* src, int64_t n, cudaStream_t s);
void launch_convert_bf16_to_f32(float* dst, const uint16_t* src, int64_t n, cudaStream_t s);

// ---- the activations' backwards (bf16; dx may alias dy) ----
void launch_gelu_tanh_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                               cudaStream_t s);
void launch_quick_gelu_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                                cudaStream_t s);
void launch_gelu_erf_backward(uint16_t* dx, const uint16_t* dy, const uint16_t* x, int64_t n,
                              cudaStream_t s);
// dgate_up[rows, 2 inter] from dy[rows, inter] and gate_up[rows, 2 inter] (may alias dgate_up).
void launch_swiglu_backward(uint16_t* dgate_up, const uint16_t* dy, const uint16_t* gate_up,
                            int64_t rows, int64_t inter, cudaStream_t s);

}  // namespace iris::cuda
