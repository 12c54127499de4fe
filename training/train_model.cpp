#include "training/train_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>

#include "bridge/joined_model.h"
#include "bridge/peft.h"
#include "bridge/rope_index.h"
#include "core/splitmix.h"
#include "core/thread_cpu_clock.h"
#include "core/vision_tables.h"
#include "language/moe_mlp.h"
#include "language/mrope.h"
#include "vision/vision_tower_order.h"

namespace iris {
namespace {

constexpr int32_t kIgnoreIndex = -100;

// A gradient tensor, or none when its part is frozen (which also skips the weight-gradient work).
Tensor g_or_none(const Tensor& t, bool trainable) {
  return trainable ? t : Tensor();
}

// Each tower's adapter scratch, from the config's weight table: the memory plan's pass has the
// config but no weights.
struct LoraScratchSizes {
  LoraScratchSize text, vision, merger;
};
LoraScratchSizes lora_scratch_sizes(const ModelConfig& cfg) {
  LoraScratchSizes sizes;
  if (!cfg.lora.enabled()) return sizes;
  const std::unique_ptr<Backend> cpu = make_cpu_backend();
  const auto layout =
      allocate_weights(*cpu, cfg, DType::f32, [](const std::string&) { return false; });
  for (const WeightBinding& b : layout->bindings) {
    if (!is_lora_tensor(b.hf_name)) continue;
    LoraScratchSize& size = b.hf_name.starts_with("model.visual.merger.") ? sizes.merger
                            : b.hf_name.starts_with("model.visual.")      ? sizes.vision
                                                                          : sizes.text;
    if (b.hf_name.ends_with(".lora_A.weight")) {
      size.rank = std::max(size.rank, b.hf_shape[0]);
      size.in = std::max(size.in, b.hf_shape[1]);
    } else {
      size.out = std::max(size.out, b.hf_shape[0]);
    }
    size.dropout = cfg.lora.dropout > 0.0;
  }
  return sizes;
}

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

// A decoder layer's saved activations by name, and the recompute modes that keep them per layer
// (the allocation below): full keeps the input only, selective also what the recomputation
// cannot rebuild cheaply, none everything.
struct SavedActivation {
  const char* name;
  Tensor DecoderLayerBuffers::*field;
  Recompute kept_up_to;  // kept per layer by this mode and the ones that recompute less
};
constexpr SavedActivation kSavedActivations[] = {
    {"x_in", &DecoderLayerBuffers::x_in, Recompute::full},
    {"rms1", &DecoderLayerBuffers::rms1, Recompute::none},
    {"rstd1", &DecoderLayerBuffers::rstd1, Recompute::selective},
    {"qkv_lin", &DecoderLayerBuffers::qkv_lin, Recompute::selective},
    {"qk_rstd", &DecoderLayerBuffers::qk_rstd, Recompute::selective},
    {"qkv", &DecoderLayerBuffers::qkv, Recompute::none},
    {"attn", &DecoderLayerBuffers::attn, Recompute::selective},
    {"lse", &DecoderLayerBuffers::lse, Recompute::selective},
    {"x_mid", &DecoderLayerBuffers::x_mid, Recompute::selective},
    {"rms2", &DecoderLayerBuffers::rms2, Recompute::none},
    {"rstd2", &DecoderLayerBuffers::rstd2, Recompute::selective},
    {"gate_up", &DecoderLayerBuffers::gate_up, Recompute::selective},
    {"act", &DecoderLayerBuffers::act, Recompute::none},
};

// Whether `mode` keeps what `kept_up_to` says per layer (none keeps the most, full the least).
bool keeps(Recompute mode, Recompute kept_up_to) {
  auto rank = [](Recompute r) {
    return r == Recompute::none ? 0 : r == Recompute::selective ? 1 : 2;
  };
  return rank(mode) <= rank(kept_up_to);
}

}  // namespace

std::vector<std::string> offloadable_activations(Recompute recompute) {
  std::vector<std::string> names;
  for (const SavedActivation& a : kSavedActivations)
    if (keeps(recompute, a.kept_up_to)) names.push_back(a.name);
  return names;
}

int64_t labelled_positions(const std::vector<int32_t>& labels) {
  int64_t n = 0;
  for (size_t i = 1; i < labels.size(); ++i) n += labels[i] != kIgnoreIndex;
  return n;
}

int64_t loss_label_slots(int64_t labels, int64_t bucket) {
  int64_t octave = 512;
  while (octave * 2 < labels) octave *= 2;
  const int64_t step = octave / 8;
  const int64_t slots = std::max<int64_t>(1, (labels + step - 1) / step) * step;
  return std::min(slots, bucket);
}

ModelPart model_part(const std::string& name) {
  if (starts_with(name, "model.visual.merger.") ||
      starts_with(name, "model.visual.deepstack_merger_list."))
    return ModelPart::merger;
  if (starts_with(name, "model.visual.")) return ModelPart::vision_tower;
  if (starts_with(name, "model.language_model.") || starts_with(name, "lm_head."))
    return ModelPart::language_model;
  IRIS_FAIL("parameter '", name,
            "' belongs to no known part of Qwen3-VL (expected model.visual.*, "
            "model.language_model.* or lm_head.*)");
}

int decoder_layer(const std::string& name) {
  static const std::string kLayers = "model.language_model.layers.";
  if (!starts_with(name, kLayers.c_str())) return -1;
  return std::stoi(name.substr(kLayers.size()));
}

bool stage_holds(const PipelineStage& st, bool tied_embeddings, const std::string& name) {
  if (model_part(name) != ModelPart::language_model) return st.has_vision;
  if (const int l = decoder_layer(name); l >= 0) return l >= st.first_layer && l < st.end_layer;
  if (starts_with(name, "model.language_model.embed_tokens."))
    return st.has_embed() || (st.has_head && tied_embeddings);
  // The final norm and lm_head.
  return st.has_head;
}

bool FreezeSpec::frozen(const std::string& name) const {
  if (is_lora_tensor(name) || in_modules_to_save(name, modules_to_save)) return false;
  switch (model_part(name)) {
    case ModelPart::vision_tower:
      return vision_tower;
    case ModelPart::merger:
      return merger;
    case ModelPart::language_model:
      return language_model;
  }
  return false;
}

TrainableQwen3VL::TrainableQwen3VL(Backend& backend, const ModelConfig& cfg, ModelWeights& params,
                                   const TrainLimits& limits, ModelWeights* shared_grads)
    : be_(backend),
      cfg_(cfg),
      params_(params),
      limits_(limits),
      compute_dtype_(backend.compute_dtype()),
      loss_workspace_bytes_([be = &backend](int64_t rows, int64_t hidden, int64_t vocab) {
        return be->lm_head_loss_workspace_bytes(rows, hidden, vocab);
      }) {
  IRIS_CHECK(params.text.embed.defined() && params.text.embed.dtype == backend.compute_dtype() &&
                 params.text.embed.device == backend.device(),
             "training parameters must live on the ", backend.name(),
             " backend in its compute "
             "dtype: allocate or load them with that backend");
  check_limits();
  if (shared_grads != nullptr) {
    IRIS_CHECK(shared_grads->bindings.size() == params.bindings.size(),
               "shared gradients must be f32 weights of the same config on the same backend");
    for (const WeightBinding& b : shared_grads->bindings)
      IRIS_CHECK(b.allocated() == !limits.frozen.frozen(b.hf_name) &&
                     (!b.allocated() ||
                      (b.target->dtype == DType::f32 && b.target->device == backend.device())),
                 "shared gradients must be f32 on the same backend and hold the trainable "
                 "tensors of the same frozen parts ('",
                 b.hf_name, "')");
    grads_ = shared_grads;
  } else {
    // Gradients of the trainable parameters only: a part frozen from the start holds none.
    const FreezeSpec planned = limits.frozen;
    own_grads_ = allocate_weights(backend, cfg, DType::f32,
                                  [planned](const std::string& n) { return !planned.frozen(n); });
    grads_ = own_grads_.get();
  }
  v_inv_freq_ = vision_rope_inv_freq(cfg_.vision.head_dim(), cfg_.vision.rope_theta);
  rope_inv_freq_ = mrope_inv_freq(cfg_.text);
  rope_axes_ = mrope_pair_axes(cfg_.text);
  Arena plan;
  allocate(plan);
  arena_ = Arena(backend, plan.used());
  allocate(arena_);
  if (offload_host_bytes_ > 0)
    offload_host_ = std::unique_ptr<void, std::function<void(void*)>>(
        be_.allocate_host(offload_host_bytes_), [be = &be_](void* p) { be->free_host(p); });
  // Rows a padded micro-batch gathers but never computes (the sink row of a bucket that a later,
  // larger bucket has not written) must hold finite values: an ignored row's zero gradient is
  // 0 * x, which a NaN left in memory would poison.
  be_.fill_zero(Tensor(arena_.base(), DType::f32, be_.device(),
                       {static_cast<int64_t>(arena_.capacity() / sizeof(float))}));
  zero_grads();
  be_.fill_zero(loss_total_);
  if (moe_aux_sum_.defined()) be_.fill_zero(moe_aux_sum_);
  set_frozen(limits.frozen.vision_tower || limits.vision_tower_frozen, limits.frozen.merger,
             limits.frozen.language_model);
}

void TrainableQwen3VL::check_limits() {
  const VisionConfig& v = cfg_.vision;
  const TextConfig& t = cfg_.text;
  if (t.any_sparse_layer()) {
    // HF's load-balancing loss is one product over every sparse layer's statistics: a stage of a
    // pipeline holds only its own.
    IRIS_CHECK(limits_.stage.index == 0 && limits_.stage.count == 1,
               "training a mixture-of-experts model (Qwen3-VL-MoE) over pipeline stages is not "
               "implemented yet; set parallel.pipeline_model_parallel_size: 1");
  }
  IRIS_CHECK(limits_.max_seq_len > 0, "TrainLimits.max_seq_len must be positive");
  IRIS_CHECK(limits_.max_patches >= 0 && limits_.max_patches % v.merge_unit() == 0,
             "TrainLimits.max_patches (", limits_.max_patches, ") must be a multiple of ",
             v.merge_unit());
  IRIS_CHECK(limits_.max_images >= 0, "TrainLimits.max_images must not be negative");
  IRIS_CHECK(limits_.max_samples > 0, "TrainLimits.max_samples must be positive");
  IRIS_CHECK(limits_.loss_chunk_rows > 0, "TrainLimits.loss_chunk_rows must be positive");
  IRIS_CHECK(v.out_hidden_size == t.hidden_size, "vision out_hidden_size ", v.out_hidden_size,
             " differs from the text hidden size ", t.hidden_size);
  IRIS_CHECK(v.deepstack_visual_indexes.size() <= size_t(t.num_hidden_layers), "the config has ",
             v.deepstack_visual_indexes.size(), " DeepStack taps but only ", t.num_hidden_layers,
             " decoder layers to inject them into");
  for (int tap : v.deepstack_visual_indexes)
    IRIS_CHECK(tap >= 0 && tap < v.depth, "DeepStack tap ", tap, " is not a vision block index");
  IRIS_CHECK(t.head_dim % 2 == 0 && v.head_dim() % 2 == 0, "head dims must be even");
  if (!limits_.offload.empty()) {
    const std::vector<std::string> can = offloadable_activations(limits_.recompute);
    std::string listed;
    for (const std::string& n : can) listed += (listed.empty() ? "" : ", ") + n;
    for (size_t i = 0; i < limits_.offload.size(); ++i) {
      const std::string& n = limits_.offload[i];
      IRIS_CHECK(std::find(can.begin(), can.end(), n) != can.end(), "activation offload: '", n,
                 "' is not an activation the decoder layers keep with train.recompute=",
                 recompute_name(limits_.recompute), "; those are: ", listed);
      IRIS_CHECK(std::find(limits_.offload.begin(), limits_.offload.begin() + i, n) ==
                     limits_.offload.begin() + i,
                 "activation offload: '", n, "' is named twice");
    }
    IRIS_CHECK(!t.any_sparse_layer(),
               "activation offload of a mixture-of-experts model is not implemented yet; set "
               "train.offload_activations=none");
  }
  auto check_buckets = [](const std::vector<int64_t>& b, int64_t max, int64_t unit,
                          const char* what) {
    for (size_t i = 0; i < b.size(); ++i)
      IRIS_CHECK(b[i] > 0 && b[i] <= max && b[i] % unit == 0 && (i == 0 || b[i] > b[i - 1]), what,
                 " buckets must ascend, be positive multiples of ", unit, " and be at most ", max,
                 " (bucket ", b[i], ")");
  };
  check_buckets(limits_.text_buckets, limits_.max_seq_len, 1, "text");
  check_buckets(limits_.vision_buckets, limits_.max_patches, v.merge_unit(), "vision");
  IRIS_CHECK(limits_.vision_buckets.empty() || !limits_.text_buckets.empty(),
             "vision buckets need text buckets: the padded vision rows land in the text's padding");
  if (!limits_.text_buckets.empty() && limits_.vision_buckets.empty() && limits_.max_patches > 0)
    limits_.vision_buckets = {limits_.max_patches};
  PipelineStage& st = limits_.stage;
  if (st.count == 1) {
    st = PipelineStage{};
    st.end_layer = t.num_hidden_layers;
  }
  validate_stage(cfg_, st);
  IRIS_CHECK(st.has_vision == st.has_embed(), "pipeline ", st.describe(),
             ": the vision encoder belongs to stage 0, whose embedding its features join");
}

TrainableQwen3VL::ArenaPlan TrainableQwen3VL::plan_arena(const ModelConfig& cfg,
                                                         const TrainLimits& limits,
                                                         DType compute_dtype,
                                                         const LossWorkspaceBytes& loss_workspace) {
  // A planning arena hands out null tensors and only counts: nothing is allocated on any device,
  // so a plan for a GPU is made on a machine without one. The host backend only stands in for
  // the reference the model keeps; the dtype and the loss workspace are the planned device's.
  const std::unique_ptr<Backend> host = make_cpu_backend();
  ModelWeights no_params;
  TrainableQwen3VL m(*host, cfg, no_params, limits, compute_dtype, loss_workspace);
  Arena plan;
  m.allocate(plan);
  ArenaPlan out{plan.used(), m.activation_bytes_, 0, m.offload_host_bytes_};
  // Planned tensors have no data, so an input is told from an absent one by its shape.
  for (Tensor TrainableQwen3VL::*member : input_members()) {
    const Tensor& t = m.*member;
    if (t.ndim > 0)
      out.input_bytes += (static_cast<size_t>(t.numel()) * dtype_size(t.dtype) + 255) / 256 * 256;
  }
  return out;
}

TrainableQwen3VL::TrainableQwen3VL(Backend& host, const ModelConfig& cfg, ModelWeights& no_params,
                                   const TrainLimits& limits, DType compute_dtype,
                                   const LossWorkspaceBytes& loss_workspace)
    : be_(host),
      cfg_(cfg),
      params_(no_params),
      limits_(limits),
      compute_dtype_(compute_dtype),
      loss_workspace_bytes_(loss_workspace) {
  check_limits();
}

void TrainableQwen3VL::allocate(Arena& a) {
  const VisionConfig& v = cfg_.vision;
  const TextConfig& t = cfg_.text;
  const DType F = DType::f32, I32 = DType::i32, A = compute_dtype_;
  const PipelineStage& st = limits_.stage;
  const int64_t L = limits_.max_seq_len, H = t.hidden_size;
  // A stage without the encoder plans no vision rows; the merged-row count still sizes the
  // DeepStack features it receives and the image-pad row table every stage derives.
  const int64_t Sm_all = limits_.max_patches / v.merge_unit();
  const int64_t S = st.has_vision ? limits_.max_patches : 0, Sm = S / v.merge_unit(),
                D = v.hidden_size, M = v.merged_dim(), Iv = v.intermediate_size, nh = v.num_heads;
  const int64_t out = v.out_hidden_size;

  // Text tensors that scatters and gathers address get one more row: a padded micro-batch's sink.
  const int64_t Ls = L + 1;
  ids_ = a.alloc(I32, {L});
  pad_rows_ = a.alloc(I32, {std::max(L, Sm_all)});
  label_rows_ = a.alloc(I32, {L});
  targets_ = a.alloc(I32, {L});
  positions_ = a.alloc(I32, {L, 3});
  cos_ = a.alloc(F, {L, t.head_dim});
  sin_ = a.alloc(F, {L, t.head_dim});
  text_cu_ = a.alloc(I32, {limits_.max_samples + 2});  // + the padding segment
  grad_scale_ = a.alloc(F, {1});
  loss_sum_ = a.alloc(F, {1});
  loss_total_ = a.alloc(F, {1});
  pixels_ = a.alloc(A, {S, v.patch_dim()});
  v_cos_ = a.alloc(F, {S, v.head_dim()});
  v_sin_ = a.alloc(F, {S, v.head_dim()});
  pos_index_ = a.alloc(I32, {S, 4});
  pos_weight_ = a.alloc(F, {S, 4});
  v_cu_ = a.alloc(I32, {vision_segment_capacity() + 1});
  v_window_cu_ =
      v.window_units() > 0 && S > 0 ? a.alloc(I32, {vision_window_capacity(v, S) + 1}) : Tensor();
  v_grids_ = a.alloc(I32, {vision_grids_numel(vision_segment_capacity())});
  v_real_rows_ = a.alloc(I32, {1});

  // A block's tensors are its own when its backward reads them as the forward left them; the
  // others are one set shared by all blocks (recomputed before each block's backward, or never
  // read again when the tower is frozen).
  const Recompute rc = limits_.recompute;
  const bool v_keep_all = !limits_.vision_tower_frozen && rc == Recompute::none;
  const bool v_keep_layer = !limits_.vision_tower_frozen && rc != Recompute::full;
  VisionBlockBuffers vs;
  // The planning pass's tensors have no storage, so "already made" is tracked here, not by
  // Tensor::defined().
  std::set<const Tensor*> made;
  auto v_buf = [&](bool own, Tensor& shared, DType dt, std::vector<int64_t> shape) {
    if (own) return a.alloc(dt, shape);
    if (made.insert(&shared).second) shared = a.alloc(dt, shape);
    return shared;
  };
  const size_t activations_start = a.used();
  vx_.clear();
  for (int l = 0; l <= v.depth; ++l) vx_.push_back(a.alloc(A, {S, D}));
  vb_.assign(static_cast<size_t>(v.depth), {});
  for (size_t l = 0; l < vb_.size(); ++l) {
    VisionBlockBuffers& b = vb_[l];
    b.x_in = vx_[l];
    b.x_out = vx_[l + 1];
    b.ln1 = v_buf(v_keep_all, vs.ln1, A, {S, D});
    b.mean1 = v_buf(v_keep_layer, vs.mean1, F, {S});
    b.rstd1 = v_buf(v_keep_layer, vs.rstd1, F, {S});
    b.qkv = v_buf(v_keep_layer, vs.qkv, A, {S, 3 * D});
    b.lse = v_buf(v_keep_layer, vs.lse, F, {S, nh});
    b.attn = v_buf(v_keep_layer, vs.attn, A, {S, D});
    b.x_mid = v_buf(v_keep_layer, vs.x_mid, A, {S, D});
    b.ln2 = v_buf(v_keep_all, vs.ln2, A, {S, D});
    b.mean2 = v_buf(v_keep_layer, vs.mean2, F, {S});
    b.rstd2 = v_buf(v_keep_layer, vs.rstd2, F, {S});
    b.fc1 = v_buf(v_keep_layer, vs.fc1, A, {S, v.tower->mlp_up_width(v)});
    b.act = v_buf(v_keep_all, vs.act, A, {S, Iv});
  }
  v_recompute_out_ = !limits_.vision_tower_frozen && rc == Recompute::full && S > 0
                         ? a.alloc(A, {S, D})
                         : Tensor();
  auto merger = [&](MergerBuffers& m, int64_t norm_rows) {
    m.ln = a.alloc(A, {Sm, M});
    m.mean = a.alloc(F, {norm_rows});
    m.rstd = a.alloc(F, {norm_rows});
    m.fc1 = a.alloc(A, {Sm, M});
    m.act = a.alloc(A, {Sm, M});
    m.out = a.alloc(A, {Sm, out});
  };
  merger(merger_, S);
  // Stage 0 runs every DeepStack merger; a later stage keeps only the features that cross it
  // (those injected at its layers or after), as they arrive.
  ds_.assign(v.deepstack_visual_indexes.size(), {});
  for (size_t k = 0; k < ds_.size(); ++k) {
    if (st.has_vision)
      merger(ds_[k], Sm);
    else if (static_cast<int>(k) >= st.first_layer)
      ds_[k].out = a.alloc(A, {Sm_all, out});
  }

  // One adapter scratch per tower, shared by its layers' forwards and backwards.
  const LoraScratchSizes lora = lora_scratch_sizes(cfg_);
  t_lora_ = allocate_lora_scratch(a, A, L, lora.text);
  v_lora_ = allocate_lora_scratch(a, A, S, lora.vision);
  merger_.lora = allocate_lora_scratch(a, A, Sm, lora.merger);
  lora_seed_ = lora.text.dropout || lora.vision.dropout || lora.merger.dropout
                   ? a.alloc(DType::i64, {1})
                   : Tensor();

  // Offloaded kinds take two slots each (layer l's in slot l % 2) instead of one tensor a layer.
  offload_.clear();
  auto offload_slot = [&](Tensor DecoderLayerBuffers::*field, DType dt,
                          const std::vector<int64_t>& shape, size_t l) {
    auto it = std::find_if(offload_.begin(), offload_.end(),
                           [field](const OffloadKind& k) { return k.field == field; });
    if (it == offload_.end()) {
      OffloadKind k;
      k.field = field;
      for (Tensor& slot : k.slots) slot = a.alloc(dt, shape);
      offload_.push_back(k);
      it = offload_.end() - 1;
    }
    return it->slots[l % 2];
  };
  DecoderLayerBuffers ts;  // the tensors the layers share
  auto l_buf = [&](bool own, Tensor DecoderLayerBuffers::*field, DType dt,
                   std::vector<int64_t> shape, size_t l) {
    if (own && offloads(field)) return offload_slot(field, dt, shape, l);
    return v_buf(own, ts.*field, dt, shape);
  };
  tx_.assign(static_cast<size_t>(t.num_hidden_layers) + 1, Tensor());
  for (int l = st.first_layer; l <= st.end_layer; ++l)
    tx_[l] = offloads(&DecoderLayerBuffers::x_in)
                 ? offload_slot(&DecoderLayerBuffers::x_in, A, {Ls, H}, static_cast<size_t>(l))
                 : a.alloc(A, {Ls, H});
  tl_.assign(static_cast<size_t>(t.num_hidden_layers), {});
  const int nqk = t.num_attention_heads + t.num_key_value_heads;
  const bool t_keep_all = rc == Recompute::none, t_keep_layer = rc != Recompute::full;
  using B = DecoderLayerBuffers;
  for (auto l = static_cast<size_t>(st.first_layer); l < static_cast<size_t>(st.end_layer); ++l) {
    DecoderLayerBuffers& x = tl_[l];
    x.x_in = tx_[l];
    x.x_out = tx_[l + 1];
    x.rms1 = l_buf(t_keep_all, &B::rms1, A, {L, H}, l);
    x.rstd1 = l_buf(t_keep_layer, &B::rstd1, F, {L}, l);
    x.qkv_lin = l_buf(t_keep_layer, &B::qkv_lin, A, {L, t.qkv_width()}, l);
    x.qk_rstd = l_buf(t_keep_layer, &B::qk_rstd, F, {L, nqk}, l);
    x.qkv = l_buf(t_keep_all, &B::qkv, A, {L, t.qkv_width()}, l);
    x.attn = l_buf(t_keep_layer, &B::attn, A, {L, t.q_width()}, l);
    x.lse = l_buf(t_keep_layer, &B::lse, F, {L, t.num_attention_heads}, l);
    x.x_mid = l_buf(t_keep_layer, &B::x_mid, A, {L, H}, l);
    x.rms2 = l_buf(t_keep_all, &B::rms2, A, {L, H}, l);
    x.rstd2 = l_buf(t_keep_layer, &B::rstd2, F, {L}, l);
    if (!t.sparse_layer(static_cast<int>(l))) {
      x.gate_up = l_buf(t_keep_layer, &B::gate_up, A, {L, 2 * int64_t(t.intermediate_size)}, l);
      x.act = l_buf(t_keep_all, &B::act, A, {L, t.intermediate_size}, l);
      continue;
    }
    // A sparse layer's routing and expert rows, kept as the dense MLP's are; its logits are
    // never read again.
    const int64_t E = t.num_experts, k = t.num_experts_per_tok, Ie = t.moe_intermediate_size;
    const MoeCapacity& rule = limits_.moe_capacity;
    const int64_t R = moe_sorted_rows(t, rule, L);
    MoeBuffers& m = x.moe;
    m.capacity_rule = rule;
    m.logits = v_buf(false, ts.moe.logits, A, {L, E});
    m.probs = v_buf(t_keep_layer, ts.moe.probs, F, {L, E});
    m.ids = v_buf(t_keep_layer, ts.moe.ids, I32, {L, k});
    if (rule.drops()) m.kept_ids = v_buf(t_keep_layer, ts.moe.kept_ids, I32, {L, k});
    m.weights = v_buf(t_keep_layer, ts.moe.weights, A, {L, k});
    m.offsets = v_buf(t_keep_layer, ts.moe.offsets, I32, {E + 1});
    m.slot_rows = v_buf(t_keep_layer, ts.moe.slot_rows, I32, {L, k});
    m.x_sorted = v_buf(t_keep_layer, ts.moe.x_sorted, A, {R, H});
    m.gate_up = v_buf(t_keep_layer, ts.moe.gate_up, A, {R, 2 * Ie});
    m.act = v_buf(t_keep_all, ts.moe.act, A, {R, Ie});
    m.y_sorted = v_buf(t_keep_layer, ts.moe.y_sorted, A, {R, H});
  }
  t_recompute_out_ = rc == Recompute::full ? a.alloc(A, {L, H}) : Tensor();
  activation_bytes_ = a.used() - activations_start;
  // The host keeps every layer's part of each offloaded kind (the x_in kind: the layers' inputs).
  offload_host_bytes_ = 0;
  for (OffloadKind& k : offload_) {
    k.layer_bytes =
        (static_cast<size_t>(k.slots[0].numel()) * dtype_size(k.slots[0].dtype) + 63) / 64 * 64;
    k.host_offset = offload_host_bytes_;
    offload_host_bytes_ += k.layer_bytes * static_cast<size_t>(st.end_layer - st.first_layer);
  }
  if (st.has_head) {
    final_ = a.alloc(A, {Ls, H});
    final_rstd_ = a.alloc(F, {L});
    xlab_ = a.alloc(A, {L, H});
    dxlab_ = a.alloc(A, {L, H});
    loss_chunk_ = std::min(limits_.loss_chunk_rows, L);
    const size_t ws = loss_workspace_bytes_(loss_chunk_, H, t.vocab_size);
    loss_workspace_ = a.alloc(F, {static_cast<int64_t>((ws + sizeof(float) - 1) / sizeof(float))});
  }

  // Where the compute dtype is f32 the GEMMs read the f32 residual gradient itself.
  const bool f32_compute = A == F;
  t_dres_ = a.alloc(F, {Ls, H});
  t_dres_c_ = f32_compute ? t_dres_ : a.alloc(A, {L, H});
  // The input-side gradients that feed the norms' backwards stay f32: one bf16 rounding fewer on
  // the residual path (the CUDA golden gradients gained from it).
  t_dtmp_ = a.alloc(F, {Ls, H});
  t_dloss_ = f32_compute || !st.has_head ? t_dtmp_ : a.alloc(A, {Ls, H});
  t_dattn_ = a.alloc(A, {L, t.q_width()});
  t_dqkv_ = a.alloc(A, {L, t.qkv_width()});
  t_dgu_ = a.alloc(A, {L, 2 * int64_t(t.intermediate_size)});
  t_dact_ = a.alloc(A, {L, t.intermediate_size});
  t_dsum_ = a.alloc(F, {L, t.num_attention_heads});
  moe_layers_ = 0;
  for (int l = st.first_layer; l < st.end_layer; ++l) moe_layers_ += t.sparse_layer(l);
  if (moe_layers_ > 0) {
    t_moe_ = allocate_moe_grad_scratch(a, A, t, L, limits_.moe_capacity);
    if (limits_.moe_capacity.drops()) moe_dropped_ = a.alloc(I32, {1});
    text_real_rows_ = a.alloc(I32, {1});
    moe_load_ = a.alloc(F, {t.num_experts});
    moe_prob_sum_ = a.alloc(F, {t.num_experts});
    moe_aux_sum_ = a.alloc(F, {1});
    moe_aux_dprob_ = a.alloc(F, {t.num_experts});
  }
  v_dres_ = a.alloc(F, {S, D});
  v_dres_c_ = f32_compute ? v_dres_ : a.alloc(A, {S, D});
  v_dtmp_ = a.alloc(F, {S, D});
  v_dattn_ = a.alloc(A, {S, D});
  v_dqkv_ = a.alloc(A, {S, 3 * D});
  v_dfc_ = a.alloc(A, {S, Iv});
  v_dup_ = v.tower->mlp_up_width(v) == Iv ? v_dfc_ : a.alloc(A, {S, v.tower->mlp_up_width(v)});
  v_dsum_ = a.alloc(F, {S, nh});
  m_da_ = a.alloc(A, {Sm, M});
  m_dln_ = a.alloc(F, {Sm, M});
  d_embeds_ = a.alloc(A, {Sm, out});
  d_ds_.assign(v.deepstack_visual_indexes.size(), Tensor());
  for (size_t k = 0; k < d_ds_.size(); ++k)
    if (st.has_vision || static_cast<int>(k) >= st.first_layer)
      d_ds_[k] = a.alloc(A, {Sm_all, out});
}

const std::array<Tensor TrainableQwen3VL::*, TrainableQwen3VL::kInputs>&
TrainableQwen3VL::input_members() {
  static const std::array<Tensor TrainableQwen3VL::*, kInputs> members = {
      &TrainableQwen3VL::ids_,        &TrainableQwen3VL::pad_rows_,
      &TrainableQwen3VL::label_rows_, &TrainableQwen3VL::targets_,
      &TrainableQwen3VL::positions_,  &TrainableQwen3VL::text_cu_,
      &TrainableQwen3VL::grad_scale_, &TrainableQwen3VL::pixels_,
      &TrainableQwen3VL::v_grids_,    &TrainableQwen3VL::text_real_rows_,
      &TrainableQwen3VL::lora_seed_};
  return members;
}

TrainableQwen3VL::BatchShape TrainableQwen3VL::shape() const {
  return BatchShape{padded_, L_, S_, n_pad_, n_label_, n_segments_, n_text_segments_, n_windows_};
}

void TrainableQwen3VL::set_shape(const BatchShape& s) {
  padded_ = s.padded, L_ = s.L, S_ = s.S, n_pad_ = s.n_pad, n_label_ = s.n_label;
  n_segments_ = s.n_segments, n_text_segments_ = s.n_text_segments, n_windows_ = s.n_windows;
}

size_t TrainableQwen3VL::write_bytes_per_micro_batch() const {
  size_t bytes = 0;
  for (Tensor TrainableQwen3VL::*m : input_members()) {
    const Tensor& t = this->*m;
    if (t.defined())
      bytes += (static_cast<size_t>(t.numel()) * dtype_size(t.dtype) + 255) / 256 * 256;
  }
  return bytes;
}

void TrainableQwen3VL::zero_grads() {
  // Weights of one config share one layout in every dtype, so the gradients are one flat span.
  if (grads_->arena.capacity() == 0) return;
  be_.fill_zero(Tensor(grads_->arena.base(), DType::f32, be_.device(),
                       {static_cast<int64_t>(grads_->arena.capacity() / sizeof(float))}));
}

void TrainableQwen3VL::set_frozen(bool vision_tower, bool merger, bool language_model) {
  IRIS_CHECK(vision_tower || !limits_.vision_tower_frozen,
             "this model's memory was planned with the vision tower frozen (it keeps no block "
             "activations), so the tower cannot be unfrozen; plan it with "
             "TrainLimits.vision_tower_frozen = false");
  const FreezeSpec wanted{vision_tower, merger, language_model, limits_.frozen.modules_to_save};
  for (const WeightBinding& b : grads_->bindings)
    IRIS_CHECK(wanted.frozen(b.hf_name) || b.allocated(), "'", b.hf_name,
               "' belongs to a part this model was planned with frozen (TrainLimits.frozen), "
               "which holds no gradient; plan the model with that part trainable to train it");
  frozen_ = wanted;
  // A part trains when any of its tensors does: its own weights, a module to save or an adapter.
  trains_lm_ = trains_tower_ = trains_merger_ = false;
  for (const WeightBinding& b : grads_->bindings) {
    if (!b.allocated() || frozen_.frozen(b.hf_name)) continue;
    switch (model_part(b.hf_name)) {
      case ModelPart::language_model:
        trains_lm_ = true;
        break;
      case ModelPart::vision_tower:
        trains_tower_ = true;
        break;
      case ModelPart::merger:
        trains_merger_ = true;
        break;
    }
  }
  // Graph keys name the frozen parts, so graphs of the old setting are simply never replayed;
  // freeing them keeps memory from growing with every change.
  delete_graphs();
  for (const WeightBinding& b : grads_->bindings)
    if (frozen_.frozen(b.hf_name) && b.allocated()) be_.fill_zero(b.tensor());
}

LossStats TrainableQwen3VL::forward(const std::vector<const TrainSample*>& batch) {
  return run_and_read(batch, false, 0.0f);
}

LossStats TrainableQwen3VL::forward_backward(const std::vector<const TrainSample*>& batch,
                                             float grad_scale) {
  return run_and_read(batch, true, grad_scale);
}

int64_t TrainableQwen3VL::queue_forward_backward(const std::vector<const TrainSample*>& batch,
                                                 float grad_scale) {
  run(batch, true, grad_scale, loss_total_);
  return n_label_real_;
}

namespace {

// Sets a flag for a scope, and clears it on every way out.
class FlagScope {
 public:
  FlagScope(bool& flag, bool value) : flag_(flag) { flag_ = value; }
  ~FlagScope() { flag_ = false; }
  FlagScope(const FlagScope&) = delete;
  FlagScope& operator=(const FlagScope&) = delete;

