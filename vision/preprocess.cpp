#include "vision/preprocess.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs.h"
#include "core/image_patches.h"
#include "core/json_read.h"

namespace iris {

// ---------------------------------------------------------------------------------------------
// Config

namespace {

using nlohmann::json;

int64_t json_int(const json& v, const std::string& key) {
  if (v.is_number_integer()) return v.get<int64_t>();
  // Some exported configs write integers as 3136.0.
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.0e15)
      return static_cast<int64_t>(d);
  }
  IRIS_FAIL("preprocessor config: \"", key, "\" must be an integer, got ", json_excerpt(v));
}

double json_number(const json& v, const std::string& key) {
  IRIS_CHECK(v.is_number(), "preprocessor config: \"", key, "\" must be a number, got ",
             json_excerpt(v));
  return v.get<double>();
}

bool json_bool(const json& v, const std::string& key) {
  IRIS_CHECK(v.is_boolean(), "preprocessor config: \"", key, "\" must be true or false, got ",
             json_excerpt(v));
  return v.get<bool>();
}

int json_small_int(const json& v, const std::string& key) {
  const int64_t x = json_int(v, key);
  IRIS_CHECK(x >= INT_MIN && x <= INT_MAX, "preprocessor config: \"", key, "\" = ", x,
             " is out of range");
  return static_cast<int>(x);
}

// transformers accepts a single number for image_mean/image_std and broadcasts it.
std::array<float, 3> json_triple(const json& v, const std::string& key) {
  std::array<float, 3> out{};
  if (v.is_number()) {
    out.fill(static_cast<float>(v.get<double>()));
    return out;
  }
  IRIS_CHECK(v.is_array() && v.size() == 3, "preprocessor config: \"", key,
             "\" must be a list of 3 numbers (one per RGB channel), got ", json_excerpt(v));
  for (size_t i = 0; i < 3; ++i)
    out[i] = static_cast<float>(json_number(v[i], key + "[" + std::to_string(i) + "]"));
  return out;
}

}  // namespace

void PreprocessorConfig::validate() const {
  IRIS_CHECK(patch_size >= 1 && patch_size <= 1024,
             "preprocessor config: patch_size = ", patch_size,
             " is invalid (expected a positive size such as 16 or 14)");
  IRIS_CHECK(temporal_patch_size >= 1 && temporal_patch_size <= 64,
             "preprocessor config: temporal_patch_size = ", temporal_patch_size,
             " is invalid (expected a small positive integer, usually 2)");
  IRIS_CHECK(merge_size >= 1 && merge_size <= 64, "preprocessor config: merge_size = ", merge_size,
             " is invalid (expected a small positive integer, usually 2)");
  IRIS_CHECK(min_pixels >= 1, "preprocessor config: min_pixels (size.shortest_edge) = ", min_pixels,
             " must be positive");
  IRIS_CHECK(max_pixels >= min_pixels,
             "preprocessor config: max_pixels (size.longest_edge) = ", max_pixels,
             " is smaller than min_pixels (size.shortest_edge) = ", min_pixels);
  IRIS_CHECK(max_pixels <= (int64_t{1} << 40), "preprocessor config: max_pixels = ", max_pixels,
             " is implausibly large");
  for (int c = 0; c < 3; ++c) {
    IRIS_CHECK(std::isfinite(image_mean[c]), "preprocessor config: image_mean[", c,
               "] is not finite");
    IRIS_CHECK(std::isfinite(image_std[c]) && image_std[c] != 0.0f,
               "preprocessor config: image_std[", c, "] = ", image_std[c],
               " must be finite and non-zero");
  }
  IRIS_CHECK(std::isfinite(rescale_factor) && rescale_factor > 0,
             "preprocessor config: rescale_factor = ", rescale_factor,
             " must be positive (usually 1/255)");
}

PreprocessorConfig PreprocessorConfig::from_json(const json& j) {
  return from_json(j, PreprocessorConfig{});
}

