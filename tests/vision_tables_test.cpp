// Backend::vision_tables on the CPU, and plan_vision_inputs (the host layout the encoder uploaded
// before the tables moved onto the device), against tables written here straight from the spec
// (shared/docs/qwen-vl-spec.md 3.2 to 3.4): the op reads the grids from a device tensor (image
// count included) and must write every table so, bit for bit. The CUDA kernel is checked against
// this CPU op in tests/core_backend_ops_test.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/backend.h"
#include "core/vision_tables.h"
#include "vision/vision_encoder.h"

namespace iris {
namespace {

struct Mix {
  std::string name;
  std::vector<GridTHW> grids;
  int64_t padded_rows;  // 0: no padding
  int capacity;
};

// One image, eight of different shapes, a padded bucket with zero-length tail segments, frames
// (t > 1), and the all-padding call a graph is captured on.
std::vector<Mix> mixes() {
  return {
      {"one 448 image", {{1, 28, 28}}, 0, 2},
      {"eight images",
       {{1, 28, 28},
        {1, 16, 40},
        {1, 56, 14},
        {1, 2, 2},
        {1, 30, 18},
        {1, 8, 64},
        {1, 44, 44},
        {1, 4, 6}},
       0,
       9},
      {"three images in a 4096 bucket", {{1, 28, 28}, {1, 20, 36}, {1, 12, 12}}, 4096, 17},
      {"frames in a bucket", {{2, 16, 16}, {3, 8, 12}, {1, 10, 10}}, 1024, 8},
      {"exact bucket fit", {{1, 16, 16}, {1, 16, 16}}, 512, 4},
      {"all padding", {}, 256, 4},
  };
}

VisionConfig config(int head_dim, int grid_side, float theta) {
  VisionConfig v;
  v.num_heads = 4;
  v.hidden_size = 4 * head_dim;
  v.num_position_embeddings = grid_side * grid_side;
  v.spatial_merge_size = 2;
  v.rope_theta = theta;
  return v;
}

// The Qwen3-VL vision heads (64), a wider one (72), and the tiny fixture's (8 on a 4x4 grid).
std::vector<VisionConfig> configs() {
  return {config(64, 48, 10000.0f), config(72, 48, 10000.0f), config(8, 4, 10000.0f),
          config(16, 32, 1000000.0f)};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// bf16 rounding (nearest, ties to even) of a finite float, as torch's .to(bfloat16).
float to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// Spec 3.3: inv_freq[j] = 1 / theta^(2j / rot_dim), rot_dim = head_dim / 2, in float32, then held
// in bf16 as the model's buffers are.
std::vector<float> spec_inv_freq(int head_dim, float theta) {
  const int rot_dim = head_dim / 2;
  std::vector<float> out;
  for (int j = 0; j < rot_dim / 2; ++j)
    out.push_back(to_bf16(1.0f / std::pow(theta, float(2 * j) / float(rot_dim))));
  return out;
}

// Spec 3.2 step 1: torch.linspace in float32, the first half from the start, the rest from the end.
std::vector<float> spec_linspace(float end, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  const float step = n > 1 ? end / float(n - 1) : 0.0f;
  for (int64_t i = 0; i < n; ++i)
    out[size_t(i)] = n == 1 ? 0.0f : i < n / 2 ? step * float(i) : end - step * float(n - 1 - i);
  return out;
}

struct Tables {
  std::vector<float> cos, sin, weight;
  std::vector<int32_t> index, cu;
  int32_t real = 0;
};

// Every table of a call, computed per patch in raster order and then scattered to its row in
// merge-window order (spec 2.5's closed form), rather than walked in merge order as the op does.
// Padding rows rotate by nothing and weigh nothing (cos 1, sin 0, index 0, weight 0) and make one
// segment of their own; the offsets repeat up to the capacity.
Tables spec_tables(const std::vector<GridTHW>& grids, int64_t padded_rows, int capacity,
                   int head_dim, const std::vector<float>& inv, int G) {
  int64_t n = 0;
  for (const GridTHW& g : grids) n += g[0] * g[1] * g[2];
  const int64_t rows = std::max(n, padded_rows);
  const int hd = head_dim, quarter = head_dim / 4;
  Tables t;
  t.cos.assign(size_t(rows * hd), 1.0f);
  t.sin.assign(size_t(rows * hd), 0.0f);
  t.index.assign(size_t(rows * 4), 0);
  t.weight.assign(size_t(rows * 4), 0.0f);
  t.cu = {0};
  int64_t base = 0;
  for (const GridTHW& g : grids) {
    const int64_t h = g[1], w = g[2];
    const std::vector<float> hs = spec_linspace(float(G - 1), h),
                             ws = spec_linspace(float(G - 1), w);
    for (int64_t slice = 0; slice < g[0]; ++slice) {
      for (int64_t r = 0; r < h; ++r)
        for (int64_t c = 0; c < w; ++c) {
          const int64_t row = base + ((r / 2) * (w / 2) + c / 2) * 4 + (r % 2) * 2 + (c % 2);
          for (int j = 0; j < quarter; ++j)
            for (int copy = 0; copy < 2; ++copy) {  // emb = concat(f, f)
              const size_t at = size_t(row * hd + copy * 2 * quarter + j);
              t.cos[at] = std::cos(float(r) * inv[size_t(j)]);
              t.sin[at] = std::sin(float(r) * inv[size_t(j)]);
              t.cos[at + size_t(quarter)] = std::cos(float(c) * inv[size_t(j)]);
              t.sin[at + size_t(quarter)] = std::sin(float(c) * inv[size_t(j)]);
            }
          const int h0 = int(hs[size_t(r)]), w0 = int(ws[size_t(c)]);
          const int h1 = std::min(h0 + 1, G - 1), w1 = std::min(w0 + 1, G - 1);
          const float dh = hs[size_t(r)] - float(h0), dw = ws[size_t(c)] - float(w0);
          const int32_t idx[4] = {h0 * G + w0, h0 * G + w1, h1 * G + w0, h1 * G + w1};
          const float wt[4] = {(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw};
          for (int k = 0; k < 4; ++k) {
            t.index[size_t(row * 4 + k)] = idx[k];
            t.weight[size_t(row * 4 + k)] = wt[k];
          }
        }
      base += h * w;
      t.cu.push_back(int32_t(base));  // spec 3.4: one segment per temporal slice
    }
  }
  if (rows > n) t.cu.push_back(int32_t(rows));
  while (int(t.cu.size()) < capacity + 1) t.cu.push_back(t.cu.back());
  t.real = int32_t(n);
  return t;
}

TEST(CpuVisionTables, SpecTablesPinnedByHand) {
  // Grid (1, 2, 6) on a 4 x 4 learned grid: hs = linspace(0, 3, 2) = [0, 3], ws = linspace(0, 3,
  // 6) = [0, .6, 1.2, 1.8, 2.4, 3]; rows in merge order are (0,0) (0,1) (1,0) (1,1) (0,2) ...
  const std::vector<float> inv = {1.0f, 0.5f};
  const Tables t = spec_tables({{1, 2, 6}}, 16, 3, 8, inv, 4);
  const std::vector<int32_t> first_corner = {0, 0, 12, 12, 1, 1, 13, 13, 2, 3, 14, 15};
  for (size_t row = 0; row < first_corner.size(); ++row)
    EXPECT_EQ(t.index[row * 4], first_corner[row]) << row;
  // Patch (0, 1): w0 = 0, w1 = 1, dw = 0.6: weights 0.4 and 0.6 on the first row of the grid.
  EXPECT_EQ(std::vector<int32_t>(t.index.begin() + 4, t.index.begin() + 8),
            (std::vector<int32_t>{0, 1, 4, 5}));
  EXPECT_FLOAT_EQ(t.weight[4], 0.4f);
  EXPECT_FLOAT_EQ(t.weight[5], 0.6f);
  EXPECT_EQ(t.weight[6], 0.0f);
  // Patch (1, 0) (row 2): rotates by row 1 in columns 0-1 and 4-5, by column 0 in 2-3 and 6-7.
  EXPECT_EQ(t.cos[2 * 8 + 0], std::cos(1.0f));
  EXPECT_EQ(t.cos[2 * 8 + 1], std::cos(0.5f));
  EXPECT_EQ(t.cos[2 * 8 + 2], 1.0f);
  EXPECT_EQ(t.sin[2 * 8 + 4], std::sin(1.0f));
  // Padding rows 12..15: no rotation, no position embedding, one segment, then repeats.
  EXPECT_EQ(t.cos[12 * 8 + 3], 1.0f);
  EXPECT_EQ(t.weight[12 * 4], 0.0f);
  EXPECT_EQ(t.cu, (std::vector<int32_t>{0, 12, 16, 16}));
  EXPECT_EQ(t.real, 12);
  // The frequencies: 1 / 10000^(2j/32) for head_dim 64, j = 1 is 10^-0.25 = 0.5623, held in
  // bf16 as 0.5625.
  EXPECT_EQ(spec_inv_freq(64, 10000.0f)[1], 0.5625f);
}

TEST(CpuVisionTables, OpAndPlanVisionInputsEqualTheSpecTablesBitForBit) {
  auto be = make_cpu_backend();
  for (const VisionConfig& v : configs()) {
    // The frequencies the model uses are the spec's.
    const std::vector<float> inv = vision_rope_inv_freq(v.head_dim(), v.rope_theta);
    ASSERT_EQ(inv, spec_inv_freq(v.head_dim(), v.rope_theta));
    for (const Mix& mix : mixes()) {
      SCOPED_TRACE(mix.name + ", head_dim " + std::to_string(v.head_dim()));
      const Tables want = spec_tables(mix.grids, mix.padded_rows, mix.capacity, v.head_dim(), inv,
                                      v.position_grid_side());
      const VisionInputs plan = plan_vision_inputs(v, mix.grids, mix.padded_rows, mix.capacity);
      EXPECT_TRUE(same_bits(plan.cos, want.cos));
      EXPECT_TRUE(same_bits(plan.sin, want.sin));
      EXPECT_TRUE(same_bits(plan.pos_weight, want.weight));
      EXPECT_EQ(plan.pos_index, want.index);
      EXPECT_EQ(plan.cu_seqlens, want.cu);
      EXPECT_EQ(plan.n_patches, want.real);

      const int64_t R = plan.rows, hd = v.head_dim();
      const int C = mix.capacity;
      Arena arena(*be, size_t{64} << 20);
      const Tensor cos = arena.alloc(DType::f32, {R, hd}), sin = arena.alloc(DType::f32, {R, hd});
      const Tensor index = arena.alloc(DType::i32, {R, 4});
      const Tensor weight = arena.alloc(DType::f32, {R, 4});
      const Tensor cu = arena.alloc(DType::i32, {C + 1});
      const Tensor real = arena.alloc(DType::i32, {1});
      const Tensor grids = arena.alloc(DType::i32, {vision_grids_numel(C)});
      // Every output starts as garbage that the op must overwrite.
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (const Tensor* t : {&cos, &sin, &weight})
        std::fill(t->as<float>(), t->as<float>() + t->numel(), nan);
      for (const Tensor* t : {&index, &cu, &real})
        std::fill(t->as<int32_t>(), t->as<int32_t>() + t->numel(), -7);
      // Entries past the image count are never read: fill them with a grid that would fail.
      std::vector<int32_t> packed;
      pack_vision_grids(mix.grids, C, packed);
      for (size_t i = 1 + 3 * mix.grids.size(); i < packed.size(); ++i) packed[i] = 3;
      be->write(grids, packed.data(), DType::i32);

      be->vision_tables(cos, sin, index, weight, cu, real, grids, inv, v.spatial_merge_size,
                        v.position_grid_side());

      auto f32 = [&](const Tensor& t) {
        return std::vector<float>(t.as<float>(), t.as<float>() + t.numel());
      };
      auto i32 = [&](const Tensor& t) {
        return std::vector<int32_t>(t.as<int32_t>(), t.as<int32_t>() + t.numel());
      };
      EXPECT_TRUE(same_bits(f32(cos), want.cos));
      EXPECT_TRUE(same_bits(f32(sin), want.sin));
      EXPECT_TRUE(same_bits(f32(weight), want.weight));
      EXPECT_EQ(i32(index), want.index);
      EXPECT_EQ(i32(cu), want.cu);
      EXPECT_EQ(real.as<int32_t>()[0], want.real);
      // The segment count the host passes to attention is where the offsets stop growing.
      const std::vector<int32_t> c = i32(cu);
      EXPECT_EQ(c[static_cast<size_t>(plan.n_segments)], R);
      if (plan.n_segments > 0) EXPECT_LT(c[static_cast<size_t>(plan.n_segments) - 1], R);
    }
  }
}

TEST(CpuVisionTables, UnpaddedCallsWithoutCapacityKeepTheirExactSegments) {
  // plan_vision_inputs without a capacity lists exactly the segments used; the op, which always
  // has one, gives the same offsets followed by zero-length segments.
  const VisionConfig v = config(64, 48, 10000.0f);
  const std::vector<GridTHW> grids = {{2, 4, 6}, {1, 2, 2}};
  const VisionInputs exact = plan_vision_inputs(v, grids);
  EXPECT_EQ(exact.cu_seqlens, (std::vector<int32_t>{0, 24, 48, 52}));
  EXPECT_EQ(exact.n_segments, 3);
  const VisionInputs capped = plan_vision_inputs(v, grids, 0, 5);
  EXPECT_EQ(capped.cu_seqlens, (std::vector<int32_t>{0, 24, 48, 52, 52, 52}));
  EXPECT_TRUE(same_bits(exact.cos, capped.cos));
  const VisionCall call = plan_vision_call(v, grids, 64, 4);
  EXPECT_EQ(call.n_patches, 52);
  EXPECT_EQ(call.rows, 64);
  EXPECT_EQ(call.n_segments, 4);
}

TEST(CpuVisionTables, InvalidGridsAreRefusedBeforeAnythingIsWritten) {
  auto be = make_cpu_backend();
  const std::vector<float> inv_freq = vision_rope_inv_freq(8, 10000.0f);
  const int C = 3;
  const int64_t R = 32;
  Arena arena(*be, size_t{1} << 20);
  const Tensor cos = arena.alloc(DType::f32, {R, 8}), sin = arena.alloc(DType::f32, {R, 8});
  const Tensor index = arena.alloc(DType::i32, {R, 4}), weight = arena.alloc(DType::f32, {R, 4});
  const Tensor cu = arena.alloc(DType::i32, {C + 1}), real = arena.alloc(DType::i32, {1});
  const Tensor grids = arena.alloc(DType::i32, {vision_grids_numel(C)});
  auto run = [&](std::vector<int32_t> packed) {
    packed.resize(static_cast<size_t>(vision_grids_numel(C)), 0);
    be->write(grids, packed.data(), DType::i32);
    be->vision_tables(cos, sin, index, weight, cu, real, grids, inv_freq, 2, 4);
  };
  std::fill(cu.as<int32_t>(), cu.as<int32_t>() + C + 1, -5);
  EXPECT_THROW(run({1, 1, 3, 4}), Error);  // height not a multiple of the merge size
  EXPECT_THROW(run({1, 1, 8, 6}), Error);  // 48 patches in 32 rows
  EXPECT_THROW(run({3, 1, 2, 2, 1, 2, 2, 1, 2, 2}), Error);  // 3 images + padding: 4 segments
  EXPECT_THROW(run({2, 1, 2, 2, 2, 2, 2}), Error);           // 1 + 2 frames + padding: 4
  EXPECT_THROW(run({4}), Error);                             // more images than the capacity
  EXPECT_THROW(run({1, 0, 2, 2}), Error);                    // no frames
  EXPECT_EQ(cu.as<int32_t>()[0], -5);
  EXPECT_NO_THROW(run({2, 1, 2, 2, 1, 2, 6}));
  EXPECT_EQ(std::vector<int32_t>(cu.as<int32_t>(), cu.as<int32_t>() + C + 1),
            (std::vector<int32_t>{0, 4, 16, 32}));
  EXPECT_EQ(real.as<int32_t>()[0], 16);
}

}  // namespace
}  // namespace iris
