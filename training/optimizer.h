// AdamW with fp32 master weights: the master weights, gradients and moments are ModelWeights with
// the whole model's binding table that hold the trainable tensors only (training/param_spec.h), so
// every state tensor is addressed by its HF name and a frozen part holds no state. The update
// follows torch.optim.AdamW (foreach path): decoupled decay p *= 1 - lr * wd before the Adam step,
// bias-corrected moments, per-parameter step counts, and weight decay only on parameters with >= 2
// dims.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "parallel/communicator.h"
#include "parallel/shard_exchange.h"
#include "parallel/shard_sum.h"
#include "training/sharded_weights.h"
#include "training/train_model.h"

namespace iris {

struct AdamWConfig {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;    // applied to parameters with >= 2 dims only
  float clip_grad_norm = 0.0f;  // global L2 norm to clip to; <= 0 disables clipping
  // Each part's learning rate relative to the scheduled one (Qwen's vision_tower_lr and
  // mm_projector_lr): a randomly initialised vision tower can want a larger step than the LM.
  float vision_tower_lr_scale = 1.0f;
  float merger_lr_scale = 1.0f;
  float lr_scale(ModelPart part) const;
};

// Pipeline parallel: the tensors (by binding index) each stage of a pipeline computes gradients
// for, and the stages' communicator (stage order). A stage updates only the tensors it holds; the
// gradient norm is the global one, each tensor's sum of squares taken from the first stage that
// holds it and the tensors added in binding order, as one process adds them (a tensor held by two
// stages, the tied embedding, has the same summed gradient on both and counts once).
struct StageTensors {
  Communicator* stages = nullptr;
  std::vector<std::vector<bool>> held;  // [stage][tensor]
  // The stage that saves and counts tensor i: the first that holds it.
  int owner(size_t tensor) const;
};

// A pipeline stage's span of a flat layout: from its first held tensor (held: by binding, and
// with storage in w) to the end of its last; {0, 0} where it holds none.
std::pair<int64_t, int64_t> stage_span(const ModelWeights& w, const std::vector<bool>& held);

// L2 norm over the gradients of every parameter that is not frozen (summed in f64; CPU tensors).
double grad_norm(const ModelWeights& grads, const FreezeSpec& frozen = {});

// AdamW through the Backend's multi-tensor ops: the master weights, gradients and both moments are
// f32 ModelWeights of one config, hence one layout, and are updated as flat buffers in one launch.
// On the CPU the master weights are the weights the model reads; on CUDA a bf16 working copy is
// rewritten from them by the same kernel.
//
// Sharded (ZeRO-1) over the ranks of `shard_over`: rank r keeps the moments and step counts of
// its shard of the flat buffers only (ShardExchange: one contiguous range of elements, tensors
// may straddle it), 1/world of the unsharded state. A step reduce-scatters the gradients (the
// rank-order sum the unsharded all-reduce forms), finds the global norm from every rank's
// per-span sums of squares, updates the shard in place and all-gathers the weights. The norm adds
// the spans in the unsharded order, a tensor split between ranks as the sum of its parts in rank
// order: the unsharded norm bit for bit wherever no tensor is split, and otherwise an f64 sum of
// squares that may differ in its last bits (a split tensor's two partial sums are rounded apart),
// which reaches the f32 norm, and so the clip and the weights, only when it sits that close to an
// f32 rounding boundary. Each rank holds the f32 master weights of its shard only (init_master
// fills them), rewrites the working copy of its shard (bf16 on CUDA, the f32 weights on the CPU),
// and the ranks gather the working copy (its own layout: each shard's elements are one range of
// the working arena). Checkpoints hold the unsharded state: gather_state() brings every shard of
// the master weights and moments to rank 0, and load() takes each rank's shard of any file,
// whatever world size wrote it.
//
// Sharded and pipelined (shard_over the stage's data-parallel group, pipeline its stages): each
// stage shards its span of the flat buffers (its first to its last held tensor) over its replicas
// as above, each replica's rows being the held tensors' parts inside its shard. The norm's sums
// of squares are gathered over the replicas, then over the stages, which lays them out in world
// rank order (rank = stage x replicas + replica); each tensor is taken from its owning stage's
// replicas in replica order and the tensors added in binding order: the unsharded pipeline's
// norm, with the same caveat for a tensor split between two shards. gather_state() brings the
// stage's state to its replica 0, which saves the tensors the stage owns.
class AdamW {
 public:
  // master and grads: f32 ModelWeights on `backend` built from `cfg` (same bindings). working:
  // the compute-dtype weights the model reads, or null where they are `master` itself.
  // shard_over: shard the state over this communicator's ranks (null: every rank holds it all);
  // its exchanges move at most bucket_elements elements at a time. Sharded, master is null and
  // working given: the optimizer keeps the f32 master weights of its shard only, 1/world of them,
  // which init_master() fills. grad_shard (sharded): the gradients arrive summed in
  // this rank's shard of them (parallel.sharding=optimizer_grads, training/sharded_gradients.h)
  // and `grads` is their layout only, which no rank holds whole; the step exchanges no gradients.
  // weight_shard (sharded, with grad_shard; parallel.sharding=optimizer_grads_params,
  // training/sharded_weights.h): `working` is its layout, which no rank holds whole; the update
  // writes the working copy of this rank's range outside the decoder layers, the layers' gathers
  // round this rank's master weights of them, and weight_shard gathers what the model reads.
  AdamW(Backend& backend, const ModelConfig& cfg, ModelWeights* master, ModelWeights& grads,
        const AdamWConfig& config, ModelWeights* working = nullptr,
        Communicator* shard_over = nullptr, int64_t bucket_elements = int64_t(1) << 25,
        const StageTensors* pipeline = nullptr, ShardSum* grad_shard = nullptr,
        ShardedWeights* weight_shard = nullptr);
  ~AdamW();

