// Image files as transformers' load_image reads them: EXIF orientation (exif_transpose), JPEG
// (libjpeg-turbo), WebP (libwebp) and TIFF (libtiff), against files written here with the same
// libraries and against the HF golden of tools/make_image_format_golden.py
// (tests/data/image_formats).
#include <cstdio>  // jpeglib.h needs FILE and size_t declared before it

#include <jpeglib.h>
#include <stb_image_write.h>
#include <tiffio.h>
#include <webp/decode.h>
#include <webp/encode.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>

#include "core/error.h"
#include "test_util.h"
#include "vision/image.h"
#include "vision/image_formats.h"
#include "vision/preprocess.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using image_detail::exif_orientation;
using image_detail::file_orientation;
using test::error_of;
using test::scratch_dir;

ImageRGB8 pattern(int w, int h, uint32_t seed) {
  std::mt19937 rng(seed);
  ImageRGB8 img{w, h, std::vector<uint8_t>(size_t(w) * h * 3)};
  for (auto& p : img.pixels) p = uint8_t(rng() & 0xff);
  return img;
}

ImageRGB8 decode(const std::string& bytes, const std::string& name,
                 int64_t max_pixels = kDefaultMaxImagePixels) {
  return decode_image(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), name,
                      max_pixels);
}

const uint8_t* at(const ImageRGB8& img, int x, int y) {
  return &img.pixels[(size_t(y) * img.width + x) * 3];
}

// The turns of PIL's Image.transpose, built from two primitives (a mirror and a clockwise quarter
// turn) rather than from the decoder's per-pixel formulas.
ImageRGB8 mirror(const ImageRGB8& in) {
  ImageRGB8 out{in.width, in.height, std::vector<uint8_t>(in.pixels.size())};
  for (int y = 0; y < in.height; ++y)
    for (int x = 0; x < in.width; ++x)
      std::memcpy(&out.pixels[(size_t(y) * in.width + x) * 3], at(in, in.width - 1 - x, y), 3);
  return out;
}
ImageRGB8 quarter_cw(const ImageRGB8& in) {
  ImageRGB8 out{in.height, in.width, std::vector<uint8_t>(in.pixels.size())};
  for (int y = 0; y < out.height; ++y)
    for (int x = 0; x < out.width; ++x)
      std::memcpy(&out.pixels[(size_t(y) * out.width + x) * 3], at(in, y, in.height - 1 - x), 3);
  return out;
}
// What exif_transpose does to an image stored with orientation k.
ImageRGB8 upright_from(const ImageRGB8& stored, int k) {
  auto turns = [](ImageRGB8 img, int n) {
    for (int i = 0; i < n; ++i) img = quarter_cw(img);
    return img;
  };
  switch (k) {
    case 2:
      return mirror(stored);  // FLIP_LEFT_RIGHT
    case 3:
      return turns(stored, 2);  // ROTATE_180
    case 4:
      return turns(mirror(stored), 2);  // FLIP_TOP_BOTTOM
    case 5:
      return mirror(turns(stored, 1));  // TRANSPOSE
    case 6:
      return turns(stored, 1);  // ROTATE_270 (a quarter clockwise)
    case 7:
      return turns(mirror(stored), 1);  // TRANSVERSE
    case 8:
      return turns(stored, 3);  // ROTATE_90
    default:
      return stored;
  }
}

// ---------------------------------------------------------------------------------------------
// EXIF blocks

// A TIFF-structured EXIF block: header, then IFD0 at offset 8 with the given entries (tag, type,
// count, the 4 inline bytes or the offset), then `tail` (data that entries point into, from
// offset 8 + 2 + 12n + 4).
struct Entry {
  uint16_t tag, type;
  uint32_t count;
  std::vector<uint8_t> value;  // 4 bytes, in the block's byte order
};

std::string put16(uint16_t v, bool le) {
  return le ? std::string{char(v & 0xff), char(v >> 8)} : std::string{char(v >> 8), char(v & 0xff)};
}
std::string put32(uint32_t v, bool le) {
  std::string s;
  for (int i = 0; i < 4; ++i) s.push_back(char(v >> (8 * (le ? i : 3 - i))));
  return s;
}
std::vector<uint8_t> bytes_of(const std::string& s) {
  return {s.begin(), s.end()};
}

std::string exif_block(const std::vector<Entry>& entries, bool le = true,
                       const std::string& tail = "", const std::string& prefix = "") {
  std::string b = prefix + (le ? std::string("II\x2a\x00", 4) : std::string("MM\x00\x2a", 4));
  b += put32(8, le);
  b += put16(uint16_t(entries.size()), le);
  for (const Entry& e : entries) {
    b += put16(e.tag, le) + put16(e.type, le) + put32(e.count, le);
    b.append(e.value.begin(), e.value.end());
  }
  b += put32(0, le);  // no next IFD
  return b + tail;
}

int orient_of(const std::string& exif, const std::string& xmp = "") {
  return exif_orientation(reinterpret_cast<const uint8_t*>(exif.data()), exif.size(),
                          xmp.empty() ? nullptr : reinterpret_cast<const uint8_t*>(xmp.data()),
                          xmp.size());
}

Entry short_orientation(uint16_t v, bool le = true) {
  return {0x0112, 3, 1, bytes_of(put16(v, le) + std::string(2, '\0'))};
}

TEST(ExifOrientation, ShortInBothByteOrdersAndEveryValue) {
  for (const bool le : {true, false})
    for (int v = 0; v <= 10; ++v)
      EXPECT_EQ(orient_of(exif_block({short_orientation(uint16_t(v), le)}, le)),
                v >= 2 && v <= 8 ? v : 1)
          << "value " << v << (le ? " II" : " MM");
  EXPECT_EQ(orient_of(exif_block({short_orientation(0x0106)})), 1);  // not 6: all 16 bits count
  // "Exif\0\0" prefixes, as a JPEG APP1 or a WebP chunk may carry them, once or twice.
  const std::string exif_hdr("Exif\0\0", 6);
  EXPECT_EQ(orient_of(exif_block({short_orientation(6)}, true, "", exif_hdr)), 6);
  EXPECT_EQ(orient_of(exif_block({short_orientation(6)}, true, "", exif_hdr + exif_hdr)), 6);
}

