// TIFF through libtiff, read from memory. libtiff decompresses (none, PackBits, LZW, Deflate,
// JPEG, CCITT, ... with predictors and fill orders undone); the samples are then made RGB as PIL's
// TiffImagePlugin unpacks them (its OPEN_INFO table and Unpack.c) and convert("RGB") converts them.
#include <tiffio.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "vision/image_formats.h"

namespace iris::image_detail {

namespace {

// libtiff reads through these from the caller's buffer.
struct MemoryFile {
  const uint8_t* data;
  uint64_t size;
  uint64_t pos = 0;
};

tmsize_t read_proc(thandle_t h, void* buf, tmsize_t want) {
  auto* f = static_cast<MemoryFile*>(h);
  if (want <= 0 || f->pos >= f->size) return 0;
  const uint64_t n = std::min<uint64_t>(static_cast<uint64_t>(want), f->size - f->pos);
  std::memcpy(buf, f->data + f->pos, n);
  f->pos += n;
  return static_cast<tmsize_t>(n);
}

tmsize_t write_proc(thandle_t, void*, tmsize_t) {
  return -1;
}

toff_t seek_proc(thandle_t h, toff_t off, int whence) {
  auto* f = static_cast<MemoryFile*>(h);
  uint64_t base = 0;
  if (whence == SEEK_CUR) base = f->pos;
  if (whence == SEEK_END) base = f->size;
  if (off > UINT64_MAX - base) return static_cast<toff_t>(-1);
  f->pos = base + off;  // past the end is allowed, as for a file; reads there return nothing
  return f->pos;
}

int close_proc(thandle_t) {
  return 0;
}

toff_t size_proc(thandle_t h) {
  return static_cast<MemoryFile*>(h)->size;
}

int map_proc(thandle_t, void**, toff_t*) {
  return 0;
}

void unmap_proc(thandle_t, void*, toff_t) {}

// libtiff's first complaint about this file, for the error message.
struct Complaint {
  std::string text;
};

int on_error(TIFF*, void* user, const char* module, const char* fmt, va_list ap) {
  auto* c = static_cast<Complaint*>(user);
  if (c != nullptr && c->text.empty()) {
    char buf[512];
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    c->text = module != nullptr && *module ? std::string(module) + ": " + buf : std::string(buf);
  }
  return 1;  // handled: nothing goes to the process-wide handler (stderr)
}

int on_warning(TIFF*, void*, const char*, const char*, va_list) {
  return 1;  // unknown tags and the like: PIL opens such files without a word
}

// A few libtiff paths report through the process-wide handlers, which print to stderr; this
// library answers with an iris::Error instead, so those handlers are silenced once.
void silence_global_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    TIFFSetErrorHandler(nullptr);
    TIFFSetWarningHandler(nullptr);
  });
}

// How PIL's table reads the samples of each layout it opens (TiffImagePlugin.OPEN_INFO), limited
// to the unsigned-integer ones below; the rest are refused naming what the file holds.
enum class Kind { grey, grey16, grey_alpha, rgb, palette, cmyk };
enum class Alpha { none, straight, premultiplied };

struct Layout {
  Kind kind;
  Alpha alpha = Alpha::none;
  bool invert = false;  // MinIsWhite
};

std::string describe(uint16_t photometric, uint16_t spp, uint16_t bps, uint16_t format,
                     const std::vector<uint16_t>& extras) {
  std::string e;
  for (uint16_t x : extras) e += (e.empty() ? "" : ",") + std::to_string(x);
  return str_cat("photometric interpretation ", photometric, ", ", spp, " samples per pixel of ",
                 bps, " bits, sample format ", format, ", extra samples (", e, ")");
}

}  // namespace

