// A LoRA run's checkpoint through iris export --peft / --merge and iris generate --lora: the
// adapter written in PEFT's format and read back runs as the trained model did, the merged
// export is a plain model with the trained model's logits within rounding, and what Iris cannot
// run as trained (a key that adapts nothing, a wrong shape, a DoRA config, a plain export that
// would drop the adapters) is an error that names it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/peft.h"
#include "bridge/qwen3vl_model.h"
#include "core/backend.h"
#include "core/fs.h"
#include "core/safetensors.h"
#include "core/splitmix.h"
#include "lora_test_util.h"
#include "model_test_util.h"
#include "process_util.h"
#include "test_util.h"
#include "training/checkpoint.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

constexpr const char* kQA =
    "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight";

std::vector<float> logits_of(Backend& be, const ModelConfig& cfg, std::unique_ptr<ModelWeights> w) {
  Qwen3VLModel model(be, cfg, std::move(w), test::golden_limits());
  return test::golden_logits(model);
}

std::vector<float> logits_of_dir(Backend& be, const std::string& dir) {
  Qwen3VLModel model(be, dir, test::golden_limits());
  return test::golden_logits(model);
}

std::vector<float> logits_file(const std::string& path) {
  const HostTensor t = SafetensorsFile(path).load("logits");
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

ModelConfig base_config() {
  return ModelConfig::from_file(test::fixture_dir() + "/config.json");
}

class AppLoraTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(test::fixture_dir() + "/tokenizer.json"))
      GTEST_SKIP() << "tests/data/qwen3vl-tiny/tokenizer.json is missing (scripts/setup.sh "
                      "fetches it); iris export and generate need it";
    root_ = test::scratch_dir() / ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(root_);
    fs::create_directories(root_);
  }

  std::string path(const std::string& name) const { return (root_ / name).string(); }

  test::ProcessExit iris(const std::vector<std::string>& args) {
    std::vector<std::string> all{IRIS_BINARY};
    all.insert(all.end(), args.begin(), args.end());
    return test::run_process(all, path("log_" + std::to_string(++runs_) + ".txt"));
  }

  // What the command printed is the user's: a failure says what went wrong, never where in the
  // sources.
  static void expect_failure(const test::ProcessExit& e, int code,
                             const std::vector<std::string>& needles) {
    EXPECT_EQ(e.code, code) << e.output;
    for (const std::string& n : needles)
      EXPECT_NE(e.output.find(n), std::string::npos) << "no '" << n << "' in: " << e.output;
    EXPECT_EQ(e.output.find(".cpp:"), std::string::npos) << e.output;
  }

  // The adapted model, as a LoRA run trains it: adapters on every module Iris adapts (random, B
  // included) and the vision merger trained in full (modules_to_save: [merger]).
  ModelConfig lora_config(bool rslora = false) const {
    ModelConfig cfg = base_config();
    cfg.lora.rank = 4;
    cfg.lora.alpha = 8;
    cfg.lora.rslora = rslora;
    // Every name but the merger's, which trains in full here (a module is adapted or saved).
    for (const std::string& t : lora_target_names())
      if (!t.starts_with("merger.")) cfg.lora.target_modules.push_back(t);
    return cfg;
  }

  // A checkpoint as iris train writes one for a LoRA run: the base's config.json, every tensor in
  // f32 with the adapters under their HF names, adapter_config.json, the tokenizer and side
  // files, trainer_state.json. Returns the adapted model's logits.
  std::vector<float> make_checkpoint(const std::string& dir, bool rslora = false) {
    auto be = make_cpu_backend();
    const ModelConfig cfg = lora_config(rslora);
    auto w = load_weights(*be, cfg, test::fixture_dir());
    test::randomize_adapters(*be, *w, 21);
    SplitMix64 rng(5);
    for (const WeightBinding& b : w->bindings) {
      if (!in_modules_to_save(b.hf_name, {"merger"})) continue;
      std::vector<float> v = test::read(*be, b.tensor());
      for (float& x : v) x += static_cast<float>(0.05 * rng.normal());
      be->write(b.tensor(), v.data(), DType::f32);
    }
    fs::create_directories(dir);
    save_weights(*be, *w, dir + "/model.safetensors", DType::f32);
    for (const char* f : {"config.json", "tokenizer.json", "tokenizer_config.json",
                          "preprocessor_config.json", "generation_config.json"})
      fs::copy_file(fs::path(test::fixture_dir()) / f, fs::path(dir) / f);
    write_file_atomic(dir + "/adapter_config.json",
                      peft_adapter_config(cfg, *w, {0.0, {"merger"}, test::fixture_dir()}));
    TrainerState state;
    state.files = list_checkpoint_files(dir);
    save_trainer_state(dir + "/trainer_state.json", state);
    return logits_of(*be, cfg, std::move(w));
  }

  // A copy of the adapter directory `from` whose adapter_model.safetensors `edit` changed.
  std::string edited_adapter(const std::string& from, const std::string& name,
                             const std::function<void(std::vector<SafetensorsWriteItem>&,
                                                      std::vector<std::vector<float>>&)>& edit) {
    const std::string dir = path(name);
    fs::create_directories(dir);
    fs::copy_file(from + "/adapter_config.json", dir + "/adapter_config.json");
    const SafetensorsFile f(from + "/adapter_model.safetensors");
    std::vector<SafetensorsWriteItem> items;
    std::vector<std::vector<float>> storage;
    storage.reserve(64);  // items added by `edit` point into it
    for (const auto& [key, e] : f.entries()) items.push_back({key, e.dtype, e.shape, e.data});
    edit(items, storage);
    write_safetensors(dir + "/adapter_model.safetensors", items, {{"format", "pt"}});
    return dir;
  }

  // A copy of the adapter directory `from` whose adapter_config.json `edit` changed.
  std::string edited_config(const std::string& from, const std::string& name,
                            const std::function<void(nlohmann::json&)>& edit) {
    const std::string dir = path(name);
    fs::create_directories(dir);
    fs::copy_file(from + "/adapter_model.safetensors", dir + "/adapter_model.safetensors");
    nlohmann::json j = nlohmann::json::parse(read_text_file(from + "/adapter_config.json"));
    edit(j);
    write_file_atomic(dir + "/adapter_config.json", j.dump(2));
    return dir;
  }

  fs::path root_;
  int runs_ = 0;
};

