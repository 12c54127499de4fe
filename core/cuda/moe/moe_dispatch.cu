// The permutation of a mixture-of-experts layer (core/backend_ops.inc: moe_dispatch and
// moe_combine). The plan runs in one block so that it needs no scratch beyond shared memory and
// no host synchronisation: each warp counts the experts of a contiguous segment of slots, the
// counts are prefixed over the warps and the experts, and each warp then walks its segment again,
// ranking equal experts within a 32-slot step with __match_any_sync. Rows are therefore stable
// by slot, as the CPU oracle assigns them.
#include <cuda_runtime.h>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/moe/moe.h"

namespace iris::cuda {
namespace {

constexpr int kPlanWarps = 16;

__global__ void moe_plan_kernel(int32_t* __restrict__ offsets, int32_t* __restrict__ slot_rows,
                                const int32_t* __restrict__ ids, int64_t slots, int E,
                                int64_t padded_capacity) {
  extern __shared__ int32_t smem[];
  int32_t* warp_count = smem;              // [kPlanWarps][E]
  int32_t* start = smem + kPlanWarps * E;  // [E + 1]
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  for (int i = static_cast<int>(threadIdx.x); i < kPlanWarps * E; i += blockDim.x) smem[i] = 0;
  __syncthreads();
  const int64_t per_warp = (slots + kPlanWarps - 1) / kPlanWarps;
  const int64_t begin = warp * per_warp, end = min(slots, begin + per_warp);
  auto expert_of = [&](int64_t s) {
    const int32_t e = ids[s];
    return e >= 0 && e < E ? e : -1;
  };
  for (int64_t s = begin + lane; s < end; s += 32) {
    const int32_t e = expert_of(s);
    if (e >= 0) atomicAdd(&warp_count[warp * E + e], 1);
  }
  __syncthreads();
  // Per expert, each warp's first row relative to the expert's start, and the expert's total.
  for (int e = static_cast<int>(threadIdx.x); e < E; e += blockDim.x) {
    int32_t running = 0;
    for (int w = 0; w < kPlanWarps; ++w) {
      const int32_t c = warp_count[w * E + e];
      warp_count[w * E + e] = running;
      running += c;
    }
    start[e + 1] = running;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    start[0] = 0;
    for (int e = 0; e < E; ++e)
      start[e + 1] = padded_capacity > 0 ? static_cast<int32_t>((e + 1) * padded_capacity)
                                         : start[e + 1] + start[e];
  }
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e <= E; e += blockDim.x) offsets[e] = start[e];
  const unsigned lower = (1u << lane) - 1u;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t s = base + lane;
    const bool here = s < end;
    const unsigned active = __ballot_sync(0xffffffffu, here);
    const int32_t e = here ? expert_of(s) : -2;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (here) {
      if (e < 0) {
        slot_rows[s] = -1;
      } else {
        const int rank = __popc(peers & active & lower);
        const int32_t within = warp_count[warp * E + e] + rank;
        // Past a padded segment only when the caller skipped the drop (the CPU oracle refuses
        // that): such a slot goes nowhere rather than into the next expert's rows.
        slot_rows[s] = padded_capacity > 0 && within >= padded_capacity ? -1 : start[e] + within;
      }
    }
    __syncwarp();
    // The lowest lane of each expert's peers moves that expert's count on by the step's slots.
    if (here && e >= 0 && (peers & active & lower) == 0)
      warp_count[warp * E + e] += __popc(peers & active);
    __syncwarp();
  }
}

constexpr int kDropThreads = 512;

// A non-negative bf16's bits order as its value; the sign bit (only -0 among routing weights)
// counts as zero.
__device__ __forceinline__ uint32_t weight_key(uint16_t bits) {
  return (bits & 0x8000u) != 0 ? 0u : bits;
}

// The block's exclusive prefix of `flag` over its threads, and the block's total.
__device__ int block_exclusive_count(bool flag, int* warp_totals, int* total) {
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const unsigned votes = __ballot_sync(0xffffffffu, flag);
  const int below = __popc(votes & ((1u << lane) - 1u));
  if (lane == 0) warp_totals[warp] = __popc(votes);
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < kDropThreads / 32; ++w) {
    if (w < warp) before += warp_totals[w];
    all += warp_totals[w];
  }
  *total = all;
  __syncthreads();
  return before + below;
}

