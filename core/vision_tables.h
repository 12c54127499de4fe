// The per-call tables of a vision encoder call (2D RoPE cos/sin, position-embedding interpolation
// indices and weights, attention segments) on the host. Backend::vision_tables computes them on
// the device from the images' grid sizes; this is its definition: the CPU backend runs it (the
// oracle the CUDA kernel is checked against), and plan_vision_inputs (vision/) lays out the same
// tables for a list of grids.
#pragma once

#include <cstdint>
#include <vector>

namespace iris {

// The 2D RoPE frequencies of a vision head: head_dim / 4 per axis (a row's first quarter-pairs
// rotate with its patch row, the next with its column). Computed in float32 as torch does, then
// rounded to bf16: HF keeps inv_freq in a buffer that is cast with the model, so checkpoints run
// through model.to(bfloat16) (the released weights and our goldens) rotate with bf16
// frequencies, as the text M-RoPE does (language/mrope.cpp). Measured against an f64 HF run:
// unrounded frequencies move the vision qkv gradients by 8e-5 of their scale, rounded by 3e-6.
std::vector<float> vision_rope_inv_freq(int head_dim, float rope_theta);

// The grids of one call as Backend::vision_tables reads them: i32 [1 + 3 * capacity], the image
// count n, then (t, h, w) of images 0 .. n-1; entries past image n are not read.
constexpr int64_t vision_grids_numel(int capacity) {
  return 1 + 3 * static_cast<int64_t>(capacity);
}

// The tables of one call over `rows` rows (the patches of every image in order, then padding),
// written as Backend::vision_tables specifies. Refuses what the device kernel could only clamp:
// a bad grid, more patches than rows, more segments than `capacity`.
struct VisionTablesOut {
  float* cos = nullptr;           // [rows, head_dim]
  float* sin = nullptr;           // [rows, head_dim]
  int32_t* pos_index = nullptr;   // [rows, 4]
  float* pos_weight = nullptr;    // [rows, 4]
  int32_t* cu_seqlens = nullptr;  // [capacity + 1]
  int32_t* real_rows = nullptr;   // [1]
  // With window attention (window_units > 0): one segment per window, then the padding's, then
  // zero-length segments up to window_capacity: i32 [window_capacity + 1].
  int32_t* window_cu = nullptr;
};
// window_units > 0 (Qwen2.5-VL): the rows are laid out in window order rather than raster order.
// Each frame's merged units (merge_size^2 patches each) are cut into windows of window_units x
// window_units units from the top left (the last row and column of windows clipped by the grid),
// windows are taken in raster order and units inside a window in raster order, as HF's
// get_window_index permutes them. Frames stay contiguous, so cu_seqlens still segments by frame.
void vision_tables_host(const VisionTablesOut& out, const int32_t* grids, int capacity,
                        int64_t rows, int head_dim, const std::vector<float>& inv_freq,
                        int merge_size, int grid_side, int window_units = 0,
                        int window_capacity = 0);

// For each merged unit in window order, its index in raster order over all images of `grids`
// (packed as vision_tables reads them): HF's window_index.
std::vector<int32_t> vision_window_index(const int32_t* grids, int merge_size, int window_units);

// The number of windows of a (t, h, w) grid (h, w in patches) with window_units merged units a
// side: t * ceil(h / m / units) * ceil(w / m / units).
int64_t vision_window_count(int64_t t, int64_t h, int64_t w, int merge_size, int window_units);

// Merged unit `i` of a frame laid out in window order is unit (row, col) of the raster grid of
// h2 x w2 units: the closed form of the window walk (full windows before the last band and
// column), so that host and device compute it per row without a walk.
#ifdef __CUDACC__
__host__ __device__
#endif
    inline void
    window_unit_position(int64_t i, int64_t h2, int64_t w2, int units, int64_t* row, int64_t* col) {
  const int64_t band_units = units * w2;  // units in a full band of windows
  const int64_t wy = i / band_units, in_band = i % band_units;
  const int64_t band_h = h2 - wy * units < units ? h2 - wy * units : units;
  const int64_t full_window = band_h * units;
  const int64_t wx = in_band / full_window, in_window = in_band % full_window;
  const int64_t win_w = w2 - wx * units < units ? w2 - wx * units : units;
  *row = wy * units + in_window / win_w;
  *col = wx * units + in_window % win_w;
}

}  // namespace iris
