// Host-side dtype conversion for the CUDA backend's transfers, spread over the host's cores: a
// batch of images arrives as ~10M f32 pixels, and converting them on one core took longer than
// the vision encoder itself.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace iris::cuda {

// memcpy over the host's cores, in blocks (a weight upload from the page cache).
void copy_bytes_parallel(void* dst, const void* src, size_t bytes);
// copy_bytes_parallel of n floating-point elements of `dtype` that also checks each block in the
// copy, while it is in cache: the index of the first NaN or Inf element, or -1.
int64_t copy_finite_parallel(void* dst, const void* src, DType dtype, int64_t n);
// The same on the calling thread alone, for callers that run their own threads (a team per
// caller would put many threads on each core).
int64_t copy_finite(void* dst, const void* src, DType dtype, int64_t n);
// n elements of src converted into dst, unless src holds a NaN or Inf: then the index of the
// first, dst untouched. On the calling thread alone.
int64_t convert_finite(void* dst, DType to, const void* src, DType from, int64_t n);
// dst[i] = f32_to_bf16(src[i]) (round to nearest even, NaN stays NaN), for i < n.
void convert_f32_to_bf16(uint16_t* dst, const float* src, int64_t n);
// dst[i] = bf16_to_f32(src[i]), for i < n.
void convert_bf16_to_f32(float* dst, const uint16_t* src, int64_t n);

}  // namespace iris::cuda
