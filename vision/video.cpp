#include "vision/video.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_read.h"

namespace iris {

namespace {

using nlohmann::json;

// transformers' VideoMetadata without a frame rate: sample_frames assumes 24.
constexpr double kAssumedVideoFps = 24.0;

int64_t video_int(const json& j, const char* key, const std::string& source, int64_t lo,
                  int64_t hi) {
  const json& v = j[key];
  int64_t x = 0;
  if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else if (v.is_number_float() && std::isfinite(v.get<double>()) &&
             v.get<double>() == std::floor(v.get<double>()) && std::fabs(v.get<double>()) < 1e15) {
    x = static_cast<int64_t>(v.get<double>());
  } else {
    IRIS_FAIL(source, ": \"", key, "\" must be an integer, got ", json_excerpt(v));
  }
  IRIS_CHECK(x >= lo && x <= hi, source, ": \"", key, "\" = ", x, " is outside [", lo, ", ", hi,
             "]");
  return x;
}

}  // namespace

VideoProcessorConfig VideoProcessorConfig::from_json(const json& j,
                                                     const VideoProcessorConfig& base,
                                                     const std::string& source) {
  IRIS_CHECK(j.is_object(), source, " must be a JSON object, got ", j.type_name());
  VideoProcessorConfig c = base;
  try {
    c.frame = PreprocessorConfig::from_json(j, base.frame);
  } catch (const Error& e) {
    IRIS_FAIL(source, ": ", e.what());
  }
  // do_sample_frames: false means every frame is used, whatever fps says.
  bool sample = true;
  if (j.contains("do_sample_frames") && !j["do_sample_frames"].is_null()) {
    IRIS_CHECK(j["do_sample_frames"].is_boolean(), source,
               ": \"do_sample_frames\" must be true or false, got ",
               json_excerpt(j["do_sample_frames"]));
    sample = j["do_sample_frames"].get<bool>();
  }
  if (j.contains("fps") && !j["fps"].is_null()) {
    IRIS_CHECK(j["fps"].is_number() && std::isfinite(j["fps"].get<double>()), source,
               ": \"fps\" must be a number, got ", json_excerpt(j["fps"]));
    c.fps = j["fps"].get<double>();
  }
  if (!sample) c.fps = 0;
  if (j.contains("min_frames") && !j["min_frames"].is_null())
    c.min_frames = static_cast<int>(video_int(j, "min_frames", source, 1, 1 << 20));
  if (j.contains("max_frames") && !j["max_frames"].is_null())
    c.max_frames = static_cast<int>(video_int(j, "max_frames", source, 1, 1 << 20));
  c.validate(source);
  return c;
}

void VideoProcessorConfig::validate(const std::string& source) const {
  try {
    frame.validate();
  } catch (const Error& e) {
    IRIS_FAIL(source, ": ", e.what());
  }
  IRIS_CHECK(std::isfinite(fps) && fps >= 0 && fps <= 1000, source, ": fps = ", fps,
             " must be between 0 (every frame) and 1000 frames per second");
  IRIS_CHECK(min_frames >= 1 && max_frames >= min_frames, source, ": min_frames ", min_frames,
             " and max_frames ", max_frames, " must satisfy 1 <= min_frames <= max_frames");
}

std::vector<int64_t> sample_frames_linspace(int64_t total, double video_fps,
                                            const VideoProcessorConfig& cfg) {
  IRIS_CHECK(total >= 1, "a video needs at least one frame");
  int64_t n = 0;
  if (cfg.fps > 0) {
    const double rate = video_fps > 0 ? video_fps : kAssumedVideoFps;
    n = static_cast<int64_t>(static_cast<double>(total) / rate * cfg.fps);
    n = std::min({std::max<int64_t>(n, cfg.min_frames), int64_t{cfg.max_frames}, total});
  } else {
    n = total;  // every frame: no sampling at all
  }
  // numpy.linspace(0, total - 1, n): start + i * step, the last value exactly the end; then
  // numpy.round (half to even, which nearbyint does under the default rounding mode).
  std::vector<int64_t> out(static_cast<size_t>(n));
  const double end = static_cast<double>(total - 1);
  const double step = n > 1 ? end / static_cast<double>(n - 1) : 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = i == n - 1 && n > 1 ? end : static_cast<double>(i) * step;
    out[static_cast<size_t>(i)] = static_cast<int64_t>(std::nearbyint(x));
  }
  return out;
}

std::vector<int64_t> sample_frames_arange(int64_t total, double video_fps,
                                          const VideoProcessorConfig& cfg) {
  IRIS_CHECK(total >= 1, "a video needs at least one frame");
  std::vector<int64_t> out;
  if (cfg.fps <= 0) {
    out.resize(static_cast<size_t>(total));
    for (int64_t i = 0; i < total; ++i) out[static_cast<size_t>(i)] = i;
    return out;
  }
  const int tp = cfg.frame.temporal_patch_size;
  const double rate = video_fps > 0 ? video_fps : kAssumedVideoFps;
  const double max_frames =
      std::floor(static_cast<double>(std::min<int64_t>(cfg.max_frames, total)) / tp) * tp;
  double n = static_cast<double>(total) / rate * cfg.fps;
  n = std::min(
      {std::max(n, static_cast<double>(cfg.min_frames)), max_frames, static_cast<double>(total)});
  n = std::floor(n / tp) * tp;
  IRIS_CHECK(n >= 1, "the video has ", total, " frames, fewer than temporal_patch_size ", tp,
             " after sampling; it is too short for this model");
  // torch.arange(0, total, total / n): its length is ceil(total / step) in double, each value
  // i * step rounded to float32, then .int() truncates.
  const double step = static_cast<double>(total) / n;
  const int64_t len = static_cast<int64_t>(std::ceil(static_cast<double>(total) / step));
  out.resize(static_cast<size_t>(len));
  for (int64_t i = 0; i < len; ++i)
    out[static_cast<size_t>(i)] =
        static_cast<int64_t>(static_cast<float>(static_cast<double>(i) * step));
  return out;
}

