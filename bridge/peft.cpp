#include "bridge/peft.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "core/error.h"
#include "core/splitmix.h"

namespace iris {
namespace {

constexpr const char* kLoraA = ".lora_A.weight";
constexpr const char* kLoraB = ".lora_B.weight";
constexpr const char* kPeftPrefix = "base_model.model.";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}
bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// Where a target name applies: the language model's layers or the vision tower's blocks.
bool in_domain(const std::string& target, const std::string& module) {
  if (starts_with(target, "merger.")) return starts_with(module, "model.visual.merger.");
  const bool vision = starts_with(target, "attn.") || starts_with(target, "mlp.");
  return vision ? starts_with(module, "model.visual.blocks.")
                : starts_with(module, "model.language_model.layers.") ||
                      starts_with(module, "model.layers.");
}

}  // namespace

float LoraConfig::scale() const {
  const double r = rank;
  return static_cast<float>(rslora ? alpha / std::sqrt(r) : alpha / r);
}

bool LoraConfig::adapts(const std::string& module) const {
  if (!enabled()) return false;
  if (!modules.empty()) return std::find(modules.begin(), modules.end(), module) != modules.end();
  for (const std::string& t : target_modules)
    if (ends_with(module, "." + t) && in_domain(t, module)) return true;
  return false;
}

const std::vector<std::string>& lora_target_names() {
  static const std::vector<std::string> kNames = {"q_proj",
                                                  "k_proj",
                                                  "v_proj",
                                                  "o_proj",
                                                  "gate_proj",
                                                  "up_proj",
                                                  "down_proj",
                                                  "attn.qkv",
                                                  "attn.proj",
                                                  "mlp.linear_fc1",
                                                  "mlp.linear_fc2",
                                                  "mlp.fc1",
                                                  "mlp.fc2",
                                                  "mlp.gate_proj",
                                                  "mlp.up_proj",
                                                  "mlp.down_proj",
                                                  "merger.linear_fc1",
                                                  "merger.linear_fc2",
                                                  "merger.mlp.0",
                                                  "merger.mlp.2"};
  return kNames;
}

void check_lora_targets(const std::vector<std::string>& targets, const std::string& where) {
  const auto& names = lora_target_names();
  std::string list;
  for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
  IRIS_CHECK(!targets.empty(), where, ": peft.target_modules is empty; name the modules to adapt (",
             list, ")");
  for (const std::string& t : targets)
    IRIS_CHECK(std::find(names.begin(), names.end(), t) != names.end(), where,
               ": peft.target_modules has '", t, "', which Iris cannot adapt; the names are ", list,
               " (or train a module in full with peft.modules_to_save)");
}

bool is_lora_tensor(const std::string& hf_name) {
  return ends_with(hf_name, kLoraA) || ends_with(hf_name, kLoraB);
}

std::string lora_module(const std::string& hf_name) {
  IRIS_CHECK(is_lora_tensor(hf_name), "'", hf_name, "' is not a LoRA adapter tensor");
  return hf_name.substr(0, hf_name.size() - std::string(kLoraA).size());
}

void check_lora_matches(const ModelConfig& cfg, const ModelWeights& layout,
                        const std::string& where) {
  if (!cfg.lora.enabled() || !cfg.lora.modules.empty()) return;
  for (const std::string& t : cfg.lora.target_modules) {
    bool matched = false;
    for (const WeightBinding& b : layout.bindings)
      if (is_lora_tensor(b.hf_name) && ends_with(lora_module(b.hf_name), "." + t)) matched = true;
    IRIS_CHECK(matched, where, ": peft.target_modules has '", t,
               "', which matches no module of this ", cfg.model_type,
               " model (a mixture-of-experts model's MLPs are its experts, which LoRA does not "
               "adapt); remove it");
  }
}

void init_lora_weights(Backend& backend, ModelWeights& weights, uint64_t seed) {
  SplitMix64 rng(seed ^ 0x4c6f5241ULL);  // a stream apart from the base weights' draws
  std::vector<float> host;
  for (const WeightBinding& b : weights.bindings) {
    if (!is_lora_tensor(b.hf_name) || !b.allocated()) continue;
    const int64_t rows = b.hf_shape[0], cols = b.hf_shape[1];
    host.assign(static_cast<size_t>(rows * cols), 0.0f);
    if (b.hf_name.ends_with(kLoraA)) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(cols));
      for (float& v : host) v = static_cast<float>((2.0 * rng.uniform01() - 1.0) * bound);
    }
    backend.write(b.tensor(), host.data(), DType::f32);
  }
  backend.synchronize();
}

