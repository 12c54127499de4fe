// The GPU side of the GEMM tuning cache (core/tuning_cache.h): the identity a tuning result
// belongs to, cuBLASLt algorithms as cache entries and back, and the check a cached algorithm
// passes before it is used.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>

#include "core/tuning_cache.h"

namespace iris::cuda {

// The device's name, compute capability and multiprocessor count, the driver (its kernel module
// release where /proc says it, and the CUDA version it supports), the CUDA runtime and cuBLASLt.
GemmTuningIdentity gemm_tuning_identity(int device);

GemmTuningEntry tuning_entry_of(const cublasLtMatmulAlgo_t& algo, double time_us);
cublasLtMatmulAlgo_t algo_of(const GemmTuningEntry& entry);

// Whether cuBLASLt accepts `algo` for the problem of these descriptors (cublasLtMatmulAlgoCheck)
// with a workspace of at most `workspace_bytes`. A cached algorithm comes from a file that may
// have been edited or made by another build, so it is checked before it ever runs.
bool algo_fits(cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
               cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
               const cublasLtMatmulAlgo_t& algo, size_t workspace_bytes);

// Whether `algo` reduces split-K slices with one of the schemes in `mask` (a
// cublasLtReductionScheme_t mask; no split-K always qualifies).
bool algo_reduction_in(const cublasLtMatmulAlgo_t& algo, uint32_t mask);

}  // namespace iris::cuda
