// Training telemetry: the model-FLOP count of a step, the per-interval log line, a progress bar
// with ETA on terminals, the metrics JSONL file and an SVG plot of loss and learning rate.
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bridge/model_config.h"
#include "core/backend.h"
#include "core/tensor.h"
#include "vision/vision_encoder.h"

namespace iris {

// Which parts receive gradients; decides how much backward work each part costs.
// Which parts' weights train (their weight gradients are computed), and where LoRA adapters let
// the gradient flow through frozen weights (input gradients without weight gradients; the
// adapters' own products, under 1% of a layer's at rank 32, are not counted).
struct TrainedParts {
  bool vision_tower = true;
  bool merger = true;  // the final merger and the DeepStack mergers
  bool language_model = true;
  bool vision_tower_adapters = false;
  bool language_model_adapters = false;
};

// The shape of one training sequence: its real token count (no padding), the rows whose logits
// the loss needs (positions with a labelled next token) and the patch grid of each image (t, h, w
// before the 2x2 merge).
struct SampleShape {
  int64_t tokens = 0;
  int64_t logit_rows = 0;
  std::vector<GridTHW> grids;
};

// Model FLOPs of one forward + backward pass over `shape`: every matmul (vision blocks, patch
// embedding, mergers, decoder layers, the lm_head over the rows the loss reads, which is all the
// trainer computes) at 2 FLOPs per multiply-add, plus
// attention scores and the weighted sum (each frame of an image attends to itself in the encoder;
// the causal triangle in the decoder). Backward costs one forward for the input gradient where
// gradients flow through a part (it is trainable or something before it is) and one more for the
// weight gradient where the part is trainable; a frozen part with nothing trainable before it costs
// only its forward. Norms, activations and the loss are left out, as in the usual MFU counts.
double training_flops(const ModelConfig& cfg, const SampleShape& shape, const TrainedParts& parts);

// Peak resident memory of this process in bytes (VmHWM), 0 where /proc is unavailable.
int64_t peak_host_memory_bytes();

// The dense bf16 peak of the device a run trains on, the denominator of its MFU.
struct DevicePeak {
  double flops_per_second = 0;  // 0: unknown (the CPU, or a GPU missing from the table)
  std::string source;           // where the figure comes from, or why there is none
};

// From a small table of datasheet figures (dense bf16 tensor-core FLOP/s, no sparsity) matched
// against the CUDA device name inside `backend_name` ("cuda:0 (NVIDIA H100 80GB HBM3)"). The CPU
// and GPUs missing from the table get 0 rather than a guess, so that no MFU is made up.
DevicePeak dense_bf16_peak(Device device, const std::string& backend_name);

struct StepMetrics {
  int64_t iteration = 0;
  double loss = 0;  // mean over the labelled tokens of the interval
  double learning_rate = 0;
  double grad_norm = 0;  // before clipping, of the last step of the interval
  // A mixture-of-experts model's load-balancing loss (HF's, before its coefficient), the mean
  // over the interval's micro-batches; moe_aux_runs 0 (a dense model): none.
  double moe_aux_loss = 0;
  int64_t moe_aux_runs = 0;
  // Under a static expert capacity (model.moe_expert_capacity_factor): the slots (token, expert
  // choice, sparse layer) the interval's training micro-batches dropped, of those they routed;
  // moe_routed_slots 0: dropless.
  int64_t moe_dropped_slots = 0;
  int64_t moe_routed_slots = 0;
  int64_t labelled_tokens = 0;
  int64_t tokens = 0;  // every input token of the interval, all ranks
  int64_t samples = 0;
  // Wall time of the interval's steps: its whole wall time (wall_seconds) less its evaluations and
  // checkpoints (eval_seconds, checkpoint_seconds), each timed from a device synchronisation to
  // its end, so that they count in no step's time and no throughput.
  double seconds = 0;
  double wall_seconds = 0;
  double eval_seconds = 0, checkpoint_seconds = 0;
  int64_t evaluations = 0, checkpoints = 0;
  // The process of the run that logged the interval: 0, and one more after each resume.
  int64_t stretch = 0;
  double flops = 0;  // training_flops summed over the interval, all ranks
  int64_t memory_bytes = 0;
  // Optimizer steps in the interval, and three parts of their time, summed over them:
  //  data: waiting for the step's samples (the data pipeline);
  //  host enqueue: from the samples in hand to the return of the optimizer step, by which time
  //    the step's work is queued (a launch-bound step's host enqueue is close to its step time),
  //    less host wait;
  //    Of it: host prepare, the micro-batches' inputs made and uploaded, and graph launch, the
  //    launches of captured graphs (summed over the threads of a CPU run's micro-batch replicas);
  //  host wait: the part of that the host spent waiting for the device to free write staging
  //    (a host that runs ahead of a busy device by the staging's depth waits there);
  //  device: from the step's start, as the device reached it (the work queued before it done),
  //    to the end of its last work (timing marks, read without a synchronisation per step; the
  //    host clock on the CPU, where it equals host enqueue).
  int64_t steps = 0;
  double data_seconds = 0;
  double host_seconds = 0;
  double host_wait_seconds = 0;
  double host_prepare_seconds = 0, graph_launch_seconds = 0;
  // The launching thread's CPU time inside those launches: below their wall time where a launch
  // slept while waiting for the device (a full launch queue) rather than working.
  double graph_launch_cpu_seconds = 0;
  double device_seconds = 0;
  int64_t graphs_captured = 0;  // graphs captured during the interval (warm-up, not steady state)
  // Steps queued behind a held device (logging.host_probe_steps), and how many of them filled
  // the launch queue before the host was done (their host figure then includes that wait).
  int64_t probed_steps = 0;
  int64_t probe_queue_full = 0;
  // Steps run op by op through the step profile (logging.op_profile_step): not steady steps.
  int64_t op_profiled_steps = 0;

