#include "training/run_setup.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <tuple>

#include <omp.h>

#include "bridge/peft.h"
#include "core/error.h"
#include "core/fs.h"
#include "training/memory_plan.h"
#include "training/param_spec.h"
#include "training/pipeline_parallel.h"
#include "training/run_checkpoints.h"
#include "training/train_setup.h"
#include "training/trainer.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

AdamWConfig adamw_config(const Recipe& r) {
  AdamWConfig ac;
  ac.beta1 = static_cast<float>(r.optimizer.betas[0]);
  ac.beta2 = static_cast<float>(r.optimizer.betas[1]);
  ac.eps = static_cast<float>(r.optimizer.eps);
  ac.weight_decay = static_cast<float>(r.optimizer.weight_decay);
  ac.clip_grad_norm = static_cast<float>(r.optimizer.clip_grad);
  if (r.optimizer.vision_lr > 0)
    ac.vision_tower_lr_scale = static_cast<float>(r.optimizer.vision_lr / r.optimizer.lr);
  if (r.optimizer.merger_lr > 0)
    ac.merger_lr_scale = static_cast<float>(r.optimizer.merger_lr / r.optimizer.lr);
  return ac;
}

// Copies every tensor of `src` (f32, on the host) that `dst` holds into `dst` on `be` (converted
// to dst's dtype).
void upload_weights(Backend& be, ModelWeights& dst, const ModelWeights& src) {
  for (size_t i = 0; i < src.bindings.size(); ++i)
    if (dst.bindings[i].allocated())
      be.write(dst.bindings[i].tensor(), src.bindings[i].tensor().data, DType::f32);
}

// The runs of a pipeline stage's gradient tensors in the flat gradients, alignment gaps between
// them included: the stage's data-parallel group sums only what the stage computes (the rest are
// zero), in few exchanges.
std::vector<std::pair<int64_t, int64_t>> stage_reduce_ranges(const TrainableQwen3VL& model,
                                                             const ModelWeights& g) {
  std::vector<std::tuple<int64_t, int64_t, bool>> tensors;  // begin, end, held
  for (const WeightBinding& b : g.bindings) {
    if (!b.allocated()) continue;  // frozen: no gradient
    const Tensor t = b.tensor();
    const auto begin = static_cast<int64_t>(
        (static_cast<const char*>(t.data) - static_cast<const char*>(g.arena.base())) /
        sizeof(float));
    tensors.emplace_back(begin, begin + t.numel(), model.holds(b.hf_name));
  }
  std::sort(tensors.begin(), tensors.end());
  std::vector<std::pair<int64_t, int64_t>> ranges;
  bool extend = false;
  for (const auto& [begin, end, held] : tensors) {
    if (held && extend)
      ranges.back().second = std::max(ranges.back().second, end);
    else if (held)
      ranges.push_back({begin, end});
    extend = held;
  }
  return ranges;
}

}  // namespace

namespace {

// The checkpoint a run on `r` would continue from, found without writing anything: the newest
// complete one in checkpoint.dir, else the checkpoint.resume path that seeds a new run. Empty
// for a fresh run (or where the checks of start_run will refuse the directory).
std::string checkpoint_to_continue(const Recipe& r) {
  if (r.checkpoint.resume == "never") return "";
  const std::string own = find_resume_point(r.checkpoint.dir).dir;
  if (!own.empty() || r.checkpoint.resume == "auto") return own;
  return checkpoint_complete(r.checkpoint.resume) ? r.checkpoint.resume : "";
}

std::string lr_text(float lr) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", static_cast<double>(lr));
  return buf;
}

