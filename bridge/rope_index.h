// 3-row M-RoPE position ids for a prompt with images (HF get_rope_index, Qwen3-VL).
#pragma once

#include <cstdint>
#include <vector>

#include "vision/vision_encoder.h"

namespace iris {

struct RopeIndex {
  std::vector<int64_t> positions;  // [3, n_tokens]: T row, H row, W row
  int64_t delta = 0;               // decode position = token index + delta
};

// Text tokens advance all three axes together; each run of image-pad tokens takes the next grid
// and spans its merged rows (H) and columns (W) from the same start.
RopeIndex compute_rope_index(const std::vector<int32_t>& ids, const std::vector<GridTHW>& grids,
                             int32_t image_token_id, int spatial_merge_size);

}  // namespace iris
