#include "bridge/model_config.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "bridge/architecture.h"
#include "bridge/config_fields.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/json_read.h"

namespace iris {

using nlohmann::json;
using namespace config_fields;

ModelConfig ModelConfig::from_file(const std::string& path) {
  return from_json_text(read_text_file(path, "model config", kJsonConfigLimits.max_bytes), path);
}

ModelConfig ModelConfig::from_json_text(const std::string& text, const std::string& src) {
  const json j = parse_json(text, src);
  IRIS_CHECK(j.is_object(), src, " must hold a JSON object");
  ModelConfig c;
  read_string(j, "model_type", c.model_type, src);
  c.arch = &architecture_for(c.model_type, src);
  c.arch->read_config(j, c, src);

  // What every family shares: the special tokens, the tied head, and the vision tower's
  // geometry as the preprocessing and the merger see it.
  TextConfig& t = c.text;
  t.tie_word_embeddings = c.tie_word_embeddings;
  // Special tokens given here index the embedding table. (The defaults are Qwen's ids, which a
  // small test vocabulary may not reach; prefill checks every id it embeds.)
  read_int(j, "image_token_id", c.image_token_id, src, 0, t.vocab_size - 1);
  read_int(j, "video_token_id", c.video_token_id, src, 0, t.vocab_size - 1);
  read_int(j, "vision_start_token_id", c.vision_start_token_id, src, 0, t.vocab_size - 1);
  read_int(j, "vision_end_token_id", c.vision_end_token_id, src, 0, t.vocab_size - 1);
  const VisionConfig& v = c.vision;
  const std::string vw = src + ": vision_config";
  // Iris's image preprocessing produces RGB, so the patch embedding must take three channels.
  IRIS_CHECK(v.in_channels == 3, vw, ".in_channels is ", v.in_channels,
             " but images are preprocessed to 3 channels (RGB)");
  IRIS_CHECK(v.hidden_size % v.num_heads == 0 && v.head_dim() % 4 == 0, vw, ".hidden_size ",
             v.hidden_size, " / num_heads ", v.num_heads,
             " must be a whole head size divisible by 4 (2D RoPE)");
  IRIS_CHECK(int64_t{v.hidden_size} * v.spatial_merge_size * v.spatial_merge_size <= kMaxWidth, vw,
             ".hidden_size x spatial_merge_size^2 is out of range (at most ", kMaxWidth, ")");
  IRIS_CHECK(
      int64_t{v.in_channels} * v.temporal_patch_size * v.patch_size * v.patch_size <= kMaxWidth, vw,
      ": in_channels x temporal_patch_size x patch_size^2 is out of range (at most ", kMaxWidth,
      ")");
  IRIS_CHECK(v.out_hidden_size == t.hidden_size, vw, ".out_hidden_size ", v.out_hidden_size,
             " must equal the text hidden_size ", t.hidden_size);
  return c;
}

PreprocessorConfig model_preprocessor(const std::string& model_dir, const ModelConfig& cfg) {
  namespace fs = std::filesystem;
  const fs::path path = fs::path(model_dir) / "preprocessor_config.json";
  if (!fs::exists(path)) {
    // Without the file, the family's released values with the model's own patch geometry.
    PreprocessorConfig pp = cfg.arch->default_preprocessor(cfg);
    pp.patch_size = cfg.vision.patch_size;
    pp.temporal_patch_size = cfg.vision.temporal_patch_size;
    pp.merge_size = cfg.vision.spatial_merge_size;
    return pp;
  }
  const PreprocessorConfig pp = PreprocessorConfig::from_file(path.string());
  check_preprocessor_matches(cfg, pp, (fs::path(model_dir) / "config.json").string(),
                             path.string());
  return pp;
}

VideoProcessorConfig model_video_preprocessor(const std::string& model_dir,
                                              const ModelConfig& cfg) {
  namespace fs = std::filesystem;
  VideoProcessorConfig base = cfg.arch->default_video_preprocessor(cfg);
  for (const char* name : {"video_preprocessor_config.json", "preprocessor_config.json"}) {
    const fs::path path = fs::path(model_dir) / name;
    if (!fs::exists(path)) continue;
    const std::string text =
        read_text_file(path.string(), "video processor config", kJsonConfigLimits.max_bytes);
    const VideoProcessorConfig vc =
        VideoProcessorConfig::from_json(parse_json(text, path.string()), base, path.string());
    check_preprocessor_matches(cfg, vc.frame, (fs::path(model_dir) / "config.json").string(),
                               path.string());
    return vc;
  }
  return base;
}

VideoClip load_model_video(const std::string& path, const ModelConfig& cfg,
                           const VideoProcessorConfig& vpre,
                           const std::function<void(const VideoPlan&)>& check, VideoOutput output) {
  ResizedSize size{};
  const DecodedVideo d = decode_video(path, [&](const VideoInfo& info) {
    std::vector<int64_t> keep = cfg.arch->sample_video_frames(info.total_frames, info.fps, vpre);
    size = cfg.arch->video_frame_size(static_cast<int64_t>(keep.size()), info.height, info.width,
                                      vpre);
    if (check) check(VideoPlan{info, keep, size});
    return keep;
  });
  VideoClip clip = preprocess_video(d.frames, size, vpre, output);
  clip.frame_indices = d.indices;
  clip.total_frames = d.info.total_frames;
  clip.video_fps = d.info.fps;
  return clip;
}

void check_preprocessor_matches(const ModelConfig& cfg, const PreprocessorConfig& pp,
                                const std::string& config_name,
                                const std::string& preprocessor_name) {
  const VisionConfig& v = cfg.vision;
  auto same = [&](const char* pp_key, int pp_value, const char* cfg_key, int cfg_value) {
    IRIS_CHECK(pp_value == cfg_value, preprocessor_name, ": ", pp_key, " is ", pp_value, " but ",
               config_name, " has vision_config.", cfg_key, " ", cfg_value,
               "; the two files must describe the same patches (fix the one that does not "
               "match the checkpoint)");
  };
  same("patch_size", pp.patch_size, "patch_size", v.patch_size);
  same("temporal_patch_size", pp.temporal_patch_size, "temporal_patch_size", v.temporal_patch_size);
  same("merge_size", pp.merge_size, "spatial_merge_size", v.spatial_merge_size);
}

}  // namespace iris
