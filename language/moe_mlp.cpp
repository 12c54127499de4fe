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
  r.real_rows = m.real_rows;
  r.aux_dprob = m.aux_dprob;
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
  be.moe_route(m.ids, m.weights, m.probs, m.logits, cfg.num_experts_per_tok, m.real_rows);
  be.moe_dispatch(m.x_sorted, m.offsets, m.slot_rows, b.rms2, m.ids);
  be.moe_grouped_linear(m.gate_up, m.x_sorted, w.experts_gate_up_w, m.offsets);
  be.swiglu(m.act, m.gate_up);
  be.moe_grouped_linear(m.y_sorted, m.act, w.experts_down_w, m.offsets);
  if (b.x_out.data != b.x_mid.data) be.copy(b.x_out, b.x_mid);
  be.moe_combine(b.x_out, m.y_sorted, m.slot_rows, m.weights, true);
}

void moe_mlp_backward(Backend& be, const DecoderLayerWeights& w, DecoderLayerWeights* g,
                      const DecoderLayerBuffers& b, const DecoderGradScratch& s) {
  const MoeBuffers& m = b.moe;
  const MoeGradScratch& d = s.moe;
  const auto grad = [&](Tensor DecoderLayerWeights::*t) { return g ? g->*t : Tensor(); };
  // The combine reads the f32 residual gradient itself.
  be.moe_combine_backward(d.dy_sorted, d.dweights, s.dres, m.y_sorted, m.slot_rows, m.weights);
  be.moe_grouped_linear_backward(d.dact, grad(&DecoderLayerWeights::experts_down_w), d.dy_sorted,
                                 m.act, w.experts_down_w, m.offsets);
  be.swiglu_backward(d.dgu, d.dact, m.gate_up);
  be.moe_grouped_linear_backward(d.dx_sorted, grad(&DecoderLayerWeights::experts_gate_up_w), d.dgu,
                                 m.x_sorted, w.experts_gate_up_w, m.offsets);
  // d(normed rows): each token's slots summed back, then the router's share.
  be.fill_zero(s.dtmp);
  be.moe_dispatch_backward(s.dtmp, d.dx_sorted, m.slot_rows);
  be.moe_route_backward(d.dlogits, d.dweights, m.probs, m.ids, m.aux_dprob);
  be.linear_backward_input(s.dtmp, d.dlogits, w.router_w, true);
  if (g) be.linear_backward_weight(g->router_w, Tensor(), d.dlogits, b.rms2);
  be.rms_norm_backward(s.dres, grad(&DecoderLayerWeights::post_norm_w), s.dtmp, b.x_mid, b.rstd2,
                       w.post_norm_w);
}

MoeGradScratch allocate_moe_grad_scratch(Arena& a, DType compute, const TextConfig& cfg,
                                         int64_t max_tokens) {
  const int64_t T = max_tokens, E = cfg.num_experts, k = cfg.num_experts_per_tok,
                H = cfg.hidden_size, I = cfg.moe_intermediate_size;
  MoeGradScratch s;
  s.dy_sorted = a.alloc(compute, {T * k, H});
  s.dact = a.alloc(compute, {T * k, I});
  s.dgu = a.alloc(compute, {T * k, 2 * I});
  s.dx_sorted = a.alloc(compute, {T * k, H});
  s.dweights = a.alloc(DType::f32, {T, k});
  s.dlogits = a.alloc(compute, {T, E});
  return s;
}

MoeGradScratch moe_grad_rows(const MoeGradScratch& s, const TextConfig& cfg, int64_t T) {
  const int64_t slots = T * cfg.num_experts_per_tok;
  MoeGradScratch r;
  r.dy_sorted = s.dy_sorted.slice(0, slots);
  r.dact = s.dact.slice(0, slots);
  r.dgu = s.dgu.slice(0, slots);
  r.dx_sorted = s.dx_sorted.slice(0, slots);
  r.dweights = s.dweights.slice(0, T);
  r.dlogits = s.dlogits.slice(0, T);
  return r;
}

}  // namespace iris
