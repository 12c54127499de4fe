#include "core/cuda/gemm/gemm_tuning.h"

#include <cuda_runtime.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include "core/cuda/cuda_check.h"

namespace iris::cuda {

static_assert(sizeof(cublasLtMatmulAlgo_t) == sizeof(GemmTuningEntry::algo),
              "a cache entry holds cublasLtMatmulAlgo_t's words exactly");

GemmTuningIdentity gemm_tuning_identity(int device) {
  cudaDeviceProp prop{};
  IRIS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int driver = 0, runtime = 0;
  IRIS_CUDA_CHECK(cudaDriverGetVersion(&driver));
  IRIS_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  GemmTuningIdentity id;
  id.gpu = prop.name;
  id.compute_capability = str_cat(prop.major, ".", prop.minor);
  id.multiprocessors = prop.multiProcessorCount;
  // cudaDriverGetVersion names the CUDA version the driver supports, which several driver
  // releases share; the release itself comes from the kernel module, where Linux exposes it.
  std::ifstream proc("/proc/driver/nvidia/version");
  const std::string release =
      proc ? nvidia_driver_release(std::string(std::istreambuf_iterator<char>(proc), {})) : "";
  const std::string cuda = str_cat("CUDA ", driver / 1000, ".", driver % 1000 / 10);
  id.driver = release.empty() ? cuda : release + ", " + cuda;
  id.cuda_runtime = runtime;
  id.cublaslt = static_cast<int64_t>(cublasLtGetVersion());
  return id;
}

GemmTuningEntry tuning_entry_of(const cublasLtMatmulAlgo_t& algo, double time_us) {
  GemmTuningEntry e;
  std::memcpy(e.algo.data(), algo.data, sizeof(algo.data));
  e.time_us = time_us;
  return e;
}

cublasLtMatmulAlgo_t algo_of(const GemmTuningEntry& entry) {
  cublasLtMatmulAlgo_t algo{};
  std::memcpy(algo.data, entry.algo.data(), sizeof(algo.data));
  return algo;
}

bool algo_fits(cublasLtHandle_t handle, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a,
               cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
               const cublasLtMatmulAlgo_t& algo, size_t workspace_bytes) {
  cublasLtMatmulHeuristicResult_t result{};
  // Any status but success means "not for this problem" (a bad value, another architecture):
  // the caller falls back to the heuristic's choice.
  const cublasStatus_t st = cublasLtMatmulAlgoCheck(handle, op, a, b, c, d, &algo, &result);
  return st == CUBLAS_STATUS_SUCCESS && result.state == CUBLAS_STATUS_SUCCESS &&
         result.workspaceSize <= workspace_bytes;
}

bool algo_reduction_in(const cublasLtMatmulAlgo_t& algo, uint32_t mask) {
  uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
  size_t written = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoConfigGetAttribute(
      &algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme), &written);
  if (st != CUBLAS_STATUS_SUCCESS || written != sizeof(scheme)) return false;
  return scheme == CUBLASLT_REDUCTION_SCHEME_NONE || (scheme & mask) == scheme;
}

}  // namespace iris::cuda
