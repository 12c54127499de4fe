#include "core/cpu/cpu_train_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <omp.h>

#if defined(__x86_64__) || defined(__SSE2__)
#include <immintrin.h>
#endif

#include "core/cpu/cpu_gemm.h"
#include "core/error.h"

namespace iris::train {
namespace {

// Reductions over rows into a per-column result (weight and bias gradients) are split by column
// blocks, so every output element is summed by one thread in row order: deterministic, no
// atomics, no per-thread partial buffers.
constexpr int64_t kColumnBlock = 16;
// Below this much work (elements, or multiply-adds for attention) a loop runs on one thread: a
// parallel region costs barriers, and on a loaded machine a barrier waits for a descheduled
// thread (the tiny model's step was 10x slower with 2 threads than with 1 on 2 busy cores).
constexpr int64_t kParallelGrain = int64_t(1) << 16;
constexpr int kMaxThreads = 256;
constexpr int64_t kAlignFloats = 16;  // a 64-byte cache line

template <typename F>
void for_column_blocks(int64_t R, int64_t C, F f) {
  const int64_t nb = (C + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (R * C > kParallelGrain)
  for (int64_t b = 0; b < nb; ++b) f(b * kColumnBlock, std::min(C, (b + 1) * kColumnBlock));
}

void column_sums_accumulate(float* out, const float* x, int64_t R, int64_t C) {
  for_column_blocks(R, C, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + r * C;
      for (int64_t c = c0; c < c1; ++c) out[c] += xr[c];
    }
  });
}

// Eight partial sums: the compiler keeps them in one vector register instead of a chain of n
// dependent adds (attention takes a head_dim-long dot per query-key pair).
float dot(const float* a, const float* b, int n) {
  float part[8] = {};
  int d = 0;
  for (; d + 8 <= n; d += 8)
    for (int k = 0; k < 8; ++k) part[k] += a[d + k] * b[d + k];
  float s =
      ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// x = exp(x) in place for x <= 0 (vectorised where the CPU has AVX2 and FMA).
void exp_nonpositive_inplace(float* x, int64_t n);

// Per-thread scratch for one query's (or key's) scores: grown to the longest segment once, then
// reused, so steady-state steps allocate nothing.
float* score_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// The segment holding row i, or -1 past the last one (cu is non-decreasing).
int segment_of(const int32_t* cu, int n_segments, int64_t i) {
  if (i >= cu[n_segments]) return -1;
  const int32_t* it = std::upper_bound(cu, cu + n_segments + 1, static_cast<int32_t>(i));
  return static_cast<int>(it - cu) - 1;
}

void check_attention_args(int nq, int nkv, int hd, const int32_t* cu, int n_segments, int64_t T) {
  IRIS_CHECK(nkv > 0 && nq % nkv == 0, "attention: ", nq, " query heads are not a multiple of ",
             nkv, " kv heads");
  IRIS_CHECK(hd > 0 && hd <= kMaxHeadDim, "attention: head_dim ", hd, " outside [1, ", kMaxHeadDim,
             "]");
  IRIS_CHECK(n_segments >= 0 && cu[0] == 0 && cu[n_segments] <= T,
             "attention: cu_seqlens must start at 0 and end at most at the ", T, " rows");
  for (int s = 0; s < n_segments; ++s)
    IRIS_CHECK(cu[s] <= cu[s + 1], "attention: cu_seqlens must be non-decreasing");
}

// Rotate-half RoPE on one head and its exact adjoint (the transpose of the rotation).
void rope_head(float* h, const float* c, const float* s, int hd) {
  const int half = hd / 2;
  for (int i = 0; i < half; ++i) {
    const float a = h[i], b = h[i + half];
    h[i] = a * c[i] - b * s[i];
    h[i + half] = b * c[i + half] + a * s[i + half];
  }
}

void rope_head_backward(float* g, const float* dy, const float* c, const float* s, int hd) {
  const int half = hd / 2;
  for (int i = 0; i < half; ++i) {
    const float da = dy[i], db = dy[i + half];
    g[i] = da * c[i] + db * s[i + half];
    g[i + half] = db * c[i + half] - da * s[i];
  }
}

// The same rounding steps as the CPU backend's rms_norm_row (f64 sum of squares, f32 rsqrt).
float rms_rstd(const float* x, int64_t n, float eps) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  return 1.0f / std::sqrt(static_cast<float>(ss / double(n)) + eps);
}

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluTanhC = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

}  // namespace

// ---- Linear ------------------------------------------------------------------------------------

void linear_forward(float* y, const float* x, const float* w, const float* bias, int64_t M,
                    int64_t K, int64_t N, bool accumulate) {
  cpu::sgemm_xwt(M, N, K, x, w, y, accumulate ? 1.0f : 0.0f);
  if (bias) {
#pragma omp parallel for schedule(static) if (M * N > kParallelGrain)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
  }
}

void linear_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                     const float* w, int64_t M, int64_t K, int64_t N, bool accumulate_dx) {
  if (dx) cpu::sgemm_xw(M, K, N, dy, w, dx, accumulate_dx ? 1.0f : 0.0f);
  if (dw) cpu::sgemm_xtw(N, K, M, dy, x, dw, 1.0f);
  if (db) column_sums_accumulate(db, dy, M, N);
}

// ---- LayerNorm ---------------------------------------------------------------------------------

void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t R, int64_t C, float eps) {
#pragma omp parallel for schedule(static) if (R * C > kParallelGrain)
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * C;
    double mu = 0.0;
    for (int64_t i = 0; i < C; ++i) mu += xr[i];
    mu /= double(C);
    double var = 0.0;
    for (int64_t i = 0; i < C; ++i) var += (xr[i] - mu) * (xr[i] - mu);
    var /= double(C);
    const float m = static_cast<float>(mu);
    const float rs = 1.0f / std::sqrt(static_cast<float>(var) + eps);
    mean[r] = m;
    rstd[r] = rs;
    float* yr = y + r * C;
    for (int64_t i = 0; i < C; ++i) yr[i] = (xr[i] - m) * rs * w[i] + b[i];
  }
}

void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                        const float* mean, const float* rstd, const float* w, int64_t R,
                        int64_t C) {
  if (dx) {
#pragma omp parallel for schedule(static) if (R * C > kParallelGrain)
    for (int64_t r = 0; r < R; ++r) {
      const float *xr = x + r * C, *gr = dy + r * C;
      const float m = mean[r], rs = rstd[r];
      double sum_g = 0.0, sum_gx = 0.0;
      for (int64_t i = 0; i < C; ++i) {
        const float g = gr[i] * w[i];
        sum_g += g;
        sum_gx += double(g) * double((xr[i] - m) * rs);
      }
      const float mg = static_cast<float>(sum_g / double(C));
      const float mgx = static_cast<float>(sum_gx / double(C));
      float* dr = dx + r * C;
      for (int64_t i = 0; i < C; ++i) {
        const float xhat = (xr[i] - m) * rs;
        dr[i] += rs * (gr[i] * w[i] - mg - xhat * mgx);
      }
    }
  }
  if (dw || db) {
    for_column_blocks(R, C, [&](int64_t c0, int64_t c1) {
      for (int64_t r = 0; r < R; ++r) {
        const float *xr = x + r * C, *gr = dy + r * C;
        for (int64_t c = c0; c < c1; ++c) {
          if (dw) dw[c] += gr[c] * ((xr[c] - mean[r]) * rstd[r]);
          if (db) db[c] += gr[c];
        }
      }
    });
  }
}

// ---- RMSNorm -----------------------------------------------------------------------------------

void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t R, int64_t C,
                     float eps) {
#pragma omp parallel for schedule(static) if (R * C > kParallelGrain)
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = x + r * C;
    const float rs = rms_rstd(xr, C, eps);
    rstd[r] = rs;
    float* yr = y + r * C;
    for (int64_t i = 0; i < C; ++i) yr[i] = xr[i] * rs * w[i];
  }
}

