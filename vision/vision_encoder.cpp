#include "vision/vision_encoder.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>

#include "core/vision_tables.h"
#include "vision/vision_tower_order.h"

namespace iris {

int64_t count_patches(const std::vector<GridTHW>& grids) {
  int64_t n = 0;
  for (const auto& g : grids) n += g[0] * g[1] * g[2];
  return n;
}

VisionSegments VisionSegments::for_block(const VisionConfig& cfg, int l) const {
  VisionSegments s = *this;
  if (cfg.windowed_block(l)) {
    s.cu_seqlens = window_cu;
    s.n_segments = n_windows;
  }
  return s;
}

void vision_attention_forward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                              const VisionBlockBuffers& b, const VisionSegments& seg) {
  const int nh = cfg.num_heads, hd = cfg.head_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  cfg.tower->norm(be, cfg, b.ln1, b.mean1, b.rstd1, b.x_in, w.norm1_w, w.norm1_b);
  be.linear(b.qkv, b.ln1, w.qkv_w, w.qkv_b, false);
  lora_forward(be, w.qkv_lora, b.qkv, b.ln1, b.lora);
  // No q/k norm in the tower: the rotation runs in place, and its backward needs only the tables.
  be.qkv_norm_rope(b.qkv, Tensor(), Tensor(), 0.0f, seg.cos, seg.sin, nh, nh, hd, false);
  if (b.saves()) {
    be.attention_train(b.attn, b.lse, b.qkv, seg.cu_seqlens, seg.n_segments, nh, nh, hd, scale,
                       false, seg.real_rows);
  } else {
    be.attention_segments(b.attn, b.qkv, seg.cu_seqlens, seg.n_segments, nh, hd, scale,
                          seg.real_rows);
  }
  if (b.x_mid.data != b.x_in.data) be.copy(b.x_mid, b.x_in);
  be.linear(b.x_mid, b.attn, w.proj_w, w.proj_b, true);
  lora_forward(be, w.proj_lora, b.x_mid, b.attn, b.lora);
}

void vision_mlp_forward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                        const VisionBlockBuffers& b) {
  cfg.tower->norm(be, cfg, b.ln2, b.mean2, b.rstd2, b.x_mid, w.norm2_w, w.norm2_b);
  if (w.fc1_lora.empty()) {
    cfg.tower->mlp_up(be, w, b.fc1, b.act, b.ln2);
  } else {
    // The adapters' rows join fc1's output before the activation reads it.
    be.linear(b.fc1, b.ln2, w.fc1_w, w.fc1_b, false);
    lora_forward(be, w.fc1_lora, b.fc1, b.ln2, b.lora);
    cfg.tower->mlp_activation(be, b.act, b.fc1);
  }
  if (b.x_out.data != b.x_mid.data) be.copy(b.x_out, b.x_mid);
  be.linear(b.x_out, b.act, w.fc2_w, w.fc2_b, true);
  lora_forward(be, w.fc2_lora, b.x_out, b.act, b.lora);
}

void vision_block_forward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                          const VisionBlockBuffers& b, const VisionSegments& seg) {
  vision_attention_forward(be, cfg, w, b, seg);
  vision_mlp_forward(be, cfg, w, b);
}

void vision_block_recompute(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                            const VisionBlockBuffers& b, const VisionSegments& seg,
                            Recompute mode) {
  if (mode == Recompute::full) {
    vision_block_forward(be, cfg, w, b, seg);
    return;
  }
  if (mode != Recompute::selective) return;
  const VisionTower& tower = *cfg.tower;
  tower.norm(be, cfg, b.ln1, b.mean1, b.rstd1, b.x_in, w.norm1_w, w.norm1_b);
  tower.norm(be, cfg, b.ln2, b.mean2, b.rstd2, b.x_mid, w.norm2_w, w.norm2_b);
  tower.mlp_activation(be, b.act, b.fc1);
}

