// One validation pass for a model folder: config.json values typed and range-checked, checked
// against preprocessor_config.json and against the checkpoint's tensors (none missing, none
// unused), non-finite weights reported by name, and sampling that never picks an id the
// tokenizer cannot decode.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "bridge/generator.h"
#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "core/fs.h"
#include "core/json_read.h"
#include "language/sampler.h"
#include "test_util.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::error_of;

json fixture_config() {
  return json::parse(read_text_file(test::fixture_dir() + "/config.json"));
}

std::string config_error(const json& j) {
  return error_of([&] { ModelConfig::from_json_text(j.dump(), "config.json"); });
}

// The error for the fixture's config with text_config.<key> (or vision_config.<key>) set to v.
std::string text_error(const char* key, const json& v) {
  json j = fixture_config();
  j["text_config"][key] = v;
  return config_error(j);
}
std::string vision_error(const char* key, const json& v) {
  json j = fixture_config();
  j["vision_config"][key] = v;
  return config_error(j);
}

#define EXPECT_HAS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "in: " << (haystack)

TEST(ModelConfigValidation, TheFixtureIsValid) {
  const ModelConfig c = ModelConfig::from_json_text(fixture_config().dump(), "config.json");
  EXPECT_EQ(c.text.hidden_size, 64);
  EXPECT_EQ(c.vision.deepstack_visual_indexes, (std::vector<int>{0, 2}));
}

TEST(ModelConfigValidation, IntegersMustBeIntegers) {
  EXPECT_HAS(text_error("hidden_size", 64.9),
             "config.json: text_config.hidden_size must be an integer, got 64.9");
  EXPECT_HAS(text_error("hidden_size", (int64_t{1} << 32) + 64),
             "text_config.hidden_size = 4294967360 is out of range");
  EXPECT_HAS(text_error("hidden_size", true),
             "text_config.hidden_size must be an integer, got true");
  EXPECT_HAS(text_error("num_hidden_layers", "3"), "num_hidden_layers must be an integer");
  EXPECT_HAS(vision_error("patch_size", 16.5), "vision_config.patch_size must be an integer");
  // 1e12 is reported as itself, not as a wrapped 32-bit value.
  EXPECT_HAS(text_error("vocab_size", 1e12),
             "text_config.vocab_size = 1000000000000.0 is out of range");
}

TEST(ModelConfigValidation, SizesMustBePositive) {
  EXPECT_HAS(text_error("intermediate_size", 0),
             "text_config.intermediate_size = 0 is out of range");
  EXPECT_HAS(text_error("num_attention_heads", -4), "num_attention_heads = -4 is out of range");
  EXPECT_HAS(vision_error("depth", 0), "vision_config.depth = 0 is out of range");
  EXPECT_HAS(vision_error("spatial_merge_size", 0), "spatial_merge_size = 0 is out of range");
  EXPECT_HAS(vision_error("temporal_patch_size", 0), "temporal_patch_size = 0 is out of range");
}

TEST(ModelConfigValidation, MropeSectionCannotOverflow) {
  json j = fixture_config();
  j["text_config"]["rope_parameters"]["mrope_section"] = {2147483000, 2147483000, 1296};
  EXPECT_HAS(config_error(j), "mrope_section[0] = 2147483000 is out of range");
  j["text_config"]["rope_parameters"]["mrope_section"] = {2, 3, 4};
  EXPECT_HAS(config_error(j), "mrope_section [2, 3, 4] sums to 9 but must be head_dim/2 = 8");
  j["text_config"]["rope_parameters"]["mrope_section"] = {2, 3};
  EXPECT_HAS(config_error(j), "mrope_section must be a list of 3 integers");
}

