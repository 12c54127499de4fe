// Qwen2.5-VL's vision tower: RMSNorm blocks, a gated SiLU MLP with biases
// (down(silu(gate(x)) * up(x))), a patch embedding without bias and no learned position
// embedding. Its window attention is configured by VisionConfig::window_size and
// fullatt_block_indexes.
#include "vision/vision_encoder.h"
#include "vision/vision_tower.h"

namespace iris {
namespace {

class Qwen25VLTower final : public VisionTower {
 public:
  const char* family() const override { return "qwen2_5_vl"; }
  int64_t mlp_up_width(const VisionConfig& cfg) const override {
    return 2 * int64_t{cfg.intermediate_size};
  }

  void norm(Backend& be, const VisionConfig& cfg, const Tensor& y, const Tensor& mean,
            const Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b) const override {
    (void)mean;
    (void)b;
    if (rstd.defined())
      be.rms_norm_train(y, rstd, x, w, cfg.layer_norm_eps);
    else
      be.rms_norm(y, x, w, cfg.layer_norm_eps);
  }
  void norm_backward(Backend& be, const Tensor& dx, const Tensor& dw, const Tensor& db,
                     const Tensor& dy, const Tensor& x, const Tensor& mean, const Tensor& rstd,
                     const Tensor& w) const override {
    (void)db;
    (void)mean;
    be.rms_norm_backward(dx, dw, dy, x, rstd, w);
  }

  void mlp_up(Backend& be, const VisionBlockWeights& w, const Tensor& up, const Tensor& act,
              const Tensor& x) const override {
    be.linear(up, x, w.fc1_w, w.fc1_b, false);
    be.swiglu(act, up);
  }
  void mlp_activation(Backend& be, const Tensor& act, const Tensor& up) const override {
    be.swiglu(act, up);
  }
  void mlp_activation_backward(Backend& be, const Tensor& dup, const Tensor& dact,
                               const Tensor& up) const override {
    be.swiglu_backward(dup, dact, up);
  }

  void embed(Backend& be, const VisionWeights& w, const Tensor& x, const Tensor& pixels,
             const Tensor&, const Tensor&) const override {
    tower_parts::plain_patch_embedding(be, w, x, pixels);
  }
  void embed_backward(Backend& be, VisionWeights& g, const Tensor& dres, const Tensor& dres_c,
                      const Tensor& pixels, const Tensor&, const Tensor&) const override {
    tower_parts::plain_patch_embedding_backward(be, g, dres, dres_c, pixels);
  }
};

}  // namespace

const VisionTower& qwen2_5_vl_vision_tower() {
  static const Qwen25VLTower tower;
  return tower;
}

}  // namespace iris
