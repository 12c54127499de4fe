#include "core/cuda/gemm.h"

#include "core/cuda/cuda_check.h"

namespace iris::cuda {
namespace {

int alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 2 && (v % a) != 0) a /= 2;
  return a;
}

}  // namespace

LtGemm::LtGemm(void* workspace, size_t workspace_bytes)
    : workspace_(workspace), workspace_bytes_(workspace_bytes) {
  IRIS_CUBLAS_CHECK(cublasLtCreate(&handle_));
}

LtGemm::~LtGemm() {
  // Destructors never throw: failures while tearing down are ignored.
  for (auto& [key, p] : plans_) {
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.c) cublasLtMatrixLayoutDestroy(p.c);
    if (p.op) cublasLtMatmulDescDestroy(p.op);
  }
  if (handle_) cublasLtDestroy(handle_);
}

const LtGemm::Plan& LtGemm::plan(const Key& key) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  const auto [m, n, k, has_bias, accumulate, align_x, align_w, align_y] = key;
  Plan p;
  // Row-major y[M,N] = x[M,K] w[N,K]^T is column-major y^T[N,M] = w^T x^T: cuBLASLt's A is w
  // (stored K x N column-major, transposed), B is x (K x M), C/D are y^T (N x M, ld N).
  IRIS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  IRIS_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a)));
  IRIS_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b)));
  if (has_bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = CUDA_R_16BF;
    IRIS_CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
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
  cublasLtMatmulHeuristicResult_t result{};
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
      s = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref, 1, &result,
                                         &found);
    return s;
  }();
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.c);
    cublasLtMatmulDescDestroy(p.op);
    IRIS_CUBLAS_CHECK(st);
    IRIS_FAIL("cuBLASLt has no bf16 algorithm for linear M=", m, " N=", n, " K=", k,
              " (alignments x ", align_x, ", w ", align_w, ", y ", align_y, ")");
  }
  p.algo = result.algo;
  return plans_.emplace(key, p).first->second;
}

void LtGemm::run(uint16_t* y, const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t m,
                 int64_t n, int64_t k, bool accumulate, cudaStream_t stream) {
  const Key key{
      m, n, k, bias != nullptr, accumulate, alignment_of(x), alignment_of(w), alignment_of(y)};
  const Plan& p = plan(key);
  if (bias != nullptr)
    IRIS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof(bias)));
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  IRIS_CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c,
                                   &p.algo, workspace_, workspace_bytes_, stream));
}

}  // namespace iris::cuda
