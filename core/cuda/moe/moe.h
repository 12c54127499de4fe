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

}  // namespace iris::cuda
