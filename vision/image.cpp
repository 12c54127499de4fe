#include "vision/image.h"

#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include "core/error.h"
#include "core/fs.h"

#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb_image.h>
#include <stb_image_write.h>

namespace iris {

namespace {

struct StbiFree {
  void operator()(stbi_uc* p) const { stbi_image_free(p); }
};

// PIL's Image.alpha_composite(white, rgba) in integer arithmetic (AlphaComposite.c, 7 extra bits of
// precision, rounded divisions by 255), so that transparent images match HF's convert_to_rgb bit
// for bit rather than to within one level.
inline uint8_t composite_on_white(uint32_t v, uint32_t a) {
  if (a == 0) return 255;
  constexpr uint32_t kBits = 7;
  const uint32_t out_a255 = a * 255 + 255 * (255 - a);
  const uint32_t coef1 = a * 255 * 255 * (1u << kBits) / out_a255;
  const uint32_t coef2 = 255 * (1u << kBits) - coef1;
  const uint32_t t = v * coef1 + 255 * coef2 + (0x80u << kBits);
  return static_cast<uint8_t>(((((t >> 8) + t) >> 8)) >> kBits);
}

}  // namespace

void check_image(const ImageRGB8& img, const char* what) {
  IRIS_CHECK(img.width > 0 && img.height > 0, what, ": image has invalid size ", img.width, "x",
             img.height, " (width and height must be positive)");
  IRIS_CHECK(img.pixels.size() == static_cast<size_t>(img.width) * img.height * 3, what,
             ": image of ", img.width, "x", img.height, " needs ",
             static_cast<size_t>(img.width) * img.height * 3, " bytes of RGB pixels but holds ",
             img.pixels.size());
}

ImageRGB8 decode_image(const uint8_t* data, size_t size, const std::string& name_for_errors) {
  IRIS_CHECK(size > 0, "cannot decode image ", name_for_errors,
             ": it is empty (0 bytes); expected PNG, JPEG, BMP, GIF, TGA or PNM data");
  IRIS_CHECK(data != nullptr, "cannot decode image ", name_for_errors, ": null data pointer");
  IRIS_CHECK(size <= static_cast<size_t>(INT_MAX), "cannot decode image ", name_for_errors, ": ",
             size, " bytes is more than the decoder accepts (2 GiB)");
  const int len = static_cast<int>(size);
  int w = 0, h = 0, channels = 0;
  if (!stbi_info_from_memory(data, len, &w, &h, &channels))
    IRIS_FAIL("cannot decode image ", name_for_errors, ": ", stbi_failure_reason(),
              " (supported formats: PNG, JPEG, BMP, GIF, TGA, PNM; the file may be truncated or "
              "not an image)");
  IRIS_CHECK(channels >= 1 && channels <= 4, "cannot decode image ", name_for_errors, ": ",
             channels, " channels per pixel is not supported (expected 1 to 4)");
  // Alpha only survives as an extra channel, so ask stb for one whenever the source may carry it:
  // palette PNGs with tRNS and GIF transparency then composite like true RGBA, and grey PNGs with a
  // tRNS colour key composite as PIL's convert("RGBA") makes them. Opaque alpha composites to the
  // identity. RGB with a colour key stays opaque, as PIL leaves RGB images untouched.
  const bool keep_alpha = channels != 3;
  const int want = channels <= 2 ? 2 : channels;
  std::unique_ptr<stbi_uc, StbiFree> decoded(
      stbi_load_from_memory(data, len, &w, &h, &channels, want));
  if (!decoded)
    IRIS_FAIL("cannot decode image ", name_for_errors, ": ", stbi_failure_reason(),
              " (the file may be truncated or corrupt)");
  IRIS_CHECK(w > 0 && h > 0, "cannot decode image ", name_for_errors, ": decoder returned size ", w,
             "x", h);

  ImageRGB8 img;
  img.width = w;
  img.height = h;
  const size_t n = static_cast<size_t>(w) * h;
  img.pixels.resize(n * 3);
  const stbi_uc* src = decoded.get();
  uint8_t* dst = img.pixels.data();
  if (!keep_alpha) {
    std::memcpy(dst, src, n * 3);
  } else if (want == 2) {
    for (size_t i = 0; i < n; ++i)
      dst[3 * i] = dst[3 * i + 1] = dst[3 * i + 2] = composite_on_white(src[2 * i], src[2 * i + 1]);
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint32_t a = src[4 * i + 3];
      for (int c = 0; c < 3; ++c) dst[3 * i + c] = composite_on_white(src[4 * i + c], a);
    }
  }
  return img;
}

ImageRGB8 load_image(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  IRIS_CHECK(std::filesystem::exists(status), "image file not found: ", path,
             " (check the path; relative paths are resolved from the current directory)");
  IRIS_CHECK(!std::filesystem::is_directory(status), "cannot load image ", path,
             ": it is a directory, not an image file");
  std::ifstream f(path, std::ios::binary);
  IRIS_CHECK(f.good(), "cannot open image ", path, ": ", std::strerror(errno));
  f.seekg(0, std::ios::end);
  const std::streamoff end = f.tellg();
  IRIS_CHECK(end >= 0, "cannot read image ", path, ": cannot determine its size");
  f.seekg(0, std::ios::beg);
  std::vector<uint8_t> bytes(static_cast<size_t>(end));
  if (!bytes.empty()) {
    f.read(reinterpret_cast<char*>(bytes.data()), end);
    IRIS_CHECK(f.gcount() == end, "cannot read image ", path, ": short read (", f.gcount(), " of ",
               end, " bytes)");
  }
  return decode_image(bytes.data(), bytes.size(), path);
}

void write_png(const std::string& path, const ImageRGB8& img) {
  check_image(img, ("write_png " + path).c_str());
  IRIS_CHECK(static_cast<size_t>(img.width) * 3 <= static_cast<size_t>(INT_MAX), "write_png ", path,
             ": image is too wide (", img.width, " pixels) for the PNG encoder");
  int len = 0;
  std::unique_ptr<unsigned char, decltype(&free)> png(
      stbi_write_png_to_mem(img.pixels.data(), img.width * 3, img.width, img.height, 3, &len),
      &free);
  IRIS_CHECK(png != nullptr && len > 0, "write_png ", path, ": PNG encoding of ", img.width, "x",
             img.height, " image failed (out of memory?)");
  write_file_atomic(path, std::string(reinterpret_cast<const char*>(png.get()), len));
}

}  // namespace iris
