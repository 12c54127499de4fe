#include "vision/video_decode.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "core/error.h"
#include "core/fs.h"

#if IRIS_HAVE_OPENCV
#include <opencv2/core.hpp>
#include <opencv2/core/utils/logger.hpp>
#include <opencv2/imgproc.hpp>
#include <opencv2/videoio.hpp>
#include <opencv2/videoio/registry.hpp>
#endif

namespace iris {

namespace {

#if IRIS_HAVE_OPENCV

// The file must exist and be a regular file before OpenCV sees it: FFmpeg would block reading a
// FIFO, and its message for a missing file or a directory says nothing useful.
void check_video_path(const std::string& path) {
  IRIS_CHECK(!path.empty(), "cannot decode video: the path is empty");
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  IRIS_CHECK(std::filesystem::exists(status), "video file not found: ", path,
             " (check the path; relative paths are resolved from the current directory)");
  IRIS_CHECK(!std::filesystem::is_directory(status), "cannot decode video ", path,
             ": it is a directory, not a video file");
  check_regular_file(path, "video file");
  IRIS_CHECK(std::filesystem::file_size(path, ec) != 0, "cannot decode video ", path,
             ": it is empty (0 bytes)");
}

// OpenCV's warnings and FFmpeg's error lines ("moov atom not found", "File ended prematurely")
// would otherwise reach the terminal for every bad file, beside the iris::Error that says the same.
// OpenCV sets FFmpeg's log level itself when its backend first loads, so FFmpeg is silenced
// through the variables OpenCV reads then: OPENCV_FFMPEG_DEBUG=1 installs OpenCV's log callback,
// which drops every message above OPENCV_FFMPEG_LOGLEVEL (-8 is AV_LOG_QUIET). A user who set
// OPENCV_LOG_LEVEL or OPENCV_FFMPEG_DEBUG keeps what they asked for.
void quiet_opencv_logs() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("OPENCV_LOG_LEVEL") == nullptr)
      cv::utils::logging::setLogLevel(cv::utils::logging::LOG_LEVEL_SILENT);
    if (std::getenv("OPENCV_FFMPEG_DEBUG") == nullptr) {
      ::setenv("OPENCV_FFMPEG_DEBUG", "1", 0);
      ::setenv("OPENCV_FFMPEG_LOGLEVEL", "-8", 1);
    }
  });
}

bool have_ffmpeg_backend() {
  static const bool have = [] {
    quiet_opencv_logs();
    return cv::videoio_registry::hasBackend(cv::CAP_FFMPEG);
  }();
  return have;
}

void check_ffmpeg_backend(const std::string& what, const std::string& path) {
  IRIS_CHECK(have_ffmpeg_backend(), "cannot ", what, " ", path,
             ": this OpenCV has no FFmpeg video backend (install Debian's libopencv-videoio-dev, "
             "whose videoio is built with FFmpeg, and rebuild iris)");
}

// Opens `path` with the FFmpeg backend; an error if no video stream can be decoded.
void open_capture(cv::VideoCapture& cap, const std::string& path) {
  if (!cap.open(path, cv::CAP_FFMPEG) || !cap.isOpened())
    IRIS_FAIL("cannot decode video ", path,
              ": no decodable video stream or unknown codec (the file may be truncated, corrupt or "
              "not a video)");
}

// An OpenCV frame (BGR, or grey, or BGRA) as RGB of the stream's size.
ImageRGB8 to_rgb(const cv::Mat& frame, const VideoInfo& info, const std::string& path,
                 int64_t index) {
  IRIS_CHECK(frame.depth() == CV_8U, "cannot decode video ", path, ": frame ", index,
             " decoded with OpenCV depth ", frame.depth(), ", not 8-bit samples");
  IRIS_CHECK(frame.cols == info.width && frame.rows == info.height, "cannot decode video ", path,
             ": frame ", index, " decoded as ", frame.cols, "x", frame.rows,
             " but the stream's size is ", info.width, "x", info.height);
  ImageRGB8 img;
  img.width = frame.cols;
  img.height = frame.rows;
  img.pixels.resize(static_cast<size_t>(img.width) * img.height * 3);
  cv::Mat out(img.height, img.width, CV_8UC3, img.pixels.data());  // writes into img.pixels
  switch (frame.channels()) {
    case 1:
      cv::cvtColor(frame, out, cv::COLOR_GRAY2RGB);
      break;
    case 3:
      cv::cvtColor(frame, out, cv::COLOR_BGR2RGB);
      break;
    case 4:
      cv::cvtColor(frame, out, cv::COLOR_BGRA2RGB);
      break;
    default:
      IRIS_FAIL("cannot decode video ", path, ": frame ", index, " decoded with ", frame.channels(),
                " channels (expected 1, 3 or 4)");
  }
  IRIS_CHECK(out.data == img.pixels.data(), "cannot decode video ", path,
             ": colour conversion of frame ", index, " did not write in place");
  return img;
}