 private:
  bool& flag_;
};

}  // namespace

int64_t TrainableQwen3VL::queue_step(
    const std::vector<std::vector<const TrainSample*>>& micro_batches, float grad_scale) {
  int64_t labelled = 0;
  const size_t n = micro_batches.size();
  micro_batches_in_step_ = static_cast<int>(std::max<size_t>(n, 1));
  struct ResetCount {
    int& count;
    ~ResetCount() { count = 1; }
  } reset_count{micro_batches_in_step_};
  if (graph_api_ == nullptr || graphs_.decoder != GraphImpl::full_iteration || n < 2 ||
      n > slots_.size()) {
    for (size_t i = 0; i < n; ++i) {
      const FlagScope last(last_backward_, i + 1 == n);
      labelled += queue_forward_backward(micro_batches[i], grad_scale);
    }
    return labelled;
  }
  // The inputs of every micro-batch go up before any of them runs: the graph of the step reads
  // each from its own slot.
  for (size_t i = 0; i < n; ++i) {
    use_slot(i);
    prepare(micro_batches[i]);
    write_step_values(grad_scale, true);
    slots_[i].shape = shape();
    slots_[i].n_label_real = n_label_real_;
    slots_[i].n_text_real = n_text_real_;
    labelled += n_label_real_;
  }
  // One graph when every micro-batch has the shape (and so the host values) of the first, and
  // each one's backward runs.
  const BatchShape& first = slots_[0].shape;
  bool one_shape = first.padded;
  for (size_t i = 0; i < n && one_shape; ++i)
    one_shape = slots_[i].shape == first && slots_[i].n_label_real > 0;
  const bool lm = trains_lm_;
  const bool vision_grads = first.S > 0 && (trains_tower_ || trains_merger_);
  if (one_shape && (lm || vision_grads)) {
    graphed(str_cat("step of ", n, " micro-batches fwd+bwd L", first.L, " S", first.S, " labels ",
                    first.n_label, " frozen ", int(!trains_tower_), int(!trains_merger_),
                    int(!trains_lm_)),
            [this, n, vision_grads] {
              for (size_t i = 0; i < n; ++i) {
                use_slot(i);
                micro_batch(true, vision_grads, loss_total_, false);
              }
            });
    if (moe_layers_ > 0) moe_aux_runs_ += static_cast<int64_t>(n);
    for (size_t i = 0; i < n; ++i) moe_routed_slots_ += routed_slots(slots_[i].n_text_real);
  } else {
    for (size_t i = 0; i < n; ++i) {
      move_into_own_inputs(i);
      const FlagScope last(last_backward_, i + 1 == n);
      run_prepared(true, loss_total_);
    }
  }
  use_slot(0);
  return labelled;
}

void TrainableQwen3VL::move_into_own_inputs(size_t i) {
  if (i != 0) {
    const InputSlot& s = slots_[i];
    InputSlot& own = slots_[0];
    // The rows of each input (in input_members' order) that prepare() wrote; -1: all of it.
    const BatchShape& b = s.shape;
    const int64_t rows[kInputs] = {b.L, b.n_pad, b.n_label,        b.n_label, b.L, -1,
                                   -1,  b.S,     b.S > 0 ? -1 : 0, -1,        -1};
    for (size_t k = 0; k < kInputs; ++k) {
      if (!own.inputs[k].defined()) continue;  // an input this model does not have
      if (rows[k] < 0)
        be_.copy(own.inputs[k], s.inputs[k]);
      else if (rows[k] > 0)
        be_.copy(own.inputs[k].slice(0, rows[k]), s.inputs[k].slice(0, rows[k]));
    }
    own.shape = s.shape;
    own.n_label_real = s.n_label_real;
    own.n_text_real = s.n_text_real;
  }
  use_slot(0);
}

void TrainableQwen3VL::plan_input_slots(int n) {
  slots_.assign(static_cast<size_t>(std::max(n, 1)), InputSlot{});
  for (size_t k = 0; k < kInputs; ++k) slots_[0].inputs[k] = this->*input_members()[k];
  auto place = [&](Arena& a) {
    for (size_t i = 1; i < slots_.size(); ++i)
      for (size_t k = 0; k < kInputs; ++k) {
        const Tensor& own = slots_[0].inputs[k];
        if (own.defined()) slots_[i].inputs[k] = a.alloc(own.dtype, own.dims());
      }
  };
  Arena plan;
  place(plan);
  slot_arena_ = Arena();
  if (plan.used() == 0) return;
  slot_arena_ = Arena(be_, plan.used());
  place(slot_arena_);
  // As the model's own arena: rows a padded micro-batch gathers but never writes are finite.
  be_.fill_zero(Tensor(slot_arena_.base(), DType::f32, be_.device(),
                       {static_cast<int64_t>(slot_arena_.capacity() / sizeof(float))}));
}

void TrainableQwen3VL::set_dropout_step(uint64_t seed, int64_t step,
                                        std::vector<int64_t> micro_batch_ids) {
  SplitMix64 mix(seed ^ (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ULL));
  dropout_base_ = mix.next();
  dropout_micro_batches_ = 0;
  dropout_ids_ = std::move(micro_batch_ids);
}

void TrainableQwen3VL::write_step_values(float grad_scale, bool training) {
  be_.write(grad_scale_, &grad_scale, DType::f32);
  if (!lora_seed_.defined()) return;
  // Each training micro-batch its own masks; evaluation none (a negative seed).
  int64_t seed = -1;
  if (training) {
    const int64_t k = dropout_micro_batches_++;
    const int64_t id = k < static_cast<int64_t>(dropout_ids_.size()) ? dropout_ids_[size_t(k)] : k;
    SplitMix64 mix(dropout_base_ + static_cast<uint64_t>(id));
    seed = static_cast<int64_t>(mix.next() >> 1);
  }
  be_.write(lora_seed_, &seed, DType::i64);
}

void TrainableQwen3VL::use_slot(size_t i) {
  const InputSlot& s = slots_[i];
  for (size_t k = 0; k < kInputs; ++k) this->*input_members()[k] = s.inputs[k];
  set_shape(s.shape);
  n_label_real_ = s.n_label_real;
  n_text_real_ = s.n_text_real;
}

std::pair<int64_t, int64_t> TrainableQwen3VL::take_moe_drops() {
  if (!moe_dropped_.defined()) return {0, 0};
  int32_t dropped = 0;
  be_.read(&dropped, DType::i32, moe_dropped_);
  be_.fill_zero(moe_dropped_);
  const int64_t routed = moe_routed_slots_;
  moe_routed_slots_ = 0;
  return {dropped, routed};
}

std::pair<double, int64_t> TrainableQwen3VL::take_moe_aux_loss() {
  if (moe_layers_ == 0) return {0.0, 0};
  float sum = 0.0f;
  be_.read(&sum, DType::f32, moe_aux_sum_);
  be_.fill_zero(moe_aux_sum_);
  const int64_t runs = moe_aux_runs_;
  moe_aux_runs_ = 0;
  return {sum, runs};
}

double TrainableQwen3VL::take_loss_sum() {
  float total = 0.0f;
  be_.read(&total, DType::f32, loss_total_);
  be_.fill_zero(loss_total_);
  return total;
}

LossStats TrainableQwen3VL::run_and_read(const std::vector<const TrainSample*>& batch,
                                         bool backward, float grad_scale) {
  be_.fill_zero(loss_sum_);
  run(batch, backward, grad_scale, loss_sum_);
  float loss_sum = 0.0f;
  be_.read(&loss_sum, DType::f32, loss_sum_);
  return LossStats{loss_sum, n_label_real_};
}

void TrainableQwen3VL::prepare(const std::vector<const TrainSample*>& batch) {
  struct Timed {
    double& total;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~Timed() {
      total += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
  } timed{host_seconds_.prepare};
  const VisionConfig& v = cfg_.vision;
  const TextConfig& t = cfg_.text;
  IRIS_CHECK(!batch.empty(), "the micro-batch has no samples");
  IRIS_CHECK(static_cast<int>(batch.size()) <= limits_.max_samples, "the micro-batch has ",
             batch.size(), " samples, more than the ", limits_.max_samples, " planned");
  int64_t L = 0, S = 0;
  size_t n_images = 0;
  for (const TrainSample* s : batch) {
    const int64_t n = static_cast<int64_t>(s->ids.size());
    IRIS_CHECK(n > 0, "a training sample has no tokens");
    IRIS_CHECK(s->labels.size() == s->ids.size(), "the sample has ", s->labels.size(),
               " labels for ", n, " tokens; labels must align with ids (unshifted, -100 = none)");
    const int64_t patches = count_patches(s->grids);
    IRIS_CHECK(static_cast<int64_t>(s->pixel_values.size()) == patches * v.patch_dim(),
               "the sample has ", s->pixel_values.size(), " pixel values; its grids need ", patches,
               " patches x ", v.patch_dim());
    L += n;
    S += patches;
    // Each video frame pair is an attention segment, as an image is.
    for (const GridTHW& g : s->grids) n_images += static_cast<size_t>(g[0]);
  }
  IRIS_CHECK(L <= limits_.max_seq_len, "the micro-batch has ", L,
             " tokens, more than the planned maximum of ", limits_.max_seq_len,
             " (raise train.seq_length or truncate the samples)");
  IRIS_CHECK(static_cast<int64_t>(n_images) <= limits_.max_images, "the micro-batch has ", n_images,
             " images and video frame pairs, more than the planned ", limits_.max_images);
  IRIS_CHECK(S <= limits_.max_patches, "the micro-batch's images have ", S,
             " patches, more than the planned maximum of ", limits_.max_patches,
             " (train.max_vision_patches)");

  // The buckets this micro-batch pads up to, if it fits under the largest ones.
  auto bucket_for = [](const std::vector<int64_t>& buckets, int64_t n) -> int64_t {
    for (int64_t b : buckets)
      if (b >= n) return b;
    return -1;
  };
  int64_t Lb = L, Sb = S;
  padded_ = false;
  if (!limits_.text_buckets.empty()) {
    const int64_t lb = bucket_for(limits_.text_buckets, L);
    const int64_t sb = S == 0 ? 0 : bucket_for(limits_.vision_buckets, S);
    if (lb > 0 && sb >= 0) {
      padded_ = true;
      Lb = lb;
      Sb = sb;
    } else {
      IRIS_CHECK(!(graph_api_ != nullptr && graphs_.overflow_is_error), "the micro-batch has ", L,
                 " tokens and ", S, " vision patches, above the largest graph buckets (",
                 limits_.text_buckets.back(), " tokens, ",
                 limits_.vision_buckets.empty() ? 0 : limits_.vision_buckets.back(),
                 " patches); raise cuda_graph.max_vision_cuda_graph_seq_length or set "
                 "cuda_graph.vision_cuda_graph_overflow: eager");
      ++overflow_runs_;
    }
  }
  padding_.tokens += L;
  padding_.padded_tokens += Lb;
  padding_.patches += S;
  padding_.padded_patches += Sb;

  h_ids_.resize(static_cast<size_t>(Lb));
  h_pad_rows_.clear();
  h_label_rows_.clear();
  h_targets_.clear();
  h_text_cu_.assign(1, 0);
  h_positions_.resize(static_cast<size_t>(Lb * 3));
  std::vector<GridTHW> grids;
  int64_t row = 0, patch_row = 0;
  for (const TrainSample* s : batch) {
    const int64_t n = static_cast<int64_t>(s->ids.size());
    int64_t n_pad = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (s->ids[i] == cfg_.image_token_id || s->ids[i] == cfg_.video_token_id) {
        h_pad_rows_.push_back(static_cast<int32_t>(row + i));
        ++n_pad;
      }
    }
    IRIS_CHECK(n_pad * v.merge_unit() == count_patches(s->grids), "the sample has ", n_pad,
               " <|image_pad|> and <|video_pad|> tokens but its images and videos produce ",
               count_patches(s->grids) / v.merge_unit(), " merged embeddings");
    IRIS_CHECK(!s->runs.empty() ||
                   std::find(s->ids.begin(), s->ids.end(), cfg_.video_token_id) == s->ids.end(),
               "a sample with <|video_pad|> tokens needs its vision runs (Sample::runs)");
    // HF shift: position i predicts labels[i + 1]; labels[0] is never a target, and no target
    // crosses into the next sample.
    for (int64_t i = 0; i + 1 < n; ++i) {
      const int32_t y = s->labels[i + 1];
      if (y == kIgnoreIndex) continue;
      IRIS_CHECK(y >= 0 && y < t.vocab_size, "label ", y, " at position ", i + 1,
                 " is outside the vocabulary of ", t.vocab_size, " (use -100 for no label)");
      h_label_rows_.push_back(static_cast<int32_t>(row + i));
      h_targets_.push_back(y);
    }
    // A video pad goes to the device as an image pad: both rows are overwritten by the vision
    // scatter, and the embedding's backward skips the image pad id, so neither kind gives the
    // embedding table a gradient (as HF, whose pad embeddings are replaced by masked_scatter).
    std::transform(s->ids.begin(), s->ids.end(), h_ids_.begin() + row, [&](int32_t id) {
      return id == cfg_.video_token_id ? cfg_.image_token_id : id;
    });
    const RopeIndex rope = compute_rope_index(
        s->ids,
        s->runs.empty() ? image_runs(s->grids, cfg_.image_token_id, v.spatial_merge_size) : s->runs,
        cfg_.image_token_id, cfg_.video_token_id);
    mrope_positions_token_major(rope.positions.data(), n, h_positions_.data() + row * 3);
    const int64_t patches = count_patches(s->grids);
    if (patches > 0 && limits_.stage.has_vision) {
      const float* pixels = s->pixel_values.data();
      if (v.window_units() > 0) {
        // The tower computes in window order (VisionConfig::window_size); a sample's windows are
        // its own, so each sample's rows are reordered on their own.
        h_window_pixels_.resize(s->pixel_values.size());
        to_window_order(v, vision_unit_order(v, s->grids, patches), pixels,
                        h_window_pixels_.data());
        pixels = h_window_pixels_.data();
      }
      be_.write(pixels_.slice(patch_row, patch_row + patches), pixels, DType::f32);
    }
    patch_row += patches;
    grids.insert(grids.end(), s->grids.begin(), s->grids.end());
    row += n;
    h_text_cu_.push_back(static_cast<int32_t>(row));
  }
  if (v.window_units() > 0 && !h_pad_rows_.empty()) {
    // Merged row j of the tower's output is raster unit order[j]: its embedding goes to that
    // unit's pad token.
    const std::vector<int32_t> order = vision_unit_order(v, grids, 0);
    std::vector<int32_t> raster = h_pad_rows_;
    for (size_t j = 0; j < order.size(); ++j)
      h_pad_rows_[j] = raster[static_cast<size_t>(order[j])];
  }
  n_label_real_ = static_cast<int64_t>(h_label_rows_.size());
  n_text_segments_ = static_cast<int>(batch.size());
  if (padded_) {
    // Padding tokens: id 0 at position 0 in a causal segment of their own, no labels. Padding
    // label slots and merged vision rows point at the sink row past the bucket, which no layer
    // reads; their targets are ignored, so they add no loss and a zero gradient.
    std::fill(h_ids_.begin() + L, h_ids_.end(), 0);
    std::fill(h_positions_.begin() + L * 3, h_positions_.end(), 0);  // cos 1, sin 0
    if (Lb > L) h_text_cu_.push_back(static_cast<int32_t>(Lb));
    n_text_segments_ = limits_.max_samples + 1;
    // Under full_iteration the loss is captured, and its label slot count is a host value that
    // the graph keeps: the slots pad to loss_label_slots' sizes rather than to the bucket, which
    // would run the lm_head over rows only the sink holds (a 4096-token sample with 1,650
    // labels: 2.5x its loss work). Elsewhere the loss runs eagerly between graphs and takes the
    // real count: padded slots would cost lm_head rows for nothing.
    if (graph_api_ != nullptr && graphs_.decoder == GraphImpl::full_iteration) {
      const int64_t label_slots = loss_label_slots(n_label_real_, Lb);
      h_label_rows_.resize(static_cast<size_t>(label_slots), static_cast<int32_t>(Lb));
      h_targets_.resize(static_cast<size_t>(label_slots), kIgnoreIndex);
    }
    h_pad_rows_.resize(static_cast<size_t>(Sb / v.merge_unit()), static_cast<int32_t>(Lb));
  }
  L_ = Lb;
  S_ = Sb;
  n_pad_ = static_cast<int64_t>(h_pad_rows_.size());
  n_label_ = static_cast<int64_t>(h_label_rows_.size());
  padding_.labels += n_label_real_;
  padding_.label_slots += n_label_;
  h_text_cu_.resize(static_cast<size_t>(limits_.max_samples) + 2, h_text_cu_.back());

  be_.write(ids_.slice(0, Lb), h_ids_.data(), DType::i32);
  n_text_real_ = L;
  if (text_real_rows_.defined()) {
    const int32_t real = static_cast<int32_t>(L);
    be_.write(text_real_rows_, &real, DType::i32);
  }
  be_.write(positions_.slice(0, Lb), h_positions_.data(), DType::i32);
  be_.write(text_cu_, h_text_cu_.data(), DType::i32);
  if (n_pad_ > 0) be_.write(pad_rows_.slice(0, n_pad_), h_pad_rows_.data(), DType::i32);
  if (n_label_ > 0) {
    be_.write(label_rows_.slice(0, n_label_), h_label_rows_.data(), DType::i32);
    be_.write(targets_.slice(0, n_label_), h_targets_.data(), DType::i32);
  }
  if (S > 0 && limits_.stage.has_vision) {
    // Padded: the padding rows form the last segment, and the segment count is the capacity
    // (zero-length segments at the tail), so that it is the same for every micro-batch. Only
    // the grids go up; vision_forward computes the tables from them.
    const int capacity = vision_segment_capacity();
    const VisionCall call = plan_vision_call(v, grids, padded_ ? Sb : 0, capacity);
    n_segments_ = padded_ ? capacity : call.n_segments;
    n_windows_ = padded_ ? vision_window_capacity(v, Sb) : call.n_windows;
    pack_vision_grids(grids, capacity, h_grids_);
    be_.write(v_grids_, h_grids_.data(), DType::i32);
    if (Sb > S) be_.fill_zero(pixels_.slice(S, Sb));
  }
}

void TrainableQwen3VL::run(const std::vector<const TrainSample*>& batch, bool backward,
                           float grad_scale, const Tensor& loss_out) {
  IRIS_CHECK(limits_.stage.count == 1, "pipeline ", limits_.stage.describe(),
             " holds part of the model: run it with stage_prepare, stage_forward and "
             "stage_backward, its neighbours' tensors handed over between them");
  prepare(batch);
  write_step_values(grad_scale, backward);
  run_prepared(backward, loss_out);
}

void TrainableQwen3VL::run_prepared(bool backward, const Tensor& loss_out) {
  run_prepared_micro_batch(backward, loss_out);
  if (backward && layer_hook_) layer_hook_(-1, LayerPass::backward, false);
}

void TrainableQwen3VL::layer_event(int layer, LayerPass pass, bool begin) {
  if (!layer_hook_) return;
  IRIS_CHECK(graph_bodies_ == 0,
             "sharding by layer gathers each decoder layer's weights and sums its gradients "
             "between graphs; it cannot run inside a full_iteration graph");
  layer_hook_(layer, pass, begin);
}

void TrainableQwen3VL::run_prepared_micro_batch(bool backward, const Tensor& loss_out) {
  const bool lm = trains_lm_;
  const bool vision_grads = S_ > 0 && (trains_tower_ || trains_merger_);
  backward = backward && n_label_real_ > 0 && (lm || vision_grads);
  if (moe_layers_ > 0 && backward) {
    ++moe_aux_runs_;
    moe_routed_slots_ += routed_slots(n_text_real_);
  }
  // Graphs serve the trainer's path (the loss adds into loss_total_) on padded micro-batches.
  const bool graphs = graph_api_ != nullptr && padded_ && loss_out.data == loss_total_.data;
  if (!graphs) {
    micro_batch(backward, vision_grads, loss_out, false);
    return;
  }
  // A key names every host value its body passes to an op: the shapes (bucket lengths, merged
  // rows), the phase and what is frozen. Everything else the body reads is in device memory.
  const std::string shape = str_cat("L", L_, " S", S_, " labels ", n_label_, " frozen ",
                                    int(!trains_tower_), int(!trains_merger_), int(!trains_lm_));
  if (graphs_.decoder == GraphImpl::full_iteration) {
    graphed(str_cat("micro-batch ", backward ? "fwd+bwd " : "fwd ", shape),
            [this, backward, vision_grads, loss_out] {
              micro_batch(backward, vision_grads, loss_out, false);
            });
    return;
  }
  micro_batch(backward, vision_grads, loss_out, graphs_.decoder == GraphImpl::local);
}

void TrainableQwen3VL::micro_batch(bool backward, bool vision_grads, const Tensor& loss_out,
                                   bool layer_graphs) {
  forward_part(backward, loss_out, layer_graphs);
  if (backward) backward_part(vision_grads, layer_graphs);
}

void TrainableQwen3VL::forward_part(bool backward, const Tensor& loss_out, bool layer_graphs) {
  // Inside a full_iteration capture the vision encoder runs in the enclosing body; otherwise it
  // may replay graphs of its own.
  const bool vision_graphs = graph_api_ != nullptr && padded_ && graphs_.vision &&
                             graphs_.decoder != GraphImpl::full_iteration;
  const bool whole_encoder = vision_graphs && graphs_.vision_modules.empty();
  const bool vision_modules = vision_graphs && !graphs_.vision_modules.empty();
  const std::string vkey = str_cat("S", S_, " frozen ", int(!trains_tower_), int(!trains_merger_));
  if (S_ > 0 && limits_.stage.has_vision)
    maybe_graphed(whole_encoder, str_cat("vision fwd ", vkey),
                  [this, vision_modules] { vision_forward(vision_modules); });
  text_forward(layer_graphs, backward, loss_out);
}

void TrainableQwen3VL::backward_part(bool vision_grads, bool layer_graphs) {
  const bool vision_graphs = graph_api_ != nullptr && padded_ && graphs_.vision &&
                             graphs_.decoder != GraphImpl::full_iteration;
  const bool whole_encoder = vision_graphs && graphs_.vision_modules.empty();
  const bool vision_modules = vision_graphs && !graphs_.vision_modules.empty();
  const std::string vkey = str_cat("S", S_, " frozen ", int(!trains_tower_), int(!trains_merger_));
  text_backward(layer_graphs);
  if (vision_grads && limits_.stage.has_vision) {
    maybe_graphed(whole_encoder, str_cat("vision bwd ", vkey),
                  [this, vision_modules] { vision_backward(vision_modules); });
    // All of them again: the hook was silent inside a whole-encoder graph.
    vision_gradients_final();
  }
}

void TrainableQwen3VL::gradient_final(const Tensor& grad) {
  if (last_backward_ && graph_bodies_ == 0 && gradients_final_ && grad.defined())
    gradients_final_(grad);
}

namespace {

// Every tensor of a layer's, block's or merger's weights (a gradient the backward of that part
// writes).
template <class F>
void each_tensor(const LoraAdapters& adapters, F f) {
  for (const LoraAdapter& p : adapters.parts) {
    f(p.a);
    f(p.b);
  }
}
template <class F>
void each_tensor(const DecoderLayerWeights& w, F f) {
  for (const Tensor* t :
       {&w.input_norm_w, &w.qkv_w, &w.qkv_b, &w.q_norm_w, &w.k_norm_w, &w.o_w, &w.post_norm_w,
        &w.gate_up_w, &w.down_w, &w.router_w, &w.experts_gate_up_w, &w.experts_down_w})
    f(*t);
  for (const LoraAdapters* ad : {&w.qkv_lora, &w.o_lora, &w.gate_up_lora, &w.down_lora})
    each_tensor(*ad, f);
}
template <class F>
void each_tensor(const VisionBlockWeights& w, F f) {
  for (const Tensor* t : {&w.norm1_w, &w.norm1_b, &w.qkv_w, &w.qkv_b, &w.proj_w, &w.proj_b,
                          &w.norm2_w, &w.norm2_b, &w.fc1_w, &w.fc1_b, &w.fc2_w, &w.fc2_b})
    f(*t);
  for (const LoraAdapters* ad : {&w.qkv_lora, &w.proj_lora, &w.fc1_lora, &w.fc2_lora})
    each_tensor(*ad, f);
}
template <class F>
void each_tensor(const PatchMergerWeights& w, F f) {
  for (const Tensor* t : {&w.norm_w, &w.norm_b, &w.fc1_w, &w.fc1_b, &w.fc2_w, &w.fc2_b}) f(*t);
  for (const LoraAdapters* ad : {&w.fc1_lora, &w.fc2_lora}) each_tensor(*ad, f);
}

}  // namespace

void TrainableQwen3VL::vision_gradients_final() {
  const VisionWeights& g = grads_->vision;
  auto mark = [this](const Tensor& t) { gradient_final(t); };
  each_tensor(g.merger, mark);
  for (int l = static_cast<int>(g.blocks.size()) - 1; l >= 0; --l) each_tensor(g.blocks[l], mark);
  for (const PatchMergerWeights& m : g.deepstack_mergers) each_tensor(m, mark);
  for (const Tensor* t : {&g.pos_embed, &g.patch_w, &g.patch_b}) mark(*t);
}

int64_t TrainableQwen3VL::stage_prepare(const std::vector<const TrainSample*>& batch,
                                        float grad_scale, bool forward_only) {
  prepare(batch);
  const bool lm = trains_lm_;
  stage_forward_only_ = forward_only;
  stage_vision_grads_ = S_ > 0 && (trains_tower_ || trains_merger_);
  stage_backward_ = !forward_only && n_label_real_ > 0 && (lm || stage_vision_grads_);
  write_step_values(grad_scale, !forward_only);
  return n_label_real_;
}

namespace {
bool graphs_full_iteration(const TrainGraphs& g) {
  return g.decoder == GraphImpl::full_iteration;
}
}  // namespace

double TrainableQwen3VL::take_forward_loss_sum() {
  float total = 0.0f;
  be_.read(&total, DType::f32, loss_sum_);
  be_.fill_zero(loss_sum_);
  return total;
}

void TrainableQwen3VL::stage_forward() {
  // Evaluation runs eagerly, as the whole model's forward() does.
  const bool graphs = graph_api_ != nullptr && padded_ && !stage_forward_only_;
  if (stage_forward_only_) {
    forward_part(false, loss_sum_, false);
    return;
  }
  if (graphs && graphs_full_iteration(graphs_)) {
    // The exchange with the neighbouring stages splits the micro-batch: its forward and its
    // backward are a graph each.
    graphed(
        str_cat("stage fwd", stage_backward_ ? "+loss grad " : " ", "L", L_, " S", S_, " labels ",
                n_label_, " frozen ", int(!trains_tower_), int(!trains_merger_), int(!trains_lm_)),
        [this] { forward_part(stage_backward_, loss_total_, false); });
    return;
  }
  forward_part(stage_backward_, loss_total_, graphs && graphs_.decoder == GraphImpl::local);
}

void TrainableQwen3VL::stage_backward(bool last_of_step) {
  IRIS_CHECK(stage_backward_, "stage_backward: this micro-batch has no backward");
  const FlagScope last(last_backward_, last_of_step);
  const bool graphs = graph_api_ != nullptr && padded_;
  if (graphs && graphs_full_iteration(graphs_)) {
    graphed(str_cat("stage bwd L", L_, " S", S_, " labels ", n_label_, " frozen ",
                    int(!trains_tower_), int(!trains_merger_), int(!trains_lm_)),
            [this] { backward_part(stage_vision_grads_, false); });
    return;
  }
  backward_part(stage_vision_grads_, graphs && graphs_.decoder == GraphImpl::local);
}

void TrainableQwen3VL::stage_micro_batch_done() {
  if (layer_hook_) layer_hook_(-1, LayerPass::backward, false);
}

std::vector<Tensor> TrainableQwen3VL::boundary(int layer, bool gradients) const {
  std::vector<Tensor> out;
  // The hidden state, or the f32 residual gradient (what a single model hands from layer to
  // layer), with the padding's sink row.
  out.push_back((gradients ? t_dres_ : tx_[layer]).slice(0, L_ + sink_rows()));
  if (n_pad_ > 0)
    for (int k = layer; k < deepstack_count(); ++k)
      out.push_back((gradients ? d_ds_[k] : ds_[k].out).slice(0, n_pad_));
  return out;
}

std::vector<Tensor> TrainableQwen3VL::forward_inputs() const {
  const PipelineStage& st = limits_.stage;
  return st.has_embed() ? std::vector<Tensor>() : boundary(st.first_layer, false);
}

std::vector<Tensor> TrainableQwen3VL::forward_outputs() const {
  const PipelineStage& st = limits_.stage;
  return st.has_head ? std::vector<Tensor>() : boundary(st.end_layer, false);
}

std::vector<Tensor> TrainableQwen3VL::backward_inputs() const {
  const PipelineStage& st = limits_.stage;
  return st.has_head ? std::vector<Tensor>() : boundary(st.end_layer, true);
}

std::vector<Tensor> TrainableQwen3VL::backward_outputs() const {
  const PipelineStage& st = limits_.stage;
  return st.has_embed() ? std::vector<Tensor>() : boundary(st.first_layer, true);
}

bool TrainableQwen3VL::holds(const std::string& name) const {
  return stage_holds(limits_.stage, cfg_.tie_word_embeddings, name);
}

void TrainableQwen3VL::graphed(const std::string& key, const std::function<void()>& body) {
  // A body's gradients are named after the graph (a hook inside would record into a capture, or
  // differ between a graph's eager warm-up and its replays).
  struct Nested {
    int& depth;
    explicit Nested(int& d) : depth(d) { ++depth; }
    ~Nested() { --depth; }
  } nested(graph_bodies_);
  GraphSet& set = graph_sets_[key];
  if (set.graph.valid()) {
    const auto start = std::chrono::steady_clock::now();
    const double cpu_start = thread_cpu_seconds();
    set.graph.launch();
    host_seconds_.graph_launch +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    host_seconds_.graph_launch_cpu += thread_cpu_seconds() - cpu_start;
    return;
  }
  if (set.eager_runs < graphs_.warmup_runs) {
    ++set.eager_runs;
    body();
    return;
  }
  const auto memory_before = static_cast<int64_t>(be_.device_memory_in_use());
  const auto t0 = std::chrono::steady_clock::now();
  set.graph = capture_and_run(*graph_api_, be_, key, body);
  capture_ms_ +=
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  set.memory_bytes = static_cast<int64_t>(be_.device_memory_in_use()) - memory_before;
  graph_memory_bytes_ += set.memory_bytes;
}

std::vector<std::pair<std::string, int64_t>> TrainableQwen3VL::graph_memory_by_set() const {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& [key, set] : graph_sets_)
    if (set.graph.valid()) out.emplace_back(key, set.memory_bytes);
  return out;
}

