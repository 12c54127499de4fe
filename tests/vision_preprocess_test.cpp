// Image decoding and Qwen-VL preprocessing against the HF golden (tests/data/qwen3vl-tiny) and
// against independent re-derivations of the spec's formulas.
#include <stb_image_write.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>

#include "core/arena.h"
#include "core/backend.h"
#include "core/error.h"
#include "test_util.h"
#include "vision/image.h"
#include "vision/preprocess.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

std::string bad_dir() {
  return test::data_dir() + "/bad_images";
}

using test::scratch_dir;

ImageRGB8 random_image(int w, int h, uint32_t seed) {
  std::mt19937 rng(seed);
  ImageRGB8 img;
  img.width = w;
  img.height = h;
  img.pixels.resize(static_cast<size_t>(w) * h * 3);
  for (auto& p : img.pixels) p = static_cast<uint8_t>(rng() & 0xff);
  return img;
}

using test::error_of;

void append_bytes(void* ctx, void* data, int n) {
  static_cast<std::string*>(ctx)->append(static_cast<const char*>(data), n);
}

// ---------------------------------------------------------------------------------------------
// Golden parity

TEST(VisionPreprocess, MatchesHFGolden) {
  const std::string dir = test::fixture_dir();
  const PreprocessorConfig cfg = PreprocessorConfig::from_file(dir + "/preprocessor_config.json");
  const std::vector<ImageRGB8> images = {load_image(dir + "/images/image0.png"),
                                         load_image(dir + "/images/image1.png")};
  ASSERT_EQ(images[0].width, 200);
  ASSERT_EQ(images[0].height, 150);
  ASSERT_EQ(images[1].width, 96);
  ASSERT_EQ(images[1].height, 260);

  const PreprocessedBatch got = preprocess_images(images, cfg);
  test::Golden golden;
  const HostTensor want_grid = golden.tensor("image_grid_thw");
  ASSERT_EQ(want_grid.dims(), (std::vector<int64_t>{2, 3}));
  ASSERT_EQ(got.grid_thw.size(), 2u);
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 3; ++k)
      EXPECT_EQ(got.grid_thw[i][k], want_grid.data<int64_t>()[i * 3 + k]) << "image " << i;

  const HostTensor want = golden.tensor("pixel_values");
  ASSERT_EQ(got.pixel_values.dims(), want.dims());
  const std::vector<float> a = got.pixel_values.to_f32(), b = want.to_f32();
  // Pre-normalisation units: one uint8 level is std*255 = 127.5 normalised units.
  const double unit = 255.0 * cfg.image_std[0];
  size_t within = 0, exact = 0;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i])) * unit;
    worst = std::max(worst, d);
    within += d <= 2.0 + 1e-4;
    exact += a[i] == b[i];
  }
  const double frac = double(within) / double(a.size());
  std::printf(
      "pixel_values vs HF: %zu/%zu within 2 levels (%.6f), %zu bit-exact, max diff %.4f levels\n",
      within, a.size(), frac, exact, worst);
  RecordProperty("fraction_within_2_levels", std::to_string(frac));
  RecordProperty("max_diff_levels", std::to_string(worst));
  EXPECT_GE(frac, 0.999);

  // The batch is the per-image results stacked in order.
  int64_t row = 0;
  for (size_t i = 0; i < images.size(); ++i) {
    const PreprocessedImage one = preprocess_image(images[i], cfg);
    EXPECT_EQ(one.grid_thw, got.grid_thw[i]);
    const std::vector<float> v = one.pixel_values.to_f32();
    ASSERT_EQ(one.pixel_values.dim(1), got.pixel_values.dim(1));
    const size_t off = static_cast<size_t>(row * got.pixel_values.dim(1));
    EXPECT_TRUE(std::equal(v.begin(), v.end(), a.begin() + off)) << "image " << i;
    row += one.pixel_values.dim(0);
  }
  EXPECT_EQ(row, got.pixel_values.dim(0));
}

// ---------------------------------------------------------------------------------------------
// smart_resize

TEST(VisionPreprocess, SmartResizeRoundsHalfToEven) {
  // 720/32 = 22.5 -> 22 (round half to even); std::round would give 736.
  const ResizedSize s = smart_resize(720, 1280, 32, 65536, 16777216);
  EXPECT_EQ(s.height, 704);
  EXPECT_EQ(s.width, 1280);
  // 816/32 = 25.5 -> 26: the even neighbour is above here.
  EXPECT_EQ(smart_resize(816, 816, 32, 65536, 16777216).height, 832);
  // Not a tie: plain rounding both ways.
  EXPECT_EQ(smart_resize(500, 1000, 32, 65536, 16777216).height, 512);
  EXPECT_EQ(smart_resize(500, 1000, 32, 65536, 16777216).width, 992);
}

TEST(VisionPreprocess, SmartResizeMinPixelsBranch) {
  // 150x200: rounds to 160x192 = 30720 < 65536, so scale up by sqrt(65536/30000) and ceil.
  ResizedSize s = smart_resize(150, 200, 32, 65536, 16777216);
  EXPECT_EQ(s.height, 224);
  EXPECT_EQ(s.width, 320);
  s = smart_resize(260, 96, 32, 65536, 16777216);
  EXPECT_EQ(s.height, 448);
  EXPECT_EQ(s.width, 160);
  // Tiny images grow to at least min_pixels.
  s = smart_resize(10, 10, 32, 65536, 16777216);
  EXPECT_EQ(s.height, 256);
  EXPECT_EQ(s.width, 256);
  EXPECT_GE(int64_t(s.height) * s.width, 65536);
}

TEST(VisionPreprocess, SmartResizeMaxPixelsBranch) {
  // 3000x4000 -> beta = sqrt(12e6/1e6); floor(3000/beta/32)*32 = 864, floor(4000/beta/32)*32 =
  // 1152.
  ResizedSize s = smart_resize(3000, 4000, 32, 65536, 1000000);
  EXPECT_EQ(s.height, 864);
  EXPECT_EQ(s.width, 1152);
  EXPECT_LE(int64_t(s.height) * s.width, 1000000);
  // 8000x8000 with the Qwen3-VL cap lands exactly on 4096x4096 = 16777216.
  s = smart_resize(8000, 8000, 32, 65536, 16777216);
  EXPECT_EQ(s.height, 4096);
  EXPECT_EQ(s.width, 4096);
  // The short side would floor to 0 and is held at one factor (5.x guard).
  s = smart_resize(100, 10000, 32, 1024, 4096);
  EXPECT_EQ(s.height, 32);
  EXPECT_EQ(s.width, 640);
  // Already a multiple and within bounds: unchanged.
  s = smart_resize(1344, 1344, 32, 65536, 16777216);
  EXPECT_EQ(s.height, 1344);
  EXPECT_EQ(s.width, 1344);
}

