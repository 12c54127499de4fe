#include "core/cpu/cpu_moe_ops.h"

#include <cmath>
#include <cstring>

#include <algorithm>
#include <vector>

#include "core/cpu/cpu_gemm.h"
#include "core/error.h"

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

int64_t moe_capacity_drop(int32_t* kept_ids, const int32_t* ids, const float* weights,
                          int64_t slots, int64_t E, int64_t capacity, bool by_weight) {
  std::vector<std::vector<int64_t>> of_expert(static_cast<size_t>(E));
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = ids[s];
    IRIS_CHECK(e >= -1 && e < E, "moe_capacity_drop: expert id ", e, " of slot ", s,
               " is outside -1..", E - 1);
    kept_ids[s] = e;
    if (e >= 0) of_expert[static_cast<size_t>(e)].push_back(s);
  }
  int64_t dropped = 0;
  for (std::vector<int64_t>& list : of_expert) {
    if (static_cast<int64_t>(list.size()) <= capacity) continue;
    // Slot order already breaks ties: a stable sort by weight keeps the lower slot first.
    if (by_weight)
      std::stable_sort(list.begin(), list.end(),
                       [&](int64_t a, int64_t b) { return weights[a] > weights[b]; });
    for (size_t i = static_cast<size_t>(capacity); i < list.size(); ++i) kept_ids[list[i]] = -1;
    dropped += static_cast<int64_t>(list.size()) - capacity;
  }
  return dropped;
}

void moe_dispatch(float* x_sorted, int32_t* offsets, int32_t* slot_rows, const float* x,
                  const int32_t* ids, int64_t T, int k, int64_t E, int64_t H,
                  int64_t padded_capacity) {
  const int64_t slots = T * k;
  std::vector<int64_t> count(static_cast<size_t>(E), 0);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = ids[s];
    IRIS_CHECK(e >= -1 && e < E, "moe_dispatch: expert id ", e, " of slot ", s, " is outside -1..",
               E - 1);
    if (e >= 0) ++count[static_cast<size_t>(e)];
  }
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = count[static_cast<size_t>(e)];
    IRIS_CHECK(padded_capacity == 0 || c <= padded_capacity, "moe_dispatch: expert ", e, " has ", c,
               " slots, more than padded_capacity ", padded_capacity,
               " (drop them first with moe_capacity_drop)");
    offsets[e + 1] =
        static_cast<int32_t>(padded_capacity > 0 ? (e + 1) * padded_capacity : offsets[e] + c);
  }
  std::vector<int64_t> next(offsets, offsets + E);
  for (int64_t s = 0; s < slots; ++s) {
    const int32_t e = ids[s];
    slot_rows[s] = e < 0 ? -1 : static_cast<int32_t>(next[static_cast<size_t>(e)]++);
  }
  if (padded_capacity > 0)
    std::memset(x_sorted, 0, static_cast<size_t>(E * padded_capacity * H) * sizeof(float));
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < slots; ++s)
    if (slot_rows[s] >= 0)
      std::memcpy(x_sorted + slot_rows[s] * H, x + (s / k) * H,
                  static_cast<size_t>(H) * sizeof(float));
}

void moe_grouped_linear(float* y, const float* x, const float* w, const int32_t* offsets, int64_t E,
                        int64_t N, int64_t K) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = offsets[e], rows = offsets[e + 1] - begin;
    if (rows > 0) sgemm_xw(rows, N, K, x + begin * K, w + e * K * N, y + begin * N, 0.0f);
  }
}

void moe_combine(float* y, const float* y_sorted, const int32_t* slot_rows, const float* weights,
                 int64_t T, int k, int64_t H, bool accumulate) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* out = y + t * H;
    for (int64_t h = 0; h < H; ++h) {
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) {
        const int32_t r = slot_rows[t * k + j];
        if (r >= 0) sum += weights[t * k + j] * y_sorted[r * H + h];
      }
      out[h] = accumulate ? out[h] + sum : sum;
    }
  }
}

