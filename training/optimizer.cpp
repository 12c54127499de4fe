#include "training/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <tuple>

#include "core/safetensors.h"

namespace iris {
namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

void check_same_bindings(const ModelWeights& a, const ModelWeights& b, const char* what) {
  IRIS_CHECK(a.bindings.size() == b.bindings.size(), "AdamW: the ", what, " hold ",
             b.bindings.size(), " tensors but the parameters ", a.bindings.size(),
             "; build both with allocate_weights from the same config");
  for (size_t i = 0; i < a.bindings.size(); ++i) {
    IRIS_CHECK(a.bindings[i].hf_name == b.bindings[i].hf_name &&
                   a.bindings[i].hf_shape == b.bindings[i].hf_shape,
               "AdamW: ", what, " tensor ", i, " is '", b.bindings[i].hf_name, "' ",
               shape_text(b.bindings[i].hf_shape), ", the parameter is '", a.bindings[i].hf_name,
               "' ", shape_text(a.bindings[i].hf_shape));
    IRIS_CHECK(a.bindings[i].allocated() == b.bindings[i].allocated(), "AdamW: the ", what,
               " hold '", b.bindings[i].hf_name, "' ",
               b.bindings[i].allocated() ? "but the master weights do not"
                                         : "only where the master weights do not",
               "; allocate both for the same trainable parameters (training/param_spec.h)");
    if (!a.bindings[i].allocated()) continue;
    IRIS_CHECK(
        a.bindings[i].tensor().dtype == DType::f32 && b.bindings[i].tensor().dtype == DType::f32,
        "AdamW: '", a.bindings[i].hf_name, "' must be f32 (master weights)");
  }
}

// The model parts none of whose tensors the master weights hold (frozen for the whole run): a
// state file names them, so that a resume that unfreezes one knows why its moments are absent.
std::string stateless_parts(const ModelWeights& master) {
  bool held[3] = {false, false, false};
  for (const WeightBinding& b : master.bindings)
    if (b.allocated()) held[static_cast<int>(model_part(b.hf_name))] = true;
  std::string parts;
  const char* names[3] = {"vision_tower", "merger", "language_model"};
  for (int p = 0; p < 3; ++p)
    if (!held[p]) parts += str_cat(parts.empty() ? "" : ",", names[p]);
  return parts;
}

std::string part_name(ModelPart p) {
  switch (p) {
    case ModelPart::vision_tower:
      return "vision_tower";
    case ModelPart::merger:
      return "merger";
    case ModelPart::language_model:
      return "language_model";
  }
  return "";
}

}  // namespace

int StageTensors::owner(size_t tensor) const {
  for (size_t s = 0; s < held.size(); ++s)
    if (held[s][tensor]) return static_cast<int>(s);
  IRIS_FAIL("no pipeline stage holds tensor ", tensor);
}

double grad_norm(const ModelWeights& grads, const FreezeSpec& frozen) {
  double ss = 0.0;
  for (const WeightBinding& b : grads.bindings) {
    if (frozen.frozen(b.hf_name) || !b.allocated()) continue;
    const Tensor g = b.tensor();
    IRIS_CHECK(g.device == Device::cpu, "grad_norm reads CPU gradients");
    const float* p = g.as<float>();
    for (int64_t i = 0, n = g.numel(); i < n; ++i) ss += double(p[i]) * double(p[i]);
  }
  return std::sqrt(ss);
}

namespace {

// Element offset of a tensor inside its weights' arena.
int64_t offset_in(const ModelWeights& w, const Tensor& t) {
  return static_cast<int64_t>(
      (static_cast<const char*>(t.data) - static_cast<const char*>(w.arena.base())) /
      static_cast<ptrdiff_t>(dtype_size(t.dtype)));
}

Tensor flat(Backend& be, const ModelWeights& w, DType dtype) {
  return Tensor(w.arena.base(), dtype, be.device(),
                {static_cast<int64_t>(w.arena.capacity() / dtype_size(dtype))});
}

}  // namespace

std::pair<int64_t, int64_t> stage_span(const ModelWeights& w, const std::vector<bool>& held) {
  int64_t begin = std::numeric_limits<int64_t>::max(), end = 0;
  for (size_t i = 0; i < w.bindings.size(); ++i) {
    if (!held[i] || !w.bindings[i].allocated()) continue;
    const Tensor t = w.bindings[i].tensor();
    begin = std::min(begin, offset_in(w, t));
    end = std::max(end, offset_in(w, t) + t.numel());
  }
  // A stage whose tensors are all frozen has an empty span.
  if (end == 0) return {0, 0};
  return {begin, end};
}