void merger_forward(Backend& be, const VisionConfig& cfg, const PatchMergerWeights& w,
                    const MergerBuffers& b, const Tensor& x, int64_t rows, bool post_shuffle,
                    bool gemms_beside) {
  const int64_t Sm = rows / cfg.merge_unit(), M = cfg.merged_dim(), D = cfg.hidden_size;
  // Post-shuffle (DeepStack) normalises the concatenated 2x2 window; pre-shuffle (the main
  // merger) normalises each patch and concatenates afterwards. Both are the same memory.
  const Tensor xin = post_shuffle ? x.slice(0, rows).view({Sm, M}) : x.slice(0, rows);
  const Tensor ln = post_shuffle ? b.ln.slice(0, Sm) : b.ln.slice(0, Sm).view({rows, D});
  const int64_t norm_rows = post_shuffle ? Sm : rows;
  be.join_side_work();  // the mergers share their buffers
  const auto part = [&](const Tensor& t) { return t.defined() ? t.slice(0, norm_rows) : t; };
  cfg.tower->norm(be, cfg, ln, part(b.mean), part(b.rstd), xin, w.norm_w, w.norm_b);
  // A DeepStack merger's output feeds only the decoder, so once its norm has read x (which the
  // next layer updates in place) its two GEMMs may run beside the remaining layers. At one small
  // image they are weight-streaming GEMMs beside latency-bound layers.
  const SideWorkScope side(be, gemms_beside);
  be.linear(b.fc1.slice(0, Sm), b.ln.slice(0, Sm), w.fc1_w, w.fc1_b, false);
  lora_forward(be, w.fc1_lora, b.fc1.slice(0, Sm), b.ln.slice(0, Sm), b.lora);
  be.gelu_erf(b.act.slice(0, Sm), b.fc1.slice(0, Sm));
  be.linear(b.out.slice(0, Sm), b.act.slice(0, Sm), w.fc2_w, w.fc2_b, false);
  lora_forward(be, w.fc2_lora, b.out.slice(0, Sm), b.act.slice(0, Sm), b.lora);
}

void merger_backward(Backend& be, const VisionConfig& cfg, const PatchMergerWeights& w,
                     PatchMergerWeights* g, const MergerBuffers& b, const Tensor& x, int64_t rows,
                     bool post_shuffle, const Tensor& dout, const Tensor& dx,
                     const VisionGradScratch& s) {
  if (!g && !dx.defined()) return;
  const int64_t Sm = rows / cfg.merge_unit(), M = cfg.merged_dim(), D = cfg.hidden_size;
  const Tensor da = s.m_da.slice(0, Sm), dln = s.m_dln.slice(0, Sm), dy = dout.slice(0, Sm);
  // Overwrites da; accumulates fc2's weight and bias gradients.
  be.linear_backward_input(da, dy, w.fc2_w, false);
  if (g) be.linear_backward_weight(g->fc2_w, g->fc2_b, dy, b.act.slice(0, Sm));
  lora_backward(be, w.fc2_lora, g ? &g->fc2_lora : nullptr, da, dy, b.act.slice(0, Sm), b.lora);
  be.gelu_erf_backward(da, da, b.fc1.slice(0, Sm));
  // Overwrites dln; accumulates fc1's gradients.
  be.linear_backward_input(dln, da, w.fc1_w, false);
  if (g) be.linear_backward_weight(g->fc1_w, g->fc1_b, da, b.ln.slice(0, Sm));
  lora_backward(be, w.fc1_lora, g ? &g->fc1_lora : nullptr, dln, da, b.ln.slice(0, Sm), b.lora);
  // Accumulates into dx (the residual gradient) and the norm's gradients.
  const Tensor dnw = g ? g->norm_w : Tensor(), dnb = g ? g->norm_b : Tensor();
  const int64_t norm_rows = post_shuffle ? Sm : rows;
  const auto as_norm = [&](const Tensor& t) {
    return post_shuffle ? t.slice(0, rows).view({Sm, M}) : t.slice(0, rows).view({rows, D});
  };
  cfg.tower->norm_backward(be, dx.defined() ? as_norm(dx) : Tensor(), dnw, dnb,
                           post_shuffle ? dln : dln.view({rows, D}), as_norm(x),
                           b.mean.slice(0, norm_rows), b.rstd.slice(0, norm_rows), w.norm_w);
}