TEST_F(AppLoraTest, PeftExportHoldsPeftsKeysAndAdapterConfig) {
  const std::string ckpt = path("step_0000002"), out = path("adapter");
  make_checkpoint(ckpt);
  const test::ProcessExit x = iris({"export", ckpt, out, "--peft", "--dtype", "f32"});
  ASSERT_EQ(x.code, 0) << x.output;
  std::set<std::string> files;
  for (const auto& e : fs::directory_iterator(out)) files.insert(e.path().filename().string());
  EXPECT_EQ(files, (std::set<std::string>{"adapter_config.json", "adapter_model.safetensors"}));
  EXPECT_EQ(read_text_file(out + "/adapter_config.json"),
            read_text_file(ckpt + "/adapter_config.json"));
  const nlohmann::json j = nlohmann::json::parse(read_text_file(out + "/adapter_config.json"));
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["task_type"], "CAUSAL_LM");
  EXPECT_EQ(j["r"], 4);
  EXPECT_EQ(j["lora_alpha"], 8.0);
  EXPECT_EQ(j["use_rslora"], false);
  EXPECT_EQ(j["use_dora"], false);
  EXPECT_EQ(j["bias"], "none");
  EXPECT_EQ(j["fan_in_fan_out"], false);
  EXPECT_EQ(j["modules_to_save"], nlohmann::json::array({"merger"}));
  EXPECT_EQ(j["rank_pattern"], nlohmann::json::object());
  EXPECT_EQ(j["alpha_pattern"], nlohmann::json::object());
  const std::regex targets(j["target_modules"].get<std::string>());
  EXPECT_TRUE(std::regex_match("model.language_model.layers.0.self_attn.q_proj", targets));
  EXPECT_TRUE(std::regex_match("model.visual.blocks.2.attn.qkv", targets));
  EXPECT_FALSE(std::regex_match("model.visual.merger.linear_fc1", targets));

  // PEFT's keys: base_model.model. and the module path, adapter name removed; the merger's
  // tensors whole, under the names of the tensors they replace. Nothing else of the base model.
  const SafetensorsFile adapter(out + "/adapter_model.safetensors");
  const SafetensorsFile trained(ckpt + "/model.safetensors");
  EXPECT_EQ(adapter.metadata().at("format"), "pt");
  std::set<std::string> want, got;
  for (const auto& [name, e] : trained.entries())
    if (is_lora_tensor(name) || name.starts_with("model.visual.merger."))
      want.insert("base_model.model." + name);
  for (const auto& [key, e] : adapter.entries()) got.insert(key);
  EXPECT_EQ(got, want);
  for (const char* key :
       {kQA, "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight",
        "base_model.model.model.language_model.layers.2.mlp.down_proj.lora_A.weight",
        "base_model.model.model.visual.blocks.0.attn.qkv.lora_B.weight",
        "base_model.model.model.visual.blocks.1.attn.proj.lora_A.weight",
        "base_model.model.model.visual.merger.linear_fc1.weight",
        "base_model.model.model.visual.merger.norm.bias"})
    EXPECT_TRUE(adapter.contains(key)) << key;
  for (const char* key : {"base_model.model.model.language_model.layers.0.self_attn.q_proj.weight",
                          "base_model.model.model.language_model.embed_tokens.weight",
                          "base_model.model.model.visual.deepstack_merger_list.0.norm.weight"})
    EXPECT_FALSE(adapter.contains(key)) << key;
  const ModelConfig cfg = base_config();
  EXPECT_EQ(adapter.at(kQA).shape, (std::vector<int64_t>{4, cfg.text.hidden_size}));
  EXPECT_EQ(
      adapter.at("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_B.weight")
          .shape,
      (std::vector<int64_t>{cfg.text.q_width(), 4}));
  // f32: the trained values, bit for bit.
  for (const auto& [key, e] : adapter.entries()) {
    const SafetensorsEntry& src = trained.at(key.substr(std::string("base_model.model.").size()));
    ASSERT_EQ(e.dtype, DType::f32) << key;
    ASSERT_EQ(e.nbytes, src.nbytes) << key;
    EXPECT_EQ(std::memcmp(e.data, src.data, e.nbytes), 0) << key;
  }

  // The default dtype is the plain export's.
  const test::ProcessExit bf16 = iris({"export", ckpt, path("adapter_bf16"), "--peft"});
  ASSERT_EQ(bf16.code, 0) << bf16.output;
  EXPECT_EQ(SafetensorsFile(path("adapter_bf16") + "/adapter_model.safetensors").at(kQA).dtype,
            DType::bf16);
}

