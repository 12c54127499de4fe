// Backend::text_rope_tables on the CPU, and mrope_tables (the host tables the trainer uploaded
// before they moved onto the device), against tables written here straight from the spec
// (shared/docs/qwen-vl-spec.md 4.4): from the same positions, bit for bit; and the CUDA kernel
// against the CPU op, within two ulps (skipped without a GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/arena.h"
#include "core/backend.h"
#include "core/error.h"
#include "language/mrope.h"

namespace iris {
namespace {

// Positions of an image between text, as get_rope_index lays them out: T, H, W rows of n each.
std::vector<int64_t> mixed_positions(int64_t n) {
  std::vector<int64_t> p(static_cast<size_t>(3 * n));
  for (int64_t t = 0; t < n; ++t) {
    const bool image = t >= 5 && t < 5 + 24;  // a 4 x 6 merged grid
    const int64_t k = t - 5;
    p[static_cast<size_t>(t)] = image ? 5 : (t < 5 ? t : t - 24 + 6);
    p[static_cast<size_t>(n + t)] = image ? 5 + k / 6 : p[static_cast<size_t>(t)];
    p[static_cast<size_t>(2 * n + t)] = image ? 5 + k % 6 : p[static_cast<size_t>(t)];
  }
  p[static_cast<size_t>(n - 1)] = p[static_cast<size_t>(2 * n - 1)] =
      p[static_cast<size_t>(3 * n - 1)] = 262000;  // far into a long context
  return p;
}

// bf16 rounding (nearest, ties to even) of a finite float, as torch's .to(bfloat16).
float to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// Spec 4.4: inv_freq[j] = 1 / theta^(2j / head_dim) in float32 (held in bf16 with the model's
// buffers), and the interleaved sections: pair j turns with H for j = 1 mod 3 below 3 * s_H, with
// W for j = 2 mod 3 below 3 * s_W, and with T otherwise.
struct SpecRope {
  std::vector<float> inv;
  std::vector<int> axis;
};
SpecRope spec_rope(int head_dim, float theta, int section_h, int section_w) {
  SpecRope r;
  for (int j = 0; j < head_dim / 2; ++j) {
    r.inv.push_back(to_bf16(1.0f / std::pow(theta, float(2 * j) / float(head_dim))));
    r.axis.push_back(j % 3 == 1 && j < 3 * section_h ? 1 : j % 3 == 2 && j < 3 * section_w ? 2 : 0);
  }
  return r;
}

// cos/sin [n, head_dim] of positions given as 3 rows (T, H, W) of n: emb = concat(freq, freq).
void spec_tables(const SpecRope& r, const std::vector<int64_t>& pos, int64_t n,
                 std::vector<float>& cos, std::vector<float>& sin) {
  const int64_t half = static_cast<int64_t>(r.inv.size()), hd = 2 * half;
  cos.assign(static_cast<size_t>(n * hd), 0.0f);
  sin.assign(cos.size(), 0.0f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < half; ++j) {
      const float f = static_cast<float>(pos[size_t(r.axis[size_t(j)] * n + t)]) * r.inv[size_t(j)];
      for (int64_t col : {j, half + j}) {
        cos[size_t(t * hd + col)] = std::cos(f);
        sin[size_t(t * hd + col)] = std::sin(f);
      }
    }
}

TEST(CpuTextRopeTables, SpecTablesPinnedByHand) {
  const SpecRope r = spec_rope(128, 5e6f, 20, 20);  // Qwen3-VL: sections [24, 20, 20]
  // T owns j = 0, 3, ..., 57 and 60..63 (24 pairs), H and W 20 each.
  EXPECT_EQ(std::count(r.axis.begin(), r.axis.end(), 0), 24);
  EXPECT_EQ(std::count(r.axis.begin(), r.axis.end(), 1), 20);
  EXPECT_EQ(r.axis[1], 1);
  EXPECT_EQ(r.axis[2], 2);
  EXPECT_EQ(r.axis[58], 1);
  EXPECT_EQ(r.axis[59], 2);
  EXPECT_EQ(r.axis[61], 0);
  // inv_freq[1] = 5e6^(-1/64) = 0.78579..., held in bf16 as 0.78515625.
  EXPECT_EQ(r.inv[0], 1.0f);
  EXPECT_EQ(r.inv[1], 0.78515625f);
  // An image token at (T, H, W) = (5, 6, 7): pair 0 turns with 5, pair 1 with 6, pair 2 with 7,
  // and column 64 + j repeats column j.
  std::vector<float> cos, sin;
  spec_tables(r, {5, 6, 7}, 1, cos, sin);
  EXPECT_EQ(cos[0], std::cos(5.0f));
  EXPECT_EQ(cos[1], std::cos(6.0f * 0.78515625f));
  EXPECT_EQ(sin[2], std::sin(7.0f * r.inv[2]));
  EXPECT_EQ(cos[64 + 1], cos[1]);
  // Position 0 does not rotate.
  spec_tables(r, {0, 0, 0}, 1, cos, sin);
  EXPECT_EQ(cos, std::vector<float>(128, 1.0f));
  EXPECT_EQ(sin, std::vector<float>(128, 0.0f));
}

TEST(CpuTextRopeTables, OpAndMropeTablesEqualTheSpecTablesBitForBit) {
  auto be = make_cpu_backend();
  TextConfig cfg;  // Qwen3-VL's head_dim 128, theta 5e6, sections 24/20/20
  const int64_t n = 40, hd = cfg.head_dim;
  const SpecRope spec =
      spec_rope(cfg.head_dim, cfg.rope_theta, cfg.mrope_section[1], cfg.mrope_section[2]);
  // The model's frequencies and axes are the spec's.
  ASSERT_EQ(mrope_inv_freq(cfg), spec.inv);
  ASSERT_EQ(mrope_pair_axes(cfg), spec.axis);
  const std::vector<int64_t> pos = mixed_positions(n);
  std::vector<float> want_cos, want_sin;
  spec_tables(spec, pos, n, want_cos, want_sin);

  std::vector<float> host_cos(want_cos.size()), host_sin(want_sin.size());
  mrope_tables(cfg, pos.data(), n, host_cos.data(), host_sin.data());
  EXPECT_EQ(std::memcmp(host_cos.data(), want_cos.data(), want_cos.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(host_sin.data(), want_sin.data(), want_sin.size() * sizeof(float)), 0);

  std::vector<int32_t> token_major(static_cast<size_t>(3 * n));
  for (int64_t t = 0; t < n; ++t)
    for (int a = 0; a < 3; ++a)
      token_major[static_cast<size_t>(t * 3 + a)] = static_cast<int32_t>(pos[size_t(a * n + t)]);
  Arena arena(*be, size_t(1) << 20);
  const Tensor positions = arena.alloc(DType::i32, {n, 3});
  const Tensor cos = arena.alloc(DType::f32, {n, hd}), sin = arena.alloc(DType::f32, {n, hd});
  be->write(positions, token_major.data(), DType::i32);
  be->text_rope_tables(cos, sin, positions, mrope_inv_freq(cfg), mrope_pair_axes(cfg));
  std::vector<float> got_cos(want_cos.size()), got_sin(want_sin.size());
  be->read(got_cos.data(), DType::f32, cos);
  be->read(got_sin.data(), DType::f32, sin);
  EXPECT_EQ(std::memcmp(got_cos.data(), want_cos.data(), got_cos.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(got_sin.data(), want_sin.data(), got_sin.size() * sizeof(float)), 0);

  // Text tokens (all three axes equal) get 1D rotations: the same as mrope_tables_1d's.
  std::vector<float> one_cos(size_t(5 * hd)), one_sin(one_cos.size());
  mrope_tables_1d(cfg, 0, 5, one_cos.data(), one_sin.data());
  EXPECT_EQ(std::memcmp(one_cos.data(), want_cos.data(), one_cos.size() * sizeof(float)), 0);
}

TEST(CpuTextRopeTables, MismatchedShapesAreRefused) {
  auto be = make_cpu_backend();
  TextConfig cfg;
  Arena arena(*be, size_t(1) << 20);
  const Tensor positions = arena.alloc(DType::i32, {4, 3});
  const Tensor cos = arena.alloc(DType::f32, {4, cfg.head_dim});
  const Tensor short_sin = arena.alloc(DType::f32, {3, cfg.head_dim});
  EXPECT_THROW(
      be->text_rope_tables(cos, short_sin, positions, mrope_inv_freq(cfg), mrope_pair_axes(cfg)),
      Error);
  std::vector<int> bad_axes = mrope_pair_axes(cfg);
  bad_axes[3] = 3;
  EXPECT_THROW(be->text_rope_tables(cos, cos, positions, mrope_inv_freq(cfg), bad_axes), Error);
}

// Distance in representable floats (same-sign finite values, which cos and sin are or are 0).
int64_t ulps(float a, float b) {
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  if (ia < 0) ia = INT32_MIN - ia;
  if (ib < 0) ib = INT32_MIN - ib;
  return std::llabs(static_cast<int64_t>(ia) - ib);
}

TEST(CudaTextRopeTables, KernelWithinTwoUlpsOfTheCpuOp) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  TextConfig cfg;
  auto cpu = make_cpu_backend();
  auto gpu = make_cuda_backend(0);
  for (int64_t L : {int64_t{1}, int64_t{37}, int64_t{4096}}) {
    SCOPED_TRACE(L);
    // Spread over a long context: small positions, large ones, and every axis different.
    std::vector<int32_t> positions(static_cast<size_t>(3 * L));
    for (size_t i = 0; i < positions.size(); ++i)
      positions[i] = static_cast<int32_t>((i * 2654435761u) % 300000u);
    auto run = [&](Backend& be, std::vector<float>& cos, std::vector<float>& sin) {
      Arena arena(be, size_t(L) * (3 * 4 + 2 * 4 * cfg.head_dim) + 4096);
      const Tensor p = arena.alloc(DType::i32, {L, 3});
      const Tensor c = arena.alloc(DType::f32, {L, cfg.head_dim});
      const Tensor s = arena.alloc(DType::f32, {L, cfg.head_dim});
      be.write(p, positions.data(), DType::i32);
      be.text_rope_tables(c, s, p, mrope_inv_freq(cfg), mrope_pair_axes(cfg));
      cos.resize(static_cast<size_t>(L * cfg.head_dim));
      sin.resize(cos.size());
      be.read(cos.data(), DType::f32, c);
      be.read(sin.data(), DType::f32, s);
    };
    std::vector<float> want_cos, want_sin, got_cos, got_sin;
    run(*cpu, want_cos, want_sin);
    run(*gpu, got_cos, got_sin);
    int64_t worst = 0;
    for (size_t e = 0; e < want_cos.size(); ++e)
      worst = std::max({worst, ulps(got_cos[e], want_cos[e]), ulps(got_sin[e], want_sin[e])});
    EXPECT_LE(worst, 2) << "cos/sin ulps";
  }
}

}  // namespace
}  // namespace iris
