// LoRA adapters (core/lora.h, bridge/peft.h) checked without a golden: an adapted projection
// is the frozen weight plus scale * B A, so a model with adapters must give the logits of the
// model with the adapters merged into its weights, and its adapter gradients must follow from the
// merged model's weight gradient G by the chain rule: dB = scale G A^T, dA = scale B^T G.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <regex>

#include "bridge/hf_weights.h"
#include "bridge/peft.h"
#include "bridge/qwen3vl_model.h"
#include "core/splitmix.h"
#include "lora_test_util.h"
#include "model_test_util.h"
#include "test_util.h"
#include "training/optimizer.h"
#include "training/param_spec.h"
#include "training/train_model.h"
#include "training_test_util.h"

namespace iris {
namespace {

using test::binding;
using test::Golden;
using test::merge_into;
using test::randomize_adapters;
using test::read;

// Every target name: the families' vision MLP and merger names each match their own fixture's
// modules.
const std::vector<std::string>& kAllTargets = lora_target_names();

ModelConfig lora_config(const std::vector<std::string>& targets, int rank = 4, double alpha = 8,
                        const std::string& dir = test::fixture_dir()) {
  ModelConfig cfg = ModelConfig::from_file(dir + "/config.json");
  cfg.lora.rank = rank;
  cfg.lora.alpha = alpha;
  cfg.lora.target_modules = targets;
  return cfg;
}

// The golden sample's limits; `frozen`: the base frozen, as under peft.type=lora.
TrainLimits golden_train_limits(bool frozen) {
  TrainLimits limits;
  limits.max_seq_len = 256;
  limits.max_patches = 1024;
  limits.max_images = 4;
  limits.loss_chunk_rows = 16;
  if (frozen) limits.frozen = {true, true, true, {}};
  return limits;
}

double rel_l2(const std::vector<float>& got, const std::vector<double>& want) {
  double d = 0, n = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    d += (got[i] - want[i]) * (got[i] - want[i]);
    n += want[i] * want[i];
  }
  return std::sqrt(d / std::max(n, 1e-30));
}

TEST(LoraOnTheCpu, AdaptersOnQAndVLeaveTheKColumnsUntouched) {
  auto be = make_cpu_backend();
  const int64_t T = 3, in = 5, q = 4, k = 2, v = 2, r = 2;
  Arena arena(*be, 4096 * sizeof(float));
  auto random = [&](const std::vector<int64_t>& shape, uint64_t seed) {
    return test::random_tensor(*be, arena, shape, seed);
  };
  LoraAdapters ad;
  ad.scale = 1.5f;
  ad.parts = {{random({r, in}, 1), random({q, r}, 2), 0},
              {random({r, in}, 3), random({v, r}, 4), q + k}};
  const Tensor x = random({T, in}, 5), y = random({T, q + k + v}, 6);
  const std::vector<float> before = read(*be, y);
  LoraScratchSize size;
  size.cover(ad);
  const LoraScratch s = allocate_lora_scratch(arena, DType::f32, T, size);
  lora_forward(*be, ad, y, x, s);
  const std::vector<float> after = read(*be, y);
  const std::vector<float> X = read(*be, x);
  for (size_t p = 0; p < ad.parts.size(); ++p) {
    const std::vector<float> A = read(*be, ad.parts[p].a), B = read(*be, ad.parts[p].b);
    const int64_t out = ad.parts[p].b.rows(), off = ad.parts[p].out_offset;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < out; ++o) {
        double d = 0;
        for (int64_t j = 0; j < r; ++j) {
          double low = 0;
          for (int64_t i = 0; i < in; ++i) low += double(X[t * in + i]) * A[j * in + i];
          d += low * B[o * r + j];
        }
        const size_t at = static_cast<size_t>(t * (q + k + v) + off + o);
        EXPECT_NEAR(after[at], before[at] + ad.scale * d, 1e-5) << "part " << p;
      }
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = q; c < q + k; ++c) {
      const size_t at = static_cast<size_t>(t * (q + k + v) + c);
      EXPECT_EQ(after[at], before[at]) << "k column " << c << " changed";
    }
}