void TrainableQwen3VL::maybe_graphed(bool as_graph, const std::string& key,
                                     const std::function<void()>& body) {
  if (as_graph)
    graphed(key, body);
  else
    body();
}

namespace {
bool has_module(const std::vector<GraphModule>& modules, GraphModule m) {
  return std::find(modules.begin(), modules.end(), m) != modules.end();
}
}  // namespace

void TrainableQwen3VL::use_graphs(GraphApi& api, const TrainGraphs& graphs) {
  IRIS_CHECK(!limits_.text_buckets.empty(),
             "training graphs need bucket padding: plan the model with TrainLimits.text_buckets");
  IRIS_CHECK(graphs.warmup_runs >= 0, "cuda_graph.cuda_graph_warmup_steps must not be negative");
  for (GraphModule m : graphs.vision_modules)
    IRIS_CHECK(m == GraphModule::attn || m == GraphModule::mlp,
               "cuda_graph.vision_cuda_graph_modules holds '", to_string(m),
               "': the vision encoder has attn and mlp modules only");
  const auto named = [&](GraphModule m) { return has_module(graphs.decoder_modules, m); };
  const bool moe_modules = named(GraphModule::moe) || named(GraphModule::moe_router) ||
                           named(GraphModule::moe_preprocess);
  IRIS_CHECK(!moe_modules || moe_layers_ > 0,
             "cuda_graph.cuda_graph_modules names MoE modules, but this model (or pipeline stage) "
             "has no MoE layers; valid "
             "values for it: attn, mlp");
  IRIS_CHECK(!named(GraphModule::moe) || (limits_.moe_capacity.drops() && limits_.moe_capacity.pad),
             "cuda_graph.cuda_graph_modules 'moe' graphs the whole MoE layer, which needs a static "
             "capacity per expert: set model.moe_expert_capacity_factor (e.g. 1.0) and "
             "model.moe_pad_expert_input_to_capacity=true, or graph moe_router,moe_preprocess "
             "instead (dropless)");
  IRIS_CHECK(graphs.decoder_modules.empty() || graphs.decoder == GraphImpl::local,
             "cuda_graph.cuda_graph_modules applies to cuda_graph_impl local (full_iteration "
             "captures the whole micro-batch): leave it empty");
  IRIS_CHECK(graphs.vision_modules.empty() || graphs.vision,
             "cuda_graph.vision_cuda_graph_modules needs vision_cuda_graph_impl local");
  IRIS_CHECK(graphs.step_micro_batches >= 0, "TrainGraphs.step_micro_batches must not be negative");
  delete_graphs();
  graph_api_ = &api;
  graphs_ = graphs;
  // A full-iteration step replays one graph over input slots planned here, outside any step.
  plan_input_slots(graphs.decoder == GraphImpl::full_iteration ? graphs.step_micro_batches : 1);
}

