#include "core/cuda/gemm/gemm.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/gemm/gemm_tuning.h"

namespace iris::cuda {
namespace {

// The alignment in bytes (256 at most) that both the pointer and the leading dimension of an
// operand keep: the heuristic only offers algorithms whose loads that alignment allows. run()
// keys by the pointers alone (ld_bytes 0): its keys, and with them its algorithms and the tuning
// cache's "linear" entries, stay the ones it has always had.
int alignment_of(const void* p, int64_t ld_bytes) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && ((v % a) != 0 || (ld_bytes % a) != 0)) a /= 2;
  return a;
}

// Candidates asked of the heuristic. Its first choice is often not the fastest for skinny or
// mid-sized shapes (a few hundred rows), where one bad tile shape leaves most SMs idle. Each
// candidate is timed as its best of kTimedRounds rounds of kTimedReps calls.
constexpr int kCandidates = 8;
constexpr int kTimedReps = 5;
constexpr int kTimedRounds = 3;
// The training calls keep the first candidate in the heuristic's order whose time is within this
// fraction of the fastest: near ties then resolve the same way in every process instead of by
// timing noise (the algorithm decides the rounding, so a stable pick keeps runs comparable bit for
// bit). run() keeps the fastest (a margin of 0).
constexpr float kTrainTieMargin = 0.02f;

// By the Op and Epilogue values of LtGemm's keys, in errors and in tuning cache keys.
constexpr const char* kOpNames[] = {"linear", "forward_f32", "backward_input", "backward_weight"};
constexpr const char* kEpilogueNames[] = {"none", "bias", "gelu", "gelu_bias"};

// Reduction schemes that the heuristic may offer the training calls. Split-K with a separate
// reduction step in fp32 (COMPUTE_TYPE), or in the output type when that is f32, sums the slices
// in a fixed order. INPLACE (slices summed into the output through counters) is left out, and so
// is reducing in bf16, which would round partial sums of a bf16 dx.
uint32_t reduction_mask(bool d_f32) {
  uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  if (d_f32) mask |= CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
  return mask;
}

// ---- db[N] += column sums of dy[M,N] (bf16), deterministic ----
// A block owns kColsumCols columns; its threads split the rows into kColsumThreads / (threads per
// column group) lanes, lane l summing rows l, l + lanes, ... in order; the lanes' sums are then
// added in a fixed tree. The order depends on M and N only, so the bits do too.
constexpr int kColsumCols = 16;  // 32 bytes of a bf16 row: one memory sector
constexpr int kColsumThreads = 512;

template <int VEC>
__global__ void __launch_bounds__(kColsumThreads)
    column_sum_kernel(float* __restrict__ db, const uint16_t* __restrict__ dy, int64_t m,
                      int64_t n) {
  constexpr int kColThreads = kColsumCols / VEC;
  constexpr int kLanes = kColsumThreads / kColThreads;
  static_assert((kLanes & (kLanes - 1)) == 0, "the lane tree needs a power of two");
  __shared__ float part[kLanes][kColsumCols];
  const int tc = threadIdx.x % kColThreads;
  const int lane = threadIdx.x / kColThreads;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColsumCols + tc * VEC;
  float acc[VEC];
#pragma unroll
  for (int v = 0; v < VEC; ++v) acc[v] = 0.f;
  if (c < n) {
    const uint16_t* p = dy + c;
#pragma unroll 4
    for (int64_t r = lane; r < m; r += kLanes) {
      if constexpr (VEC == 2) {
        // N even and dy 4-byte aligned: columns c, c + 1 as one 32-bit load (low half first).
        const uint32_t pair = __ldg(reinterpret_cast<const unsigned int*>(p + r * n));
        acc[0] += __uint_as_float(pair << 16);
        acc[1] += __uint_as_float(pair & 0xffff0000u);
      } else {
        acc[0] += bf16_to_float(__ldg(reinterpret_cast<const unsigned short*>(p + r * n)));
      }
    }
  }
#pragma unroll
  for (int v = 0; v < VEC; ++v) part[lane][tc * VEC + v] = acc[v];
  __syncthreads();
  for (int s = kLanes / 2; s > 0; s >>= 1) {
    if (lane < s) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) part[lane][tc * VEC + v] += part[lane + s][tc * VEC + v];
    }
    __syncthreads();
  }
  if (lane == 0) {
#pragma unroll
    for (int v = 0; v < VEC; ++v)
      if (c + v < n) db[c + v] += part[0][tc * VEC + v];
  }
}

