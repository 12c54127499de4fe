#include "language/moe_mlp.h"

namespace iris {

MoeBuffers allocate_moe_buffers(Arena& a, DType compute, const TextConfig& cfg, int64_t max_tokens,
                                bool keep_probs) {
  const int64_t T = max_tokens, E = cfg.num_experts, k = cfg.num_experts_per_tok,
                H = cfg.hidden_size, I = cfg.moe_intermediate_size;
  MoeBuffers m;
  m.logits = a.alloc(compute, {T, E});
  if (keep_probs) m.probs = a.alloc(DType::f32, {T, E});
  m.ids = a.alloc(DType::i32, {T, k});
  m.weights = a.alloc(compute, {T, k});
  m.offsets = a.alloc(DType::i32, {E + 1});
  m.slot_rows = a.alloc(DType::i32, {T, k});
  m.x_sorted = a.alloc(compute, {T * k, H});
  m.gate_up = a.alloc(compute, {T * k, 2 * I});
  m.act = a.alloc(compute, {T * k, I});
  m.y_sorted = a.alloc(compute, {T * k, H});
  return m;
}

MoeBuffers moe_rows(const MoeBuffers& m, const TextConfig& cfg, int64_t T) {
  const int64_t slots = T * cfg.num_experts_per_tok;
  MoeBuffers r;
  r.logits = m.logits.slice(0, T);
  if (m.probs.defined()) r.probs = m.probs.slice(0, T);
  r.ids = m.ids.slice(0, T);
  r.weights = m.weights.slice(0, T);
  r.offsets = m.offsets;
  r.slot_rows = m.slot_rows.slice(0, T);
  r.x_sorted = m.x_sorted.slice(0, slots);
  r.gate_up = m.gate_up.slice(0, slots);
  r.act = m.act.slice(0, slots);
  r.y_sorted = m.y_sorted.slice(0, slots);
  return r;
}

void moe_mlp_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                     const DecoderLayerBuffers& b) {
  const MoeBuffers& m = b.moe;
  const float eps = cfg.rms_norm_eps;
  if (b.saves())
    be.rms_norm_train(b.rms2, b.rstd2, b.x_mid, w.post_norm_w, eps);
  else
    be.rms_norm(b.rms2, b.x_mid, w.post_norm_w, eps);
  be.linear(m.logits, b.rms2, w.router_w, Tensor(), false);
  be.moe_route(m.ids, m.weights, m.probs, m.logits, cfg.num_experts_per_tok, Tensor());
  be.moe_dispatch(m.x_sorted, m.offsets, m.slot_rows, b.rms2, m.ids);
  be.moe_grouped_linear(m.gate_up, m.x_sorted, w.experts_gate_up_w, m.offsets);
  be.swiglu(m.act, m.gate_up);
  be.moe_grouped_linear(m.y_sorted, m.act, w.experts_down_w, m.offsets);
  if (b.x_out.data != b.x_mid.data) be.copy(b.x_out, b.x_mid);
  be.moe_combine(b.x_out, m.y_sorted, m.slot_rows, m.weights, true);
}

}  // namespace iris
