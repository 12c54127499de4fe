// The CUDA backend's GEMMs: through cuBLASLt (gemm.cu), inference and training alike, and for the
// few rows of a decode step through the GEMV kernels (gemv.cu, at the end). bf16 operands travel
// as uint16_t bits, sums are fp32, everything is row-major:
//   run:             y[M,N] (bf16)         = x[M,K] . w[N,K]^T (+ bias[N]) (+ y), optionally
//                                            through the tanh-GELU epilogue     (linear)
//   forward_f32:     y[M,N] (f32)          = x[M,K] . w[N,K]^T           (lm_head logits)
//   backward_input:  dx[M,K] (bf16 or f32) = dy[M,N] . w[N,K] (+ dx)
//   backward_weight: dw[N,K] (f32)        += dy[M,N]^T . x[M,K],  db[N] (f32) += sum_m dy[m,:]
//
// Plans (descriptors and the chosen algorithm) are cached per call, shape, output dtype,
// epilogue, accumulation and operand alignment, and choose their algorithm as set_tuning says
// (GemmTuning in core/tuning_cache.h): the heuristic's first candidate, the persistent tuning
// cache's pick, or, in tune mode and outside stream capture, the fastest candidate timed on the
// real operands. A call that times synchronises the stream, so run one eager step before
// capturing a graph (plan_info and has_*_plan tell whether a call would still build a plan). Once
// a key's plan exists every call only enqueues work (capturable).
//
// Determinism of the training calls: a plan's algorithm is fixed for the life of the object,
// candidates (cached ones included) are limited to reduction schemes without split-K atomics, and
// db is a fixed-order column sum (no float atomics), so the same inputs give the same bits on
// every call. Across processes a timed or cached pick may differ (and with it the rounding);
// GemmTuning::heuristic makes the pick the heuristic's first candidate, which depends only on the
// GPU, the library version and the key: training runs that way, so that a resumed run continues
// bit for bit.
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
  // accumulating GEMM (run and backward_input with accumulate, backward_weight always), whose
  // real output is also an input. An accumulating output larger than tune_scratch_bytes is not
  // timed: its plan takes the cached or the heuristic's first candidate. `cache` (the caller's,
  // may be null: then nothing is read or recorded) is the persistent tuning cache.
  LtGemm(void* workspace, size_t workspace_bytes, void* tune_scratch, size_t tune_scratch_bytes,
         GemmTuningCache* cache = nullptr);
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // How plans made from now on choose their algorithm (the default is cached; only tune ever
  // times and synchronises). Existing plans are kept, so that eager calls and captured graphs
  // keep running the same algorithms.
  void set_tuning(GemmTuning mode) { tuning_ = mode; }
  GemmTuning tuning() const { return tuning_; }

  // gelu: y = gelu_tanh(x w^T + bias), applied in f32 before the single rounding to bf16
  // (accumulate must be false then). Returns false, having done nothing, when cuBLASLt has no
  // algorithm for that GELU epilogue (the caller runs the unfused ops); any other failure throws.
  bool run(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
           int64_t n, int64_t k, bool accumulate, bool gelu, cudaStream_t stream);
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
  // Whether the matching training call already has its plan (it then enqueues only, never
  // synchronises). Shapes that need no matmul (a zero dimension, backward_weight without dw)
  // count as planned.
  bool has_forward_f32_plan(const float* y, const uint16_t* x, const uint16_t* w, int64_t m,
                            int64_t n, int64_t k) const;
  bool has_backward_input_plan(const void* dx, bool dx_f32, const uint16_t* dy, const uint16_t* w,
                               int64_t m, int64_t n, int64_t k, bool accumulate) const;
  bool has_backward_weight_plan(const float* dw, const uint16_t* dy, const uint16_t* x, int64_t m,
                                int64_t n, int64_t k) const;
  size_t plan_count() const { return plans_.size(); }
  GemmPlanCounts plan_counts() const;

 private:
  // The calls, and the epilogues of run(), by their values in keys; named in kOpNames and
  // kEpilogueNames (gemm.cu) for errors and tuning cache keys.
  enum Op : int { kLinear = 0, kForwardF32 = 1, kBackwardInput = 2, kBackwardWeight = 3 };
  enum Epilogue : int { kNone = 0, kBias = 1, kGelu = 2, kGeluBias = 3 };
  // Fields: op, m, n, k (the row-major sizes of the call), f32 output, epilogue, accumulate,
  // alignments in bytes of cuBLASLt's A, B and D.
  using Key = std::tuple<int, int64_t, int64_t, int64_t, bool, int, bool, int, int, int>;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;  // null: no algorithm for this GELU epilogue
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    Source source = Source::heuristic;
  };
  // One call as a cuBLASLt problem (gemm.cu).
  struct Problem;

  static Key linear_key(const uint16_t* y, const uint16_t* x, const uint16_t* w,
                        const uint16_t* bias, int64_t m, int64_t n, int64_t k, bool accumulate,
                        bool gelu);
  static Key forward_f32_key(const float* y, const uint16_t* x, const uint16_t* w, int64_t m,
                             int64_t n, int64_t k);
  static Key backward_input_key(const void* dx, bool dx_f32, const uint16_t* dy, const uint16_t* w,
                                int64_t m, int64_t n, int64_t k, bool accumulate);
  static Key backward_weight_key(const float* dw, const uint16_t* dy, const uint16_t* x, int64_t m,
                                 int64_t n, int64_t k);
  static Problem problem_of(const Key& key);
  static std::string cache_key(const Key& key);

  // D = op(A) op(B) (+ bias) (+ D) with the key's plan; a and b are cuBLASLt's A and B. Returns
  // false, having done nothing, for a GELU epilogue that has no algorithm.
  bool matmul(const Key& key, void* d, const void* a, const void* b, const void* bias,
              cudaStream_t stream);
  const Plan& plan(const Key& key, void* d, const void* a, const void* b, const void* bias,
                   cudaStream_t stream);
  // The candidate to keep among `count`, timed on the real operands: its index and its best time
  // per call in microseconds. Not timed when no candidate would run (index 0 then).
  struct Pick {
    bool timed = false;
    int index = 0;
    double us = 0;
  };
  Pick fastest(const Plan& p, const cublasLtMatmulHeuristicResult_t* results, int count, void* d,
               const void* a, const void* b, const void* bias, bool accumulate, float tie_margin,
               cudaStream_t stream);
  static void destroy(Plan& p);

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