void TrainableQwen3VL::delete_graphs() {
  graph_sets_.clear();
}

std::vector<std::string> TrainableQwen3VL::graph_keys() const {
  std::vector<std::string> keys;
  for (const auto& [key, set] : graph_sets_)
    if (set.graph.valid()) keys.push_back(key);
  return keys;
}

size_t TrainableQwen3VL::graph_count() const {
  size_t n = 0;
  for (const auto& [key, set] : graph_sets_) n += set.graph.valid();
  return n;
}

// ---- Vision ------------------------------------------------------------------------------------

VisionBlockBuffers TrainableQwen3VL::vision_block(int l) const {
  const int64_t S = S_;
  const VisionBlockBuffers& p = vb_[static_cast<size_t>(l)];
  VisionBlockBuffers b;
  for (auto [dst, src] : {std::pair{&b.x_in, &p.x_in},
                          {&b.ln1, &p.ln1},
                          {&b.mean1, &p.mean1},
                          {&b.rstd1, &p.rstd1},
                          {&b.qkv, &p.qkv},
                          {&b.lse, &p.lse},
                          {&b.attn, &p.attn},
                          {&b.x_mid, &p.x_mid},
                          {&b.ln2, &p.ln2},
                          {&b.mean2, &p.mean2},
                          {&b.rstd2, &p.rstd2},
                          {&b.fc1, &p.fc1},
                          {&b.act, &p.act},
                          {&b.x_out, &p.x_out}})
    *dst = src->slice(0, S);
  b.lora = v_lora_;
  b.lora.seed = lora_seed_;
  return b;
}

