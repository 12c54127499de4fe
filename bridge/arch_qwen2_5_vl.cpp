// Qwen2.5-VL: the Qwen2 decoder (q/k/v biases, no q/k norms) with contiguous M-RoPE sections,
// and a vision tower of RMSNorm blocks with a gated SiLU MLP, window attention between
// full-attention blocks, no learned position embedding and no DeepStack. The hub's checkpoints
// are flat (text fields at the top level) and name tensors visual.* and model.*; Iris's table
// uses transformers 5.x's module names (model.visual.*, model.language_model.*), which exports
// write, and loads either (bridge/hf_weights.cpp), as HF does.
#include <nlohmann/json.hpp>

#include "bridge/arch_qwen2_family.h"
#include "bridge/architecture.h"
#include "bridge/config_fields.h"
#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "bridge/rope_index.h"
#include "core/json_read.h"
#include "vision/video.h"
#include "vision/vision_tower.h"

namespace iris {
namespace {

using nlohmann::json;
using namespace config_fields;

class Qwen25VL final : public Qwen2FamilyArchitecture {
 public:
  const char* model_type() const override { return "qwen2_5_vl"; }
  const char* hf_class() const override { return "Qwen2_5_VLForConditionalGeneration"; }
  const char* display_name() const override { return "Qwen2.5-VL"; }

  void read_config(const json& j, ModelConfig& c, const std::string& src) const override {
    std::string tw;
    qwen2_text_fields(j, c.text, c.tie_word_embeddings, src, tw);
    VisionConfig& v = c.vision;
    v = VisionConfig{};
    v.tower = &qwen2_5_vl_vision_tower();
    // HF's class defaults, which the released configs spell out anyway.
    v.hidden_size = 1280;
    v.intermediate_size = 3420;
    v.window_size = 112;
    v.fullatt_block_indexes = {7, 15, 23, 31};
    v.tokens_per_second = 4;
    std::string vw;
    const json& vc = qwen2_vision_fields(j, v, c.text.hidden_size, src, vw);
    read_int(vc, "hidden_size", v.hidden_size, vw, 1, kMaxWidth);
    read_int(vc, "intermediate_size", v.intermediate_size, vw, 1, kMaxWidth);
    read_int(vc, "out_hidden_size", v.out_hidden_size, vw, 1, kMaxWidth);
    read_int(vc, "window_size", v.window_size, vw, 1, 1 << 20);
    read_increasing_ints(vc, "fullatt_block_indexes", v.fullatt_block_indexes, vw, 0, v.depth - 1);
    read_int(vc, "tokens_per_second", v.tokens_per_second, vw, 0, 1 << 20);
    expect_activation(vc, vw, "silu");
    for (int b : v.fullatt_block_indexes)
      IRIS_CHECK(b < v.depth, vw, ".fullatt_block_indexes names block ", b, " of a tower of ",
                 v.depth, " blocks (vision_config.depth)");
    const int unit = v.patch_size * v.spatial_merge_size;
    IRIS_CHECK(v.window_size % unit == 0, vw, ".window_size ", v.window_size,
               " must be a multiple of patch_size x spatial_merge_size = ", unit,
               " (windows are whole merged units)");
  }

  void declare_weights(const ModelConfig& cfg, ModelWeights& w, WeightTable& t) const override {
    const VisionConfig& v = cfg.vision;
    const int64_t D = v.hidden_size, I = v.intermediate_size, M = v.merged_dim(),
                  out = v.out_hidden_size;
    VisionWeights& vw = w.vision;
    const std::string vis = "model.visual.";
    t.add(vis + "patch_embed.proj.weight", vw.patch_w, {D, v.patch_dim()},
          {D, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size});
    vw.blocks.resize(static_cast<size_t>(v.depth));
    for (int i = 0; i < v.depth; ++i) {
      const std::string pre = vis + "blocks." + std::to_string(i) + ".";
      VisionBlockWeights& b = vw.blocks[i];
      t.norm(pre + "norm1", b.norm1_w, nullptr, D);
      t.norm(pre + "norm2", b.norm2_w, nullptr, D);
      t.linear(pre + "attn.qkv", b.qkv_w, b.qkv_b, 3 * D, D);
      t.linear(pre + "attn.proj", b.proj_w, b.proj_b, D, D);
      t.lora(cfg.lora, pre + "attn.", {{"qkv", 3 * D}}, D, b.qkv_lora);
      t.lora(cfg.lora, pre + "attn.", {{"proj", D}}, D, b.proj_lora);
      // gate_proj and up_proj stacked, as the decoder's gate_up (the tower's swiglu reads it).
      t.add_stacked(b.fc1_w, {2 * I, D});
      t.part(pre + "mlp.gate_proj.weight", {I, D}, b.fc1_w, 0);
      t.part(pre + "mlp.up_proj.weight", {I, D}, b.fc1_w, I);
      t.add_stacked(b.fc1_b, {2 * I});
      t.part(pre + "mlp.gate_proj.bias", {I}, b.fc1_b, 0);
      t.part(pre + "mlp.up_proj.bias", {I}, b.fc1_b, I);
      t.linear(pre + "mlp.down_proj", b.fc2_w, b.fc2_b, D, I);
      t.lora(cfg.lora, pre + "mlp.", {{"gate_proj", I}, {"up_proj", I}}, D, b.fc1_lora);
      t.lora(cfg.lora, pre + "mlp.", {{"down_proj", D}}, I, b.fc2_lora);
    }
    t.norm(vis + "merger.ln_q", vw.merger.norm_w, nullptr, D);
    t.linear(vis + "merger.mlp.0", vw.merger.fc1_w, vw.merger.fc1_b, M, M);
    t.linear(vis + "merger.mlp.2", vw.merger.fc2_w, vw.merger.fc2_b, out, M);
    t.lora(cfg.lora, vis + "merger.", {{"mlp.0", M}}, M, vw.merger.fc1_lora);
    t.lora(cfg.lora, vis + "merger.", {{"mlp.2", out}}, M, vw.merger.fc2_lora);
    declare_decoder(cfg, w, t, "model.language_model.", DecoderTensors::qwen2);
  }

  // Slice k sits k * tokens_per_second * int(second_per_grid_t) positions after the start, with
  // second_per_grid_t = temporal_patch_size / the frames kept per second (transformers 5.x
  // truncates the seconds first: 4.x multiplied, then truncated, which differs for clips sampled at
  // other rates than 2 frames a second).
  std::vector<VisionRun> video_runs(const VideoClip& clip, const ModelConfig& cfg) const override {
    return whole_video_run(
        clip, cfg,
        cfg.vision.tokens_per_second *
            static_cast<int64_t>(clip.seconds_per_slice(cfg.vision.temporal_patch_size)));
  }
};

}  // namespace

const Architecture& qwen2_5_vl_architecture() {
  static const Qwen25VL arch;
  return arch;
}

}  // namespace iris