TEST(ModelConfigValidation, RopeThetaAndNormEpsMustBePositive) {
  json j = fixture_config();
  j["text_config"]["rope_parameters"]["rope_theta"] = 0;
  EXPECT_HAS(config_error(j), "rope_parameters.rope_theta = 0 is out of range");
  EXPECT_HAS(text_error("rope_theta", -1.0), "text_config.rope_theta = -1.0 is out of range");
  EXPECT_HAS(text_error("rms_norm_eps", -1e-6),
             "text_config.rms_norm_eps = -1e-06 is out of range");
  EXPECT_HAS(text_error("rms_norm_eps", 0), "rms_norm_eps = 0 is out of range");
  EXPECT_HAS(text_error("rms_norm_eps", "small"), "rms_norm_eps must be a number");
}

TEST(ModelConfigValidation, TypeMistakesNameTheFileAndKey) {
  EXPECT_HAS(text_error("hidden_act", 3),
             "config.json: text_config.hidden_act must be a string, got 3");
  EXPECT_HAS(text_error("tie_word_embeddings", "yes"),
             "text_config.tie_word_embeddings must be true or false");
  json j = fixture_config();
  j["model_type"] = json::array();
  EXPECT_HAS(config_error(j), "config.json.model_type must be a string");
  j = fixture_config();
  j["text_config"]["rope_parameters"] = "default";
  EXPECT_HAS(config_error(j), "text_config.rope_parameters must be an object");
  j = fixture_config();
  j["image_token_id"] = 151936;
  EXPECT_HAS(config_error(j), "image_token_id = 151936 is out of range");
}

TEST(ModelConfigValidation, DeepstackIndexesAreStrictlyIncreasing) {
  EXPECT_HAS(vision_error("deepstack_visual_indexes", json::array({0, 0})),
             "deepstack_visual_indexes must be strictly increasing");
  EXPECT_HAS(vision_error("deepstack_visual_indexes", json::array({2, 0})),
             "deepstack_visual_indexes must be strictly increasing");
  EXPECT_HAS(vision_error("deepstack_visual_indexes", json::array({0, 3})),
             "deepstack_visual_indexes[1] = 3 is out of range");
}

TEST(ModelConfigValidation, InChannelsMustBeRgb) {
  EXPECT_HAS(vision_error("in_channels", 4), "vision_config.in_channels is 4");
}

TEST(ModelConfigValidation, DeepNestingIsAnErrorNotAStackOverflow) {
  std::string text = read_text_file(test::fixture_dir() + "/config.json");
  const std::string key = "\"hidden_size\": 64";
  const size_t at = text.find(key);
  ASSERT_NE(at, std::string::npos);
  text.replace(at, key.size(),
               "\"hidden_size\": " + std::string(200000, '[') + std::string(200000, ']'));
  const std::string msg = error_of([&] { ModelConfig::from_json_text(text, "config.json"); });
  EXPECT_HAS(msg, "config.json nests arrays and objects more than 64 levels deep");
  EXPECT_LT(msg.size(), 300u);
}

TEST(ModelConfigValidation, AnUnusedListOfMillionsOfValuesIsRefusedUnparsed) {
  // 40M "{}" in an unused key once took 4.4 GB; past the value limit is enough to be refused.
  std::string text = read_text_file(test::fixture_dir() + "/config.json");
  const size_t open = text.find('{');
  ASSERT_NE(open, std::string::npos);
  std::string unused = "\"unused\": [{}";
  for (int64_t i = 0; i < kJsonConfigLimits.max_values; ++i) unused += ",{}";
  text.insert(open + 1, unused + "],");
  const std::string msg = error_of([&] { ModelConfig::from_json_text(text, "config.json"); });
  EXPECT_HAS(msg, "config.json holds ");
  EXPECT_HAS(msg, "JSON values (arrays, objects, strings, numbers), more than the " +
                      std::to_string(kJsonConfigLimits.max_values));
  EXPECT_LT(msg.size(), 300u);
}