// PIL compares the tag's first value, whatever its type, with the keys 2..8 of a dict: ints match,
// floats and fractions equal to an int match too, bytes and text never do.
TEST(ExifOrientation, TheValueIsReadAsPilReadsEachType) {
  auto entry = [](uint16_t type, uint32_t count, const std::string& value4) {
    return Entry{0x0112, type, count, bytes_of(value4)};
  };
  const bool le = true;
  EXPECT_EQ(orient_of(exif_block({entry(4, 1, put32(8, le))})), 8);                    // LONG
  EXPECT_EQ(orient_of(exif_block({entry(9, 1, put32(3, le))})), 3);                    // SLONG
  EXPECT_EQ(orient_of(exif_block({entry(8, 1, put16(uint16_t(-6), le) + "xx")})), 1);  // SSHORT -6
  EXPECT_EQ(orient_of(exif_block({entry(6, 1, std::string("\x05\0\0\0", 4))})), 5);    // SBYTE
  EXPECT_EQ(orient_of(exif_block({entry(1, 1, std::string("\x06\0\0\0", 4))})), 1);    // BYTE
  EXPECT_EQ(orient_of(exif_block({entry(7, 1, std::string("\x06\0\0\0", 4))})), 1);    // UNDEFINED
  EXPECT_EQ(orient_of(exif_block({entry(2, 2, std::string("6\0\0\0", 4))})), 1);       // ASCII "6"
  float f = 6.0f;
  uint32_t fb;
  std::memcpy(&fb, &f, 4);
  EXPECT_EQ(orient_of(exif_block({entry(11, 1, put32(fb, le))})), 6);  // FLOAT 6.0
  f = 6.5f;
  std::memcpy(&fb, &f, 4);
  EXPECT_EQ(orient_of(exif_block({entry(11, 1, put32(fb, le))})), 1);  // FLOAT 6.5
  // Out-of-line values: a RATIONAL 12/2 is 6, 13/2 and n/0 are no orientation; a DOUBLE 3.0.
  const size_t data_at = 8 + 2 + 12 + 4;
  auto rational = [&](uint16_t type, uint32_t num, uint32_t den) {
    return orient_of(exif_block({entry(type, 1, put32(uint32_t(data_at), le))}, le,
                                put32(num, le) + put32(den, le)));
  };
  EXPECT_EQ(rational(5, 12, 2), 6);
  EXPECT_EQ(rational(5, 13, 2), 1);
  EXPECT_EQ(rational(5, 6, 0), 1);
  EXPECT_EQ(rational(10, uint32_t(-8), uint32_t(-1)), 8);  // SRATIONAL -8/-1
  double d = 3.0;
  uint64_t db;
  std::memcpy(&db, &d, 8);
  EXPECT_EQ(orient_of(exif_block({entry(12, 1, put32(uint32_t(data_at), le))}, le,
                                 put32(uint32_t(db), le) + put32(uint32_t(db >> 32), le))),
            3);
  // Several values: the first counts.
  EXPECT_EQ(orient_of(exif_block({entry(3, 2, put16(7, le) + put16(2, le))})), 7);
}

TEST(ExifOrientation, EntriesAreWalkedAsPilWalksThem) {
  const Entry six = short_orientation(6), three = short_orientation(3);
  const Entry width{0x0100, 3, 1, bytes_of(put16(70, true) + "xx")};
  // The last of two Orientation entries wins.
  EXPECT_EQ(orient_of(exif_block({six, width, three})), 3);
  // An entry of an unknown type, or with no values, is skipped.
  EXPECT_EQ(orient_of(exif_block({six, {0x0112, 99, 1, bytes_of(put32(3, true))}})), 6);
  EXPECT_EQ(orient_of(exif_block({six, {0x0112, 3, 0, bytes_of(put32(3, true))}})), 6);
  // An entry whose data lies past the block ends the walk: the entries before it count, the
  // ones after it do not.
  const Entry out_of_block{0x010f, 2, 100, bytes_of(put32(5000, true))};
  EXPECT_EQ(orient_of(exif_block({six, out_of_block})), 6);
  EXPECT_EQ(orient_of(exif_block({out_of_block, six})), 1);
  // A count so large that count x size overflows ends it too.
  EXPECT_EQ(orient_of(exif_block({{0x010f, 12, 0xffffffffu, bytes_of(put32(30, true))}, six})), 1);
  // A truncated entry table keeps what was read.
  std::string cut = exif_block({six, three});
  cut.resize(8 + 2 + 12 + 5);
  EXPECT_EQ(orient_of(cut), 6);
}

TEST(ExifOrientation, XmpCountsOnlyWithoutTheTag) {
  const std::string attr = R"(<x:xmpmeta><rdf:Description tiff:Orientation="8"/></x:xmpmeta>)";
  const std::string elem = "<rdf:li/><tiff:Orientation>5</tiff:Orientation>";
  EXPECT_EQ(orient_of("", attr), 8);
  EXPECT_EQ(orient_of("", elem), 5);
  EXPECT_EQ(orient_of("", "tiff:Orientation='6' tiff:Orientation=\"x\" tiff:Orientation>2"), 2);
  EXPECT_EQ(orient_of("", "tiff:Orientation=\"9\""), 1);
  EXPECT_EQ(orient_of("", "tiff:Orientation=\""), 1);
  // EXIF without the tag, or with no IFD where its header says: XMP decides.
  EXPECT_EQ(orient_of(exif_block({{0x0100, 3, 1, bytes_of(put32(70, true))}}), attr), 8);
  std::string far = exif_block({});
  far.replace(4, 4, put32(1000, true));
  EXPECT_EQ(orient_of(far, attr), 8);
  // With the tag, even as 1, XMP is not read.
  EXPECT_EQ(orient_of(exif_block({short_orientation(1)}), attr), 1);
}

// A block PIL cannot read at all leaves the image as stored (and XMP unread).
TEST(ExifOrientation, UnreadableBlocksLeaveTheImageAsStored) {
  const std::string attr = R"(tiff:Orientation="6")";
  EXPECT_EQ(orient_of("not a TIFF header at all", attr), 1);
  EXPECT_EQ(orient_of(std::string("II\x2a\x00\x08", 5), attr), 1);  // under 8 bytes
  std::string big = exif_block({short_orientation(6)});
  big[2] = 0x2b;  // BigTIFF: PIL's 8-byte read has no room for its first-IFD offset
  EXPECT_EQ(orient_of(big, attr), 1);
  EXPECT_EQ(orient_of(std::string("Exif\0\0", 6), attr), 6);  // empty after the prefix: no EXIF
}

// Every truncation and 20,000 random corruptions of valid blocks: never a crash or a read out of
// bounds (the sanitizer build checks the latter), always an orientation in 1..8.
TEST(ExifOrientation, HostileBlocksNeverCrash) {
  const size_t data_at = 8 + 2 + 3 * 12 + 4;
  const std::string block =
      exif_block({short_orientation(6),
                  {0x010f, 2, 9, bytes_of(put32(uint32_t(data_at), true))},
                  {0x0112, 5, 1, bytes_of(put32(uint32_t(data_at + 9), true))}},
                 true, std::string("Camera\0\0\0", 9) + put32(16, true) + put32(2, true));
  EXPECT_EQ(orient_of(block), 8);
  for (size_t n = 0; n <= block.size(); ++n) {
    const int o = orient_of(block.substr(0, n));
    EXPECT_TRUE(o >= 1 && o <= 8) << n;
  }
  std::mt19937 rng(41);
  for (int i = 0; i < 20000; ++i) {
    std::string b = block;
    for (int k = 0, flips = 1 + int(rng() % 6); k < flips; ++k) b[rng() % b.size()] = char(rng());
    const int o = orient_of(b);
    ASSERT_TRUE(o >= 1 && o <= 8) << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Orientation through whole files

void append(void* ctx, void* data, int n) {
  static_cast<std::string*>(ctx)->append(static_cast<const char*>(data), size_t(n));
}

// `jpeg` with an APP1 segment of `payload` right after its SOI.
std::string with_app1(const std::string& jpeg, const std::string& payload) {
  const size_t len = payload.size() + 2;
  return jpeg.substr(0, 2) + "\xff\xe1" + char(len >> 8) + char(len & 0xff) + payload +
         jpeg.substr(2);
}

uint32_t crc32(const std::string& bytes) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : bytes) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return c ^ 0xffffffffu;
}

