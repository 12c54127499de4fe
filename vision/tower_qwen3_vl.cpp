// Qwen3-VL's vision tower: LayerNorm blocks, an fc1 -> gelu(tanh) -> fc2 MLP with biases, a
// biased patch embedding and a learned 48x48 position grid interpolated to each image.
#include "vision/vision_encoder.h"
#include "vision/vision_tower.h"

namespace iris {
namespace {

class Qwen3VLTower final : public VisionTower {
 public:
  const char* family() const override { return "qwen3_vl"; }
  int64_t mlp_up_width(const VisionConfig& cfg) const override { return cfg.intermediate_size; }

  void norm(Backend& be, const VisionConfig& cfg, const Tensor& y, const Tensor& mean,
            const Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b) const override {
    tower_parts::layer_norm(be, cfg, y, mean, rstd, x, w, b);
  }
  void norm_backward(Backend& be, const Tensor& dx, const Tensor& dw, const Tensor& db,
                     const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                     const Tensor& w) const override {
    be.layer_norm_backward(dx, dw, db, dy, x, mean, rstd, w);
  }

  void mlp_up(Backend& be, const VisionBlockWeights& w, const Tensor& up, const Tensor& act,
              const Tensor& x) const override {
    if (up.data == act.data) {
      // gelu_pytorch_tanh fused into fc1 (the GEMM epilogue on CUDA).
      be.linear_gelu_tanh(act, x, w.fc1_w, w.fc1_b);
      return;
    }
    be.linear(up, x, w.fc1_w, w.fc1_b, false);
    be.gelu_tanh(act, up);
  }
  void mlp_activation(Backend& be, const Tensor& act, const Tensor& up) const override {
    be.gelu_tanh(act, up);
  }
  void mlp_activation_backward(Backend& be, const Tensor& dup, const Tensor& dact,
                               const Tensor& up) const override {
    be.gelu_tanh_backward(dup, dact, up);
  }

  void embed(Backend& be, const VisionWeights& w, const Tensor& x, const Tensor& pixels,
             const Tensor& pos_index, const Tensor& pos_weight) const override {
    be.linear(x, pixels, w.patch_w, w.patch_b, false);
    be.add_interpolated_rows(x, w.pos_embed, pos_index, pos_weight);
  }
  void embed_backward(Backend& be, VisionWeights& g, const Tensor& dres, const Tensor& dres_c,
                      const Tensor& pixels, const Tensor& pos_index,
                      const Tensor& pos_weight) const override {
    if (g.pos_embed.defined())
      be.add_interpolated_rows_backward(g.pos_embed, dres, pos_index, pos_weight);
    be.linear_backward_weight(g.patch_w, g.patch_b, in_compute_dtype(be, dres, dres_c), pixels);
  }
};

}  // namespace

const VisionTower& qwen3_vl_vision_tower() {
  static const Qwen3VLTower tower;
  return tower;
}

}  // namespace iris