std::string peft_adapter_config(const ModelConfig& cfg, const ModelWeights& layout,
                                const PeftRun& run) {
  IRIS_CHECK(cfg.lora.enabled(), "the model has no LoRA adapters to describe");
  // Adapted modules grouped by where they sit: a layer or block prefix (its index replaced by a
  // digit pattern) and the module names under it.
  std::map<std::string, std::set<std::string>> groups;
  std::set<std::string> singles;
  static const std::regex kIndexed(R"(^(.*\.(?:layers|blocks))\.\d+\.(.*)$)");
  for (const WeightBinding& b : layout.bindings) {
    if (!is_lora_tensor(b.hf_name)) continue;
    const std::string module = lora_module(b.hf_name);
    std::smatch m;
    if (std::regex_match(module, m, kIndexed))
      groups[m[1].str()].insert(m[2].str());
    else
      singles.insert(module);  // one module of its own, such as the merger's
  }
  const auto escape = [](const std::string& s) {
    std::string out;
    for (char c : s) {
      if (c == '.') out += '\\';
      out += c;
    }
    return out;
  };
  std::string alternatives;
  for (const auto& [prefix, names] : groups) {
    std::string inner;
    for (const std::string& n : names) inner += (inner.empty() ? "" : "|") + escape(n);
    alternatives +=
        (alternatives.empty() ? "" : "|") + escape(prefix) + "\\.\\d+\\.(" + inner + ")";
  }
  for (const std::string& module : singles)
    alternatives += (alternatives.empty() ? "" : "|") + escape(module);
  nlohmann::ordered_json j;
  j["peft_type"] = "LORA";
  j["task_type"] = "CAUSAL_LM";
  j["base_model_name_or_path"] =
      run.base_model.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(run.base_model);
  j["r"] = cfg.lora.rank;
  j["lora_alpha"] = cfg.lora.alpha;
  j["lora_dropout"] = run.dropout;
  j["use_rslora"] = cfg.lora.rslora;
  j["use_dora"] = false;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["init_lora_weights"] = true;
  j["inference_mode"] = true;
  j["target_modules"] = "^(" + alternatives + ")$";
  j["modules_to_save"] = run.modules_to_save.empty() ? nlohmann::ordered_json()
                                                     : nlohmann::ordered_json(run.modules_to_save);
  j["rank_pattern"] = nlohmann::ordered_json::object();
  j["alpha_pattern"] = nlohmann::ordered_json::object();
  return j.dump(2) + "\n";
}

std::string peft_key(const std::string& hf_name) {
  return kPeftPrefix + hf_name;
}

std::string hf_name_of_peft_key(const std::string& key) {
  if (!starts_with(key, kPeftPrefix)) return {};
  const std::string name = key.substr(std::string(kPeftPrefix).size());
  return is_lora_tensor(name) ? name : std::string();
}

}  // namespace iris

// Adapter files: adapter_config.json and adapter_model.safetensors read for iris generate --lora.
#include <chrono>
#include <filesystem>

#include "bridge/architecture.h"
#include "core/json_read.h"
#include "core/safetensors.h"

