// Decoding video files into RGB frames through OpenCV's FFmpeg backend (optional: a build without
// OpenCV, see IRIS_VIDEO in CMakeLists.txt, has the same API and throws saying what to install).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "vision/image.h"

namespace iris {

// What a container says about its video stream, read before any frame is decoded.
struct VideoInfo {
  int64_t total_frames = 0;  // frames in the stream
  double fps = 0;            // frames per second (0 when the container gives none)
  int width = 0, height = 0;
};

// Checked before any frame is decoded (the pixels and the frame count from the container's
// header, the sampled frames from the chooser's answer).
struct VideoLimits {
  int64_t max_frame_pixels = kDefaultMaxImagePixels;  // from vision/image.h, per frame
  int64_t max_total_frames = 1'000'000;
  int64_t max_sampled_frames = 4096;
};

struct DecodedVideo {
  VideoInfo info;
  std::vector<int64_t> indices;   // the frames kept, ascending, each < info.total_frames
  std::vector<ImageRGB8> frames;  // one per index, RGB (ImageRGB8 from vision/image.h)
};

// Chooses the frames to keep from the stream's metadata (a family's sampling rule).
using FrameChooser = std::function<std::vector<int64_t>(const VideoInfo&)>;

// Whether this build decodes video (built with OpenCV, whose videoio has the FFmpeg backend).
bool video_decoding_available();

// Opens `path`, reads its video stream's VideoInfo (counting the frames by decoding through the
// stream when the container gives no count), asks `choose` which frames to keep and decodes the
// stream once from the start, keeping those. The indices must be ascending (a repeated index is
// allowed and repeats the frame), each in [0, total_frames), and at most
// limits.max_sampled_frames of them. Frames are read in order and never seeked to: seeking is
// inexact in many codecs. Every failure is an iris::Error naming the file: not a regular file, no
// decodable video stream, a limit exceeded (before decoding), the chooser's indices, a stream that
// ends before a kept frame (a truncated file, or a container that overstates its frame count).
DecodedVideo decode_video(const std::string& path, const FrameChooser& choose,
                          const VideoLimits& limits = {});

// Writes frames (all the same size) losslessly (FFV1 in Matroska, RGB: every decoder reads back the
// exact pixels) at `fps`, atomically (temporary file in the same folder, then rename). For tests
// and tools. The file is Matroska whatever `path`'s extension; name it .mkv.
void write_lossless_video(const std::string& path, const std::vector<ImageRGB8>& frames,
                          double fps);

}  // namespace iris