void launch_column_sum(float* db, const uint16_t* dy, int64_t m, int64_t n, cudaStream_t stream) {
  const int64_t blocks = (n + kColsumCols - 1) / kColsumCols;
  IRIS_CHECK(blocks <= std::numeric_limits<int>::max(), "column sum over too many columns: ", n);
  const bool pairs = n % 2 == 0 && reinterpret_cast<uintptr_t>(dy) % 4 == 0;
  if (pairs)
    column_sum_kernel<2>
        <<<static_cast<unsigned>(blocks), kColsumThreads, 0, stream>>>(db, dy, m, n);
  else
    column_sum_kernel<1>
        <<<static_cast<unsigned>(blocks), kColsumThreads, 0, stream>>>(db, dy, m, n);
  IRIS_CUDA_LAUNCH_CHECK();
}

}  // namespace

HeuristicsWarmup::HeuristicsWarmup(int device) {
  thread_ = std::thread([device] {
    // Every status is checked, but a failure only ends the warm-up: the first real GEMM makes
    // the same calls through IRIS_CUBLAS_CHECK and reports the error there, on the caller's
    // thread, in the caller's terms.
    if (cudaSetDevice(device) != cudaSuccess) return;
    cublasLtHandle_t handle = nullptr;
    if (cublasLtCreate(&handle) != CUBLAS_STATUS_SUCCESS) return;
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t layout = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    constexpr int kSide = 64;
    if (cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, kSide, kSide, kSide) ==
            CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS) {
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      // Its answer is not used: the query is made for the loading it triggers.
      (void)cublasLtMatmulAlgoGetHeuristic(handle, op, layout, layout, layout, layout, pref, 1,
                                           &result, &found);
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (layout) cublasLtMatrixLayoutDestroy(layout);
    if (op) cublasLtMatmulDescDestroy(op);
    cublasLtDestroy(handle);
  });
}

HeuristicsWarmup::~HeuristicsWarmup() {
  if (thread_.joinable()) thread_.join();
}

// One cuBLASLt problem, column-major: D[d_rows, d_cols] = op(A) op(B), A and B stored as
// [rows, cols] with leading dimension ld (before op is applied).
struct LtGemm::Problem {
  cublasOperation_t trans_a, trans_b;
  uint64_t a_rows, a_cols;
  uint64_t b_rows, b_cols;
  uint64_t d_rows, d_cols;
  cudaDataType_t d_type;
};

LtGemm::Problem LtGemm::problem_of(const Key& key) {
  const auto [op, m, n, k, d_f32, epilogue, accumulate, align_a, align_b, align_d] = key;
  const cudaDataType_t d_type = d_f32 ? CUDA_R_32F : CUDA_R_16BF;
  const auto M = static_cast<uint64_t>(m), N = static_cast<uint64_t>(n),
             K = static_cast<uint64_t>(k);
  switch (op) {
    case kLinear:
    case kForwardF32:
      // Row-major y[M,N] is column-major y^T[N,M] (ld N), and y^T = w x^T: A is w (row-major
      // [N,K] = column-major [K,N], ld K) transposed to [N,K]; B is x (row-major [M,K] =
      // column-major [K,M], ld K) as is. GEMM m=N, n=M, k=K.
      return {CUBLAS_OP_T, CUBLAS_OP_N, K, N, K, M, N, M, d_type};
    case kBackwardInput:
      // Row-major dx[M,K] is column-major dx^T[K,M] (ld K), and dx^T = w^T dy^T: A is w
      // (column-major [K,N], ld K) as is; B is dy (row-major [M,N] = column-major [N,M], ld N) as
      // is. GEMM m=K, n=M, k=N.
      return {CUBLAS_OP_N, CUBLAS_OP_N, K, N, N, M, K, M, d_type};
    default:
      // backward_weight. Row-major dw[N,K] is column-major dw^T[K,N] (ld K), and dw^T = x^T dy:
      // A is x (column-major [K,M], ld K) as is; B is dy (column-major [N,M], ld N) transposed
      // to [M,N]. GEMM m=K, n=N, k=M.
      return {CUBLAS_OP_N, CUBLAS_OP_T, K, M, N, M, K, N, d_type};
  }
}