TEST(ModelConfigValidation, PreprocessorMustDescribeTheSamePatches) {
  const ModelConfig cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  const fs::path dir = test::scratch_dir() / "pre";
  fs::create_directories(dir);
  auto with = [&](const char* key, int value) {
    json p = json::parse(read_text_file(test::fixture_dir() + "/preprocessor_config.json"));
    p[key] = value;
    std::ofstream((dir / "preprocessor_config.json").string()) << p.dump();
    return error_of([&] { model_preprocessor(dir.string(), cfg); });
  };
  EXPECT_HAS(with("patch_size", 8), "patch_size is 8 but");
  EXPECT_HAS(with("patch_size", 8), "vision_config.patch_size 16");
  EXPECT_HAS(with("patch_size", 32), "patch_size is 32");
  EXPECT_HAS(with("temporal_patch_size", 1), "temporal_patch_size is 1");
  EXPECT_HAS(with("merge_size", 4), "vision_config.spatial_merge_size 2");
  // Without the file the model's own geometry is used.
  fs::remove(dir / "preprocessor_config.json");
  ModelConfig other = cfg;
  other.vision.patch_size = 14;
  EXPECT_EQ(model_preprocessor(dir.string(), other).patch_size, 14);
}

// A scratch model directory: the fixture's config with `edit` applied, and its weights.
class WeightsDir {
 public:
  WeightsDir() : dir_(test::scratch_dir() / ("weights_" + std::to_string(counter_++))) {
    fs::create_directories(dir_);
    fs::copy_file(fs::path(test::fixture_dir()) / "model.safetensors", dir_ / "model.safetensors");
  }
  std::string path() const { return dir_.string(); }
  void rewrite(const std::function<void(std::vector<SafetensorsWriteItem>&)>& edit) {
    SafetensorsFile f(test::fixture_dir() + "/model.safetensors");
    std::vector<SafetensorsWriteItem> items;
    for (const auto& [name, e] : f.entries()) items.push_back({name, e.dtype, e.shape, e.data});
    edit(items);
    write_safetensors((dir_ / "model.safetensors").string(), items);
  }

 private:
  fs::path dir_;
  static inline int counter_ = 0;
};

std::string load_error(const WeightsDir& d, const json& config) {
  auto backend = make_backend("cpu");
  return error_of([&] {
    load_weights(*backend, ModelConfig::from_json_text(config.dump(), "config.json"), d.path());
  });
}

TEST(ModelWeightsValidation, FewerLayersThanTheCheckpointIsAnError) {
  WeightsDir d;
  json j = fixture_config();
  j["text_config"]["num_hidden_layers"] = 2;
  const std::string msg = load_error(d, j);
  EXPECT_HAS(msg, "that its config.json does not describe, e.g. 'model.language_model.layers.2.");
  j = fixture_config();
  j["vision_config"]["deepstack_visual_indexes"] = {0};
  EXPECT_HAS(load_error(d, j), "deepstack_merger_list.1.");
}

TEST(ModelWeightsValidation, MoreLayersThanTheCheckpointIsAnError) {
  WeightsDir d;
  json j = fixture_config();
  j["text_config"]["num_hidden_layers"] = 4;
  EXPECT_HAS(load_error(d, j), "is missing tensor 'model.language_model.layers.3.");
}

TEST(ModelWeightsValidation, ZeroSizedLayersAreRejectedBeforeAnyArithmetic) {
  // intermediate_size 0 with weights of that shape once divided by zero in the CPU GEMM.
  WeightsDir d;
  d.rewrite([](std::vector<SafetensorsWriteItem>& items) {
    for (auto& it : items)
      if (it.name.find("mlp.gate_proj") != std::string::npos ||
          it.name.find("mlp.up_proj") != std::string::npos)
        it.shape = {0, 64};
      else if (it.name.find("mlp.down_proj") != std::string::npos)
        it.shape = {64, 0};
  });
  json j = fixture_config();
  j["text_config"]["intermediate_size"] = 0;
  EXPECT_HAS(load_error(d, j), "config.json: text_config.intermediate_size = 0 is out of range");
}

