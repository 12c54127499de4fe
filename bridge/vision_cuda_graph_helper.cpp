#include "bridge/vision_cuda_graph_helper.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <utility>

#include "bridge/joined_model.h"
#include "bridge/qwen3vl_model.h"
#include "language/decoder.h"
#include "language/mrope.h"
#include "vision/vision_tower_order.h"

namespace iris {

PaddedVisionCall plan_padded_vision_call(const VisionConfig& model, const VisionGraphConfig& graphs,
                                         const std::vector<GridTHW>& grids, int segment_capacity) {
  PaddedVisionCall call;
  call.n_patches = count_patches(grids);
  IRIS_CHECK(call.n_patches > 0, "a vision call needs at least one image with patches");
  call.bucket = choose_vision_bucket(graphs, call.n_patches);
  if (call.bucket) call.call = plan_vision_call(model, grids, *call.bucket, segment_capacity);
  return call;
}

VisionCudaGraphHelper::VisionCudaGraphHelper(Qwen3VLModel& model, const PipelineStage& stage,
                                             const GraphConfigs& cfg, GraphApi& api,
                                             const GraphHelperOptions& options)
    : model_(&model),
      backend_(model.backend()),
      stage_(stage),
      cfg_(cfg),
      api_(&api),
      decoder_(&model.decoder()),
      warmup_steps_(cfg.language.warmup_steps) {
  init(options);
}

VisionCudaGraphHelper::VisionCudaGraphHelper(Qwen3VLModel& model, const PipelineStage& stage,
                                             const GraphConfigs& cfg,
                                             const GraphHelperOptions& options)
    : model_(&model),
      backend_(model.backend()),
      stage_(stage),
      cfg_(cfg),
      owned_api_(make_graph_api(model.backend())),
      api_(owned_api_.get()),
      decoder_(&model.decoder()),
      warmup_steps_(cfg.language.warmup_steps) {
  init(options);
}

void VisionCudaGraphHelper::init(const GraphHelperOptions& options) {
  validate_stage(model_->config(), stage_);
  IRIS_CHECK(warmup_steps_ >= 0, "cuda_graph_warmup_steps ", warmup_steps_, " must be >= 0");
  if (stage_.has_vision) encoder_ = &model_->vision();
  vision_active_ = encoder_ != nullptr && cfg_.vision.impl == VisionGraphImpl::local;
  if (vision_active_) {
    const VisionGraphConfig& v = cfg_.vision;
    IRIS_CHECK(!v.buckets.empty(),
               "vision CUDA graphs have no buckets: call finalize_graph_configs() before building "
               "the graph helper");
    const int unit = encoder_->config().merge_unit();
    for (int64_t rows : v.buckets) {
      IRIS_CHECK(rows % unit == 0, "vision_cuda_graph_buckets entry ", rows,
                 " is not a multiple of ", unit,
                 " (the merge window): every graph runs the patch mergers");
      // Every bucket replays in the encoder's own buffers, so the encoder must already be
      // planned for the largest one; a bucket never allocates.
      IRIS_CHECK(rows <= encoder_->max_rows(), "vision_cuda_graph_buckets entry ", rows,
                 " exceeds the ", encoder_->max_rows(),
                 " patch rows the vision encoder was planned for; raise "
                 "ModelLimits::max_vision_patches to at least ",
                 v.buckets.back(), " or lower max_vision_cuda_graph_seq_length");
      buckets_.emplace_back();
      buckets_.back().rows = rows;
    }
  }
  decoder_active_ = cfg_.language.impl == GraphImpl::local &&
                    cfg_.language.inference_scope != InferenceGraphScope::none;
  if (options.capture_at_startup) capture_now();
}

VisionCudaGraphHelper::~VisionCudaGraphHelper() {
  delete_graphs();
  if (model_ != nullptr) model_->detach_graphs(this);
}

void VisionCudaGraphHelper::require_model() const {
  IRIS_CHECK(model_ != nullptr, "the model of this CUDA graph helper (", stage_.describe(),
             ") was destroyed");
}

// ---- vision ----

VisionCudaGraphHelper::BucketGraph& VisionCudaGraphHelper::bucket_graph(int64_t rows) {
  for (BucketGraph& b : buckets_)
    if (b.rows == rows) return b;
  IRIS_FAIL("no vision graph bucket of ", rows, " rows");
}

namespace {
// A vision call through one graph per block: each block's graph replayed (or captured, on the
// first call) in the tower's order, the embedding, the DeepStack mergers and the main merger
// eagerly around them.
class BlockGraphSteps final : public VisionTowerSteps {
 public:
  BlockGraphSteps(VisionEncoder& encoder, int64_t rows, std::function<void(int)> block_graph)
      : encoder_(encoder), rows_(rows), block_graph_(std::move(block_graph)) {}
  void embed() override { encoder_.run_embed(rows_); }
  void block(int l) override { block_graph_(l); }
  void deepstack_merger(int k, int) override { encoder_.run_deepstack_merger(k, rows_); }
  void merger() override { encoder_.run_merger(rows_); }

