#include "core/cuda/train_scratch.h"

#include "core/cuda/device_utils.cuh"
#include "core/cuda/logits/logits.h"
#include "core/cuda/norm_rope/norm_rope.h"
#include "core/cuda/optimizer/optimizer.h"
#include "core/error.h"

namespace iris::cuda {

size_t train_scratch_bytes(int64_t max_cols, int64_t max_ce_rows, int64_t max_tensors) {
  int64_t f = norm_backward_scratch_floats(max_cols);
  const int64_t others[] = {qkv_norm_rope_backward_scratch_floats(kQkvNormRopeMaxHeadDim),
                            grad_norm_scratch_floats(), adamw_scratch_floats(max_tensors),
                            cross_entropy_scratch_floats(max_ce_rows)};
  for (int64_t o : others) f = o > f ? o : f;
  return static_cast<size_t>(f) * sizeof(float);
}

void check_scratch(const float* scratch, int64_t scratch_floats, int64_t need, size_t align,
                   const char* op) {
  IRIS_CHECK(scratch_floats >= need, op, ": the scratch of ", scratch_floats,
             " floats is smaller than the ", need, " this call needs");
  IRIS_CHECK(scratch != nullptr && aligned(scratch, align), op, ": the scratch must be ", align,
             "-byte aligned");
}

}  // namespace iris::cuda
