// Qwen3-VL as a trainable model on any Backend: a forward that keeps every activation its backward
// needs, and the backward as an explicit, ordered list of Backend training ops (core/backend.h).
// On the CPU backend everything is fp32 and this is the oracle; on CUDA the weights the forward
// reads and the activations are bf16, while statistics, the residual-stream gradient and every
// parameter gradient are f32.
//
// A micro-batch packs several samples: their tokens are concatenated as causal segments of one
// sequence (each with its own M-RoPE positions), their images as vision segments. The gradients
// are a ModelWeights of f32 tensors on the backend with the binding table of the parameters, so
// the gradient of HF tensor X is found under the same name.
//
// Memory is planned once from TrainLimits: one arena holds every activation, the backward's
// scratch and the loss's workspace; a step allocates nothing.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "bridge/pipeline_stage.h"
#include "bridge/rope_index.h"
#include "core/arena.h"
#include "core/backend.h"
#include "core/graph_capture.h"
#include "core/graph_config.h"
#include "core/recompute.h"
#include "vision/vision_encoder.h"

namespace iris {

// One training sequence. ids and labels have the same length; labels follow HF (unshifted: the
// model predicts labels[i + 1] from position i; -100 marks tokens without a label).
// pixel_values: [n_patches, patch_dim] f32 rows of all images in prompt order (as the processor
// emits them); grids: one (t, h, w) per image.
struct TrainSample {
  std::vector<int32_t> ids, labels;
  std::vector<float> pixel_values;  // images and videos in the order their pads come
  std::vector<GridTHW> grids;
  std::vector<VisionRun> runs;  // with videos, the pad runs (Sample::runs); empty: images only
};

// The positions whose next token is labelled (HF's shift: labels[0] is never a target): the
// tokens the loss of a sample averages over.
int64_t labelled_positions(const std::vector<int32_t>& labels);

// The label slots a captured loss runs over for `labels` real labels of a micro-batch padded to
// `bucket` tokens: a graph keeps its row count, so counts share a few sizes. Multiples of 64 up
// to 512, then eighths of an octave (multiples of 64 to 1024, of 128 to 2048, ...), at most the
// bucket: a few sizes for short samples, and at most 1/8 of the lm_head's rows wasted on long
// ones (a power of two ran 2048 slots for 1,652 labels: 10 ms a step of eight 4096-token
// micro-batches of the 2B model on an H200).
int64_t loss_label_slots(int64_t labels, int64_t bucket);

struct LossStats {
  double loss_sum = 0;   // summed cross-entropy over labelled tokens
  int64_t n_tokens = 0;  // labelled tokens (mean loss = loss_sum / n_tokens)
};

// The three parts Qwen's fine-tuning scripts freeze or give their own learning rate
// (tune_mm_vision = vision tower: patch_embed, pos_embed, blocks; tune_mm_mlp = merger and
// DeepStack mergers; tune_mm_llm = the language model with its embedding and lm_head).
enum class ModelPart { vision_tower, merger, language_model };

// The part the HF tensor `hf_name` belongs to (unknown names are an error).
ModelPart model_part(const std::string& hf_name);
// The decoder layer the HF tensor `hf_name` belongs to (model.language_model.layers.N.*), or -1.
int decoder_layer(const std::string& hf_name);

// Whether pipeline stage `stage` computes (and so updates) the HF tensor `hf_name`: its decoder
// layers, the vision encoder, mergers and embedding on stage 0, the final norm and lm_head on the
// last stage, and with tied embeddings the embedding on the last stage too (as its lm_head).
bool stage_holds(const PipelineStage& stage, bool tied_embeddings, const std::string& hf_name);

struct FreezeSpec {
  bool vision_tower = false;
  bool merger = false;
  bool language_model = false;
  // PEFT's modules_to_save: modules trained in full though their part is frozen, named as PEFT
  // matches them (a module's path or its last components: merger, lm_head, embed_tokens).
  std::vector<std::string> modules_to_save;
  // Whether the HF tensor `hf_name` is frozen: it belongs to a frozen part and to no module to
  // save. LoRA adapters never are (unknown names are an error).
  bool frozen(const std::string& hf_name) const;
  bool operator==(const FreezeSpec&) const = default;
};

// The largest micro-batch the model is planned for (all its samples together).
struct TrainLimits {
  int64_t max_seq_len = 2048;   // tokens
  int64_t max_patches = 16384;  // vision patch rows (before the 2x2 merge)
  int max_images = 16;          // images (vision attention segments)
  int max_samples = 1;          // samples packed into one micro-batch (causal segments)
  // Rows of [rows, vocab] f32 logits materialised at once by the loss; the larger, the fewer
  // passes over the lm_head weight and its gradient.
  int64_t loss_chunk_rows = 32;
  // What the forward keeps per layer (core/recompute.h).
  Recompute recompute = Recompute::none;
  // A frozen vision tower keeps no block activations: nothing backpropagates into it (its
  // block outputs that the mergers read are still kept). set_frozen may freeze more later,
  // never unfreeze the tower of a model planned with it frozen.
  bool vision_tower_frozen = false;
  // The parts frozen from the start hold no gradient (training/param_spec.h: only trainable
  // parameters have f32 state), and the backward skips their weight gradients; set_frozen may
  // freeze more later, never unfreeze one of these.
  FreezeSpec frozen;
  // Bucket padding, so that a few graph sets serve every micro-batch: the tokens are padded up to
  // the smallest text bucket at or above their count (the padding in a causal segment of its own
  // whose labels are ignored) and the patch rows up to the smallest vision bucket (a vision
  // segment of its own that attends to nothing and is written as zeros). Padding changes no loss
  // and no gradient beyond fp32 rounding. Empty text_buckets: no padding. Empty vision_buckets
  // with text buckets: max_patches is the only one. Ascending; text buckets at most max_seq_len,
  // vision buckets multiples of the merge unit at most max_patches. A micro-batch above the
  // largest bucket runs unpadded (and eagerly).
  std::vector<int64_t> text_buckets;
  std::vector<int64_t> vision_buckets;
  // Megatron's static per-expert capacity for the sparse layers (language/decoder.h); its
  // capacity follows each micro-batch's rows (the bucket's, when padded, as Megatron counts a
  // padded sequence's pad tokens), so with a capacity, padding can change which slots drop.
  MoeCapacity moe_capacity;
  // Activation offload: the names of the decoder layers' saved activations (DecoderLayerBuffers'
  // fields that the recompute mode keeps per layer: offloadable_activations) that go to host
  // memory. Each named tensor lives on the device in two slots that the layers take turns in
  // (layer l in slot l % 2): the forward copies a layer's to the host while the next layer
  // computes, and the backward copies them back one layer ahead. Empty: none.
  std::vector<std::string> offload;
  // The pipeline stage this model is (bridge/pipeline_stage.h): it plans activations for, and
  // runs, only its decoder layers, plus the vision encoder, its mergers and the embedding on
  // stage 0 and the final norm, lm_head and loss on the last stage. count 1: the whole model
  // (the layer range is filled in).
  PipelineStage stage;
};

// The decoder layers' saved activations that train.offload_activations may name under a recompute
// mode (those the forward keeps per layer), in layer order: x_in (the layer's input) first.
std::vector<std::string> offloadable_activations(Recompute recompute);

// Which parts of queue_forward_backward replay captured graphs (core/graph_capture.h). Graphs run
// only on padded micro-batches (TrainLimits' buckets), one set per bucket shape; a shape's first
// warmup_runs micro-batches run eagerly, the next one is captured (and runs), later ones replay.
struct TrainGraphs {
  // local: each decoder layer's forward and its backward; full_iteration: the whole micro-batch's
  // forward and backward (vision included) as one graph.
  GraphImpl decoder = GraphImpl::none;
  // With decoder local: empty captures whole layers; attn and/or mlp capture those halves of
  // each layer as graphs of their own, and the rest runs eagerly between them.
  std::vector<GraphModule> decoder_modules;
  bool vision = false;  // the encoder's forward (with its mergers) and its backward
  // With vision: empty captures the whole encoder; attn and/or mlp capture those halves of each
  // block, and the patch embedding, the mergers and the rest run eagerly.
  std::vector<GraphModule> vision_modules;
  int warmup_runs = 3;
  // With decoder full_iteration: the micro-batches of one step (queue_step) to plan input slots
  // for, so that a step whose micro-batches all pad to one bucket shape runs as one graph; up to
  // 1: one graph per micro-batch. Each slot holds a micro-batch's inputs at the planned maximum.
  int step_micro_batches = 0;
  // A micro-batch above the largest bucket: run eagerly (counted in overflow_runs()) or fail.
  bool overflow_is_error = false;
};

class TrainableQwen3VL {
 public:
  // params: the weights the forward reads, in the backend's compute dtype (allocate_weights /
  // load_weights on `backend`); kept by reference (the optimizer rewrites them in place).
  // shared_grads: accumulate into these gradients (another model of the same stage, parameters
  // and frozen parts) rather than into gradients of its own. A pipeline stage keeps one model per
  // micro-batch in flight, each with its own activations; their backwards run in micro-batch
  // order into one buffer, which is the order a single model sums them in.
  TrainableQwen3VL(Backend& backend, const ModelConfig& cfg, ModelWeights& params,
                   const TrainLimits& limits, ModelWeights* shared_grads = nullptr);

