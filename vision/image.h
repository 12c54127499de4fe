// Decoding and encoding 8-bit RGB images (stb_image / stb_image_write, libjpeg-turbo, libwebp,
// libtiff).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace iris {

// Interleaved RGB, row-major (HWC), 3 bytes per pixel, no row padding.
struct ImageRGB8 {
  int width = 0, height = 0;
  std::vector<uint8_t> pixels;
};

// The most pixels (width x height, read from the file's header before anything is decoded) an
// image may have: PIL's decompression-bomb limit, at which HF's image loading refuses a file too
// (2 x PIL.Image.MAX_IMAGE_PIXELS). It covers every camera's photos (a 100-megapixel frame is 1.8x
// below it); Qwen processors resize anything above 16384 x 28 x 28 pixels down anyway.
inline constexpr int64_t kDefaultMaxImagePixels = 178956970;

// The formats decode_image reads, for messages (help, errors).
inline constexpr const char* kImageFormats = "PNG, JPEG, WebP, TIFF, BMP, GIF, TGA, PNM";

// Decodes an image as transformers' load_image reads it (PIL.Image.open, ImageOps.exif_transpose,
// RGB), from PNG, JPEG, WebP (first frame of an animation), TIFF (first image; the layouts are
// listed in vision/image_tiff.cpp), BMP, GIF (first frame), TGA and PNM (stb also reads PSD, HDR
// and PIC). JPEG decodes through libjpeg-turbo with the settings PIL uses, so its pixels are
// PIL's (grey, RGB, and CMYK read inverted as PIL reads it). Grey becomes RGB. Alpha (RGBA,
// grey+alpha, palettes with transparency) is dropped, as load_image's convert("RGB") drops it: a
// pixel keeps the colour it stores, even under alpha 0. transformers 5.x's convert_to_rgb is the
// same convert("RGB"), so the processor sees these pixels whichever of the two made the image RGB
// (the golden of tools/make_image_format_golden.py records both). One known difference: a GIF's
// transparent pixels come out black from stb_image, where PIL gives the colour their palette entry
// stores. Samples of more than 8 bits, and PNM samples under another maximum than 255, become 8
// bits as PIL's open and convert("RGB") make them (16-bit grey clipped, other 16-bit PNG and TIFF
// cut to the high byte, PNM scaled). BMPs stored top-down (negative height) read as PIL reads them.
//
// EXIF orientation is applied as exif_transpose applies it (all 8 values; the rotated photo comes
// out upright), from JPEG, PNG (eXIf), WebP and TIFF files, falling back to XMP's tiff:Orientation
// as PIL does (vision/image_formats.h says how the tag is read). A malformed EXIF block never
// fails an image: it is used as stored.
//
// Throws iris::Error naming the file for a missing file or data that cannot be decoded, with the
// decoder's reason. An image of more than `max_pixels` pixels is an error that names the limit's
// setting before any memory is spent on it; a path that is not a regular file (a FIFO, a
// directory) is an error too.
ImageRGB8 load_image(const std::string& path, int64_t max_pixels = kDefaultMaxImagePixels);
ImageRGB8 decode_image(const uint8_t* data, size_t size, const std::string& name_for_errors,
                       int64_t max_pixels = kDefaultMaxImagePixels);

// Encodes as PNG and writes atomically (temporary file, then rename).
void write_png(const std::string& path, const ImageRGB8& img);

// Throws iris::Error unless the image has positive dimensions and exactly width*height*3 bytes.
void check_image(const ImageRGB8& img, const char* what);

}  // namespace iris
