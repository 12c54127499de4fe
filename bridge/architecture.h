// The model registry: one Architecture per Qwen-VL family, each in a file of its own
// (bridge/arch_<family>.cpp), picked by config.json's model_type. An architecture says what is
// its own: its config fields and their checks, its HF tensor table (import and export), its
// vision tower (vision/tower_<family>.cpp) and the preprocessing defaults of its checkpoints.
// The joined model, the decoder, training and graph capture are shared and read only what the
// architecture filled in (ModelConfig, the tensors it declared).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace iris {

struct ModelConfig;
struct ModelWeights;
struct PreprocessorConfig;

// An architecture's tensor table as it is declared: each Iris tensor is planned with its shape
// and bound to the HF tensors stored in it (several, stacked along rows, for fused projections).
class WeightTable {
 public:
  explicit WeightTable(ModelWeights& weights) : w_(weights) {}
  // A tensor of its own under one HF name; hf_shape when the file stores it in another shape
  // (a Conv3d kernel, which Iris holds flattened).
  void add(const std::string& hf_name, Tensor& dst, std::vector<int64_t> dims,
           std::vector<int64_t> hf_shape = {});
  // A tensor that several HF tensors are stacked in along rows: plan it, then bind each part.
  void add_stacked(Tensor& dst, std::vector<int64_t> dims);
  void part(const std::string& hf_name, std::vector<int64_t> hf_shape, Tensor& dst,
            int64_t row_offset);
  // prefix.weight [n, k] and prefix.bias [n].
  void linear(const std::string& prefix, Tensor& w, Tensor& b, int64_t n, int64_t k);
  // prefix.weight [n] and, where the norm has one (b not null), prefix.bias [n].
  void norm(const std::string& prefix, Tensor& w, Tensor* b, int64_t n);

  const std::vector<std::pair<Tensor*, std::vector<int64_t>>>& planned() const { return planned_; }

 private:
  ModelWeights& w_;
  std::vector<std::pair<Tensor*, std::vector<int64_t>>> planned_;
};

class Architecture {
 public:
  virtual ~Architecture() = default;
  // config.json's model_type, the HF class its checkpoints are saved as, and the name users know.
  virtual const char* model_type() const = 0;
  virtual const char* hf_class() const = 0;
  virtual const char* display_name() const = 0;
  // Fills cfg from config.json (its model_type already matched), every value typed and
  // range-checked; errors name `src` and the field.
  virtual void read_config(const nlohmann::json& j, ModelConfig& cfg,
                           const std::string& src) const = 0;
  // The HF tensor table, in checkpoint order.
  virtual void declare_weights(const ModelConfig& cfg, ModelWeights& w, WeightTable& t) const = 0;
  // preprocessor_config.json's values for a checkpoint that has none.
  virtual PreprocessorConfig default_preprocessor(const ModelConfig& cfg) const = 0;
};

// The preprocessing of the Qwen2-VL and Qwen2.5-VL checkpoints: CLIP's mean and std, 14-pixel
// patches, 56^2 to 28^2 x 16384 pixels.
PreprocessorConfig clip_preprocessor();

const Architecture& qwen3_vl_architecture();
const Architecture& qwen2_5_vl_architecture();
const Architecture& qwen2_vl_architecture();

// Every architecture Iris loads, in the order the docs list them.
const std::vector<const Architecture*>& architectures();
// The architecture of config.json's model_type; an unknown one is an error that names `src`
// and the supported model types.
const Architecture& architecture_for(const std::string& model_type, const std::string& src);

}  // namespace iris
