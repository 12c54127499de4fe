// Single-precision GEMM used by the CPU backend: OpenBLAS when available, otherwise a blocked
// OpenMP loop (so that machines without OpenBLAS, such as the GPU box, still build the oracle).
#pragma once

#include <cstdint>

namespace iris::cpu {

// y[M,N] = x[M,K] . w[N,K]^T + beta * y
void sgemm_xwt(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y,
               float beta);

}  // namespace iris::cpu
