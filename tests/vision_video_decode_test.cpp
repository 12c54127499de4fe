// Video decoding through OpenCV: exact pixels of a lossless round trip, frame choice, and hostile
// files and choosers, each refused with an iris::Error naming the file.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_util.h"
#include "vision/video_decode.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

constexpr int kWidth = 64, kHeight = 48, kFrames = 30;
constexpr double kFps = 10;

// The test video's sample at (frame, y, x, channel): every byte value occurs, and neighbouring
// frames, rows, columns and channels all differ.
uint8_t sample(int f, int y, int x, int c) {
  return static_cast<uint8_t>(f * 37 + y * 11 + x * 5 + c * 101 + (x * y * (c + 1)) % 7);
}

ImageRGB8 test_frame(int f) {
  ImageRGB8 img;
  img.width = kWidth;
  img.height = kHeight;
  img.pixels.resize(static_cast<size_t>(kWidth) * kHeight * 3);
  for (int y = 0; y < kHeight; ++y)
    for (int x = 0; x < kWidth; ++x)
      for (int c = 0; c < 3; ++c)
        img.pixels[(static_cast<size_t>(y) * kWidth + x) * 3 + c] = sample(f, y, x, c);
  return img;
}

// A fresh directory per test process, holding the lossless test video (written once).
const std::string& test_video() {
  static const std::string path = [] {
    const std::string p = (test::scratch_dir() / "video" / "test.mkv").string();
    fs::create_directories(fs::path(p).parent_path());
    std::vector<ImageRGB8> frames;
    for (int f = 0; f < kFrames; ++f) frames.push_back(test_frame(f));
    write_lossless_video(p, frames, kFps);
    return p;
  }();
  return path;
}

