// Host-side launchers of the CUDA backend's kernels. bf16 data travels as uint16_t bits; every
// launcher enqueues on `stream` and returns without synchronising, so all of them can be
// captured into a CUDA graph. Shapes are validated by the backend before these are called.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace iris::cuda {

// ---- skinny GEMMs for a few rows (gemv.cu) ----
constexpr int64_t kGemvMaxM = 8;
// Raises the dynamic shared-memory limit of the GEMV kernels; called once per device.
void gemv_init();
// Whether the GEMV kernels take y[M,N] = x[M,K] w[N,K]^T: M <= kGemvMaxM, K a multiple of 8, the
// x rows small enough for shared memory, x and w 16-byte aligned.
bool gemv_supported(int64_t m, int64_t n, int64_t k, const void* x, const void* w);
// y = x w^T (+ bias) (+ y when accumulate), f32 sums rounded once. The GEMVs are launched as
// programmatic dependents (sm_90): they load their first weights before the previous kernel on
// the stream has finished, so w must not be the output of that kernel (weights are written by
// copies, never by the kernel right before a projection); x, y, bias and the norm weights are
// read only after it has completed.

void launch_gemv(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
                 int64_t n, int64_t k, bool accumulate, cudaStream_t s);
// xn = rms_norm(x, norm_w) (stored too, 16-byte aligned), y = xn w^T, and when act is not null
// (N even) act[M, N/2] = swiglu(y). xn must not alias x.
void launch_gemv_rms_norm(uint16_t* y, uint16_t* xn, uint16_t* act, const uint16_t* x,
                          const uint16_t* norm_w, float eps, const uint16_t* w, int64_t m,
                          int64_t n, int64_t k, cudaStream_t s);

}  // namespace iris::cuda
