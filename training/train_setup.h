// What a recipe's run plans before it allocates anything: the activation limits of its models and
// the split of its pipeline stages. The trainer runs with these, and the memory plan
// (training/memory_plan.h) counts them, so a dry run plans what a run holds.
#pragma once

#include <vector>

#include "bridge/model_config.h"
#include "bridge/pipeline_stage.h"
#include "training/metrics_log.h"
#include "training/recipe.h"
#include "training/train_model.h"

namespace iris {

// The largest micro-batch each model is planned for, its recompute and frozen parts, and (with
// graphs) its bucket padding. on_gpu: the loss streams larger chunks of labelled rows.
TrainLimits recipe_train_limits(const Recipe& r, bool on_gpu);

// The stages of parallel.pipeline_parallel_size (split by training FLOPs of a full micro-batch,
// or by the measured times of parallel.pipeline_costs, unless parallel.pipeline_layers says
// otherwise); one stage: the whole model.
std::vector<PipelineStage> recipe_pipeline_stages(const Recipe& r, const ModelConfig& cfg,
                                                  const TrainLimits& limits);

// The freeze settings of the recipe.
FreezeSpec recipe_frozen_parts(const Recipe& r);
// What the throughput's FLOP count takes as trained (training/metrics_log.h): the parts whose
// weights train, and under LoRA the parts the adapters let the gradient through.
TrainedParts recipe_trained_parts(const Recipe& r);
// The same for a model and its freeze settings, from the parameter specs (adapters included).
TrainedParts trained_parts(const ModelConfig& cfg, const FreezeSpec& frozen);

// Models a rank of `stage` keeps, one per micro-batch whose activations it holds at once (1F1B on
// a pipeline; one otherwise).
int recipe_models_per_rank(const Recipe& r, int stage);

}  // namespace iris
