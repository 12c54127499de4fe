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

}  // namespace iris::cpu