DecodedVideo decode_video_opencv(const std::string& path, const FrameChooser& choose,
                                 const VideoLimits& limits) {
  cv::VideoCapture cap;
  open_capture(cap, path);
  VideoInfo info;
  const double count = cap.get(cv::CAP_PROP_FRAME_COUNT);
  const double fps = cap.get(cv::CAP_PROP_FPS);
  const double width = cap.get(cv::CAP_PROP_FRAME_WIDTH);
  const double height = cap.get(cv::CAP_PROP_FRAME_HEIGHT);
  info.fps = std::isfinite(fps) && fps > 0 ? fps : 0;
  IRIS_CHECK(width >= 1 && height >= 1 && width <= 1e9 && height <= 1e9, "cannot decode video ",
             path, ": its video stream gives size ", width, "x", height);
  info.width = static_cast<int>(width);
  info.height = static_cast<int>(height);
  const int64_t pixels = int64_t{info.width} * info.height;
  IRIS_CHECK(pixels <= limits.max_frame_pixels, "video ", path, " has frames of ", info.width, "x",
             info.height, " = ", pixels, " pixels, more than the limit of ",
             limits.max_frame_pixels, " per frame (max_frame_pixels)");
  if (std::isfinite(count) && count >= 1) {
    IRIS_CHECK(count <= static_cast<double>(limits.max_total_frames), "video ", path, " has ",
               static_cast<int64_t>(count), " frames, more than the limit of ",
               limits.max_total_frames, " (max_total_frames)");
    info.total_frames = static_cast<int64_t>(count);
  } else {
    // No count in the container: decode through the stream once to count, then start again.
    int64_t n = 0;
    while (cap.grab()) {
      ++n;
      IRIS_CHECK(n <= limits.max_total_frames, "video ", path,
                 " has more frames than the limit of ", limits.max_total_frames,
                 " (max_total_frames; counted by decoding, the container gives no count)");
    }
    info.total_frames = n;
    cap.release();
    open_capture(cap, path);
  }
  IRIS_CHECK(info.total_frames > 0, "cannot decode video ", path,
             ": its video stream has no frames");

  const std::vector<int64_t> indices = choose(info);
  IRIS_CHECK(!indices.empty(), "cannot decode video ", path,
             ": the frame sampling chose none of its ", info.total_frames, " frames");
  IRIS_CHECK(static_cast<int64_t>(indices.size()) <= limits.max_sampled_frames, "video ", path,
             ": the frame sampling chose ", indices.size(), " frames, more than the limit of ",
             limits.max_sampled_frames, " (max_sampled_frames)");
  for (size_t i = 0; i < indices.size(); ++i) {
    IRIS_CHECK(indices[i] >= 0 && indices[i] < info.total_frames, "video ", path,
               ": the frame sampling chose frame ", indices[i], ", outside its ", info.total_frames,
               " frames (0 to ", info.total_frames - 1, ")");
    IRIS_CHECK(i == 0 || indices[i] >= indices[i - 1], "video ", path,
               ": the frame sampling's indices are not ascending (frame ", indices[i],
               " follows frame ", indices[i - 1], ")");
  }

  DecodedVideo out;
  out.info = info;
  out.indices = indices;
  out.frames.reserve(indices.size());
  cv::Mat frame;
  int64_t read = 0;  // frames grabbed so far; the next grab gives frame `read`
  for (const int64_t want : indices) {
    if (!out.frames.empty() && want == out.indices[out.frames.size() - 1]) {
      out.frames.push_back(out.frames.back());  // a repeated index
      continue;
    }
    while (read <= want) {
      if (!cap.grab())
        IRIS_FAIL("cannot decode video ", path, ": frame ", want,
                  " could not be decoded: the stream ended after ", read,
                  " frames were read, of the ", info.total_frames,
                  " it should have (the file may be truncated)");
      ++read;
    }
    if (!cap.retrieve(frame) || frame.empty())
      IRIS_FAIL("cannot decode video ", path, ": frame ", want, " could not be decoded (", read,
                " frames were read; the file may be truncated or corrupt)");
    out.frames.push_back(to_rgb(frame, info, path, want));
  }
  return out;
}

