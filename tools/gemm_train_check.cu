// Standalone check of the training calls of iris::cuda::LtGemm (core/cuda/gemm/gemm.cu) against an
// fp64 host reference: forward_f32, backward_input (bf16 / f32, with and without accumulation) and
// backward_weight (dw and db, accumulating into random initial values), each run twice for
// bitwise determinism, plus a CUDA-graph replay and an instance that takes the heuristic's first
// choice (the main one times the candidates, without a tuning cache). Prints PASS/FAIL
// per check; the exit status is the number of failures.
//
// Build and run (from the repository root):
// clang-format off
//   /usr/local/cuda/bin/nvcc -std=c++20 -O2 -gencode=arch=compute_90a,code=sm_90a -I. tools/gemm_train_check.cu core/cuda/gemm/gemm.cu core/cuda/gemm/gemm_tuning.cpp core/tuning_cache.cpp core/fs.cpp core/json_read.cpp core/error.cpp -lcublasLt -lcublas -o /tmp/gemm_train_check
//   /tmp/gemm_train_check
// clang-format on
//
// Large outputs are compared on a sample of rows (the fp64 reference of every row would take
// minutes); small ones in full.

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/cuda/gemm/gemm.h"
#include "core/splitmix.h"

using iris::cuda::LtGemm;

namespace {

int g_failures = 0;
// Every copy and memset goes through the stream the GEMMs run on (a non-blocking one, which does
// not wait for the legacy default stream), then waits for it.
cudaStream_t g_stream = nullptr;

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Device memory; `offset` bytes past a 256-byte aligned base (to exercise unaligned operands).
struct DevBuf {
  char* base = nullptr;
  size_t offset = 0;
  DevBuf(size_t bytes, size_t off) : offset(off) {
    IRIS_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&base), bytes + off + 256));
  }
  ~DevBuf() { cudaFree(base); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* ptr() const {
    return reinterpret_cast<T*>(base + offset);
  }
};

// Random bf16 values in [-1, 1]: `bits` for the device, `vals` (exact) for the reference.
struct Bf16Host {
  std::vector<uint16_t> bits;
  std::vector<float> vals;
};

Bf16Host random_bf16(size_t n, uint64_t seed) {
  iris::SplitMix64 rng(seed);
  Bf16Host h;
  h.bits.resize(n);
  h.vals.resize(n);
  for (size_t i = 0; i < n; ++i) {
    h.bits[i] = f32_to_bf16(static_cast<float>(2.0 * rng.uniform01() - 1.0));
    h.vals[i] = bf16_to_f32(h.bits[i]);
  }
  return h;
}

std::vector<float> random_f32(size_t n, uint64_t seed, double scale) {
  iris::SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(scale * (2.0 * rng.uniform01() - 1.0));
  return v;
}

template <typename T>
void upload(T* dst, const std::vector<T>& src) {
  IRIS_CUDA_CHECK(
      cudaMemcpyAsync(dst, src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice, g_stream));
  IRIS_CUDA_CHECK(cudaStreamSynchronize(g_stream));
}

void fill_bytes(void* dst, int value, size_t bytes) {
  IRIS_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, g_stream));
  IRIS_CUDA_CHECK(cudaStreamSynchronize(g_stream));
}

template <typename T>
std::vector<T> download(const T* src, size_t n) {
  std::vector<T> v(n);
  IRIS_CUDA_CHECK(cudaMemcpyAsync(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost, g_stream));
  IRIS_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  return v;
}

std::vector<float> as_f32(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_to_f32(bits[i]);
  return v;
}

// Rows of an output of `rows` rows to compare: all of them when the reference is cheap, else an
// evenly spaced sample (first and last included).
std::vector<int64_t> sample_rows(int64_t rows, double cost_per_row) {
  constexpr double kBudget = 2e8;  // multiply-adds per reference
  int64_t want = static_cast<int64_t>(kBudget / cost_per_row);
  if (want < 2) want = 2;
  std::vector<int64_t> out;
  if (want >= rows) {
    for (int64_t r = 0; r < rows; ++r) out.push_back(r);
  } else {
    for (int64_t i = 0; i < want; ++i) out.push_back(i * (rows - 1) / (want - 1));
  }
  return out;
}

// Reference rows of a row-major output with `cols` columns (row index -> fp64 values).
struct RefRows {
  std::vector<int64_t> rows;
  std::vector<std::vector<double>> vals;
  int64_t cols = 0;
};