void vision_mlp_backward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                         VisionBlockWeights& g, const VisionBlockBuffers& b,
                         const VisionGradScratch& s) {
  // Overwrites dfc, dup and dtmp, accumulates fc1/fc2 and norm2 gradients and dres.
  const Tensor dy = in_compute_dtype(be, s.dres, s.dres_c);
  be.linear_backward_input(s.dfc, dy, w.fc2_w, false);
  be.linear_backward_weight(g.fc2_w, g.fc2_b, dy, b.act);
  lora_backward(be, w.fc2_lora, &g.fc2_lora, s.dfc, dy, b.act, s.lora);
  cfg.tower->mlp_activation_backward(be, s.dup, s.dfc, b.fc1);
  be.linear_backward_input(s.dtmp, s.dup, w.fc1_w, false);
  be.linear_backward_weight(g.fc1_w, g.fc1_b, s.dup, b.ln2);
  lora_backward(be, w.fc1_lora, &g.fc1_lora, s.dtmp, s.dup, b.ln2, s.lora);
  cfg.tower->norm_backward(be, s.dres, g.norm2_w, g.norm2_b, s.dtmp, b.x_mid, b.mean2, b.rstd2,
                           w.norm2_w);
}

void vision_attention_backward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                               VisionBlockWeights& g, const VisionBlockBuffers& b,
                               const VisionSegments& seg, const VisionGradScratch& s) {
  const int nh = cfg.num_heads, hd = cfg.head_dim();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // Overwrites dattn, dqkv and dtmp, accumulates qkv/proj and norm1 gradients and dres.
  const Tensor dy = in_compute_dtype(be, s.dres, s.dres_c);
  be.linear_backward_input(s.dattn, dy, w.proj_w, false);
  be.linear_backward_weight(g.proj_w, g.proj_b, dy, b.attn);
  lora_backward(be, w.proj_lora, &g.proj_lora, s.dattn, dy, b.attn, s.lora);
  be.attention_backward(s.dqkv, s.dsum, s.dattn, b.attn, b.lse, b.qkv, seg.cu_seqlens,
                        seg.n_segments, nh, nh, hd, scale, false, seg.real_rows);
  be.qkv_norm_rope_backward(s.dqkv, Tensor(), Tensor(), s.dqkv, Tensor(), Tensor(), Tensor(),
                            Tensor(), seg.cos, seg.sin, nh, nh, hd, false);
  be.linear_backward_input(s.dtmp, s.dqkv, w.qkv_w, false);
  be.linear_backward_weight(g.qkv_w, g.qkv_b, s.dqkv, b.ln1);
  lora_backward(be, w.qkv_lora, &g.qkv_lora, s.dtmp, s.dqkv, b.ln1, s.lora);
  cfg.tower->norm_backward(be, s.dres, g.norm1_w, g.norm1_b, s.dtmp, b.x_in, b.mean1, b.rstd1,
                           w.norm1_w);
}

void vision_block_backward(Backend& be, const VisionConfig& cfg, const VisionBlockWeights& w,
                           VisionBlockWeights& g, const VisionBlockBuffers& b,
                           const VisionSegments& seg, const VisionGradScratch& s) {
  vision_mlp_backward(be, cfg, w, g, b, s);
  vision_attention_backward(be, cfg, w, g, b, seg, s);
}