MergerBuffers TrainableQwen3VL::merger_buffers() const {
  MergerBuffers b = merger_;
  b.lora.seed = lora_seed_;  // the micro-batch's, which use_slot may have switched
  return b;
}

VisionSegments TrainableQwen3VL::vision_segments() const {
  VisionSegments seg{v_cos_.slice(0, S_), v_sin_.slice(0, S_), v_cu_, n_segments_,
                     padded_ ? v_real_rows_ : Tensor()};
  // A padded micro-batch attends over the most windows its bucket can hold (zero-length ones
  // after the real ones), so that the count, a host value, is one for every micro-batch a graph
  // of that bucket replays; an unpadded one over its own. Never the whole buffer's: the attention
  // kernels pay for each segment.
  if (v_window_cu_.defined()) {
    seg.window_cu = v_window_cu_;
    seg.n_windows = n_windows_;
  }
  return seg;
}

VisionGradScratch TrainableQwen3VL::vision_grad_scratch() const {
  const int64_t S = S_;
  VisionGradScratch s{v_dres_.slice(0, S),
                      v_dres_c_.slice(0, S),
                      v_dtmp_.slice(0, S),
                      v_dfc_.slice(0, S),
                      v_dup_.slice(0, S),
                      v_dattn_.slice(0, S),
                      v_dqkv_.slice(0, S),
                      v_dsum_.slice(0, S),
                      m_da_,
                      m_dln_,
                      v_lora_};
  if (v_lora_.defined()) s.lora.seed = lora_seed_;
  return s;
}

