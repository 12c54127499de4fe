#include "training/step_runner.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <exception>
#include <filesystem>

#include "core/error.h"
#include "core/fs.h"
#include "core/hardware_limits.h"
#include "core/usable_cores.h"
#include "training/pipeline_parallel.h"
#include "training/train_setup.h"

namespace iris {
namespace {

// How long a probed step may hold the device (logging.host_probe_steps): far above any step's
// enqueue, so that a hold that ends by itself means the host filled the launch queue.
constexpr double kHostProbeHoldSeconds = 5.0;

TrainSample to_train_sample(Sample&& s) {
  TrainSample t;
  t.ids = std::move(s.ids);
  t.labels = std::move(s.labels);
  t.pixel_values = std::move(s.pixel_values);
  t.grids = std::move(s.grids);
  t.runs = std::move(s.runs);
  return t;
}

// queue_forward_backward of every micro-batch, micro-batch i on replica i % replicas.size(); the
// losses stay on each replica's device total. One replica takes the step whole (queue_step: with
// full_iteration graphs, one graph). With several replicas (CPU only) each runs on a thread of its
// own, and the ops inside run on that one thread. Returns the labelled tokens seen.
int64_t run_on_replicas(const std::vector<std::unique_ptr<TrainableQwen3VL>>& replicas,
                        const std::vector<std::vector<const TrainSample*>>& micro_batches,
                        float grad_scale) {
  const auto n = static_cast<int64_t>(replicas.size());
  if (n == 1) return replicas[0]->queue_step(micro_batches, grad_scale);
  std::vector<int64_t> labelled(micro_batches.size(), 0);
  {
    // An exception must not leave an OpenMP region; the first one is rethrown after it.
    std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
    const int n_threads = static_cast<int>(n);
#pragma omp parallel num_threads(n_threads)
    {
      // The runtime may give fewer threads than asked for; a thread then takes several replicas.
      for (int64_t k = omp_get_thread_num(); k < n; k += omp_get_num_threads()) {
        try {
          for (auto i = static_cast<size_t>(k); i < micro_batches.size();
               i += static_cast<size_t>(n))
            labelled[i] = replicas[static_cast<size_t>(k)]->queue_forward_backward(micro_batches[i],
                                                                                   grad_scale);
        } catch (...) {
          errors[static_cast<size_t>(k)] = std::current_exception();
        }
      }
    }
    for (const std::exception_ptr& e : errors)
      if (e) std::rethrow_exception(e);
  }
  int64_t total = 0;
  for (int64_t c : labelled) total += c;
  return total;
}

}  // namespace

StepRunner::StepRunner(const Recipe& r, RankTraining& rank, DataParallel& dp, Dataset& train_data)
    : r_(r),
      rank_(rank),
      dp_(dp),
      train_data_(train_data),
      parts_(recipe_trained_parts(r)),
      step_timer_(rank.backend()) {
  batch_.reserve(static_cast<size_t>(r.train.global_batch_size));
}

TrainSample StepRunner::next_sample(Dataset& data) {
  const int64_t max_patches = rank_.limits().max_patches;
  for (int64_t tries = 0;; ++tries) {
    Sample s = data.next();
    if (report_skips_) report_skips_(data);
    if (count_patches(s.grids) <= max_patches) return to_train_sample(std::move(s));
    ++skipped_large_;
    IRIS_CHECK(tries <= data.size(), "no sample fits train.max_vision_patches = ", max_patches,
               " (the last one, ", s.source, ", has ", count_patches(s.grids),
               " patches); raise it or lower data.max_pixels");
  }
}

int64_t StepRunner::run(int64_t it, float lr, bool probed, StepMetrics& interval) {
  Backend& be = rank_.backend();
  TrainableQwen3VL& model = rank_.model();
  const auto& models = rank_.models();
  const int64_t micro = r_.train.micro_batch_size;
  const auto fetch_start = std::chrono::steady_clock::now();
  batch_.clear();
  int64_t batch_labels = 0;
  for (int64_t i = 0; i < r_.train.global_batch_size; ++i) {
    batch_.push_back(next_sample(train_data_));
    batch_labels += labelled_positions(batch_.back().labels);
  }
  IRIS_CHECK(batch_labels > 0, "global batch of iteration ", it,
             " has no labelled token; every sample needs an assistant reply");
  interval.data_seconds += seconds_since(fetch_start);

  // A probed step is queued while the device, idle after the synchronisation, is held: its
  // host enqueue is then the host's own work, where a busy device makes the host wait in
  // launches once the launch queue is full (a compute-bound step's host figure is mostly that).
  if (probed) {
    be.synchronize();
    be.hold_device(kHostProbeHoldSeconds);
  }
  // The profiled step runs op by op (each op timed alone on the device) from an idle device.
  ProfilingBackend* const profile = it == r_.logging.op_profile_step ? rank_.op_profile() : nullptr;
  // The profiled step also labels its ops by model part, for parallel.pipeline_costs: possible
  // where the rank holds every decoder layer.
  const int layers = rank_.config().text.num_hidden_layers;
  int64_t backward_layers = 0;
  std::vector<TrainableQwen3VL::LayerHook> saved_hooks;
  if (profile != nullptr) {
    profile->start();
    profile->set_part(kPartFirst);
    if (!rank_.pipelined())
      for (auto& m : models) {
        saved_hooks.push_back(m->layer_hook());
        m->on_layer(pipeline_part_hook(*profile, layers, &backward_layers, saved_hooks.back()));
      }
  }
  const auto step_start = std::chrono::steady_clock::now();
  // Waits and host times outside the step (an evaluation, a checkpoint) are not the step's.
  be.take_write_wait_seconds();
  for (auto& m : models) m->take_host_seconds();
  step_timer_.begin_step();
  model.zero_grads();
  const float grad_scale = static_cast<float>(1.0 / static_cast<double>(batch_labels));
  // This rank's micro-batches (all of them for a single process).
  micro_batches_.clear();
  std::vector<int64_t> global_ids;
  int64_t share_labels = 0;
  for (size_t i = 0; i < batch_.size(); i += static_cast<size_t>(micro)) {
    if (!dp_.owns(static_cast<int64_t>(i) / micro)) continue;
    global_ids.push_back(static_cast<int64_t>(i) / micro);
    micro_batches_.emplace_back();
    for (size_t j = i; j < i + static_cast<size_t>(micro); ++j) {
      micro_batches_.back().push_back(&batch_[j]);
      share_labels += labelled_positions(batch_[j].labels);
    }
  }
  // LoRA dropout draws each micro-batch's masks from its place in the global batch. Micro-batch i
  // runs on replica i % n_replicas (run_on_replicas); a pipeline stage's models take theirs as
  // 1F1B hands them out, so there each model counts its own, its rank mixed into the seed.
  const auto seed = static_cast<uint64_t>(r_.train.seed);
  for (size_t k = 0; k < models.size(); ++k) {
    if (rank_.pipelined()) {
      models[k]->set_dropout_step(seed ^ (static_cast<uint64_t>(dp_.rank()) << 40), it);
      continue;
    }
    std::vector<int64_t> ids;
    for (size_t i = k; i < global_ids.size(); i += models.size()) ids.push_back(global_ids[i]);
    models[k]->set_dropout_step(seed, it, std::move(ids));
  }
  // Micro-batch i runs on replica i % n_replicas, each replica's in order, and the replicas are
  // summed in order: the result depends on the thread count but not on timing.
  const int64_t counted = rank_.pipelined()
                              ? run_pipeline_step(models, micro_batches_, grad_scale, dp_)
                              : run_on_replicas(models, micro_batches_, grad_scale);
  if (profile != nullptr) profile->set_part("");  // the gradient sums and the optimizer
  rank_.sum_gradients(dp_);
  for (const TrainSample& s : batch_) {
    interval.tokens += static_cast<int64_t>(s.ids.size());
    interval.flops += training_flops(
        rank_.config(), {static_cast<int64_t>(s.ids.size()), labelled_positions(s.labels), s.grids},
        parts_);
  }
  IRIS_CHECK(counted == share_labels, "the model counted ", counted,
             " labelled tokens in iteration ", it, " but the labels hold ", share_labels,
             "; the loss normalisation would be wrong (label convention mismatch)");
  // Queued behind the backward: the loss and the gradient norm stay on the device until the
  // next logged step (a step with a non-finite gradient changes no weight meanwhile).
  rank_.optimizer().step(lr, model.frozen());
  // The step's end, which the GPU must reach within parallel.timeout_seconds (NCCL has no
  // timeout of its own); no host wait.
  dp_.mark_progress();
  // Waits for the device inside the step's writes are throttling, not enqueue work.
  const double waited = be.take_write_wait_seconds();
  interval.host_wait_seconds += waited;
  for (auto& m : models) {
    const TrainableQwen3VL::HostSeconds h = m->take_host_seconds();
    interval.host_prepare_seconds += h.prepare;
    interval.graph_launch_seconds += h.graph_launch;
    interval.graph_launch_cpu_seconds += h.graph_launch_cpu;
  }
  interval.host_seconds += seconds_since(step_start) - waited;
  step_timer_.end_step();
  ++interval.steps;
  if (profile != nullptr) {
    be.synchronize();
    const std::vector<OpRecord> records = profile->stop();
    op_profile_ = step_profile(records, 1e3 * seconds_since(step_start));
    ++interval.op_profiled_steps;
    MeasuredPipelineCosts measured;
    measured.layers = layers;
    if (rank_.pipelined()) {
      measured.not_measured = "this rank is one pipeline stage; profile a run without stages";
    } else {
      for (size_t k = 0; k < models.size(); ++k) models[k]->on_layer(saved_hooks[k]);
      if (backward_layers == 0)
        measured.not_measured =
            "the decoder layers' backward did not run apart (the language model is frozen)";
      else
        measured.costs = measured_pipeline_costs(records, layers);
    }
    pipeline_costs_ = std::move(measured);
  }
  if (probed) {
    ++interval.probed_steps;
    if (be.release_device()) ++interval.probe_queue_full;
  }
  interval.labelled_tokens += batch_labels;
  interval.samples += r_.train.global_batch_size;
  return batch_labels;
}

double timed_apart(Backend& be, const std::function<void()>& work) {
  // The step before is still on the device (the host runs ahead): its tail is the step's time.
  be.synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  work();
  return seconds_since(t0);
}

void evaluate(const Recipe& r, RankTraining& rank, DataParallel& dp, StepRunner& steps,
              Dataset& eval_data, MetricsLog& log, int64_t iteration) {
  TrainableQwen3VL& model = rank.model();
  const int64_t micro = r.train.micro_batch_size;
  eval_data.seek(DataPosition{});
  EvalMetrics em;
  em.iteration = iteration;
  double loss_sum = 0;
  std::vector<TrainSample> eval_batch;
  for (int64_t b = 0; b < r.train.eval_iters * r.train.global_batch_size; b += micro) {
    eval_batch.clear();
    for (int64_t i = 0; i < micro; ++i) eval_batch.push_back(steps.next_sample(eval_data));
    std::vector<const TrainSample*> mb;
    for (const TrainSample& s : eval_batch) mb.push_back(&s);
    if (rank.pipelined()) {
      // Forward only, one micro-batch at a time through the stages.
      em.labelled_tokens += model.stage_prepare(mb, 0.0f, /*forward_only=*/true);
      dp.stage_exchange({}, model.forward_inputs(), {}, {}, "the evaluation's forward receive");
      model.stage_forward();
      dp.stage_exchange({}, {}, model.forward_outputs(), {}, "the evaluation's forward send");
      dp.mark_progress();
      // Read per micro-batch and added in f64, as forward() is (zero before the last stage).
      loss_sum += model.take_forward_loss_sum();
    } else {
      const LossStats ls = model.forward(mb);
      loss_sum += ls.loss_sum;
      em.labelled_tokens += ls.n_tokens;
    }
    em.samples += micro;
  }
  // Every pipeline evaluates the whole set: the last stage of the first one counts.
  if (rank.pipelined()) loss_sum = dp.global_loss_sum(dp.replica() == 0 ? loss_sum : 0.0);
  em.loss = em.labelled_tokens > 0 ? loss_sum / em.labelled_tokens : 0.0;
  log.log_eval(em);
}

RunLog::RunLog(const Recipe& r, const TrainerOptions& options, const std::string& run_dir,
               const RankTraining& rank, DataParallel& dp, int64_t start_iteration, bool resumed)
    : r_(r),
      rank_(rank),
      dp_(dp),
      summary_path_((std::filesystem::path(run_dir) / "run_summary.json").string()),
      start_iteration_(start_iteration) {
  // MFU's denominator, when the device is one whose peak is known.
  peak_ = dense_bf16_peak(rank.backend().device(), rank.backend().name());
  MetricsLog::Options lo;
  lo.ranks = dp.world();
  lo.peak_flops_per_second = peak_.flops_per_second;
  lo.run_dir = run_dir;
  lo.metrics_file = r.logging.metrics_file;
  lo.plot_file = r.logging.plot;
  lo.total_iterations = r.train.train_iters;
  lo.progress_bar = options.progress_bar;
  lo.out = options.out;
  lo.rank_tag = launcher_rank_tag(dp.launched(), dp.rank());
  if (!dp.writer()) {
    quiet_.reset(std::fopen("/dev/null", "w"));
    IRIS_CHECK(quiet_ != nullptr, "cannot open /dev/null for rank ", dp.rank(), "'s silent log");
    lo = MetricsLog::Options{"",           "",         "", r.train.train_iters, false,
                             quiet_.get(), dp.world(), 0,  lo.rank_tag};
  }
  log_ = std::make_unique<MetricsLog>(lo, start_iteration);
  if (dp.writer() && resumed) {
    RunHistory history;
    std::string why;
    if (read_run_history(summary_path_, start_iteration, history, why)) {
      run_intervals_ = std::move(history.intervals);
      earlier_stretches_ = std::move(history.stretches);
    } else {
      history_note_ = str_cat("note: ", summary_path_, " will cover the run from iteration ",
                              start_iteration, " on only: ", why);
    }
  }
  interval_.stretch = static_cast<int64_t>(earlier_stretches_.size());
  graphs_at_interval_start_ = rank.graph_count();
  interval_start_ = std::chrono::steady_clock::now();
}

void RunLog::describe_start(const std::string& resume_dir, const TrainerState& state,
                            const std::vector<std::string>& notes) {
  MetricsLog& log = *log_;
  const Recipe& r = r_;
  DataParallel& dp = dp_;
  for (const std::string& n : notes) log.message(n);
  if (!history_note_.empty()) log.message(history_note_);
  const TrainableQwen3VL& model = rank_.model();
  log.message(str_cat(
      resume_dir.empty() ? "starting" : "resuming from " + resume_dir + " at", " iteration ",
      state.iteration, " of ", r.train.train_iters, ": ", rank_.parameters(),
      " parameters, global batch ", r.train.global_batch_size, " = ", r.train.micro_batch_size,
      " x ", r.accumulation_steps, " accumulation steps",
      dp.replicas() > 1 ? str_cat(" x ", dp.replicas(), " data-parallel ranks") : "",
      rank_.pipelined() ? str_cat(", through ", dp.stages(), " pipeline stages") : "", ", on ",
      rank_.backend().name(), ", activation arena ", model.arena_bytes() / (1024 * 1024), " MiB",
      rank_.micro_batch_threads() > 1
          ? str_cat(" x ", rank_.micro_batch_threads(), " micro-batch threads")
          : "",
      ", run directory ", r.checkpoint.dir));
  log.message(rank_.memory_report(r, dp));
  if (!rank_.planned_memory().empty()) log.message(rank_.planned_memory());
  log.message("peak for MFU: " + peak_.source);
  const int64_t micro = r.train.micro_batch_size;
  if (dp.world() > 1) log.message(dp.layout(r.train.global_batch_size / micro, micro));
  if (rank_.pipelined()) {
    // Which graphs each stage captures: its own layers', and the encoder's on stage 0 only.
    std::vector<std::string> graph_sets;
    for (const PipelineStage& st : rank_.stages()) {
      std::string g;
      if (r.cuda_graph.language.impl != GraphImpl::none)
        g = str_cat("decoder ", to_string(r.cuda_graph.language.impl), " (layers ", st.first_layer,
                    "-", st.end_layer - 1, ")");
      if (st.has_vision && r.cuda_graph.vision.impl != VisionGraphImpl::none &&
          r.cuda_graph.language.impl != GraphImpl::full_iteration)
        g += str_cat(g.empty() ? "" : ", ", "vision ", to_string(r.cuda_graph.vision.impl));
      graph_sets.push_back(g);
    }
    log.message(str_cat(
        "pipeline stages (",
        r.parallel.pipeline_layers.empty() ? "split by training FLOPs" : "parallel.pipeline_layers",
        "; stage s keeps the activations of min(", dp.stages(),
        " - s, micro-batches per replica) micro-batches):\n",
        describe_pipeline(rank_.stages(), dp.replicas(), graph_sets)));
  }
  // After the weights are drawn and uploaded, which use every core. OMP_NUM_THREADS, when set,
  // is the user's own choice.
  if (rank_.on_gpu() && std::getenv("OMP_NUM_THREADS") == nullptr) {
    const int cores = usable_cores();
    const int local = dp.local_processes();
    const int threads = gpu_host_threads(cores, local, r.data.config.num_workers);
    omp_set_num_threads(threads);
    log.message(str_cat("host threads: ", threads, " (", cores, " cores",
                        local > 1 ? str_cat(" shared by ", local, " processes") : std::string(),
                        ", less ", r.data.config.num_workers,
                        " data workers and the step's own thread; OMP_NUM_THREADS overrides)"));
  }
  if (!resume_dir.empty() && state.threads > 0 && state.threads != omp_get_max_threads())
    log.message(str_cat("note: the checkpoint was written with ", state.threads,
                        " threads and this run has ", omp_get_max_threads(),
                        "; losses will differ from an uninterrupted run in the last bits (set "
                        "OMP_NUM_THREADS=",
                        state.threads, " for an exact continuation)"));
}

double RunLog::read_losses(int64_t it, const std::string& last_checkpoint) {
  double loss_sum = 0;
  double aux_sum = 0, aux_runs = 0, dropped = 0, routed = 0;
  for (auto& m : rank_.models()) {
    loss_sum += m->take_loss_sum();
    const auto [aux, runs] = m->take_moe_aux_loss();
    aux_sum += aux;
    aux_runs += static_cast<double>(runs);
    const auto [d, r] = m->take_moe_drops();
    dropped += static_cast<double>(d);
    routed += static_cast<double>(r);
  }
  loss_sum = dp_.global_loss_sum(loss_sum);
  if (rank_.config().text.any_sparse_layer()) {
    interval_aux_sum_ += dp_.global_loss_sum(aux_sum);
    interval_aux_runs_ += static_cast<int64_t>(dp_.global_loss_sum(aux_runs));
  }
  if (rank_.limits().moe_capacity.drops()) {
    interval_dropped_slots_ += static_cast<int64_t>(dp_.global_loss_sum(dropped));
    interval_routed_slots_ += static_cast<int64_t>(dp_.global_loss_sum(routed));
  }
  const std::vector<float> norms = rank_.optimizer().take_grad_norms();
  const int64_t first = it - static_cast<int64_t>(norms.size()) + 1;
  const std::string last = last_checkpoint.empty() ? "none" : last_checkpoint;
  for (size_t k = 0; k < norms.size(); ++k)
    IRIS_CHECK(std::isfinite(norms[k]), "the gradient norm is ", norms[k], " at iteration ",
               first + static_cast<int64_t>(k),
               " (NaN or overflow in the backward; that step changed no weight); lower "
               "optimizer.lr or check the data (the last checkpoint is ",
               last, ")");
  const double loss = loss_sum / static_cast<double>(unread_labels_);
  IRIS_CHECK(std::isfinite(loss), "the loss is ", loss, " in iterations ", first, "-", it,
             "; lower optimizer.lr or check the data (the last checkpoint is ", last, ")");
  interval_loss_sum_ += loss_sum;
  unread_labels_ = 0;
  return loss;
}

void RunLog::add_evaluation(double seconds) {
  interval_.eval_seconds += seconds;
  ++interval_.evaluations;
}

void RunLog::add_checkpoint(double seconds) {
  interval_.checkpoint_seconds += seconds;
  ++interval_.checkpoints;
}

void RunLog::end_interval(int64_t it, float lr, double device_seconds) {
  StepMetrics& interval = interval_;
  interval.iteration = it;
  interval.loss = interval_loss_sum_ / static_cast<double>(interval.labelled_tokens);
  interval.learning_rate = lr;
  interval.grad_norm = rank_.optimizer().last_grad_norm();
  interval.moe_aux_runs = interval_aux_runs_;
  interval.moe_dropped_slots = interval_dropped_slots_;
  interval.moe_routed_slots = interval_routed_slots_;
  interval.moe_aux_loss =
      interval_aux_runs_ > 0 ? interval_aux_sum_ / static_cast<double>(interval_aux_runs_) : 0.0;
  interval.wall_seconds = seconds_since(interval_start_);
  interval.seconds = interval.wall_seconds - interval.eval_seconds - interval.checkpoint_seconds;
  // On the GPU memory is planned up front, so what the device holds now is its peak.
  interval.memory_bytes = rank_.on_gpu() ? static_cast<int64_t>(rank_.gpu()->device_memory_in_use())
                                         : peak_host_memory_bytes();
  // The loss read before this waited for the device, so these marks are complete.
  interval.device_seconds = device_seconds;
  interval.graphs_captured = static_cast<int64_t>(rank_.graph_count() - graphs_at_interval_start_);
  graphs_at_interval_start_ = rank_.graph_count();
  peak_memory_ = std::max(peak_memory_, interval.memory_bytes);
  log_->log(interval);
  run_intervals_.push_back(interval);
  if (interval.checkpoints > 0) write_summary("running", it, 0);
  interval_ = StepMetrics{};
  interval_.stretch = static_cast<int64_t>(earlier_stretches_.size());
  interval_loss_sum_ = 0;
  interval_aux_sum_ = 0;
  interval_aux_runs_ = 0;
  interval_dropped_slots_ = 0;
  interval_routed_slots_ = 0;
}

void RunLog::write_summary(const std::string& status, int64_t final_iteration, int stop_signal) {
  if (!dp_.writer()) return;
  const Recipe& r = r_;
  const TrainableQwen3VL& model = rank_.model();
  RunSummary sum;
  sum.status = status;
  sum.device = rank_.backend().name();
  sum.on_gpu = rank_.on_gpu();
  sum.ranks = dp_.world();
  sum.stretches = earlier_stretches_;
  sum.stretches.push_back({start_iteration_, final_iteration, stop_signal, sum.device, sum.ranks});
  sum.start_iteration = sum.stretches.front().start;
  sum.final_iteration = final_iteration;
  sum.stop_signal = stop_signal;
  sum.micro_batch_size = r.train.micro_batch_size;
  sum.global_batch_size = r.train.global_batch_size;
  sum.seq_length = r.train.seq_length;
  sum.recompute = r.train.recompute;
  sum.intervals = run_intervals_;
  sum.peak = peak_;
  sum.peak_memory_bytes =
      rank_.on_gpu()
          ? std::max(peak_memory_, static_cast<int64_t>(rank_.gpu()->device_memory_in_use()))
          : peak_host_memory_bytes();
  sum.decoder_graphs = to_string(r.cuda_graph.language.impl);
  sum.vision_graphs = to_string(r.cuda_graph.vision.impl);
  sum.graph_count = static_cast<int64_t>(rank_.graph_count());
  sum.capture_ms = rank_.capture_ms();
  sum.graph_memory_bytes = model.graph_memory_bytes();
  sum.overflow_runs = model.overflow_runs();
  for (const auto& m : rank_.models()) {
    const auto& p = m->padding_stats();
    sum.tokens += p.tokens;
    sum.padded_tokens += p.padded_tokens;
    sum.patches += p.patches;
    sum.padded_patches += p.padded_patches;
    sum.labels += p.labels;
    sum.label_slots += p.label_slots;
  }
  write_file_atomic(summary_path_, run_summary_json(sum));
}

void RunLog::describe_end(const TrainResult& result, int64_t start_state_iteration,
                          const DataStats& ds, const DataStats* eval_stats, int64_t skipped_large) {
  MetricsLog& log = *log_;
  const Recipe& r = r_;
  const TrainableQwen3VL& model = rank_.model();
  if (result.stop_signal != 0)
    log.message(str_cat(
        "stopped by ", result.stop_signal == SIGINT ? "SIGINT" : "SIGTERM", " at iteration ",
        result.final_iteration > 0 ? result.final_iteration : start_state_iteration, " of ",
        r.train.train_iters,
        result.last_checkpoint.empty() ? std::string("; no checkpoint yet")
                                       : "; the last checkpoint is " + result.last_checkpoint,
        ": run the same command to resume"));
  if (const std::string s = ds.summary(); !s.empty()) log.message("data: " + s);
  if (eval_stats != nullptr)
    if (const std::string s = eval_stats->summary(); !s.empty()) log.message("eval data: " + s);
  if (skipped_large > 0)
    log.message(str_cat("data: ", skipped_large, " samples with more than ",
                        rank_.limits().max_patches,
                        " vision patches skipped (train.max_vision_patches)"));
  if (const std::string o = dp_.overlap_summary(); !o.empty()) log.message(o);
  if (rank_.graphs_on()) {
    const auto& p = model.padding_stats();
    log.message(str_cat("graphs: ", rank_.graph_count(), " captured in ", int(rank_.capture_ms()),
                        " ms; padding: ", p.tokens, " of ", p.padded_tokens, " tokens and ",
                        p.patches, " of ", p.padded_patches, " patch rows and ", p.labels, " of ",
                        p.label_slots, " label slots real; ", model.overflow_runs(),
                        " micro-batches above the largest bucket ran eagerly"));
    if (rank_.on_gpu()) {
      // What the graphs hold, by set: the largest one names the shape that costs most.
      std::pair<std::string, int64_t> largest{"", -1};
      int64_t total = 0;
      size_t sets = 0;
      for (const auto& m : rank_.models())
        for (const auto& set : m->graph_memory_by_set()) {
          total += set.second;
          ++sets;
          if (set.second > largest.second) largest = set;
        }
      if (sets > 0)
        log.message(str_cat("graph memory: ", total >> 20, " MiB in ", sets, " graphs; largest '",
                            largest.first, "', ", largest.second >> 20, " MiB"));
    }
  }
  if (!dp_.writer()) return;
  write_summary(result.stop_signal != 0 ? "stopped" : "finished", result.final_iteration,
                result.stop_signal);
  // This stretch's, as the summary's steady state is.
  std::vector<StepMetrics> own;
  for (const StepMetrics& m : run_intervals_)
    if (m.stretch == static_cast<int64_t>(earlier_stretches_.size())) own.push_back(m);
  const SteadyState st = steady_state(own);
  const auto g4 = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.4g", v);
    return std::string(buf);
  };
  const double per_rank = static_cast<double>(dp_.world());
  if (st.steps > 0)
    log.message(str_cat(
        "steady state (iterations ", st.first_iteration, "-", st.last_iteration, "): step ",
        g4(st.step_seconds), " s (data ", g4(st.data_seconds), ", host enqueue ",
        g4(st.host_seconds), " (preparing inputs ", g4(st.host_prepare_seconds),
        ", launching graphs ", g4(st.graph_launch_seconds), "), host waiting for write staging ",
        g4(st.host_wait_seconds), ", device ", g4(st.device_seconds), "), ",
        g4(st.tokens_per_second / per_rank), " tokens/s and ",
        g4(st.flops_per_second / per_rank / 1e12), " model TFLOP/s per ",
        rank_.on_gpu() ? "GPU" : "process",
        peak_.flops_per_second > 0
            ? ", MFU " + g4(100 * st.flops_per_second / per_rank / peak_.flops_per_second) + "%"
            : std::string()));
  else
    log.message(
        "steady state: none (it starts after the first logged interval and after the last "
        "graph capture; run more iterations or lower logging.log_interval)");
  // The whole run's, across its resumes, as the summary's totals are.
  if (!run_intervals_.empty()) {
    StepMetrics t;
    for (const StepMetrics& m : run_intervals_) {
      t.steps += m.steps;
      t.tokens += m.tokens;
      t.seconds += m.seconds;
      t.eval_seconds += m.eval_seconds;
      t.checkpoint_seconds += m.checkpoint_seconds;
      t.evaluations += m.evaluations;
      t.checkpoints += m.checkpoints;
    }
    const StepMetrics &first = run_intervals_.front(), &last = run_intervals_.back();
    const size_t stretches = earlier_stretches_.size() + 1;
    log.message(str_cat(
        "run totals (iterations ", first.iteration - first.steps + 1, "-", last.iteration,
        stretches > 1 ? str_cat(", ", stretches, " stretches") : std::string(), "): ", t.steps,
        " steps, ", t.tokens, " tokens in ", g4(t.seconds), " s of steps; ", t.evaluations,
        " evaluations in ", g4(t.eval_seconds), " s; ", t.checkpoints, " checkpoints in ",
        g4(t.checkpoint_seconds), " s; loss ", g4(first.loss), " (iteration ", first.iteration,
        ") to ", g4(last.loss), " (iteration ", last.iteration, ")"));
  }
  log.message("run summary: " + summary_path_);
}

}  // namespace iris
