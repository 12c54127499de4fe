#include "language/moe_mlp.h"

#include <algorithm>
#include <cmath>

namespace iris {

int64_t moe_expert_capacity(const TextConfig& cfg, const MoeCapacity& rule, int64_t T) {
  if (!rule.drops()) return 0;
  const double slots = static_cast<double>(T) * cfg.num_experts_per_tok;
  const auto capacity =
      static_cast<int64_t>(std::ceil(slots / static_cast<double>(cfg.num_experts) * rule.factor));
  return std::clamp<int64_t>(capacity, 1, std::max<int64_t>(T, 1));
}

int64_t moe_sorted_rows(const TextConfig& cfg, const MoeCapacity& rule, int64_t T) {
  return rule.drops() && rule.pad ? cfg.num_experts * moe_expert_capacity(cfg, rule, T)
                                  : T * cfg.num_experts_per_tok;
}

MoeBuffers allocate_moe_buffers(Arena& a, DType compute, const TextConfig& cfg, int64_t max_tokens,
                                bool keep_probs, const MoeCapacity& rule) {
  const int64_t T = max_tokens, E = cfg.num_experts, k = cfg.num_experts_per_tok,
                H = cfg.hidden_size, I = cfg.moe_intermediate_size;
  const int64_t R = moe_sorted_rows(cfg, rule, T);
  MoeBuffers m;
  m.capacity_rule = rule;
  m.logits = a.alloc(compute, {T, E});
  if (keep_probs) m.probs = a.alloc(DType::f32, {T, E});
  m.ids = a.alloc(DType::i32, {T, k});
  if (rule.drops()) m.kept_ids = a.alloc(DType::i32, {T, k});
  m.weights = a.alloc(compute, {T, k});
  m.offsets = a.alloc(DType::i32, {E + 1});
  m.slot_rows = a.alloc(DType::i32, {T, k});
  m.x_sorted = a.alloc(compute, {R, H});
  m.gate_up = a.alloc(compute, {R, 2 * I});
  m.act = a.alloc(compute, {R, I});
  m.y_sorted = a.alloc(compute, {R, H});
  return m;
}

MoeBuffers moe_rows(const MoeBuffers& m, const TextConfig& cfg, int64_t T) {
  const int64_t rows = moe_sorted_rows(cfg, m.capacity_rule, T);
  MoeBuffers r;
  r.logits = m.logits.slice(0, T);
  if (m.probs.defined()) r.probs = m.probs.slice(0, T);
  r.ids = m.ids.slice(0, T);
  r.weights = m.weights.slice(0, T);
  r.offsets = m.offsets;
  r.slot_rows = m.slot_rows.slice(0, T);
  r.x_sorted = m.x_sorted.slice(0, rows);
  r.gate_up = m.gate_up.slice(0, rows);
  r.act = m.act.slice(0, rows);
  r.y_sorted = m.y_sorted.slice(0, rows);
  r.real_rows = m.real_rows;
  r.aux_dprob = m.aux_dprob;
  r.capacity_rule = m.capacity_rule;
  r.capacity = moe_expert_capacity(cfg, m.capacity_rule, T);
  if (m.kept_ids.defined()) r.kept_ids = m.kept_ids.slice(0, T);
  r.dropped = m.dropped;
  return r;
}

void moe_mlp_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                     const DecoderLayerBuffers& b) {
  moe_router_forward(be, cfg, w, b);
  moe_preprocess_forward(be, b);
  moe_experts_forward(be, w, b);
}

void moe_router_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                        const DecoderLayerBuffers& b) {
  const MoeBuffers& m = b.moe;
  const float eps = cfg.rms_norm_eps;
  if (b.saves())
    be.rms_norm_train(b.rms2, b.rstd2, b.x_mid, w.post_norm_w, eps);
  else
    be.rms_norm(b.rms2, b.x_mid, w.post_norm_w, eps);
  be.linear(m.logits, b.rms2, w.router_w, Tensor(), false);
  be.moe_route(m.ids, m.weights, m.probs, m.logits, cfg.num_experts_per_tok, m.real_rows);
  if (m.capacity > 0)
    be.moe_capacity_drop(m.kept_ids, m.dropped, m.ids, m.weights, cfg.num_experts, m.capacity,
                         static_cast<int>(m.capacity_rule.policy));
}

void moe_preprocess_forward(Backend& be, const DecoderLayerBuffers& b) {
  const MoeBuffers& m = b.moe;
  const bool drops = m.capacity > 0;
  be.moe_dispatch(m.x_sorted, m.offsets, m.slot_rows, b.rms2, drops ? m.kept_ids : m.ids,
                  drops && m.capacity_rule.pad ? m.capacity : 0);
}

// Each expert's rows when they are padded to its capacity, else 0 (read from the offsets).
int64_t padded_rows(const MoeBuffers& m) {
  return m.capacity > 0 && m.capacity_rule.pad ? m.capacity : 0;
}