  double tokens_per_second() const { return seconds > 0 ? tokens / seconds : 0; }
  double samples_per_second() const { return seconds > 0 ? samples / seconds : 0; }
  double tflops_per_second() const { return seconds > 0 ? flops / seconds / 1e12 : 0; }
};

// Each step's device time from Backend timing marks, without a synchronisation per step: a step's
// start and end marks take two slots of a ring of Backend::kTimingMarks / 2 steps, and its span
// is read when its slots come round again (its work has finished by then, unless the host runs
// that many steps ahead, when the wait only throttles it) or by take_seconds(), which the trainer
// calls at a logged step, after the read that synchronises anyway. Marks are recorded between
// steps, never inside a graph capture.
class StepTimer {
 public:
  explicit StepTimer(Backend& backend) : be_(backend) {}
  void begin_step();
  void end_step();
  // Device seconds of the steps ended since the last call.
  double take_seconds();

 private:
  static constexpr int kRing = Backend::kTimingMarks / 2;
  void read(int slot);

  Backend& be_;
  int next_ = 0;  // ring slot of the next step
  bool open_ = false;
  std::array<bool, kRing> unread_{};  // ended, span not yet added
  double seconds_ = 0;
};

// The steady state of a run, for performance figures: the logged intervals after the first one
// and after the last one that captured a graph, so that warm-up, first-touch costs, the eager
// runs before a capture and the capture itself stay out. Figures are per step (means weighted
// by the steps of each interval) and per second over all ranks.
struct SteadyState {
  int64_t steps = 0;  // 0: no interval qualified, and every figure below is 0
  int64_t first_iteration = 0, last_iteration = 0;
  double step_seconds = 0, data_seconds = 0, host_seconds = 0, host_wait_seconds = 0,
         host_prepare_seconds = 0, graph_launch_seconds = 0, graph_launch_cpu_seconds = 0,
         device_seconds = 0;
  double tokens_per_second = 0, flops_per_second = 0;
  int64_t probe_queue_full = 0;  // probed steps whose host filled the launch queue
};
SteadyState steady_state(const std::vector<StepMetrics>& intervals);
// The same means over the probed steps (logging.host_probe_steps) alone.
SteadyState host_probe(const std::vector<StepMetrics>& intervals);

// One process's part of a run: from the step it started (or resumed) at to its last one.
struct RunStretch {
  int64_t start = 0, final = 0;
  int stop_signal = 0;
  std::string device;
  int64_t ranks = 1;
};

// What a run leaves in its run directory (run_summary.json), rewritten after every checkpoint and
// at the end: the whole run across its resumes (its stretches, the logged intervals up to the
// checkpoint each resume continued, their totals and first and last loss), and, of the last
// stretch (the process writing it: a resumed one warms up, captures its graphs and may run on
// other devices), the steady state, graphs, padding and memory that performance reports read.
struct RunSummary {
  // running: written at a checkpoint with the run going on (what a killed run leaves);
  // finished: train.train_iters reached; stopped: by SIGTERM or SIGINT (stop_signal).
  std::string status = "finished";
  std::string device;  // the backend's name
  bool on_gpu = false;
  int64_t ranks = 1;
  int64_t start_iteration = 0, final_iteration = 0;  // the whole run's
  int stop_signal = 0;
  std::vector<RunStretch> stretches;  // in order; the last one is the writer's
  int64_t micro_batch_size = 0, global_batch_size = 0, seq_length = 0;
  std::string recompute;
  std::vector<StepMetrics> intervals;  // the whole run's, in order
  DevicePeak peak;
  int64_t peak_memory_bytes = 0;
  std::string decoder_graphs = "none", vision_graphs = "none";
  int64_t graph_count = 0, overflow_runs = 0;
  double capture_ms = 0;
  int64_t graph_memory_bytes = 0;  // reported only on a GPU (the CPU has no device memory)
  int64_t tokens = 0, padded_tokens = 0, patches = 0, padded_patches = 0;
  int64_t labels = 0, label_slots = 0;  // the loss's real labels and the slots it ran over
};
// The summary as a JSON document (keys documented in scripts/performance/README.md). Figures
// that do not exist for the run (MFU without a known peak, graph memory on the CPU, the steady
// state of a run too short to have one) are null.
std::string run_summary_json(const RunSummary& s);

// A logged interval as metrics.jsonl and run_summary.json hold it, and back; false when `j` is
// not one (an evaluation's record, or a line of another shape).
nlohmann::json step_metrics_json(const StepMetrics& m, int64_t ranks = 1,
                                 double peak_flops_per_second = 0);
bool step_metrics_from_json(const nlohmann::json& j, StepMetrics& m);

// What an earlier stretch's run_summary.json says of the run up to `iteration`, the step a
// resume continues from: its stretches (the last one cut at `iteration`) and the intervals that
// end by it. False, with `why`, when it cannot tell: no summary, one that does not cover the
// run up to `iteration`, or one of another shape.
struct RunHistory {
  std::vector<RunStretch> stretches;
  std::vector<StepMetrics> intervals;
};
bool read_run_history(const std::string& summary_path, int64_t iteration, RunHistory& history,
                      std::string& why);
struct EvalMetrics {
  int64_t iteration = 0;
  double loss = 0;
  int64_t labelled_tokens = 0;
  int64_t samples = 0;
};

// One log line, e.g. "iter 10/200 | loss 2.3456 | lr 3.00e-04 | ...". The MFU is shown when
// peak_flops_per_second (of one of `ranks` devices) is known, the evaluations' and checkpoints'
// time when the interval had some.
std::string format_log_line(const StepMetrics& m, int64_t total_iterations, int64_t ranks = 1,
                            double peak_flops_per_second = 0);

struct PlotPoint {
  double x, y;
};
struct PlotSeries {
  std::string label;
  std::string color;  // CSS colour
  std::vector<PlotPoint> points;
};
struct PlotPanel {
  std::string title;
  std::string y_label;
  std::vector<PlotSeries> series;
};

// A self-contained SVG (no scripts, no external fonts): panels side by side, each with axes,
// "nice" tick values and a legend. Empty panels render as "no data yet".
std::string render_svg_plot(const std::vector<PlotPanel>& panels, const std::string& x_label);

enum class LogLevel { info, warn, error };

// The head of a log line: local time, level and, under a launcher, the rank, e.g.
// "2026-11-27 21:03:04 INFO [rank 1] ". `rank_tag` is "" or "[rank N]" (launcher_rank_tag).
std::string log_line_prefix(LogLevel level, const std::string& rank_tag);
// `text` with that head on each of its lines. A text that begins "warning: " is logged at WARN
// (the prefix dropped), "error: " at ERROR, anything else at INFO.
std::string format_log_message(const std::string& text, const std::string& rank_tag);
// "[rank N]" for a process a launcher started (mpirun, srun; rank 0 included), else "".
std::string launcher_rank_tag(bool launched, int rank);

// Whether to draw the progress bar for logging.progress (auto | on | off): auto draws it only on
// a terminal that no launcher gave the process, because mpirun and srun hand each rank a
// terminal whose output ends up in a log file, escape codes and all.
bool progress_bar_wanted(const std::string& setting, bool stdout_is_terminal, bool launched);

// Writes the run's telemetry. Files are relative to the run directory; an empty name turns that
// output off.
class MetricsLog {
 public:
  struct Options {
    std::string run_dir;
    std::string metrics_file = "metrics.jsonl";
    std::string plot_file = "training_curves.svg";
    int64_t total_iterations = 0;
    bool progress_bar = false;  // redraw a bar with ETA on stdout between log lines
    FILE* out = stdout;
    // Processes (GPUs) the interval's tokens and FLOPs are spread over, and each one's dense
    // bf16 peak (0: unknown, no MFU), for the per-GPU figures of the records.
    int64_t ranks = 1;
    double peak_flops_per_second = 0;
    // "[rank N]" under a launcher, for the head of each message (format_log_message).
    std::string rank_tag;
  };

