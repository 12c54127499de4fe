// Qwen3-VL (dense), and what Qwen3-VL-MoE shares with it (bridge/arch_qwen3_family.h): a nested
// config, the Qwen3 decoder (q/k norms, no q/k/v bias) with interleaved M-RoPE, and a vision tower
// with a learned position grid and DeepStack mergers whose features are added after the first
// decoder layers. Tensors under transformers 5.x's module names (model.visual.*,
// model.language_model.*), as the released checkpoints store them.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "bridge/arch_qwen3_family.h"
#include "bridge/architecture.h"
#include "bridge/config_fields.h"
#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "bridge/rope_index.h"
#include "core/json_read.h"
#include "vision/video.h"
#include "vision/vision_tower.h"

namespace iris {

using nlohmann::json;
using namespace config_fields;

void Qwen3FamilyArchitecture::read_config(const json& j, ModelConfig& c,
                                          const std::string& src) const {
  IRIS_CHECK(j.contains("text_config") && j["text_config"].is_object(), src,
             ": missing text_config (Qwen3-VL configs are nested)");
  IRIS_CHECK(j.contains("vision_config") && j["vision_config"].is_object(), src,
             ": missing vision_config");
  const json& tc = j["text_config"];
  const std::string tw = src + ": text_config";
  TextConfig& t = c.text;
  read_text_fields(tc, t, tw);
  read_bool(tc, "attention_bias", t.attention_bias, tw);
  IRIS_CHECK(!t.attention_bias, tw, ".attention_bias=true is not a Qwen3 layout");
  // The top-level flag wins, as in HF; the text_config copy is a fallback.
  c.tie_word_embeddings = false;
  read_bool(tc, "tie_word_embeddings", c.tie_word_embeddings, tw);
  read_bool(j, "tie_word_embeddings", c.tie_word_embeddings, src);

  const json& vc = j["vision_config"];
  const std::string vw = src + ": vision_config";
  VisionConfig& v = c.vision;
  v.tower = &qwen3_vl_vision_tower();
  read_int(vc, "depth", v.depth, vw, 1, kMaxLayers);
  read_int(vc, "hidden_size", v.hidden_size, vw, 1, kMaxWidth);
  read_int(vc, "intermediate_size", v.intermediate_size, vw, 1, kMaxWidth);
  read_int(vc, "num_heads", v.num_heads, vw, 1, kMaxHeads);
  read_int(vc, "in_channels", v.in_channels, vw, 1, 64);
  read_int(vc, "patch_size", v.patch_size, vw, 1, 1024);
  read_int(vc, "spatial_merge_size", v.spatial_merge_size, vw, 1, 64);
  read_int(vc, "temporal_patch_size", v.temporal_patch_size, vw, 1, 64);
  read_int(vc, "out_hidden_size", v.out_hidden_size, vw, 1, kMaxWidth);
  read_int(vc, "num_position_embeddings", v.num_position_embeddings, vw, 1, kMaxPositions);
  read_increasing_ints(vc, "deepstack_visual_indexes", v.deepstack_visual_indexes, vw, 0,
                       v.depth - 1);
  expect_activation(vc, vw, "gelu_pytorch_tanh");
  // Deepstack feature k is added after decoder layer k.
  IRIS_CHECK(int(v.deepstack_visual_indexes.size()) <= t.num_hidden_layers, vw, ": ",
             v.deepstack_visual_indexes.size(),
             " deepstack_visual_indexes, more than text_config.num_hidden_layers ",
             t.num_hidden_layers, " (one decoder layer receives each)");
  try {
    v.position_grid_side();
  } catch (const Error& e) {
    IRIS_FAIL(vw, ": ", e.what());
  }
}

void Qwen3FamilyArchitecture::declare_weights(const ModelConfig& cfg, ModelWeights& w,
                                              WeightTable& t) const {
  const VisionConfig& v = cfg.vision;
  const int64_t D = v.hidden_size, I = v.intermediate_size, M = v.merged_dim(),
                out = v.out_hidden_size;
  VisionWeights& vw = w.vision;
  const std::string vis = "model.visual.";
  t.add(vis + "patch_embed.proj.weight", vw.patch_w, {D, v.patch_dim()},
        {D, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size});
  t.add(vis + "patch_embed.proj.bias", vw.patch_b, {D});
  t.add(vis + "pos_embed.weight", vw.pos_embed, {v.num_position_embeddings, D});
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
    t.linear(pre + "mlp.linear_fc1", b.fc1_w, b.fc1_b, I, D);
    t.linear(pre + "mlp.linear_fc2", b.fc2_w, b.fc2_b, D, I);
    t.lora(cfg.lora, pre + "mlp.", {{"linear_fc1", I}}, D, b.fc1_lora);
    t.lora(cfg.lora, pre + "mlp.", {{"linear_fc2", D}}, I, b.fc2_lora);
  }
  auto merger = [&](const std::string& pre, PatchMergerWeights& m, int64_t norm_dim) {
    t.norm(pre + "norm", m.norm_w, &m.norm_b, norm_dim);
    t.linear(pre + "linear_fc1", m.fc1_w, m.fc1_b, M, M);
    t.linear(pre + "linear_fc2", m.fc2_w, m.fc2_b, out, M);
  };
  merger(vis + "merger.", vw.merger, D);
  // The main merger takes adapters; the DeepStack mergers, whose GEMMs run beside the tower's
  // layers at inference, do not.
  t.lora(cfg.lora, vis + "merger.", {{"linear_fc1", M}}, M, vw.merger.fc1_lora);
  t.lora(cfg.lora, vis + "merger.", {{"linear_fc2", out}}, M, vw.merger.fc2_lora);
  vw.deepstack_mergers.resize(v.deepstack_visual_indexes.size());
  for (size_t k = 0; k < vw.deepstack_mergers.size(); ++k)
    merger(vis + "deepstack_merger_list." + std::to_string(k) + ".", vw.deepstack_mergers[k], M);
  declare_decoder(cfg, w, t, "model.language_model.", DecoderTensors::qwen3);
}

