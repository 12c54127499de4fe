// The golden fixture's training sample (input ids, labels, pixels, grids) for training tests.
#pragma once

#include <vector>
#include "model_test_util.h"
#include "test_util.h"

#include "training/train_model.h"

namespace iris::test {

inline TrainSample golden_sample(const Golden& golden) {
  TrainSample s;
  s.ids = ids_of(golden.tensor("input_ids"));
  s.labels = ids_of(golden.tensor("labels"));
  const HostTensor pv = golden.tensor("pixel_values");
  s.pixel_values.assign(pv.data<float>(), pv.data<float>() + pv.numel());
  s.grids = grids_of(golden.tensor("image_grid_thw"));
  return s;
}

// Every gradient tensor of a model as f32 values read through its backend, in binding order; a
// tensor without a gradient (a part planned frozen, TrainLimits::frozen) as an empty one.
inline std::vector<std::vector<float>> all_grads(TrainableQwen3VL& m) {
  std::vector<std::vector<float>> out;
  for (const WeightBinding& b : m.grads().bindings) {
    if (!b.allocated()) {
      out.emplace_back();
      continue;
    }
    const Tensor g = b.target->slice(b.row_offset, b.row_offset + b.hf_shape[0]);
    std::vector<float> v(static_cast<size_t>(g.numel()));
    m.backend().read(v.data(), DType::f32, g);
    out.push_back(std::move(v));
  }
  return out;
}

}  // namespace iris::test
