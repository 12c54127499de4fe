// parallel.sharding=optimizer_grads (ZeRO-2): a rank keeps the f32 gradients of its shard only,
// summed over the data-parallel ranks as the backward writes them (parallel/shard_sum.h).
//
// The gradients the model writes are laid out as the optimizer's flat buffers are, except that
// the decoder layers take turns in two slots (layer l in slot l % 2): the backward finishes layer
// l + 1, then layer l, so by the time layer l - 2 writes its slot, layer l's gradients have long
// been sent to their owners. Every other tensor (the vision tower, the mergers, the embedding,
// the final norm, the lm_head) keeps its gradients for the whole step, and they are summed once
// after the last micro-batch, as the unsharded reduction sums them. For Qwen3-VL-8B the layers
// are 90% of the gradients, so a rank holds the other 10%, two layers and its 1/N shard instead
// of all of them.
//
// Per micro-batch, around each layer's backward (TrainableQwen3VL::on_layer): before
// it writes, the backend waits for the exchange that last read the slot (Communicator::
// wait_point) and zeroes the slot; after it, the layer's range is summed into the owners'
// shards while the backward goes on (on CUDA the exchanges run on the communicator's stream,
// detached). A micro-batch whose backward did not run (no labelled token) sums zeros for every
// layer in the same order, so every rank posts the same exchanges. The layers' sums of the step's
// first micro-batch replace the accumulator's contents and later ones add to it; the other
// tensors' are summed once: with one micro-batch per rank the accumulator holds the unsharded
// run's gradients bit for bit (shard_sum.h says what more micro-batches change).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "parallel/communicator.h"
#include "parallel/shard_sum.h"
#include "training/layer_slots.h"
#include "training/param_spec.h"

namespace iris {

class ShardedGradients {
 public:
  // The gradients of `specs`' trainable tensors on `be`, laid out as above.
  ShardedGradients(Backend& be, const ModelConfig& cfg, const ParamSpecs& specs);

  // What the models write (the layers' tensors share the slots).
  ModelWeights& grads() { return *grads_; }
  // The flat layout the optimizer's buffers and the shards follow (addresses only, no memory).
  ModelWeights& layout() { return *layout_; }
  // Bytes of the gradients a rank holds besides its shard: the other tensors and the two slots.
  size_t local_bytes() const { return grads_->arena.capacity(); }
  // Elements of the flat layout.
  int64_t elements() const { return n_; }

  // Makes the exchange over the data-parallel ranks (after the communicator exists).
  void connect(Backend& be, Communicator& comm, int64_t bucket_elements);
  // This rank's summed gradients, elements [shard().begin(), shard().end()) of the layout.
  ShardSum& shard() { return *sum_; }
  size_t shard_bytes() const { return sum_ ? sum_->bytes() : 0; }

  // The model's hook: layer l's backward begins (it will write the slot) or has ended.
  void layer(int l, bool begin);
  // After each training micro-batch's backward (or in its place). The layers a skipped backward
  // did not reach are summed as zeros, in the backward's order, each between around(l, true)
  // and around(l, false) as a backward calls the hooks of everything else that runs by layer
  // (sharded weights), so that every rank posts the same exchanges in the same order.
  void micro_batch_done(const std::function<void(int layer, bool begin)>& around = {});
  // After the step's last micro-batch: sums the other tensors and orders the backend's later
  // work (the optimizer) after every exchange of the step.
  void step_done();

 private:
  Tensor slot_view(int l) const;

  Backend* be_ = nullptr;
  Communicator* comm_ = nullptr;
  std::unique_ptr<ModelWeights> layout_, grads_;
  int64_t n_ = 0;
  std::unique_ptr<LayerSlots> slots_;
  std::vector<bool> summed_;  // by layer, in the current micro-batch
  int micro_batches_ = 0;     // of this step, done
  std::unique_ptr<ShardSum> sum_;
};

}  // namespace iris
