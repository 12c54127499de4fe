// Pipeline splits from measured time instead of FLOP estimates: a profiled step's ops
// (logging.op_profile_step, core/op_profile.h) labelled by the model part they belong to, summed
// into the costs pipeline_split balances, written beside the run (pipeline_costs.json) and read
// back by a later run's parallel.pipeline_costs.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/op_profile.h"
#include "training/pipeline_parallel.h"
#include "training/train_model.h"

namespace iris {

// The labels of the parts: stage 0's extra (the vision encoder, its mergers and the embedding,
// forward and backward), the decoder layers, and the last stage's extra (the final norm, lm_head
// and loss). Ops under any other label (the optimizer: "") are no stage's.
inline constexpr const char* kPartFirst = "first";
inline constexpr const char* kPartLayer = "layer";
inline constexpr const char* kPartLast = "last";

// A layer hook (TrainableQwen3VL::on_layer) for a model that holds every decoder layer
// (`layers`): it labels the ops `profile` records by part, counting in *backward_layers the
// layer backwards it saw, then calls `next` (may be empty). The part before the first layer of
// each micro-batch is kPartFirst.
TrainableQwen3VL::LayerHook pipeline_part_hook(ProfilingBackend& profile, int layers,
                                               int64_t* backward_layers,
                                               TrainableQwen3VL::LayerHook next);

// The parts' device time in the records (ms of the profiled step; `layer` per decoder layer of
// the `layers` the step ran).
PipelineCosts measured_pipeline_costs(const std::vector<OpRecord>& records, int layers);

// {"layer_ms", "first_ms", "last_ms", "layers"}, and back. read_pipeline_costs's errors name
// parallel.pipeline_costs and the file.
nlohmann::json pipeline_costs_json(const PipelineCosts& costs, int layers);
PipelineCosts read_pipeline_costs(const std::string& path);

}  // namespace iris