// Dropout on the adapter's input (PEFT's lora_B(lora_A(dropout(x)))): the forward and every
// gradient against the same sums written out on the host with the op's mask, which drops about p
// of the inputs, scales the rest by 1 / (1 - p), and is off for a negative seed.
TEST(LoraOnTheCpu, DropoutMasksTheAdapterInputInTheForwardAndTheBackward) {
  auto be = make_cpu_backend();
  const int64_t T = 6, in = 40, out = 5, r = 3;
  const float p = 0.25f;
  Arena arena(*be, 1 << 20);
  auto random = [&](const std::vector<int64_t>& shape, uint64_t seed) {
    return test::random_tensor(*be, arena, shape, seed);
  };
  LoraAdapters ad;
  ad.scale = 2.0f;
  ad.dropout = p;
  ad.parts = {{random({r, in}, 1), random({out, r}, 2), 0, 77}};
  LoraAdapters g;
  g.parts = {{arena.alloc(DType::f32, {r, in}), arena.alloc(DType::f32, {out, r}), 0, 77}};
  be->fill_zero(g.parts[0].a);
  be->fill_zero(g.parts[0].b);
  const Tensor x = random({T, in}, 3), dy = random({T, out}, 4);
  const Tensor y = arena.alloc(DType::f32, {T, out}), dx = arena.alloc(DType::f32, {T, in});
  be->fill_zero(y);
  be->fill_zero(dx);
  LoraScratchSize size;
  size.cover(ad);
  LoraScratch s = allocate_lora_scratch(arena, DType::f32, T, size);
  ASSERT_TRUE(s.dropped.defined());
  s.seed = arena.alloc(DType::i64, {1});
  const int64_t seed = 12345;
  be->write(s.seed, &seed, DType::i64);
  lora_forward(*be, ad, y, x, s);
  lora_backward(*be, ad, &g, dx, dy, x, s);

  const std::vector<float> X = read(*be, x), A = read(*be, ad.parts[0].a),
                           B = read(*be, ad.parts[0].b), DY = read(*be, dy);
  const uint32_t threshold = dropout_threshold(p);
  std::vector<double> xd(X.size());
  int64_t dropped = 0;
  for (size_t i = 0; i < X.size(); ++i) {
    const bool keep = dropout_draw(seed, 77, i) >= threshold;
    dropped += !keep;
    xd[i] = keep ? X[i] / (1.0 - p) : 0.0;
  }
  EXPECT_NEAR(double(dropped) / double(X.size()), p, 0.1);
  std::vector<double> low(T * r, 0.0), y_want(T * out, 0.0), dlow(T * r, 0.0);
  std::vector<double> dA(r * in, 0.0), dB(out * r, 0.0), dx_want(T * in, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < r; ++j)
      for (int64_t i = 0; i < in; ++i) low[t * r + j] += xd[t * in + i] * A[j * in + i];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t j = 0; j < r; ++j) {
        y_want[t * out + o] += ad.scale * low[t * r + j] * B[o * r + j];
        dB[o * r + j] += ad.scale * DY[t * out + o] * low[t * r + j];
        dlow[t * r + j] += ad.scale * DY[t * out + o] * B[o * r + j];
      }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < in; ++i)
      for (int64_t j = 0; j < r; ++j) {
        dA[j * in + i] += dlow[t * r + j] * xd[t * in + i];
        // d(xd)/dx is the mask over (1 - p): zero where xd was dropped.
        if (xd[t * in + i] != 0.0 || X[t * in + i] == 0.0)
          dx_want[t * in + i] += dlow[t * r + j] * A[j * in + i] / (1.0 - p);
      }
  EXPECT_LE(rel_l2(read(*be, y), y_want), 1e-5);
  EXPECT_LE(rel_l2(read(*be, g.parts[0].a), dA), 1e-5);
  EXPECT_LE(rel_l2(read(*be, g.parts[0].b), dB), 1e-5);
  EXPECT_LE(rel_l2(read(*be, dx), dx_want), 1e-5);

  // A negative seed (evaluation) turns it off: the forward reads x itself.
  const int64_t off = -1;
  be->write(s.seed, &off, DType::i64);
  be->fill_zero(y);
  lora_forward(*be, ad, y, x, s);
  std::vector<double> y_off(T * out, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t j = 0; j < r; ++j) {
        double l = 0;
        for (int64_t i = 0; i < in; ++i) l += double(X[t * in + i]) * A[j * in + i];
        y_off[t * out + o] += ad.scale * l * B[o * r + j];
      }
  EXPECT_LE(rel_l2(read(*be, y), y_off), 1e-5);
}

