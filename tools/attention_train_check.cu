// Standalone check of the training attention kernels (core/cuda/attention/attention_train.cu)
// against a float64 host reference: forward (out, lse) and backward (dq, dk, dv), zero rows past
// the last segment and in padding segments, every output element written (outputs are poisoned with
// NaNs first), bitwise determinism over two runs, and CUDA-graph capture. `--bench` also times
// large shapes (decoder causal GQA at head_dim 128, vision segments at head_dim 64 and 72).
//
// Build (from the repository root), then run on a Hopper GPU:
// clang-format off
//   /usr/local/cuda/bin/nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -I. -DIRIS_CUDA_SM90A=1 tools/attention_train_check.cu core/cuda/attention/attention_train.cu core/cuda/attention/attention_train_wgmma.cu core/cuda/attention/attention.cu core/error.cpp -o /tmp/attention_train_check
//   /tmp/attention_train_check [--bench | --only-bench[=K]]
// clang-format on
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cuda/attention/attention.h"
#include "core/error.h"

#define CK(x)                                                                                \
  do {                                                                                       \
    cudaError_t e_ = (x);                                                                    \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, \
                   __LINE__, #x);                                                            \
      std::exit(2);                                                                          \
    }                                                                                        \
  } while (0)

namespace {

uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf2f(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Case {
  std::string name;
  int hd, nq, nkv;
  bool causal;
  std::vector<int> segs;     // live segments
  std::vector<int> padding;  // padding segments after them (real_rows = their start)
  int tail;                  // rows past the last segment
  bool pass_real_rows;       // pass real_rows (else nullptr; padding must then be empty)
  float q_gain = 1.f;        // sharper or flatter softmax
};

struct Dev {
  uint16_t *qkv, *out, *dout, *dqkv;
  float *lse, *dsum;
  int32_t *cu, *real;
};

double rel_l2(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

void run_once(const Case& c, const Dev& d, int64_t T, int n_seg, int sms, cudaStream_t s) {
  const float scale = 1.f / std::sqrt(static_cast<float>(c.hd));
  const int64_t width = static_cast<int64_t>(c.nq + 2 * c.nkv) * c.hd;
  const int64_t hidden = static_cast<int64_t>(c.nq) * c.hd;
  // Poison every output: NaN bits.
  CK(cudaMemsetAsync(d.out, 0xff, T * hidden * 2, s));
  CK(cudaMemsetAsync(d.lse, 0xff, T * c.nq * 4, s));
  CK(cudaMemsetAsync(d.dqkv, 0xff, T * width * 2, s));
  CK(cudaMemsetAsync(d.dsum, 0xff, T * c.nq * 4, s));
  iris::cuda::launch_attention_train_forward(d.out, d.lse, d.qkv, d.cu,
                                             c.pass_real_rows ? d.real : nullptr, n_seg, T, c.nq,
                                             c.nkv, c.hd, scale, c.causal, sms, s);
  iris::cuda::launch_attention_train_backward(d.dqkv, d.dsum, d.dout, d.out, d.lse, d.qkv, d.cu,
                                              c.pass_real_rows ? d.real : nullptr, n_seg, T, c.nq,
                                              c.nkv, c.hd, scale, c.causal, sms, s);
}

bool run_case(const Case& c, int sms, std::mt19937& rng) {
  std::vector<int32_t> cu = {0};
  for (int l : c.segs) cu.push_back(cu.back() + l);
  const int32_t real_rows = cu.back();
  for (int l : c.padding) cu.push_back(cu.back() + l);
  const int n_seg = static_cast<int>(cu.size()) - 1;
  const int64_t T = cu.back() + c.tail;
  const int hd = c.hd, nq = c.nq, nkv = c.nkv, group = nq / nkv;
  const int64_t width = static_cast<int64_t>(nq + 2 * nkv) * hd, hidden = int64_t(nq) * hd;
  const int64_t koff = hidden, voff = hidden + int64_t(nkv) * hd;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));

  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> qkv(T * width), dout(T * hidden);
  for (int64_t r = 0; r < T; ++r)
    for (int64_t j = 0; j < width; ++j)
      qkv[r * width + j] = f2bf(nd(rng) * (j < hidden ? c.q_gain : 1.f));
  for (auto& x : dout) x = f2bf(nd(rng));

  Dev d{};
  CK(cudaMalloc(&d.qkv, T * width * 2));
  CK(cudaMalloc(&d.dqkv, T * width * 2));
  CK(cudaMalloc(&d.out, T * hidden * 2));
  CK(cudaMalloc(&d.dout, T * hidden * 2));
  CK(cudaMalloc(&d.lse, T * nq * 4));
  CK(cudaMalloc(&d.dsum, T * nq * 4));
  CK(cudaMalloc(&d.cu, cu.size() * 4));
  CK(cudaMalloc(&d.real, 4));
  CK(cudaMemcpy(d.qkv, qkv.data(), T * width * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.dout, dout.data(), T * hidden * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.cu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.real, &real_rows, 4, cudaMemcpyHostToDevice));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));

  std::vector<uint16_t> out[2], dqkv[2];
  std::vector<float> lse[2], dsum[2];
  for (int rep = 0; rep < 3; ++rep) {  // two eager runs, then one captured in a graph
    if (rep < 2) {
      run_once(c, d, T, n_seg, sms, s);
    } else {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      run_once(c, d, T, n_seg, sms, s);
      CK(cudaStreamEndCapture(s, &graph));
      CK(cudaGraphInstantiate(&exec, graph, 0));
      CK(cudaGraphLaunch(exec, s));
      CK(cudaStreamSynchronize(s));
      CK(cudaGraphExecDestroy(exec));
      CK(cudaGraphDestroy(graph));
    }
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    const int k = rep == 0 ? 0 : 1;
    out[k].resize(T * hidden);
    dqkv[k].resize(T * width);
    lse[k].resize(T * nq);
    dsum[k].resize(T * nq);
    CK(cudaMemcpy(out[k].data(), d.out, T * hidden * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dqkv[k].data(), d.dqkv, T * width * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lse[k].data(), d.lse, T * nq * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(dsum[k].data(), d.dsum, T * nq * 4, cudaMemcpyDeviceToHost));
    if (rep >= 1) {
      const bool same = out[0] == out[1] && dqkv[0] == dqkv[1] &&
                        std::memcmp(lse[0].data(), lse[1].data(), T * nq * 4) == 0 &&
                        std::memcmp(dsum[0].data(), dsum[1].data(), T * nq * 4) == 0;
      if (!same) {
        std::printf("%-14s FAIL: run %d differs bitwise from run 1%s\n", c.name.c_str(), rep + 1,
                    rep == 2 ? " (graph replay)" : "");
        return false;
      }
    }
  }

  // float64 reference on the bf16 inputs.
  auto Q = [&](int64_t i, int h, int dd) {
    return double(bf2f(qkv[i * width + int64_t(h) * hd + dd]));
  };
  auto K = [&](int64_t j, int g, int dd) {
    return double(bf2f(qkv[j * width + koff + int64_t(g) * hd + dd]));
  };
  auto V = [&](int64_t j, int g, int dd) {
    return double(bf2f(qkv[j * width + voff + int64_t(g) * hd + dd]));
  };
  auto DO = [&](int64_t i, int h, int dd) {
    return double(bf2f(dout[i * hidden + int64_t(h) * hd + dd]));
  };
  std::vector<double> o_ref(T * hidden, 0), lse_ref(T * nq, 0), dqkv_ref(T * width, 0);
  std::vector<char> live(T, 0);
  for (size_t sgi = 0; sgi < c.segs.size(); ++sgi) {
    const int64_t b = cu[sgi], e = cu[sgi + 1];
    for (int64_t i = b; i < e; ++i) live[i] = 1;
    for (int h = 0; h < nq; ++h) {
      const int g = h / group;
      std::vector<double> P((e - b) * (e - b), 0.0);  // [i - b][j - b]
      for (int64_t i = b; i < e; ++i) {
        const int64_t je = c.causal ? i + 1 : e;
        double mx = -1e300;
        for (int64_t j = b; j < je; ++j) {
          double sdot = 0;
          for (int dd = 0; dd < hd; ++dd) sdot += Q(i, h, dd) * K(j, g, dd);
          P[(i - b) * (e - b) + (j - b)] = sdot * scale;
          mx = std::max(mx, sdot * scale);
        }
        double sum = 0;
        for (int64_t j = b; j < je; ++j) sum += std::exp(P[(i - b) * (e - b) + (j - b)] - mx);
        for (int64_t j = b; j < je; ++j)
          P[(i - b) * (e - b) + (j - b)] = std::exp(P[(i - b) * (e - b) + (j - b)] - mx) / sum;
        lse_ref[i * nq + h] = mx + std::log(sum);
        for (int dd = 0; dd < hd; ++dd) {
          double acc = 0;
          for (int64_t j = b; j < je; ++j) acc += P[(i - b) * (e - b) + (j - b)] * V(j, g, dd);
          o_ref[i * hidden + int64_t(h) * hd + dd] = acc;
        }
      }
      // Backward of this head.
      for (int64_t i = b; i < e; ++i) {
        const int64_t je = c.causal ? i + 1 : e;
        double ds0 = 0;
        for (int dd = 0; dd < hd; ++dd)
          ds0 += DO(i, h, dd) * o_ref[i * hidden + int64_t(h) * hd + dd];
        for (int64_t j = b; j < je; ++j) {
          const double p = P[(i - b) * (e - b) + (j - b)];
          double dp = 0;
          for (int dd = 0; dd < hd; ++dd) dp += DO(i, h, dd) * V(j, g, dd);
          const double ds = p * (dp - ds0) * scale;
          for (int dd = 0; dd < hd; ++dd) {
            dqkv_ref[i * width + int64_t(h) * hd + dd] += ds * K(j, g, dd);
            dqkv_ref[j * width + koff + int64_t(g) * hd + dd] += ds * Q(i, h, dd);
            dqkv_ref[j * width + voff + int64_t(g) * hd + dd] += p * DO(i, h, dd);
          }
        }
      }
    }
  }

  // Compare live rows; dead rows must be exact zeros.
  std::vector<double> go, ro, gl, rl, gq, rq, gk, rk, gv, rv;
  bool nan = false, dead_ok = true;
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t j = 0; j < hidden; ++j) {
      const float v = bf2f(out[0][i * hidden + j]);
      nan |= !std::isfinite(v);
      if (live[i])
        go.push_back(v), ro.push_back(o_ref[i * hidden + j]);
      else
        dead_ok &= v == 0.f;
    }
    for (int h = 0; h < nq; ++h) {
      const float v = lse[0][i * nq + h];
      nan |= !std::isfinite(v) || !std::isfinite(dsum[0][i * nq + h]);
      if (live[i])
        gl.push_back(v), rl.push_back(lse_ref[i * nq + h]);
      else
        dead_ok &= v == 0.f && dsum[0][i * nq + h] == 0.f;
    }
    for (int64_t j = 0; j < width; ++j) {
      const float v = bf2f(dqkv[0][i * width + j]);
      nan |= !std::isfinite(v);
      if (!live[i]) {
        dead_ok &= v == 0.f;
        continue;
      }
      auto& g = j < koff ? gq : j < voff ? gk : gv;
      auto& r = j < koff ? rq : j < voff ? rk : rv;
      g.push_back(v);
      r.push_back(dqkv_ref[i * width + j]);
    }
  }
  const double e_o = rel_l2(go, ro), e_l = rel_l2(gl, rl), e_q = rel_l2(gq, rq),
               e_k = rel_l2(gk, rk), e_v = rel_l2(gv, rv);
  const bool ok =
      !nan && dead_ok && e_o < 2e-2 && e_l < 1e-3 && e_q < 2e-2 && e_k < 2e-2 && e_v < 2e-2;
  std::printf(
      "%-14s T=%-5lld hd=%-3d heads=%d/%d %-6s out %.2e lse %.2e dq %.2e dk %.2e dv %.2e"
      "%s%s  %s\n",
      c.name.c_str(), static_cast<long long>(T), hd, nq, nkv, c.causal ? "causal" : "full", e_o,
      e_l, e_q, e_k, e_v, nan ? " NaN/inf!" : "", dead_ok ? "" : " dead-rows-not-zero!",
      ok ? "PASS" : "FAIL");
  CK(cudaStreamDestroy(s));
  for (void* ptr : {(void*)d.qkv, (void*)d.dqkv, (void*)d.out, (void*)d.dout, (void*)d.lse,
                    (void*)d.dsum, (void*)d.cu, (void*)d.real})
    CK(cudaFree(ptr));
  return ok;
}

