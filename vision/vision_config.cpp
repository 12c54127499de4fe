#include "vision/vision_config.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace iris {

int VisionConfig::position_grid_side() const {
  if (num_position_embeddings == 0) return 1;
  const int side = static_cast<int>(std::lround(std::sqrt(double(num_position_embeddings))));
  IRIS_CHECK(side * side == num_position_embeddings, "vision num_position_embeddings ",
             num_position_embeddings, " is not a square grid");
  return side;
}

bool VisionConfig::windowed_block(int l) const {
  return window_units() > 0 && std::find(fullatt_block_indexes.begin(), fullatt_block_indexes.end(),
                                         l) == fullatt_block_indexes.end();
}

}  // namespace iris