ResizedSize smart_resize_video(int64_t n_frames, int height, int width, int temporal_factor,
                               int factor, int64_t min_pixels, int64_t max_pixels) {
  IRIS_CHECK(n_frames >= temporal_factor, "a video of ", n_frames,
             " sampled frame(s) is too short: this model needs at least ", temporal_factor,
             " (temporal_patch_size); give a longer video or a higher --video-fps");
  IRIS_CHECK(height > 0 && width > 0, "video frame size ", width, "x", height, " is invalid");
  int64_t H = height, W = width;
  if (H < factor || W < factor) {
    const double scale = std::max(static_cast<double>(factor) / static_cast<double>(H),
                                  static_cast<double>(factor) / static_cast<double>(W));
    H = static_cast<int64_t>(static_cast<double>(H) * scale);
    W = static_cast<int64_t>(static_cast<double>(W) * scale);
  }
  const double ratio = static_cast<double>(std::max(H, W)) / static_cast<double>(std::min(H, W));
  IRIS_CHECK(ratio <= 200.0, "video frames of ", width, "x", height, " have aspect ratio ", ratio,
             ", but Qwen-VL preprocessing requires at most 200; crop or pad the video first");
  const int64_t F = factor;
  int64_t h = static_cast<int64_t>(std::nearbyint(static_cast<double>(H) / F)) * F;
  int64_t w = static_cast<int64_t>(std::nearbyint(static_cast<double>(W) / F)) * F;
  const int64_t t =
      static_cast<int64_t>(std::nearbyint(static_cast<double>(n_frames) / temporal_factor)) *
      temporal_factor;
  const double nhw =
      static_cast<double>(n_frames) * static_cast<double>(H) * static_cast<double>(W);
  if (static_cast<double>(t) * static_cast<double>(h) * static_cast<double>(w) >
      static_cast<double>(max_pixels)) {
    const double beta = std::sqrt(nhw / static_cast<double>(max_pixels));
    h = std::max(F, static_cast<int64_t>(std::floor(static_cast<double>(H) / beta / F)) * F);
    w = std::max(F, static_cast<int64_t>(std::floor(static_cast<double>(W) / beta / F)) * F);
  } else if (static_cast<double>(t) * static_cast<double>(h) * static_cast<double>(w) <
             static_cast<double>(min_pixels)) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / nhw);
    h = static_cast<int64_t>(std::ceil(static_cast<double>(H) * beta / F)) * F;
    w = static_cast<int64_t>(std::ceil(static_cast<double>(W) * beta / F)) * F;
  }
  IRIS_CHECK(h > 0 && w > 0 && h <= INT_MAX / 4 && w <= INT_MAX / 4, "video frames of ", width, "x",
             height, " resize to ", w, "x", h,
             ", which is out of range; check the video "
             "processor's size (min/max pixels)");
  return {static_cast<int>(h), static_cast<int>(w)};
}

VideoClip preprocess_video(const std::vector<ImageRGB8>& frames, ResizedSize size,
                           const VideoProcessorConfig& cfg, VideoOutput output) {
  cfg.validate("video processor config");
  IRIS_CHECK(!frames.empty(), "a video needs at least one frame");
  std::vector<ImageRGB8> resized;
  std::vector<const ImageRGB8*> kept;
  if (cfg.frame.do_resize && (frames[0].height != size.height || frames[0].width != size.width)) {
    resized.reserve(frames.size());
    for (const ImageRGB8& f : frames) {
      check_image(f, "video frame");
      resized.push_back(resize_bicubic_antialias(f, size.height, size.width));
    }
    for (const ImageRGB8& f : resized) kept.push_back(&f);
  } else {
    for (const ImageRGB8& f : frames) kept.push_back(&f);
  }
  const size_t tp = static_cast<size_t>(cfg.frame.temporal_patch_size);
  while (kept.size() % tp != 0) kept.push_back(kept.back());
  VideoClip clip;
  if (output == VideoOutput::host_rows) {
    clip.pixel_values = patchify_frames(kept, cfg.frame);
  } else {
    clip.frames.reserve(kept.size());
    for (const ImageRGB8* f : kept) clip.frames.push_back(*f);
  }
  clip.grid_thw = {static_cast<int64_t>(kept.size() / tp), kept[0]->height / cfg.frame.patch_size,
                   kept[0]->width / cfg.frame.patch_size};
  return clip;
}

double VideoClip::fps_or_default() const {
  return video_fps > 0 ? video_fps : kAssumedVideoFps;
}

double VideoClip::sampled_fps() const {
  if (video_fps <= 0 || total_frames <= 0 || frame_indices.empty()) return fps_or_default();
  return static_cast<double>(frame_indices.size()) / static_cast<double>(total_frames) * video_fps;
}

}  // namespace iris