  // Sharded master weights: every rank calls it with its f32 host copy of the whole model (the
  // same binding table, any layout); rank 0's values fill every rank's shard.
  void init_master(const ModelWeights& source);
  // Whether tensor i has master weights (it is trainable).
  bool trains(size_t tensor) const;
  // Tensor i's f32 master weights into `out` (host, numel floats). Sharded master weights are
  // read on rank 0 after every rank's gather_state(), until save().
  void read_master(size_t tensor, float* out) const;
  // Bytes of the master weights the optimizer keeps itself (0: they are the caller's).
  size_t master_bytes() const;

  // Clips the gradients to config.clip_grad_norm (torch.nn.utils.clip_grad_norm_: scale by
  // max_norm / (norm + 1e-6) when that is below 1), then updates every parameter that is not
  // frozen, each with lr times its part's lr_scale. Frozen parameters, their moments and their
  // step counts are left untouched, and so is everything when the gradient norm is not finite.
  // Nothing is read back: the step is queued behind the backward. Sharded, the gradients are each
  // rank's own (summed here), the norm is read on the host and every rank must call step().
  void step(float lr, const FreezeSpec& frozen = {});
  // The global gradient norm (before clipping) of each step since the last call, in order
  // (waits for the device).
  std::vector<float> take_grad_norms();
  // The last norm take_grad_norms returned.
  double last_grad_norm() const { return last_norm_; }

  // Updates taken (calls to step()).
  int64_t steps() const { return steps_; }
  // Bytes of the moments this rank holds (the master weights and gradients belong to their
  // owners).
  size_t state_bytes() const;
  // Bytes of the exchanges' scratch and norm tables of a sharded optimizer (0 unsharded).
  size_t exchange_bytes() const;
  // The ranks the state is sharded over (1: unsharded).
  int shards() const { return comm_ != nullptr ? comm_->size() : 1; }
  const AdamWConfig& config() const { return config_; }
  // The moments by tensor; unsharded only.
  ModelWeights& exp_avg();
  ModelWeights& exp_avg_sq();

  // The state as safetensors: exp_avg.<hf name>, exp_avg_sq.<hf name> (f32) and step.<hf name>
  // (i64 [1]) per parameter; the update count in the metadata. load() restores it bit-exactly and
  // checks that every tensor is present with the right shape. The file does not depend on the
  // backend: a state saved on one device loads on another. Sharded, save() runs on rank 0 after
  // every rank's gather_state(), and load() reads this rank's shard.
  // Pipeline stages save the tensors they own (StageTensors::owner) and load the ones they hold,
  // each found by name in whichever of `paths` has it, so a state written by one split loads
  // under another. Only tensors with state (the trainable ones) are written, and the metadata's
  // stateless_parts names the model parts without any; a load finds no state for such a part
  // and starts it at zero moments and step counts (reinitialised_parts), while a tensor missing
  // from any other part is an error. A part frozen now is simply not read.
  void save(const std::string& path) const;
  void load(const std::string& path);
  void load(const std::vector<std::string>& paths);
  // The parts the last load() found no state for because the run that wrote the file kept them
  // frozen (its stateless_parts metadata), and started at zero moments and step counts.
  const std::vector<std::string>& reinitialised_parts() const { return reinitialised_parts_; }
  // Sharded: every rank's shard of the state to rank 0, for its save() (every rank calls it; the
  // host copy on rank 0 lasts until save()). Unsharded: nothing to do.
  void gather_state();