namespace {

// Which parts of a block or layer replay graphs of their own (Megatron's modules): attn, the
// dense MLP (mlp), a sparse layer's router (moe_router), with its routing metadata and
// permutation (moe_preprocess), or its whole MoE MLP (moe).
struct HalfGraphs {
  bool attn = false, mlp = false, moe = false, moe_router = false, moe_preprocess = false;
};
HalfGraphs half_graphs(bool on, const std::vector<GraphModule>& modules) {
  return {on && has_module(modules, GraphModule::attn), on && has_module(modules, GraphModule::mlp),
          on && has_module(modules, GraphModule::moe),
          on && has_module(modules, GraphModule::moe_router),
          on && has_module(modules, GraphModule::moe_preprocess)};
}
}  // namespace

void TrainableQwen3VL::vision_forward(bool module_graphs) {
  // The tower's order on the training buffers; a block's halves are graphs where
  // TrainGraphs::vision_modules names them. Keys name the rows and the segment count (the only
  // host values the halves pass).
  class Steps final : public VisionTowerSteps {
   public:
    Steps(TrainableQwen3VL& m, bool module_graphs) : m_(m), seg_(m.vision_segments()) {
      halves_ = half_graphs(module_graphs, m.graphs_.vision_modules);
      shape_ = str_cat(" S", m.S_, " segments ", m.n_segments_);
    }
    // The micro-batch's tables from its grids (in the vision graph, when there is one); the
    // backward reads them as the forward left them.
    void embed() override {
      TrainableQwen3VL& m = m_;
      const VisionConfig& v = m.cfg_.vision;
      const int64_t S = m.S_;
      m.be_.vision_tables(m.v_cos_.slice(0, S), m.v_sin_.slice(0, S), m.pos_index_.slice(0, S),
                          m.pos_weight_.slice(0, S), m.v_cu_, m.v_real_rows_, m.v_grids_,
                          m.v_inv_freq_, v.spatial_merge_size, v.position_grid_side(),
                          m.v_window_cu_, v.window_units());
      v.tower->embed(m.be_, m.params_.vision, m.vx_[0].slice(0, S), m.pixels_.slice(0, S),
                     m.pos_index_.slice(0, S), m.pos_weight_.slice(0, S));
    }
    void block(int l) override {
      TrainableQwen3VL& m = m_;
      const VisionConfig& v = m.cfg_.vision;
      const VisionBlockWeights& w = m.params_.vision.blocks[l];
      const VisionBlockBuffers b = m.vision_block(l);
      const VisionSegments seg = seg_.for_block(v, l);
      m.maybe_graphed(halves_.attn, str_cat("vision block ", l, " attn fwd", shape_),
                      [&m, &v, &w, b, seg] { vision_attention_forward(m.be_, v, w, b, seg); });
      m.maybe_graphed(halves_.mlp, str_cat("vision block ", l, " mlp fwd", shape_),
                      [&m, &v, &w, b] { vision_mlp_forward(m.be_, v, w, b); });
    }
    void deepstack_merger(int k, int l) override {
      merger_forward(m_.be_, m_.cfg_.vision, m_.params_.vision.deepstack_mergers[k], m_.ds_[k],
                     m_.vx_[l + 1], m_.S_, true);
    }
    void merger() override {
      const VisionConfig& v = m_.cfg_.vision;
      merger_forward(m_.be_, v, m_.params_.vision.merger, m_.merger_buffers(), m_.vx_[v.depth],
                     m_.S_, false);
    }

   private:
    TrainableQwen3VL& m_;
    VisionSegments seg_;
    HalfGraphs halves_;
    std::string shape_;
  };
  Steps steps(*this, module_graphs);
  vision_tower_forward(cfg_.vision, steps);
}