// The resumed checkpoint's schedule against the recipe's: the same, or refused, or (with
// schedule.override_on_resume) replaced with a note. Returns the notes for the log.
std::vector<std::string> check_resumed_schedule(const Recipe& r, const RunStart& s) {
  if (!s.state.has_schedule)
    return {str_cat("note: ", s.resume_dir,
                    " records no learning-rate schedule (it was written before checkpoints kept "
                    "one), so a change of optimizer.lr, optimizer.min_lr, optimizer.weight_decay "
                    "or schedule.* cannot be told; the recipe's schedule is used")};
  const ScheduleSettings now = recipe_schedule(r);
  const std::vector<ScheduleChange> changes = schedule_changes(s.state.schedule, now);
  if (changes.empty()) return {};
  std::string keys;
  for (const ScheduleChange& c : changes)
    keys += str_cat(keys.empty() ? "" : ", ", c.key, " ", c.before, " -> ", c.now);
  const int64_t next = s.state.iteration + 1;
  // The rate of the next step under each schedule (the step after `iteration` updates).
  const std::string rates =
      str_cat("the learning rate of iteration ", next, " is ",
              lr_text(s.state.schedule.lr_schedule().at(s.state.iteration)),
              " under the checkpoint's schedule and ",
              lr_text(now.lr_schedule().at(s.state.iteration)), " under the recipe's");
  if (r.schedule.override_on_resume)
    return {
        str_cat("note: schedule.override_on_resume: the recipe's learning-rate schedule "
                "differs from the one ",
                s.resume_dir, " was trained with (", keys, ") and is used from iteration ", next,
                " on; ", rates)};
  const bool ends_decay = s.state.schedule.kind == "cosine" && s.state.schedule.decay_iters == 0;
  IRIS_FAIL("the recipe changes the learning-rate schedule that ", s.resume_dir,
            " was trained with: ", keys, "; ", rates,
            ". Set those keys back to continue the same schedule",
            ends_decay ? str_cat(" (to train past the old end at optimizer.min_lr, keep "
                                 "the cosine's end with schedule.decay_iters=",
                                 s.state.schedule.train_iters, ")")
                       : std::string(),
            ", or set schedule.override_on_resume=true to train on under the new one");
}

}  // namespace

RunStart start_run(const Recipe& r, DataParallel& dp) {
  RunStart s;
  s.run_dir = r.checkpoint.dir;
  const std::string& run_dir = s.run_dir;
  // A run already at train.train_iters is found before anything that writes (the lock records
  // its holder's pid), so that running a finished command again leaves every file as it was.
  {
    const std::string done = checkpoint_to_continue(r);
    int64_t step = -1;
    if (!done.empty()) {
      const TrainerState st = load_trainer_state((fs::path(done) / kTrainerStateFile).string());
      if (st.iteration == r.train.train_iters) {
        step = st.iteration;
        s.resume_dir = done;
        s.state = st;
      }
    }
    // Every rank takes rank 0's view, should a checkpoint complete between their looks.
    if (dp.rank0_value(step, "the finished-run check") >= 0) {
      IRIS_CHECK(step >= 0, "rank ", dp.rank(), " does not see the checkpoint at iteration ",
                 r.train.train_iters, " that rank 0 sees in ", run_dir,
                 "; start every rank in one working directory on one filesystem");
      s.finished = true;
      return s;
    }
  }
  make_directories(run_dir, "the run directory (checkpoint.dir)");
  // Everything below reads or writes the run directory: one run at a time. Of a multi-process
  // run, rank 0 writes it; the others read what it holds once rank 0 has cleaned it.
  if (dp.writer()) {
    s.lock = std::make_unique<RunLock>(run_dir);
    remove_checkpoint_debris(run_dir);
  }
  dp.barrier("the run directory check");

  s.found = find_resume_point(run_dir);
  if (r.checkpoint.resume == "auto") {
    s.resume_dir = s.found.dir;
  } else if (r.checkpoint.resume == "never") {
    const std::vector<int64_t> existing = list_checkpoints(run_dir);
    IRIS_CHECK(existing.empty(), "checkpoint.dir ", run_dir, " already holds checkpoints (",
               checkpoint_name(existing.empty() ? 0 : existing.back()),
               existing.size() > 1 ? str_cat(" and ", existing.size() - 1, " more") : "",
               ") and checkpoint.resume is never; set checkpoint.resume=auto to continue that "
               "run, or choose another checkpoint.dir");
  } else {
    std::string why;
    IRIS_CHECK(checkpoint_complete(r.checkpoint.resume, &why), "checkpoint.resume ",
               r.checkpoint.resume, " is not a complete checkpoint directory (", why,
               "); give a step_NNNNNNN directory, auto or never");
    // The path seeds a new run; once the run directory has checkpoints of its own, a restart of
    // the same command continues those instead of starting over from the seed.
    s.resume_dir = s.found.dir.empty() ? r.checkpoint.resume : s.found.dir;
  }
  if (!s.resume_dir.empty())
    s.state = load_trainer_state((fs::path(s.resume_dir) / kTrainerStateFile).string());
  IRIS_CHECK(s.state.iteration <= r.train.train_iters, "the checkpoint ", s.resume_dir,
             " is at step ", s.state.iteration, ", past train.train_iters ", r.train.train_iters,
             "; raise train.train_iters to train further");
  if (!s.resume_dir.empty()) s.notes = check_resumed_schedule(r, s);
  // This run writes only steps past its start, and never over a directory it did not write: one
  // there (an incomplete checkpoint, or one a resume was pointed away from) is refused now rather
  // than when the run reaches it.
  for (int64_t step : list_checkpoints(run_dir)) {
    const std::string dir = (fs::path(run_dir) / checkpoint_name(step)).string();
    IRIS_CHECK(step <= s.state.iteration, "checkpoint.dir ", run_dir, " holds ",
               checkpoint_name(step), ", past step ", s.state.iteration, " where this run ",
               s.resume_dir.empty() ? "starts" : "resumes (from " + s.resume_dir + ")",
               ", and a run never replaces a checkpoint it did not write; move ", dir,
               " out of checkpoint.dir (or set another checkpoint.dir) and restart");
    if (checkpoint_complete(dir)) s.owned.push_back(step);
  }
  return s;
}

