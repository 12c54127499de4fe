#include "language/mrope.h"

#include <cmath>

#include "core/dtype.h"

namespace iris {
namespace {

// The inverse frequencies are rounded to bf16: HF keeps them in a non-persistent buffer that is
// cast with the model, so a checkpoint saved and run through model.to(bfloat16) (as the released
// weights and our goldens were) rotates with bf16-rounded frequencies. Unrounded f32 frequencies
// drift from HF by ~1e-3 at position 15 already (measured on the tiny fixture).
std::vector<float> inv_freq_bf16(const TextConfig& cfg) {
  const int half = cfg.head_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int j = 0; j < half; ++j)
    inv[j] = round_bf16(1.0f /
                        std::pow(cfg.rope_theta, static_cast<float>(2 * j) / float(cfg.head_dim)));
  return inv;
}

// Which axis (0 = T, 1 = H, 2 = W) owns frequency j in the interleaved layout.
int interleaved_axis(const TextConfig& cfg, int j) {
  if (j % 3 == 1 && j < 3 * cfg.mrope_section[1]) return 1;
  if (j % 3 == 2 && j < 3 * cfg.mrope_section[2]) return 2;
  return 0;
}

}  // namespace

std::vector<float> mrope_inv_freq(const TextConfig& cfg) {
  return inv_freq_bf16(cfg);
}

std::vector<int> mrope_pair_axes(const TextConfig& cfg) {
  std::vector<int> axis(static_cast<size_t>(cfg.head_dim / 2));
  for (int j = 0; j < cfg.head_dim / 2; ++j)
    axis[static_cast<size_t>(j)] = interleaved_axis(cfg, j);
  return axis;
}

void mrope_tables(const TextConfig& cfg, const int64_t* pos, int64_t n, float* cos, float* sin) {
  const std::vector<float> inv = mrope_inv_freq(cfg);
  const int half = cfg.head_dim / 2;
  const std::vector<int> axis = mrope_pair_axes(cfg);
  for (int64_t t = 0; t < n; ++t) {
    for (int j = 0; j < half; ++j) {
      const float f = static_cast<float>(pos[axis[j] * n + t]) * inv[j];
      const float c = std::cos(f), s = std::sin(f);
      cos[t * cfg.head_dim + j] = cos[t * cfg.head_dim + half + j] = c;
      sin[t * cfg.head_dim + j] = sin[t * cfg.head_dim + half + j] = s;
    }
  }
}

void mrope_tables_1d(const TextConfig& cfg, int64_t first, int64_t n, float* cos, float* sin) {
  std::vector<int64_t> pos(static_cast<size_t>(3 * n));
  for (int a = 0; a < 3; ++a)
    for (int64_t t = 0; t < n; ++t) pos[a * n + t] = first + t;
  mrope_tables(cfg, pos.data(), n, cos, sin);
}

}  // namespace iris
