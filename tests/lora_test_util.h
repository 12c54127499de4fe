// Helpers for tests of LoRA adapters: a model's tensors by name, adapters filled with random
// values, and adapters merged into a model's base weights by hand.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/peft.h"
#include "bridge/qwen3vl_model.h"
#include "core/backend.h"
#include "core/splitmix.h"
#include "model_test_util.h"
#include "test_util.h"

namespace iris::test {

// A model's logits on a fixture's golden prompt (image included, so the vision adapters and the
// mergers count) and one decode step after it, which runs the adapters on a single row.
inline std::vector<float> golden_logits(Qwen3VLModel& model,
                                        const std::string& dir = fixture_dir()) {
  const Golden golden(dir);
  const std::vector<int32_t> ids = ids_of(golden.tensor("input_ids"));
  const HostTensor pv = golden.tensor("pixel_values");
  model.encode_images(pv.data<float>(), grids_of(golden.tensor("image_grid_thw")));
  model.prefill(ids);
  std::vector<float> all = model.prompt_logits();
  model.decode(ids.back());
  const std::vector<float> last = model.last_logits();
  all.insert(all.end(), last.begin(), last.end());
  return all;
}

inline ModelLimits golden_limits() {
  ModelLimits limits;
  limits.max_context = 256;
  limits.max_step_tokens = 128;
  limits.max_vision_patches = 1024;
  limits.max_images = 4;
  limits.all_logits = true;
  return limits;
}

// A [shape] f32 tensor of N(0, 1) draws from `seed`, in `arena`.
inline Tensor random_tensor(Backend& be, Arena& arena, const std::vector<int64_t>& shape,
                            uint64_t seed) {
  Tensor t = arena.alloc(DType::f32, shape);
  SplitMix64 rng(seed);
  std::vector<float> h(static_cast<size_t>(t.numel()));
  for (float& v : h) v = static_cast<float>(rng.normal());
  be.write(t, h.data(), DType::f32);
  return t;
}

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