PreprocessorConfig PreprocessorConfig::from_json(const json& j, const PreprocessorConfig& base) {
  IRIS_CHECK(j.is_object(), "preprocessor config must be a JSON object, got ", j.type_name());
  PreprocessorConfig c = base;
  if (j.contains("patch_size")) c.patch_size = json_small_int(j["patch_size"], "patch_size");
  if (j.contains("temporal_patch_size"))
    c.temporal_patch_size = json_small_int(j["temporal_patch_size"], "temporal_patch_size");
  if (j.contains("merge_size")) c.merge_size = json_small_int(j["merge_size"], "merge_size");
  if (j.contains("size") && !j["size"].is_null()) {
    const json& s = j["size"];
    IRIS_CHECK(s.is_object(),
               "preprocessor config: \"size\" must be an object with shortest_edge "
               "and longest_edge (pixel-count bounds), got ",
               json_excerpt(s));
    const bool hf = s.contains("shortest_edge") || s.contains("longest_edge");
    const bool legacy = s.contains("min_pixels") || s.contains("max_pixels");
    IRIS_CHECK(hf || legacy,
               "preprocessor config: \"size\" must contain shortest_edge and "
               "longest_edge (or min_pixels and max_pixels), got ",
               json_excerpt(s));
    if (s.contains("shortest_edge"))
      c.min_pixels = json_int(s["shortest_edge"], "size.shortest_edge");
    if (s.contains("longest_edge")) c.max_pixels = json_int(s["longest_edge"], "size.longest_edge");
    if (s.contains("min_pixels")) c.min_pixels = json_int(s["min_pixels"], "size.min_pixels");
    if (s.contains("max_pixels")) c.max_pixels = json_int(s["max_pixels"], "size.max_pixels");
  }
  // Top-level keys win over "size", as in transformers' backward-compatibility path.
  if (j.contains("min_pixels") && !j["min_pixels"].is_null())
    c.min_pixels = json_int(j["min_pixels"], "min_pixels");
  if (j.contains("max_pixels") && !j["max_pixels"].is_null())
    c.max_pixels = json_int(j["max_pixels"], "max_pixels");
  if (j.contains("image_mean")) c.image_mean = json_triple(j["image_mean"], "image_mean");
  if (j.contains("image_std")) c.image_std = json_triple(j["image_std"], "image_std");
  if (j.contains("rescale_factor"))
    c.rescale_factor = json_number(j["rescale_factor"], "rescale_factor");
  if (j.contains("do_resize")) c.do_resize = json_bool(j["do_resize"], "do_resize");
  if (j.contains("do_rescale")) c.do_rescale = json_bool(j["do_rescale"], "do_rescale");
  if (j.contains("do_normalize")) c.do_normalize = json_bool(j["do_normalize"], "do_normalize");
  if (j.contains("do_convert_rgb"))
    c.do_convert_rgb = json_bool(j["do_convert_rgb"], "do_convert_rgb");
  // Only PIL's BICUBIC (3) is implemented; silently resampling differently would shift every
  // pixel_values entry away from what the model was trained on.
  if (j.contains("resample") && !j["resample"].is_null()) {
    const int64_t r = json_int(j["resample"], "resample");
    IRIS_CHECK(r == 3, "preprocessor config: resample = ", r,
               " is not supported; only bicubic (3), which every Qwen-VL release uses");
  }
  c.validate();
  return c;
}

PreprocessorConfig PreprocessorConfig::from_file(const std::string& path) {
  const std::string text = read_text_file(path, "preprocessor config", kJsonConfigLimits.max_bytes);
  json j;
  try {
    j = parse_json(text, path);
  } catch (const Error& e) {
    IRIS_FAIL("malformed JSON in preprocessor config: ", e.what());
  }
  try {
    return from_json(j);
  } catch (const Error& e) {
    IRIS_FAIL(path, ": ", e.what());
  } catch (const json::exception& e) {
    IRIS_FAIL(path, ": unexpected value in preprocessor config: ", json_error_text(e));
  }
}

// ---------------------------------------------------------------------------------------------
// smart_resize