LtGemm::LtGemm(void* workspace, size_t workspace_bytes, void* tune_scratch,
               size_t tune_scratch_bytes, GemmTuningCache* cache)
    : workspace_(workspace),
      workspace_bytes_(workspace_bytes),
      tune_scratch_(tune_scratch),
      tune_scratch_bytes_(tune_scratch_bytes),
      cache_(cache) {
  IRIS_CUBLAS_CHECK(cublasLtCreate(&handle_));
}

void LtGemm::destroy(Plan& p) {
  // Called from the destructor too: failures while tearing down are ignored.
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.d) cublasLtMatrixLayoutDestroy(p.d);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p = Plan{};
}

LtGemm::~LtGemm() {
  for (auto& [key, p] : plans_) destroy(p);
  if (handle_) cublasLtDestroy(handle_);
}

// ---- keys: the alignments are those of cuBLASLt's operands in problem_of's order ----

std::string LtGemm::cache_key(const Key& key) {
  const auto [op, m, n, k, d_f32, epilogue, accumulate, align_a, align_b, align_d] = key;
  GemmTuningKey t;
  t.op = kOpNames[op];
  t.m = m, t.n = n, t.k = k;
  t.out_f32 = d_f32;
  t.epilogue = kEpilogueNames[epilogue];
  t.accumulate = accumulate;
  t.align_a = align_a, t.align_b = align_b, t.align_d = align_d;
  return t.text();
}

LtGemm::Key LtGemm::linear_key(const uint16_t* y, const uint16_t* x, const uint16_t* w,
                               const uint16_t* bias, int64_t m, int64_t n, int64_t k,
                               bool accumulate, bool gelu) {
  const int epilogue = gelu              ? (bias != nullptr ? kGeluBias : kGelu)
                       : bias != nullptr ? kBias
                                         : kNone;
  return Key{kLinear,
             m,
             n,
             k,
             false,
             epilogue,
             accumulate,
             alignment_of(w, 0),
             alignment_of(x, 0),
             alignment_of(y, 0)};
}

LtGemm::Key LtGemm::forward_f32_key(const float* y, const uint16_t* x, const uint16_t* w, int64_t m,
                                    int64_t n, int64_t k) {
  const int aw = alignment_of(w, 2 * k), ax = alignment_of(x, 2 * k), ay = alignment_of(y, 4 * n);
  return Key{kForwardF32, m, n, k, true, kNone, false, aw, ax, ay};
}

LtGemm::Key LtGemm::backward_input_key(const void* dx, bool dx_f32, const uint16_t* dy,
                                       const uint16_t* w, int64_t m, int64_t n, int64_t k,
                                       bool accumulate) {
  const int aw = alignment_of(w, 2 * k), ady = alignment_of(dy, 2 * n),
            adx = alignment_of(dx, (dx_f32 ? 4 : 2) * k);
  return Key{kBackwardInput, m, n, k, dx_f32, kNone, accumulate, aw, ady, adx};
}

LtGemm::Key LtGemm::backward_weight_key(const float* dw, const uint16_t* dy, const uint16_t* x,
                                        int64_t m, int64_t n, int64_t k) {
  const int ax = alignment_of(x, 2 * k), ady = alignment_of(dy, 2 * n),
            adw = alignment_of(dw, 4 * k);
  return Key{kBackwardWeight, m, n, k, true, kNone, true, ax, ady, adw};
}

std::optional<LtGemm::PlanInfo> LtGemm::plan_info(const uint16_t* y, const uint16_t* x,
                                                  const uint16_t* w, const uint16_t* bias,
                                                  int64_t m, int64_t n, int64_t k, bool accumulate,
                                                  bool gelu) const {
  const auto it = plans_.find(linear_key(y, x, w, bias, m, n, k, accumulate, gelu));
  if (it == plans_.end() || it->second.op == nullptr) return std::nullopt;
  return PlanInfo{it->second.algo, it->second.source};
}

bool LtGemm::has_forward_f32_plan(const float* y, const uint16_t* x, const uint16_t* w, int64_t m,
                                  int64_t n, int64_t k) const {
  if (m == 0 || n == 0 || k == 0) return true;
  return plans_.count(forward_f32_key(y, x, w, m, n, k)) != 0;
}

bool LtGemm::has_backward_input_plan(const void* dx, bool dx_f32, const uint16_t* dy,
                                     const uint16_t* w, int64_t m, int64_t n, int64_t k,
                                     bool accumulate) const {
  if (m == 0 || n == 0 || k == 0) return true;
  return plans_.count(backward_input_key(dx, dx_f32, dy, w, m, n, k, accumulate)) != 0;
}

