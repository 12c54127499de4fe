// Qwen-VL image preprocessing: smart_resize, antialiased bicubic resampling, rescale/normalise and
// patchify into the pixel_values layout the vision encoder consumes (spec sections 2.2-2.5).
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/image_patches.h"
#include "core/tensor.h"
#include "vision/image.h"

namespace iris {

// preprocessor_config.json. Defaults are Qwen3-VL's.
struct PreprocessorConfig {
  int patch_size = 16, temporal_patch_size = 2, merge_size = 2;
  // size.shortest_edge / size.longest_edge: despite the names they bound the pixel count.
  int64_t min_pixels = 65536, max_pixels = 16777216;
  std::array<float, 3> image_mean{0.5f, 0.5f, 0.5f}, image_std{0.5f, 0.5f, 0.5f};
  double rescale_factor = 1.0 / 255.0;
  bool do_resize = true, do_rescale = true, do_normalize = true, do_convert_rgb = true;

  // Accepts size.{shortest_edge,longest_edge}, size.{min_pixels,max_pixels} and top-level
  // min_pixels/max_pixels (Qwen2-VL files; these override size, as in transformers).
  static PreprocessorConfig from_file(const std::string& path);
  // Keys absent from `j` keep `base`'s values.
  static PreprocessorConfig from_json(const nlohmann::json& j);
  static PreprocessorConfig from_json(const nlohmann::json& j, const PreprocessorConfig& base);
  // Throws iris::Error if a value is out of range.
  void validate() const;
};

struct ResizedSize {
  int height, width;
};

// transformers 5.x smart_resize: round-half-even to multiples of factor, then rescale into
// [min_pixels, max_pixels] keeping the aspect ratio. Aspect ratio above 200 is an error.
ResizedSize smart_resize(int height, int width, int factor, int64_t min_pixels, int64_t max_pixels);

// The grid preprocess_image gives an image of `height` x `width`: smart_resize's size when
// do_resize is on, the image's own otherwise. No pixel is touched, so token budgets can be checked
// before any resampling, normalising or patchifying (which for a large budget take gigabytes).
std::array<int64_t, 3> image_grid(int height, int width, const PreprocessorConfig& cfg);
// The language model's tokens for an image of that grid: one per merge_size^2 patches.
int64_t image_token_count(const std::array<int64_t, 3>& grid, const PreprocessorConfig& cfg);
// The fewest tokens smart_resize can give any image under cfg's pixel bounds: an image enlarged
// or kept has at least min_pixels; one shrunk to fit max_pixels keeps at least a quarter of them
// (each side is floored to a multiple of the factor, but never below it, so a side keeps at least
// half of its exact scaled length).
int64_t fewest_image_tokens(const PreprocessorConfig& cfg);

// Antialiased bicubic (a = -0.5) on uint8, bit-compatible with ATen's CPU uint8 kernel that
// torchvision's resize(antialias=True) runs: separable, horizontal pass first, int16 fixed-point
// weights, uint8 intermediate, clamp. A dimension whose size does not change is not filtered.
ImageRGB8 resize_bicubic_antialias(const ImageRGB8& src, int out_height, int out_width);

// The value of each byte per channel after do_rescale and do_normalize, with transformers' float32
// arithmetic.
PixelTable pixel_table(const PreprocessorConfig& cfg);

// Preprocessing's first part: each image checked and brought to its grid's size (smart_resize
// and resize_bicubic_antialias when do_resize is on). Normalising and patchifying the result,
// on the host (patchify_images) or by the backend (VisionPixels), is the rest.
struct SizedImages {
  std::vector<ImageRGB8> images;  // each at its grid's size
  std::vector<std::array<int64_t, 3>> grid_thw;
};
SizedImages size_images(std::vector<ImageRGB8> images, const PreprocessorConfig& cfg);

struct PreprocessedImage {
  HostTensor pixel_values;  // f32 [grid_t*gh*gw, 3*Tp*P*P], merge-window row order
  std::array<int64_t, 3> grid_thw;
};
PreprocessedImage preprocess_image(const ImageRGB8& image, const PreprocessorConfig& cfg);

// The pixel rows of video frames already at their final size (a multiple of patch_size *
// merge_size, all one size), temporal slice k made of frames k*Tp .. k*Tp+Tp-1 (the frame count
// must be a multiple of temporal_patch_size): f32 [slices * gh * gw, 3*Tp*P*P].
HostTensor patchify_frames(const std::vector<const ImageRGB8*>& frames,
                           const PreprocessorConfig& cfg);

// Several images concatenated along rows, grids in order (one vision encoder call).
struct PreprocessedBatch {
  HostTensor pixel_values;
  std::vector<std::array<int64_t, 3>> grid_thw;
};
PreprocessedBatch preprocess_images(const std::vector<ImageRGB8>& images,
                                    const PreprocessorConfig& cfg);
// The rows of images already sized: preprocess_images is patchify_images(size_images(...)).
PreprocessedBatch patchify_images(const SizedImages& sized, const PreprocessorConfig& cfg);

}  // namespace iris
