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
};
void vision_tables_host(const VisionTablesOut& out, const int32_t* grids, int capacity,
                        int64_t rows, int head_dim, const std::vector<float>& inv_freq,
                        int merge_size, int grid_side);

}  // namespace iris