TEST_F(AppLoraTest, PeftExportReadBackRunsAsTheTrainedModel) {
  const std::string ckpt = path("step_0000002"), out = path("adapter");
  const std::vector<float> trained = make_checkpoint(ckpt);
  ASSERT_EQ(iris({"export", ckpt, out, "--peft", "--dtype", "f32"}).code, 0);
  auto be = make_cpu_backend();
  const std::vector<float> base =
      logits_of(*be, base_config(), load_weights(*be, base_config(), test::fixture_dir()));
  // The adapters change the model: a test of an adapter that was left out would fail here.
  ASSERT_GT(test::relative_l2(base, trained), 1e-3);

  ModelConfig cfg = base_config();
  auto w = load_weights_with_adapter(*be, cfg, test::fixture_dir(), out, 1.0f, false);
  EXPECT_EQ(cfg.lora.rank, 4);
  EXPECT_EQ(cfg.lora.scale(), 2.0f);
  // Every module the checkpoint adapts, and no other.
  std::set<std::string> want;
  const SafetensorsFile trained_file(ckpt + "/model.safetensors");
  for (const auto& [name, e] : trained_file.entries())
    if (is_lora_tensor(name)) want.insert(lora_module(name));
  EXPECT_EQ(std::set<std::string>(cfg.lora.modules.begin(), cfg.lora.modules.end()), want);
  // Unmerged, on the CPU, the trained model's arithmetic: its logits bit for bit.
  const std::vector<float> unmerged = logits_of(*be, cfg, std::move(w));
  ASSERT_EQ(unmerged.size(), trained.size());
  EXPECT_LE(test::relative_l2(unmerged, trained), 1e-6);
  EXPECT_TRUE(unmerged == trained);

  // Merged at load: a plain model, the same logits within f32 rounding.
  ModelConfig plain = base_config();
  auto merged_w = load_weights_with_adapter(*be, plain, test::fixture_dir(), out, 1.0f, true);
  EXPECT_FALSE(plain.lora.enabled());
  EXPECT_LE(test::relative_l2(logits_of(*be, plain, std::move(merged_w)), trained), 1e-5);

  // --lora-scale 2 is the model trained with twice the alpha (the checkpoint's own adapters).
  ModelConfig doubled = lora_config();
  doubled.lora.alpha = 16;
  const std::vector<float> want_doubled = logits_of(*be, doubled, load_weights(*be, doubled, ckpt));
  ModelConfig scaled = base_config();
  auto scaled_w = load_weights_with_adapter(*be, scaled, test::fixture_dir(), out, 2.0f, false);
  const std::vector<float> got_doubled = logits_of(*be, scaled, std::move(scaled_w));
  EXPECT_LE(test::relative_l2(got_doubled, want_doubled), 1e-6);
  EXPECT_GT(test::relative_l2(got_doubled, trained), 1e-3);

  // An adapter saved by PEFT under transformers' older module paths (model.layers.*, visual.*)
  // is the same adapter.
  const std::string old = edited_adapter(out, "old_layout", [](auto& items, auto&) {
    for (SafetensorsWriteItem& it : items) {
      const std::string p = "base_model.model.";
      std::string name = it.name.substr(p.size());
      if (name.starts_with("model.language_model."))
        name = "model." + name.substr(std::string("model.language_model.").size());
      else if (name.starts_with("model.visual."))
        name = name.substr(6);
      it.name = p + name;
    }
  });
  ModelConfig old_cfg = base_config();
  auto old_w = load_weights_with_adapter(*be, old_cfg, test::fixture_dir(), old, 1.0f, false);
  EXPECT_TRUE(logits_of(*be, old_cfg, std::move(old_w)) == trained);
}