std::string finished_message(const Recipe& r, const RunStart& start) {
  const int64_t n = start.state.iteration;
  // Not the checkpoint.resume path that seeds a new run: one of the run directory's own.
  const bool own = start.resume_dir != r.checkpoint.resume;
  std::string head =
      own ? str_cat("run ", r.checkpoint.dir, " already finished at iteration ", n, " of ",
                    r.train.train_iters, " (", start.resume_dir, "); nothing to do")
          : str_cat("checkpoint.resume ", start.resume_dir, " is at iteration ", n,
                    ", which is train.train_iters; nothing to train");
  // Where the cosine decays over train.train_iters, raising it alone changes the schedule,
  // which the resume would refuse: say so now rather than after the next command.
  const ScheduleSettings& was =
      start.state.has_schedule ? start.state.schedule : recipe_schedule(r);
  const std::string schedule =
      was.kind == "cosine" && was.decay_iters == 0
          ? str_cat(
                "; the cosine decay ends at train.train_iters, so also set schedule.decay_iters=",
                n,
                " to keep the schedule (the new steps train at optimizer.min_lr), or "
                "schedule.override_on_resume=true for a new one")
          : std::string();
  return str_cat(head, " (raise train.train_iters to train further", schedule, ")");
}

ModelSource model_source(const Recipe& r, const std::string& resume_dir) {
  ModelSource m;
  if (!resume_dir.empty()) {
    const std::string cj = (fs::path(resume_dir) / "config.json").string();
    m.config_text = read_text_file(cj);
    m.cfg = ModelConfig::from_json_text(m.config_text, cj);
    if (r.has_model_config)
      check_same_model_geometry(r.model_config, m.cfg, "the recipe's model", cj,
                                "the checkpoint belongs to another model; use another "
                                "checkpoint.dir or set checkpoint.resume=never");
    // The adapters are the run's, as its checkpoints hold them; config.json is the base model's.
    m.cfg.lora = recipe_lora(r.peft);
    m.weights_dir = resume_dir;
  } else {
    IRIS_CHECK(r.model.init == "random" || !r.model.hf_dir.empty(),
               "model.init is pretrained but model.hf_dir is not set; pass "
               "model.hf_dir=/path/to/checkpoint (a Hugging Face Qwen-VL checkpoint directory)");
    IRIS_CHECK(r.has_model_config, "no model config: set model.config or model.hf_dir");
    m.config_text = r.model_config_json;
    m.cfg = r.model_config;
    if (r.model.init != "random") m.weights_dir = r.model.hf_dir;
  }
  return m;
}

