#include "bridge/random_weights.h"

#include <algorithm>
#include <random>

namespace iris {

std::unique_ptr<ModelWeights> random_weights(Backend& backend, const ModelConfig& cfg,
                                             uint64_t seed, float std) {
  auto w = allocate_weights(backend, cfg);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, std);
  // Billions of parameters at real sizes: draw one pool and read it at random offsets per tensor,
  // which keeps start-up in seconds while every tensor still differs.
  constexpr size_t kPool = size_t(1) << 22;
  std::vector<float> pool(kPool);
  for (float& v : pool) v = normal(rng);
  std::vector<float> host;
  for (const WeightBinding& b : w->bindings) {
    int64_t n = 1;
    for (int64_t d : b.hf_shape) n *= d;
    host.resize(static_cast<size_t>(n));
    const bool is_norm = b.hf_name.find("norm") != std::string::npos && b.hf_shape.size() == 1 &&
                         b.hf_name.ends_with(".weight");
    const bool is_bias = b.hf_name.ends_with(".bias");
    if (is_norm) {
      std::fill(host.begin(), host.end(), 1.0f);
    } else if (is_bias) {
      std::fill(host.begin(), host.end(), 0.0f);
    } else {
      size_t at = std::uniform_int_distribution<size_t>(0, kPool - 1)(rng);
      for (int64_t i = 0; i < n; ++i) {
        host[i] = pool[at];
        at = (at + 7919) % kPool;  // a stride coprime with the pool size visits every entry
      }
    }
    const int64_t rows = b.hf_shape[0];
    backend.write(b.target->slice(b.row_offset, b.row_offset + rows), host.data(), DType::f32);
  }
  backend.synchronize();
  return w;
}

}  // namespace iris