  // Loss of a micro-batch (samples packed as described above).
  LossStats forward(const std::vector<const TrainSample*>& micro_batch);
  // Loss, and grads += grad_scale * d(loss_sum)/dparam for every parameter that is not frozen.
  // grad_scale = 1 / (labelled tokens of the global batch) gives the gradient of the mean loss.
  LossStats forward_backward(const std::vector<const TrainSample*>& micro_batch, float grad_scale);
  // forward_backward without reading the loss back: it is added to a total on the device, which
  // take_loss_sum reads (one host synchronisation per logged step instead of one per
  // micro-batch). Returns the micro-batch's labelled tokens.
  int64_t queue_forward_backward(const std::vector<const TrainSample*>& micro_batch,
                                 float grad_scale);
  // queue_forward_backward of a step's micro-batches in order. With full_iteration graphs planned
  // for them (TrainGraphs::step_micro_batches) and all of them padded to one bucket shape, every
  // micro-batch's inputs go up first, each into a slot of its own, and the forwards and backwards
  // run as one graph; otherwise micro-batch by micro-batch. Returns the labelled tokens.
  int64_t queue_step(const std::vector<std::vector<const TrainSample*>>& micro_batches,
                     float grad_scale);
  // The summed loss of the micro-batches queued since the last call; resets the total.
  double take_loss_sum();
  // A mixture-of-experts model's load-balancing loss (HF's, unscaled) summed over the
  // micro-batches run since the last call, and their count; resets both. Zero for a dense model.
  std::pair<double, int64_t> take_moe_aux_loss();
  // The slots dropped over capacity and the slots routed, summed over the training micro-batches
  // since the last call (both 0 without a capacity); resets both.
  std::pair<int64_t, int64_t> take_moe_drops();
  // One sample as a micro-batch.
  LossStats forward(const TrainSample& s) { return forward({&s}); }
  LossStats forward_backward(const TrainSample& s, float grad_scale) {
    return forward_backward({&s}, grad_scale);
  }

