// JPEG through libjpeg(-turbo), as PIL's JpegImagePlugin decodes it. PIL leaves libjpeg's
// decompression defaults alone (the accurate integer IDCT, JDCT_ISLOW, and fancy chroma
// upsampling), and so does this file: where both link a libjpeg-turbo, the pixels equal PIL's bit
// for bit (the HF golden checks it). stb_image's decoder, used before, rounds its IDCT and
// upsampling otherwise and differed by up to 2 levels.
#include <cstdio>  // jpeglib.h needs FILE and size_t declared before it

#include <jerror.h>
#include <jpeglib.h>

#include <csetjmp>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "vision/image_formats.h"

namespace iris::image_detail {

namespace {

struct ErrorManager {
  jpeg_error_mgr pub;  // first: libjpeg hands back a pointer to it
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

struct Decoder {
  jpeg_decompress_struct cinfo;
  ErrorManager err;
};

// libjpeg reports a fatal error by calling this, which must not return; it jumps back to the
// setjmp of read_header or read_pixels with libjpeg's message kept.
[[noreturn]] void error_exit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Warnings pass silently, as PIL's output_message drops them (corrupt data decodes as libjpeg
// recovers it). The exception is running out of data: libjpeg would pad it with an end marker
// and decode the rest grey, where PIL's decoder waits for more and load() refuses the file as
// truncated.
void emit_message(j_common_ptr cinfo, int msg_level) {
  if (msg_level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) error_exit(cinfo);
}

// The two steps that call into libjpeg, each with its own setjmp. Only trivially destructible
// objects live in these frames, so the longjmp from error_exit skips no destructor.
bool read_header(Decoder& d, const uint8_t* data, size_t size) {
  if (setjmp(d.err.jump)) return false;
  jpeg_create_decompress(&d.cinfo);
  jpeg_mem_src(&d.cinfo, data, static_cast<unsigned long>(size));
  jpeg_read_header(&d.cinfo, TRUE);
  return true;
}

bool read_pixels(Decoder& d, uint8_t* out, size_t row_bytes) {
  if (setjmp(d.err.jump)) return false;
  jpeg_start_decompress(&d.cinfo);
  while (d.cinfo.output_scanline < d.cinfo.output_height) {
    JSAMPROW row = out + static_cast<size_t>(d.cinfo.output_scanline) * row_bytes;
    jpeg_read_scanlines(&d.cinfo, &row, 1);
  }
  return true;
}

}  // namespace

bool is_jpeg(const uint8_t* data, size_t size) {
  return size >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF;
}

ImageRGB8 decode_jpeg(const uint8_t* data, size_t size, const std::string& name,
                      int64_t max_pixels) {
  Decoder d;
  std::memset(&d, 0, sizeof d);  // jpeg_destroy_decompress is then safe whatever failed
  d.cinfo.err = jpeg_std_error(&d.err.pub);
  d.err.pub.error_exit = error_exit;
  d.err.pub.emit_message = emit_message;
  struct Destroy {
    Decoder& d;
    ~Destroy() { jpeg_destroy_decompress(&d.cinfo); }
  } destroy{d};

  IRIS_CHECK(read_header(d, data, size), "cannot decode image ", name,
             ": its JPEG header is corrupt or truncated (libjpeg: ", d.err.message, ")");
  const int64_t w = d.cinfo.image_width, h = d.cinfo.image_height;
  IRIS_CHECK(w > 0 && h > 0, "cannot decode image ", name, ": its header gives size ", w, "x", h);
  IRIS_CHECK(w * h <= max_pixels, "image ", name, " is ", w, "x", h, " = ", w * h,
             " pixels, more than the limit of ", max_pixels,
             " (a decompression bomb, or a scan far larger than the model can see); downscale it, "
             "or raise the limit (iris generate --max-image-pixels, recipe data.max_image_pixels)");
  // PIL opens 1, 3 and 4 components as L, RGB and CMYK, and refuses other counts.
  const int comps = d.cinfo.num_components;
  IRIS_CHECK(comps == 1 || comps == 3 || comps == 4, "cannot decode image ", name, ": JPEG with ",
             comps, " components is not supported (1, 3 or 4 are)");
  d.cinfo.out_color_space = comps == 1 ? JCS_GRAYSCALE : comps == 3 ? JCS_RGB : JCS_CMYK;

  std::vector<uint8_t> samples(static_cast<size_t>(w * h) * comps);
  IRIS_CHECK(read_pixels(d, samples.data(), static_cast<size_t>(w) * comps), "cannot decode image ",
             name, ": JPEG data is corrupt or truncated (libjpeg: ", d.err.message, ")");

  ImageRGB8 img;
  img.width = static_cast<int>(w);
  img.height = static_cast<int>(h);
  const size_t n = static_cast<size_t>(w * h);
  img.pixels.resize(n * 3);
  uint8_t* dst = img.pixels.data();
  const uint8_t* src = samples.data();
  switch (comps) {
    case 1:
      for (size_t i = 0; i < n; ++i) dst[3 * i] = dst[3 * i + 1] = dst[3 * i + 2] = src[i];
      break;
    case 3:
      std::memcpy(dst, src, n * 3);
      break;
    default:
      // PIL reads every 4-component JPEG as Adobe writes them, inverted ("CMYK;I", whatever the
      // markers say), then convert("RGB") applies its cmyk2rgb.
      for (size_t i = 0; i < n; ++i)
        for (int c = 0; c < 3; ++c)
          dst[3 * i + c] = pil_cmyk_to_rgb(255u - src[4 * i + c], 255u - src[4 * i + 3]);
  }
  return img;
}

}  // namespace iris::image_detail