AdamW::AdamW(Backend& backend, const ModelConfig& cfg, ModelWeights* master_weights,
             ModelWeights& grads, const AdamWConfig& config, ModelWeights* working,
             Communicator* shard_over, int64_t bucket_elements, const StageTensors* pipeline,
             ShardSum* grad_shard, ShardedWeights* weight_shard)
    : be_(backend),
      config_(config),
      layout_(master_weights != nullptr ? *master_weights : grads),
      master_(master_weights),
      grads_(grads),
      working_(working),
      grad_shard_(grad_shard),
      weight_shard_(weight_shard) {
  IRIS_CHECK(weight_shard == nullptr || (shard_over != nullptr && grad_shard != nullptr &&
                                         working == &weight_shard->layout()),
             "AdamW: sharded weights need a sharded optimizer, sharded gradients and their layout "
             "as the working weights");
  IRIS_CHECK(grad_shard == nullptr || shard_over != nullptr,
             "AdamW: gradients summed into shards need a sharded optimizer");
  // Sharded, the optimizer keeps the master weights of its shard itself and writes the working
  // weights through; unsharded, they are the caller's.
  IRIS_CHECK((master_weights == nullptr) == (shard_over != nullptr) &&
                 (shard_over == nullptr || working != nullptr),
             "AdamW: sharded, the optimizer keeps its shard of the master weights itself (pass "
             "none) and needs working weights to write; unsharded, pass the master weights");
  // The master weights' layout is the gradients' (checked below when they are given).
  const ModelWeights& master = layout_;
  IRIS_CHECK(
      config.beta1 >= 0.0f && config.beta1 < 1.0f && config.beta2 >= 0.0f && config.beta2 < 1.0f,
      "AdamW betas must lie in [0, 1), got ", config.beta1, ", ", config.beta2);
  IRIS_CHECK(config.eps > 0.0f, "AdamW eps must be positive, got ", config.eps);
  IRIS_CHECK(config.weight_decay >= 0.0f, "AdamW weight_decay must not be negative");
  check_same_bindings(master, grads, "gradients");
  const size_t n = master.bindings.size();
  // The flat buffers are walked with the master's offsets: every f32 copy must share its layout.
  for (size_t i = 0; i < n; ++i)
    IRIS_CHECK(
        !master.bindings[i].allocated() || offset_in(grads, grads.bindings[i].tensor()) ==
                                               offset_in(master, master.bindings[i].tensor()),
        "AdamW: the gradients of '", master.bindings[i].hf_name,
        "' are laid out unlike the master weights; allocate both with allocate_weights");
  if (working) {
    IRIS_CHECK(working->bindings.size() == n, "AdamW: the working weights hold ",
               working->bindings.size(), " tensors, the master weights ", n);
    IRIS_CHECK(working->text.embed.dtype == backend.compute_dtype(),
               "AdamW: the working weights must be in the backend's compute dtype");
  }
  if (master_ != nullptr) flat_master_ = flat(be_, master, DType::f32);
  flat_grads_ = flat(be_, grads, DType::f32);
  if (working) flat_working_ = flat(be_, *working, backend.compute_dtype());

  // This rank's rows: every tensor whole, or the parts of tensors inside its shard.
  std::vector<Row> mine;
  if (shard_over != nullptr && pipeline != nullptr) {
    check_pipeline(*pipeline);
    setup_shard(*shard_over, bucket_elements, pipeline);
    mine = rows_[rows_base_ + static_cast<size_t>(shard_over->rank())];
  } else if (shard_over != nullptr) {
    setup_shard(*shard_over, bucket_elements, nullptr);
    mine = rows_[static_cast<size_t>(shard_over->rank())];
  } else if (pipeline != nullptr) {
    check_pipeline(*pipeline);
    for (size_t i = 0; i < n; ++i) {
      if (!master.bindings[i].allocated()) continue;
      const Tensor t = master.bindings[i].tensor();
      if (pipeline->held[size_t(pipeline->stages->rank())][i])
        mine.push_back({static_cast<int64_t>(i), offset_in(master, t), t.numel()});
    }
    setup_pipeline(*pipeline);
    // The moments span the stage's tensors only, from its first to its last in the flat layout
    // (the buffers are viewed from there, as a shard is).
    std::tie(shard_begin_, shard_end_) =
        stage_span(master, pipeline->held[size_t(pipeline->stages->rank())]);
    flat_master_ = flat_master_.slice(shard_begin_, shard_end_);
    flat_grads_ = flat_grads_.slice(shard_begin_, shard_end_);
    // At least one element so that a stage whose tensors are all frozen still has buffers.
    const int64_t len = std::max<int64_t>(1, shard_end_ - shard_begin_);
    auto plan_state = [&](Arena& a) {
      flat_m_ = a.alloc(DType::f32, {len});
      flat_v_ = a.alloc(DType::f32, {len});
    };
    Arena planning;
    plan_state(planning);
    shard_state_ = Arena(be_, planning.used());
    plan_state(shard_state_);
    flat_m_ = flat_m_.slice(0, shard_end_ - shard_begin_);
    flat_v_ = flat_v_.slice(0, shard_end_ - shard_begin_);
  } else {
    // The moments of the tensors the master weights hold (the trainable ones), in their layout.
    auto held = [&master](const std::string& name) {
      for (const WeightBinding& b : master.bindings)
        if (b.hf_name == name) return b.allocated();
      return false;
    };
    m_ = allocate_weights(backend, cfg, DType::f32, held);
    v_ = allocate_weights(backend, cfg, DType::f32, held);
    check_same_bindings(master, *m_, "moments (config differs from the parameters')");
    for (size_t i = 0; i < n; ++i) {
      if (!master.bindings[i].allocated()) continue;
      const Tensor t = master.bindings[i].tensor();
      IRIS_CHECK(offset_in(*m_, m_->bindings[i].tensor()) == offset_in(master, t),
                 "AdamW: the moments of '", master.bindings[i].hf_name,
                 "' are laid out unlike the master weights");
      mine.push_back({static_cast<int64_t>(i), offset_in(master, t), t.numel()});
    }
    flat_m_ = flat(be_, *m_, DType::f32);
    flat_v_ = flat(be_, *v_, DType::f32);
  }
  be_.fill_zero(flat_m_);
  be_.fill_zero(flat_v_);

  // At least one row so that a rank whose shard holds only padding still has its tables.
  const auto nt = std::max<int64_t>(1, static_cast<int64_t>(mine.size()));
  auto plan = [&](Arena& a) {
    spans_ = a.alloc(DType::i64, {nt, 3});
    hyper_ = a.alloc(DType::f32, {nt, 2});
    steps_dev_ = a.alloc(DType::i64, {nt});
    lr_ = a.alloc(DType::f32, {1});
    grad_stats_ = a.alloc(DType::f32, {2});
    norm_history_ = a.alloc(DType::f32, {kNormHistory});
  };
  Arena planning;
  plan(planning);
  tables_ = Arena(backend, planning.used());
  plan(tables_);
  std::vector<int64_t> spans(static_cast<size_t>(3 * nt), 0);
  std::vector<ShardedWeights::MasterPiece> master_pieces;
  for (size_t k = 0; k < mine.size(); ++k) {
    const Row& row = mine[k];
    const auto i = static_cast<size_t>(row.tensor);
    const int64_t into_tensor = row.flat_begin - offset_in(master, master.bindings[i].tensor());
    spans[3 * k] = row.flat_begin - shard_begin_;
    spans[3 * k + 1] = row.length;
    spans[3 * k + 2] =
        working ? offset_in(*working, working->bindings[i].tensor()) + into_tensor : 0;
    if (weight_shard_ != nullptr) {
      const ShardedWeights::Place p = weight_shard_->place(spans[3 * k + 2]);
      if (p.in_layers)
        master_pieces.push_back(
            {spans[3 * k + 2], flat_master_.slice(spans[3 * k], spans[3 * k] + row.length)});
      spans[3 * k + 2] = p.offset;
      const auto at = static_cast<int64_t>(k);
      if (working_groups_.empty() || working_groups_.back().writes_working == p.in_layers)
        working_groups_.push_back({at, at + 1, !p.in_layers});
      else
        working_groups_.back().end = at + 1;
    }
  }
  if (weight_shard_ != nullptr) weight_shard_->connect_master(std::move(master_pieces));
  be_.write(spans_, spans.data(), DType::i64);
  const std::vector<int64_t> zeros(static_cast<size_t>(nt), 0);
  be_.write(steps_dev_, zeros.data(), DType::i64);
  my_rows_ = std::move(mine);
}

