// Host-side launchers of the row kernels (rows.cu): rows moved by index, and the backwards of the
// lookups, which add in a fixed order (no float atomics). bf16 travels as uint16_t bits; every
// launcher enqueues on `s` without synchronising or allocating (graph-capturable). Parameters
// typed `const void*` with a `bool ..._f32` flag are f32 when the flag is set, bf16 otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace iris::cuda {

// ---- inference ----
// Rows whose id is outside [0, vocab) are written as zeros (the device cannot throw).
void launch_embedding(uint16_t* y, const uint16_t* table, const int32_t* ids, int64_t n_ids,
                      int64_t vocab, int64_t cols, cudaStream_t s);
// Indices outside [0, dst_rows) are skipped.
void launch_scatter_rows(uint16_t* dst, const uint16_t* src, const int32_t* index, int64_t n,
                         int64_t dst_rows, int64_t cols, bool accumulate, cudaStream_t s);
void launch_add_interpolated_rows(uint16_t* y, const uint16_t* table, const int32_t* index,
                                  const float* weight, int64_t rows, int64_t table_rows,
                                  int64_t cols, cudaStream_t s);

// ---- training: the backwards ----
// dtable[ids[t], :] (f32 [vocab, cols]) += dy[t, :] for ids[t] != skip_id and in [0, vocab);
// rows with the same id add in token order (one block per first occurrence; O(T^2) id scan).
void launch_embedding_backward(float* dtable, const void* dy, bool dy_f32, const int32_t* ids,
                               int64_t tokens, int64_t vocab, int64_t cols, int32_t skip_id,
                               cudaStream_t s);
// dst[i, :] = src[index[i], :] converted; indices outside [0, src_rows) give zero rows.
void launch_gather_rows(void* dst, bool dst_f32, const void* src, bool src_f32,
                        const int32_t* index, int64_t rows, int64_t src_rows, int64_t cols,
                        cudaStream_t s);
// dtable (f32 [table_rows, cols]) [index[s,k], :] += weight[s,k] * dy[s, :] for s < rows, k < 4,
// in (s, k) order per table row; indices outside [0, table_rows) skipped.
void launch_add_interpolated_rows_backward(float* dtable, const void* dy, bool dy_f32,
                                           const int32_t* index, const float* weight, int64_t rows,
                                           int64_t table_rows, int64_t cols, cudaStream_t s);

}  // namespace iris::cuda
