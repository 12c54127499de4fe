// The joined configuration of a Qwen-VL checkpoint, read from an HF config.json by its
// architecture (bridge/architecture.h).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "language/text_config.h"
#include "vision/preprocess.h"
#include "vision/video.h"
#include "vision/video_decode.h"
#include "vision/vision_config.h"

namespace iris {

class Architecture;
const Architecture& qwen3_vl_architecture();

// LoRA adapters the model carries (Hugging Face PEFT's LoraConfig; bridge/peft.h): none when rank
// is 0. Their tensors join the weight table under PEFT's module names (q_proj.lora_A.weight, ...).
struct LoraConfig {
  int rank = 0;
  double alpha = 0.0;
  bool rslora = false;   // scale alpha / sqrt(r) instead of alpha / r
  double dropout = 0.0;  // on each adapter's input, in training only
  // Iris's target names (bridge/peft.h: lora_target_names), or, when `modules` is not empty,
  // exactly those HF modules (an adapter read from a file adapts the modules it has).
  std::vector<std::string> target_modules;
  std::vector<std::string> modules;
  bool enabled() const { return rank > 0; }
  float scale() const;
  // Whether the HF module `module` (e.g. model.language_model.layers.3.self_attn.q_proj) has one.
  bool adapts(const std::string& module) const;
};

struct ModelConfig {
  std::string model_type = "qwen3_vl";
  const Architecture* arch = &qwen3_vl_architecture();
  TextConfig text;
  VisionConfig vision;
  int image_token_id = 151655;
  int video_token_id = 151656;
  int vision_start_token_id = 151652;
  int vision_end_token_id = 151653;
  bool tie_word_embeddings = false;
  LoraConfig lora;

  // Reads config.json with the architecture its model_type names (nested or flat layout;
  // rope_parameters or legacy rope_scaling + rope_theta). Errors name the file and the field.
  static ModelConfig from_file(const std::string& config_json_path);
  // Every value is typed and range-checked (integers must be integers, sizes positive, rope_theta
  // and rms_norm_eps positive, deepstack_visual_indexes strictly increasing).
  static ModelConfig from_json_text(const std::string& text, const std::string& source_name);
};

// The checkpoint's preprocessor_config.json (or, without one, the defaults with the model's patch
// geometry), checked against the model: pixel rows made with another patch_size,
// temporal_patch_size or merge_size would not be the rows the vision tower reads.
PreprocessorConfig model_preprocessor(const std::string& model_dir, const ModelConfig& cfg);
// The checkpoint's video processor: video_preprocessor_config.json, else preprocessor_config.json
// (transformers' fallback), over the family's defaults with the model's patch geometry; checked
// against the model as the image processor is.
VideoProcessorConfig model_video_preprocessor(const std::string& model_dir, const ModelConfig& cfg);

// What load_model_video will make of a file, from its container's metadata alone: the frames the
// family's sampling keeps and the size each is resized to.
struct VideoPlan {
  const VideoInfo& info;
  const std::vector<int64_t>& keep;
  ResizedSize size;
};
// A video file decoded as the model's family samples it (only the kept frames), each frame
// resized and the clip patchified as its video processor does: what iris generate --video and
// training data read. `check` sees the plan before any frame is decoded and may refuse it by
// throwing. Errors say what was wrong; callers add the file where it is not named.
VideoClip load_model_video(const std::string& path, const ModelConfig& cfg,
                           const VideoProcessorConfig& vpre,
                           const std::function<void(const VideoPlan&)>& check = nullptr,
                           VideoOutput output = VideoOutput::host_rows);
void check_preprocessor_matches(const ModelConfig& cfg, const PreprocessorConfig& pp,
                                const std::string& config_name,
                                const std::string& preprocessor_name);

}  // namespace iris