bool run_on_gpu(const Recipe& r) {
  const bool on_gpu = r.train.device == "cuda" || (r.train.device == "auto" && cuda_available());
  IRIS_CHECK(!on_gpu || cuda_available(),
             "train.device is cuda, but this machine has no usable GPU or this iris was built "
             "without CUDA; set train.device=cpu (or auto, which picks the GPU when there is one)");
  return on_gpu;
}

RankTraining::GraphsFirst::~GraphsFirst() {
  if (models != nullptr)
    for (auto& m : *models) m->delete_graphs();
}

RankTraining::RankTraining(const Recipe& r, const ModelSource& source,
                           const std::string& resume_dir, DataParallel& dp)
    : cfg_(source.cfg) {
  graphs_on_ = r.cuda_graph.language.impl != GraphImpl::none ||
               r.cuda_graph.vision.impl != VisionGraphImpl::none;
  const bool on_gpu = run_on_gpu(r);
  cpu_ = make_cpu_backend();
  if (on_gpu) {
    gpu_ = make_cuda_backend(dp.cuda_device());
    // cuBLASLt's first choice for every GEMM, neither timed nor read from the tuning cache: the
    // algorithm decides the rounding, and a run resumed in a new process (after someone filled
    // the cache, or on a newer cache) must continue bit for bit.
    gpu_->set_gemm_tuning(GemmTuning::heuristic);
  }
  if (r.logging.op_profile_step > 0) {
    // Measured before the run's memory is allocated (the operands are freed on return).
    Backend& device = on_gpu ? *gpu_ : *cpu_;
    floors_ = measure_limits(device, /*quick=*/!on_gpu, 5);
    profile_ = std::make_unique<ProfilingBackend>(device);
  }
  if (on_gpu) plan_memory(r);
  load_weights_on_host(r, source);
  frozen_ = recipe_frozen_parts(r);
  limits_ = recipe_train_limits(r, on_gpu);
  // Pipeline stages: this rank plans and runs its stage's share of the model only.
  if (dp.stages() > 1) {
    stages_ = recipe_pipeline_stages(r, cfg_, limits_);
    limits_.stage = stages_[static_cast<size_t>(dp.stage())];
  }
  n_params_ = ParamSpecs(*params_, frozen_, DType::f32).parameters();
  make_models(r, dp);
  if (graphs_on_) use_graphs(r, dp);
  // A step's writes (its micro-batches' inputs and the optimizer's few values) stage at once, so
  // the host queues the step without waiting for the device's copies of its first micro-batches.
  backend().reserve_write_staging(
      static_cast<size_t>(r.train.global_batch_size / r.train.micro_batch_size) *
          model().write_bytes_per_micro_batch() +
      (size_t{1} << 16));
  connect(r, dp, resume_dir);
}

RankTraining::~RankTraining() = default;

Backend& RankTraining::compute() const {
  if (profile_) return *profile_;
  return gpu_ ? *gpu_ : *cpu_;
}

void RankTraining::plan_memory(const Recipe& r) {
  // The run's memory per GPU, planned before anything of it is allocated (or the weights read).
  const MemoryPlan memory = plan_training_memory(
      r, cfg_, true, planned_device_bytes(r, static_cast<int64_t>(gpu_->device_memory_total())));
  IRIS_CHECK(memory.fits(), "the run does not fit the GPU's memory:\n",
             memory_refusal(r, cfg_, memory));
  const std::string total = memory.describe();
  const size_t line = total.rfind("per-GPU total: ");
  planned_memory_ = str_cat("memory plan: ", total.substr(line, total.size() - line - 1),
                            " (iris train --dry-run prints it by buffer)");
}

void RankTraining::load_weights_on_host(const Recipe& r, const ModelSource& source) {
  // The host copy of the f32 weights: on the CPU the weights the model reads; on the GPU only
  // the source of the upload, released after it.
  if (source.weights_dir.empty()) {
    params_ = allocate_weights(*cpu_, cfg_);
    init_random_weights(*cpu_, *params_, source.config_text,
                        static_cast<uint64_t>(r.model.init_seed));
  } else {
    params_ = load_weights(*cpu_, cfg_, source.weights_dir);
    // A fresh run's adapters start as PEFT starts them; a resumed run's come from its checkpoint.
    if (cfg_.lora.enabled() && source.weights_dir == r.model.hf_dir)
      init_lora_weights(*cpu_, *params_, static_cast<uint64_t>(r.model.init_seed));
  }
}

