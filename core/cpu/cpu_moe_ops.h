// The CPU backend's mixture-of-experts kernels in fp32 over raw row-major arrays, the oracle the
// CUDA kernels are checked against (core/backend_ops.inc documents each op).
#pragma once

#include <cstdint>

namespace iris::cpu {

// moe_route over rows [0, T): ids [T, k], weights [T, k], probs [T, E] (may be null); rows at or
// past real_rows are padding.
void moe_route(int32_t* ids, float* weights, float* probs, const float* logits, int64_t T,
               int64_t E, int k, int64_t real_rows);

// moe_capacity_drop over `slots` slots and E experts (by_weight: the "probs" policy, else
// "position"); returns the slots dropped.
int64_t moe_capacity_drop(int32_t* kept_ids, const int32_t* ids, const float* weights,
                          int64_t slots, int64_t E, int64_t capacity, bool by_weight);

// moe_dispatch of `slots` = T * k slots over E experts, rows of H floats; padded_capacity 0:
// compact, else E fixed segments of that many rows.
void moe_dispatch(float* x_sorted, int32_t* offsets, int32_t* slot_rows, const float* x,
                  const int32_t* ids, int64_t T, int k, int64_t E, int64_t H,
                  int64_t padded_capacity);

// moe_grouped_linear: w [E, K, N], x [R, K], y [R, N], over rows [0, offsets[E]).
void moe_grouped_linear(float* y, const float* x, const float* w, const int32_t* offsets, int64_t E,
                        int64_t N, int64_t K);
// Its backward: dx [R, K]; dw [E, K, N] (may be null) accumulates.
void moe_grouped_linear_backward(float* dx, float* dw, const float* dy, const float* x,
                                 const float* w, const int32_t* offsets, int64_t E, int64_t K,
                                 int64_t N);

// moe_combine: y [T, H], y_sorted [*, H], slot_rows and weights [T, k].
void moe_combine(float* y, const float* y_sorted, const int32_t* slot_rows, const float* weights,
                 int64_t T, int k, int64_t H, bool accumulate);
// Its backward: dy_sorted rows of routed slots, dweights [T, k].
void moe_combine_backward(float* dy_sorted, float* dweights, const float* dy, const float* y_sorted,
                          const int32_t* slot_rows, const float* weights, int64_t T, int k,
                          int64_t H);

// moe_dispatch's backward: dx [T, H] += the token's sorted rows in slot order.
void moe_dispatch_backward(float* dx, const float* dx_sorted, const int32_t* slot_rows, int64_t T,
                           int k, int64_t H);

// moe_route_backward: dlogits [T, E] from dweights [T, k], probs [T, E], ids [T, k] and
// aux_dprob [E] (may be null).
void moe_route_backward(float* dlogits, const float* dweights, const float* probs,
                        const int32_t* ids, const float* aux_dprob, int64_t T, int64_t E, int k);
// moe_route_stats: load and prob_sum [E] accumulate over rows [0, T).
void moe_route_stats(float* load, float* prob_sum, const int32_t* ids, const float* probs,
                     int64_t T, int64_t E, int k);
// moe_aux_loss over N = layers * real_rows rows.
void moe_aux_loss(float* aux_sum, float* dprob, const float* load, const float* prob_sum, int64_t E,
                  int64_t real_rows, int layers, float grad_scale);

}  // namespace iris::cpu