void moe_combine_backward(float* dy_sorted, float* dweights, const float* dy, const float* y_sorted,
                          const int32_t* slot_rows, const float* weights, int64_t T, int k,
                          int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < T * k; ++s) {
    const int32_t r = slot_rows[s];
    if (r < 0) {
      dweights[s] = 0.0f;
      continue;
    }
    const float* g = dy + (s / k) * H;
    const float* y = y_sorted + r * H;
    float* out = dy_sorted + r * H;
    float dot = 0.0f;
    for (int64_t h = 0; h < H; ++h) {
      out[h] = weights[s] * g[h];
      dot += g[h] * y[h];
    }
    dweights[s] = dot;
  }
}

void moe_grouped_linear_backward(float* dx, float* dw, const float* dy, const float* x,
                                 const float* w, const int32_t* offsets, int64_t E, int64_t K,
                                 int64_t N) {
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = offsets[e], rows = offsets[e + 1] - begin;
    if (rows == 0) continue;
    sgemm_xwt(rows, K, N, dy + begin * N, w + e * K * N, dx + begin * K, 0.0f);
    if (dw != nullptr) sgemm_xtw(K, N, rows, x + begin * K, dy + begin * N, dw + e * K * N, 1.0f);
  }
}

void moe_dispatch_backward(float* dx, const float* dx_sorted, const int32_t* slot_rows, int64_t T,
                           int k, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) {
        const int32_t r = slot_rows[t * k + j];
        if (r >= 0) sum += dx_sorted[r * H + h];
      }
      dx[t * H + h] += sum;
    }
}

void moe_route_backward(float* dlogits, const float* dweights, const float* probs,
                        const int32_t* ids, const float* aux_dprob, int64_t T, int64_t E, int k) {
  // Checked before the parallel loop: an exception may not leave an OpenMP region.
  for (int64_t s = 0; s < T * k; ++s)
    IRIS_CHECK(ids[s] >= (ids[s - s % k] < 0 ? -1 : 0) && ids[s] < E,
               "moe_route_backward: expert id ", ids[s], " of slot ", s, " is outside 0..", E - 1);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* dl = dlogits + t * E;
    const int32_t* id = ids + t * k;
    if (id[0] < 0) {
      for (int64_t e = 0; e < E; ++e) dl[e] = 0.0f;
      continue;
    }
    const float* p = probs + t * E;
    const float* dw = dweights + t * k;
    float S = 0.0f;
    for (int j = 0; j < k; ++j) S += p[id[j]];
    float g = 0.0f;
    for (int j = 0; j < k; ++j) g += dw[j] * (p[id[j]] / S);
    // dl holds dp until the softmax's backward rewrites it.
    for (int64_t e = 0; e < E; ++e) dl[e] = aux_dprob != nullptr ? aux_dprob[e] : 0.0f;
    for (int j = 0; j < k; ++j) dl[id[j]] += (dw[j] - g) / S;
    float dot = 0.0f;
    for (int64_t e = 0; e < E; ++e) dot += p[e] * dl[e];
    for (int64_t e = 0; e < E; ++e) dl[e] = p[e] * (dl[e] - dot);
  }
}

void moe_route_stats(float* load, float* prob_sum, const int32_t* ids, const float* probs,
                     int64_t T, int64_t E, int k) {
  for (int64_t s = 0; s < T * k; ++s) {
    IRIS_CHECK(ids[s] >= -1 && ids[s] < E, "moe_route_stats: expert id ", ids[s], " of slot ", s,
               " is outside -1..", E - 1);
    if (ids[s] >= 0) load[ids[s]] += 1.0f;
  }
  for (int64_t e = 0; e < E; ++e) {
    float sum = prob_sum[e];
    for (int64_t t = 0; t < T; ++t) sum += probs[t * E + e];
    prob_sum[e] = sum;
  }
}

void moe_aux_loss(float* aux_sum, float* dprob, const float* load, const float* prob_sum, int64_t E,
                  int64_t real_rows, int layers, float grad_scale) {
  const float N = static_cast<float>(real_rows) * static_cast<float>(layers);
  if (!(N > 0.0f)) {
    for (int64_t e = 0; e < E; ++e) dprob[e] = 0.0f;
    return;
  }
  float aux = 0.0f;
  for (int64_t e = 0; e < E; ++e) aux += (load[e] / N) * (prob_sum[e] / N);
  aux_sum[0] += static_cast<float>(E) * aux;
  for (int64_t e = 0; e < E; ++e) dprob[e] = grad_scale * static_cast<float>(E) * load[e] / (N * N);
}

}  // namespace iris::cpu