// `png` with an eXIf chunk of `exif` before IEND.
std::string with_exif_chunk(const std::string& png, const std::string& exif) {
  const size_t iend = png.rfind("IEND") - 4;
  std::string chunk = put32(uint32_t(exif.size()), false) + "eXIf" + exif;
  chunk += put32(crc32("eXIf" + exif), false);
  return png.substr(0, iend) + chunk + png.substr(iend);
}

TEST(ImageOrientation, AllEightOrientationsTurnJpegAndPngUpright) {
  const ImageRGB8 stored = pattern(23, 14, 3);  // odd sizes: an off-by-one shows
  std::string png, jpeg;
  ASSERT_NE(stbi_write_png_to_func(append, &png, stored.width, stored.height, 3,
                                   stored.pixels.data(), stored.width * 3),
            0);
  ASSERT_NE(stbi_write_jpg_to_func(append, &jpeg, stored.width, stored.height, 3,
                                   stored.pixels.data(), 95),
            0);
  const ImageRGB8 jpeg_stored = decode(jpeg, "plain.jpg");
  for (int k = 1; k <= 8; ++k) {
    SCOPED_TRACE("orientation " + std::to_string(k));
    const std::string exif = exif_block({short_orientation(uint16_t(k), k % 2 == 0)}, k % 2 == 0);
    const ImageRGB8 want = upright_from(stored, k);
    const ImageRGB8 from_png = decode(with_exif_chunk(png, exif), "turned.png");
    EXPECT_EQ(from_png.width, k >= 5 ? 14 : 23);
    EXPECT_EQ(from_png.height, k >= 5 ? 23 : 14);
    EXPECT_EQ(from_png.pixels, want.pixels);
    const ImageRGB8 from_jpeg =
        decode(with_app1(jpeg, std::string("Exif\0\0", 6) + exif), "turned.jpg");
    EXPECT_EQ(from_jpeg.width, want.width);
    EXPECT_EQ(from_jpeg.pixels, upright_from(jpeg_stored, k).pixels);
  }
  // XMP in its own APP1 counts where there is no EXIF.
  const std::string xmp = std::string("http://ns.adobe.com/xap/1.0/\0", 29) +
                          R"(<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>)";
  EXPECT_EQ(decode(with_app1(jpeg, xmp), "xmp.jpg").pixels, upright_from(jpeg_stored, 6).pixels);
  // A malformed EXIF block is ignored: the image as stored.
  EXPECT_EQ(decode(with_app1(jpeg, std::string("Exif\0\0garbage", 13)), "bad_exif.jpg").pixels,
            jpeg_stored.pixels);
}

// ---------------------------------------------------------------------------------------------
// WebP

std::string webp_lossless(const ImageRGB8& img) {
  uint8_t* out = nullptr;
  const size_t n =
      WebPEncodeLosslessRGB(img.pixels.data(), img.width, img.height, img.width * 3, &out);
  std::string s(reinterpret_cast<const char*>(out), n);
  WebPFree(out);
  return s;
}

std::string le32(uint32_t v) {
  return put32(v, true);
}

// A simple-format WebP rewrapped in the extended format with an EXIF chunk, as cameras and PIL
// write one: RIFF, VP8X (flags, canvas size - 1), the image's chunk, EXIF.
std::string webp_with_exif(const std::string& simple, int w, int h, const std::string& exif,
                           bool alpha = false) {
  const std::string image_chunk = simple.substr(12);
  std::string vp8x = "VP8X" + le32(10);
  vp8x += char(0x08 | (alpha ? 0x10 : 0));  // EXIF, alpha
  vp8x += std::string(3, '\0');
  for (const int v : {w - 1, h - 1})
    vp8x += std::string{char(v & 0xff), char(v >> 8 & 0xff), char(v >> 16)};
  std::string exif_chunk = "EXIF" + le32(uint32_t(exif.size())) + exif;
  if (exif.size() % 2) exif_chunk += '\0';
  const std::string body = "WEBP" + vp8x + image_chunk + exif_chunk;
  return "RIFF" + le32(uint32_t(body.size())) + body;
}

TEST(WebPImage, LosslessDecodesExactly) {
  const ImageRGB8 img = pattern(37, 21, 5);
  const ImageRGB8 back = decode(webp_lossless(img), "lossless.webp");
  EXPECT_EQ(back.width, 37);
  EXPECT_EQ(back.height, 21);
  EXPECT_EQ(back.pixels, img.pixels);
}

// A lossless RGBA WebP that keeps the colours of transparent pixels (libwebp's `exact`, as
// PIL's save(..., exact=True)); the simple encoder may replace them to compress better.
std::string webp_lossless_rgba_exact(const std::vector<uint8_t>& rgba, int w, int h) {
  WebPConfig config;
  WebPPicture pic;
  if (!WebPConfigInit(&config) || !WebPPictureInit(&pic)) return {};
  config.lossless = 1;
  config.exact = 1;
  pic.use_argb = 1;
  pic.width = w;
  pic.height = h;
  WebPMemoryWriter writer;
  WebPMemoryWriterInit(&writer);
  pic.writer = WebPMemoryWrite;
  pic.custom_ptr = &writer;
  const bool ok = WebPPictureImportRGBA(&pic, rgba.data(), w * 4) && WebPEncode(&config, &pic);
  std::string file = ok ? std::string(reinterpret_cast<const char*>(writer.mem), writer.size) : "";
  WebPPictureFree(&pic);
  WebPMemoryWriterClear(&writer);
  return file;
}

TEST(WebPImage, AlphaIsDroppedAndLossyMatchesLibwebp) {
  // load_image's convert("RGB") drops alpha: each pixel keeps its stored colour, also where alpha
  // is 0 (the first pixel of every row here, whose colours are random, not white).
  std::vector<uint8_t> rgba(16 * 9 * 4);
  std::mt19937 rng(9);
  for (auto& v : rgba) v = uint8_t(rng());
  for (int i = 0; i < 9; ++i) rgba[size_t(i) * 16 * 4 + 3] = 0;  // transparent, colour stored
  const std::string file = webp_lossless_rgba_exact(rgba, 16, 9);
  ASSERT_FALSE(file.empty());
  const ImageRGB8 img = decode(file, "alpha.webp");
  ASSERT_EQ(img.pixels.size(), size_t(16 * 9 * 3));
  int mismatches = 0, transparent_not_white = 0;
  for (int i = 0; i < 16 * 9; ++i)
    for (int c = 0; c < 3; ++c) {
      const uint8_t stored = rgba[size_t(i) * 4 + c];
      mismatches += img.pixels[size_t(i) * 3 + c] != stored;
      transparent_not_white += rgba[size_t(i) * 4 + 3] == 0 && stored != 255;
    }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GT(transparent_not_white, 0);  // so that compositing onto white could not pass

  // Lossy: the animation decoder PIL uses gives what libwebp's plain RGB decoder gives.
  const ImageRGB8 src = pattern(40, 30, 6);
  uint8_t* lossy = nullptr;
  const size_t ln = WebPEncodeRGB(src.pixels.data(), 40, 30, 40 * 3, 75.0f, &lossy);
  const std::string lossy_file(reinterpret_cast<const char*>(lossy), ln);
  WebPFree(lossy);
  int w = 0, h = 0;
  uint8_t* plain = WebPDecodeRGB(reinterpret_cast<const uint8_t*>(lossy_file.data()), ln, &w, &h);
  ASSERT_NE(plain, nullptr);
  const std::vector<uint8_t> want(plain, plain + size_t(w) * h * 3);
  WebPFree(plain);
  EXPECT_EQ(decode(lossy_file, "lossy.webp").pixels, want);
}