  // ---- Pipeline stages (TrainLimits::stage) ----
  // queue_forward_backward in halves, so that the activations and their gradients can cross
  // between stages. Per micro-batch: stage_prepare (every stage derives the metadata, M-RoPE
  // tables and labels from the samples itself), then fill forward_inputs() with what the
  // previous stage sent, stage_forward (the loss goes to the queued total on the last stage),
  // send forward_outputs(); when stage_backward_needed(), fill backward_inputs() with what the
  // next stage sent, stage_backward, send backward_outputs(). The lists are in one order on
  // both sides of a boundary (the hidden state with its padding sink row, then the DeepStack
  // features a later layer injects, by layer); a list may be empty. Returns the labelled tokens.
  // forward_only (evaluation): no backward, and the loss goes to a total of its own, which
  // take_forward_loss_sum reads, rather than the training total.
  int64_t stage_prepare(const std::vector<const TrainSample*>& micro_batch, float grad_scale,
                        bool forward_only = false);
  double take_forward_loss_sum();
  void stage_forward();
  bool stage_backward_needed() const { return stage_backward_; }
  // last_of_step: this is the step's last backward into these gradients (on_gradients_final).
  void stage_backward(bool last_of_step = false);
  // After each training micro-batch of a stage, whether or not its backward ran: the layer
  // hook's (-1, backward, false) (on_layer).
  void stage_micro_batch_done();
  std::vector<Tensor> forward_inputs() const;
  std::vector<Tensor> forward_outputs() const;
  std::vector<Tensor> backward_inputs() const;
  std::vector<Tensor> backward_outputs() const;
  const PipelineStage& stage() const { return limits_.stage; }
  // Whether this stage computes the HF tensor `hf_name` (the tied embedding: stage 0 and the last).
  bool holds(const std::string& hf_name) const;

