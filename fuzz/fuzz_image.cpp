// Image files of every format decode_image reads (stb's, WebP through libwebp, TIFF through
// libtiff, with their EXIF and XMP orientation): decoded (under a pixel limit small enough for the
// fuzzer's memory budget) and, when small, preprocessed into pixel rows as for the vision tower.
// libwebp and libtiff are Debian's builds, not instrumented: coverage guides the fuzzer through
// Iris's code around them only.
#include "core/error.h"
#include "vision/image.h"
#include "vision/preprocess.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const iris::ImageRGB8 img = iris::decode_image(data, size, "fuzz", int64_t{1} << 22);
    iris::check_image(img, "fuzz");
    if (int64_t{img.width} * img.height <= 256 * 256) {
      iris::PreprocessorConfig pp;
      pp.min_pixels = 32 * 32;
      pp.max_pixels = 64 * 64;
      iris::preprocess_image(img, pp);
    }
  } catch (const iris::Error&) {
  }
  return 0;
}
