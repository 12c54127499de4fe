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
  // As vLLM and the OpenAI API define them, over the reply's tokens only: each token already in
  // the reply loses presence_penalty once and frequency_penalty per time it occurs. 0 = off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  uint64_t seed = 0;
};

class Sampler {
 public:
  // `sampleable`, when not empty, has one entry per logit: ids whose entry is 0 are never chosen
  // (a checkpoint's output rows past the tokenizer's last token are padding that no text
  // decodes to).
  explicit Sampler(const SamplingParams& params, std::vector<uint8_t> sampleable = {});
  // logits: one row of vocab_size floats (modified in place by the penalty and the mask);
  // history: tokens seen so far. Throws iris::Error for NaN logits.
  int32_t sample(std::vector<float>& logits, const std::vector<int32_t>& history);
  // The same, where history[reply_start:] is the reply so far (what the presence and frequency
  // penalties count).
  int32_t sample(std::vector<float>& logits, const std::vector<int32_t>& history,
                 size_t reply_start);
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  std::vector<uint8_t> sampleable_;
  std::mt19937_64 rng_;
  std::vector<int32_t> candidates_;  // reused across calls
  std::vector<float> probs_;
};

}  // namespace iris