void TrainableQwen3VL::vision_backward(bool module_graphs) {
  // The tower's order, reversed, on the training buffers. dres holds d(output of the block the
  // walk is at); DeepStack taps read that output too.
  class Steps final : public VisionTowerGradSteps {
   public:
    Steps(TrainableQwen3VL& m, bool module_graphs)
        : m_(m), seg_(m.vision_segments()), scratch_(m.vision_grad_scratch()) {
      tower_ = m.trains_tower_;
      dres_ = tower_ ? scratch_.dres : Tensor();
      halves_ = half_graphs(module_graphs, m.graphs_.vision_modules);
      shape_ = str_cat(" S", m.S_, " segments ", m.n_segments_);
    }
    void merger() override {
      TrainableQwen3VL& m = m_;
      const VisionConfig& v = m.cfg_.vision;
      VisionWeights& g = m.grads_->vision;
      if (tower_) m.be_.fill_zero(dres_);
      merger_backward(m.be_, v, m.params_.vision.merger, merger_grads(g.merger), m.merger_buffers(),
                      m.vx_[v.depth], m.S_, false, m.d_embeds_, dres_, scratch_);
      mark(g.merger);
    }
    void deepstack_merger(int k, int l) override {
      TrainableQwen3VL& m = m_;
      VisionWeights& g = m.grads_->vision;
      merger_backward(m.be_, m.cfg_.vision, m.params_.vision.deepstack_mergers[k],
                      merger_grads(g.deepstack_mergers[k]), m.ds_[k], m.vx_[l + 1], m.S_, true,
                      m.d_ds_[k], dres_, scratch_);
      mark(g.deepstack_mergers[k]);
    }
    void block(int l) override {
      TrainableQwen3VL& m = m_;
      const VisionConfig& v = m.cfg_.vision;
      const VisionBlockWeights& w = m.params_.vision.blocks[l];
      VisionBlockWeights& gb = m.grads_->vision.blocks[l];
      const VisionBlockBuffers b = m.vision_block(l);
      const VisionSegments seg = seg_.for_block(v, l);
      const VisionGradScratch scratch = scratch_;
      const int64_t S = m.S_;
      // The recomputation runs with the MLP half, whose backward is the first to read it.
      m.maybe_graphed(halves_.mlp, str_cat("vision block ", l, " mlp bwd", shape_),
                      [&m, &v, &w, &gb, b, seg, scratch, S] {
                        if (m.limits_.recompute != Recompute::none) {
                          VisionBlockBuffers rerun = b;
                          if (m.limits_.recompute == Recompute::full)
                            rerun.x_out = m.v_recompute_out_.slice(0, S);
                          vision_block_recompute(m.be_, v, w, rerun, seg, m.limits_.recompute);
                        }
                        vision_mlp_backward(m.be_, v, w, gb, b, scratch);
                      });
      m.maybe_graphed(halves_.attn, str_cat("vision block ", l, " attn bwd", shape_),
                      [&m, &v, &w, &gb, b, seg, scratch] {
                        vision_attention_backward(m.be_, v, w, gb, b, seg, scratch);
                      });
      mark(gb);
    }
    void embed() override {
      TrainableQwen3VL& m = m_;
      VisionWeights& g = m.grads_->vision;
      const int64_t S = m.S_;
      // A tower trained through its adapters alone leaves its embedding frozen.
      if (!g.pos_embed.defined() && !g.patch_w.defined() && !g.patch_b.defined()) return;
      m.cfg_.vision.tower->embed_backward(m.be_, g, dres_, scratch_.dres_c, m.pixels_.slice(0, S),
                                          m.pos_index_.slice(0, S), m.pos_weight_.slice(0, S));
      for (const Tensor* t : {&g.pos_embed, &g.patch_w, &g.patch_b})
        if (t->defined()) m.gradient_final(*t);
    }
    bool tower() const { return tower_; }

   private:
    PatchMergerWeights* merger_grads(PatchMergerWeights& g) const {
      return !m_.trains_merger_ ? nullptr : &g;
    }
    void mark(const PatchMergerWeights& w) {
      each_tensor(w, [this](const Tensor& t) { m_.gradient_final(t); });
    }
    void mark(const VisionBlockWeights& w) {
      each_tensor(w, [this](const Tensor& t) { m_.gradient_final(t); });
    }
    TrainableQwen3VL& m_;
    VisionSegments seg_;
    VisionGradScratch scratch_;
    Tensor dres_;
    bool tower_ = false;
    HalfGraphs halves_;
    std::string shape_;
  };
  Steps steps(*this, module_graphs);
  vision_tower_backward(cfg_.vision, steps, steps.tower());
}

// ---- Text --------------------------------------------------------------------------------------

DecoderLayerBuffers TrainableQwen3VL::text_layer(int l) const {
  const int64_t L = L_;
  const DecoderLayerBuffers& p = tl_[static_cast<size_t>(l)];
  DecoderLayerBuffers b;
  for (auto [dst, src] : {std::pair{&b.x_in, &p.x_in},
                          {&b.rms1, &p.rms1},
                          {&b.rstd1, &p.rstd1},
                          {&b.qkv_lin, &p.qkv_lin},
                          {&b.qk_rstd, &p.qk_rstd},
                          {&b.qkv, &p.qkv},
                          {&b.lse, &p.lse},
                          {&b.attn, &p.attn},
                          {&b.x_mid, &p.x_mid},
                          {&b.rms2, &p.rms2},
                          {&b.rstd2, &p.rstd2},
                          {&b.gate_up, &p.gate_up},
                          {&b.act, &p.act},
                          {&b.x_out, &p.x_out}})
    if (src->defined()) *dst = src->slice(0, L);
  b.lora = t_lora_;
  b.lora.seed = lora_seed_;
  if (cfg_.text.sparse_layer(l)) {
    b.moe = moe_rows(p.moe, cfg_.text, L);
    b.moe.real_rows = text_real_rows_;
    // The load-balancing loss adds its gradient when its coefficient is not zero.
    if (cfg_.text.router_aux_loss_coef != 0.0f) b.moe.aux_dprob = moe_aux_dprob_;
  }
  return b;
}

DecoderAttention TrainableQwen3VL::text_attention() const {
  DecoderAttention at;
  at.cos = cos_.slice(0, L_);
  at.sin = sin_.slice(0, L_);
  at.cu_seqlens = text_cu_;
  at.n_segments = n_text_segments_;
  return at;
}

bool TrainableQwen3VL::offloads(Tensor DecoderLayerBuffers::*field) const {
  for (const std::string& n : limits_.offload)
    for (const SavedActivation& a : kSavedActivations)
      if (a.field == field && n == a.name) return true;
  return false;
}

void* TrainableQwen3VL::offload_host(const OffloadKind& k, int layer) const {
  return static_cast<char*>(offload_host_.get()) + k.host_offset +
         k.layer_bytes * static_cast<size_t>(layer - limits_.stage.first_layer);
}

// Copy points: 0 and 1 the x_in slots', 2 and 3 the other kinds' (by slot).
void TrainableQwen3VL::offload_forward(int l, bool begin) {
  if (offload_.empty()) return;
  const int slot = l % 2, next = (l + 1) % 2;
  auto copy_out = [&](bool x_kind) {
    for (const OffloadKind& k : offload_)
      if ((k.field == &DecoderLayerBuffers::x_in) == x_kind)
        be_.copy_to_host_async(offload_host(k, l),
                               (tl_[static_cast<size_t>(l)].*k.field).slice(0, L_));
  };
  const bool x_kind = offloads(&DecoderLayerBuffers::x_in);
  const bool other_kinds = offload_.size() > (x_kind ? 1u : 0u);
  if (begin) {
    // Layer l's input is final (the DeepStack rows added): it goes out while the layer computes.
    offload_resident_[0][slot] = l;
    if (offload_copies_ && x_kind) {
      copy_out(true);
      be_.mark_copies(slot);
    }
    // The layer writes the x slot its input's predecessor (layer l - 1's input) took and the
    // other kinds' slot of layer l - 2: their copies to the host must be done.
    be_.wait_copies(next);
    be_.wait_copies(2 + slot);
    offload_resident_[1][slot] = l;
    return;
  }
  if (offload_copies_ && other_kinds) {
    copy_out(false);
    be_.mark_copies(2 + slot);
  }
  if (l + 1 == limits_.stage.end_layer) offload_resident_[0][next] = l + 1;
}

void TrainableQwen3VL::offload_reload(int l, int group) {
  for (const OffloadKind& k : offload_)
    if ((k.field == &DecoderLayerBuffers::x_in) == (group == 0))
      be_.copy_from_host_async((tl_[static_cast<size_t>(l)].*k.field).slice(0, L_),
                               offload_host(k, l));
  be_.mark_copies(2 * group + l % 2);
  offload_resident_[group][l % 2] = l;
}

void TrainableQwen3VL::offload_backward(int l) {
  if (offload_.empty()) return;
  const bool x_kind = offloads(&DecoderLayerBuffers::x_in);
  const bool other_kinds = offload_.size() > (x_kind ? 1u : 0u);
  for (int group = 0; group < 2; ++group) {
    if (!(group == 0 ? x_kind : other_kinds)) continue;
    if (offload_resident_[group][l % 2] != l) offload_reload(l, group);
    // The next layer back goes into the other slot, whose last reader (layer l + 1's backward)
    // is queued: the copy runs while this layer computes.
    if (l - 1 >= limits_.stage.first_layer && offload_resident_[group][(l - 1) % 2] != l - 1)
      offload_reload(l - 1, group);
    be_.wait_copies(2 * group + l % 2);
  }
}

