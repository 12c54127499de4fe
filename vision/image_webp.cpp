// WebP through libwebp, the way PIL's WebPImagePlugin decodes it: libwebp's animation decoder
// (which a still image goes through too) gives the first frame's canvas as straight RGBA, PIL's
// image is RGBA when WebPGetFeatures reports alpha (RGB otherwise), and load_image's
// convert("RGB") then drops alpha: the colours stay as stored, also under alpha 0.
#include <webp/decode.h>
#include <webp/demux.h>

#include <memory>

#include "core/error.h"
#include "vision/image_formats.h"

namespace iris::image_detail {

namespace {

const char* status_text(VP8StatusCode s) {
  switch (s) {
    case VP8_STATUS_OUT_OF_MEMORY:
      return "out of memory";
    case VP8_STATUS_INVALID_PARAM:
      return "invalid parameter";
    case VP8_STATUS_BITSTREAM_ERROR:
      return "bitstream error";
    case VP8_STATUS_UNSUPPORTED_FEATURE:
      return "unsupported feature";
    case VP8_STATUS_SUSPENDED:
      return "suspended";
    case VP8_STATUS_USER_ABORT:
      return "aborted";
    case VP8_STATUS_NOT_ENOUGH_DATA:
      return "not enough data: truncated";
    default:
      return "unknown error";
  }
}

}  // namespace

ImageRGB8 decode_webp(const uint8_t* data, size_t size, const std::string& name,
                      int64_t max_pixels) {
  WebPBitstreamFeatures features;
  const VP8StatusCode status = WebPGetFeatures(data, size, &features);
  IRIS_CHECK(status == VP8_STATUS_OK, "cannot decode image ", name,
             ": its WebP header is corrupt or truncated (", status_text(status), ")");
  const int w = features.width, h = features.height;
  IRIS_CHECK(w > 0 && h > 0, "cannot decode image ", name, ": its header gives size ", w, "x", h);
  IRIS_CHECK(int64_t{w} * h <= max_pixels, "image ", name, " is ", w, "x", h, " = ", int64_t{w} * h,
             " pixels, more than the limit of ", max_pixels,
             " (a decompression bomb, or a scan far larger than the model can see); downscale it, "
             "or raise the limit (iris generate --max-image-pixels, recipe data.max_image_pixels)");

  WebPAnimDecoderOptions options;
  IRIS_CHECK(WebPAnimDecoderOptionsInit(&options), "cannot decode image ", name,
             ": libwebp's animation decoder does not match the headers it was built with");
  options.color_mode = MODE_RGBA;
  options.use_threads = 0;
  const WebPData bytes{data, size};
  std::unique_ptr<WebPAnimDecoder, void (*)(WebPAnimDecoder*)> dec(
      WebPAnimDecoderNew(&bytes, &options), &WebPAnimDecoderDelete);
  IRIS_CHECK(dec != nullptr, "cannot decode image ", name,
             ": WebP data is corrupt or truncated (its chunks do not parse)");
  WebPAnimInfo info;
  IRIS_CHECK(WebPAnimDecoderGetInfo(dec.get(), &info), "cannot decode image ", name,
             ": WebP data is corrupt or truncated");
  // The canvas is what the features gave for every file the demuxer accepts; checked all the
  // same, since the buffer below is read at this size.
  IRIS_CHECK(int64_t{info.canvas_width} == w && int64_t{info.canvas_height} == h,
             "cannot decode image ", name, ": its WebP canvas is ", info.canvas_width, "x",
             info.canvas_height, " but its header says ", w, "x", h, " (corrupt WebP)");
  uint8_t* rgba = nullptr;
  int timestamp = 0;
  IRIS_CHECK(WebPAnimDecoderGetNext(dec.get(), &rgba, &timestamp) && rgba != nullptr,
             "cannot decode image ", name, ": WebP data is corrupt or truncated");

  ImageRGB8 img;
  img.width = w;
  img.height = h;
  const size_t n = static_cast<size_t>(w) * h;
  img.pixels.resize(n * 3);
  uint8_t* dst = img.pixels.data();
  for (size_t i = 0; i < n; ++i)
    for (int c = 0; c < 3; ++c) dst[3 * i + c] = rgba[4 * i + c];  // alpha dropped
  return img;
}

}  // namespace iris::image_detail
