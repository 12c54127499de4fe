// bf16 GEMMs through cuBLASLt: y[M,N] = x[M,K] w[N,K]^T (+ bias[N]) (+ y), fp32 compute.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace iris::cuda {

class LtGemm {
 public:
  // `workspace` (device memory owned by the caller) is handed to every matmul.
  LtGemm(void* workspace, size_t workspace_bytes);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  void run(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
           int64_t n, int64_t k, bool accumulate, cudaStream_t stream);

 private:
  // The algorithm depends on the shape, the epilogue and the operands' alignment (a pointer
  // into the middle of a tensor may be less aligned than the heuristic's default of 256).
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, int, int, int>;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  const Plan& plan(const Key& key);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_;
  size_t workspace_bytes_;
  std::map<Key, Plan> plans_;
};

}  // namespace iris::cuda