TEST(ModelWeightsValidation, NonFiniteWeightsAreReportedByName) {
  WeightsDir d;
  std::vector<float> bad(64, 1.0f);
  bad[5] = std::numeric_limits<float>::quiet_NaN();
  d.rewrite([&](std::vector<SafetensorsWriteItem>& items) {
    for (auto& it : items)
      if (it.name == "model.language_model.norm.weight") {
        it.dtype = DType::f32;
        it.data = bad.data();
      }
  });
  const std::string msg = load_error(d, fixture_config());
  EXPECT_HAS(msg, "tensor 'model.language_model.norm.weight' holds a non-finite value");
  EXPECT_HAS(msg, "at element 5");
}

TEST(Sampling, PaddingRowsAreNeverChosen) {
  // 10 logits of which the tokenizer decodes the first 6; the padding rows hold the largest.
  const std::vector<uint8_t> mask{1, 1, 1, 1, 1, 1, 0, 0, 0, 0};
  for (float temp : {0.0f, 1.0f, 50.0f}) {
    SamplingParams p;
    p.temperature = temp;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.seed = 7;
    Sampler s(p, mask);
    for (int i = 0; i < 500; ++i) {
      std::vector<float> logits{0, 0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 9, 9, 9, 9};
      const int32_t id = s.sample(logits, {});
      ASSERT_LT(id, 6) << "temperature " << temp;
    }
  }
  SamplingParams p;
  p.top_k = 3;  // the top 3 are all padding: the best real token is still chosen
  p.temperature = 1.0f;
  Sampler s(p, mask);
  std::vector<float> logits{0, 0, 0, 0, 0, 5, 9, 9, 9, 9};
  EXPECT_EQ(s.sample(logits, {}), 5);
  std::vector<float> nan_logits{0, std::nanf(""), 0, 0, 0, 0, 0, 0, 0, 0};
  EXPECT_HAS(error_of([&] { s.sample(nan_logits, {}); }), "NaN logit");
}

TEST(Sampling, PresenceAndFrequencyPenaltiesCountTheReplyOnly) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.presence_penalty = 0.5f;
  p.frequency_penalty = 0.25f;
  Sampler s(p);
  // Token 2 leads by 0.6; the prompt's copies of it (before reply_start) cost nothing.
  std::vector<float> logits{0, 0.4f, 1.0f, 0};
  EXPECT_EQ(s.sample(logits, {2, 2, 2}, 3), 2);
  EXPECT_FLOAT_EQ(logits[2], 1.0f);
  // Once in the reply: 1.0 - 0.5 - 0.25 = 0.25 < 0.4, so token 1 wins.
  logits = {0, 0.4f, 1.0f, 0};
  EXPECT_EQ(s.sample(logits, {2, 2, 2, 2}, 3), 1);
  EXPECT_FLOAT_EQ(logits[2], 0.25f);
  // Twice: the frequency part counts occurrences, the presence part once.
  logits = {0, 0.4f, 1.0f, 0};
  s.sample(logits, {2, 2}, 0);
  EXPECT_FLOAT_EQ(logits[2], 0.0f);
  // Negative values reward repeats, as in vLLM.
  p.presence_penalty = -1.0f;
  p.frequency_penalty = 0.0f;
  Sampler r(p);
  logits = {0, 0.4f, 0.1f, 0};
  EXPECT_EQ(r.sample(logits, {2}, 0), 2);
  p.presence_penalty = std::nanf("");
  EXPECT_HAS(error_of([&] { Sampler bad(p); }), "must be finite");
}

TEST(Sampling, TheMaskFollowsTheTokenizer) {
  const Tokenizer tok = Tokenizer::from_file(test::tokenizer_path());
  const std::vector<uint8_t> mask = sampleable_ids(tok, 151936);
  ASSERT_EQ(mask.size(), 151936u);
  EXPECT_EQ(mask[0], 1);
  EXPECT_EQ(mask[151668], 1);  // the last added token
  EXPECT_EQ(mask[151669], 0);
  EXPECT_EQ(mask[151935], 0);
}

}  // namespace
}  // namespace iris
