// Data-parallel gradient reduction over one flat f32 gradient span (whose address never moves), in
// buckets: each bucket is a contiguous span that the communicator sums in rank order
// (Communicator::all_reduce), so every rank ends with the same bits, run after run. The scratch
// the exchange needs is one bucket, allocated here once; nothing is allocated per step (buckets
// in flight together share it: they queue one after another on the communicator's stream).
//
// The reduction can overlap the backward, as Megatron-LM's and PyTorch DDP's do: the model names
// each gradient tensor once the step's last write to it is queued (gradient_final), and a bucket
// is launched as soon as every tensor it overlaps is final, while the backward goes on (on CUDA
// the collectives queue on the communicator's stream after an event of the backend's, and the
// backend waits for them only in reduce()). A bucket is the same span summed by the same call
// whenever it is launched, so the bits are those of reducing after the backward. The buckets are
// launched in one fixed order on every rank, from the highest address down (the order the
// backward finishes the tensors in: parameters are laid out from the vision encoder to the
// lm_head), whichever tensors a rank's last micro-batch finishes: a rank whose last micro-batch
// skips a part (no images, no labelled token) launches that part's buckets in reduce(), in their
// place in the order, so every rank posts the same collectives in the same sequence.
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
  // tensors: the element ranges of the gradient tensors in `grads` that gradient_final names
  // (disjoint, any order); elements of a bucket outside every tensor (alignment gaps) are zero
  // and need no mark. Empty: no overlap, every bucket waits for reduce().
  GradReducer(Backend& be, Communicator& comm, const Tensor& grads,
              int64_t bucket_elements = kDefaultBucketElements,
              const std::vector<std::pair<int64_t, int64_t>>& ranges = {},
              const std::vector<std::pair<int64_t, int64_t>>& tensors = {});
  // During the backward of the step's last micro-batch, outside any graph capture: no later work
  // of the step writes `grad` (one of `tensors`, whole, as a view of the gradients). Launches
  // every bucket that is next in the launch order and whose tensors are all final. Naming a
  // tensor twice in a step is harmless; naming one that is not in `tensors` is an error.
  void gradient_final(const Tensor& grad);
  // Sums every rank's gradients: launches the buckets gradient_final has not, in the launch order,
  // and orders the backend's later work (the optimizer, the next step's zero_grads) after every
  // bucket of the step (on CUDA by an event, no host wait). The next step starts with no tensor
  // final.
  void reduce();

  int64_t buckets() const { return static_cast<int64_t>(buckets_.size()); }
  size_t scratch_bytes() const { return scratch_arena_.capacity(); }
  // Buckets launched in the current step so far (by gradient_final; reduce() ends the step).
  int64_t launched() const { return next_; }
  // Buckets gradient_final launched in the last step that reduce() ended: the overlap achieved.
  int64_t launched_early() const { return launched_early_; }

 private:
  void launch_ready();
  void launch_next();

  Communicator& comm_;
  const char* base_ = nullptr;
  std::vector<Tensor> buckets_;                        // ascending addresses
  std::vector<std::pair<int64_t, int64_t>> spans_;     // the buckets' element ranges
  std::vector<std::pair<int64_t, int64_t>> tensors_;   // ascending by begin
  std::vector<std::pair<int64_t, int64_t>> overlaps_;  // per tensor: its buckets [first, last)
  std::vector<int> unfinished_, unfinished_at_start_;  // per bucket: tensors not yet final
  std::vector<char> final_;                            // per tensor, this step
  int64_t next_ = 0;  // launch-order position: bucket buckets() - 1 - next_ is next
  int64_t early_ = 0, launched_early_ = 0;
  bool detached_ = false;
  Arena scratch_arena_;
  Tensor scratch_;
};

}  // namespace iris
