#include "vision/image.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <memory>

#include "core/error.h"
#include "core/fs.h"
#include "vision/image_formats.h"

#define STB_IMAGE_IMPLEMENTATION
// JPEG goes through libjpeg-turbo (vision/image_jpeg.cpp), as PIL decodes it; stb's JPEG decoder,
// whose 2.27 release writes out of bounds for oversized Huffman tables, is not compiled in.
#define STBI_NO_JPEG
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include <stb_image.h>
#include <stb_image_write.h>

namespace iris {

namespace {

struct StbiFree {
  void operator()(stbi_uc* p) const { stbi_image_free(p); }
};

// stb 2.27 parses a PNM header's numbers into an int without an overflow check (signed overflow,
// undefined behaviour; fixed upstream later). Read the header exactly as stbi__pnm_info does and
// reject a number stb would overflow on. Only P5 and P6 reach that parser. `maxval`, when given,
// receives the header's third number (the sample maximum).
std::string pnm_header_problem(const uint8_t* d, size_t n, int64_t* maxval = nullptr) {
  if (n < 2 || d[0] != 'P' || (d[1] != '5' && d[1] != '6')) return {};
  size_t pos = 2;
  auto at_eof = [&] { return pos >= n; };
  auto get8 = [&]() -> char { return pos < n ? static_cast<char>(d[pos++]) : '\0'; };
  auto is_space = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
  };
  char c = get8();
  for (int field = 0; field < 3; ++field) {
    for (;;) {  // stbi__pnm_skip_whitespace
      while (!at_eof() && is_space(c)) c = get8();
      if (at_eof() || c != '#') break;
      while (!at_eof() && c != '\n' && c != '\r') c = get8();
    }
    int64_t value = 0;  // stbi__pnm_getinteger
    while (!at_eof() && c >= '0' && c <= '9') {
      value = value * 10 + (c - '0');
      if (value > INT_MAX) return "a number in its PNM header is too large (corrupt PNM)";
      c = get8();
    }
    if (field == 2 && maxval != nullptr) *maxval = value;
  }
  return {};
}

// stb 2.27 keeps 16-bit PNM samples in host byte order instead of converting from the file's
// big-endian order, so its 8-bit result holds the low bytes. Later versions convert. Probe once
// which behaviour we are linked with rather than assume it.
bool stb_pnm16_is_byte_swapped() {
  static const bool swapped = [] {
    static constexpr unsigned char kProbe[] = "P5\n1 1\n65535\n\x12\x34";
    int w = 0, h = 0, c = 0;
    stbi_us* p = stbi_load_16_from_memory(kProbe, sizeof(kProbe) - 1, &w, &h, &c, 1);
    const bool s = p != nullptr && p[0] == 0x3412;
    stbi_image_free(p);
    return s;
  }();
  return swapped;
}

// A PNM sample as PIL's PpmImagePlugin makes it and convert("RGB") then leaves it, from the
// file's value `v` under its `maxval`: a grey file of more than 8 bits opens as mode I with the
// values scaled to 0..65535 (kept raw at maxval 65535) and converts clipped to 255; every other
// file (grey of 8 bits, RGB of any depth) is scaled to 0..255. The scaling is Python's
// min(out_max, round(v / maxval * out_max)), rounding half to even. stb keeps the raw values.
uint8_t pil_pnm_sample(uint32_t v, uint32_t maxval, bool grey) {
  const bool mode_i = grey && maxval > 255;
  if (maxval == (mode_i ? 65535u : 255u)) return static_cast<uint8_t>(std::min<uint32_t>(v, 255));
  const double out_max = mode_i ? 65535.0 : 255.0;
  const double scaled =
      std::min(out_max, std::nearbyint(static_cast<double>(v) / maxval * out_max));
  return static_cast<uint8_t>(std::min(scaled, 255.0));
}

// 16-bit PGM/PPM reduced to 8 bits as PIL reduces them (pil_pnm_sample).
std::vector<uint8_t> decode_pnm16(const uint8_t* data, int len, int channels, uint32_t maxval,
                                  int& w, int& h, const std::string& name) {
  int c = 0;
  std::unique_ptr<stbi_us, void (*)(void*)> raw(
      stbi_load_16_from_memory(data, len, &w, &h, &c, channels), &stbi_image_free);
  if (!raw)
    IRIS_FAIL("cannot decode image ", name, ": ", stbi_failure_reason(),
              " (the file may be truncated or corrupt)");
  const size_t n = static_cast<size_t>(w) * h * channels;
  const bool swapped = stb_pnm16_is_byte_swapped();
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    const stbi_us v = raw.get()[i];
    const uint32_t sample = swapped ? ((v & 0xff) << 8) | (v >> 8) : v;
    out[i] = pil_pnm_sample(sample, maxval, channels == 1);
  }
  return out;
}

