// A training run's set-up, everything before its first step: where it starts (the run directory
// and the checkpoint it resumes), what it trains (the model's config and where its weights come
// from), and each rank's models, weights, optimizer and exchanges, allocated here once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "bridge/pipeline_stage.h"
#include "core/arena.h"
#include "core/backend.h"
#include "core/graph_capture.h"
#include "core/hardware_limits.h"
#include "core/op_profile.h"
#include "training/checkpoint.h"
#include "training/data_parallel.h"
#include "training/optimizer.h"
#include "training/recipe.h"
#include "training/sharded_gradients.h"
#include "training/sharded_weights.h"
#include "training/train_model.h"

namespace iris {

// Where a run starts. Of a multi-process run, rank 0 holds the run directory's lock and has
// cleaned it of a killed writer's debris before the others look at it.
struct RunStart {
  std::string run_dir;
  std::unique_ptr<RunLock> lock;  // rank 0's
  ResumePoint found;
  std::string resume_dir;  // the checkpoint this run continues; empty: a new run
  TrainerState state;      // the resumed checkpoint's (a new run's: zero)
  // The complete checkpoints up to the start, the run this one continues: checkpoint.keep_last
  // counts them with the run's own.
  std::vector<int64_t> owned;
  // The checkpoint to continue is at train.train_iters: nothing to train. Nothing was locked,
  // cleaned or written (resume_dir and state are the checkpoint's; lock is null).
  bool finished = false;
  // What the log says of the resume before the first step (the schedule kept or overridden).
  std::vector<std::string> notes;
};

// Locks and checks the run directory and finds the checkpoint to resume (checkpoint.resume).
// A resume whose recipe changes the schedule the checkpoint trained with (schedule_changes) is
// an error naming the keys unless schedule.override_on_resume is set.
RunStart start_run(const Recipe& r, DataParallel& dp);

// What `iris train` says when a run has nothing left to do (RunStart::finished), in recipe
// keys: how to train further, and what that does to a cosine schedule.
std::string finished_message(const Recipe& r, const RunStart& start);

// What a run trains: the model's config (a resumed checkpoint's) and where its weights are read.
struct ModelSource {
  ModelConfig cfg;
  std::string config_text;  // config.json as the run's checkpoints write it
  std::string weights_dir;  // empty: drawn at random (model.init random)
};
ModelSource model_source(const Recipe& r, const std::string& resume_dir);

// Whether the run trains on the GPU (train.device); cuda without one is an error.
bool run_on_gpu(const Recipe& r);

// One rank's share of the run: its backend, the weights the model reads and the optimizer's
// state (training/param_spec.h says which buffer holds what), its models (one, or one per
// micro-batch thread on the CPU, or per micro-batch in flight on a pipeline stage), their graphs,
// the data-parallel exchanges and the optimizer, resumed from `resume_dir` when given. The GPU's
// memory plan is checked before anything is allocated on it.
class RankTraining {
 public:
  RankTraining(const Recipe& r, const ModelSource& source, const std::string& resume_dir,
               DataParallel& dp);
  ~RankTraining();
  RankTraining(const RankTraining&) = delete;
  RankTraining& operator=(const RankTraining&) = delete;

  bool on_gpu() const { return gpu_ != nullptr; }
  bool graphs_on() const { return graphs_on_; }
  bool pipelined() const { return stages_.size() > 1; }
  // parallel.sharding=optimizer (optimizer.distributed) with replicas to shard over.
  bool sharded() const { return sharded_; }
  // parallel.sharding=optimizer_grads as well: the gradients are sharded too.
  bool gradients_sharded() const { return sharded_grads_ != nullptr; }
  int micro_batch_threads() const { return n_replicas_; }
  int64_t parameters() const { return n_params_; }
  const ModelConfig& config() const { return cfg_; }
  const TrainLimits& limits() const { return limits_; }
  const FreezeSpec& frozen() const { return frozen_; }
  const std::vector<PipelineStage>& stages() const { return stages_; }

