#include "training/sharded_gradients.h"

#include <algorithm>
#include <limits>
#include <string>

#include "core/error.h"
#include "training/train_model.h"

namespace iris {

namespace {

constexpr int kSlots = 2;

int64_t elements_at(const ModelWeights& w, const Tensor& t) {
  return (static_cast<const char*>(t.data) - static_cast<const char*>(w.arena.base())) /
         static_cast<int64_t>(sizeof(float));
}

}  // namespace

ShardedGradients::ShardedGradients(Backend& be, const ModelConfig& cfg, const ParamSpecs& specs)
    : be_(&be) {
  layout_ = reserve_weights(be.device(), cfg, DType::f32, specs.trainable_filter());
  n_ = static_cast<int64_t>(layout_->arena.capacity() / sizeof(float));
  const int n_layers = cfg.text.num_hidden_layers;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  std::vector<std::pair<int64_t, int64_t>> spans(static_cast<size_t>(n_layers), {kMax, 0});
  for (const WeightBinding& b : layout_->bindings) {
    if (!b.allocated()) continue;
    const Tensor t = *b.target;
    const int64_t at = elements_at(*layout_, t), end = at + t.numel();
    const int l = decoder_layer(b.hf_name);
    if (l < 0) continue;
    IRIS_CHECK(l < n_layers, "sharded gradients: '", b.hf_name, "' names a layer past ", n_layers);
    auto& s = spans[static_cast<size_t>(l)];
    s = {std::min(s.first, at), std::max(s.second, end)};
  }
  // Each layer's range runs to the next one's start (alignment padding included), and the layers
  // with gradients must be one block in layer order that no other tensor enters.
  layers_.assign(static_cast<size_t>(n_layers), {});
  int64_t prev_end = -1;
  int first = -1, last = -1;
  for (int l = 0; l < n_layers; ++l) {
    const auto& s = spans[static_cast<size_t>(l)];
    if (s.first == kMax) continue;
    IRIS_CHECK(prev_end < 0 || s.first >= prev_end, "sharded gradients: decoder layer ", l,
               "'s tensors are not laid out after layer ", last, "'s");
    if (first < 0) first = l;
    if (last >= 0) layers_[static_cast<size_t>(last)].end = s.first;
    layers_[static_cast<size_t>(l)] = {s.first, s.second, false};
    prev_end = s.second;
    last = l;
  }
  if (first >= 0) {
    constexpr int64_t kAlign = Arena::kAlignment / sizeof(float);
    Layer& tail = layers_[static_cast<size_t>(last)];
    tail.end = std::min(n_, (tail.end + kAlign - 1) / kAlign * kAlign);
    layers_begin_ = layers_[static_cast<size_t>(first)].begin;
    layers_end_ = tail.end;
    for (const Layer& L : layers_) slot_ = std::max(slot_, L.end - L.begin);
    // Contiguity: the gaps between layers hold no tensor of another layer or part.
    for (const WeightBinding& b : layout_->bindings) {
      if (!b.allocated() || decoder_layer(b.hf_name) >= 0) continue;
      const int64_t at = elements_at(*layout_, *b.target);
      IRIS_CHECK(at + b.target->numel() <= layers_begin_ || at >= layers_end_,
                 "sharded gradients: '", b.hf_name, "' lies among the decoder layers' tensors");
    }
  }
  std::vector<std::pair<int64_t, int>> starts;  // (begin, layer), ascending
  for (int l = 0; l < n_layers; ++l)
    if (layers_[static_cast<size_t>(l)].end > layers_[static_cast<size_t>(l)].begin)
      starts.push_back({layers_[static_cast<size_t>(l)].begin, l});
  const int64_t local = layers_begin_ + kSlots * slot_ + (n_ - layers_end_);
  grads_ = allocate_weights_placed(
      be, cfg, DType::f32, specs.trainable_filter(), static_cast<size_t>(local) * sizeof(float),
      [this, &starts](size_t offset) {
        const auto o = static_cast<int64_t>(offset / sizeof(float));
        int64_t at = o;
        if (o >= layers_end_) {
          at = layers_begin_ + kSlots * slot_ + (o - layers_end_);
        } else if (o >= layers_begin_) {
          // The last layer with gradients that starts at or before o.
          const auto it = std::upper_bound(
              starts.begin(), starts.end(), o,
              [](int64_t x, const std::pair<int64_t, int>& s) { return x < s.first; });
          IRIS_CHECK(it != starts.begin(), "sharded gradients: element ", o,
                     " is in no decoder layer");
          const auto [layer_begin, l] = *(it - 1);
          at = layers_begin_ + (l % kSlots) * slot_ + (o - layer_begin);
        }
        return static_cast<size_t>(at) * sizeof(float);
      });
  if (grads_->arena.capacity() > 0)
    be.fill_zero(Tensor(grads_->arena.base(), DType::f32, be.device(), {local}));
}

void ShardedGradients::connect(Backend& be, Communicator& comm, int64_t bucket_elements) {
  comm_ = &comm;
  sum_ = std::make_unique<ShardSum>(be, comm, n_, bucket_elements);
}

Tensor ShardedGradients::slot_view(int l) const {
  const Layer& L = layers_[static_cast<size_t>(l)];
  return Tensor(static_cast<float*>(grads_->arena.base()) + layers_begin_ + (l % kSlots) * slot_,
                DType::f32, be_->device(), {L.end - L.begin});
}

void ShardedGradients::layer(int l, bool begin) {
  IRIS_CHECK(comm_ != nullptr, "sharded gradients: connect() before the first step");
  IRIS_CHECK(l >= 0 && l < static_cast<int>(layers_.size()), "sharded gradients: layer ", l);
  Layer& L = layers_[static_cast<size_t>(l)];
  if (L.end == L.begin) return;
  if (begin) {
    comm_->wait_point(l % kSlots);
    be_->fill_zero(slot_view(l));
    return;
  }
  comm_->begin_detached();
  sum_->add(slot_view(l), L.begin, micro_batches_ > 0);
  comm_->mark_point(l % kSlots);
  L.summed = true;
}

void ShardedGradients::micro_batch_done() {
  // The layers a skipped backward did not reach, in the backward's order, as zeros.
  for (int l = static_cast<int>(layers_.size()) - 1; l >= 0; --l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    if (L.end == L.begin || L.summed) continue;
    layer(l, true);
    layer(l, false);
  }
  for (Layer& L : layers_) L.summed = false;
  ++micro_batches_;
}

void ShardedGradients::step_done() {
  IRIS_CHECK(comm_ != nullptr, "sharded gradients: connect() before the first step");
  comm_->begin_detached();
  const float* base = static_cast<const float*>(grads_->arena.base());
  auto others = [&](int64_t layout_begin, int64_t layout_end, int64_t local_begin) {
    if (layout_end > layout_begin)
      sum_->add(Tensor(const_cast<float*>(base) + local_begin, DType::f32, be_->device(),
                       {layout_end - layout_begin}),
                layout_begin, false);
  };
  others(0, layers_begin_, 0);
  others(layers_end_, n_, layers_begin_ + kSlots * slot_);
  comm_->end_detached();
  micro_batches_ = 0;
}

}  // namespace iris
