// Backend::vision_tables on the device: the 2D RoPE tables, the position-embedding interpolation
// and the attention segments of a vision call, computed from the grids in device memory so that a
// captured encoder graph computes them at replay and the host uploads a few ints per call.
#include <algorithm>

#include "core/cuda/cuda_check.h"
#include "core/cuda/tables/tables.h"
#include "core/vision_tables.h"

namespace iris::cuda {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops cap the grid; every block rebuilds the image table first, so fewer blocks
// also mean less of that.
constexpr int64_t kMaxBlocks = 4096;

// Kernel arguments are copied at launch (and frozen in a captured graph), which is what a
// per-model constant needs.
struct Freqs {
  float v[kVisionTablesMaxQuarter];
};

// torch.linspace(start, end, steps)[i] in float32 with each operation rounded on its own, as the
// host's vision_tables_host computes it: the explicit intrinsics keep nvcc from contracting a
// multiply and an add into an FMA, so the interpolation indices and weights match bit for bit.
__device__ float linspace_at(float start, float end, int64_t steps, int64_t i) {
  if (steps == 1) return start;
  const float step = __fdiv_rn(__fsub_rn(end, start), static_cast<float>(steps - 1));
  return i < steps / 2 ? __fadd_rn(start, __fmul_rn(step, static_cast<float>(i)))
                       : __fsub_rn(end, __fmul_rn(step, static_cast<float>(steps - 1 - i)));
}

// One thread per (row, column j) with j < max(head_dim / 2, 4): j < head_dim / 2 writes the
// rotation pair (j, j + head_dim / 2), j < 4 the row's bilinear corner j.
__global__ void vision_tables_kernel(float* cos, float* sin, int32_t* pos_index, float* pos_weight,
                                     int32_t* cu_seqlens, int32_t* real_rows, const int32_t* grids,
                                     int capacity, int64_t rows, int head_dim, Freqs freqs, int m,
                                     int G, int32_t* window_cu, int units, int window_capacity) {
  // Per image: its first row, t, h, w. The grids are loaded by as many threads as there are
  // images, and one thread adds up the rows from shared memory: the capacity is small (the
  // images of one call), so a serial sum costs less than a parallel scan's barriers.
  extern __shared__ int4 images[];
  __shared__ int64_t n_patches;
  const int n = min(max(grids[0], 0), capacity);
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    images[i] = make_int4(0, grids[1 + 3 * i], grids[2 + 3 * i], grids[3 + 3 * i]);
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t row = 0;
    for (int i = 0; i < n; ++i) {
      images[i].x = static_cast<int>(min(row, rows));
      row += static_cast<int64_t>(images[i].y) * images[i].z * images[i].w;
    }
    n_patches = min(row, rows);
    if (blockIdx.x == 0) {
      // One segment per frame, the padding's own, then zero-length segments up to the capacity.
      int k = 0;
      int64_t end = 0;
      cu_seqlens[0] = 0;
      for (int i = 0; i < n; ++i)
        for (int f = 0; f < images[i].y && k < capacity; ++f) {
          end += static_cast<int64_t>(images[i].z) * images[i].w;
          cu_seqlens[++k] = static_cast<int32_t>(min(end, rows));
        }
      if (rows > n_patches && k < capacity) cu_seqlens[++k] = static_cast<int32_t>(rows);
      for (int i = k + 1; i <= capacity; ++i) cu_seqlens[i] = cu_seqlens[k];
      real_rows[0] = static_cast<int32_t>(n_patches);
      if (units > 0) {
        // One segment per window, in the order vision_tables_host lays the rows out.
        int kw = 0;
        int64_t wend = 0;
        window_cu[0] = 0;
        for (int i = 0; i < n; ++i) {
          const int64_t h2 = images[i].z / m, w2 = images[i].w / m;
          for (int f = 0; f < images[i].y; ++f)
            for (int64_t wy = 0; wy * units < h2; ++wy)
              for (int64_t wx = 0; wx * units < w2 && kw < window_capacity; ++wx) {
                const int64_t wh = min(static_cast<int64_t>(units), h2 - wy * units);
                const int64_t ww = min(static_cast<int64_t>(units), w2 - wx * units);
                wend += wh * ww * m * m;
                window_cu[++kw] = static_cast<int32_t>(min(wend, rows));
              }
        }
        if (rows > n_patches && kw < window_capacity) window_cu[++kw] = static_cast<int32_t>(rows);
        for (int i = kw + 1; i <= window_capacity; ++i) window_cu[i] = window_cu[kw];
      }
    }
  }
  __syncthreads();

