// What each parameter is, apart from where it lives: its HF name and shape, the dtype the model
// reads it in, its model part, whether this run trains it, and the axis a sharded layout splits.
// Every training buffer is derived from these specs for what it must hold: the weights the model
// reads hold every parameter (a frozen part keeps those and nothing else), while the gradients,
// f32 master weights and both AdamW moments hold the trainable parameters only (allocate_state).
// The memory plan (training/memory_plan.h) counts the same specs, so what it prints is what the
// trainer allocates.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "bridge/pipeline_stage.h"
#include "core/backend.h"
#include "training/train_model.h"

namespace iris {

struct ParamSpec {
  std::string hf_name;
  std::vector<int64_t> shape;
  DType dtype = DType::bf16;  // what the forward reads (the backend's compute dtype)
  ModelPart part = ModelPart::language_model;
  bool trainable = true;
  // The axis a sharded layout splits: rows, along which fused q/k/v and gate/up stack their HF
  // tensors, so a shard boundary never cuts through one HF row.
  int shard_axis = 0;
  int64_t numel() const;
};

class ParamSpecs {
 public:
  // From the binding table (any allocation of the config: a partial one holds the whole table)
  // and the freeze settings.
  ParamSpecs(const ModelWeights& layout, const FreezeSpec& frozen, DType compute_dtype);
  // Without allocating anything: the table of `cfg`'s weights.
  ParamSpecs(const ModelConfig& cfg, const FreezeSpec& frozen, DType compute_dtype);

  const std::vector<ParamSpec>& all() const { return specs_; }
  const FreezeSpec& frozen() const { return frozen_; }
  bool trainable(const std::string& hf_name) const;
  // The predicate allocate_weights keeps a training buffer's tensors by.
  std::function<bool(const std::string&)> trainable_filter() const;
  // Elements of every parameter, and of the trainable ones; `holds` (by HF name) restricts both
  // to some tensors, e.g. a pipeline stage's. A tied lm_head has no binding, so it counts once.
  int64_t parameters(const std::function<bool(const std::string&)>& holds = {}) const;
  int64_t trainable_parameters(const std::function<bool(const std::string&)>& holds = {}) const;

 private:
  void build(const ModelWeights& layout, DType compute_dtype);
  FreezeSpec frozen_;
  std::vector<ParamSpec> specs_;
};

// An f32 buffer of the trainable parameters only (gradients, master weights, moments), with the
// whole binding table: a frozen tensor's target is an undefined Tensor. Every such buffer of one
// spec shares one layout, so the optimizer walks them as flat buffers together.
std::unique_ptr<ModelWeights> allocate_state(Backend& backend, const ModelConfig& cfg,
                                             const ParamSpecs& specs);

// Bytes of the tensors `w` allocated (what a buffer holds, alignment included).
size_t allocated_bytes(const ModelWeights& w);

}  // namespace iris
