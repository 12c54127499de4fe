// Checked CUDA / cuBLASLt calls: every failure becomes an iris::Error naming the statement, the
// file and the line, so a failing op in a long model run points at the exact call.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/error.h"

namespace iris::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* stmt, const char* file,
                                          int line) {
  throw_error(file, line,
              str_cat("CUDA error ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ") in `",
                      stmt, "`"));
}

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* stmt,
                                            const char* file, int line) {
  throw_error(file, line, str_cat("cuBLAS error ", static_cast<int>(status), " in `", stmt, "`"));
}

}  // namespace iris::cuda

#define IRIS_CUDA_CHECK(stmt)                                                    \
  do {                                                                           \
    const cudaError_t iris_cuda_err_ = (stmt);                                   \
    if (iris_cuda_err_ != cudaSuccess)                                           \
      ::iris::cuda::throw_cuda_error(iris_cuda_err_, #stmt, __FILE__, __LINE__); \
  } while (0)

#define IRIS_CUBLAS_CHECK(stmt)                                                     \
  do {                                                                              \
    const cublasStatus_t iris_cublas_st_ = (stmt);                                  \
    if (iris_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                   \
      ::iris::cuda::throw_cublas_error(iris_cublas_st_, #stmt, __FILE__, __LINE__); \
  } while (0)

// After a <<<>>> launch: reports bad launch configurations immediately (asynchronous faults
// surface at the next synchronising call, as with any CUDA code).
#define IRIS_CUDA_LAUNCH_CHECK() IRIS_CUDA_CHECK(cudaGetLastError())