void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* rstd,
                      const float* w, int64_t R, int64_t C) {
  if (dx) {
#pragma omp parallel for schedule(static) if (R * C > kParallelGrain)
    for (int64_t r = 0; r < R; ++r) {
      const float *xr = x + r * C, *gr = dy + r * C;
      const float rs = rstd[r];
      double sum_gx = 0.0;
      for (int64_t i = 0; i < C; ++i) sum_gx += double(gr[i] * w[i]) * double(xr[i] * rs);
      const float mgx = static_cast<float>(sum_gx / double(C));
      float* dr = dx + r * C;
      for (int64_t i = 0; i < C; ++i) dr[i] += rs * (gr[i] * w[i] - xr[i] * rs * mgx);
    }
  }
  if (dw) {
    for_column_blocks(R, C, [&](int64_t c0, int64_t c1) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = c0; c < c1; ++c) dw[c] += dy[r * C + c] * (x[r * C + c] * rstd[r]);
    });
  }
}

// ---- q/k norm + RoPE ---------------------------------------------------------------------------

void qk_norm_rope_forward(float* out, float* rstd, const float* in, const float* qn,
                          const float* kn, const float* cos, const float* sin, int64_t T, int nq,
                          int nkv, int hd, float eps) {
  IRIS_CHECK(hd % 2 == 0 && hd <= kMaxHeadDim, "rope: head_dim ", hd,
             " must be even and <= ", kMaxHeadDim);
  IRIS_CHECK((qn == nullptr && kn == nullptr) || rstd != nullptr,
             "qk_norm_rope_forward: q/k norms need an rstd buffer");
  IRIS_CHECK(out != in || (qn == nullptr && kn == nullptr),
             "qk_norm_rope_forward: out may alias in only without q/k norms (the backward needs "
             "the un-normalised input)");
  const int nh = nq + nkv;
  const int64_t width = int64_t(nq + 2 * nkv) * hd;
#pragma omp parallel for schedule(static) if (T * width > kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos + t * hd;
    const float* s = sin + t * hd;
    for (int h = 0; h < nh; ++h) {
      const float* xi = in + t * width + int64_t(h) * hd;
      float* yo = out + t * width + int64_t(h) * hd;
      const float* nw = h < nq ? qn : kn;
      if (nw) {
        const float rs = rms_rstd(xi, hd, eps);
        rstd[t * nh + h] = rs;
        for (int i = 0; i < hd; ++i) yo[i] = xi[i] * rs * nw[i];
      } else if (yo != xi) {
        std::memcpy(yo, xi, sizeof(float) * hd);
      }
      rope_head(yo, c, s, hd);
    }
    if (out != in)
      std::memcpy(out + t * width + int64_t(nh) * hd, in + t * width + int64_t(nh) * hd,
                  sizeof(float) * nkv * hd);
  }
}

void qk_norm_rope_backward(float* din, float* dqn, float* dkn, const float* dout, const float* in,
                           const float* rstd, const float* qn, const float* kn, const float* cos,
                           const float* sin, int64_t T, int nq, int nkv, int hd) {
  const int nh = nq + nkv;
  const int64_t width = int64_t(nq + 2 * nkv) * hd;
  // Weight gradients first: when din aliases dout the rotated gradient is gone afterwards. They
  // are tiny ([hd]) sums over T * heads, kept serial for a fixed summation order.
  if ((dqn && qn) || (dkn && kn)) {
    float g[kMaxHeadDim];
    for (int64_t t = 0; t < T; ++t) {
      for (int h = 0; h < nh; ++h) {
        float* dw = h < nq ? dqn : dkn;
        const float* nw = h < nq ? qn : kn;
        if (!dw || !nw) continue;
        rope_head_backward(g, dout + t * width + int64_t(h) * hd, cos + t * hd, sin + t * hd, hd);
        const float* xi = in + t * width + int64_t(h) * hd;
        const float rs = rstd[t * nh + h];
        for (int i = 0; i < hd; ++i) dw[i] += g[i] * (xi[i] * rs);
      }
    }
  }
#pragma omp parallel for schedule(static) if (T * width > kParallelGrain)
  for (int64_t t = 0; t < T; ++t) {
    float g[kMaxHeadDim];
    for (int h = 0; h < nh; ++h) {
      const float* dy = dout + t * width + int64_t(h) * hd;
      float* dx = din + t * width + int64_t(h) * hd;
      rope_head_backward(g, dy, cos + t * hd, sin + t * hd, hd);
      const float* nw = h < nq ? qn : kn;
      if (!nw) {
        std::memcpy(dx, g, sizeof(float) * hd);
        continue;
      }
      const float* xi = in + t * width + int64_t(h) * hd;
      const float rs = rstd[t * nh + h];
      double sum_gx = 0.0;
      for (int i = 0; i < hd; ++i) sum_gx += double(g[i] * nw[i]) * double(xi[i] * rs);
      const float mgx = static_cast<float>(sum_gx / double(hd));
      for (int i = 0; i < hd; ++i) dx[i] = rs * (g[i] * nw[i] - xi[i] * rs * mgx);
    }
    if (din != dout)
      std::memcpy(din + t * width + int64_t(nh) * hd, dout + t * width + int64_t(nh) * hd,
                  sizeof(float) * nkv * hd);
  }
}

// ---- Attention ---------------------------------------------------------------------------------

namespace {

// Scratch of one thread for the GEMM attention of one (segment, head): the [n, n] scores and
// their gradient, and the segment's rows of q, k, v, dout and the gradients, made contiguous.
struct SegmentScratch {
  std::vector<float> scores, dscores, q, k, v, dout, o, dk, dv;
  void reserve(int64_t n, int hd) {
    const auto nn = static_cast<size_t>(n * n), nh = static_cast<size_t>(n * hd);
    for (auto* b : {&scores, &dscores})
      if (b->size() < nn) b->resize(nn);
    for (auto* b : {&q, &k, &v, &dout, &o, &dk, &dv})
      if (b->size() < nh) b->resize(nh);
  }
};
SegmentScratch& segment_scratch() {
  thread_local SegmentScratch s;
  return s;
}

// Copies rows [b, b + n) of one head (hd columns at column offset col, row stride `stride`) into
// dst[n, hd], and back.
void gather_head(float* dst, const float* src, int64_t b, int64_t n, int64_t stride, int64_t col,
                 int hd) {
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(dst + i * hd, src + (b + i) * stride + col, sizeof(float) * hd);
}
void scatter_head(float* dst, const float* src, int64_t b, int64_t n, int64_t stride, int64_t col,
                  int hd) {
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(dst + (b + i) * stride + col, src + i * hd, sizeof(float) * hd);
}

// The columns row i of a segment attends to.
int64_t attended(int64_t i, int64_t n, bool causal) {
  return causal ? i + 1 : n;
}

// dsum[i,h] = sum_j p_ij dp_ij = dout_i . out_i: the softmax backward's row term.
void softmax_row_terms(float* dsum, const float* dout, const float* out, int64_t T, int nq,
                       int hd) {
  const int64_t D = int64_t(nq) * hd;
#pragma omp parallel for schedule(static) if (T * D > kParallelGrain)
  for (int64_t i = 0; i < T; ++i)
    for (int h = 0; h < nq; ++h)
      dsum[i * nq + h] = dot(dout + i * D + int64_t(h) * hd, out + i * D + int64_t(h) * hd, hd);
}

bool segments_fit_gemm(const int32_t* cu, int n_segments) {
  for (int s = 0; s < n_segments; ++s)
    if (cu[s + 1] - cu[s] > kAttentionGemmMaxSegment) return false;
  return true;
}

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t T, int nq, int nkv, int hd,
                       float scale, const int32_t* cu, int n_segments, bool causal) {
  check_attention_args(nq, nkv, hd, cu, n_segments, T);
  if (!segments_fit_gemm(cu, n_segments)) {
    attention_forward_by_rows(out, lse, qkv, T, nq, nkv, hd, scale, cu, n_segments, causal);
    return;
  }
  const int group = nq / nkv;
  const int64_t width = int64_t(nq + 2 * nkv) * hd, D = int64_t(nq) * hd;
  const int64_t koff = D, voff = D + int64_t(nkv) * hd;
  const int64_t pairs = int64_t(n_segments) * nq;
  const bool parallel = pairs > 1 && cu[n_segments] * T * hd > kParallelGrain;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t sh = 0; sh < pairs; ++sh) {
    const int seg = static_cast<int>(sh / nq), h = static_cast<int>(sh % nq), g = h / group;
    const int64_t b = cu[seg], n = cu[seg + 1] - b;
    if (n == 0) continue;
    SegmentScratch& w = segment_scratch();
    w.reserve(n, hd);
    float* S = w.scores.data();
    gather_head(w.q.data(), qkv, b, n, width, int64_t(h) * hd, hd);
    gather_head(w.k.data(), qkv, b, n, width, koff + int64_t(g) * hd, hd);
    gather_head(w.v.data(), qkv, b, n, width, voff + int64_t(g) * hd, hd);
    cpu::sgemm_xwt(n, n, hd, w.q.data(), w.k.data(), S, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      float* p = S + i * n;
      const int64_t m = attended(i, n, causal);
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < m; ++j) {
        p[j] *= scale;
        mx = std::max(mx, p[j]);
      }
      for (int64_t j = 0; j < m; ++j) p[j] -= mx;
      exp_nonpositive_inplace(p, m);
      double sum = 0.0;
      for (int64_t j = 0; j < m; ++j) sum += p[j];
      const float inv = static_cast<float>(1.0 / sum);
      for (int64_t j = 0; j < m; ++j) p[j] *= inv;
      std::fill(p + m, p + n, 0.0f);
      lse[(b + i) * nq + h] = mx + static_cast<float>(std::log(sum));
    }
    cpu::sgemm_xw(n, hd, n, S, w.v.data(), w.o.data(), 0.0f);
    scatter_head(out, w.o.data(), b, n, D, int64_t(h) * hd, hd);
  }
  // Rows past the last segment take part in nothing.
  for (int64_t r = cu[n_segments]; r < T; ++r) {
    std::fill(out + r * D, out + (r + 1) * D, 0.0f);
    std::fill(lse + r * nq, lse + (r + 1) * nq, 0.0f);
  }
}

