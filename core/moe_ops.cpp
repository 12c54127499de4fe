#include "core/moe_ops.h"

#include "core/error.h"

namespace iris {

void check_moe_route_shapes(const Tensor& ids, const Tensor& weights, const Tensor& probs,
                            const Tensor& logits, int k, const Tensor& real_rows) {
  IRIS_CHECK(logits.ndim == 2 && logits.cols() > 0, "moe_route: logits ", logits.shape_str(),
             " should be [tokens, experts]");
  const int64_t T = logits.rows(), E = logits.cols();
  IRIS_CHECK(k >= 1 && k <= kMoeMaxTopK && k <= E, "moe_route: k = ", k, " should be in 1..",
             E < kMoeMaxTopK ? E : int64_t{kMoeMaxTopK}, " for ", E, " experts");
  IRIS_CHECK(ids.dtype == DType::i32 && ids.ndim == 2 && ids.rows() == T && ids.cols() == k,
             "moe_route: ids ", ids.shape_str(), " should be i32 [", T, ", ", k, "]");
  IRIS_CHECK(weights.ndim == 2 && weights.rows() == T && weights.cols() == k, "moe_route: weights ",
             weights.shape_str(), " should be [", T, ", ", k, "]");
  if (probs.defined())
    IRIS_CHECK(
        probs.dtype == DType::f32 && probs.ndim == 2 && probs.rows() == T && probs.cols() == E,
        "moe_route: probs ", probs.shape_str(), " should be f32 [", T, ", ", E, "]");
  if (real_rows.defined())
    IRIS_CHECK(real_rows.dtype == DType::i32 && real_rows.numel() == 1, "moe_route: real_rows ",
               real_rows.shape_str(), " should be i32 [1]");
}

void check_moe_capacity_drop_shapes(const Tensor& kept_ids, const Tensor& dropped,
                                    const Tensor& ids, const Tensor& weights, int experts,
                                    int64_t capacity, int policy) {
  IRIS_CHECK(ids.dtype == DType::i32 && ids.ndim == 2, "moe_capacity_drop: ids ", ids.shape_str(),
             " should be i32 [tokens, k]");
  IRIS_CHECK(kept_ids.dtype == DType::i32 && kept_ids.ndim == 2 && kept_ids.rows() == ids.rows() &&
                 kept_ids.cols() == ids.cols() && kept_ids.data != ids.data,
             "moe_capacity_drop: kept_ids ", kept_ids.shape_str(), " should be i32 ",
             ids.shape_str(), " apart from ids (which the router's backward still reads)");
  IRIS_CHECK(weights.ndim == 2 && weights.rows() == ids.rows() && weights.cols() == ids.cols(),
             "moe_capacity_drop: weights ", weights.shape_str(), " should be shaped as ids ",
             ids.shape_str());
  if (dropped.defined())
    IRIS_CHECK(dropped.dtype == DType::i32 && dropped.numel() == 1, "moe_capacity_drop: dropped ",
               dropped.shape_str(), " should be i32 [1]");
  IRIS_CHECK(experts >= 1, "moe_capacity_drop: experts ", experts, " should be >= 1");
  IRIS_CHECK(capacity >= 1 && capacity <= (int64_t{1} << 30), "moe_capacity_drop: capacity ",
             capacity, " should be in 1..2^30");
  IRIS_CHECK(policy == static_cast<int>(MoeDropPolicy::probs) ||
                 policy == static_cast<int>(MoeDropPolicy::position),
             "moe_capacity_drop: policy ", policy, " should be 0 (probs) or 1 (position)");
}

void check_moe_dispatch_shapes(const Tensor& x_sorted, const Tensor& offsets,
                               const Tensor& slot_rows, const Tensor& x, const Tensor& ids,
                               int64_t padded_capacity) {
  IRIS_CHECK(ids.dtype == DType::i32 && ids.ndim == 2, "moe_dispatch: ids ", ids.shape_str(),
             " should be i32 [tokens, k]");
  const int64_t T = ids.rows(), slots = ids.numel();
  IRIS_CHECK(x.ndim == 2 && x.rows() == T, "moe_dispatch: x ", x.shape_str(), " should have ", T,
             " rows, one per token of ids ", ids.shape_str());
  IRIS_CHECK(offsets.dtype == DType::i32 && offsets.numel() >= 2, "moe_dispatch: offsets ",
             offsets.shape_str(), " should be i32 [experts + 1]");
  IRIS_CHECK(padded_capacity >= 0 && padded_capacity <= (int64_t{1} << 30),
             "moe_dispatch: padded_capacity ", padded_capacity,
             " should be 0 (dropless) or a capacity in 1..2^30");
  const int64_t E = offsets.numel() - 1;
  const int64_t rows = padded_capacity > 0 ? E * padded_capacity : slots;
  IRIS_CHECK(x_sorted.ndim == 2 && x_sorted.rows() == rows && x_sorted.cols() == x.cols() &&
                 x_sorted.dtype == x.dtype,
             "moe_dispatch: x_sorted ", x_sorted.shape_str(), " should be [", rows, ", ", x.cols(),
             "] like x ", x.shape_str(),
             padded_capacity > 0 ? " (experts x padded_capacity rows)" : " (tokens x k rows)");
  IRIS_CHECK(slot_rows.dtype == DType::i32 && slot_rows.numel() == slots,
             "moe_dispatch: slot_rows ", slot_rows.shape_str(), " should be i32 with ", slots,
             " entries");
}

void check_moe_grouped_linear_shapes(const Tensor& y, const Tensor& x, const Tensor& w,
                                     const Tensor& offsets) {
  IRIS_CHECK(w.ndim == 3, "moe_grouped_linear: w ", w.shape_str(), " should be [experts, in, out]");
  const int64_t E = w.shape[0], K = w.shape[1], N = w.shape[2];
  IRIS_CHECK(offsets.dtype == DType::i32 && offsets.numel() == E + 1,
             "moe_grouped_linear: offsets ", offsets.shape_str(), " should be i32 [", E + 1,
             "] for ", E, " experts");
  IRIS_CHECK(x.ndim == 2 && x.cols() == K, "moe_grouped_linear: x ", x.shape_str(), " should have ",
             K, " columns (w ", w.shape_str(), ")");
  IRIS_CHECK(y.ndim == 2 && y.rows() == x.rows() && y.cols() == N, "moe_grouped_linear: y ",
             y.shape_str(), " should be [", x.rows(), ", ", N, "]");
  IRIS_CHECK(y.data != x.data, "moe_grouped_linear: y aliases x");
}

void check_moe_rows_per_expert(const Tensor& x, const Tensor& w, int64_t rows_per_expert,
                               const char* op) {
  IRIS_CHECK(rows_per_expert >= 0, op, ": rows_per_expert ", rows_per_expert,
             " should be 0 (rows from offsets) or each expert's padded rows");
  if (rows_per_expert > 0)
    IRIS_CHECK(x.rows() == w.shape[0] * rows_per_expert, op, ": x ", x.shape_str(), " should have ",
               w.shape[0], " experts x ", rows_per_expert, " rows (rows_per_expert)");
}

namespace {
// The combine's shapes, whatever the dtypes (its backward's dy may be f32 beside bf16 rows).
void check_combine_dims(const Tensor& y, const Tensor& y_sorted, const Tensor& slot_rows,
                        const Tensor& weights, const char* op) {
  IRIS_CHECK(slot_rows.dtype == DType::i32 && slot_rows.ndim == 2, op, ": slot_rows ",
             slot_rows.shape_str(), " should be i32 [tokens, k]");
  const int64_t T = slot_rows.rows(), k = slot_rows.cols();
  IRIS_CHECK(weights.ndim == 2 && weights.rows() == T && weights.cols() == k, op, ": weights ",
             weights.shape_str(), " should be [", T, ", ", k, "]");
  IRIS_CHECK(y.ndim == 2 && y.rows() == T, op, ": y ", y.shape_str(), " should have ", T, " rows");
  IRIS_CHECK(y_sorted.ndim == 2 && y_sorted.cols() == y.cols(), op, ": y_sorted ",
             y_sorted.shape_str(), " should be [rows, ", y.cols(), "]");
}
}  // namespace

void check_moe_combine_shapes(const Tensor& y, const Tensor& y_sorted, const Tensor& slot_rows,
                              const Tensor& weights) {
  check_combine_dims(y, y_sorted, slot_rows, weights, "moe_combine");
  IRIS_CHECK(y_sorted.dtype == y.dtype, "moe_combine: y_sorted ", y_sorted.shape_str(), " and y ",
             y.shape_str(), " differ in dtype");
}

void check_moe_combine_backward_shapes(const Tensor& dy_sorted, const Tensor& dweights,
                                       const Tensor& dy, const Tensor& y_sorted,
                                       const Tensor& slot_rows, const Tensor& weights) {
  check_combine_dims(dy, y_sorted, slot_rows, weights, "moe_combine_backward");
  IRIS_CHECK(dy_sorted.ndim == 2 && dy_sorted.rows() == y_sorted.rows() &&
                 dy_sorted.cols() == y_sorted.cols(),
             "moe_combine_backward: dy_sorted ", dy_sorted.shape_str(), " should be shaped as ",
             y_sorted.shape_str());
  IRIS_CHECK(dweights.dtype == DType::f32 && dweights.numel() == slot_rows.numel(),
             "moe_combine_backward: dweights ", dweights.shape_str(), " should be f32 with ",
             slot_rows.numel(), " entries");
}

void check_moe_dispatch_backward_shapes(const Tensor& dx, const Tensor& dx_sorted,
                                        const Tensor& slot_rows) {
  IRIS_CHECK(slot_rows.dtype == DType::i32 && slot_rows.ndim == 2,
             "moe_dispatch_backward: slot_rows ", slot_rows.shape_str(),
             " should be i32 [tokens, k]");
  IRIS_CHECK(dx.ndim == 2 && dx.rows() == slot_rows.rows(), "moe_dispatch_backward: dx ",
             dx.shape_str(), " should have ", slot_rows.rows(), " rows");
  IRIS_CHECK(dx_sorted.ndim == 2 && dx_sorted.cols() == dx.cols(),
             "moe_dispatch_backward: dx_sorted ", dx_sorted.shape_str(), " should be [rows, ",
             dx.cols(), "]");
}

void check_moe_route_backward_shapes(const Tensor& dlogits, const Tensor& dweights,
                                     const Tensor& probs, const Tensor& ids,
                                     const Tensor& aux_dprob) {
  IRIS_CHECK(probs.dtype == DType::f32 && probs.ndim == 2 && probs.cols() > 0,
             "moe_route_backward: probs ", probs.shape_str(), " should be f32 [tokens, experts]");
  const int64_t T = probs.rows(), E = probs.cols();
  IRIS_CHECK(ids.dtype == DType::i32 && ids.ndim == 2 && ids.rows() == T && ids.cols() >= 1 &&
                 ids.cols() <= kMoeMaxTopK && ids.cols() <= E,
             "moe_route_backward: ids ", ids.shape_str(), " should be i32 [", T,
             ", k] with k <= ", E < kMoeMaxTopK ? E : int64_t{kMoeMaxTopK});
  IRIS_CHECK(dweights.dtype == DType::f32 && dweights.ndim == 2 && dweights.rows() == T &&
                 dweights.cols() == ids.cols(),
             "moe_route_backward: dweights ", dweights.shape_str(), " should be f32 [", T, ", ",
             ids.cols(), "]");
  IRIS_CHECK(dlogits.ndim == 2 && dlogits.rows() == T && dlogits.cols() == E,
             "moe_route_backward: dlogits ", dlogits.shape_str(), " should be [", T, ", ", E, "]");
  if (aux_dprob.defined())
    IRIS_CHECK(aux_dprob.dtype == DType::f32 && aux_dprob.numel() == E,
               "moe_route_backward: aux_dprob ", aux_dprob.shape_str(), " should be f32 [", E, "]");
}

void check_moe_route_stats_shapes(const Tensor& load, const Tensor& prob_sum, const Tensor& ids,
                                  const Tensor& probs) {
  IRIS_CHECK(probs.dtype == DType::f32 && probs.ndim == 2 && probs.cols() > 0,
             "moe_route_stats: probs ", probs.shape_str(), " should be f32 [tokens, experts]");
  const int64_t T = probs.rows(), E = probs.cols();
  IRIS_CHECK(ids.dtype == DType::i32 && ids.ndim == 2 && ids.rows() == T, "moe_route_stats: ids ",
             ids.shape_str(), " should be i32 [", T, ", k]");
  for (const Tensor* t : {&load, &prob_sum})
    IRIS_CHECK(t->dtype == DType::f32 && t->numel() == E, "moe_route_stats: load and prob_sum ",
               t->shape_str(), " should be f32 [", E, "]");
}

void check_moe_aux_loss_shapes(const Tensor& aux_sum, const Tensor& dprob, const Tensor& load,
                               const Tensor& prob_sum, const Tensor& real_rows, int layers) {
  const int64_t E = load.numel();
  IRIS_CHECK(E > 0 && load.dtype == DType::f32, "moe_aux_loss: load ", load.shape_str(),
             " should be f32 [experts]");
  for (const Tensor* t : {&prob_sum, &dprob})
    IRIS_CHECK(t->dtype == DType::f32 && t->numel() == E, "moe_aux_loss: prob_sum and dprob ",
               t->shape_str(), " should be f32 [", E, "]");
  IRIS_CHECK(aux_sum.dtype == DType::f32 && aux_sum.numel() == 1, "moe_aux_loss: aux_sum ",
             aux_sum.shape_str(), " should be f32 [1]");
  IRIS_CHECK(real_rows.dtype == DType::i32 && real_rows.numel() == 1, "moe_aux_loss: real_rows ",
             real_rows.shape_str(), " should be i32 [1]");
  IRIS_CHECK(layers >= 1, "moe_aux_loss: layers = ", layers, " should be positive");
}

}  // namespace iris
