// Qwen3-VL-MoE through the model registry: its config fields and their errors, the tensor table
// in the checkpoints' layout, a golden-free check (experts that all equal the dense MLP give the
// dense model's logits, on the CPU and on CUDA), and HF's goldens (tools/make_moe_golden.py: fp32,
// TF32 off, eager experts): vision, every hidden state, each sparse layer's router logits and
// expert ids, logits, greedy ids, and the export of the loaded checkpoint.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>

#include "bridge/architecture.h"
#include "bridge/qwen3vl_model.h"
#include "bridge/random_weights.h"
#include "core/fs.h"
#include "core/safetensors.h"
#include "core/splitmix.h"
#include "model_test_util.h"
#include "test_util.h"

namespace iris {
namespace {

using nlohmann::json;
using test::all_close;
using test::error_of;
using test::Golden;
using test::grids_of;
using test::ids_of;
using test::read_f32;

std::string moe_fixture() {
  return test::data_dir() + "/qwen3vlmoe-tiny";
}

// The dense tiny fixture's config made a MoE one: 4 experts of the dense MLP's width, 2 a token,
// layer 1 dense.
json moe_config_json() {
  json j = json::parse(read_text_file(test::fixture_dir() + "/config.json"));
  j["model_type"] = "qwen3_vl_moe";
  j["architectures"] = {"Qwen3VLMoeForConditionalGeneration"};
  json& t = j["text_config"];
  t["num_experts"] = 4;
  t["num_experts_per_tok"] = 2;
  t["moe_intermediate_size"] = t["intermediate_size"];
  t["mlp_only_layers"] = {1};
  return j;
}

ModelConfig config_of(const json& j) {
  return ModelConfig::from_json_text(j.dump(), "config.json");
}

TEST(MoeConfig, FieldsAreReadAndTheSparseLayersFollowHFsRule) {
  const ModelConfig c = config_of(moe_config_json());
  EXPECT_EQ(c.arch, &qwen3_vl_moe_architecture());
  EXPECT_STREQ(c.arch->hf_class(), "Qwen3VLMoeForConditionalGeneration");
  EXPECT_EQ(c.text.num_experts, 4);
  EXPECT_EQ(c.text.num_experts_per_tok, 2);
  EXPECT_EQ(c.text.mlp_only_layers, std::vector<int>{1});
  EXPECT_FLOAT_EQ(c.text.router_aux_loss_coef, 0.001f);
  EXPECT_TRUE(c.text.sparse_layer(0));
  EXPECT_FALSE(c.text.sparse_layer(1));
  EXPECT_TRUE(c.text.sparse_layer(2));
  // Every second layer from layer 1, as (l + 1) % step == 0 picks them.
  json j = moe_config_json();
  j["text_config"]["decoder_sparse_step"] = 2;
  j["text_config"]["mlp_only_layers"] = json::array();
  j["text_config"]["router_aux_loss_coef"] = 0.01;
  const ModelConfig s = config_of(j);
  EXPECT_FALSE(s.text.sparse_layer(0));
  EXPECT_TRUE(s.text.sparse_layer(1));
  EXPECT_FALSE(s.text.sparse_layer(2));
  EXPECT_FLOAT_EQ(s.text.router_aux_loss_coef, 0.01f);
  // num_local_experts is num_experts' alias.
  j = moe_config_json();
  j["text_config"].erase("num_experts");
  j["text_config"]["num_local_experts"] = 6;
  EXPECT_EQ(config_of(j).text.num_experts, 6);
  // Absent fields take transformers 5.x's class defaults, as HF reads such a config.
  j = moe_config_json();
  for (const char* key : {"num_experts", "num_experts_per_tok", "moe_intermediate_size"})
    j["text_config"].erase(key);
  const ModelConfig d = config_of(j);
  EXPECT_EQ(d.text.num_experts, 60);
  EXPECT_EQ(d.text.num_experts_per_tok, 4);
  EXPECT_EQ(d.text.moe_intermediate_size, 1408);
  // A dense Qwen3-VL has no sparse layer whatever its text_config holds.
  EXPECT_FALSE(
      ModelConfig::from_file(test::fixture_dir() + "/config.json").text.any_sparse_layer());
}

TEST(MoeConfig, BadFieldsAreRefusedNamingThem) {
  auto error_with = [](const char* key, const json& value) {
    json j = moe_config_json();
    if (value.is_null())
      j["text_config"].erase(key);
    else
      j["text_config"][key] = value;
    return error_of([&] { config_of(j); });
  };
  EXPECT_NE(
      error_with("num_experts_per_tok", 5).find("num_experts_per_tok 5 exceeds num_experts 4"),
      std::string::npos);
  EXPECT_NE(error_with("num_experts", 0).find("num_experts"), std::string::npos);
  EXPECT_NE(error_with("decoder_sparse_step", 0).find("decoder_sparse_step"), std::string::npos);
  EXPECT_NE(error_with("mlp_only_layers", json{3}).find("mlp_only_layers"), std::string::npos);
  EXPECT_NE(error_with("num_local_experts", 5).find("disagrees with num_experts 4"),
            std::string::npos);
  EXPECT_NE(error_with("moe_intermediate_size", "768").find("moe_intermediate_size"),
            std::string::npos);
}

TEST(MoeConfig, SparseLayersDeclareTheRouterAndFusedExpertsInTheCheckpointsLayout) {
  const ModelConfig c = config_of(moe_config_json());
  auto be = make_cpu_backend();
  auto w = allocate_weights(*be, c);
  const int64_t E = 4, H = c.text.hidden_size, I = c.text.intermediate_size;
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const WeightBinding& b : w->bindings) shapes[b.hf_name] = b.hf_shape;
  const std::string l0 = "model.language_model.layers.0.mlp.",
                    l1 = "model.language_model.layers.1.mlp.";
  EXPECT_EQ(shapes[l0 + "gate.weight"], (std::vector<int64_t>{E, H}));
  EXPECT_EQ(shapes[l0 + "experts.gate_up_proj"], (std::vector<int64_t>{E, H, 2 * I}));
  EXPECT_EQ(shapes[l0 + "experts.down_proj"], (std::vector<int64_t>{E, I, H}));
  EXPECT_EQ(shapes.count(l0 + "gate_proj.weight"), 0u);
  EXPECT_EQ(shapes[l1 + "gate_proj.weight"], (std::vector<int64_t>{I, H}));
  EXPECT_EQ(shapes.count(l1 + "gate.weight"), 0u);
  EXPECT_TRUE(w->text.layers[0].router_w.defined());
  EXPECT_FALSE(w->text.layers[0].gate_up_w.defined());
  EXPECT_FALSE(w->text.layers[1].router_w.defined());
}

// The tensor table of the 30B-A3B geometry (bench/configs/qwen3vl_30b_a3b.json, the released
// config's values) holds the released checkpoint's parameter count exactly: 882 tensors,
// 31,070,754,032 parameters (the count of its published safetensors index).
TEST(MoeConfig, The30BA3BTableHoldsTheReleasedCheckpointsParameters) {
  const ModelConfig c =
      ModelConfig::from_file(std::string(IRIS_SOURCE_DIR) + "/bench/configs/qwen3vl_30b_a3b.json");
  ModelWeights w;
  WeightTable t(w);
  c.arch->declare_weights(c, w, t);
  int64_t params = 0;
  for (const WeightBinding& b : w.bindings) {
    int64_t n = 1;
    for (int64_t d : b.hf_shape) n *= d;
    params += n;
  }
  EXPECT_EQ(w.bindings.size(), 882u);
  EXPECT_EQ(params, int64_t{31070754032});
}

// Every sparse layer's experts are the dense model's MLP of that layer, transposed into the
// [E, in, out] layout, under a random router: the renormalised weights sum to one, so the logits
// are the dense model's whatever the routing.
void experts_equal_the_dense_mlp(Backend& be, float rel_l2_limit, float rel, float abs) {
  const ModelConfig dense_cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  const ModelConfig moe_cfg = config_of(moe_config_json());
  auto dense = allocate_weights(be, dense_cfg);
  fill_random_weights(be, *dense, RandomInit{7, 0.2, 0.05, true});
  auto moe = allocate_weights(be, moe_cfg);
  std::map<std::string, const WeightBinding*> by_name;
  for (const WeightBinding& b : dense->bindings) by_name[b.hf_name] = &b;
  for (const WeightBinding& b : moe->bindings) {
    auto it = by_name.find(b.hf_name);
    if (it == by_name.end()) continue;
    std::vector<float> v(static_cast<size_t>(it->second->tensor().numel()));
    be.read(v.data(), DType::f32, it->second->tensor());
    be.write(b.tensor(), v.data(), DType::f32);
  }
  const int64_t E = moe_cfg.text.num_experts, H = moe_cfg.text.hidden_size,
                I = moe_cfg.text.moe_intermediate_size;
  SplitMix64 rng(11);
  for (int l = 0; l < moe_cfg.text.num_hidden_layers; ++l) {
    if (!moe_cfg.text.sparse_layer(l)) continue;
    const DecoderLayerWeights& m = moe->text.layers[l];
    test::experts_from_dense_mlp(be, dense->text.layers[l], m, E, H, I);
    std::vector<float> router(static_cast<size_t>(E * H));
    for (float& x : router) x = static_cast<float>(rng.normal());
    be.write(m.router_w, router.data(), DType::f32);
  }
  ModelLimits limits;
  limits.max_context = 64;
  limits.max_step_tokens = 32;
  limits.max_vision_patches = 64;
  limits.max_images = 1;
  limits.all_logits = true;
  Qwen3VLModel dense_model(be, dense_cfg, std::move(dense), limits);
  Qwen3VLModel moe_model(be, moe_cfg, std::move(moe), limits);
  std::vector<int32_t> ids;
  for (int i = 0; i < 24; ++i) ids.push_back(static_cast<int32_t>(rng.below(151000)));
  dense_model.encode_images(nullptr, {});
  dense_model.prefill(ids);
  std::set<int32_t> experts_used;
  moe_model.encode_images(nullptr, {});
  moe_model.prefill(ids, [&](int index, int64_t, const Tensor&) {
    if (index == 1) {
      std::vector<int32_t> routed(ids.size() * 2);
      be.read(routed.data(), DType::i32, moe_model.decoder().routed_experts(int64_t(ids.size())));
      experts_used.insert(routed.begin(), routed.end());
    }
  });
  EXPECT_GE(experts_used.size(), 3u) << "the random router should spread the tokens";
  const std::vector<float>& want = dense_model.prompt_logits();
  const std::vector<float>& got = moe_model.prompt_logits();
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(test::relative_l2(got, want), rel_l2_limit);
  if (rel > 0) EXPECT_TRUE(all_close(got, want, rel, abs));
  // Decode steps route one token at a time.
  const std::vector<float> d1 = (dense_model.decode(5), dense_model.last_logits());
  const std::vector<float> m1 = (moe_model.decode(5), moe_model.last_logits());
  if (rel > 0) EXPECT_TRUE(all_close(m1, d1, rel, abs));
}

TEST(MoeModel, ExpertsThatAllEqualTheDenseMlpGiveTheDenseLogits) {
  auto be = make_cpu_backend();
  experts_equal_the_dense_mlp(*be, 1e-5f, 1e-4f, 1e-4f);
}

TEST(CudaMoeModel, ExpertsThatAllEqualTheDenseMlpGiveTheDenseLogits) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  auto be = make_cuda_backend(0);
  // bf16 routing weights sum to one within a bf16 rounding.
  experts_equal_the_dense_mlp(*be, 2e-2f, 0, 0);
}