ResizedSize smart_resize(int height, int width, int factor, int64_t min_pixels,
                         int64_t max_pixels) {
  IRIS_CHECK(height > 0 && width > 0, "smart_resize: image size ", width, "x", height,
             " is invalid (width and height must be positive)");
  IRIS_CHECK(factor > 0, "smart_resize: factor = ", factor, " must be positive");
  IRIS_CHECK(max_pixels > 0 && min_pixels >= 0, "smart_resize: pixel bounds [", min_pixels, ", ",
             max_pixels, "] are invalid");
  constexpr double kMaxRatio = 200.0;
  const double ratio =
      static_cast<double>(std::max(height, width)) / static_cast<double>(std::min(height, width));
  IRIS_CHECK(ratio <= kMaxRatio, "image of ", width, "x", height, " has aspect ratio ", ratio,
             ", but Qwen-VL preprocessing requires an aspect ratio of at most ", kMaxRatio,
             "; crop or pad the image first");

  const int64_t H = height, W = width, F = factor;
  const double hw = static_cast<double>(H * W);
  // Python's round() is half-to-even; nearbyint does the same under the default rounding mode
  // (720/32 = 22.5 must give 22, std::round would give 23).
  int64_t h = static_cast<int64_t>(std::nearbyint(static_cast<double>(H) / F)) * F;
  int64_t w = static_cast<int64_t>(std::nearbyint(static_cast<double>(W) / F)) * F;
  if (h * w > max_pixels) {
    const double beta = std::sqrt(hw / static_cast<double>(max_pixels));
    h = std::max(F, static_cast<int64_t>(std::floor(static_cast<double>(H) / beta / F)) * F);
    w = std::max(F, static_cast<int64_t>(std::floor(static_cast<double>(W) / beta / F)) * F);
  } else if (h * w < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / hw);
    h = static_cast<int64_t>(std::ceil(static_cast<double>(H) * beta / F)) * F;
    w = static_cast<int64_t>(std::ceil(static_cast<double>(W) * beta / F)) * F;
  }
  IRIS_CHECK(h > 0 && w > 0, "image of ", width, "x", height, " resizes to ", w, "x", h,
             " with factor ", factor, " and min_pixels ", min_pixels,
             "; raise min_pixels (size.shortest_edge) to at least ", F * F);
  IRIS_CHECK(h <= INT_MAX / 4 && w <= INT_MAX / 4, "image of ", width, "x", height, " resizes to ",
             w, "x", h, ", which is too large; lower max_pixels");
  return {static_cast<int>(h), static_cast<int>(w)};
}

std::array<int64_t, 3> image_grid(int height, int width, const PreprocessorConfig& cfg) {
  if (cfg.do_resize) {
    const ResizedSize s = smart_resize(height, width, cfg.patch_size * cfg.merge_size,
                                       cfg.min_pixels, cfg.max_pixels);
    height = s.height;
    width = s.width;
  }
  return {1, height / cfg.patch_size, width / cfg.patch_size};
}

int64_t image_token_count(const std::array<int64_t, 3>& grid, const PreprocessorConfig& cfg) {
  return grid[0] * grid[1] * grid[2] / (int64_t{cfg.merge_size} * cfg.merge_size);
}

int64_t fewest_image_tokens(const PreprocessorConfig& cfg) {
  const int64_t factor = int64_t{cfg.patch_size} * cfg.merge_size;
  if (!cfg.do_resize) return 1;
  return std::max<int64_t>(1, std::min(cfg.min_pixels, cfg.max_pixels / 4) / (factor * factor));
}

// ---------------------------------------------------------------------------------------------
// Antialiased bicubic resampling

