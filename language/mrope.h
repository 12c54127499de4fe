// Text rotary tables: interleaved M-RoPE (Qwen3-VL) from 3-row (T, H, W) position ids.
#pragma once

#include <cstdint>
#include <vector>

#include "language/text_config.h"

namespace iris {

// positions: 3 rows of n_tokens each (T row, then H, then W), as get_rope_index produces.
// cos/sin: [n_tokens, head_dim] f32, computed in f32 as HF does (the CUDA backend rounds them to
// bf16 before use, as HF casts them to the activation dtype).
void mrope_tables(const TextConfig& cfg, const int64_t* positions, int64_t n_tokens, float* cos,
                  float* sin);

// The 3 rows of n positions as Backend::text_rope_tables reads them: out[t * 3 + axis], i32.
void mrope_positions_token_major(const int64_t* positions, int64_t n, int32_t* out);

// What Backend::text_rope_tables takes to compute the same tables on a backend: frequency pair j
// (j < head_dim / 2) turns at mrope_inv_freq(cfg)[j] with the position on axis
// mrope_pair_axes(cfg)[j] (0 = T, 1 = H, 2 = W).
std::vector<float> mrope_inv_freq(const TextConfig& cfg);
std::vector<int> mrope_pair_axes(const TextConfig& cfg);

// The same position on all three axes (text-only tokens and decode steps).
void mrope_tables_1d(const TextConfig& cfg, int64_t first_position, int64_t n_tokens, float* cos,
                     float* sin);

}  // namespace iris
