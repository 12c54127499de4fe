// Helpers for tests that drive the model with the golden fixture's inputs.
#pragma once

#include <vector>

#include "core/backend.h"
#include "vision/vision_encoder.h"

namespace iris::test {

// Token ids stored as i64 in the goldens.
inline std::vector<int32_t> ids_of(const HostTensor& t) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(static_cast<int32_t>(t.data<int64_t>()[i]));
  return out;
}

// image_grid_thw [n, 3] (i64) as grids.
inline std::vector<GridTHW> grids_of(const HostTensor& t) {
  std::vector<GridTHW> g;
  for (int64_t i = 0; i < t.dim(0); ++i)
    g.push_back(
        {t.data<int64_t>()[i * 3], t.data<int64_t>()[i * 3 + 1], t.data<int64_t>()[i * 3 + 2]});
  return g;
}

inline std::vector<float> read_f32(Backend& be, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  be.read(v.data(), DType::f32, t);
  return v;
}

}  // namespace iris::test
