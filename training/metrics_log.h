// Training telemetry: the model-FLOP count of a step, the per-interval log line, a progress bar
// with ETA on terminals, the metrics JSONL file and an SVG plot of loss and learning rate.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bridge/model_config.h"
#include "vision/vision_encoder.h"

namespace iris {

// Which parts receive gradients; decides how much backward work each part costs.
struct TrainedParts {
  bool vision_tower = true;
  bool merger = true;  // the final merger and the DeepStack mergers
  bool language_model = true;
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

struct StepMetrics {
  int64_t iteration = 0;
  double loss = 0;  // mean over the labelled tokens of the interval
  double learning_rate = 0;
  double grad_norm = 0;  // before clipping, of the last step of the interval
  int64_t labelled_tokens = 0;
  int64_t tokens = 0;  // every input token of the interval
  int64_t samples = 0;
  double seconds = 0;  // wall time of the interval
  double flops = 0;    // training_flops summed over the interval
  int64_t memory_bytes = 0;

  double tokens_per_second() const { return seconds > 0 ? tokens / seconds : 0; }
  double samples_per_second() const { return seconds > 0 ? samples / seconds : 0; }
  double tflops_per_second() const { return seconds > 0 ? flops / seconds / 1e12 : 0; }
};

struct EvalMetrics {
  int64_t iteration = 0;
  double loss = 0;
  int64_t labelled_tokens = 0;
  int64_t samples = 0;
};

// One log line, e.g. "iter 10/200 | loss 2.3456 | lr 3.00e-04 | ...".
std::string format_log_line(const StepMetrics& m, int64_t total_iterations);

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
  };

  // Opens (creates) the metrics file. Records after `start_iteration` (the resumed checkpoint's
  // step, 0 for a fresh run) were written by a run that died before its next checkpoint: they
  // are dropped, and the kept ones seed the plot, so the files read as if the run never stopped.
  MetricsLog(const Options& options, int64_t start_iteration);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;

  void log(const StepMetrics& m);
  void log_eval(const EvalMetrics& m);
  // Redraws the progress bar after iteration `iteration` (no-op without a bar).
  void progress(int64_t iteration);
  // Prints a message above the bar.
  void message(const std::string& text);

  const std::vector<StepMetrics>& history() const { return history_; }

 private:
  void append_record(const std::string& json_line);
  void write_plot();
  void clear_bar();

  Options opt_;
  std::string metrics_path_;
  std::string plot_path_;
  FILE* metrics_ = nullptr;
  std::vector<StepMetrics> history_;
  std::vector<EvalMetrics> eval_history_;
  int64_t bar_start_iteration_ = 0;
  double bar_start_time_ = 0;
  bool bar_drawn_ = false;
};

}  // namespace iris
