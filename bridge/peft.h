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
// sparse layer's experts are never adapted), and the vision blocks' attn.qkv, attn.proj and MLP
// projections under their family's names (mlp.linear_fc1/2 for Qwen3-VL, mlp.gate_proj, up_proj,
// down_proj for Qwen2.5-VL, mlp.fc1/2 for Qwen2-VL), and the main merger's two projections
// (merger.linear_fc1/2 for Qwen3-VL, merger.mlp.0/2 for the Qwen2 families; DeepStack mergers are
// not adapted).
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

namespace iris {

// adapter_config.json of a LoRA adapter, as far as it decides what the adapter computes.
struct PeftAdapterConfig {
  int rank = 0;
  double alpha = 0.0;
  bool rslora = false;
  std::vector<std::string> modules_to_save;
  // lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora: what B A is multiplied by.
  float scale() const;
};
// Reads an adapter_config.json. A setting under which PEFT computes something other than
// W x + scale B A x (use_dora, rank_pattern or alpha_pattern, bias other than "none", lora_bias,
// fan_in_fan_out, a peft_type other than LORA) is an error naming the file and the field, rather
// than an adapter run differently from how it was trained.
PeftAdapterConfig read_peft_adapter_config(const std::string& path);

// Whether the HF tensor `hf_name` lies in a module that PEFT's modules_to_save names: PEFT matches
// a module by its whole path or by its last components (merger matches model.visual.merger).
bool in_modules_to_save(const std::string& hf_name, const std::vector<std::string>& modules);

// W += scale * (B A) for w [out, in], a [r, in] and b [out, r], row-major f32: B A is formed
// first and then scaled and added, the order of PEFT's merge, so that the merged weight rounds
// as PEFT's does.
void merge_lora_delta(float* w, const float* a, const float* b, int64_t out, int64_t in, int64_t r,
                      float scale);

// The base model of `base_dir` (an HF checkpoint) with the LoRA adapter of `adapter_dir`
// (adapter_config.json and adapter_model.safetensors, as iris export --peft and PEFT's
// save_pretrained write them) applied, its scale times `extra_scale`. Every key of the adapter
// file must be an adapter of a module this model can adapt, or a tensor of the base model (a
// module PEFT saved whole, modules_to_save, which replaces it), with the shape the model has:
// anything else is an error naming the key, never an adapter silently left out.
// merge = false: cfg gets the adapters (cfg.lora: r, alpha, use_rslora and the modules the file
// adapts), and the weights hold them beside the base, which keeps its exact bits; the model then
// computes what the adapter was trained to. merge = true: cfg is left as it is and the adapters
// are merged into the base weights, W + scale B A formed in f32 from the checkpoint's W (then
// rounded to the backend's dtype).
std::unique_ptr<ModelWeights> load_weights_with_adapter(Backend& backend, ModelConfig& cfg,
                                                        const std::string& base_dir,
                                                        const std::string& adapter_dir,
                                                        float extra_scale, bool merge,
                                                        WeightLoadTimes* times = nullptr);

}  // namespace iris