TEST(WebPImage, ExifChunkTurnsTheImage) {
  const ImageRGB8 stored = pattern(19, 11, 7);
  for (const int k : {3, 6, 8}) {
    const std::string file =
        webp_with_exif(webp_lossless(stored), 19, 11, exif_block({short_orientation(uint16_t(k))}));
    const ImageRGB8 img = decode(file, "turned.webp");
    EXPECT_EQ(img.pixels, upright_from(stored, k).pixels) << k;
    EXPECT_EQ(img.width, k == 3 ? 19 : 11) << k;
  }
}

TEST(WebPImage, HostileFilesAreRefusedNamingTheFile) {
  const std::string good = webp_lossless(pattern(30, 20, 8));
  for (size_t n : {size_t(12), size_t(20), size_t(30), good.size() / 2, good.size() - 1}) {
    const std::string msg = error_of([&] { decode(good.substr(0, n), "cut.webp"); });
    EXPECT_NE(msg.find("cut.webp"), std::string::npos) << n << ": " << msg;
    EXPECT_NE(msg.find("WebP"), std::string::npos) << n << ": " << msg;
  }
  // A lossless bitstream whose header claims 16384 x 16384 (the most WebP allows, 1.5x PIL's
  // limit) with a few bytes of data: refused from the header; under a limit it fits, the missing
  // data is the error.
  auto vp8l = [](uint32_t w, uint32_t h) {
    const uint32_t bits = (w - 1) | (h - 1) << 14;
    std::string chunk = std::string("\x2f", 1) + le32(bits) + std::string(16, '\0');
    const std::string body = "WEBP" + std::string("VP8L") + le32(uint32_t(chunk.size())) + chunk;
    return "RIFF" + le32(uint32_t(body.size())) + body;
  };
  std::string msg = error_of([&] { decode(vp8l(16384, 16384), "bomb.webp"); });
  EXPECT_NE(msg.find("bomb.webp is 16384x16384 = 268435456 pixels, more than the limit of " +
                     std::to_string(kDefaultMaxImagePixels)),
            std::string::npos)
      << msg;
  msg = error_of([&] { decode(vp8l(1000, 800), "hollow.webp"); });
  EXPECT_NE(msg.find("cannot decode image hollow.webp: WebP data is corrupt or truncated"),
            std::string::npos)
      << msg;
  // A VP8X canvas larger than the still image inside it is refused by libwebp.
  msg = error_of([&] { decode(webp_with_exif(good, 5000, 5000, exif_block({})), "canvas.webp"); });
  EXPECT_NE(msg.find("canvas.webp: its WebP header is corrupt"), std::string::npos) << msg;
  // Every truncation, and random corruption: an error or an image, never a crash.
  std::mt19937 rng(4);
  for (int i = 0; i < 300; ++i) {
    std::string b = good;
    b[12 + rng() % (b.size() - 12)] = char(rng());
    try {
      check_image(decode(b, "fuzzed.webp", 1 << 20), "fuzzed");
    } catch (const Error&) {
    }
  }
}

// ---------------------------------------------------------------------------------------------
// TIFF

struct TiffSpec {
  int width = 0, height = 0;
  uint16_t photometric = PHOTOMETRIC_RGB, spp = 3, bps = 8;
  uint16_t planar = PLANARCONFIG_CONTIG, compression = COMPRESSION_NONE, predictor = 0;
  std::vector<uint16_t> extras;
  uint16_t format = SAMPLEFORMAT_UINT;
  uint32_t rows_per_strip = 3;
  uint32_t tile = 0;  // tile width and length; 0: strips
  uint16_t orientation = 0;
  std::vector<uint16_t> colormap;  // 3 * 2^bps entries: reds, greens, blues
};

// Writes `samples` (chunky, one integer per sample, row-major) with libtiff; returns the file.
std::string write_tiff(const TiffSpec& s, const std::vector<uint32_t>& samples) {
  static int counter = 0;
  const fs::path path = scratch_dir() / ("t" + std::to_string(counter++) + ".tif");
  TIFF* t = TIFFOpen(path.c_str(), "w");
  EXPECT_NE(t, nullptr);
  TIFFSetField(t, TIFFTAG_IMAGEWIDTH, uint32_t(s.width));
  TIFFSetField(t, TIFFTAG_IMAGELENGTH, uint32_t(s.height));
  TIFFSetField(t, TIFFTAG_SAMPLESPERPIXEL, s.spp);
  TIFFSetField(t, TIFFTAG_BITSPERSAMPLE, s.bps);
  TIFFSetField(t, TIFFTAG_PHOTOMETRIC, s.photometric);
  TIFFSetField(t, TIFFTAG_PLANARCONFIG, s.planar);
  TIFFSetField(t, TIFFTAG_COMPRESSION, s.compression);
  TIFFSetField(t, TIFFTAG_SAMPLEFORMAT, s.format);
  if (s.predictor) TIFFSetField(t, TIFFTAG_PREDICTOR, s.predictor);
  if (!s.extras.empty())
    TIFFSetField(t, TIFFTAG_EXTRASAMPLES, uint16_t(s.extras.size()), s.extras.data());
  if (s.orientation) TIFFSetField(t, TIFFTAG_ORIENTATION, s.orientation);
  if (!s.colormap.empty()) {
    const size_t n = s.colormap.size() / 3;
    TIFFSetField(t, TIFFTAG_COLORMAP, s.colormap.data(), s.colormap.data() + n,
                 s.colormap.data() + 2 * n);
  }
  const bool separate = s.planar == PLANARCONFIG_SEPARATE;
  const int planes = separate ? s.spp : 1, per_px = separate ? 1 : s.spp;
  // One plane's rows packed at bps bits (MSB first), 16-bit samples in host order (libtiff swaps).
  auto pack_rows = [&](int plane, int x0, int y0, int w, int h, int row_stride_px) {
    const size_t row_bytes = (size_t(row_stride_px) * per_px * s.bps + 7) / 8;
    std::vector<uint8_t> buf(row_bytes * h, 0);
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w && x0 + x < s.width; ++x)
        for (int c = 0; c < per_px; ++c) {
          if (y0 + y >= s.height) continue;
          const uint32_t v =
              samples[(size_t(y0 + y) * s.width + x0 + x) * s.spp + (separate ? plane : c)];
          const size_t i = size_t(x) * per_px + c;
          uint8_t* row = &buf[size_t(y) * row_bytes];
          if (s.bps == 32) {
            std::memcpy(row + 4 * i, &v, 4);
          } else if (s.bps == 16) {
            const uint16_t v16 = uint16_t(v);
            std::memcpy(row + 2 * i, &v16, 2);
          } else if (s.bps == 8) {
            row[i] = uint8_t(v);
          } else {
            const size_t bit = i * s.bps;
            row[bit / 8] |= uint8_t(v << (8 - s.bps - bit % 8));
          }
        }
    return buf;
  };
  if (s.tile) {
    TIFFSetField(t, TIFFTAG_TILEWIDTH, s.tile);
    TIFFSetField(t, TIFFTAG_TILELENGTH, s.tile);
    for (int p = 0; p < planes; ++p)
      for (int y = 0; y < s.height; y += int(s.tile))
        for (int x = 0; x < s.width; x += int(s.tile)) {
          std::vector<uint8_t> tile = pack_rows(p, x, y, int(s.tile), int(s.tile), int(s.tile));
          EXPECT_GE(TIFFWriteTile(t, tile.data(), uint32_t(x), uint32_t(y), 0, uint16_t(p)), 0);
        }
  } else {
    TIFFSetField(t, TIFFTAG_ROWSPERSTRIP, s.rows_per_strip);
    for (int p = 0; p < planes; ++p)
      for (int y = 0; y < s.height; ++y) {
        std::vector<uint8_t> row = pack_rows(p, 0, y, s.width, 1, s.width);
        EXPECT_EQ(TIFFWriteScanline(t, row.data(), uint32_t(y), uint16_t(p)), 1);
      }
  }
  TIFFClose(t);
  return read_text_file(path.string());
}

