// Skinny GEMMs (M <= 8 rows of x): y[M,N] = x[M,K] w[N,K]^T, the decode-step projections. With a
// handful of rows the product is a stream over the weights, so the kernel is built for bandwidth:
// each warp owns two weight rows and keeps 16 independent 16-byte loads per lane in flight, x
// sits in shared memory (bf16, staged while the first weight loads are on their way), and the
// sums stay in f32. cuBLASLt's M=1 kernels reach about three quarters of the memory bandwidth
// on these shapes; this layout streams at close to the copy rate.
//
// Fused variants for the decoder: the RMSNorm of x can be applied while staging it (every block
// normalises the few rows itself, block 0 also stores them), and a gate/up projection can end in
// SwiGLU (a warp's two rows are gate row j and up row I + j). Rounding points match the unfused
// ops exactly: the normalised x is rounded to bf16 as rms_norm stores it, gate and up are rounded
// as the GEMM output, and silu(gate) is rounded before the product as in swiglu.
#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/gemm/gemm.h"
#include "core/cuda/launch.cuh"

namespace iris::cuda {
namespace {

constexpr int kRowsPerWarp = 2;
// 256-element K slabs (32 lanes x 8) whose weight loads are issued together.
constexpr int kSlabElems = kWarpSize * 8;

// Block shape per variant. A plain GEMV has 128 threads and 8 slabs in flight (8 slabs x 2 rows =
// 16 loads of 16 bytes per lane, enough bytes in flight per SM to cover the memory latency). The
// fused-norm GEMVs recompute the RMS of x in every block, so they take 256 threads (twice the
// rows per block, half the recomputation) and 4 slabs. On an H100, over 28 layers of distinct
// weights: qkv (4096 x 2048) 9.15 -> 8.08 us, gate_up + SwiGLU (12288 x 2048) 19.6 -> 18.6 us;
// the plain o_proj was slower that way (5.5 -> 6.0 us) and keeps the smaller shape.
template <bool kNorm>
struct GemvShape {
  static constexpr int kThreads = kNorm ? 256 : 128;
  static constexpr int kWarps = kThreads / kWarpSize;
  static constexpr int kSlabsInFlight = kNorm ? 4 : 8;
};
// x rows live in dynamic shared memory; larger inputs go to cuBLASLt.
constexpr int kGemvMaxSmemBytes = 64 * 1024;

struct GemvParams {
  uint16_t* y;
  const uint16_t* x;
  const uint16_t* w;
  const uint16_t* bias;    // optional, [N]
  uint16_t* xn;            // kNorm: normalised x, stored by block 0
  uint16_t* act;           // kSwiglu: [M, N/2]
  const uint16_t* norm_w;  // kNorm: [K]
  float eps;
  int m;
  int64_t n, k;
  bool accumulate;
};

// Weights are read exactly once: keep them out of L1 so that x and the norm weights stay there.
__device__ __forceinline__ uint4 load_stream(const uint16_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

template <int MAXM, bool kNorm, bool kSwiglu>
__global__ void __launch_bounds__(GemvShape<kNorm>::kThreads) gemv_kernel(GemvParams p) {
  constexpr int kGemvThreads = GemvShape<kNorm>::kThreads;
  constexpr int kGemvWarps = GemvShape<kNorm>::kWarps;
  constexpr int kSlabsInFlight = GemvShape<kNorm>::kSlabsInFlight;
  extern __shared__ __align__(16) uint16_t xs[];  // [m][K] bf16
  __shared__ float red[MAXM][kGemvWarps];
  const int tid = threadIdx.x, warp = tid / kWarpSize, lane = tid % kWarpSize;
  const int64_t K = p.k;

  // This warp's two weight rows: consecutive rows, or gate row j and up row I + j.
  int64_t rows[kRowsPerWarp];
  bool valid[kRowsPerWarp];
  if constexpr (kSwiglu) {
    const int64_t inter = p.n / 2;
    const int64_t j = static_cast<int64_t>(blockIdx.x) * kGemvWarps + warp;
    rows[0] = j, rows[1] = inter + j;
    valid[0] = valid[1] = j < inter;
  } else {
    const int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kGemvWarps + warp) * kRowsPerWarp;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) rows[r] = r0 + r, valid[r] = r0 + r < p.n;
  }
  const uint16_t* wrow[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) wrow[r] = p.w + (valid[r] ? rows[r] : 0) * K;