void fsync_directory_of(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

void write_lossless_video_opencv(const std::string& path, const std::vector<ImageRGB8>& frames,
                                 double fps) {
  // OpenCV picks the container from the name's extension, so the temporary ends in .mkv.
  std::string tmp = path + ".tmp.XXXXXX.mkv";
  const int fd = ::mkstemps(tmp.data(), 4);
  IRIS_CHECK(fd >= 0, "cannot create a temporary file beside ", path, ": ", std::strerror(errno));
  if (::fchmod(fd, 0644) != 0) {
    // mkstemps's 0600 only makes the file private; the contents are still right.
  }
  ::close(fd);
  try {
    const int w = frames[0].width, h = frames[0].height;
    {
      // FFV1 keeps every bit: OpenCV 4.6 encodes it from packed 8-bit BGRA (AV_PIX_FMT_RGB32, no
      // chroma subsampling), and tests/vision_video_decode_test.cpp checks every pixel of a
      // round trip. A 4:2:0 codec would change the pixels.
      cv::VideoWriter writer(tmp, cv::CAP_FFMPEG, cv::VideoWriter::fourcc('F', 'F', 'V', '1'), fps,
                             cv::Size(w, h), true);
      IRIS_CHECK(writer.isOpened(), "cannot write video ", path,
                 ": OpenCV's FFmpeg backend could not start an FFV1 encoder in Matroska");
      cv::Mat bgr(h, w, CV_8UC3);
      for (const ImageRGB8& img : frames) {
        const cv::Mat rgb(h, w, CV_8UC3, const_cast<uint8_t*>(img.pixels.data()));
        cv::cvtColor(rgb, bgr, cv::COLOR_RGB2BGR);
        writer.write(bgr);
      }
      writer.release();
    }
    // VideoWriter reports no write errors (a full disk): read the header back.
    cv::VideoCapture check;
    IRIS_CHECK(check.open(tmp, cv::CAP_FFMPEG) && check.isOpened() &&
                   check.get(cv::CAP_PROP_FRAME_COUNT) == static_cast<double>(frames.size()),
               "cannot write video ", path, ": the written file ", tmp,
               " does not read back with its ", frames.size(), " frames (disk full?)");
    check.release();
    const int tfd = ::open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
    IRIS_CHECK(tfd >= 0 && ::fsync(tfd) == 0, "flushing ", tmp, " failed: ", std::strerror(errno));
    ::close(tfd);
    IRIS_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "renaming ", tmp, " to ", path,
               " failed: ", std::strerror(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  fsync_directory_of(path);
}

#endif  // IRIS_HAVE_OPENCV

[[noreturn]] void fail_no_video_support(const std::string& what, const std::string& path) {
  IRIS_FAIL("cannot ", what, " ", path,
            ": this build of iris has no video support (it was built without OpenCV); install "
            "libopencv-videoio-dev (scripts/setup.sh does) and rebuild");
}

}  // namespace

bool video_decoding_available() {
#if IRIS_HAVE_OPENCV
  return have_ffmpeg_backend();
#else
  return false;
#endif
}

DecodedVideo decode_video(const std::string& path, const FrameChooser& choose,
                          const VideoLimits& limits) {
#if IRIS_HAVE_OPENCV
  check_video_path(path);
  IRIS_CHECK(static_cast<bool>(choose), "cannot decode video ", path, ": no frame chooser given");
  check_ffmpeg_backend("decode video", path);
  try {
    return decode_video_opencv(path, choose, limits);
  } catch (const cv::Exception& e) {
    IRIS_FAIL("cannot decode video ", path, ": OpenCV failed: ", e.what());
  }
#else
  (void)choose;
  (void)limits;
  fail_no_video_support("decode video", path);
#endif
}

void write_lossless_video(const std::string& path, const std::vector<ImageRGB8>& frames,
                          double fps) {
#if IRIS_HAVE_OPENCV
  IRIS_CHECK(!path.empty(), "cannot write a video: the output path is empty");
  IRIS_CHECK(!frames.empty(), "cannot write video ", path, ": no frames given");
  IRIS_CHECK(std::isfinite(fps) && fps > 0, "cannot write video ", path, ": fps ", fps,
             " must be positive");
  for (size_t i = 0; i < frames.size(); ++i) {
    check_image(frames[i], ("write_lossless_video " + path).c_str());
    IRIS_CHECK(frames[i].width == frames[0].width && frames[i].height == frames[0].height,
               "cannot write video ", path, ": frame ", i, " is ", frames[i].width, "x",
               frames[i].height, " but frame 0 is ", frames[0].width, "x", frames[0].height,
               " (all frames must be the same size)");
  }
  check_replaceable(path, "video file");
  check_ffmpeg_backend("write video", path);
  try {
    write_lossless_video_opencv(path, frames, fps);
  } catch (const cv::Exception& e) {
    IRIS_FAIL("cannot write video ", path, ": OpenCV failed: ", e.what());
  }
#else
  (void)frames;
  (void)fps;
  fail_no_video_support("write video", path);
#endif
}

}  // namespace iris
