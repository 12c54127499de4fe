#include "core/hardware_limits.h"

#include "core/arena.h"

namespace iris {

HardwareLimits measure_limits(Backend& be, bool quick, int iters) {
  HardwareLimits h;
  const int64_t n = be.device() == Device::cuda ? (quick ? 4096 : 8192) : 512;
  const int64_t copy_bytes = be.device() == Device::cuda ? (int64_t(1) << 30) : (int64_t(1) << 26);
  Arena plan;
  plan.alloc(be.compute_dtype(), {n, n});
  plan.alloc(be.compute_dtype(), {n, n});
  plan.alloc(be.compute_dtype(), {n, n});
  plan.alloc(DType::f32, {copy_bytes / 4});
  plan.alloc(DType::f32, {copy_bytes / 4});
  Arena a(be, plan.used());
  const Tensor x = a.alloc(be.compute_dtype(), {n, n}), w = a.alloc(be.compute_dtype(), {n, n}),
               y = a.alloc(be.compute_dtype(), {n, n});
  const Tensor src = a.alloc(DType::f32, {copy_bytes / 4}),
               dst = a.alloc(DType::f32, {copy_bytes / 4});
  be.fill_zero(x);
  be.fill_zero(w);
  be.fill_zero(src);
  const double tg = time_median(be, iters, [&] { be.linear(y, x, w, Tensor(), false); });
  h.gemm_tflops = 2.0 * double(n) * n * n / tg / 1e12;
  h.gemm_n = n;
  const double tc = time_median(be, iters, [&] { be.copy(dst, src); });
  h.copy_gbps = 2.0 * double(copy_bytes) / tc / 1e9;
  return h;
}

}  // namespace iris
