#include "vision/vision_config.h"

#include <cmath>

#include "core/error.h"

namespace iris {

int VisionConfig::position_grid_side() const {
  const int side = static_cast<int>(std::lround(std::sqrt(double(num_position_embeddings))));
  IRIS_CHECK(side * side == num_position_embeddings, "vision num_position_embeddings ",
             num_position_embeddings, " is not a square grid");
  return side;
}

}  // namespace iris