// ---- skinny GEMMs for a few rows (gemv.cu) ----
constexpr int64_t kGemvMaxM = 8;
// Raises the dynamic shared-memory limit of the GEMV kernels; called once per device.
void gemv_init();
// Whether the GEMV kernels take y[M,N] = x[M,K] w[N,K]^T: M <= kGemvMaxM, K a multiple of 8, the
// x rows small enough for shared memory, x and w 16-byte aligned.
bool gemv_supported(int64_t m, int64_t n, int64_t k, const void* x, const void* w);
// y = x w^T (+ bias) (+ y when accumulate), f32 sums rounded once. The GEMVs are launched as
// programmatic dependents (sm_90): they load their first weights before the previous kernel on
// the stream has finished, so w must not be the output of that kernel (weights are written by
// copies, never by the kernel right before a projection); x, y, bias and the norm weights are
// read only after it has completed.

void launch_gemv(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
                 int64_t n, int64_t k, bool accumulate, cudaStream_t s);
// xn = rms_norm(x, norm_w) (stored too, 16-byte aligned), y = xn w^T, and when act is not null
// (N even) act[M, N/2] = swiglu(y). xn must not alias x.
void launch_gemv_rms_norm(uint16_t* y, uint16_t* xn, uint16_t* act, const uint16_t* x,
                          const uint16_t* norm_w, float eps, const uint16_t* w, int64_t m,
                          int64_t n, int64_t k, cudaStream_t s);

}  // namespace iris::cuda
