// CUDA graphs for one pipeline stage of Qwen3-VL inference: the vision encoder (one padded graph
// per bucket, under the vision graph config) and the decode step (under the language graph
// config). What it does better than Megatron-Bridge's VisionTECudaGraphHelper:
//  - images of a call keep their own attention segments after padding (the images' grid sizes
//    are a graph input, uploaded before every replay, and the graph's first kernel computes
//    cu_seqlens and the 2D RoPE and position tables from them), so padding never changes an
//    image's output, equal patch counts with different image boundaries never replay stale
//    segments, and the host's share of a call is the pixels and a few ints;
//  - several buckets instead of one fixed maximum, all sharing the encoder's buffers (planned
//    once for the largest bucket: a bucket allocates nothing), and an explicit overflow policy;
//  - capture and deletion never wait on other stages; a stage without a vision encoder creates
//    no vision graphs, and deleting there is a no-op rather than an error; deleting twice is
//    safe; the destructor deletes, and graphs are always destroyed before the buffers they read;
//  - after delete_graphs() a stage never captures again (a late call runs eagerly instead of
//    re-capturing during teardown, the hang of Bridge PR #5291).
//
// Graphs read the static buffers of the module they replay: vision graphs the encoder's, decoder
// graphs the decoder's (KV cache, ids, RoPE tables and past_len live there, so one decode graph
// serves every token). The helper itself allocates no device memory.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "bridge/pipeline_stage.h"
#include "core/graph_capture.h"
#include "core/graph_config.h"
#include "vision/vision_encoder.h"

namespace iris {

class Qwen3VLModel;
class TextDecoder;

// One encoder call padded for a graph: the bucket for its patches (nullopt above the largest
// bucket) and, when there is one, the call checked for bucket rows and segment_capacity segments
// (padding rows in a segment of their own).
struct PaddedVisionCall {
  int64_t n_patches = 0;
  std::optional<int64_t> bucket;
  VisionCall call;
};
PaddedVisionCall plan_padded_vision_call(const VisionConfig& model, const VisionGraphConfig& graphs,
                                         const std::vector<GridTHW>& grids, int segment_capacity);

enum class GraphSet { vision, decoder };

struct GraphHelperOptions {
  // Warm up and capture every graph of the stage in the constructor, instead of lazily on first
  // use after language.warmup_steps eager runs. It runs the encoder and a decode step on dummy
  // inputs: the KV cache rows of a prompt stay intact, but the image embeddings and the logits
  // of the last call are overwritten, so capture before encode_images() or after reading them.
  bool capture_at_startup = false;
};

class VisionCudaGraphHelper {
 public:
  // `cfg` must be finalized (finalize_graph_configs). `api` must outlive the helper; the model
  // too, unless the helper is attached to it (then the model deletes the graphs if it goes
  // first).
  VisionCudaGraphHelper(Qwen3VLModel& model, const PipelineStage& stage, const GraphConfigs& cfg,
                        GraphApi& api, const GraphHelperOptions& options = {});
  // With the graph API that fits the model's backend (CUDA graphs, or the stand-in on the CPU).
  VisionCudaGraphHelper(Qwen3VLModel& model, const PipelineStage& stage, const GraphConfigs& cfg,
                        const GraphHelperOptions& options = {});
  ~VisionCudaGraphHelper();
  VisionCudaGraphHelper(const VisionCudaGraphHelper&) = delete;
  VisionCudaGraphHelper& operator=(const VisionCudaGraphHelper&) = delete;

  // One encoder call on this stage's encoder: padded to its bucket and replayed (or run eagerly
  // during warmup, or captured), or the unpadded eager encoder when vision graphs are off,
  // deleted, or the call overflows with overflow: eager. The outputs hold the real merged rows
  // only (views into the encoder's buffers, valid until the next call).
  VisionEncoder::Output encode(const VisionPixels& pixels, const std::vector<GridTHW>& grids);

