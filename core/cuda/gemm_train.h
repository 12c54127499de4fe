// The GEMMs of training through cuBLASLt (bf16 operands as uint16_t bits, fp32 compute), all
// row-major:
//   forward_f32:     y[M,N] (f32)          = x[M,K] . w[N,K]^T           (lm_head logits)
//   backward_input:  dx[M,K] (bf16 or f32) = dy[M,N] . w[N,K] (+ dx)
//   backward_weight: dw[N,K] (f32)        += dy[M,N]^T . x[M,K],  db[N] (f32) += sum_m dy[m,:]
//
// Plans (descriptors and the chosen algorithm) are cached per shape, output dtype, accumulation
// and operand alignment, as LtGemm does. The first call of a key builds its plan and, with tuning
// on and outside stream capture, times the heuristic's candidates on the real operands: that call
// synchronises the stream, so run one eager step before capturing a graph (has_*_plan tells
// whether a call would still build a plan). A plan built during capture takes the heuristic's
// first candidate without timing. Once a key's plan exists every call only enqueues work
// (capturable).
//
// Determinism: a plan's algorithm is fixed for the life of the object, candidates are limited to
// reduction schemes without split-K atomics, and db is a fixed-order column sum (no float
// atomics), so the same inputs give the same bits on every call. Across processes the timed pick
// may differ (and with it the rounding); set_tuning(false) makes the pick the heuristic's first
// candidate, which depends only on the GPU, the library version and the key.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

namespace iris::cuda {

class LtTrainGemm {
 public:
  // `workspace` (device memory owned by the caller) is handed to every matmul; `tune_scratch`
  // (also the caller's) receives the outputs of trial runs when algorithms are timed for an
  // accumulating GEMM (backward_weight always, backward_input with accumulate), whose real output
  // is also an input. An accumulating output larger than tune_scratch_bytes is not timed: its
  // plan takes the heuristic's first candidate.
  LtTrainGemm(void* workspace, size_t workspace_bytes, void* tune_scratch,
              size_t tune_scratch_bytes);
  ~LtTrainGemm();
  LtTrainGemm(const LtTrainGemm&) = delete;
  LtTrainGemm& operator=(const LtTrainGemm&) = delete;

  // Whether plans built from now on time the heuristic's candidates (default true). Off: the
  // first candidate is taken and building a plan never synchronises. Existing plans are kept, so
  // that eager calls and captured graphs keep running the same algorithms.
  void set_tuning(bool on) { tuning_ = on; }
  bool tuning() const { return tuning_; }

  // y[M,N] (f32) = x[M,K] . w[N,K]^T.
  void forward_f32(float* y, const uint16_t* x, const uint16_t* w, int64_t m, int64_t n, int64_t k,
                   cudaStream_t stream);
  // dx[M,K] = dy[M,N] . w[N,K] (+ dx when accumulate); dx is f32 when dx_f32, else bf16. dx must
  // not alias dy or w.
  void backward_input(void* dx, bool dx_f32, const uint16_t* dy, const uint16_t* w, int64_t m,
                      int64_t n, int64_t k, bool accumulate, cudaStream_t stream);
  // dw[N,K] (f32) += dy[M,N]^T . x[M,K] when dw is not null; db[N] (f32) += column sums of dy
  // when db is not null.
  void backward_weight(float* dw, float* db, const uint16_t* dy, const uint16_t* x, int64_t m,
                       int64_t n, int64_t k, cudaStream_t stream);

  // Whether the matching call already has its plan (it then enqueues only, never synchronises).
  // Shapes that need no matmul (a zero dimension, backward_weight without dw) count as planned.
  bool has_forward_f32_plan(const float* y, const uint16_t* x, const uint16_t* w, int64_t m,
                            int64_t n, int64_t k) const;
  bool has_backward_input_plan(const void* dx, bool dx_f32, const uint16_t* dy, const uint16_t* w,
                               int64_t m, int64_t n, int64_t k, bool accumulate) const;
  bool has_backward_weight_plan(const float* dw, const uint16_t* dy, const uint16_t* x, int64_t m,
                                int64_t n, int64_t k) const;
  size_t plan_count() const { return plans_.size(); }

 private:
  enum Op : int { kForwardF32 = 0, kBackwardInput = 1, kBackwardWeight = 2 };
  // Fields: op, m, n, k (the row-major sizes of the call), f32 output, accumulate, alignments in
  // bytes of cuBLASLt's A, B and D (pointer and leading dimension together).
  using Key = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int, int, int>;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };

  static Key forward_f32_key(const float* y, const uint16_t* x, const uint16_t* w, int64_t m,
                             int64_t n, int64_t k);
  static Key backward_input_key(const void* dx, bool dx_f32, const uint16_t* dy, const uint16_t* w,
                                int64_t m, int64_t n, int64_t k, bool accumulate);
  static Key backward_weight_key(const float* dw, const uint16_t* dy, const uint16_t* x, int64_t m,
                                 int64_t n, int64_t k);

  // D = op(A) op(B) (+ D) with the key's plan; a and b are cuBLASLt's A and B.
  void matmul(const Key& key, void* d, const void* a, const void* b, cudaStream_t stream);
  const Plan& plan(const Key& key, void* d, const void* a, const void* b, cudaStream_t stream);
  // Index of the candidate to keep among `count`, timed on the real operands.
  int fastest(const Plan& p, const cublasLtMatmulHeuristicResult_t* results, int count, void* d,
              const void* a, const void* b, bool accumulate, cudaStream_t stream);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_;
  size_t workspace_bytes_;
  void* tune_scratch_;
  size_t tune_scratch_bytes_;
  bool tuning_ = true;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  std::map<Key, Plan> plans_;
};

}  // namespace iris::cuda