void attention_backward(float* dqkv, float* dsum, const float* dout, const float* out,
                        const float* lse, const float* qkv, int64_t T, int nq, int nkv, int hd,
                        float scale, const int32_t* cu, int n_segments, bool causal) {
  check_attention_args(nq, nkv, hd, cu, n_segments, T);
  if (!segments_fit_gemm(cu, n_segments)) {
    attention_backward_by_rows(dqkv, dsum, dout, out, lse, qkv, T, nq, nkv, hd, scale, cu,
                               n_segments, causal);
    return;
  }
  const int group = nq / nkv;
  const int64_t width = int64_t(nq + 2 * nkv) * hd, D = int64_t(nq) * hd;
  const int64_t koff = D, voff = D + int64_t(nkv) * hd;
  softmax_row_terms(dsum, dout, out, T, nq, hd);
  // One task per (segment, kv head): the query heads of a group add into the same dk and dv, so
  // they run in order on one thread.
  const int64_t pairs = int64_t(n_segments) * nkv;
  const bool parallel = pairs > 1 && cu[n_segments] * T * hd > kParallelGrain;
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t sg = 0; sg < pairs; ++sg) {
    const int seg = static_cast<int>(sg / nkv), g = static_cast<int>(sg % nkv);
    const int64_t b = cu[seg], n = cu[seg + 1] - b;
    if (n == 0) continue;
    SegmentScratch& w = segment_scratch();
    w.reserve(n, hd);
    float *P = w.scores.data(), *dS = w.dscores.data();
    float *dk = w.dk.data(), *dv = w.dv.data();
    gather_head(w.k.data(), qkv, b, n, width, koff + int64_t(g) * hd, hd);
    gather_head(w.v.data(), qkv, b, n, width, voff + int64_t(g) * hd, hd);
    for (int h = g * group; h < (g + 1) * group; ++h) {
      const float beta = h == g * group ? 0.0f : 1.0f;
      gather_head(w.q.data(), qkv, b, n, width, int64_t(h) * hd, hd);
      gather_head(w.dout.data(), dout, b, n, D, int64_t(h) * hd, hd);
      cpu::sgemm_xwt(n, n, hd, w.q.data(), w.k.data(), P, 0.0f);
      cpu::sgemm_xwt(n, n, hd, w.dout.data(), w.v.data(), dS, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        float* p = P + i * n;
        float* ds = dS + i * n;
        const int64_t m = attended(i, n, causal);
        const float l = lse[(b + i) * nq + h], ds0 = dsum[(b + i) * nq + h];
        for (int64_t j = 0; j < m; ++j) p[j] = p[j] * scale - l;
        exp_nonpositive_inplace(p, m);
        for (int64_t j = 0; j < m; ++j) ds[j] = p[j] * (ds[j] - ds0) * scale;
        std::fill(p + m, p + n, 0.0f);
        std::fill(ds + m, ds + n, 0.0f);
      }
      // dk and dv first: dq = dS k then overwrites q's scratch, which dk reads.
      cpu::sgemm_xtw(n, hd, n, dS, w.q.data(), dk, beta);
      cpu::sgemm_xtw(n, hd, n, P, w.dout.data(), dv, beta);
      cpu::sgemm_xw(n, hd, n, dS, w.k.data(), w.q.data(), 0.0f);
      scatter_head(dqkv, w.q.data(), b, n, width, int64_t(h) * hd, hd);
    }
    scatter_head(dqkv, dk, b, n, width, koff + int64_t(g) * hd, hd);
    scatter_head(dqkv, dv, b, n, width, voff + int64_t(g) * hd, hd);
  }
  // Rows past the last segment take part in nothing.
  for (int64_t r = cu[n_segments]; r < T; ++r) {
    float* row = dqkv + r * width;
    std::fill(row, row + width, 0.0f);
  }
}

void attention_forward_by_rows(float* out, float* lse, const float* qkv, int64_t T, int nq, int nkv,
                               int hd, float scale, const int32_t* cu, int n_segments,
                               bool causal) {
  check_attention_args(nq, nkv, hd, cu, n_segments, T);
  const int group = nq / nkv;
  const int64_t width = int64_t(nq + 2 * nkv) * hd, D = int64_t(nq) * hd;
  const int64_t koff = D, voff = D + int64_t(nkv) * hd;
#pragma omp parallel for collapse(2) schedule(dynamic, 4) if (T * T * nq * hd > kParallelGrain)
  for (int64_t i = 0; i < T; ++i) {
    for (int h = 0; h < nq; ++h) {
      float* o = out + i * D + int64_t(h) * hd;
      const int seg = segment_of(cu, n_segments, i);
      if (seg < 0) {
        std::fill(o, o + hd, 0.0f);
        lse[i * nq + h] = 0.0f;
        continue;
      }
      const int64_t b = cu[seg], e = causal ? i + 1 : cu[seg + 1];
      const float* q = qkv + i * width + int64_t(h) * hd;
      const int64_t g = h / group;
      // Scores of the whole segment row, then one vectorised exp and the weighted sum of V.
      float* p = score_scratch(e - b);
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = b; j < e; ++j) {
        p[j - b] = dot(q, qkv + j * width + koff + g * hd, hd) * scale;
        mx = std::max(mx, p[j - b]);
      }
      for (int64_t j = b; j < e; ++j) p[j - b] -= mx;
      exp_nonpositive_inplace(p, e - b);
      float acc[kMaxHeadDim] = {};
      double sum = 0.0;
      for (int64_t j = b; j < e; ++j) {
        const float pj = p[j - b];
        sum += pj;
        const float* vr = qkv + j * width + voff + g * hd;
        for (int d = 0; d < hd; ++d) acc[d] += pj * vr[d];
      }
      const float inv = static_cast<float>(1.0 / sum);
      for (int d = 0; d < hd; ++d) o[d] = acc[d] * inv;
      lse[i * nq + h] = mx + static_cast<float>(std::log(sum));
    }
  }
}

