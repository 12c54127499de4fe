#include "core/cuda/gemm.h"

#include <cmath>
#include <limits>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/cuda/gemm_tuning.h"

namespace iris::cuda {
namespace {

int alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 2 && (v % a) != 0) a /= 2;
  return a;
}

// Candidates asked of the heuristic. Its first choice is often not the fastest for skinny or
// mid-sized shapes (a few hundred rows), where one bad tile shape leaves most SMs idle.
constexpr int kCandidates = 8;
constexpr int kTimedReps = 5;
constexpr int kTimedRounds = 3;

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
  if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p = Plan{};
}

LtGemm::~LtGemm() {
  for (auto& [key, p] : plans_) destroy(p);
  if (handle_) cublasLtDestroy(handle_);
}

LtGemm::Key LtGemm::key_of(const uint16_t* y, const uint16_t* x, const uint16_t* w,
                           const uint16_t* bias, int64_t m, int64_t n, int64_t k, bool accumulate,
                           bool gelu) {
  return Key{m,
             n,
             k,
             bias != nullptr,
             gelu,
             accumulate,
             alignment_of(x),
             alignment_of(w),
             alignment_of(y)};
}

std::string LtGemm::cache_key(const Key& key) {
  const auto [m, n, k, has_bias, gelu, accumulate, align_x, align_w, align_y] = key;
  GemmTuningKey t;
  t.op = "linear";
  t.m = m, t.n = n, t.k = k;
  t.epilogue = gelu ? (has_bias ? "gelu_bias" : "gelu") : has_bias ? "bias" : "none";
  t.accumulate = accumulate;
  // cuBLASLt's A is w, B is x, D is y (see plan()).
  t.align_a = align_w, t.align_b = align_x, t.align_d = align_y;
  return t.text();
}

