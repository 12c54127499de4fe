// Qwen2-VL: the Qwen2 decoder (q/k/v biases, no q/k norms) with contiguous M-RoPE sections, and a
// vision tower of LayerNorm blocks with a quick_gelu MLP, full attention within frames, no
// learned position embedding and no DeepStack; its vision config names the tower's width
// embed_dim and its MLP mlp_ratio (hidden_size is the output width). Flat hub layout, as
// Qwen2.5-VL.
#include <cmath>
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

class Qwen2VL final : public Qwen2FamilyArchitecture {
 public:
  const char* model_type() const override { return "qwen2_vl"; }
  const char* hf_class() const override { return "Qwen2VLForConditionalGeneration"; }
  const char* display_name() const override { return "Qwen2-VL"; }

  void read_config(const json& j, ModelConfig& c, const std::string& src) const override {
    std::string tw;
    qwen2_text_fields(j, c.text, c.tie_word_embeddings, src, tw);
    VisionConfig& v = c.vision;
    v = VisionConfig{};
    v.tower = &qwen2_vl_vision_tower();
    v.hidden_size = 1280;
    std::string vw;
    const json& vc = qwen2_vision_fields(j, v, c.text.hidden_size, src, vw);
    double mlp_ratio = 4;
    read_int(vc, "embed_dim", v.hidden_size, vw, 1, kMaxWidth);
    if (present(vc, "mlp_ratio"))
      mlp_ratio = json_real(vc["mlp_ratio"], vw, "mlp_ratio", 0.0, 1024.0, true);
    read_int(vc, "hidden_size", v.out_hidden_size, vw, 1, kMaxWidth);
    expect_activation(vc, vw, "quick_gelu");
    // HF sizes the MLP as int(embed_dim * mlp_ratio).
    const double inter = std::floor(v.hidden_size * mlp_ratio);
    IRIS_CHECK(inter >= 1 && inter <= double(kMaxWidth), vw, ": embed_dim x mlp_ratio = ", inter,
               " is out of range");
    v.intermediate_size = static_cast<int>(inter);
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
      t.norm(pre + "norm1", b.norm1_w, &b.norm1_b, D);
      t.norm(pre + "norm2", b.norm2_w, &b.norm2_b, D);
      t.linear(pre + "attn.qkv", b.qkv_w, b.qkv_b, 3 * D, D);
      t.linear(pre + "attn.proj", b.proj_w, b.proj_b, D, D);
      t.lora(cfg.lora, pre + "attn.", {{"qkv", 3 * D}}, D, b.qkv_lora);
      t.lora(cfg.lora, pre + "attn.", {{"proj", D}}, D, b.proj_lora);
      t.linear(pre + "mlp.fc1", b.fc1_w, b.fc1_b, I, D);
      t.linear(pre + "mlp.fc2", b.fc2_w, b.fc2_b, D, I);
      t.lora(cfg.lora, pre + "mlp.", {{"fc1", I}}, D, b.fc1_lora);
      t.lora(cfg.lora, pre + "mlp.", {{"fc2", D}}, I, b.fc2_lora);
    }
    t.norm(vis + "merger.ln_q", vw.merger.norm_w, &vw.merger.norm_b, D);
    t.linear(vis + "merger.mlp.0", vw.merger.fc1_w, vw.merger.fc1_b, M, M);
    t.linear(vis + "merger.mlp.2", vw.merger.fc2_w, vw.merger.fc2_b, out, M);
    t.lora(cfg.lora, vis + "merger.", {{"mlp.0", M}}, M, vw.merger.fc1_lora);
    t.lora(cfg.lora, vis + "merger.", {{"mlp.2", out}}, M, vw.merger.fc2_lora);
    declare_decoder(cfg, w, t, "model.language_model.", DecoderTensors::qwen2);
  }

  // Slice k of the video sits k positions after its start.
  std::vector<VisionRun> video_runs(const VideoClip& clip, const ModelConfig& cfg) const override {
    return whole_video_run(clip, cfg, 1);
  }
};

}  // namespace

const Architecture& qwen2_vl_architecture() {
  static const Qwen2VL arch;
  return arch;
}

}  // namespace iris
