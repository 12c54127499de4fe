#include "bridge/joined_model.h"

namespace iris {

namespace {
int deepstack_taps(const ModelConfig& cfg) {
  return static_cast<int>(cfg.vision.deepstack_visual_indexes.size());
}
}  // namespace

void joined_forward(const ModelConfig& cfg, const PipelineStage& stage, JoinedForwardSteps& steps) {
  const int n_layers = cfg.text.num_hidden_layers;
  if (stage.has_embed()) {
    steps.embed();
    steps.scatter_vision();
    steps.hidden_state(0);
  }
  for (int l = stage.first_layer; l < stage.end_layer; ++l) {
    steps.layer(l);
    if (l + 1 < n_layers) steps.hidden_state(l + 1);
    if (l < deepstack_taps(cfg)) steps.add_deepstack(l);
  }
  if (stage.has_head) {
    steps.final_norm();
    steps.hidden_state(n_layers);
    steps.head();
  }
}

void joined_backward(const ModelConfig& cfg, const PipelineStage& stage,
                     JoinedBackwardSteps& steps) {
  if (stage.has_head) steps.head();
  for (int l = stage.end_layer - 1; l >= stage.first_layer; --l) {
    if (l < deepstack_taps(cfg)) steps.deepstack(l);
    steps.layer(l);
  }
  if (stage.has_embed()) steps.embed();
}

}  // namespace iris