// A 16-bit grey PNG opens in PIL as mode I;16 with its full sample values, and convert("RGB")
// clips them: any value above 255 is 255 (Convert.c, I16_RGB). stb's 8-bit API keeps the high
// byte instead, right for PIL's other 16-bit PNG modes (RGB;16B, RGBA;16B, LA;16B unpack the high
// byte) but not for this one. A tRNS colour key changes no value: convert("RGB") ignores it.
std::vector<uint8_t> decode_png16_grey(const uint8_t* data, int len, int& w, int& h,
                                       const std::string& name) {
  int c = 0;
  std::unique_ptr<stbi_us, void (*)(void*)> raw(stbi_load_16_from_memory(data, len, &w, &h, &c, 1),
                                                &stbi_image_free);
  if (!raw)
    IRIS_FAIL("cannot decode image ", name, ": PNG data is corrupt or truncated (",
              stbi_failure_reason(), ")");
  const size_t n = static_cast<size_t>(w) * h;
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = static_cast<uint8_t>(std::min<stbi_us>(raw.get()[i], 255));
  return out;
}

// The format a file's signature claims, for error messages; null when none matches.
const char* sniff_format(const uint8_t* d, size_t n) {
  auto starts = [&](std::initializer_list<uint8_t> sig) {
    return n >= sig.size() && std::equal(sig.begin(), sig.end(), d);
  };
  if (starts({0x89, 'P', 'N', 'G'})) return "PNG";
  if (starts({'G', 'I', 'F', '8'})) return "GIF";
  if (starts({'B', 'M'})) return "BMP";
  if (n >= 2 && d[0] == 'P' && d[1] >= '1' && d[1] <= '6') return "PNM";
  return nullptr;
}

// Everything stb reads, as decode_image documents it; JPEG, WebP and TIFF have decoders of their
// own.
ImageRGB8 decode_with_stb(const uint8_t* data, size_t size, const std::string& name_for_errors,
                          int64_t max_pixels);

}  // namespace

void check_image(const ImageRGB8& img, const char* what) {
  IRIS_CHECK(img.width > 0 && img.height > 0, what, ": image has invalid size ", img.width, "x",
             img.height, " (width and height must be positive)");
  IRIS_CHECK(img.pixels.size() == static_cast<size_t>(img.width) * img.height * 3, what,
             ": image of ", img.width, "x", img.height, " needs ",
             static_cast<size_t>(img.width) * img.height * 3, " bytes of RGB pixels but holds ",
             img.pixels.size());
}

ImageRGB8 decode_image(const uint8_t* data, size_t size, const std::string& name_for_errors,
                       int64_t max_pixels) {
  IRIS_CHECK(size > 0, "cannot decode image ", name_for_errors,
             ": it is empty (0 bytes); expected ", kImageFormats, " data");
  IRIS_CHECK(data != nullptr, "cannot decode image ", name_for_errors, ": null data pointer");
  IRIS_CHECK(size <= static_cast<size_t>(INT_MAX), "cannot decode image ", name_for_errors, ": ",
             size, " bytes is more than the decoder accepts (2 GiB)");
  ImageRGB8 img = image_detail::is_jpeg(data, size)
                      ? image_detail::decode_jpeg(data, size, name_for_errors, max_pixels)
                  : image_detail::is_webp(data, size)
                      ? image_detail::decode_webp(data, size, name_for_errors, max_pixels)
                  : image_detail::is_tiff(data, size)
                      ? image_detail::decode_tiff(data, size, name_for_errors, max_pixels)
                      : decode_with_stb(data, size, name_for_errors, max_pixels);
  // transformers' load_image applies PIL.ImageOps.exif_transpose before anything else.
  return image_detail::apply_orientation(std::move(img),
                                         image_detail::file_orientation(data, size));
}