  const int rot_dim = head_dim / 2, quarter = rot_dim / 2;
  const int width = max(rot_dim, 4);
  const int64_t total = rows * width;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = idx / width;
    const int j = static_cast<int>(idx % width);
    float* cr = cos + row * head_dim;
    float* sr = sin + row * head_dim;
    if (row >= n_patches) {
      // Padding rotates by nothing and adds nothing of the position embedding.
      if (j < rot_dim) {
        cr[j] = cr[j + rot_dim] = 1.f;
        sr[j] = sr[j + rot_dim] = 0.f;
      }
      if (j < 4) {
        pos_index[row * 4 + j] = 0;
        pos_weight[row * 4 + j] = 0.f;
      }
      continue;
    }
    int i = 0;
    while (i + 1 < n && row >= images[i + 1].x) ++i;
    const int4 im = images[i];
    const int64_t frame = static_cast<int64_t>(im.z) * im.w;
    // The patch order of the host: frames, then merge windows row-major, then within a window.
    const int64_t o = (row - im.x) % frame;
    const int64_t unit = o / (m * m), within = o % (m * m), units_per_row = im.w / m;
    int64_t unit_row = unit / units_per_row, unit_col = unit % units_per_row;
    if (units > 0) window_unit_position(unit, im.z / m, units_per_row, units, &unit_row, &unit_col);
    const int64_t r = unit_row * m + within / m;
    const int64_t c = unit_col * m + within % m;
    if (j < rot_dim) {
      const int64_t p = j < quarter ? r : c;
      const float f = __fmul_rn(static_cast<float>(p), freqs.v[j < quarter ? j : j - quarter]);
      // Rounded from double: the correctly rounded float in all but rare cases, where glibc's
      // cosf and sinf (the CPU oracle) are off by an ulp in about 1% of these arguments.
      double s, co;
      ::sincos(static_cast<double>(f), &s, &co);
      cr[j] = cr[j + rot_dim] = static_cast<float>(co);
      sr[j] = sr[j + rot_dim] = static_cast<float>(s);
    }
    if (j < 4) {
      const float hs = linspace_at(0.f, static_cast<float>(G - 1), im.z, r);
      const float ws = linspace_at(0.f, static_cast<float>(G - 1), im.w, c);
      const int h0 = static_cast<int>(hs), w0 = static_cast<int>(ws);
      const int h1 = min(h0 + 1, G - 1), w1 = min(w0 + 1, G - 1);
      const float dh = __fsub_rn(hs, static_cast<float>(h0));
      const float dw = __fsub_rn(ws, static_cast<float>(w0));
      const float a = j < 2 ? __fsub_rn(1.f, dh) : dh;       // row weight of the corner
      const float b = j % 2 == 0 ? __fsub_rn(1.f, dw) : dw;  // column weight
      pos_index[row * 4 + j] = (j < 2 ? h0 : h1) * G + (j % 2 == 0 ? w0 : w1);
      pos_weight[row * 4 + j] = __fmul_rn(a, b);
    }
  }
}

}  // namespace

void launch_vision_tables(float* cos, float* sin, int32_t* pos_index, float* pos_weight,
                          int32_t* cu_seqlens, int32_t* real_rows, const int32_t* grids,
                          int capacity, int64_t rows, int head_dim, const float* inv_freq,
                          int merge_size, int grid_side, int32_t* window_cu, int window_units,
                          int window_capacity, cudaStream_t s) {
  Freqs freqs{};
  std::copy(inv_freq, inv_freq + head_dim / 4, freqs.v);
  const int64_t work = rows * std::max(head_dim / 2, 4);
  const int64_t blocks = std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks);
  vision_tables_kernel<<<static_cast<unsigned>(blocks), kThreads,
                         static_cast<size_t>(capacity) * sizeof(int4), s>>>(
      cos, sin, pos_index, pos_weight, cu_seqlens, real_rows, grids, capacity, rows, head_dim,
      freqs, merge_size, grid_side, window_cu, window_units, window_capacity);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace iris::cuda
