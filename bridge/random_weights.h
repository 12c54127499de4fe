// Random initialisation of a model's weights on a backend, as HF's _init_weights does it: linear
// and embedding weights ~ N(0, initializer_range), biases 0, norm weights 1. For training from
// scratch and for benchmarks of real geometries without downloading checkpoints.
#pragma once

#include <cstdint>
#include <memory>

#include "bridge/hf_weights.h"

namespace iris {

struct RandomInit {
  uint64_t seed = 1;
  double text_std = 0.02, vision_std = 0.02;  // each tower's initializer_range
  // false: every element drawn from SplitMix64 in binding order (training: the same weights on
  // every platform for a seed). true: one pool of draws read at strided offsets per tensor
  // (benchmarks at billions of parameters: start-up in seconds, every tensor still different).
  bool pooled = false;
};

void fill_random_weights(Backend& backend, ModelWeights& weights, const RandomInit& init);

// Pooled weights of one std for a benchmark.
std::unique_ptr<ModelWeights> random_weights(Backend& backend, const ModelConfig& cfg,
                                             uint64_t seed, float std = 0.02f);

}  // namespace iris
