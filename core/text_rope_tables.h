// The M-RoPE tables of a text call on the host, from its tokens' (t, h, w) positions.
// Backend::text_rope_tables computes them on the device; this is its definition: the CPU backend
// runs it (the oracle the CUDA kernel is checked against), and language/mrope.cpp's
// mrope_tables computes the same from the three rows get_rope_index produces.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace iris {

// Refuses arguments Backend::text_rope_tables does not take (naming `op`): cos and sin f32
// [L, head_dim] with head_dim even, positions [L, 3], head_dim / 2 frequencies and axes in 0..2.
void check_text_rope_tables(const Tensor& cos, const Tensor& sin, const Tensor& positions,
                            const std::vector<float>& inv_freq, const std::vector<int>& pair_axis,
                            const char* op);

// cos, sin [rows, head_dim]: columns j and j + head_dim / 2 are cos/sin of
// float(positions[r * 3 + pair_axis[j]]) * inv_freq[j], in float (glibc's cosf and sinf).
void text_rope_tables_host(float* cos, float* sin, const int32_t* positions, int64_t rows,
                           int64_t head_dim, const std::vector<float>& inv_freq,
                           const std::vector<int>& pair_axis);

}  // namespace iris