namespace {

// Keys cubic with a = -0.5, as in ATen's aa_filter and PIL's bicubic_filter.
inline double cubic_aa_filter(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  // Same operation order as ATen's cubic_convolution1/2, so the double weights agree bit for bit.
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a;
  return 0.0;
}

// Per-output taps of one axis: the first input index, the tap count and int16 weights scaled by
// 2^precision. Mirrors ATen's _compute_index_ranges_int16_weights, whose weight rounding and
// precision choice decide the ±1 LSB behaviour we want to match.
struct AxisFilter {
  int precision = 0;
  int stride = 0;  // weights per output
  std::vector<int> first, count;
  std::vector<int16_t> weights;
};

AxisFilter make_axis_filter(int in_size, int out_size) {
  const double scale = static_cast<double>(in_size) / out_size;
  constexpr double kInterpSize = 4.0;  // bicubic
  const double support = scale >= 1.0 ? kInterpSize * 0.5 * scale : kInterpSize * 0.5;
  int max_taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  // ATen's AVX2 build pads the tap count to a multiple of 4; the only effect is on the clamp of
  // the tap count below, which we keep identical.
  max_taps = (max_taps + 3) / 4 * 4;
  const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;

  AxisFilter f;
  f.stride = max_taps;
  f.first.resize(out_size);
  f.count.resize(out_size);
  std::vector<double> wd(static_cast<size_t>(out_size) * max_taps, 0.0);
  double wt_max = 0.0;
  for (int i = 0; i < out_size; ++i) {
    const double center = scale * (i + 0.5);
    const int64_t xmin = std::max(static_cast<int64_t>(center - support + 0.5), int64_t{0});
    int64_t xsize = std::min(static_cast<int64_t>(center + support + 0.5), int64_t{in_size}) - xmin;
    xsize = std::clamp(xsize, int64_t{0}, int64_t{max_taps});
    double* w = wd.data() + static_cast<size_t>(i) * max_taps;
    double total = 0.0;
    for (int64_t j = 0; j < xsize; ++j) {
      w[j] = cubic_aa_filter((static_cast<double>(j + xmin) - center + 0.5) * invscale);
      total += w[j];
    }
    if (total != 0.0)
      for (int64_t j = 0; j < xsize; ++j) {
        w[j] /= total;
        wt_max = std::max(wt_max, w[j]);
      }
    f.first[i] = static_cast<int>(xmin);
    f.count[i] = static_cast<int>(xsize);
  }
  int precision = 0;
  for (; precision < 22; ++precision) {
    const int next = static_cast<int>(0.5 + wt_max * (1 << (precision + 1)));
    if (next >= (1 << 15)) break;
  }
  f.precision = precision;
  f.weights.resize(wd.size());
  for (size_t k = 0; k < wd.size(); ++k) {
    const double v = wd[k] * (1 << precision);
    f.weights[k] =
        static_cast<int16_t>(v < 0 ? static_cast<int>(-0.5 + v) : static_cast<int>(0.5 + v));
  }
  return f;
}

inline uint8_t clamp_shift(int32_t acc, int precision) {
  return static_cast<uint8_t>(std::clamp(acc >> precision, 0, 255));
}

void resample_horizontal(const uint8_t* src, int height, int in_w, uint8_t* dst, int out_w) {
  const AxisFilter f = make_axis_filter(in_w, out_w);
  const int32_t round = 1 << (f.precision - 1);
#pragma omp parallel for schedule(static)
  for (int y = 0; y < height; ++y) {
    const uint8_t* row = src + static_cast<size_t>(y) * in_w * 3;
    uint8_t* out = dst + static_cast<size_t>(y) * out_w * 3;
    for (int x = 0; x < out_w; ++x) {
      const int16_t* w = f.weights.data() + static_cast<size_t>(x) * f.stride;
      const uint8_t* p = row + static_cast<size_t>(f.first[x]) * 3;
      int32_t r = round, g = round, b = round;
      for (int j = 0; j < f.count[x]; ++j) {
        r += p[3 * j] * w[j];
        g += p[3 * j + 1] * w[j];
        b += p[3 * j + 2] * w[j];
      }
      out[3 * x] = clamp_shift(r, f.precision);
      out[3 * x + 1] = clamp_shift(g, f.precision);
      out[3 * x + 2] = clamp_shift(b, f.precision);
    }
  }
}

void resample_vertical(const uint8_t* src, int in_h, int width, uint8_t* dst, int out_h) {
  const AxisFilter f = make_axis_filter(in_h, out_h);
  const int32_t round = 1 << (f.precision - 1);
  const size_t row_len = static_cast<size_t>(width) * 3;
#pragma omp parallel
  {
    // Accumulating whole rows tap by tap keeps the inner loop contiguous and vectorisable.
    std::vector<int32_t> acc(row_len);
#pragma omp for schedule(static)
    for (int y = 0; y < out_h; ++y) {
      std::fill(acc.begin(), acc.end(), round);
      const int16_t* w = f.weights.data() + static_cast<size_t>(y) * f.stride;
      for (int j = 0; j < f.count[y]; ++j) {
        const uint8_t* row = src + static_cast<size_t>(f.first[y] + j) * row_len;
        const int32_t wj = w[j];
        for (size_t k = 0; k < row_len; ++k) acc[k] += row[k] * wj;
      }
      uint8_t* out = dst + static_cast<size_t>(y) * row_len;
      for (size_t k = 0; k < row_len; ++k) out[k] = clamp_shift(acc[k], f.precision);
    }
  }
}

}  // namespace

