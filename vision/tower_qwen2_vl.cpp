// Qwen2-VL's vision tower: LayerNorm blocks, an fc1 -> quick_gelu -> fc2 MLP with biases, a
// patch embedding without bias and no learned position embedding.
#include "vision/vision_encoder.h"
#include "vision/vision_tower.h"

namespace iris {
namespace {

class Qwen2VLTower final : public VisionTower {
 public:
  const char* family() const override { return "qwen2_vl"; }
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
    be.linear(up, x, w.fc1_w, w.fc1_b, false);
    be.quick_gelu(act, up);
  }
  void mlp_activation(Backend& be, const Tensor& act, const Tensor& up) const override {
    be.quick_gelu(act, up);
  }
  void mlp_activation_backward(Backend& be, const Tensor& dup, const Tensor& dact,
                               const Tensor& up) const override {
    be.quick_gelu_backward(dup, dact, up);
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

const VisionTower& qwen2_vl_vision_tower() {
  static const Qwen2VLTower tower;
  return tower;
}

}  // namespace iris
