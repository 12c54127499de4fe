// Random initialisation of a model's weights on a backend: for benchmarks of real geometries
// without downloading checkpoints, and for training from scratch.
#pragma once

#include <cstdint>
#include <memory>

#include "bridge/hf_weights.h"

namespace iris {

// Linear and embedding weights ~ N(0, std), biases 0, norm weights 1 (HF's _init_weights).
std::unique_ptr<ModelWeights> random_weights(Backend& backend, const ModelConfig& cfg,
                                             uint64_t seed, float std = 0.02f);

}  // namespace iris
