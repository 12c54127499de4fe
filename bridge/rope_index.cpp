#include "bridge/rope_index.h"

#include <algorithm>

namespace iris {

RopeIndex compute_rope_index(const std::vector<int32_t>& ids, const std::vector<GridTHW>& grids,
                             int32_t image_token_id, int m, int64_t start) {
  const int64_t L = static_cast<int64_t>(ids.size());
  RopeIndex r;
  r.positions.assign(static_cast<size_t>(3 * L), 0);
  int64_t cur = start, max_pos = start - 1;
  size_t next_grid = 0;
  int64_t i = 0;
  while (i < L) {
    if (ids[i] != image_token_id) {
      for (int a = 0; a < 3; ++a) r.positions[a * L + i] = cur;
      max_pos = std::max(max_pos, cur);
      ++cur;
      ++i;
      continue;
    }
    int64_t run = 0;
    while (i + run < L && ids[i + run] == image_token_id) ++run;
    // A run may hold several images back to back; consume grids until the run is covered.
    int64_t done = 0;
    while (done < run) {
      IRIS_CHECK(next_grid < grids.size(), "the prompt has more image-pad tokens than the ",
                 grids.size(), " images provide");
      const GridTHW& g = grids[next_grid++];
      const int64_t h2 = g[1] / m, w2 = g[2] / m, n = g[0] * h2 * w2;
      IRIS_CHECK(done + n <= run, "an image needs ", n, " pad tokens but its run has only ",
                 run - done);
      for (int64_t k = 0; k < g[0]; ++k)
        for (int64_t y = 0; y < h2; ++y)
          for (int64_t x = 0; x < w2; ++x) {
            const int64_t at = i + done + (k * h2 + y) * w2 + x;
            r.positions[0 * L + at] = cur + k;
            r.positions[1 * L + at] = cur + y;
            r.positions[2 * L + at] = cur + x;
            max_pos = std::max({max_pos, cur + k, cur + y, cur + x});
          }
      cur += std::max(h2, w2);
      done += n;
    }
    i += run;
  }
  IRIS_CHECK(next_grid == grids.size(), grids.size(), " images were given but the prompt has pad ",
             "tokens for only ", next_grid);
  r.delta = max_pos + 1 - L;
  return r;
}

}  // namespace iris
