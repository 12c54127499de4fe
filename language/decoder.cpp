#include "language/decoder.h"

#include <cmath>

#include "language/moe_mlp.h"

namespace iris {
namespace {

// The per-head 1/rms the q/k norms save: a family without them (Qwen2) saves nothing.
Tensor qk_rstd(const DecoderLayerWeights& w, const DecoderLayerBuffers& b) {
  return w.q_norm_w.defined() ? b.qk_rstd : Tensor();
}

}  // namespace

void decoder_attention_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                               const DecoderLayerBuffers& b, const DecoderAttention& at) {
  const int nq = cfg.num_attention_heads, nkv = cfg.num_key_value_heads, hd = cfg.head_dim;
  const float eps = cfg.rms_norm_eps, scale = 1.0f / std::sqrt(static_cast<float>(hd));
  if (b.saves()) {
    be.rms_norm_train(b.rms1, b.rstd1, b.x_in, w.input_norm_w, eps);
    be.linear(b.qkv_lin, b.rms1, w.qkv_w, w.qkv_b, false);
    lora_forward(be, w.qkv_lora, b.qkv_lin, b.rms1, b.lora);
    be.qkv_norm_rope_train(b.qkv, qk_rstd(w, b), b.qkv_lin, w.q_norm_w, w.k_norm_w, eps, at.cos,
                           at.sin, nq, nkv, hd, true);
    be.attention_train(b.attn, b.lse, b.qkv, at.cu_seqlens, at.n_segments, nq, nkv, hd, scale, true,
                       Tensor());
  } else {
    // The norms are fused into the projections that read them (one kernel per decode step).
    be.rms_norm_linear(b.qkv, b.rms1, b.x_in, w.input_norm_w, eps, w.qkv_w, w.qkv_b, Tensor());
    lora_forward(be, w.qkv_lora, b.qkv, b.rms1, b.lora);
    be.qkv_norm_rope_kv_store(b.qkv, w.q_norm_w, w.k_norm_w, eps, at.cos, at.sin, nq, nkv, hd, true,
                              at.k_cache, at.v_cache, at.past_len);
    be.attention_causal(b.attn, b.qkv, at.k_cache, at.v_cache, at.past_len, nq, nkv, hd, scale);
  }
  if (b.x_mid.data != b.x_in.data) be.copy(b.x_mid, b.x_in);
  be.linear(b.x_mid, b.attn, w.o_w, Tensor(), true);
  lora_forward(be, w.o_lora, b.x_mid, b.attn, b.lora);
}

void decoder_mlp_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                         const DecoderLayerBuffers& b) {
  // A layer is the tensors it has: a sparse one holds a router and experts.
  if (w.router_w.defined()) {
    moe_mlp_forward(be, cfg, w, b);
    return;
  }
  const float eps = cfg.rms_norm_eps;
  if (b.saves()) {
    be.rms_norm_train(b.rms2, b.rstd2, b.x_mid, w.post_norm_w, eps);
    be.linear(b.gate_up, b.rms2, w.gate_up_w, Tensor(), false);
    lora_forward(be, w.gate_up_lora, b.gate_up, b.rms2, b.lora);
    be.swiglu(b.act, b.gate_up);
  } else if (w.gate_up_lora.empty()) {
    be.rms_norm_linear(b.gate_up, b.rms2, b.x_mid, w.post_norm_w, eps, w.gate_up_w, Tensor(),
                       b.act);
  } else {
    // The adapters' rows join gate_up before the activation reads it.
    be.rms_norm_linear(b.gate_up, b.rms2, b.x_mid, w.post_norm_w, eps, w.gate_up_w, Tensor(),
                       Tensor());
    lora_forward(be, w.gate_up_lora, b.gate_up, b.rms2, b.lora);
    be.swiglu(b.act, b.gate_up);
  }
  if (b.x_out.data != b.x_mid.data) be.copy(b.x_out, b.x_mid);
  be.linear(b.x_out, b.act, w.down_w, Tensor(), true);
  lora_forward(be, w.down_lora, b.x_out, b.act, b.lora);
}

void decoder_layer_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                           const DecoderLayerBuffers& b, const DecoderAttention& at) {
  decoder_attention_forward(be, cfg, w, b, at);
  decoder_mlp_forward(be, cfg, w, b);
}

void decoder_layer_recompute(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                             const DecoderLayerBuffers& b, const DecoderAttention& at,
                             Recompute mode) {
  if (mode == Recompute::full) {
    decoder_layer_forward(be, cfg, w, b, at);
    return;
  }
  if (mode != Recompute::selective) return;
  const float eps = cfg.rms_norm_eps;
  // The statistics are rewritten with the values they already hold.
  be.rms_norm_train(b.rms1, b.rstd1, b.x_in, w.input_norm_w, eps);
  be.qkv_norm_rope_train(b.qkv, qk_rstd(w, b), b.qkv_lin, w.q_norm_w, w.k_norm_w, eps, at.cos,
                         at.sin, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                         true);
  be.rms_norm_train(b.rms2, b.rstd2, b.x_mid, w.post_norm_w, eps);
  // A layer is the tensors it has: a sparse one's activations are its experts' rows.
  if (w.router_w.defined())
    be.swiglu(b.moe.act, b.moe.gate_up);
  else
    be.swiglu(b.act, b.gate_up);
}