// ---- HF goldens -------------------------------------------------------------------------------

constexpr float kRel = 1e-4f, kAbs = 1e-4f;

class MoeGolden : public ::testing::Test {
 protected:
  void SetUp() override {
    golden_ = std::make_unique<Golden>(moe_fixture());
    backend_ = make_cpu_backend();
    ModelLimits limits;
    limits.max_context = 256;
    limits.max_step_tokens = 128;
    limits.max_vision_patches = 256;
    limits.max_images = 4;
    limits.all_logits = true;
    model_ = std::make_unique<Qwen3VLModel>(*backend_, moe_fixture(), limits);
  }
  void encode_golden_images() {
    const HostTensor pv = golden_->tensor("pixel_values");
    model_->encode_images(pv.data<float>(), grids_of(golden_->tensor("image_grid_thw")));
  }
  void check_prompt(const std::string& prefix, const std::vector<int32_t>& ids) {
    const TextConfig& t = model_->config().text;
    const int n_hidden = t.num_hidden_layers + 1;
    const int64_t T = static_cast<int64_t>(ids.size()), k = t.num_experts_per_tok;
    std::vector<std::vector<float>> hidden(static_cast<size_t>(n_hidden));
    int sparse_checked = 0;
    model_->prefill(ids, [&](int index, int64_t, const Tensor& rows) {
      hidden[index] = read_f32(*backend_, rows);
      // Between layers the routing buffers hold the layer just run.
      const int layer = index - 1;
      if (layer < 0 || !t.sparse_layer(layer)) return;
      ++sparse_checked;
      const std::string l = std::to_string(layer);
      EXPECT_TRUE(all_close(read_f32(*backend_, model_->decoder().router_logits(T)),
                            golden_->tensor(prefix + ".router_logits." + l).to_f32(), kRel, kAbs))
          << prefix << " router logits of layer " << l;
      std::vector<int32_t> got(static_cast<size_t>(T * k));
      backend_->read(got.data(), DType::i32, model_->decoder().routed_experts(T));
      EXPECT_EQ(got, ids_of(golden_->tensor(prefix + ".router_ids." + l)))
          << prefix << " expert ids of layer " << l;
    });
    EXPECT_EQ(sparse_checked, static_cast<int>(golden_->json()["sparse_layers"].size()));
    for (int l = 0; l < n_hidden; ++l)
      EXPECT_TRUE(all_close(
          hidden[l], golden_->tensor(prefix + ".hidden." + std::to_string(l)).to_f32(), kRel, kAbs))
          << prefix << ".hidden." << l;
    test::expect_top8_and_logsumexp(model_->prompt_logits().data(), T, t.vocab_size,
                                    golden_->tensor(prefix + ".top8_ids"),
                                    golden_->tensor(prefix + ".top8_values"),
                                    golden_->tensor(prefix + ".logsumexp"), prefix, kRel, kAbs);
  }
  std::vector<int32_t> greedy(const std::vector<int32_t>& ids, int n) {
    model_->prefill(ids);
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) {
      const std::vector<float> l = model_->last_logits();
      out.push_back(static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin()));
      if (i + 1 < n) model_->decode(out.back());
    }
    return out;
  }

  std::unique_ptr<Golden> golden_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Qwen3VLModel> model_;
};

