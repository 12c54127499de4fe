#include "vision/vision_encoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace iris {
namespace {

// torch.linspace in float32: the two halves are computed from opposite ends.
std::vector<float> torch_linspace(float start, float end, int64_t steps) {
  std::vector<float> out(static_cast<size_t>(steps));
  if (steps == 1) {
    out[0] = start;
    return out;
  }
  const float step = (end - start) / static_cast<float>(steps - 1);
  const int64_t half = steps / 2;
  for (int64_t i = 0; i < steps; ++i)
    out[i] = i < half ? start + step * static_cast<float>(i)
                      : end - step * static_cast<float>(steps - 1 - i);
  return out;
}

}  // namespace

int64_t count_patches(const std::vector<GridTHW>& grids) {
  int64_t n = 0;
  for (const auto& g : grids) n += g[0] * g[1] * g[2];
  return n;
}

VisionInputs plan_vision_inputs(const VisionConfig& cfg, const std::vector<GridTHW>& grids,
                                int64_t padded_rows, int segment_capacity) {
  const int m = cfg.spatial_merge_size;
  const int hd = cfg.head_dim();
  const int G = cfg.position_grid_side();
  VisionInputs in;
  in.n_patches = count_patches(grids);
  in.rows = padded_rows > 0 ? padded_rows : in.n_patches;
  IRIS_CHECK(in.rows >= in.n_patches, "vision padding to ", in.rows, " rows is smaller than the ",
             in.n_patches, " patches of this call");
  in.cos.assign(static_cast<size_t>(in.rows * hd), 1.0f);
  in.sin.assign(static_cast<size_t>(in.rows * hd), 0.0f);
  in.pos_index.assign(static_cast<size_t>(in.rows * 4), 0);
  in.pos_weight.assign(static_cast<size_t>(in.rows * 4), 0.0f);
  in.cu_seqlens.push_back(0);

  // inv_freq over rot_dim = hd/2, computed in float32 as torch does, then rounded to bf16: HF
  // keeps it in a buffer that is cast with the model, so checkpoints run through
  // model.to(bfloat16) (the released weights and our goldens) rotate with bf16 frequencies, as
  // the text M-RoPE does (language/mrope.cpp). Measured against an f64 HF run: unrounded
  // frequencies move the vision qkv gradients by 8e-5 of their scale, rounded by 3e-6.
  const int rot_dim = hd / 2;
  std::vector<float> inv_freq(static_cast<size_t>(rot_dim / 2));
  for (int j = 0; j < rot_dim / 2; ++j)
    inv_freq[j] =
        round_bf16(1.0f / std::pow(cfg.rope_theta, static_cast<float>(2 * j) / float(rot_dim)));

  // Per-axis tables: a row's angles depend only on its patch row or column, so the trig runs
  // once per distinct coordinate (not per patch), which keeps the host's share of a multi-image
  // encoder call small. The values are the same floats as computing them per patch.
  const int quarter = rot_dim / 2;
  std::vector<float> axis_cos, axis_sin;
  auto axis_tables = [&](int64_t n) {
    axis_cos.resize(static_cast<size_t>(n * quarter));
    axis_sin.resize(static_cast<size_t>(n * quarter));
    for (int64_t p = 0; p < n; ++p)
      for (int j = 0; j < quarter; ++j) {
        const float f = static_cast<float>(p) * inv_freq[j];
        axis_cos[p * quarter + j] = std::cos(f);
        axis_sin[p * quarter + j] = std::sin(f);
      }
  };
  int64_t row = 0;
  for (const auto& g : grids) {
    const int64_t t = g[0], h = g[1], w = g[2];
    IRIS_CHECK(t >= 1 && h >= 1 && w >= 1 && h % m == 0 && w % m == 0, "image grid [", t, ", ", h,
               ", ", w, "] must be positive with height and width divisible by ", m);
    const std::vector<float> hs = torch_linspace(0.0f, float(G - 1), h);
    const std::vector<float> ws = torch_linspace(0.0f, float(G - 1), w);
    axis_tables(std::max(h, w));
    const size_t seg = static_cast<size_t>(quarter) * sizeof(float);
    for (int64_t f = 0; f < t; ++f) {
      for (int64_t br = 0; br < h / m; ++br)
        for (int64_t bc = 0; bc < w / m; ++bc)
          for (int ir = 0; ir < m; ++ir)
            for (int ic = 0; ic < m; ++ic, ++row) {
              const int64_t r = br * m + ir, c = bc * m + ic;
              // 2D RoPE: the first quarter-pairs rotate with the row, the next with the column,
              // and the second half repeats the first.
              float* cr = &in.cos[row * hd];
              float* sr = &in.sin[row * hd];
              for (int half : {0, rot_dim}) {
                std::memcpy(cr + half, &axis_cos[r * quarter], seg);
                std::memcpy(sr + half, &axis_sin[r * quarter], seg);
                std::memcpy(cr + half + quarter, &axis_cos[c * quarter], seg);
                std::memcpy(sr + half + quarter, &axis_sin[c * quarter], seg);
              }
              // Bilinear corners of the learned grid.
              const int h0 = static_cast<int>(hs[r]), w0 = static_cast<int>(ws[c]);
              const int h1 = std::min(h0 + 1, G - 1), w1 = std::min(w0 + 1, G - 1);
              const float dh = hs[r] - static_cast<float>(h0);
              const float dw = ws[c] - static_cast<float>(w0);
              int32_t* pi = &in.pos_index[row * 4];
              float* pw = &in.pos_weight[row * 4];
              pi[0] = h0 * G + w0;
              pi[1] = h0 * G + w1;
              pi[2] = h1 * G + w0;
              pi[3] = h1 * G + w1;
              pw[0] = (1.0f - dh) * (1.0f - dw);
              pw[1] = (1.0f - dh) * dw;
              pw[2] = dh * (1.0f - dw);
              pw[3] = dh * dw;
            }
      in.cu_seqlens.push_back(static_cast<int32_t>(row));
    }
  }
  if (in.rows > in.n_patches) in.cu_seqlens.push_back(static_cast<int32_t>(in.rows));
  in.n_segments = static_cast<int>(in.cu_seqlens.size()) - 1;
  if (segment_capacity > 0) {
    IRIS_CHECK(in.n_segments <= segment_capacity, "this encoder call has ", in.n_segments,
               " segments but the buffer holds ", segment_capacity,
               " (too many images in one call)");
    in.cu_seqlens.resize(static_cast<size_t>(segment_capacity) + 1, in.cu_seqlens.back());
  }
  return in;
}

