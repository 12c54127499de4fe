// Host-side launchers of the CUDA backend's training kernels (train_kernels.cu): conversions and
// the activations' backwards.
// Same conventions as kernels.h: bf16 travels as uint16_t bits, every launcher enqueues on
// `stream` without synchronising or allocating (graph-capturable). Parameters typed `const void*`
// with a `bool ..._f32` flag are f32 when the flag is set, bf16 otherwise.
//
// Determinism: no float atomics anywhere. Reductions run on a fixed number of partial blocks that
// write to `scratch` (train_scratch.h), then a second kernel adds the partials in order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace iris::cuda {

// ---- conversion ----
void launch_convert_f32_to_bf16(uint16_t* dst, const float* src, int64_t n, cudaStream_t s);
void launch_convert_bf16_to_f32(float* dst, const uint16_t* src, int64_t n, cudaStream_t s);

// ---- activations (bf16; dx may alias dy) ----
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
