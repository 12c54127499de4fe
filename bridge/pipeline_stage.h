// Splitting Qwen3-VL into pipeline stages inside one process: stage 0 holds the vision encoder
// and the first decoder layers, every later stage a contiguous range of layers, and the last
// stage also the final norm and the LM head. A stage is a description of ownership: the CUDA
// graph helper of a stage captures (and later deletes) only the graphs of the parts it owns.
#pragma once

#include <string>
#include <vector>

#include "bridge/model_config.h"

namespace iris {

struct PipelineStage {
  int index = 0;
  int count = 1;
  bool has_vision = true;  // owns the vision encoder
  int first_layer = 0;     // decoder layers [first_layer, end_layer)
  int end_layer = 0;
  bool has_head = true;  // owns the final norm and the LM head

  bool has_embed() const { return index == 0; }
  int n_layers() const { return end_layer - first_layer; }
  std::string describe() const;  // e.g. "stage 1/2 (layers 14-27, head)"
};

// n_stages stages of at least one layer each. Stage 0 also carries the vision encoder, so when
// the layers do not divide evenly the extra layers go to the later stages.
std::vector<PipelineStage> split_stages(const ModelConfig& cfg, int n_stages);

// Consecutive stages holding layer_counts[i] layers each, from layer 0: the vision encoder on the
// first, the head on the last.
std::vector<PipelineStage> stages_of_layer_counts(const std::vector<int>& layer_counts);

// Checks that `stage` is one stage of a valid split of this model; the message names the field.
void validate_stage(const ModelConfig& cfg, const PipelineStage& stage);

}  // namespace iris
