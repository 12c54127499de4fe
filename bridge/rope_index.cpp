#include "bridge/rope_index.h"

#include <algorithm>

namespace iris {

std::vector<VisionRun> image_runs(const std::vector<GridTHW>& grids, int32_t image_pad_id, int m) {
  std::vector<VisionRun> runs;
  runs.reserve(grids.size());
  for (const GridTHW& g : grids) runs.push_back({image_pad_id, g[0], g[1] / m, g[2] / m, 1});
  return runs;
}

RopeIndex compute_rope_index(const std::vector<int32_t>& ids, const std::vector<VisionRun>& runs,
                             int32_t image_pad_id, int32_t video_pad_id, int64_t start) {
  const int64_t L = static_cast<int64_t>(ids.size());
  RopeIndex r;
  r.positions.assign(static_cast<size_t>(3 * L), 0);
  int64_t cur = start, max_pos = start - 1;
  size_t next_run = 0;
  int64_t i = 0;
  auto is_pad = [&](int32_t id) { return id == image_pad_id || id == video_pad_id; };
  while (i < L) {
    if (!is_pad(ids[i])) {
      for (int a = 0; a < 3; ++a) r.positions[a * L + i] = cur;
      max_pos = std::max(max_pos, cur);
      ++cur;
      ++i;
      continue;
    }
    int64_t run = 0;
    while (i + run < L && is_pad(ids[i + run])) ++run;
    // A run of pads may hold several media back to back; take runs until it is covered.
    int64_t done = 0;
    while (done < run) {
      IRIS_CHECK(next_run < runs.size(), "the prompt has more image or video pad tokens than the ",
                 runs.size(), " images and video slices provide");
      const VisionRun& v = runs[next_run++];
      const int64_t n = v.tokens();
      IRIS_CHECK(done + n <= run, "an image or video needs ", n,
                 " pad tokens but its run has only ", run - done);
      for (int64_t k = 0; k < n; ++k)
        IRIS_CHECK(ids[i + done + k] == v.pad_id, "pad token ", i + done + k,
                   " is of another kind (image or video) than the media it belongs to");
      for (int64_t k = 0; k < v.t; ++k)
        for (int64_t y = 0; y < v.h; ++y)
          for (int64_t x = 0; x < v.w; ++x) {
            const int64_t at = i + done + (k * v.h + y) * v.w + x;
            const int64_t t_pos = cur + k * v.temporal_step;
            r.positions[0 * L + at] = t_pos;
            r.positions[1 * L + at] = cur + y;
            r.positions[2 * L + at] = cur + x;
            max_pos = std::max({max_pos, t_pos, cur + y, cur + x});
          }
      cur += std::max(v.h, v.w);
      done += n;
    }
    i += run;
  }
  IRIS_CHECK(next_run == runs.size(), runs.size(),
             " images and video slices were given but the prompt has pad tokens for only ",
             next_run);
  r.delta = max_pos + 1 - L;
  return r;
}

}  // namespace iris
