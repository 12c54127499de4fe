// parallel.sharding=optimizer_grads_params (ZeRO-3, FSDP): the weights the model reads are
// sharded too. The decoder layers' weights live whole only in two slots (training/layer_slots.h:
// layer l in slot l % 2), each rank keeps its shard of them (as the optimizer's f32 master
// weights, below), and a layer is gathered from every rank's shard into its slot before its
// forward and again before its backward, one layer ahead of the compute on the communicator's
// stream. A pipeline stage gathers its own layers only (stage_layers). The tensors outside the
// layers (the vision tower, the mergers, the embedding, the final norm, the lm_head) stay whole on
// every rank, as they are with parallel.sharding=optimizer: they are units of other sizes, used
// once per micro-batch at its two ends, and for Qwen3-VL-8B the layers are 80% of the weights.
//
// Why slots at fixed addresses (Megatron-FSDP's double buffers, Megatron-LM PR #4232): a layer's
// graphs, forward and backward, are captured against its slot, and the gathers run between the
// graphs, outside them, joined to them by events (Communicator::mark_point / wait_point): so
// per-layer graphs keep working, and the gathers overlap the previous layer's compute. A
// full_iteration graph would hold the collectives inside it; it is refused with this sharding.
//
// The shards are the optimizer's: rank r's update owns one range of the whole layout (layout(),
// addresses only). Of that range, the part outside the layers' block is written into the weights
// the model reads, which are gathered whole after every update as the sharded optimizer gathers
// them. The part inside the layers' block has no compute-dtype copy at all: a gather rounds the
// owner's f32 master weights into the slot and sends them from there (FSDP2's sharded f32
// parameters cast before the all-gather), which saves a bf16 shard, 2 B per layer parameter
// over N, on every rank (6.6 GiB for Qwen3-VL-8B on 2 GPUs). The rounding is the one the
// update's own write of a working copy makes, so a gathered layer holds the bits an unsharded
// update would have written: a run gives the losses and gradients of
// parallel.sharding=optimizer_grads bit for bit.
//
// Every rank must run the same hooks in the same order (the gathers are exchanges): forwards
// and backwards are the same on every rank, and a training micro-batch whose backward did not run
// gathers what its backward would have (ShardedGradients::micro_batch_done's `around`).
// Frozen decoder-layer weights have no owner in the optimizer's layout: a recipe that freezes
// the language model or trains adapters (LoRA) is refused with this sharding.
#pragma once

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "core/arena.h"
#include "parallel/communicator.h"
#include "training/layer_slots.h"
#include "training/param_spec.h"

namespace iris {

class ShardedWeights {
 public:
  // The weights of `specs` in `be`'s compute dtype, laid out as above. Fails where a decoder
  // layer's tensor is frozen.
  ShardedWeights(Backend& be, const ModelConfig& cfg, const ParamSpecs& specs);

  // What the models read (the layers' tensors share the slots).
  ModelWeights& weights() { return *weights_; }
  // The whole layout the optimizer's working ranges refer to (addresses only, no memory).
  ModelWeights& layout() { return *layout_; }
  // Bytes the weights take on this rank: the whole tensors and the two slots.
  size_t local_bytes() const { return weights_->arena.capacity(); }

  // A pipeline stage computes layers [first, end) only: no other layer is gathered (before
  // connect(); by default every layer).
  void stage_layers(int first, int end);
  // From the optimizer, once it has sharded its state (before the first step): rank r's update
  // writes the working copy of elements ranges[r] of layout(); the ranges tile it in rank order.
  void connect(Communicator& comm, std::vector<std::pair<int64_t, int64_t>> ranges);
  // Where the update writes layout element o of this rank's range: at element `offset` of
  // whole_weights(), or (in_layers) nowhere, the gathers reading the master weights instead.
  struct Place {
    bool in_layers = false;
    int64_t offset = 0;
  };
  Place place(int64_t o) const;
  // The weights the model reads, flat.
  Tensor whole_weights() const;
  // From the optimizer, after connect(): where this rank's master weights of the layers are,
  // each piece the f32 values of layout elements [layout_begin, layout_begin + numel).
  struct MasterPiece {
    int64_t layout_begin = 0;
    Tensor master;
  };
  void connect_master(std::vector<MasterPiece> pieces);
  // The whole tensors from `source` (f32 on the host, the whole model's bindings).
  void fill_whole(const ModelWeights& source);

  // The model's hook (TrainableQwen3VL::on_layer): layer l's forward or backward begins (its
  // weights must be in its slot) or has been queued.
  void layer(int l, bool backward, bool begin);
  // After the optimizer's update: gathers the whole tensors from their owners; the slots' layers
  // are stale.
  void step_done();

 private:
  // Layer l into its slot: this rank's piece rounded from its master weights, every other
  // rank's received, detached.
  void gather(int l);
  // Layer l is in its slot (gathered now if not), and the backend's later work waits for it.
  void ensure(int l);
  // Layer l's gather started where its slot is free and it is not there yet.
  void prefetch(int l);

  Backend* be_ = nullptr;
  Communicator* comm_ = nullptr;
  DType dtype_;
  std::unique_ptr<ModelWeights> layout_, weights_;
  std::unique_ptr<LayerSlots> slots_;
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // by rank, of the layout
  // This rank's shard: elements [shard_begin_, shard_end_) of the layout, inside the layers'.
  int64_t shard_begin_ = 0, shard_end_ = 0;
  std::vector<MasterPiece> master_;  // in layout order
  int in_slot_[LayerSlots::kSlots] = {-1, -1};
  int first_layer_ = 0, end_layer_ = 0;  // this stage's
  bool computes(int l) const { return l >= first_layer_ && l < end_layer_ && slots_->holds(l); }
  // The whole tensors' gather after an update: this rank's pieces to every other rank, theirs in.
  std::vector<Communicator::Transfer> whole_sends_, whole_recvs_;
  std::vector<Communicator::Transfer> sends_, recvs_;
};

}  // namespace iris
