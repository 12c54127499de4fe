#include "core/cpu/cpu_gemm.h"

#include <algorithm>

#ifdef IRIS_HAVE_CBLAS
#include <cblas.h>
#endif

namespace iris::cpu {

void sgemm_xwt(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y,
               float beta) {
  if (M == 0 || N == 0) return;
#ifdef IRIS_HAVE_CBLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), 1.0f, x, static_cast<int>(K), w, static_cast<int>(K), beta, y,
              static_cast<int>(N));
#else
  constexpr int64_t kBlockN = 64;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t nb = 0; nb < N; nb += kBlockN) {
      const float* xr = x + m * K;
      const int64_t ne = std::min(N, nb + kBlockN);
      for (int64_t n = nb; n < ne; ++n) {
        const float* wr = w + n * K;
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k) acc += xr[k] * wr[k];
        y[m * N + n] = acc + (beta == 0.0f ? 0.0f : beta * y[m * N + n]);
      }
    }
  }
#endif
}

// The fallbacks below give each thread whole rows of y and run the inner loop contiguously over n,
// so no sum is split between threads.
void sgemm_xw(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y,
              float beta) {
  if (M == 0 || N == 0) return;
#ifdef IRIS_HAVE_CBLAS
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), 1.0f, x, static_cast<int>(K), w, static_cast<int>(N), beta, y,
              static_cast<int>(N));
#else
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    float* yr = y + m * N;
    for (int64_t n = 0; n < N; ++n) yr[n] = beta == 0.0f ? 0.0f : beta * yr[n];
    for (int64_t k = 0; k < K; ++k) {
      const float a = x[m * K + k];
      const float* wr = w + k * N;
      for (int64_t n = 0; n < N; ++n) yr[n] += a * wr[n];
    }
  }
#endif
}

void sgemm_xtw(int64_t M, int64_t N, int64_t K, const float* x, const float* w, float* y,
               float beta) {
  if (M == 0 || N == 0) return;
#ifdef IRIS_HAVE_CBLAS
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), 1.0f, x, static_cast<int>(M), w, static_cast<int>(N), beta, y,
              static_cast<int>(N));
#else
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    float* yr = y + m * N;
    for (int64_t n = 0; n < N; ++n) yr[n] = beta == 0.0f ? 0.0f : beta * yr[n];
    for (int64_t k = 0; k < K; ++k) {
      const float a = x[k * M + m];
      const float* wr = w + k * N;
      for (int64_t n = 0; n < N; ++n) yr[n] += a * wr[n];
    }
  }
#endif
}

}  // namespace iris::cpu
