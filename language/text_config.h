// Hyperparameters of a Qwen-VL text decoder (HF Qwen3VLTextConfig; Qwen2-VL's and Qwen2.5-VL's
// Qwen2 decoder differs in its tensors, q/k/v biases instead of q/k norms, and in the M-RoPE
// layout).
#pragma once

#include <array>
#include <cstdint>

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

  int q_width() const { return num_attention_heads * head_dim; }
  int kv_width() const { return num_key_value_heads * head_dim; }
  int qkv_width() const { return q_width() + 2 * kv_width(); }
};

}  // namespace iris
