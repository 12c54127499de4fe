#include "language/decoder.h"

#include <cmath>

namespace iris {

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
  gate_up_ = a.alloc(dt, {T, 2 * int64_t(cfg_.intermediate_size)});
  mlp_ = a.alloc(dt, {T, cfg_.intermediate_size});
  normed_ = a.alloc(dt, {T, H});
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
  const DecoderLayerWeights& w = w_.layers[l];
  const int nq = cfg_.num_attention_heads, nkv = cfg_.num_key_value_heads, hd = cfg_.head_dim;
  const float eps = cfg_.rms_norm_eps;
  Tensor x = x_.slice(0, T), xn = xn_.slice(0, T), qkv = qkv_.slice(0, T);
  // The norms are fused into the projections that read them (one kernel per decode step).
  backend_.rms_norm_linear(qkv, xn, x, w.input_norm_w, eps, w.qkv_w, Tensor());
  backend_.qkv_norm_rope_kv_store(qkv, w.q_norm_w, w.k_norm_w, eps, cos_.slice(0, T),
                                  sin_.slice(0, T), nq, nkv, hd, true, k_cache_[l], v_cache_[l],
                                  past_len_);
  backend_.attention_causal(attn_.slice(0, T), qkv, k_cache_[l], v_cache_[l], past_len_, nq, nkv,
                            hd, 1.0f / std::sqrt(static_cast<float>(hd)));
  backend_.linear(x, attn_.slice(0, T), w.o_w, Tensor(), true);
  backend_.rms_norm_linear(gate_up_.slice(0, T), xn, x, w.post_norm_w, eps, w.gate_up_w,
                           mlp_.slice(0, T));
  backend_.linear(x, mlp_.slice(0, T), w.down_w, Tensor(), true);
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