bool LtGemm::has_backward_weight_plan(const float* dw, const uint16_t* dy, const uint16_t* x,
                                      int64_t m, int64_t n, int64_t k) const {
  if (dw == nullptr || m == 0 || n == 0 || k == 0) return true;
  return plans_.count(backward_weight_key(dw, dy, x, m, n, k)) != 0;
}

GemmPlanCounts LtGemm::plan_counts() const {
  GemmPlanCounts c;
  for (const auto& [key, p] : plans_) {
    if (p.op == nullptr) continue;
    if (p.source == Source::heuristic) ++c.heuristic;
    if (p.source == Source::cache) ++c.cached;
    if (p.source == Source::timed) ++c.timed;
  }
  c.rejected = rejected_;
  return c;
}

// ---- plans ----

LtGemm::Pick LtGemm::fastest(const Plan& p, const cublasLtMatmulHeuristicResult_t* results,
                             int count, void* d, const void* a, const void* b, const void* bias,
                             bool accumulate, float tie_margin, cudaStream_t stream) {
  // Trial outputs: an accumulating GEMM reads D, so its trials write the scratch buffer (whose
  // contents do not matter); otherwise D itself, which the real call overwrites afterwards.
  void* out = accumulate ? tune_scratch_ : d;
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  if (bias != nullptr)
    IRIS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof(bias)));
  auto launch = [&](int i) {
    return cublasLtMatmul(handle_, p.op, &alpha, a, p.a, b, p.b, &beta, out, p.d, out, p.d,
                          &results[i].algo, workspace_, workspace_bytes_, stream);
  };
  // A candidate that refuses to run is skipped; the heuristic's first choice is the fallback.
  std::vector<int> usable;
  for (int i = 0; i < count; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace_bytes_ &&
        launch(i) == CUBLAS_STATUS_SUCCESS)
      usable.push_back(i);
  if (usable.empty()) return {};
  // Each candidate's best of several rounds, the rounds interleaved over the candidates: clock
  // ramps and other work on the GPU then weigh on all of them alike instead of on whichever
  // happened to be timed at that moment. Timed once each, fc2 of eight 448x448 images (6272 x
  // 1024 x 4096, accumulating) got a pick that ran 81-93 us per call in three H100 runs (ncu),
  // where the best candidate times 73-83 us.
  std::vector<float> best_ms(count, std::numeric_limits<float>::infinity());
  for (int round = 0; round < kTimedRounds; ++round)
    for (int i : usable) {
      IRIS_CUDA_CHECK(cudaEventRecord(start_.get(), stream));
      bool ok = true;
      for (int r = 0; r < kTimedReps && ok; ++r) ok = launch(i) == CUBLAS_STATUS_SUCCESS;
      IRIS_CUDA_CHECK(cudaEventRecord(stop_.get(), stream));
      IRIS_CUDA_CHECK(cudaEventSynchronize(stop_.get()));
      float ms = 0.f;
      IRIS_CUDA_CHECK(cudaEventElapsedTime(&ms, start_.get(), stop_.get()));
      if (ok && ms < best_ms[i]) best_ms[i] = ms;
    }
  float fastest_ms = std::numeric_limits<float>::infinity();
  for (int i : usable) fastest_ms = std::min(fastest_ms, best_ms[i]);
  // Every candidate failed while timed: nothing was learnt, and the first choice stays.
  if (!std::isfinite(fastest_ms)) return {};
  for (int i : usable)
    if (best_ms[i] <= fastest_ms * (1.f + tie_margin))
      return {true, i, 1000.0 * best_ms[i] / kTimedReps};
  return {};
}

