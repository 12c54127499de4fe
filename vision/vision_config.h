// Hyperparameters of the Qwen3-VL vision tower (HF Qwen3VLVisionConfig).
#pragma once

#include <cstdint>
#include <vector>

namespace iris {

struct VisionConfig {
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

  int head_dim() const { return hidden_size / num_heads; }
  int patch_dim() const { return in_channels * temporal_patch_size * patch_size * patch_size; }
  int merged_dim() const { return hidden_size * spatial_merge_size * spatial_merge_size; }
  int merge_unit() const { return spatial_merge_size * spatial_merge_size; }
  // Side of the learned position-embedding grid (48 for 2304 entries).
  int position_grid_side() const;
};

}  // namespace iris
