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

// L2 norm over the gradients of every parameter that is not frozen (summed in f64; CPU tensors).
double grad_norm(const ModelWeights& grads, const FreezeSpec& frozen = {});

// AdamW through the Backend's multi-tensor ops: the master weights, gradients and both moments are
// f32 ModelWeights of one config, hence one layout, and are updated as flat buffers in one launch.
// On the CPU the master weights are the weights the model reads; on CUDA a bf16 working copy is
// rewritten from them by the same kernel.
class AdamW {
 public:
  // master and grads: f32 ModelWeights on `backend` built from `cfg` (same bindings). working:
  // the compute-dtype weights the model reads, or null where they are `master` itself.
  AdamW(Backend& backend, const ModelConfig& cfg, ModelWeights& master, ModelWeights& grads,
        const AdamWConfig& config, ModelWeights* working = nullptr);

  // Clips the gradients to config.clip_grad_norm (torch.nn.utils.clip_grad_norm_: scale by
  // max_norm / (norm + 1e-6) when that is below 1), then updates every parameter that is not
  // frozen, each with lr times its part's lr_scale. Frozen parameters, their moments and their
  // step counts are left untouched, and so is everything when the gradient norm is not finite.
  // Nothing is read back: the step is queued behind the backward.
  void step(float lr, const FreezeSpec& frozen = {});
  // The global gradient norm (before clipping) of each step since the last call, in order
  // (waits for the device).
  std::vector<float> take_grad_norms();
  // The last norm take_grad_norms returned.
  double last_grad_norm() const { return last_norm_; }

  // Updates taken (calls to step()).
  int64_t steps() const { return steps_; }
  // Bytes of the moments (the master weights and gradients belong to their owners).
  size_t state_bytes() const { return m_->arena.capacity() + v_->arena.capacity(); }
  const AdamWConfig& config() const { return config_; }
  ModelWeights& exp_avg() { return *m_; }
  ModelWeights& exp_avg_sq() { return *v_; }

  // The state as safetensors: exp_avg.<hf name>, exp_avg_sq.<hf name> (f32) and step.<hf name>
  // (i64 [1]) per parameter; the update count in the metadata. load() restores it bit-exactly and
  // checks that every tensor is present with the right shape. The file does not depend on the
  // backend: a state saved on one device loads on another.
  void save(const std::string& path) const;
  void load(const std::string& path);

 private:
  void write_hyper(const FreezeSpec& frozen);
  void read_norm_history();
  // Gradient norms of steps not yet read back, kept on the device; a full history is read
  // before the next step writes to it.
  static constexpr int64_t kNormHistory = 4096;

  Backend& be_;
  AdamWConfig config_;
  ModelWeights& master_;
  ModelWeights& grads_;
  ModelWeights* working_;
  std::unique_ptr<ModelWeights> m_, v_;
  Arena tables_;  // spans, hyper, steps, lr, grad_stats, norm history on the backend
  Tensor spans_, hyper_, steps_dev_, lr_, grad_stats_, norm_history_;
  int64_t unread_norms_ = 0;
  std::vector<float> read_norms_;  // read back, not yet taken
  double last_norm_ = 0;
  Tensor flat_master_, flat_grads_, flat_m_, flat_v_, flat_working_;
  FreezeSpec hyper_frozen_;
  bool hyper_written_ = false;
  int64_t steps_ = 0;
};

}  // namespace iris