TEST_F(AppLoraTest, MergeExportIsAPlainModelWithTheTrainedLogits) {
  auto be = make_cpu_backend();
  const std::vector<float> base =
      logits_of(*be, base_config(), load_weights(*be, base_config(), test::fixture_dir()));
  for (const bool rslora : {false, true}) {
    SCOPED_TRACE(rslora ? "use_rslora" : "alpha / r");
    const std::string tag = rslora ? "_rs" : "";
    const std::string ckpt = path("step_0000002" + tag), out = path("merged" + tag);
    const std::vector<float> trained = make_checkpoint(ckpt, rslora);
    const test::ProcessExit x = iris({"export", ckpt, out, "--merge", "--dtype", "f32"});
    ASSERT_EQ(x.code, 0) << x.output;
    EXPECT_FALSE(fs::exists(out + "/adapter_config.json"));
    for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"})
      EXPECT_TRUE(fs::exists(out + "/" + f)) << f;
    std::set<std::string> want, got;
    const SafetensorsFile trained_file(ckpt + "/model.safetensors");
    const SafetensorsFile merged_file(out + "/model.safetensors");
    for (const auto& [name, e] : trained_file.entries())
      if (!is_lora_tensor(name)) want.insert(name);
    for (const auto& [name, e] : merged_file.entries()) got.insert(name);
    EXPECT_EQ(got, want);
    const std::vector<float> merged = logits_of_dir(*be, out);
    EXPECT_LE(test::relative_l2(merged, trained), 1e-5);
    EXPECT_GT(test::relative_l2(merged, base), 1e-3);
  }
}

// The binary end to end: -m base --lora DIR gives the merged export's logits, so does
// --lora-merge, and the base alone does not.
TEST_F(AppLoraTest, GenerateWithLoraGivesTheMergedModelsLogits) {
  const std::string ckpt = path("step_0000002"), adapter = path("adapter"), merged = path("merged");
  make_checkpoint(ckpt);
  ASSERT_EQ(iris({"export", ckpt, adapter, "--peft", "--dtype", "f32"}).code, 0);
  ASSERT_EQ(iris({"export", ckpt, merged, "--merge", "--dtype", "f32"}).code, 0);
  auto generate = [&](const std::string& name, std::vector<std::string> args) {
    const std::string out = path(name + ".logits.safetensors");
    std::vector<std::string> all{"generate",
                                 "--image",
                                 test::fixture_dir() + "/images/image0.png",
                                 "-p",
                                 "Describe the picture.",
                                 "-n",
                                 "2",
                                 "--temp",
                                 "0",
                                 "--device",
                                 "cpu",
                                 "--json",
                                 "--logits-out",
                                 out};
    all.insert(all.end(), args.begin(), args.end());
    const test::ProcessExit g = iris(all);
    EXPECT_EQ(g.code, 0) << g.output;
    return g.code == 0 ? logits_file(out) : std::vector<float>{};
  };
  const std::string base = test::fixture_dir();
  const std::vector<float> with_lora = generate("lora", {"-m", base, "--lora", adapter});
  const std::vector<float> from_merged = generate("merged", {"-m", merged});
  const std::vector<float> lora_merge =
      generate("lora_merge", {"-m", base, "--lora", adapter, "--lora-merge"});
  const std::vector<float> plain = generate("base", {"-m", base});
  ASSERT_FALSE(with_lora.empty());
  ASSERT_EQ(with_lora.size(), from_merged.size());
  EXPECT_LE(test::relative_l2(with_lora, from_merged), 1e-5);
  EXPECT_LE(test::relative_l2(lora_merge, from_merged), 1e-5);
  EXPECT_GT(test::relative_l2(plain, from_merged), 1e-3);

  expect_failure(iris({"generate", "-m", base, "-p", "hi", "--lora-scale", "2"}), 2,
                 {"--lora-scale", "--lora DIR"});
  expect_failure(iris({"generate", "-m", base, "-p", "hi", "--lora-merge"}), 2,
                 {"--lora-merge", "--lora DIR"});
  // The run's checkpoint or the adapter given as the model: what to run instead.
  expect_failure(iris({"generate", "-m", ckpt, "-p", "hi", "--device", "cpu"}), 1,
                 {"is a LoRA run's checkpoint", "OUT --peft", "--lora OUT", "OUT --merge"});
  expect_failure(iris({"generate", "-m", adapter, "-p", "hi", "--device", "cpu"}), 1,
                 {"holds a PEFT adapter", "--lora " + adapter});
}

