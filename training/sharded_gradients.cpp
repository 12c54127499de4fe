#include "training/sharded_gradients.h"

#include "core/error.h"

namespace iris {

ShardedGradients::ShardedGradients(Backend& be, const ModelConfig& cfg, const ParamSpecs& specs)
    : be_(&be) {
  layout_ = reserve_weights(be.device(), cfg, DType::f32, specs.trainable_filter());
  n_ = static_cast<int64_t>(layout_->arena.capacity() / sizeof(float));
  slots_ = std::make_unique<LayerSlots>(*layout_, cfg.text.num_hidden_layers, sizeof(float));
  summed_.assign(static_cast<size_t>(slots_->layers()), false);
  const int64_t local = slots_->local_elements();
  grads_ = allocate_weights_placed(
      be, cfg, DType::f32, specs.trainable_filter(), static_cast<size_t>(local) * sizeof(float),
      [this](size_t offset) {
        return static_cast<size_t>(slots_->local(static_cast<int64_t>(offset / sizeof(float)))) *
               sizeof(float);
      });
  if (grads_->arena.capacity() > 0)
    be.fill_zero(Tensor(grads_->arena.base(), DType::f32, be.device(), {local}));
}

void ShardedGradients::connect(Backend& be, Communicator& comm, int64_t bucket_elements) {
  comm_ = &comm;
  sum_ = std::make_unique<ShardSum>(be, comm, n_, bucket_elements);
}

Tensor ShardedGradients::slot_view(int l) const {
  const LayerSlots::Range& r = slots_->layer(l);
  return Tensor(static_cast<float*>(grads_->arena.base()) + slots_->slot_begin(l), DType::f32,
                be_->device(), {r.end - r.begin});
}

void ShardedGradients::layer(int l, bool begin) {
  IRIS_CHECK(comm_ != nullptr, "sharded gradients: connect() before the first step");
  IRIS_CHECK(l >= 0 && l < slots_->layers(), "sharded gradients: layer ", l);
  if (!slots_->holds(l)) return;
  const int slot = l % LayerSlots::kSlots;
  if (begin) {
    comm_->wait_point(slot);
    be_->fill_zero(slot_view(l));
    return;
  }
  comm_->begin_detached();
  sum_->add(slot_view(l), slots_->layer(l).begin, micro_batches_ > 0);
  comm_->mark_point(slot);
  summed_[static_cast<size_t>(l)] = true;
}

void ShardedGradients::micro_batch_done(const std::function<void(int layer, bool begin)>& around) {
  for (int l = slots_->layers() - 1; l >= 0; --l) {
    if (!slots_->holds(l) || summed_[static_cast<size_t>(l)]) continue;
    layer(l, true);
    if (around) around(l, true);
    layer(l, false);
    if (around) around(l, false);
  }
  summed_.assign(summed_.size(), false);
  ++micro_batches_;
}

void ShardedGradients::step_done() {
  IRIS_CHECK(comm_ != nullptr, "sharded gradients: connect() before the first step");
  comm_->begin_detached();
  const float* base = static_cast<const float*>(grads_->arena.base());
  auto others = [&](int64_t layout_begin, int64_t layout_end) {
    if (layout_end > layout_begin)
      sum_->add(Tensor(const_cast<float*>(base) + slots_->local(layout_begin), DType::f32,
                       be_->device(), {layout_end - layout_begin}),
                layout_begin, false);
  };
  others(0, slots_->block_begin());
  others(slots_->block_end(), n_);
  comm_->end_detached();
  micro_batches_ = 0;
}

}  // namespace iris
