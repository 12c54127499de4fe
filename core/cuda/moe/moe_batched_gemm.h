// The experts' projections when every expert owns the same rows (Megatron's drop-and-pad,
// moe_dispatch with a capacity): one strided batched cuBLASLt matmul over the experts, on tensor
// cores, in place of the grouped kernels that read each expert's rows from the device. Row-major,
// bf16 operands, f32 sums, experts' weights in the checkpoints' [E, K, N] layout:
//   forward:          y[e] [C, N] (bf16)  = x[e] [C, K] . w[e] [K, N]
//   backward_input:  dx[e] [C, K] (bf16)  = dy[e] [C, N] . w[e]^T
//   backward_weight: dw[e] [K, N] (f32)  += x[e]^T . dy[e]
// Each shape's plan is made on its first call (the heuristic's first candidate among the
// reduction schemes without split-K atomics) and kept, so later calls only enqueue (capturable)
// and give the same bits.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace iris::cuda {

class MoeBatchedGemm {
 public:
  // `workspace` (the caller's device memory) is used by every matmul on the caller's stream.
  MoeBatchedGemm(void* workspace, size_t workspace_bytes);
  ~MoeBatchedGemm();
  MoeBatchedGemm(const MoeBatchedGemm&) = delete;
  MoeBatchedGemm& operator=(const MoeBatchedGemm&) = delete;

  void forward(uint16_t* y, const uint16_t* x, const uint16_t* w, int64_t E, int64_t C, int64_t K,
               int64_t N, cudaStream_t s);
  void backward_input(uint16_t* dx, const uint16_t* dy, const uint16_t* w, int64_t E, int64_t C,
                      int64_t K, int64_t N, cudaStream_t s);
  void backward_weight(float* dw, const uint16_t* x, const uint16_t* dy, int64_t E, int64_t C,
                       int64_t K, int64_t N, cudaStream_t s);

 private:
  enum Op : int { kForward = 0, kBackwardInput = 1, kBackwardWeight = 2 };
  // Op, E, C, K, N and the alignment in bytes of the three operands (pointers and batch strides).
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int>;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  const Plan& plan(const Key& key);
  void matmul(const Key& key, void* d, const void* a, const void* b, float beta, cudaStream_t s);
  static void destroy(Plan& p);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_;
  size_t workspace_bytes_;
  std::map<Key, Plan> plans_;
};

}  // namespace iris::cuda