const LtGemm::Plan& LtGemm::plan(const Key& key, void* d, const void* a, const void* b,
                                 const void* bias, cudaStream_t stream) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  const auto [op, m, n, k, d_f32, epilogue, accumulate, align_a, align_b, align_d] = key;
  const Problem pr = problem_of(key);
  const bool has_bias = epilogue == kBias || epilogue == kGeluBias;
  const bool gelu = epilogue == kGelu || epilogue == kGeluBias;

  Plan p;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  uint32_t found_mask = 0;  // the reduction schemes the training candidates were asked with
  bool asked = false;       // whether the failure, if any, is the heuristic's answer
  const cublasStatus_t st = [&] {
    cublasStatus_t s = cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &pr.trans_a,
                                         sizeof(pr.trans_a));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &pr.trans_b,
                                         sizeof(pr.trans_b));
    if (s == CUBLAS_STATUS_SUCCESS && epilogue != kNone) {
      // cuBLASLt's GELU is the tanh approximation (HF's gelu_pytorch_tanh).
      const cublasLtEpilogue_t epi =
          gelu ? (has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU)
               : CUBLASLT_EPILOGUE_BIAS;
      s = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    }
    if (s == CUBLAS_STATUS_SUCCESS && has_bias) {
      const cudaDataType_t bias_type = CUDA_R_16BF;
      s = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                         sizeof(bias_type));
    }
    // Leading dimensions: operands are dense, so ld is the stored row count.
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, pr.a_rows, pr.a_cols,
                                     static_cast<int64_t>(pr.a_rows));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, pr.b_rows, pr.b_cols,
                                     static_cast<int64_t>(pr.b_rows));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatrixLayoutCreate(&p.d, pr.d_type, pr.d_rows, pr.d_cols,
                                     static_cast<int64_t>(pr.d_rows));
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceCreate(&pref);
    const uint32_t aa = align_a, ab = align_b, ad = align_d;
    const uint64_t ws = workspace_bytes_;
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                               sizeof(ws));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                               &aa, sizeof(aa));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                               &ab, sizeof(ab));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                               &ad, sizeof(ad));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                               &ad, sizeof(ad));
    // run() asks once, leaving the reduction schemes at cuBLASLt's default, so that its plans
    // keep the algorithms they have always had (and the cache entries recorded for them).
    if (op == kLinear) {
      if (s != CUBLAS_STATUS_SUCCESS) return s;
      asked = true;
      return cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.d, p.d, pref, kCandidates,
                                            results, &found);
    }
    // The training calls ask with the deterministic reduction schemes first; should none of
    // those fit (not seen so far), with any scheme: cuBLASLt's own schemes still reduce in a
    // fixed order for a fixed algorithm.
    for (const uint32_t mask : {reduction_mask(d_f32), uint32_t{CUBLASLT_REDUCTION_SCHEME_MASK}}) {
      if (s != CUBLAS_STATUS_SUCCESS || found > 0) break;
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                               &mask, sizeof(mask));
      if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.d, p.d, pref, kCandidates,
                                           results, &found);
      found_mask = mask;
      // "No algorithm" may come back as NOT_SUPPORTED; the wider mask is tried next.
      if (s == CUBLAS_STATUS_NOT_SUPPORTED) {
        s = CUBLAS_STATUS_SUCCESS;
        found = 0;
      }
    }
    return s;
  }();
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    destroy(p);
    // A GELU epilogue without an algorithm is remembered as such; the caller falls back.
    if (gelu && asked && (st == CUBLAS_STATUS_SUCCESS || st == CUBLAS_STATUS_NOT_SUPPORTED))
      return plans_.emplace(key, Plan{}).first->second;
    IRIS_CUBLAS_CHECK(st);
    IRIS_FAIL("cuBLASLt has no bf16 algorithm for ", kOpNames[op], " M=", m, " N=", n, " K=", k,
              " (", d_f32 ? "f32" : "bf16", " output, epilogue ", kEpilogueNames[epilogue],
              "; alignments A ", align_a, ", B ", align_b, ", D ", align_d, ")");
  }
  // The heuristic's first choice, unless the cache has a pick (checked, the training calls'
  // reduction scheme included, before it is trusted) or tuning times the candidates: once per key
  // and process, on the real operands, outside graph capture only (a capture cannot wait for
  // events). Whatever is chosen is kept for the life of this object, so that a graph and the
  // eager path always run the same algorithm and agree bit for bit.
  try {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    IRIS_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const auto d_bytes = static_cast<int64_t>(pr.d_rows * pr.d_cols) * (d_f32 ? 4 : 2);
    const bool fits_scratch =
        !accumulate ||
        (tune_scratch_ != nullptr && d_bytes <= static_cast<int64_t>(tune_scratch_bytes_) &&
         alignment_of(tune_scratch_, 0) >= align_d);
    const bool can_time = tuning_ == GemmTuning::tune && found > 1 &&
                          capture == cudaStreamCaptureStatusNone && fits_scratch;
    const std::string ckey = cache_ != nullptr ? cache_key(key) : std::string();
    p.algo = results[0].algo;
    p.source = Source::heuristic;
    // Tuning retimes what an earlier process recorded, not what this one did (a second planner,
    // the side stream's, then takes the first one's pick).
    if (cache_ != nullptr && tuning_ != GemmTuning::heuristic &&
        !(can_time && !cache_->recorded(ckey))) {
      if (const auto entry = cache_->find(ckey)) {
        const cublasLtMatmulAlgo_t algo = algo_of(*entry);
        if ((op == kLinear || algo_reduction_in(algo, found_mask)) &&
            algo_fits(handle_, p.op, p.a, p.b, p.d, p.d, algo, workspace_bytes_)) {
          p.algo = algo;
          p.source = Source::cache;
        } else {
          cache_->drop(ckey);
          ++rejected_;
        }
      }
    }
    if (p.source == Source::heuristic && can_time) {
      const float tie_margin = op == kLinear ? 0.f : kTrainTieMargin;
      const Pick pick = fastest(p, results, found, d, a, b, bias, accumulate, tie_margin, stream);
      if (pick.timed) {
        p.algo = results[pick.index].algo;
        p.source = Source::timed;
        if (cache_ != nullptr) cache_->record(ckey, tuning_entry_of(p.algo, pick.us));
      }
    }
  } catch (...) {
    destroy(p);
    throw;
  }
  return plans_.emplace(key, p).first->second;
}