  // Captures and replays graphs in queue_forward_backward from now on (a model planned with text
  // buckets only). `api` must outlive the graphs: delete_graphs() before it goes.
  void use_graphs(GraphApi& api, const TrainGraphs& graphs);
  // Destroys every graph this model created (none created: nothing happens); the graphs are
  // captured again on later use if use_graphs is still in effect.
  void delete_graphs();
  bool graphs_created() const { return graph_count() > 0; }
  size_t graph_count() const;
  // The names of the captured graphs (each names its part, phase and shape).
  std::vector<std::string> graph_keys() const;
  double capture_ms() const { return capture_ms_; }
  // Host seconds, since the last call, of two parts of queueing micro-batches: preparing their
  // inputs (metadata, tables and the uploads of both) and launching captured graphs.
  struct HostSeconds {
    double prepare = 0, graph_launch = 0, graph_launch_cpu = 0;
  };
  HostSeconds take_host_seconds() { return std::exchange(host_seconds_, HostSeconds{}); }
  // Device memory the captures took (in use after each capture minus before it, summed): the
  // graphs' own memory, as the device reports it (0 on the CPU, which reports none).
  int64_t graph_memory_bytes() const { return graph_memory_bytes_; }
  // The same per captured graph, by key: what each set holds.
  std::vector<std::pair<std::string, int64_t>> graph_memory_by_set() const;
  // Micro-batches run unpadded because they were above the largest bucket.
  int64_t overflow_runs() const { return overflow_runs_; }
  // Real and padded tokens and patch rows of the micro-batches run so far (padding's cost), and
  // their labels against the label slots the loss ran over (padded only where it is captured).
  struct PaddingStats {
    int64_t tokens = 0, padded_tokens = 0, patches = 0, padded_patches = 0;
    int64_t labels = 0, label_slots = 0;
  };
  const PaddingStats& padding_stats() const { return padding_; }

  // Data-parallel overlap (parallel/grad_reducer.h): during the backward of the step's last
  // micro-batch (queue_step's last, or stage_backward(true)), `hook` is called with each gradient
  // tensor of grads() (whole, as the weight structs hold it) as soon as the step's last op that
  // writes it is queued, in backward order: the lm_head and final norm, the decoder layers from
  // last to first, the embedding, then the vision mergers, blocks from last to first and patch
  // embedding. It is called only between graphs, never from a graph's body (captured, replayed
  // or warming up): with local graphs between the layers' graphs, with full_iteration not at all
  // (the reduction then starts after the step). A tensor may be named again; one not written
  // this step (a frozen part, no images) is still named where it would be. Empty: none.
  using GradientsFinal = std::function<void(const Tensor& grad)>;
  void on_gradients_final(GradientsFinal hook) { gradients_final_ = std::move(hook); }
  // Sharding by layer (training/sharded_gradients.h, training/sharded_weights.h): called with
  // (l, forward, true) before decoder layer l's forward reads its weights and (l, forward, false)
  // once it is queued, in every forward (training and evaluation); with (l, backward, true)
  // before layer l's backward reads its weights and writes its gradients and (l, backward,
  // false) once it is queued, where the language model trains; and with (-1, backward, false)
  // after each training micro-batch, whether or not its backward ran. Where the language model
  // trains, also with (kLmHeadGradient, forward, true / false) around a training forward's loss,
  // which writes the lm_head's gradient, and (kEmbeddingGradient, backward, true / false) around
  // the embedding's backward. Always outside any graph (refused with full_iteration graphs).
  // Empty: none.
  static constexpr int kLmHeadGradient = -2, kEmbeddingGradient = -3;
  enum class LayerPass { forward, backward };
  using LayerHook = std::function<void(int layer, LayerPass pass, bool begin)>;
  void on_layer(LayerHook hook) { layer_hook_ = std::move(hook); }
  const LayerHook& layer_hook() const { return layer_hook_; }