// Every key of an adapter file is applied, or the adapter is refused with the key named.
TEST_F(AppLoraTest, EveryAdapterKeyMustResolve) {
  const std::string ckpt = path("step_0000002"), adapter = path("adapter");
  make_checkpoint(ckpt);
  ASSERT_EQ(iris({"export", ckpt, adapter, "--peft", "--dtype", "f32"}).code, 0);
  const ModelConfig cfg = base_config();
  const int64_t H = cfg.text.hidden_size;
  auto add = [&](const std::string& key, std::vector<int64_t> shape) {
    return [key, shape](std::vector<SafetensorsWriteItem>& items,
                        std::vector<std::vector<float>>& storage) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      storage.emplace_back(static_cast<size_t>(n), 0.01f);
      items.push_back({key, DType::f32, shape, storage.back().data()});
    };
  };
  auto run = [&](const std::string& dir) {
    return iris({"generate", "-m", test::fixture_dir(), "--lora", dir, "-p", "hi", "-n", "1",
                 "--device", "cpu"});
  };
  // A layer the model does not have.
  const std::string missing =
      "base_model.model.model.language_model.layers.7.self_attn.q_proj.lora_A.weight";
  expect_failure(run(edited_adapter(adapter, "missing_layer", add(missing, {4, H}))), 1,
                 {missing, "does not have"});
  // A module Iris has but does not adapt (a DeepStack merger's).
  const std::string deepstack =
      "base_model.model.model.visual.deepstack_merger_list.0.linear_fc1.lora_A.weight";
  expect_failure(
      run(edited_adapter(
          adapter, "deepstack_lora",
          [&](auto& items, auto& storage) {
            add(deepstack, {4, 8})(items, storage);
            add("base_model.model.model.visual.deepstack_merger_list.0.linear_fc1.lora_B.weight",
                {8, 4})(items, storage);
          })),
      1, {deepstack, "cannot adapt"});
  // A key PEFT's save would have stripped of its adapter name, and a tensor the model lacks.
  for (const std::string& key :
       {std::string("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A."
                    "default.weight"),
        std::string("base_model.model.model.language_model.norm.extra")})
    expect_failure(
        run(edited_adapter(adapter, "stray_" + std::to_string(key.size()), add(key, {4, H}))), 1,
        {key, "neither a LoRA tensor"});
  // A key outside PEFT's namespace.
  expect_failure(run(edited_adapter(adapter, "no_prefix", add("lora_A.weight", {4, H}))), 1,
                 {"'lora_A.weight'", "base_model.model."});
  // A wrong shape, named with the key and both shapes.
  const std::string wrong = edited_adapter(adapter, "wrong_shape", [&](auto& items, auto& st) {
    std::erase_if(items, [](const SafetensorsWriteItem& it) { return it.name == kQA; });
    add(kQA, {5, H})(items, st);
  });
  expect_failure(run(wrong), 1,
                 {kQA, "[5, " + std::to_string(H) + "]", "[4, " + std::to_string(H) + "]"});
  // Half an adapter.
  const std::string half = edited_adapter(adapter, "half", [](auto& items, auto&) {
    std::erase_if(items, [](const SafetensorsWriteItem& it) {
      return it.name == "base_model.model.model.language_model.layers.1.mlp.up_proj.lora_B.weight";
    });
  });
  expect_failure(run(half), 1,
                 {"model.language_model.layers.1.mlp.up_proj has lora_A.weight but no "
                  "lora_B.weight"});
}