void TrainableQwen3VL::text_forward(bool layer_graphs, bool backward, const Tensor& loss_out) {
  const int64_t L = L_;
  offload_copies_ = backward;
  // The tables every layer's attention (and its backward) rotates with.
  be_.text_rope_tables(cos_.slice(0, L), sin_.slice(0, L), positions_.slice(0, L), rope_inv_freq_,
                       rope_axes_);
  if (moe_layers_ > 0) {
    be_.fill_zero(moe_load_);
    be_.fill_zero(moe_prob_sum_);
  }
  // The joined order on the training buffers: whole layers as graphs, or the halves
  // TrainGraphs::decoder_modules names (the rest eagerly).
  class Steps final : public JoinedForwardSteps {
   public:
    Steps(TrainableQwen3VL& m, bool layer_graphs, bool backward, const Tensor& loss_out)
        : m_(m), backward_(backward), loss_out_(loss_out) {
      const auto& modules = m.graphs_.decoder_modules;
      whole_ = layer_graphs && modules.empty();
      halves_ = half_graphs(layer_graphs, modules);
      shape_ = str_cat(" L", m.L_, " pads ", m.n_pad_);
      // Training counts the slots dropped over capacity; an evaluation's forward does not, so
      // its graphs are others.
      count_drops_ = backward && m.moe_dropped_.defined();
      if (m.moe_dropped_.defined() && !backward) shape_ += " drops uncounted";
    }
    void embed() override {
      m_.be_.embedding(m_.tx_[0].slice(0, m_.L_), m_.params_.text.embed, m_.ids_.slice(0, m_.L_));
    }
    void scatter_vision() override {
      if (m_.n_pad_ > 0)
        m_.be_.scatter_rows(m_.tx_[0].slice(0, rows_with_sink()),
                            m_.merger_.out.slice(0, m_.n_pad_), m_.pad_rows_.slice(0, m_.n_pad_),
                            false);
    }
    void layer(int l) override {
      m_.layer_event(l, LayerPass::forward, true);
      m_.offload_forward(l, true);
      layer_body(l);
      m_.offload_forward(l, false);
      m_.layer_event(l, LayerPass::forward, false);
    }
    void layer_body(int l) {
      TrainableQwen3VL& m = m_;
      const TextConfig& t = m.cfg_.text;
      const DecoderLayerWeights& w = m.params_.text.layers[l];
      DecoderLayerBuffers b = m.text_layer(l);
      const bool sparse = b.moe.ids.defined();
      if (sparse && count_drops_) b.moe.dropped = m.moe_dropped_;
      const DecoderAttention at = m.text_attention();
      auto attention = [&m, &t, &w, b, at] { decoder_attention_forward(m.be_, t, w, b, at); };
      // A dense layer's MLP, or a sparse layer's, in the three parts that Megatron's modules name.
      std::function<void()> router, preprocess, experts, mlp;
      if (sparse) {
        router = [&m, &t, &w, b] {
          moe_router_forward(m.be_, t, w, b);
          // The routing's statistics, for the load-balancing loss after the last layer.
          m.be_.moe_route_stats(m.moe_load_, m.moe_prob_sum_, b.moe.ids, b.moe.probs);
        };
        preprocess = [&m, b] { moe_preprocess_forward(m.be_, b); };
        experts = [&m, &w, b] { moe_experts_forward(m.be_, w, b); };
        mlp = [router, preprocess, experts] {
          router();
          preprocess();
          experts();
        };
      } else {
        mlp = [&m, &t, &w, b] { decoder_mlp_forward(m.be_, t, w, b); };
      }
      if (whole_) {
        m.graphed(str_cat("layer ", l, " fwd", shape_), [attention, mlp] {
          attention();
          mlp();
        });
        return;
      }
      m.maybe_graphed(halves_.attn, str_cat("layer ", l, " attn fwd", shape_), attention);
      if (!sparse) {
        m.maybe_graphed(halves_.mlp, str_cat("layer ", l, " mlp fwd", shape_), mlp);
        return;
      }
      if (halves_.moe) {
        m.graphed(str_cat("layer ", l, " moe fwd", shape_), mlp);
        return;
      }
      if (halves_.moe_preprocess) {
        m.graphed(str_cat("layer ", l, " moe_router+moe_preprocess fwd", shape_),
                  [router, preprocess] {
                    router();
                    preprocess();
                  });
      } else {
        m.maybe_graphed(halves_.moe_router, str_cat("layer ", l, " moe_router fwd", shape_),
                        router);
        preprocess();
      }
      experts();
    }
    void add_deepstack(int l) override {
      if (m_.n_pad_ > 0)
        m_.be_.scatter_rows(m_.tx_[l + 1].slice(0, rows_with_sink()),
                            m_.ds_[l].out.slice(0, m_.n_pad_), m_.pad_rows_.slice(0, m_.n_pad_),
                            true);
    }
    void final_norm() override {
      const TextConfig& t = m_.cfg_.text;
      m_.be_.rms_norm_train(m_.final_.slice(0, m_.L_), m_.final_rstd_.slice(0, m_.L_),
                            m_.tx_[t.num_hidden_layers].slice(0, m_.L_), m_.params_.text.norm_w,
                            t.rms_norm_eps);
    }
    void head() override {
      // Training's micro-batches report it (run_prepared counts them on the host, as a replayed
      // graph does not run this).
      if (m_.moe_layers_ > 0 && backward_) {
        const float coef = m_.cfg_.text.router_aux_loss_coef;
        m_.be_.moe_aux_loss(m_.moe_aux_sum_, m_.moe_aux_dprob_, m_.moe_load_, m_.moe_prob_sum_,
                            m_.text_real_rows_, m_.moe_layers_,
                            coef / static_cast<float>(m_.micro_batches_in_step_));
      }
      // Training writes the lm_head's gradient (the embedding's, tied).
      const bool writes_head = backward_ && m_.trains_lm_;
      if (writes_head) m_.layer_event(kLmHeadGradient, LayerPass::forward, true);
      m_.loss(backward_, loss_out_);
      if (writes_head) m_.layer_event(kLmHeadGradient, LayerPass::forward, false);
    }

   private:
    // Scatters and gathers address the rows with the padding's sink row.
    int64_t rows_with_sink() const { return m_.L_ + m_.sink_rows(); }
    TrainableQwen3VL& m_;
    bool backward_;
    Tensor loss_out_;
    bool whole_ = false, count_drops_ = false;
    HalfGraphs halves_;
    std::string shape_;
  };
  Steps steps(*this, layer_graphs, backward, loss_out);
  joined_forward(cfg_, limits_.stage, steps);
}

void TrainableQwen3VL::loss(bool backward, const Tensor& loss_out) {
  if (n_label_ == 0) return;
  const Tensor xlab = xlab_.slice(0, n_label_);
  be_.gather_rows(xlab, final_.slice(0, L_ + sink_rows()), label_rows_.slice(0, n_label_));
  const bool lm = trains_lm_;
  // Overwrites dxlab; accumulates the lm_head's gradient (the embedding's, when tied).
  be_.lm_head_loss(loss_out, backward ? dxlab_.slice(0, n_label_) : Tensor(),
                   backward ? g_or_none(grads_->text.lm_head, lm) : Tensor(), xlab,
                   params_.text.lm_head, targets_.slice(0, n_label_), grad_scale_, loss_workspace_,
                   loss_chunk_);
}

void TrainableQwen3VL::move_grads_into(TrainableQwen3VL& sum) {
  IRIS_CHECK(&sum != this && &sum.params_ == &params_,
             "move_grads_into needs another replica of the same parameters");
  IRIS_CHECK(be_.device() == Device::cpu && sum.be_.device() == Device::cpu,
             "move_grads_into sums replicas on the CPU");
  IRIS_CHECK(grads_->arena.capacity() == sum.grads_->arena.capacity(),
             "move_grads_into needs replicas planned with the same frozen parts");
  const int64_t n = static_cast<int64_t>(grads_->arena.capacity() / sizeof(float));
  float* src = static_cast<float*>(grads_->arena.base());
  float* dst = static_cast<float*>(sum.grads_->arena.base());
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 16))
  for (int64_t k = 0; k < n; ++k) {
    dst[k] += src[k];
    src[k] = 0.0f;
  }
}

void TrainableQwen3VL::text_backward(bool layer_graphs) {
  // The joined order, reversed, on the training buffers.
  class Steps final : public JoinedBackwardSteps {
   public:
    Steps(TrainableQwen3VL& m, bool layer_graphs) : m_(m) {
      const int64_t L = m.L_;
      scratch_ = DecoderGradScratch{m.t_dres_.slice(0, L),
                                    m.t_dres_c_.slice(0, L),
                                    m.t_dtmp_.slice(0, L),
                                    m.t_dact_.slice(0, L),
                                    m.t_dgu_.slice(0, L),
                                    m.t_dattn_.slice(0, L),
                                    m.t_dqkv_.slice(0, L),
                                    m.t_dsum_.slice(0, L),
                                    {},
                                    m.t_lora_};
      scratch_.lora.seed = m.lora_seed_;
      if (m.moe_layers_ > 0)
        scratch_.moe = moe_grad_rows(m.t_moe_, m.cfg_.text, m.limits_.moe_capacity, L);
      // With the sink row, which padding's gathers read as zero.
      dres_sink_ = m.t_dres_.slice(0, L + m.sink_rows());
      lm_ = m.trains_lm_;
      const auto& modules = m.graphs_.decoder_modules;
      whole_ = layer_graphs && modules.empty();
      halves_ = half_graphs(layer_graphs, modules);
      shape_ = str_cat(" L", L, " pads ", m.n_pad_, " lm ", int(lm_));
    }
    // A stage before the last starts from the gradient the next stage sent into dres instead.
    void head() override {
      TrainableQwen3VL& m = m_;
      const TextConfig& t = m.cfg_.text;
      DecoderWeights& g = m.grads_->text;
      const int64_t L = m.L_;
      const Tensor dloss_sink = m.t_dloss_.slice(0, L + m.sink_rows());
      m.be_.fill_zero(dres_sink_);
      m.be_.fill_zero(dloss_sink);
      m.be_.scatter_rows(dloss_sink, m.dxlab_.slice(0, m.n_label_),
                         m.label_rows_.slice(0, m.n_label_), false);
      m.be_.rms_norm_backward(scratch_.dres, g_or_none(g.norm_w, lm_), m.t_dloss_.slice(0, L),
                              m.tx_[t.num_hidden_layers].slice(0, L), m.final_rstd_.slice(0, L),
                              m.params_.text.norm_w);
      // The loss wrote the lm_head's; tied, it is the embedding, which this stage may still add
      // to.
      m.gradient_final(g.norm_w);
      if (!m.cfg_.tie_word_embeddings || !m.limits_.stage.has_embed()) m.gradient_final(g.lm_head);
    }
    // dres holds d(input of layer l + 1), which is also d(the DeepStack rows added after l).
    void deepstack(int l) override {
      if (m_.n_pad_ > 0)
        m_.be_.gather_rows(m_.d_ds_[l].slice(0, m_.n_pad_), dres_sink_,
                           m_.pad_rows_.slice(0, m_.n_pad_));
    }
    void layer(int l) override {
      TrainableQwen3VL& m = m_;
      const TextConfig& t = m.cfg_.text;
      const DecoderLayerWeights& w = m.params_.text.layers[l];
      DecoderLayerWeights* gl = lm_ ? &m.grads_->text.layers[l] : nullptr;
      if (lm_) m.layer_event(l, LayerPass::backward, true);
      m.offload_backward(l);
      const DecoderLayerBuffers b = m.text_layer(l);
      const DecoderAttention at = m.text_attention();
      const DecoderGradScratch scratch = scratch_;
      const int64_t L = m.L_;
      // The recomputation runs with the MLP half, the first to need it.
      auto recompute = [&m, &t, &w, L, b, at] {
        if (m.limits_.recompute == Recompute::none) return;
        DecoderLayerBuffers rerun = b;
        if (m.limits_.recompute == Recompute::full) rerun.x_out = m.t_recompute_out_.slice(0, L);
        decoder_layer_recompute(m.be_, t, w, rerun, at, m.limits_.recompute);
      };
      auto attention = [&m, &t, &w, gl, b, at, scratch] {
        decoder_attention_backward(m.be_, t, w, gl, b, at, scratch);
      };
      // The forward's parts backward: a sparse layer's experts, then the permutation's and the
      // router's, which Megatron's moe_preprocess and moe_router graphs hold.
      const bool sparse = b.moe.ids.defined();
      std::function<void()> experts, preprocess, router, mlp;
      if (sparse) {
        experts = [recompute, &m, &w, gl, b, scratch] {
          recompute();
          moe_experts_backward(m.be_, w, gl, b, scratch);
        };
        preprocess = [&m, b, scratch] { moe_preprocess_backward(m.be_, b, scratch); };
        router = [&m, &w, gl, b, scratch] { moe_router_backward(m.be_, w, gl, b, scratch); };
        mlp = [experts, preprocess, router] {
          experts();
          preprocess();
          router();
        };
      } else {
        mlp = [recompute, &m, &w, gl, b, scratch] {
          recompute();
          decoder_mlp_backward(m.be_, w, gl, b, scratch);
        };
      }
      if (whole_) {
        m.graphed(str_cat("layer ", l, " bwd", shape_), [mlp, attention] {
          mlp();
          attention();
        });
      } else {
        if (!sparse) {
          m.maybe_graphed(halves_.mlp, str_cat("layer ", l, " mlp bwd", shape_), mlp);
        } else if (halves_.moe) {
          m.graphed(str_cat("layer ", l, " moe bwd", shape_), mlp);
        } else {
          experts();
          if (halves_.moe_preprocess) {
            m.graphed(str_cat("layer ", l, " moe_router+moe_preprocess bwd", shape_),
                      [preprocess, router] {
                        preprocess();
                        router();
                      });
          } else {
            preprocess();
            m.maybe_graphed(halves_.moe_router, str_cat("layer ", l, " moe_router bwd", shape_),
                            router);
          }
        }
        m.maybe_graphed(halves_.attn, str_cat("layer ", l, " attn bwd", shape_), attention);
      }
      each_tensor(m.grads_->text.layers[l], [&m](const Tensor& x) { m.gradient_final(x); });
      if (lm_) m.layer_event(l, LayerPass::backward, false);
    }
    // Image-pad rows were overwritten by the vision scatter: their gradient goes to the vision
    // tower, not to the pad token's embedding row.
    void embed() override {
      TrainableQwen3VL& m = m_;
      DecoderWeights& g = m.grads_->text;
      if (lm_ && g.embed.defined()) {
        m.layer_event(kEmbeddingGradient, LayerPass::backward, true);
        m.be_.embedding_backward(g.embed, scratch_.dres, m.ids_.slice(0, m.L_),
                                 m.cfg_.image_token_id);
        m.layer_event(kEmbeddingGradient, LayerPass::backward, false);
      }
      m.gradient_final(g.embed);
      if (m.n_pad_ > 0)
        m.be_.gather_rows(m.d_embeds_.slice(0, m.n_pad_), dres_sink_,
                          m.pad_rows_.slice(0, m.n_pad_));
    }

   private:
    TrainableQwen3VL& m_;
    DecoderGradScratch scratch_;
    Tensor dres_sink_;
    bool lm_ = false, whole_ = false;
    HalfGraphs halves_;
    std::string shape_;
  };
  Steps steps(*this, layer_graphs);
  joined_backward(cfg_, limits_.stage, steps);
}

}  // namespace iris
