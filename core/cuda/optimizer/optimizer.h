// Host-side launchers of the optimizer kernels (optimizer.cu), for Backend::grad_norm_clip,
// grad_sum_squares and adamw_step over flat f32 buffers. Every launcher enqueues on `s` without
// synchronising or allocating (graph-capturable).
//
// Determinism: no float atomics. The gradient norm runs on a fixed grid (kOptimizerBlocks) whose
// partial sums go to `scratch` (train_scratch.h) and are then added in order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace iris::cuda {

// ---- scratch sizes (floats) ----
constexpr int kOptimizerBlocks = 1024;  // fixed grid of grad_norm_clip (and adamw)
// grad_norm_clip: kOptimizerBlocks doubles.
int64_t grad_norm_scratch_floats();
// adamw_step: 4 floats per tensor.
int64_t adamw_scratch_floats(int64_t n_tensors);

// ---- launchers ----
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
