// bf16 GEMMs through cuBLASLt: y[M,N] = x[M,K] w[N,K]^T (+ bias[N]) (+ y), fp32 compute, with an
// optional tanh-GELU epilogue.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace iris::cuda {

class LtGemm {
 public:
  // `workspace` (device memory owned by the caller) is handed to every matmul; `tune_scratch`
  // (also the caller's) receives the outputs of trial runs when algorithms are timed for an
  // accumulating GEMM, whose real output is also an input.
  LtGemm(void* workspace, size_t workspace_bytes, void* tune_scratch, size_t tune_scratch_bytes);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // gelu: y = gelu_tanh(x w^T + bias), applied in f32 before the single rounding to bf16
  // (accumulate must be false then). Returns false, having done nothing, when cuBLASLt has no
  // algorithm for that GELU epilogue (the caller runs the unfused ops); any other failure throws.
  bool run(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
           int64_t n, int64_t k, bool accumulate, bool gelu, cudaStream_t stream);
  // With tuning off, plans made afterwards take the heuristic's first candidate: the choice then
  // depends only on the GPU, the library and the shape, not on a timing race, so another process
  // (a resumed training run) computes the same bits.
  void set_tuning(bool on) { tuning_ = on; }

 private:
  // The algorithm depends on the shape, the epilogue and the operands' alignment (a pointer
  // into the middle of a tensor may be less aligned than the heuristic's default of 256).
  // Fields: m, n, k, has_bias, gelu, accumulate, alignment of x, w, y.
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, bool, int, int, int>;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;  // null: no algorithm for this GELU epilogue
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  const Plan& plan(const Key& key, uint16_t* y, const uint16_t* x, const uint16_t* w,
                   const uint16_t* bias, cudaStream_t stream);
  // Index of the fastest of `count` candidate algorithms, timed on the real operands.
  int fastest(Plan& p, const cublasLtMatmulHeuristicResult_t* results, int count, uint16_t* y,
              const uint16_t* x, const uint16_t* w, const uint16_t* bias, bool accumulate,
              cudaStream_t stream);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_;
  size_t workspace_bytes_;
  void* tune_scratch_;
  size_t tune_scratch_bytes_;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  std::map<Key, Plan> plans_;
  bool tuning_ = true;
};

}  // namespace iris::cuda