AdamW::~AdamW() = default;

void AdamW::init_master(const ModelWeights& source) {
  IRIS_CHECK(master_ == nullptr, "AdamW::init_master: the master weights are the caller's");
  IRIS_CHECK(source.bindings.size() == layout_.bindings.size(),
             "AdamW::init_master: the source holds ", source.bindings.size(),
             " tensors, the model ", layout_.bindings.size());
  // Writes rank q's shard into `into` (its elements from shard q's first on); rows of tensors only,
  // the gaps between them are never read.
  auto fill = [&](const std::vector<Row>& rows, int64_t shard_begin, const Tensor& into) {
    for (const Row& row : rows) {
      const auto i = static_cast<size_t>(row.tensor);
      const Tensor src = source.bindings[i].tensor();
      IRIS_CHECK(src.dtype == DType::f32 && src.device == Device::cpu, "AdamW::init_master: '",
                 source.bindings[i].hf_name, "' must be f32 on the host");
      const int64_t into_tensor = row.flat_begin - offset_in(layout_, layout_.bindings[i].tensor());
      const int64_t at = row.flat_begin - shard_begin;
      be_.write(into.slice(at, at + row.length), static_cast<const float*>(src.data) + into_tensor,
                DType::f32);
    }
  };
  // Rank 0's copy is the truth, as the working weights' broadcast makes it (data_parallel.h): it
  // fills every rank's shard and sends it through the gradients, which the first step zeroes.
  const int world = comm_->size(), me = comm_->rank();
  const int64_t n = full_grads_.numel();
  if (me != 0) {
    comm_->recv(flat_master_, 0);
    be_.synchronize();
    return;
  }
  for (int q = world - 1; q >= 0; --q) {
    const int64_t b = span_begin_ + ShardExchange::begin(n, world, q);
    const int64_t e = span_begin_ + ShardExchange::end(n, world, q);
    const auto& rows = rows_[rows_base_ + static_cast<size_t>(q)];
    if (q == 0) {
      fill(rows, b, flat_master_);
    } else {
      const Tensor stage = staging_.slice(0, e - b);
      fill(rows, b, stage);
      comm_->send(stage, q);
      // The next shard reuses the staging memory.
      be_.synchronize();
    }
  }
  be_.synchronize();
}

bool AdamW::trains(size_t tensor) const {
  return layout_.bindings[tensor].allocated();
}

void AdamW::read_master(size_t tensor, float* out) const {
  const WeightBinding& b = layout_.bindings[tensor];
  IRIS_CHECK(b.allocated(), "AdamW::read_master: '", b.hf_name, "' is frozen (no master weights)");
  if (master_ != nullptr) {
    be_.read(out, DType::f32, b.tensor());
    return;
  }
  IRIS_CHECK(comm_->rank() == 0 && !gathered_master_.empty(),
             "AdamW::read_master: the sharded master weights are read on rank 0 after every "
             "rank's gather_state()");
  const int64_t at = offset_in(layout_, b.tensor()) - span_begin_;
  std::memcpy(out, gathered_master_.data() + at,
              static_cast<size_t>(b.tensor().numel()) * sizeof(float));
}

size_t AdamW::master_bytes() const {
  return master_shard_.capacity();
}

void AdamW::check_pipeline(const StageTensors& pipeline) const {
  IRIS_CHECK(pipeline.held.size() == size_t(pipeline.stages->size()), "AdamW: the pipeline lists ",
             pipeline.held.size(), " stages but its communicator has ", pipeline.stages->size());
  IRIS_CHECK(pipeline.stages->device() == be_.device(), "AdamW: the pipeline's ",
             pipeline.stages->name(), " communicator is not on the optimizer's device");
  for (size_t q = 0; q < pipeline.held.size(); ++q)
    IRIS_CHECK(pipeline.held[q].size() == layout_.bindings.size(), "AdamW: stage ", q, " lists ",
               pipeline.held[q].size(), " tensors, the model has ", layout_.bindings.size());
}

void AdamW::read_stage_tensors(const StageTensors& pipeline) {
  const size_t n = layout_.bindings.size();
  norm_comm_ = pipeline.stages;
  owner_.resize(n);
  held_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    // A tensor without state (frozen) is no stage's to update or save.
    const bool has_state = layout_.bindings[i].allocated();
    owner_[i] = has_state ? pipeline.owner(i) : -1;
    held_[i] = has_state && pipeline.held[size_t(norm_comm_->rank())][i];
  }
}