VisionCall plan_vision_call(const VisionConfig& cfg, const std::vector<GridTHW>& grids,
                            int64_t padded_rows, int segment_capacity) {
  const int m = cfg.spatial_merge_size;
  VisionCall call;
  int64_t segments = 0;
  for (const auto& g : grids) {
    const int64_t t = g[0], h = g[1], w = g[2];
    // The device reads the grids as i32, and no patch count below may overflow.
    const int64_t limit = std::numeric_limits<int32_t>::max();
    IRIS_CHECK(t >= 1 && h >= 1 && w >= 1 && h % m == 0 && w % m == 0, "image grid [", t, ", ", h,
               ", ", w, "] must be positive with height and width divisible by ", m);
    IRIS_CHECK(t <= limit && h <= limit && w <= limit && h * w <= limit &&
                   t * (h * w) <= limit - call.n_patches,
               "image grid [", t, ", ", h, ", ", w, "] makes the call exceed ", limit, " patches");
    call.n_patches += t * h * w;
    segments += t;
    if (cfg.window_units() > 0)
      call.n_windows += static_cast<int>(vision_window_count(t, h, w, m, cfg.window_units()));
  }
  call.rows = padded_rows > 0 ? padded_rows : call.n_patches;
  IRIS_CHECK(call.rows >= call.n_patches, "vision padding to ", call.rows,
             " rows is smaller than the ", call.n_patches, " patches of this call");
  if (call.rows > call.n_patches) {
    ++segments;  // the padding rows' own segment
    if (cfg.window_units() > 0) ++call.n_windows;
  }
  if (segment_capacity > 0)
    IRIS_CHECK(segments <= segment_capacity, "this encoder call has ", segments,
               " segments but the buffer holds ", segment_capacity,
               " (too many images in one call)");
  call.n_segments = static_cast<int>(segments);
  return call;
}

void pack_vision_grids(const std::vector<GridTHW>& grids, int capacity, std::vector<int32_t>& out) {
  IRIS_CHECK(static_cast<int64_t>(grids.size()) <= capacity, grids.size(),
             " images in one vision call, more than its ", capacity, " segments");
  out.assign(static_cast<size_t>(vision_grids_numel(capacity)), 0);
  out[0] = static_cast<int32_t>(grids.size());
  for (size_t i = 0; i < grids.size(); ++i)
    for (int k = 0; k < 3; ++k) {
      IRIS_CHECK(grids[i][k] >= 0 && grids[i][k] <= std::numeric_limits<int32_t>::max(),
                 "image grid entry ", grids[i][k], " does not fit the device's i32 grids");
      out[1 + 3 * i + k] = static_cast<int32_t>(grids[i][k]);
    }
}

int vision_window_capacity(const VisionConfig& cfg, int64_t rows) {
  // Every window holds at least one merged unit, and padding takes one more segment.
  return cfg.window_units() > 0 ? static_cast<int>(rows / cfg.merge_unit()) + 1 : 0;
}

std::vector<int32_t> vision_unit_order(const VisionConfig& cfg, const std::vector<GridTHW>& grids,
                                       int64_t rows) {
  if (cfg.window_units() == 0) return {};
  std::vector<int32_t> packed;
  pack_vision_grids(grids, static_cast<int>(std::max<size_t>(grids.size(), 1)), packed);
  std::vector<int32_t> order =
      vision_window_index(packed.data(), cfg.spatial_merge_size, cfg.window_units());
  // Padding rows stay where they are.
  for (int64_t u = static_cast<int64_t>(order.size()); u < rows / cfg.merge_unit(); ++u)
    order.push_back(static_cast<int32_t>(u));
  return order;
}

void to_window_order(const VisionConfig& cfg, const std::vector<int32_t>& unit_order,
                     const float* pixels, float* out) {
  const size_t unit_floats = static_cast<size_t>(cfg.merge_unit()) * cfg.patch_dim();
  for (size_t i = 0; i < unit_order.size(); ++i)
    std::copy_n(pixels + static_cast<size_t>(unit_order[i]) * unit_floats, unit_floats,
                out + i * unit_floats);
}