  const std::vector<std::unique_ptr<TrainableQwen3VL>>& models() const { return replicas_; }
  TrainableQwen3VL& model() const { return *replicas_[0]; }
  Backend& backend() const { return model().backend(); }
  Backend* gpu() const { return gpu_.get(); }
  AdamW& optimizer() const { return *opt_; }
  // With logging.op_profile_step: the step profile the models and the optimizer issue their ops
  // through (it times them only while it records), and the GEMM and copy rates measured at set-up
  // that its table holds each op family against; else null.
  ProfilingBackend* op_profile() const { return profile_.get(); }
  const HardwareLimits& floors() const { return floors_; }
  // The weights the model reads (every parameter); the optimizer reads the master weights.
  ModelWeights& weights() const { return *weights_; }
  const StageTensors& stage_tensors() const { return stage_tensors_; }

  // After the step's backwards: the micro-batch threads' gradients into the first model's, the
  // data-parallel reduction and the tied embedding's exchange between the first and last stage.
  void sum_gradients(DataParallel& dp);

  // Graphs of all the rank's models.
  size_t graph_count() const;
  double capture_ms() const;
  // The memory held, by buffer, as allocated.
  std::string memory_report(const Recipe& r, DataParallel& dp) const;
  // On the GPU: the memory plan's per-GPU total and the memory it had to fit, which the peak the
  // run reports can be held against (empty on the CPU).
  const std::string& planned_memory() const { return planned_memory_; }

 private:
  void plan_memory(const Recipe& r);
  void load_weights_on_host(const Recipe& r, const ModelSource& source);
  void make_models(const Recipe& r, DataParallel& dp);
  void use_graphs(const Recipe& r, DataParallel& dp);
  void connect(const Recipe& r, DataParallel& dp, const std::string& resume_dir);

  ModelConfig cfg_;
  std::string planned_memory_;
  bool graphs_on_ = false;
  bool sharded_ = false;
  int n_replicas_ = 1;
  int64_t n_params_ = 0;
  FreezeSpec frozen_;
  TrainLimits limits_;
  std::vector<PipelineStage> stages_;

  std::unique_ptr<Backend> cpu_, gpu_;
  std::unique_ptr<ProfilingBackend> profile_;
  HardwareLimits floors_;
  // Where the models and the optimizer issue their ops: the profile, else the device's backend.
  Backend& compute() const;
  std::unique_ptr<ModelWeights> params_;  // f32 on the host; on the GPU released after upload
  std::unique_ptr<ModelWeights> master_, working_;
  ModelWeights* weights_ = nullptr;
  ModelWeights* master_weights_ = nullptr;   // null: sharded, the optimizer keeps them
  ModelWeights* written_through_ = nullptr;  // the copy the optimizer writes through to, if any
  // parallel.sharding=optimizer_grads: the gradients the models write, and their shard.
  std::unique_ptr<ShardedGradients> sharded_grads_;
  std::unique_ptr<ShardedWeights> sharded_weights_;
  std::vector<std::unique_ptr<TrainableQwen3VL>> replicas_;
  std::unique_ptr<GraphApi> graph_api_;
  // The graphs go before the API that destroys them, also when the set-up fails half way.
  struct GraphsFirst {
    std::vector<std::unique_ptr<TrainableQwen3VL>>* models = nullptr;
    ~GraphsFirst();
  } graphs_first_;
  std::unique_ptr<DataParallel::Link> dp_link_;
  StageTensors stage_tensors_;
  std::unique_ptr<AdamW> opt_;
  // Tied embeddings across stages: room for the other stage's gradient (and, sharded, for the
  // sum over the stage's replicas).
  bool tied_across_ = false;
  Arena tied_arena_;
  Tensor tied_scratch_;
};

}  // namespace iris