void moe_experts_forward(Backend& be, const DecoderLayerWeights& w, const DecoderLayerBuffers& b) {
  const MoeBuffers& m = b.moe;
  be.moe_grouped_linear(m.gate_up, m.x_sorted, w.experts_gate_up_w, m.offsets, padded_rows(m));
  be.swiglu(m.act, m.gate_up);
  be.moe_grouped_linear(m.y_sorted, m.act, w.experts_down_w, m.offsets, padded_rows(m));
  if (b.x_out.data != b.x_mid.data) be.copy(b.x_out, b.x_mid);
  be.moe_combine(b.x_out, m.y_sorted, m.slot_rows, m.weights, true);
}

void moe_mlp_backward(Backend& be, const DecoderLayerWeights& w, DecoderLayerWeights* g,
                      const DecoderLayerBuffers& b, const DecoderGradScratch& s) {
  moe_experts_backward(be, w, g, b, s);
  moe_preprocess_backward(be, b, s);
  moe_router_backward(be, w, g, b, s);
}

void moe_experts_backward(Backend& be, const DecoderLayerWeights& w, DecoderLayerWeights* g,
                          const DecoderLayerBuffers& b, const DecoderGradScratch& s) {
  const MoeBuffers& m = b.moe;
  const MoeGradScratch& d = s.moe;
  const auto grad = [&](Tensor DecoderLayerWeights::*t) { return g ? g->*t : Tensor(); };
  // A padded segment's rows past its slots get no gradient from the combine; zeros keep them out
  // of the experts' weight gradients (their inputs are zeros too).
  if (m.capacity > 0 && m.capacity_rule.pad) be.fill_zero(d.dy_sorted);
  // The combine reads the f32 residual gradient itself.
  be.moe_combine_backward(d.dy_sorted, d.dweights, s.dres, m.y_sorted, m.slot_rows, m.weights);
  be.moe_grouped_linear_backward(d.dact, grad(&DecoderLayerWeights::experts_down_w), d.dy_sorted,
                                 m.act, w.experts_down_w, m.offsets, padded_rows(m));
  be.swiglu_backward(d.dgu, d.dact, m.gate_up);
  be.moe_grouped_linear_backward(d.dx_sorted, grad(&DecoderLayerWeights::experts_gate_up_w), d.dgu,
                                 m.x_sorted, w.experts_gate_up_w, m.offsets, padded_rows(m));
}

void moe_preprocess_backward(Backend& be, const DecoderLayerBuffers& b,
                             const DecoderGradScratch& s) {
  be.fill_zero(s.dtmp);
  be.moe_dispatch_backward(s.dtmp, s.moe.dx_sorted, b.moe.slot_rows);
}

void moe_router_backward(Backend& be, const DecoderLayerWeights& w, DecoderLayerWeights* g,
                         const DecoderLayerBuffers& b, const DecoderGradScratch& s) {
  const MoeBuffers& m = b.moe;
  const MoeGradScratch& d = s.moe;
  const auto grad = [&](Tensor DecoderLayerWeights::*t) { return g ? g->*t : Tensor(); };
  // A dropped slot's weight has no gradient of its own (the combine gave it 0), but it still
  // shares the renormalisation with the token's kept slots, as in Megatron, where the drop masks
  // the routing probabilities after the top k.
  be.moe_route_backward(d.dlogits, d.dweights, m.probs, m.ids, m.aux_dprob);
  be.linear_backward_input(s.dtmp, d.dlogits, w.router_w, true);
  if (g) be.linear_backward_weight(g->router_w, Tensor(), d.dlogits, b.rms2);
  be.rms_norm_backward(s.dres, grad(&DecoderLayerWeights::post_norm_w), s.dtmp, b.x_mid, b.rstd2,
                       w.post_norm_w);
}

MoeGradScratch allocate_moe_grad_scratch(Arena& a, DType compute, const TextConfig& cfg,
                                         int64_t max_tokens, const MoeCapacity& rule) {
  const int64_t T = max_tokens, E = cfg.num_experts, k = cfg.num_experts_per_tok,
                H = cfg.hidden_size, I = cfg.moe_intermediate_size;
  const int64_t R = moe_sorted_rows(cfg, rule, T);
  MoeGradScratch s;
  s.dy_sorted = a.alloc(compute, {R, H});
  s.dact = a.alloc(compute, {R, I});
  s.dgu = a.alloc(compute, {R, 2 * I});
  s.dx_sorted = a.alloc(compute, {R, H});
  s.dweights = a.alloc(DType::f32, {T, k});
  s.dlogits = a.alloc(compute, {T, E});
  return s;
}

MoeGradScratch moe_grad_rows(const MoeGradScratch& s, const TextConfig& cfg,
                             const MoeCapacity& rule, int64_t T) {
  const int64_t rows = moe_sorted_rows(cfg, rule, T);
  MoeGradScratch r;
  r.dy_sorted = s.dy_sorted.slice(0, rows);
  r.dact = s.dact.slice(0, rows);
  r.dgu = s.dgu.slice(0, rows);
  r.dx_sorted = s.dx_sorted.slice(0, rows);
  r.dweights = s.dweights.slice(0, T);
  r.dlogits = s.dlogits.slice(0, T);
  return r;
}

}  // namespace iris
