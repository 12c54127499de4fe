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

struct LoraAdapters;
struct LoraConfig;
struct ModelConfig;
struct ModelWeights;
struct PreprocessorConfig;
struct ResizedSize;
struct VideoClip;
struct VideoProcessorConfig;
struct VisionRun;

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
  // The LoRA adapters (cfg.lora) of a projection of `in` inputs that fuses the HF modules
  // prefix + name, each with its rows, in order: prefix + name + ".lora_A.weight" [r, in] and
  // ".lora_B.weight" [rows, r] for each module cfg.lora adapts; none for the others.
  void lora(const LoraConfig& lora, const std::string& prefix,
            const std::vector<std::pair<std::string, int64_t>>& modules, int64_t in,
            LoraAdapters& dst);

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

  // Video, as the family's HF video processor and processor handle it (spec 2.6, 2.7, 8.4, 8.5).
  // The video processor's defaults, under the checkpoint's video_preprocessor_config.json.
  virtual VideoProcessorConfig default_video_preprocessor(const ModelConfig& cfg) const = 0;
  // The frames kept of a video of `total_frames` at `video_fps` (0: unknown), ascending.
  virtual std::vector<int64_t> sample_video_frames(int64_t total_frames, double video_fps,
                                                   const VideoProcessorConfig& vc) const = 0;
  // The size every kept frame is resized to.
  virtual ResizedSize video_frame_size(int64_t n_frames, int height, int width,
                                       const VideoProcessorConfig& vc) const = 0;
  // The prompt text that replaces the chat template's <|vision_start|><|video_pad|><|vision_end|>
  // for this video; each <|video_pad|> in it stands for one of video_runs' runs, in order.
  virtual std::string video_prompt_text(const VideoClip& clip) const = 0;
  virtual std::vector<VisionRun> video_runs(const VideoClip& clip,
                                            const ModelConfig& cfg) const = 0;
};

// The preprocessing of the Qwen2-VL and Qwen2.5-VL checkpoints: CLIP's mean and std, 14-pixel
// patches, 56^2 to 28^2 x 16384 pixels.
PreprocessorConfig clip_preprocessor();
// The video processor of Qwen2-VL and Qwen2.5-VL (transformers' Qwen2VLVideoProcessor): CLIP's
// mean and std, 128 x 28^2 to 768 x 28^2 pixels a frame, 4 to 768 frames. transformers keeps every
// frame unless asked to sample; Iris samples 2 frames a second, as the model cards' qwen-vl-utils
// does (fps 0 keeps every frame).
VideoProcessorConfig qwen2_video_preprocessor(const ModelConfig& cfg);
// The frame-pair runs of the Qwen2 families: one run for the whole video, its temporal slices
// `temporal_step` positions apart.
std::vector<VisionRun> whole_video_run(const VideoClip& clip, const ModelConfig& cfg,
                                       int64_t temporal_step);

const Architecture& qwen3_vl_architecture();
const Architecture& qwen2_5_vl_architecture();
const Architecture& qwen2_vl_architecture();
const Architecture& qwen3_vl_moe_architecture();

// Every architecture Iris loads, in the order the docs list them.
const std::vector<const Architecture*>& architectures();
// The architecture of config.json's model_type; an unknown one is an error that names `src`
// and the supported model types.
const Architecture& architecture_for(const std::string& model_type, const std::string& src);

}  // namespace iris
