#include "core/cpu/cpu_moe_ops.h"

#include <cmath>
#include <vector>

namespace iris::cpu {

void moe_route(int32_t* ids, float* weights, float* probs, const float* logits, int64_t T,
               int64_t E, int k, int64_t real_rows) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    int32_t* id = ids + t * k;
    float* w = weights + t * k;
    float* p = probs != nullptr ? probs + t * E : nullptr;
    if (t >= real_rows) {
      for (int j = 0; j < k; ++j) {
        id[j] = -1;
        w[j] = 0.0f;
      }
      if (p != nullptr)
        for (int64_t e = 0; e < E; ++e) p[e] = 0.0f;
      continue;
    }
    const float* x = logits + t * E;
    float max = x[0];
    for (int64_t e = 1; e < E; ++e) max = std::fmax(max, x[e]);
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += std::exp(x[e] - max);
    const float denom = static_cast<float>(sum);
    if (p != nullptr)
      for (int64_t e = 0; e < E; ++e) p[e] = std::exp(x[e] - max) / denom;
    // k rounds of "largest logit not yet taken, lower index first": the softmax is monotonic, so
    // this is the order of the probabilities without depending on how exp rounds.
    std::vector<char> taken(static_cast<size_t>(E), 0);
    float chosen_sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[static_cast<size_t>(e)] && (best < 0 || x[e] > x[best])) best = e;
      taken[static_cast<size_t>(best)] = 1;
      id[j] = static_cast<int32_t>(best);
      w[j] = std::exp(x[best] - max) / denom;
      chosen_sum += w[j];
    }
    for (int j = 0; j < k; ++j) w[j] /= chosen_sum;
  }
}

}  // namespace iris::cpu