TEST_F(MoeGolden, TheFixtureIsAMoeCheckpointWithADenseLayerAndAnUntiedHead) {
  const ModelConfig& c = model_->config();
  EXPECT_EQ(c.arch, &qwen3_vl_moe_architecture());
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_TRUE(c.text.any_sparse_layer());
  bool dense = false;
  for (int l = 0; l < c.text.num_hidden_layers; ++l) dense |= !c.text.sparse_layer(l);
  EXPECT_TRUE(dense);
}

TEST_F(MoeGolden, VisionEmbeddingsAndDeepStackMatchHF) {
  const HostTensor pv = golden_->tensor("pixel_values");
  const auto out =
      model_->vision().encode(pv.data<float>(), grids_of(golden_->tensor("image_grid_thw")));
  EXPECT_TRUE(all_close(read_f32(*backend_, out.embeds), golden_->tensor("vision.embeds").to_f32(),
                        kRel, kAbs));
  ASSERT_EQ(out.deepstack.size(), model_->config().vision.deepstack_visual_indexes.size());
  for (size_t k = 0; k < out.deepstack.size(); ++k)
    EXPECT_TRUE(all_close(read_f32(*backend_, out.deepstack[k]),
                          golden_->tensor("vision.deepstack." + std::to_string(k)).to_f32(), kRel,
                          kAbs))
        << "deepstack " << k;
}

