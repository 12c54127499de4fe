#include "training/layer_slots.h"

#include <algorithm>
#include <limits>

#include "core/error.h"
#include "training/train_model.h"

namespace iris {

LayerSlots::LayerSlots(const ModelWeights& layout, int n_layers, size_t element_bytes) {
  n_ = static_cast<int64_t>(layout.arena.capacity() / element_bytes);
  auto elements_at = [&](const Tensor& t) {
    return (static_cast<const char*>(t.data) - static_cast<const char*>(layout.arena.base())) /
           static_cast<int64_t>(element_bytes);
  };
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  std::vector<std::pair<int64_t, int64_t>> spans(static_cast<size_t>(n_layers), {kMax, 0});
  for (const WeightBinding& b : layout.bindings) {
    if (!b.allocated()) continue;
    const int l = decoder_layer(b.hf_name);
    if (l < 0) continue;
    IRIS_CHECK(l < n_layers, "layer slots: '", b.hf_name, "' names a layer past ", n_layers);
    const Tensor t = *b.target;
    const int64_t at = elements_at(t);
    auto& s = spans[static_cast<size_t>(l)];
    s = {std::min(s.first, at), std::max(s.second, at + t.numel())};
  }
  // Each layer's range runs to the next one's start (alignment padding included), and the layers
  // with tensors must be one block in layer order that no other tensor enters.
  layers_.assign(static_cast<size_t>(n_layers), {});
  int64_t prev_end = -1;
  int first = -1, last = -1;
  for (int l = 0; l < n_layers; ++l) {
    const auto& s = spans[static_cast<size_t>(l)];
    if (s.first == kMax) continue;
    IRIS_CHECK(prev_end < 0 || s.first >= prev_end, "layer slots: decoder layer ", l,
               "'s tensors are not laid out after layer ", last, "'s");
    if (first < 0) first = l;
    if (last >= 0) layers_[static_cast<size_t>(last)].end = s.first;
    layers_[static_cast<size_t>(l)] = {s.first, s.second};
    prev_end = s.second;
    last = l;
  }
  if (first < 0) return;
  const auto align = static_cast<int64_t>(Arena::kAlignment / element_bytes);
  Range& tail = layers_[static_cast<size_t>(last)];
  tail.end = std::min(n_, (tail.end + align - 1) / align * align);
  begin_ = layers_[static_cast<size_t>(first)].begin;
  end_ = tail.end;
  for (const Range& r : layers_) slot_ = std::max(slot_, r.end - r.begin);
  for (const WeightBinding& b : layout.bindings) {
    if (!b.allocated() || decoder_layer(b.hf_name) >= 0) continue;
    const int64_t at = elements_at(*b.target);
    IRIS_CHECK(at + b.target->numel() <= begin_ || at >= end_, "layer slots: '", b.hf_name,
               "' lies among the decoder layers' tensors");
  }
  for (int l = 0; l < n_layers; ++l)
    if (holds(l)) starts_.push_back({layer(l).begin, l});
}

int64_t LayerSlots::local(int64_t o) const {
  if (o < begin_) return o;
  if (o >= end_) return begin_ + kSlots * slot_ + (o - end_);
  // The last layer with tensors that starts at or before o.
  const auto it =
      std::upper_bound(starts_.begin(), starts_.end(), o,
                       [](int64_t x, const std::pair<int64_t, int>& s) { return x < s.first; });
  IRIS_CHECK(it != starts_.begin(), "layer slots: element ", o, " is in no decoder layer");
  const auto [layer_begin, l] = *(it - 1);
  return slot_begin(l) + (o - layer_begin);
}

}  // namespace iris