void RankTraining::make_models(const Recipe& r, DataParallel& dp) {
  // The weights the model reads hold every parameter; the f32 master weights, gradients and
  // moments hold the trainable ones only (training/param_spec.h). On the CPU the weights are f32
  // and, with nothing frozen, are the master weights themselves; with a part frozen the master
  // weights are the trainable tensors' own copy, which the optimizer writes through to them.
  const int64_t micro = r.train.micro_batch_size;
  const int64_t n_micro = r.train.global_batch_size / micro;
  // A pipeline stage keeps the activations of every micro-batch 1F1B has in flight on it, in
  // models of their own over one gradient buffer.
  const int slots = pipelined() ? pipeline_slots(dp.stage(), dp.stages(),
                                                 static_cast<int>(n_micro / dp.replicas()))
                                : 1;
  // ZeRO-1 (parallel.sharding=optimizer): each rank keeps the moments and f32 master weights of
  // its shard only, inside the optimizer, which fills them from the host copy in connect() and
  // writes the weights the model reads through (on the CPU too, so that CI runs the GPU's path).
  // A pipeline stage's replicas shard the stage's tensors; with one replica there is nothing to
  // shard them over.
  sharded_ = r.optimizer.distributed && dp.replicas() > 1;
  // ZeRO-2 (parallel.sharding=optimizer_grads): the models write the layers' gradients into two
  // slots, and each rank keeps its shard of the sums (training/sharded_gradients.h). ZeRO-3
  // (optimizer_grads_params) also reads the layers' weights from two slots, each rank keeping
  // its shard of them (training/sharded_weights.h).
  const bool shard_weights = sharded_ && r.parallel.sharding == "optimizer_grads_params";
  if (sharded_ && (r.parallel.sharding == "optimizer_grads" || shard_weights)) {
    const ParamSpecs specs(*params_, frozen_, compute().compute_dtype());
    sharded_grads_ = std::make_unique<ShardedGradients>(compute(), cfg_, specs);
    if (shard_weights) sharded_weights_ = std::make_unique<ShardedWeights>(compute(), cfg_, specs);
  }
  ModelWeights* const shared_grads = sharded_grads_ ? &sharded_grads_->grads() : nullptr;
  if (sharded_weights_) {
    // The optimizer fills the weights in connect(), once it has sharded them; on the GPU the host
    // copy is released after that.
    weights_ = &sharded_weights_->weights();
    sharded_weights_->fill_whole(*params_);
    if (pipelined())
      sharded_weights_->stage_layers(limits_.stage.first_layer, limits_.stage.end_layer);
    // A pipeline stage's slots read the one set of weights and write the one set of gradients.
    for (int k = 0; k < slots; ++k)
      replicas_.push_back(
          std::make_unique<TrainableQwen3VL>(compute(), cfg_, *weights_, limits_, shared_grads));
  } else if (on_gpu()) {
    if (!sharded_) {
      const ParamSpecs specs(*params_, frozen_, gpu_->compute_dtype());
      master_ = allocate_state(*gpu_, cfg_, specs);
      upload_weights(*gpu_, *master_, *params_);
    }
    working_ = allocate_weights(*gpu_, cfg_);
    upload_weights(*gpu_, *working_, *params_);
    // The host copy served the load (or the random draw) only: checkpoints read the device.
    // Sharded, the optimizer takes its master weights from it first.
    if (!sharded_) params_.reset();
    weights_ = working_.get();
    replicas_.push_back(
        std::make_unique<TrainableQwen3VL>(compute(), cfg_, *working_, limits_, shared_grads));
    for (int k = 1; k < slots; ++k)
      replicas_.push_back(std::make_unique<TrainableQwen3VL>(compute(), cfg_, *working_, limits_,
                                                             &replicas_[0]->grads()));
  } else {
    if (!sharded_ && (frozen_.vision_tower || frozen_.merger || frozen_.language_model)) {
      master_ = allocate_state(*cpu_, cfg_, ParamSpecs(*params_, frozen_, cpu_->compute_dtype()));
      upload_weights(*cpu_, *master_, *params_);
    }
    weights_ = params_.get();
    // A small model's ops are too small to split across threads without most of the time going
    // to barriers, so each thread trains whole micro-batches on a replica of its own
    // (activations and gradients; the parameters are shared) and the replicas' gradients are
    // summed before the optimizer step. A large model keeps one replica and splits each op
    // instead: a replica costs a second copy of the gradients.
    constexpr int64_t kReplicaGradientBudget = int64_t(1) << 30;
    // Of a multi-process run, each rank is one replica (data_parallel.h): the ranks' gradients
    // are then summed as a single process sums its replicas'.
    // The step profile times one op at a time, so a profiled run keeps one replica.
    n_replicas_ = n_params_ * int64_t(sizeof(float)) <= kReplicaGradientBudget && dp.world() == 1 &&
                          !graphs_on_ && !profile_
                      ? static_cast<int>(std::min<int64_t>(omp_get_max_threads(), n_micro))
                      : 1;
    if (pipelined()) {
      replicas_.push_back(
          std::make_unique<TrainableQwen3VL>(compute(), cfg_, *params_, limits_, shared_grads));
      for (int k = 1; k < slots; ++k)
        replicas_.push_back(std::make_unique<TrainableQwen3VL>(compute(), cfg_, *params_, limits_,
                                                               &replicas_[0]->grads()));
    } else {
      IRIS_CHECK(shared_grads == nullptr || n_replicas_ == 1,
                 "sharded gradients need one model per rank");
      for (int k = 0; k < n_replicas_; ++k)
        replicas_.push_back(
            std::make_unique<TrainableQwen3VL>(compute(), cfg_, *params_, limits_, shared_grads));
    }
  }
  master_weights_ = master_ ? master_.get() : sharded_ ? nullptr : weights_;
  written_through_ = master_ || sharded_ ? weights_ : nullptr;
}

