#include "training/sharded_weights.h"

#include <algorithm>
#include <tuple>

#include "core/error.h"
#include "training/train_model.h"

namespace iris {

namespace {

// The communicator's points 0 and 1 are the gradient slots' (training/sharded_gradients.cpp).
constexpr int kFirstPoint = 2;
static_assert(kFirstPoint + LayerSlots::kSlots <= Communicator::kPoints);

auto keep_all() {
  return [](const std::string&) { return true; };
}

}  // namespace

ShardedWeights::ShardedWeights(Backend& be, const ModelConfig& cfg, const ParamSpecs& specs)
    : be_(&be), dtype_(be.compute_dtype()) {
  for (const ParamSpec& p : specs.all())
    IRIS_CHECK(p.trainable || decoder_layer(p.hf_name) < 0, "parallel.sharding=",
               "optimizer_grads_params shards the decoder layers' trainable weights, but '",
               p.hf_name,
               "' is frozen (train.freeze_language_model or peft.type=lora): use "
               "parallel.sharding=optimizer_grads");
  const size_t element = dtype_size(dtype_);
  layout_ = reserve_weights(be.device(), cfg, dtype_, keep_all());
  slots_ = std::make_unique<LayerSlots>(*layout_, cfg.text.num_hidden_layers, element);
  end_layer_ = slots_->layers();
  weights_ = allocate_weights_placed(
      be, cfg, dtype_, keep_all(), static_cast<size_t>(slots_->local_elements()) * element,
      [this, element](size_t offset) {
        return static_cast<size_t>(slots_->local(static_cast<int64_t>(offset / element))) * element;
      });
}

void ShardedWeights::stage_layers(int first, int end) {
  IRIS_CHECK(comm_ == nullptr && 0 <= first && first <= end && end <= slots_->layers(),
             "sharded weights: stage layers [", first, ", ", end, ") before connect(), of ",
             slots_->layers());
  first_layer_ = first;
  end_layer_ = end;
}

void ShardedWeights::connect(Communicator& comm, std::vector<std::pair<int64_t, int64_t>> ranges) {
  IRIS_CHECK(comm.device() == be_->device() && static_cast<int>(ranges.size()) == comm.size(),
             "sharded weights: one working range per rank of the communicator, on its device");
  comm_ = &comm;
  ranges_ = std::move(ranges);
  const int me = comm.rank();
  const int64_t lb = slots_->block_begin(), le = slots_->block_end();
  auto shard_of = [&](int q) {
    const int64_t b = std::clamp(ranges_[static_cast<size_t>(q)].first, lb, le);
    return std::pair{b, std::clamp(ranges_[static_cast<size_t>(q)].second, b, le)};
  };
  std::tie(shard_begin_, shard_end_) = shard_of(me);
  // The whole tensors' pieces of every rank's range, before the layers and after them, in the
  // weights the model reads.
  const Tensor flat = whole_weights();
  auto pieces = [&](int q, std::vector<Communicator::Transfer>& out) {
    const auto [b, e] = ranges_[static_cast<size_t>(q)];
    for (const auto& [lo, hi] : {std::pair{int64_t{0}, lb}, std::pair{le, slots_->elements()}}) {
      const int64_t p0 = std::max(b, lo), p1 = std::min(e, hi);
      if (p0 < p1) out.push_back({flat.slice(slots_->local(p0), slots_->local(p0) + p1 - p0), q});
    }
  };
  for (int q = 0; q < comm.size(); ++q) {
    if (q == me) continue;
    std::vector<Communicator::Transfer> mine;
    pieces(me, mine);
    for (Communicator::Transfer& t : mine) whole_sends_.push_back({t.t, q});
    pieces(q, whole_recvs_);
  }
}

ShardedWeights::Place ShardedWeights::place(int64_t o) const {
  IRIS_CHECK(comm_ != nullptr, "sharded weights: connect() first");
  if (o < slots_->block_begin() || o >= slots_->block_end()) return {false, slots_->local(o)};
  IRIS_CHECK(o >= shard_begin_ && o < shard_end_, "sharded weights: layout element ", o,
             " is not in this rank's shard [", shard_begin_, ", ", shard_end_, ")");
  return {true, o - shard_begin_};
}

Tensor ShardedWeights::whole_weights() const {
  return Tensor(weights_->arena.base(), dtype_, be_->device(), {slots_->local_elements()});
}

void ShardedWeights::connect_master(std::vector<MasterPiece> pieces) {
  IRIS_CHECK(comm_ != nullptr, "sharded weights: connect() before connect_master()");
  std::sort(pieces.begin(), pieces.end(), [](const MasterPiece& a, const MasterPiece& b) {
    return a.layout_begin < b.layout_begin;
  });
  for (const MasterPiece& p : pieces)
    IRIS_CHECK(p.master.dtype == DType::f32 && p.layout_begin >= shard_begin_ &&
                   p.layout_begin + p.master.numel() <= shard_end_,
               "sharded weights: a master piece [", p.layout_begin, ", ",
               p.layout_begin + p.master.numel(), ") outside this rank's shard [", shard_begin_,
               ", ", shard_end_, ")");
  master_ = std::move(pieces);
  in_slot_[0] = in_slot_[1] = -1;
}

static void check_source(const ModelWeights& source, const ModelWeights& layout) {
  IRIS_CHECK(source.bindings.size() == layout.bindings.size(), "sharded weights: the source holds ",
             source.bindings.size(), " tensors, the model ", layout.bindings.size());
  for (const WeightBinding& b : source.bindings)
    IRIS_CHECK(b.tensor().dtype == DType::f32 && b.tensor().device == Device::cpu,
               "sharded weights: '", b.hf_name, "' must be f32 on the host");
}

void ShardedWeights::fill_whole(const ModelWeights& source) {
  check_source(source, *layout_);
  for (size_t i = 0; i < source.bindings.size(); ++i)
    if (decoder_layer(source.bindings[i].hf_name) < 0)
      be_->write(weights_->bindings[i].tensor(), source.bindings[i].tensor().data, DType::f32);
}

void ShardedWeights::gather(int l) {
  const LayerSlots::Range& r = slots_->layer(l);
  const Tensor slot =
      whole_weights().slice(slots_->slot_begin(l), slots_->slot_begin(l) + r.end - r.begin);
  const int me = comm_->rank();
  sends_.clear();
  recvs_.clear();
  for (int q = 0; q < comm_->size(); ++q) {
    if (q == me) continue;
    const auto [b, e] = ranges_[static_cast<size_t>(q)];
    const int64_t p0 = std::max(b, r.begin), p1 = std::min(e, r.end);
    if (p0 < p1) recvs_.push_back({slot.slice(p0 - r.begin, p1 - r.begin), q});
  }
  // This rank's part, rounded on the backend's stream (the slot's last reader is queued before
  // it), then sent from the slot. The alignment gaps between its tensors travel unwritten; no
  // reader looks at them.
  const int64_t m0 = std::max(shard_begin_, r.begin), m1 = std::min(shard_end_, r.end);
  for (const MasterPiece& p : master_) {
    const int64_t p0 = std::max(m0, p.layout_begin);
    const int64_t p1 = std::min(m1, p.layout_begin + p.master.numel());
    if (p0 < p1)
      be_->convert(slot.slice(p0 - r.begin, p1 - r.begin),
                   p.master.slice(p0 - p.layout_begin, p1 - p.layout_begin));
  }
  if (m0 < m1)
    for (int q = 0; q < comm_->size(); ++q)
      if (q != me) sends_.push_back({slot.slice(m0 - r.begin, m1 - r.begin), q});
  comm_->begin_detached();
  comm_->exchange(sends_, recvs_, "the sharded weights' gather of a decoder layer");
  comm_->mark_point(kFirstPoint + l % LayerSlots::kSlots);
  in_slot_[l % LayerSlots::kSlots] = l;
}

void ShardedWeights::ensure(int l) {
  if (in_slot_[l % LayerSlots::kSlots] != l) gather(l);
  comm_->wait_point(kFirstPoint + l % LayerSlots::kSlots);
}

void ShardedWeights::prefetch(int l) {
  if (in_slot_[l % LayerSlots::kSlots] != l) gather(l);
}

void ShardedWeights::layer(int l, bool backward, bool begin) {
  IRIS_CHECK(comm_ != nullptr, "sharded weights: connect() before the first step");
  IRIS_CHECK(l >= first_layer_ && l < end_layer_, "sharded weights: layer ", l,
             " is not one of this stage's [", first_layer_, ", ", end_layer_, ")");
  if (!begin || !slots_->holds(l)) return;
  ensure(l);
  // The next layer goes into the other slot, whose last reader (the layer before this one) is
  // queued: the gather starts once it is done, while this layer computes.
  const int next = backward ? l - 1 : l + 1;
  if (computes(next)) {
    prefetch(next);
  } else if (!backward) {
    // The forward's last gather is waited for: an evaluation leaves nothing detached behind it
    // (a checkpoint's exchanges may follow).
    comm_->end_detached();
  }
}

void ShardedWeights::step_done() {
  IRIS_CHECK(comm_ != nullptr, "sharded weights: connect() before the first step");
  if (!whole_sends_.empty() || !whole_recvs_.empty())
    comm_->exchange(whole_sends_, whole_recvs_, "the sharded weights' gather after an update");
  in_slot_[0] = in_slot_[1] = -1;
}

}  // namespace iris