void attention_backward_by_rows(float* dqkv, float* dsum, const float* dout, const float* out,
                                const float* lse, const float* qkv, int64_t T, int nq, int nkv,
                                int hd, float scale, const int32_t* cu, int n_segments,
                                bool causal) {
  check_attention_args(nq, nkv, hd, cu, n_segments, T);
  const int group = nq / nkv;
  const int64_t width = int64_t(nq + 2 * nkv) * hd, D = int64_t(nq) * hd;
  const int64_t koff = D, voff = D + int64_t(nkv) * hd;
  softmax_row_terms(dsum, dout, out, T, nq, hd);

  // Two passes (as FlashAttention-2's backward): queries own dq, keys own dk and dv, so no two
  // threads write the same gradient and the probabilities are recomputed from lse.
#pragma omp parallel for collapse(2) schedule(dynamic, 4) if (T * T * nq * hd > kParallelGrain)
  for (int64_t i = 0; i < T; ++i) {
    for (int h = 0; h < nq; ++h) {
      float* dq = dqkv + i * width + int64_t(h) * hd;
      std::fill(dq, dq + hd, 0.0f);
      const int seg = segment_of(cu, n_segments, i);
      if (seg < 0) continue;
      const int64_t b = cu[seg], e = causal ? i + 1 : cu[seg + 1];
      const float* q = qkv + i * width + int64_t(h) * hd;
      const float* go = dout + i * D + int64_t(h) * hd;
      const int64_t g = h / group;
      const float l = lse[i * nq + h], ds0 = dsum[i * nq + h];
      float* p = score_scratch(e - b);
      for (int64_t j = b; j < e; ++j)
        p[j - b] = dot(q, qkv + j * width + koff + g * hd, hd) * scale - l;
      exp_nonpositive_inplace(p, e - b);
      for (int64_t j = b; j < e; ++j) {
        const float* kr = qkv + j * width + koff + g * hd;
        const float* vr = qkv + j * width + voff + g * hd;
        const float ds = p[j - b] * (dot(go, vr, hd) - ds0);
        for (int d = 0; d < hd; ++d) dq[d] += ds * kr[d];
      }
      for (int d = 0; d < hd; ++d) dq[d] *= scale;
    }
  }
#pragma omp parallel for collapse(2) schedule(dynamic, 4) if (T * T * nq * hd > kParallelGrain)
  for (int64_t j = 0; j < T; ++j) {
    for (int g = 0; g < nkv; ++g) {
      float* dk = dqkv + j * width + koff + int64_t(g) * hd;
      float* dv = dqkv + j * width + voff + int64_t(g) * hd;
      std::fill(dk, dk + hd, 0.0f);
      std::fill(dv, dv + hd, 0.0f);
      const int seg = segment_of(cu, n_segments, j);
      if (seg < 0) continue;
      const int64_t b = causal ? j : cu[seg], e = cu[seg + 1];
      const float* kr = qkv + j * width + koff + int64_t(g) * hd;
      const float* vr = qkv + j * width + voff + int64_t(g) * hd;
      float* pr = score_scratch(e - b);
      for (int h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i = b; i < e; ++i)
          pr[i - b] = dot(qkv + i * width + int64_t(h) * hd, kr, hd) * scale - lse[i * nq + h];
        exp_nonpositive_inplace(pr, e - b);
        for (int64_t i = b; i < e; ++i) {
          const float* q = qkv + i * width + int64_t(h) * hd;
          const float* go = dout + i * D + int64_t(h) * hd;
          const float p = pr[i - b];
          const float ds = p * (dot(go, vr, hd) - dsum[i * nq + h]);
          for (int d = 0; d < hd; ++d) {
            dv[d] += p * go[d];
            dk[d] += ds * q[d];
          }
        }
      }
      for (int d = 0; d < hd; ++d) dk[d] *= scale;
    }
  }
  // Rows past the last segment take part in nothing.
  for (int64_t r = cu[n_segments]; r < T; ++r) {
    float* row = dqkv + r * width;
    std::fill(row, row + width, 0.0f);
  }
}

// ---- Activations -------------------------------------------------------------------------------

void gelu_tanh_forward(float* y, const float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    y[i] = 0.5f * v * (1.0f + std::tanh(kSqrt2OverPi * (v + kGeluTanhC * v * v * v)));
  }
}

void gelu_tanh_backward(float* dx, const float* dy, const float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = std::tanh(kSqrt2OverPi * (v + kGeluTanhC * v * v * v));
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluTanhC * v * v);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
  }
}

void gelu_erf_forward(float* y, const float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) y[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * kInvSqrt2));
}

// d/dx x s(kx) = s + k x s (1 - s), s = sigmoid(kx).
void quick_gelu_backward(float* dx, const float* dy, const float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float s = 1.0f / (1.0f + std::exp(-1.702f * v));
    dx[i] = dy[i] * (s + 1.702f * v * s * (1.0f - s));
  }
}

void gelu_erf_backward(float* dx, const float* dy, const float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float cdf = 0.5f * (1.0f + std::erf(v * kInvSqrt2));
    const float pdf = kInvSqrt2Pi * std::exp(-0.5f * v * v);
    dx[i] = dy[i] * (cdf + v * pdf);
  }
}

void swiglu_forward(float* y, const float* gu, int64_t M, int64_t I) {
#pragma omp parallel for schedule(static) if (M * I > kParallelGrain)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) {
      const float g = gu[m * 2 * I + i];
      y[m * I + i] = g / (1.0f + std::exp(-g)) * gu[m * 2 * I + I + i];
    }
}

void swiglu_backward(float* dgu, const float* dy, const float* gu, int64_t M, int64_t I) {
#pragma omp parallel for schedule(static) if (M * I > kParallelGrain)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) {
      const float g = gu[m * 2 * I + i], u = gu[m * 2 * I + I + i], d = dy[m * I + i];
      const float sig = 1.0f / (1.0f + std::exp(-g));
      dgu[m * 2 * I + i] = d * u * sig * (1.0f + g * (1.0f - sig));
      dgu[m * 2 * I + I + i] = d * g * sig;
    }
}

// ---- Rows --------------------------------------------------------------------------------------

void embedding_forward(float* y, const float* table, const int32_t* ids, int64_t T, int64_t H,
                       int64_t V) {
  for (int64_t t = 0; t < T; ++t) {
    const int32_t id = ids[t];
    IRIS_CHECK(id >= 0 && id < V, "token id ", id, " at position ", t,
               " is outside the vocabulary of ", V);
    std::memcpy(y + t * H, table + int64_t(id) * H, sizeof(float) * H);
  }
}

void embedding_backward(float* dtable, const float* dy, const int32_t* ids, int64_t T, int64_t H,
                        int32_t skip_id) {
  // A token may repeat, so rows of dtable are shared; split by columns instead.
  for_column_blocks(T, H, [&](int64_t c0, int64_t c1) {
    for (int64_t t = 0; t < T; ++t) {
      if (ids[t] == skip_id) continue;
      float* d = dtable + int64_t(ids[t]) * H;
      const float* g = dy + t * H;
      for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
    }
  });
}

void gather_rows(float* dst, const float* src, const int32_t* index, int64_t N, int64_t H) {
#pragma omp parallel for schedule(static) if (N * H > kParallelGrain)
  for (int64_t i = 0; i < N; ++i)
    std::memcpy(dst + i * H, src + int64_t(index[i]) * H, sizeof(float) * H);
}

void scatter_rows(float* dst, const float* src, const int32_t* index, int64_t N, int64_t H,
                  bool accumulate) {
#pragma omp parallel for schedule(static) if (N * H > kParallelGrain)
  for (int64_t i = 0; i < N; ++i) {
    float* d = dst + int64_t(index[i]) * H;
    const float* s = src + i * H;
    if (accumulate) {
      for (int64_t c = 0; c < H; ++c) d[c] += s[c];
    } else {
      std::memcpy(d, s, sizeof(float) * H);
    }
  }
}

// ---- Position embedding ------------------------------------------------------------------------

void pos_embed_forward(float* y, const float* table, const int32_t* index, const float* weight,
                       int64_t S, int64_t D) {
#pragma omp parallel for schedule(static) if (S * D > kParallelGrain)
  for (int64_t s = 0; s < S; ++s) {
    float* yr = y + s * D;
    for (int64_t c = 0; c < D; ++c) {
      float acc = 0.0f;
      for (int k = 0; k < 4; ++k) acc += weight[s * 4 + k] * table[index[s * 4 + k] * D + c];
      yr[c] += acc;
    }
  }
}

void pos_embed_backward(float* dtable, const float* dy, const int32_t* index, const float* weight,
                        int64_t S, int64_t D) {
  for_column_blocks(4 * S, D, [&](int64_t c0, int64_t c1) {
    for (int64_t s = 0; s < S; ++s) {
      const float* g = dy + s * D;
      for (int k = 0; k < 4; ++k) {
        const float wk = weight[s * 4 + k];
        float* d = dtable + int64_t(index[s * 4 + k]) * D;
        for (int64_t c = c0; c < c1; ++c) d[c] += wk * g[c];
      }
    }
  });
}

// ---- lm_head + cross-entropy -------------------------------------------------------------------

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define IRIS_LM_HEAD_AVX2 1
#endif

