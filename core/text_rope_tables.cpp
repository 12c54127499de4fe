#include "core/text_rope_tables.h"

#include <cmath>

#include "core/error.h"

namespace iris {

void check_text_rope_tables(const Tensor& cos, const Tensor& sin, const Tensor& positions,
                            const std::vector<float>& inv_freq, const std::vector<int>& pair_axis,
                            const char* op) {
  const int64_t L = cos.rows(), hd = cos.cols(), half = hd / 2;
  IRIS_CHECK(cos.dtype == DType::f32 && sin.dtype == DType::f32 && positions.dtype == DType::i32 &&
                 sin.rows() == L && sin.cols() == hd && positions.numel() == L * 3 && hd % 2 == 0 &&
                 static_cast<int64_t>(inv_freq.size()) == half &&
                 static_cast<int64_t>(pair_axis.size()) == half,
             op, ": cos ", cos.shape_str(), ", sin ", sin.shape_str(), ", positions ",
             positions.shape_str(), " with ", inv_freq.size(), " frequencies and ",
             pair_axis.size(), " axes (expected f32 [L, hd] twice, i32 [L, 3], hd / 2 of each)");
  for (int a : pair_axis)
    IRIS_CHECK(a >= 0 && a < 3, op, ": position axis ", a, " is not 0, 1 or 2");
}

void text_rope_tables_host(float* cos, float* sin, const int32_t* positions, int64_t rows,
                           int64_t head_dim, const std::vector<float>& inv_freq,
                           const std::vector<int>& pair_axis) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = 0; j < half; ++j) {
      const float f = static_cast<float>(positions[t * 3 + pair_axis[j]]) * inv_freq[j];
      cos[t * head_dim + j] = cos[t * head_dim + half + j] = std::cos(f);
      sin[t * head_dim + j] = sin[t * head_dim + half + j] = std::sin(f);
    }
}

}  // namespace iris