TEST(LoraOnTheCpu, EveryTargetMatchesAModuleOrIsAnError) {
  EXPECT_THROW(check_lora_targets({"q_proj", "qkv_proj"}, "recipe"), Error);
  EXPECT_THROW(check_lora_targets({}, "recipe"), Error);
  check_lora_targets(kAllTargets, "recipe");
  ModelConfig cfg = lora_config({"q_proj", "attn.qkv"});
  auto be = make_cpu_backend();
  const auto layout =
      allocate_weights(*be, cfg, DType::f32, [](const std::string&) { return false; });
  check_lora_matches(cfg, *layout, "recipe");
  int adapters = 0;
  for (const WeightBinding& b : layout->bindings) adapters += is_lora_tensor(b.hf_name);
  // q_proj in every decoder layer and attn.qkv in every vision block, A and B each.
  EXPECT_EQ(adapters, 2 * (cfg.text.num_hidden_layers + cfg.vision.depth));
  EXPECT_EQ(peft_key("model.language_model.layers.0.self_attn.q_proj.lora_A.weight"),
            "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(hf_name_of_peft_key("base_model.model.model.visual.blocks.1.attn.qkv.lora_B.weight"),
            "model.visual.blocks.1.attn.qkv.lora_B.weight");
  EXPECT_EQ(hf_name_of_peft_key("base_model.model.lm_head.weight"), "");
}

TEST(LoraOnTheCpu, AdapterConfigNamesExactlyTheAdaptedModules) {
  const ModelConfig cfg =
      lora_config({"q_proj", "v_proj", "down_proj", "attn.qkv", "merger.linear_fc1"}, 8, 16);
  auto be = make_cpu_backend();
  const auto layout =
      allocate_weights(*be, cfg, DType::f32, [](const std::string&) { return false; });
  const nlohmann::json j =
      nlohmann::json::parse(peft_adapter_config(cfg, *layout, {0.05, {"merger"}, "Qwen/X"}));
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["r"], 8);
  EXPECT_EQ(j["lora_alpha"], 16.0);
  EXPECT_EQ(j["lora_dropout"], 0.05);
  EXPECT_EQ(j["modules_to_save"], nlohmann::json::array({"merger"}));
  EXPECT_EQ(j["base_model_name_or_path"], "Qwen/X");
  const std::regex target(j["target_modules"].get<std::string>());
  for (const char* m : {"model.language_model.layers.0.self_attn.q_proj",
                        "model.language_model.layers.1.self_attn.v_proj",
                        "model.language_model.layers.1.mlp.down_proj",
                        "model.visual.blocks.0.attn.qkv", "model.visual.merger.linear_fc1"})
    EXPECT_TRUE(std::regex_match(m, target)) << m;
  for (const char* m :
       {"model.language_model.layers.0.self_attn.k_proj",
        "model.language_model.layers.0.mlp.gate_proj", "model.visual.blocks.0.attn.proj",
        "model.visual.merger.linear_fc2", "model.visual.deepstack_merger_list.0.linear_fc1",
        "model.language_model.layers.0.self_attn.q_proj.lora_A"})
    EXPECT_FALSE(std::regex_match(m, target)) << m;
}

