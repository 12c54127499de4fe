// parallel.sharding=optimizer_grads (ZeRO-2): a rank keeps the f32 gradients of its shard only,
// summed over the data-parallel ranks as the backward writes them (parallel/shard_sum.h).
//
// The gradients the model writes are laid out as the optimizer's flat buffers are, except that
// the decoder layers take turns in two slots (layer l in slot l % 2): the backward finishes layer
// l + 1, then layer l, so by the time layer l - 2 writes its slot, layer l's gradients have long
// been sent to their owners. An untied embedding and lm_head take turns in one slot of their own
// the same way: the loss writes the lm_head's gradient at the end of the forward, which is summed
// into the owners' shards while the backward runs, and the embedding's backward, the backward's
// last, writes the slot again. Every other tensor (the vision tower, the mergers, the final norm,
// a tied embedding) keeps its gradients for the whole step, and they are summed once after the
// last micro-batch, as the unsharded reduction sums them. For Qwen3-VL-8B the layers are 83% of
// the gradients and the embedding and lm_head 15%: a rank holds the rest, two layers, one
// vocabulary-sized slot and its 1/N shard instead of all of them (for Qwen3-VL-32B on 8 GPUs the
// vocabulary slot saves 2.9 GiB a rank).
//
// Per micro-batch, around each layer's backward (TrainableQwen3VL::on_layer): before
// it writes, the backend waits for the exchange that last read the slot (Communicator::
// wait_point) and zeroes the slot; after it, the layer's range is summed into the owners'
// shards while the backward goes on (on CUDA the exchanges run on the communicator's stream,
// detached); the lm_head and the embedding likewise around their writes. A micro-batch whose
// backward did not run (no labelled token) sums zeros for the lm_head, every layer and the
// embedding in the same order, so every rank posts the same exchanges. The layers' sums of the
// step's first micro-batch replace the accumulator's contents and later ones add to it; the other
// tensors' are summed once: with one micro-batch per rank the accumulator holds the unsharded
// run's gradients bit for bit (shard_sum.h says what more micro-batches change).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
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

  // Makes the exchange over the data-parallel ranks (after the communicator exists). A pipeline
  // stage's ranks shard its span of the layout, [span.first, span.second), and sum the layers
  // [layers.first, layers.second) it computes; by default the whole layout and every layer.
  void connect(Backend& be, Communicator& comm, int64_t bucket_elements,
               std::pair<int64_t, int64_t> span = {0, -1}, std::pair<int, int> layers = {0, -1});
  // This rank's summed gradients, elements [shard().begin(), shard().end()) of the layout.
  ShardSum& shard() { return *sum_; }
  size_t shard_bytes() const { return sum_ ? sum_->bytes() : 0; }

  // The model's hook: layer l's backward begins (it will write the slot) or has ended.
  void layer(int l, bool begin);
  // The model's hook: the loss is about to write the lm_head's gradient, or the embedding's
  // backward its, or that write is queued. Nothing where they are not in the vocabulary slot.
  enum class VocabUnit { lm_head, embedding };
  void vocab(VocabUnit unit, bool begin);
  // After each training micro-batch's backward (or in its place). What a skipped backward did not
  // write is summed as zeros, in its order (the lm_head, the layers, the embedding), each layer
  // between around(l, true) and around(l, false) as a backward calls the hooks of everything else
  // that runs by layer (sharded weights), so that every rank posts the same exchanges in the
  // same order.
  void micro_batch_done(const std::function<void(int layer, bool begin)>& around = {});
  // After the step's last micro-batch: sums the other tensors and orders the backend's later
  // work (the optimizer) after every exchange of the step.
  void step_done();

 private:
  Tensor slot_view(int l) const;
  // Where layout element o lives in the local buffer: the layers by their slots, the vocabulary
  // units by theirs, the other tensors in layout order.
  int64_t local(int64_t o) const;
  Tensor vocab_view(VocabUnit unit) const;

  Backend* be_ = nullptr;
  Communicator* comm_ = nullptr;
  std::unique_ptr<ModelWeights> layout_, grads_;
  int64_t n_ = 0;
  std::unique_ptr<LayerSlots> slots_;
  std::vector<bool> summed_;  // by layer, in the current micro-batch
  // The vocabulary units, by VocabUnit: their elements [begin, begin + length) of the layout
  // (length rounded up to the arena's alignment; 0: not in the slot), and the slot's start in the
  // local buffer.
  struct Unit {
    int64_t begin = 0, length = 0;
    bool summed = false;  // in the current micro-batch
  };
  Unit units_[2];
  int64_t vocab_local_ = 0;
  int micro_batches_ = 0;  // of this step, done
  std::unique_ptr<ShardSum> sum_;
  int64_t span_begin_ = 0, span_end_ = 0;
  int first_layer_ = 0, end_layer_ = 0;
  // Sums layout elements [begin, end) of the local buffer's `at`, clamped to the span.
  void add_clamped(float* at, int64_t begin, int64_t end, bool accumulate);
};

}  // namespace iris
