// The MLP of a sparse (mixture-of-experts) decoder layer, as transformers 5.x's
// Qwen3VLMoeTextSparseMoeBlock computes it (../shared/docs/qwen3vl-moe-spec.md 1.3, 1.4): the
// router's logits in the compute dtype, softmax in f32 over every expert, the top k renormalised;
// each token's k slots sorted by expert, each expert's SwiGLU over its rows, and the k outputs of
// a token summed in slot order with their weights (no atomics: the same bits every run). It is
// dropless, as HF is: every slot is computed, unless training sets a capacity (MoeCapacity), which
// drops slots over it as Megatron does. Each step is a Backend op with a CPU oracle, and none
// waits for the host, so that a layer can be captured in a CUDA graph.
#pragma once

#include "core/arena.h"
#include "core/backend.h"
#include "language/decoder.h"
#include "language/text_config.h"

namespace iris {

// The slots an expert keeps of a step of T tokens under `rule`: Megatron's get_capacity,
// ceil(T k / E x factor), at most T (no expert can be sent more, so a larger capacity drops
// nothing more and pads only); 0 when dropless.
int64_t moe_expert_capacity(const TextConfig& cfg, const MoeCapacity& rule, int64_t T);
// The sorted rows of such a step: E x capacity when padded to capacity, else T k.
int64_t moe_sorted_rows(const TextConfig& cfg, const MoeCapacity& rule, int64_t T);

// Buffers for steps of up to max_tokens tokens, from `a` (training keeps the router's softmax).
MoeBuffers allocate_moe_buffers(Arena& a, DType compute, const TextConfig& cfg, int64_t max_tokens,
                                bool keep_probs, const MoeCapacity& rule = {});
// The buffers' rows for a step of T tokens, with its capacity.
MoeBuffers moe_rows(const MoeBuffers& m, const TextConfig& cfg, int64_t T);

// x_out = x_mid + MoE(post_attention_layernorm(x_mid)), with b.rms2 the normed rows and b.moe
// the step's buffers (moe_rows): the three parts below in order.
void moe_mlp_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                     const DecoderLayerBuffers& b);
// The parts that Megatron's graph modules name. The router (moe_router): the post-attention
// norm, the gating GEMM, the top k and, with a capacity, the drop.
void moe_router_forward(Backend& be, const TextConfig& cfg, const DecoderLayerWeights& w,
                        const DecoderLayerBuffers& b);
// The routing metadata and permutation (moe_preprocess).
void moe_preprocess_forward(Backend& be, const DecoderLayerBuffers& b);
// The experts and the combine into x_out.
void moe_experts_forward(Backend& be, const DecoderLayerWeights& w, const DecoderLayerBuffers& b);

// Its backward: dres holds d(x_out) and gains d(x_mid) through the MLP; dtmp is overwritten; g
// (null: frozen) accumulates the router's, the experts' and the post-attention norm's gradients.
// The three parts below, in reverse order.
void moe_mlp_backward(Backend& be, const DecoderLayerWeights& w, DecoderLayerWeights* g,
                      const DecoderLayerBuffers& b, const DecoderGradScratch& s);
void moe_experts_backward(Backend& be, const DecoderLayerWeights& w, DecoderLayerWeights* g,
                          const DecoderLayerBuffers& b, const DecoderGradScratch& s);
// d(normed rows) into dtmp: each token's slots summed back.
void moe_preprocess_backward(Backend& be, const DecoderLayerBuffers& b,
                             const DecoderGradScratch& s);
// The router's share of dtmp, then the norm's backward into dres.
void moe_router_backward(Backend& be, const DecoderLayerWeights& w, DecoderLayerWeights* g,
                         const DecoderLayerBuffers& b, const DecoderGradScratch& s);

// Scratch for the backward of steps of up to max_tokens tokens, from `a`.
MoeGradScratch allocate_moe_grad_scratch(Arena& a, DType compute, const TextConfig& cfg,
                                         int64_t max_tokens, const MoeCapacity& rule = {});
MoeGradScratch moe_grad_rows(const MoeGradScratch& s, const TextConfig& cfg,
                             const MoeCapacity& rule, int64_t T);

}  // namespace iris
