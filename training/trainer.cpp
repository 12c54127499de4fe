#include "training/trainer.h"

#include "bridge/architecture.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bridge/chat_prompt.h"
#include "bridge/random_weights.h"
#include "core/error.h"
#include "core/fs.h"
#include "language/tokenizer.h"
#include "training/chat_format.h"
#include "training/checkpoint.h"
#include "training/data_parallel.h"
#include "training/dataset.h"
#include "training/lr_schedule.h"
#include "training/pipeline_costs.h"
#include "training/run_checkpoints.h"
#include "training/run_setup.h"
#include "training/step_runner.h"

namespace iris {
namespace {

using nlohmann::json;

// SIGTERM (a scheduler's preemption or time limit) and SIGINT (Ctrl-C) ask the step loop to save
// a checkpoint after the step in progress and return; a second one ends the process at once.
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal != 0) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  g_stop_signal = sig;
  // write() is async-signal-safe; the step loop may not notice the flag for a while.
  static const char kText[] =
      "\niris train: stop requested; saving a checkpoint after the current step (send the "
      "signal again to stop at once, without it)\n";
  const ssize_t ignored = ::write(STDERR_FILENO, kText, sizeof(kText) - 1);
  (void)ignored;
}

// Installs the handlers for the lifetime of the object, then puts back whatever was there.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;  // reads and writes in progress go on rather than fail with EINTR
    ::sigaction(SIGTERM, &sa, &old_term_);
    ::sigaction(SIGINT, &sa, &old_int_);
  }
  ~StopSignals() {
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGINT, &old_int_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int received() const { return g_stop_signal; }

 private:
  struct sigaction old_term_ {};
  struct sigaction old_int_ {};
};

}  // namespace

int gpu_host_threads(int cores, int processes_on_host, int data_workers) {
  return std::max(1, cores / std::max(1, processes_on_host) - data_workers - 1);
}

void init_random_weights(Backend& backend, ModelWeights& weights, const std::string& config_json,
                         uint64_t seed) {
  const json j = json::parse(config_json);
  auto range = [&](const char* section) {
    if (j.contains(section) && j[section].contains("initializer_range") &&
        j[section]["initializer_range"].is_number())
      return j[section]["initializer_range"].get<double>();
    return j.value("initializer_range", 0.02);
  };
  RandomInit init;
  init.seed = seed;
  init.text_std = range("text_config");
  init.vision_std = range("vision_config");
  fill_random_weights(backend, weights, init);
}

