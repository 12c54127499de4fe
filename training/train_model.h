// Qwen3-VL as a trainable model on the fp32 CPU reference: a forward that keeps every activation
// its backward needs, and a hand-written backward (training/backward_ops.h) in reverse order.
// The parameters are a ModelWeights of f32 tensors on the CPU backend and double as the optimizer's
// master weights; the gradients are a second ModelWeights with the same binding table, so the
// gradient of HF tensor X is found under the same name.
//
// Memory is planned once from TrainLimits: one arena holds every activation, the backward's
// scratch and the chunked logits; a step allocates no tensors.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "core/arena.h"
#include "core/backend.h"
#include "vision/vision_encoder.h"

namespace iris {

// One training sequence. ids and labels have the same length; labels follow HF (unshifted: the
// model predicts labels[i + 1] from position i; -100 marks tokens without a label).
// pixel_values: [n_patches, patch_dim] f32 rows of all images in prompt order (as the processor
// emits them); grids: one (t, h, w) per image.
struct TrainSample {
  std::vector<int32_t> ids, labels;
  std::vector<float> pixel_values;
  std::vector<GridTHW> grids;
};

struct LossStats {
  double loss_sum = 0;   // summed cross-entropy over labelled tokens
  int64_t n_tokens = 0;  // labelled tokens (mean loss = loss_sum / n_tokens)
};

struct TrainLimits {
  int64_t max_seq_len = 2048;   // tokens of one sample
  int64_t max_patches = 16384;  // vision patch rows of one sample (before the 2x2 merge)
  int max_images = 16;          // images (vision attention segments) of one sample
  // Rows of [rows, vocab] logits materialised at once by the loss; the larger, the fewer passes
  // over the lm_head gradient, at rows * vocab * 4 bytes.
  int64_t loss_chunk_rows = 32;
  // Labelled rows whose lm_head weight gradient is held back and applied in one pass (0: each
  // sample applies its own; so does a sample with more labelled rows than this). A small model's
  // step is dominated by streaming the [vocab, hidden] gradient once per sample; rows * vocab * 4
  // bytes buys doing it once per this many rows.
  int64_t deferred_head_rows = 0;
};

// Which parts get no gradient, named like Qwen's fine-tuning flags (tune_mm_vision = vision
// tower: patch_embed, pos_embed, blocks; tune_mm_mlp = merger and DeepStack mergers; tune_mm_llm
// = the language model with its embedding and lm_head).
// The three parts Qwen's fine-tuning scripts freeze or give their own learning rate.
enum class ModelPart { vision_tower, merger, language_model };

// The part the HF tensor `hf_name` belongs to (unknown names are an error).
ModelPart model_part(const std::string& hf_name);

struct FreezeSpec {
  bool vision_tower = false;
  bool merger = false;
  bool language_model = false;
  // Whether the HF tensor `hf_name` belongs to a frozen part (unknown names are an error).
  bool frozen(const std::string& hf_name) const;
};

class TrainableQwen3VL {
 public:
  // params: f32 weights on the CPU backend `cpu` (allocate_weights/load_weights with
  // make_cpu_backend()); kept by reference and updated in place by the optimizer.
  TrainableQwen3VL(Backend& cpu, const ModelConfig& cfg, ModelWeights& params,
                   const TrainLimits& limits);

  // Loss only.
  LossStats forward(const TrainSample& s);
  // Loss, and grads += grad_scale * d(loss_sum)/dparam for every parameter that is not frozen.
  // grad_scale = 1 / (labelled tokens of the global batch) gives the gradient of the mean loss.
  LossStats forward_backward(const TrainSample& s, float grad_scale);

  // The gradients, with any held-back lm_head rows applied first.
  ModelWeights& grads() {
    flush_head_grad();
    return *grads_;
  }
  // Applies the lm_head weight gradient of held-back rows (TrainLimits.deferred_head_rows); call
  // before reading the gradients through anything but grads() (an optimizer step).
  void flush_head_grad();
  ModelWeights& params() { return params_; }
  void zero_grads();
  // Sample-parallel training runs one replica per thread, each with its own activations and
  // gradients over the shared parameters. This adds this replica's gradients into `sum`'s and
  // leaves this replica's at zero. Held-back lm_head rows are applied straight into `sum`, and the
  // embedding's gradient is added only on the rows this replica's samples touched, so the
  // [vocab, hidden] tensor is not streamed once per replica.
  void move_grads_into(TrainableQwen3VL& sum);
  // Frozen parts keep a zero gradient and skip their weight-gradient GEMMs; backpropagation still
  // runs through a frozen part when a trainable part lies before it.
  void set_frozen(bool vision_tower, bool merger, bool language_model);
  const FreezeSpec& frozen() const { return frozen_; }