// What PEFT would compute otherwise than W x + scale B A x is refused, naming file and field.
TEST_F(AppLoraTest, AdapterConfigsIrisCannotRunAreRefused) {
  const std::string ckpt = path("step_0000002"), adapter = path("adapter");
  make_checkpoint(ckpt);
  ASSERT_EQ(iris({"export", ckpt, adapter, "--peft", "--dtype", "f32"}).code, 0);
  auto refusal = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const std::string dir = edited_config(adapter, name, edit);
    ModelConfig cfg = base_config();
    auto be = make_cpu_backend();
    return test::error_of(
        [&] { load_weights_with_adapter(*be, cfg, test::fixture_dir(), dir, 1.0f, false); });
  };
  const std::vector<std::pair<std::string, std::function<void(nlohmann::json&)>>> cases = {
      {"use_dora", [](nlohmann::json& j) { j["use_dora"] = true; }},
      {"rank_pattern",
       [](nlohmann::json& j) {
         j["rank_pattern"] = {{"q_proj", 8}};
       }},
      {"alpha_pattern",
       [](nlohmann::json& j) {
         j["alpha_pattern"] = {{"q_proj", 4}};
       }},
      {"bias", [](nlohmann::json& j) { j["bias"] = "all"; }},
      {"fan_in_fan_out", [](nlohmann::json& j) { j["fan_in_fan_out"] = true; }},
      {"peft_type", [](nlohmann::json& j) { j["peft_type"] = "IA3"; }},
      {"lora_alpha", [](nlohmann::json& j) { j.erase("lora_alpha"); }},
  };
  for (const auto& [field, edit] : cases) {
    // The file (in a folder named after the field), then the field.
    const std::string e = refusal(field, edit);
    const size_t file = e.find(field + "/adapter_config.json");
    ASSERT_NE(file, std::string::npos) << e;
    EXPECT_NE(e.find(field, file + field.size()), std::string::npos) << e;
  }
  // Through the binary, as the user meets it.
  expect_failure(iris({"generate", "-m", test::fixture_dir(), "--lora", path("use_dora"), "-p",
                       "hi", "-n", "1", "--device", "cpu"}),
                 1, {"adapter_config.json: use_dora is true"});
  // A pickled adapter is named as what is not read.
  const std::string bin = path("pickled");
  fs::create_directories(bin);
  fs::copy_file(adapter + "/adapter_config.json", bin + "/adapter_config.json");
  write_file_atomic(bin + "/adapter_model.bin", "not read");
  expect_failure(iris({"generate", "-m", test::fixture_dir(), "--lora", bin, "-p", "hi", "-n", "1",
                       "--device", "cpu"}),
                 1, {"no adapter_model.safetensors", "adapter_model.bin"});
}

TEST_F(AppLoraTest, ExportsThatWouldLoseOrInventAdaptersAreRefused) {
  const std::string ckpt = path("step_0000002");
  make_checkpoint(ckpt);
  // A plain export would hand HF a model with tensors it does not know.
  expect_failure(iris({"export", ckpt, path("plain")}), 1,
                 {"holds LoRA adapters", "--peft", "--merge"});
  EXPECT_FALSE(fs::exists(path("plain")));
  expect_failure(iris({"export", ckpt, path("both"), "--peft", "--merge"}), 2,
                 {"--peft and --merge exclude each other"});
  EXPECT_FALSE(fs::exists(path("both")));

  // A checkpoint of a run without adapters has none to export or merge.
  const std::string full = path("full_run");
  fs::create_directories(full);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"})
    fs::copy_file(fs::path(test::fixture_dir()) / f, fs::path(full) / f);
  TrainerState state;
  state.files = list_checkpoint_files(full);
  save_trainer_state(full + "/trainer_state.json", state);
  for (const char* flag : {"--peft", "--merge"}) {
    expect_failure(iris({"export", full, path(std::string("none") + flag), flag}), 1,
                   {"holds no LoRA adapters", std::string("without ") + flag});
    EXPECT_FALSE(fs::exists(path(std::string("none") + flag)));
  }
  EXPECT_EQ(iris({"export", full, path("full_export")}).code, 0);
}

}  // namespace
}  // namespace iris
