// Next-token sampling on the host: greedy, temperature, top-k, top-p, min-p, repetition penalty,
// seeded so that a run can be reproduced.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace iris {

struct SamplingParams {
  float temperature = 0.8f;         // 0 = greedy
  int top_k = 40;                   // 0 = off
  float top_p = 0.95f;              // 1 = off
  float min_p = 0.05f;              // 0 = off
  float repetition_penalty = 1.0f;  // 1 = off; applied to tokens already generated or prompted
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // logits: one row of vocab_size floats (modified in place by the penalty); history: tokens
  // seen so far.
  int32_t sample(std::vector<float>& logits, const std::vector<int32_t>& history);
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> candidates_;  // reused across calls
  std::vector<float> probs_;
};

}  // namespace iris