std::vector<uint32_t> random_samples(const TiffSpec& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> v(size_t(s.width) * s.height * s.spp);
  for (auto& x : v) x = rng() & ((1u << s.bps) - 1);
  return v;
}

// The expected RGB of each pixel from its samples.
ImageRGB8 expect_rgb(const TiffSpec& s, const std::vector<uint32_t>& samples,
                     const std::function<std::array<int, 3>(const uint32_t*)>& f) {
  ImageRGB8 img{s.width, s.height, {}};
  for (size_t i = 0; i < size_t(s.width) * s.height; ++i) {
    const auto rgb = f(&samples[i * s.spp]);
    img.pixels.insert(img.pixels.end(), {uint8_t(rgb[0]), uint8_t(rgb[1]), uint8_t(rgb[2])});
  }
  return img;
}

TEST(TiffImage, RgbInEveryStorageLayoutDecodesExactly) {
  TiffSpec base;
  base.width = 37;
  base.height = 21;
  const std::vector<uint32_t> px = random_samples(base, 1);
  const ImageRGB8 want = expect_rgb(base, px, [](const uint32_t* p) {
    return std::array<int, 3>{int(p[0]), int(p[1]), int(p[2])};
  });
  struct Case {
    const char* name;
    std::function<void(TiffSpec&)> set;
  };
  for (const Case& c : std::vector<Case>{
           {"strips", [](TiffSpec&) {}},
           {"one strip", [](TiffSpec& s) { s.rows_per_strip = 1000; }},
           {"LZW + predictor",
            [](TiffSpec& s) { s.compression = COMPRESSION_LZW, s.predictor = 2; }},
           {"Deflate", [](TiffSpec& s) { s.compression = COMPRESSION_ADOBE_DEFLATE; }},
           {"PackBits", [](TiffSpec& s) { s.compression = COMPRESSION_PACKBITS; }},
           {"planar", [](TiffSpec& s) { s.planar = PLANARCONFIG_SEPARATE; }},
           {"tiles", [](TiffSpec& s) { s.tile = 16; }},
           {"planar tiles", [](TiffSpec& s) { s.tile = 16, s.planar = PLANARCONFIG_SEPARATE; }},
       }) {
    SCOPED_TRACE(c.name);
    TiffSpec s = base;
    c.set(s);
    const ImageRGB8 img = decode(write_tiff(s, px), "rgb.tif");
    EXPECT_EQ(img.width, 37);
    EXPECT_EQ(img.height, 21);
    EXPECT_EQ(img.pixels, want.pixels);
  }
  // 16 bits: the high byte, as PIL's RGB;16 unpackers keep it.
  TiffSpec s16 = base;
  s16.bps = 16;
  const std::vector<uint32_t> px16 = random_samples(s16, 2);
  EXPECT_EQ(decode(write_tiff(s16, px16), "rgb16.tif").pixels,
            expect_rgb(s16, px16, [](const uint32_t* p) {
              return std::array<int, 3>{int(p[0] >> 8), int(p[1] >> 8), int(p[2] >> 8)};
            }).pixels);
}

TEST(TiffImage, AlphaAndExtraSamplesAsPilReadsThem) {
  TiffSpec s;
  s.width = 16;
  s.height = 16;
  s.spp = 4;
  std::vector<uint32_t> px = random_samples(s, 3);
  for (int a = 0; a < 256; ++a) px[size_t(a) * 4 + 3] = uint32_t(a);  // every alpha once
  // Alpha is dropped (load_image's convert("RGB")): unassociated alpha leaves the stored colours,
  // also at alpha 0, where compositing onto white would give 255.
  s.extras = {EXTRASAMPLE_UNASSALPHA};
  const ImageRGB8 stored = expect_rgb(s, px, [](const uint32_t* p) {
    return std::array<int, 3>{int(p[0]), int(p[1]), int(p[2])};
  });
  EXPECT_EQ(decode(write_tiff(s, px), "rgba.tif").pixels, stored.pixels);
  // Premultiplied samples must not exceed alpha for the file to make sense; PIL clips anyway.
  s.extras = {EXTRASAMPLE_ASSOCALPHA};
  const ImageRGB8 unpremultiplied = expect_rgb(s, px, [](const uint32_t* p) {
    std::array<int, 3> out{};
    const int a = int(p[3]);
    for (int c = 0; c < 3; ++c)  // Unpack.c's unpackRGBa; then alpha is dropped
      out[size_t(c)] = a == 0 ? 0 : a == 255 ? int(p[c]) : std::min(int(p[c]) * 255 / a, 255);
    return out;
  });
  EXPECT_EQ(decode(write_tiff(s, px), "rgba_premultiplied.tif").pixels, unpremultiplied.pixels);
  s.extras = {EXTRASAMPLE_UNSPECIFIED};
  EXPECT_EQ(decode(write_tiff(s, px), "rgbx.tif").pixels,
            expect_rgb(s, px, [](const uint32_t* p) {
              return std::array<int, 3>{int(p[0]), int(p[1]), int(p[2])};
            }).pixels);
  // Grey + alpha.
  TiffSpec la = s;
  la.photometric = PHOTOMETRIC_MINISBLACK;
  la.spp = 2;
  la.extras = {EXTRASAMPLE_UNASSALPHA};
  std::vector<uint32_t> lpx = random_samples(la, 4);
  for (size_t i = 0; i < 8; ++i) lpx[i * 2 + 1] = 0;  // transparent, grey stored
  EXPECT_EQ(decode(write_tiff(la, lpx), "la.tif").pixels,
            expect_rgb(la, lpx, [](const uint32_t* p) {
              const int v = int(p[0]);
              return std::array<int, 3>{v, v, v};
            }).pixels);
}