namespace {

// The data a run trains on, positioned where the resumed checkpoint left it, and the held-out
// set it evaluates on. The files' fingerprints go into every checkpoint, so that a resume can
// tell when the data changed under it (its position would then point into other samples).
struct RunData {
  std::vector<DataFileFingerprint> files;
  std::unique_ptr<Dataset> train, eval;
};

// Videos in the data are preprocessed as the model's family and video processor say (the
// checkpoint's video_preprocessor_config.json, else its family's defaults), under
// data.video_fps and data.video_max_frames.
std::shared_ptr<const DataVideo> data_video(const Recipe& r, const ModelConfig& cfg) {
  auto v = std::make_shared<DataVideo>();
  v->model = cfg;
  v->processor = r.model.hf_dir.empty() ? cfg.arch->default_video_preprocessor(cfg)
                                        : model_video_preprocessor(r.model.hf_dir, cfg);
  if (r.data.config.video_fps >= 0) v->processor.fps = r.data.config.video_fps;
  if (r.data.config.video_max_frames > 0) {
    v->processor.max_frames = r.data.config.video_max_frames;
    v->processor.min_frames = std::min(v->processor.min_frames, v->processor.max_frames);
  }
  v->processor.validate("data.video_fps and data.video_max_frames");
  return v;
}

RunData open_data(const Recipe& r, const ModelConfig& cfg, const Tokenizer& tok,
                  const PreprocessorConfig& pp, const ChatFormat& chat, const RunStart& start) {
  RunData d;
  if (!r.data.config.mock)
    for (const std::string& f : r.data.config.train_files)
      d.files.push_back(fingerprint_data_file(f));
  DataConfig train_cfg = r.data.config;
  train_cfg.video = data_video(r, cfg);
  d.train = std::make_unique<Dataset>(train_cfg, tok, pp, chat);
  if (!start.resume_dir.empty()) {
    IRIS_CHECK(start.state.data_seed == r.data.config.seed, "the checkpoint ", start.resume_dir,
               " was trained with data seed ", start.state.data_seed, " but train.seed is ",
               r.data.config.seed,
               "; resuming would continue another data order (restore "
               "train.seed=",
               start.state.data_seed, ")");
    d.train->seek(start.state.data_position);
  }
  if (r.train.eval_interval > 0) {
    DataConfig ec = train_cfg;
    ec.train_files = r.data.eval_files;
    ec.files_key = "data.eval_files";
    ec.shuffle = false;
    ec.seed = r.data.config.seed + 1;  // mock mode: held-out samples differ from training ones
    d.eval = std::make_unique<Dataset>(ec, tok, pp, chat);
  }
  return d;
}

// What the log says before the first step, besides the run's size and layout: the resume's
// warnings, the optimizer state a resume found missing, the chat template and data changes.
std::vector<std::string> start_notes(const RunStart& start, const RankTraining& rank,
                                     const ChatFormat& chat, const RunData& data) {
  std::vector<std::string> notes = start.found.warnings;
  notes.insert(notes.end(), start.notes.begin(), start.notes.end());
  if (!rank.optimizer().reinitialised_parts().empty()) {
    std::string parts;
    for (const std::string& p : rank.optimizer().reinitialised_parts())
      parts += str_cat(parts.empty() ? "" : ", ", p);
    notes.push_back(str_cat("note: the checkpoint has no optimizer state for ", parts,
                            " (frozen in the run that wrote it); its AdamW moments and step "
                            "counts start at zero"));
  }
  notes.push_back(chat.describe());
  if (!chat.has_template() && !chat.kwargs().empty())
    notes.push_back(
        "note: data.enable_thinking has no effect: the built-in ChatML has no variables");
  if (!start.resume_dir.empty())
    for (const std::string& change : data_changes(start.state.data_files, data.files))
      notes.push_back(str_cat("warning: ", change, "; the resumed run continues at epoch ",
                              start.state.data_position.epoch, ", sample ",
                              start.state.data_position.index,
                              " of the data as it is now, so samples may be skipped or repeated"));
  return notes;
}

// The step loop: set-up, then each step, its log and its checkpoint, until train.train_iters or
// a stop signal.
TrainResult train(const Recipe& r, const TrainerOptions& options, DataParallel& dp) {
  const StopSignals stop;
  RunStart start = start_run(r, dp);
  TrainerState& state = start.state;
  TrainResult result;
  result.run_dir = start.run_dir;
  result.start_iteration = result.final_iteration = state.iteration;
  result.last_checkpoint = start.resume_dir;
  if (start.finished) {
    result.finished = finished_message(r, start);
    return result;
  }
  const ModelSource source = model_source(r, start.resume_dir);
  RankTraining rank(r, source, start.resume_dir, dp);

  const Tokenizer tok = Tokenizer::from_file(r.model.tokenizer);
  const ModelConfig& cfg = source.cfg;
  check_vision_token_ids(tok, r.model.tokenizer, cfg.image_token_id, cfg.video_token_id,
                         cfg.vision_start_token_id, cfg.vision_end_token_id, "the model's config");
  const PreprocessorConfig pp = recipe_preprocessor(r);
  const ChatFormat chat = recipe_chat_format(r);
  RunData data = open_data(r, cfg, tok, pp, chat, start);
  {
    // Ranks started in other folders could read other files under the same relative paths;
    // only rank 0's fingerprints reach the checkpoints, so the difference would go unnoticed.
    std::string fingerprints;
    for (const DataFileFingerprint& f : data.files)
      fingerprints += str_cat(f.bytes, ":", f.hash, ";");
    dp.check_same_on_every_rank(fingerprints, "data files (data.train_files: sizes and hashes)",
                                "start every rank in one working directory, or give absolute "
                                "paths to the same files");
  }
  Checkpoints checkpoints(r, start, rank, dp, hf_config_text(source.config_text),
                          side_files(r, tok, pp, chat), data.files);
  checkpoints.write_resolved_config();
  // With schedule.override_on_resume a resume may change it; the checkpoints record it.
  const LrSchedule schedule = recipe_schedule(r).lr_schedule();

  RunLog run_log(r, options, start.run_dir, rank, dp, state.iteration, !start.resume_dir.empty());
  MetricsLog& log = run_log.log();
  run_log.describe_start(start.resume_dir, state, start_notes(start, rank, chat, data));

  const int64_t start_iteration = state.iteration;
  // The checkpoint's files are timed as its save; committing it (the rename, `latest`, pruning)
  // waits for the step's record, as Checkpoints explains.
  auto write_checkpoint = [&](int64_t it) {
    const double seconds =
        timed_apart(rank.backend(), [&] { checkpoints.write(it, state, data.train->position()); });
    run_log.add_checkpoint(seconds);
    return seconds;
  };
  auto commit_checkpoint = [&](int64_t it, double seconds) {
    const std::string dir = checkpoints.commit(it);
    if (dir.empty()) return;
    result.last_checkpoint = dir;
    char took[32];
    std::snprintf(took, sizeof(took), "%.4g", seconds);
    log.message(str_cat("saved checkpoint ", dir, " in ", took, " s"));
  };

  StepRunner steps(r, rank, dp, *data.train);
  // Each skipped line is reported as it is found, and the whole count by reason at the end.
  const auto report_skips = [&](Dataset& d) {
    const char* which = &d == data.train.get() ? "data" : "eval data";
    for (const SkippedLine& s : d.take_new_skips())
      log.message(str_cat("warning: ", which, ": skipped ", s.describe()));
  };
  report_skips(*data.train);
  if (data.eval) report_skips(*data.eval);
  steps.on_skips(report_skips);
  log.progress(state.iteration);
  // A stop asked for before the first step leaves nothing new to save.
  result.stop_signal = dp.agreed_stop(stop.received());
  for (int64_t it = state.iteration + 1; it <= r.train.train_iters && !result.stop_signal; ++it) {
    const bool probed = it > r.train.train_iters - r.logging.host_probe_steps;
    const float lr = schedule.at(it - 1);
    const int64_t batch_labels = steps.run(it, lr, probed, run_log.interval());
    if (const std::optional<StepProfile> p = steps.take_op_profile()) {
      log.message(str_cat("step profile of iteration ", it, ": ", p->ops_ms,
                          " ms of device time in its ops, each run alone, and ", p->idle_ms,
                          " ms idle between them (the step ran op by op, so it is slower than "
                          "the others and kept out of the steady state)"));
      for (const std::string& line :
           step_profile_table(*p, rank.floors().gemm_tflops, rank.floors().copy_gbps))
        log.message("  " + line);
    }
    if (const auto measured = steps.take_pipeline_costs()) {
      if (!measured->costs) {
        log.message("pipeline costs not measured: " + measured->not_measured);
      } else {
        const PipelineCosts& c = *measured->costs;
        const std::string path =
            (std::filesystem::path(start.run_dir) / "pipeline_costs.json").string();
        if (dp.rank() == 0)
          write_file_atomic(path, pipeline_costs_json(c, measured->layers).dump(2) + "\n");
        log.message(str_cat("pipeline costs of iteration ", it, ": ", c.layer,
                            " ms per decoder layer, ", c.first, " ms of vision and embedding, ",
                            c.last, " ms of norm, lm_head and loss; written to ", path,
                            " (a pipelined run balances its stages by them with "
                            "parallel.pipeline_costs=",
                            path, ")"));
      }
    }
    state.iteration = it;
    state.consumed_samples += r.train.global_batch_size;
    for (const TrainSample& s : steps.batch())
      state.consumed_tokens += static_cast<int64_t>(s.ids.size());
    run_log.add_unread(batch_labels);
    result.final_iteration = it;

    // Every rank stops after the same step, whichever of them the signal reached, with a
    // checkpoint of that step.
    result.stop_signal = dp.agreed_stop(stop.received());
    const bool saving = (r.checkpoint.save_interval > 0 && it % r.checkpoint.save_interval == 0) ||
                        (it == r.train.train_iters && r.checkpoint.save_final) ||
                        result.stop_signal != 0;
    // Intervals end at multiples of log_interval and at every checkpoint, so that a resume
    // continues the run's record (run_summary.json, metrics) from a closed interval; after a
    // resume the first one starts at the checkpoint. A probed step, and the profiled one, is an
    // interval of its own, kept out of the steady state.
    const bool interval_ends = it % r.logging.log_interval == 0 || it == r.train.train_iters ||
                               probed || it == r.train.train_iters - r.logging.host_probe_steps ||
                               it == r.logging.op_profile_step ||
                               it + 1 == r.logging.op_profile_step || saving;
    if (interval_ends) result.last_loss = run_log.read_losses(it, result.last_checkpoint);
    // Both are timed apart from the steps, and the interval's line (after them) gives their time.
    if (data.eval && it % r.train.eval_interval == 0)
      run_log.add_evaluation(
          timed_apart(rank.backend(), [&] { evaluate(r, rank, dp, steps, *data.eval, log, it); }));
    const double checkpoint_seconds = saving ? write_checkpoint(it) : 0.0;
    if (interval_ends) {
      run_log.end_interval(it, lr, steps.take_device_seconds());
      if (saving) commit_checkpoint(it, checkpoint_seconds);
      run_log.start_interval();
    }
    log.progress(it);
  }
  run_log.describe_end(result, start_iteration, data.train->stats(),
                       data.eval ? &data.eval->stats() : nullptr, steps.skipped_large());
  return result;
}

}  // namespace

TrainResult run_training(const Recipe& recipe, const TrainerOptions& options) {
  DataParallel dp(recipe.parallel);
  if (dp.world() == 1) return train(recipe, options, dp);
  // An error on one rank would leave the others waiting in their next exchange: it ends the job.
  try {
    return train(recipe, options, dp);
  } catch (const std::exception& e) {
    dp.abort_job(e);
  }
}

}  // namespace iris