void decoder_mlp_backward(Backend& be, const DecoderLayerWeights& w, DecoderLayerWeights* g,
                          const DecoderLayerBuffers& b, const DecoderGradScratch& s) {
  if (w.router_w.defined()) {
    moe_mlp_backward(be, w, g, b, s);
    return;
  }
  const auto grad = [&](Tensor DecoderLayerWeights::*m) { return g ? g->*m : Tensor(); };
  // Overwrites dact, dgu and dtmp; accumulates down/gate_up and post-norm gradients and dres.
  const Tensor dy = in_compute_dtype(be, s.dres, s.dres_c);
  const auto adapters_grad = [&](LoraAdapters DecoderLayerWeights::*m) {
    return g ? &(g->*m) : nullptr;
  };
  be.linear_backward_input(s.dact, dy, w.down_w, false);
  if (g) be.linear_backward_weight(g->down_w, Tensor(), dy, b.act);
  lora_backward(be, w.down_lora, adapters_grad(&DecoderLayerWeights::down_lora), s.dact, dy, b.act,
                s.lora);
  be.swiglu_backward(s.dgu, s.dact, b.gate_up);
  be.linear_backward_input(s.dtmp, s.dgu, w.gate_up_w, false);
  if (g) be.linear_backward_weight(g->gate_up_w, Tensor(), s.dgu, b.rms2);
  lora_backward(be, w.gate_up_lora, adapters_grad(&DecoderLayerWeights::gate_up_lora), s.dtmp,
                s.dgu, b.rms2, s.lora);
  be.rms_norm_backward(s.dres, grad(&DecoderLayerWeights::post_norm_w), s.dtmp, b.x_mid, b.rstd2,
                       w.post_norm_w);
}

void decoder_attention_backward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                                DecoderLayerWeights* g, const DecoderLayerBuffers& b,
                                const DecoderAttention& at, const DecoderGradScratch& s) {
  const int nq = cfg.num_attention_heads, nkv = cfg.num_key_value_heads, hd = cfg.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const auto grad = [&](Tensor DecoderLayerWeights::*m) { return g ? g->*m : Tensor(); };
  // Overwrites dattn, dqkv and dtmp; accumulates o/qkv, q/k-norm and input-norm gradients and
  // dres.
  const Tensor dy = in_compute_dtype(be, s.dres, s.dres_c);
  const auto adapters_grad = [&](LoraAdapters DecoderLayerWeights::*m) {
    return g ? &(g->*m) : nullptr;
  };
  be.linear_backward_input(s.dattn, dy, w.o_w, false);
  if (g) be.linear_backward_weight(g->o_w, Tensor(), dy, b.attn);
  lora_backward(be, w.o_lora, adapters_grad(&DecoderLayerWeights::o_lora), s.dattn, dy, b.attn,
                s.lora);
  be.attention_backward(s.dqkv, s.dsum, s.dattn, b.attn, b.lse, b.qkv, at.cu_seqlens, at.n_segments,
                        nq, nkv, hd, scale, true, Tensor());
  be.qkv_norm_rope_backward(s.dqkv, grad(&DecoderLayerWeights::q_norm_w),
                            grad(&DecoderLayerWeights::k_norm_w), s.dqkv, b.qkv_lin, qk_rstd(w, b),
                            w.q_norm_w, w.k_norm_w, at.cos, at.sin, nq, nkv, hd, true);
  be.linear_backward_input(s.dtmp, s.dqkv, w.qkv_w, false);
  if (g) be.linear_backward_weight(g->qkv_w, g->qkv_b, s.dqkv, b.rms1);
  lora_backward(be, w.qkv_lora, adapters_grad(&DecoderLayerWeights::qkv_lora), s.dtmp, s.dqkv,
                b.rms1, s.lora);
  be.rms_norm_backward(s.dres, grad(&DecoderLayerWeights::input_norm_w), s.dtmp, b.x_in, b.rstd1,
                       w.input_norm_w);
}

void decoder_layer_backward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                            DecoderLayerWeights* g, const DecoderLayerBuffers& b,
                            const DecoderAttention& at, const DecoderGradScratch& s) {
  decoder_mlp_backward(be, w, g, b, s);
  decoder_attention_backward(be, cfg, w, g, b, at, s);
}

TextDecoder::TextDecoder(Backend& backend, const TextConfig& cfg, const DecoderWeights& weights,
                         const DecoderLimits& limits)
    : backend_(backend), cfg_(cfg), w_(weights), limits_(limits) {
  IRIS_CHECK(limits.max_context > 0 && limits.max_step_tokens > 0 && limits.max_logit_rows > 0,
             "decoder limits must be positive");
  IRIS_CHECK(static_cast<int>(weights.layers.size()) == cfg.num_hidden_layers,
             "decoder weights hold ", weights.layers.size(), " layers, config says ",
             cfg.num_hidden_layers);
  Arena plan;
  allocate(plan);
  arena_ = Arena(backend, plan.used());
  allocate(arena_);
}

