// Data-parallel gradient reduction over one flat f32 gradient span (whose address never moves), in
// buckets: each bucket is a contiguous span that the communicator sums in rank order
// (Communicator::all_reduce), so every rank ends with the same bits, run after run. The scratch
// the exchange needs is one bucket, allocated here once; nothing is allocated per step.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "core/backend.h"
#include "parallel/communicator.h"

namespace iris {

class GradReducer {
 public:
  // Default bucket: 32 Mi elements (128 MiB of f32), large enough that a 2B model's gradients go
  // in a few calls, small enough that the scratch stays a fraction of the gradients.
  static constexpr int64_t kDefaultBucketElements = int64_t(1) << 25;

  // ranges: the element ranges [begin, end) of `grads` to sum, ascending and disjoint (a pipeline
  // stage's own tensors; the others' gradients are zero there); empty: all of it.
  GradReducer(Backend& be, Communicator& comm, const Tensor& grads,
              int64_t bucket_elements = kDefaultBucketElements,
              const std::vector<std::pair<int64_t, int64_t>>& ranges = {});
  // Sums every rank's gradients, bucket by bucket in address order (queued on the communicator's
  // stream on CUDA, ordered after the backward and before the optimizer by events).
  void reduce();

  int64_t buckets() const { return static_cast<int64_t>(buckets_.size()); }
  size_t scratch_bytes() const { return scratch_arena_.capacity(); }

 private:
  Communicator& comm_;
  std::vector<Tensor> buckets_;
  Arena scratch_arena_;
  Tensor scratch_;
};

}  // namespace iris
