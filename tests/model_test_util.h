// Helpers for tests that drive the model with the golden fixture's inputs.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "core/backend.h"
#include "language/decoder.h"
#include "vision/vision_encoder.h"

namespace iris::test {

// Token ids stored as i64 in the goldens.
inline std::vector<int32_t> ids_of(const HostTensor& t) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(static_cast<int32_t>(t.data<int64_t>()[i]));
  return out;
}

// image_grid_thw [n, 3] (i64) as grids.
inline std::vector<GridTHW> grids_of(const HostTensor& t) {
  std::vector<GridTHW> g;
  for (int64_t i = 0; i < t.dim(0); ++i)
    g.push_back(
        {t.data<int64_t>()[i * 3], t.data<int64_t>()[i * 3 + 1], t.data<int64_t>()[i * 3 + 2]});
  return g;
}

inline std::vector<float> read_f32(Backend& be, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  be.read(v.data(), DType::f32, t);
  return v;
}

// ||got - want|| / ||want||.
inline double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// Every row's top-8 logits against an HF golden's `prefix`.top8_ids / .top8_values (ids exactly,
// values within rel * |v| + abs) and its logsumexp (.logsumexp) within the same tolerance. Two
// golden entries closer than that tolerance are a tie that summation order decides (the golden's
// 6.0293512 and 6.0293503 come out swapped on some CPUs' BLAS): either order is taken there.
inline void expect_top8_and_logsumexp(const float* logits, int64_t rows, int64_t V,
                                      const HostTensor& top_ids, const HostTensor& top_vals,
                                      const HostTensor& lse, const std::string& prefix, float rel,
                                      float abs) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * V;
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 8, order.end(), [&](int32_t a, int32_t b) {
      return row[a] > row[b] || (row[a] == row[b] && a < b);
    });
    const int64_t* ids = top_ids.data<int64_t>() + r * 8;
    const float* vals = top_vals.data<float>() + r * 8;
    for (int k = 0; k < 8; ++k) {
      const float want = vals[k], tol = rel * std::fabs(want) + abs;
      bool tied = false;
      for (int j = 0; j < 8; ++j)
        tied = tied || (ids[j] == order[k] && std::fabs(vals[j] - want) <= tol);
      if (!tied) EXPECT_EQ(order[k], ids[k]) << prefix << " row " << r;
      EXPECT_NEAR(row[order[k]], want, tol) << prefix << " row " << r;
    }
    double s = 0;
    for (int64_t v = 0; v < V; ++v) s += std::exp(double(row[v]) - row[order[0]]);
    const float want = lse.data<float>()[r];
    EXPECT_NEAR(row[order[0]] + std::log(s), want, rel * std::fabs(want) + abs)
        << prefix << " logsumexp row " << r;
  }
}

// A sparse layer whose E experts are all the dense layer's MLP: gate_up_w [2I, H] and down_w
// [H, I] transposed into the checkpoints' [E, H, 2I] and [E, I, H] on `be`.
inline void experts_from_dense_mlp(Backend& be, const DecoderLayerWeights& dense,
                                   const DecoderLayerWeights& moe, int64_t E, int64_t H,
                                   int64_t I) {
  const std::vector<float> gu = read_f32(be, dense.gate_up_w), down = read_f32(be, dense.down_w);
  std::vector<float> gu_t(static_cast<size_t>(E * H * 2 * I)),
      down_t(static_cast<size_t>(E * I * H));
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t r = 0; r < 2 * I; ++r)
      for (int64_t h = 0; h < H; ++h) gu_t[(e * H + h) * 2 * I + r] = gu[r * H + h];
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < I; ++i) down_t[(e * I + i) * H + h] = down[h * I + i];
  }
  be.write(moe.experts_gate_up_w, gu_t.data(), DType::f32);
  be.write(moe.experts_down_w, down_t.data(), DType::f32);
}

}  // namespace iris::test
