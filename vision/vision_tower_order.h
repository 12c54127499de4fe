// The vision tower's order, written once: the encoder of inference, its CUDA graphs and the
// training model each supply the steps with their own buffers and run them through these two
// functions, so the order (and where a family's DeepStack taps sit in it) lives here alone.
#pragma once

#include "vision/vision_config.h"

namespace iris {

class VisionTowerSteps {
 public:
  virtual ~VisionTowerSteps() = default;
  // The tables of the call's grids, then the patch (and position) embedding.
  virtual void embed() = 0;
  virtual void block(int l) = 0;
  // DeepStack tap `k` reads the output of block `l`.
  virtual void deepstack_merger(int k, int l) = 0;
  virtual void merger() = 0;
};

class VisionTowerGradSteps {
 public:
  virtual ~VisionTowerGradSteps() = default;
  // Each takes d(its output) and adds d(its input) into the running residual gradient, which
  // starts at the main merger (d(output of the last block)).
  virtual void merger() = 0;
  virtual void deepstack_merger(int k, int l) = 0;
  virtual void block(int l) = 0;
  virtual void embed() = 0;
};

void vision_tower_forward(const VisionConfig& cfg, VisionTowerSteps& steps);
// With the tower frozen (through_blocks false) only the mergers run: nothing below them needs a
// gradient.
void vision_tower_backward(const VisionConfig& cfg, VisionTowerGradSteps& steps,
                           bool through_blocks);

}  // namespace iris