 private:
  VisionEncoder& encoder_;
  int64_t rows_;
  std::function<void(int)> block_graph_;
};
}  // namespace

void VisionCudaGraphHelper::run_bucket(BucketGraph& b) {
  // The segment count is part of the graph, so every call runs with the full capacity; unused
  // segments are empty (their cu_seqlens entries repeat the last offset).
  const int segments = encoder_->max_segments();
  const bool per_layer = cfg_.vision.inference_scope == VisionGraphScope::layer;
  if (b.captured() && !per_layer) {
    b.graphs[0].launch();
    return;
  }
  if (!b.captured() && b.eager_runs < warmup_steps_) {
    ++b.eager_runs;
    b.out = encoder_->run(b.rows, segments);
    return;
  }
  if (!per_layer) {
    b.graphs.push_back(
        capture_and_run(*api_, backend_, str_cat("vision bucket ", b.rows, ", ", stage_.describe()),
                        [this, &b, segments] { b.out = encoder_->run(b.rows, segments); }));
    return;
  }
  const bool capture = !b.captured();
  BlockGraphSteps steps(*encoder_, b.rows, [this, &b, segments, capture](int l) {
    if (!capture) {
      b.graphs[static_cast<size_t>(l)].launch();
      return;
    }
    b.graphs.push_back(capture_and_run(
        *api_, backend_, str_cat("vision bucket ", b.rows, " block ", l, ", ", stage_.describe()),
        [this, &b, segments, l] { encoder_->run_block(l, b.rows, segments); }));
  });
  vision_tower_forward(encoder_->config(), steps);
  b.out = encoder_->output(b.rows);
}

VisionEncoder::Output VisionCudaGraphHelper::encode(const VisionPixels& pixels,
                                                    const std::vector<GridTHW>& grids) {
  require_model();
  IRIS_CHECK(encoder_ != nullptr, "encode() on pipeline ", stage_.describe(),
             ", which holds no vision encoder; the stage with the encoder encodes images");
  last_bucket_ = 0;
  last_launch_ms_ = 0;
  if (!vision_active_ || vision_deleted_) return encoder_->encode(pixels, grids);
  const PaddedVisionCall call =
      plan_padded_vision_call(encoder_->config(), cfg_.vision, grids, encoder_->max_segments());
  if (!call.bucket) {
    IRIS_CHECK(cfg_.vision.overflow == VisionGraphOverflow::eager, "a vision call of ",
               call.n_patches, " patches exceeds the largest CUDA graph bucket (",
               cfg_.vision.buckets.back(),
               ") and vision_cuda_graph_overflow is error; raise "
               "max_vision_cuda_graph_seq_length, add a bucket of at least ",
               call.n_patches,
               " to vision_cuda_graph_buckets, or set vision_cuda_graph_overflow: "
               "eager");
    if (overflow_calls_++ == 0)
      std::fprintf(stderr,
                   "warning: a vision call of %lld patches exceeds the largest CUDA graph bucket "
                   "(%lld); it and any later such call run eagerly (raise "
                   "max_vision_cuda_graph_seq_length to graph them)\n",
                   static_cast<long long>(call.n_patches),
                   static_cast<long long>(cfg_.vision.buckets.back()));
    return encoder_->encode(pixels, grids);
  }
  encoder_->upload(pixels, grids, *call.bucket);
  BucketGraph& b = bucket_graph(*call.bucket);
  const bool replay = b.captured();
  const auto launch_start = std::chrono::steady_clock::now();
  run_bucket(b);
  if (replay)
    last_launch_ms_ =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - launch_start)
            .count();
  last_bucket_ = b.rows;
  const int64_t real = call.n_patches / encoder_->config().merge_unit();
  VisionEncoder::Output out;
  out.embeds = b.out.embeds.slice(0, real);
  for (const Tensor& d : b.out.deepstack) out.deepstack.push_back(d.slice(0, real));
  return out;
}

