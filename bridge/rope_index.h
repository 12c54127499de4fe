// 3-row M-RoPE position ids for a prompt with images and videos (HF get_rope_index).
#pragma once

#include <cstdint>
#include <vector>

#include "vision/vision_encoder.h"

namespace iris {

struct RopeIndex {
  std::vector<int64_t> positions;  // [3, n_tokens]: T row, H row, W row
  int64_t delta = 0;               // decode position = token index in `ids` + delta
};

// One run of vision pad tokens in the prompt: t x h x w merged units in raster order, frame by
// frame. Its units sit at T = start + k * temporal_step (frame k), H = start + row,
// W = start + col, and the text after it starts at start + max(h, w). How a family cuts its
// media into runs is its architecture's (an image is one run of t = 1; a Qwen3-VL video one run
// per temporal slice, a Qwen2.5-VL video one run with its time scale as the step).
struct VisionRun {
  int32_t pad_id = 0;  // the token the run is made of (<|image_pad|> or <|video_pad|>)
  int64_t t = 1, h = 0, w = 0;
  int64_t temporal_step = 1;
  int64_t tokens() const { return t * h * w; }
};

// The runs of images of these grids (in patches), in order.
std::vector<VisionRun> image_runs(const std::vector<GridTHW>& grids, int32_t image_pad_id,
                                  int spatial_merge_size);

// Text tokens advance all three axes together; each maximal run of pad tokens (image_pad_id or
// video_pad_id) takes the next runs, in order, until it is covered.
//
// `start` is the position of ids[0]. A chat's next turn passes the position after everything
// before it (max + 1, which is where the running position stands after text): HF computes the
// whole conversation in one walk, and the walk's state at a text boundary is only that position,
// so continuing from it gives the positions of walking the whole sequence again.
RopeIndex compute_rope_index(const std::vector<int32_t>& ids, const std::vector<VisionRun>& runs,
                             int32_t image_pad_id, int32_t video_pad_id, int64_t start = 0);

}  // namespace iris