void RankTraining::use_graphs(const Recipe& r, DataParallel& dp) {
  // One graph API for all models (a capture is per backend, which CPU replica threads share).
  graph_api_ = make_graph_api(backend());
  graphs_first_.models = &replicas_;
  TrainGraphs tg;
  tg.decoder = r.cuda_graph.language.impl;
  tg.decoder_modules = r.cuda_graph.language.modules;
  tg.vision = r.cuda_graph.vision.impl == VisionGraphImpl::local;
  tg.vision_modules = r.cuda_graph.vision.modules;
  tg.warmup_runs = r.cuda_graph.language.warmup_steps;
  tg.overflow_is_error = r.cuda_graph.vision.overflow == VisionGraphOverflow::error;
  // This replica's micro-batches of a step (data_parallel.h: micro-batch i is replica
  // i % replicas'), which a full_iteration step graph plans input slots for; a pipeline stage
  // exchanges with its neighbours between micro-batches, so its graphs stop there.
  const int64_t n_micro = r.train.global_batch_size / r.train.micro_batch_size;
  tg.step_micro_batches =
      pipelined() ? 0
                  : static_cast<int>((n_micro + dp.replicas() - 1 - dp.replica()) / dp.replicas());
  // Graph replicas are pipeline slots (one thread runs them in turn); CPU micro-batch threads
  // keep graphs off.
  for (auto& m : replicas_) m->use_graphs(*graph_api_, tg);
}