// ---- decoder ----

namespace {
// A decode step through one graph per layer: each layer's graph replayed (or captured, on the
// first call) in the joined order, the embedding and the head eagerly around them.
class LayerGraphDecode final : public DecodeSteps {
 public:
  LayerGraphDecode(TextDecoder& decoder, std::function<void(int)> layer_graph)
      : DecodeSteps(decoder, true), layer_graph_(std::move(layer_graph)) {}
  void layer(int l) override { layer_graph_(l); }

 private:
  std::function<void(int)> layer_graph_;
};
}  // namespace

void VisionCudaGraphHelper::run_decoder_eager() {
  DecodeSteps step(*decoder_, true);
  joined_forward(model_->config(), stage_, step);
}

void VisionCudaGraphHelper::capture_decoder() {
  // Built aside and kept only when complete, so that a failed capture leaves no partial set.
  std::vector<CapturedGraph> graphs;
  if (cfg_.language.inference_scope == InferenceGraphScope::block) {
    graphs.push_back(capture_and_run(*api_, backend_, str_cat("decoder block, ", stage_.describe()),
                                     [this] { run_decoder_eager(); }));
  } else {
    LayerGraphDecode step(*decoder_, [this, &graphs](int l) {
      graphs.push_back(capture_and_run(*api_, backend_,
                                       str_cat("decoder layer ", l, ", ", stage_.describe()),
                                       [this, l] { decoder_->layer(l, 1); }));
    });
    joined_forward(model_->config(), stage_, step);
  }
  decoder_graphs_ = std::move(graphs);
}

void VisionCudaGraphHelper::decode_stage() {
  require_model();
  if (!decoder_active_ || decoder_deleted_) {
    run_decoder_eager();
    return;
  }
  if (decoder_graphs_.empty()) {
    if (decoder_eager_runs_ < warmup_steps_) {
      ++decoder_eager_runs_;
      run_decoder_eager();
    } else {
      capture_decoder();
    }
    return;
  }
  if (cfg_.language.inference_scope == InferenceGraphScope::block) {
    decoder_graphs_.front().launch();
    return;
  }
  LayerGraphDecode step(*decoder_, [this](int l) {
    decoder_graphs_[static_cast<size_t>(l - stage_.first_layer)].launch();
  });
  joined_forward(model_->config(), stage_, step);
}

int32_t VisionCudaGraphHelper::greedy_token() {
  require_model();
  IRIS_CHECK(stage_.has_head, "greedy_token() on pipeline ", stage_.describe(),
             ", which has no LM head; read it on the last stage");
  int32_t token = 0;
  backend_.read(&token, DType::i32, decoder_->next_tokens(1));
  return token;
}

// ---- capture at start-up ----

// Warmup lets state that is created lazily on first use (GEMM plans) be created outside a
// capture; one eager run on the dummy inputs does that, so more would only delay start-up.

void VisionCudaGraphHelper::capture_now() {
  require_model();
  if (vision_active_ && !vision_deleted_) {
    const float no_pixels = 0.0f;
    for (BucketGraph& b : buckets_) {
      if (b.captured()) continue;
      // An all-padding call: one segment of zero rows, which is all a capture needs.
      encoder_->upload(&no_pixels, {}, b.rows);
      if (b.eager_runs < std::min(warmup_steps_, 1)) run_bucket(b);
      b.eager_runs = std::max(b.eager_runs, warmup_steps_);
      run_bucket(b);
    }
  }
  if (decoder_active_ && !decoder_deleted_ && decoder_graphs_.empty()) {
    // A dummy step on the cache's last row: a prompt reads that row only after writing it, so
    // capturing at any time leaves every cached token intact.
    const TextConfig& tc = decoder_->config();
    std::vector<float> cos(static_cast<size_t>(tc.head_dim)), sin(cos.size());
    mrope_tables_1d(tc, 0, 1, cos.data(), sin.data());
    const int32_t token = 0;
    decoder_->upload_step(&token, cos.data(), sin.data(), 1, decoder_->limits().max_context - 1);
    if (decoder_eager_runs_ < std::min(warmup_steps_, 1)) run_decoder_eager();
    decoder_eager_runs_ = std::max(decoder_eager_runs_, warmup_steps_);
    capture_decoder();
  }
}

