// Hyperparameters of a Qwen-VL text decoder (HF Qwen3VLTextConfig; Qwen2-VL's and Qwen2.5-VL's
// Qwen2 decoder differs in its tensors, q/k/v biases instead of q/k norms, and in the M-RoPE
// layout).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace iris {

struct TextConfig {
  int vocab_size = 151936;
  int hidden_size = 4096;
  int intermediate_size = 22016;
  int num_hidden_layers = 32;
  int num_attention_heads = 32;
  int num_key_value_heads = 32;
  int head_dim = 128;
  int max_position_embeddings = 128000;
  float rms_norm_eps = 1e-6f;
  float rope_theta = 5000000.0f;
  std::array<int, 3> mrope_section{24, 20, 20};
  bool mrope_interleaved = true;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  // Mixture of experts (Qwen3-VL-MoE); num_experts 0 is a dense model. A sparse layer's MLP is
  // num_experts SwiGLU experts of width moe_intermediate_size, num_experts_per_tok of them per
  // token, picked by a router; the other layers keep the dense MLP of intermediate_size.
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int moe_intermediate_size = 0;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;
  float router_aux_loss_coef = 0.001f;

  int q_width() const { return num_attention_heads * head_dim; }
  int kv_width() const { return num_key_value_heads * head_dim; }
  int qkv_width() const { return q_width() + 2 * kv_width(); }
  // HF's rule (Qwen3VLMoeTextDecoderLayer): layer l is sparse unless it is in mlp_only_layers,
  // and only every decoder_sparse_step-th layer is.
  bool sparse_layer(int l) const {
    return num_experts > 0 && (l + 1) % decoder_sparse_step == 0 &&
           std::find(mlp_only_layers.begin(), mlp_only_layers.end(), l) == mlp_only_layers.end();
  }
  bool any_sparse_layer() const {
    for (int l = 0; l < num_hidden_layers; ++l)
      if (sparse_layer(l)) return true;
    return false;
  }
};

}  // namespace iris