#ifdef IRIS_LM_HEAD_AVX2
namespace {

// The lm_head is most of a small model's training step (a [rows, 152k] x [152k, H] product three
// times per sample). With few labelled rows the GEMM library spends as long packing the vocabulary
// matrix as multiplying, so on AVX2 machines two fused passes replace the three GEMMs: logits
// (one read of w), then dx and dw together (one read of w, one read-modify-write of dw).
constexpr int64_t kMaxFusedRows = 256;  // rows per chunk the fused backward keeps on the stack
constexpr int64_t kVocabBlock = 256;    // dx sums over the vocabulary in blocks of this size

bool have_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp for x <= 0 (Cephes' expf: range reduction by ln 2 and a degree-5 polynomial, ~1 ulp);
// inputs below -87 give 0, which changes no f64 sum of probabilities.
__attribute__((target("avx2,fma"))) inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 fx = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, y);
}

__attribute__((target("avx2,fma"))) void exp_nonpositive_avx2(float* x, int64_t n) {
  int64_t i = 0;
  // exp_nonpositive maps NaN to 0; a diverged score must stay NaN.
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(x + i,
                     _mm256_blendv_ps(exp_nonpositive(v), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

void exp_nonpositive_inplace(float* x, int64_t n) {
  if (have_avx2_fma()) return exp_nonpositive_avx2(x, n);
  for (int64_t i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

// Row r of logits -> exp(logit - max) in place; returns the f64 sum and sets *mx.
__attribute__((target("avx2,fma"))) double exp_row_avx2(float* lr, int64_t V, float* mx_out) {
  __m256 m8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan8 = _mm256_setzero_ps();
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 l = _mm256_loadu_ps(lr + v);
    m8 = _mm256_max_ps(m8, l);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(l, l, _CMP_UNORD_Q));
  }
  float mx = -std::numeric_limits<float>::infinity();
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m8);
  for (float l : lanes) mx = std::max(mx, l);
  bool nan = _mm256_movemask_ps(nan8) != 0;
  for (int64_t t = v; t < V; ++t) {
    mx = std::max(mx, lr[t]);
    nan = nan || std::isnan(lr[t]);
  }
  // max_ps drops NaNs; a diverged model must still report a NaN loss.
  if (nan) {
    *mx_out = std::numeric_limits<float>::quiet_NaN();
    return std::numeric_limits<double>::quiet_NaN();
  }
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (v = 0; v + 8 <= V; v += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(lr + v), mxv));
    _mm256_storeu_ps(lr + v, e);
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double d[4];
  _mm256_store_pd(d, _mm256_add_pd(s0, s1));
  double s = (d[0] + d[1]) + (d[2] + d[3]);
  for (; v < V; ++v) {
    lr[v] = std::exp(lr[v] - mx);
    s += lr[v];
  }
  *mx_out = mx;
  return s;
}

// logits[r, v] = x_r . w_v for v in [v0, v1) and every r < n (H a multiple of 8).
__attribute__((target("avx2,fma"))) void logits_avx2(float* logits, const float* x, const float* w,
                                                     int64_t n, int64_t H, int64_t V, int64_t v0,
                                                     int64_t v1) {
  int64_t v = v0;
  for (; v + 4 <= v1; v += 4) {
    const float *w0 = w + v * H, *w1 = w0 + H, *w2 = w1 + H, *w3 = w2 + H;
    int64_t r = 0;
    // Two rows by four vocabulary rows: eight independent FMA chains per step.
    for (; r + 2 <= n; r += 2) {
      const float *xa = x + r * H, *xb = xa + H;
      __m256 a[8];
      for (__m256& t : a) t = _mm256_setzero_ps();
      for (int64_t h = 0; h < H; h += 8) {
        const __m256 va = _mm256_loadu_ps(xa + h), vb = _mm256_loadu_ps(xb + h);
        const __m256 m0 = _mm256_loadu_ps(w0 + h), m1 = _mm256_loadu_ps(w1 + h),
                     m2 = _mm256_loadu_ps(w2 + h), m3 = _mm256_loadu_ps(w3 + h);
        a[0] = _mm256_fmadd_ps(va, m0, a[0]);
        a[1] = _mm256_fmadd_ps(va, m1, a[1]);
        a[2] = _mm256_fmadd_ps(va, m2, a[2]);
        a[3] = _mm256_fmadd_ps(va, m3, a[3]);
        a[4] = _mm256_fmadd_ps(vb, m0, a[4]);
        a[5] = _mm256_fmadd_ps(vb, m1, a[5]);
        a[6] = _mm256_fmadd_ps(vb, m2, a[6]);
        a[7] = _mm256_fmadd_ps(vb, m3, a[7]);
      }
      for (int j = 0; j < 4; ++j) {
        logits[r * V + v + j] = hsum(a[j]);
        logits[(r + 1) * V + v + j] = hsum(a[4 + j]);
      }
    }
    for (; r < n; ++r) {
      const float* xr = x + r * H;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t h = 0; h < H; h += 8) {
        const __m256 xv = _mm256_loadu_ps(xr + h);
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + h), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w1 + h), a1);
        a2 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w2 + h), a2);
        a3 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w3 + h), a3);
      }
      float* out = logits + r * V + v;
      out[0] = hsum(a0);
      out[1] = hsum(a1);
      out[2] = hsum(a2);
      out[3] = hsum(a3);
    }
  }
  for (; v < v1; ++v) {
    for (int64_t r = 0; r < n; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t h = 0; h < H; h += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * H + h), _mm256_loadu_ps(w + v * H + h), a);
      logits[r * V + v] = hsum(a);
    }
  }
}

// For columns [h0, h1) (multiples of 8): overwrites dx[r, h] = sum_v dl[r, v] w[v, h] and
// accumulates dw[v, h] += sum_r dl[r, v] x[r, h] (dw may be null). The sum over the vocabulary
// runs in blocks whose partial sums (in blk[n, H], columns [h0, h1)) are added to dx, which keeps
// its rounding error near that of a blocked GEMM. One call streams w and dw once.
__attribute__((target("avx2,fma"))) void head_backward_avx2(float* dx, float* dw, const float* dl,
                                                            const float* x, const float* w,
                                                            int64_t n, int64_t H, int64_t V,
                                                            int64_t h0, int64_t h1, float* blk) {
  float g[kMaxFusedRows];
  for (int64_t r = 0; r < n; ++r) std::fill(dx + r * H + h0, dx + r * H + h1, 0.0f);
  for (int64_t vb = 0; vb < V; vb += kVocabBlock) {
    for (int64_t r = 0; r < n; ++r) std::fill(blk + r * H + h0, blk + r * H + h1, 0.0f);
    const int64_t ve = std::min(V, vb + kVocabBlock);
    for (int64_t v = vb; v < ve; ++v) {
      for (int64_t r = 0; r < n; ++r) g[r] = dl[r * V + v];
      const float* wv = w + v * H;
      float* dwv = dw ? dw + v * H : nullptr;
      int64_t h = h0;
      // Four column vectors at once: the dw sums over r are FMA chains, and four independent
      // chains hide the FMA latency that a single one would wait on.
      for (; h + 32 <= h1; h += 32) {
        __m256 w4[4], acc[4];
        for (int j = 0; j < 4; ++j) {
          w4[j] = _mm256_loadu_ps(wv + h + 8 * j);
          acc[j] = dwv ? _mm256_loadu_ps(dwv + h + 8 * j) : _mm256_setzero_ps();
        }
        float* bp = blk + h;
        for (int64_t r = 0; r < n; ++r) {
          const __m256 gr = _mm256_set1_ps(g[r]);
          const float* xr = x + r * H + h;
          float* b = bp + r * H;
          for (int j = 0; j < 4; ++j) {
            acc[j] = _mm256_fmadd_ps(gr, _mm256_loadu_ps(xr + 8 * j), acc[j]);
            _mm256_storeu_ps(b + 8 * j, _mm256_fmadd_ps(gr, w4[j], _mm256_loadu_ps(b + 8 * j)));
          }
        }
        if (dwv)
          for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dwv + h + 8 * j, acc[j]);
      }
      for (; h < h1; h += 8) {
        const __m256 wvec = _mm256_loadu_ps(wv + h);
        __m256 acc = dwv ? _mm256_loadu_ps(dwv + h) : _mm256_setzero_ps();
        float* bp = blk + h;
        for (int64_t r = 0; r < n; ++r) {
          const __m256 gr = _mm256_set1_ps(g[r]);
          acc = _mm256_fmadd_ps(gr, _mm256_loadu_ps(x + r * H + h), acc);
          float* b = bp + r * H;
          _mm256_storeu_ps(b, _mm256_fmadd_ps(gr, wvec, _mm256_loadu_ps(b)));
        }
        if (dwv) _mm256_storeu_ps(dwv + h, acc);
      }
    }
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = h0; h < h1; ++h) dx[r * H + h] += blk[r * H + h];
  }
}

