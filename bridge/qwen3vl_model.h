// Qwen3-VL: the vision tower and the text decoder joined. Images are encoded in one call, their
// embeddings scattered over the <|image_pad|> rows of the prompt, DeepStack features added after
// the first decoder layers, and positions given by 3-row M-RoPE.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "bridge/pipeline_stage.h"
#include "bridge/rope_index.h"
#include "language/decoder.h"
#include "vision/vision_encoder.h"

namespace iris {

struct ModelLimits {
  int64_t max_context = 4096;          // KV cache rows
  int64_t max_step_tokens = 2048;      // prefill chunk
  int64_t max_vision_patches = 16384;  // patch rows of one encoder call (before the 2x2 merge)
  int max_images = 16;                 // images (or video frame pairs) in one encoder call
  bool all_logits = false;             // keep logits of every prefill row (tests)
};

// Called with the residual stream at HF's hidden_states points: index 0 = input of layer 0
// (after the vision scatter), index l (1..N-1) = output of layer l-1 before its DeepStack add,
// index N = the final norm's output. `first_row` is the chunk's offset in the prompt.
using HiddenObserver = std::function<void(int index, int64_t first_row, const Tensor& rows)>;

class VisionCudaGraphHelper;  // bridge/vision_cuda_graph_helper.h

class Qwen3VLModel {
 public:
  // Loads config.json and the safetensors weights of an HF checkpoint directory.
  Qwen3VLModel(Backend& backend, const std::string& checkpoint_dir, const ModelLimits& limits);
  // Wraps weights that already live on the backend (random init, training, export tests).
  Qwen3VLModel(Backend& backend, const ModelConfig& cfg, std::unique_ptr<ModelWeights> weights,
               const ModelLimits& limits);
  ~Qwen3VLModel();

  const ModelConfig& config() const { return cfg_; }
  const ModelLimits& limits() const { return limits_; }
  Backend& backend() const { return backend_; }
  ModelWeights& weights() { return *weights_; }
  // Of a model loaded from a checkpoint directory (zero for weights handed in).
  const WeightLoadTimes& weight_load_times() const { return weight_load_times_; }
  VisionEncoder& vision() { return *vision_; }
  TextDecoder& decoder() { return *decoder_; }

  // Encodes every image of the next prompt in one vision call (pixel rows of all images
  // concatenated, merge-window order, grids in prompt order).
  void encode_images(const VisionPixels& pixels, const std::vector<GridTHW>& grids);
  // Images and videos together, in prompt order: their pixel rows concatenated, one grid per
  // image or video, and the runs of pad tokens the prompt holds for them (image_runs, an
  // architecture's video_runs), which place them in M-RoPE. The tower attends within each
  // frame, so one call gives every item the embeddings of an encoding of its own.
  void encode_vision(const VisionPixels& pixels, const std::vector<GridTHW>& grids,
                     std::vector<VisionRun> runs);
  // Runs the prompt through the decoder from an empty cache. When the prompt holds image pads,
  // encode_images() must have been called with the matching grids.
  void prefill(const std::vector<int32_t>& ids, const HiddenObserver& observer = nullptr);
  // Runs `ids` after the n_past() tokens already in the cache (a chat's next turn), at cache row
  // n_past() and M-RoPE position next_position(), as if they had been part of one prefill with
  // the tokens before them. Image pads need encode_images() as for prefill (this call's images
  // only); the observer's rows count from the first of `ids`.
  void extend(const std::vector<int32_t>& ids, const HiddenObserver& observer = nullptr);
  // Feeds one token at the next position.
  void decode(int32_t token);
  // Forgets the cached tokens; the next prefill or extend starts at row and position 0.
  void clear_cache();
  // Keeps the first `rows` cached tokens and forgets the rest, so that the next extend continues
  // after them (a chat whose template rewrote the end of the conversation). The cut may not fall
  // inside an image.
  void truncate_cache(int64_t rows);

  int64_t n_past() const { return n_past_; }
  // The position the next token fed takes: one past the largest position of the cached tokens
  // (an image's pads take a row each but share positions, so it is not n_past()).
  int64_t next_position() const { return n_past_ + delta_; }
  // Positions of the last prefill or extend call's tokens; its delta counts from that call's
  // first token.
  const RopeIndex& rope_index() const { return rope_; }
  // Routes encode_images() and decode() through CUDA graph helpers, one per pipeline stage
  // (prefill stays eager); the helpers run the same encoder and decoder pieces as the eager path.
  // A helper detaches itself when destroyed; if the model goes first, it deletes the attached
  // helpers' graphs, which read its buffers.
  void attach_graphs(VisionCudaGraphHelper* helper);
  void detach_graphs(VisionCudaGraphHelper* helper) noexcept;

  // Logits of the last token fed, copied to the host as f32.
  std::vector<float> last_logits();
  // With limits.all_logits: logits of every prompt row, [n_prompt, vocab] on the host.
  const std::vector<float>& prompt_logits() const { return prompt_logits_; }

 private:
  void build();
  void run_rows(int64_t T, int64_t first_row, const HiddenObserver& observer);

  Backend& backend_;
  ModelConfig cfg_;
  ModelLimits limits_;
  std::unique_ptr<ModelWeights> weights_;
  WeightLoadTimes weight_load_times_;
  std::unique_ptr<VisionEncoder> vision_;
  std::unique_ptr<TextDecoder> decoder_;
  PipelineStage whole_model_;  // this model's eager passes run every part
  Arena arena_;
  Tensor scatter_index_;  // i32 [max_step_tokens]: rows of image pads inside a chunk

  std::vector<GridTHW> grids_;
  std::vector<VisionRun> runs_;
  VisionEncoder::Output vision_out_;
  int64_t vision_rows_ = 0;  // merged rows produced by the last encode_images
  RopeIndex rope_;
  int64_t n_past_ = 0;
  int64_t delta_ = 0;  // position of cache row r (r >= n_past_) is r + delta_
  // Per cached row, the position a token after it would take; -1 for an image's rows, after which
  // the cache may not be cut.
  std::vector<int64_t> next_position_after_;
  int64_t last_row_in_step_ = 0;
  std::vector<float> prompt_logits_;
  std::vector<float> cos_, sin_;  // host staging, sized once
  std::vector<int32_t> index_host_;
  std::vector<VisionCudaGraphHelper*> graphs_;
};

}  // namespace iris
