// Single-precision GEMM used by the CPU backend: OpenBLAS when available, otherwise a blocked
// OpenMP loop (so that machines without OpenBLAS, such as the GPU box, still build the oracle).
#pragma once

#include <cstdint>

namespace iris::cpu {

// y[M,N] = x[M,K] . w[N,K]^T + beta * y
void sgemm_xwt(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y,
               float beta);

// y[M,N] = x[M,K] . w[K,N] + beta * y  (the input gradient of a linear layer: dx = dy . W)
void sgemm_xw(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y,
              float beta);

// y[M,N] = x[K,M]^T . w[K,N] + beta * y  (the weight gradient of a linear layer: dW += dy^T . x)
void sgemm_xtw(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y,
               float beta);

}  // namespace iris::cpu
