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

}  // namespace iris