void TextDecoder::allocate(Arena& a) {
  const DType dt = backend_.compute_dtype();
  const int64_t T = limits_.max_step_tokens, H = cfg_.hidden_size;
  ids_ = a.alloc(DType::i32, {T});
  cos_ = a.alloc(DType::f32, {T, cfg_.head_dim});
  sin_ = a.alloc(DType::f32, {T, cfg_.head_dim});
  past_len_ = a.alloc(DType::i32, {1});
  x_ = a.alloc(dt, {T, H});
  xn_ = a.alloc(dt, {T, H});
  qkv_ = a.alloc(dt, {T, cfg_.qkv_width()});
  attn_ = a.alloc(dt, {T, cfg_.q_width()});
  bool any_dense = false;
  for (int l = 0; l < cfg_.num_hidden_layers; ++l) any_dense |= !cfg_.sparse_layer(l);
  if (any_dense) {
    gate_up_ = a.alloc(dt, {T, 2 * int64_t(cfg_.intermediate_size)});
    mlp_ = a.alloc(dt, {T, cfg_.intermediate_size});
  }
  if (cfg_.any_sparse_layer()) moe_ = allocate_moe_buffers(a, dt, cfg_, T, false);
  normed_ = a.alloc(dt, {T, H});
  LoraScratchSize lora;
  for (const DecoderLayerWeights& w : w_.layers)
    for (const LoraAdapters* ad : {&w.qkv_lora, &w.o_lora, &w.gate_up_lora, &w.down_lora})
      lora.cover(*ad);
  lora_ = allocate_lora_scratch(a, dt, T, lora);
  logits_ = a.alloc(dt, {limits_.max_logit_rows, cfg_.vocab_size});
  next_ = a.alloc(DType::i32, {limits_.max_logit_rows});
  k_cache_.clear();
  v_cache_.clear();
  for (int l = 0; l < cfg_.num_hidden_layers; ++l) {
    k_cache_.push_back(a.alloc(dt, {limits_.max_context, cfg_.kv_width()}));
    v_cache_.push_back(a.alloc(dt, {limits_.max_context, cfg_.kv_width()}));
  }
}

void TextDecoder::upload_step(const int32_t* ids, const float* cos, const float* sin, int64_t T,
                              int64_t past_len) {
  IRIS_CHECK(T > 0 && T <= limits_.max_step_tokens, "a step of ", T,
             " tokens exceeds the planned maximum of ", limits_.max_step_tokens);
  IRIS_CHECK(past_len >= 0 && past_len + T <= limits_.max_context, "context of ", past_len + T,
             " tokens exceeds the maximum context of ", limits_.max_context, " (raise --ctx-size)");
  backend_.write(ids_.slice(0, T), ids, DType::i32);
  backend_.write(cos_.slice(0, T), cos, DType::f32);
  backend_.write(sin_.slice(0, T), sin, DType::f32);
  const int32_t p = static_cast<int32_t>(past_len);
  backend_.write(past_len_, &p, DType::i32);
}

void TextDecoder::embed(int64_t T) {
  backend_.embedding(x_.slice(0, T), w_.embed, ids_.slice(0, T));
}

void TextDecoder::layer(int l, int64_t T) {
  DecoderLayerBuffers b;
  b.x_in = b.x_mid = b.x_out = x_.slice(0, T);
  b.rms1 = b.rms2 = xn_.slice(0, T);
  b.qkv_lin = b.qkv = qkv_.slice(0, T);
  b.attn = attn_.slice(0, T);
  b.lora = lora_;
  if (cfg_.sparse_layer(l)) {
    b.moe = moe_rows(moe_, cfg_, T);
  } else {
    b.gate_up = gate_up_.slice(0, T);
    b.act = mlp_.slice(0, T);
  }
  DecoderAttention at;
  at.cos = cos_.slice(0, T);
  at.sin = sin_.slice(0, T);
  at.k_cache = k_cache_[l];
  at.v_cache = v_cache_[l];
  at.past_len = past_len_;
  decoder_layer_forward(backend_, cfg_, w_.layers[l], b, at);
}

void TextDecoder::final_norm(int64_t T) {
  backend_.rms_norm(normed_.slice(0, T), x_.slice(0, T), w_.norm_w, cfg_.rms_norm_eps);
}

void TextDecoder::lm_head(int64_t first_row, int64_t n_rows) {
  IRIS_CHECK(n_rows <= limits_.max_logit_rows, n_rows, " logit rows exceed the planned ",
             limits_.max_logit_rows);
  backend_.linear(logits_.slice(0, n_rows), normed_.slice(first_row, first_row + n_rows),
                  w_.lm_head, Tensor(), false);
}

void TextDecoder::argmax(int64_t n_rows) {
  backend_.argmax_rows(next_.slice(0, n_rows), logits_.slice(0, n_rows));
}

}  // namespace iris
