#include "training/sharded_gradients.h"

#include <algorithm>
#include <utility>

#include "core/error.h"

namespace iris {

namespace {

constexpr int64_t kAlign = static_cast<int64_t>(Arena::kAlignment / sizeof(float));
int64_t aligned(int64_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}
// The communicator's points 0 and 1 are the layer slots', 2 and 3 the weight slots'
// (training/sharded_weights.cpp).
constexpr int kVocabPoint = 4;
static_assert(kVocabPoint < Communicator::kPoints);

}  // namespace

ShardedGradients::ShardedGradients(Backend& be, const ModelConfig& cfg, const ParamSpecs& specs)
    : be_(&be) {
  layout_ = reserve_weights(be.device(), cfg, DType::f32, specs.trainable_filter());
  n_ = static_cast<int64_t>(layout_->arena.capacity() / sizeof(float));
  slots_ = std::make_unique<LayerSlots>(*layout_, cfg.text.num_hidden_layers, sizeof(float));
  summed_.assign(static_cast<size_t>(slots_->layers()), false);
  // An untied embedding and lm_head, both trained: the embedding lies before the layers' block
  // and the lm_head after it (training/layer_slots.h), each starting on the arena's alignment.
  const Tensor& embed = layout_->text.embed;
  const Tensor& head = layout_->text.lm_head;
  if (embed.defined() && head.defined() && embed.data != head.data) {
    auto at = [&](const Tensor& t) {
      return (static_cast<const char*>(t.data) - static_cast<const char*>(layout_->arena.base())) /
             static_cast<int64_t>(sizeof(float));
    };
    // With the alignment gap after each, as a layer's range has (a zero sum).
    auto unit = [&](const Tensor& t) {
      return Unit{at(t), std::min(aligned(t.numel()), n_ - at(t))};
    };
    units_[int(VocabUnit::embedding)] = unit(embed);
    units_[int(VocabUnit::lm_head)] = unit(head);
    IRIS_CHECK(units_[int(VocabUnit::embedding)].begin + units_[int(VocabUnit::embedding)].length <=
                       slots_->block_begin() &&
                   units_[int(VocabUnit::lm_head)].begin >= slots_->block_end(),
               "sharded gradients: the embedding must lie before the decoder layers and the "
               "lm_head after them");
  }
  const int64_t removed =
      units_[int(VocabUnit::embedding)].length + units_[int(VocabUnit::lm_head)].length;
  vocab_local_ = aligned(slots_->local_elements() - removed);
  const int64_t local_elements = vocab_local_ + std::max(units_[int(VocabUnit::embedding)].length,
                                                         units_[int(VocabUnit::lm_head)].length);
  grads_ = allocate_weights_placed(
      be, cfg, DType::f32, specs.trainable_filter(),
      static_cast<size_t>(local_elements) * sizeof(float), [this](size_t offset) {
        return static_cast<size_t>(local(static_cast<int64_t>(offset / sizeof(float)))) *
               sizeof(float);
      });
  if (grads_->arena.capacity() > 0)
    be.fill_zero(Tensor(grads_->arena.base(), DType::f32, be.device(), {local_elements}));
}

int64_t ShardedGradients::local(int64_t o) const {
  const Unit& e = units_[int(VocabUnit::embedding)];
  const Unit& h = units_[int(VocabUnit::lm_head)];
  if (e.length > 0 && o >= e.begin && o < e.begin + e.length) return vocab_local_ + (o - e.begin);
  if (h.length > 0 && o >= h.begin && o < h.begin + h.length) return vocab_local_ + (o - h.begin);
  // The other tensors close up over the units' ranges.
  int64_t shift = 0;
  if (e.length > 0 && o >= e.begin + e.length) shift += e.length;
  if (h.length > 0 && o >= h.begin + h.length) shift += h.length;
  return slots_->local(o) - shift;
}

Tensor ShardedGradients::vocab_view(VocabUnit unit) const {
  return Tensor(static_cast<float*>(grads_->arena.base()) + vocab_local_, DType::f32, be_->device(),
                {units_[int(unit)].length});
}

void ShardedGradients::connect(Backend& be, Communicator& comm, int64_t bucket_elements,
                               std::pair<int64_t, int64_t> span, std::pair<int, int> layers) {
  comm_ = &comm;
  span_begin_ = span.first;
  span_end_ = span.second < 0 ? n_ : span.second;
  first_layer_ = layers.first;
  end_layer_ = layers.second < 0 ? slots_->layers() : layers.second;
  IRIS_CHECK(0 <= span_begin_ && span_begin_ <= span_end_ && span_end_ <= n_ && 0 <= first_layer_ &&
                 first_layer_ <= end_layer_ && end_layer_ <= slots_->layers(),
             "sharded gradients: span [", span_begin_, ", ", span_end_, ") and layers [",
             first_layer_, ", ", end_layer_, ") outside the layout's ", n_, " and ",
             slots_->layers());
  sum_ =
      std::make_unique<ShardSum>(be, comm, span_begin_, span_end_ - span_begin_, bucket_elements);
}

void ShardedGradients::add_clamped(float* at, int64_t begin, int64_t end, bool accumulate) {
  // A stage's last layer, or a unit, runs to the next tensor's start, which may lie past the span.
  const int64_t b = std::max(begin, span_begin_), e = std::min(end, span_end_);
  if (b < e) sum_->add(Tensor(at + (b - begin), DType::f32, be_->device(), {e - b}), b, accumulate);
}

Tensor ShardedGradients::slot_view(int l) const {
  const LayerSlots::Range& r = slots_->layer(l);
  return Tensor(static_cast<float*>(grads_->arena.base()) + local(r.begin), DType::f32,
                be_->device(), {r.end - r.begin});
}

void ShardedGradients::vocab(VocabUnit unit, bool begin) {
  IRIS_CHECK(comm_ != nullptr, "sharded gradients: connect() before the first step");
  Unit& u = units_[int(unit)];
  // Not in the slot, or (a pipeline stage) not this stage's.
  if (u.length == 0 || u.begin + u.length <= span_begin_ || u.begin >= span_end_) return;
  if (begin) {
    comm_->wait_point(kVocabPoint);
    be_->fill_zero(vocab_view(unit));
    return;
  }
  comm_->begin_detached();
  add_clamped(static_cast<float*>(vocab_view(unit).data), u.begin, u.begin + u.length,
              micro_batches_ > 0);
  comm_->mark_point(kVocabPoint);
  u.summed = true;
}

void ShardedGradients::layer(int l, bool begin) {
  IRIS_CHECK(comm_ != nullptr, "sharded gradients: connect() before the first step");
  IRIS_CHECK(l >= first_layer_ && l < end_layer_, "sharded gradients: layer ", l,
             " is not one of this stage's [", first_layer_, ", ", end_layer_, ")");
  if (!slots_->holds(l)) return;
  const int slot = l % LayerSlots::kSlots;
  if (begin) {
    comm_->wait_point(slot);
    be_->fill_zero(slot_view(l));
    return;
  }
  comm_->begin_detached();
  add_clamped(static_cast<float*>(slot_view(l).data), slots_->layer(l).begin, slots_->layer(l).end,
              micro_batches_ > 0);
  comm_->mark_point(slot);
  summed_[static_cast<size_t>(l)] = true;
}

void ShardedGradients::micro_batch_done(const std::function<void(int layer, bool begin)>& around) {
  auto zeros_of = [this](VocabUnit unit) {
    if (units_[int(unit)].summed) return;
    vocab(unit, true);
    vocab(unit, false);
  };
  zeros_of(VocabUnit::lm_head);
  for (int l = end_layer_ - 1; l >= first_layer_; --l) {
    if (!slots_->holds(l) || summed_[static_cast<size_t>(l)]) continue;
    layer(l, true);
    if (around) around(l, true);
    layer(l, false);
    if (around) around(l, false);
  }
  zeros_of(VocabUnit::embedding);
  summed_.assign(summed_.size(), false);
  for (Unit& u : units_) u.summed = false;
  ++micro_batches_;
}

void ShardedGradients::step_done() {
  IRIS_CHECK(comm_ != nullptr, "sharded gradients: connect() before the first step");
  comm_->begin_detached();
  const float* base = static_cast<const float*>(grads_->arena.base());
  auto others = [&](int64_t layout_begin, int64_t layout_end) {
    // The stage's part of the range, which local() keeps contiguous.
    const int64_t b = std::max(layout_begin, span_begin_), e = std::min(layout_end, span_end_);
    if (b < e) add_clamped(const_cast<float*>(base) + local(b), b, e, false);
  };
  // Everything outside the layers' block and the vocabulary units, in layout order.
  std::vector<std::pair<int64_t, int64_t>> skip{{slots_->block_begin(), slots_->block_end()}};
  for (const Unit& u : units_)
    if (u.length > 0) skip.push_back({u.begin, u.begin + u.length});
  std::sort(skip.begin(), skip.end());
  int64_t at = 0;
  for (const auto& [b, e] : skip) {
    others(at, b);
    at = e;
  }
  others(at, n_);
  comm_->end_detached();
  micro_batches_ = 0;
}

}  // namespace iris
