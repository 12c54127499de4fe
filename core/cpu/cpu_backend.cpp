// The fp32 CPU reference backend: the oracle every other backend is checked against, and the
// backend CI runs end to end. Written for clarity first; OpenMP over rows/heads for speed.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "core/backend.h"
#include "core/cpu/cpu_gemm.h"
#include "core/cpu/cpu_moe_ops.h"
#include "core/cpu/cpu_train_ops.h"
#include "core/image_patches.h"
#include "core/moe_ops.h"
#include "core/taping_backend.h"
#include "core/text_rope_tables.h"
#include "core/vision_tables.h"

namespace iris {
namespace {

// Below this many elements of work an op runs on one thread: a parallel region costs two
// barriers, and on a busy machine a barrier waits for a descheduled thread (measured: the tiny
// model decoded 10x slower with every op parallel on 2 loaded cores).
constexpr int64_t kParallelGrain = int64_t(1) << 16;

void check_cpu(const Tensor& t, const char* what) {
  IRIS_CHECK(t.device == Device::cpu, what, " is not a CPU tensor");
  IRIS_CHECK(t.data != nullptr || t.numel() == 0, what, " has no data");
}

void check_f32(const Tensor& t, const char* what) {
  check_cpu(t, what);
  IRIS_CHECK(t.dtype == DType::f32, what, " must be f32 on the CPU backend, got ", t.shape_str());
}

void check_i32(const Tensor& t, const char* what) {
  check_cpu(t, what);
  IRIS_CHECK(t.dtype == DType::i32, what, " must be i32, got ", t.shape_str());
}

// The oracle refuses what the CUDA kernels cannot: routing tables that point outside their rows.
void check_offsets(const Tensor& offsets, int64_t rows, const char* op) {
  const int32_t* off = offsets.as<int32_t>();
  const int64_t E = offsets.numel() - 1;
  for (int64_t e = 0; e < E; ++e)
    IRIS_CHECK(off[0] == 0 && off[e] <= off[e + 1] && off[E] <= rows, op,
               ": offsets are not ascending within the ", rows, " rows");
}
// The experts' segments moe_dispatch pads to rows_per_expert (when it is not 0).
void check_padded_offsets(const Tensor& offsets, int64_t rows_per_expert, const char* op) {
  if (rows_per_expert == 0) return;
  const int32_t* off = offsets.as<int32_t>();
  for (int64_t e = 0; e < offsets.numel(); ++e)
    IRIS_CHECK(off[e] == e * rows_per_expert, op, ": offsets[", e, "] is ", off[e], ", not ", e,
               " x rows_per_expert ", rows_per_expert);
}
void check_slot_rows(const Tensor& slot_rows, int64_t rows, const char* op) {
  const int32_t* r = slot_rows.as<int32_t>();
  for (int64_t s = 0; s < slot_rows.numel(); ++s)
    IRIS_CHECK(r[s] >= -1 && r[s] < rows, op, ": slot row ", r[s], " is outside the ", rows,
               " sorted rows");
}

float gelu_tanh_f(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
}

float gelu_erf_f(float x) {
  return 0.5f * x * (1.0f + std::erf(x * 0.7071067811865476f));
}

float quick_gelu_f(float x) {
  return x / (1.0f + std::exp(-1.702f * x));
}

float silu_f(float x) {
  return x / (1.0f + std::exp(-x));
}

void rms_norm_row(float* y, const float* x, const float* w, int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  const float r = 1.0f / std::sqrt(static_cast<float>(ss / double(n)) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

// Rotate-half RoPE of one head in place.
void rope_head(float* h, const float* cos, const float* sin, int hd) {
  const int half = hd / 2;
  for (int i = 0; i < half; ++i) {
    const float a = h[i], b = h[i + half];
    h[i] = a * cos[i] - b * sin[i];
    h[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

class CpuBackend final : public Backend {
 public:
  Device device() const override { return Device::cpu; }
  std::string name() const override { return "cpu"; }
  DType compute_dtype() const override { return DType::f32; }

  void* allocate(size_t bytes) override {
    void* p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    IRIS_CHECK(p != nullptr, "out of host memory allocating ", bytes, " bytes");
    return p;
  }
  void deallocate(void* ptr) override { std::free(ptr); }

  void write(const Tensor& dst, const void* host_src, DType src_dtype) override {
    check_cpu(dst, "write destination");
    convert_elements(dst.data, dst.dtype, host_src, src_dtype, dst.numel());
  }
  void read(void* host_dst, DType dst_dtype, const Tensor& src) override {
    check_cpu(src, "read source");
    convert_elements(host_dst, dst_dtype, src.data, src.dtype, src.numel());
  }
  void copy(const Tensor& dst, const Tensor& src) override {
    check_cpu(dst, "copy destination");
    check_cpu(src, "copy source");
    IRIS_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy ", src.shape_str(),
               " into ", dst.shape_str());
    if (dst.data != src.data) std::memmove(dst.data, src.data, src.nbytes());
  }
  void fill_zero(const Tensor& dst) override {
    check_cpu(dst, "fill_zero destination");
    std::memset(dst.data, 0, dst.nbytes());
  }
  void synchronize() override {}

  // Ops have finished when they return, so the host clock is the device's.
  void record_timing_mark(int slot) override {
    IRIS_CHECK(slot >= 0 && slot < kTimingMarks, "timing mark slot ", slot, " is outside 0..",
               kTimingMarks - 1);
    marks_[static_cast<size_t>(slot)] = std::chrono::steady_clock::now();
    recorded_[static_cast<size_t>(slot)] = true;
  }
  double timing_mark_elapsed_ms(int from, int to) override {
    for (int s : {from, to})
      IRIS_CHECK(s >= 0 && s < kTimingMarks && recorded_[static_cast<size_t>(s)],
                 "timing mark slot ", s, " was never recorded");
    return std::chrono::duration<double, std::milli>(marks_[static_cast<size_t>(to)] -
                                                     marks_[static_cast<size_t>(from)])
        .count();
  }

  void linear(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
              bool accumulate) override {
    check_f32(y, "linear output");
    check_f32(x, "linear input");
    check_f32(w, "linear weight");
    const int64_t M = x.rows(), K = x.cols(), N = w.dim(0);
    IRIS_CHECK(w.ndim == 2 && w.dim(1) == K, "linear: weight ", w.shape_str(),
               " does not match input ", x.shape_str());
    IRIS_CHECK(y.rows() == M && y.cols() == N, "linear: output ", y.shape_str(), " should be [", M,
               ", ", N, "]");
    IRIS_CHECK(y.data != x.data, "linear: output aliases input");
    float* yp = y.as<float>();
    cpu::sgemm_xwt(M, N, K, x.as<float>(), w.as<float>(), yp, accumulate ? 1.0f : 0.0f);
    if (bias.defined()) {
      check_f32(bias, "linear bias");
      IRIS_CHECK(bias.numel() == N, "linear: bias ", bias.shape_str(), " should have ", N);
      const float* b = bias.as<float>();
#pragma omp parallel for schedule(static) if (M * N > kParallelGrain)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) yp[m * N + n] += b[n];
    }
  }

  void layer_norm(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b,
                  float eps) override {
    check_f32(y, "layer_norm output");
    check_f32(x, "layer_norm input");
    const int64_t R = x.rows(), C = x.cols();
    IRIS_CHECK(y.numel() == x.numel() && w.numel() == C && b.numel() == C, "layer_norm: shapes ",
               x.shape_str(), " ", w.shape_str(), " ", b.shape_str());
    const float *xp = x.as<float>(), *wp = w.as<float>(), *bp = b.as<float>();
    float* yp = y.as<float>();
#pragma omp parallel for schedule(static) if (R * C > kParallelGrain)
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = xp + r * C;
      double mean = 0.0;
      for (int64_t i = 0; i < C; ++i) mean += xr[i];
      mean /= double(C);
      double var = 0.0;
      for (int64_t i = 0; i < C; ++i) var += (xr[i] - mean) * (xr[i] - mean);
      var /= double(C);
      const float m = static_cast<float>(mean);
      const float rs = 1.0f / std::sqrt(static_cast<float>(var) + eps);
      float* yr = yp + r * C;
      for (int64_t i = 0; i < C; ++i) yr[i] = (xr[i] - m) * rs * wp[i] + bp[i];
    }
  }

  void rms_norm(const Tensor& y, const Tensor& x, const Tensor& w, float eps) override {
    check_f32(y, "rms_norm output");
    check_f32(x, "rms_norm input");
    const int64_t R = x.rows(), C = x.cols();
    IRIS_CHECK(y.numel() == x.numel() && w.numel() == C, "rms_norm: shapes ", x.shape_str(), " ",
               w.shape_str());
    const float* wp = w.as<float>();
#pragma omp parallel for schedule(static) if (R * C > kParallelGrain)
    for (int64_t r = 0; r < R; ++r)
      rms_norm_row(y.as<float>() + r * C, x.as<float>() + r * C, wp, C, eps);
  }

  void add(const Tensor& y, const Tensor& a, const Tensor& b) override {
    check_f32(y, "add output");
    IRIS_CHECK(a.numel() == y.numel() && b.numel() == y.numel(), "add: shapes ", a.shape_str(),
               " + ", b.shape_str(), " -> ", y.shape_str());
    const float *ap = a.as<float>(), *bp = b.as<float>();
    float* yp = y.as<float>();
    const int64_t n = y.numel();
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
    for (int64_t i = 0; i < n; ++i) yp[i] = ap[i] + bp[i];
  }

  void dropout(const Tensor& y, const Tensor& x, float p, const Tensor& seed,
               uint64_t stream) override {
    check_f32(y, "dropout output");
    check_f32(x, "dropout input");
    IRIS_CHECK(y.numel() == x.numel(), "dropout: ", x.shape_str(), " -> ", y.shape_str());
    IRIS_CHECK(seed.dtype == DType::i64 && seed.numel() == 1, "dropout: seed must be i64 [1], got ",
               seed.shape_str());
    const uint32_t threshold = dropout_threshold(p);
    const int64_t s = seed.as<int64_t>()[0], n = x.numel();
    const float* xp = x.as<float>();
    float* yp = y.as<float>();
    if (s < 0) {
      if (yp != xp) std::copy(xp, xp + n, yp);
      return;
    }
    const float scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
    for (int64_t i = 0; i < n; ++i)
      yp[i] = dropout_draw(static_cast<uint64_t>(s), stream, static_cast<uint64_t>(i)) >= threshold
                  ? xp[i] * scale
                  : 0.0f;
  }

  void add_column_block(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                        int64_t cols, float scale, bool accumulate) override {
    check_f32(dst, "add_column_block destination");
    check_f32(src, "add_column_block source");
    check_column_block(dst, dst_col, src, src_col, cols);
    const int64_t R = dst.rows(), dc = dst.cols(), sc = src.cols();
    float* d = dst.as<float>();
    const float* s = src.as<float>();
#pragma omp parallel for schedule(static) if (R * cols > kParallelGrain)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        float& out = d[r * dc + dst_col + c];
        const float v = scale * s[r * sc + src_col + c];
        out = accumulate ? out + v : v;
      }
  }

  void gelu_tanh(const Tensor& y, const Tensor& x) override {
    unary(y, x, gelu_tanh_f);
  }
  void gelu_erf(const Tensor& y, const Tensor& x) override {
    unary(y, x, gelu_erf_f);
  }
  void quick_gelu(const Tensor& y, const Tensor& x) override {
    unary(y, x, quick_gelu_f);
  }

  void swiglu(const Tensor& y, const Tensor& gate_up) override {
    check_f32(y, "swiglu output");
    check_f32(gate_up, "swiglu input");
    const int64_t M = gate_up.rows(), I = gate_up.cols() / 2;
    IRIS_CHECK(gate_up.cols() % 2 == 0 && y.rows() == M && y.cols() == I,
               "swiglu: ", gate_up.shape_str(), " -> ", y.shape_str());
    const float* g = gate_up.as<float>();
    float* yp = y.as<float>();
#pragma omp parallel for schedule(static) if (M * I > kParallelGrain)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < I; ++i)
        yp[m * I + i] = silu_f(g[m * 2 * I + i]) * g[m * 2 * I + I + i];
  }

  void qkv_norm_rope(
      const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, float eps,
      const Tensor& cos, const Tensor& sin, int n_q, int n_kv, int hd,
      bool /*round_tables_to_compute_dtype: f32 is the compute dtype here*/) override {
    check_f32(qkv, "qkv");
    check_f32(cos, "rope cos");
    check_f32(sin, "rope sin");
    const int64_t T = qkv.rows();
    const int64_t width = int64_t(n_q + 2 * n_kv) * hd;
    IRIS_CHECK(qkv.cols() == width, "qkv_norm_rope: qkv ", qkv.shape_str(), " should have ", width,
               " columns");
    IRIS_CHECK(cos.rows() == T && cos.cols() == hd && sin.rows() == T && sin.cols() == hd,
               "qkv_norm_rope: cos/sin ", cos.shape_str(), " should be [", T, ", ", hd, "]");
    const float* qn = q_norm_w.defined() ? q_norm_w.as<float>() : nullptr;
    const float* kn = k_norm_w.defined() ? k_norm_w.as<float>() : nullptr;
    float* p = qkv.as<float>();
#pragma omp parallel for schedule(static) if (T * width > kParallelGrain)
    for (int64_t t = 0; t < T; ++t) {
      const float* c = cos.as<float>() + t * hd;
      const float* s = sin.as<float>() + t * hd;
      for (int h = 0; h < n_q + n_kv; ++h) {
        float* head = p + t * width + int64_t(h) * hd;
        const float* nw = h < n_q ? qn : kn;
        if (nw) rms_norm_row(head, head, nw, hd, eps);
        rope_head(head, c, s, hd);
      }
    }
  }

  void attention_segments(const Tensor& out, const Tensor& qkv, const Tensor& cu_seqlens,
                          int n_segments, int n_heads, int hd, float scale,
                          const Tensor& real_rows) override {
    check_f32(out, "attention output");
    check_f32(qkv, "qkv");
    check_i32(cu_seqlens, "cu_seqlens");
    if (real_rows.defined()) {
      check_i32(real_rows, "real_rows");
      IRIS_CHECK(real_rows.numel() == 1, "attention_segments: real_rows ", real_rows.shape_str(),
                 " should hold one count");
    }
    const int64_t S = qkv.rows(), D = int64_t(n_heads) * hd;
    IRIS_CHECK(qkv.cols() == 3 * D && out.rows() == S && out.cols() == D,
               "attention_segments: qkv ", qkv.shape_str(), " out ", out.shape_str());
    IRIS_CHECK(cu_seqlens.numel() >= n_segments + 1, "cu_seqlens has ", cu_seqlens.numel(),
               " entries for ", n_segments, " segments");
    const int32_t* cu = cu_seqlens.as<int32_t>();
    IRIS_CHECK(cu[0] == 0 && cu[n_segments] <= S, "cu_seqlens must start at 0 and end <= ", S);
    for (int s = 0; s < n_segments; ++s)
      IRIS_CHECK(cu[s] <= cu[s + 1], "cu_seqlens must be non-decreasing");
    const float* p = qkv.as<float>();
    float* o = out.as<float>();
    // Rows past the last segment attend nowhere; keep them defined. So are padding segments'.
    for (int64_t r = cu[n_segments]; r < S; ++r) std::fill(o + r * D, o + (r + 1) * D, 0.0f);
    const int64_t real = real_rows.defined() ? real_rows.as<int32_t>()[0] : S;
    for (int s = 0; s < n_segments; ++s)
      if (cu[s] >= real) std::fill(o + int64_t{cu[s]} * D, o + int64_t{cu[s + 1]} * D, 0.0f);
    int64_t longest = 0;
    for (int s = 0; s < n_segments; ++s) longest = std::max<int64_t>(longest, cu[s + 1] - cu[s]);
#pragma omp parallel if (S * longest * D > kParallelGrain)
    {
      std::vector<float> scores;
#pragma omp for collapse(2) schedule(dynamic)
      for (int64_t i = 0; i < S; ++i) {
        for (int h = 0; h < n_heads; ++h) {
          int seg = 0;
          while (seg < n_segments && !(i >= cu[seg] && i < cu[seg + 1])) ++seg;
          if (seg == n_segments || cu[seg] >= real) continue;
          const int64_t b = cu[seg], e = cu[seg + 1];
          const float* q = p + i * 3 * D + int64_t(h) * hd;
          scores.resize(static_cast<size_t>(e - b));
          attend(o + i * D + int64_t(h) * hd, q, p + D + int64_t(h) * hd,
                 p + 2 * D + int64_t(h) * hd, 3 * D, b, e, hd, scale, scores.data());
        }
      }
    }
  }

  void kv_store(const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                const Tensor& past_len, int n_q, int n_kv, int hd) override {
    check_f32(k_cache, "k_cache");
    check_f32(v_cache, "v_cache");
    check_f32(qkv, "qkv");
    check_i32(past_len, "past_len");
    const int64_t T = qkv.rows(), kvw = int64_t(n_kv) * hd, width = int64_t(n_q) * hd + 2 * kvw;
    const int64_t past = past_len.as<int32_t>()[0];
    IRIS_CHECK(qkv.cols() == width && k_cache.cols() == kvw && v_cache.cols() == kvw,
               "kv_store: qkv ", qkv.shape_str(), " caches ", k_cache.shape_str());
    IRIS_CHECK(past >= 0 && past + T <= k_cache.rows(), "kv_store: ", past + T,
               " positions exceed the KV cache capacity of ", k_cache.rows(),
               " (raise the maximum context length)");
    const float* p = qkv.as<float>();
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(k_cache.as<float>() + (past + t) * kvw, p + t * width + int64_t(n_q) * hd,
                  kvw * sizeof(float));
      std::memcpy(v_cache.as<float>() + (past + t) * kvw, p + t * width + int64_t(n_q) * hd + kvw,
                  kvw * sizeof(float));
    }
  }

  void attention_causal(const Tensor& out, const Tensor& qkv, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& past_len, int n_q, int n_kv, int hd,
                        float scale) override {
    check_f32(out, "attention output");
    check_f32(qkv, "qkv");
    check_i32(past_len, "past_len");
    IRIS_CHECK(n_kv > 0 && n_q % n_kv == 0, "attention_causal: ", n_q,
               " query heads are not a multiple of ", n_kv, " kv heads");
    const int64_t T = qkv.rows(), kvw = int64_t(n_kv) * hd, width = int64_t(n_q) * hd + 2 * kvw;
    const int64_t past = past_len.as<int32_t>()[0];
    IRIS_CHECK(past + T <= k_cache.rows(), "attention_causal: context exceeds the KV cache");
    IRIS_CHECK(out.rows() == T && out.cols() == int64_t(n_q) * hd, "attention_causal: out ",
               out.shape_str());
    const int group = n_q / n_kv;
    const float* p = qkv.as<float>();
    float* o = out.as<float>();
#pragma omp parallel if (T * (past + T) * n_q * hd > kParallelGrain)
    {
      std::vector<float> scores;
#pragma omp for collapse(2) schedule(dynamic)
      for (int64_t t = 0; t < T; ++t) {
        for (int h = 0; h < n_q; ++h) {
          const int64_t n_keys = past + t + 1;
          scores.resize(static_cast<size_t>(n_keys));
          const int g = h / group;
          attend(o + t * n_q * hd + int64_t(h) * hd, p + t * width + int64_t(h) * hd,
                 k_cache.as<float>() + int64_t(g) * hd, v_cache.as<float>() + int64_t(g) * hd, kvw,
                 0, n_keys, hd, scale, scores.data());
        }
      }
    }
  }

  void embedding(const Tensor& y, const Tensor& table, const Tensor& ids) override {
    check_f32(y, "embedding output");
    check_f32(table, "embedding table");
    check_i32(ids, "token ids");
    const int64_t T = ids.numel(), H = table.cols(), V = table.rows();
    IRIS_CHECK(y.rows() == T && y.cols() == H, "embedding: output ", y.shape_str());
    for (int64_t t = 0; t < T; ++t) {
      const int32_t id = ids.as<int32_t>()[t];
      IRIS_CHECK(id >= 0 && id < V, "token id ", id, " is outside the vocabulary of ", V);
      std::memcpy(y.as<float>() + t * H, table.as<float>() + int64_t(id) * H, H * sizeof(float));
    }
  }

  void scatter_rows(const Tensor& dst, const Tensor& src, const Tensor& index,
                    bool accumulate) override {
    check_f32(dst, "scatter destination");
    check_f32(src, "scatter source");
    check_i32(index, "scatter index");
    const int64_t N = index.numel(), H = dst.cols();
    IRIS_CHECK(src.rows() == N && src.cols() == H, "scatter_rows: ", N, " indices for source ",
               src.shape_str(), " into ", dst.shape_str());
    for (int64_t i = 0; i < N; ++i) {
      const int32_t r = index.as<int32_t>()[i];
      IRIS_CHECK(r >= 0 && r < dst.rows(), "scatter index ", r, " out of range");
      float* d = dst.as<float>() + int64_t(r) * H;
      const float* s = src.as<float>() + i * H;
      for (int64_t c = 0; c < H; ++c) d[c] = accumulate ? d[c] + s[c] : s[c];
    }
  }

  void add_interpolated_rows(const Tensor& y, const Tensor& table, const Tensor& index,
                             const Tensor& weight) override {
    check_f32(y, "interpolation output");
    check_f32(table, "position table");
    check_i32(index, "interpolation index");
    check_f32(weight, "interpolation weight");
    const int64_t S = y.rows(), D = y.cols();
    IRIS_CHECK(index.numel() == S * 4 && weight.numel() == S * 4 && table.cols() == D,
               "add_interpolated_rows: y ", y.shape_str(), " index ", index.shape_str());
    const int32_t* idx = index.as<int32_t>();
    const float* w = weight.as<float>();
#pragma omp parallel for schedule(static) if (S * D > kParallelGrain)
    for (int64_t s = 0; s < S; ++s) {
      float* yr = y.as<float>() + s * D;
      for (int64_t c = 0; c < D; ++c) {
        float acc = 0.0f;
        for (int k = 0; k < 4; ++k) acc += w[s * 4 + k] * table.as<float>()[idx[s * 4 + k] * D + c];
        yr[c] += acc;
      }
    }
  }

  void text_rope_tables(const Tensor& cos, const Tensor& sin, const Tensor& positions,
                        const std::vector<float>& inv_freq,
                        const std::vector<int>& pair_axis) override {
    check_cpu(cos, "text_rope_tables cos");
    check_cpu(sin, "text_rope_tables sin");
    check_cpu(positions, "text_rope_tables positions");
    check_text_rope_tables(cos, sin, positions, inv_freq, pair_axis, "text_rope_tables");
    text_rope_tables_host(cos.as<float>(), sin.as<float>(), positions.as<int32_t>(), cos.rows(),
                          cos.cols(), inv_freq, pair_axis);
  }

  void vision_tables(const Tensor& cos, const Tensor& sin, const Tensor& pos_index,
                     const Tensor& pos_weight, const Tensor& cu_seqlens, const Tensor& real_rows,
                     const Tensor& grids, const std::vector<float>& inv_freq, int merge_size,
                     int grid_side, const Tensor& window_cu, int window_units) override {
    check_f32(cos, "vision_tables cos");
    check_f32(sin, "vision_tables sin");
    check_i32(pos_index, "vision_tables pos_index");
    check_f32(pos_weight, "vision_tables pos_weight");
    check_i32(cu_seqlens, "vision_tables cu_seqlens");
    check_i32(real_rows, "vision_tables real_rows");
    check_i32(grids, "vision_tables grids");
    const int64_t R = cos.rows(), hd = cos.cols();
    const int64_t capacity = cu_seqlens.numel() - 1;
    IRIS_CHECK(sin.rows() == R && sin.cols() == hd && pos_index.numel() == R * 4 &&
                   pos_weight.numel() == R * 4 && real_rows.numel() == 1 && capacity >= 1 &&
                   capacity <= INT32_MAX && grids.numel() == vision_grids_numel(int(capacity)),
               "vision_tables: cos ", cos.shape_str(), ", sin ", sin.shape_str(), ", pos_index ",
               pos_index.shape_str(), ", pos_weight ", pos_weight.shape_str(), ", cu_seqlens ",
               cu_seqlens.shape_str(), ", real_rows ", real_rows.shape_str(), ", grids ",
               grids.shape_str(),
               " (expected [R, hd] twice, [R, 4] twice, [C + 1], [1], [1 + 3C])");
    VisionTablesOut out;
    out.cos = cos.as<float>();
    out.sin = sin.as<float>();
    out.pos_index = pos_index.as<int32_t>();
    out.pos_weight = pos_weight.as<float>();
    out.cu_seqlens = cu_seqlens.as<int32_t>();
    out.real_rows = real_rows.as<int32_t>();
    int window_capacity = 0;
    if (window_units > 0) {
      check_i32(window_cu, "vision_tables window_cu");
      window_capacity = static_cast<int>(window_cu.numel() - 1);
      out.window_cu = window_cu.as<int32_t>();
    }
    vision_tables_host(out, grids.as<int32_t>(), static_cast<int>(capacity), R,
                       static_cast<int>(hd), inv_freq, merge_size, grid_side, window_units,
                       window_capacity);
  }

  void image_patches(const Tensor& dst, const Tensor& frames, const Tensor& table,
                     const Tensor& dst_rows, const ImagePatchGeometry& g) override {
    check_f32(dst, "image_patches dst");
    check_cpu(frames, "image_patches frames");
    check_cpu(table, "image_patches table");
    check_cpu(dst_rows, "image_patches dst_rows");
    check_image_patches(dst, frames, table, dst_rows, g, "image_patches");
    const int32_t* rows = dst_rows.as<int32_t>();
    for (int64_t i = 0; i < g.patches(); ++i)
      IRIS_CHECK(rows[i] >= 0 && rows[i] < dst.rows(), "image_patches: patch ", i, " goes to row ",
                 rows[i], " of a destination of ", dst.rows());
    const auto* bytes = static_cast<const uint8_t*>(frames.data);
    const int64_t frame_bytes = int64_t{g.height} * g.width * 3;
    const bool one_frame = frames.numel() == frame_bytes;
    std::vector<const uint8_t*> slice;
    for (int f = 0; f < g.temporal_patch_size; ++f)
      slice.push_back(bytes + (one_frame ? 0 : f * frame_bytes));
    image_patches_host(dst.as<float>(), dst.cols(), slice.data(), g, table.as<float>(), rows);
  }

  void argmax_rows(const Tensor& out, const Tensor& x) override {
    check_i32(out, "argmax output");
    check_f32(x, "argmax input");
    const int64_t M = x.rows(), N = x.cols();
    for (int64_t m = 0; m < M; ++m) {
      const float* r = x.as<float>() + m * N;
      out.as<int32_t>()[m] = static_cast<int32_t>(std::max_element(r, r + N) - r);
    }
  }

  void moe_route(const Tensor& ids, const Tensor& weights, const Tensor& probs,
                 const Tensor& logits, int k, const Tensor& real_rows) override {
    check_f32(logits, "moe_route logits");
    check_i32(ids, "moe_route ids");
    check_f32(weights, "moe_route weights");
    const int64_t T = logits.rows(), E = logits.cols();
    check_moe_route_shapes(ids, weights, probs, logits, k, real_rows);
    if (probs.defined()) check_f32(probs, "moe_route probs");
    int64_t real = T;
    if (real_rows.defined()) {
      check_i32(real_rows, "moe_route real_rows");
      real = real_rows.as<int32_t>()[0];
    }
    cpu::moe_route(ids.as<int32_t>(), weights.as<float>(),
                   probs.defined() ? probs.as<float>() : nullptr, logits.as<float>(), T, E, k,
                   real);
  }

  void moe_capacity_drop(const Tensor& kept_ids, const Tensor& dropped, const Tensor& ids,
                         const Tensor& weights, int experts, int64_t capacity,
                         int policy) override {
    check_i32(kept_ids, "moe_capacity_drop kept_ids");
    check_i32(ids, "moe_capacity_drop ids");
    check_f32(weights, "moe_capacity_drop weights");
    check_moe_capacity_drop_shapes(kept_ids, dropped, ids, weights, experts, capacity, policy);
    if (dropped.defined()) check_i32(dropped, "moe_capacity_drop dropped");
    const int64_t n = cpu::moe_capacity_drop(kept_ids.as<int32_t>(), ids.as<int32_t>(),
                                             weights.as<float>(), ids.numel(), experts, capacity,
                                             policy == static_cast<int>(MoeDropPolicy::probs));
    if (dropped.defined()) dropped.as<int32_t>()[0] += static_cast<int32_t>(n);
  }

  void moe_dispatch(const Tensor& x_sorted, const Tensor& offsets, const Tensor& slot_rows,
                    const Tensor& x, const Tensor& ids, int64_t padded_capacity) override {
    check_f32(x_sorted, "moe_dispatch x_sorted");
    check_f32(x, "moe_dispatch x");
    check_i32(offsets, "moe_dispatch offsets");
    check_i32(slot_rows, "moe_dispatch slot_rows");
    check_i32(ids, "moe_dispatch ids");
    check_moe_dispatch_shapes(x_sorted, offsets, slot_rows, x, ids, padded_capacity);
    cpu::moe_dispatch(x_sorted.as<float>(), offsets.as<int32_t>(), slot_rows.as<int32_t>(),
                      x.as<float>(), ids.as<int32_t>(), ids.rows(), static_cast<int>(ids.cols()),
                      offsets.numel() - 1, x.cols(), padded_capacity);
  }

  void moe_grouped_linear(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& offsets,
                          int64_t rows_per_expert) override {
    check_f32(y, "moe_grouped_linear y");
    check_f32(x, "moe_grouped_linear x");
    check_f32(w, "moe_grouped_linear w");
    check_i32(offsets, "moe_grouped_linear offsets");
    check_moe_grouped_linear_shapes(y, x, w, offsets);
    check_offsets(offsets, x.rows(), "moe_grouped_linear");
    check_moe_rows_per_expert(x, w, rows_per_expert, "moe_grouped_linear");
    check_padded_offsets(offsets, rows_per_expert, "moe_grouped_linear");
    cpu::moe_grouped_linear(y.as<float>(), x.as<float>(), w.as<float>(), offsets.as<int32_t>(),
                            w.shape[0], w.shape[2], w.shape[1]);
  }

  void moe_combine(const Tensor& y, const Tensor& y_sorted, const Tensor& slot_rows,
                   const Tensor& weights, bool accumulate) override {
    check_f32(y, "moe_combine y");
    check_f32(y_sorted, "moe_combine y_sorted");
    check_i32(slot_rows, "moe_combine slot_rows");
    check_f32(weights, "moe_combine weights");
    check_moe_combine_shapes(y, y_sorted, slot_rows, weights);
    check_slot_rows(slot_rows, y_sorted.rows(), "moe_combine");
    cpu::moe_combine(y.as<float>(), y_sorted.as<float>(), slot_rows.as<int32_t>(),
                     weights.as<float>(), y.rows(), static_cast<int>(slot_rows.cols()), y.cols(),
                     accumulate);
  }

  void moe_combine_backward(const Tensor& dy_sorted, const Tensor& dweights, const Tensor& dy,
                            const Tensor& y_sorted, const Tensor& slot_rows,
                            const Tensor& weights) override {
    check_f32(dy_sorted, "moe_combine_backward dy_sorted");
    check_f32(dweights, "moe_combine_backward dweights");
    check_f32(dy, "moe_combine_backward dy");
    check_f32(y_sorted, "moe_combine_backward y_sorted");
    check_i32(slot_rows, "moe_combine_backward slot_rows");
    check_f32(weights, "moe_combine_backward weights");
    check_moe_combine_backward_shapes(dy_sorted, dweights, dy, y_sorted, slot_rows, weights);
    check_slot_rows(slot_rows, y_sorted.rows(), "moe_combine_backward");
    cpu::moe_combine_backward(dy_sorted.as<float>(), dweights.as<float>(), dy.as<float>(),
                              y_sorted.as<float>(), slot_rows.as<int32_t>(), weights.as<float>(),
                              dy.rows(), static_cast<int>(slot_rows.cols()), dy.cols());
  }

  void moe_grouped_linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy,
                                   const Tensor& x, const Tensor& w, const Tensor& offsets,
                                   int64_t rows_per_expert) override {
    check_f32(dx, "moe_grouped_linear_backward dx");
    check_f32(dy, "moe_grouped_linear_backward dy");
    check_f32(x, "moe_grouped_linear_backward x");
    check_f32(w, "moe_grouped_linear_backward w");
    check_i32(offsets, "moe_grouped_linear_backward offsets");
    check_moe_grouped_linear_shapes(dy, x, w, offsets);
    IRIS_CHECK(dx.rows() == x.rows() && dx.cols() == x.cols(), "moe_grouped_linear_backward: dx ",
               dx.shape_str(), " should be shaped as x ", x.shape_str());
    if (dw.defined()) {
      check_f32(dw, "moe_grouped_linear_backward dw");
      IRIS_CHECK(dw.numel() == w.numel(), "moe_grouped_linear_backward: dw ", dw.shape_str(),
                 " should be shaped as w ", w.shape_str());
    }
    check_offsets(offsets, x.rows(), "moe_grouped_linear_backward");
    check_moe_rows_per_expert(x, w, rows_per_expert, "moe_grouped_linear_backward");
    check_padded_offsets(offsets, rows_per_expert, "moe_grouped_linear_backward");
    cpu::moe_grouped_linear_backward(dx.as<float>(), dw.defined() ? dw.as<float>() : nullptr,
                                     dy.as<float>(), x.as<float>(), w.as<float>(),
                                     offsets.as<int32_t>(), w.shape[0], w.shape[1], w.shape[2]);
  }

  void moe_dispatch_backward(const Tensor& dx, const Tensor& dx_sorted,
                             const Tensor& slot_rows) override {
    check_f32(dx, "moe_dispatch_backward dx");
    check_f32(dx_sorted, "moe_dispatch_backward dx_sorted");
    check_i32(slot_rows, "moe_dispatch_backward slot_rows");
    check_moe_dispatch_backward_shapes(dx, dx_sorted, slot_rows);
    check_slot_rows(slot_rows, dx_sorted.rows(), "moe_dispatch_backward");
    cpu::moe_dispatch_backward(dx.as<float>(), dx_sorted.as<float>(), slot_rows.as<int32_t>(),
                               dx.rows(), static_cast<int>(slot_rows.cols()), dx.cols());
  }

  void moe_route_backward(const Tensor& dlogits, const Tensor& dweights, const Tensor& probs,
                          const Tensor& ids, const Tensor& aux_dprob) override {
    check_f32(dlogits, "moe_route_backward dlogits");
    check_f32(dweights, "moe_route_backward dweights");
    check_f32(probs, "moe_route_backward probs");
    check_i32(ids, "moe_route_backward ids");
    if (aux_dprob.defined()) check_f32(aux_dprob, "moe_route_backward aux_dprob");
    check_moe_route_backward_shapes(dlogits, dweights, probs, ids, aux_dprob);
    cpu::moe_route_backward(dlogits.as<float>(), dweights.as<float>(), probs.as<float>(),
                            ids.as<int32_t>(),
                            aux_dprob.defined() ? aux_dprob.as<float>() : nullptr, probs.rows(),
                            probs.cols(), static_cast<int>(ids.cols()));
  }

  void moe_route_stats(const Tensor& load, const Tensor& prob_sum, const Tensor& ids,
                       const Tensor& probs) override {
    check_f32(load, "moe_route_stats load");
    check_f32(prob_sum, "moe_route_stats prob_sum");
    check_i32(ids, "moe_route_stats ids");
    check_f32(probs, "moe_route_stats probs");
    check_moe_route_stats_shapes(load, prob_sum, ids, probs);
    cpu::moe_route_stats(load.as<float>(), prob_sum.as<float>(), ids.as<int32_t>(),
                         probs.as<float>(), probs.rows(), probs.cols(),
                         static_cast<int>(ids.cols()));
  }

  void moe_aux_loss(const Tensor& aux_sum, const Tensor& dprob, const Tensor& load,
                    const Tensor& prob_sum, const Tensor& real_rows, int layers,
                    float grad_scale) override {
    for (const Tensor* t : {&aux_sum, &dprob, &load, &prob_sum}) check_f32(*t, "moe_aux_loss");
    check_i32(real_rows, "moe_aux_loss real_rows");
    check_moe_aux_loss_shapes(aux_sum, dprob, load, prob_sum, real_rows, layers);
    cpu::moe_aux_loss(aux_sum.as<float>(), dprob.as<float>(), load.as<float>(),
                      prob_sum.as<float>(), load.numel(), real_rows.as<int32_t>()[0], layers,
                      grad_scale);
  }

  // ---- Training ops: the fp32 kernels of core/cpu/cpu_train_ops.h ----

  void convert(const Tensor& dst, const Tensor& src) override {
    check_f32(dst, "convert destination");
    check_f32(src, "convert source");
    copy(dst, src);
  }

  void linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w,
                             bool accumulate) override {
    check_f32(dx, "linear_backward_input dx");
    check_f32(dy, "linear_backward_input dy");
    check_f32(w, "linear_backward_input weight");
    const int64_t M = dy.rows(), N = dy.cols(), K = w.dim(1);
    IRIS_CHECK(w.ndim == 2 && w.dim(0) == N && dx.rows() == M && dx.cols() == K,
               "linear_backward_input: dy ", dy.shape_str(), ", weight ", w.shape_str(), ", dx ",
               dx.shape_str());
    IRIS_CHECK(dx.data != dy.data, "linear_backward_input: dx aliases dy");
    cpu::sgemm_xw(M, K, N, dy.as<float>(), w.as<float>(), dx.as<float>(), accumulate ? 1.0f : 0.0f);
  }

