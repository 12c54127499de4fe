#include "core/cuda/moe/moe_batched_gemm.h"

#include <algorithm>

#include "core/cuda/cuda_check.h"
#include "core/error.h"

namespace iris::cuda {
namespace {

// The largest power of two up to 256 that divides every address a batch of the operand starts at.
int alignment(const void* p, int64_t stride_bytes) {
  const auto v = reinterpret_cast<uintptr_t>(p) | static_cast<uintptr_t>(stride_bytes) | 256u;
  return static_cast<int>(v & (~v + 1));
}

// A matrix of `batch` column-major rows x cols matrices, `stride` elements apart.
cublasStatus_t batched_layout(cublasLtMatrixLayout_t* l, cudaDataType_t type, int64_t rows,
                              int64_t cols, int64_t batch, int64_t stride) {
  cublasStatus_t s = cublasLtMatrixLayoutCreate(l, type, static_cast<uint64_t>(rows),
                                                static_cast<uint64_t>(cols), rows);
  const auto count = static_cast<int32_t>(batch);
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                         sizeof(count));
  if (s == CUBLAS_STATUS_SUCCESS)
    s = cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                         sizeof(stride));
  return s;
}

constexpr const char* kOpNames[] = {"forward", "backward_input", "backward_weight"};

}  // namespace

MoeBatchedGemm::MoeBatchedGemm(void* workspace, size_t workspace_bytes)
    : workspace_(workspace), workspace_bytes_(workspace_bytes) {
  IRIS_CUBLAS_CHECK(cublasLtCreate(&handle_));
}

MoeBatchedGemm::~MoeBatchedGemm() {
  for (auto& [key, p] : plans_) destroy(p);
  if (handle_) cublasLtDestroy(handle_);
}

void MoeBatchedGemm::destroy(Plan& p) {
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.d) cublasLtMatrixLayoutDestroy(p.d);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p = Plan{};
}

// Row-major [r, c] is column-major [c, r]; each call as cuBLASLt's D = op(A) op(B):
//   forward:         D = y^T [N, C],  A = w[e] as stored [N, K],         B = x^T [K, C]
//   backward_input:  D = dx^T [K, C], A = w[e] as stored [N, K], op T,    B = dy^T [N, C]
//   backward_weight: D = dw^T [N, K], A = dy^T [N, C],                   B = x as stored [K, C], op
//   T
const MoeBatchedGemm::Plan& MoeBatchedGemm::plan(const Key& key) {
  if (const auto it = plans_.find(key); it != plans_.end()) return it->second;
  const auto [op, E, C, K, N, align] = key;
  const bool f32_out = op == kBackwardWeight;
  const cublasOperation_t trans_a = op == kBackwardInput ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_b = op == kBackwardWeight ? CUBLAS_OP_T : CUBLAS_OP_N;
  Plan p;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = [&] {
    cublasStatus_t s = cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                         sizeof(trans_a));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                         sizeof(trans_b));
    if (s != CUBLAS_STATUS_SUCCESS) return s;
    if (op == kForward) {
      s = batched_layout(&p.a, CUDA_R_16BF, N, K, E, K * N);
      if (s == CUBLAS_STATUS_SUCCESS) s = batched_layout(&p.b, CUDA_R_16BF, K, C, E, C * K);
      if (s == CUBLAS_STATUS_SUCCESS) s = batched_layout(&p.d, CUDA_R_16BF, N, C, E, C * N);
    } else if (op == kBackwardInput) {
      s = batched_layout(&p.a, CUDA_R_16BF, N, K, E, K * N);
      if (s == CUBLAS_STATUS_SUCCESS) s = batched_layout(&p.b, CUDA_R_16BF, N, C, E, C * N);
      if (s == CUBLAS_STATUS_SUCCESS) s = batched_layout(&p.d, CUDA_R_16BF, K, C, E, C * K);
    } else {
      s = batched_layout(&p.a, CUDA_R_16BF, N, C, E, C * N);
      if (s == CUBLAS_STATUS_SUCCESS) s = batched_layout(&p.b, CUDA_R_16BF, K, C, E, C * K);
      if (s == CUBLAS_STATUS_SUCCESS) s = batched_layout(&p.d, CUDA_R_32F, N, K, E, K * N);
    }
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasLtMatmulPreferenceCreate(&pref);
    const uint64_t ws = workspace_bytes_;
    const auto a = static_cast<uint32_t>(align);
    // No split-K scheme that adds partial sums in an order that varies: the same bits every call.
    uint32_t mask = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    if (f32_out) mask |= CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE;
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                               sizeof(ws));
    for (const auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmulPreferenceSetAttribute(pref, attr, &a, sizeof(a));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                               &mask, sizeof(mask));
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.d, p.d, pref, 1, &result,
                                         &found);
    return s;
  }();
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    destroy(p);
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) IRIS_CUBLAS_CHECK(st);
    IRIS_FAIL("cuBLASLt has no bf16 batched algorithm for the experts' ", kOpNames[op], " over ", E,
              " experts of ", C, " rows, K=", K, " N=", N, " (alignment ", align, " bytes)");
  }
  p.algo = result.algo;
  return plans_.emplace(key, p).first->second;
}

void MoeBatchedGemm::matmul(const Key& key, void* d, const void* a, const void* b, float beta,
                            cudaStream_t s) {
  const Plan& p = plan(key);
  const float alpha = 1.0f;
  IRIS_CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, a, p.a, b, p.b, &beta, d, p.d, d, p.d,
                                   &p.algo, workspace_, workspace_bytes_, s));
}

void MoeBatchedGemm::forward(uint16_t* y, const uint16_t* x, const uint16_t* w, int64_t E,
                             int64_t C, int64_t K, int64_t N, cudaStream_t s) {
  if (E == 0 || C == 0) return;
  const int align =
      std::min({alignment(y, C * N * 2), alignment(x, C * K * 2), alignment(w, K * N * 2)});
  matmul({kForward, E, C, K, N, align}, y, w, x, 0.0f, s);
}

void MoeBatchedGemm::backward_input(uint16_t* dx, const uint16_t* dy, const uint16_t* w, int64_t E,
                                    int64_t C, int64_t K, int64_t N, cudaStream_t s) {
  if (E == 0 || C == 0) return;
  const int align =
      std::min({alignment(dx, C * K * 2), alignment(dy, C * N * 2), alignment(w, K * N * 2)});
  matmul({kBackwardInput, E, C, K, N, align}, dx, w, dy, 0.0f, s);
}

void MoeBatchedGemm::backward_weight(float* dw, const uint16_t* x, const uint16_t* dy, int64_t E,
                                     int64_t C, int64_t K, int64_t N, cudaStream_t s) {
  if (E == 0 || C == 0) return;
  const int align =
      std::min({alignment(dw, K * N * 4), alignment(dy, C * N * 2), alignment(x, C * K * 2)});
  matmul({kBackwardWeight, E, C, K, N, align}, dw, dy, x, 1.0f, s);
}

}  // namespace iris::cuda
