// What both backends check of the mixture-of-experts ops' arguments (core/backend_ops.inc), so
// that a wrong shape is the same clear error on the CPU and on CUDA.
#pragma once

#include "core/tensor.h"

namespace iris {

// The largest k the routers accept (a warp's lanes on CUDA).
constexpr int kMoeMaxTopK = 32;

void check_moe_route_shapes(const Tensor& ids, const Tensor& weights, const Tensor& probs,
                            const Tensor& logits, int k, const Tensor& real_rows);
// Megatron's drop policies (moe_token_drop_policy), as moe_capacity_drop's `policy` numbers them.
enum class MoeDropPolicy : int { probs = 0, position = 1 };

void check_moe_capacity_drop_shapes(const Tensor& kept_ids, const Tensor& dropped,
                                    const Tensor& ids, const Tensor& weights, int experts,
                                    int64_t capacity, int policy);
void check_moe_dispatch_shapes(const Tensor& x_sorted, const Tensor& offsets,
                               const Tensor& slot_rows, const Tensor& x, const Tensor& ids,
                               int64_t padded_capacity);
void check_moe_grouped_linear_shapes(const Tensor& y, const Tensor& x, const Tensor& w,
                                     const Tensor& offsets);
// rows_per_expert > 0: the experts' x [E * rows_per_expert, K].
void check_moe_rows_per_expert(const Tensor& x, const Tensor& w, int64_t rows_per_expert,
                               const char* op);
void check_moe_combine_shapes(const Tensor& y, const Tensor& y_sorted, const Tensor& slot_rows,
                              const Tensor& weights);
void check_moe_combine_backward_shapes(const Tensor& dy_sorted, const Tensor& dweights,
                                       const Tensor& dy, const Tensor& y_sorted,
                                       const Tensor& slot_rows, const Tensor& weights);
void check_moe_dispatch_backward_shapes(const Tensor& dx, const Tensor& dx_sorted,
                                        const Tensor& slot_rows);
void check_moe_route_backward_shapes(const Tensor& dlogits, const Tensor& dweights,
                                     const Tensor& probs, const Tensor& ids,
                                     const Tensor& aux_dprob);
void check_moe_route_stats_shapes(const Tensor& load, const Tensor& prob_sum, const Tensor& ids,
                                  const Tensor& probs);
void check_moe_aux_loss_shapes(const Tensor& aux_sum, const Tensor& dprob, const Tensor& load,
                               const Tensor& prob_sum, const Tensor& real_rows, int layers);

}  // namespace iris