VisionEncoder::VisionEncoder(Backend& backend, const VisionConfig& cfg,
                             const VisionWeights& weights, int64_t max_rows, int max_segments)
    : backend_(backend), cfg_(cfg), w_(weights), max_rows_(max_rows), max_segments_(max_segments) {
  const int unit = cfg.merge_unit();
  IRIS_CHECK(max_rows > 0 && max_rows % unit == 0, "vision max rows ", max_rows,
             " must be a positive multiple of ", unit);
  IRIS_CHECK(max_segments > 0, "vision encoder needs at least one segment");
  Arena plan;
  allocate(plan);
  arena_ = Arena(backend, plan.used());
  allocate(arena_);
  zero_rows_.clear();
}

void VisionEncoder::allocate(Arena& a) {
  const DType dt = backend_.compute_dtype();
  const int64_t S = max_rows_, D = cfg_.hidden_size, M = cfg_.merged_dim();
  const int64_t Sm = S / cfg_.merge_unit();
  pixels_ = a.alloc(dt, {S, cfg_.patch_dim()});
  cos_ = a.alloc(DType::f32, {S, cfg_.head_dim()});
  sin_ = a.alloc(DType::f32, {S, cfg_.head_dim()});
  pos_index_ = a.alloc(DType::i32, {S, 4});
  pos_weight_ = a.alloc(DType::f32, {S, 4});
  cu_seqlens_ = a.alloc(DType::i32, {max_segments_ + 1});
  real_rows_ = a.alloc(DType::i32, {1});
  x_ = a.alloc(dt, {S, D});
  xn_ = a.alloc(dt, {S, D});
  qkv_ = a.alloc(dt, {S, 3 * D});
  attn_ = a.alloc(dt, {S, D});
  mlp_ = a.alloc(dt, {S, cfg_.intermediate_size});
  merged_norm_ = a.alloc(dt, {Sm, M});
  merger_hidden_ = a.alloc(dt, {Sm, M});
  embeds_ = a.alloc(dt, {Sm, cfg_.out_hidden_size});
  deepstack_.clear();
  for (size_t i = 0; i < cfg_.deepstack_visual_indexes.size(); ++i)
    deepstack_.push_back(a.alloc(dt, {Sm, cfg_.out_hidden_size}));
}