// ---- state and deletion ----

bool VisionCudaGraphHelper::capture_finished(GraphSet set) const {
  if (set == GraphSet::vision)
    return !vision_active_ || vision_deleted_ ||
           std::all_of(buckets_.begin(), buckets_.end(),
                       [](const BucketGraph& b) { return b.captured(); });
  return !decoder_active_ || decoder_deleted_ || !decoder_graphs_.empty();
}

bool VisionCudaGraphHelper::capture_finished() const {
  return capture_finished(GraphSet::vision) && capture_finished(GraphSet::decoder);
}

size_t VisionCudaGraphHelper::graph_count(GraphSet set) const {
  if (set == GraphSet::decoder) return decoder_graphs_.size();
  size_t n = 0;
  for (const BucketGraph& b : buckets_) n += b.graphs.size();
  return n;
}

bool VisionCudaGraphHelper::graphs_created(GraphSet set) const {
  return graph_count(set) > 0;
}

bool VisionCudaGraphHelper::graphs_created() const {
  return graphs_created(GraphSet::vision) || graphs_created(GraphSet::decoder);
}

void VisionCudaGraphHelper::delete_graphs(GraphSet set) noexcept {
  if (set == GraphSet::vision) {
    for (BucketGraph& b : buckets_) {
      b.graphs.clear();
      b.out = {};
    }
    vision_deleted_ = true;
  } else {
    decoder_graphs_.clear();
    decoder_deleted_ = true;
  }
}

void VisionCudaGraphHelper::delete_graphs() noexcept {
  delete_graphs(GraphSet::vision);
  delete_graphs(GraphSet::decoder);
}

void VisionCudaGraphHelper::model_destroyed() noexcept {
  delete_graphs();
  model_ = nullptr;
  encoder_ = nullptr;
  decoder_ = nullptr;
}

// ---- routing for Qwen3VLModel ----

VisionEncoder::Output encode_with_graph_helpers(const std::vector<VisionCudaGraphHelper*>& helpers,
                                                VisionEncoder& eager, const VisionPixels& pixels,
                                                const std::vector<GridTHW>& grids) {
  VisionCudaGraphHelper* owner = nullptr;
  for (VisionCudaGraphHelper* h : helpers) {
    if (!h->stage().has_vision) continue;
    IRIS_CHECK(owner == nullptr, "two attached CUDA graph helpers own the vision encoder (",
               owner->stage().describe(), " and ", h->stage().describe(), ")");
    owner = h;
  }
  return owner != nullptr ? owner->encode(pixels, grids) : eager.encode(pixels, grids);
}

void decode_step_with_graph_helpers(const std::vector<VisionCudaGraphHelper*>& helpers) {
  IRIS_CHECK(!helpers.empty(), "decode through CUDA graph helpers needs at least one");
  std::vector<VisionCudaGraphHelper*> order(helpers);
  std::sort(order.begin(), order.end(),
            [](const auto* a, const auto* b) { return a->stage().index < b->stage().index; });
  const int count = order.front()->stage().count;
  IRIS_CHECK(static_cast<int>(order.size()) == count, "the model has ", order.size(),
             " CUDA graph helpers attached for a split into ", count,
             " pipeline stages; attach one helper per stage");
  int next_layer = 0;
  for (int i = 0; i < count; ++i) {
    const PipelineStage& s = order[static_cast<size_t>(i)]->stage();
    IRIS_CHECK(s.index == i && s.count == count && s.first_layer == next_layer,
               "the attached CUDA graph helpers do not form one pipeline split: expected stage ", i,
               "/", count, " starting at layer ", next_layer, ", got ", s.describe());
    next_layer = s.end_layer;
  }
  for (VisionCudaGraphHelper* h : order) h->decode_stage();
}

}  // namespace iris
