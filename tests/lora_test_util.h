// Helpers for tests of LoRA adapters: a model's tensors by name, adapters filled with random
// values, and adapters merged into a model's base weights by hand.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/peft.h"
#include "core/backend.h"
#include "core/splitmix.h"

namespace iris::test {

inline const WeightBinding& binding(const ModelWeights& w, const std::string& name) {
  for (const WeightBinding& b : w.bindings)
    if (b.hf_name == name) return b;
  ADD_FAILURE() << "no tensor " << name;
  return w.bindings.front();
}

inline std::vector<float> read(Backend& be, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  be.read(v.data(), DType::f32, t);
  return v;
}

// Fills every adapter with small random values (a fresh adapter's B is zero, which would test
// nothing of B's path).
inline void randomize_adapters(Backend& be, ModelWeights& w, uint64_t seed) {
  SplitMix64 rng(seed);
  for (const WeightBinding& b : w.bindings) {
    if (!is_lora_tensor(b.hf_name)) continue;
    std::vector<float> v(static_cast<size_t>(b.tensor().numel()));
    for (float& x : v) x = static_cast<float>(rng.normal() * 0.05);
    be.write(b.tensor(), v.data(), DType::f32);
  }
}

// W += scale * B A for every adapter of `adapted`, into the base weights of `merged`.
inline void merge_into(Backend& be, const ModelWeights& adapted, float scale,
                       ModelWeights& merged) {
  for (const WeightBinding& b : adapted.bindings) {
    if (!b.hf_name.ends_with(".lora_A.weight")) continue;
    const std::string module = lora_module(b.hf_name);
    const std::vector<float> A = read(be, b.tensor());
    const std::vector<float> B = read(be, binding(adapted, module + ".lora_B.weight").tensor());
    const WeightBinding& base = binding(merged, module + ".weight");
    std::vector<float> W = read(be, base.tensor());
    const int64_t out = base.hf_shape[0], in = base.hf_shape[1], r = b.hf_shape[0];
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        double d = 0;
        for (int64_t k = 0; k < r; ++k) d += double(B[o * r + k]) * A[k * in + i];
        W[o * in + i] += static_cast<float>(scale * d);
      }
    be.write(base.tensor(), W.data(), DType::f32);
  }
}

}  // namespace iris::test
