// LoRA adapters in Hugging Face PEFT's terms: the target names a recipe may give, the tensor
// names adapters have in Iris's weight table (HF's module path + .lora_A.weight / .lora_B.weight,
// the keys PEFT saves without their base_model.model. prefix), and the adapter files PEFT reads
// and writes (adapter_config.json, adapter_model.safetensors).
#pragma once

#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"

namespace iris {

// The target names peft.target_modules accepts, each with the modules it adapts: the language
// model's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj and down_proj (dense layers; a
// sparse layer's experts are never adapted), and the vision blocks' attn.qkv and attn.proj.
const std::vector<std::string>& lora_target_names();
// An error naming the accepted names unless every one of `targets` is one of them.
void check_lora_targets(const std::vector<std::string>& targets, const std::string& where);

// Whether the HF tensor name is an adapter's (…​.lora_A.weight or …​.lora_B.weight).
bool is_lora_tensor(const std::string& hf_name);
// The HF module an adapter tensor belongs to (its name without .lora_A.weight / .lora_B.weight).
std::string lora_module(const std::string& hf_name);

// An error unless every target of cfg.lora adapts at least one module of `layout` (a target that
// matches nothing would train nothing, silently).
void check_lora_matches(const ModelConfig& cfg, const ModelWeights& layout,
                        const std::string& where);

// PEFT's initialisation (init_lora_weights = true): lora_A ~ U(-1/sqrt(in), 1/sqrt(in)) (torch's
// kaiming_uniform_ with a = sqrt(5)) and lora_B = 0, so that a fresh adapter leaves the model's
// output as it is. Drawn from `seed` in binding order; other tensors are left alone.
void init_lora_weights(Backend& backend, ModelWeights& weights, uint64_t seed);

// What adapter_config.json records beyond the model's LoRA settings.
struct PeftRun {
  double dropout = 0.0;
  std::vector<std::string> modules_to_save;
  std::string base_model;  // base_model_name_or_path: the HF folder or hub id trained from
};
// adapter_config.json as PEFT writes it for the adapters `layout` holds: target_modules is a
// regex that PEFT full-matches against module paths, naming exactly the adapted modules (a list
// would be suffix-matched, and adapt a Qwen2.5-VL vision MLP's gate_proj along with the
// language model's).
std::string peft_adapter_config(const ModelConfig& cfg, const ModelWeights& layout,
                                const PeftRun& run);

// PEFT's key of an Iris adapter tensor, and back (empty when `key` is not an adapter key).
std::string peft_key(const std::string& hf_name);
std::string hf_name_of_peft_key(const std::string& key);

}  // namespace iris