VisionInputs plan_vision_inputs(const VisionConfig& cfg, const std::vector<GridTHW>& grids,
                                int64_t padded_rows, int segment_capacity) {
  const VisionCall call = plan_vision_call(cfg, grids, padded_rows, segment_capacity);
  const int hd = cfg.head_dim();
  // The tables are written for a capacity; without one, for exactly the segments used.
  const int capacity = std::max(segment_capacity > 0 ? segment_capacity : call.n_segments, 1);
  std::vector<int32_t> packed;
  pack_vision_grids(grids, capacity, packed);
  VisionInputs in;
  in.n_patches = call.n_patches;
  in.rows = call.rows;
  in.n_segments = call.n_segments;
  in.cos.resize(static_cast<size_t>(in.rows * hd));
  in.sin.resize(in.cos.size());
  in.pos_index.resize(static_cast<size_t>(in.rows * 4));
  in.pos_weight.resize(in.pos_index.size());
  in.cu_seqlens.resize(static_cast<size_t>(capacity) + 1);
  int32_t real_rows = 0;
  VisionTablesOut out;
  out.cos = in.cos.data();
  out.sin = in.sin.data();
  out.pos_index = in.pos_index.data();
  out.pos_weight = in.pos_weight.data();
  out.cu_seqlens = in.cu_seqlens.data();
  out.real_rows = &real_rows;
  std::vector<int32_t> window_cu(static_cast<size_t>(vision_window_capacity(cfg, in.rows)) + 1);
  out.window_cu = window_cu.data();
  vision_tables_host(out, packed.data(), capacity, in.rows, hd,
                     vision_rope_inv_freq(hd, cfg.rope_theta), cfg.spatial_merge_size,
                     cfg.position_grid_side(), cfg.window_units(),
                     vision_window_capacity(cfg, in.rows));
  if (segment_capacity <= 0) in.cu_seqlens.resize(static_cast<size_t>(in.n_segments) + 1);
  return in;
}

VisionEncoder::VisionEncoder(Backend& backend, const VisionConfig& cfg,
                             const VisionWeights& weights, int64_t max_rows, int max_segments)
    : backend_(backend), cfg_(cfg), w_(weights), max_rows_(max_rows), max_segments_(max_segments) {
  const int unit = cfg.merge_unit();
  IRIS_CHECK(max_rows > 0 && max_rows % unit == 0, "vision max rows ", max_rows,
             " must be a positive multiple of ", unit);
  IRIS_CHECK(max_segments > 0, "vision encoder needs at least one segment");
  inv_freq_ = vision_rope_inv_freq(cfg.head_dim(), cfg.rope_theta);
  if (cfg.window_units() > 0)
    window_pixels_.reserve(static_cast<size_t>(max_rows * cfg.patch_dim()));
  grids_host_.assign(static_cast<size_t>(vision_grids_numel(max_segments)), 0);
  Arena plan;
  allocate(plan);
  arena_ = Arena(backend, plan.used());
  allocate(arena_);
}

void VisionEncoder::allocate(Arena& a) {
  const DType dt = backend_.compute_dtype();
  const int64_t S = max_rows_, D = cfg_.hidden_size, M = cfg_.merged_dim();
  const int64_t Sm = S / cfg_.merge_unit();
  pixels_ = a.alloc(dt, {S, cfg_.patch_dim()});
  image_bytes_ =
      a.alloc(DType::u8, {S * cfg_.temporal_patch_size * cfg_.patch_size * cfg_.patch_size * 3});
  pixel_table_ = a.alloc(DType::f32, {3 * 256});
  patch_rows_ = a.alloc(DType::i32, {S});
  grids_ = a.alloc(DType::i32, {vision_grids_numel(max_segments_)});
  cos_ = a.alloc(DType::f32, {S, cfg_.head_dim()});
  sin_ = a.alloc(DType::f32, {S, cfg_.head_dim()});
  pos_index_ = a.alloc(DType::i32, {S, 4});
  pos_weight_ = a.alloc(DType::f32, {S, 4});
  cu_seqlens_ = a.alloc(DType::i32, {max_segments_ + 1});
  real_rows_ = a.alloc(DType::i32, {1});
  const bool windows = cfg_.window_units() > 0;
  window_cu_ = windows ? a.alloc(DType::i32, {vision_window_capacity(cfg_, S) + 1}) : Tensor();
  unit_order_ = windows ? a.alloc(DType::i32, {Sm}) : Tensor();
  x_ = a.alloc(dt, {S, D});
  xn_ = a.alloc(dt, {S, D});
  qkv_ = a.alloc(dt, {S, 3 * D});
  attn_ = a.alloc(dt, {S, D});
  const int64_t up = cfg_.tower->mlp_up_width(cfg_);
  mlp_ = a.alloc(dt, {S, up});
  act_ = up == cfg_.intermediate_size ? mlp_ : a.alloc(dt, {S, cfg_.intermediate_size});
  merged_norm_ = a.alloc(dt, {Sm, M});
  merger_hidden_ = a.alloc(dt, {Sm, M});
  embeds_ = a.alloc(dt, {Sm, cfg_.out_hidden_size});
  windowed_embeds_ = windows ? a.alloc(dt, {Sm, cfg_.out_hidden_size}) : Tensor();
  deepstack_.clear();
  for (size_t i = 0; i < cfg_.deepstack_visual_indexes.size(); ++i)
    deepstack_.push_back(a.alloc(dt, {Sm, cfg_.out_hidden_size}));
  LoraScratchSize lora;
  for (const VisionBlockWeights& w : w_.blocks)
    for (const LoraAdapters* ad : {&w.qkv_lora, &w.proj_lora, &w.fc1_lora, &w.fc2_lora})
      lora.cover(*ad);
  lora_ = allocate_lora_scratch(a, dt, S, lora);
  LoraScratchSize merger_lora;
  for (const LoraAdapters* ad : {&w_.merger.fc1_lora, &w_.merger.fc2_lora}) merger_lora.cover(*ad);
  merger_lora_ = allocate_lora_scratch(a, dt, Sm, merger_lora);
}

