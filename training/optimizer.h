// AdamW on the CPU reference with fp32 master weights: the f32 parameters of a TrainableQwen3VL
// are the master copy, and the moments are two more ModelWeights with the same binding table, so
// every state tensor is addressed by its HF name. The update follows torch.optim.AdamW (foreach
// path): decoupled decay p *= 1 - lr * wd before the Adam step, bias-corrected moments,
// per-parameter step counts, and weight decay only on parameters with >= 2 dims.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "training/train_model.h"

namespace iris {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;    // applied to parameters with >= 2 dims only
  float clip_grad_norm = 0.0f;  // global L2 norm to clip to; <= 0 disables clipping
  // Each part's learning rate relative to the scheduled one (Qwen's vision_tower_lr and
  // mm_projector_lr): a randomly initialised vision tower can want a larger step than the LM.
  float vision_tower_lr_scale = 1.0f;
  float merger_lr_scale = 1.0f;
  float lr_scale(ModelPart part) const;
};

// L2 norm over the gradients of every parameter that is not frozen (summed in f64).
double grad_norm(const ModelWeights& grads, const FreezeSpec& frozen = {});

class AdamW {
 public:
  // params and grads: f32 ModelWeights on the CPU backend built from `cfg` (same bindings).
  AdamW(Backend& cpu, const ModelConfig& cfg, ModelWeights& params, ModelWeights& grads,
        const AdamWConfig& config);

  // Clips the gradients in place to config.clip_grad_norm (torch.nn.utils.clip_grad_norm_: scale
  // by max_norm / (norm + 1e-6) when that is below 1), then updates every parameter that is not
  // frozen, each with lr times its part's lr_scale. Returns the global gradient norm before
  // clipping. Frozen parameters, their moments
  // and their step counts are left untouched.
  double step(float lr, const FreezeSpec& frozen = {});

  // Updates taken (calls to step()).
  int64_t steps() const { return steps_; }
  const AdamWConfig& config() const { return config_; }
  ModelWeights& exp_avg() { return *m_; }
  ModelWeights& exp_avg_sq() { return *v_; }

  // The state as safetensors: exp_avg.<hf name>, exp_avg_sq.<hf name> (f32) and step.<hf name>
  // (i64 [1]) per parameter; the update count in the metadata. load() restores it bit-exactly and
  // checks that every tensor is present with the right shape.
  void save(const std::string& path) const;
  void load(const std::string& path);

 private:
  Backend& be_;
  AdamWConfig config_;
  ModelWeights& params_;
  ModelWeights& grads_;
  std::unique_ptr<ModelWeights> m_, v_;
  std::vector<int64_t> param_steps_;  // per binding, like torch's state["step"]
  int64_t steps_ = 0;
};

}  // namespace iris