// Times forward and backward on a large shape; FLOPs counted as 4 hd nq per (query, key) pair
// seen for the forward and 2.5x that for the backward (the usual FlashAttention convention).
void bench(const char* name, int hd, int nq, int nkv, bool causal, const std::vector<int>& segs,
           int sms) {
  std::vector<int32_t> cu = {0};
  double pairs = 0;
  for (int l : segs) {
    cu.push_back(cu.back() + l);
    pairs += causal ? 0.5 * double(l) * (l + 1) : double(l) * l;
  }
  const int64_t T = cu.back(), width = int64_t(nq + 2 * nkv) * hd, hidden = int64_t(nq) * hd;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> h(T * width);
  for (auto& x : h) x = f2bf(nd(rng));
  std::vector<uint16_t> hdo(T * hidden);
  for (auto& x : hdo) x = f2bf(nd(rng));
  Dev d{};
  CK(cudaMalloc(&d.qkv, T * width * 2));
  CK(cudaMalloc(&d.dqkv, T * width * 2));
  CK(cudaMalloc(&d.out, T * hidden * 2));
  CK(cudaMalloc(&d.dout, T * hidden * 2));
  CK(cudaMalloc(&d.lse, T * nq * 4));
  CK(cudaMalloc(&d.dsum, T * nq * 4));
  CK(cudaMalloc(&d.cu, cu.size() * 4));
  CK(cudaMemcpy(d.qkv, h.data(), T * width * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.dout, hdo.data(), T * hidden * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.cu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  const float scale = 1.f / std::sqrt(float(hd));
  const int n_seg = static_cast<int>(segs.size());
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1, e2;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaEventCreate(&e2));
  std::vector<float> tf, tb;
  for (int rep = 0; rep < 13; ++rep) {
    CK(cudaEventRecord(e0, s));
    iris::cuda::launch_attention_train_forward(d.out, d.lse, d.qkv, d.cu, nullptr, n_seg, T, nq,
                                               nkv, hd, scale, causal, sms, s);
    CK(cudaEventRecord(e1, s));
    iris::cuda::launch_attention_train_backward(d.dqkv, d.dsum, d.dout, d.out, d.lse, d.qkv, d.cu,
                                                nullptr, n_seg, T, nq, nkv, hd, scale, causal, sms,
                                                s);
    CK(cudaEventRecord(e2, s));
    CK(cudaEventSynchronize(e2));
    float a, b;
    CK(cudaEventElapsedTime(&a, e0, e1));
    CK(cudaEventElapsedTime(&b, e1, e2));
    if (rep >= 3) tf.push_back(a), tb.push_back(b);
  }
  std::sort(tf.begin(), tf.end());
  std::sort(tb.begin(), tb.end());
  const double fl = 4.0 * hd * nq * pairs;
  const double mf = tf[tf.size() / 2], mb = tb[tb.size() / 2];
  std::printf("bench %-26s fwd %8.1f us %6.1f TFLOP/s   bwd %8.1f us %6.1f TFLOP/s\n", name,
              mf * 1e3, fl / (mf * 1e-3) / 1e12, mb * 1e3, 2.5 * fl / (mb * 1e-3) / 1e12);
  CK(cudaStreamDestroy(s));
  for (void* ptr : {(void*)d.qkv, (void*)d.dqkv, (void*)d.out, (void*)d.dout, (void*)d.lse,
                    (void*)d.dsum, (void*)d.cu})
    CK(cudaFree(ptr));
}

}  // namespace

