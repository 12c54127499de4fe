// Hyperparameters of a Qwen-VL vision tower (HF Qwen3VLVisionConfig, Qwen2_5_VLVisionConfig,
// Qwen2VLVisionConfig), and the family's tower (vision/vision_tower.h) that gives them meaning.
#pragma once

#include <cstdint>
#include <vector>

namespace iris {

class VisionTower;
const VisionTower& qwen3_vl_vision_tower();

struct VisionConfig {
  // The family's own pieces (norms, MLP, embedding); the defaults below are Qwen3-VL's.
  const VisionTower* tower = &qwen3_vl_vision_tower();
  int depth = 27;
  int hidden_size = 1152;
  int intermediate_size = 4304;
  int num_heads = 16;
  int in_channels = 3;
  int patch_size = 16;
  int spatial_merge_size = 2;
  int temporal_patch_size = 2;
  int out_hidden_size = 3584;
  int num_position_embeddings = 2304;
  std::vector<int> deepstack_visual_indexes{8, 16, 24};
  float layer_norm_eps = 1e-6f;
  float rope_theta = 10000.0f;
  // Window attention (Qwen2.5-VL): the window's side in pixels (0: every block attends within
  // whole frames) and the blocks that still do.
  int window_size = 0;
  std::vector<int> fullatt_block_indexes;
  // Video M-RoPE (Qwen2.5-VL): temporal positions per second of video.
  int tokens_per_second = 2;

  int head_dim() const { return hidden_size / num_heads; }
  int patch_dim() const { return in_channels * temporal_patch_size * patch_size * patch_size; }
  int merged_dim() const { return hidden_size * spatial_merge_size * spatial_merge_size; }
  int merge_unit() const { return spatial_merge_size * spatial_merge_size; }
  // Merged units per window side (0 without window attention).
  int window_units() const {
    return window_size > 0 ? window_size / (patch_size * spatial_merge_size) : 0;
  }
  // Whether block l attends within windows rather than whole frames.
  bool windowed_block(int l) const;
  // Side of the learned position-embedding grid (48 for 2304 entries; 1 without one).
  int position_grid_side() const;
};

}  // namespace iris