TEST(LoraOnTheCpu, AFreshAdapterLeavesTheLogitsAsTheyWere) {
  auto be = make_cpu_backend();
  const ModelConfig cfg = lora_config(kAllTargets);
  auto weights = load_weights(*be, cfg, test::fixture_dir());
  init_lora_weights(*be, *weights, 7);
  // lora_A drawn, lora_B zero.
  const WeightBinding& a =
      binding(*weights, "model.language_model.layers.0.self_attn.q_proj.lora_A.weight");
  const WeightBinding& b =
      binding(*weights, "model.language_model.layers.0.self_attn.q_proj.lora_B.weight");
  const std::vector<float> av = read(*be, a.tensor()), bv = read(*be, b.tensor());
  const float bound = 1.0f / std::sqrt(static_cast<float>(a.hf_shape[1]));
  double sq = 0;
  for (float x : av) {
    EXPECT_LE(std::abs(x), bound);
    sq += double(x) * x;
  }
  EXPECT_GT(sq, 0.0);
  for (float x : bv) EXPECT_EQ(x, 0.0f);

  auto logits_of = [&](const ModelConfig& c, std::unique_ptr<ModelWeights> w) {
    Qwen3VLModel model(*be, c, std::move(w), test::golden_limits());
    return test::golden_logits(model);
  };
  const ModelConfig base_cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  const std::vector<float> base =
      logits_of(base_cfg, load_weights(*be, base_cfg, test::fixture_dir()));
  const std::vector<float> fresh = logits_of(cfg, std::move(weights));
  ASSERT_EQ(base.size(), fresh.size());
  for (size_t i = 0; i < base.size(); ++i) ASSERT_EQ(base[i], fresh[i]) << i;
}

// Inference with adapters gives the merged model's logits (relative L2 within `tol`).
void inference_matches_the_merged_model(std::unique_ptr<Backend> be, double tol,
                                        const std::string& dir = test::fixture_dir()) {
  const ModelConfig cfg = lora_config(kAllTargets, 4, 8, dir);
  const ModelConfig base_cfg = ModelConfig::from_file(dir + "/config.json");
  auto adapted = load_weights(*be, cfg, dir);
  randomize_adapters(*be, *adapted, 11);
  auto merged = load_weights(*be, base_cfg, dir);
  merge_into(*be, *adapted, cfg.lora.scale(), *merged);

  auto logits_of = [&](const ModelConfig& c, std::unique_ptr<ModelWeights> w) {
    Qwen3VLModel model(*be, c, std::move(w), test::golden_limits());
    return test::golden_logits(model, dir);
  };
  const std::vector<float> want = logits_of(base_cfg, std::move(merged));
  const std::vector<float> got = logits_of(cfg, std::move(adapted));
  ASSERT_EQ(got.size(), want.size());
  double d = 0, n = 0, changed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    d += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    n += double(want[i]) * want[i];
  }
  std::printf("  logits: relative L2 to the merged model %.3g\n", std::sqrt(d / n));
  EXPECT_LE(std::sqrt(d / n), tol);
  // The adapters do change the model (a test of a no-op would pass the check above too).
  const std::vector<float> base = logits_of(base_cfg, load_weights(*be, base_cfg, dir));
  for (size_t i = 0; i < got.size(); ++i) changed += std::abs(double(got[i]) - base[i]);
  EXPECT_GT(changed / double(got.size()), 1e-4);
}

TEST(LoraOnTheCpu, InferenceWithAdaptersGivesTheMergedModelsLogits) {
  inference_matches_the_merged_model(make_cpu_backend(), 1e-5);
}
// The other families through the same declarations: Qwen2's biased q/k/v, Qwen2.5-VL's windowed
// tower, and a MoE model, whose adapters are its attention's (its MLPs are experts).
TEST(LoraOnTheCpu, EveryFamilyWithAdaptersGivesItsMergedModelsLogits) {
  for (const char* family : {"qwen25vl-tiny", "qwen2vl-tiny", "qwen3vlmoe-tiny"}) {
    SCOPED_TRACE(family);
    inference_matches_the_merged_model(make_cpu_backend(), 1e-5, test::data_dir() + "/" + family);
  }
}
// bf16: the merged weight is rounded once more than the base and adapter the unmerged model reads.
TEST(LoraOnCuda, InferenceWithAdaptersGivesTheMergedModelsLogits) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  inference_matches_the_merged_model(make_cuda_backend(0), 2e-2);
}

