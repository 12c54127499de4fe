#include "training/train_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "bridge/rope_index.h"
#include "core/dtype.h"
#include "language/mrope.h"
#include "training/backward_ops.h"

namespace iris {
namespace {

constexpr int32_t kIgnoreIndex = -100;

float* f(const Tensor& t) {
  return t.as<float>();
}
const float* cf(const Tensor& t) {
  return t.defined() ? t.as<float>() : nullptr;
}
// A gradient tensor, or null when its part is frozen (which also skips the weight-gradient GEMM).
float* g_or_null(const Tensor& t, bool trainable) {
  return trainable ? t.as<float>() : nullptr;
}
int32_t* i32(const Tensor& t) {
  return t.as<int32_t>();
}

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

}  // namespace

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

bool FreezeSpec::frozen(const std::string& name) const {
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

TrainableQwen3VL::TrainableQwen3VL(Backend& cpu, const ModelConfig& cfg, ModelWeights& params,
                                   const TrainLimits& limits)
    : be_(cpu), cfg_(cfg), params_(params), limits_(limits) {
  IRIS_CHECK(cpu.device() == Device::cpu && cpu.compute_dtype() == DType::f32,
             "TrainableQwen3VL runs on the fp32 CPU backend (make_cpu_backend()), got ",
             cpu.name());
  IRIS_CHECK(params.text.embed.defined() && params.text.embed.dtype == DType::f32 &&
                 params.text.embed.device == Device::cpu,
             "training parameters must be f32 on the CPU backend: load them with "
             "load_weights(*make_cpu_backend(), ...)");
  const VisionConfig& v = cfg.vision;
  const TextConfig& t = cfg.text;
  IRIS_CHECK(limits.max_seq_len > 0, "TrainLimits.max_seq_len must be positive");
  IRIS_CHECK(limits.max_patches >= 0 && limits.max_patches % v.merge_unit() == 0,
             "TrainLimits.max_patches (", limits.max_patches, ") must be a multiple of ",
             v.merge_unit());
  IRIS_CHECK(limits.max_images >= 0, "TrainLimits.max_images must not be negative");
  IRIS_CHECK(limits.loss_chunk_rows > 0, "TrainLimits.loss_chunk_rows must be positive");
  IRIS_CHECK(v.out_hidden_size == t.hidden_size, "vision out_hidden_size ", v.out_hidden_size,
             " differs from the text hidden size ", t.hidden_size);
  IRIS_CHECK(v.deepstack_visual_indexes.size() <= size_t(t.num_hidden_layers), "the config has ",
             v.deepstack_visual_indexes.size(), " DeepStack taps but only ", t.num_hidden_layers,
             " decoder layers to inject them into");
  for (int tap : v.deepstack_visual_indexes)
    IRIS_CHECK(tap >= 0 && tap < v.depth, "DeepStack tap ", tap, " is not a vision block index");
  IRIS_CHECK(t.head_dim % 2 == 0 && t.head_dim <= train::kMaxHeadDim && v.head_dim() % 2 == 0 &&
                 v.head_dim() <= train::kMaxHeadDim,
             "head dims must be even and at most ", train::kMaxHeadDim);
  grads_ = allocate_weights(cpu, cfg);
  embed_row_touched_.assign(static_cast<size_t>(t.vocab_size), 0);
  touched_embed_rows_.reserve(static_cast<size_t>(t.vocab_size));
  zero_grads();
  Arena plan;
  allocate(plan);
  arena_ = Arena(cpu, plan.used());
  allocate(arena_);
}

void TrainableQwen3VL::allocate(Arena& a) {
  const VisionConfig& v = cfg_.vision;
  const TextConfig& t = cfg_.text;
  const DType F = DType::f32, I32 = DType::i32;
  const int64_t L = limits_.max_seq_len, H = t.hidden_size;
  const int64_t S = limits_.max_patches, Sm = S / v.merge_unit(), D = v.hidden_size,
                M = v.merged_dim(), Iv = v.intermediate_size, nh = v.num_heads;
  const int64_t out = v.out_hidden_size;

  ids_ = a.alloc(I32, {L});
  pad_rows_ = a.alloc(I32, {L});
  label_rows_ = a.alloc(I32, {L});
  targets_ = a.alloc(I32, {L});
  cos_ = a.alloc(F, {L, t.head_dim});
  sin_ = a.alloc(F, {L, t.head_dim});
  text_cu_ = a.alloc(I32, {2});

  vx_.clear();
  for (int l = 0; l <= v.depth; ++l) vx_.push_back(a.alloc(F, {S, D}));
  vb_.assign(static_cast<size_t>(v.depth), {});
  for (auto& b : vb_) {
    b.ln1 = a.alloc(F, {S, D});
    b.mean1 = a.alloc(F, {S});
    b.rstd1 = a.alloc(F, {S});
    b.qkv = a.alloc(F, {S, 3 * D});
    b.lse = a.alloc(F, {S, nh});
    b.attn = a.alloc(F, {S, D});
    b.x_mid = a.alloc(F, {S, D});
    b.ln2 = a.alloc(F, {S, D});
    b.mean2 = a.alloc(F, {S});
    b.rstd2 = a.alloc(F, {S});
    b.fc1 = a.alloc(F, {S, Iv});
    b.act = a.alloc(F, {S, Iv});
  }
  auto merger = [&](MergerActs& m, int64_t norm_rows) {
    m.ln = a.alloc(F, {Sm, M});
    m.mean = a.alloc(F, {norm_rows});
    m.rstd = a.alloc(F, {norm_rows});
    m.fc1 = a.alloc(F, {Sm, M});
    m.act = a.alloc(F, {Sm, M});
    m.out = a.alloc(F, {Sm, out});
  };
  merger(merger_, S);
  ds_.assign(v.deepstack_visual_indexes.size(), {});
  for (auto& m : ds_) merger(m, Sm);

  tx_.clear();
  for (int l = 0; l <= t.num_hidden_layers; ++l) tx_.push_back(a.alloc(F, {L, H}));
  tl_.assign(static_cast<size_t>(t.num_hidden_layers), {});
  const int nqk = t.num_attention_heads + t.num_key_value_heads;
  for (auto& x : tl_) {
    x.rms1 = a.alloc(F, {L, H});
    x.rstd1 = a.alloc(F, {L});
    x.qkv_lin = a.alloc(F, {L, t.qkv_width()});
    x.qk_rstd = a.alloc(F, {L, nqk});
    x.qkv = a.alloc(F, {L, t.qkv_width()});
    x.attn = a.alloc(F, {L, t.q_width()});
    x.lse = a.alloc(F, {L, t.num_attention_heads});
    x.x_mid = a.alloc(F, {L, H});
    x.rms2 = a.alloc(F, {L, H});
    x.rstd2 = a.alloc(F, {L});
    x.gate_up = a.alloc(F, {L, 2 * int64_t(t.intermediate_size)});
    x.act = a.alloc(F, {L, t.intermediate_size});
  }
  final_ = a.alloc(F, {L, H});
  final_rstd_ = a.alloc(F, {L});
  xlab_ = a.alloc(F, {L, H});
  dxlab_ = a.alloc(F, {L, H});
  loss_chunk_ = std::min(limits_.loss_chunk_rows, L);
  logits_ = a.alloc(F, {train::lm_head_scratch_floats(loss_chunk_, H, t.vocab_size)});
  pending_capacity_ = std::max<int64_t>(limits_.deferred_head_rows, 0);
  if (pending_capacity_ > 0) {
    pending_dl_ = a.alloc(F, {pending_capacity_, t.vocab_size});
    pending_x_ = a.alloc(F, {pending_capacity_, H});
  }

  t_dres_ = a.alloc(F, {L, H});
  t_dtmp_ = a.alloc(F, {L, H});
  t_dattn_ = a.alloc(F, {L, t.q_width()});
  t_dqkv_ = a.alloc(F, {L, t.qkv_width()});
  t_dgu_ = a.alloc(F, {L, 2 * int64_t(t.intermediate_size)});
  t_dact_ = a.alloc(F, {L, t.intermediate_size});
  t_dsum_ = a.alloc(F, {L, t.num_attention_heads});
  v_dres_ = a.alloc(F, {S, D});
  v_dtmp_ = a.alloc(F, {S, D});
  v_dattn_ = a.alloc(F, {S, D});
  v_dqkv_ = a.alloc(F, {S, 3 * D});
  v_dfc_ = a.alloc(F, {S, Iv});
  v_dsum_ = a.alloc(F, {S, nh});
  m_da_ = a.alloc(F, {Sm, M});
  m_dln_ = a.alloc(F, {Sm, M});
  d_embeds_ = a.alloc(F, {Sm, out});
  d_ds_.clear();
  for (size_t k = 0; k < v.deepstack_visual_indexes.size(); ++k)
    d_ds_.push_back(a.alloc(F, {Sm, out}));
}

void TrainableQwen3VL::zero_grads() {
  pending_rows_ = 0;
  for (int32_t row : touched_embed_rows_) embed_row_touched_[static_cast<size_t>(row)] = 0;
  touched_embed_rows_.clear();
  head_grad_dense_ = false;
  // Fused tensors (q/k/v, gate/up) carry several bindings; the one at row 0 covers the whole.
  for (const WeightBinding& b : grads_->bindings)
    if (b.row_offset == 0) be_.fill_zero(*b.target);
}

void TrainableQwen3VL::set_frozen(bool vision_tower, bool merger, bool language_model) {
  frozen_ = FreezeSpec{vision_tower, merger, language_model};
  for (const WeightBinding& b : grads_->bindings)
    if (frozen_.frozen(b.hf_name))
      be_.fill_zero(b.target->slice(b.row_offset, b.row_offset + b.hf_shape[0]));
}

LossStats TrainableQwen3VL::forward(const TrainSample& s) {
  return run(s, false, 0.0f);
}

LossStats TrainableQwen3VL::forward_backward(const TrainSample& s, float grad_scale) {
  return run(s, true, grad_scale);
}

void TrainableQwen3VL::prepare(const TrainSample& s) {
  const VisionConfig& v = cfg_.vision;
  const TextConfig& t = cfg_.text;
  const int64_t L = static_cast<int64_t>(s.ids.size());
  IRIS_CHECK(L > 0, "the training sample has no tokens");
  IRIS_CHECK(L <= limits_.max_seq_len, "the training sample has ", L,
             " tokens, more than TrainLimits.max_seq_len = ", limits_.max_seq_len,
             " (raise it or truncate the sample)");
  IRIS_CHECK(s.labels.size() == s.ids.size(), "the sample has ", s.labels.size(), " labels for ", L,
             " tokens; labels must align with ids (unshifted, -100 = none)");
  IRIS_CHECK(static_cast<int>(s.grids.size()) <= limits_.max_images, "the sample has ",
             s.grids.size(), " images, more than TrainLimits.max_images = ", limits_.max_images);
  const int64_t S = count_patches(s.grids);
  IRIS_CHECK(S <= limits_.max_patches, "the sample's images have ", S,
             " patches, more than TrainLimits.max_patches = ", limits_.max_patches);
  IRIS_CHECK(static_cast<int64_t>(s.pixel_values.size()) == S * v.patch_dim(), "the sample has ",
             s.pixel_values.size(), " pixel values; its grids need ", S, " patches x ",
             v.patch_dim());
  int64_t n_pad = 0;
  for (int64_t i = 0; i < L; ++i) {
    IRIS_CHECK(s.ids[i] != cfg_.video_token_id,
               "video tokens are not supported in training samples (position ", i, ")");
    if (s.ids[i] == cfg_.image_token_id) i32(pad_rows_)[n_pad++] = static_cast<int32_t>(i);
  }
  IRIS_CHECK(n_pad * v.merge_unit() == S, "the sample has ", n_pad,
             " <|image_pad|> tokens but its images produce ", S / v.merge_unit(),
             " merged embeddings");
  // HF shift: position i predicts labels[i + 1]; labels[0] is never a target.
  int64_t n_label = 0;
  for (int64_t i = 0; i + 1 < L; ++i) {
    const int32_t y = s.labels[i + 1];
    if (y == kIgnoreIndex) continue;
    IRIS_CHECK(y >= 0 && y < t.vocab_size, "label ", y, " at position ", i + 1,
               " is outside the vocabulary of ", t.vocab_size, " (use -100 for no label)");
    i32(label_rows_)[n_label] = static_cast<int32_t>(i);
    i32(targets_)[n_label++] = y;
  }
  std::memcpy(ids_.data, s.ids.data(), sizeof(int32_t) * L);
  i32(text_cu_)[0] = 0;
  i32(text_cu_)[1] = static_cast<int32_t>(L);
  const RopeIndex rope =
      compute_rope_index(s.ids, s.grids, cfg_.image_token_id, v.spatial_merge_size);
  mrope_tables(t, rope.positions.data(), L, f(cos_), f(sin_));
  if (S > 0) {
    vin_ = plan_vision_inputs(v, s.grids);
    n_segments_ = vin_.n_segments;
  }
  L_ = L;
  S_ = S;
  n_pad_ = n_pad;
  n_label_ = n_label;
}

LossStats TrainableQwen3VL::run(const TrainSample& s, bool backward, float grad_scale) {
  prepare(s);
  const bool lm = !frozen_.language_model;
  const bool vision_grads = S_ > 0 && (!frozen_.vision_tower || !frozen_.merger);
  backward = backward && n_label_ > 0 && (lm || vision_grads);
  if (S_ > 0) vision_forward(s.pixel_values.data());
  text_forward();
  LossStats st;
  st.loss_sum = loss_and_head_backward(backward, grad_scale);
  st.n_tokens = n_label_;
  if (backward) {
    text_backward();
    if (vision_grads) vision_backward(s.pixel_values.data());
  }
  return st;
}

// ---- Vision ------------------------------------------------------------------------------------

void TrainableQwen3VL::vision_forward(const float* pixels) {
  using namespace train;
  const VisionConfig& v = cfg_.vision;
  const VisionWeights& w = params_.vision;
  const int64_t S = S_, D = v.hidden_size, Iv = v.intermediate_size;
  const int nh = v.num_heads, hd = v.head_dim();
  const float eps = v.layer_norm_eps, scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int32_t* cu = vin_.cu_seqlens.data();

  linear_forward(f(vx_[0]), pixels, cf(w.patch_w), cf(w.patch_b), S, v.patch_dim(), D, false);
  pos_embed_forward(f(vx_[0]), cf(w.pos_embed), vin_.pos_index.data(), vin_.pos_weight.data(), S,
                    D);
  const auto& taps = v.deepstack_visual_indexes;
  for (int l = 0; l < v.depth; ++l) {
    const VisionBlockWeights& bw = w.blocks[l];
    VisionBlockActs& a = vb_[l];
    const float* x = cf(vx_[l]);
    layernorm_forward(f(a.ln1), f(a.mean1), f(a.rstd1), x, cf(bw.norm1_w), cf(bw.norm1_b), S, D,
                      eps);
    linear_forward(f(a.qkv), f(a.ln1), cf(bw.qkv_w), cf(bw.qkv_b), S, D, 3 * D, false);
    // The vision RoPE has no q/k norm, so it rotates in place; its backward needs only the tables.
    qk_norm_rope_forward(f(a.qkv), nullptr, f(a.qkv), nullptr, nullptr, vin_.cos.data(),
                         vin_.sin.data(), S, nh, nh, hd, 0.0f);
    attention_forward(f(a.attn), f(a.lse), f(a.qkv), S, nh, nh, hd, scale, cu, n_segments_, false);
    std::memcpy(f(a.x_mid), x, sizeof(float) * S * D);
    linear_forward(f(a.x_mid), f(a.attn), cf(bw.proj_w), cf(bw.proj_b), S, D, D, true);
    layernorm_forward(f(a.ln2), f(a.mean2), f(a.rstd2), f(a.x_mid), cf(bw.norm2_w), cf(bw.norm2_b),
                      S, D, eps);
    linear_forward(f(a.fc1), f(a.ln2), cf(bw.fc1_w), cf(bw.fc1_b), S, D, Iv, false);
    gelu_tanh_forward(f(a.act), f(a.fc1), S * Iv);
    float* y = f(vx_[l + 1]);
    std::memcpy(y, f(a.x_mid), sizeof(float) * S * D);
    linear_forward(y, f(a.act), cf(bw.fc2_w), cf(bw.fc2_b), S, Iv, D, true);
    const auto tap = std::find(taps.begin(), taps.end(), l);
    if (tap != taps.end()) {
      const size_t k = static_cast<size_t>(tap - taps.begin());
      merger_forward(w.deepstack_mergers[k], ds_[k], y, true);
    }
  }
  merger_forward(w.merger, merger_, f(vx_[v.depth]), false);
}

void TrainableQwen3VL::merger_forward(const PatchMergerWeights& w, MergerActs& a, const float* x,
                                      bool post) {
  using namespace train;
  const VisionConfig& v = cfg_.vision;
  const int64_t Sm = S_ / v.merge_unit(), M = v.merged_dim();
  // Post-shuffle (DeepStack) normalises the concatenated 2x2 window; pre-shuffle (the main
  // merger) normalises each patch and concatenates afterwards. Both are the same memory.
  if (post) {
    layernorm_forward(f(a.ln), f(a.mean), f(a.rstd), x, cf(w.norm_w), cf(w.norm_b), Sm, M,
                      v.layer_norm_eps);
  } else {
    layernorm_forward(f(a.ln), f(a.mean), f(a.rstd), x, cf(w.norm_w), cf(w.norm_b), S_,
                      v.hidden_size, v.layer_norm_eps);
  }
  linear_forward(f(a.fc1), f(a.ln), cf(w.fc1_w), cf(w.fc1_b), Sm, M, M, false);
  gelu_erf_forward(f(a.act), f(a.fc1), Sm * M);
  linear_forward(f(a.out), f(a.act), cf(w.fc2_w), cf(w.fc2_b), Sm, M, v.out_hidden_size, false);
}

void TrainableQwen3VL::merger_backward(const PatchMergerWeights& w, PatchMergerWeights* g,
                                       const MergerActs& a, const float* x, const float* dout,
                                       float* dx, bool post) {
  using namespace train;
  if (!g && !dx) return;
  const VisionConfig& v = cfg_.vision;
  const int64_t Sm = S_ / v.merge_unit(), M = v.merged_dim();
  const bool gw = g != nullptr;
  linear_backward(f(m_da_), gw ? f(g->fc2_w) : nullptr, gw ? f(g->fc2_b) : nullptr, dout, f(a.act),
                  cf(w.fc2_w), Sm, M, v.out_hidden_size, false);
  gelu_erf_backward(f(m_da_), f(m_da_), f(a.fc1), Sm * M);
  linear_backward(f(m_dln_), gw ? f(g->fc1_w) : nullptr, gw ? f(g->fc1_b) : nullptr, f(m_da_),
                  f(a.ln), cf(w.fc1_w), Sm, M, M, false);
  const int64_t rows = post ? Sm : S_, cols = post ? M : v.hidden_size;
  layernorm_backward(dx, gw ? f(g->norm_w) : nullptr, gw ? f(g->norm_b) : nullptr, f(m_dln_), x,
                     f(a.mean), f(a.rstd), cf(w.norm_w), rows, cols);
}

void TrainableQwen3VL::vision_backward(const float* pixels) {
  using namespace train;
  const VisionConfig& v = cfg_.vision;
  const VisionWeights& w = params_.vision;
  VisionWeights& g = grads_->vision;
  const int64_t S = S_, D = v.hidden_size, Iv = v.intermediate_size;
  const int nh = v.num_heads, hd = v.head_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int32_t* cu = vin_.cu_seqlens.data();
  const bool tower = !frozen_.vision_tower;
  const auto& taps = v.deepstack_visual_indexes;
  auto merger_grads = [&](PatchMergerWeights& m) { return frozen_.merger ? nullptr : &m; };

  float* dres = tower ? f(v_dres_) : nullptr;
  if (tower) std::fill(dres, dres + S * D, 0.0f);
  merger_backward(w.merger, merger_grads(g.merger), merger_, f(vx_[v.depth]), f(d_embeds_), dres,
                  false);
  if (!tower) {
    for (size_t k = 0; k < taps.size(); ++k)
      merger_backward(w.deepstack_mergers[k], merger_grads(g.deepstack_mergers[k]), ds_[k],
                      f(vx_[taps[k] + 1]), f(d_ds_[k]), nullptr, true);
    return;
  }
  for (int l = v.depth - 1; l >= 0; --l) {
    // dres holds d(output of block l); DeepStack taps read that output too.
    const auto tap = std::find(taps.begin(), taps.end(), l);
    if (tap != taps.end()) {
      const size_t k = static_cast<size_t>(tap - taps.begin());
      merger_backward(w.deepstack_mergers[k], merger_grads(g.deepstack_mergers[k]), ds_[k],
                      f(vx_[l + 1]), f(d_ds_[k]), dres, true);
    }
    const VisionBlockWeights& bw = w.blocks[l];
    VisionBlockWeights& bg = g.blocks[l];
    const VisionBlockActs& a = vb_[l];
    linear_backward(f(v_dfc_), f(bg.fc2_w), f(bg.fc2_b), dres, f(a.act), cf(bw.fc2_w), S, Iv, D,
                    false);
    gelu_tanh_backward(f(v_dfc_), f(v_dfc_), f(a.fc1), S * Iv);
    linear_backward(f(v_dtmp_), f(bg.fc1_w), f(bg.fc1_b), f(v_dfc_), f(a.ln2), cf(bw.fc1_w), S, D,
                    Iv, false);
    layernorm_backward(dres, f(bg.norm2_w), f(bg.norm2_b), f(v_dtmp_), f(a.x_mid), f(a.mean2),
                       f(a.rstd2), cf(bw.norm2_w), S, D);
    linear_backward(f(v_dattn_), f(bg.proj_w), f(bg.proj_b), dres, f(a.attn), cf(bw.proj_w), S, D,
                    D, false);
    attention_backward(f(v_dqkv_), f(v_dsum_), f(v_dattn_), f(a.attn), f(a.lse), f(a.qkv), S, nh,
                       nh, hd, scale, cu, n_segments_, false);
    qk_norm_rope_backward(f(v_dqkv_), nullptr, nullptr, f(v_dqkv_), nullptr, nullptr, nullptr,
                          nullptr, vin_.cos.data(), vin_.sin.data(), S, nh, nh, hd);
    linear_backward(f(v_dtmp_), f(bg.qkv_w), f(bg.qkv_b), f(v_dqkv_), f(a.ln1), cf(bw.qkv_w), S, D,
                    3 * D, false);
    layernorm_backward(dres, f(bg.norm1_w), f(bg.norm1_b), f(v_dtmp_), f(vx_[l]), f(a.mean1),
                       f(a.rstd1), cf(bw.norm1_w), S, D);
  }
  pos_embed_backward(f(g.pos_embed), dres, vin_.pos_index.data(), vin_.pos_weight.data(), S, D);
  linear_backward(nullptr, f(g.patch_w), f(g.patch_b), dres, pixels, cf(w.patch_w), S,
                  v.patch_dim(), D, false);
}

// ---- Text --------------------------------------------------------------------------------------

void TrainableQwen3VL::text_forward() {
  using namespace train;
  const TextConfig& t = cfg_.text;
  const DecoderWeights& w = params_.text;
  const int64_t L = L_, H = t.hidden_size, It = t.intermediate_size;
  const int nq = t.num_attention_heads, nkv = t.num_key_value_heads, hd = t.head_dim;
  const float eps = t.rms_norm_eps, scale = 1.0f / std::sqrt(static_cast<float>(hd));

  embedding_forward(f(tx_[0]), cf(w.embed), i32(ids_), L, H, t.vocab_size);
  if (n_pad_ > 0) scatter_rows(f(tx_[0]), f(merger_.out), i32(pad_rows_), n_pad_, H, false);
  for (int l = 0; l < t.num_hidden_layers; ++l) {
    const DecoderLayerWeights& lw = w.layers[l];
    TextLayerActs& a = tl_[l];
    const float* x = cf(tx_[l]);
    rmsnorm_forward(f(a.rms1), f(a.rstd1), x, cf(lw.input_norm_w), L, H, eps);
    linear_forward(f(a.qkv_lin), f(a.rms1), cf(lw.qkv_w), nullptr, L, H, t.qkv_width(), false);
    qk_norm_rope_forward(f(a.qkv), f(a.qk_rstd), f(a.qkv_lin), cf(lw.q_norm_w), cf(lw.k_norm_w),
                         f(cos_), f(sin_), L, nq, nkv, hd, eps);
    attention_forward(f(a.attn), f(a.lse), f(a.qkv), L, nq, nkv, hd, scale, i32(text_cu_), 1, true);
    std::memcpy(f(a.x_mid), x, sizeof(float) * L * H);
    linear_forward(f(a.x_mid), f(a.attn), cf(lw.o_w), nullptr, L, t.q_width(), H, true);
    rmsnorm_forward(f(a.rms2), f(a.rstd2), f(a.x_mid), cf(lw.post_norm_w), L, H, eps);
    linear_forward(f(a.gate_up), f(a.rms2), cf(lw.gate_up_w), nullptr, L, H, 2 * It, false);
    swiglu_forward(f(a.act), f(a.gate_up), L, It);
    float* y = f(tx_[l + 1]);
    std::memcpy(y, f(a.x_mid), sizeof(float) * L * H);
    linear_forward(y, f(a.act), cf(lw.down_w), nullptr, L, It, H, true);
    if (n_pad_ > 0 && l < static_cast<int>(ds_.size()))
      scatter_rows(y, f(ds_[l].out), i32(pad_rows_), n_pad_, H, true);
  }
  rmsnorm_forward(f(final_), f(final_rstd_), f(tx_[t.num_hidden_layers]), cf(w.norm_w), L, H, eps);
}

double TrainableQwen3VL::loss_and_head_backward(bool backward, float grad_scale) {
  const TextConfig& t = cfg_.text;
  const int64_t H = t.hidden_size;
  if (n_label_ == 0) return 0.0;
  train::gather_rows(f(xlab_), f(final_), i32(label_rows_), n_label_, H);
  const bool lm = !frozen_.language_model;
  // Rows are held back while they fit; a sample with more labelled rows than the whole capacity
  // applies its own after the held-back ones, which keeps the order of the sums.
  if (backward && lm && n_label_ <= pending_capacity_) {
    if (pending_rows_ + n_label_ > pending_capacity_) flush_head_grad();
    const double loss = train::lm_head_cross_entropy(
        f(dxlab_), nullptr, f(xlab_), cf(params_.text.lm_head), i32(targets_), n_label_, H,
        t.vocab_size, grad_scale, f(logits_), logits_.numel(), loss_chunk_,
        f(pending_dl_) + pending_rows_ * t.vocab_size);
    std::memcpy(f(pending_x_) + pending_rows_ * H, f(xlab_), sizeof(float) * n_label_ * H);
    pending_rows_ += n_label_;
    return loss;
  }
  if (backward) flush_head_grad();
  if (backward && lm) head_grad_dense_ = true;
  return train::lm_head_cross_entropy(
      backward ? f(dxlab_) : nullptr, backward ? g_or_null(grads_->text.lm_head, lm) : nullptr,
      f(xlab_), cf(params_.text.lm_head), i32(targets_), n_label_, H, t.vocab_size, grad_scale,
      f(logits_), logits_.numel(), loss_chunk_);
}

void TrainableQwen3VL::flush_head_grad() {
  if (pending_rows_ == 0) return;
  const TextConfig& t = cfg_.text;
  train::lm_head_weight_grad(f(grads_->text.lm_head), f(pending_dl_), f(pending_x_), pending_rows_,
                             t.hidden_size, t.vocab_size);
  pending_rows_ = 0;
  head_grad_dense_ = true;
}

void TrainableQwen3VL::move_grads_into(TrainableQwen3VL& sum) {
  IRIS_CHECK(&sum != this && &sum.params_ == &params_,
             "move_grads_into needs another replica of the same parameters");
  const TextConfig& t = cfg_.text;
  const int64_t H = t.hidden_size;
  if (pending_rows_ > 0) {
    train::lm_head_weight_grad(f(sum.grads_->text.lm_head), f(pending_dl_), f(pending_x_),
                               pending_rows_, H, t.vocab_size);
    pending_rows_ = 0;
    sum.head_grad_dense_ = true;
  }
  const Tensor* embed = &grads_->text.embed;
  const Tensor* head = grads_->tied_lm_head ? embed : &grads_->text.lm_head;
  for (size_t i = 0; i < grads_->bindings.size(); ++i) {
    const WeightBinding& b = grads_->bindings[i];
    if (b.row_offset != 0) continue;  // fused tensors: the binding at row 0 covers the whole
    float* src = f(*b.target);
    float* dst = f(*sum.grads_->bindings[i].target);
    if (!head_grad_dense_ && b.target == embed) {
      for (int32_t row : touched_embed_rows_) {
        float* s = src + int64_t(row) * H;
        float* d = dst + int64_t(row) * H;
        for (int64_t c = 0; c < H; ++c) d[c] += s[c];
        std::fill(s, s + H, 0.0f);
        if (!sum.embed_row_touched_[static_cast<size_t>(row)]) {
          sum.embed_row_touched_[static_cast<size_t>(row)] = 1;
          sum.touched_embed_rows_.push_back(row);
        }
      }
      continue;
    }
    if (!head_grad_dense_ && b.target == head) continue;  // an untied lm_head with no rows yet
    const int64_t n = b.target->numel();
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 16))
    for (int64_t k = 0; k < n; ++k) {
      dst[k] += src[k];
      src[k] = 0.0f;
    }
  }
  for (int32_t row : touched_embed_rows_) embed_row_touched_[static_cast<size_t>(row)] = 0;
  touched_embed_rows_.clear();
  if (head_grad_dense_) sum.head_grad_dense_ = true;
  head_grad_dense_ = false;
}