TEST(TiffImage, GreyPaletteAndCmykAsPilConvertsThem) {
  for (const uint16_t bps : {1, 2, 4, 8, 16})
    for (const uint16_t photometric : {PHOTOMETRIC_MINISBLACK, PHOTOMETRIC_MINISWHITE}) {
      if (bps == 16 && photometric == PHOTOMETRIC_MINISWHITE) continue;
      SCOPED_TRACE(std::to_string(bps) + " bits, photometric " + std::to_string(photometric));
      TiffSpec s;
      s.width = 29;  // rows end inside a byte at 1, 2 and 4 bits
      s.height = 7;
      s.spp = 1;
      s.bps = bps;
      s.photometric = photometric;
      const std::vector<uint32_t> px = random_samples(s, 5 + bps);
      const ImageRGB8 img = decode(write_tiff(s, px), "grey.tif");
      EXPECT_EQ(img.pixels, expect_rgb(s, px, [&](const uint32_t* p) {
                              int v = bps == 16 ? std::min<int>(int(p[0]), 255)
                                                : int(p[0]) * 255 / ((1 << bps) - 1);
                              if (photometric == PHOTOMETRIC_MINISWHITE) v = 255 - v;
                              return std::array<int, 3>{v, v, v};
                            }).pixels);
    }
  // A 4-bit palette: the colormap's high bytes.
  TiffSpec pal;
  pal.width = 13;
  pal.height = 5;
  pal.spp = 1;
  pal.bps = 4;
  pal.photometric = PHOTOMETRIC_PALETTE;
  for (int c = 0; c < 3; ++c)
    for (int i = 0; i < 16; ++i) pal.colormap.push_back(uint16_t((i * 4001 + c * 12345) & 0xffff));
  const std::vector<uint32_t> ppx = random_samples(pal, 6);
  EXPECT_EQ(decode(write_tiff(pal, ppx), "palette.tif").pixels,
            expect_rgb(pal, ppx, [&](const uint32_t* p) {
              std::array<int, 3> out{};
              for (int c = 0; c < 3; ++c) out[size_t(c)] = pal.colormap[size_t(c) * 16 + p[0]] >> 8;
              return out;
            }).pixels);
  // CMYK through PIL's cmyk2rgb: 255 - k - c (255 - k) / 255, rounded as Convert.c rounds.
  TiffSpec cmyk;
  cmyk.width = 16;
  cmyk.height = 16;
  cmyk.spp = 4;
  cmyk.photometric = PHOTOMETRIC_SEPARATED;
  const std::vector<uint32_t> cpx = random_samples(cmyk, 7);
  EXPECT_EQ(decode(write_tiff(cmyk, cpx), "cmyk.tif").pixels,
            expect_rgb(cmyk, cpx, [](const uint32_t* p) {
              std::array<int, 3> out{};
              const int nk = 255 - int(p[3]);
              for (int c = 0; c < 3; ++c)
                out[size_t(c)] = nk - int(std::lround(int(p[c]) * nk / 255.0));
              return out;
            }).pixels);
}

// YCbCr in JPEG compression, as scanners write it: libjpeg gives RGB back.
TEST(TiffImage, JpegYCbCrDecodesToRgb) {
  const int w = 48, h = 32;
  ImageRGB8 smooth{w, h, {}};
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      smooth.pixels.insert(smooth.pixels.end(), {uint8_t(x * 5), uint8_t(y * 7), uint8_t(128)});
  const fs::path path = scratch_dir() / "ycbcr.tif";
  TIFF* t = TIFFOpen(path.c_str(), "w");
  ASSERT_NE(t, nullptr);
  TIFFSetField(t, TIFFTAG_IMAGEWIDTH, uint32_t(w));
  TIFFSetField(t, TIFFTAG_IMAGELENGTH, uint32_t(h));
  TIFFSetField(t, TIFFTAG_SAMPLESPERPIXEL, 3);
  TIFFSetField(t, TIFFTAG_BITSPERSAMPLE, 8);
  TIFFSetField(t, TIFFTAG_COMPRESSION, COMPRESSION_JPEG);
  TIFFSetField(t, TIFFTAG_PHOTOMETRIC, PHOTOMETRIC_YCBCR);
  TIFFSetField(t, TIFFTAG_JPEGCOLORMODE, JPEGCOLORMODE_RGB);  // libtiff converts from RGB
  TIFFSetField(t, TIFFTAG_JPEGQUALITY, 95);
  TIFFSetField(t, TIFFTAG_ROWSPERSTRIP, 16u);
  for (int y = 0; y < h; ++y)
    ASSERT_EQ(TIFFWriteScanline(t, &smooth.pixels[size_t(y) * w * 3], uint32_t(y), 0), 1);
  TIFFClose(t);
  const ImageRGB8 img = load_image(path.string());
  ASSERT_EQ(img.width, w);
  ASSERT_EQ(img.height, h);
  double sum = 0;
  for (size_t i = 0; i < img.pixels.size(); ++i)
    sum += std::abs(int(img.pixels[i]) - int(smooth.pixels[i]));
  EXPECT_LT(sum / img.pixels.size(), 3.0);
}

TEST(TiffImage, OrientationTagTurnsTheImage) {
  TiffSpec s;
  s.width = 11;
  s.height = 6;
  const std::vector<uint32_t> px = random_samples(s, 8);
  const ImageRGB8 stored = decode(write_tiff(s, px), "stored.tif");
  for (const uint16_t k : {2, 5, 6, 7}) {
    s.orientation = k;
    EXPECT_EQ(decode(write_tiff(s, px), "turned.tif").pixels, upright_from(stored, k).pixels) << k;
  }
}

