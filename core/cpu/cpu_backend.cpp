// The fp32 CPU reference backend: the oracle every other backend is checked against, and the
// backend CI runs end to end. Written for clarity first; OpenMP over rows/heads for speed.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "core/backend.h"
#include "core/cpu/cpu_gemm.h"

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

float gelu_tanh_f(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * x * (1.0f + std::tanh(k * (x + 0.044715f * x * x * x)));
}

float gelu_erf_f(float x) {
  return 0.5f * x * (1.0f + std::erf(x * 0.7071067811865476f));
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

  void gelu_tanh(const Tensor& y, const Tensor& x) override {
    unary(y, x, gelu_tanh_f);
  }
  void gelu_erf(const Tensor& y, const Tensor& x) override {
    unary(y, x, gelu_erf_f);
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

  void argmax_rows(const Tensor& out, const Tensor& x) override {
    check_i32(out, "argmax output");
    check_f32(x, "argmax input");
    const int64_t M = x.rows(), N = x.cols();
    for (int64_t m = 0; m < M; ++m) {
      const float* r = x.as<float>() + m * N;
      out.as<int32_t>()[m] = static_cast<int32_t>(std::max_element(r, r + N) - r);
    }
  }

 private:
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
  return std::make_unique<CpuBackend>();
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
