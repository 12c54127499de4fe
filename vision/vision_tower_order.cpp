#include "vision/vision_tower_order.h"

#include <algorithm>

namespace iris {

namespace {
// The DeepStack tap that reads block l's output, or -1.
int tap_of(const VisionConfig& cfg, int l) {
  const auto& taps = cfg.deepstack_visual_indexes;
  const auto it = std::find(taps.begin(), taps.end(), l);
  return it == taps.end() ? -1 : static_cast<int>(it - taps.begin());
}
}  // namespace

void vision_tower_forward(const VisionConfig& cfg, VisionTowerSteps& steps) {
  steps.embed();
  for (int l = 0; l < cfg.depth; ++l) {
    steps.block(l);
    if (const int k = tap_of(cfg, l); k >= 0) steps.deepstack_merger(k, l);
  }
  steps.merger();
}

void vision_tower_backward(const VisionConfig& cfg, VisionTowerGradSteps& steps,
                           bool through_blocks) {
  steps.merger();
  for (int l = cfg.depth - 1; l >= 0; --l) {
    // A tap reads block l's output, so its gradient joins before block l's backward.
    if (const int k = tap_of(cfg, l); k >= 0) steps.deepstack_merger(k, l);
    if (through_blocks) steps.block(l);
  }
  if (through_blocks) steps.embed();
}

}  // namespace iris