void RankTraining::connect(const Recipe& r, DataParallel& dp, const std::string& resume_dir) {
  Backend& be = backend();
  TrainableQwen3VL& first = model();
  // Sharded (make_models), the weights the model reads are gathered whole every step.
  const std::vector<std::pair<int64_t, int64_t>> reduce_ranges =
      pipelined() ? stage_reduce_ranges(first, first.grads())
                  : std::vector<std::pair<int64_t, int64_t>>{};
  ModelWeights* const rank0_weights[] = {master_weights_, written_through_};
  dp_link_.reset(new DataParallel::Link(dp.connect(be, first.grads(), rank0_weights, 2,
                                                   /*reduce_gradients=*/!sharded_, reduce_ranges)));
  // Each bucket's all-reduce starts during the backward of the step's last micro-batch, once its
  // gradients are final.
  if (const auto hook = dp.gradients_final_hook())
    for (auto& m : replicas_) m->on_gradients_final(hook);
  // A pipeline stage updates the tensors it computes, and the gradient norm is the pipeline's.
  if (pipelined()) {
    stage_tensors_.stages = dp.pipeline_communicator();
    for (const PipelineStage& st : stages_) {
      stage_tensors_.held.emplace_back();
      for (const WeightBinding& b : weights_->bindings)
        stage_tensors_.held.back().push_back(stage_holds(st, cfg_.tie_word_embeddings, b.hf_name));
    }
  }
  if (sharded_grads_) {
    // A pipeline stage's replicas shard its span (as the optimizer's) and sum its layers.
    const std::pair<int64_t, int64_t> span =
        pipelined() ? stage_span(sharded_grads_->layout(),
                                 stage_tensors_.held[static_cast<size_t>(dp.stage())])
                    : std::pair<int64_t, int64_t>{0, -1};
    sharded_grads_->connect(
        be, *dp.data_parallel_communicator(), r.parallel.grad_bucket_elements, span,
        pipelined() ? std::pair{limits_.stage.first_layer, limits_.stage.end_layer}
                    : std::pair{0, -1});
    // One hook for both, in one order on every rank: the gradients' sum, then the weights'
    // gather, around each layer.
    using Pass = TrainableQwen3VL::LayerPass;
    for (auto& m : replicas_)
      m->on_layer([sg = sharded_grads_.get(), sw = sharded_weights_.get()](int layer, Pass pass,
                                                                           bool begin) {
        const bool backward = pass == Pass::backward;
        if (layer == TrainableQwen3VL::kLmHeadGradient ||
            layer == TrainableQwen3VL::kEmbeddingGradient) {
          sg->vocab(layer == TrainableQwen3VL::kLmHeadGradient
                        ? ShardedGradients::VocabUnit::lm_head
                        : ShardedGradients::VocabUnit::embedding,
                    begin);
          return;
        }
        if (layer < 0) {
          if (sw == nullptr) {
            sg->micro_batch_done();
          } else {
            sg->micro_batch_done([sw](int l, bool b) { sw->layer(l, true, b); });
          }
          return;
        }
        if (backward) sg->layer(layer, begin);
        if (sw != nullptr) sw->layer(layer, backward, begin);
      });
  }
  opt_ = std::make_unique<AdamW>(
      be, cfg_, master_weights_, sharded_grads_ ? sharded_grads_->layout() : first.grads(),
      adamw_config(r), sharded_weights_ ? &sharded_weights_->layout() : written_through_,
      sharded_ ? dp.data_parallel_communicator() : nullptr, int64_t(1) << 25,
      pipelined() ? &stage_tensors_ : nullptr, sharded_grads_ ? &sharded_grads_->shard() : nullptr,
      sharded_weights_.get());
  if (sharded_) {
    opt_->init_master(*params_);
    // On the CPU the host copy is the weights the model reads (unless they are sharded); on the
    // GPU it has served.
    if (on_gpu() || sharded_weights_) params_.reset();
  }
  tied_across_ = pipelined() && cfg_.tie_word_embeddings &&
                 !frozen_.frozen("model.language_model.embed_tokens.weight") &&
                 (dp.stage() == 0 || dp.stage() == dp.stages() - 1);
  if (tied_across_) {
    const int64_t n = dp.tied_scratch_elements(first.grads().text.embed.numel());
    Arena plan;
    plan.alloc(DType::f32, {n});
    tied_arena_ = Arena(be, plan.used());
    tied_scratch_ = tied_arena_.alloc(DType::f32, {n});
  }
  if (!resume_dir.empty()) opt_->load(optimizer_files(resume_dir));
}

