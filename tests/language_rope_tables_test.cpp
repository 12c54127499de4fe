// Backend::text_rope_tables on the CPU against mrope_tables, the host tables the trainer uploaded
// before they moved onto the device: from the same positions, bit for bit; and the CUDA kernel
// against the CPU op, within two ulps (skipped without a GPU).
#include <gtest/gtest.h>

#include <algorithm>
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

TEST(CpuTextRopeTables, OpEqualsMropeTablesBitForBit) {
  auto be = make_cpu_backend();
  TextConfig cfg;  // Qwen3-VL's head_dim 128, theta 5e6, sections 24/20/20
  const int64_t n = 40, hd = cfg.head_dim;
  const std::vector<int64_t> pos = mixed_positions(n);
  std::vector<float> want_cos(static_cast<size_t>(n * hd)), want_sin(want_cos.size());
  mrope_tables(cfg, pos.data(), n, want_cos.data(), want_sin.data());

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

  // Every axis of the interleaved layout is used, and the text tokens' rows are 1D rotations.
  const std::vector<int> axes = mrope_pair_axes(cfg);
  for (int a = 0; a < 3; ++a) EXPECT_NE(std::count(axes.begin(), axes.end(), a), 0) << a;
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
