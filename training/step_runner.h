// A training run's steps and its log: StepRunner runs one optimizer step (the global batch
// fetched, this rank's micro-batches through its models, the gradients summed, the optimizer
// step queued), RunLog reads the device's losses and gradient norms once per logged interval,
// writes the interval's metrics and, at the end, the run's summary.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/op_profile.h"
#include "training/data_parallel.h"
#include "training/dataset.h"
#include "training/metrics_log.h"
#include "training/pipeline_costs.h"
#include "training/recipe.h"
#include "training/run_setup.h"
#include "training/train_model.h"
#include "training/trainer.h"

namespace iris {

class StepRunner {
 public:
  StepRunner(const Recipe& r, RankTraining& rank, DataParallel& dp, Dataset& train_data);

  // Runs step `it` at learning rate `lr` and adds its times, tokens and FLOPs into `interval`.
  // probed: the step is queued while the device is held (logging.host_probe_steps). Returns the
  // global batch's labelled tokens.
  int64_t run(int64_t it, float lr, bool probed, StepMetrics& interval);
  // The global batch of the last step.
  const std::vector<TrainSample>& batch() const { return batch_; }

  // The next sample of `data` whose images fit the planned activation memory; the others are
  // skipped, deterministically, so a resumed run skips the same ones.
  TrainSample next_sample(Dataset& data);
  int64_t skipped_large() const { return skipped_large_; }
  // Called with the dataset after each sample it gives: the lines it skipped meanwhile are
  // reported as they are found.
  void on_skips(std::function<void(Dataset&)> report) { report_skips_ = std::move(report); }
  // Device seconds of the steps since the last call.
  double take_device_seconds() { return step_timer_.take_seconds(); }
  // The step profile of the step logging.op_profile_step names, once it has run (then empty).
  std::optional<StepProfile> take_op_profile() { return std::exchange(op_profile_, std::nullopt); }
  // What the profiled step measured for parallel.pipeline_costs (training/pipeline_costs.h), once
  // it has run (then empty): the costs, or why there are none.
  struct MeasuredPipelineCosts {
    std::optional<PipelineCosts> costs;
    int layers = 0;
    std::string not_measured;
  };
  std::optional<MeasuredPipelineCosts> take_pipeline_costs() {
    return std::exchange(pipeline_costs_, std::nullopt);
  }

 private:
  const Recipe& r_;
  RankTraining& rank_;
  DataParallel& dp_;
  Dataset& train_data_;
  const TrainedParts parts_;
  StepTimer step_timer_;
  int64_t skipped_large_ = 0;
  std::function<void(Dataset&)> report_skips_;
  std::vector<TrainSample> batch_;
  std::vector<std::vector<const TrainSample*>> micro_batches_;
  std::optional<StepProfile> op_profile_;
  std::optional<MeasuredPipelineCosts> pipeline_costs_;
};

// Runs `work` once the device has finished what was queued before it, and returns its wall time:
// an evaluation's or a checkpoint's own, with none of the step before it.
double timed_apart(Backend& be, const std::function<void()>& work);

// The evaluation on data.eval_files: its loss, logged.
void evaluate(const Recipe& r, RankTraining& rank, DataParallel& dp, StepRunner& steps,
              Dataset& eval_data, MetricsLog& log, int64_t iteration);

class RunLog {
 public:
  // Ranks other than 0 train silently: one log, one metrics file. `resumed`: the run continues a
  // checkpoint at start_iteration, and run_summary.json carries on what the earlier stretches
  // left there (read_run_history).
  RunLog(const Recipe& r, const TrainerOptions& options, const std::string& run_dir,
         const RankTraining& rank, DataParallel& dp, int64_t start_iteration, bool resumed);

  MetricsLog& log() { return *log_; }
  // What the run is about to do: its size, layout, memory and threads.
  void describe_start(const std::string& resume_dir, const TrainerState& state,
                      const std::vector<std::string>& notes);
  // The interval in progress, which steps add into.
  StepMetrics& interval() { return interval_; }
  // A step's labelled tokens, whose loss stays on the device until the next read.
  void add_unread(int64_t labels) { unread_labels_ += labels; }
  // The one read of an interval: the summed loss of the steps since the last read and each
  // step's gradient norm, checked finite (errors name the last checkpoint). Returns the mean loss.
  double read_losses(int64_t it, const std::string& last_checkpoint);
  // An evaluation's or a checkpoint's wall time (timed_apart), kept out of the interval's steps.
  void add_evaluation(double seconds);
  void add_checkpoint(double seconds);
  // Closes the interval that ends at step `it` and logs it; `device_seconds` are its steps'. An
  // interval with a checkpoint also rewrites run_summary.json, so that a run killed later leaves
  // the record a resume from that checkpoint continues.
  void end_interval(int64_t it, float lr, double device_seconds);
  // Starts the next interval's clock: what came between (the record, the summary, a checkpoint's
  // commit) belongs to no interval.
  void start_interval() { interval_start_ = std::chrono::steady_clock::now(); }
  // After the last step: why it stopped, what the data skipped, the graphs and the run summary.
  void describe_end(const TrainResult& result, int64_t start_state_iteration,
                    const DataStats& data_stats, const DataStats* eval_stats,
                    int64_t skipped_large);

 private:
  // run_summary.json (rank 0): the run to `final_iteration` with the status given.
  void write_summary(const std::string& status, int64_t final_iteration, int stop_signal);

  const Recipe& r_;
  const RankTraining& rank_;
  DataParallel& dp_;
  std::string summary_path_;
  DevicePeak peak_;
  std::unique_ptr<FILE, int (*)(FILE*)> quiet_{nullptr, &std::fclose};
  std::unique_ptr<MetricsLog> log_;
  StepMetrics interval_;
  // The run's intervals (the earlier stretches' up to the resumed checkpoint, then this one's),
  // the earlier stretches, and the most device memory seen, for run_summary.json.
  std::vector<StepMetrics> run_intervals_;
  std::vector<RunStretch> earlier_stretches_;
  int64_t start_iteration_ = 0;
  std::string history_note_;  // why run_summary.json starts at this stretch, when it must
  int64_t peak_memory_ = 0;
  size_t graphs_at_interval_start_ = 0;
  double interval_loss_sum_ = 0;
  double interval_aux_sum_ = 0;  // load-balancing losses of the interval's micro-batches, all ranks
  int64_t interval_aux_runs_ = 0;
  // Slots dropped over the experts' capacity, of those routed, all ranks (metrics_log.h).
  int64_t interval_dropped_slots_ = 0, interval_routed_slots_ = 0;
  int64_t unread_labels_ = 0;  // labelled tokens of the steps whose loss is still on the device
  std::chrono::steady_clock::time_point interval_start_;
};

}  // namespace iris
