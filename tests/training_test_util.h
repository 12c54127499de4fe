// The golden fixture's training sample (input ids, labels, pixels, grids) for training tests.
#pragma once

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

}  // namespace iris::test