void AdamW::setup_pipeline(const StageTensors& pipeline) {
  const size_t n = layout_.bindings.size();
  read_stage_tensors(pipeline);
  const int stages = norm_comm_->size();
  rows_.assign(static_cast<size_t>(stages), {});
  for (int q = 0; q < stages; ++q)
    for (size_t i = 0; i < n; ++i)
      if (pipeline.held[size_t(q)][i] && layout_.bindings[i].allocated())
        rows_[size_t(q)].push_back({static_cast<int64_t>(i), 0, 0});
  rows_max_ = 1;
  for (const auto& r : rows_) rows_max_ = std::max<int64_t>(rows_max_, int64_t(r.size()));
  norm_order_.assign(n, {});
  for (size_t i = 0; i < n; ++i) {
    if (owner_[i] < 0) continue;  // no state: frozen
    const auto& rows = rows_[size_t(owner_[i])];
    for (size_t k = 0; k < rows.size(); ++k)
      if (rows[k].tensor == static_cast<int64_t>(i))
        norm_order_[i].push_back(owner_[i] * rows_max_ + static_cast<int64_t>(k));
  }
  plan_row_sums(stages);
}

void AdamW::plan_row_sums(int64_t groups) {
  auto plan = [&](Arena& a) {
    row_sums_ = a.alloc(DType::i64, {rows_max_});
    all_row_sums_ = a.alloc(DType::i64, {groups * rows_max_});
  };
  Arena planning;
  plan(planning);
  shard_tables_ = Arena(be_, planning.used());
  plan(shard_tables_);
  be_.fill_zero(row_sums_);
  host_row_sums_.resize(static_cast<size_t>(groups * rows_max_));
}

bool AdamW::saves(size_t tensor) const {
  if (!layout_.bindings[tensor].allocated()) return false;
  return owner_.empty() || owner_[tensor] == norm_comm_->rank();
}

bool AdamW::loads(size_t tensor) const {
  if (!layout_.bindings[tensor].allocated()) return false;
  return held_.empty() || held_[tensor];
}

std::vector<std::vector<AdamW::Row>> AdamW::shard_rows(const ModelWeights& w, int64_t begin,
                                                       int64_t n, int world,
                                                       const std::vector<bool>* held) {
  std::vector<std::vector<Row>> rows(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const int64_t b = begin + ShardExchange::begin(n, world, r);
    const int64_t e = begin + ShardExchange::end(n, world, r);
    for (size_t i = 0; i < w.bindings.size(); ++i) {
      if ((held != nullptr && !(*held)[i]) || !w.bindings[i].allocated()) continue;
      const Tensor t = w.bindings[i].tensor();
      const int64_t tb = offset_in(w, t), te = tb + t.numel();
      const int64_t lo = std::max(tb, b), hi = std::min(te, e);
      if (lo < hi) rows[static_cast<size_t>(r)].push_back({static_cast<int64_t>(i), lo, hi - lo});
    }
  }
  return rows;
}

void AdamW::setup_shard(Communicator& comm, int64_t bucket_elements, const StageTensors* pipeline) {
  IRIS_CHECK(comm.device() == be_.device(), "AdamW: the communicator (", comm.name(),
             ") is not on the optimizer's device");
  comm_ = &comm;
  norm_comm_ = &comm;
  const int world = comm.size();
  // The ranges the shards tile: the whole flat buffers, or each stage's span, which the stage's
  // replicas shard as a data-parallel run shards the whole (every stage's, for the norm's table).
  std::vector<std::pair<int64_t, int64_t>> spans{{0, flat_grads_.numel()}};
  int stage = 0;
  if (pipeline != nullptr) {
    read_stage_tensors(*pipeline);
    stage = pipeline->stages->rank();
    spans.clear();
    for (const std::vector<bool>& held : pipeline->held) spans.push_back(stage_span(layout_, held));
    rows_base_ = static_cast<size_t>(stage) * static_cast<size_t>(world);
  }
  const auto [span_begin, span_end] = spans[static_cast<size_t>(stage)];
  span_begin_ = span_begin;
  full_grads_ = flat_grads_.slice(span_begin, span_end);
  if (grad_shard_ != nullptr) {
    // Summed as the backward wrote them; full_grads_ spans addresses with no memory behind them.
    shard_begin_ = span_begin + ShardExchange::begin(full_grads_.numel(), world, comm.rank());
    shard_end_ = span_begin + ShardExchange::end(full_grads_.numel(), world, comm.rank());
    IRIS_CHECK(grad_shard_->begin() == shard_begin_ && grad_shard_->end() == shard_end_,
               "AdamW: the gradients' shard [", grad_shard_->begin(), ", ", grad_shard_->end(),
               ") is not the optimizer's [", shard_begin_, ", ", shard_end_, ")");
    flat_grads_ = grad_shard_->sums();
    staging_ = grad_shard_->accumulator();
  } else {
    // Only the gradients are exchanged here; the working weights are gathered by rank ranges.
    exchange_ = std::make_unique<ShardExchange>(be_, comm, full_grads_, Tensor(), bucket_elements);
    shard_begin_ = span_begin + exchange_->begin();
    shard_end_ = span_begin + exchange_->end();
    flat_grads_ = flat_grads_.slice(shard_begin_, shard_end_);
    staging_ = full_grads_;
  }
  rows_.clear();
  for (size_t q = 0; q < spans.size(); ++q) {
    auto rows = shard_rows(layout_, spans[q].first, spans[q].second - spans[q].first, world,
                           pipeline != nullptr ? &pipeline->held[q] : nullptr);
    rows_.insert(rows_.end(), rows.begin(), rows.end());
  }
  rows_max_ = 1;
  for (const auto& r : rows_)
    rows_max_ = std::max<int64_t>(rows_max_, static_cast<int64_t>(r.size()));
  const int64_t len = std::max<int64_t>(1, shard_end_ - shard_begin_);
  auto plan = [&](Arena& a) {
    flat_m_ = a.alloc(DType::f32, {len});
    flat_v_ = a.alloc(DType::f32, {len});
  };
  Arena planning;
  plan(planning);
  shard_state_ = Arena(be_, planning.used());
  plan(shard_state_);
  flat_m_ = flat_m_.slice(0, shard_end_ - shard_begin_);
  flat_v_ = flat_v_.slice(0, shard_end_ - shard_begin_);
  // The master weights of this rank's shard only, filled by init_master().
  Arena master_plan;
  master_plan.alloc(DType::f32, {len});
  master_shard_ = Arena(be_, master_plan.used());
  flat_master_ = master_shard_.alloc(DType::f32, {len}).slice(0, shard_end_ - shard_begin_);
  // Rows by world rank (stage x replicas + replica); a tensor's parts from its owning stage's
  // replicas only (a tied embedding's other stage holds the same sum), in replica order.
  const auto groups = static_cast<int64_t>(rows_.size());
  plan_row_sums(groups);
  norm_order_.assign(layout_.bindings.size(), {});
  for (int64_t g = 0; g < groups; ++g)
    for (size_t k = 0; k < rows_[static_cast<size_t>(g)].size(); ++k) {
      const auto i = static_cast<size_t>(rows_[static_cast<size_t>(g)][k].tensor);
      if (pipeline != nullptr && g / world != owner_[i]) continue;
      norm_order_[i].push_back(g * rows_max_ + static_cast<int64_t>(k));
    }
  if (working_ != nullptr) plan_working_gather();
}

