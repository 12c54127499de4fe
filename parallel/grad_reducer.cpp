#include "parallel/grad_reducer.h"

#include <algorithm>

#include "core/error.h"

namespace iris {

GradReducer::GradReducer(Backend& be, Communicator& comm, const Tensor& grads,
                         int64_t bucket_elements,
                         const std::vector<std::pair<int64_t, int64_t>>& ranges,
                         const std::vector<std::pair<int64_t, int64_t>>& tensors)
    : comm_(comm) {
  IRIS_CHECK(
      grads.dtype == DType::f32 && grads.device == comm.device() && grads.device == be.device(),
      "GradReducer: the gradients must be f32 on the communicator's device");
  IRIS_CHECK(bucket_elements > 0, "GradReducer: bucket_elements must be > 0");
  const int64_t n = grads.numel();
  base_ = static_cast<const char*>(grads.data);
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
    for (int64_t b = begin; b < end; b += step) {
      spans_.push_back({b, std::min(end, b + step)});
      buckets_.push_back(flat.slice(b, spans_.back().second));
    }
  }
  // Which buckets each tensor overlaps, and how many tensors each bucket waits for.
  tensors_ = tensors;
  std::sort(tensors_.begin(), tensors_.end());
  unfinished_at_start_.assign(buckets_.size(), 0);
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const int64_t begin = tensors_[i].first, end = tensors_[i].second;
    IRIS_CHECK(begin >= 0 && begin < end && end <= n && (i == 0 || tensors_[i - 1].second <= begin),
               "GradReducer: tensor [", begin, ", ", end,
               ") is empty, overlaps another or lies outside the ", n, " gradients");
    // The first bucket ending after the tensor's start, up to the first starting at its end.
    const auto first = std::partition_point(spans_.begin(), spans_.end(),
                                            [&](const auto& s) { return s.second <= begin; });
    auto stop = first;
    while (stop != spans_.end() && stop->first < end) ++stop;
    overlaps_.push_back({first - spans_.begin(), stop - spans_.begin()});
    for (auto b = first; b != stop; ++b) ++unfinished_at_start_[size_t(b - spans_.begin())];
  }
  // With no tensor named, no bucket can start before reduce(); one that overlaps none (a range of
  // gaps only) would start at the first mark, which never comes.
  if (tensors_.empty()) std::fill(unfinished_at_start_.begin(), unfinished_at_start_.end(), 1);
  unfinished_ = unfinished_at_start_;
  final_.assign(tensors_.size(), 0);

  int64_t need = 0;
  for (const Tensor& b : buckets_)
    need = std::max(need, all_reduce_scratch_elements(b.numel(), comm.size()));
  if (need == 0) return;
  Arena plan;
  plan.alloc(DType::f32, {need});
  scratch_arena_ = Arena(be, plan.used());
  scratch_ = scratch_arena_.alloc(DType::f32, {need});
}

void GradReducer::gradient_final(const Tensor& grad) {
  const auto offset = static_cast<const char*>(grad.data) - base_;
  const int64_t begin = offset / static_cast<int64_t>(sizeof(float));
  const auto it =
      std::lower_bound(tensors_.begin(), tensors_.end(), std::pair<int64_t, int64_t>{begin, 0});
  IRIS_CHECK(grad.dtype == DType::f32 && offset >= 0 && offset % sizeof(float) == 0 &&
                 it != tensors_.end() && it->first == begin && it->second - begin == grad.numel(),
             "GradReducer: gradient_final got ", grad.shape_str(),
             ", which is not one of the gradient tensors it was given");
  const auto i = static_cast<size_t>(it - tensors_.begin());
  if (final_[i]) return;
  final_[i] = 1;
  for (int64_t b = overlaps_[i].first; b < overlaps_[i].second; ++b) --unfinished_[size_t(b)];
  launch_ready();
}

void GradReducer::launch_ready() {
  const auto nb = static_cast<int64_t>(buckets_.size());
  while (next_ < nb && unfinished_[size_t(nb - 1 - next_)] == 0) {
    launch_next();
    ++early_;
  }
}

void GradReducer::launch_next() {
  if (!detached_) {
    comm_.begin_detached();
    detached_ = true;
  }
  comm_.all_reduce(buckets_[buckets_.size() - 1 - static_cast<size_t>(next_)], scratch_);
  ++next_;
}

void GradReducer::reduce() {
  while (next_ < static_cast<int64_t>(buckets_.size())) launch_next();
  if (detached_) comm_.end_detached();
  detached_ = false;
  launched_early_ = early_;
  early_ = 0;
  next_ = 0;
  unfinished_ = unfinished_at_start_;
  std::fill(final_.begin(), final_.end(), 0);
}

}  // namespace iris