  // This stage's part of a decode step (batch 1) whose inputs TextDecoder::upload_step() wrote:
  // the embedding on stage 0, the stage's layers, and on the last stage the final norm, the LM
  // head and the on-device argmax (read it with greedy_token(); sampling reads the logits).
  void decode_stage();
  // The argmax of the last decode step's logits (last stage only).
  int32_t greedy_token();

  // Captures every graph this stage still lacks, each after one eager warmup run on dummy inputs
  // (none when warmup_steps is 0 or it already ran eagerly); see GraphHelperOptions.
  void capture_now();

  // Nothing left to capture for the set: all its graphs exist, or the stage has nothing to
  // capture there (graphs off, no encoder on this stage), or its graphs were deleted.
  bool capture_finished(GraphSet set) const;
  bool capture_finished() const;
  // At least one graph of the set exists now.
  bool graphs_created(GraphSet set) const;
  bool graphs_created() const;
  size_t graph_count(GraphSet set) const;

  // Destroys the graphs this stage created (none: no-op) and stops capturing for good; later
  // calls run eagerly. Never throws, never synchronises, safe to repeat.
  void delete_graphs(GraphSet set) noexcept;
  void delete_graphs() noexcept;

  const PipelineStage& stage() const { return stage_; }
  const Qwen3VLModel* model() const { return model_; }
  GraphApi& api() const { return *api_; }
  // Bucket of the last encode() call; 0 when it ran unpadded.
  int64_t last_bucket() const { return last_bucket_; }
  // Host milliseconds the last encode() spent launching its captured graph(s) (in the layer
  // scope with the eager glue between them); 0 when it ran eagerly. What remains of a call's
  // host time past the pixel upload is planning and the grids' upload.
  double last_launch_ms() const { return last_launch_ms_; }
  // Calls above the largest bucket that ran eagerly.
  int64_t overflow_calls() const { return overflow_calls_; }

  // Called by the model's destructor: the graphs read its buffers, so they go first.
  void model_destroyed() noexcept;

 private:
  struct BucketGraph {
    int64_t rows = 0;
    int eager_runs = 0;
    // Scope block: one graph (embedding, blocks, mergers). Scope layer: one per block, with the
    // embedding and the main merger run eagerly around them.
    std::vector<CapturedGraph> graphs;
    VisionEncoder::Output out;  // all rows/4 merged rows of the bucket
    bool captured() const { return !graphs.empty(); }
  };

  void init(const GraphHelperOptions& options);
  void require_model() const;
  BucketGraph& bucket_graph(int64_t rows);
  void run_bucket(BucketGraph& b);
  void run_decoder_eager();
  void capture_decoder();

  Qwen3VLModel* model_;
  Backend& backend_;
  PipelineStage stage_;
  GraphConfigs cfg_;
  std::unique_ptr<GraphApi> owned_api_;
  GraphApi* api_;
  VisionEncoder* encoder_ = nullptr;  // null on stages without the vision encoder
  TextDecoder* decoder_;
  int warmup_steps_;

  bool vision_active_ = false;
  bool vision_deleted_ = false;
  std::vector<BucketGraph> buckets_;
  int64_t last_bucket_ = 0;
  double last_launch_ms_ = 0;
  int64_t overflow_calls_ = 0;

  bool decoder_active_ = false;
  bool decoder_deleted_ = false;
  int decoder_eager_runs_ = 0;
  // block: one graph for the stage's whole part; layer: one per layer of the stage.
  std::vector<CapturedGraph> decoder_graphs_;
};

// Used by Qwen3VLModel when helpers are attached. The encoder call goes through the helper of
// the stage that owns the encoder (eagerly on `eager` when none does); a decode step runs every
// stage's part in order, and the helpers must form one complete split of the model.
VisionEncoder::Output encode_with_graph_helpers(const std::vector<VisionCudaGraphHelper*>& helpers,
                                                VisionEncoder& eager, const VisionPixels& pixels,
                                                const std::vector<GridTHW>& grids);
void decode_step_with_graph_helpers(const std::vector<VisionCudaGraphHelper*>& helpers);

}  // namespace iris