TEST(TiffImage, UnsupportedAndHostileFilesAreRefusedNamingTheFile) {
  TiffSpec f;
  f.width = 4;
  f.height = 4;
  f.spp = 1;
  f.bps = 32;
  f.photometric = PHOTOMETRIC_MINISBLACK;
  f.format = SAMPLEFORMAT_IEEEFP;
  std::string msg =
      error_of([&] { decode(write_tiff(f, std::vector<uint32_t>(16, 0)), "float.tif"); });
  EXPECT_NE(msg.find("float.tif: TIFF with photometric interpretation 1, 1 samples per pixel of 32 "
                     "bits, sample format 3"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("convert it to PNG"), std::string::npos) << msg;

  TiffSpec s;
  s.width = 30;
  s.height = 20;
  s.compression = COMPRESSION_LZW;
  const std::string good = write_tiff(s, random_samples(s, 9));
  for (size_t n : {size_t(4), size_t(8), size_t(16), good.size() / 2, good.size() - 1}) {
    msg = error_of([&] { decode(good.substr(0, n), "cut.tif"); });
    EXPECT_NE(msg.find("cut.tif"), std::string::npos) << n << ": " << msg;
    EXPECT_NE(msg.find("TIFF"), std::string::npos) << n << ": " << msg;
  }
  // A header claiming 100000 x 100000 pixels: refused before any strip is read.
  {
    const fs::path path = scratch_dir() / "huge.tif";
    TIFF* t = TIFFOpen(path.c_str(), "w");
    ASSERT_NE(t, nullptr);
    TIFFSetField(t, TIFFTAG_IMAGEWIDTH, 100000u);
    TIFFSetField(t, TIFFTAG_IMAGELENGTH, 100000u);
    TIFFSetField(t, TIFFTAG_BITSPERSAMPLE, 8);
    TIFFSetField(t, TIFFTAG_SAMPLESPERPIXEL, 1);
    TIFFSetField(t, TIFFTAG_PHOTOMETRIC, PHOTOMETRIC_MINISBLACK);
    TIFFSetField(t, TIFFTAG_ROWSPERSTRIP, 1u);
    TIFFSetField(t, TIFFTAG_COMPRESSION, COMPRESSION_ADOBE_DEFLATE);
    std::vector<uint8_t> row(100000, 0);
    ASSERT_EQ(TIFFWriteScanline(t, row.data(), 0, 0), 1);  // one row of the 100000 it claims
    TIFFClose(t);
    msg = error_of([&] { load_image(path.string()); });
    EXPECT_NE(
        msg.find(path.string() + " is 100000x100000 = 10000000000 pixels, more than the limit"),
        std::string::npos)
        << msg;
  }
  // Random corruption of a valid file: an error or an image, never a crash.
  std::mt19937 rng(5);
  for (int i = 0; i < 300; ++i) {
    std::string b = good;
    for (int k = 0; k < 3; ++k) b[8 + rng() % (b.size() - 8)] = char(rng());
    try {
      check_image(decode(b, "fuzzed.tif", 1 << 20), "fuzzed");
    } catch (const Error&) {
    }
  }
}

// A JPEG written by libjpeg from `px` (`in` describes its samples) and stored in `stored`, which
// for CMYK input is CMYK or YCCK, both with the Adobe marker libjpeg writes for them.
std::string write_jpeg(const std::vector<uint8_t>& px, int w, int h, J_COLOR_SPACE in,
                       J_COLOR_SPACE stored) {
  jpeg_compress_struct c;
  jpeg_error_mgr err;
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buf, &size);
  c.image_width = JDIMENSION(w);
  c.image_height = JDIMENSION(h);
  c.in_color_space = in;
  c.input_components = in == JCS_GRAYSCALE ? 1 : in == JCS_RGB ? 3 : 4;
  jpeg_set_defaults(&c);
  jpeg_set_colorspace(&c, stored);
  jpeg_set_quality(&c, 90, TRUE);
  jpeg_start_compress(&c, TRUE);
  const size_t row_bytes = size_t(w) * size_t(c.input_components);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(px.data()) + c.next_scanline * row_bytes;
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  jpeg_destroy_compress(&c);
  std::string file(reinterpret_cast<const char*>(buf), size);
  free(buf);
  return file;
}

// The samples libjpeg decodes from `file` into `out` with its default settings, which are PIL's.
std::vector<uint8_t> libjpeg_samples(const std::string& file, J_COLOR_SPACE out) {
  jpeg_decompress_struct d;
  jpeg_error_mgr err;
  d.err = jpeg_std_error(&err);
  jpeg_create_decompress(&d);
  jpeg_mem_src(&d, reinterpret_cast<const unsigned char*>(file.data()), file.size());
  jpeg_read_header(&d, TRUE);
  d.out_color_space = out;
  jpeg_start_decompress(&d);
  const size_t row_bytes = size_t(d.output_width) * size_t(d.output_components);
  std::vector<uint8_t> samples(row_bytes * d.output_height);
  while (d.output_scanline < d.output_height) {
    JSAMPROW row = samples.data() + d.output_scanline * row_bytes;
    jpeg_read_scanlines(&d, &row, 1);
  }
  jpeg_finish_decompress(&d);
  jpeg_destroy_decompress(&d);
  return samples;
}

TEST(JpegImage, GreyAndRgbAreLibjpegsPixels) {
  // libjpeg's defaults are PIL's (the golden test checks the pixels against PIL's); a decoder
  // with other settings (the fast IDCT, plain upsampling, stb's) differs here in many samples.
  const ImageRGB8 img = pattern(37, 21, 11);
  const std::string rgb = write_jpeg(img.pixels, 37, 21, JCS_RGB, JCS_YCbCr);
  const ImageRGB8 got = decode(rgb, "rgb.jpg");
  EXPECT_EQ(got.width, 37);
  EXPECT_EQ(got.height, 21);
  EXPECT_EQ(got.pixels, libjpeg_samples(rgb, JCS_RGB));

  std::vector<uint8_t> grey(37 * 21);
  for (size_t i = 0; i < grey.size(); ++i) grey[i] = img.pixels[3 * i];
  const std::string grey_file = write_jpeg(grey, 37, 21, JCS_GRAYSCALE, JCS_GRAYSCALE);
  const std::vector<uint8_t> want = libjpeg_samples(grey_file, JCS_GRAYSCALE);
  std::vector<uint8_t> want_rgb;
  for (uint8_t v : want) want_rgb.insert(want_rgb.end(), {v, v, v});
  EXPECT_EQ(decode(grey_file, "grey.jpg").pixels, want_rgb);
}

TEST(JpegImage, CmykAndYcckAreReadInvertedAsPilReadsThem) {
  // PIL opens every 4-component JPEG with the rawmode "CMYK;I" (Adobe's inverted samples), then
  // convert("RGB") applies cmyk2rgb: 255 - k - c (255 - k) / 255, rounded.
  std::vector<uint8_t> cmyk(16 * 16 * 4);
  std::mt19937 rng(12);
  for (auto& v : cmyk) v = uint8_t(rng());
  for (const J_COLOR_SPACE stored : {JCS_CMYK, JCS_YCCK}) {
    SCOPED_TRACE(stored == JCS_CMYK ? "CMYK" : "YCCK");
    const std::string file = write_jpeg(cmyk, 16, 16, JCS_CMYK, stored);
    const std::vector<uint8_t> s = libjpeg_samples(file, JCS_CMYK);
    std::vector<uint8_t> want;
    for (size_t i = 0; i < 16 * 16; ++i) {
      const int nk = s[4 * i + 3];  // 255 - k, k being the inverted sample
      for (int c = 0; c < 3; ++c)
        want.push_back(uint8_t(nk - int(std::lround((255 - s[4 * i + c]) * nk / 255.0))));
    }
    EXPECT_EQ(decode(file, "cmyk.jpg").pixels, want);
  }
}

