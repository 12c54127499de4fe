#include "language/mrope.h"

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/error.h"
#include "core/text_rope_tables.h"

namespace iris {
namespace {

// Which axis (0 = T, 1 = H, 2 = W) owns frequency j in the interleaved layout.
int interleaved_axis(const TextConfig& cfg, int j) {
  if (j % 3 == 1 && j < 3 * cfg.mrope_section[1]) return 1;
  if (j % 3 == 2 && j < 3 * cfg.mrope_section[2]) return 2;
  return 0;
}

// The contiguous layout (Qwen2-VL, Qwen2.5-VL): the first mrope_section[0] frequencies follow T,
// the next mrope_section[1] H, the rest W.
int contiguous_axis(const TextConfig& cfg, int j) {
  if (j < cfg.mrope_section[0]) return 0;
  return j < cfg.mrope_section[0] + cfg.mrope_section[1] ? 1 : 2;
}

}  // namespace

// The inverse frequencies are rounded to bf16: HF keeps them in a non-persistent buffer that is
// cast with the model, so a checkpoint saved and run through model.to(bfloat16) (as the released
// weights and our goldens were) rotates with bf16-rounded frequencies. Unrounded f32 frequencies
// drift from HF by ~1e-3 at position 15 already (measured on the tiny fixture).
std::vector<float> mrope_inv_freq(const TextConfig& cfg) {
  const int half = cfg.head_dim / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int j = 0; j < half; ++j)
    inv[j] = round_bf16(1.0f /
                        std::pow(cfg.rope_theta, static_cast<float>(2 * j) / float(cfg.head_dim)));
  return inv;
}

std::vector<int> mrope_pair_axes(const TextConfig& cfg) {
  std::vector<int> axis(static_cast<size_t>(cfg.head_dim / 2));
  for (int j = 0; j < cfg.head_dim / 2; ++j)
    axis[static_cast<size_t>(j)] =
        cfg.mrope_interleaved ? interleaved_axis(cfg, j) : contiguous_axis(cfg, j);
  return axis;
}

void mrope_positions_token_major(const int64_t* pos, int64_t n, int32_t* out) {
  for (int64_t t = 0; t < n; ++t)
    for (int a = 0; a < 3; ++a) {
      const int64_t p = pos[a * n + t];
      IRIS_CHECK(p >= INT32_MIN && p <= INT32_MAX, "position ", p, " of token ", t,
                 " is outside 32 bits");
      out[t * 3 + a] = static_cast<int32_t>(p);
    }
}

void mrope_tables(const TextConfig& cfg, const int64_t* pos, int64_t n, float* cos, float* sin) {
  // As Backend::text_rope_tables reads them, so that both compute the tables one way.
  std::vector<int32_t> token_major(static_cast<size_t>(3 * n));
  mrope_positions_token_major(pos, n, token_major.data());
  text_rope_tables_host(cos, sin, token_major.data(), n, cfg.head_dim, mrope_inv_freq(cfg),
                        mrope_pair_axes(cfg));
}

void mrope_tables_1d(const TextConfig& cfg, int64_t first, int64_t n, float* cos, float* sin) {
  std::vector<int64_t> pos(static_cast<size_t>(3 * n));
  for (int a = 0; a < 3; ++a)
    for (int64_t t = 0; t < n; ++t) pos[a * n + t] = first + t;
  mrope_tables(cfg, pos.data(), n, cos, sin);
}

}  // namespace iris
