// The one FLOP count (bridge/model_flops.h) against counts written out by hand for the
// Qwen2.5-VL fixture: its gated vision MLP and its windowed blocks.
#include <gtest/gtest.h>

#include "bridge/model_config.h"
#include "bridge/model_flops.h"
#include "test_util.h"

namespace iris {
namespace {

TEST(ModelFlops, Qwen25VLWindowedBlocksAndGatedMlpCountedByHand) {
  const ModelConfig cfg = ModelConfig::from_file(test::data_dir() + "/qwen25vl-tiny/config.json");
  const VisionConfig& v = cfg.vision;
  ASSERT_EQ(v.hidden_size, 32);
  ASSERT_EQ(v.intermediate_size, 48);
  ASSERT_EQ(v.depth, 3);
  ASSERT_EQ(v.window_units(), 4);  // block 1 attends to whole frames, 0 and 2 within windows
  // 10 x 14 patches: 5 x 7 merged units, windows of 4x4, 4x3, 1x4 and 1x3 units (x4 patches).
  const ForwardFlops f = vision_tower_flops(v, {GridTHW{1, 10, 14}});
  const double D = 32, I = 48, rows = 140, patch_dim = 3 * 2 * 14 * 14;
  const double gemm = 2 * rows * patch_dim * D + 3 * rows * 2 * (4 * D * D + D * 2 * I + D * I);
  EXPECT_DOUBLE_EQ(f.gemm, gemm);
  const double windows = 4 * D * (64.0 * 64 + 48.0 * 48 + 16.0 * 16 + 12.0 * 12);
  const double frame = 4 * D * rows * rows;
  EXPECT_DOUBLE_EQ(f.attention, 2 * windows + frame);
  // The merger: 2x2 units of 32 -> 128 wide, then to the text width 16.
  EXPECT_DOUBLE_EQ(merger_flops(v, 140), 2 * 35.0 * (128 * 128 + 128 * 16));
}

TEST(ModelFlops, DecoderCountsCausalAttentionAfterThePast) {
  const ModelConfig cfg = ModelConfig::from_file(test::data_dir() + "/qwen25vl-tiny/config.json");
  const TextConfig& t = cfg.text;  // 16 wide, one head of 16, intermediate 48, 3 layers
  const ForwardFlops f = decoder_flops(t, 5, 10, 1);
  EXPECT_DOUBLE_EQ(f.gemm, 3 * 2 * 5 * (16.0 * 48 + 16 * 16 + 3 * 16 * 48) + 2 * 16.0 * 152064);
  EXPECT_DOUBLE_EQ(f.attention, 3 * 4 * 16.0 * (5 * 10 + 15));
}

}  // namespace
}  // namespace iris
