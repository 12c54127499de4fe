#include "parallel/grad_reducer.h"

#include <algorithm>

#include "core/error.h"

namespace iris {

GradReducer::GradReducer(Backend& be, Communicator& comm, const Tensor& grads,
                         int64_t bucket_elements,
                         const std::vector<std::pair<int64_t, int64_t>>& ranges)
    : comm_(comm) {
  IRIS_CHECK(
      grads.dtype == DType::f32 && grads.device == comm.device() && grads.device == be.device(),
      "GradReducer: the gradients must be f32 on the communicator's device");
  IRIS_CHECK(bucket_elements > 0, "GradReducer: bucket_elements must be > 0");
  const int64_t n = grads.numel();
  const Tensor flat = grads.view({n});
  // Whole pieces per rank in every bucket but the last, so that only the last one has a tail.
  const int64_t w = comm.size();
  const int64_t step = std::max<int64_t>(w, bucket_elements / w * w);
  std::vector<std::pair<int64_t, int64_t>> spans = ranges;
  if (spans.empty()) spans.push_back({0, n});
  int64_t last = 0;
  for (const auto& [begin, end] : spans) {
    IRIS_CHECK(begin >= last && begin < end && end <= n, "GradReducer: range [", begin, ", ", end,
               ") is not ascending, disjoint and inside the ", n, " gradients");
    last = end;
    for (int64_t b = begin; b < end; b += step)
      buckets_.push_back(flat.slice(b, std::min(end, b + step)));
  }
  int64_t need = 0;
  for (const Tensor& b : buckets_)
    need = std::max(need, all_reduce_scratch_elements(b.numel(), comm.size()));
  if (need == 0) return;
  Arena plan;
  plan.alloc(DType::f32, {need});
  scratch_arena_ = Arena(be, plan.used());
  scratch_ = scratch_arena_.alloc(DType::f32, {need});
}

void GradReducer::reduce() {
  for (const Tensor& b : buckets_) comm_.all_reduce(b, scratch_);
}

}  // namespace iris