VisionCall VisionEncoder::upload(const VisionPixels& pixels, const std::vector<GridTHW>& grids,
                                 int64_t padded_rows) {
  const VisionCall call = plan_vision_call(cfg_, grids, padded_rows, max_segments_);
  n_windows_ = padded_rows > 0 ? vision_window_capacity(cfg_, call.rows) : call.n_windows;
  IRIS_CHECK(call.rows <= max_rows_, "vision call of ", call.rows,
             " patch rows exceeds the planned ", max_rows_,
             " (raise the maximum vision sequence length)");
  IRIS_CHECK(call.n_patches == 0 || pixels.rows != nullptr || pixels.from_frames(),
             "a vision call of ", call.n_patches, " patches came without pixels");
  // The grids first: a few ints that rarely wait, while the pixel write below may wait for the
  // staging buffer it shares with them.
  pack_vision_grids(grids, max_segments_, grids_host_);
  backend_.write(grids_, grids_host_.data(), DType::i32);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> order;
  if (cfg_.window_units() > 0) {
    // The tower computes in window order (VisionConfig::window_size): the pixel rows go up in
    // it, and unit_order_ writes the outputs back in raster order.
    order = vision_unit_order(cfg_, grids, call.rows);
    backend_.write(unit_order_.slice(0, static_cast<int64_t>(order.size())), order.data(),
                   DType::i32);
    order.resize(static_cast<size_t>(call.n_patches / cfg_.merge_unit()));
  }
  if (pixels.from_frames()) {
    upload_media(pixels.media, grids, order, call.n_patches);
  } else {
    const float* rows = pixels.rows;
    if (!order.empty()) {
      window_pixels_.resize(static_cast<size_t>(call.n_patches * cfg_.patch_dim()));
      to_window_order(cfg_, order, rows, window_pixels_.data());
      rows = window_pixels_.data();
    }
    backend_.write(pixels_.slice(0, call.n_patches), rows, DType::f32);
  }
  last_pixel_upload_ms_ =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  if (call.rows > call.n_patches) backend_.fill_zero(pixels_.slice(call.n_patches, call.rows));
  return call;
}

VisionPixels::VisionPixels(const std::vector<ImageRGB8>& sized_images, const PixelTable& table) {
  for (const ImageRGB8& im : sized_images) media.push_back({{&im}, &table});
}

