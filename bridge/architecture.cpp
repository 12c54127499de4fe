#include "bridge/architecture.h"

#include "bridge/model_config.h"
#include "bridge/rope_index.h"
#include "core/error.h"
#include "core/json_read.h"
#include "vision/preprocess.h"
#include "vision/video.h"

namespace iris {

PreprocessorConfig clip_preprocessor() {
  PreprocessorConfig pp;
  pp.patch_size = 14;
  pp.min_pixels = 56 * 56;
  pp.max_pixels = int64_t{28} * 28 * 16384;
  pp.image_mean = {0.48145466f, 0.4578275f, 0.40821073f};
  pp.image_std = {0.26862954f, 0.26130258f, 0.27577711f};
  return pp;
}

VideoProcessorConfig qwen2_video_preprocessor(const ModelConfig& cfg) {
  VideoProcessorConfig vc;
  vc.frame = clip_preprocessor();
  vc.frame.patch_size = cfg.vision.patch_size;
  vc.frame.temporal_patch_size = cfg.vision.temporal_patch_size;
  vc.frame.merge_size = cfg.vision.spatial_merge_size;
  vc.frame.min_pixels = int64_t{128} * 28 * 28;
  vc.frame.max_pixels = int64_t{768} * 28 * 28;
  vc.fps = 2.0;
  vc.min_frames = 4;
  vc.max_frames = 768;
  return vc;
}

std::vector<VisionRun> whole_video_run(const VideoClip& clip, const ModelConfig& cfg,
                                       int64_t temporal_step) {
  const int m = cfg.vision.spatial_merge_size;
  return {{cfg.video_token_id, clip.grid_thw[0], clip.grid_thw[1] / m, clip.grid_thw[2] / m,
           temporal_step}};
}

const std::vector<const Architecture*>& architectures() {
  static const std::vector<const Architecture*> all{
      &qwen3_vl_architecture(), &qwen2_5_vl_architecture(), &qwen2_vl_architecture(),
      &qwen3_vl_moe_architecture()};
  return all;
}

const Architecture& architecture_for(const std::string& model_type, const std::string& src) {
  std::string known;
  for (const Architecture* a : architectures()) {
    if (model_type == a->model_type()) return *a;
    known +=
        str_cat(known.empty() ? "" : ", ", "\"", a->model_type(), "\" (", a->display_name(), ")");
  }
  IRIS_FAIL(src, ": model_type '", clip_text(model_type, 40),
            "' is not supported; Iris loads model_type ", known);
}

}  // namespace iris