void RankTraining::sum_gradients(DataParallel& dp) {
  for (int k = 1; k < n_replicas_; ++k) replicas_[static_cast<size_t>(k)]->move_grads_into(model());
  dp.reduce_gradients();
  // Sharded, the tied embedding's sum over the replicas and the stages lands whole on replica
  // 0 and zero on the others (DataParallel::sum_tied_gradient), so the shards' sum after it
  // leaves it as is.
  if (tied_across_)
    dp.sum_tied_gradient(backend(), model().grads().text.embed, tied_scratch_, sharded_);
  if (sharded_grads_) sharded_grads_->step_done();
}

size_t RankTraining::graph_count() const {
  size_t n = 0;
  for (const auto& m : replicas_) n += m->graph_count();
  return n;
}

double RankTraining::capture_ms() const {
  double ms = 0;
  for (const auto& m : replicas_) ms += m->capture_ms();
  return ms;
}

std::string RankTraining::memory_report(const Recipe& r, DataParallel& dp) const {
  // The memory planned for the run, by category; nothing is allocated once steps begin.
  const auto mib = [](size_t b) { return str_cat(b / (size_t(1) << 20), " MiB"); };
  TrainableQwen3VL& m = model();
  std::string plan =
      str_cat("memory on ", backend().name(), ": weights ", mib(weights_->arena.capacity()));
  if (sharded_weights_) plan += " (outside the decoder layers, and 2 layer slots)";
  if (master_)
    plan += str_cat(", f32 master weights ", mib(master_->arena.capacity()));
  else if (opt_->master_bytes() > 0)
    plan += str_cat(", f32 master weights ", mib(opt_->master_bytes()), " (this rank's 1/",
                    opt_->shards(), ")");
  if (sharded_grads_)
    plan += str_cat(", gradients ", mib(sharded_grads_->local_bytes()),
                    " (outside the decoder layers, and 2 layer slots) + ",
                    mib(sharded_grads_->shard_bytes()),
                    " (this rank's shard of the sums and one bucket's exchange scratch)");
  else
    plan += str_cat(", gradients ", mib(m.grads().arena.capacity()), " x ", n_replicas_);
  plan += str_cat(", AdamW moments ", mib(opt_->state_bytes()), ", activations ",
                  mib(m.activation_bytes()), " (train.recompute ", r.train.recompute,
                  ") and workspace ", mib(m.arena_bytes() - m.activation_bytes()), " x ",
                  replicas_.size(),
                  pipelined() ? " (this stage's parts, per micro-batch in flight)" : "");
  if (m.offloaded_bytes() > 0)
    plan += str_cat("; offloaded to host ", mib(m.offloaded_bytes()), " x ", replicas_.size(),
                    " (pinned; the device keeps two layers' of each offloaded activation)");
  if (opt_->shards() > 1)
    plan +=
        str_cat("; the AdamW moments are this rank's 1/", opt_->shards(),
                pipelined() ? " of its stage's" : "", " (parallel.sharding=", r.parallel.sharding,
                "), exchange scratch ", mib(opt_->exchange_bytes()));
  else if (r.optimizer.distributed && pipelined())
    plan +=
        "; optimizer.distributed has no replicas to shard a stage's moments over "
        "(parallel.data_parallel_size 1): each stage keeps its own";
  if (dp.world() > 1)
    plan +=
        ", " + dp.describe(graphs_on_ && r.cuda_graph.language.impl == GraphImpl::full_iteration);
  if (graphs_on_) {
    std::string tb, vb;
    for (int64_t b : limits_.text_buckets) tb += str_cat(tb.empty() ? "" : ",", b);
    for (int64_t b : limits_.vision_buckets) vb += str_cat(vb.empty() ? "" : ",", b);
    auto scope = [](const std::vector<GraphModule>& modules) {
      if (modules.empty()) return std::string();
      std::string s;
      for (GraphModule g : modules) s += str_cat(s.empty() ? "" : ",", to_string(g));
      return " (" + s + ")";
    };
    plan += str_cat("; graphs: decoder ", to_string(r.cuda_graph.language.impl),
                    scope(r.cuda_graph.language.modules), ", vision ",
                    to_string(r.cuda_graph.vision.impl), scope(r.cuda_graph.vision.modules),
                    ", captured after ", r.cuda_graph.language.warmup_steps,
                    " eager runs of a shape; text buckets [", tb, "], vision buckets [", vb, "]");
  }
  return plan;
}

}  // namespace iris