void VisionEncoder::upload_media(const std::vector<VisionMedia>& media,
                                 const std::vector<GridTHW>& grids,
                                 const std::vector<int32_t>& unit_order, int64_t n_patches) {
  IRIS_CHECK(cfg_.in_channels == 3, "RGB frames cannot feed a vision tower of ", cfg_.in_channels,
             " input channels");
  IRIS_CHECK(media.size() == grids.size(), "a vision call of ", grids.size(), " grids came with ",
             media.size(), " images and videos");
  const int P = cfg_.patch_size, Tp = cfg_.temporal_patch_size;
  for (size_t i = 0; i < media.size(); ++i) {
    const GridTHW& g = grids[i];
    const std::vector<const ImageRGB8*>& frames = media[i].frames;
    const bool image = frames.size() == 1 && g[0] == 1;
    IRIS_CHECK(media[i].table != nullptr && (image || int64_t(frames.size()) == g[0] * Tp), "grid ",
               i, " [", g[0], ", ", g[1], ", ", g[2], "] of a vision call came with ",
               frames.size(), " frames (an image brings 1, a video grid_t * ", Tp, ")");
    for (const ImageRGB8* f : frames)
      IRIS_CHECK(int64_t{f->height} == g[1] * P && int64_t{f->width} == g[2] * P &&
                     f->pixels.size() == size_t(f->height) * f->width * 3,
                 "a frame of grid ", i, " of a vision call is ", f->width, "x", f->height,
                 " but its grid is [", g[0], ", ", g[1], ", ", g[2],
                 "] (size images with size_images first)");
  }
  // Patch r of the call (raster order) goes to row r, or in window order to its unit's place.
  const int64_t unit = cfg_.merge_unit();
  patch_rows_host_.resize(static_cast<size_t>(n_patches));
  std::vector<int32_t> place(unit_order.size());
  for (size_t i = 0; i < unit_order.size(); ++i)
    place[static_cast<size_t>(unit_order[i])] = int32_t(i);
  for (int64_t r = 0; r < n_patches; ++r)
    patch_rows_host_[static_cast<size_t>(r)] = static_cast<int32_t>(
        place.empty() ? r : place[static_cast<size_t>(r / unit)] * unit + r % unit);
  backend_.write(patch_rows_.slice(0, n_patches), patch_rows_host_.data(), DType::i32);
  // One table buffer serves every grid: each write is ordered before the op that reads it and
  // after the op before, on the backend's one stream.
  int64_t row = 0, byte = 0;
  for (size_t i = 0; i < media.size(); ++i) {
    backend_.write(pixel_table_, media[i].table->data(), DType::f32);
    const std::vector<const ImageRGB8*>& frames = media[i].frames;
    ImagePatchGeometry geometry;
    geometry.height = frames[0]->height;
    geometry.width = frames[0]->width;
    geometry.patch_size = P;
    geometry.temporal_patch_size = Tp;
    geometry.merge_size = cfg_.spatial_merge_size;
    const int64_t frame_bytes = int64_t{geometry.height} * geometry.width * 3;
    const size_t per_slice = frames.size() == 1 ? 1 : static_cast<size_t>(Tp);
    for (size_t first = 0; first < frames.size(); first += per_slice) {
      const Tensor bytes = image_bytes_.slice(byte, byte + frame_bytes * int64_t(per_slice));
      for (size_t f = 0; f < per_slice; ++f)
        backend_.write(bytes.slice(int64_t(f) * frame_bytes, int64_t(f + 1) * frame_bytes),
                       frames[first + f]->pixels.data(), DType::u8);
      backend_.image_patches(pixels_, bytes, pixel_table_,
                             patch_rows_.slice(row, row + geometry.patches()), geometry);
      row += geometry.patches();
      byte += frame_bytes * int64_t(per_slice);
    }
  }
}

void VisionEncoder::run_merger(const PatchMergerWeights& m, const Tensor& x, int64_t rows,
                               bool post_shuffle, const Tensor& out, bool beside_layers) {
  MergerBuffers b;
  b.ln = merged_norm_;
  b.fc1 = b.act = merger_hidden_;
  b.out = out;
  b.lora = merger_lora_;
  merger_forward(backend_, cfg_, m, b, x, rows, post_shuffle, beside_layers);
}