void AdamW::plan_working_gather() {
  // Each rank's step rewrites the working copy of the elements of its shard, which in the
  // working arena's own layout (its alignment gaps may differ from the f32 arena's) are one
  // contiguous range: the tensors lie in the same order in both arenas, so the working offset
  // of a shard boundary grows with it. Rank 0's range starts at 0 and the last one's ends at the
  // arena's end, so that the ranges tile the arena, gaps included.
  const int world = comm_->size();
  const size_t n = layout_.bindings.size();
  // Frozen tensors have no master weights; their working copy lies in the gaps between the ranges
  // of trainable ones and is gathered with them, unchanged (every rank holds the same).
  std::vector<std::pair<int64_t, size_t>> order;  // master offset, tensor
  for (size_t i = 0; i < n; ++i)
    if (layout_.bindings[i].allocated())
      order.push_back({offset_in(layout_, layout_.bindings[i].tensor()), i});
  std::sort(order.begin(), order.end());
  int64_t last = -1;
  for (const auto& [off, i] : order) {
    const int64_t w = offset_in(*working_, working_->bindings[i].tensor());
    IRIS_CHECK(w > last,
               "AdamW: the working weights lie in another tensor order than the master "
               "weights ('",
               layout_.bindings[i].hf_name,
               "'); allocate both with allocate_weights from one config");
    last = w;
  }
  const int64_t nw = flat_working_.numel();
  // The working element of f32 element x, a shard boundary: inside a tensor at the same place
  // in its working copy, elsewhere where the next tensor starts.
  auto to_working = [&](int64_t x) {
    for (const auto& [off, i] : order) {
      const int64_t len = layout_.bindings[i].tensor().numel();
      if (x < off + len)
        return offset_in(*working_, working_->bindings[i].tensor()) + std::max<int64_t>(0, x - off);
    }
    return nw;
  };
  // A pipeline stage's ranges tile the working copy of its span instead, from its first
  // tensor's working offset to where the tensor after its last starts.
  const int64_t nm = full_grads_.numel();
  const bool whole =
      span_begin_ == 0 && nm == static_cast<int64_t>(layout_.arena.capacity() / sizeof(float));
  working_ranges_.clear();
  for (int q = 0; q < world; ++q) {
    const int64_t b =
        q == 0 && whole ? 0 : to_working(span_begin_ + ShardExchange::begin(nm, world, q));
    const int64_t e =
        q == world - 1 && whole ? nw : to_working(span_begin_ + ShardExchange::end(nm, world, q));
    working_ranges_.push_back({b, e});
  }
  if (weight_shard_ != nullptr) {
    weight_shard_->connect(*comm_, working_ranges_);
    return;
  }
  // Every rank's range to every other rank, in place, as one grouped exchange: the ranges differ
  // in length, which an all-gather cannot take, and the bytes moved are an all-gather's.
  const int me = comm_->rank();
  const auto [b, e] = working_ranges_[static_cast<size_t>(me)];
  for (int q = 0; q < world; ++q) {
    if (q == me) continue;
    working_sends_.push_back({flat_working_.slice(b, e), q});
    const auto [qb, qe] = working_ranges_[static_cast<size_t>(q)];
    working_recvs_.push_back({flat_working_.slice(qb, qe), q});
  }
}

void AdamW::gather_working() {
  if (weight_shard_ != nullptr) {
    weight_shard_->step_done();
    return;
  }
  if (!working_sends_.empty())
    comm_->exchange(working_sends_, working_recvs_, "the sharded optimizer's weight gather");
}

size_t AdamW::state_bytes() const {
  if (m_ == nullptr) return shard_state_.capacity();
  return m_->arena.capacity() + v_->arena.capacity();
}

size_t AdamW::exchange_bytes() const {
  if (comm_ == nullptr) return 0;
  return (exchange_ ? exchange_->scratch_bytes() : 0) + shard_tables_.capacity();
}

ModelWeights& AdamW::exp_avg() {
  IRIS_CHECK(m_ != nullptr,
             "AdamW::exp_avg: the moments are sharded over the ranks or pipeline stages");
  return *m_;
}

ModelWeights& AdamW::exp_avg_sq() {
  IRIS_CHECK(v_ != nullptr,
             "AdamW::exp_avg_sq: the moments are sharded over the ranks or pipeline stages");
  return *v_;
}

