// Host-side launchers of the mixture-of-experts kernels (moe_*.cu). bf16 travels as uint16_t
// bits; every launcher enqueues on `s` without synchronising or allocating (graph-capturable).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace iris::cuda {

// The most experts the router kernel takes: a warp holds a row, 16 logits a lane.
constexpr int kMoeRouteMaxExperts = 512;

// ---- the router (Backend::moe_route) ----
// One warp a row of bf16 logits [T, E]: ids i32 [T, k], weights bf16 [T, k], probs f32 [T, E]
// (null: not written); real_rows null or one i32 on the device, read when the kernel runs.
void launch_moe_route(int32_t* ids, uint16_t* weights, float* probs, const uint16_t* logits,
                      int64_t T, int E, int k, const int32_t* real_rows, cudaStream_t s);

// ---- the permutation (Backend::moe_dispatch, Backend::moe_combine) ----
// One block plans the whole call (counts, offsets and every slot's row, stable by slot); ids
// outside 0..E-1 count as padding (the CPU oracle refuses them; moe_route makes none). The rows
// of x (bf16 [T, H]) then go to x_sorted.
// padded_capacity > 0: E segments of that many rows, zeros past each expert's slots.
void launch_moe_dispatch(uint16_t* x_sorted, int32_t* offsets, int32_t* slot_rows,
                         const uint16_t* x, const int32_t* ids, int64_t T, int k, int E, int64_t H,
                         int64_t padded_capacity, cudaStream_t s);
// Backend::moe_capacity_drop over `slots` slots: one block an expert (E blocks), weights bf16;
// dropped null: not counted.
void launch_moe_capacity_drop(int32_t* kept_ids, int32_t* dropped, const int32_t* ids,
                              const uint16_t* weights, int64_t slots, int E, int64_t capacity,
                              bool by_weight, cudaStream_t s);
// y[t] (+)= sum over j of weights[t, j] * y_sorted[slot_rows[t, j]], in f32 in slot order.
void launch_moe_combine(uint16_t* y, const uint16_t* y_sorted, const int32_t* slot_rows,
                        const uint16_t* weights, int64_t T, int k, int64_t H, bool accumulate,
                        cudaStream_t s);

// dy_sorted[row of (t, j)] = weights[t, j] * dy[t] and dweights f32 [T, k] = dy[t] . y_sorted[row];
// dy is f32 (dy_is_f32) or bf16.
void launch_moe_combine_backward(uint16_t* dy_sorted, float* dweights, const void* dy,
                                 bool dy_is_f32, const uint16_t* y_sorted, const int32_t* slot_rows,
                                 const uint16_t* weights, int64_t T, int k, int64_t H,
                                 cudaStream_t s);
// dx[t] += the token's sorted rows in slot order; dx is f32 (dx_is_f32) or bf16.
void launch_moe_dispatch_backward(void* dx, bool dx_is_f32, const uint16_t* dx_sorted,
                                  const int32_t* slot_rows, int64_t T, int k, int64_t H,
                                  cudaStream_t s);

// ---- the experts' projections (Backend::moe_grouped_linear) ----
// y [R, N] = x [R, K] . w[e] per expert's rows, w bf16 [E, K, N]; the row counts are read from
// offsets on the device, so the grid covers every split of R rows over E experts.
void launch_moe_grouped_linear(uint16_t* y, const uint16_t* x, const uint16_t* w,
                               const int32_t* offsets, int64_t R, int E, int64_t N, int64_t K,
                               cudaStream_t s);
// dx [R, K] = dy [R, N] . w[e]^T, and dw f32 [E, K, N] (null: none) += x^T . dy per expert.
void launch_moe_grouped_linear_backward(uint16_t* dx, float* dw, const uint16_t* dy,
                                        const uint16_t* x, const uint16_t* w,
                                        const int32_t* offsets, int64_t R, int E, int64_t K,
                                        int64_t N, cudaStream_t s);

// ---- the router's backward and the load-balancing loss (moe_aux.cu) ----
// One warp a row: dlogits bf16 [T, E] from dweights f32 [T, k], probs f32 [T, E], ids [T, k] and
// aux_dprob f32 [E] (null: none).
void launch_moe_route_backward(uint16_t* dlogits, const float* dweights, const float* probs,
                               const int32_t* ids, const float* aux_dprob, int64_t T, int E, int k,
                               cudaStream_t s);
// load and prob_sum f32 [E] += the call's counts and probability sums (a thread an expert).
void launch_moe_route_stats(float* load, float* prob_sum, const int32_t* ids, const float* probs,
                            int64_t T, int E, int k, cudaStream_t s);
// aux_sum f32 [1] += the loss; dprob f32 [E]; real_rows one i32 on the device.
void launch_moe_aux_loss(float* aux_sum, float* dprob, const float* load, const float* prob_sum,
                         const int32_t* real_rows, int E, int layers, float grad_scale,
                         cudaStream_t s);

}  // namespace iris::cuda
