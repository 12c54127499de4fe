// The GEMMs of training through cuBLASLt (bf16 operands as uint16_t bits, fp32 compute), all
// row-major:
//   forward_f32:     y[M,N] (f32)          = x[M,K] . w[N,K]^T           (lm_head logits)
//   backward_input:  dx[M,K] (bf16 or f32) = dy[M,N] . w[N,K] (+ dx)
//   backward_weight: dw[N,K] (f32)        += dy[M,N]^T . x[M,K],  db[N] (f32) += sum_m dy[m,:]
//
// Plans (descriptors and the chosen algorithm) are cached per shape, output dtype, accumulation
// and operand alignment, as LtGemm does, and choose their algorithm as set_tuning says (GemmTuning
// in core/tuning_cache.h): the heuristic's first candidate, the persistent tuning cache's pick,
// or, in tune mode and outside stream capture, the fastest candidate timed on the real operands.
// A call that times synchronises the stream, so run one eager step before capturing a graph
// (has_*_plan tells whether a call would still build a plan). Once a key's plan exists every call
// only enqueues work (capturable).
//
// Determinism: a plan's algorithm is fixed for the life of the object, candidates (cached ones
// included) are limited to reduction schemes without split-K atomics, and db is a fixed-order
// column sum (no float atomics), so the same inputs give the same bits on every call. Across
// processes a timed or cached pick may differ (and with it the rounding); GemmTuning::heuristic
// makes the pick the heuristic's first candidate, which depends only on the GPU, the library
// version and the key: training runs that way, so that a resumed run continues bit for bit.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>

#include "core/cuda/cuda_handles.h"
#include "core/tuning_cache.h"

namespace iris::cuda {

class LtTrainGemm {
 public:
  // `workspace` (device memory owned by the caller) is handed to every matmul; `tune_scratch`
  // (also the caller's) receives the outputs of trial runs when algorithms are timed for an
  // accumulating GEMM (backward_weight always, backward_input with accumulate), whose real output
  // is also an input. An accumulating output larger than tune_scratch_bytes is not timed: its
  // plan takes the cached or the heuristic's first candidate. `cache` (the caller's, may be null:
  // then nothing is read or recorded) is the persistent tuning cache.
  LtTrainGemm(void* workspace, size_t workspace_bytes, void* tune_scratch,
              size_t tune_scratch_bytes, GemmTuningCache* cache = nullptr);
  ~LtTrainGemm();
  LtTrainGemm(const LtTrainGemm&) = delete;
  LtTrainGemm& operator=(const LtTrainGemm&) = delete;

  // How plans built from now on choose their algorithm (default cached; only tune ever times and
  // synchronises). Existing plans are kept, so that eager calls and captured graphs keep running
  // the same algorithms.
  void set_tuning(GemmTuning mode) { tuning_ = mode; }
  GemmTuning tuning() const { return tuning_; }

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
  GemmPlanCounts plan_counts() const;

 private:
  enum Op : int { kForwardF32 = 0, kBackwardInput = 1, kBackwardWeight = 2 };
  // Fields: op, m, n, k (the row-major sizes of the call), f32 output, accumulate, alignments in
  // bytes of cuBLASLt's A, B and D (pointer and leading dimension together).
  using Key = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int, int, int>;
  enum class Source { heuristic, cache, timed };
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    Source source = Source::heuristic;
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
  static std::string cache_key(const Key& key);
  // The candidate to keep among `count`, timed on the real operands: its index and its best time
  // per call in microseconds. Not timed when no candidate would run (index 0 then).
  struct Pick {
    bool timed = false;
    int index = 0;
    double us = 0;
  };
  Pick fastest(const Plan& p, const cublasLtMatmulHeuristicResult_t* results, int count, void* d,
               const void* a, const void* b, bool accumulate, cudaStream_t stream);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_;
  size_t workspace_bytes_;
  void* tune_scratch_;
  size_t tune_scratch_bytes_;
  GemmTuningCache* cache_;
  GemmTuning tuning_ = GemmTuning::cached;
  int64_t rejected_ = 0;  // cached entries that failed the checks (over the object's life)
  // Timing events: tune mode times the candidates between them.
  Event start_{cudaEventDefault}, stop_{cudaEventDefault};
  std::map<Key, Plan> plans_;
};

}  // namespace iris::cuda