  uint4 wv[kSlabsInFlight][kRowsPerWarp];
  auto load_group = [&](int64_t slab0) {
#pragma unroll
    for (int u = 0; u < kSlabsInFlight; ++u) {
      const int64_t c = (slab0 + u) * kSlabElems + lane * 8;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r)
        wv[u][r] = valid[r] && c < K ? load_stream(wrow[r] + c) : make_uint4(0, 0, 0, 0);
    }
  };
  // The first weights depend on no earlier kernel: under a programmatic launch their loads are
  // in flight while the kernel before this one finishes; x, y and xn are touched only after
  // pdl_wait(). Without one, they overlap the staging of x below.
  load_group(0);
  pdl_wait();

  const int64_t n_vec = K / 8;
  if constexpr (kNorm) {
    // Sum of squares of each row, then the rounded rms_norm output (y = bf16(bf16(x * r) * w)).
    float ss[MAXM];
#pragma unroll
    for (int m = 0; m < MAXM; ++m) ss[m] = 0.f;
    for (int64_t i = tid; i < n_vec; i += kGemvThreads) {
#pragma unroll
      for (int m = 0; m < MAXM; ++m) {
        if (m >= p.m) break;
        float f[8];
        load8(p.x + m * K + i * 8, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[m] += f[e] * f[e];
      }
    }
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
      const float s = warp_sum(ss[m]);
      if (lane == 0) red[m][warp] = s;
    }
    __syncthreads();
    const float inv_cols = 1.f / static_cast<float>(K);
    float rstd[MAXM];
#pragma unroll
    for (int m = 0; m < MAXM; ++m) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kGemvWarps; ++w) s += red[m][w];
      rstd[m] = rsqrtf(s * inv_cols + p.eps);
    }
    const bool store_xn = blockIdx.x == 0;
    for (int64_t i = tid; i < n_vec; i += kGemvThreads) {
      float wn[8];
      load8(p.norm_w + i * 8, wn);
#pragma unroll
      for (int m = 0; m < MAXM; ++m) {
        if (m >= p.m) break;
        float f[8];
        load8(p.x + m * K + i * 8, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = round_bf16(f[e] * rstd[m]) * wn[e];
        const uint4 packed = pack8(f);
        *reinterpret_cast<uint4*>(xs + m * K + i * 8) = packed;
        if (store_xn) *reinterpret_cast<uint4*>(p.xn + m * K + i * 8) = packed;
      }
    }
  } else {
    for (int64_t i = tid; i < static_cast<int64_t>(p.m) * n_vec; i += kGemvThreads)
      reinterpret_cast<uint4*>(xs)[i] = reinterpret_cast<const uint4*>(p.x)[i];
  }
  __syncthreads();

  float acc[MAXM][kRowsPerWarp];
#pragma unroll
  for (int m = 0; m < MAXM; ++m)
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) acc[m][r] = 0.f;

  const int64_t n_slabs = (K + kSlabElems - 1) / kSlabElems;
  for (int64_t slab0 = 0; slab0 < n_slabs; slab0 += kSlabsInFlight) {
    if (slab0 > 0) load_group(slab0);
#pragma unroll
    for (int u = 0; u < kSlabsInFlight; ++u) {
      const int64_t c = (slab0 + u) * kSlabElems + lane * 8;
      if (c >= K) break;
      float wf[kRowsPerWarp][8];
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) unpack8(wv[u][r], wf[r]);
#pragma unroll
      for (int m = 0; m < MAXM; ++m) {
        if (m >= p.m) break;
        float xf[8];
        unpack8(*reinterpret_cast<const uint4*>(xs + m * K + c), xf);
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[m][r] = fmaf(xf[e], wf[r][e], acc[m][r]);
      }
    }
  }

#pragma unroll
  for (int m = 0; m < MAXM; ++m)
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) acc[m][r] = warp_sum(acc[m][r]);

  // The next kernel of the decode step may launch now and queue its weight loads behind our
  // stores. Triggered at the start instead, its blocks took SM slots that this GEMV's own later
  // blocks needed: on an H100, 28 back-to-back o_proj GEMVs (2048 x 2048) took 6.3 us each that
  // way and 5.5 this way, a decoder layer's four GEMVs 48.5 us against 46.9.
  pdl_launch_dependents();
  // Every lane now holds every sum; lane m writes row m's outputs.