bool LtGemm::matmul(const Key& key, void* d, const void* a, const void* b, const void* bias,
                    cudaStream_t stream) {
  const Plan& p = plan(key, d, a, b, bias, stream);
  if (p.op == nullptr) return false;
  if (bias != nullptr)
    IRIS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof(bias)));
  const float alpha = 1.f, beta = std::get<6>(key) ? 1.f : 0.f;
  IRIS_CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, a, p.a, b, p.b, &beta, d, p.d, d, p.d,
                                   &p.algo, workspace_, workspace_bytes_, stream));
  return true;
}

// ---- the calls ----

bool LtGemm::run(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
                 int64_t n, int64_t k, bool accumulate, bool gelu, cudaStream_t stream) {
  // cuBLASLt A = w, B = x, D = y (see problem_of).
  return matmul(linear_key(y, x, w, bias, m, n, k, accumulate, gelu), y, w, x, bias, stream);
}

void LtGemm::forward_f32(float* y, const uint16_t* x, const uint16_t* w, int64_t m, int64_t n,
                         int64_t k, cudaStream_t stream) {
  IRIS_CHECK(m >= 0 && n >= 0 && k >= 0, "forward_f32: negative size M=", m, " N=", n, " K=", k);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    IRIS_CUDA_CHECK(cudaMemsetAsync(y, 0, static_cast<size_t>(m * n) * sizeof(float), stream));
    return;
  }
  // cuBLASLt A = w, B = x, D = y (see problem_of).
  matmul(forward_f32_key(y, x, w, m, n, k), y, w, x, nullptr, stream);
}

void LtGemm::backward_input(void* dx, bool dx_f32, const uint16_t* dy, const uint16_t* w, int64_t m,
                            int64_t n, int64_t k, bool accumulate, cudaStream_t stream) {
  IRIS_CHECK(m >= 0 && n >= 0 && k >= 0, "backward_input: negative size M=", m, " N=", n, " K=", k);
  if (m == 0 || k == 0) return;
  if (n == 0) {
    if (!accumulate)
      IRIS_CUDA_CHECK(
          cudaMemsetAsync(dx, 0, static_cast<size_t>(m * k) * (dx_f32 ? 4 : 2), stream));
    return;
  }
  // cuBLASLt A = w, B = dy, D = dx (see problem_of).
  matmul(backward_input_key(dx, dx_f32, dy, w, m, n, k, accumulate), dx, w, dy, nullptr, stream);
}

void LtGemm::backward_weight(float* dw, float* db, const uint16_t* dy, const uint16_t* x, int64_t m,
                             int64_t n, int64_t k, cudaStream_t stream) {
  IRIS_CHECK(m >= 0 && n >= 0 && k >= 0, "backward_weight: negative size M=", m, " N=", n,
             " K=", k);
  if (m == 0 || n == 0) return;  // nothing to add
  // cuBLASLt A = x, B = dy, D = C = dw with beta 1 (see problem_of).
  if (dw != nullptr && k > 0)
    matmul(backward_weight_key(dw, dy, x, m, n, k), dw, x, dy, nullptr, stream);
  if (db != nullptr) launch_column_sum(db, dy, m, n, stream);
}

}  // namespace iris::cuda