float AdamWConfig::lr_scale(ModelPart part) const {
  switch (part) {
    case ModelPart::vision_tower:
      return vision_tower_lr_scale;
    case ModelPart::merger:
      return merger_lr_scale;
    case ModelPart::language_model:
      return 1.0f;
  }
  return 1.0f;
}

void AdamW::write_hyper(const FreezeSpec& frozen) {
  // A rank without rows keeps its one table row inert: no elements, lr scale 0 (frozen).
  std::vector<float> hyper(static_cast<size_t>(2 * hyper_.rows()), 0.0f);
  for (size_t k = 0; k < my_rows_.size(); ++k) {
    const WeightBinding& b = layout_.bindings[static_cast<size_t>(my_rows_[k].tensor)];
    // Rows exist for tensors with master weights only, so a part without state stays frozen.
    hyper[2 * k] = b.hf_shape.size() >= 2 ? config_.weight_decay : 0.0f;
    hyper[2 * k + 1] = frozen.frozen(b.hf_name) ? 0.0f : config_.lr_scale(model_part(b.hf_name));
  }
  be_.write(hyper_, hyper.data(), DType::f32);
  hyper_frozen_ = frozen;
  hyper_written_ = true;
}

void AdamW::sharded_norm() {
  be_.grad_sum_squares(row_sums_.slice(0, spans_.rows()), flat_grads_, spans_, hyper_);
  if (comm_ != nullptr && norm_comm_ != comm_) {
    // Sharded stages: the stage's replicas' rows, then every stage's, in world rank order.
    const int64_t per_stage = comm_->size() * rows_max_, me = norm_comm_->rank();
    const Tensor stage_sums = all_row_sums_.slice(me * per_stage, (me + 1) * per_stage);
    comm_->all_gather(stage_sums, row_sums_);
    norm_comm_->all_gather(all_row_sums_, stage_sums);
  } else {
    norm_comm_->all_gather(all_row_sums_, row_sums_);
  }
  be_.read(host_row_sums_.data(), DType::i64, all_row_sums_);
  // grad_norm_clip's sum: tensor by tensor in order, a split tensor as its parts in rank order.
  double ss = 0.0;
  for (const std::vector<int64_t>& parts : norm_order_) {
    if (parts.empty()) continue;
    double t = host_row_sums_[static_cast<size_t>(parts[0])];
    for (size_t k = 1; k < parts.size(); ++k) t += host_row_sums_[static_cast<size_t>(parts[k])];
    ss += t;
  }
  const double norm = std::sqrt(ss);
  // As grad_norm_clip forms it: the coefficient in f32 from the f32 norm.
  const float max_norm = config_.clip_grad_norm;
  float coef = max_norm > 0.0f ? max_norm / (static_cast<float>(norm) + 1e-6f) : 1.0f;
  if (!(coef < 1.0f)) coef = 1.0f;
  const float stats[2] = {static_cast<float>(norm), coef};
  be_.write(grad_stats_, stats, DType::f32);
}

void AdamW::step(float scheduled_lr, const FreezeSpec& frozen) {
  if (!hyper_written_ || !(frozen == hyper_frozen_)) write_hyper(frozen);
  if (unread_norms_ == kNormHistory) read_norm_history();
  be_.write(lr_, &scheduled_lr, DType::f32);
  if (comm_ != nullptr) {
    if (exchange_) exchange_->reduce_scatter();
    sharded_norm();
  } else if (norm_comm_ != nullptr) {
    sharded_norm();
  } else {
    be_.grad_norm_clip(grad_stats_, flat_grads_, spans_, hyper_, config_.clip_grad_norm);
  }
  be_.copy(norm_history_.slice(unread_norms_, unread_norms_ + 1), grad_stats_.slice(0, 1));
  ++unread_norms_;
  if (weight_shard_ == nullptr)
    be_.adamw_step(flat_master_, flat_grads_, flat_m_, flat_v_, flat_working_, spans_, hyper_,
                   steps_dev_, lr_, grad_stats_, config_.beta1, config_.beta2, config_.eps);
  for (const WorkingGroup& g : working_groups_)
    be_.adamw_step(flat_master_, flat_grads_, flat_m_, flat_v_,
                   g.writes_working ? weight_shard_->whole_weights() : Tensor(),
                   spans_.slice(g.begin, g.end), hyper_.slice(g.begin, g.end),
                   steps_dev_.slice(g.begin, g.end), lr_, grad_stats_, config_.beta1, config_.beta2,
                   config_.eps);
  // A skipped step (non-finite norm) changed no shard: the gather then hands back the same bits.
  if (comm_ != nullptr) gather_working();
  ++steps_;
}

void AdamW::read_norm_history() {
  const size_t done = read_norms_.size();
  read_norms_.resize(done + static_cast<size_t>(unread_norms_));
  if (unread_norms_ > 0)
    be_.read(read_norms_.data() + done, DType::f32, norm_history_.slice(0, unread_norms_));
  unread_norms_ = 0;
}

std::vector<float> AdamW::take_grad_norms() {
  read_norm_history();
  std::vector<float> out;
  out.swap(read_norms_);
  if (!out.empty()) last_norm_ = out.back();
  return out;
}

