#include "vision/vision_encoder.h"
#include "vision/vision_tower.h"

namespace iris::tower_parts {

void layer_norm(Backend& be, const VisionConfig& cfg, const Tensor& y, const Tensor& mean,
                const Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b) {
  if (rstd.defined())
    be.layer_norm_train(y, mean, rstd, x, w, b, cfg.layer_norm_eps);
  else
    be.layer_norm(y, x, w, b, cfg.layer_norm_eps);
}

void plain_patch_embedding(Backend& be, const VisionWeights& w, const Tensor& x,
                           const Tensor& pixels) {
  be.linear(x, pixels, w.patch_w, Tensor(), false);
}

void plain_patch_embedding_backward(Backend& be, VisionWeights& g, const Tensor& dres,
                                    const Tensor& dres_c, const Tensor& pixels) {
  be.linear_backward_weight(g.patch_w, Tensor(), in_compute_dtype(be, dres, dres_c), pixels);
}

}  // namespace iris::tower_parts
