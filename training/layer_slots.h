// The decoder layers of a flat weight layout taking turns in two slots, which gradient and weight
// sharding both hold instead of every layer (training/sharded_gradients.h,
// training/sharded_weights.h).
//
// In the layouts of bridge/hf_weights.h the decoder layers' tensors form one block in layer
// order, between the tensors that come before them (the vision tower, the embedding) and after
// them (the final norm, the lm_head). A local buffer holds the tensors before the block, two
// slots as long as the longest layer, and the tensors after it: layer l's tensors lie in slot
// l % 2 at their offsets within the layer. The backward runs layer l + 1 before layer l and the
// forward layer l - 1 before layer l, so while one slot is in use the other is being filled or
// emptied.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "bridge/hf_weights.h"

namespace iris {

class LayerSlots {
 public:
  static constexpr int kSlots = 2;

  // layout: a layout of `element_bytes`-byte elements (its arena's base is offset 0); n_layers:
  // the config's decoder layers. Fails where another tensor lies among the layers' tensors.
  LayerSlots(const ModelWeights& layout, int n_layers, size_t element_bytes);

  // Layer l's elements [begin, end) of the layout, to the next layer's first (alignment gaps
  // included); begin == end: the layout holds no tensor of it.
  struct Range {
    int64_t begin = 0, end = 0;
  };
  const Range& layer(int l) const { return layers_[static_cast<size_t>(l)]; }
  bool holds(int l) const { return layer(l).end > layer(l).begin; }
  int layers() const { return static_cast<int>(layers_.size()); }

  // Elements of the layout, and the layers' block [block_begin(), block_end()) of it.
  int64_t elements() const { return n_; }
  int64_t block_begin() const { return begin_; }
  int64_t block_end() const { return end_; }
  // Elements of the local buffer: before the block, two slots, after the block.
  int64_t local_elements() const { return begin_ + kSlots * slot_ + (n_ - end_); }
  // Where layout element o lives in the local buffer.
  int64_t local(int64_t o) const;
  // Where layer l's first element lives in the local buffer (its slot's start).
  int64_t slot_begin(int l) const { return begin_ + (l % kSlots) * slot_; }

 private:
  std::vector<Range> layers_;
  int64_t n_ = 0, begin_ = 0, end_ = 0, slot_ = 0;
  std::vector<std::pair<int64_t, int>> starts_;  // (begin, layer) of the layers that hold tensors
};

}  // namespace iris