// ||got - (init + ref)|| / ||init + ref|| over the reference rows; init (may be empty) is the
// output's value before an accumulating call.
double rel_l2(const std::vector<float>& got, const RefRows& ref, const std::vector<float>& init) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.rows.size(); ++i) {
    const int64_t r = ref.rows[i];
    for (int64_t c = 0; c < ref.cols; ++c) {
      const size_t at = static_cast<size_t>(r * ref.cols + c);
      const double want = ref.vals[i][c] + (init.empty() ? 0.0 : init[at]);
      const double d = static_cast<double>(got[at]) - want;
      num += d * d;
      den += want * want;
    }
  }
  if (!std::isfinite(num)) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

bool same_bits(const void* a, const void* b, size_t bytes) {
  return std::memcmp(a, b, bytes) == 0;
}

void report(const std::string& what, double err, double tol, bool deterministic) {
  const bool ok = err < tol && deterministic;
  std::printf("%s  %-58s rel_l2 %.3e (tol %.0e)%s\n", ok ? "PASS" : "FAIL", what.c_str(), err, tol,
              deterministic ? "" : "  NOT BITWISE DETERMINISTIC");
  if (!ok) ++g_failures;
}

void report_bool(const std::string& what, bool ok) {
  std::printf("%s  %s\n", ok ? "PASS" : "FAIL", what.c_str());
  if (!ok) ++g_failures;
}

struct Case {
  const char* name;
  int64_t m, n, k;
  bool misalign;      // operands offset by one element from 256-byte alignment
  bool forward_only;  // the lm_head case: forward_f32 alone
  bool graph;         // also replay the ops as a captured CUDA graph
};

struct Context {
  void* workspace;
  size_t workspace_bytes;
  void* scratch;
  size_t scratch_bytes;
  cudaStream_t stream;
};

float time_ms(cudaStream_t s, int reps, const auto& fn) {
  cudaEvent_t a, b;
  IRIS_CUDA_CHECK(cudaEventCreate(&a));
  IRIS_CUDA_CHECK(cudaEventCreate(&b));
  fn();  // warm-up
  IRIS_CUDA_CHECK(cudaEventRecord(a, s));
  for (int i = 0; i < reps; ++i) fn();
  IRIS_CUDA_CHECK(cudaEventRecord(b, s));
  IRIS_CUDA_CHECK(cudaEventSynchronize(b));
  float ms = 0;
  IRIS_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / reps;
}