namespace {
// The eager call: the tower's order on the encoder's buffers, each DeepStack merger beside the
// blocks after it.
class EncoderSteps final : public VisionTowerSteps {
 public:
  EncoderSteps(VisionEncoder& encoder, int64_t rows, int n_segments,
               std::function<void(int, int64_t)> deepstack)
      : encoder_(encoder), rows_(rows), n_segments_(n_segments), deepstack_(std::move(deepstack)) {}
  void embed() override { encoder_.run_embed(rows_); }
  void block(int l) override { encoder_.run_block(l, rows_, n_segments_); }
  void deepstack_merger(int k, int) override { deepstack_(k, rows_); }
  void merger() override { encoder_.run_merger(rows_); }

 private:
  VisionEncoder& encoder_;
  int64_t rows_;
  int n_segments_;
  std::function<void(int, int64_t)> deepstack_;
};
}  // namespace

VisionEncoder::Output VisionEncoder::run(int64_t S, int n_segments) {
  EncoderSteps steps(*this, S, n_segments,
                     [this](int k, int64_t rows) { run_deepstack_merger(k, rows, true); });
  vision_tower_forward(cfg_, steps);
  return output(S);
}

void VisionEncoder::run_embed(int64_t S) {
  IRIS_CHECK(S > 0 && S <= max_rows_ && S % cfg_.merge_unit() == 0, "vision run over ", S,
             " rows (planned ", max_rows_, ")");
  // The tables of the grids in grids_, on the device: inside a captured graph they follow each
  // replay's images, and the host uploads no tables.
  backend_.vision_tables(cos_.slice(0, S), sin_.slice(0, S), pos_index_.slice(0, S),
                         pos_weight_.slice(0, S), cu_seqlens_, real_rows_, grids_, inv_freq_,
                         cfg_.spatial_merge_size, cfg_.position_grid_side(), window_cu_,
                         cfg_.window_units());
  cfg_.tower->embed(backend_, w_, x_.slice(0, S), pixels_.slice(0, S), pos_index_.slice(0, S),
                    pos_weight_.slice(0, S));
}

void VisionEncoder::run_block(int l, int64_t S, int n_segments) {
  VisionBlockBuffers b;
  b.x_in = b.x_mid = b.x_out = x_.slice(0, S);
  b.ln1 = b.ln2 = xn_.slice(0, S);
  b.qkv = qkv_.slice(0, S);
  b.attn = attn_.slice(0, S);
  b.fc1 = mlp_.slice(0, S);
  b.act = act_.slice(0, S);
  b.lora = lora_;
  VisionSegments seg{cos_.slice(0, S), sin_.slice(0, S), cu_seqlens_, n_segments, real_rows_};
  seg.window_cu = window_cu_;
  seg.n_windows = n_windows_;
  vision_block_forward(backend_, cfg_, w_.blocks[l], b, seg.for_block(cfg_, l));
}

void VisionEncoder::run_deepstack_merger(int k, int64_t S, bool beside_layers) {
  run_merger(w_.deepstack_mergers[static_cast<size_t>(k)], x_.slice(0, S), S, true,
             deepstack_[static_cast<size_t>(k)], beside_layers);
}

void VisionEncoder::run_merger(int64_t S) {
  const int64_t Sm = S / cfg_.merge_unit();
  if (cfg_.window_units() > 0) {
    run_merger(w_.merger, x_, S, false, windowed_embeds_, false);
    backend_.scatter_rows(embeds_.slice(0, Sm), windowed_embeds_.slice(0, Sm),
                          unit_order_.slice(0, Sm), false);
  } else {
    run_merger(w_.merger, x_, S, false, embeds_, false);
  }
}

VisionEncoder::Output VisionEncoder::output(int64_t S) const {
  const int64_t Sm = S / cfg_.merge_unit();
  Output out;
  out.embeds = embeds_.slice(0, Sm);
  for (const Tensor& d : deepstack_) out.deepstack.push_back(d.slice(0, Sm));
  return out;
}

VisionEncoder::Output VisionEncoder::encode(const VisionPixels& pixels,
                                            const std::vector<GridTHW>& grids) {
  const VisionCall call = upload(pixels, grids);
  Output out = run(call.rows, call.n_segments);
  const int64_t real = call.n_patches / cfg_.merge_unit();
  out.embeds = out.embeds.slice(0, real);
  for (Tensor& d : out.deepstack) d = d.slice(0, real);
  return out;
}

}  // namespace iris