TEST(VisionPreprocess, SmartResizeRejectsExtremeAspectRatio) {
  EXPECT_NO_THROW(smart_resize(1, 200, 32, 65536, 16777216));
  std::string msg = error_of([] { smart_resize(1, 201, 32, 65536, 16777216); });
  EXPECT_NE(msg.find("aspect ratio"), std::string::npos) << msg;
  msg = error_of([] { smart_resize(4020, 20, 32, 65536, 16777216); });
  EXPECT_NE(msg.find("aspect ratio"), std::string::npos) << msg;
  msg = error_of([] { smart_resize(0, 20, 32, 65536, 16777216); });
  EXPECT_NE(msg.find("positive"), std::string::npos) << msg;
  // Through the full pipeline too.
  msg = error_of([] { preprocess_image(random_image(402, 2, 1), PreprocessorConfig{}); });
  EXPECT_NE(msg.find("aspect ratio"), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------------
// Resampling

// The antialiased bicubic filter straight from the spec, in double, with uint8 rounding between
// the passes: the fixed-point kernel may differ from it by at most one level.
std::vector<std::vector<double>> spec_weights(int in, int out, std::vector<int>& first) {
  const double scale = double(in) / out, fs = std::max(scale, 1.0), support = 2 * fs;
  std::vector<std::vector<double>> w(out);
  first.assign(out, 0);
  auto k = [](double x) {
    const double a = -0.5;
    x = std::fabs(x);
    if (x < 1) return (a + 2) * x * x * x - (a + 3) * x * x + 1;
    if (x < 2) return a * x * x * x - 5 * a * x * x + 8 * a * x - 4 * a;
    return 0.0;
  };
  for (int i = 0; i < out; ++i) {
    const double center = (i + 0.5) * scale;
    const int lo = std::max(0, int(center - support + 0.5));
    const int hi = std::min(in, int(center + support + 0.5));
    double sum = 0;
    for (int j = lo; j < hi; ++j) {
      w[i].push_back(k((j - center + 0.5) / fs));
      sum += w[i].back();
    }
    for (double& v : w[i]) v /= sum;
    first[i] = lo;
  }
  return w;
}

ImageRGB8 reference_resize(const ImageRGB8& src, int oh, int ow) {
  auto to_u8 = [](double v) { return uint8_t(std::clamp(std::floor(v + 0.5), 0.0, 255.0)); };
  ImageRGB8 mid{ow, src.height, std::vector<uint8_t>(size_t(ow) * src.height * 3)};
  std::vector<int> fx, fy;
  if (ow == src.width) {
    mid = src;
  } else {
    const auto wx = spec_weights(src.width, ow, fx);
    for (int y = 0; y < src.height; ++y)
      for (int x = 0; x < ow; ++x)
        for (int c = 0; c < 3; ++c) {
          double acc = 0;
          for (size_t j = 0; j < wx[x].size(); ++j)
            acc += wx[x][j] * src.pixels[(size_t(y) * src.width + fx[x] + j) * 3 + c];
          mid.pixels[(size_t(y) * ow + x) * 3 + c] = to_u8(acc);
        }
  }
  if (oh == src.height) return mid;
  ImageRGB8 out{ow, oh, std::vector<uint8_t>(size_t(ow) * oh * 3)};
  const auto wy = spec_weights(src.height, oh, fy);
  for (int y = 0; y < oh; ++y)
    for (int x = 0; x < ow; ++x)
      for (int c = 0; c < 3; ++c) {
        double acc = 0;
        for (size_t j = 0; j < wy[y].size(); ++j)
          acc += wy[y][j] * mid.pixels[((fy[y] + j) * size_t(ow) + x) * 3 + c];
        out.pixels[(size_t(y) * ow + x) * 3 + c] = to_u8(acc);
      }
  return out;
}

TEST(VisionPreprocess, BicubicAntialiasAgreesWithSpecFilter) {
  struct Case {
    int w, h, ow, oh;
  };
  // Upscale, downscale (antialias support widens), mixed, one axis unchanged.
  for (const Case c : {Case{37, 23, 96, 64}, Case{120, 90, 31, 17}, Case{50, 70, 128, 20},
                       Case{64, 40, 64, 97}, Case{81, 33, 29, 33}}) {
    const ImageRGB8 src = random_image(c.w, c.h, 7 + c.w);
    const ImageRGB8 got = resize_bicubic_antialias(src, c.oh, c.ow);
    ASSERT_EQ(got.width, c.ow);
    ASSERT_EQ(got.height, c.oh);
    ASSERT_EQ(got.pixels.size(), size_t(c.ow) * c.oh * 3);
    const ImageRGB8 ref = reference_resize(src, c.oh, c.ow);
    int worst = 0;
    size_t off = 0;
    for (size_t i = 0; i < got.pixels.size(); ++i) {
      const int d = std::abs(int(got.pixels[i]) - int(ref.pixels[i]));
      worst = std::max(worst, d);
      off += d != 0;
    }
    // Intermediate rounding can compound: allow 2 levels after two passes, rarely.
    EXPECT_LE(worst, 2) << c.w << "x" << c.h << " -> " << c.ow << "x" << c.oh;
    EXPECT_LT(double(off) / got.pixels.size(), 0.05) << c.w << "x" << c.h;
  }
}

TEST(VisionPreprocess, BicubicAntialiasKeepsConstantsAndIdentity) {
  ImageRGB8 flat{45, 31, {}};
  for (int i = 0; i < 45 * 31; ++i) flat.pixels.insert(flat.pixels.end(), {0, 255, 77});
  for (auto [oh, ow] : {std::pair{100, 17}, std::pair{7, 300}, std::pair{31, 45}}) {
    const ImageRGB8 r = resize_bicubic_antialias(flat, oh, ow);
    for (size_t i = 0; i < r.pixels.size(); i += 3) {
      ASSERT_EQ(r.pixels[i], 0);
      ASSERT_EQ(r.pixels[i + 1], 255);
      ASSERT_EQ(r.pixels[i + 2], 77);
    }
  }
  const ImageRGB8 noise = random_image(40, 30, 3);
  EXPECT_EQ(resize_bicubic_antialias(noise, 30, 40).pixels, noise.pixels);
  std::string msg = error_of([&] { resize_bicubic_antialias(noise, 0, 10); });
  EXPECT_NE(msg.find("positive"), std::string::npos) << msg;
  ImageRGB8 broken = noise;
  broken.pixels.pop_back();
  msg = error_of([&] { resize_bicubic_antialias(broken, 10, 10); });
  EXPECT_NE(msg.find("bytes"), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------------
// Normalise + patchify layout

// Closed form of spec 2.5, written independently of the implementation's loop structure.
void check_layout(const ImageRGB8& img, const PreprocessorConfig& cfg) {
  const PreprocessedImage out = preprocess_image(img, cfg);
  const int P = cfg.patch_size, Tp = cfg.temporal_patch_size, m = cfg.merge_size;
  const int gh = img.height / P, gw = img.width / P;
  ASSERT_EQ(out.grid_thw, (std::array<int64_t, 3>{1, gh, gw}));
  const int64_t cols = 3 * Tp * P * P;
  ASSERT_EQ(out.pixel_values.dims(), (std::vector<int64_t>{int64_t(gh) * gw, cols}));
  const float* pv = out.pixel_values.data<float>();
  size_t checked = 0;
  for (int r = 0; r < gh; ++r)
    for (int c = 0; c < gw; ++c) {
      const int64_t row = ((int64_t(r / m) * (gw / m) + c / m) * m + r % m) * m + c % m;
      for (int ch = 0; ch < 3; ++ch)
        for (int f = 0; f < Tp; ++f)
          for (int py = 0; py < P; ++py)
            for (int px = 0; px < P; ++px) {
              const int64_t col = ((int64_t(ch) * Tp + f) * P + py) * P + px;
              const uint8_t u = img.pixels[(size_t(r * P + py) * img.width + c * P + px) * 3 + ch];
              const float mean = cfg.image_mean[ch] * float(1.0 / cfg.rescale_factor);
              const float sd = cfg.image_std[ch] * float(1.0 / cfg.rescale_factor);
              const float want = (float(u) - mean) / sd;
              ASSERT_EQ(pv[row * cols + col], want)
                  << "patch (" << r << "," << c << ") ch " << ch << " f " << f << " px (" << py
                  << "," << px << ")";
              ++checked;
            }
    }
  EXPECT_EQ(checked, size_t(out.pixel_values.numel()));
}

TEST(VisionPreprocess, PatchifyFollowsMergeWindowOrder) {
  PreprocessorConfig cfg;
  cfg.min_pixels = 1024;  // keep the 96x64 image at its size, so values are known exactly
  check_layout(random_image(96, 64, 11), cfg);
  // Qwen2.5-VL geometry and CLIP statistics: P = 14, factor 28, 1176 columns.
  PreprocessorConfig q25;
  q25.patch_size = 14;
  q25.min_pixels = 3136;
  q25.max_pixels = 12845056;
  q25.image_mean = {0.48145466f, 0.4578275f, 0.40821073f};
  q25.image_std = {0.26862954f, 0.26130258f, 0.27577711f};
  check_layout(random_image(84, 56, 12), q25);
}

// Backend::image_patches, the path that sends images to the device as bytes, on the CPU backend
// against the host preprocessing (the CUDA kernel is checked against this CPU op in
// tests/core_backend_ops_test.cpp): the same rows bit for bit, for images sized by size_images (one
// resized, one kept), with the patches scattered to rows a window order would give, and for a
// video's temporal slice of distinct frames against patchify_frames.
TEST(VisionPreprocess, BackendImagePatchesEqualHostPreprocessing) {
  auto cpu = make_cpu_backend();
  PreprocessorConfig cfg;
  cfg.min_pixels = 1024;
  const std::vector<ImageRGB8> images = {random_image(100, 70, 21), random_image(96, 64, 22)};
  const PreprocessedBatch host = preprocess_images(images, cfg);
  const SizedImages sized = size_images(images, cfg);
  ASSERT_EQ(sized.grid_thw, host.grid_thw);
  const int64_t cols = host.pixel_values.dim(1), rows = host.pixel_values.dim(0);
  const PixelTable table = pixel_table(cfg);
  Arena arena(*cpu, size_t{8} << 20);
  const Tensor dst = arena.alloc(DType::f32, {rows, cols});
  const Tensor table_t = arena.alloc(DType::f32, {3 * 256});
  cpu->write(table_t, table.data(), DType::f32);
  // Rows in reverse order of the patches: where each patch lands is the op's to follow.
  std::vector<int32_t> reversed(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) reversed[static_cast<size_t>(r)] = int32_t(rows - 1 - r);
  int64_t row = 0;
  for (const ImageRGB8& im : sized.images) {
    ImagePatchGeometry g;
    g.height = im.height;
    g.width = im.width;
    const Tensor frames = arena.alloc(DType::u8, {int64_t{im.height} * im.width * 3});
    cpu->write(frames, im.pixels.data(), DType::u8);
    const Tensor where = arena.alloc(DType::i32, {g.patches()});
    cpu->write(where, reversed.data() + row, DType::i32);
    cpu->image_patches(dst, frames, table_t, where, g);
    row += g.patches();
  }
  ASSERT_EQ(row, rows);
  const float* got = dst.as<float>();
  const float* want = host.pixel_values.data<float>();
  for (int64_t r = 0; r < rows; ++r)
    ASSERT_EQ(0, std::memcmp(got + (rows - 1 - r) * cols, want + r * cols, cols * sizeof(float)))
        << "patch " << r;

  // A temporal slice of two different frames (a video's), in place.
  const ImageRGB8 f0 = random_image(64, 32, 23), f1 = random_image(64, 32, 24);
  const HostTensor video = patchify_frames({&f0, &f1}, cfg);
  ImagePatchGeometry g;
  g.height = 32;
  g.width = 64;
  const Tensor frames = arena.alloc(DType::u8, {2 * 32 * 64 * 3});
  cpu->write(frames.slice(0, 32 * 64 * 3), f0.pixels.data(), DType::u8);
  cpu->write(frames.slice(32 * 64 * 3, 2 * 32 * 64 * 3), f1.pixels.data(), DType::u8);
  std::vector<int32_t> in_place(static_cast<size_t>(g.patches()));
  for (size_t i = 0; i < in_place.size(); ++i) in_place[i] = static_cast<int32_t>(i);
  const Tensor where = arena.alloc(DType::i32, {g.patches()});
  cpu->write(where, in_place.data(), DType::i32);
  const Tensor out = arena.alloc(DType::f32, {g.patches(), cols});
  cpu->image_patches(out, frames, table_t, where, g);
  EXPECT_EQ(0, std::memcmp(out.as<float>(), video.data<float>(), video.numel() * sizeof(float)));

  // What the op cannot do is refused, naming what was wrong.
  g.width = 60;  // not whole 32-pixel merge windows
  EXPECT_NE(error_of([&] {
              cpu->image_patches(out, frames, table_t, where, g);
            }).find("not whole merge windows"),
            std::string::npos);
  g.width = 64;
  in_place[3] = static_cast<int32_t>(g.patches());  // past the destination's rows
  cpu->write(where, in_place.data(), DType::i32);
  EXPECT_NE(
      error_of([&] { cpu->image_patches(out, frames, table_t, where, g); }).find("goes to row"),
      std::string::npos);
}

TEST(VisionPreprocess, RescaleAndNormaliseFlags) {
  const ImageRGB8 img = random_image(64, 64, 5);
  PreprocessorConfig cfg;
  cfg.min_pixels = 1024;
  cfg.do_normalize = false;
  PreprocessedImage out = preprocess_image(img, cfg);
  // Column 0 of row 0 is pixel (0,0) red; column P*P*Tp begins green.
  EXPECT_EQ(out.pixel_values.data<float>()[0], float(img.pixels[0]) * float(1.0 / 255.0));
  cfg.do_rescale = false;
  out = preprocess_image(img, cfg);
  EXPECT_EQ(out.pixel_values.data<float>()[0], float(img.pixels[0]));
  EXPECT_EQ(out.pixel_values.data<float>()[16 * 16 * 2], float(img.pixels[1]));
}

TEST(VisionPreprocess, DoResizeOffRequiresMultiples) {
  PreprocessorConfig cfg;
  cfg.do_resize = false;
  const PreprocessedImage ok = preprocess_image(random_image(64, 32, 2), cfg);
  EXPECT_EQ(ok.grid_thw, (std::array<int64_t, 3>{1, 2, 4}));
  const std::string msg = error_of([&] { preprocess_image(random_image(70, 32, 2), cfg); });
  EXPECT_NE(msg.find("multiple"), std::string::npos) << msg;
}

TEST(VisionPreprocess, EmptyBatchAndInvalidImage) {
  const PreprocessedBatch b = preprocess_images({}, PreprocessorConfig{});
  EXPECT_EQ(b.pixel_values.dims(), (std::vector<int64_t>{0, 1536}));
  EXPECT_TRUE(b.grid_thw.empty());
  const std::string msg = error_of([] { preprocess_image(ImageRGB8{}, PreprocessorConfig{}); });
  EXPECT_NE(msg.find("invalid size"), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------------
// Config

TEST(VisionPreprocess, ConfigFromFixtureFile) {
  const PreprocessorConfig c =
      PreprocessorConfig::from_file(test::fixture_dir() + "/preprocessor_config.json");
  EXPECT_EQ(c.patch_size, 16);
  EXPECT_EQ(c.temporal_patch_size, 2);
  EXPECT_EQ(c.merge_size, 2);
  EXPECT_EQ(c.min_pixels, 65536);
  EXPECT_EQ(c.max_pixels, 16777216);
  EXPECT_EQ(c.image_mean, (std::array<float, 3>{0.5f, 0.5f, 0.5f}));
  EXPECT_DOUBLE_EQ(c.rescale_factor, 1.0 / 255.0);
}

TEST(VisionPreprocess, ConfigQwen2StyleKeys) {
  // Qwen2/2.5-VL files: top-level min_pixels/max_pixels, overriding "size".
  const auto j = nlohmann::json::parse(R"({"min_pixels": 3136, "max_pixels": 12845056,
      "size": {"shortest_edge": 1, "longest_edge": 2}, "patch_size": 14, "merge_size": 2,
      "temporal_patch_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
      "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3})");
  const PreprocessorConfig c = PreprocessorConfig::from_json(j);
  EXPECT_EQ(c.patch_size, 14);
  EXPECT_EQ(c.min_pixels, 3136);
  EXPECT_EQ(c.max_pixels, 12845056);
  EXPECT_FLOAT_EQ(c.image_std[2], 0.27577711f);
  const PreprocessorConfig legacy = PreprocessorConfig::from_json(
      nlohmann::json::parse(R"({"size": {"min_pixels": 100, "max_pixels": 2000.0}})"));
  EXPECT_EQ(legacy.min_pixels, 100);
  EXPECT_EQ(legacy.max_pixels, 2000);
}

TEST(VisionPreprocess, ConfigErrors) {
  const fs::path bad = scratch_dir() / "malformed_preprocessor_config.json";
  std::ofstream(bad) << "{\"patch_size\": 16,";
  std::string msg = error_of([&] { PreprocessorConfig::from_file(bad.string()); });
  EXPECT_NE(msg.find("malformed JSON"), std::string::npos) << msg;
  EXPECT_NE(msg.find(bad.string()), std::string::npos) << msg;

  msg = error_of([] { PreprocessorConfig::from_file("/nonexistent/preprocessor_config.json"); });
  EXPECT_NE(msg.find("/nonexistent/preprocessor_config.json"), std::string::npos) << msg;

  const fs::path bad_value = scratch_dir() / "bad_value_preprocessor_config.json";
  std::ofstream(bad_value) << R"({"patch_size": 0})";
  msg = error_of([&] { PreprocessorConfig::from_file(bad_value.string()); });
  EXPECT_NE(msg.find("patch_size"), std::string::npos) << msg;
  EXPECT_NE(msg.find(bad_value.string()), std::string::npos) << msg;

  auto err = [](const char* text) {
    return error_of([&] { PreprocessorConfig::from_json(nlohmann::json::parse(text)); });
  };
  EXPECT_NE(err(R"({"patch_size": "16"})").find("must be an integer"), std::string::npos);
  EXPECT_NE(err(R"({"merge_size": 2.5})").find("merge_size"), std::string::npos);
  EXPECT_NE(err(R"({"size": {"shortest_edge": 5000, "longest_edge": 10}})").find("smaller"),
            std::string::npos);
  EXPECT_NE(err(R"({"image_std": [0.5, 0, 0.5]})").find("image_std"), std::string::npos);
  EXPECT_NE(err(R"({"image_mean": [0.5, 0.5]})").find("3 numbers"), std::string::npos);
  EXPECT_NE(err(R"({"do_resize": "yes"})").find("do_resize"), std::string::npos);
  EXPECT_NE(err(R"({"rescale_factor": -1})").find("rescale_factor"), std::string::npos);
  EXPECT_NE(err(R"({"resample": 2})").find("bicubic"), std::string::npos);
  EXPECT_NE(err(R"({"size": {"height": 224, "width": 224}})").find("shortest_edge"),
            std::string::npos);
  EXPECT_NE(err("[1, 2]").find("object"), std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Decoding

TEST(VisionImage, BadFilesNameTheFile) {
  for (const char* name :
       {"truncated.png", "random_bytes.jpg", "empty.png", "truncated.webp", "truncated.tif"}) {
    const std::string path = bad_dir() + "/" + name;
    ASSERT_TRUE(fs::exists(path)) << path;
    const std::string msg = error_of([&] { load_image(path); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("cannot decode image"), std::string::npos) << msg;
  }
  const std::string missing = bad_dir() + "/no_such_image.png";
  std::string msg = error_of([&] { load_image(missing); });
  EXPECT_NE(msg.find("not found"), std::string::npos) << msg;
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  msg = error_of([&] { load_image(bad_dir()); });
  EXPECT_NE(msg.find("directory"), std::string::npos) << msg;
  // stb's reason is passed on: the random bytes match no format.
  msg = error_of([&] { load_image(bad_dir() + "/random_bytes.jpg"); });
  EXPECT_NE(msg.find("unknown image type"), std::string::npos) << msg;
}

TEST(VisionImage, CorruptJpegIsReportedAsAJpeg) {
  const ImageRGB8 img = random_image(64, 64, 5);
  std::string jpg;
  ASSERT_TRUE(stbi_write_jpg_to_func(append_bytes, &jpg, 64, 64, 3, img.pixels.data(), 90));
  // Cut inside the entropy-coded data, 100 bytes after the start of scan: the header parses, the
  // decode fails, and the message is libjpeg's, not another format's ("bad png sig", as stb gave).
  const size_t sos = jpg.find("\xff\xda");
  ASSERT_NE(sos, std::string::npos);
  ASSERT_LT(sos + 100, jpg.size() / 2);
  const std::string cut = jpg.substr(0, sos + 100);
  const std::string msg = error_of(
      [&] { decode_image(reinterpret_cast<const uint8_t*>(cut.data()), cut.size(), "photo.jpg"); });
  EXPECT_NE(msg.find("photo.jpg: JPEG data is corrupt or truncated"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("png"), std::string::npos) << msg;
  const std::string header_only = jpg.substr(0, 20);
  EXPECT_NE(error_of([&] {
              decode_image(reinterpret_cast<const uint8_t*>(header_only.data()), header_only.size(),
                           "photo.jpg");
            }).find("its JPEG header is corrupt"),
            std::string::npos);
}

TEST(VisionImage, PixelLimitIsCheckedFromTheHeaderBeforeDecoding) {
  // A PNG whose IHDR claims 30,000 x 30,000 and which holds no pixel data at all: refused from
  // the header alone (decoding would have failed only after allocating 2.7 GB).
  std::string png = "\x89PNG\r\n\x1a\n";
  auto be32 = [&](uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) png.push_back(static_cast<char>(v >> shift));
  };
  be32(13);
  png += "IHDR";
  be32(30000);
  be32(30000);
  png += std::string("\x08\x00\x00\x00\x00", 5);
  be32(0);
  const auto* data = reinterpret_cast<const uint8_t*>(png.data());
  std::string msg = error_of([&] { decode_image(data, png.size(), "bomb.png"); });
  EXPECT_NE(msg.find("bomb.png is 30000x30000 = 900000000 pixels, more than the limit of " +
                     std::to_string(kDefaultMaxImagePixels)),
            std::string::npos)
      << msg;
  // The limit is inclusive and a parameter.
  const std::string path = test::fixture_dir() + "/images/image0.png";
  const ImageRGB8 img = load_image(path);
  const int64_t pixels = int64_t{img.width} * img.height;
  EXPECT_EQ(load_image(path, pixels).width, img.width);
  msg = error_of([&] { load_image(path, pixels - 1); });
  EXPECT_NE(msg.find("more than the limit of " + std::to_string(pixels - 1)), std::string::npos)
      << msg;
}

TEST(VisionImage, PnmHeaderNumbersThatOverflowAreRejected) {
  // stb 2.27 accumulates header numbers in an int without an overflow check.
  const std::string pnm = "P5" + std::string(30, '5') + "6\n4 2\n255\n" + std::string(8, 'x');
  const std::string msg = error_of(
      [&] { decode_image(reinterpret_cast<const uint8_t*>(pnm.data()), pnm.size(), "big.pgm"); });
  EXPECT_NE(msg.find("big.pgm: a number in its PNM header is too large"), std::string::npos) << msg;
  // A long number inside a header comment is skipped, as stb skips it.
  const std::string commented = "P5\n# 99999999999999999999\n2 1\n255\nab";
  const ImageRGB8 img = decode_image(reinterpret_cast<const uint8_t*>(commented.data()),
                                     commented.size(), "commented.pgm");
  EXPECT_EQ(img.width, 2);
  EXPECT_EQ(img.pixels[3], 'b');
}

// Inputs the image fuzzer (fuzz/fuzz_image.cpp) once crashed on: each is now an error or an
// image, decoded under the fuzzer's settings.
TEST(VisionImage, FuzzFindingsDecodeOrFailCleanly) {
  const fs::path dir = fs::path(test::data_dir()) / "fuzz/regressions/image";
  int n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    SCOPED_TRACE(entry.path().string());
    const std::string bytes = read_text_file(entry.path().string());
    try {
      const ImageRGB8 img = decode_image(reinterpret_cast<const uint8_t*>(bytes.data()),
                                         bytes.size(), "fuzz", int64_t{1} << 22);
      check_image(img, "fuzz");
    } catch (const Error&) {
    }
    ++n;
  }
  EXPECT_GE(n, 2);
}

TEST(VisionImage, AFifoIsRefusedNotWaitedOn) {
  const std::string fifo = (scratch_dir() / "image_fifo.png").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string msg = error_of([&] { load_image(fifo); });
  EXPECT_NE(msg.find("is a FIFO"), std::string::npos) << msg;
}

TEST(VisionImage, DecodeFromMemoryMatchesFile) {
  const std::string path = test::fixture_dir() + "/images/image1.png";
  const std::string bytes = read_text_file(path);
  const ImageRGB8 a = load_image(path);
  const ImageRGB8 b =
      decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "image1 bytes");
  EXPECT_EQ(a.width, b.width);
  EXPECT_EQ(a.height, b.height);
  EXPECT_EQ(a.pixels, b.pixels);
  const std::string msg = error_of([&] {
    decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size() / 3, "cut bytes");
  });
  EXPECT_NE(msg.find("cut bytes"), std::string::npos) << msg;
}

TEST(VisionImage, WritePngRoundTripsAtomically) {
  const ImageRGB8 img = random_image(33, 17, 9);
  const fs::path path = scratch_dir() / "roundtrip.png";
  write_png(path.string(), img);
  const ImageRGB8 back = load_image(path.string());
  EXPECT_EQ(back.width, 33);
  EXPECT_EQ(back.height, 17);
  EXPECT_EQ(back.pixels, img.pixels);
  for (const auto& e : fs::directory_iterator(scratch_dir()))
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
  const std::string msg =
      error_of([&] { write_png((scratch_dir() / "no_dir" / "x.png").string(), img); });
  EXPECT_NE(msg.find("no_dir"), std::string::npos) << msg;
  ImageRGB8 bad = img;
  bad.pixels.resize(10);
  EXPECT_NE(error_of([&] { write_png(path.string(), bad); }).find("bytes"), std::string::npos);
}

// load_image's convert("RGB") drops alpha (as transformers 5.x's convert_to_rgb does): every pixel
// keeps the colour it stores. Transparent pixels here store colours far from white, so that
// compositing onto white (an older Iris choice) would fail every check below.
TEST(VisionImage, AlphaIsDroppedKeepingStoredColours) {
  // RGBA: transparent red, opaque blue, half-transparent black, quarter-opaque green.
  const uint8_t rgba[] = {255, 0, 0, 0, 0, 0, 255, 255, 0, 0, 0, 128, 10, 200, 30, 64};
  const fs::path p4 = scratch_dir() / "rgba.png";
  ASSERT_NE(stbi_write_png(p4.c_str(), 2, 2, 4, rgba, 8), 0);
  const ImageRGB8 img = load_image(p4.string());
  ASSERT_EQ(img.width, 2);
  ASSERT_EQ(img.height, 2);
  EXPECT_EQ(img.pixels, (std::vector<uint8_t>{255, 0, 0, 0, 0, 255, 0, 0, 0, 10, 200, 30}));

  // Grey + alpha (transparent, opaque, partly transparent), and plain grey (replicated to RGB).
  const uint8_t la[] = {40, 0, 90, 255, 7, 100};
  const fs::path p2 = scratch_dir() / "la.png";
  ASSERT_NE(stbi_write_png(p2.c_str(), 3, 1, 2, la, 6), 0);
  EXPECT_EQ(load_image(p2.string()).pixels,
            (std::vector<uint8_t>{40, 40, 40, 90, 90, 90, 7, 7, 7}));
  const uint8_t grey[] = {0, 128, 255};
  const fs::path p1 = scratch_dir() / "grey.png";
  ASSERT_NE(stbi_write_png(p1.c_str(), 3, 1, 1, grey, 3), 0);
  EXPECT_EQ(load_image(p1.string()).pixels,
            (std::vector<uint8_t>{0, 0, 0, 128, 128, 128, 255, 255, 255}));

  // Every (v, a) pair through the decoder: a 256x256 RGBA image with v = x, a = y; each pixel
  // must come out as its stored value, whatever its alpha.
  std::vector<uint8_t> all(256 * 256 * 4);
  for (int a = 0; a < 256; ++a)
    for (int v = 0; v < 256; ++v) {
      uint8_t* px = &all[(a * 256 + v) * 4];
      px[0] = px[1] = px[2] = uint8_t(v);
      px[3] = uint8_t(a);
    }
  const fs::path pall = scratch_dir() / "all_alpha.png";
  ASSERT_NE(stbi_write_png(pall.c_str(), 256, 256, 4, all.data(), 256 * 4), 0);
  const ImageRGB8 allimg = load_image(pall.string());
  int mismatches = 0;
  for (int a = 0; a < 256; ++a)
    for (int v = 0; v < 256; ++v)
      for (int c = 0; c < 3; ++c) mismatches += allimg.pixels[(a * 256 + v) * 3 + c] != v;
  EXPECT_EQ(mismatches, 0);
}

// A minimal PNG encoder (stored deflate blocks) for chunk layouts stb_image_write cannot produce:
// palettes and tRNS colour keys.
uint32_t crc32(const std::string& bytes) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : bytes) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return c ^ 0xffffffffu;
}

void put_be32(std::string& s, uint32_t v) {
  for (int sh = 24; sh >= 0; sh -= 8) s.push_back(char((v >> sh) & 0xff));
}

void put_chunk(std::string& png, const std::string& type, const std::string& data) {
  put_be32(png, uint32_t(data.size()));
  const std::string body = type + data;
  png += body;
  put_be32(png, crc32(body));
}

std::string make_png(int w, int h, int color_type, const std::vector<uint8_t>& pixels,
                     const std::string& plte, const std::string& trns, int bit_depth = 8) {
  std::string png("\x89PNG\r\n\x1a\n", 8), ihdr;
  put_be32(ihdr, uint32_t(w));
  put_be32(ihdr, uint32_t(h));
  ihdr += std::string{char(bit_depth), char(color_type), 0, 0, 0};
  put_chunk(png, "IHDR", ihdr);
  if (!plte.empty()) put_chunk(png, "PLTE", plte);
  if (!trns.empty()) put_chunk(png, "tRNS", trns);
  const size_t row = pixels.size() / h;
  std::string raw;
  for (int y = 0; y < h; ++y) {
    raw.push_back(0);  // filter: none
    raw.append(reinterpret_cast<const char*>(pixels.data()) + y * row, row);
  }
  std::string z("\x78\x01", 2);
  z.push_back(1);  // one final stored block
  const uint16_t len = uint16_t(raw.size()), nlen = uint16_t(~len);
  z += std::string{char(len & 0xff), char(len >> 8), char(nlen & 0xff), char(nlen >> 8)};
  z += raw;
  uint32_t a = 1, b = 0;
  for (unsigned char ch : raw) {
    a = (a + ch) % 65521;
    b = (b + a) % 65521;
  }
  put_be32(z, (b << 16) | a);
  put_chunk(png, "IDAT", z);
  put_chunk(png, "IEND", "");
  return png;
}

ImageRGB8 decode_string(const std::string& bytes, const std::string& name) {
  return decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), name);
}

TEST(VisionImage, PaletteAndColourKeyTransparency) {
  // Palette: red fully transparent, green opaque, blue at alpha 100. PIL opens it as mode P and
  // convert("RGB") gives each entry's colour, dropping the tRNS alpha.
  const std::string plte{char(255), 0, 0, 0, char(255), 0, 0, 0, char(255)};
  const std::string trns{0, char(255), char(100)};
  const std::vector<uint8_t> colours = {255, 0, 0, 0, 255, 0, 0, 0, 255};
  EXPECT_EQ(decode_string(make_png(3, 1, 3, {0, 1, 2}, plte, trns), "palette").pixels, colours);
  // The same palette without tRNS.
  EXPECT_EQ(decode_string(make_png(3, 1, 3, {0, 1, 2}, plte, ""), "opaque palette").pixels,
            colours);
  // Grey with colour key 50: convert("RGB") ignores the key, so 50 stays 50.
  const ImageRGB8 grey = decode_string(make_png(2, 1, 0, {50, 51}, "", std::string{0, 50}), "grey");
  EXPECT_EQ(grey.pixels, (std::vector<uint8_t>{50, 50, 50, 51, 51, 51}));
  // RGB with a colour key: ignored the same way.
  const ImageRGB8 rgb = decode_string(
      make_png(2, 1, 2, {10, 20, 30, 40, 50, 60}, "", std::string{0, 10, 0, 20, 0, 30}), "rgb");
  EXPECT_EQ(rgb.pixels, (std::vector<uint8_t>{10, 20, 30, 40, 50, 60}));
}

// 16-bit samples as a PNG stores them: big-endian.
std::vector<uint8_t> be16(std::initializer_list<int> samples) {
  std::vector<uint8_t> out;
  for (int v : samples) out.insert(out.end(), {uint8_t(v >> 8), uint8_t(v & 0xff)});
  return out;
}

// What PIL's open and load_image's convert("RGB") make of each 16-bit PNG colour type:
// - grey (type 0) opens as I;16 with the full values; convert("RGB") clips them to 255
//   (Convert.c's I16_RGB: a non-zero high byte gives 255), so 0x6400 is 255, not 100;
// - RGB (2), grey+alpha (4) and RGBA (6) open as RGB / LA / RGBA through the RGB;16B, LA;16B and
//   RGBA;16B unpackers, which keep each sample's high byte; convert("RGB") then drops alpha;
// - a tRNS key on 16-bit grey changes no value: convert("RGB") ignores it.
TEST(VisionImage, SixteenBitPngMatchesPil) {
  const ImageRGB8 grey = decode_string(
      make_png(6, 1, 0, be16({0x0000, 0x0064, 0x00ff, 0x0100, 0x6400, 0xffff}), "", "", 16),
      "grey16.png");
  EXPECT_EQ(grey.pixels, (std::vector<uint8_t>{0, 0, 0, 100, 100, 100, 255, 255, 255, 255, 255, 255,
                                               255, 255, 255, 255, 255, 255}));

  // Key 0x0064: that pixel keeps its value 100; 0x6400 (the bytes swapped) is clipped to 255.
  const std::string key{0, 0x64};
  const ImageRGB8 keyed =
      decode_string(make_png(3, 1, 0, be16({0x0064, 0x6400, 0x0032}), "", key, 16), "key16.png");
  EXPECT_EQ(keyed.pixels, (std::vector<uint8_t>{100, 100, 100, 255, 255, 255, 50, 50, 50}));

  const ImageRGB8 rgb = decode_string(
      make_png(2, 1, 2, be16({0x1234, 0xabcd, 0x00ff, 0x6400, 0xffff, 0x0100}), "", "", 16),
      "rgb16.png");
  EXPECT_EQ(rgb.pixels, (std::vector<uint8_t>{0x12, 0xab, 0x00, 0x64, 0xff, 0x01}));

  // Grey+alpha keeps high bytes: 0x6400 is 100 here, unlike plain grey; alpha (opaque,
  // transparent, partial) is dropped.
  const ImageRGB8 la = decode_string(
      make_png(3, 1, 4, be16({0x6400, 0xffff, 0x6400, 0x0000, 0x2800, 0x64ff}), "", "", 16),
      "la16.png");
  EXPECT_EQ(la.pixels, (std::vector<uint8_t>{100, 100, 100, 100, 100, 100, 40, 40, 40}));

  const ImageRGB8 rgba = decode_string(
      make_png(2, 1, 6, be16({0x1234, 0xabcd, 0x00ff, 0xffff, 0x0a00, 0xc800, 0x1e00, 0x0000}), "",
               "", 16),
      "rgba16.png");
  EXPECT_EQ(rgba.pixels, (std::vector<uint8_t>{0x12, 0xab, 0x00, 10, 200, 30}));
}

// A 24-bit uncompressed BMP (BITMAPINFOHEADER) of `rows_rgb`, given top row first. `top_down`
// stores them in that order with a negative height, as PIL and Windows read one; `header_height`
// replaces the height the header states.
std::string make_bmp24(int w, const std::vector<std::vector<uint8_t>>& rows_rgb, bool top_down,
                       std::optional<int32_t> header_height = std::nullopt) {
  const int h = static_cast<int>(rows_rgb.size());
  const int stride = (w * 3 + 3) / 4 * 4;
  std::string bmp = "BM";
  auto le32 = [&](uint32_t v) {
    for (int sh = 0; sh < 32; sh += 8) bmp.push_back(char((v >> sh) & 0xff));
  };
  auto le16 = [&](uint16_t v) { bmp += std::string{char(v & 0xff), char(v >> 8)}; };
  le32(uint32_t(54 + stride * h));
  le32(0);
  le32(54);
  le32(40);
  le32(uint32_t(w));
  le32(uint32_t(header_height.value_or(top_down ? -h : h)));
  le16(1);
  le16(24);
  for (int i = 0; i < 6; ++i) le32(i == 1 ? uint32_t(stride * h) : 0);
  for (int r = 0; r < h; ++r) {
    const std::vector<uint8_t>& row = rows_rgb[size_t(top_down ? r : h - 1 - r)];
    for (int x = 0; x < w; ++x)
      bmp += std::string{char(row[3 * x + 2]), char(row[3 * x + 1]), char(row[3 * x])};  // BGR
    bmp += std::string(size_t(stride - w * 3), '\0');
  }
  return bmp;
}

TEST(VisionImage, TopDownBmpReadsAsPilDoes) {
  const std::vector<std::vector<uint8_t>> rows = {
      {255, 0, 0, 0, 255, 0}, {0, 0, 255, 10, 20, 30}, {1, 2, 3, 200, 100, 50}};
  std::vector<uint8_t> want;
  for (const auto& r : rows) want.insert(want.end(), r.begin(), r.end());
  for (const bool top_down : {false, true}) {
    SCOPED_TRACE(top_down ? "top-down" : "bottom-up");
    const ImageRGB8 img = decode_string(make_bmp24(2, rows, top_down), "rows.bmp");
    EXPECT_EQ(img.width, 2);
    EXPECT_EQ(img.height, 3);
    EXPECT_EQ(img.pixels, want);
  }
  // The pixel limit counts the rows of a top-down file too.
  std::string msg = error_of([&] {
    const std::string bmp = make_bmp24(2, rows, true);
    decode_image(reinterpret_cast<const uint8_t*>(bmp.data()), bmp.size(), "rows.bmp", 5);
  });
  EXPECT_NE(msg.find("rows.bmp is 2x3 = 6 pixels, more than the limit of 5"), std::string::npos)
      << msg;
  // Still refused: no rows, and a height whose magnitude does not fit an int.
  for (const int32_t bad : {int32_t{0}, INT32_MIN}) {
    msg = error_of([&] { decode_string(make_bmp24(2, rows, true, bad), "bad.bmp"); });
    EXPECT_NE(msg.find("bad.bmp"), std::string::npos) << msg;
  }
}

TEST(VisionImage, JpegDecodesAndOversizedHuffmanTableIsRejected) {
  // A smooth image survives JPEG at quality 95 to within a few levels, in colour and in grey.
  ImageRGB8 smooth{64, 48, {}};
  for (int y = 0; y < 48; ++y)
    for (int x = 0; x < 64; ++x)
      smooth.pixels.insert(smooth.pixels.end(), {uint8_t(x * 4), uint8_t(y * 5), uint8_t(128)});
  std::string jpg;
  ASSERT_NE(stbi_write_jpg_to_func(append_bytes, &jpg, 64, 48, 3, smooth.pixels.data(), 95), 0);
  const ImageRGB8 back = decode_string(jpg, "smooth.jpg");
  ASSERT_EQ(back.width, 64);
  ASSERT_EQ(back.height, 48);
  double sum = 0;
  for (size_t i = 0; i < back.pixels.size(); ++i)
    sum += std::abs(int(back.pixels[i]) - int(smooth.pixels[i]));
  EXPECT_LT(sum / back.pixels.size(), 3.0);
  std::vector<uint8_t> grey_px(64 * 48);
  for (size_t i = 0; i < grey_px.size(); ++i) grey_px[i] = uint8_t(i % 64 * 4);
  std::string grey_jpg;
  ASSERT_NE(stbi_write_jpg_to_func(append_bytes, &grey_jpg, 64, 48, 1, grey_px.data(), 95), 0);
  const ImageRGB8 grey = decode_string(grey_jpg, "grey.jpg");
  EXPECT_EQ(grey.pixels[3 * 10], grey.pixels[3 * 10 + 1]);
  EXPECT_EQ(grey.pixels[3 * 10], grey.pixels[3 * 10 + 2]);
  EXPECT_NEAR(grey.pixels[3 * 10], 40, 4);

  // A Huffman table with more than 256 codes (stb 2.27 wrote past its code table for one):
  // libjpeg refuses it.
  const size_t dht = jpg.find("\xff\xc4");
  ASSERT_NE(dht, std::string::npos);
  std::string bad = jpg;
  bad[dht + 5 + 14] = char(200);  // counts of 15- and 16-bit codes
  bad[dht + 5 + 15] = char(200);
  const std::string msg = error_of([&] { decode_string(bad, "huffman.jpg"); });
  EXPECT_NE(msg.find("Huffman"), std::string::npos) << msg;
  EXPECT_NE(msg.find("huffman.jpg"), std::string::npos) << msg;
}

// PIL's PpmImagePlugin: grey of more than 8 bits opens as mode I (raw at maxval 65535, else
// scaled to 0..65535) and convert("RGB") clips it to 255, as for 16-bit grey PNG; every other file
// is scaled to 0..255 by min(255, round(v / maxval * 255)), Python's round (half to even).
TEST(VisionImage, PnmSamplesScaleAsPilScalesThem) {
  auto pnm = [](const std::string& head, std::initializer_list<int> samples, bool wide) {
    std::string s = head;
    for (int v : samples)
      s += wide ? std::string{char(v >> 8), char(v & 0xff)} : std::string(1, char(v));
    return s;
  };
  auto grey = [](std::initializer_list<int> v) {
    std::vector<uint8_t> out;
    for (int x : v) out.resize(out.size() + 3, uint8_t(x));
    return out;
  };
  // 16-bit PGM (stb 2.27 over-reads if asked to convert channels, so this also guards that path).
  EXPECT_EQ(
      decode_string(pnm("P5\n4 1\n65535\n", {0x0000, 0x0064, 0x80ff, 0xffff}, true), "grey16.pgm")
          .pixels,
      grey({0, 100, 255, 255}));
  // maxval 1000: 3 -> round(196.6) = 197, 4 -> 262, clipped.
  EXPECT_EQ(decode_string(pnm("P5\n3 1\n1000\n", {0, 3, 4}, true), "grey1000.pgm").pixels,
            grey({0, 197, 255}));
  // 16-bit PPM: scaled to 255, not cut to the high byte (0xff00 is 254, not 255).
  EXPECT_EQ(
      decode_string(pnm("P6\n1 1\n65535\n", {0xff00, 0x8080, 0x0080}, true), "rgb16.ppm").pixels,
      (std::vector<uint8_t>{254, 128, 0}));
  // 8-bit PGM with maxval 10: 1 -> 25.5 -> 26 and 3 -> 76.5 -> 76 (half to even), 10 -> 255.
  EXPECT_EQ(decode_string(pnm("P5\n3 1\n10\n", {1, 3, 10}, false), "grey10.pgm").pixels,
            grey({26, 76, 255}));
  // maxval 255 is left as it is; 0 is refused, as PIL refuses it.
  EXPECT_EQ(decode_string(pnm("P5\n2 1\n255\n", {7, 200}, false), "grey.pgm").pixels,
            grey({7, 200}));
  const std::string msg =
      error_of([&] { decode_string(pnm("P5\n1 1\n0\n", {0}, false), "zero.pgm"); });
  EXPECT_NE(msg.find("zero.pgm: its PNM header gives a maximum sample value of 0"),
            std::string::npos)
      << msg;
}

// ---------------------------------------------------------------------------------------------

}  // namespace
}  // namespace iris