void run_case(const Case& c, const Context& ctx, bool timings) {
  const int64_t M = c.m, N = c.n, K = c.k;
  const size_t off16 = c.misalign ? 2 : 0, off32 = c.misalign ? 4 : 0;
  const std::string tag = std::string(c.name) + " M=" + std::to_string(M) +
                          " N=" + std::to_string(N) + " K=" + std::to_string(K) + ": ";
  std::printf("-- %s%s\n", tag.c_str(), c.misalign ? " (operands misaligned)" : "");
  const cudaStream_t s = ctx.stream;
  LtGemm gemm(ctx.workspace, ctx.workspace_bytes, ctx.scratch, ctx.scratch_bytes);
  gemm.set_tuning(iris::GemmTuning::tune);

  const Bf16Host x = random_bf16(M * K, 11 + M), w = random_bf16(N * K, 22 + N),
                 dy = random_bf16(M * N, 33 + K);
  DevBuf dx_(M * K * 2, off16), dw_(N * K * 2, off16), ddy(M * N * 2, off16);
  upload(dx_.ptr<uint16_t>(), x.bits);  // x
  upload(dw_.ptr<uint16_t>(), w.bits);  // w
  upload(ddy.ptr<uint16_t>(), dy.bits);
  const uint16_t* d_x = dx_.ptr<uint16_t>();
  const uint16_t* d_w = dw_.ptr<uint16_t>();
  const uint16_t* d_dy = ddy.ptr<uint16_t>();

  // ---- forward_f32: y[M,N] = x w^T ----
  {
    RefRows ref;
    ref.cols = N;
    ref.rows = sample_rows(M, static_cast<double>(N) * K);
    for (int64_t r : ref.rows) {
      std::vector<double> row(N);
      const float* xr = &x.vals[r * K];
      for (int64_t j = 0; j < N; ++j) {
        const float* wr = &w.vals[j * K];
        double acc = 0;
        for (int64_t q = 0; q < K; ++q) acc += static_cast<double>(xr[q]) * wr[q];
        row[j] = acc;
      }
      ref.vals.push_back(std::move(row));
    }
    DevBuf y(M * N * 4, off32);
    gemm.forward_f32(y.ptr<float>(), d_x, d_w, M, N, K, s);
    const auto y1 = download(y.ptr<float>(), M * N);
    fill_bytes(y.ptr<float>(), 0xff, M * N * 4);
    gemm.forward_f32(y.ptr<float>(), d_x, d_w, M, N, K, s);
    const auto y2 = download(y.ptr<float>(), M * N);
    report(tag + "forward_f32", rel_l2(y1, ref, {}), 1e-5,
           same_bits(y1.data(), y2.data(), M * N * 4));

    LtGemm untuned(ctx.workspace, ctx.workspace_bytes, ctx.scratch, ctx.scratch_bytes);
    untuned.set_tuning(iris::GemmTuning::heuristic);
    untuned.forward_f32(y.ptr<float>(), d_x, d_w, M, N, K, s);
    const auto y3 = download(y.ptr<float>(), M * N);
    report(tag + "forward_f32 (tuning off)", rel_l2(y3, ref, {}), 1e-5, true);
    if (timings) {
      const float ms =
          time_ms(s, 10, [&] { gemm.forward_f32(y.ptr<float>(), d_x, d_w, M, N, K, s); });
      std::printf("      forward_f32: %.3f ms, %.0f TFLOP/s\n", ms, 2.0 * M * N * K / ms * 1e-9);
    }
  }
  if (c.forward_only) return;

  // ---- backward_input: dx[M,K] = dy w (+ dx) ----
  {
    RefRows ref;
    ref.cols = K;
    ref.rows = sample_rows(M, static_cast<double>(N) * K);
    for (int64_t r : ref.rows) {
      std::vector<double> row(K, 0.0);
      for (int64_t j = 0; j < N; ++j) {
        const double a = dy.vals[r * N + j];
        const float* wr = &w.vals[j * K];
        for (int64_t q = 0; q < K; ++q) row[q] += a * wr[q];
      }
      ref.vals.push_back(std::move(row));
    }
    DevBuf dx(M * K * 4, off32);
    // bf16, overwriting (the output holds garbage first).
    {
      fill_bytes(dx.ptr<void>(), 0x7f, M * K * 2);
      gemm.backward_input(dx.ptr<void>(), false, d_dy, d_w, M, N, K, false, s);
      const auto r1 = download(dx.ptr<uint16_t>(), M * K);
      gemm.backward_input(dx.ptr<void>(), false, d_dy, d_w, M, N, K, false, s);
      const auto r2 = download(dx.ptr<uint16_t>(), M * K);
      report(tag + "backward_input bf16", rel_l2(as_f32(r1), ref, {}), 1e-2,
             same_bits(r1.data(), r2.data(), M * K * 2));
      if (timings) {
        const float ms = time_ms(s, 10, [&] {
          gemm.backward_input(dx.ptr<void>(), false, d_dy, d_w, M, N, K, false, s);
        });
        std::printf("      backward_input bf16: %.3f ms, %.0f TFLOP/s\n", ms,
                    2.0 * M * N * K / ms * 1e-9);
      }
    }
    // f32, overwriting.
    {
      fill_bytes(dx.ptr<void>(), 0x7f, M * K * 4);
      gemm.backward_input(dx.ptr<void>(), true, d_dy, d_w, M, N, K, false, s);
      const auto r1 = download(dx.ptr<float>(), M * K);
      gemm.backward_input(dx.ptr<void>(), true, d_dy, d_w, M, N, K, false, s);
      const auto r2 = download(dx.ptr<float>(), M * K);
      report(tag + "backward_input f32", rel_l2(r1, ref, {}), 1e-5,
             same_bits(r1.data(), r2.data(), M * K * 4));
    }
    // f32, accumulating into random values.
    {
      const auto init = random_f32(M * K, 44 + M, 4.0);
      upload(dx.ptr<float>(), init);
      gemm.backward_input(dx.ptr<void>(), true, d_dy, d_w, M, N, K, true, s);
      const auto r1 = download(dx.ptr<float>(), M * K);
      upload(dx.ptr<float>(), init);
      gemm.backward_input(dx.ptr<void>(), true, d_dy, d_w, M, N, K, true, s);
      const auto r2 = download(dx.ptr<float>(), M * K);
      report(tag + "backward_input f32 accumulate", rel_l2(r1, ref, init), 1e-5,
             same_bits(r1.data(), r2.data(), M * K * 4));
    }
    // bf16, accumulating into random bf16 values.
    {
      const Bf16Host init = random_bf16(M * K, 55 + M);
      upload(dx.ptr<uint16_t>(), init.bits);
      gemm.backward_input(dx.ptr<void>(), false, d_dy, d_w, M, N, K, true, s);
      const auto r1 = download(dx.ptr<uint16_t>(), M * K);
      upload(dx.ptr<uint16_t>(), init.bits);
      gemm.backward_input(dx.ptr<void>(), false, d_dy, d_w, M, N, K, true, s);
      const auto r2 = download(dx.ptr<uint16_t>(), M * K);
      report(tag + "backward_input bf16 accumulate", rel_l2(as_f32(r1), ref, init.vals), 1e-2,
             same_bits(r1.data(), r2.data(), M * K * 2));
    }
  }

  // ---- backward_weight: dw[N,K] += dy^T x, db[N] += column sums of dy ----
  {
    RefRows ref;
    ref.cols = K;
    ref.rows = sample_rows(N, static_cast<double>(M) * K);
    for (int64_t j : ref.rows) {
      std::vector<double> row(K, 0.0);
      for (int64_t r = 0; r < M; ++r) {
        const double a = dy.vals[r * N + j];
        const float* xr = &x.vals[r * K];
        for (int64_t q = 0; q < K; ++q) row[q] += a * xr[q];
      }
      ref.vals.push_back(std::move(row));
    }
    RefRows ref_db;
    ref_db.cols = N;
    ref_db.rows = {0};
    ref_db.vals.assign(1, std::vector<double>(N, 0.0));
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < N; ++j) ref_db.vals[0][j] += dy.vals[r * N + j];

    const auto dw0 = random_f32(N * K, 66 + N, 8.0);
    const auto db0 = random_f32(N, 77 + N, 8.0);
    DevBuf dw(N * K * 4, off32), db(N * 4, off32);
    auto run = [&](LtGemm& g, bool with_dw) {
      upload(dw.ptr<float>(), dw0);
      upload(db.ptr<float>(), db0);
      g.backward_weight(with_dw ? dw.ptr<float>() : nullptr, db.ptr<float>(), d_dy, d_x, M, N, K,
                        s);
      return std::make_pair(download(dw.ptr<float>(), N * K), download(db.ptr<float>(), N));
    };
    const auto [dw1, db1] = run(gemm, true);
    const auto [dw2, db2] = run(gemm, true);
    report(tag + "backward_weight dw (accumulating)", rel_l2(dw1, ref, dw0), 1e-5,
           same_bits(dw1.data(), dw2.data(), N * K * 4));
    report(tag + "backward_weight db (accumulating)", rel_l2(db1, ref_db, db0), 1e-5,
           same_bits(db1.data(), db2.data(), N * 4));
    const auto [dw3, db3] = run(gemm, false);
    report_bool(
        tag + "backward_weight db alone: dw untouched, db bits as with dw",
        same_bits(dw3.data(), dw0.data(), N * K * 4) && same_bits(db3.data(), db1.data(), N * 4));

    LtGemm untuned(ctx.workspace, ctx.workspace_bytes, ctx.scratch, ctx.scratch_bytes);
    untuned.set_tuning(iris::GemmTuning::heuristic);
    const auto [dw4, db4] = run(untuned, true);
    const auto [dw5, db5] = run(untuned, true);
    report(tag + "backward_weight dw (tuning off)", rel_l2(dw4, ref, dw0), 1e-5,
           same_bits(dw4.data(), dw5.data(), N * K * 4));
    if (timings) {
      const float ms = time_ms(s, 10, [&] {
        gemm.backward_weight(dw.ptr<float>(), db.ptr<float>(), d_dy, d_x, M, N, K, s);
      });
      std::printf("      backward_weight dw+db: %.3f ms, %.0f TFLOP/s\n", ms,
                  2.0 * M * N * K / ms * 1e-9);
      const float ms_db = time_ms(
          s, 10, [&] { gemm.backward_weight(nullptr, db.ptr<float>(), d_dy, d_x, M, N, K, s); });
      std::printf("      backward_weight db alone: %.3f ms\n", ms_db);
    }
  }

  // ---- the same calls captured into a CUDA graph, once their plans exist ----
  if (c.graph) {
    DevBuf y(M * N * 4, off32), dx(M * K * 4, off32), dw(N * K * 4, off32), db(N * 4, off32);
    const auto dw0 = random_f32(N * K, 88, 8.0);
    const auto db0 = random_f32(N, 99, 8.0);
    auto enqueue = [&] {
      gemm.forward_f32(y.ptr<float>(), d_x, d_w, M, N, K, s);
      gemm.backward_input(dx.ptr<void>(), false, d_dy, d_w, M, N, K, false, s);
      gemm.backward_weight(dw.ptr<float>(), db.ptr<float>(), d_dy, d_x, M, N, K, s);
    };
    const bool planned =
        gemm.has_forward_f32_plan(y.ptr<float>(), d_x, d_w, M, N, K) &&
        gemm.has_backward_input_plan(dx.ptr<void>(), false, d_dy, d_w, M, N, K, false) &&
        gemm.has_backward_weight_plan(dw.ptr<float>(), d_dy, d_x, M, N, K);
    report_bool(tag + "plans exist before capture", planned);
    upload(dw.ptr<float>(), dw0);
    upload(db.ptr<float>(), db0);
    enqueue();
    const auto ye = download(y.ptr<float>(), M * N);
    const auto dxe = download(dx.ptr<uint16_t>(), M * K);
    const auto dwe = download(dw.ptr<float>(), N * K);
    const auto dbe = download(db.ptr<float>(), N);

    const size_t plans_before = gemm.plan_count();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    IRIS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    enqueue();
    IRIS_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    IRIS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    fill_bytes(y.ptr<float>(), 0, M * N * 4);
    fill_bytes(dx.ptr<void>(), 0, M * K * 2);
    upload(dw.ptr<float>(), dw0);
    upload(db.ptr<float>(), db0);
    IRIS_CUDA_CHECK(cudaGraphLaunch(exec, s));
    const auto yg = download(y.ptr<float>(), M * N);
    const auto dxg = download(dx.ptr<uint16_t>(), M * K);
    const auto dwg = download(dw.ptr<float>(), N * K);
    const auto dbg = download(db.ptr<float>(), N);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    report_bool(tag + "graph replay matches eager bit for bit",
                gemm.plan_count() == plans_before && same_bits(ye.data(), yg.data(), M * N * 4) &&
                    same_bits(dxe.data(), dxg.data(), M * K * 2) &&
                    same_bits(dwe.data(), dwg.data(), N * K * 4) &&
                    same_bits(dbe.data(), dbg.data(), N * 4));
  }
}

}  // namespace

