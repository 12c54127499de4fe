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
  const bool vision = starts_with(target, "attn.");
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
  static const std::vector<std::string> kNames = {"q_proj",    "k_proj",    "v_proj",
                                                  "o_proj",    "gate_proj", "up_proj",
                                                  "down_proj", "attn.qkv",  "attn.proj"};
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
               " (the vision merger is trained in full with peft.modules_to_save: [merger])");
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
  static const std::regex kIndexed(R"(^(.*\.(?:layers|blocks))\.\d+\.(.*)$)");
  for (const WeightBinding& b : layout.bindings) {
    if (!is_lora_tensor(b.hf_name)) continue;
    const std::string module = lora_module(b.hf_name);
    std::smatch m;
    IRIS_CHECK(std::regex_match(module, m, kIndexed), "adapter module '", module,
               "' is not inside a layer or block");
    groups[m[1].str()].insert(m[2].str());
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
