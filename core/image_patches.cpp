#include "core/image_patches.h"

#include <cstddef>
#include <cstring>

#include "core/error.h"

namespace iris {

void image_patches_host(float* dst, int64_t dst_cols, const uint8_t* const* frames,
                        const ImagePatchGeometry& g, const float* table, const int32_t* dst_rows) {
  const int P = g.patch_size, Tp = g.temporal_patch_size, m = g.merge_size;
  const int gw = g.width / P, bw = gw / m;
  const size_t frame = static_cast<size_t>(P) * P;
  const int64_t n_patches = g.patches();
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < n_patches; ++row) {
    const int64_t block = row / (m * m);
    const int in_block = static_cast<int>(row % (m * m));
    const int r = static_cast<int>(block / bw) * m + in_block / m;
    const int c = static_cast<int>(block % bw) * m + in_block % m;
    float* out = dst + (dst_rows != nullptr ? dst_rows[row] : row) * dst_cols;
    for (int ch = 0; ch < 3; ++ch) {
      float* plane = out + static_cast<size_t>(ch) * Tp * frame;
      const float* lut = table + ch * 256;
      for (int f = 0; f < Tp; ++f) {
        float* d0 = plane + static_cast<size_t>(f) * frame;
        if (f > 0 && frames[f] == frames[f - 1]) {
          std::memcpy(d0, d0 - frame, frame * sizeof(float));
          continue;
        }
        for (int py = 0; py < P; ++py) {
          const uint8_t* s =
              frames[f] +
              ((static_cast<size_t>(r) * P + py) * g.width + static_cast<size_t>(c) * P) * 3 + ch;
          float* d = d0 + static_cast<size_t>(py) * P;
          for (int x = 0; x < P; ++x) d[x] = lut[s[3 * x]];
        }
      }
    }
  }
}

void check_image_patches(const Tensor& dst, const Tensor& frames, const Tensor& table,
                         const Tensor& dst_rows, const ImagePatchGeometry& g, const char* op) {
  const int unit = g.patch_size * g.merge_size;
  IRIS_CHECK(g.patch_size > 0 && g.merge_size > 0 && g.temporal_patch_size > 0 && g.height > 0 &&
                 g.width > 0 && g.height % unit == 0 && g.width % unit == 0,
             op, ": an image of ", g.width, "x", g.height, " is not whole merge windows of ", unit,
             " pixels (patch_size ", g.patch_size, ", merge_size ", g.merge_size, ")");
  const int64_t frame_bytes = int64_t{g.height} * g.width * 3;
  IRIS_CHECK(frames.dtype == DType::u8 && (frames.numel() == frame_bytes ||
                                           frames.numel() == frame_bytes * g.temporal_patch_size),
             op, ": frames ", frames.shape_str(), " should be u8 with ", frame_bytes,
             " bytes (one frame) or ", frame_bytes * g.temporal_patch_size, " (",
             g.temporal_patch_size, " frames)");
  IRIS_CHECK(table.dtype == DType::f32 && table.numel() == 3 * 256, op, ": table ",
             table.shape_str(), " should be f32 [768]");
  IRIS_CHECK(dst_rows.dtype == DType::i32 && dst_rows.numel() == g.patches(), op, ": dst_rows ",
             dst_rows.shape_str(), " should be i32 [", g.patches(), "]");
  IRIS_CHECK(dst.ndim == 2 && dst.cols() == g.row_values() && dst.rows() >= g.patches(), op,
             ": dst ", dst.shape_str(), " should be [at least ", g.patches(), ", ", g.row_values(),
             "]");
}

}  // namespace iris
