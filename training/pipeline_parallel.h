// Pipeline-parallel training: the model's decoder layers split into contiguous stages, one
// process each (bridge/pipeline_stage.h says what a stage holds), and a step's micro-batches run
// through them in the 1F1B order (one forward, one backward), which keeps at most
// stages - stage micro-batches' activations alive on a stage.
//
// The result is that of one process: every stage prepares each micro-batch's metadata from the
// samples itself (every rank walks the same sample sequence), the hidden state and its gradient
// cross the stage boundary as the f32 (compute-dtype) tensors a single model hands from layer to
// layer, and each stage's backwards run in micro-batch order into one gradient buffer, which is
// the order a single model accumulates in. Only a gradient two stages both compute (the tied
// embedding: stage 0's lookup, the last stage's lm_head) is summed in another order, which can
// change its last bits.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bridge/model_config.h"
#include "bridge/pipeline_stage.h"
#include "training/train_model.h"

namespace iris {

class DataParallel;

// Training FLOPs of the parts a split balances, for one full micro-batch.
struct PipelineCosts {
  double layer = 1;  // one decoder layer
  double first = 0;  // stage 0's extra: the vision encoder, its mergers and the embedding
  double last = 0;   // the last stage's extra: the final norm, lm_head and loss
};

// The stages of a pipeline of n_stages. `layers`: decoder layers per stage from
// parallel.pipeline_layers (positive, summing to the model's layers; errors name the key), or
// empty for the split whose most expensive stage costs least (ties: the earliest such split).
std::vector<PipelineStage> pipeline_split(const ModelConfig& cfg, int n_stages,
                                          const std::vector<double>& layers,
                                          const PipelineCosts& costs);

// Micro-batches whose activations a stage keeps at once under 1F1B: its models.
int pipeline_slots(int stage, int stages, int micro_batches);

// Runs this rank's micro-batches of a step on its stage in 1F1B order, exchanging activations
// and gradients with the neighbouring stages through `dp` (each exchange pairs a send with the
// receive the neighbour expects next, so blocking MPI cannot deadlock). Micro-batch i runs on
// slots[i % slots.size()]; the slots share one gradient buffer. Returns the labelled tokens.
int64_t run_pipeline_step(const std::vector<std::unique_ptr<TrainableQwen3VL>>& slots,
                          const std::vector<std::vector<const TrainSample*>>& micro_batches,
                          float grad_scale, DataParallel& dp);

// "stage 0: layers 0-9, vision, embedding (ranks 0, 1)" per stage, one line each.
std::string describe_pipeline(const std::vector<PipelineStage>& stages, int replicas,
                              const std::vector<std::string>& graph_sets);

}  // namespace iris