void AdamW::gather_state() {
  if (comm_ == nullptr) return;
  const int world = comm_->size();
  // The checkpoint reads the whole f32 master on rank 0: every shard, gathered to its host below.
  if (comm_->rank() != 0) {
    comm_->send(flat_m_, 0);
    comm_->send(flat_v_, 0);
    comm_->send(flat_master_, 0);
    comm_->send(steps_dev_, 0);
    return;
  }
  // Host memory for the whole state (a pipeline stage's: its span), as the unsharded save reads
  // it back; released by save().
  const int64_t n = full_grads_.numel();
  gathered_m_.assign(static_cast<size_t>(n), 0.0f);
  gathered_v_.assign(static_cast<size_t>(n), 0.0f);
  gathered_master_.assign(static_cast<size_t>(n), 0.0f);
  gathered_steps_.assign(layout_.bindings.size(), -1);
  std::vector<int64_t> row_steps;
  for (int q = 0; q < world; ++q) {
    const int64_t b = ShardExchange::begin(n, world, q), e = ShardExchange::end(n, world, q);
    const auto& rows = rows_[rows_base_ + static_cast<size_t>(q)];
    row_steps.assign(std::max<size_t>(1, rows.size()), 0);
    if (q == 0) {
      be_.read(gathered_m_.data() + b, DType::f32, flat_m_);
      be_.read(gathered_v_.data() + b, DType::f32, flat_v_);
      be_.read(gathered_master_.data() + b, DType::f32, flat_master_);
      be_.read(row_steps.data(), DType::i64, steps_dev_);
    } else if (comm_->device() == Device::cpu) {
      // The MPI communicator moves host memory.
      comm_->recv(Tensor(gathered_m_.data() + b, DType::f32, Device::cpu, {e - b}), q);
      comm_->recv(Tensor(gathered_v_.data() + b, DType::f32, Device::cpu, {e - b}), q);
      comm_->recv(Tensor(gathered_master_.data() + b, DType::f32, Device::cpu, {e - b}), q);
      comm_->recv(Tensor(row_steps.data(), DType::i64, Device::cpu,
                         {static_cast<int64_t>(row_steps.size())}),
                  q);
    } else {
      // NCCL moves device memory: each piece lands in the gradients, which are spent until the
      // next step zeroes them (no buffer of its own), and is read from there.
      const Tensor stage = staging_.slice(0, e - b);
      comm_->recv(stage, q);
      be_.read(gathered_m_.data() + b, DType::f32, stage);
      comm_->recv(stage, q);
      be_.read(gathered_v_.data() + b, DType::f32, stage);
      comm_->recv(stage, q);
      be_.read(gathered_master_.data() + b, DType::f32, stage);
      const Tensor steps(staging_.data, DType::i64, staging_.device,
                         {static_cast<int64_t>(row_steps.size())});
      comm_->recv(steps, q);
      be_.read(row_steps.data(), DType::i64, steps);
    }
    for (size_t k = 0; k < rows.size(); ++k) {
      int64_t& s = gathered_steps_[static_cast<size_t>(rows[k].tensor)];
      IRIS_CHECK(s < 0 || s == row_steps[k], "AdamW: the ranks disagree on the step count of '",
                 layout_.bindings[static_cast<size_t>(rows[k].tensor)].hf_name, "' (", s, " and ",
                 row_steps[k], ")");
      s = row_steps[k];
    }
  }
  for (int64_t& s : gathered_steps_) s = std::max<int64_t>(s, 0);
}

void AdamW::save(const std::string& path) const {
  const size_t n = layout_.bindings.size();
  // Host copies of the device state, written in one pass.
  std::vector<float> m, v;
  std::vector<int64_t> param_steps(n);
  if (comm_ != nullptr) {
    IRIS_CHECK(comm_->rank() == 0 && gathered_m_.size() == static_cast<size_t>(full_grads_.numel()),
               "AdamW::save: a sharded optimizer is saved by rank 0 after every rank's "
               "gather_state()");
    m.swap(gathered_m_);
    v.swap(gathered_v_);
    param_steps.swap(gathered_steps_);
    std::vector<float>().swap(gathered_master_);
  } else {
    m.resize(static_cast<size_t>(flat_m_.numel()));
    v.resize(m.size());
    be_.read(m.data(), DType::f32, flat_m_);
    be_.read(v.data(), DType::f32, flat_v_);
    // One step count per table row: every tensor, or a pipeline stage's held ones.
    std::vector<int64_t> row_steps(static_cast<size_t>(steps_dev_.numel()));
    be_.read(row_steps.data(), DType::i64, steps_dev_);
    for (size_t k = 0; k < my_rows_.size(); ++k)
      param_steps[static_cast<size_t>(my_rows_[k].tensor)] = row_steps[k];
  }
  std::vector<SafetensorsWriteItem> items;
  items.reserve(3 * n);
  for (size_t i = 0; i < n; ++i) {
    if (!saves(i)) continue;
    const WeightBinding& b = layout_.bindings[i];
    // The host copy starts at the stage's first element (sharded: gathered from its span's).
    const int64_t off =
        offset_in(layout_, b.tensor()) - (comm_ != nullptr ? span_begin_ : shard_begin_);
    items.push_back({"exp_avg." + b.hf_name, DType::f32, b.hf_shape, m.data() + off});
    items.push_back({"exp_avg_sq." + b.hf_name, DType::f32, b.hf_shape, v.data() + off});
    items.push_back({"step." + b.hf_name, DType::i64, {1}, &param_steps[i]});
  }
  write_safetensors(path, items,
                    {{"format", "iris-adamw"},
                     {"steps", std::to_string(steps_)},
                     {"beta1", std::to_string(config_.beta1)},
                     {"beta2", std::to_string(config_.beta2)},
                     {"eps", std::to_string(config_.eps)},
                     {"weight_decay", std::to_string(config_.weight_decay)},
                     {"stateless_parts", stateless_parts(layout_)}});
}

namespace {

// The state is checked like the weights are: a NaN or Inf moment, a negative second moment or a
// step count outside the run's would resume with other updates than the saved run's, silently
// (or fail a step later as a NaN gradient norm, far from its cause).
void check_moments(const std::string& path, const std::string& name, const float* m, const float* v,
                   int64_t step, int64_t steps, int64_t n) {
  IRIS_CHECK(step >= 0 && step <= steps, path, ": 'step.", name, "' is ", step,
             ", outside 0 .. the state's ", steps, " steps; the optimizer state is damaged");
  bool zero = true;
  for (int64_t i = 0; i < n; ++i) {
    IRIS_CHECK(std::isfinite(m[i]) && std::isfinite(v[i]) && v[i] >= 0.0f, path, ": '",
               !std::isfinite(m[i]) ? "exp_avg." : "exp_avg_sq.", name, "' holds ",
               !std::isfinite(m[i]) ? m[i] : v[i], " at element ", i,
               " (moments must be finite, second moments not negative); the optimizer state is "
               "damaged");
    zero = zero && m[i] == 0.0f && v[i] == 0.0f;
  }
  IRIS_CHECK(step > 0 || zero, path, ": '", name,
             "' has moments but a step count of 0 (its bias correction would be wrong); the "
             "optimizer state is damaged");
}

}  // namespace

