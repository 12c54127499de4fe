// tools/make_video_golden.py's test video: 30 frames of 140x100 at 12 fps, each sample a formula
// of the frame, row, column and channel, written losslessly so that every decoder sees the same
// pixels HF was given.
#pragma once

#include <cstdint>
#include <vector>

#include "vision/image.h"

namespace iris::test {

constexpr int kFormulaFrames = 30, kFormulaHeight = 100, kFormulaWidth = 140;
constexpr double kFormulaFps = 12.0;

inline uint8_t formula_value(int64_t f, int y, int x, int c) {
  return static_cast<uint8_t>((7 * f + 3 * y + 5 * x + 61 * c + ((x * y) >> 3)) & 255);
}

inline ImageRGB8 formula_frame(int64_t f) {
  ImageRGB8 im;
  im.width = kFormulaWidth;
  im.height = kFormulaHeight;
  im.pixels.resize(static_cast<size_t>(kFormulaWidth) * kFormulaHeight * 3);
  for (int y = 0; y < kFormulaHeight; ++y)
    for (int x = 0; x < kFormulaWidth; ++x)
      for (int c = 0; c < 3; ++c)
        im.pixels[(static_cast<size_t>(y) * kFormulaWidth + x) * 3 + c] = formula_value(f, y, x, c);
  return im;
}

inline std::vector<ImageRGB8> formula_frames() {
  std::vector<ImageRGB8> frames;
  for (int f = 0; f < kFormulaFrames; ++f) frames.push_back(formula_frame(f));
  return frames;
}

}  // namespace iris::test