// One block an expert. Its slots over capacity are found without sorting: with the "probs"
// policy, a two-byte radix select over the weights' bits finds the capacity-th largest weight,
// the slots above it are kept and, among those equal to it, the first in slot order up to the
// capacity (an ordered walk with a block prefix); with "position" only the walk. Each block
// writes its own expert's slots; block 0 also the padding slots.
__global__ void moe_capacity_drop_kernel(int32_t* __restrict__ kept, int32_t* __restrict__ dropped,
                                         const int32_t* __restrict__ ids,
                                         const uint16_t* __restrict__ weights, int64_t slots,
                                         int64_t capacity, bool by_weight) {
  const int e = static_cast<int>(blockIdx.x);
  const int E = static_cast<int>(gridDim.x);
  __shared__ int hist[256];
  __shared__ int warp_totals[kDropThreads / 32];
  __shared__ int count, select_bin, above;
  for (int i = static_cast<int>(threadIdx.x); i < 256; i += blockDim.x) hist[i] = 0;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  for (int64_t s = threadIdx.x; s < slots; s += blockDim.x) {
    const int32_t id = ids[s];
    if (id == e) {
      atomicAdd(&count, 1);
      if (by_weight) atomicAdd(&hist[weight_key(weights[s]) >> 8], 1);
    } else if (e == 0 && (id < 0 || id >= E)) {
      kept[s] = -1;
    }
  }
  __syncthreads();
  const int n = count;
  if (n <= capacity) {
    for (int64_t s = threadIdx.x; s < slots; s += blockDim.x)
      if (ids[s] == e) kept[s] = e;
    return;
  }
  // The threshold key: slots above it are kept, `need` of those equal to it in slot order.
  uint32_t threshold = 0;
  int64_t need = capacity;
  if (by_weight) {
    for (int byte = 0; byte < 2; ++byte) {
      if (threadIdx.x == 0) {
        int64_t cum = byte == 0 ? 0 : above;
        int bin = 255;
        for (; bin > 0; --bin) {
          if (cum + hist[bin] >= need) break;
          cum += hist[bin];
        }
        select_bin = bin;
        above = static_cast<int>(cum);
      }
      __syncthreads();
      if (byte == 0) {
        const uint32_t high = static_cast<uint32_t>(select_bin);
        threshold = high << 8;
        for (int i = static_cast<int>(threadIdx.x); i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int64_t s = threadIdx.x; s < slots; s += blockDim.x)
          if (ids[s] == e) {
            const uint32_t key = weight_key(weights[s]);
            if ((key >> 8) == high) atomicAdd(&hist[key & 0xffu], 1);
          }
        __syncthreads();
      } else {
        threshold |= static_cast<uint32_t>(select_bin);
        need = capacity - above;
      }
    }
  }
  // The ordered walk: the first `need` slots at the threshold (every slot, by position) stay.
  int64_t taken = 0;
  for (int64_t base = 0; base < slots; base += blockDim.x) {
    const int64_t s = base + threadIdx.x;
    const bool mine = s < slots && ids[s] == e;
    const uint32_t key = mine && by_weight ? weight_key(weights[s]) : 0u;
    const bool at = mine && key == threshold;
    int in_step = 0;
    const int before = block_exclusive_count(at, warp_totals, &in_step);
    if (mine) kept[s] = (by_weight && key > threshold) || (at && taken + before < need) ? e : -1;
    taken += in_step;
  }
  if (threadIdx.x == 0 && dropped != nullptr) atomicAdd(dropped, n - static_cast<int>(capacity));
}

__global__ void moe_gather_kernel(uint16_t* __restrict__ x_sorted,
                                  const int32_t* __restrict__ slot_rows,
                                  const uint16_t* __restrict__ x, int k, int64_t H) {
  const int64_t s = blockIdx.x;
  const int32_t r = slot_rows[s];
  if (r < 0) return;
  const uint16_t* src = x + (s / k) * H;
  uint16_t* dst = x_sorted + static_cast<int64_t>(r) * H;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dst[h] = src[h];
}

__global__ void moe_combine_kernel(uint16_t* __restrict__ y, const uint16_t* __restrict__ y_sorted,
                                   const int32_t* __restrict__ slot_rows,
                                   const uint16_t* __restrict__ weights, int k, int64_t H,
                                   bool accumulate) {
  const int64_t t = blockIdx.x;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int32_t r = slot_rows[t * k + j];
      if (r >= 0)
        sum += bf16_to_float(weights[t * k + j]) *
               bf16_to_float(y_sorted[static_cast<int64_t>(r) * H + h]);
    }
    if (accumulate) sum += bf16_to_float(y[t * H + h]);
    y[t * H + h] = float_to_bf16(sum);
  }
}

template <typename DY>
__device__ __forceinline__ float load_grad(const DY* p, int64_t i);
template <>
__device__ __forceinline__ float load_grad<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float load_grad<uint16_t>(const uint16_t* p, int64_t i) {
  return bf16_to_float(p[i]);
}

constexpr int kReduceThreads = 256;

// One block a slot: its sorted row of the gradient and its weight's gradient, the dot product
// reduced in a fixed tree (the same bits every run).
template <typename DY>
__global__ void moe_combine_backward_kernel(uint16_t* __restrict__ dy_sorted,
                                            float* __restrict__ dweights, const DY* __restrict__ dy,
                                            const uint16_t* __restrict__ y_sorted,
                                            const int32_t* __restrict__ slot_rows,
                                            const uint16_t* __restrict__ weights, int k,
                                            int64_t H) {
  const int64_t s = blockIdx.x;
  const int32_t r = slot_rows[s];
  if (r < 0) {
    if (threadIdx.x == 0) dweights[s] = 0.0f;
    return;
  }
  const float w = bf16_to_float(weights[s]);
  const int64_t t = s / k;
  float dot = 0.0f;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    const float g = load_grad(dy, t * H + h);
    dy_sorted[static_cast<int64_t>(r) * H + h] = float_to_bf16(w * g);
    dot += g * bf16_to_float(y_sorted[static_cast<int64_t>(r) * H + h]);
  }
  __shared__ float part[kReduceThreads];
  part[threadIdx.x] = dot;
  __syncthreads();
  for (int half = kReduceThreads / 2; half > 0; half >>= 1) {
    if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) dweights[s] = part[0];
}

