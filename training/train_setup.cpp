#include "training/train_setup.h"

#include <algorithm>

#include "bridge/peft.h"
#include "core/error.h"
#include "training/metrics_log.h"
#include "training/param_spec.h"
#include "training/pipeline_costs.h"
#include "training/pipeline_parallel.h"

namespace iris {

FreezeSpec recipe_frozen_parts(const Recipe& r) {
  // LoRA freezes the whole base model but the modules to save; the adapters train.
  if (r.peft.lora()) return {true, true, true, r.peft.modules_to_save};
  return {r.train.freeze_vision_tower, r.train.freeze_merger, r.train.freeze_language_model, {}};
}

TrainedParts recipe_trained_parts(const Recipe& r) {
  if (!r.peft.lora() || !r.has_model_config)
    return {!r.train.freeze_vision_tower, !r.train.freeze_merger, !r.train.freeze_language_model,
            false, false};
  return trained_parts(r.model_config, recipe_frozen_parts(r));
}

TrainedParts trained_parts(const ModelConfig& cfg, const FreezeSpec& frozen) {
  TrainedParts t{false, false, false, false, false};
  const ParamSpecs specs(cfg, frozen, DType::f32);
  for (const ParamSpec& s : specs.all()) {
    if (!s.trainable) continue;
    const bool adapter = is_lora_tensor(s.hf_name);
    switch (s.part) {
      case ModelPart::vision_tower:
        (adapter ? t.vision_tower_adapters : t.vision_tower) = true;
        break;
      case ModelPart::merger:
        t.merger = true;
        break;
      case ModelPart::language_model:
        (adapter ? t.language_model_adapters : t.language_model) = true;
        break;
    }
  }
  return t;
}

TrainLimits recipe_train_limits(const Recipe& r, bool on_gpu) {
  const PreprocessorConfig pp = recipe_preprocessor(r);
  const bool graphs_on = r.cuda_graph.language.impl != GraphImpl::none ||
                         r.cuda_graph.vision.impl != VisionGraphImpl::none;
  // One micro-batch packs micro_batch_size samples; the activation memory is planned for the
  // largest one.
  const int64_t micro = r.train.micro_batch_size;
  TrainLimits limits;
  limits.max_samples = static_cast<int>(micro);
  limits.max_seq_len = r.train.seq_length * micro;
  limits.max_patches = recipe_max_vision_patches(r) * micro;
  const int64_t factor = int64_t(pp.patch_size) * pp.merge_size;
  const int64_t min_image_tokens = std::max<int64_t>(1, pp.min_pixels / (factor * factor));
  limits.max_images = static_cast<int>(std::min<int64_t>(
      {(r.train.seq_length / min_image_tokens + 1) * micro, limits.max_seq_len, 1 << 20}));
  // The lm_head's weight and gradient are streamed once per chunk of labelled rows: on the CPU
  // that pass is most of a small model's step, so the chunk covers a micro-batch's labels.
  limits.loss_chunk_rows = on_gpu ? 1024 : 256;
  limits.recompute = parse_recompute(r.train.recompute);
  limits.offload = recipe_offloaded_activations(r);
  limits.moe_capacity.factor = r.model.moe_expert_capacity_factor;
  limits.moe_capacity.pad = r.model.moe_pad_expert_input_to_capacity;
  limits.moe_capacity.policy =
      r.model.moe_token_drop_policy == "position" ? MoeDropPolicy::position : MoeDropPolicy::probs;
  limits.frozen = recipe_frozen_parts(r);
  // A tower with nothing to train keeps no block activations; under LoRA it trains only where
  // it has adapters or a module to save.
  limits.vision_tower_frozen = r.train.freeze_vision_tower;
  if (r.peft.lora() && r.has_model_config) {
    const TrainedParts t = trained_parts(r.model_config, limits.frozen);
    limits.vision_tower_frozen = !t.vision_tower && !t.vision_tower_adapters;
  }
  if (graphs_on) {
    // Text buckets: powers of two from 256 below the planned maximum, then the maximum, so that a
    // micro-batch pads by less than half; the vision buckets are the graph config's.
    for (int64_t b = 256; b < limits.max_seq_len; b *= 2) limits.text_buckets.push_back(b);
    limits.text_buckets.push_back(limits.max_seq_len);
    const VisionGraphConfig& vg = r.cuda_graph.vision;
    IRIS_CHECK(vg.max_seq_length <= limits.max_patches,
               "cuda_graph.max_vision_cuda_graph_seq_length (", vg.max_seq_length,
               ") is above the vision patches planned for a micro-batch (", limits.max_patches,
               " = train.max_vision_patches x train.micro_batch_size); lower it or raise "
               "train.max_vision_patches");
    limits.vision_buckets = vg.buckets;
  }
  return limits;
}

std::vector<PipelineStage> recipe_pipeline_stages(const Recipe& r, const ModelConfig& cfg,
                                                  const TrainLimits& limits) {
  const int n_stages = static_cast<int>(r.parallel.pipeline_parallel_size);
  if (n_stages <= 1) {
    PipelineStage whole;
    whole.end_layer = cfg.text.num_hidden_layers;
    return {whole};
  }
  if (!r.parallel.pipeline_costs.empty())
    return pipeline_split(cfg, n_stages, r.parallel.pipeline_layers,
                          read_pipeline_costs(r.parallel.pipeline_costs));
  const TrainedParts trained = recipe_trained_parts(r);
  const int64_t T = limits.max_seq_len;
  std::vector<GridTHW> image;
  if (limits.max_patches > 0) image.push_back({1, 1, limits.max_patches});
  const double text = training_flops(cfg, {T, 0, {}}, trained);
  PipelineCosts costs;
  costs.layer = text / cfg.text.num_hidden_layers;
  costs.first = training_flops(cfg, {T, 0, image}, trained) - text;
  costs.last = training_flops(cfg, {T, T, {}}, trained) - text;
  return pipeline_split(cfg, n_stages, r.parallel.pipeline_layers, costs);
}

int recipe_models_per_rank(const Recipe& r, int stage) {
  const int stages = static_cast<int>(r.parallel.pipeline_parallel_size);
  if (stages <= 1) return 1;
  const int64_t micro_batches = r.train.global_batch_size / r.train.micro_batch_size;
  return pipeline_slots(stage, stages,
                        static_cast<int>(micro_batches / r.parallel.data_parallel_size));
}

}  // namespace iris
