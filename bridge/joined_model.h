// The joined model's order, written once: the token embedding, the vision embeddings over the
// image and video pad rows, the decoder layers with the DeepStack features added after the first
// ones, the final norm and the head. Every path supplies the steps with its own buffers (a
// prefill chunk, a decode step and its CUDA graphs, the training model's forward and backward, a
// pipeline stage's share) and runs them through these two functions, so the order, and where a
// family's parts sit in it, lives here alone. The vision tower's own order is
// vision/vision_tower_order.h.
#pragma once

#include "bridge/model_config.h"
#include "bridge/pipeline_stage.h"
#include "language/decoder.h"

namespace iris {

class JoinedForwardSteps {
 public:
  virtual ~JoinedForwardSteps() = default;
  virtual void embed() = 0;
  // The vision embeddings over the pad rows (a step without pad rows does nothing).
  virtual void scatter_vision() = 0;
  virtual void layer(int l) = 0;
  // The DeepStack features of tap l added to the pad rows after layer l.
  virtual void add_deepstack(int l) = 0;
  virtual void final_norm() = 0;
  virtual void head() = 0;
  // At HF's hidden_states points: 0 after the vision scatter, l (1..N-1) after layer l-1 before
  // its DeepStack add, N after the final norm.
  virtual void hidden_state(int /*index*/) {}
};

class JoinedBackwardSteps {
 public:
  virtual ~JoinedBackwardSteps() = default;
  // From the loss through the head and the final norm into d(output of the last layer).
  virtual void head() = 0;
  // d(the DeepStack rows added after layer l): d(output of layer l) at the pad rows.
  virtual void deepstack(int l) = 0;
  virtual void layer(int l) = 0;
  // The embedding's gradient, and the pad rows' gradient handed to the vision tower.
  virtual void embed() = 0;
};

// A decode step (batch 1) on a TextDecoder whose upload_step() wrote the inputs. A decode row is
// never a pad row, so the vision steps have nothing to do; `argmax` adds the greedy token on the
// device after the head (what a graph's caller reads instead of the logits).
class DecodeSteps : public JoinedForwardSteps {
 public:
  DecodeSteps(TextDecoder& decoder, bool argmax) : decoder_(decoder), argmax_(argmax) {}
  void embed() override { decoder_.embed(1); }
  void scatter_vision() override {}
  void layer(int l) override { decoder_.layer(l, 1); }
  void add_deepstack(int) override {}
  void final_norm() override { decoder_.final_norm(1); }
  void head() override {
    decoder_.lm_head(0, 1);
    if (argmax_) decoder_.argmax(1);
  }

 protected:
  TextDecoder& decoder_;

 private:
  bool argmax_;
};

// The stage's part: the embedding and the vision scatter on the stage that has the embedding,
// its layers, the final norm and the head on the last.
void joined_forward(const ModelConfig& cfg, const PipelineStage& stage, JoinedForwardSteps& steps);
void joined_backward(const ModelConfig& cfg, const PipelineStage& stage,
                     JoinedBackwardSteps& steps);

}  // namespace iris
