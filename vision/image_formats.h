// The pieces of image decoding behind decode_image (vision/image.h) that have files of their own:
// WebP and TIFF through libwebp and libtiff, and the orientation PIL's exif_transpose applies.
// Internal to the vision layer and its tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "vision/image.h"

namespace iris::image_detail {

// The orientation PIL.ImageOps.exif_transpose acts on (2 to 8; 1 leaves the image as stored).
//
// The EXIF block is read as PIL's Exif.load reads it: "Exif\0\0" prefixes skipped, a TIFF header,
// then IFD0's entries until one cannot be read (those before it count, a later entry of a tag
// replaces an earlier one). The Orientation tag (0x0112) counts whatever its type, by its first
// value, as PIL compares it: an integer, or a float or rational equal to one, from 2 to 8;
// anything else (bytes, text, 9, 6.5) is 1. Without that tag, the first `tiff:Orientation="N"`
// or `<tiff:Orientation>N` of the XMP packet counts, as in PIL's getexif.
//
// A block PIL cannot read at all (no TIFF header, fewer than 8 bytes, a BigTIFF header) gives 1:
// such an image is used as stored, never refused. PIL ignores it the same way when it opens a
// JPEG without a JFIF density (its dpi probe swallows the error); elsewhere PIL raises instead.
int exif_orientation(const uint8_t* exif, size_t exif_size, const uint8_t* xmp, size_t xmp_size);

// The orientation of an encoded file, from where PIL finds its EXIF and XMP: JPEG APP1 segments
// before the first scan ("Exif\0\0" ones concatenated, the XMP one), PNG eXIf chunks, WebP EXIF and
// "XMP " chunks, a TIFF file's own first IFD (Orientation, then XMP in tag 700). Other formats,
// and any file whose structure cannot be walked, give 1.
int file_orientation(const uint8_t* data, size_t size);

// `img` turned as PIL's Image.transpose turns it for an orientation: 2 mirror, 3 rotate 180,
// 4 flip, 5 transpose, 6 rotate 90 clockwise, 7 transverse, 8 rotate 90 counter-clockwise.
ImageRGB8 apply_orientation(ImageRGB8 img, int orientation);

// A JPEG as PIL's JpegImagePlugin accepts one: a start-of-image marker and the 0xFF of the next
// (FF D8 FF). Anything else goes to stb_image, whose own JPEG decoder is not compiled in.
bool is_jpeg(const uint8_t* data, size_t size);
bool is_webp(const uint8_t* data, size_t size);
bool is_tiff(const uint8_t* data, size_t size);

// PIL's cmyk2rgb (Convert.c) for one colour sample `c` under black `k`: 255 - k - c (255 - k) /
// 255, with its rounded division by 255.
inline uint8_t pil_cmyk_to_rgb(uint32_t c, uint32_t k) {
  const uint32_t nk = 255 - k;
  const uint32_t t = c * nk + 128;
  const int v = static_cast<int>(nk) - static_cast<int>(((t >> 8) + t) >> 8);
  return static_cast<uint8_t>(v < 0 ? 0 : v > 255 ? 255 : v);
}

// The image, as PIL's JpegImagePlugin decodes it through libjpeg-turbo with libjpeg's defaults:
// grey, RGB (from YCbCr or RGB) and CMYK or YCCK (read inverted, as PIL reads every 4-component
// JPEG, then cmyk2rgb). Truncated data is an error, as in PIL; corrupt data libjpeg recovers from
// decodes as libjpeg recovers it, as in PIL.
ImageRGB8 decode_jpeg(const uint8_t* data, size_t size, const std::string& name,
                      int64_t max_pixels);

// The first frame, as PIL's WebPImagePlugin decodes it (libwebp's animation decoder, RGBA; RGB
// when WebPGetFeatures reports no alpha), with alpha dropped as for the other formats.
ImageRGB8 decode_webp(const uint8_t* data, size_t size, const std::string& name,
                      int64_t max_pixels);

// The first image, as PIL's TiffImagePlugin unpacks it and convert("RGB") makes it RGB; the
// layouts read are listed at decode_tiff's definition (vision/image_tiff.cpp).
ImageRGB8 decode_tiff(const uint8_t* data, size_t size, const std::string& name,
                      int64_t max_pixels);

}  // namespace iris::image_detail
