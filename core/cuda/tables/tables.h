// Host-side launchers of the per-call tables a text or vision call reads, computed on the device
// from the positions or image grids in device memory (text_rope_tables.cu, vision_tables.cu). Every
// launcher enqueues on `s` without synchronising (graph-capturable).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace iris::cuda {

// Backend::vision_tables: inv_freq holds head_dim / 4 host values (copied into the launch);
// head_dim is a multiple of 4 up to 4 * kVisionTablesMaxQuarter, the capacity at most
// kVisionTablesMaxCapacity segments (one shared-memory entry each). The grids are read on the
// device and cannot be refused there: invalid ones give wrong tables but no write out of bounds.
constexpr int kVisionTablesMaxQuarter = 64;
constexpr int kVisionTablesMaxCapacity = 2048;
// Backend::text_rope_tables (text_rope_tables.cu): half = head_dim / 2 frequency pairs, at most
// kTextRopeMaxPairs, with their inverse frequencies and position axes.
constexpr int kTextRopeMaxPairs = 256;
void launch_text_rope_tables(float* cos, float* sin, const int32_t* positions, int64_t rows,
                             int half, const float* inv_freq, const int* axis, cudaStream_t s);

void launch_vision_tables(float* cos, float* sin, int32_t* pos_index, float* pos_weight,
                          int32_t* cu_seqlens, int32_t* real_rows, const int32_t* grids,
                          int capacity, int64_t rows, int head_dim, const float* inv_freq,
                          int merge_size, int grid_side, int32_t* window_cu, int window_units,
                          int window_capacity, cudaStream_t s);

}  // namespace iris::cuda