bool have_avx512f() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
}

// head_backward_avx2 with four vocabulary rows at a time in 512-bit registers: the four weight
// vectors of a 16-column slab stay in registers while the labelled rows stream past, so each
// row's block sum is loaded and stored once per four vocabulary rows instead of once per row.
// Every sum is accumulated in the same order as head_backward_avx2 (over r for dw, over v for
// dx), so the two kernels give bit-identical results. Columns [h0, h1) are multiples of 16.
__attribute__((target("avx512f"))) void head_backward_avx512(float* dx, float* dw, const float* dl,
                                                             const float* x, const float* w,
                                                             int64_t n, int64_t H, int64_t V,
                                                             int64_t h0, int64_t h1, float* blk) {
  for (int64_t r = 0; r < n; ++r) std::fill(dx + r * H + h0, dx + r * H + h1, 0.0f);
  for (int64_t vb = 0; vb < V; vb += kVocabBlock) {
    for (int64_t r = 0; r < n; ++r) std::fill(blk + r * H + h0, blk + r * H + h1, 0.0f);
    const int64_t ve = std::min(V, vb + kVocabBlock);
    int64_t v = vb;
    for (; v + 4 <= ve; v += 4) {
      for (int64_t h = h0; h < h1; h += 16) {
        __m512 wv[4], acc[4];
        for (int j = 0; j < 4; ++j) {
          wv[j] = _mm512_loadu_ps(w + (v + j) * H + h);
          acc[j] = dw ? _mm512_loadu_ps(dw + (v + j) * H + h) : _mm512_setzero_ps();
        }
        for (int64_t r = 0; r < n; ++r) {
          const float* g = dl + r * V + v;
          const __m512 xr = _mm512_loadu_ps(x + r * H + h);
          float* b = blk + r * H + h;
          __m512 bv = _mm512_loadu_ps(b);
          for (int j = 0; j < 4; ++j) {
            const __m512 gj = _mm512_set1_ps(g[j]);
            acc[j] = _mm512_fmadd_ps(gj, xr, acc[j]);
            bv = _mm512_fmadd_ps(gj, wv[j], bv);
          }
          _mm512_storeu_ps(b, bv);
        }
        if (dw)
          for (int j = 0; j < 4; ++j) _mm512_storeu_ps(dw + (v + j) * H + h, acc[j]);
      }
    }
    for (; v < ve; ++v) {
      for (int64_t h = h0; h < h1; h += 16) {
        const __m512 wvec = _mm512_loadu_ps(w + v * H + h);
        __m512 acc = dw ? _mm512_loadu_ps(dw + v * H + h) : _mm512_setzero_ps();
        for (int64_t r = 0; r < n; ++r) {
          const __m512 gr = _mm512_set1_ps(dl[r * V + v]);
          acc = _mm512_fmadd_ps(gr, _mm512_loadu_ps(x + r * H + h), acc);
          float* b = blk + r * H + h;
          _mm512_storeu_ps(b, _mm512_fmadd_ps(gr, wvec, _mm512_loadu_ps(b)));
        }
        if (dw) _mm512_storeu_ps(dw + v * H + h, acc);
      }
    }
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = h0; h < h1; ++h) dx[r * H + h] += blk[r * H + h];
  }
}

// dx only (the lm_head weight gradient deferred or frozen): for columns [h0, h1) (multiples of
// 16), dx[r, h] = sum_v dl[r, v] w[v, h], summed per vocabulary block of kVocabBlock rows and
// the block sums added to dx, exactly as head_backward_avx512 does with dw null, so the two give
// the same bits. NR rows by two 16-column vectors of accumulators stay in registers while a
// block of w (L2-resident) streams past, instead of a load and store of each row's block sum
// per vocabulary row.
template <int NR>
__attribute__((target("avx512f"))) void head_dx_rows_avx512(float* dx, const float* dl,
                                                            const float* w, int64_t H, int64_t V,
                                                            int64_t vb, int64_t ve, int64_t h) {
  __m512 acc[NR][2];
  for (int rr = 0; rr < NR; ++rr) acc[rr][0] = acc[rr][1] = _mm512_setzero_ps();
  for (int64_t v = vb; v < ve; ++v) {
    const __m512 w0 = _mm512_loadu_ps(w + v * H + h), w1 = _mm512_loadu_ps(w + v * H + h + 16);
    for (int rr = 0; rr < NR; ++rr) {
      const __m512 g = _mm512_set1_ps(dl[rr * V + v]);
      acc[rr][0] = _mm512_fmadd_ps(g, w0, acc[rr][0]);
      acc[rr][1] = _mm512_fmadd_ps(g, w1, acc[rr][1]);
    }
  }
  for (int rr = 0; rr < NR; ++rr) {
    float* d = dx + rr * H + h;
    _mm512_storeu_ps(d, _mm512_add_ps(_mm512_loadu_ps(d), acc[rr][0]));
    _mm512_storeu_ps(d + 16, _mm512_add_ps(_mm512_loadu_ps(d + 16), acc[rr][1]));
  }
}

template <int NR>
__attribute__((target("avx512f"))) void head_dx_rows_avx512_16(float* dx, const float* dl,
                                                               const float* w, int64_t H, int64_t V,
                                                               int64_t vb, int64_t ve, int64_t h) {
  __m512 acc[NR];
  for (int rr = 0; rr < NR; ++rr) acc[rr] = _mm512_setzero_ps();
  for (int64_t v = vb; v < ve; ++v) {
    const __m512 w0 = _mm512_loadu_ps(w + v * H + h);
    for (int rr = 0; rr < NR; ++rr)
      acc[rr] = _mm512_fmadd_ps(_mm512_set1_ps(dl[rr * V + v]), w0, acc[rr]);
  }
  for (int rr = 0; rr < NR; ++rr) {
    float* d = dx + rr * H + h;
    _mm512_storeu_ps(d, _mm512_add_ps(_mm512_loadu_ps(d), acc[rr]));
  }
}

template <int NR>
__attribute__((target("avx512f"))) void head_dx_block_avx512(float* dx, const float* dl,
                                                             const float* w, int64_t H, int64_t V,
                                                             int64_t vb, int64_t ve, int64_t h0,
                                                             int64_t h1) {
  int64_t h = h0;
  for (; h + 32 <= h1; h += 32) head_dx_rows_avx512<NR>(dx, dl, w, H, V, vb, ve, h);
  for (; h < h1; h += 16) head_dx_rows_avx512_16<NR>(dx, dl, w, H, V, vb, ve, h);
}

// head_dx_block_avx512<nr> for a run-time row count nr in [1, NR].
template <int NR>
__attribute__((target("avx512f"))) void head_dx_block_rows(int nr, float* dx, const float* dl,
                                                           const float* w, int64_t H, int64_t V,
                                                           int64_t vb, int64_t ve, int64_t h0,
                                                           int64_t h1) {
  if constexpr (NR > 1) {
    if (nr < NR) return head_dx_block_rows<NR - 1>(nr, dx, dl, w, H, V, vb, ve, h0, h1);
  }
  head_dx_block_avx512<NR>(dx, dl, w, H, V, vb, ve, h0, h1);
}

__attribute__((target("avx512f"))) void head_dx_avx512(float* dx, const float* dl, const float* w,
                                                       int64_t n, int64_t H, int64_t V, int64_t h0,
                                                       int64_t h1) {
  constexpr int kRows = 8;
  for (int64_t r = 0; r < n; ++r) std::fill(dx + r * H + h0, dx + r * H + h1, 0.0f);
  for (int64_t vb = 0; vb < V; vb += kVocabBlock) {
    const int64_t ve = std::min(V, vb + kVocabBlock);
    for (int64_t r0 = 0; r0 < n; r0 += kRows) {
      float* d = dx + r0 * H;
      const float* g = dl + r0 * V;
      head_dx_block_rows<kRows>(static_cast<int>(std::min<int64_t>(kRows, n - r0)), d, g, w, H, V,
                                vb, ve, h0, h1);
    }
  }
}