namespace iris {
namespace {

std::string shape_string(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// transformers before 4.52 named a Qwen-VL model's modules visual.* and model.layers.* (the
// language model at the top), and adapters trained then carry those paths; the weight table has
// transformers 5.x's (model.visual.*, model.language_model.*).
std::string current_module_path(const std::string& name) {
  if (starts_with(name, "visual.")) return "model." + name;
  if (starts_with(name, "model.") && !starts_with(name, "model.visual.") &&
      !starts_with(name, "model.language_model."))
    return "model.language_model." + name.substr(6);
  return name;
}
std::string older_module_path(const std::string& name) {
  if (starts_with(name, "model.visual.")) return name.substr(6);
  if (starts_with(name, "model.language_model."))
    return "model." + name.substr(std::string("model.language_model.").size());
  return name;
}

// One key of an adapter file and the weight-table name it stands for.
struct AdapterKey {
  std::string key;
  std::string name;
  const SafetensorsEntry* entry;
};

// Writes an adapter file's tensor into the model, converted as load_weights converts (the
// backends take bf16 and f32 sources; f16 goes through f32, which keeps its Inf and NaN).
void write_adapter_tensor(Backend& backend, const Tensor& dst, const AdapterKey& k,
                          std::vector<float>& host) {
  const SafetensorsEntry& e = *k.entry;
  const void* src = e.data;
  DType src_dtype = e.dtype;
  if (e.dtype == DType::f16 && dst.dtype != DType::f16) {
    host.resize(e.nbytes / dtype_size(e.dtype));
    convert_to_f32(e, host.data());
    src = host.data();
    src_dtype = DType::f32;
  }
  const int64_t bad = backend.write_finite(dst, src, src_dtype);
  IRIS_CHECK(bad < 0, e.file, ": tensor '", k.key, "' holds a non-finite value (element ", bad,
             "); the adapter is corrupt");
}

}  // namespace

float PeftAdapterConfig::scale() const {
  LoraConfig l;
  l.rank = rank;
  l.alpha = alpha;
  l.rslora = rslora;
  return l.scale();
}

PeftAdapterConfig read_peft_adapter_config(const std::string& path) {
  const nlohmann::json j = read_json_file(path, "adapter config");
  IRIS_CHECK(j.is_object(), path, " must hold a JSON object (PEFT's LoraConfig)");
  const auto given = [&](const char* key) { return j.contains(key) && !j[key].is_null(); };
  IRIS_CHECK(given("peft_type"), path,
             " has no peft_type; it is not a PEFT adapter config (PEFT writes peft_type: LORA)");
  const std::string type = json_string(j["peft_type"], path, "peft_type");
  IRIS_CHECK(type == "LORA", path, ": peft_type is ", clip_text(type, 40),
             "; Iris runs LoRA adapters only (peft_type LORA)");
  // Each of these makes PEFT compute something other than W x + scale B A x; merging the adapter
  // with PEFT (merge_and_unload) and passing the merged model with -m runs any of them.
  const std::string merge_hint =
      "; merge the adapter into its base model with PEFT (merge_and_unload) and run the merged "
      "model instead";
  if (given("use_dora"))
    IRIS_CHECK(!json_boolean(j["use_dora"], path, "use_dora"), path,
               ": use_dora is true; Iris runs plain LoRA, not DoRA's magnitude vectors",
               merge_hint);
  for (const char* key : {"rank_pattern", "alpha_pattern"})
    if (given(key))
      IRIS_CHECK(j[key].is_object() && j[key].empty(), path, ": ", key, " is ",
                 json_excerpt(j[key]),
                 "; Iris runs adapters with one r and lora_alpha for every module", merge_hint);
  if (given("bias")) {
    const std::string bias = json_string(j["bias"], path, "bias");
    IRIS_CHECK(bias == "none", path, ": bias is ", clip_text(bias, 40),
               "; Iris runs adapters without trained biases (bias: none)", merge_hint);
  }
  if (given("lora_bias"))
    IRIS_CHECK(!json_boolean(j["lora_bias"], path, "lora_bias"), path,
               ": lora_bias is true; Iris runs adapters without a bias on lora_B", merge_hint);
  if (given("fan_in_fan_out"))
    IRIS_CHECK(!json_boolean(j["fan_in_fan_out"], path, "fan_in_fan_out"), path,
               ": fan_in_fan_out is true, which is for GPT-2's Conv1D layers; a Qwen-VL adapter "
               "stores lora_A as [r, in] and lora_B as [out, r] (fan_in_fan_out: false)");
  if (given("layer_replication"))
    IRIS_FAIL(path, ": layer_replication is set; Iris runs the base model's layers as they are",
              merge_hint);
  PeftAdapterConfig c;
  IRIS_CHECK(given("r"), path, " has no r (the adapters' rank)");
  c.rank = static_cast<int>(json_integer(j["r"], path, "r", 1, 65536));
  IRIS_CHECK(given("lora_alpha"), path, " has no lora_alpha");
  c.alpha = json_real(j["lora_alpha"], path, "lora_alpha", 0.0, 1e9, /*min_exclusive=*/true);
  if (given("use_rslora")) c.rslora = json_boolean(j["use_rslora"], path, "use_rslora");
  if (given("modules_to_save")) {
    const nlohmann::json& m = j["modules_to_save"];
    IRIS_CHECK(m.is_array(), path, ": modules_to_save must be a list of module names, got ",
               json_excerpt(m));
    for (size_t i = 0; i < m.size(); ++i)
      c.modules_to_save.push_back(
          json_string(m[i], path, "modules_to_save[" + std::to_string(i) + "]"));
  }
  return c;
}

bool in_modules_to_save(const std::string& hf_name, const std::vector<std::string>& modules) {
  for (const std::string& m : modules)
    for (size_t dot = hf_name.find('.'); dot != std::string::npos;
         dot = hf_name.find('.', dot + 1)) {
      const std::string module = hf_name.substr(0, dot);
      if (module == m || (module.size() > m.size() && ends_with(module, "." + m))) return true;
    }
  return false;
}

void merge_lora_delta(float* w, const float* a, const float* b, int64_t out, int64_t in, int64_t r,
                      float scale) {
#pragma omp parallel
  {
    std::vector<float> delta(static_cast<size_t>(in));
#pragma omp for schedule(static)
    for (int64_t o = 0; o < out; ++o) {
      std::fill(delta.begin(), delta.end(), 0.0f);
      for (int64_t k = 0; k < r; ++k) {
        const float bk = b[o * r + k];
        const float* ak = a + k * in;
        for (int64_t i = 0; i < in; ++i) delta[i] += bk * ak[i];
      }
      float* wo = w + o * in;
      for (int64_t i = 0; i < in; ++i) wo[i] += delta[i] * scale;
    }
  }
}

std::unique_ptr<ModelWeights> load_weights_with_adapter(Backend& backend, ModelConfig& cfg,
                                                        const std::string& base_dir,
                                                        const std::string& adapter_dir,
                                                        float extra_scale, bool merge,
                                                        WeightLoadTimes* times) {
  namespace fs = std::filesystem;
  IRIS_CHECK(fs::is_directory(adapter_dir), "LoRA adapter directory '", adapter_dir,
             "' does not exist (it holds adapter_config.json and adapter_model.safetensors)");
  const std::string config_path = (fs::path(adapter_dir) / "adapter_config.json").string();
  IRIS_CHECK(fs::is_regular_file(config_path), "LoRA adapter directory ", adapter_dir,
             " has no adapter_config.json; a PEFT adapter is adapter_config.json with "
             "adapter_model.safetensors, as iris export --peft and PEFT's save_pretrained write "
             "them");
  const PeftAdapterConfig ac = read_peft_adapter_config(config_path);
  IRIS_CHECK(std::isfinite(extra_scale), "the LoRA scale factor must be finite, got ", extra_scale);
  const fs::path weights_path = fs::path(adapter_dir) / "adapter_model.safetensors";
  if (!fs::is_regular_file(weights_path)) {
    const bool pickle = fs::exists(fs::path(adapter_dir) / "adapter_model.bin");
    IRIS_FAIL("LoRA adapter directory ", adapter_dir, " has no adapter_model.safetensors",
              pickle ? "; its adapter_model.bin (a PyTorch pickle) is not read: save the adapter "
                       "with safe_serialization=True (PEFT's default) to get the safetensors file"
                     : "; Iris reads adapter_model.safetensors (not adapter_model.bin)");
  }
  const SafetensorsFile file(weights_path.string());
  const std::string& fname = file.path();

  std::vector<AdapterKey> lora, whole;
  std::set<std::string> names;
  std::vector<std::string> modules;
  std::map<std::string, std::pair<const AdapterKey*, const AdapterKey*>> pairs;  // module: A, B
  for (const auto& [key, e] : file.entries()) {
    IRIS_CHECK(starts_with(key, kPeftPrefix), fname, ": key '", clip_text(key, 160),
               "' does not start with base_model.model., as the keys PEFT saves for a LoRA "
               "adapter do; this is not a PEFT LoRA adapter file");
    IRIS_CHECK(e.dtype == DType::bf16 || e.dtype == DType::f16 || e.dtype == DType::f32, fname,
               ": tensor '", clip_text(key, 160), "' has dtype ", dtype_name(e.dtype),
               "; adapter tensors must be bf16, f16 or f32");
    const std::string name = current_module_path(key.substr(std::string(kPeftPrefix).size()));
    IRIS_CHECK(names.insert(name).second, fname, ": two keys name ", clip_text(name, 160),
               " (one of them in transformers' older module layout); keep one");
    (is_lora_tensor(name) ? lora : whole).push_back({key, name, &e});
  }
  IRIS_CHECK(!lora.empty(), fname,
             " holds no LoRA tensor (keys ending in .lora_A.weight and .lora_B.weight)");
  for (const AdapterKey& k : lora) {
    const std::string module = lora_module(k.name);
    auto [it, fresh] = pairs.try_emplace(module);
    if (fresh) modules.push_back(module);
    (k.name.ends_with(kLoraA) ? it->second.first : it->second.second) = &k;
  }

  // The model as the adapter makes it; the layout declares the adapters the model can take.
  ModelConfig adapted = cfg;
  adapted.lora = LoraConfig{};
  adapted.lora.rank = ac.rank;
  adapted.lora.alpha = ac.alpha * extra_scale;  // the scale is alpha's: scaling alpha scales it
  adapted.lora.rslora = ac.rslora;
  adapted.lora.modules = modules;
  const auto layout =
      allocate_weights(backend, adapted, DType::f32, [](const std::string&) { return false; });
  std::map<std::string, const WeightBinding*> declared;
  for (const WeightBinding& b : layout->bindings) declared[b.hf_name] = &b;
  const auto check_shape = [&](const AdapterKey& k, const WeightBinding& b) {
    IRIS_CHECK(k.entry->shape == b.hf_shape, fname, ": tensor '", clip_text(k.key, 160),
               "' has shape ", shape_string(k.entry->shape), " but the model's ", b.hf_name, " is ",
               shape_string(b.hf_shape),
               is_lora_tensor(b.hf_name)
                   ? str_cat(" (lora_A is [r, in], lora_B [out, r], with r = ", ac.rank,
                             " from adapter_config.json)")
                   : std::string(" (was the adapter trained on another base model?)"));
  };
  for (const AdapterKey& k : lora) {
    const std::string module = lora_module(k.name);
    const auto it = declared.find(k.name);
    if (it == declared.end()) {
      const bool exists = declared.count(module + ".weight") > 0;
      IRIS_FAIL(fname, ": key '", clip_text(k.key, 160), "' adapts ", clip_text(module, 120),
                exists ? str_cat(", which Iris cannot adapt (LoRA runs on the language model's "
                                 "q/k/v/o_proj and its dense layers' gate/up/down_proj, and on "
                                 "the vision blocks' attn.qkv and attn.proj)")
                       : str_cat(", a module this ", cfg.arch->display_name(), " model (", base_dir,
                                 ") does not have; was the adapter trained on another base "
                                 "model?"));
    }
    check_shape(k, *it->second);
    const auto& [a, b] = pairs.at(module);
    IRIS_CHECK(a != nullptr && b != nullptr, fname, ": ", clip_text(module, 120), " has ",
               a ? "lora_A.weight but no lora_B.weight" : "lora_B.weight but no lora_A.weight",
               "; an adapter needs both");
  }
  for (const AdapterKey& k : whole) {
    const auto it = declared.find(k.name);
    IRIS_CHECK(it != declared.end() && !is_lora_tensor(k.name), fname, ": key '",
               clip_text(k.key, 160),
               "' is neither a LoRA tensor of a module (.lora_A.weight, .lora_B.weight) nor a "
               "tensor of the base model (a module PEFT saved whole, modules_to_save); Iris "
               "cannot apply it, and leaving it out would run another model than the one trained");
    check_shape(k, *it->second);
  }

  using Clock = std::chrono::steady_clock;
  WeightLoadTimes t;
  std::unique_ptr<ModelWeights> w = load_weights(backend, merge ? cfg : adapted, base_dir, &t);
  const auto t0 = Clock::now();
  std::map<std::string, const WeightBinding*> bound;
  for (const WeightBinding& b : w->bindings) bound[b.hf_name] = &b;
  std::vector<float> host;
  // Modules saved whole replace the base's tensors before anything is merged into them.
  for (const AdapterKey& k : whole)
    write_adapter_tensor(backend, bound.at(k.name)->tensor(), k, host);
  if (!merge) {
    for (const AdapterKey& k : lora)
      write_adapter_tensor(backend, bound.at(k.name)->tensor(), k, host);
  } else {
    const SafetensorsCheckpoint base(base_dir);
    std::map<std::string, const SafetensorsEntry*> replaced;
    for (const AdapterKey& k : whole) replaced[k.name] = k.entry;
    const float scale = adapted.lora.scale();
    for (const std::string& module : modules) {
      const std::string weight = module + ".weight";
      const SafetensorsEntry* we = nullptr;
      if (replaced.count(weight))
        we = replaced.at(weight);
      else
        for (const std::string& n : {weight, older_module_path(weight)})
          if (we == nullptr && base.contains(n)) we = &base.at(n);
      IRIS_CHECK(we != nullptr, "checkpoint ", base_dir, " has no tensor ", weight,
                 " to merge the adapter into");
      const auto& [a, b] = pairs.at(module);
      std::vector<float> W = to_f32(*we);
      const std::vector<float> A = to_f32(*a->entry), B = to_f32(*b->entry);
      const int64_t out = b->entry->shape[0], in = a->entry->shape[1];
      merge_lora_delta(W.data(), A.data(), B.data(), out, in, ac.rank, scale);
      const int64_t bad = backend.write_finite(bound.at(weight)->tensor(), W.data(), DType::f32);
      IRIS_CHECK(bad < 0, fname, ": merging the adapter of ", module,
                 " gives a non-finite weight (element ", bad,
                 "); the adapter holds NaN, Inf or values too large to merge");
    }
  }
  backend.synchronize();
  t.read_ms += std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (times != nullptr) *times = t;
  if (!merge) cfg = adapted;
  return w;
}

}  // namespace iris