TEST(JpegImage, TruncatedCorruptAndForeignFiles) {
  const std::string good = write_jpeg(pattern(40, 32, 13).pixels, 40, 32, JCS_RGB, JCS_YCbCr);
  // Cut anywhere, even just before the end marker: PIL's decoder waits for more data and load()
  // refuses the file as truncated, where libjpeg alone would pad it and decode the rest grey.
  for (size_t n : {size_t(3), size_t(100), good.size() / 2, good.size() - 2}) {
    const std::string msg = error_of([&] { decode(good.substr(0, n), "cut.jpg"); });
    EXPECT_NE(msg.find("cut.jpg"), std::string::npos) << n << ": " << msg;
    EXPECT_NE(msg.find("JPEG"), std::string::npos) << n << ": " << msg;
  }
  // Fill bytes before the start marker: stb took such a file for a JPEG, PIL does not.
  const std::string msg = error_of([&] { decode("\xff" + good, "filled.jpg"); });
  EXPECT_NE(msg.find("filled.jpg: unknown image type"), std::string::npos) << msg;
  // Bytes after the end marker are never read.
  EXPECT_EQ(decode(good + "trailing", "trailing.jpg").pixels, decode(good, "good.jpg").pixels);
  // Random corruption of a valid file: an error or an image, never a crash.
  std::mt19937 rng(14);
  for (int i = 0; i < 300; ++i) {
    std::string b = good;
    for (int k = 0; k < 3; ++k) b[3 + rng() % (b.size() - 3)] = char(rng());
    try {
      check_image(decode(b, "fuzzed.jpg", 1 << 20), "fuzzed");
    } catch (const Error&) {
    }
  }
}

TEST(ImageFormats, UnknownAndEmptyFilesListTheFormats) {
  std::string msg = error_of([] { decode("not an image at all", "mystery.bin"); });
  EXPECT_NE(msg.find("mystery.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("PNG, JPEG, WebP, TIFF, BMP, GIF, TGA, PNM"), std::string::npos) << msg;
  msg = error_of([] { decode_image(reinterpret_cast<const uint8_t*>(""), 0, "empty.webp"); });
  EXPECT_NE(msg.find("empty.webp: it is empty (0 bytes); expected PNG, JPEG, WebP, TIFF"),
            std::string::npos)
      << msg;
}

// ---------------------------------------------------------------------------------------------
// HF golden (tools/make_image_format_golden.py, transformers' load_image and image processor)

class ImageFormatsGolden : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::data_dir() + "/image_formats";
    if (!fs::exists(dir_ + "/golden.json"))
      GTEST_SKIP() << dir_ << "/golden.json is missing: run python3 "
                   << "tools/make_image_format_golden.py --out tests/data/image_formats where "
                      "transformers is installed";
    golden_ = std::make_unique<test::Golden>(dir_);
    ASSERT_EQ(golden_->json()["source"], "transformers.image_utils.load_image")
        << "the golden was not made with transformers";
  }
  ImageRGB8 expected(const std::string& key) const {
    const HostTensor t = golden_->tensor(key);
    EXPECT_EQ(t.dims().size(), 3u);
    ImageRGB8 img{int(t.dim(1)), int(t.dim(0)), {}};
    const int32_t* p = t.data<int32_t>();
    for (int64_t i = 0; i < t.numel(); ++i) img.pixels.push_back(uint8_t(p[i]));
    return img;
  }
  std::string dir_;
  std::unique_ptr<test::Golden> golden_;
};

TEST_F(ImageFormatsGolden, DecodedPixelsEqualHF) {
  const nlohmann::json& files = golden_->json()["files"];
  ASSERT_GE(files.size(), 20u);
  const int up_w = golden_->json()["upright"][0], up_h = golden_->json()["upright"][1];
  for (const auto& [stem, f] : files.items()) {
    SCOPED_TRACE(stem);
    const ImageRGB8 got = load_image(dir_ + "/" + f["file"].get<std::string>());
    // Every file holds the upright image, stored turned where it has an orientation.
    EXPECT_EQ(got.width, up_w);
    EXPECT_EQ(got.height, up_h);
    // load_image's pixels, which are what HF's processor is given (alpha dropped).
    const ImageRGB8 want = expected(stem + ".rgb");
    if (got.width != want.width || got.height != want.height) {
      ADD_FAILURE() << "HF gives " << want.width << "x" << want.height;
      continue;
    }
    int worst = 0;
    size_t differ = 0;
    for (size_t i = 0; i < got.pixels.size(); ++i) {
      const int d = std::abs(int(got.pixels[i]) - int(want.pixels[i]));
      worst = std::max(worst, d);
      differ += d != 0;
    }
    std::printf("%-18s %-4s orientation %d: %zu of %zu samples differ from HF, max %d levels\n",
                stem.c_str(), f["format"].get<std::string>().c_str(), f["orientation"].get<int>(),
                differ, got.pixels.size(), worst);
    // Lossy files too: JPEG goes through libjpeg-turbo with PIL's settings, lossy WebP through the
    // libwebp decoder PIL uses.
    EXPECT_EQ(worst, 0);
    if (f["has_alpha"]) {
      // The same file made RGB by transformers' convert_to_rgb (the golden's key keeps its old
      // name): convert("RGB") in transformers 5.x, so load_image's pixels again. Were it to
      // differ, transformers would treat alpha otherwise than by dropping it, and so must Iris.
      const ImageRGB8 via_hf = expected(stem + ".rgb_composited");
      size_t changed = 0;
      for (size_t i = 0; i < want.pixels.size(); ++i) changed += via_hf.pixels[i] != want.pixels[i];
      std::printf("%-18s transformers' convert_to_rgb differs from load_image in %zu samples\n",
                  stem.c_str(), changed);
      EXPECT_EQ(changed, 0u) << "transformers' convert_to_rgb no longer drops alpha";
    }
  }
}

TEST_F(ImageFormatsGolden, TurnedLosslessFilesEqualTheUprightOne) {
  const ImageRGB8 upright = load_image(dir_ + "/upright.png");
  for (const char* file : {"webp_orient6.webp", "tiff_orient8.tif", "png_orient5.png",
                           "webp_lossless.webp", "tiff_rgb.tif", "tiff_rgb_lzw.tif"})
    EXPECT_EQ(load_image(dir_ + "/" + file).pixels, upright.pixels) << file;
}

TEST_F(ImageFormatsGolden, PixelValuesEqualHF) {
  const PreprocessorConfig cfg =
      PreprocessorConfig::from_file(test::fixture_dir() + "/preprocessor_config.json");
  const nlohmann::json& stems = golden_->json()["pixel_value_stems"];
  ASSERT_FALSE(stems.empty());
  for (const auto& s : stems) {
    const std::string stem = s;
    SCOPED_TRACE(stem);
    const HostTensor want = golden_->tensor(stem + ".pixel_values");
    const HostTensor grid = golden_->tensor(stem + ".image_grid_thw");
    // From HF's decoded pixels: the preprocessing alone.
    const PreprocessedImage from_hf = preprocess_image(expected(stem + ".rgb"), cfg);
    ASSERT_EQ(from_hf.pixel_values.dims(), want.dims());
    for (int k = 0; k < 3; ++k) EXPECT_EQ(from_hf.grid_thw[k], grid.data<int64_t>()[k]);
    EXPECT_TRUE(test::all_close(from_hf.pixel_values.to_f32(), want.to_f32(), 0, 1e-4f));
    // From the file: the decoded pixels equal HF's (DecodedPixelsEqualHF), JPEG and lossy WebP
    // included, so the pixel values do too.
    const auto& f = golden_->json()["files"][stem];
    const PreprocessedImage from_file =
        preprocess_image(load_image(dir_ + "/" + f["file"].get<std::string>()), cfg);
    EXPECT_TRUE(test::all_close(from_file.pixel_values.to_f32(), want.to_f32(), 0, 1e-4f));
  }
}

}  // namespace
}  // namespace iris