void VisionEncoder::upload(const float* pixel_values, const VisionInputs& in) {
  IRIS_CHECK(in.rows <= max_rows_, "vision call of ", in.rows, " patch rows exceeds the planned ",
             max_rows_, " (raise the maximum vision sequence length)");
  IRIS_CHECK(static_cast<int>(in.cu_seqlens.size()) - 1 <= max_segments_, "vision call has ",
             in.cu_seqlens.size() - 1, " segments; the encoder was planned for ", max_segments_);
  const int64_t pd = cfg_.patch_dim();
  backend_.write(pixels_.slice(0, in.n_patches), pixel_values, DType::f32);
  if (in.rows > in.n_patches) {
    // Padding rows are zeros, written from a host buffer sized once for the largest padding.
    const size_t pad = static_cast<size_t>((in.rows - in.n_patches) * pd);
    if (zero_rows_.size() < pad) zero_rows_.assign(static_cast<size_t>(max_rows_ * pd), 0.0f);
    backend_.write(pixels_.slice(in.n_patches, in.rows), zero_rows_.data(), DType::f32);
  }
  backend_.write(cos_.slice(0, in.rows), in.cos.data(), DType::f32);
  backend_.write(sin_.slice(0, in.rows), in.sin.data(), DType::f32);
  backend_.write(pos_index_.slice(0, in.rows), in.pos_index.data(), DType::i32);
  backend_.write(pos_weight_.slice(0, in.rows), in.pos_weight.data(), DType::f32);
  std::vector<int32_t> cu(in.cu_seqlens);
  cu.resize(static_cast<size_t>(max_segments_) + 1, cu.back());
  backend_.write(cu_seqlens_, cu.data(), DType::i32);
  const int32_t real_rows = static_cast<int32_t>(in.n_patches);
  backend_.write(real_rows_, &real_rows, DType::i32);
}

void VisionEncoder::run_merger(const PatchMergerWeights& m, const Tensor& x, int64_t rows,
                               bool post_shuffle, const Tensor& out, bool beside_layers) {
  const int64_t Sm = rows / cfg_.merge_unit(), M = cfg_.merged_dim();
  const float eps = cfg_.layer_norm_eps;
  Tensor normed = merged_norm_.slice(0, Sm);
  backend_.join_side_work();  // the mergers share normed and hidden
  if (post_shuffle) {
    backend_.layer_norm(normed, x.slice(0, rows).view({Sm, M}), m.norm_w, m.norm_b, eps);
  } else {
    backend_.layer_norm(normed.view({rows, cfg_.hidden_size}), x.slice(0, rows), m.norm_w, m.norm_b,
                        eps);
  }
  Tensor hidden = merger_hidden_.slice(0, Sm);
  // A deepstack merger's output feeds only the decoder, so once its norm has read x (which the
  // next layer updates in place) its two GEMMs run beside the remaining layers. At one small
  // image they are weight-streaming GEMMs beside latency-bound layers.
  const SideWorkScope side(backend_, beside_layers);
  backend_.linear(hidden, normed, m.fc1_w, m.fc1_b, false);
  backend_.gelu_erf(hidden, hidden);
  backend_.linear(out.slice(0, Sm), hidden, m.fc2_w, m.fc2_b, false);
}