PreprocessorConfig Qwen3FamilyArchitecture::default_preprocessor(const ModelConfig& cfg) const {
  (void)cfg;
  return PreprocessorConfig{};
}

// Qwen3VLVideoProcessor's class defaults: 128 to 768 tokens' worth of pixels (32^2 each) over
// all frames, 2 frames a second, 4 to 768 frames.
VideoProcessorConfig Qwen3FamilyArchitecture::default_video_preprocessor(
    const ModelConfig& cfg) const {
  VideoProcessorConfig vc;
  vc.frame.patch_size = cfg.vision.patch_size;
  vc.frame.temporal_patch_size = cfg.vision.temporal_patch_size;
  vc.frame.merge_size = cfg.vision.spatial_merge_size;
  vc.frame.min_pixels = int64_t{128} * 32 * 32;
  vc.frame.max_pixels = int64_t{768} * 32 * 32;
  return vc;
}

std::vector<int64_t> Qwen3FamilyArchitecture::sample_video_frames(
    int64_t total, double video_fps, const VideoProcessorConfig& vc) const {
  return sample_frames_linspace(total, video_fps, vc);
}

// The pixel budget is over the whole clip, not a frame.
ResizedSize Qwen3FamilyArchitecture::video_frame_size(int64_t n_frames, int height, int width,
                                                      const VideoProcessorConfig& vc) const {
  const PreprocessorConfig& f = vc.frame;
  return smart_resize_video(n_frames, height, width, f.temporal_patch_size,
                            f.patch_size * f.merge_size, f.min_pixels, f.max_pixels);
}

// Each temporal slice is a block of its own after its time in text, "<t seconds>" with t the
// mean time of the slice's first and last frame (Qwen3VLProcessor._calculate_timestamps, which
// groups merge_size frames). transformers 5.x replaces only the template's <|video_pad|>, so
// the slices sit inside the template's own <|vision_start|> ... <|vision_end|>.
std::string Qwen3FamilyArchitecture::video_prompt_text(const VideoClip& clip) const {
  std::vector<int64_t> idx = clip.frame_indices;
  const size_t group = 2;
  while (!idx.empty() && idx.size() % group != 0) idx.push_back(idx.back());
  const double fps = clip.fps_or_default();
  std::string text = "<|vision_start|>";
  for (int64_t k = 0; k < clip.grid_thw[0]; ++k) {
    const size_t a = static_cast<size_t>(k) * group;
    IRIS_CHECK(a + group - 1 < idx.size(), "a video's ", clip.grid_thw[0], " temporal slices need ",
               clip.grid_thw[0] * 2, " frame indices, it has ", clip.frame_indices.size());
    const double t =
        (static_cast<double>(idx[a]) / fps + static_cast<double>(idx[a + group - 1]) / fps) / 2;
    char stamp[64];
    std::snprintf(stamp, sizeof(stamp), "<%.1f seconds>", t);
    text += stamp;
    text += "<|vision_start|><|video_pad|><|vision_end|>";
  }
  return text + "<|vision_end|>";
}

// One run per temporal slice: HF splits a video's grid into (1, h, w) rows.
std::vector<VisionRun> Qwen3FamilyArchitecture::video_runs(const VideoClip& clip,
                                                           const ModelConfig& cfg) const {
  const int m = cfg.vision.spatial_merge_size;
  return std::vector<VisionRun>(
      static_cast<size_t>(clip.grid_thw[0]),
      VisionRun{cfg.video_token_id, 1, clip.grid_thw[1] / m, clip.grid_thw[2] / m, 1});
}

namespace {

class Qwen3VL final : public Qwen3FamilyArchitecture {
 public:
  const char* model_type() const override { return "qwen3_vl"; }
  const char* hf_class() const override { return "Qwen3VLForConditionalGeneration"; }
  const char* display_name() const override { return "Qwen3-VL"; }
};

}  // namespace

const Architecture& qwen3_vl_architecture() {
  static const Qwen3VL arch;
  return arch;
}

}  // namespace iris
