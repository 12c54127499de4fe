// Backend::vision_tables on the CPU against plan_vision_inputs, the host layout the encoder
// uploaded before the tables moved onto the device: the op reads the grids from a device tensor
// (image count included) and must write every table as the host lays it out, bit for bit.
// The CUDA kernel is checked against this CPU op in tests/core_backend_ops_test.cpp.
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

TEST(CpuVisionTables, OpEqualsPlanVisionInputsBitForBit) {
  auto be = make_cpu_backend();
  for (const VisionConfig& v : configs())
    for (const Mix& mix : mixes()) {
      SCOPED_TRACE(mix.name + ", head_dim " + std::to_string(v.head_dim()));
      const VisionInputs want = plan_vision_inputs(v, mix.grids, mix.padded_rows, mix.capacity);
      const int64_t R = want.rows, hd = v.head_dim();
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

      be->vision_tables(cos, sin, index, weight, cu, real, grids,
                        vision_rope_inv_freq(v.head_dim(), v.rope_theta), v.spatial_merge_size,
                        v.position_grid_side());

      auto f32 = [&](const Tensor& t) {
        return std::vector<float>(t.as<float>(), t.as<float>() + t.numel());
      };
      auto i32 = [&](const Tensor& t) {
        return std::vector<int32_t>(t.as<int32_t>(), t.as<int32_t>() + t.numel());
      };
      EXPECT_TRUE(same_bits(f32(cos), want.cos));
      EXPECT_TRUE(same_bits(f32(sin), want.sin));
      EXPECT_TRUE(same_bits(f32(weight), want.pos_weight));
      EXPECT_EQ(i32(index), want.pos_index);
      EXPECT_EQ(i32(cu), want.cu_seqlens);
      EXPECT_EQ(real.as<int32_t>()[0], want.n_patches);
      // The segment count the host passes to attention is where the offsets stop growing.
      const std::vector<int32_t> c = i32(cu);
      EXPECT_EQ(c[static_cast<size_t>(want.n_segments)], R);
      if (want.n_segments > 0) EXPECT_LT(c[static_cast<size_t>(want.n_segments) - 1], R);
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
