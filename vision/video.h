// Qwen-VL video preprocessing (spec 2.6 and 8.5): the rules that choose a video's frames and the
// size its frames are resized to, and the pixel rows of the kept frames: each frame resampled and
// normalised as an image is, frames padded to a multiple of temporal_patch_size by repeating the
// last one, and each pair of consecutive frames patchified into one temporal slice.
//
// Which rules a checkpoint uses is its family's (bridge/arch_<family>.cpp picks among the ones
// here); decoding the file is vision/video_decode.h's.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "vision/image.h"
#include "vision/preprocess.h"

namespace iris {

// video_preprocessor_config.json (or, without one, preprocessor_config.json, as transformers
// falls back to it), over the family's defaults.
struct VideoProcessorConfig {
  // Patch geometry, pixel budget (min_pixels/max_pixels: per frame for Qwen2-VL and Qwen2.5-VL,
  // over all sampled frames for Qwen3-VL), resampling and normalisation.
  PreprocessorConfig frame;
  // Frames kept per second of video; 0 keeps every frame (transformers' do_sample_frames: false).
  double fps = 2.0;
  int min_frames = 4, max_frames = 768;

  // Reads the keys present in `j` over `defaults`; errors name `source`.
  static VideoProcessorConfig from_json(const nlohmann::json& j, const VideoProcessorConfig& base,
                                        const std::string& source);
  void validate(const std::string& source) const;
};

// The frames the Qwen3-VL video processor keeps: n = int(total / video_fps * fps) clamped to
// [min_frames, max_frames] and to the video's frames (without fps: every frame, at least
// min_frames), then round_half_even(linspace(0, total - 1, n)), which may repeat a frame.
// A container without a frame rate counts as 24 fps, as transformers assumes.
std::vector<int64_t> sample_frames_linspace(int64_t total_frames, double video_fps,
                                            const VideoProcessorConfig& cfg);
// The frames the Qwen2-VL and Qwen2.5-VL video processors keep: n = total / video_fps * fps
// clamped to [min_frames, max_frames] and the video's frames, floored to a multiple of
// temporal_patch_size, then torch.arange(0, total, total / n) truncated (float32, as torch
// computes it). Without fps every frame is kept.
std::vector<int64_t> sample_frames_arange(int64_t total_frames, double video_fps,
                                          const VideoProcessorConfig& cfg);

// Qwen3-VL's smart_resize for videos: the pixel budget bounds t x h x w over the frames (t the
// frame count rounded to temporal_factor), sides multiples of `factor`; sides under `factor` are
// first scaled up to it. Fewer frames than temporal_factor is an error.
ResizedSize smart_resize_video(int64_t n_frames, int height, int width, int temporal_factor,
                               int factor, int64_t min_pixels, int64_t max_pixels);

// One preprocessed video: the pixel rows of its kept frames and what the prompt needs of it.
// What preprocess_video makes of the frames: the host's patch rows (training, a session of rows)
// or the frames as bytes, for the backend to patchify (iris generate).
enum class VideoOutput { host_rows, frames };

struct VideoClip {
  // VideoOutput::host_rows: f32 [grid_t * gh * gw, 3 * Tp * P * P], merge-window row order.
  HostTensor pixel_values;
  // VideoOutput::frames: the frames at the grid's size, grid_t * temporal_patch_size of them (the
  // last repeated to fill the last slice), what VisionPixels sends.
  std::vector<ImageRGB8> frames;
  std::array<int64_t, 3> grid_thw{};
  std::vector<int64_t> frame_indices;  // the kept frames of the source, in order
  int64_t total_frames = 0;            // the source's frames
  double video_fps = 0;                // the source's frame rate (0: unknown)

  // The source's frame rate, 24 where the container gives none (as transformers assumes).
  double fps_or_default() const;
  // Frames kept per second of the source (transformers' VideoMetadata.sampled_fps).
  double sampled_fps() const;
  // Seconds one temporal slice spans (transformers' second_per_grid_t).
  double seconds_per_slice(int temporal_patch_size) const {
    return temporal_patch_size / sampled_fps();
  }
};

// Resizes every frame (all of one size) to `size` (bicubic, antialiased, as images) unless
// cfg.frame.do_resize is off, normalises, pads the frame count to a multiple of
// temporal_patch_size with copies of the last frame and patchifies (VideoOutput::host_rows), or
// keeps the padded frames as they are (VideoOutput::frames). `frames` are the kept frames.
VideoClip preprocess_video(const std::vector<ImageRGB8>& frames, ResizedSize size,
                           const VideoProcessorConfig& cfg,
                           VideoOutput output = VideoOutput::host_rows);

}  // namespace iris