// Layouts read (all unsigned integer samples, chunky or planar, strips or tiles), each as PIL
// makes it RGB: grey (MinIsBlack or MinIsWhite) of 1, 2, 4 or 8 bits, scaled to 0..255 (PIL's
// "1", "L;2", "L;4", "L"; MinIsWhite inverted); 16-bit MinIsBlack grey clipped to 255 (I;16);
// grey with unassociated alpha (LA); RGB of 8 or 16 bits (16: the high byte, as PIL's RGB;16
// unpackers keep) with no extra sample, an ignored one (ExtraSamples 0), unassociated alpha (2, or
// a fourth sample without ExtraSamples) or premultiplied alpha (1, divided out as PIL's RGBa
// unpacker does), then up to two more ignored samples; palettes of 1, 2, 4 or 8 bits (colours the
// colormap's high bytes), with an ignored or alpha second sample for 8 bits; 8-bit CMYK through
// PIL's cmyk2rgb; YCbCr in JPEG compression, which libjpeg returns as RGB. Alpha is dropped, as
// for every format. Float, signed, 32-bit, CIELab, YCbCr outside JPEG and the like are refused
// with what the file holds.
ImageRGB8 decode_tiff(const uint8_t* data, size_t size, const std::string& name,
                      int64_t max_pixels) {
  silence_global_handlers();
  MemoryFile file{data, size};
  Complaint complaint;
  std::unique_ptr<TIFFOpenOptions, void (*)(TIFFOpenOptions*)> opts(TIFFOpenOptionsAlloc(),
                                                                    &TIFFOpenOptionsFree);
  IRIS_CHECK(opts != nullptr, "cannot decode image ", name, ": out of memory");
  // libtiff sizes its own buffers (a strip, a tile, a tag's array) from the file's claims; none
  // may exceed what the largest image the pixel limit allows needs (8 bytes a pixel, RGBA of 16
  // bits), so a hostile claim fails there and not in the allocator.
  const int64_t cap =
      std::max<int64_t>(int64_t{64} << 20, std::min<int64_t>(max_pixels, INT64_MAX / 16) * 8);
  TIFFOpenOptionsSetMaxSingleMemAlloc(opts.get(), static_cast<tmsize_t>(cap));
  TIFFOpenOptionsSetErrorHandlerExtR(opts.get(), &on_error, &complaint);
  TIFFOpenOptionsSetWarningHandlerExtR(opts.get(), &on_warning, nullptr);
  // "m": no memory mapping; every read goes through read_proc's bounds.
  std::unique_ptr<TIFF, void (*)(TIFF*)> tif(
      TIFFClientOpenExt(name.c_str(), "rm", &file, &read_proc, &write_proc, &seek_proc, &close_proc,
                        &size_proc, &map_proc, &unmap_proc, opts.get()),
      &TIFFClose);
  auto reason = [&] {
    return complaint.text.empty() ? std::string() : " (" + complaint.text + ")";
  };
  IRIS_CHECK(tif != nullptr, "cannot decode image ", name,
             ": its TIFF header or first directory is corrupt or truncated", reason());

  uint32_t width = 0, height = 0;
  IRIS_CHECK(TIFFGetField(tif.get(), TIFFTAG_IMAGEWIDTH, &width) == 1 &&
                 TIFFGetField(tif.get(), TIFFTAG_IMAGELENGTH, &height) == 1,
             "cannot decode image ", name, ": its TIFF directory has no image width or length");
  IRIS_CHECK(width > 0 && height > 0 && width <= INT32_MAX && height <= INT32_MAX,
             "cannot decode image ", name, ": its header gives size ", width, "x", height);
  const int64_t pixels = int64_t{width} * height;
  IRIS_CHECK(pixels <= max_pixels, "image ", name, " is ", width, "x", height, " = ", pixels,
             " pixels, more than the limit of ", max_pixels,
             " (a decompression bomb, or a scan far larger than the model can see); downscale it, "
             "or raise the limit (iris generate --max-image-pixels, recipe data.max_image_pixels)");

  uint16_t spp = 1, bps = 1, format = SAMPLEFORMAT_UINT, planar = PLANARCONFIG_CONTIG,
           compression = COMPRESSION_NONE, photometric = 0;
  TIFFGetFieldDefaulted(tif.get(), TIFFTAG_SAMPLESPERPIXEL, &spp);
  TIFFGetFieldDefaulted(tif.get(), TIFFTAG_BITSPERSAMPLE, &bps);
  TIFFGetFieldDefaulted(tif.get(), TIFFTAG_SAMPLEFORMAT, &format);
  TIFFGetFieldDefaulted(tif.get(), TIFFTAG_PLANARCONFIG, &planar);
  TIFFGetFieldDefaulted(tif.get(), TIFFTAG_COMPRESSION, &compression);
  IRIS_CHECK(TIFFGetField(tif.get(), TIFFTAG_PHOTOMETRIC, &photometric) == 1,
             "cannot decode image ", name,
             ": its TIFF directory has no photometric interpretation (corrupt TIFF)");
  uint16_t n_extras = 0;
  uint16_t* extras_p = nullptr;
  TIFFGetFieldDefaulted(tif.get(), TIFFTAG_EXTRASAMPLES, &n_extras, &extras_p);
  const std::vector<uint16_t> extras(extras_p, extras_p + (extras_p ? n_extras : 0));

  if (photometric == PHOTOMETRIC_YCBCR && compression == COMPRESSION_JPEG) {
    // libjpeg converts to RGB, as PIL has libtiff do for such files.
    IRIS_CHECK(TIFFSetField(tif.get(), TIFFTAG_JPEGCOLORMODE, JPEGCOLORMODE_RGB) == 1,
               "cannot decode image ", name, ": its JPEG-compressed YCbCr data cannot be set up",
               reason());
    photometric = PHOTOMETRIC_RGB;
  }

  // Which layout this is, by PIL's table; 0 in `extras` past the alpha one are ignored samples.
  const size_t n_ignored = std::count(extras.begin(), extras.end(), uint16_t{0});
  auto fail_layout = [&]() -> Layout {
    IRIS_FAIL("cannot decode image ", name, ": TIFF with ",
              describe(photometric, spp, bps, format, extras),
              " is not supported (supported: 1-16 bit grey, 8 or 16-bit RGB with or without "
              "alpha, palette, 8-bit CMYK, JPEG YCbCr); convert it to PNG");
  };
  auto layout = [&]() -> Layout {
    if (format != SAMPLEFORMAT_UINT) return fail_layout();
    const bool min_is_white = photometric == PHOTOMETRIC_MINISWHITE;
    if ((photometric == PHOTOMETRIC_MINISBLACK || min_is_white) && spp == 1 && extras.empty()) {
      if (bps == 1 || bps == 2 || bps == 4 || bps == 8)
        return {Kind::grey, Alpha::none, min_is_white};
      if (bps == 16 && !min_is_white) return {Kind::grey16};
    }
    if (photometric == PHOTOMETRIC_MINISBLACK && spp == 2 && bps == 8 && extras.size() == 1 &&
        extras[0] == EXTRASAMPLE_UNASSALPHA)
      return {Kind::grey_alpha, Alpha::straight};
    if (photometric == PHOTOMETRIC_RGB && (bps == 8 || bps == 16) && spp >= 3 && spp <= 6 &&
        extras.size() == size_t(spp - 3)) {
      if (spp == 3) return {Kind::rgb};
      // The first extra sample is alpha or ignored, the others (8 bits only) ignored.
      if (bps == 16 && spp > 4) return fail_layout();
      if (n_ignored < extras.size() - 1) return fail_layout();
      if (extras[0] == 0) return n_ignored == extras.size() ? Layout{Kind::rgb} : fail_layout();
      if (extras[0] == EXTRASAMPLE_ASSOCALPHA) return {Kind::rgb, Alpha::premultiplied};
      if (extras[0] == EXTRASAMPLE_UNASSALPHA) return {Kind::rgb, Alpha::straight};
      if (extras[0] == 999 && spp == 4 && bps == 8) return {Kind::rgb, Alpha::straight};  // Corel
      return fail_layout();
    }
    if (photometric == PHOTOMETRIC_RGB && spp == 4 && extras.empty() && (bps == 8 || bps == 16))
      return {Kind::rgb, Alpha::straight};  // PIL: RGBA for a fourth sample with no ExtraSamples
    if (photometric == PHOTOMETRIC_PALETTE && spp == 1 && extras.empty() &&
        (bps == 1 || bps == 2 || bps == 4 || bps == 8))
      return {Kind::palette};
    if (photometric == PHOTOMETRIC_PALETTE && spp == 2 && bps == 8 && extras.size() == 1 &&
        (extras[0] == 0 || extras[0] == EXTRASAMPLE_UNASSALPHA))
      return {Kind::palette, extras[0] == 0 ? Alpha::none : Alpha::straight};
    if (photometric == PHOTOMETRIC_SEPARATED && bps == 8 && spp >= 4 && spp <= 6 &&
        extras.size() == size_t(spp - 4) && n_ignored == extras.size())
      return {Kind::cmyk};
    return fail_layout();
  };
  const Layout lay = layout();

  uint16_t* cmap[3] = {nullptr, nullptr, nullptr};
  if (lay.kind == Kind::palette)
    IRIS_CHECK(TIFFGetField(tif.get(), TIFFTAG_COLORMAP, &cmap[0], &cmap[1], &cmap[2]) == 1 &&
                   cmap[0] && cmap[1] && cmap[2],
               "cannot decode image ", name, ": its TIFF palette has no colormap (corrupt TIFF)");

  // The decoded samples, row by row: one buffer of rows for chunky data, one per sample plane.
  const bool separate = planar == PLANARCONFIG_SEPARATE && spp > 1;
  const int planes = separate ? spp : 1;
  const uint64_t row_bytes = TIFFScanlineSize64(tif.get());
  IRIS_CHECK(row_bytes > 0, "cannot decode image ", name, ": its TIFF rows have no size", reason());
  const uint64_t samples_per_row = uint64_t{width} * (separate ? 1 : spp);
  IRIS_CHECK(row_bytes >= (samples_per_row * bps + 7) / 8, "cannot decode image ", name,
             ": its TIFF rows are shorter than ", width, " pixels (corrupt TIFF)");
  std::vector<std::vector<uint8_t>> plane(planes, std::vector<uint8_t>(row_bytes * height));

  auto read_fail = [&](const char* what, uint32_t index) {
    IRIS_FAIL("cannot decode image ", name, ": TIFF data is corrupt or truncated (", what, " ",
              index, " does not decode", complaint.text.empty() ? "" : ": " + complaint.text, ")");
  };
  if (TIFFIsTiled(tif.get())) {
    uint32_t tw = 0, th = 0;
    TIFFGetField(tif.get(), TIFFTAG_TILEWIDTH, &tw);
    TIFFGetField(tif.get(), TIFFTAG_TILELENGTH, &th);
    const uint64_t tile_bytes = TIFFTileSize64(tif.get()), tile_row = TIFFTileRowSize64(tif.get());
    IRIS_CHECK(tw > 0 && th > 0 && tile_bytes > 0 && tile_row > 0 && tile_row * th <= tile_bytes,
               "cannot decode image ", name, ": its TIFF tiles have no size (corrupt TIFF)",
               reason());
    // Tile widths are multiples of 16 pixels (TIFF 6.0), so each tile starts on a byte.
    IRIS_CHECK(tw % 16 == 0, "cannot decode image ", name, ": its TIFF tile width ", tw,
               " is not a multiple of 16 (corrupt TIFF)");
    const uint64_t bits_per_pixel = uint64_t{bps} * (separate ? 1 : spp);
    std::vector<uint8_t> tile(tile_bytes);
    for (int p = 0; p < planes; ++p)
      for (uint32_t y = 0; y < height; y += th)
        for (uint32_t x = 0; x < width; x += tw) {
          const uint32_t index = TIFFComputeTile(tif.get(), x, y, 0, static_cast<uint16_t>(p));
          if (TIFFReadEncodedTile(tif.get(), index, tile.data(),
                                  static_cast<tmsize_t>(tile_bytes)) !=
              static_cast<tmsize_t>(tile_bytes))
            read_fail("tile", index);
          const uint64_t x_byte = x * bits_per_pixel / 8;
          const uint64_t n = std::min<uint64_t>(tile_row, row_bytes - x_byte);
          for (uint32_t r = 0; r < th && y + r < height; ++r)
            std::memcpy(&plane[p][(uint64_t{y} + r) * row_bytes + x_byte], &tile[r * tile_row], n);
        }
  } else {
    uint32_t rps = height;
    TIFFGetFieldDefaulted(tif.get(), TIFFTAG_ROWSPERSTRIP, &rps);
    rps = std::clamp<uint32_t>(rps, 1, height);
    for (int p = 0; p < planes; ++p)
      for (uint32_t y = 0; y < height; y += rps) {
        const uint32_t rows = std::min(rps, height - y);
        const uint32_t index = TIFFComputeStrip(tif.get(), y, static_cast<uint16_t>(p));
        const tmsize_t want = static_cast<tmsize_t>(uint64_t{rows} * row_bytes);
        if (TIFFReadEncodedStrip(tif.get(), index, &plane[p][uint64_t{y} * row_bytes], want) !=
            want)
          read_fail("strip", index);
      }
  }

  // Sample s of pixel x in row y, as an integer of `bps` bits (16-bit samples come from libtiff in
  // the host's byte order).
  auto sample = [&](uint32_t y, uint32_t x, int s) -> uint32_t {
    const int p = separate ? s : 0;
    const uint64_t i = separate ? x : uint64_t{x} * spp + s;
    const uint8_t* row = &plane[p][uint64_t{y} * row_bytes];
    switch (bps) {
      case 16: {
        uint16_t v;
        std::memcpy(&v, row + 2 * i, 2);
        return v;
      }
      case 8:
        return row[i];
      default: {
        const uint64_t bit = i * bps;
        return (row[bit / 8] >> (8 - bps - bit % 8)) & ((1u << bps) - 1);
      }
    }
  };
  auto to8 = [&](uint32_t v) -> uint32_t { return bps == 16 ? v >> 8 : v; };

  ImageRGB8 img;
  img.width = static_cast<int>(width);
  img.height = static_cast<int>(height);
  img.pixels.resize(static_cast<size_t>(pixels) * 3);
  uint8_t* dst = img.pixels.data();
  for (uint32_t y = 0; y < height; ++y)
    for (uint32_t x = 0; x < width; ++x, dst += 3) {
      uint32_t rgb[3] = {0, 0, 0};
      switch (lay.kind) {
        case Kind::grey: {
          const uint32_t v = sample(y, x, 0);
          const uint32_t scaled = bps == 1 ? v * 255 : bps == 2 ? v * 85 : bps == 4 ? v * 17 : v;
          rgb[0] = rgb[1] = rgb[2] = lay.invert ? 255 - scaled : scaled;
          break;
        }
        case Kind::grey16:
          rgb[0] = rgb[1] = rgb[2] = std::min<uint32_t>(sample(y, x, 0), 255);
          break;
        case Kind::grey_alpha:  // the alpha sample is dropped
          rgb[0] = rgb[1] = rgb[2] = sample(y, x, 0);
          break;
        case Kind::rgb:
          for (int c = 0; c < 3; ++c) rgb[c] = to8(sample(y, x, c));
          if (lay.alpha == Alpha::premultiplied) {
            // Unpack.c's unpackRGBa: PIL opens the file as RGBA with the colours divided by alpha
            // (truncating, clipped to 255) before convert("RGB") drops alpha.
            const uint32_t a = to8(sample(y, x, 3));
            for (uint32_t& c : rgb)
              c = a == 0 ? 0 : a == 255 ? c : std::min<uint32_t>(c * 255 / a, 255);
          }
          break;
        case Kind::palette: {
          const uint32_t i = sample(y, x, 0);
          for (int c = 0; c < 3; ++c) rgb[c] = cmap[c][i] >> 8;
          break;
        }
        case Kind::cmyk:
          for (int c = 0; c < 3; ++c) rgb[c] = pil_cmyk_to_rgb(sample(y, x, c), sample(y, x, 3));
          break;
      }
      // No alpha here: load_image's convert("RGB") drops it, leaving the stored colours.
      for (int c = 0; c < 3; ++c) dst[c] = static_cast<uint8_t>(rgb[c]);
    }
  return img;
}

}  // namespace iris::image_detail
