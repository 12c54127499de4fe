// Backend::image_patches: one block per patch row, the pixel table in shared memory. A value is a
// table entry rounded once to the destination's type (round to nearest even, as the host's write
// of f32 rows rounds), so the rows equal the host preprocessing's bit for bit.
#include <cuda_bf16.h>

#include "core/cuda/cuda_check.h"
#include "core/cuda/pixels/pixels.h"

namespace iris::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ T from_table(float v);
template <>
__device__ float from_table<float>(float v) {
  return v;
}
template <>
__device__ __nv_bfloat16 from_table<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T>
__global__ void image_patches_kernel(T* dst, const uint8_t* frames, int64_t frame_bytes,
                                     bool one_frame, const float* table, const int32_t* dst_rows,
                                     ImagePatchGeometry g) {
  __shared__ float lut[3 * 256];
  for (int i = threadIdx.x; i < 3 * 256; i += blockDim.x) lut[i] = table[i];
  __syncthreads();
  const int P = g.patch_size, Tp = g.temporal_patch_size, m = g.merge_size;
  const int64_t row = blockIdx.x;
  const int bw = g.width / P / m;
  const int64_t block = row / (m * m);
  const int in_block = static_cast<int>(row % (m * m));
  const int r = static_cast<int>(block / bw) * m + in_block / m;
  const int c = static_cast<int>(block % bw) * m + in_block % m;
  const int pp = P * P, values = 3 * Tp * pp;
  T* out = dst + static_cast<int64_t>(dst_rows[row]) * values;
  for (int i = threadIdx.x; i < values; i += blockDim.x) {
    const int ch = i / (Tp * pp), f = (i / pp) % Tp, py = (i / P) % P, px = i % P;
    const int64_t at = (one_frame ? 0 : f * frame_bytes) +
                       ((static_cast<int64_t>(r) * P + py) * g.width + int64_t{c} * P + px) * 3 +
                       ch;
    out[i] = from_table<T>(lut[ch * 256 + frames[at]]);
  }
}

}  // namespace

void launch_image_patches(void* dst, bool dst_f32, const uint8_t* frames, int n_frames,
                          const float* table, const int32_t* dst_rows, const ImagePatchGeometry& g,
                          cudaStream_t s) {
  const int64_t patches = g.patches();
  if (patches == 0) return;
  const int64_t frame_bytes = int64_t{g.height} * g.width * 3;
  if (dst_f32)
    image_patches_kernel<float><<<static_cast<unsigned>(patches), kThreads, 0, s>>>(
        static_cast<float*>(dst), frames, frame_bytes, n_frames == 1, table, dst_rows, g);
  else
    image_patches_kernel<__nv_bfloat16><<<static_cast<unsigned>(patches), kThreads, 0, s>>>(
        static_cast<__nv_bfloat16*>(dst), frames, frame_bytes, n_frames == 1, table, dst_rows, g);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