// Training: the adapted model's loss is the merged model's, and each adapter's gradients follow
// from the merged weight's: dB = scale G A^T, dA = scale B^T G. The base holds no gradient.
void gradients_follow_from_the_merged_weights(std::unique_ptr<Backend> be, double loss_tol,
                                              double grad_tol,
                                              const std::string& dir = test::fixture_dir()) {
  const ModelConfig cfg = lora_config(kAllTargets, 4, 8, dir);
  const ModelConfig base_cfg = ModelConfig::from_file(dir + "/config.json");
  auto adapted = load_weights(*be, cfg, dir);
  randomize_adapters(*be, *adapted, 13);
  auto merged = load_weights(*be, base_cfg, dir);
  merge_into(*be, *adapted, cfg.lora.scale(), *merged);

  const TrainLimits limits = golden_train_limits(false), lora_limits = golden_train_limits(true);
  const TrainSample sample = test::golden_sample(Golden(dir));
  const float scale_loss = 1.0f / static_cast<float>(labelled_positions(sample.labels));
  TrainableQwen3VL lora_model(*be, cfg, *adapted, lora_limits);
  TrainableQwen3VL full_model(*be, base_cfg, *merged, limits);
  lora_model.zero_grads();
  full_model.zero_grads();
  const LossStats lora_loss = lora_model.forward_backward(sample, scale_loss);
  const LossStats full_loss = full_model.forward_backward(sample, scale_loss);
  EXPECT_NEAR(lora_loss.loss_sum, full_loss.loss_sum, loss_tol * std::abs(full_loss.loss_sum));
  double worst = 0;

  const float scale = cfg.lora.scale();
  int checked = 0;
  for (const WeightBinding& g : lora_model.grads().bindings) {
    if (!is_lora_tensor(g.hf_name)) {
      EXPECT_FALSE(g.allocated()) << g.hf_name << " is frozen but holds a gradient";
      continue;
    }
    if (!g.hf_name.ends_with(".lora_A.weight")) continue;
    const std::string module = lora_module(g.hf_name);
    const WeightBinding& wa = binding(*adapted, g.hf_name);
    const std::vector<float> A = read(*be, wa.tensor());
    const std::vector<float> B = read(*be, binding(*adapted, module + ".lora_B.weight").tensor());
    const std::vector<float> G =
        read(*be, binding(full_model.grads(), module + ".weight").tensor());
    const std::vector<float> dA = read(*be, g.tensor());
    const std::vector<float> dB =
        read(*be, binding(lora_model.grads(), module + ".lora_B.weight").tensor());
    const int64_t r = wa.hf_shape[0], in = wa.hf_shape[1], out = int64_t(B.size()) / r;
    std::vector<double> wantA(A.size(), 0.0), wantB(B.size(), 0.0);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        const double gi = G[o * in + i];
        for (int64_t k = 0; k < r; ++k) {
          wantB[o * r + k] += scale * gi * A[k * in + i];
          wantA[k * in + i] += scale * B[o * r + k] * gi;
        }
      }
    EXPECT_LE(rel_l2(dA, wantA), grad_tol) << g.hf_name;
    EXPECT_LE(rel_l2(dB, wantB), grad_tol) << module << ".lora_B.weight";
    worst = std::max({worst, rel_l2(dA, wantA), rel_l2(dB, wantB)});
    ++checked;
  }
  std::printf("  adapter gradients: worst relative L2 to the chain rule %.3g\n", worst);
  // Every adapter the model declares has its gradient checked, and the targets reach every kind
  // of module: per decoder layer q, k, v, o and a dense layer's gate, up, down; per block qkv,
  // proj and at least the MLP's two; the merger's two.
  int declared = 0;
  for (const WeightBinding& b : adapted->bindings)
    declared += b.hf_name.ends_with(".lora_A.weight");
  EXPECT_EQ(checked, declared);
  int dense = 0;
  for (int l = 0; l < cfg.text.num_hidden_layers; ++l) dense += !cfg.text.sparse_layer(l);
  EXPECT_GE(checked, 4 * cfg.text.num_hidden_layers + 3 * dense + 4 * cfg.vision.depth + 2);
}