  ModelWeights& grads() { return *grads_; }
  ModelWeights& params() { return params_; }
  Backend& backend() const { return be_; }
  void zero_grads();
  // Sample-parallel CPU training runs one replica per thread, each with its own activations and
  // gradients over the shared parameters. This adds this replica's gradients into `sum`'s and
  // leaves this replica's at zero (CPU backend only).
  void move_grads_into(TrainableQwen3VL& sum);
  // Frozen parts skip their weight-gradient GEMMs (a part frozen after planning keeps a zero
  // gradient; one planned frozen, TrainLimits::frozen, has none); backpropagation still runs
  // through a frozen part when a trainable part lies before it.
  void set_frozen(bool vision_tower, bool merger, bool language_model);
  // LoRA dropout's masks for the training step `step` of a run seeded `seed`: the k-th training
  // micro-batch prepared after this draws its masks from micro_batch_ids[k], its place in the
  // global batch (so that ranks and replicas together draw what one process draws), or from k
  // where the list is shorter. A resumed run draws the same ones. Without a call the base is 0.
  void set_dropout_step(uint64_t seed, int64_t step, std::vector<int64_t> micro_batch_ids = {});
  const FreezeSpec& frozen() const { return frozen_; }

  const ModelConfig& config() const { return cfg_; }
  const TrainLimits& limits() const { return limits_; }
  size_t arena_bytes() const { return arena_.capacity(); }
  // The most bytes one micro-batch writes from the host (its inputs at the planned maximum, each
  // write rounded up as a backend stages it): what Backend::reserve_write_staging needs per
  // micro-batch for the host to queue a whole step without waiting.
  size_t write_bytes_per_micro_batch() const;
  // The part of the arena that holds the layers' activations (what train.recompute and a frozen
  // tower shrink); the rest is inputs, the loss's workspace and the backward's scratch.
  size_t activation_bytes() const { return activation_bytes_; }

  // The arena a model of these limits allocates and its activation part, planned without
  // allocating anything (training/memory_plan.h): compute_dtype and loss_workspace are those of
  // the backend it would run on (Backend::lm_head_loss_workspace_bytes).
  using LossWorkspaceBytes = std::function<size_t(int64_t rows, int64_t hidden, int64_t vocab)>;
  struct ArenaPlan {
    size_t arena_bytes = 0, activation_bytes = 0;
    // One micro-batch's inputs (write_bytes_per_micro_batch): what each further input slot of a
    // full_iteration step graph holds.
    size_t input_bytes = 0;
    // Host memory of the offloaded activations (TrainLimits::offload).
    size_t offloaded_bytes = 0;
  };
  // Host bytes the offloaded activations take (TrainLimits::offload).
  size_t offloaded_bytes() const { return offload_host_bytes_; }
  static ArenaPlan plan_arena(const ModelConfig& cfg, const TrainLimits& limits,
                              DType compute_dtype, const LossWorkspaceBytes& loss_workspace);

