// The scratch buffer of the training kernels: their fixed-order reductions write partial results
// there (instead of adding into the output with float atomics), then a second kernel adds the
// partials in order. Launchers taking `scratch` (f32, 16-byte aligned, of `scratch_floats`
// floats) check its size on the host; two launches sharing one scratch buffer must not run
// concurrently (e.g. on two streams).
#pragma once

#include <cstddef>
#include <cstdint>

namespace iris::cuda {

// Bytes of one scratch buffer serving every training launcher for norm widths up to max_cols (and
// any head_dim), cross-entropy chunks up to max_ce_rows rows and optimizers over up to max_tensors.
size_t train_scratch_bytes(int64_t max_cols, int64_t max_ce_rows, int64_t max_tensors);

// Throws unless `scratch` holds `need` floats and is `align`-byte aligned; `op` names the caller.
void check_scratch(const float* scratch, int64_t scratch_floats, int64_t need, size_t align,
                   const char* op);

}  // namespace iris::cuda