  const ModelConfig& config() const { return cfg_; }
  const TrainLimits& limits() const { return limits_; }
  size_t arena_bytes() const { return arena_.capacity(); }

 private:
  struct VisionBlockActs {
    Tensor ln1, mean1, rstd1, qkv, lse, attn, x_mid, ln2, mean2, rstd2, fc1, act;
  };
  struct MergerActs {
    Tensor ln, mean, rstd, fc1, act, out;
  };
  struct TextLayerActs {
    Tensor rms1, rstd1, qkv_lin, qk_rstd, qkv, attn, lse, x_mid, rms2, rstd2, gate_up, act;
  };

  void allocate(Arena& a);
  LossStats run(const TrainSample& s, bool backward, float grad_scale);
  void prepare(const TrainSample& s);
  void vision_forward(const float* pixels);
  void merger_forward(const PatchMergerWeights& w, MergerActs& a, const float* x, bool post);
  void text_forward();
  double loss_and_head_backward(bool backward, float grad_scale);
  void text_backward();
  void vision_backward(const float* pixels);
  // d(out) -> merger weight grads (g null: frozen) and, when dx is non-null, dx += d(input).
  void merger_backward(const PatchMergerWeights& w, PatchMergerWeights* g, const MergerActs& a,
                       const float* x, const float* dout, float* dx, bool post);

  Backend& be_;
  ModelConfig cfg_;
  ModelWeights& params_;
  std::unique_ptr<ModelWeights> grads_;
  TrainLimits limits_;
  FreezeSpec frozen_;
  Arena arena_;

  // The current sample's shape.
  int64_t L_ = 0;        // tokens
  int64_t S_ = 0;        // vision patch rows
  int64_t n_pad_ = 0;    // image-pad tokens (= S_ / merge_unit)
  int64_t n_label_ = 0;  // positions whose next token is labelled
  int n_segments_ = 0;   // vision attention segments
  VisionInputs vin_;     // host-planned RoPE tables, interpolation and cu_seqlens

  // Inputs.
  Tensor ids_, pad_rows_, label_rows_, targets_, cos_, sin_, text_cu_;
  // Vision activations: x_[l] is the input of block l, x_[depth] the tower's output.
  std::vector<Tensor> vx_;
  std::vector<VisionBlockActs> vb_;
  MergerActs merger_;
  std::vector<MergerActs> ds_;
  // Text activations: tx_[l] is the input of layer l (after the previous DeepStack add),
  // tx_[n_layers] the input of the final norm.
  std::vector<Tensor> tx_;
  std::vector<TextLayerActs> tl_;
  Tensor final_, final_rstd_, xlab_, dxlab_;
  Tensor logits_;  // the loss's scratch: loss_chunk_ rows of logits at a time
  int64_t loss_chunk_ = 0;
  // Held-back lm_head gradient rows: d(logits) and the final-norm rows they multiply.
  Tensor pending_dl_, pending_x_;
  int64_t pending_rows_ = 0, pending_capacity_ = 0;
  // What move_grads_into must add: whether the lm_head's gradient (the embedding's, when tied)
  // was written densely since the last zeroing, and which embedding rows the samples touched.
  bool head_grad_dense_ = false;
  std::vector<uint8_t> embed_row_touched_;
  std::vector<int32_t> touched_embed_rows_;
  // Backward scratch.
  Tensor t_dres_, t_dtmp_, t_dattn_, t_dqkv_, t_dgu_, t_dact_, t_dsum_;
  Tensor v_dres_, v_dtmp_, v_dattn_, v_dqkv_, v_dfc_, v_dsum_, m_da_, m_dln_, d_embeds_;
  std::vector<Tensor> d_ds_;
};

}  // namespace iris