// dw rows [v0, v1) += dl^T x, four vocabulary rows by four 16-column vectors per pass over the
// rows (sixteen accumulators), each element summed over r in order.
__attribute__((target("avx512f"))) void head_weight_grad_avx512(float* dw, const float* dl,
                                                                const float* x, int64_t n,
                                                                int64_t H, int64_t V, int64_t v0,
                                                                int64_t v1) {
  int64_t v = v0;
  for (; v + 4 <= v1; v += 4) {
    int64_t h = 0;
    for (; h + 64 <= H; h += 64) {
      __m512 acc[4][4];
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_loadu_ps(dw + (v + j) * H + h + 16 * c);
      for (int64_t r = 0; r < n; ++r) {
        __m512 xr[4];
        for (int c = 0; c < 4; ++c) xr[c] = _mm512_loadu_ps(x + r * H + h + 16 * c);
        for (int j = 0; j < 4; ++j) {
          const __m512 g = _mm512_set1_ps(dl[r * V + v + j]);
          for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_fmadd_ps(g, xr[c], acc[j][c]);
        }
      }
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(dw + (v + j) * H + h + 16 * c, acc[j][c]);
    }
    for (; h < H; h += 16) {
      __m512 acc[4];
      for (int j = 0; j < 4; ++j) acc[j] = _mm512_loadu_ps(dw + (v + j) * H + h);
      for (int64_t r = 0; r < n; ++r) {
        const __m512 xr = _mm512_loadu_ps(x + r * H + h);
        for (int j = 0; j < 4; ++j)
          acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(dl[r * V + v + j]), xr, acc[j]);
      }
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(dw + (v + j) * H + h, acc[j]);
    }
  }
  for (; v < v1; ++v)
    for (int64_t h = 0; h < H; h += 16) {
      __m512 acc = _mm512_loadu_ps(dw + v * H + h);
      for (int64_t r = 0; r < n; ++r)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(dl[r * V + v]), _mm512_loadu_ps(x + r * H + h), acc);
      _mm512_storeu_ps(dw + v * H + h, acc);
    }
}

// The same with 8-float vectors: four vocabulary rows by two column vectors.
__attribute__((target("avx2,fma"))) void head_weight_grad_avx2(float* dw, const float* dl,
                                                               const float* x, int64_t n, int64_t H,
                                                               int64_t V, int64_t v0, int64_t v1) {
  int64_t v = v0;
  for (; v + 4 <= v1; v += 4) {
    int64_t h = 0;
    for (; h + 16 <= H; h += 16) {
      __m256 acc[4][2];
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 2; ++c) acc[j][c] = _mm256_loadu_ps(dw + (v + j) * H + h + 8 * c);
      for (int64_t r = 0; r < n; ++r) {
        const __m256 x0 = _mm256_loadu_ps(x + r * H + h), x1 = _mm256_loadu_ps(x + r * H + h + 8);
        for (int j = 0; j < 4; ++j) {
          const __m256 g = _mm256_set1_ps(dl[r * V + v + j]);
          acc[j][0] = _mm256_fmadd_ps(g, x0, acc[j][0]);
          acc[j][1] = _mm256_fmadd_ps(g, x1, acc[j][1]);
        }
      }
      for (int j = 0; j < 4; ++j)
        for (int c = 0; c < 2; ++c) _mm256_storeu_ps(dw + (v + j) * H + h + 8 * c, acc[j][c]);
    }
    for (; h < H; h += 8) {
      for (int j = 0; j < 4; ++j) {
        __m256 acc = _mm256_loadu_ps(dw + (v + j) * H + h);
        for (int64_t r = 0; r < n; ++r)
          acc = _mm256_fmadd_ps(_mm256_set1_ps(dl[r * V + v + j]), _mm256_loadu_ps(x + r * H + h),
                                acc);
        _mm256_storeu_ps(dw + (v + j) * H + h, acc);
      }
    }
  }
  for (; v < v1; ++v)
    for (int64_t h = 0; h < H; h += 8) {
      __m256 acc = _mm256_loadu_ps(dw + v * H + h);
      for (int64_t r = 0; r < n; ++r)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dl[r * V + v]), _mm256_loadu_ps(x + r * H + h), acc);
      _mm256_storeu_ps(dw + v * H + h, acc);
    }
}

}  // namespace
#endif

int64_t lm_head_scratch_floats(int64_t chunk_rows, int64_t H, int64_t V) {
  // Logits, then the fused backward's block sums, aligned up to a cache line (kAlignFloats).
  return chunk_rows * (V + H) + kAlignFloats;
}

double lm_head_cross_entropy(float* dx, float* dw, const float* x, const float* w,
                             const int32_t* targets, int64_t N, int64_t H, int64_t V,
                             float grad_scale, float* scratch, int64_t scratch_floats,
                             int64_t chunk_rows, float* dl_out) {
  IRIS_CHECK(chunk_rows > 0, "lm_head_cross_entropy: chunk_rows must be positive");
  IRIS_CHECK(scratch_floats >= lm_head_scratch_floats(chunk_rows, H, V),
             "lm_head_cross_entropy: scratch of ", scratch_floats, " floats is smaller than the ",
             lm_head_scratch_floats(chunk_rows, H, V), " that ", chunk_rows,
             " rows need (size it with lm_head_scratch_floats)");
  for (int64_t i = 0; i < N; ++i)
    IRIS_CHECK(targets[i] < V, "label ", targets[i], " is outside the vocabulary of ", V,
               " (use -100 for tokens without a label)");
#ifdef IRIS_LM_HEAD_AVX2
  const bool fused = have_avx2_fma() && H % 8 == 0 && chunk_rows <= kMaxFusedRows;
  // Column ranges are whole 16-float units, so 512-bit vectors cover them exactly.
  const bool wide = fused && have_avx512f() && H % 16 == 0;
#else
  const bool fused = false;
#endif
  const int n_threads = std::min(omp_get_max_threads(), kMaxThreads);
  double loss = 0.0;
  for (int64_t r0 = 0; r0 < N; r0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, N - r0);
    const float* xc = x + r0 * H;
    const bool parallel = n * V * H > kParallelGrain;
    if (fused) {
#ifdef IRIS_LM_HEAD_AVX2
#pragma omp parallel num_threads(n_threads) if (parallel)
      {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        // Split the vocabulary on multiples of 4 rows (the kernel's block).
        const int64_t blocks = (V + 3) / 4;
        logits_avx2(scratch, xc, w, n, H, V, std::min(V, 4 * (blocks * tid / nt)),
                    std::min(V, 4 * (blocks * (tid + 1) / nt)));
      }
#endif
    } else {
      cpu::sgemm_xwt(n, V, H, xc, w, scratch, 0.0f);
    }
    // Per-thread partial losses, summed in thread order afterwards: an OpenMP reduction would
    // combine them in arrival order and the loss would differ in the last bit between runs.
    double partial[kMaxThreads] = {};
#pragma omp parallel num_threads(n_threads) if (n * V > kParallelGrain)
    {
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t rb = n * tid / nt, re = n * (tid + 1) / nt;
      for (int64_t r = rb; r < re; ++r) {
        float* lr = scratch + r * V;
        const int32_t t = targets[r0 + r];
        if (t < 0) {  // an ignored row (bucket padding): no loss, a zero gradient row
          if (dx) std::fill(lr, lr + V, 0.0f);
          continue;
        }
        const float target_logit = lr[t];
        // One exp per logit, kept in place for the gradient; the sum in f64.
        float mx;
        double s = 0.0;
#ifdef IRIS_LM_HEAD_AVX2
        if (fused) {
          s = exp_row_avx2(lr, V, &mx);
        } else
#endif
        {
          mx = *std::max_element(lr, lr + V);
          for (int64_t v = 0; v < V; ++v) {
            lr[v] = std::exp(lr[v] - mx);
            s += lr[v];
          }
        }
        partial[tid] += double(mx) + std::log(s) - double(target_logit);
        if (dx) {
          // In place: the row becomes grad_scale * (softmax - onehot).
          const float k = static_cast<float>(double(grad_scale) / s);
          for (int64_t v = 0; v < V; ++v) lr[v] *= k;
          lr[t] -= grad_scale;
        }
      }
    }
    for (int k = 0; k < n_threads; ++k) loss += partial[k];
    if (!dx) continue;
    if (dl_out) std::memcpy(dl_out + r0 * V, scratch, sizeof(float) * static_cast<size_t>(n * V));
    if (fused) {
#ifdef IRIS_LM_HEAD_AVX2
      // Each thread owns a range of columns (whole cache lines): dx and dw need no reduction,
      // and w and dw are streamed once in all.
      // Threads write neighbouring column ranges of blk: start it on a cache line so that no
      // line is shared (a shared line bounced between cores made this pass 10x slower).
      float* blk = scratch + chunk_rows * V;
      blk += (kAlignFloats - (reinterpret_cast<uintptr_t>(blk) / sizeof(float)) % kAlignFloats) %
             kAlignFloats;
#pragma omp parallel num_threads(n_threads) if (parallel)
      {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t units = (H + 15) / 16;
        const int64_t h0 = std::min(H, 16 * (units * tid / nt)),
                      h1 = std::min(H, 16 * (units * (tid + 1) / nt));
        if (h1 > h0) {
          if (wide && dw == nullptr)
            head_dx_avx512(dx + r0 * H, scratch, w, n, H, V, h0, h1);
          else if (wide)
            head_backward_avx512(dx + r0 * H, dw, scratch, xc, w, n, H, V, h0, h1, blk);
          else
            head_backward_avx2(dx + r0 * H, dw, scratch, xc, w, n, H, V, h0, h1, blk);
        }
      }
#endif
    } else {
      cpu::sgemm_xw(n, H, V, scratch, w, dx + r0 * H, 0.0f);
      if (dw) cpu::sgemm_xtw(V, H, n, scratch, xc, dw, 1.0f);
    }
  }
  return loss;
}