std::string scratch_file(const std::string& name) {
  const fs::path dir = test::scratch_dir() / "video";
  fs::create_directories(dir);
  return (dir / name).string();
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

FrameChooser every_frame() {
  return [](const VideoInfo& info) {
    std::vector<int64_t> all;
    for (int64_t i = 0; i < info.total_frames; ++i) all.push_back(i);
    return all;
  };
}

FrameChooser fixed(std::vector<int64_t> indices) {
  return [indices](const VideoInfo&) { return indices; };
}

#define REQUIRE_VIDEO()                                                               \
  if (!video_decoding_available())                                                    \
  GTEST_SKIP() << "this build has no video decoding (install libopencv-videoio-dev, " \
                  "scripts/setup.sh does, and reconfigure)"

TEST(VideoDecode, WithoutOpenCvSaysWhatToInstall) {
#if IRIS_HAVE_OPENCV
  GTEST_SKIP() << "built with OpenCV";
#else
  EXPECT_FALSE(video_decoding_available());
  const std::string msg = test::error_of([] { decode_video("clip.mp4", every_frame()); });
  EXPECT_NE(msg.find("clip.mp4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("no video support"), std::string::npos) << msg;
  EXPECT_NE(msg.find("libopencv-videoio-dev"), std::string::npos) << msg;
  const std::string wmsg =
      test::error_of([] { write_lossless_video("out.mkv", {test_frame(0)}, kFps); });
  EXPECT_NE(wmsg.find("no video support"), std::string::npos) << wmsg;
#endif
}

TEST(VideoDecode, LosslessRoundTripIsExact) {
  REQUIRE_VIDEO();
  const DecodedVideo v = decode_video(test_video(), every_frame());
  EXPECT_EQ(v.info.total_frames, kFrames);
  EXPECT_DOUBLE_EQ(v.info.fps, kFps);
  EXPECT_EQ(v.info.width, kWidth);
  EXPECT_EQ(v.info.height, kHeight);
  ASSERT_EQ(v.indices.size(), static_cast<size_t>(kFrames));
  ASSERT_EQ(v.frames.size(), static_cast<size_t>(kFrames));
  int64_t wrong = 0;
  for (int f = 0; f < kFrames; ++f) {
    EXPECT_EQ(v.indices[f], f);
    const ImageRGB8& img = v.frames[f];
    ASSERT_EQ(img.width, kWidth);
    ASSERT_EQ(img.height, kHeight);
    ASSERT_EQ(img.pixels.size(), static_cast<size_t>(kWidth) * kHeight * 3);
    for (int y = 0; y < kHeight; ++y)
      for (int x = 0; x < kWidth; ++x)
        for (int c = 0; c < 3; ++c)
          if (img.pixels[(static_cast<size_t>(y) * kWidth + x) * 3 + c] != sample(f, y, x, c)) {
            if (wrong < 5)
              ADD_FAILURE() << "frame " << f << " (" << y << ", " << x << ", " << c << "): "
                            << int(img.pixels[(static_cast<size_t>(y) * kWidth + x) * 3 + c])
                            << " != " << int(sample(f, y, x, c));
            ++wrong;
          }
  }
  EXPECT_EQ(wrong, 0);
}

TEST(VideoDecode, ChooserPicksFrames) {
  REQUIRE_VIDEO();
  VideoInfo seen;
  const DecodedVideo v = decode_video(test_video(), [&](const VideoInfo& info) {
    seen = info;
    return std::vector<int64_t>{0, 7, 29};
  });
  EXPECT_EQ(seen.total_frames, kFrames);
  EXPECT_EQ(v.indices, (std::vector<int64_t>{0, 7, 29}));
  ASSERT_EQ(v.frames.size(), 3u);
  EXPECT_EQ(v.frames[0].pixels, test_frame(0).pixels);
  EXPECT_EQ(v.frames[1].pixels, test_frame(7).pixels);
  EXPECT_EQ(v.frames[2].pixels, test_frame(29).pixels);
  // A repeated index repeats the frame.
  const DecodedVideo r = decode_video(test_video(), fixed({3, 3, 4}));
  ASSERT_EQ(r.frames.size(), 3u);
  EXPECT_EQ(r.frames[0].pixels, test_frame(3).pixels);
  EXPECT_EQ(r.frames[1].pixels, test_frame(3).pixels);
  EXPECT_EQ(r.frames[2].pixels, test_frame(4).pixels);
}

// The iris::Error of decode_video(path, choose, limits); it must name the file.
std::string decode_error(const std::string& path, const FrameChooser& choose,
                         const VideoLimits& limits = {}) {
  const std::string msg = test::error_of([&] { decode_video(path, choose, limits); });
  EXPECT_NE(msg.find(path), std::string::npos) << "the error does not name " << path << ": " << msg;
  return msg;
}

TEST(VideoDecode, HostileFilesAreRefusedNamingThem) {
  REQUIRE_VIDEO();
  EXPECT_NE(decode_error(scratch_file("missing.mp4"), every_frame()).find("not found"),
            std::string::npos);

  const std::string dir = scratch_file("a_directory.mp4");
  fs::create_directories(dir);
  EXPECT_NE(decode_error(dir, every_frame()).find("directory"), std::string::npos);

  const std::string text = scratch_file("text.mp4");
  write_bytes(text, "this is not a video, only some text renamed .mp4\n");
  EXPECT_NE(decode_error(text, every_frame()).find("no decodable video stream"), std::string::npos);

  const std::string empty = scratch_file("empty.mp4");
  write_bytes(empty, "");
  EXPECT_NE(decode_error(empty, every_frame()).find("empty"), std::string::npos);

  // Half the bytes: either no stream opens or the stream ends before the last frame. Never a crash
  // or a hang.
  const std::string whole = read_bytes(test_video());
  ASSERT_GT(whole.size(), 1000u);
  const std::string half = scratch_file("half.mkv");
  write_bytes(half, whole.substr(0, whole.size() / 2));
  const std::string msg = decode_error(
      half, [](const VideoInfo& info) { return std::vector<int64_t>{info.total_frames - 1}; });
  EXPECT_TRUE(msg.find("truncated") != std::string::npos ||
              msg.find("no decodable video stream") != std::string::npos)
      << msg;
}

TEST(VideoDecode, BadChoicesAreRefused) {
  REQUIRE_VIDEO();
  const std::string& v = test_video();
  EXPECT_NE(decode_error(v, fixed({0, kFrames})).find("outside"), std::string::npos);
  EXPECT_NE(decode_error(v, fixed({-1})).find("outside"), std::string::npos);
  EXPECT_NE(decode_error(v, fixed({5, 3})).find("not ascending"), std::string::npos);
  EXPECT_NE(decode_error(v, fixed({})).find("none"), std::string::npos);
  VideoLimits few;
  few.max_sampled_frames = 4;
  EXPECT_NE(decode_error(v, fixed({0, 1, 2, 3, 4}), few).find("max_sampled_frames"),
            std::string::npos);
  EXPECT_EQ(decode_video(v, fixed({0, 1, 2, 3}), few).frames.size(), 4u);
}

TEST(VideoDecode, LimitsRefuseBeforeDecoding) {
  REQUIRE_VIDEO();
  const std::string& v = test_video();
  bool chose = false;
  const FrameChooser spy = [&](const VideoInfo& info) {
    chose = true;
    return every_frame()(info);
  };
  VideoLimits small;
  small.max_frame_pixels = kWidth * kHeight - 1;
  std::string msg = decode_error(v, spy, small);
  EXPECT_NE(msg.find("max_frame_pixels"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(kWidth * kHeight - 1)), std::string::npos) << msg;
  EXPECT_FALSE(chose);

  VideoLimits short_limit;
  short_limit.max_total_frames = kFrames - 1;
  msg = decode_error(v, spy, short_limit);
  EXPECT_NE(msg.find("max_total_frames"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(kFrames - 1)), std::string::npos) << msg;
  EXPECT_FALSE(chose);

  // At the limits exactly, the video decodes.
  small.max_frame_pixels = kWidth * kHeight;
  small.max_total_frames = kFrames;
  EXPECT_EQ(decode_video(v, spy, small).frames.size(), static_cast<size_t>(kFrames));
  EXPECT_TRUE(chose);
}

TEST(VideoDecode, WriterRefusesMixedSizes) {
  REQUIRE_VIDEO();
  ImageRGB8 other = test_frame(0);
  other.width = kWidth / 2;
  other.pixels.resize(static_cast<size_t>(other.width) * kHeight * 3);
  const std::string path = scratch_file("mixed.mkv");
  const std::string msg = test::error_of([&] {
    write_lossless_video(path, {test_frame(0), other}, kFps);
  });
  EXPECT_NE(msg.find("same size"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(path));
}

}  // namespace
}  // namespace iris
