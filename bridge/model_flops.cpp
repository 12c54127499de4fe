#include "bridge/model_flops.h"

#include "core/vision_tables.h"

namespace iris {

ForwardFlops vision_tower_flops(const VisionConfig& v, const std::vector<GridTHW>& grids) {
  const double D = v.hidden_size, I = v.intermediate_size;
  // The MLP's first projection is mlp_up_width wide (twice I when gated), its second I.
  const double up = static_cast<double>(v.tower->mlp_up_width(v));
  const double per_row = 2 * (4 * D * D + D * up + D * I);
  ForwardFlops f;
  for (const GridTHW& g : grids) {
    const double frame = static_cast<double>(g[1] * g[2]), rows = static_cast<double>(g[0]) * frame;
    f.gemm += 2 * rows * v.patch_dim() * D + v.depth * rows * per_row;
    // Sum over segments of 4 * n^2 * D: whole frames, or the windows of a windowed block.
    const double frames_att = 4 * rows * frame * D;
    double windows_att = frames_att;
    if (v.window_units() > 0) {
      const int64_t m = v.spatial_merge_size, units = v.window_units();
      const int64_t h2 = g[1] / m, w2 = g[2] / m;
      windows_att = 0;
      for (int64_t wy = 0; wy * units < h2; ++wy)
        for (int64_t wx = 0; wx * units < w2; ++wx) {
          const double n = static_cast<double>(std::min(units, h2 - wy * units) *
                                               std::min(units, w2 - wx * units) * m * m);
          windows_att += 4 * n * n * D * static_cast<double>(g[0]);
        }
    }
    for (int l = 0; l < v.depth; ++l) f.attention += v.windowed_block(l) ? windows_att : frames_att;
  }
  return f;
}

double merger_flops(const VisionConfig& v, int64_t patches) {
  const double M = v.merged_dim(), out = v.out_hidden_size;
  const double merged = static_cast<double>(patches) / v.merge_unit();
  return (1.0 + static_cast<double>(v.deepstack_visual_indexes.size())) * 2 * merged *
         (M * M + M * out);
}

double active_mlp_params(const TextConfig& t) {
  const double H = t.hidden_size, I = t.intermediate_size;
  const double sparse = H * t.num_experts + static_cast<double>(t.num_experts_per_tok) * 3 * H *
                                                t.moe_intermediate_size;
  double params = 0;
  for (int l = 0; l < t.num_hidden_layers; ++l) params += t.sparse_layer(l) ? sparse : 3 * H * I;
  return params;
}

ForwardFlops decoder_flops(const TextConfig& t, double T, double past, double logit_rows) {
  const double H = t.hidden_size, q = t.q_width(), kv = t.kv_width();
  ForwardFlops f;
  f.gemm = 2 * T * (t.num_hidden_layers * (H * (q + 2 * kv) + q * H) + active_mlp_params(t)) +
           2 * logit_rows * H * t.vocab_size;
  f.attention = t.num_hidden_layers * 4 * q * (T * past + T * (T + 1) / 2);
  return f;
}

}  // namespace iris
