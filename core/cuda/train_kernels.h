// Host-side launchers of the CUDA backend's training kernels (train_kernels.cu): the backwards,
// the cross-entropy over a logits chunk and the optimizer.
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

// ---- scratch sizes (floats) ----
constexpr int kOptimizerBlocks = 1024;  // fixed grid of grad_norm_clip (and adamw)
// grad_norm_clip: kOptimizerBlocks doubles.
int64_t grad_norm_scratch_floats();
// adamw_step: 4 floats per tensor.
int64_t adamw_scratch_floats(int64_t n_tensors);

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

// ---- optimizer over flat f32 buffers (Backend::grad_norm_clip / adamw_step) ----
// spans i64 [n, 3] = {offset, numel, offset into weights}; hyper f32 [n, 2] = {weight decay, lr
// scale}, scale 0 = frozen (skipped). grad_stats[2] = {L2 norm of the unfrozen gradients (f64
// squares, fixed-order sum), clip coef min(max_norm / (float(norm) + 1e-6f), 1) (1 when max_norm
// <= 0)}. Needs grad_norm_scratch_floats() (8-byte aligned).
void launch_grad_norm_clip(float* grad_stats, const float* grads, const int64_t* spans,
                           const float* hyper, int64_t n_tensors, float max_norm, float* scratch,
                           int64_t scratch_floats, cudaStream_t s);
// sums[i] = the f64 sum of squares of span i's gradient (0 when frozen), one block per span in a
// fixed order (the same bits every run).
void launch_grad_sum_squares(double* sums, const float* grads, const int64_t* spans,
                             const float* hyper, int64_t n_tensors, cudaStream_t s);
// One torch foreach AdamW step (training/optimizer.cpp's arithmetic, IEEE ops in the same order)
// of every unfrozen tensor: steps[i] += 1 on the device, gradient times grad_stats[1] when that
// is below 1 (grads itself is not modified), lr = lr[0] times the lr scale; then weights (bf16,
// may be null) [spans[i,2] + k] = bf16(params[spans[i,0] + k]). Two launches (step counts and
// per-tensor scalars into scratch, then one multi-tensor update). Needs
// adamw_scratch_floats(n_tensors).
void launch_adamw_step(float* params, const float* grads, float* exp_avg, float* exp_avg_sq,
                       uint16_t* weights, const int64_t* spans, const float* hyper, int64_t* steps,
                       const float* lr, const float* grad_stats, int64_t n_tensors, float beta1,
                       float beta2, float eps, float* scratch, int64_t scratch_floats,
                       cudaStream_t s);

}  // namespace iris::cuda
