#include "language/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"

namespace iris {

Sampler::Sampler(const SamplingParams& p, std::vector<uint8_t> sampleable)
    : params_(p), sampleable_(std::move(sampleable)), rng_(p.seed) {
  IRIS_CHECK(sampleable_.empty() ||
                 std::find(sampleable_.begin(), sampleable_.end(), uint8_t{1}) != sampleable_.end(),
             "no token id may be sampled: the tokenizer decodes none of the model's output rows");
  IRIS_CHECK(p.temperature >= 0.0f, "temperature must be >= 0, got ", p.temperature);
  IRIS_CHECK(p.top_k >= 0, "top-k must be >= 0, got ", p.top_k);
  IRIS_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, "top-p must be in (0, 1], got ", p.top_p);
  IRIS_CHECK(p.min_p >= 0.0f && p.min_p < 1.0f, "min-p must be in [0, 1), got ", p.min_p);
  IRIS_CHECK(p.repetition_penalty > 0.0f, "repetition penalty must be > 0, got ",
             p.repetition_penalty);
  IRIS_CHECK(std::isfinite(p.presence_penalty) && std::isfinite(p.frequency_penalty),
             "presence and frequency penalties must be finite, got ", p.presence_penalty, " and ",
             p.frequency_penalty);
}

int32_t Sampler::sample(std::vector<float>& logits, const std::vector<int32_t>& history) {
  return sample(logits, history, history.size());
}

int32_t Sampler::sample(std::vector<float>& logits, const std::vector<int32_t>& history,
                        size_t reply_start) {
  IRIS_CHECK(reply_start <= history.size(), "the reply starts at ", reply_start,
             " of a history of ", history.size(), " tokens");
  const int32_t V = static_cast<int32_t>(logits.size());
  IRIS_CHECK(V > 0, "cannot sample from an empty vocabulary");
  IRIS_CHECK(sampleable_.empty() || sampleable_.size() == logits.size(), "the sampler's mask has ",
             sampleable_.size(), " entries but the model gives ", V, " logits");
  constexpr float kNever = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < V; ++i) {
    // A NaN would break the orderings below; it means broken weights or inputs, not a choice.
    IRIS_CHECK(!std::isnan(logits[i]), "the model produced a NaN logit (token id ", i,
               "); its weights or inputs hold non-finite values");
    if (!sampleable_.empty() && !sampleable_[i]) logits[i] = kNever;
  }
  if (params_.repetition_penalty != 1.0f) {
    // As in HF: divide positive logits, multiply negative ones, once per distinct token.
    std::vector<int32_t> seen(history);
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (int32_t t : seen) {
      if (t < 0 || t >= V) continue;
      float& l = logits[t];
      l = l > 0 ? l / params_.repetition_penalty : l * params_.repetition_penalty;
    }
  }
  if ((params_.presence_penalty != 0.0f || params_.frequency_penalty != 0.0f) &&
      reply_start < history.size()) {
    std::vector<int32_t> reply(history.begin() + static_cast<int64_t>(reply_start), history.end());
    std::sort(reply.begin(), reply.end());
    for (size_t i = 0; i < reply.size();) {
      size_t j = i;
      while (j < reply.size() && reply[j] == reply[i]) ++j;
      const int32_t t = reply[i];
      if (t >= 0 && t < V && logits[t] != kNever)
        logits[t] -=
            params_.presence_penalty + params_.frequency_penalty * static_cast<float>(j - i);
      i = j;
    }
  }
  if (params_.temperature == 0.0f) {
    const auto best = std::max_element(logits.begin(), logits.end());
    IRIS_CHECK(*best != kNever, "every token's logit is -inf; nothing can be sampled");
    return static_cast<int32_t>(best - logits.begin());
  }

  candidates_.resize(V);
  std::iota(candidates_.begin(), candidates_.end(), 0);
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  int32_t n = V;
  if (params_.top_k > 0 && params_.top_k < V) {
    n = params_.top_k;
    std::partial_sort(candidates_.begin(), candidates_.begin() + n, candidates_.end(), by_logit);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_logit);
  }
  // Masked ids sort last; they stay out of the candidates, so even rounding in the draw below
  // cannot pick one.
  while (n > 0 && logits[candidates_[n - 1]] == kNever) --n;
  IRIS_CHECK(n > 0, "every token's logit is -inf; nothing can be sampled");
  probs_.resize(n);
  const float mx = logits[candidates_[0]];
  double sum = 0.0;
  for (int32_t i = 0; i < n; ++i) {
    probs_[i] = std::exp((logits[candidates_[i]] - mx) / params_.temperature);
    sum += probs_[i];
  }
  for (int32_t i = 0; i < n; ++i) probs_[i] = static_cast<float>(probs_[i] / sum);
  if (params_.min_p > 0.0f) {
    const float floor_p = params_.min_p * probs_[0];
    int32_t keep = 1;
    while (keep < n && probs_[keep] >= floor_p) ++keep;
    n = keep;
  }
  if (params_.top_p < 1.0f) {
    double cum = 0.0;
    int32_t keep = 0;
    while (keep < n) {
      cum += probs_[keep++];
      if (cum >= params_.top_p) break;
    }
    n = keep;
  }
  double total = 0.0;
  for (int32_t i = 0; i < n; ++i) total += probs_[i];
  std::uniform_real_distribution<double> uni(0.0, total);
  const double r = uni(rng_);
  double acc = 0.0;
  for (int32_t i = 0; i < n; ++i) {
    acc += probs_[i];
    if (r < acc) return candidates_[i];
  }
  return candidates_[n - 1];
}

}  // namespace iris