ImageRGB8 resize_bicubic_antialias(const ImageRGB8& src, int out_height, int out_width) {
  check_image(src, "resize_bicubic_antialias");
  IRIS_CHECK(out_height > 0 && out_width > 0, "resize_bicubic_antialias: target size ", out_width,
             "x", out_height, " is invalid (width and height must be positive)");
  IRIS_CHECK(static_cast<int64_t>(out_height) * out_width <= (int64_t{1} << 31) &&
                 static_cast<int64_t>(src.height) * out_width <= (int64_t{1} << 31),
             "resize_bicubic_antialias: target size ", out_width, "x", out_height, " is too large");
  if (out_width == src.width && out_height == src.height) return src;
  ImageRGB8 horiz;
  const ImageRGB8* cur = &src;
  if (out_width != src.width) {
    horiz.width = out_width;
    horiz.height = src.height;
    horiz.pixels.resize(static_cast<size_t>(out_width) * src.height * 3);
    resample_horizontal(src.pixels.data(), src.height, src.width, horiz.pixels.data(), out_width);
    if (out_height == src.height) return horiz;
    cur = &horiz;
  }
  ImageRGB8 out;
  out.width = out_width;
  out.height = out_height;
  out.pixels.resize(static_cast<size_t>(out_width) * out_height * 3);
  resample_vertical(cur->pixels.data(), cur->height, cur->width, out.pixels.data(), out_height);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Normalise + patchify

PixelTable pixel_table(const PreprocessorConfig& cfg) {
  // Each output value is a function of one byte and its channel, computed once per byte with the
  // float32 operations transformers performs, fused as in its torchvision backend: mean and std
  // are float32 tensors multiplied by the python float 1/rescale_factor, then (x - mean') / std'.
  PixelTable table{};
  const float inv_rescale = static_cast<float>(1.0 / cfg.rescale_factor);
  const float rescale = static_cast<float>(cfg.rescale_factor);
  for (int c = 0; c < 3; ++c) {
    const float mean = cfg.do_rescale ? cfg.image_mean[c] * inv_rescale : cfg.image_mean[c];
    const float stdv = cfg.do_rescale ? cfg.image_std[c] * inv_rescale : cfg.image_std[c];
    for (int v = 0; v < 256; ++v) {
      const float x = static_cast<float>(v);
      float& out = table[static_cast<size_t>(c) * 256 + v];
      if (cfg.do_normalize)
        out = (x - mean) / stdv;
      else if (cfg.do_rescale)
        out = x * rescale;
      else
        out = x;
    }
  }
  return table;
}

namespace {

struct Plan {
  ImageRGB8 resized;  // empty when the input is used as is
  int height = 0, width = 0;
  std::array<int64_t, 3> grid{};
  int64_t rows = 0;
};

Plan plan_image(const ImageRGB8& image, const PreprocessorConfig& cfg, size_t index) {
  const std::string what = "preprocess image " + std::to_string(index);
  check_image(image, what.c_str());
  const int factor = cfg.patch_size * cfg.merge_size;
  Plan p;
  p.height = image.height;
  p.width = image.width;
  if (cfg.do_resize) {
    const ResizedSize s =
        smart_resize(image.height, image.width, factor, cfg.min_pixels, cfg.max_pixels);
    if (s.height != image.height || s.width != image.width) {
      p.resized = resize_bicubic_antialias(image, s.height, s.width);
      p.height = s.height;
      p.width = s.width;
    }
  } else {
    IRIS_CHECK(image.height % factor == 0 && image.width % factor == 0, what,
               ": do_resize is off but the image is ", image.width, "x", image.height,
               ", not a multiple of patch_size*merge_size = ", factor,
               "; resize it first or enable do_resize");
  }
  p.grid = {1, p.height / cfg.patch_size, p.width / cfg.patch_size};
  p.rows = p.grid[0] * p.grid[1] * p.grid[2];
  return p;
}

void patchify(const ImageRGB8* const* slice, const PreprocessorConfig& cfg, const PixelTable& table,
              float* dst) {
  ImagePatchGeometry g;
  g.height = slice[0]->height;
  g.width = slice[0]->width;
  g.patch_size = cfg.patch_size;
  g.temporal_patch_size = cfg.temporal_patch_size;
  g.merge_size = cfg.merge_size;
  std::vector<const uint8_t*> frames;
  for (int f = 0; f < cfg.temporal_patch_size; ++f) frames.push_back(slice[f]->pixels.data());
  image_patches_host(dst, g.row_values(), frames.data(), g, table.data(), nullptr);
}

}  // namespace

SizedImages size_images(std::vector<ImageRGB8> images, const PreprocessorConfig& cfg) {
  cfg.validate();
  SizedImages out;
  out.images.reserve(images.size());
  for (size_t i = 0; i < images.size(); ++i) {
    Plan p = plan_image(images[i], cfg, i);
    out.images.push_back(p.resized.pixels.empty() ? std::move(images[i]) : std::move(p.resized));
    out.grid_thw.push_back(p.grid);
  }
  return out;
}

PreprocessedBatch patchify_images(const SizedImages& sized, const PreprocessorConfig& cfg) {
  cfg.validate();
  int64_t total_rows = 0;
  for (const auto& g : sized.grid_thw) total_rows += g[0] * g[1] * g[2];
  const int64_t cols = int64_t{3} * cfg.temporal_patch_size * cfg.patch_size * cfg.patch_size;
  PreprocessedBatch out;
  out.pixel_values = HostTensor(DType::f32, {total_rows, cols});
  const PixelTable table = pixel_table(cfg);
  float* dst = out.pixel_values.data<float>();
  for (size_t i = 0; i < sized.images.size(); ++i) {
    // One frame repeated to temporal_patch_size makes an image's single temporal slice.
    const std::vector<const ImageRGB8*> slice(static_cast<size_t>(cfg.temporal_patch_size),
                                              &sized.images[i]);
    patchify(slice.data(), cfg, table, dst);
    dst += sized.grid_thw[i][1] * sized.grid_thw[i][2] * cols;
  }
  out.grid_thw = sized.grid_thw;
  return out;
}

PreprocessedBatch preprocess_images(const std::vector<ImageRGB8>& images,
                                    const PreprocessorConfig& cfg) {
  return patchify_images(size_images(images, cfg), cfg);
}

HostTensor patchify_frames(const std::vector<const ImageRGB8*>& frames,
                           const PreprocessorConfig& cfg) {
  cfg.validate();
  const int Tp = cfg.temporal_patch_size, unit = cfg.patch_size * cfg.merge_size;
  IRIS_CHECK(!frames.empty() && frames.size() % static_cast<size_t>(Tp) == 0,
             "patchify_frames: ", frames.size(),
             " frames is not a positive multiple of temporal_patch_size ", Tp);
  const ImageRGB8& first = *frames[0];
  IRIS_CHECK(first.height % unit == 0 && first.width % unit == 0, "video frames of ", first.width,
             "x", first.height, " are not a multiple of patch_size*merge_size = ", unit);
  for (const ImageRGB8* f : frames) {
    check_image(*f, "video frame");
    IRIS_CHECK(f->width == first.width && f->height == first.height,
               "video frames differ in size: ", f->width, "x", f->height, " after ", first.width,
               "x", first.height);
  }
  const int64_t slices = static_cast<int64_t>(frames.size()) / Tp;
  const int64_t per_slice = int64_t{first.height / cfg.patch_size} * (first.width / cfg.patch_size);
  const int64_t cols = int64_t{3} * Tp * cfg.patch_size * cfg.patch_size;
  HostTensor out(DType::f32, {slices * per_slice, cols});
  const PixelTable table = pixel_table(cfg);
  for (int64_t k = 0; k < slices; ++k)
    patchify(frames.data() + k * Tp, cfg, table, out.data<float>() + k * per_slice * cols);
  return out;
}

PreprocessedImage preprocess_image(const ImageRGB8& image, const PreprocessorConfig& cfg) {
  PreprocessedBatch b = preprocess_images({image}, cfg);
  return {std::move(b.pixel_values), b.grid_thw[0]};
}

}  // namespace iris