int main(int argc, char** argv) {
  bool do_bench = false, only_bench = false;
  int bench_pick = -1;  // --only-bench=K: bench K alone
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--bench") == 0) do_bench = true;
    if (std::strncmp(argv[i], "--only-bench", 12) == 0) {
      do_bench = only_bench = true;
      if (argv[i][12] == '=') bench_pick = std::atoi(argv[i] + 13);
    }
  }
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  try {
    iris::cuda::attention_init();
    iris::cuda::attention_train_init();
    bool all = true;
    if (!only_bench) {
      std::mt19937 rng(12345);
      const std::vector<Case> cases = {
          {"vision_hd64", 64, 4, 4, false, {300, 256, 17, 0, 200}, {64, 40}, 20, true},
          {"vision_hd72", 72, 3, 3, false, {300, 256, 17, 0, 200}, {64, 40}, 20, true},
          {"vision_hd16", 16, 2, 2, false, {129, 64, 1, 250}, {33}, 5, true},
          {"vision_hd32", 32, 4, 4, false, {5, 300, 128}, {70}, 0, true},
          {"vision_hd80", 80, 2, 2, false, {257, 130}, {16}, 3, true},
          {"vision_sharp", 64, 2, 2, false, {400, 129}, {}, 0, false, 3.f},
          {"decoder_hd128", 128, 16, 8, true, {700, 333, 250}, {}, 17, false},
          {"decoder_hd16", 16, 4, 2, true, {400, 130, 77}, {}, 9, false},
          {"decoder_hd128_pad", 128, 8, 2, true, {300, 65, 1, 64}, {50}, 7, true},
          {"decoder_hd128_sharp", 128, 4, 4, true, {257}, {}, 0, false, 3.f},
          {"vision_hd64_gqa", 64, 4, 2, false, {130, 64, 1, 0, 129}, {}, 3, false},
          {"vision_hd72_long", 72, 2, 2, false, {2100, 70}, {30}, 0, true},
          {"causal_hd64_pad", 64, 8, 2, true, {300, 200}, {50}, 0, true},
          {"causal_hd72", 72, 4, 1, true, {190, 67}, {}, 4, false},
          {"generic_hd40", 40, 4, 2, true, {150, 90}, {}, 3, false},
          {"generic_hd24", 24, 2, 2, false, {100, 60}, {20}, 0, true},
          {"no_segments", 64, 2, 2, false, {}, {}, 16, false},
          {"all_padding", 32, 2, 2, true, {}, {40, 24}, 8, true},
      };
      for (const Case& c : cases) all &= run_case(c, sms, rng);
      std::printf("%s\n", all ? "ALL PASS" : "SOME FAILED");
    }
    if (do_bench) {
      struct B {
        const char* name;
        int hd, nq, nkv;
        bool causal;
        std::vector<int> segs;
      };
      const std::vector<B> benches = {
          {"decoder 1x4096 16/8x128", 128, 16, 8, true, {4096}},
          {"decoder 2x4096 16/8x128", 128, 16, 8, true, {4096, 4096}},
          {"decoder 1x8192 16/8x128", 128, 16, 8, true, {8192}},
          {"vision 16x1024 16x64", 64, 16, 16, false, std::vector<int>(16, 1024)},
          {"vision 4x4096 16x64", 64, 16, 16, false, std::vector<int>(4, 4096)},
          {"vision 64x256 16x64", 64, 16, 16, false, std::vector<int>(64, 256)},
          {"vision 16x1024 16x72", 72, 16, 16, false, std::vector<int>(16, 1024)},
          {"vision 1x16384 16x72", 72, 16, 16, false, {16384}},
      };
      for (size_t i = 0; i < benches.size(); ++i)
        if (bench_pick < 0 || bench_pick == static_cast<int>(i))
          bench(benches[i].name, benches[i].hd, benches[i].nq, benches[i].nkv, benches[i].causal,
                benches[i].segs, sms);
    }
    return all ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
