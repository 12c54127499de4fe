// EXIF and XMP orientation, read as PIL reads them (Image.getexif, TiffImagePlugin's
// ImageFileDirectory_v2.load), and the transposes of ImageOps.exif_transpose. Every read is
// bounds-checked: the blocks come from files of unknown origin.
#include <webp/demux.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string_view>

#include "vision/image_formats.h"

namespace iris::image_detail {

namespace {

struct Bytes {
  const uint8_t* d;
  size_t n;
  bool little;

  bool has(uint64_t at, uint64_t len) const { return at <= n && len <= n - at; }
  uint16_t u16(size_t at) const {
    return little ? uint16_t(d[at] | d[at + 1] << 8) : uint16_t(d[at] << 8 | d[at + 1]);
  }
  uint32_t u32(size_t at) const {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t(d[at + (little ? i : 3 - i)]) << (8 * i);
    return v;
  }
  uint64_t u64(size_t at) const {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t(d[at + (little ? i : 7 - i)]) << (8 * i);
    return v;
  }
};

// Bytes per value of each TIFF field type PIL's IFD reader knows; 0 for the ones it skips.
int type_size(uint16_t type) {
  switch (type) {
    case 1:
    case 2:
    case 6:
    case 7:
      return 1;  // BYTE, ASCII, SBYTE, UNDEFINED
    case 3:
    case 8:
      return 2;  // SHORT, SSHORT
    case 4:
    case 9:
    case 11:
    case 13:
      return 4;  // LONG, SLONG, FLOAT, IFD
    case 5:
    case 10:
    case 12:
    case 16:
      return 8;  // RATIONAL, SRATIONAL, DOUBLE, LONG8
    default:
      return 0;
  }
}

struct Field {
  uint16_t type = 0;
  const uint8_t* data = nullptr;
  size_t size = 0;
};

struct Ifd0 {
  std::optional<Field> orientation, xmp;
};

constexpr uint16_t kOrientationTag = 0x0112, kXmpTag = 700;

// IFD0's Orientation and XMP fields as ImageFileDirectory_v2.load finds them: entries in order;
// one of an unknown type or no data is skipped; one whose data lies outside the block ends the
// walk (PIL's read raises, and the entries before it are kept); the next-IFD pointer is not
// needed.
Ifd0 read_ifd(const Bytes& b, uint64_t offset, bool big) {
  Ifd0 out;
  const size_t count_size = big ? 8 : 2, entry_size = big ? 20 : 12, inline_size = big ? 8 : 4;
  if (!b.has(offset, count_size)) return out;
  const uint64_t entries = big ? b.u64(offset) : b.u16(offset);
  uint64_t at = offset + count_size;
  for (uint64_t i = 0; i < entries; ++i, at += entry_size) {
    if (!b.has(at, entry_size)) break;
    const uint16_t tag = b.u16(at), type = b.u16(at + 2);
    const uint64_t count = big ? b.u64(at + 4) : b.u32(at + 4);
    const size_t value_at = at + (big ? 12 : 8);
    const int unit = type_size(type);
    if (unit == 0) continue;
    if (count > UINT64_MAX / 8) break;  // PIL's read of that many bytes fails
    const uint64_t size = count * unit;
    const uint8_t* data = b.d + value_at;
    if (size > inline_size) {
      const uint64_t where = big ? b.u64(value_at) : b.u32(value_at);
      if (big && where >= (uint64_t{1} << 63)) continue;  // PIL warns and skips this one
      if (!b.has(where, size)) break;
      data = b.d + where;
    }
    if (size == 0) continue;
    const Field f{type, data, static_cast<size_t>(size)};
    if (tag == kOrientationTag) out.orientation = f;
    if (tag == kXmpTag) out.xmp = f;
  }
  return out;
}

// The TIFF header PIL accepts (TiffImagePlugin.PREFIXES), its byte order and whether PIL takes it
// for BigTIFF (it tests the third byte only, so "MM\0+" reads as classic).
std::optional<Bytes> tiff_header(const uint8_t* d, size_t n, bool& big) {
  if (n < 8) return std::nullopt;
  static constexpr const char* kPrefixes[] = {"MM\x00\x2a", "II\x2a\x00", "MM\x2a\x00",
                                              "II\x00\x2a", "MM\x00\x2b", "II\x2b\x00"};
  bool ok = false;
  for (const char* p : kPrefixes) ok = ok || std::memcmp(d, p, 4) == 0;
  if (!ok) return std::nullopt;
  big = d[2] == 0x2b;
  return Bytes{d, n, d[0] == 'I'};
}

// The first value of an Orientation field as exif_transpose's dict lookup sees it: ints, and
// floats or fractions equal to an int, match 2..8; bytes and text never match.
int orientation_value(const Field& f, bool little) {
  const Bytes b{f.data, f.size, little};
  auto in_range = [](int64_t v) { return v >= 2 && v <= 8 ? static_cast<int>(v) : 1; };
  switch (f.type) {
    case 3:
      return in_range(b.u16(0));
    case 4:
    case 13:
      return in_range(b.u32(0));
    case 16:
      return b.u64(0) <= 8 ? in_range(static_cast<int64_t>(b.u64(0))) : 1;
    case 6:
      return in_range(static_cast<int8_t>(f.data[0]));
    case 8:
      return in_range(static_cast<int16_t>(b.u16(0)));
    case 9:
      return in_range(static_cast<int32_t>(b.u32(0)));
    case 5:
    case 10: {
      const bool is_signed = f.type == 10;
      const int64_t num = is_signed ? int64_t{static_cast<int32_t>(b.u32(0))} : int64_t{b.u32(0)};
      const int64_t den = is_signed ? int64_t{static_cast<int32_t>(b.u32(4))} : int64_t{b.u32(4)};
      if (den == 0 || num % den != 0) return 1;  // PIL: NaN, or not a whole number
      return in_range(num / den);
    }
    case 11:
    case 12: {
      double v;
      if (f.type == 11) {
        const uint32_t bits = b.u32(0);
        float x;
        std::memcpy(&x, &bits, 4);
        v = x;
      } else {
        const uint64_t bits = b.u64(0);
        std::memcpy(&v, &bits, 8);
      }
      if (!(v >= 2 && v <= 8) || v != std::floor(v)) return 1;
      return static_cast<int>(v);
    }
    default:
      return 1;
  }
}

// re.search(rb'tiff:Orientation(="|>)([0-9])', xmp), the digit's value; -1 without a match.
int xmp_orientation(const uint8_t* xmp, size_t size) {
  const std::string_view s(reinterpret_cast<const char*>(xmp), size);
  constexpr std::string_view kKey = "tiff:Orientation";
  for (size_t at = s.find(kKey); at != std::string_view::npos; at = s.find(kKey, at + 1)) {
    size_t p = at + kKey.size();
    if (p + 1 < s.size() && s[p] == '=' && s[p + 1] == '"')
      p += 2;
    else if (p < s.size() && s[p] == '>')
      p += 1;
    else
      continue;
    if (p < s.size() && s[p] >= '0' && s[p] <= '9') return s[p] - '0';
  }
  return -1;
}

int from_xmp(const uint8_t* xmp, size_t size) {
  const int v = xmp ? xmp_orientation(xmp, size) : -1;
  return v >= 2 && v <= 8 ? v : 1;
}

bool starts_with(const uint8_t* d, size_t n, std::string_view prefix) {
  return n >= prefix.size() && std::memcmp(d, prefix.data(), prefix.size()) == 0;
}

// JPEG: the segments before the first scan, walked as PIL's JpegImageFile._open walks them.
int jpeg_orientation(const uint8_t* d, size_t n) {
  std::string exif;
  bool have_exif = false;
  const uint8_t* xmp = nullptr;
  size_t xmp_size = 0;
  size_t pos = 2;  // after SOI
  while (pos < n) {
    if (d[pos] != 0xFF) break;  // PIL: "no marker found"
    while (pos < n && d[pos] == 0xFF) ++pos;
    if (pos >= n) break;
    const uint8_t m = d[pos++];
    if (m == 0xDA || m == 0xD9) break;  // start of scan, end of image
    if (m == 0x00 || m == 0x01 || (m >= 0xD0 && m <= 0xD8)) continue;  // no length field
    if (n - pos < 2) break;
    const size_t len = size_t(d[pos]) << 8 | d[pos + 1];
    if (len < 2 || len - 2 > n - pos - 2) break;  // PIL: a truncated read
    const uint8_t* s = d + pos + 2;
    const size_t sn = len - 2;
    if (m == 0xE1 && starts_with(s, sn, std::string_view("Exif\0\0", 6))) {
      // Later Exif segments continue the first (Pillow 10.2 and later).
      exif.append(reinterpret_cast<const char*>(s) + (have_exif ? 6 : 0), sn - (have_exif ? 6 : 0));
      have_exif = true;
    } else if (m == 0xE1 &&
               starts_with(s, sn, std::string_view("http://ns.adobe.com/xap/1.0/\0", 29))) {
      xmp = s + 29;
      xmp_size = sn - 29;
    }
    pos += len;
  }
  return exif_orientation(have_exif ? reinterpret_cast<const uint8_t*>(exif.data()) : nullptr,
                          exif.size(), xmp, xmp_size);
}

// PNG: the last eXIf chunk, wherever it is (PIL reads the chunks after the image data on load).
// XMP in an iTXt chunk and ImageMagick's "Raw profile type exif" text are not read.
int png_orientation(const uint8_t* d, size_t n) {
  const uint8_t* exif = nullptr;
  size_t exif_size = 0;
  size_t pos = 8;
  while (n - pos >= 12) {
    const size_t len =
        size_t(d[pos]) << 24 | size_t(d[pos + 1]) << 16 | size_t(d[pos + 2]) << 8 | d[pos + 3];
    const uint8_t* type = d + pos + 4;
    if (len > n - pos - 12) break;
    if (std::memcmp(type, "eXIf", 4) == 0) {
      exif = d + pos + 8;
      exif_size = len;
    }
    if (std::memcmp(type, "IEND", 4) == 0) break;
    pos += 12 + len;
  }
  if (exif == nullptr) return 1;
  return exif_orientation(exif, exif_size, nullptr, 0);
}

// WebP: the first EXIF and "XMP " chunks, through libwebp's demuxer as PIL finds them.
int webp_orientation(const uint8_t* d, size_t n) {
  const WebPData data{d, n};
  std::unique_ptr<WebPDemuxer, void (*)(WebPDemuxer*)> demux(WebPDemux(&data), &WebPDemuxDelete);
  if (!demux) return 1;
  WebPChunkIterator exif, xmp;
  const bool has_exif = WebPDemuxGetChunk(demux.get(), "EXIF", 1, &exif) != 0;
  const bool has_xmp = WebPDemuxGetChunk(demux.get(), "XMP ", 1, &xmp) != 0;
  // An empty chunk is absent for PIL (it tests the bytes' truth).
  const bool use_exif = has_exif && exif.chunk.size > 0, use_xmp = has_xmp && xmp.chunk.size > 0;
  const int o =
      exif_orientation(use_exif ? exif.chunk.bytes : nullptr, use_exif ? exif.chunk.size : 0,
                       use_xmp ? xmp.chunk.bytes : nullptr, use_xmp ? xmp.chunk.size : 0);
  if (has_exif) WebPDemuxReleaseChunkIterator(&exif);
  if (has_xmp) WebPDemuxReleaseChunkIterator(&xmp);
  return o;
}

// TIFF: the file's own first IFD, which PIL's getexif reads in place of an EXIF block.
int tiff_orientation(const uint8_t* d, size_t n) {
  bool big = false;
  const std::optional<Bytes> b = tiff_header(d, n, big);
  if (!b) return 1;
  uint64_t first = 0;
  if (big) {
    if (n < 16) return 1;
    first = b->u64(8);
  } else {
    first = b->u32(4);
  }
  const Ifd0 ifd = read_ifd(*b, first, big);
  if (ifd.orientation) return orientation_value(*ifd.orientation, b->little);
  // Tag 700 as PIL stores it in info["xmp"]: bytes for BYTE and UNDEFINED, text for ASCII.
  if (ifd.xmp && (ifd.xmp->type == 1 || ifd.xmp->type == 2 || ifd.xmp->type == 7))
    return from_xmp(ifd.xmp->data, ifd.xmp->size);
  return 1;
}

}  // namespace

int exif_orientation(const uint8_t* exif, size_t exif_size, const uint8_t* xmp, size_t xmp_size) {
  if (exif != nullptr) {
    while (starts_with(exif, exif_size, std::string_view("Exif\0\0", 6))) {
      exif += 6;
      exif_size -= 6;
    }
  }
  if (exif == nullptr || exif_size == 0) return from_xmp(xmp, xmp_size);
  bool big = false;
  const std::optional<Bytes> b = tiff_header(exif, exif_size, big);
  // PIL reads an 8-byte header only, so a BigTIFF one has no first-IFD offset for it.
  if (!b || big) return 1;
  const Ifd0 ifd = read_ifd(*b, b->u32(4), false);
  if (ifd.orientation) return orientation_value(*ifd.orientation, b->little);
  return from_xmp(xmp, xmp_size);
}

bool is_webp(const uint8_t* d, size_t n) {
  return n >= 12 && std::memcmp(d, "RIFF", 4) == 0 && std::memcmp(d + 8, "WEBP", 4) == 0;
}

bool is_tiff(const uint8_t* d, size_t n) {
  return n >= 4 && (std::memcmp(d, "II\x2a\x00", 4) == 0 || std::memcmp(d, "MM\x00\x2a", 4) == 0 ||
                    std::memcmp(d, "II\x2b\x00", 4) == 0 || std::memcmp(d, "MM\x00\x2b", 4) == 0);
}

int file_orientation(const uint8_t* d, size_t n) {
  if (n >= 2 && d[0] == 0xFF && d[1] == 0xD8) return jpeg_orientation(d, n);
  if (n >= 8 && std::memcmp(d, "\x89PNG\r\n\x1a\n", 8) == 0) return png_orientation(d, n);
  if (is_webp(d, n)) return webp_orientation(d, n);
  if (is_tiff(d, n)) return tiff_orientation(d, n);
  return 1;
}

ImageRGB8 apply_orientation(ImageRGB8 img, int orientation) {
  if (orientation < 2 || orientation > 8) return img;
  const size_t w = static_cast<size_t>(img.width), h = static_cast<size_t>(img.height);
  const bool swap = orientation >= 5;
  ImageRGB8 out;
  out.width = swap ? img.height : img.width;
  out.height = swap ? img.width : img.height;
  out.pixels.resize(img.pixels.size());
  const size_t ow = static_cast<size_t>(out.width), oh = static_cast<size_t>(out.height);
  for (size_t y = 0; y < oh; ++y) {
    uint8_t* dst = &out.pixels[y * ow * 3];
    for (size_t x = 0; x < ow; ++x, dst += 3) {
      size_t sx = x, sy = y;  // the source pixel of output pixel (x, y)
      switch (orientation) {
        case 2:
          sx = w - 1 - x;
          break;
        case 3:
          sx = w - 1 - x;
          sy = h - 1 - y;
          break;
        case 4:
          sy = h - 1 - y;
          break;
        case 5:
          sx = y;
          sy = x;
          break;
        case 6:
          sx = y;
          sy = h - 1 - x;
          break;
        case 7:
          sx = w - 1 - y;
          sy = h - 1 - x;
          break;
        case 8:
          sx = w - 1 - y;
          sy = x;
          break;
      }
      std::memcpy(dst, &img.pixels[(sy * w + sx) * 3], 3);
    }
  }
  return out;
}

}  // namespace iris::image_detail
