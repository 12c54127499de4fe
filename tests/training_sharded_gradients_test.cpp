// Gradient sharding's layout (training/sharded_gradients.h): the decoder layers' gradients take
// turns in two slots while every other tensor keeps its own memory, and the optimizer's flat
// layout (addresses only) is the one allocate_state gives, so shards and the unsharded state
// agree element for element.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "core/backend.h"
#include "test_util.h"
#include "training/param_spec.h"
#include "training/recipe.h"
#include "training/sharded_gradients.h"

namespace iris {
namespace {

Recipe tiny_recipe(const std::vector<std::string>& overrides = {}) {
  const std::string text = "model:\n  init: random\n  config: " + test::fixture_dir() +
                           "/config.json\n  tokenizer: " + test::fixture_dir() +
                           "/tokenizer.json\n"
                           "data:\n  mock: true\n"
                           "train:\n  micro_batch_size: 1\n  global_batch_size: 2\n"
                           "  seq_length: 128\n";
  return load_recipe_text(text, test::fixture_dir() + "/tiny.yaml", overrides);
}

int64_t offset_of(const ModelWeights& w, const Tensor& t) {
  return static_cast<const char*>(t.data) - static_cast<const char*>(w.arena.base());
}

TEST(ShardedGradients, LayersTakeTurnsInTwoSlotsAndTheLayoutIsTheOptimizers) {
  const Recipe r = tiny_recipe();
  const ModelConfig& cfg = r.model_config;
  ASSERT_GE(cfg.text.num_hidden_layers, 3);
  auto be = make_cpu_backend();
  const ParamSpecs specs(cfg, FreezeSpec{}, DType::f32);
  ShardedGradients sg(*be, cfg, specs);
  const auto full = allocate_state(*be, cfg, specs);
  ModelWeights& g = sg.grads();
  ModelWeights& layout = sg.layout();
  ASSERT_EQ(layout.bindings.size(), full->bindings.size());
  EXPECT_EQ(layout.arena.capacity(), full->arena.capacity());
  EXPECT_EQ(sg.elements(), static_cast<int64_t>(full->arena.capacity() / sizeof(float)));
  for (size_t i = 0; i < full->bindings.size(); ++i) {
    EXPECT_EQ(layout.bindings[i].allocated(), full->bindings[i].allocated());
    if (full->bindings[i].allocated())
      EXPECT_EQ(offset_of(layout, layout.bindings[i].tensor()),
                offset_of(*full, full->bindings[i].tensor()))
          << full->bindings[i].hf_name;
  }
  // Layer l and l + 2 share memory, l and l + 1 do not.
  const auto& layers = g.text.layers;
  EXPECT_EQ(layers[0].qkv_w.data, layers[2].qkv_w.data);
  EXPECT_EQ(layers[0].down_w.data, layers[2].down_w.data);
  EXPECT_NE(layers[0].qkv_w.data, layers[1].qkv_w.data);
  // Every tensor outside the layers has memory of its own, apart from the slots and each other.
  const char* slots_begin = static_cast<const char*>(layers[0].input_norm_w.data);
  const char* slots_end =
      static_cast<const char*>(layers[1].down_w.data) + layers[1].down_w.nbytes();
  std::set<const void*> seen;
  for (const WeightBinding& b : g.bindings) {
    if (!b.allocated() || b.hf_name.find(".layers.") != std::string::npos) continue;
    const char* p = static_cast<const char*>(b.tensor().data);
    EXPECT_TRUE(p + b.tensor().nbytes() <= slots_begin || p >= slots_end) << b.hf_name;
    EXPECT_TRUE(seen.insert(b.tensor().data).second || b.hf_name == "lm_head.weight") << b.hf_name;
  }
  // What a rank holds: everything but the third layer's gradients.
  const size_t layer_bytes = static_cast<size_t>(slots_end - slots_begin) / 2;
  EXPECT_LT(sg.local_bytes(), full->arena.capacity());
  EXPECT_NEAR(
      static_cast<double>(sg.local_bytes()),
      static_cast<double>(full->arena.capacity() - (cfg.text.num_hidden_layers - 2) * layer_bytes),
      Arena::kAlignment);
}

// Untied, the embedding's and lm_head's gradients share one slot (the loss writes the lm_head's
// and the backward's end the embedding's), apart from the layers' slots and the other tensors;
// tied, the one tensor keeps memory of its own.
TEST(ShardedGradients, AnUntiedEmbeddingAndLmHeadShareOneSlot) {
  Recipe r = tiny_recipe();
  ModelConfig cfg = r.model_config;
  ASSERT_TRUE(cfg.tie_word_embeddings) << "the fixture's tied case is the test above";
  auto be = make_cpu_backend();
  const ParamSpecs tied_specs(cfg, FreezeSpec{}, DType::f32);
  ShardedGradients tied(*be, cfg, tied_specs);
  cfg.tie_word_embeddings = false;
  const ParamSpecs specs(cfg, FreezeSpec{}, DType::f32);
  ShardedGradients sg(*be, cfg, specs);
  const ModelWeights& g = sg.grads();
  ASSERT_TRUE(g.text.embed.defined() && g.text.lm_head.defined());
  EXPECT_EQ(g.text.embed.data, g.text.lm_head.data);
  const char* vocab = static_cast<const char*>(g.text.embed.data);
  const size_t vocab_bytes = std::max(g.text.embed.nbytes(), g.text.lm_head.nbytes());
  for (const WeightBinding& b : g.bindings) {
    if (!b.allocated() || b.tensor().data == g.text.embed.data) continue;
    const char* p = static_cast<const char*>(b.tensor().data);
    EXPECT_TRUE(p + b.tensor().nbytes() <= vocab || p >= vocab + vocab_bytes) << b.hf_name;
  }
  // As much as the tied model's, whose one vocabulary-sized gradient the slot replaces.
  EXPECT_NEAR(static_cast<double>(sg.local_bytes()), static_cast<double>(tied.local_bytes()),
              2.0 * Arena::kAlignment);
  // The layout the optimizer follows still gives each its own elements.
  EXPECT_NE(sg.layout().text.embed.data, sg.layout().text.lm_head.data);
}

// A frozen language model leaves no layer with gradients: nothing takes turns.
TEST(ShardedGradients, WithoutTrainableLayersTheGradientsAreThoseOfTheOtherParts) {
  const Recipe r = tiny_recipe();
  const ModelConfig& cfg = r.model_config;
  auto be = make_cpu_backend();
  FreezeSpec frozen;
  frozen.language_model = true;
  const ParamSpecs specs(cfg, frozen, DType::f32);
  ShardedGradients sg(*be, cfg, specs);
  const auto full = allocate_state(*be, cfg, specs);
  EXPECT_EQ(sg.local_bytes(), full->arena.capacity());
  EXPECT_FALSE(sg.grads().text.layers[0].qkv_w.defined());
}

}  // namespace
}  // namespace iris
