// bf16 GEMMs through cuBLASLt: y[M,N] = x[M,K] w[N,K]^T (+ bias[N]) (+ y), fp32 compute, with an
// optional tanh-GELU epilogue.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <tuple>

#include "core/cuda/cuda_handles.h"
#include "core/tuning_cache.h"

namespace iris::cuda {

// cuBLASLt loads its heuristics data on the process's first algorithm query, whichever handle
// asks: about 100 ms on an H200, which otherwise lands in the first GEMM of a command (the first
// vision encode of `iris generate`). This asks once, on its own thread and handle, so that the
// cost is paid beside what the caller does next (reading the weights). The destructor waits.
class HeuristicsWarmup {
 public:
  explicit HeuristicsWarmup(int device);
  ~HeuristicsWarmup();
  HeuristicsWarmup(const HeuristicsWarmup&) = delete;
  HeuristicsWarmup& operator=(const HeuristicsWarmup&) = delete;

 private:
  std::thread thread_;
};

class LtGemm {
 public:
  // `workspace` (device memory owned by the caller) is handed to every matmul; `tune_scratch`
  // (also the caller's) receives the outputs of trial runs when algorithms are timed for an
  // accumulating GEMM, whose real output is also an input. `cache` (the caller's, may be null:
  // then nothing is read or recorded) is the persistent tuning cache.
  LtGemm(void* workspace, size_t workspace_bytes, void* tune_scratch, size_t tune_scratch_bytes,
         GemmTuningCache* cache = nullptr);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // gelu: y = gelu_tanh(x w^T + bias), applied in f32 before the single rounding to bf16
  // (accumulate must be false then). Returns false, having done nothing, when cuBLASLt has no
  // algorithm for that GELU epilogue (the caller runs the unfused ops); any other failure throws.
  bool run(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
           int64_t n, int64_t k, bool accumulate, bool gelu, cudaStream_t stream);
  // How plans made from now on choose their algorithm (GemmTuning in core/tuning_cache.h; the
  // default is cached). Existing plans are kept, so that eager calls and captured graphs keep
  // running the same algorithms. Candidates are timed only outside stream capture: timing waits
  // on events.
  void set_tuning(GemmTuning mode) { tuning_ = mode; }
  GemmTuning tuning() const { return tuning_; }

  // Where a plan's algorithm came from.
  enum class Source { heuristic, cache, timed };
  struct PlanInfo {
    cublasLtMatmulAlgo_t algo;
    Source source;
  };
  // The plan that run() with these arguments would use, if it has been made (nullopt also for a
  // GELU epilogue that has no algorithm).
  std::optional<PlanInfo> plan_info(const uint16_t* y, const uint16_t* x, const uint16_t* w,
                                    const uint16_t* bias, int64_t m, int64_t n, int64_t k,
                                    bool accumulate, bool gelu) const;
  GemmPlanCounts plan_counts() const;

 private:
  // The algorithm depends on the shape, the epilogue and the operands' alignment (a pointer
  // into the middle of a tensor may be less aligned than the heuristic's default of 256).
  // Fields: m, n, k, has_bias, gelu, accumulate, alignment of x, w, y.
  using Key = std::tuple<int64_t, int64_t, int64_t, bool, bool, bool, int, int, int>;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;  // null: no algorithm for this GELU epilogue
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    Source source = Source::heuristic;
  };
  static Key key_of(const uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                    int64_t m, int64_t n, int64_t k, bool accumulate, bool gelu);
  static std::string cache_key(const Key& key);
  const Plan& plan(const Key& key, uint16_t* y, const uint16_t* x, const uint16_t* w,
                   const uint16_t* bias, cudaStream_t stream);
  // The fastest of `count` candidate algorithms, timed on the real operands: its index and its
  // best time per call in microseconds. Not timed when no candidate would run (index 0 then).
  struct Pick {
    bool timed = false;
    int index = 0;
    double us = 0;
  };
  Pick fastest(Plan& p, const cublasLtMatmulHeuristicResult_t* results, int count, uint16_t* y,
               const uint16_t* x, const uint16_t* w, const uint16_t* bias, bool accumulate,
               cudaStream_t stream);
  static void destroy(Plan& p);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_;
  size_t workspace_bytes_;
  void* tune_scratch_;
  size_t tune_scratch_bytes_;
  // Timing events: tune mode times the candidates between them.
  Event start_{cudaEventDefault}, stop_{cudaEventDefault};
  std::map<Key, Plan> plans_;
  GemmTuningCache* cache_;
  GemmTuning tuning_ = GemmTuning::cached;
  int64_t rejected_ = 0;  // cached entries that failed the check (over the object's life)
};

}  // namespace iris::cuda
