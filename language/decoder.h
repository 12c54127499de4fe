// The Qwen3 text decoder with a KV cache. Like the vision encoder, a step is split into
// upload_step() (host inputs into static buffers) and compute pieces that read only those
// buffers, so that a decode step (or each layer) can be captured in a CUDA graph and replayed
// for every token.
#pragma once

#include <cstdint>
#include <vector>

#include "core/arena.h"
#include "core/backend.h"
#include "core/lora.h"
#include "core/moe_ops.h"
#include "core/recompute.h"
#include "language/text_config.h"

namespace iris {

// A family's layer is the tensors it has: Qwen3 has q/k norms and no q/k/v bias, Qwen2 the
// reverse; the other stays undefined, and every op takes an undefined tensor as "none".
struct DecoderLayerWeights {
  Tensor input_norm_w;        // [H]
  Tensor qkv_w;               // [(nq + 2 nkv) hd, H]: q_proj, k_proj, v_proj stacked
  Tensor qkv_b;               // [(nq + 2 nkv) hd] (Qwen2)
  Tensor q_norm_w, k_norm_w;  // [hd] (Qwen3)
  Tensor o_w;                 // [H, nq hd]
  Tensor post_norm_w;         // [H]
  Tensor gate_up_w;           // [2I, H]: gate_proj then up_proj
  Tensor down_w;              // [H, I]
  // A sparse (mixture-of-experts) layer has these instead of gate_up_w and down_w, in the
  // checkpoints' layout (language/moe_mlp.h).
  Tensor router_w;           // [E, H]: mlp.gate
  Tensor experts_gate_up_w;  // [E, H, 2I]: each expert's gate columns, then its up columns
  Tensor experts_down_w;     // [E, I, H]
  // LoRA adapters (core/lora.h) on the HF modules each fused projection holds: q/k/v, o, gate/up
  // and down; empty where none is adapted (a sparse layer's experts never are).
  LoraAdapters qkv_lora, o_lora, gate_up_lora, down_lora;
};

struct DecoderWeights {
  Tensor embed;  // [V, H]
  std::vector<DecoderLayerWeights> layers;
  Tensor norm_w;   // [H]
  Tensor lm_head;  // [V, H]; the embedding itself when tied
};

struct DecoderLimits {
  int64_t max_context = 4096;      // KV cache rows
  int64_t max_step_tokens = 4096;  // tokens in one forward (prefill chunk)
  int64_t max_logit_rows = 1;      // rows of logits computed in one call
};

// ---- One definition of a decoder layer, for inference and training ---------------------------
// Inference passes its shared scratch: x_in, x_mid and x_out are one tensor (the residual updated
// in place), rms1 and rms2 one, qkv_lin and qkv one (q/k norm and RoPE in place, the k/v rows
// stored into the cache), and no statistics; the norms are fused into the projections that read
// them. Training passes a buffer for each and the rstd/lse tensors: the forward then saves what
// decoder_layer_backward reads.
// Megatron's static per-expert capacity for training (model.moe_expert_capacity_factor,
// moe_pad_expert_input_to_capacity, moe_token_drop_policy; language/moe_mlp.h): factor 0 is
// dropless, as HF and inference are.
struct MoeCapacity {
  double factor = 0.0;
  bool pad = false;  // every expert computes exactly its capacity's rows
  MoeDropPolicy policy = MoeDropPolicy::probs;
  bool drops() const { return factor > 0.0; }
};
// A sparse layer's MLP reads and writes `moe` (language/moe_mlp.h) in place of gate_up and act.
struct MoeBuffers {
  Tensor logits;     // [T, E] the router's logits (compute dtype)
  Tensor probs;      // f32 [T, E] their softmax, kept by training for the backward; else undefined
  Tensor ids;        // i32 [T, k] each token's experts
  Tensor weights;    // [T, k] their routing weights
  Tensor offsets;    // i32 [E + 1] each expert's rows of the sorted order
  Tensor slot_rows;  // i32 [T, k] each slot's row of the sorted order
  // The sorted rows, R of them: T k, or E x capacity when padded to capacity.
  Tensor x_sorted;  // [R, H] the normed rows, one per slot, grouped by expert
  Tensor gate_up;   // [R, 2I]
  Tensor act;       // [R, I]
  Tensor y_sorted;  // [R, H] each slot's expert output
  // With a capacity (capacity_rule.drops()): the step's slots per expert (moe_rows), the routing
  // after the drop (i32 [T, k], which the permutation follows) and where dropped slots are
  // counted (i32 [1]; undefined: not counted, as in a recomputation or an evaluation).
  MoeCapacity capacity_rule;
  int64_t capacity = 0;
  Tensor kept_ids;
  Tensor dropped;
  // Training: i32 [1] the step's real rows (undefined: every row; later rows are padding and
  // route nowhere), and f32 [E] the load-balancing loss's gradient with respect to each routed
  // row's probabilities (moe_aux_loss; undefined: no such loss).
  Tensor real_rows;
  Tensor aux_dprob;
};
struct DecoderLayerBuffers {
  Tensor x_in, rms1, rstd1, qkv_lin, qk_rstd, qkv, lse, attn, x_mid, rms2, rstd2, gate_up, act,
      x_out;
  MoeBuffers moe;
  LoraScratch lora;  // where the layer has adapters
  bool saves() const { return lse.defined(); }
};
// Where a layer's attention looks. Training: causal segments of one packed sequence
// (cu_seqlens). Inference: the KV cache, with the step's rows at past_len[0].
struct DecoderAttention {
  Tensor cos, sin;  // f32 [T, head_dim] M-RoPE tables
  Tensor cu_seqlens;
  int n_segments = 0;
  Tensor k_cache, v_cache, past_len;
};
void decoder_layer_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                           const DecoderLayerBuffers& b, const DecoderAttention& at);
// The layer's two halves, which per-module training graphs capture separately: the attention
// (x_mid = x_in + attention) and the MLP (x_out = x_mid + MLP). decoder_layer_forward is the
// first then the second.
void decoder_attention_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                               const DecoderLayerBuffers& b, const DecoderAttention& at);
void decoder_mlp_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                         const DecoderLayerBuffers& b);
// Before a layer's backward: rewrites the activations `mode` did not keep from those it kept
// (selective: rms1, qkv, rms2, act; full: the whole layer from x_in, whose b.x_out must then be
// scratch, not the next layer's input). Nothing for Recompute::none.
void decoder_layer_recompute(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                             const DecoderLayerBuffers& b, const DecoderAttention& at,
                             Recompute mode);
