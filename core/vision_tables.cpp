#include "core/vision_tables.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"

namespace iris {
namespace {

// torch.linspace in float32: the two halves are computed from opposite ends.
void torch_linspace(float start, float end, int64_t steps, std::vector<float>& out) {
  out.resize(static_cast<size_t>(steps));
  if (steps == 1) {
    out[0] = start;
    return;
  }
  const float step = (end - start) / static_cast<float>(steps - 1);
  const int64_t half = steps / 2;
  for (int64_t i = 0; i < steps; ++i)
    out[i] = i < half ? start + step * static_cast<float>(i)
                      : end - step * static_cast<float>(steps - 1 - i);
}

}  // namespace

std::vector<float> vision_rope_inv_freq(int head_dim, float rope_theta) {
  IRIS_CHECK(head_dim > 0 && head_dim % 4 == 0, "vision head_dim ", head_dim,
             " must be a positive multiple of 4 (2D RoPE: a quarter per axis and half)");
  const int rot_dim = head_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(rot_dim / 2));
  for (int j = 0; j < rot_dim / 2; ++j)
    inv_freq[j] =
        round_bf16(1.0f / std::pow(rope_theta, static_cast<float>(2 * j) / float(rot_dim)));
  return inv_freq;
}

int64_t vision_window_count(int64_t t, int64_t h, int64_t w, int merge_size, int window_units) {
  const int64_t h2 = h / merge_size, w2 = w / merge_size;
  return t * ((h2 + window_units - 1) / window_units) * ((w2 + window_units - 1) / window_units);
}

std::vector<int32_t> vision_window_index(const int32_t* grids, int merge_size, int window_units) {
  std::vector<int32_t> index;
  int64_t base = 0;
  for (int32_t i = 0; i < grids[0]; ++i) {
    const int64_t t = grids[1 + 3 * i], h2 = grids[2 + 3 * i] / merge_size,
                  w2 = grids[3 + 3 * i] / merge_size;
    for (int64_t f = 0; f < t; ++f)
      for (int64_t unit = 0; unit < h2 * w2; ++unit) {
        int64_t r = 0, c = 0;
        window_unit_position(unit, h2, w2, window_units, &r, &c);
        index.push_back(static_cast<int32_t>(base + f * h2 * w2 + r * w2 + c));
      }
    base += t * h2 * w2;
  }
  return index;
}