VisionEncoder::Output VisionEncoder::run(int64_t S, int n_segments) {
  run_embed(S);
  for (int l = 0; l < cfg_.depth; ++l) run_block(l, S, n_segments, true);
  return run_finish(S);
}

void VisionEncoder::run_embed(int64_t S) {
  IRIS_CHECK(S > 0 && S <= max_rows_ && S % cfg_.merge_unit() == 0, "vision run over ", S,
             " rows (planned ", max_rows_, ")");
  Tensor x = x_.slice(0, S);
  backend_.linear(x, pixels_.slice(0, S), w_.patch_w, w_.patch_b, false);
  backend_.add_interpolated_rows(x, w_.pos_embed, pos_index_.slice(0, S), pos_weight_.slice(0, S));
}

void VisionEncoder::run_block(int l, int64_t S, int n_segments, bool merger_beside_layers) {
  const int nh = cfg_.num_heads, hd = cfg_.head_dim();
  const float eps = cfg_.layer_norm_eps;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  Tensor x = x_.slice(0, S), xn = xn_.slice(0, S), qkv = qkv_.slice(0, S);
  Tensor attn = attn_.slice(0, S), mlp = mlp_.slice(0, S);
  const VisionBlockWeights& b = w_.blocks[l];
  backend_.layer_norm(xn, x, b.norm1_w, b.norm1_b, eps);
  backend_.linear(qkv, xn, b.qkv_w, b.qkv_b, false);
  backend_.qkv_norm_rope(qkv, Tensor(), Tensor(), 0.0f, cos_.slice(0, S), sin_.slice(0, S), nh, nh,
                         hd, false);
  backend_.attention_segments(attn, qkv, cu_seqlens_, n_segments, nh, hd, scale, real_rows_);
  backend_.linear(x, attn, b.proj_w, b.proj_b, true);
  backend_.layer_norm(xn, x, b.norm2_w, b.norm2_b, eps);
  // gelu_pytorch_tanh fused into fc1 (the GEMM epilogue on CUDA).
  backend_.linear_gelu_tanh(mlp, xn, b.fc1_w, b.fc1_b);
  backend_.linear(x, mlp, b.fc2_w, b.fc2_b, true);
  const auto& taps = cfg_.deepstack_visual_indexes;
  const auto tap = std::find(taps.begin(), taps.end(), l);
  if (tap != taps.end()) {
    const size_t k = static_cast<size_t>(tap - taps.begin());
    run_merger(w_.deepstack_mergers[k], x, S, true, deepstack_[k], merger_beside_layers);
  }
}

VisionEncoder::Output VisionEncoder::run_finish(int64_t S) {
  run_merger(w_.merger, x_, S, false, embeds_, false);
  const int64_t Sm = S / cfg_.merge_unit();
  Output out;
  out.embeds = embeds_.slice(0, Sm);
  for (const Tensor& d : deepstack_) out.deepstack.push_back(d.slice(0, Sm));
  return out;
}

VisionEncoder::Output VisionEncoder::encode(const float* pixel_values,
                                            const std::vector<GridTHW>& grids) {
  const VisionInputs in = plan_vision_inputs(cfg_, grids);
  upload(pixel_values, in);
  Output out = run(in.rows, in.n_segments);
  const int64_t real = in.n_patches / cfg_.merge_unit();
  out.embeds = out.embeds.slice(0, real);
  for (Tensor& d : out.deepstack) d = d.slice(0, real);
  return out;
}

}  // namespace iris