  void linear_backward_weight(const Tensor& dw, const Tensor& db, const Tensor& dy,
                              const Tensor& x) override {
    check_f32(dy, "linear_backward_weight dy");
    check_f32(x, "linear_backward_weight x");
    const int64_t M = dy.rows(), N = dy.cols(), K = x.cols();
    IRIS_CHECK(x.rows() == M, "linear_backward_weight: dy ", dy.shape_str(), " and x ",
               x.shape_str(), " differ in rows");
    if (dw.defined()) {
      check_f32(dw, "linear_backward_weight dw");
      IRIS_CHECK(dw.rows() == N && dw.cols() == K, "linear_backward_weight: dw ", dw.shape_str(),
                 " should be [", N, ", ", K, "]");
    }
    if (db.defined()) {
      check_f32(db, "linear_backward_weight db");
      IRIS_CHECK(db.numel() == N, "linear_backward_weight: db ", db.shape_str(), " should have ",
                 N);
    }
    train::linear_backward(nullptr, dw.defined() ? dw.as<float>() : nullptr,
                           db.defined() ? db.as<float>() : nullptr, dy.as<float>(), x.as<float>(),
                           nullptr, M, K, N, false);
  }

  void layer_norm_train(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                        const Tensor& w, const Tensor& b, float eps) override {
    for (const Tensor* t : {&y, &mean, &rstd, &x, &w, &b}) check_f32(*t, "layer_norm_train");
    const int64_t R = x.rows(), C = x.cols();
    check_rows_cols(y, R, C, "layer_norm_train output");
    IRIS_CHECK(mean.numel() == R && rstd.numel() == R && w.numel() == C && b.numel() == C,
               "layer_norm_train: statistics or weights do not match ", x.shape_str());
    IRIS_CHECK(y.data != x.data, "layer_norm_train: y aliases x");
    train::layernorm_forward(y.as<float>(), mean.as<float>(), rstd.as<float>(), x.as<float>(),
                             w.as<float>(), b.as<float>(), R, C, eps);
  }