TEST_F(MoeGolden, MultimodalHiddenStatesRoutingAndLogitsMatchHF) {
  encode_golden_images();
  check_prompt("mm", ids_of(golden_->tensor("input_ids")));
}

TEST_F(MoeGolden, TextOnlyHiddenStatesRoutingAndLogitsMatchHF) {
  model_->encode_images(nullptr, {});
  check_prompt("text", ids_of(golden_->tensor("text_input_ids")));
}

TEST_F(MoeGolden, GreedyIdsEqualHF) {
  const auto want_mm = golden_->json()["mm_greedy_ids"].get<std::vector<int32_t>>();
  encode_golden_images();
  EXPECT_EQ(greedy(ids_of(golden_->tensor("input_ids")), static_cast<int>(want_mm.size())),
            want_mm);
  const auto want_text = golden_->json()["text_greedy_ids"].get<std::vector<int32_t>>();
  model_->encode_images(nullptr, {});
  EXPECT_EQ(greedy(ids_of(golden_->tensor("text_input_ids")), static_cast<int>(want_text.size())),
            want_text);
}

// The loaded checkpoint written back is the checkpoint: names, shapes (the fused experts stay
// [E, in, out]) and bits.
TEST_F(MoeGolden, ExportGivesBackTheCheckpointBitForBit) {
  const auto out = test::scratch_dir() / "moe_export.safetensors";
  save_weights(*backend_, model_->weights(), out.string());
  SafetensorsFile mine(out.string()), theirs(moe_fixture() + "/model.safetensors");
  ASSERT_EQ(mine.entries().size(), theirs.entries().size());
  for (const auto& [name, entry] : theirs.entries()) {
    ASSERT_TRUE(mine.contains(name)) << name;
    const HostTensor a = mine.load(name), b = theirs.load(name);
    EXPECT_EQ(a.dims(), b.dims()) << name;
    EXPECT_EQ(a.to_f32(), b.to_f32()) << name;
  }
}

