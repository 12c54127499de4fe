// What one Qwen-VL family's vision tower does its own way. The tower's structure is shared
// (vision/vision_encoder.h: patch embedding, pre-norm blocks of attention and MLP with 2D RoPE,
// the 2x2 merger); each family says which norm it uses, what its MLP computes and how patches
// are embedded, in a file of its own (vision/tower_<family>.cpp). Window attention is a
// configuration (VisionConfig::window_size), not a tower of its own: the rows of an encoder call
// are then laid out in window order by the tables (core/vision_tables.h).
#pragma once

#include <cstdint>

#include "core/backend.h"
#include "vision/vision_config.h"

namespace iris {

struct VisionBlockWeights;
struct VisionWeights;

class VisionTower {
 public:
  virtual ~VisionTower() = default;
  virtual const char* family() const = 0;

  // Columns of the MLP's first projection: the activation's width (intermediate_size), or twice
  // it for a gated MLP (gate and up stacked, as the decoder's gate_up).
  virtual int64_t mlp_up_width(const VisionConfig& cfg) const = 0;

  // The blocks' norms and the merger's: y = norm(x) with weight w (and bias b where the family's
  // norm has one). Training passes rstd, and mean, to save the statistics the backward reads (an
  // RMSNorm leaves mean untouched); inference passes neither. y must not alias x in training.
  virtual void norm(Backend& be, const VisionConfig& cfg, const Tensor& y, const Tensor& mean,
                    const Tensor& rstd, const Tensor& x, const Tensor& w,
                    const Tensor& b) const = 0;
  // dx (f32, optional) += d/dx; dw and db (f32, optional) += their gradients.
  virtual void norm_backward(Backend& be, const Tensor& dx, const Tensor& dw, const Tensor& db,
                             const Tensor& dy, const Tensor& x, const Tensor& mean,
                             const Tensor& rstd, const Tensor& w) const = 0;

  // up = x . fc1_w^T + fc1_b, act = activation(up). up and act may be one tensor (inference,
  // where mlp_up_width equals the activation's width): the family may then fuse the activation
  // into the GEMM.
  virtual void mlp_up(Backend& be, const VisionBlockWeights& w, const Tensor& up, const Tensor& act,
                      const Tensor& x) const = 0;
  // act = activation(up), for recomputation.
  virtual void mlp_activation(Backend& be, const Tensor& act, const Tensor& up) const = 0;
  // Overwrites dup from dact and the forward's up; dup may alias dact where the widths agree.
  virtual void mlp_activation_backward(Backend& be, const Tensor& dup, const Tensor& dact,
                                       const Tensor& up) const = 0;

  // x = the patch embedding of the pixel rows, plus the interpolated learned position
  // embedding where the family has one (pos_index and pos_weight from Backend::vision_tables).
  virtual void embed(Backend& be, const VisionWeights& w, const Tensor& x, const Tensor& pixels,
                     const Tensor& pos_index, const Tensor& pos_weight) const = 0;
  // g's embedding gradients (+=) from dres (f32) and its compute-dtype copy dres_c.
  virtual void embed_backward(Backend& be, VisionWeights& g, const Tensor& dres,
                              const Tensor& dres_c, const Tensor& pixels, const Tensor& pos_index,
                              const Tensor& pos_weight) const = 0;
};

// Pieces that more than one family's tower is made of.
namespace tower_parts {
// LayerNorm with weight and bias (Qwen3-VL, Qwen2-VL); training saves mean and rstd.
void layer_norm(Backend& be, const VisionConfig& cfg, const Tensor& y, const Tensor& mean,
                const Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b);
// The patch embedding without bias or position embedding (Qwen2-VL, Qwen2.5-VL).
void plain_patch_embedding(Backend& be, const VisionWeights& w, const Tensor& x,
                           const Tensor& pixels);
void plain_patch_embedding_backward(Backend& be, VisionWeights& g, const Tensor& dres,
                                    const Tensor& dres_c, const Tensor& pixels);
}  // namespace tower_parts

const VisionTower& qwen3_vl_vision_tower();
const VisionTower& qwen2_5_vl_vision_tower();
const VisionTower& qwen2_vl_vision_tower();

}  // namespace iris