 private:
  // plan_arena's model: its limits checked, nothing allocated.
  TrainableQwen3VL(Backend& host, const ModelConfig& cfg, ModelWeights& no_params,
                   const TrainLimits& limits, DType compute_dtype,
                   const LossWorkspaceBytes& loss_workspace);
  // Checks the limits and completes them (the whole model as one stage, default vision buckets).
  void check_limits();
  void allocate(Arena& a);
  // Adds the micro-batch's summed loss into loss_out (device f32 [1]).
  void run(const std::vector<const TrainSample*>& batch, bool backward, float grad_scale,
           const Tensor& loss_out);
  LossStats run_and_read(const std::vector<const TrainSample*>& batch, bool backward,
                         float grad_scale);
  void prepare(const std::vector<const TrainSample*>& batch);
  // The graphs or eager work of the micro-batch prepare() set up.
  void run_prepared(bool backward, const Tensor& loss_out);
  void run_prepared_micro_batch(bool backward, const Tensor& loss_out);
  void layer_event(int layer, LayerPass pass, bool begin);
  // Replays the graph called `key`, or runs `body` (warm-up, or graphs off), or captures it.
  void graphed(const std::string& key, const std::function<void()>& body);
  // graphed(key, body) when `as_graph`, else body() (eagerly, or inside an enclosing capture).
  void maybe_graphed(bool as_graph, const std::string& key, const std::function<void()>& body);
  void micro_batch(bool backward, bool vision_grads, const Tensor& loss_out, bool layer_graphs);
  void forward_part(bool backward, const Tensor& loss_out, bool layer_graphs);
  void backward_part(bool vision_grads, bool layer_graphs);
  // What crosses the stage boundary before decoder layer `layer`, forward or (gradients) backward:
  // the hidden state, then the DeepStack features injected at that layer or later, by layer.
  std::vector<Tensor> boundary(int layer, bool gradients) const;
  // The DeepStack features (by injection layer) that cross this stage's input or output boundary.
  int deepstack_count() const { return static_cast<int>(ds_.size()); }
  // The rows past a padded micro-batch's tokens that scatters and gathers of padding use: one
  // row after the bucket, never read by a layer.
  int64_t sink_rows() const { return padded_ ? 1 : 0; }
  // Vision attention segments a micro-batch may use: its images and the padding's.
  int vision_segment_capacity() const { return limits_.max_images + 1; }
  // module_graphs: the blocks' halves named in TrainGraphs::vision_modules replay graphs.
  void vision_forward(bool module_graphs);
  // Block l's saved activations over the current micro-batch's rows.
  VisionBlockBuffers vision_block(int l) const;
  VisionSegments vision_segments() const;
  // The main merger's buffers with the micro-batch's LoRA dropout seed.
  MergerBuffers merger_buffers() const;
  // The stage's part of the joined forward (bridge/joined_model.h), the loss as its head.
  void text_forward(bool layer_graphs, bool backward, const Tensor& loss_out);
  // Layer l's saved activations over the current micro-batch's tokens.
  DecoderLayerBuffers text_layer(int l) const;
  DecoderAttention text_attention() const;
  void loss(bool backward, const Tensor& loss_out);
  void text_backward(bool layer_graphs);
  // on_gradients_final's hook for `grad`, when this backward is the step's last and no graph
  // body is running.
  void gradient_final(const Tensor& grad);
  void vision_gradients_final();
  void vision_backward(bool module_graphs);
  VisionGradScratch vision_grad_scratch() const;

  Backend& be_;
  ModelConfig cfg_;
  ModelWeights& params_;
  std::unique_ptr<ModelWeights> own_grads_;
  ModelWeights* grads_ = nullptr;
  TrainLimits limits_;
  DType compute_dtype_;
  LossWorkspaceBytes loss_workspace_bytes_;
  // Stage mode: whether the current micro-batch's backward runs (the same on every stage: it
  // follows from the samples and the frozen parts).
  bool stage_backward_ = false;
  bool stage_vision_grads_ = false;
  bool stage_forward_only_ = false;
  // Whether each part has a trainable tensor (set_frozen): its backward then runs.
  bool trains_lm_ = false, trains_tower_ = false, trains_merger_ = false;
  LoraScratch t_lora_, v_lora_;  // where the model has adapters (core/lora.h)
  // LoRA dropout: the micro-batch's seed (i64 [1], an input of its slot), drawn from the step's
  // base and the micro-batches prepared in the step so far.
  Tensor lora_seed_;
  uint64_t dropout_base_ = 0;
  int64_t dropout_micro_batches_ = 0;
  std::vector<int64_t> dropout_ids_;
  void write_step_values(float grad_scale, bool training);
  FreezeSpec frozen_;
  Arena arena_;
  size_t activation_bytes_ = 0;