namespace {

ImageRGB8 decode_with_stb(const uint8_t* data, size_t size, const std::string& name_for_errors,
                          int64_t max_pixels) {
  const int len = static_cast<int>(size);
  int64_t pnm_maxval = 255;
  const std::string pnm_problem = pnm_header_problem(data, size, &pnm_maxval);
  IRIS_CHECK(pnm_problem.empty(), "cannot decode image ", name_for_errors, ": ", pnm_problem);
  const char* format = sniff_format(data, size);
  int w = 0, h = 0, channels = 0;
  if (!stbi_info_from_memory(data, len, &w, &h, &channels)) {
    // stb tries every format in turn and reports the last one's complaint ("bad png sig" for a
    // JPEG): name the format the file's signature claims instead.
    if (format)
      IRIS_FAIL("cannot decode image ", name_for_errors, ": its ", format,
                " header is corrupt or truncated");
    IRIS_FAIL("cannot decode image ", name_for_errors,
              ": unknown image type (supported: ", kImageFormats,
              "); the file may be truncated or not an image");
  }
  IRIS_CHECK(channels >= 1 && channels <= 4, "cannot decode image ", name_for_errors, ": ",
             channels, " channels per pixel is not supported (expected 1 to 4)");
  // A negative BMP height marks rows stored top-down (PIL reads such files, and stb's decoder
  // flips them itself); only its header reader passes the sign on.
  if (format != nullptr && std::strcmp(format, "BMP") == 0 && h < 0 && h != INT_MIN) h = -h;
  IRIS_CHECK(w > 0 && h > 0, "cannot decode image ", name_for_errors, ": its header gives size ", w,
             "x", h);
  IRIS_CHECK(int64_t{w} * h <= max_pixels, "image ", name_for_errors, " is ", w, "x", h, " = ",
             int64_t{w} * h, " pixels, more than the limit of ", max_pixels,
             " (a decompression bomb, or a scan far larger than the model can see); downscale it, "
             "or raise the limit (iris generate --max-image-pixels, recipe data.max_image_pixels)");
  // We ask stb for the stored channel count: its own channel converter is wrong for 16-bit PNM
  // in 2.27 (a heap over-read). Alpha, where there is some, is then dropped, as load_image's
  // convert("RGB") drops it (and transformers 5.x's convert_to_rgb, the same convert("RGB")):
  // every pixel keeps the colour it stores, whatever its alpha. stb reports a grey or RGB PNG
  // with a tRNS colour key as grey or RGB, which is right: convert("RGB") ignores the key too.
  // Palette PNGs with tRNS and GIFs report 4 channels, alpha after the palette's colours.
  const int want = channels;
  static constexpr uint8_t kPngSignature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  const bool is_png = size >= 8 && std::memcmp(data, kPngSignature, 8) == 0;
  std::unique_ptr<stbi_uc, StbiFree> decoded;
  std::vector<uint8_t> from16;  // 8-bit samples made from a 16-bit file where stb's differ
  const bool is_pnm = size >= 2 && data[0] == 'P' && (data[1] == '5' || data[1] == '6');
  IRIS_CHECK(!is_pnm || (pnm_maxval >= 1 && pnm_maxval <= 65535), "cannot decode image ",
             name_for_errors, ": its PNM header gives a maximum sample value of ", pnm_maxval,
             " (it must be 1 to 65535)");
  if (is_pnm && stbi_is_16_bit_from_memory(data, len)) {
    from16 =
        decode_pnm16(data, len, want, static_cast<uint32_t>(pnm_maxval), w, h, name_for_errors);
  } else if (is_png && channels == 1 && stbi_is_16_bit_from_memory(data, len)) {
    from16 = decode_png16_grey(data, len, w, h, name_for_errors);
  } else {
    decoded.reset(stbi_load_from_memory(data, len, &w, &h, &channels, want));
    if (!decoded) {
      // When stb's decoder for the file's own format gives up, stb goes on testing the other
      // formats, and the reason left is the last test's ("bad png sig" for a JPEG); such a
      // reason says nothing about this file.
      const std::string reason = stbi_failure_reason() ? stbi_failure_reason() : "";
      const bool about_this_file = reason.find("sig") == std::string::npos &&
                                   reason.rfind("not ", 0) != 0 &&
                                   reason.find("unknown image type") == std::string::npos;
      IRIS_FAIL("cannot decode image ", name_for_errors, ": ", format ? format : "image",
                " data is corrupt or truncated",
                about_this_file && !reason.empty() ? " (" + reason + ")" : std::string());
    }
  }
  IRIS_CHECK(w > 0 && h > 0, "cannot decode image ", name_for_errors, ": decoder returned size ", w,
             "x", h);
  if (is_pnm && decoded && pnm_maxval != 255) {
    uint8_t* samples = decoded.get();
    const size_t count = static_cast<size_t>(w) * h * want;
    for (size_t i = 0; i < count; ++i)
      samples[i] = pil_pnm_sample(samples[i], static_cast<uint32_t>(pnm_maxval), want == 1);
  }

  ImageRGB8 img;
  img.width = w;
  img.height = h;
  const size_t n = static_cast<size_t>(w) * h;
  img.pixels.resize(n * 3);
  const uint8_t* src = decoded ? decoded.get() : from16.data();
  uint8_t* dst = img.pixels.data();
  switch (want) {
    case 1:
      for (size_t i = 0; i < n; ++i) dst[3 * i] = dst[3 * i + 1] = dst[3 * i + 2] = src[i];
      break;
    case 2:
      for (size_t i = 0; i < n; ++i) dst[3 * i] = dst[3 * i + 1] = dst[3 * i + 2] = src[2 * i];
      break;
    case 3:
      std::memcpy(dst, src, n * 3);
      break;
    default:
      for (size_t i = 0; i < n; ++i)
        for (int c = 0; c < 3; ++c) dst[3 * i + c] = src[4 * i + c];
  }
  return img;
}

}  // namespace

ImageRGB8 load_image(const std::string& path, int64_t max_pixels) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  IRIS_CHECK(std::filesystem::exists(status), "image file not found: ", path,
             " (check the path; relative paths are resolved from the current directory)");
  IRIS_CHECK(!std::filesystem::is_directory(status), "cannot load image ", path,
             ": it is a directory, not an image file");
  const std::string bytes = read_text_file(path, "image", static_cast<size_t>(INT_MAX));
  return decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path,
                      max_pixels);
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
