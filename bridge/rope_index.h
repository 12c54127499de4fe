// 3-row M-RoPE position ids for a prompt with images (HF get_rope_index, Qwen3-VL).
#pragma once

#include <cstdint>
#include <vector>

#include "vision/vision_encoder.h"

namespace iris {

struct RopeIndex {
  std::vector<int64_t> positions;  // [3, n_tokens]: T row, H row, W row
  int64_t delta = 0;               // decode position = token index in `ids` + delta
};

// Text tokens advance all three axes together; each run of image-pad tokens takes the next grid
// and spans its merged rows (H) and columns (W) from the same start.
//
// `start` is the position of ids[0]. A chat's next turn passes the position after everything
// before it (max + 1, which is where the running position stands after text): HF computes the
// whole conversation in one walk, and the walk's state at a text boundary is only that position,
// so continuing from it gives the positions of walking the whole sequence again.
RopeIndex compute_rope_index(const std::vector<int32_t>& ids, const std::vector<GridTHW>& grids,
                             int32_t image_token_id, int spatial_merge_size, int64_t start = 0);

}  // namespace iris
