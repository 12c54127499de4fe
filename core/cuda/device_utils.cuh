// Device-side helpers shared by the kernels: bf16 packing, 16-byte vector access, reductions,
// element access for f32 and bf16 data alike, programmatic-launch hooks, and the pointer
// alignment tests their launchers make.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

namespace iris::cuda {

constexpr int kWarpSize = 32;

__device__ __forceinline__ float bf16_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// Round-to-nearest-even, the same rounding as iris::f32_to_bf16 and torch's casts.
__device__ __forceinline__ uint16_t float_to_bf16(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

// Rounds through bf16: marks the points where HF materialises a bf16 tensor mid-expression.
__device__ __forceinline__ float round_bf16(float f) {
  return __bfloat162float(__float2bfloat16_rn(f));
}

// SiLU in f32, shared by swiglu and the fused gate/up GEMV so that both round identically.
__device__ __forceinline__ float silu(float x) {
  return x / (1.f + expf(-x));
}

// One cvt.rn.bf16x2.f32 (sm_80+) instead of two conversions and a shift-or: the same rounding.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 8 bf16 values travel as one 16-byte access; rows of 1024-4096 elements are memory-bound, and
// 16-byte accesses are what reaches full bandwidth.
__device__ __forceinline__ void unpack8(const uint4& u, float (&f)[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 u;
  u.x = pack_bf16x2(f[0], f[1]);
  u.y = pack_bf16x2(f[2], f[3]);
  u.z = pack_bf16x2(f[4], f[5]);
  u.w = pack_bf16x2(f[6], f[7]);
  return u;
}

__device__ __forceinline__ void load8(const uint16_t* p, float (&f)[8]) {
  unpack8(*reinterpret_cast<const uint4*>(p), f);
}

__device__ __forceinline__ void store8(uint16_t* p, const float (&f)[8]) {
  *reinterpret_cast<uint4*>(p) = pack8(f);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the whole block, returned to every thread. `scratch` holds one float per warp; the
// trailing barrier lets the caller reuse it for the next reduction.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int n_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < n_warps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// Maximum over the whole block, returned to every thread; same contract as block_sum.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int n_warps = (blockDim.x + kWarpSize - 1) / kWarpSize;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < n_warps; ++w) m = fmaxf(m, scratch[w]);
  __syncthreads();
  return m;
}

// Block-wide double sum in a fixed tree order; `sh` holds blockDim.x doubles (a power of two).
__device__ __forceinline__ double block_sum_f64(double v, double* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
    __syncthreads();
  }
  return sh[0];
}

// ---- element access for f32 and bf16 (uint16_t) data, for kernels that take either ----

__device__ __forceinline__ float ld(const float* p, int64_t i) {
  return p[i];
}
__device__ __forceinline__ float ld(const uint16_t* p, int64_t i) {
  return bf16_to_float(p[i]);
}
__device__ __forceinline__ void st(float* p, int64_t i, float v) {
  p[i] = v;
}
__device__ __forceinline__ void st(uint16_t* p, int64_t i, float v) {
  p[i] = float_to_bf16(v);
}

// 8 consecutive elements at a 16-byte aligned address.
__device__ __forceinline__ void ld8(const float* p, float (&f)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}
__device__ __forceinline__ void ld8(const uint16_t* p, float (&f)[8]) {
  load8(p, f);
}
__device__ __forceinline__ void st8(float* p, const float (&f)[8]) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}
__device__ __forceinline__ void st8(uint16_t* p, const float (&f)[8]) {
  store8(p, f);
}

// 4 consecutive elements at a 16-byte (f32) or 8-byte (bf16) aligned address.
__device__ __forceinline__ float4 ld4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ float4 ld4(const uint16_t* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                     __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}

// Programmatic dependent launch (sm_90+). A kernel launched with programmatic stream
// serialization may start while the kernel before it still runs, once every block of that one
// has called pdl_launch_dependents() (or exited); it must call pdl_wait() before touching
// anything the earlier kernels write, which returns once they have completed and their writes
// are visible. Both are no-ops without such a launch.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

inline bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}
inline bool aligned16(const void* p) {
  return aligned(p, 16);
}

}  // namespace iris::cuda