// bf16 weights and activations against HF's fp32. A near-tie of router logits may pick another
// expert in bf16 (as HF run in bf16 may): the routing is compared as the share of slots that
// agree, and the hidden states within a relative L2 error of 3% (golden.json's bf16_rel) over the
// tokens routed as HF routed them in every sparse layer so far.
TEST(CudaMoeGolden, HiddenStatesRoutingAndLogitsWithinBf16) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const Golden golden(moe_fixture());
  auto be = make_cuda_backend(0);
  ModelLimits limits;
  limits.max_context = 256;
  limits.max_step_tokens = 128;
  limits.max_vision_patches = 256;
  limits.max_images = 4;
  limits.all_logits = true;
  Qwen3VLModel model(*be, moe_fixture(), limits);
  const HostTensor pv = golden.tensor("pixel_values");
  model.encode_images(pv.data<float>(), grids_of(golden.tensor("image_grid_thw")));
  const std::vector<int32_t> ids = ids_of(golden.tensor("input_ids"));
  const TextConfig& t = model.config().text;
  const int64_t T = static_cast<int64_t>(ids.size()), k = t.num_experts_per_tok, H = t.hidden_size;
  int64_t agree = 0, slots = 0;
  std::vector<bool> routed_as_hf(static_cast<size_t>(T), true);
  model.prefill(ids, [&](int index, int64_t, const Tensor& rows) {
    const int layer = index - 1;
    if (layer >= 0 && t.sparse_layer(layer)) {
      std::vector<int32_t> got(static_cast<size_t>(T * k));
      be->read(got.data(), DType::i32, model.decoder().routed_experts(T));
      const std::vector<int32_t> want_ids =
          ids_of(golden.tensor("mm.router_ids." + std::to_string(layer)));
      for (int64_t r = 0; r < T; ++r)
        for (int64_t j = 0; j < k; ++j, ++slots) {
          const auto first = want_ids.begin() + r * k, last = first + k;
          const bool same = std::find(first, last, got[r * k + j]) != last;
          agree += same;
          if (!same) routed_as_hf[r] = false;
        }
    }
    const std::vector<float> all = read_f32(*be, rows);
    const std::vector<float> want_all =
        golden.tensor("mm.hidden." + std::to_string(index)).to_f32();
    std::vector<float> mine, want;
    for (int64_t r = 0; r < T; ++r)
      if (routed_as_hf[r]) {
        mine.insert(mine.end(), all.begin() + r * H, all.begin() + (r + 1) * H);
        want.insert(want.end(), want_all.begin() + r * H, want_all.begin() + (r + 1) * H);
      }
    EXPECT_LE(test::relative_l2(mine, want), 0.03)
        << "hidden " << index << " over " << mine.size() / H << " of " << T << " tokens";
  });
  EXPECT_GE(double(agree) / double(slots), 0.9) << agree << " of " << slots << " slots agree";
  std::cout << agree << " of " << slots << " routed slots agree with HF's fp32 routing\n";
  const HostTensor top_vals = golden.tensor("mm.top8_values");
  const HostTensor top_ids = golden.tensor("mm.top8_ids");
  std::vector<float> got, want;
  const std::vector<float>& logits = model.prompt_logits();
  for (int64_t r = 0; r < T; ++r)
    for (int j = 0; j < 8; ++j) {
      got.push_back(logits[r * t.vocab_size + top_ids.data<int64_t>()[r * 8 + j]]);
      want.push_back(top_vals.data<float>()[r * 8 + j]);
    }
  EXPECT_LE(test::relative_l2(got, want), 0.03);
}

}  // namespace
}  // namespace iris