void lm_head_weight_grad(float* dw, const float* dl, const float* x, int64_t N, int64_t H,
                         int64_t V) {
  if (N == 0) return;
#ifdef IRIS_LM_HEAD_AVX2
  // The fused backward's condition, so that both paths sum each element the same way.
  if (have_avx2_fma() && H % 8 == 0) {
    const bool wide = have_avx512f() && H % 16 == 0;
    const int n_threads = std::min(omp_get_max_threads(), kMaxThreads);
#pragma omp parallel num_threads(n_threads) if (N * V * H > kParallelGrain)
    {
      // Each thread owns whole vocabulary rows of dw: no reduction between threads.
      const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t blocks = (V + 3) / 4;
      const int64_t v0 = std::min(V, 4 * (blocks * tid / nt)),
                    v1 = std::min(V, 4 * (blocks * (tid + 1) / nt));
      if (wide)
        head_weight_grad_avx512(dw, dl, x, N, H, V, v0, v1);
      else
        head_weight_grad_avx2(dw, dl, x, N, H, V, v0, v1);
    }
    return;
  }
#endif
  cpu::sgemm_xtw(V, H, N, dl, x, dw, 1.0f);
}

namespace {

// AdamW on elements [b, e), in the order of torch's foreach kernels. decay is exactly 1 without
// weight decay, so the multiply needs no branch. torch.lerp has two forms, chosen by the weight.
// clip: the gradient clipping coefficient, applied on load when below 1 (the same float multiply
// as torch's in-place scaling, without writing the gradients).
struct AdamWScalars {
  float decay, one_minus_b1, b2, one_minus_b2, bc2_sqrt, eps, neg_step_size, clip;
};

inline void adamw_element(float& p, float& m, float& v, float g_in, const AdamWScalars& s) {
  const float g = s.clip < 1.0f ? g_in * s.clip : g_in;
  const float mk =
      s.one_minus_b1 < 0.5f ? m + s.one_minus_b1 * (g - m) : g - (g - m) * (1.0f - s.one_minus_b1);
  const float vk = v * s.b2 + s.one_minus_b2 * (g * g);
  p = p * s.decay + s.neg_step_size * (mk / (std::sqrt(vk) / s.bc2_sqrt + s.eps));
  m = mk;
  v = vk;
}

// The square root keeps the compiler from vectorising the scalar loop (errno semantics), and the
// update is a third of a tiny model's training step, so x86 runs four lanes with SSE. Each lane
// performs the scalar element's IEEE operations in the same order: results are bit-identical.
void adamw_range(float* p, const float* g, float* m, float* v, int64_t b, int64_t e,
                 const AdamWScalars& s) {
  int64_t k = b;
#ifdef __SSE2__
  const __m128 w = _mm_set1_ps(s.one_minus_b1), omw = _mm_set1_ps(1.0f - s.one_minus_b1),
               b2 = _mm_set1_ps(s.b2), w2 = _mm_set1_ps(s.one_minus_b2),
               bc2 = _mm_set1_ps(s.bc2_sqrt), eps = _mm_set1_ps(s.eps),
               decay = _mm_set1_ps(s.decay), step = _mm_set1_ps(s.neg_step_size),
               clip = _mm_set1_ps(s.clip);
  const bool low = s.one_minus_b1 < 0.5f, clipped = s.clip < 1.0f;
  for (; k + 4 <= e; k += 4) {
    const __m128 g0 = _mm_loadu_ps(g + k), mk0 = _mm_loadu_ps(m + k);
    const __m128 gk = clipped ? _mm_mul_ps(g0, clip) : g0;
    const __m128 mk = low ? _mm_add_ps(mk0, _mm_mul_ps(w, _mm_sub_ps(gk, mk0)))
                          : _mm_sub_ps(gk, _mm_mul_ps(_mm_sub_ps(gk, mk0), omw));
    const __m128 vk =
        _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(v + k), b2), _mm_mul_ps(w2, _mm_mul_ps(gk, gk)));
    const __m128 denom = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vk), bc2), eps);
    const __m128 pk =
        _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(p + k), decay), _mm_mul_ps(step, _mm_div_ps(mk, denom)));
    _mm_storeu_ps(p + k, pk);
    _mm_storeu_ps(m + k, mk);
    _mm_storeu_ps(v + k, vk);
  }
#endif
  for (; k < e; ++k) adamw_element(p[k], m[k], v[k], g[k], s);
}

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s) {
#pragma omp parallel if (n > kParallelGrain)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    adamw_range(p, g, m, v, n * tid / nt, n * (tid + 1) / nt, s);
  }
}

}  // namespace

// Per-thread partial sums combined in thread order: an OpenMP reduction combines in arrival
// order, and a norm that differs in the last bit between runs would break bit-exact resumption
// (it sets the clipping coefficient).
double sum_of_squares(const float* p, int64_t n) {
  double partial[kMaxThreads] = {};
  const int n_threads = std::min(omp_get_max_threads(), kMaxThreads);
#pragma omp parallel num_threads(n_threads) if (n > kParallelGrain)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    // Eight independent accumulators: one f64 sum would be bound by the add latency.
    double acc[8] = {};
    const int64_t b = n * tid / nt, e = n * (tid + 1) / nt;
    int64_t i = b;
    for (; i + 8 <= e; i += 8)
      for (int k = 0; k < 8; ++k) acc[k] += double(p[i + k]) * double(p[i + k]);
    for (; i < e; ++i) acc[0] += double(p[i]) * double(p[i]);
    double s = 0.0;
    for (double a : acc) s += a;
    partial[tid] = s;
  }
  double total = 0.0;
  for (int k = 0; k < n_threads; ++k) total += partial[k];
  return total;
}

void adamw_tensor(float* p, const float* g, float* m, float* v, int64_t n, float scheduled_lr,
                  float lr_scale, float weight_decay, int64_t t, float clip_coef, float b1,
                  float b2, float eps) {
  // A scale of exactly 1 keeps the f32 learning rate bit for bit (the HF golden trajectory).
  const float lr =
      lr_scale == 1.0f ? scheduled_lr : static_cast<float>(double(scheduled_lr) * lr_scale);
  const float one_minus_b1 = static_cast<float>(1.0 - double(b1));
  const float one_minus_b2 = static_cast<float>(1.0 - double(b2));
  // Scalars as torch's foreach AdamW forms them: Python doubles, cast to f32 in the kernel.
  const float decay = static_cast<float>(1.0 - double(lr) * double(weight_decay));
  const double bc1 = 1.0 - std::pow(double(b1), double(t));
  const double bc2 = 1.0 - std::pow(double(b2), double(t));
  const float neg_step_size = static_cast<float>(-(double(lr) / bc1));
  const float bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  adamw_update(p, g, m, v, n,
               {decay, one_minus_b1, b2, one_minus_b2, bc2_sqrt, eps, neg_step_size, clip_coef});
}

}  // namespace iris::train
