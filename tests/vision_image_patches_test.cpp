// Backend::image_patches, the path that sends images to the device as bytes, on the CPU backend
// against the host preprocessing (vision/preprocess.h, itself checked against the HF golden and
// the spec in vision_preprocess_test.cpp). The CUDA kernel is checked against this CPU op in
// tests/core_backend_ops_test.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/arena.h"
#include "core/backend.h"
#include "test_util.h"
#include "vision/image.h"
#include "vision/preprocess.h"

namespace iris {
namespace {

using test::error_of;

ImageRGB8 random_image(int w, int h, uint32_t seed) {
  std::mt19937 rng(seed);
  ImageRGB8 img;
  img.width = w;
  img.height = h;
  img.pixels.resize(static_cast<size_t>(w) * h * 3);
  for (auto& p : img.pixels) p = static_cast<uint8_t>(rng() & 0xff);
  return img;
}

// The same rows bit for bit, for images sized by size_images (one
// resized, one kept), with the patches scattered to rows a window order would give, and for a
// video's temporal slice of distinct frames against patchify_frames.
TEST(VisionImagePatches, BackendOpEqualsHostPreprocessing) {
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

}  // namespace
}  // namespace iris