  // Opens (creates) the metrics file for appending. Both files are resolved inside run_dir
  // (output_path_inside: no absolute path, no "..", no symbolic link on the way). Records after
  // `start_iteration` (the resumed checkpoint's step, 0 for a fresh run) were written by a run that
  // died before its next checkpoint, and the steps they describe are about to run again: only
  // then is the file rewritten, without them (and without a torn last line). The kept records
  // seed the plot, so the files read as if the run never stopped.
  MetricsLog(const Options& options, int64_t start_iteration);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void log(const StepMetrics& m);
  void log_eval(const EvalMetrics& m);
  // Redraws the progress bar after iteration `iteration` (no-op without a bar).
  void progress(int64_t iteration);
  // Prints a message above the bar, as format_log_message heads it.
  void message(const std::string& text);
  // Flushes and closes the metrics file, throwing if what was written could not be kept; the
  // destructor closes it silently where this was not called (an error already on its way).
  void close_metrics();

  const std::vector<StepMetrics>& history() const { return history_; }

 private:
  void append_record(const std::string& json_line);
  void write_plot();
  void clear_bar();

  Options opt_;
  std::string metrics_path_;
  std::string plot_path_;
  int metrics_fd_ = -1;
  std::vector<StepMetrics> history_;
  std::vector<EvalMetrics> eval_history_;
  int64_t bar_start_iteration_ = 0;
  double bar_start_time_ = 0;
  bool bar_drawn_ = false;
};

}  // namespace iris