 private:
  struct Row {  // a tensor's part in this rank's shard
    int64_t tensor, flat_begin, length;
  };
  // Each rank's rows of the flat range [begin, begin + n) sharded over `world` ranks, in flat
  // order (the same table on every rank); held: only these tensors (null: all).
  static std::vector<std::vector<Row>> shard_rows(const ModelWeights& w, int64_t begin, int64_t n,
                                                  int world, const std::vector<bool>* held);
  // pipeline: shard this stage's span over comm (its data-parallel group); null: all of it.
  void setup_shard(Communicator& comm, int64_t bucket_elements, const StageTensors* pipeline);
  // The owners and held flags of a pipeline's tensors.
  void read_stage_tensors(const StageTensors& pipeline);
  void check_pipeline(const StageTensors& pipeline) const;
  // Sharded with a working copy: each rank's range of the working arena, and their gather.
  void plan_working_gather();
  void gather_working();
  void sharded_norm();
  void setup_pipeline(const StageTensors& pipeline);
  // Whether this rank saves (and loads) tensor i.
  bool saves(size_t tensor) const;
  bool loads(size_t tensor) const;
  void write_hyper(const FreezeSpec& frozen);
  void read_norm_history();
  // Gradient norms of steps not yet read back, kept on the device; a full history is read
  // before the next step writes to it.
  static constexpr int64_t kNormHistory = 4096;

  Backend& be_;
  AdamWConfig config_;
  // The f32 state's layout (the master weights', which the gradients share).
  const ModelWeights& layout_;
  ModelWeights* master_;  // null: sharded, the optimizer keeps its shard of them (master_shard_)
  ModelWeights& grads_;
  ModelWeights* working_;
  std::unique_ptr<ModelWeights> m_, v_;
  Arena tables_;  // spans, hyper, steps, lr, grad_stats, norm history on the backend
  Tensor spans_, hyper_, steps_dev_, lr_, grad_stats_, norm_history_;
  int64_t unread_norms_ = 0;
  std::vector<float> read_norms_;  // read back, not yet taken
  double last_norm_ = 0;
  Tensor flat_master_, flat_grads_, flat_m_, flat_v_, flat_working_;
  FreezeSpec hyper_frozen_;
  bool hyper_written_ = false;
  int64_t steps_ = 0;

  // The rows of the tables (row = tensor when unsharded); none for a rank whose shard holds only
  // padding, which keeps one inert table row.
  std::vector<Row> my_rows_;

  // Sharded state: this rank's shard [shard_begin_, shard_end_) of the flat buffers, which
  // flat_grads_ views and flat_master_ (master_shard_) holds; full_grads_ is what the exchange
  // reduce-scatters.
  Communicator* comm_ = nullptr;
  // The ranks the norm's sums of squares are gathered from: comm_ when sharded, the pipeline's
  // stages when pipelined (sharded too: each stage's part gathered over comm_ first).
  Communicator* norm_comm_ = nullptr;
  std::vector<int> owner_;  // pipelined: each tensor's owning stage
  std::vector<bool> held_;  // pipelined: whether this stage holds each tensor
  // Sharded: the range of the flat gradients the shards tile, [span_begin_, span_begin_ +
  // full_grads_.numel()): all of them, or a pipeline stage's span.
  Tensor full_grads_;
  int64_t span_begin_ = 0;
  // Sharded and pipelined: rows_ holds every stage's replicas' rows, this stage's from here.
  size_t rows_base_ = 0;
  // Per tensor, where its rows' sums of squares sit in all_row_sums_, in rank order.
  std::vector<std::vector<int64_t>> norm_order_;
  std::unique_ptr<ShardExchange> exchange_;
  ShardSum* grad_shard_ = nullptr;
  ShardedWeights* weight_shard_ = nullptr;
  // With weight_shard_: the update's calls, each over rows [begin, end) of the tables, writing
  // the working copy into weight_shard_->whole_weights(), or (the layers' rows) none: the layers'
  // gathers round the master weights themselves.
  struct WorkingGroup {
    int64_t begin = 0, end = 0;
    bool writes_working = true;
  };
  std::vector<WorkingGroup> working_groups_;
  // Device memory of at least the longest shard, free between steps, through which init_master
  // and gather_state move shards: the gradients (or their shard's accumulator).
  Tensor staging_;
  std::vector<std::pair<int64_t, int64_t>> working_ranges_;  // [rank]: begin, end
  std::vector<Communicator::Transfer> working_sends_, working_recvs_;
  Arena shard_state_, shard_tables_;
  int64_t shard_begin_ = 0, shard_end_ = 0, rows_max_ = 0;
  std::vector<std::vector<Row>> rows_;  // every rank's rows
  Tensor row_sums_, all_row_sums_;      // f64 bits: this rank's, every rank's [world, rows_max_]
  // row_sums_ and all_row_sums_ for `groups` ranks or stages that each sum their own rows.
  void plan_row_sums(int64_t groups);
  std::vector<double> host_row_sums_;
  mutable std::vector<float> gathered_m_, gathered_v_;  // rank 0, from gather_state to save
  mutable std::vector<float> gathered_master_;          // the same, of a sharded master
  Arena master_shard_;
  mutable std::vector<int64_t> gathered_steps_;
  std::vector<std::string> reinitialised_parts_;
};

}  // namespace iris