#pragma unroll
  for (int m = 0; m < MAXM; ++m) {
    if (m >= p.m || lane != m) continue;
    if constexpr (kSwiglu) {
      if (!valid[0]) continue;
      const int64_t inter = p.n / 2, j = rows[0];
      const float gate = round_bf16(acc[m][0]), up = round_bf16(acc[m][1]);
      p.y[m * p.n + j] = float_to_bf16(gate);
      p.y[m * p.n + inter + j] = float_to_bf16(up);
      p.act[m * inter + j] = float_to_bf16(round_bf16(silu(gate)) * up);
    } else {
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        if (!valid[r]) continue;
        float v = acc[m][r];
        if (p.bias != nullptr) v += bf16_to_float(p.bias[rows[r]]);
        uint16_t* out = p.y + m * p.n + rows[r];
        if (p.accumulate) v += bf16_to_float(*out);
        *out = float_to_bf16(v);
      }
    }
  }
}

template <int MAXM, bool kNorm, bool kSwiglu>
void launch_gemv_kernel(const GemvParams& p, cudaStream_t s) {
  const int64_t units = kSwiglu ? p.n / 2 : (p.n + kRowsPerWarp - 1) / kRowsPerWarp;
  constexpr int kWarps = GemvShape<kNorm>::kWarps;
  const unsigned grid = static_cast<unsigned>((units + kWarps - 1) / kWarps);
  const size_t smem = static_cast<size_t>(p.m) * p.k * sizeof(uint16_t);
  launch_programmatic(gemv_kernel<MAXM, kNorm, kSwiglu>, dim3(grid),
                      dim3(GemvShape<kNorm>::kThreads), smem, s, p);
}

template <bool kNorm, bool kSwiglu>
void dispatch_gemv(const GemvParams& p, cudaStream_t s) {
  if (p.m <= 1) return launch_gemv_kernel<1, kNorm, kSwiglu>(p, s);
  if (p.m <= 2) return launch_gemv_kernel<2, kNorm, kSwiglu>(p, s);
  if (p.m <= 4) return launch_gemv_kernel<4, kNorm, kSwiglu>(p, s);
  return launch_gemv_kernel<8, kNorm, kSwiglu>(p, s);
}

template <bool kNorm, bool kSwiglu>
void set_gemv_smem() {
  IRIS_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<1, kNorm, kSwiglu>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kGemvMaxSmemBytes));
  IRIS_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<2, kNorm, kSwiglu>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kGemvMaxSmemBytes));
  IRIS_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<4, kNorm, kSwiglu>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kGemvMaxSmemBytes));
  IRIS_CUDA_CHECK(cudaFuncSetAttribute(gemv_kernel<8, kNorm, kSwiglu>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       kGemvMaxSmemBytes));
}

}  // namespace

void gemv_init() {
  set_gemv_smem<false, false>();
  set_gemv_smem<true, false>();
  set_gemv_smem<true, true>();
}

bool gemv_supported(int64_t m, int64_t n, int64_t k, const void* x, const void* w) {
  return m >= 1 && m <= kGemvMaxM && n >= 1 && k >= 8 && k % 8 == 0 &&
         m * k * static_cast<int64_t>(sizeof(uint16_t)) <= kGemvMaxSmemBytes && aligned16(x) &&
         aligned16(w);
}

void launch_gemv(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
                 int64_t n, int64_t k, bool accumulate, cudaStream_t s) {
  GemvParams p{};
  p.y = y;
  p.x = x;
  p.w = w;
  p.bias = bias;
  p.m = static_cast<int>(m);
  p.n = n;
  p.k = k;
  p.accumulate = accumulate;
  dispatch_gemv<false, false>(p, s);
}

void launch_gemv_rms_norm(uint16_t* y, uint16_t* xn, uint16_t* act, const uint16_t* x,
                          const uint16_t* norm_w, float eps, const uint16_t* w, int64_t m,
                          int64_t n, int64_t k, cudaStream_t s) {
  GemvParams p{};
  p.y = y;
  p.x = x;
  p.w = w;
  p.xn = xn;
  p.act = act;
  p.norm_w = norm_w;
  p.eps = eps;
  p.m = static_cast<int>(m);
  p.n = n;
  p.k = k;
  if (act != nullptr) return dispatch_gemv<true, true>(p, s);
  dispatch_gemv<true, false>(p, s);
}

}  // namespace iris::cuda