  // Activation offload (TrainLimits::offload): each offloaded kind's two device slots and its
  // host region, one block of per-layer parts; the layer whose tensors each slot holds now.
  struct OffloadKind {
    Tensor DecoderLayerBuffers::*field = nullptr;
    Tensor slots[2];
    size_t host_offset = 0, layer_bytes = 0;
  };
  std::vector<OffloadKind> offload_;
  size_t offload_host_bytes_ = 0;
  std::unique_ptr<void, std::function<void(void*)>> offload_host_;
  // [0]: x_in (the residual stream, layer l's input written by layer l - 1); [1]: the others.
  int offload_resident_[2][2] = {{-1, -1}, {-1, -1}};
  bool offload_copies_ = false;  // the micro-batch's forward saves for a backward
  bool offloads(Tensor DecoderLayerBuffers::*field) const;
  void* offload_host(const OffloadKind& k, int layer) const;
  // Around layer l's forward and before its backward (outside any graph).
  void offload_forward(int l, bool begin);
  void offload_backward(int l);
  // Layer l's tensors of group g (0: x_in, 1: the others) into their slots from the host, marked
  // on the group's copy point for the slot.
  void offload_reload(int l, int group);

  // Graphs: by key (which names every host value the body uses), with their warm-up count.
  struct GraphSet {
    int eager_runs = 0;
    CapturedGraph graph;
    int64_t memory_bytes = 0;
  };
  GradientsFinal gradients_final_;
  LayerHook layer_hook_;
  bool last_backward_ = false;  // the backward running is the step's last
  int graph_bodies_ = 0;        // graph bodies running (graphed() nests in captures)
  GraphApi* graph_api_ = nullptr;
  TrainGraphs graphs_;
  std::map<std::string, GraphSet> graph_sets_;
  double capture_ms_ = 0;
  HostSeconds host_seconds_;
  int64_t graph_memory_bytes_ = 0;
  int64_t overflow_runs_ = 0;
  PaddingStats padding_;

  // The host values a micro-batch's ops take (TrainableQwen3VL's members of the same names): one
  // graph serves micro-batches whose shapes are equal.
  struct BatchShape {
    bool padded = false;
    int64_t L = 0, S = 0, n_pad = 0, n_label = 0;
    int n_segments = 0, n_text_segments = 0, n_windows = 0;
    bool operator==(const BatchShape&) const = default;
  };
  BatchShape shape() const;
  void set_shape(const BatchShape& shape);
  // The tensors prepare() writes, in one order.
  static constexpr size_t kInputs = 11;
  static const std::array<Tensor TrainableQwen3VL::*, kInputs>& input_members();
  // A step's micro-batches as queue_step holds them: the inputs prepare() wrote and the shape it
  // set, per micro-batch. Slot 0 holds the model's own inputs; use_slot points the inputs and the
  // shape at a slot's.
  struct InputSlot {
    std::array<Tensor, kInputs> inputs;
    BatchShape shape;
    int64_t n_label_real = 0, n_text_real = 0;
  };
  std::vector<InputSlot> slots_;
  Arena slot_arena_;
  void plan_input_slots(int n);
  void use_slot(size_t i);
  // Copies slot i's inputs and shape into slot 0 and uses it: graphs of single micro-batches
  // were captured reading the model's own inputs.
  void move_into_own_inputs(size_t i);