// Backward scratch: dres and dtmp f32, the rest in the compute dtype; dres_c is the
// compute-dtype copy of dres that the GEMMs read (dres itself where the compute dtype is f32).
// A sparse layer's backward scratch, over its R sorted rows (compute dtype unless noted).
struct MoeGradScratch {
  Tensor dy_sorted, dact, dgu, dx_sorted;  // [R, H], [R, I], [R, 2I], [R, H]
  Tensor dweights;                         // f32 [T, k]
  Tensor dlogits;                          // [T, E]
};
struct DecoderGradScratch {
  Tensor dres, dres_c, dtmp, dact, dgu, dattn, dqkv, dsum;
  MoeGradScratch moe;
  LoraScratch lora;
};
// dres holds d(x_out) and becomes d(x_in); g (null: frozen) receives the layer's weight
// gradients (+=).
void decoder_layer_backward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                            DecoderLayerWeights* g, const DecoderLayerBuffers& b,
                            const DecoderAttention& at, const DecoderGradScratch& s);
// decoder_layer_backward's halves, in the order it runs them: dres goes from d(x_out) to
// d(x_mid), then to d(x_in).
void decoder_mlp_backward(Backend& be, const DecoderLayerWeights& w, DecoderLayerWeights* g,
                          const DecoderLayerBuffers& b, const DecoderGradScratch& s);
void decoder_attention_backward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                                DecoderLayerWeights* g, const DecoderLayerBuffers& b,
                                const DecoderAttention& at, const DecoderGradScratch& s);

class TextDecoder {
 public:
  TextDecoder(Backend& backend, const TextConfig& cfg, const DecoderWeights& weights,
              const DecoderLimits& limits);

  // ids: T token ids; cos/sin: [T, head_dim] rotary tables; the step's tokens sit at cache rows
  // past_len .. past_len + T - 1.
  void upload_step(const int32_t* ids, const float* cos, const float* sin, int64_t T,
                   int64_t past_len);

  // Capturable compute pieces, in order: embed, layer 0..N-1, final_norm, lm_head, argmax.
  void embed(int64_t T);
  void layer(int l, int64_t T);
  void final_norm(int64_t T);
  // logits rows [0, n_rows) from final-norm rows [first_row, first_row + n_rows).
  void lm_head(int64_t first_row, int64_t n_rows);
  void argmax(int64_t n_rows);

  // A sparse layer's routing as the last layer run left it (tests read it between layers).
  Tensor router_logits(int64_t T) const { return moe_.logits.slice(0, T); }
  Tensor routed_experts(int64_t T) const { return moe_.ids.slice(0, T); }

  Tensor hidden(int64_t T) const { return x_.slice(0, T); }       // the residual stream
  Tensor normed(int64_t T) const { return normed_.slice(0, T); }  // final norm output
  Tensor logits(int64_t n_rows) const { return logits_.slice(0, n_rows); }
  Tensor next_tokens(int64_t n_rows) const { return next_.slice(0, n_rows); }

  const TextConfig& config() const { return cfg_; }
  const DecoderLimits& limits() const { return limits_; }
  const Arena& arena() const { return arena_; }
  Backend& backend() const { return backend_; }

 private:
  void allocate(Arena& a);

  Backend& backend_;
  TextConfig cfg_;
  const DecoderWeights& w_;
  DecoderLimits limits_;
  Arena arena_;
  // Static inputs.
  Tensor ids_, cos_, sin_, past_len_;
  // Activations and caches.
  Tensor x_, xn_, qkv_, attn_, gate_up_, mlp_, normed_, logits_, next_;
  std::vector<Tensor> k_cache_, v_cache_;
  MoeBuffers moe_;    // one set for every sparse layer: a layer's routing is used within it
  LoraScratch lora_;  // where the layers have adapters
};

}  // namespace iris