TEST(LoraOnTheCpu, AdapterGradientsFollowFromTheMergedWeightsGradient) {
  gradients_follow_from_the_merged_weights(make_cpu_backend(), 1e-5, 1e-4);
  for (const char* family : {"qwen25vl-tiny", "qwen2vl-tiny", "qwen3vlmoe-tiny"}) {
    SCOPED_TRACE(family);
    gradients_follow_from_the_merged_weights(make_cpu_backend(), 1e-5, 1e-4,
                                             test::data_dir() + "/" + family);
  }
}
// CUDA against the CPU oracle (which the test above ties to the chain rule and the torch golden
// ties to HF): the same adapters, loss and adapter gradients in bf16 activations and weights with
// f32 gradients, within the FamilyGradients bound for CUDA. (The chain rule on CUDA would compare
// two bf16 models, the adapted and the merged, and add their errors.)
TEST(LoraOnCuda, AdapterGradientsMatchTheCpuOracle) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const ModelConfig cfg = lora_config(kAllTargets);
  const TrainLimits limits = golden_train_limits(true);
  const TrainSample sample = test::golden_sample(Golden(test::fixture_dir()));
  const float scale_loss = 1.0f / static_cast<float>(labelled_positions(sample.labels));
  struct Run {
    double loss = 0;
    std::vector<std::pair<std::string, std::vector<float>>> grads;
  };
  auto run = [&](std::unique_ptr<Backend> be) {
    auto weights = load_weights(*be, cfg, test::fixture_dir());
    randomize_adapters(*be, *weights, 13);
    TrainableQwen3VL model(*be, cfg, *weights, limits);
    model.zero_grads();
    Run r;
    r.loss = model.forward_backward(sample, scale_loss).loss_sum;
    for (const WeightBinding& g : model.grads().bindings)
      if (g.allocated()) r.grads.emplace_back(g.hf_name, read(*be, g.tensor()));
    return r;
  };
  const Run want = run(make_cpu_backend()), got = run(make_cuda_backend(0));
  EXPECT_NEAR(got.loss, want.loss, 1e-2 * std::abs(want.loss));
  ASSERT_EQ(got.grads.size(), want.grads.size());
  double worst = 0;
  std::string worst_name;
  for (size_t k = 0; k < got.grads.size(); ++k) {
    ASSERT_EQ(got.grads[k].first, want.grads[k].first);
    ASSERT_TRUE(is_lora_tensor(got.grads[k].first)) << got.grads[k].first << " holds a gradient";
    const std::vector<double> w(want.grads[k].second.begin(), want.grads[k].second.end());
    const double e = rel_l2(got.grads[k].second, w);
    EXPECT_LE(e, 6e-2) << got.grads[k].first;
    if (e > worst) worst = e, worst_name = got.grads[k].first;
  }
  std::printf("  %zu adapter gradients: worst relative L2 to the CPU %.3g (%s)\n", got.grads.size(),
              worst, worst_name.c_str());
}