void TrainableQwen3VL::text_backward() {
  using namespace train;
  const TextConfig& t = cfg_.text;
  const DecoderWeights& w = params_.text;
  DecoderWeights& g = grads_->text;
  const bool lm = !frozen_.language_model;
  const int64_t L = L_, H = t.hidden_size, It = t.intermediate_size;
  const int nq = t.num_attention_heads, nkv = t.num_key_value_heads, hd = t.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));

  float* dres = f(t_dres_);
  float* dtmp = f(t_dtmp_);
  std::fill(dres, dres + L * H, 0.0f);
  std::fill(dtmp, dtmp + L * H, 0.0f);
  scatter_rows(dtmp, f(dxlab_), i32(label_rows_), n_label_, H, false);
  rmsnorm_backward(dres, g_or_null(g.norm_w, lm), dtmp, f(tx_[t.num_hidden_layers]), f(final_rstd_),
                   cf(w.norm_w), L, H);
  for (int l = t.num_hidden_layers - 1; l >= 0; --l) {
    // dres holds d(input of layer l + 1), which is also d(the DeepStack rows added after layer l).
    if (n_pad_ > 0 && l < static_cast<int>(ds_.size()))
      gather_rows(f(d_ds_[l]), dres, i32(pad_rows_), n_pad_, H);
    const DecoderLayerWeights& lw = w.layers[l];
    DecoderLayerWeights& lg = g.layers[l];
    const TextLayerActs& a = tl_[l];
    linear_backward(f(t_dact_), g_or_null(lg.down_w, lm), nullptr, dres, f(a.act), cf(lw.down_w), L,
                    It, H, false);
    swiglu_backward(f(t_dgu_), f(t_dact_), f(a.gate_up), L, It);
    linear_backward(dtmp, g_or_null(lg.gate_up_w, lm), nullptr, f(t_dgu_), f(a.rms2),
                    cf(lw.gate_up_w), L, H, 2 * It, false);
    rmsnorm_backward(dres, g_or_null(lg.post_norm_w, lm), dtmp, f(a.x_mid), f(a.rstd2),
                     cf(lw.post_norm_w), L, H);
    linear_backward(f(t_dattn_), g_or_null(lg.o_w, lm), nullptr, dres, f(a.attn), cf(lw.o_w), L,
                    t.q_width(), H, false);
    attention_backward(f(t_dqkv_), f(t_dsum_), f(t_dattn_), f(a.attn), f(a.lse), f(a.qkv), L, nq,
                       nkv, hd, scale, i32(text_cu_), 1, true);
    qk_norm_rope_backward(f(t_dqkv_), g_or_null(lg.q_norm_w, lm), g_or_null(lg.k_norm_w, lm),
                          f(t_dqkv_), f(a.qkv_lin), f(a.qk_rstd), cf(lw.q_norm_w), cf(lw.k_norm_w),
                          f(cos_), f(sin_), L, nq, nkv, hd);
    linear_backward(dtmp, g_or_null(lg.qkv_w, lm), nullptr, f(t_dqkv_), f(a.rms1), cf(lw.qkv_w), L,
                    H, t.qkv_width(), false);
    rmsnorm_backward(dres, g_or_null(lg.input_norm_w, lm), dtmp, f(tx_[l]), f(a.rstd1),
                     cf(lw.input_norm_w), L, H);
  }
  // Image-pad rows were overwritten by the vision scatter: their gradient goes to the vision
  // tower, not to the pad token's embedding row.
  if (lm) {
    embedding_backward(f(g.embed), dres, i32(ids_), L, H, cfg_.image_token_id);
    for (int64_t i = 0; i < L; ++i) {
      const int32_t id = i32(ids_)[i];
      if (id == cfg_.image_token_id || embed_row_touched_[static_cast<size_t>(id)]) continue;
      embed_row_touched_[static_cast<size_t>(id)] = 1;
      touched_embed_rows_.push_back(id);
    }
  }
  if (n_pad_ > 0) gather_rows(f(d_embeds_), dres, i32(pad_rows_), n_pad_, H);
}

}  // namespace iris
