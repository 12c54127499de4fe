// The CPU backend's mixture-of-experts kernels in fp32 over raw row-major arrays, the oracle the
// CUDA kernels are checked against (core/backend_ops.inc documents each op).
#pragma once

#include <cstdint>

namespace iris::cpu {

// moe_route over rows [0, T): ids [T, k], weights [T, k], probs [T, E] (may be null); rows at or
// past real_rows are padding.
void moe_route(int32_t* ids, float* weights, float* probs, const float* logits, int64_t T,
               int64_t E, int k, int64_t real_rows);

}  // namespace iris::cpu