  void layer_norm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                           const Tensor& x, const Tensor& mean, const Tensor& rstd,
                           const Tensor& w) override {
    for (const Tensor* t : {&dy, &x, &mean, &rstd, &w}) check_f32(*t, "layer_norm_backward");
    const int64_t R = x.rows(), C = x.cols();
    if (dx.defined()) check_rows_cols(dx, R, C, "layer_norm_backward dx");
    check_rows_cols(dy, R, C, "layer_norm_backward dy");
    check_opt_param_grad(dw, C, "layer_norm_backward dw");
    check_opt_param_grad(db, C, "layer_norm_backward db");
    train::layernorm_backward(opt(dx), opt(dw), opt(db), dy.as<float>(), x.as<float>(),
                              mean.as<float>(), rstd.as<float>(), w.as<float>(), R, C);
  }

  void rms_norm_train(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                      float eps) override {
    for (const Tensor* t : {&y, &rstd, &x, &w}) check_f32(*t, "rms_norm_train");
    const int64_t R = x.rows(), C = x.cols();
    check_rows_cols(y, R, C, "rms_norm_train output");
    IRIS_CHECK(rstd.numel() == R && w.numel() == C,
               "rms_norm_train: statistics or weight do not match ", x.shape_str());
    IRIS_CHECK(y.data != x.data, "rms_norm_train: y aliases x");
    train::rmsnorm_forward(y.as<float>(), rstd.as<float>(), x.as<float>(), w.as<float>(), R, C,
                           eps);
  }

