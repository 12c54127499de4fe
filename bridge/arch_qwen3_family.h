// What Qwen3-VL and Qwen3-VL-MoE share beyond the Architecture interface: the nested config, the
// vision tower with DeepStack, the decoder's tensor table (a MoE config's sparse layers declare
// their router and experts there), the preprocessing and Qwen3-VL's video handling (timestamped
// temporal slices). Each family names itself and reads what is its own.
#pragma once

#include "bridge/architecture.h"

namespace iris {

class Qwen3FamilyArchitecture : public Architecture {
 public:
  void read_config(const nlohmann::json& j, ModelConfig& c, const std::string& src) const override;
  void declare_weights(const ModelConfig& cfg, ModelWeights& w, WeightTable& t) const override;
  PreprocessorConfig default_preprocessor(const ModelConfig& cfg) const override;
  VideoProcessorConfig default_video_preprocessor(const ModelConfig& cfg) const override;
  std::vector<int64_t> sample_video_frames(int64_t total, double video_fps,
                                           const VideoProcessorConfig& vc) const override;
  ResizedSize video_frame_size(int64_t n_frames, int height, int width,
                               const VideoProcessorConfig& vc) const override;
  std::string video_prompt_text(const VideoClip& clip) const override;
  std::vector<VisionRun> video_runs(const VideoClip& clip, const ModelConfig& cfg) const override;
};

}  // namespace iris