void AdamW::load(const std::string& path) {
  load(std::vector<std::string>{path});
}

void AdamW::load(const std::vector<std::string>& paths) {
  IRIS_CHECK(!paths.empty(), "AdamW::load: no state file given");
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  for (const std::string& p : paths) files.push_back(std::make_unique<SafetensorsFile>(p));
  const std::string& path = paths[0];
  const SafetensorsFile& file = *files[0];
  for (size_t f = 1; f < files.size(); ++f)
    IRIS_CHECK(files[f]->metadata() == file.metadata(), paths[f], " and ", path,
               " are parts of different optimizer states (their metadata differ)");
  const auto& meta = file.metadata();
  const auto fmt = meta.find("format");
  IRIS_CHECK(fmt != meta.end() && fmt->second == "iris-adamw", path,
             " is not an Iris AdamW state file (metadata format != iris-adamw)");
  const auto st = meta.find("steps");
  IRIS_CHECK(st != meta.end(), path, " has no 'steps' metadata entry");
  int64_t steps = 0;
  try {
    steps = std::stoll(st->second);
  } catch (const std::exception&) {
    IRIS_FAIL(path, " has a malformed 'steps' metadata entry '", st->second, "'");
  }
  // A billion steps is far past any run; a larger or negative count is a damaged file, whose
  // bias corrections would silently change every update.
  constexpr int64_t kMaxSteps = int64_t{1} << 30;
  IRIS_CHECK(steps >= 0 && steps <= kMaxSteps, path, " gives 'steps' ", steps, ", outside 0 .. ",
             kMaxSteps, "; the optimizer state is damaged");
  auto entry = [&](const std::string& name, DType dtype, const std::vector<int64_t>& shape) {
    size_t f = 0;
    while (f < files.size() && !files[f]->contains(name)) ++f;
    IRIS_CHECK(f<files.size(), path, files.size()> 1 ? " (and its other parts)" : "", " lacks '",
               name, "'; was it saved for a model with another config?");
    const SafetensorsEntry& e = files[f]->at(name);
    IRIS_CHECK(e.dtype == dtype && e.shape == shape, paths[f], ": '", name, "' is ",
               dtype_name(e.dtype), " ", shape_text(e.shape), ", expected ", dtype_name(dtype), " ",
               shape_text(shape));
    return e.data;
  };
  // Check everything before touching the state, so a bad file leaves the optimizer as it was.
  // A part the writing run kept frozen has no state in the file (stateless_parts): resuming with
  // it trainable starts its moments and step counts at zero, as a first step would.
  const auto sl = meta.find("stateless_parts");
  const std::string file_stateless = sl != meta.end() ? "," + sl->second + "," : ",";
  reinitialised_parts_.clear();
  std::vector<const void*> src;
  for (size_t i = 0; i < layout_.bindings.size(); ++i) {
    const WeightBinding& b = layout_.bindings[i];
    const std::string part = part_name(model_part(b.hf_name));
    if (!loads(i) || file_stateless.find("," + part + ",") != std::string::npos) {
      if (loads(i) && std::find(reinitialised_parts_.begin(), reinitialised_parts_.end(), part) ==
                          reinitialised_parts_.end())
        reinitialised_parts_.push_back(part);
      src.insert(src.end(), 3, nullptr);
      continue;
    }
    src.push_back(entry("exp_avg." + b.hf_name, DType::f32, b.hf_shape));
    src.push_back(entry("exp_avg_sq." + b.hf_name, DType::f32, b.hf_shape));
    src.push_back(entry("step." + b.hf_name, DType::i64, {1}));
    check_moments(path, b.hf_name, static_cast<const float*>(src[src.size() - 3]),
                  static_cast<const float*>(src[src.size() - 2]),
                  *static_cast<const int64_t*>(src.back()), steps,
                  b.target->slice(b.row_offset, b.row_offset + b.hf_shape[0]).numel());
  }
  // Each row is a tensor, or (sharded) the part of one in this rank's shard: the file holds the
  // unsharded state, so any world size reads its shard of it.
  std::vector<int64_t> row_steps(static_cast<size_t>(spans_.rows()), 0);
  for (size_t k = 0; k < my_rows_.size(); ++k) {
    const Row& row = my_rows_[k];
    const auto i = static_cast<size_t>(row.tensor);
    if (src[3 * i] == nullptr) {
      const int64_t at = row.flat_begin - shard_begin_;
      be_.fill_zero(flat_m_.slice(at, at + row.length));
      be_.fill_zero(flat_v_.slice(at, at + row.length));
      continue;  // row_steps[k] stays 0
    }
    const auto into =
        static_cast<size_t>(row.flat_begin - offset_in(layout_, layout_.bindings[i].tensor())) *
        sizeof(float);
    const int64_t at = row.flat_begin - shard_begin_;
    be_.write(flat_m_.slice(at, at + row.length), static_cast<const char*>(src[3 * i]) + into,
              DType::f32);
    be_.write(flat_v_.slice(at, at + row.length), static_cast<const char*>(src[3 * i + 1]) + into,
              DType::f32);
    std::memcpy(&row_steps[k], src[3 * i + 2], sizeof(int64_t));
  }
  be_.write(steps_dev_, row_steps.data(), DType::i64);
  steps_ = steps;
}

}  // namespace iris