  void rms_norm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x,
                         const Tensor& rstd, const Tensor& w) override {
    for (const Tensor* t : {&dy, &x, &rstd, &w}) check_f32(*t, "rms_norm_backward");
    const int64_t R = x.rows(), C = x.cols();
    if (dx.defined()) check_rows_cols(dx, R, C, "rms_norm_backward dx");
    check_rows_cols(dy, R, C, "rms_norm_backward dy");
    check_opt_param_grad(dw, C, "rms_norm_backward dw");
    train::rmsnorm_backward(opt(dx), opt(dw), dy.as<float>(), x.as<float>(), rstd.as<float>(),
                            w.as<float>(), R, C);
  }

  void qkv_norm_rope_train(const Tensor& out, const Tensor& rstd, const Tensor& in,
                           const Tensor& q_norm_w, const Tensor& k_norm_w, float eps,
                           const Tensor& cos, const Tensor& sin, int nq, int nkv, int hd,
                           bool /*round_tables: f32 is the compute dtype here*/) override {
    check_f32(out, "qkv_norm_rope_train output");
    check_f32(in, "qkv_norm_rope_train input");
    const int64_t T = in.rows();
    check_qkv_rope(in, cos, sin, nq, nkv, hd, "qkv_norm_rope_train");
    check_rows_cols(out, T, in.cols(), "qkv_norm_rope_train output");
    const bool norms = q_norm_w.defined();
    IRIS_CHECK(norms == k_norm_w.defined(), "qkv_norm_rope_train: give both q and k norms or none");
    if (norms) {
      check_f32(rstd, "qkv_norm_rope_train rstd");
      IRIS_CHECK(rstd.numel() == T * (nq + nkv) && q_norm_w.numel() == hd && k_norm_w.numel() == hd,
                 "qkv_norm_rope_train: rstd ", rstd.shape_str(), " or norm weights do not match");
      IRIS_CHECK(out.data != in.data, "qkv_norm_rope_train: out aliases in with q/k norms");
    }
    train::qk_norm_rope_forward(out.as<float>(), norms ? rstd.as<float>() : nullptr, in.as<float>(),
                                opt_in(q_norm_w), opt_in(k_norm_w), cos.as<float>(),
                                sin.as<float>(), T, nq, nkv, hd, eps);
  }

  void qkv_norm_rope_backward(const Tensor& din, const Tensor& dq_norm_w, const Tensor& dk_norm_w,
                              const Tensor& dout, const Tensor& in, const Tensor& rstd,
                              const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& cos,
                              const Tensor& sin, int nq, int nkv, int hd,
                              bool /*round_tables*/) override {
    check_f32(din, "qkv_norm_rope_backward din");
    check_f32(dout, "qkv_norm_rope_backward dout");
    const int64_t T = dout.rows();
    check_qkv_rope(dout, cos, sin, nq, nkv, hd, "qkv_norm_rope_backward");
    check_rows_cols(din, T, dout.cols(), "qkv_norm_rope_backward din");
    const bool norms = q_norm_w.defined();
    if (norms) {
      check_f32(in, "qkv_norm_rope_backward input");
      check_f32(rstd, "qkv_norm_rope_backward rstd");
      IRIS_CHECK(in.numel() == dout.numel() && rstd.numel() == T * (nq + nkv),
                 "qkv_norm_rope_backward: saved input or rstd do not match ", dout.shape_str());
    }
    check_opt_param_grad(dq_norm_w, hd, "qkv_norm_rope_backward dq_norm_w");
    check_opt_param_grad(dk_norm_w, hd, "qkv_norm_rope_backward dk_norm_w");
    train::qk_norm_rope_backward(
        din.as<float>(), opt(dq_norm_w), opt(dk_norm_w), dout.as<float>(),
        norms ? in.as<float>() : nullptr, norms ? rstd.as<float>() : nullptr, opt_in(q_norm_w),
        opt_in(k_norm_w), cos.as<float>(), sin.as<float>(), T, nq, nkv, hd);
  }

  void attention_train(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                       const Tensor& cu_seqlens, int n_segments, int nq, int nkv, int hd,
                       float scale, bool causal, const Tensor& real_rows) override {
    check_f32(out, "attention_train output");
    check_f32(lse, "attention_train lse");
    check_f32(qkv, "attention_train qkv");
    const int64_t T = qkv.rows();
    const int n_used = used_segments(cu_seqlens, n_segments, real_rows, T, "attention_train");
    IRIS_CHECK(qkv.cols() == int64_t(nq + 2 * nkv) * hd && out.rows() == T &&
                   out.cols() == int64_t(nq) * hd && lse.numel() == T * nq,
               "attention_train: qkv ", qkv.shape_str(), ", out ", out.shape_str(), ", lse ",
               lse.shape_str(), " do not match ", nq, "+2x", nkv, " heads of ", hd);
    train::attention_forward(out.as<float>(), lse.as<float>(), qkv.as<float>(), T, nq, nkv, hd,
                             scale, cu_seqlens.as<int32_t>(), n_used, causal);
  }

  void attention_backward(const Tensor& dqkv, const Tensor& dsum, const Tensor& dout,
                          const Tensor& out, const Tensor& lse, const Tensor& qkv,
                          const Tensor& cu_seqlens, int n_segments, int nq, int nkv, int hd,
                          float scale, bool causal, const Tensor& real_rows) override {
    for (const Tensor* t : {&dqkv, &dsum, &dout, &out, &lse, &qkv})
      check_f32(*t, "attention_backward");
    const int64_t T = qkv.rows();
    const int n_used = used_segments(cu_seqlens, n_segments, real_rows, T, "attention_backward");
    IRIS_CHECK(dqkv.numel() == qkv.numel() && dout.numel() == out.numel() &&
                   out.numel() == T * nq * hd && lse.numel() == T * nq && dsum.numel() == T * nq,
               "attention_backward: shapes do not match qkv ", qkv.shape_str());
    train::attention_backward(dqkv.as<float>(), dsum.as<float>(), dout.as<float>(), out.as<float>(),
                              lse.as<float>(), qkv.as<float>(), T, nq, nkv, hd, scale,
                              cu_seqlens.as<int32_t>(), n_used, causal);
  }

  void gelu_tanh_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) override {
    check_elementwise_backward(dx, dy, x, "gelu_tanh_backward");
    train::gelu_tanh_backward(dx.as<float>(), dy.as<float>(), x.as<float>(), x.numel());
  }
  void gelu_erf_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) override {
    check_elementwise_backward(dx, dy, x, "gelu_erf_backward");
    train::gelu_erf_backward(dx.as<float>(), dy.as<float>(), x.as<float>(), x.numel());
  }
  void quick_gelu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) override {
    check_elementwise_backward(dx, dy, x, "quick_gelu_backward");
    train::quick_gelu_backward(dx.as<float>(), dy.as<float>(), x.as<float>(), x.numel());
  }
  void swiglu_backward(const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up) override {
    for (const Tensor* t : {&dgate_up, &dy, &gate_up}) check_f32(*t, "swiglu_backward");
    const int64_t M = dy.rows(), I = dy.cols();
    check_rows_cols(gate_up, M, 2 * I, "swiglu_backward gate_up");
    check_rows_cols(dgate_up, M, 2 * I, "swiglu_backward dgate_up");
    train::swiglu_backward(dgate_up.as<float>(), dy.as<float>(), gate_up.as<float>(), M, I);
  }

  void embedding_backward(const Tensor& dtable, const Tensor& dy, const Tensor& ids,
                          int32_t skip_id) override {
    check_f32(dtable, "embedding_backward dtable");
    check_f32(dy, "embedding_backward dy");
    check_i32(ids, "embedding_backward ids");
    const int64_t T = ids.numel(), H = dtable.cols(), V = dtable.rows();
    check_rows_cols(dy, T, H, "embedding_backward dy");
    for (int64_t t = 0; t < T; ++t) {
      const int32_t id = ids.as<int32_t>()[t];
      IRIS_CHECK(id == skip_id || (id >= 0 && id < V), "embedding_backward: id ", id,
                 " outside the table of ", V, " rows");
    }
    train::embedding_backward(dtable.as<float>(), dy.as<float>(), ids.as<int32_t>(), T, H, skip_id);
  }

  void gather_rows(const Tensor& dst, const Tensor& src, const Tensor& index) override {
    check_f32(dst, "gather_rows destination");
    check_f32(src, "gather_rows source");
    check_i32(index, "gather_rows index");
    const int64_t N = index.numel(), H = src.cols();
    check_rows_cols(dst, N, H, "gather_rows destination");
    for (int64_t i = 0; i < N; ++i) {
      const int32_t r = index.as<int32_t>()[i];
      IRIS_CHECK(r >= 0 && r < src.rows(), "gather_rows: index ", r, " outside ", src.rows(),
                 " rows");
    }
    train::gather_rows(dst.as<float>(), src.as<float>(), index.as<int32_t>(), N, H);
  }

  void add_interpolated_rows_backward(const Tensor& dtable, const Tensor& dy, const Tensor& index,
                                      const Tensor& weight) override {
    check_f32(dtable, "add_interpolated_rows_backward dtable");
    check_f32(dy, "add_interpolated_rows_backward dy");
    check_i32(index, "add_interpolated_rows_backward index");
    check_f32(weight, "add_interpolated_rows_backward weight");
    const int64_t S = dy.rows(), D = dy.cols();
    IRIS_CHECK(dtable.cols() == D && index.numel() == 4 * S && weight.numel() == 4 * S,
               "add_interpolated_rows_backward: dtable ", dtable.shape_str(), ", dy ",
               dy.shape_str(), ", index ", index.shape_str());
    for (int64_t i = 0; i < 4 * S; ++i) {
      const int32_t r = index.as<int32_t>()[i];
      IRIS_CHECK(r >= 0 && r < dtable.rows(), "add_interpolated_rows_backward: index ", r,
                 " outside ", dtable.rows(), " rows");
    }
    train::pos_embed_backward(dtable.as<float>(), dy.as<float>(), index.as<int32_t>(),
                              weight.as<float>(), S, D);
  }

  size_t lm_head_loss_workspace_bytes(int64_t chunk_rows, int64_t hidden,
                                      int64_t vocab) const override {
    return static_cast<size_t>(train::lm_head_scratch_floats(chunk_rows, hidden, vocab)) *
           sizeof(float);
  }

  void lm_head_loss(const Tensor& loss_sum, const Tensor& dx, const Tensor& dw, const Tensor& x,
                    const Tensor& w, const Tensor& targets, const Tensor& grad_scale,
                    const Tensor& workspace, int64_t chunk_rows) override {
    check_f32(loss_sum, "lm_head_loss loss_sum");
    check_f32(x, "lm_head_loss rows");
    check_f32(w, "lm_head_loss weight");
    check_i32(targets, "lm_head_loss targets");
    check_cpu(workspace, "lm_head_loss workspace");
    const int64_t N = x.rows(), H = x.cols(), V = w.rows();
    IRIS_CHECK(w.cols() == H && targets.numel() == N && loss_sum.numel() == 1,
               "lm_head_loss: rows ", x.shape_str(), ", weight ", w.shape_str(), ", targets ",
               targets.shape_str());
    float scale = 0.0f;
    if (dx.defined()) {
      check_f32(dx, "lm_head_loss dx");
      check_f32(grad_scale, "lm_head_loss grad_scale");
      check_rows_cols(dx, N, H, "lm_head_loss dx");
      scale = grad_scale.as<float>()[0];
    }
    check_opt_param_grad(dw, V * H, "lm_head_loss dw");
    const auto floats = static_cast<int64_t>(workspace.nbytes() / sizeof(float));
    const double loss = train::lm_head_cross_entropy(
        dx.defined() ? dx.as<float>() : nullptr, dx.defined() ? opt(dw) : nullptr, x.as<float>(),
        w.as<float>(), targets.as<int32_t>(), N, H, V, scale, static_cast<float*>(workspace.data),
        floats, chunk_rows);
    loss_sum.as<float>()[0] += static_cast<float>(loss);
  }

  void grad_norm_clip(const Tensor& grad_stats, const Tensor& grads, const Tensor& spans,
                      const Tensor& hyper, float max_norm) override {
    check_f32(grad_stats, "grad_norm_clip grad_stats");
    check_f32(grads, "grad_norm_clip grads");
    const int64_t n = check_spans(spans, hyper, grads.numel(), "grad_norm_clip");
    const int64_t* sp = spans.as<int64_t>();
    const float* hp = hyper.as<float>();
    double ss = 0.0;
    for (int64_t i = 0; i < n; ++i)
      if (hp[2 * i + 1] != 0.0f)
        ss += train::sum_of_squares(grads.as<float>() + sp[3 * i], sp[3 * i + 1]);
    const double norm = std::sqrt(ss);
    // torch computes the clip coefficient in f32 from the f32 norm.
    float coef = max_norm > 0.0f ? max_norm / (static_cast<float>(norm) + 1e-6f) : 1.0f;
    if (!(coef < 1.0f)) coef = 1.0f;
    grad_stats.as<float>()[0] = static_cast<float>(norm);
    grad_stats.as<float>()[1] = coef;
  }

  void grad_sum_squares(const Tensor& sums, const Tensor& grads, const Tensor& spans,
                        const Tensor& hyper) override {
    check_f32(grads, "grad_sum_squares grads");
    const int64_t n = check_spans(spans, hyper, grads.numel(), "grad_sum_squares");
    check_cpu(sums, "grad_sum_squares sums");
    IRIS_CHECK(sums.dtype == DType::i64 && sums.numel() == n, "grad_sum_squares: sums ",
               sums.shape_str(), " should be i64 [", n, "]");
    const int64_t* sp = spans.as<int64_t>();
    const float* hp = hyper.as<float>();
    for (int64_t i = 0; i < n; ++i) {
      const double ss = hp[2 * i + 1] != 0.0f
                            ? train::sum_of_squares(grads.as<float>() + sp[3 * i], sp[3 * i + 1])
                            : 0.0;
      std::memcpy(sums.as<int64_t>() + i, &ss, sizeof(ss));
    }
  }

  void adamw_step(const Tensor& params, const Tensor& grads, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, const Tensor& weights, const Tensor& spans,
                  const Tensor& hyper, const Tensor& steps, const Tensor& lr,
                  const Tensor& grad_stats, float beta1, float beta2, float eps) override {
    for (const Tensor* t : {&params, &grads, &exp_avg, &exp_avg_sq, &lr, &grad_stats})
      check_f32(*t, "adamw_step");
    IRIS_CHECK(grads.numel() == params.numel() && exp_avg.numel() == params.numel() &&
                   exp_avg_sq.numel() == params.numel(),
               "adamw_step: flat buffers of different lengths");
    // A working copy (f32 here) is where the model reads weights that have no master of their
    // own: frozen parts, which the master weights (trainable tensors only) leave out.
    if (weights.defined()) check_f32(weights, "adamw_step working weights");
    const int64_t n = check_spans(spans, hyper, params.numel(), "adamw_step");
    check_cpu(steps, "adamw_step steps");
    IRIS_CHECK(steps.dtype == DType::i64 && steps.numel() == n, "adamw_step: steps ",
               steps.shape_str(), " should be i64 [", n, "]");
    const int64_t* sp = spans.as<int64_t>();
    const float* hp = hyper.as<float>();
    int64_t* st = steps.as<int64_t>();
    const float scheduled_lr = lr.as<float>()[0], clip_coef = grad_stats.as<float>()[1];
    if (!std::isfinite(grad_stats.as<float>()[0])) return;
    for (int64_t i = 0; i < n; ++i) {
      const float scale = hp[2 * i + 1];
      if (scale == 0.0f) continue;
      const int64_t off = sp[3 * i], len = sp[3 * i + 1];
      train::adamw_tensor(params.as<float>() + off, grads.as<float>() + off,
                          exp_avg.as<float>() + off, exp_avg_sq.as<float>() + off, len,
                          scheduled_lr, scale, hp[2 * i], ++st[i], clip_coef, beta1, beta2, eps);
      if (weights.defined()) {
        const int64_t at = sp[3 * i + 2];
        IRIS_CHECK(at >= 0 && at + len <= weights.numel(), "adamw_step: span ", i,
                   " lies outside the working weights");
        std::memcpy(weights.as<float>() + at, params.as<float>() + off,
                    static_cast<size_t>(len) * sizeof(float));
      }
    }
  }

 private:
  std::array<std::chrono::steady_clock::time_point, kTimingMarks> marks_{};
  std::array<bool, kTimingMarks> recorded_{};

  static float* opt(const Tensor& t) {
    return t.defined() ? t.as<float>() : nullptr;
  }
  static const float* opt_in(const Tensor& t) {
    return t.defined() ? t.as<float>() : nullptr;
  }

  static void check_rows_cols(const Tensor& t, int64_t rows, int64_t cols, const char* what) {
    IRIS_CHECK(t.rows() == rows && t.cols() == cols, what, " is ", t.shape_str(), ", expected [",
               rows, ", ", cols, "]");
  }
  static void check_opt_param_grad(const Tensor& g, int64_t n, const char* what) {
    if (!g.defined()) return;
    check_f32(g, what);
    IRIS_CHECK(g.numel() == n, what, " is ", g.shape_str(), ", expected ", n, " elements");
  }
  static void check_qkv_rope(const Tensor& qkv, const Tensor& cos, const Tensor& sin, int nq,
                             int nkv, int hd, const char* what) {
    check_f32(cos, what);
    check_f32(sin, what);
    IRIS_CHECK(hd % 2 == 0 && hd <= train::kMaxHeadDim &&
                   qkv.cols() == int64_t(nq + 2 * nkv) * hd && cos.numel() == qkv.rows() * hd &&
                   sin.numel() == qkv.rows() * hd,
               what, ": qkv ", qkv.shape_str(), " or tables ", cos.shape_str(), " do not match ",
               nq, "+2x", nkv, " heads of ", hd);
  }
  static void check_elementwise_backward(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                         const char* what) {
    for (const Tensor* t : {&dx, &dy, &x}) check_f32(*t, what);
    IRIS_CHECK(dx.numel() == x.numel() && dy.numel() == x.numel(), what, ": ", dx.shape_str(), " ",
               dy.shape_str(), " ", x.shape_str());
  }
  // Segments that hold real rows: those before the first that starts at or past real_rows[0].
  static int used_segments(const Tensor& cu, int n_segments, const Tensor& real_rows, int64_t T,
                           const char* what) {
    check_i32(cu, what);
    IRIS_CHECK(n_segments >= 0 && cu.numel() >= n_segments + 1, what, ": cu_seqlens ",
               cu.shape_str(), " for ", n_segments, " segments");
    const int32_t* c = cu.as<int32_t>();
    IRIS_CHECK(c[0] == 0 && c[n_segments] <= T, what,
               ": cu_seqlens must start at 0 and end by row ", T);
    int n = n_segments;
    if (real_rows.defined()) {
      check_i32(real_rows, what);
      const int32_t real = real_rows.as<int32_t>()[0];
      n = 0;
      while (n < n_segments && c[n] < real) ++n;
    }
    return n;
  }
  static int64_t check_spans(const Tensor& spans, const Tensor& hyper, int64_t flat,
                             const char* what) {
    check_cpu(spans, what);
    check_f32(hyper, what);
    IRIS_CHECK(spans.dtype == DType::i64 && spans.cols() == 3 && hyper.cols() == 2 &&
                   hyper.rows() == spans.rows(),
               what, ": spans ", spans.shape_str(), " should be i64 [n, 3] and hyper f32 [n, 2]");
    const int64_t n = spans.rows();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t off = spans.as<int64_t>()[3 * i], len = spans.as<int64_t>()[3 * i + 1];
      IRIS_CHECK(off >= 0 && len >= 0 && off + len <= flat, what, ": tensor ", i, " spans [", off,
                 ", ", off + len, ") outside the flat buffer of ", flat);
    }
    return n;
  }

  template <typename F>
  void unary(const Tensor& y, const Tensor& x, F f) {
    check_f32(y, "activation output");
    check_f32(x, "activation input");
    IRIS_CHECK(y.numel() == x.numel(), "activation: ", x.shape_str(), " -> ", y.shape_str());
    const float* xp = x.as<float>();
    float* yp = y.as<float>();
    const int64_t n = x.numel();
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
    for (int64_t i = 0; i < n; ++i) yp[i] = f(xp[i]);
  }

  // One query against keys/values rows [b, e) of a strided buffer; softmax in f32 (double sum).
  static void attend(float* out, const float* q, const float* k, const float* v, int64_t stride,
                     int64_t b, int64_t e, int hd, float scale, float* scores) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = b; j < e; ++j) {
      const float* kr = k + j * stride;
      float dot = 0.0f;
      for (int d = 0; d < hd; ++d) dot += q[d] * kr[d];
      scores[j - b] = dot * scale;
      mx = std::max(mx, scores[j - b]);
    }
    double sum = 0.0;
    for (int64_t j = b; j < e; ++j) {
      scores[j - b] = std::exp(scores[j - b] - mx);
      sum += scores[j - b];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int d = 0; d < hd; ++d) out[d] = 0.0f;
    for (int64_t j = b; j < e; ++j) {
      const float pj = scores[j - b] * inv;
      const float* vr = v + j * stride;
      for (int d = 0; d < hd; ++d) out[d] += pj * vr[d];
    }
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() {
  return std::make_unique<TapingBackend>(std::make_unique<CpuBackend>());
}

std::unique_ptr<Backend> make_backend(const std::string& spec) {
  if (spec == "cpu") return make_cpu_backend();
  if (spec == "cuda") return make_cuda_backend(0);
  if (spec.rfind("cuda:", 0) == 0) {
    const std::string idx = spec.substr(5);
    IRIS_CHECK(!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos,
               "bad device '", spec, "': use cpu, cuda or cuda:N");
    return make_cuda_backend(std::stoi(idx));
  }
  IRIS_FAIL("unknown device '", spec, "': use cpu, cuda or cuda:N");
}

#ifndef IRIS_WITH_CUDA
bool cuda_available() {
  return false;
}
std::unique_ptr<Backend> make_cuda_backend(int) {
  IRIS_FAIL(
      "this Iris build has no CUDA backend (nvcc was not found at configure time); "
      "rebuild on a machine with the CUDA toolkit or use --device cpu");
}
#endif

}  // namespace iris