  // The current micro-batch's shape (padded: the bucket's).
  bool padded_ = false;
  int64_t n_label_real_ = 0;
  int64_t n_text_real_ = 0;  // tokens before the padding
  // The slots a training micro-batch of `tokens` real tokens routes when a capacity drops some:
  // what the dropped share is of.
  int64_t routed_slots(int64_t tokens) const {
    return moe_dropped_.defined() ? tokens * cfg_.text.num_experts_per_tok * moe_layers_ : 0;
  }
  int64_t L_ = 0;        // tokens
  int64_t S_ = 0;        // vision patch rows
  int64_t n_pad_ = 0;    // image-pad tokens (= S_ / merge_unit)
  int64_t n_label_ = 0;  // positions whose next token is labelled
  int n_segments_ = 0;   // vision attention segments
  int n_windows_ = 0;    // window segments of windowed blocks (window attention)
  int n_text_segments_ = 0;

  // Host staging, sized once.
  std::vector<int32_t> h_ids_, h_pad_rows_, h_label_rows_, h_targets_, h_text_cu_, h_grids_,
      h_positions_;
  // Inputs. The text's M-RoPE tables (cos_, sin_) are computed from positions_ (i32 [L, 3]) by
  // the text forward's first op, on the device.
  Tensor ids_, pad_rows_, label_rows_, targets_, positions_, text_cu_, grad_scale_, loss_sum_,
      loss_total_, cos_, sin_;
  std::vector<float> rope_inv_freq_;
  std::vector<int> rope_axes_;
  // The vision inputs are the pixels and the grids; the vision forward's first op computes the
  // tables (RoPE, interpolation, segments, real rows) from the grids on the device.
  Tensor pixels_, v_grids_, v_cos_, v_sin_, pos_index_, pos_weight_, v_cu_, v_real_rows_,
      v_window_cu_;
  std::vector<float> h_window_pixels_;  // a sample's pixel rows in window order
  std::vector<float> v_inv_freq_;
  // Vision activations: vx_[l] is the input of block l, vx_[depth] the tower's output.
  std::vector<Tensor> vx_;
  // At the planned row count; blocks share the tensors that are recomputed (or, with the tower
  // frozen, never read again).
  std::vector<VisionBlockBuffers> vb_;
  Tensor v_recompute_out_;  // x_out of a block rerun by Recompute::full
  MergerBuffers merger_;
  std::vector<MergerBuffers> ds_;
  // Text activations: tx_[l] is the input of layer l (after the previous DeepStack add),
  // tx_[n_layers] the input of the final norm.
  std::vector<Tensor> tx_;
  // At the planned token count; layers share the tensors that are recomputed.
  std::vector<DecoderLayerBuffers> tl_;
  Tensor t_recompute_out_;  // x_out of a layer rerun by Recompute::full
  Tensor final_, final_rstd_, xlab_, dxlab_, loss_workspace_;
  int64_t loss_chunk_ = 0;
  // Backward scratch. *_dres_ are the f32 residual gradients, *_dres_c_ their compute-dtype
  // copies for the GEMMs.
  Tensor t_dres_, t_dres_c_, t_dtmp_, t_dloss_, t_dattn_, t_dqkv_, t_dgu_, t_dact_, t_dsum_;
  MoeGradScratch t_moe_;
  // Mixture of experts: the step's real text rows (i32 [1]), the routing statistics summed over
  // a forward's sparse layers, the load-balancing loss's sum and its gradient per expert.
  Tensor text_real_rows_, moe_load_, moe_prob_sum_, moe_aux_sum_, moe_aux_dprob_;
  // The training micro-batches' dropped slots (i32 [1]) under a capacity, and on the host the
  // routed slots they dropped from, until take_moe_drops().
  Tensor moe_dropped_;
  int64_t moe_routed_slots_ = 0;
  int moe_layers_ = 0;
  int64_t moe_aux_runs_ = 0;
  // Micro-batches of the step being queued: each one's load-balancing loss counts 1/n of it, as
  // HF's accumulation divides each micro-batch's loss.
  int micro_batches_in_step_ = 1;
  Tensor v_dres_, v_dres_c_, v_dtmp_, v_dattn_, v_dqkv_, v_dfc_, v_dup_, v_dsum_, m_da_, m_dln_,
      d_embeds_;
  std::vector<Tensor> d_ds_;
};

}  // namespace iris
