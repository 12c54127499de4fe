// What Qwen2-VL and Qwen2.5-VL share beyond the Architecture interface: CLIP's preprocessing,
// their video processor, and video handled as in qwen-vl-utils (frames sampled by arange over an
// even count, each resized as an image is, the template's one <|video_pad|> the whole video).
// Each family adds its config, tensors and the M-RoPE step of a video's slices.
#pragma once

#include "bridge/architecture.h"
#include "bridge/rope_index.h"
#include "vision/video.h"

namespace iris {

class Qwen2FamilyArchitecture : public Architecture {
 public:
  PreprocessorConfig default_preprocessor(const ModelConfig&) const override {
    return clip_preprocessor();
  }

  VideoProcessorConfig default_video_preprocessor(const ModelConfig& cfg) const override {
    return qwen2_video_preprocessor(cfg);
  }

  std::vector<int64_t> sample_video_frames(int64_t total, double video_fps,
                                           const VideoProcessorConfig& vc) const override {
    return sample_frames_arange(total, video_fps, vc);
  }

  // Every frame is resized as an image is, under a per-frame pixel budget.
  ResizedSize video_frame_size(int64_t, int height, int width,
                               const VideoProcessorConfig& vc) const override {
    const PreprocessorConfig& f = vc.frame;
    return smart_resize(height, width, f.patch_size * f.merge_size, f.min_pixels, f.max_pixels);
  }

  // The template's block as it is: its one <|video_pad|> becomes the whole video.
  std::string video_prompt_text(const VideoClip&) const override {
    return "<|vision_start|><|video_pad|><|vision_end|>";
  }
};

}  // namespace iris