std::optional<LtGemm::PlanInfo> LtGemm::plan_info(const uint16_t* y, const uint16_t* x,
                                                  const uint16_t* w, const uint16_t* bias,
                                                  int64_t m, int64_t n, int64_t k, bool accumulate,
                                                  bool gelu) const {
  const auto it = plans_.find(key_of(y, x, w, bias, m, n, k, accumulate, gelu));
  if (it == plans_.end() || it->second.op == nullptr) return std::nullopt;
  return PlanInfo{it->second.algo, it->second.source};
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

LtGemm::Pick LtGemm::fastest(Plan& p, const cublasLtMatmulHeuristicResult_t* results, int count,
                             uint16_t* y, const uint16_t* x, const uint16_t* w,
                             const uint16_t* bias, bool accumulate, cudaStream_t stream) {
  // Trial outputs: an accumulating GEMM reads y, so its trials write the scratch buffer (whose
  // contents do not matter); otherwise y itself, which the real call overwrites afterwards.
  uint16_t* out = accumulate ? static_cast<uint16_t*>(tune_scratch_) : y;
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  if (bias != nullptr)
    IRIS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof(bias)));
  auto launch = [&](int i) {
    return cublasLtMatmul(handle_, p.op, &alpha, w, p.a, x, p.b, &beta, out, p.c, out, p.c,
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
  std::vector<float> best_ms(count, 0.f);
  for (int round = 0; round < kTimedRounds; ++round)
    for (int i : usable) {
      IRIS_CUDA_CHECK(cudaEventRecord(start_.get(), stream));
      bool ok = true;
      for (int r = 0; r < kTimedReps && ok; ++r) ok = launch(i) == CUBLAS_STATUS_SUCCESS;
      IRIS_CUDA_CHECK(cudaEventRecord(stop_.get(), stream));
      IRIS_CUDA_CHECK(cudaEventSynchronize(stop_.get()));
      float ms = 0.f;
      IRIS_CUDA_CHECK(cudaEventElapsedTime(&ms, start_.get(), stop_.get()));
      if (!ok) ms = std::numeric_limits<float>::infinity();
      if (round == 0 || ms < best_ms[i]) best_ms[i] = ms;
    }
  int best = usable[0];
  for (int i : usable)
    if (best_ms[i] < best_ms[best]) best = i;
  // Every candidate failed while timed: nothing was learnt, and the first choice stays.
  if (!std::isfinite(best_ms[best])) return {};
  return {true, best, 1000.0 * best_ms[best] / kTimedReps};
}

const LtGemm::Plan& LtGemm::plan(const Key& key, uint16_t* y, const uint16_t* x, const uint16_t* w,
                                 const uint16_t* bias, cudaStream_t stream) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  const auto [m, n, k, has_bias, gelu, accumulate, align_x, align_w, align_y] = key;
  Plan p;
  // Row-major y[M,N] = x[M,K] w[N,K]^T is column-major y^T[N,M] = w^T x^T: cuBLASLt's A is w
  // (stored K x N column-major, transposed), B is x (K x M), C/D are y^T (N x M, ld N).
  IRIS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  IRIS_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  IRIS_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  if (has_bias || gelu) {
    // cuBLASLt's GELU is the tanh approximation (HF's gelu_pytorch_tanh).
    const cublasLtEpilogue_t epi =
        gelu ? (has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU)
             : CUBLASLT_EPILOGUE_BIAS;
    IRIS_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  }
  if (has_bias) {
    const cudaDataType_t bias_type = CUDA_R_16BF;
    IRIS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                     &bias_type, sizeof(bias_type)));
  }
  IRIS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, k));
  IRIS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
  IRIS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_16BF, n, m, n));

  cublasLtMatmulPreference_t pref = nullptr;
  IRIS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint32_t ax = align_x, aw = align_w, ay = align_y;
  const size_t ws = workspace_bytes_;
  cublasLtMatmulHeuristicResult_t results[kCandidates] = {};
  int found = 0;
  const cublasStatus_t st = [&] {
    cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                               &aw, sizeof(aw));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                               &ax, sizeof(ax));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                               &ay, sizeof(ay));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                               &ay, sizeof(ay));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, kCandidates,
                                         results, &found);
    return s;
  }();
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
    // A GELU epilogue without an algorithm is remembered as such; the caller falls back.
    if (gelu && (st == CUBLAS_STATUS_SUCCESS || st == CUBLAS_STATUS_NOT_SUPPORTED))
      return plans_.emplace(key, Plan{}).first->second;
    IRIS_CUBLAS_CHECK(st);
    IRIS_FAIL("cuBLASLt has no bf16 algorithm for linear M=", m, " N=", n, " K=", k,
              " (alignments x ", align_x, ", w ", align_w, ", y ", align_y, ")");
  }
  // The heuristic's first choice, unless the cache has a pick (checked before it is trusted) or
  // tuning times the candidates: once per shape and process, on the real operands, outside graph
  // capture only (a capture cannot wait for events). Whatever is chosen is kept for the life of
  // this object, so that a graph and the eager path always run the same algorithm and agree bit
  // for bit.
  try {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    IRIS_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const bool fits_scratch = !accumulate || m * n * static_cast<int64_t>(sizeof(uint16_t)) <=
                                                 static_cast<int64_t>(tune_scratch_bytes_);
    const bool can_time = tuning_ == GemmTuning::tune && found > 1 &&
                          capture == cudaStreamCaptureStatusNone && fits_scratch;
    const std::string ckey = cache_ != nullptr ? cache_key(key) : std::string();
    p.algo = results[0].algo;
    p.source = Source::heuristic;
    // Tuning retimes what an earlier process recorded, not what this one did (the side stream's
    // planner then takes the main one's pick).
    if (cache_ != nullptr && tuning_ != GemmTuning::heuristic &&
        !(can_time && !cache_->recorded(ckey))) {
      if (const auto entry = cache_->find(ckey)) {
        const cublasLtMatmulAlgo_t algo = algo_of(*entry);
        if (algo_fits(handle_, p.op, p.a, p.b, p.c, p.c, algo, workspace_bytes_)) {
          p.algo = algo;
          p.source = Source::cache;
        } else {
          cache_->drop(ckey);
          ++rejected_;
        }
      }
    }
    if (p.source == Source::heuristic && can_time) {
      const Pick pick = fastest(p, results, found, y, x, w, bias, accumulate, stream);
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

bool LtGemm::run(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
                 int64_t n, int64_t k, bool accumulate, bool gelu, cudaStream_t stream) {
  const Plan& p = plan(key_of(y, x, w, bias, m, n, k, accumulate, gelu), y, x, w, bias, stream);
  if (p.op == nullptr) return false;
  if (bias != nullptr)
    IRIS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof(bias)));
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  IRIS_CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c,
                                   &p.algo, workspace_, workspace_bytes_, stream));
  return true;
}

}  // namespace iris::cuda