void vision_tables_host(const VisionTablesOut& out, const int32_t* grids, int capacity,
                        int64_t rows, int head_dim, const std::vector<float>& inv_freq,
                        int merge_size, int grid_side, int window_units, int window_capacity) {
  const int m = merge_size, hd = head_dim, G = grid_side;
  IRIS_CHECK(capacity >= 1 && m >= 1 && G >= 1 && hd > 0 && hd % 4 == 0 &&
                 static_cast<int>(inv_freq.size()) == hd / 4,
             "vision tables: ", capacity, " segments, merge size ", m, ", grid side ", G,
             ", head_dim ", hd, " with ", inv_freq.size(),
             " frequencies (head_dim must be a multiple of 4 with head_dim / 4 frequencies)");
  const int32_t n_images = grids[0];
  IRIS_CHECK(n_images >= 0 && n_images <= capacity, "vision tables: ", n_images,
             " images for a capacity of ", capacity, " segments");
  // Everything is checked before anything is written, so a refused call changes nothing.
  int64_t n_patches = 0, n_segments = 0;
  for (int32_t i = 0; i < n_images; ++i) {
    const int64_t t = grids[1 + 3 * i], h = grids[2 + 3 * i], w = grids[3 + 3 * i];
    IRIS_CHECK(t >= 1 && h >= 1 && w >= 1 && h % m == 0 && w % m == 0, "image grid [", t, ", ", h,
               ", ", w, "] must be positive with height and width divisible by ", m);
    // In this order no product overflows: each factor is below 2^31.
    IRIS_CHECK(h * w <= rows && t * (h * w) <= rows - n_patches, "vision padding to ", rows,
               " rows is smaller than the patches of this call (image ", i, " has grid [", t, ", ",
               h, ", ", w, "] after ", n_patches, " patches)");
    n_patches += t * h * w;
    n_segments += t;
  }
  IRIS_CHECK(rows <= INT32_MAX, "vision call of ", rows, " rows: cu_seqlens are i32");
  if (rows > n_patches) ++n_segments;  // the padding rows' own segment
  IRIS_CHECK(n_segments <= capacity, "this encoder call has ", n_segments,
             " segments but the buffer holds ", capacity, " (too many images in one call)");
  IRIS_CHECK(window_units >= 0, "vision tables: window of ", window_units, " units");
  if (window_units > 0) {
    int64_t windows = rows > n_patches ? 1 : 0;
    for (int32_t i = 0; i < n_images; ++i)
      windows += vision_window_count(grids[1 + 3 * i], grids[2 + 3 * i], grids[3 + 3 * i], m,
                                     window_units);
    IRIS_CHECK(out.window_cu != nullptr && windows <= window_capacity, "this encoder call has ",
               windows, " attention windows but the buffer holds ", window_capacity);
  }

  // Per-axis tables: a row's angles depend only on its patch row or column, so the trig runs
  // once per distinct coordinate (not per patch), which keeps the host's share of a multi-image
  // encoder call small. The values are the same floats as computing them per patch.
  const int rot_dim = hd / 2, quarter = rot_dim / 2;
  std::vector<float> axis_cos, axis_sin, hs, ws;
  auto axis_tables = [&](int64_t n) {
    axis_cos.resize(static_cast<size_t>(n * quarter));
    axis_sin.resize(static_cast<size_t>(n * quarter));
    for (int64_t p = 0; p < n; ++p)
      for (int j = 0; j < quarter; ++j) {
        const float f = static_cast<float>(p) * inv_freq[j];
        axis_cos[p * quarter + j] = std::cos(f);
        axis_sin[p * quarter + j] = std::sin(f);
      }
  };
  const size_t seg = static_cast<size_t>(quarter) * sizeof(float);
  int64_t row = 0, k = 0, kw = 0;
  out.cu_seqlens[0] = 0;
  if (window_units > 0) out.window_cu[0] = 0;
  for (int32_t i = 0; i < n_images; ++i) {
    const int64_t t = grids[1 + 3 * i], h = grids[2 + 3 * i], w = grids[3 + 3 * i];
    const int64_t h2 = h / m, w2 = w / m;
    torch_linspace(0.0f, float(G - 1), h, hs);
    torch_linspace(0.0f, float(G - 1), w, ws);
    axis_tables(std::max(h, w));
    for (int64_t f = 0; f < t; ++f) {
      for (int64_t unit = 0; unit < h2 * w2; ++unit) {
        int64_t br = unit / w2, bc = unit % w2;
        if (window_units > 0) {
          window_unit_position(unit, h2, w2, window_units, &br, &bc);
          // A window ends after its last unit (the next unit starts another window or frame).
          int64_t nbr = 0, nbc = 0;
          if (unit + 1 < h2 * w2) window_unit_position(unit + 1, h2, w2, window_units, &nbr, &nbc);
          const bool window_ends = unit + 1 == h2 * w2 || nbr / window_units != br / window_units ||
                                   nbc / window_units != bc / window_units;
          if (window_ends) out.window_cu[++kw] = static_cast<int32_t>(row + int64_t{m} * m);
        }
        for (int ir = 0; ir < m; ++ir)
          for (int ic = 0; ic < m; ++ic, ++row) {
            const int64_t r = br * m + ir, c = bc * m + ic;
            // 2D RoPE: the first quarter-pairs rotate with the row, the next with the column,
            // and the second half repeats the first.
            float* cr = out.cos + row * hd;
            float* sr = out.sin + row * hd;
            for (int half : {0, rot_dim}) {
              std::memcpy(cr + half, &axis_cos[r * quarter], seg);
              std::memcpy(sr + half, &axis_sin[r * quarter], seg);
              std::memcpy(cr + half + quarter, &axis_cos[c * quarter], seg);
              std::memcpy(sr + half + quarter, &axis_sin[c * quarter], seg);
            }
            // Bilinear corners of the learned grid.
            const int h0 = static_cast<int>(hs[r]), w0 = static_cast<int>(ws[c]);
            const int h1 = std::min(h0 + 1, G - 1), w1 = std::min(w0 + 1, G - 1);
            const float dh = hs[r] - static_cast<float>(h0);
            const float dw = ws[c] - static_cast<float>(w0);
            int32_t* pi = out.pos_index + row * 4;
            float* pw = out.pos_weight + row * 4;
            pi[0] = h0 * G + w0;
            pi[1] = h0 * G + w1;
            pi[2] = h1 * G + w0;
            pi[3] = h1 * G + w1;
            pw[0] = (1.0f - dh) * (1.0f - dw);
            pw[1] = (1.0f - dh) * dw;
            pw[2] = dh * (1.0f - dw);
            pw[3] = dh * dw;
          }
      }
      out.cu_seqlens[++k] = static_cast<int32_t>(row);
    }
  }
  // Padding rows rotate by nothing and add nothing of the position embedding.
  std::fill(out.cos + n_patches * hd, out.cos + rows * hd, 1.0f);
  std::fill(out.sin + n_patches * hd, out.sin + rows * hd, 0.0f);
  std::fill(out.pos_index + n_patches * 4, out.pos_index + rows * 4, 0);
  std::fill(out.pos_weight + n_patches * 4, out.pos_weight + rows * 4, 0.0f);
  if (rows > n_patches) out.cu_seqlens[++k] = static_cast<int32_t>(rows);
  // Zero-length segments up to the capacity, so that the segment count is a constant.
  std::fill(out.cu_seqlens + k + 1, out.cu_seqlens + capacity + 1, out.cu_seqlens[k]);
  if (window_units > 0) {
    if (rows > n_patches) out.window_cu[++kw] = static_cast<int32_t>(rows);
    std::fill(out.window_cu + kw + 1, out.window_cu + window_capacity + 1, out.window_cu[kw]);
  }
  out.real_rows[0] = static_cast<int32_t>(n_patches);
}

}  // namespace iris