template <typename DX>
__global__ void moe_dispatch_backward_kernel(DX* __restrict__ dx,
                                             const uint16_t* __restrict__ dx_sorted,
                                             const int32_t* __restrict__ slot_rows, int k,
                                             int64_t H) {
  const int64_t t = blockIdx.x;
  for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int32_t r = slot_rows[t * k + j];
      if (r >= 0) sum += bf16_to_float(dx_sorted[static_cast<int64_t>(r) * H + h]);
    }
    if constexpr (sizeof(DX) == sizeof(float))
      dx[t * H + h] += sum;
    else
      dx[t * H + h] = float_to_bf16(bf16_to_float(dx[t * H + h]) + sum);
  }
}

}  // namespace

void launch_moe_combine_backward(uint16_t* dy_sorted, float* dweights, const void* dy,
                                 bool dy_is_f32, const uint16_t* y_sorted, const int32_t* slot_rows,
                                 const uint16_t* weights, int64_t T, int k, int64_t H,
                                 cudaStream_t s) {
  const int64_t slots = T * k;
  if (slots == 0) return;
  if (dy_is_f32)
    moe_combine_backward_kernel<float><<<static_cast<unsigned>(slots), kReduceThreads, 0, s>>>(
        dy_sorted, dweights, static_cast<const float*>(dy), y_sorted, slot_rows, weights, k, H);
  else
    moe_combine_backward_kernel<uint16_t><<<static_cast<unsigned>(slots), kReduceThreads, 0, s>>>(
        dy_sorted, dweights, static_cast<const uint16_t*>(dy), y_sorted, slot_rows, weights, k, H);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_moe_dispatch_backward(void* dx, bool dx_is_f32, const uint16_t* dx_sorted,
                                  const int32_t* slot_rows, int64_t T, int k, int64_t H,
                                  cudaStream_t s) {
  if (T == 0) return;
  if (dx_is_f32)
    moe_dispatch_backward_kernel<float><<<static_cast<unsigned>(T), 256, 0, s>>>(
        static_cast<float*>(dx), dx_sorted, slot_rows, k, H);
  else
    moe_dispatch_backward_kernel<uint16_t><<<static_cast<unsigned>(T), 256, 0, s>>>(
        static_cast<uint16_t*>(dx), dx_sorted, slot_rows, k, H);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_moe_capacity_drop(int32_t* kept_ids, int32_t* dropped, const int32_t* ids,
                              const uint16_t* weights, int64_t slots, int E, int64_t capacity,
                              bool by_weight, cudaStream_t s) {
  moe_capacity_drop_kernel<<<static_cast<unsigned>(E), kDropThreads, 0, s>>>(
      kept_ids, dropped, ids, weights, slots, capacity, by_weight);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_moe_dispatch(uint16_t* x_sorted, int32_t* offsets, int32_t* slot_rows,
                         const uint16_t* x, const int32_t* ids, int64_t T, int k, int E, int64_t H,
                         int64_t padded_capacity, cudaStream_t s) {
  const int64_t slots = T * k;
  const size_t smem = (static_cast<size_t>(kPlanWarps) * E + E + 1) * sizeof(int32_t);
  moe_plan_kernel<<<1, 32 * kPlanWarps, smem, s>>>(offsets, slot_rows, ids, slots, E,
                                                   padded_capacity);
  IRIS_CUDA_LAUNCH_CHECK();
  // A padded segment's rows past its slots are zeros, so that its GEMMs add nothing to the
  // experts' weight gradients.
  if (padded_capacity > 0)
    IRIS_CUDA_CHECK(cudaMemsetAsync(
        x_sorted, 0, static_cast<size_t>(E) * padded_capacity * H * sizeof(uint16_t), s));
  if (slots == 0) return;
  moe_gather_kernel<<<static_cast<unsigned>(slots), 128, 0, s>>>(x_sorted, slot_rows, x, k, H);
  IRIS_CUDA_LAUNCH_CHECK();
}

void launch_moe_combine(uint16_t* y, const uint16_t* y_sorted, const int32_t* slot_rows,
                        const uint16_t* weights, int64_t T, int k, int64_t H, bool accumulate,
                        cudaStream_t s) {
  if (T == 0) return;
  moe_combine_kernel<<<static_cast<unsigned>(T), 256, 0, s>>>(y, y_sorted, slot_rows, weights, k, H,
                                                              accumulate);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
