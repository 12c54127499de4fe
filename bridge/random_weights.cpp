#include "bridge/random_weights.h"

#include <algorithm>
#include <vector>

#include "bridge/peft.h"
#include "core/splitmix.h"

namespace iris {

void fill_random_weights(Backend& backend, ModelWeights& weights, const RandomInit& init) {
  SplitMix64 rng(init.seed);
  constexpr size_t kPool = size_t(1) << 22;
  std::vector<float> pool;
  if (init.pooled) {
    pool.resize(kPool);
    for (float& v : pool) v = static_cast<float>(rng.normal());
  }
  std::vector<float> host;
  for (const WeightBinding& b : weights.bindings) {
    // Adapters start as PEFT starts them, from a stream of their own (below), so that a model's
    // base weights are the same draws with adapters or without.
    if (is_lora_tensor(b.hf_name)) continue;
    int64_t n = 1;
    for (int64_t d : b.hf_shape) n *= d;
    host.assign(static_cast<size_t>(n), 0.0f);
    const bool bias = b.hf_name.ends_with(".bias");
    const bool norm = b.norm_weight;
    const double std = b.hf_name.starts_with("model.visual.") ? init.vision_std : init.text_std;
    if (norm) {
      std::fill(host.begin(), host.end(), 1.0f);
    } else if (!bias && init.pooled) {
      size_t at = static_cast<size_t>(rng.below(kPool));
      for (int64_t i = 0; i < n; ++i) {
        host[static_cast<size_t>(i)] = static_cast<float>(pool[at] * std);
        at = (at + 7919) % kPool;  // a stride coprime with the pool size visits every entry
      }
    } else if (!bias) {
      // The draws of one sequential stream in binding order, made on every thread (a 2B model is
      // two billion Box-Muller pairs: a minute on one core).
      constexpr int64_t kChunk = int64_t(1) << 16;
      const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < chunks; ++c) {
        SplitMix64 at = rng;
        at.skip(SplitMix64::normal_draws(static_cast<uint64_t>(c * kChunk)));
        const int64_t end = std::min(n, (c + 1) * kChunk);
        for (int64_t i = c * kChunk; i < end; ++i)
          host[static_cast<size_t>(i)] = static_cast<float>(at.normal() * std);
      }
      rng.skip(SplitMix64::normal_draws(static_cast<uint64_t>(n)));
    }
    backend.write(b.target->slice(b.row_offset, b.row_offset + b.hf_shape[0]), host.data(),
                  DType::f32);
  }
  init_lora_weights(backend, weights, init.seed);
}

std::unique_ptr<ModelWeights> random_weights(Backend& backend, const ModelConfig& cfg,
                                             uint64_t seed, float std) {
  auto w = allocate_weights(backend, cfg);
  fill_random_weights(backend, *w, RandomInit{seed, double(std), double(std), true});
  return w;
}

}  // namespace iris