// Against plain torch (tools/make_lora_golden.py, fp32): rank 8, alpha 16, adapters on every
// language projection and the vision blocks' attn.qkv. The logits with the adapters, their
// gradients, and after one AdamW step of the adapters alone the adapters and the logits, within
// 1e-4; the base weights stay bit for bit as loaded.
TEST(LoraOnTheCpu, MatchesTorchLogitsGradientsAndOneAdamWStep) {
  const std::string dir = test::fixture_dir();
  const nlohmann::json meta = nlohmann::json::parse(read_text_file(dir + "/golden_lora.json"));
  const SafetensorsFile golden(dir + "/golden_lora.safetensors");
  auto be = make_cpu_backend();
  ModelConfig cfg = lora_config(meta["target_modules"].get<std::vector<std::string>>(),
                                meta["rank"].get<int>(), meta["alpha"].get<double>());
  auto params = load_weights(*be, cfg, dir);
  int adapters = 0;
  for (const WeightBinding& b : params->bindings) {
    if (!is_lora_tensor(b.hf_name)) continue;
    const HostTensor t = golden.load("adapter." + b.hf_name);
    ASSERT_EQ(t.numel(), b.tensor().numel()) << b.hf_name;
    be->write(b.tensor(), t.data<float>(), DType::f32);
    ++adapters;
  }
  EXPECT_EQ(adapters, 2 * meta["adapters"].get<int>());
  auto base_bits = [&](const ModelWeights& w) {
    std::vector<std::vector<float>> out;
    for (const WeightBinding& b : w.bindings)
      if (!is_lora_tensor(b.hf_name)) out.push_back(read(*be, b.tensor()));
    return out;
  };
  const auto base_before = base_bits(*params);

  const ModelLimits infer = test::golden_limits();
  const Golden sample_golden;
  const TrainSample sample = test::golden_sample(sample_golden);
  // An inference model of the base with `adapters`' adapter values.
  auto check_logits = [&](const ModelWeights& adapters, const std::string& prefix) {
    auto w = load_weights(*be, cfg, dir);
    for (size_t i = 0; i < w->bindings.size(); ++i)
      if (is_lora_tensor(w->bindings[i].hf_name))
        be->copy(w->bindings[i].tensor(), adapters.bindings[i].tensor());
    Qwen3VLModel model(*be, cfg, std::move(w), infer);
    model.encode_images(sample.pixel_values.data(), sample.grids);
    model.prefill(sample.ids);
    const std::vector<float>& logits = model.prompt_logits();
    const int64_t V = cfg.text.vocab_size, rows = int64_t(sample.ids.size());
    const HostTensor lse = golden.load(prefix + ".logsumexp");
    ASSERT_EQ(lse.numel(), rows);
    test::expect_top8_and_logsumexp(logits.data(), rows, V, golden.load(prefix + ".top8_ids"),
                                    golden.load(prefix + ".top8_values"), lse, prefix, 1e-4f,
                                    1e-4f);
  };
  check_logits(*params, "before");

  const TrainLimits limits = golden_train_limits(true);
  TrainableQwen3VL model(*be, cfg, *params, limits);
  model.zero_grads();
  const LossStats stats =
      model.forward_backward(sample, 1.0f / static_cast<float>(labelled_positions(sample.labels)));
  const double want_loss = meta["loss"].get<double>();
  EXPECT_NEAR(stats.loss_sum / double(stats.n_tokens), want_loss, 1e-5 * want_loss);
  for (const WeightBinding& g : model.grads().bindings) {
    if (!g.allocated()) continue;
    const std::vector<float> want = golden.load("grad." + g.hf_name).to_f32();
    std::vector<double> w(want.begin(), want.end());
    EXPECT_LE(rel_l2(read(*be, g.tensor()), w), 1e-4) << g.hf_name;
  }

  // One AdamW step of the adapters (f32 master weights of the trainable tensors only).
  const nlohmann::json& opt_cfg = meta["adamw"];
  AdamWConfig ac;
  ac.beta1 = opt_cfg["betas"][0].get<float>();
  ac.beta2 = opt_cfg["betas"][1].get<float>();
  ac.eps = opt_cfg["eps"].get<float>();
  ac.weight_decay = opt_cfg["weight_decay"].get<float>();
  const ParamSpecs specs(*params, limits.frozen, DType::f32);
  auto master = allocate_state(*be, cfg, specs);
  for (size_t i = 0; i < master->bindings.size(); ++i)
    if (master->bindings[i].allocated())
      be->copy(master->bindings[i].tensor(), params->bindings[i].tensor());
  AdamW opt(*be, cfg, master.get(), model.grads(), ac, params.get());
  opt.step(opt_cfg["lr"].get<float>(), model.frozen());
  for (const WeightBinding& b : params->bindings) {
    if (!is_lora_tensor(b.hf_name)) continue;
    const std::vector<float> want = golden.load("after_adamw." + b.hf_name).to_f32();
    std::vector<double> w(want.begin(), want.end());
    EXPECT_LE(rel_l2(read(*be, b.tensor()), w), 1e-4) << b.hf_name;
  }
  const auto base_after = base_bits(*params);
  ASSERT_EQ(base_after.size(), base_before.size());
  for (size_t i = 0; i < base_after.size(); ++i)
    EXPECT_TRUE(base_after[i] == base_before[i]) << "base tensor " << i << " changed";
  check_logits(*params, "after");
}

}  // namespace
}  // namespace iris