int main() {
  try {
    cudaDeviceProp prop{};
    IRIS_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s (sm_%d%d, %d SMs)\n", prop.name, prop.major, prop.minor,
                prop.multiProcessorCount);
    constexpr size_t kWorkspace = 32ull << 20, kScratch = 256ull << 20;
    void* workspace = nullptr;
    void* scratch = nullptr;
    IRIS_CUDA_CHECK(cudaMalloc(&workspace, kWorkspace));
    IRIS_CUDA_CHECK(cudaMalloc(&scratch, kScratch));
    cudaStream_t stream;
    IRIS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    g_stream = stream;
    const Context ctx{workspace, kWorkspace, scratch, kScratch, stream};

    const Case cases[] = {
        {"tiny", 7, 384, 16, false, false, true},
        {"small", 300, 512, 256, false, false, true},
        {"misaligned", 33, 40, 24, true, false, false},
        {"odd", 5, 24, 18, true, false, false},
        {"large", 4096, 2048, 6144, false, false, true},
        {"lm_head", 64, 151936, 2048, false, true, false},
    };
    for (const Case& c : cases) {
      try {
        run_case(c, ctx, c.m * c.n * c.k >= (int64_t{1} << 30));
      } catch (const std::exception& e) {
        std::printf("FAIL  %s: exception: %s\n", c.name, e.what());
        ++g_failures;
        cudaGetLastError();
      }
    }
    cudaStreamDestroy(stream);
    cudaFree(workspace);
    cudaFree(scratch);
  } catch (const std::exception& e) {
    std::printf("FAIL  setup: %s\n", e.what());
    return 1;
  }
  if (g_failures == 0)
    std::printf("ALL PASS\n");
  else
    std::printf("%d FAILURE(S)\n", g_failures);
  return g_failures;
}
