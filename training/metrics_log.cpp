#include "training/metrics_log.h"

#include "bridge/model_flops.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/fs.h"
#include "core/json_read.h"

namespace iris {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

std::string human_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return fmt("%.2f GiB", b / (1024.0 * 1024 * 1024));
  return fmt("%.0f MiB", b / (1024.0 * 1024));
}

std::string human_duration(double seconds) {
  const int64_t s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  char buf[64];
  if (s >= 3600)
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60));
  else if (s >= 60)
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  else
    std::snprintf(buf, sizeof(buf), "%llds", static_cast<long long>(s));
  return buf;
}

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '&')
      out += "&amp;";
    else if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

// Tick step of 1, 2 or 5 times a power of ten giving about `target` ticks over `span`.
double nice_step(double span, int target) {
  const double raw = span / std::max(1, target);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double r = raw / mag;
  return (r < 1.5 ? 1 : r < 3.5 ? 2 : r < 7.5 ? 5 : 10) * mag;
}

std::string tick_label(double v, double step) {
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e5 || a < 1e-3) return fmt("%.2g", v);
  // Enough decimals to tell neighbouring ticks apart, no more.
  const int decimals = std::max(0, -static_cast<int>(std::floor(std::log10(step))));
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

// A figure that exists only when `known`: JSON null otherwise.
nlohmann::json maybe(bool known, double v) {
  return known ? nlohmann::json(v) : nlohmann::json(nullptr);
}
nlohmann::json maybe(bool known, int64_t v) {
  return known ? nlohmann::json(v) : nlohmann::json(nullptr);
}

// Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, at boost clock. Matched in
// order against the device name, the more specific names first: "GH200" contains "H200", and
// the PCIe and NVL forms of the H100 are slower than the SXM one that plain "H100" stands for
// (CUDA names it "NVIDIA H100 80GB HBM3").
struct PeakEntry {
  const char* match;
  const char* model;
  double tflops;
};
constexpr PeakEntry kDensePeaks[] = {
    {"GH200", "GH200", 989.4},
    {"H200 NVL", "H200 NVL", 835.5},
    {"H200", "H200 SXM", 989.4},
    {"H100 PCIe", "H100 PCIe", 756.0},
    {"H100 NVL", "H100 NVL", 835.5},
    {"H100", "H100 SXM", 989.4},
    {"A100", "A100 (SXM or PCIe)", 312.0},
};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

DevicePeak dense_bf16_peak(Device device, const std::string& backend_name) {
  DevicePeak p;
  if (device != Device::cuda) {
    p.source = "none: the run is on the CPU, which has no bf16 tensor-core peak to compare with";
    return p;
  }
  const std::string name = lower(backend_name);
  for (const PeakEntry& e : kDensePeaks) {
    if (name.find(lower(e.match)) == std::string::npos) continue;
    p.flops_per_second = e.tflops * 1e12;
    p.source =
        str_cat("NVIDIA ", e.model, " datasheet: ", fmt("%.1f", e.tflops), " TFLOP/s dense bf16 ('",
                e.match, "' in the device name ", backend_name, ")");
    return p;
  }
  p.source = str_cat("none: ", backend_name,
                     " is not in the peak table (dense_bf16_peak in training/metrics_log.cpp); "
                     "add its datasheet figure there to get an MFU");
  return p;
}

void StepTimer::read(int slot) {
  seconds_ += be_.timing_mark_elapsed_ms(2 * slot, 2 * slot + 1) / 1e3;
  unread_[static_cast<size_t>(slot)] = false;
}

void StepTimer::begin_step() {
  IRIS_CHECK(!open_, "StepTimer: begin_step twice without end_step");
  // This slot's marks are about to move: the step that left them is read first.
  if (unread_[static_cast<size_t>(next_)]) read(next_);
  be_.record_timing_mark(2 * next_);
  open_ = true;
}

void StepTimer::end_step() {
  IRIS_CHECK(open_, "StepTimer: end_step without begin_step");
  be_.record_timing_mark(2 * next_ + 1);
  unread_[static_cast<size_t>(next_)] = true;
  next_ = (next_ + 1) % kRing;
  open_ = false;
}

double StepTimer::take_seconds() {
  for (int i = 0; i < kRing; ++i)
    if (unread_[static_cast<size_t>(i)]) read(i);
  const double s = seconds_;
  seconds_ = 0;
  return s;
}

namespace {

// Per-step means over the intervals from `begin` that `take` accepts.
template <typename Take>
SteadyState mean_of(const std::vector<StepMetrics>& intervals, size_t begin, Take take) {
  SteadyState s;
  double seconds = 0, tokens = 0, flops = 0;
  for (size_t i = begin; i < intervals.size(); ++i) {
    const StepMetrics& m = intervals[i];
    if (m.steps <= 0 || !take(m)) continue;
    if (s.steps == 0) s.first_iteration = m.iteration - m.steps + 1;
    s.last_iteration = m.iteration;
    s.steps += m.steps;
    seconds += m.seconds;
    s.data_seconds += m.data_seconds;
    s.host_seconds += m.host_seconds;
    s.host_wait_seconds += m.host_wait_seconds;
    s.host_prepare_seconds += m.host_prepare_seconds;
    s.graph_launch_seconds += m.graph_launch_seconds;
    s.graph_launch_cpu_seconds += m.graph_launch_cpu_seconds;
    s.device_seconds += m.device_seconds;
    s.probe_queue_full += m.probe_queue_full;
    tokens += static_cast<double>(m.tokens);
    flops += m.flops;
  }
  if (s.steps == 0) return SteadyState{};
  const auto n = static_cast<double>(s.steps);
  s.step_seconds = seconds / n;
  s.data_seconds /= n;
  s.host_seconds /= n;
  s.host_wait_seconds /= n;
  s.host_prepare_seconds /= n;
  s.graph_launch_seconds /= n;
  s.graph_launch_cpu_seconds /= n;
  s.device_seconds /= n;
  s.tokens_per_second = seconds > 0 ? tokens / seconds : 0;
  s.flops_per_second = seconds > 0 ? flops / seconds : 0;
  return s;
}

}  // namespace

SteadyState steady_state(const std::vector<StepMetrics>& intervals) {
  size_t begin = 1;
  for (size_t i = 0; i < intervals.size(); ++i)
    if (intervals[i].graphs_captured > 0) begin = std::max(begin, i + 1);
  // A probed step waited for the device to be held and released, a profiled one ran op by op:
  // neither is a steady step.
  return mean_of(intervals, begin, [](const StepMetrics& m) {
    return m.probed_steps == 0 && m.op_profiled_steps == 0;
  });
}

SteadyState host_probe(const std::vector<StepMetrics>& intervals) {
  return mean_of(intervals, 0, [](const StepMetrics& m) { return m.probed_steps > 0; });
}

std::string run_summary_json(const RunSummary& r) {
  using nlohmann::json;
  // Performance figures are the last stretch's: a resumed process warms up and captures its
  // graphs anew, and may run on other devices than the one before it.
  const int64_t current = !r.stretches.empty()   ? static_cast<int64_t>(r.stretches.size()) - 1
                          : !r.intervals.empty() ? r.intervals.back().stretch
                                                 : 0;
  std::vector<StepMetrics> last;
  for (const StepMetrics& m : r.intervals)
    if (m.stretch == current) last.push_back(m);
  const SteadyState st = steady_state(last);
  const bool steady = st.steps > 0;
  const auto ranks = static_cast<double>(std::max<int64_t>(1, r.ranks));
  const double flops_per_gpu = st.flops_per_second / ranks;
  json steady_json{
      {"rule",
       "mean over the last stretch's logged intervals (the process that wrote this summary) "
       "after its first one and after the last one that captured a graph"},
      {"steps", st.steps},
      {"first_iteration", steady ? json(st.first_iteration) : json(nullptr)},
      {"last_iteration", steady ? json(st.last_iteration) : json(nullptr)},
      {"step_seconds", maybe(steady, st.step_seconds)},
      {"data_seconds_per_step", maybe(steady, st.data_seconds)},
      {"host_enqueue_seconds_per_step", maybe(steady, st.host_seconds)},
      {"host_wait_seconds_per_step", maybe(steady, st.host_wait_seconds)},
      {"host_prepare_seconds_per_step", maybe(steady, st.host_prepare_seconds)},
      {"graph_launch_seconds_per_step", maybe(steady, st.graph_launch_seconds)},
      {"graph_launch_cpu_seconds_per_step", maybe(steady, st.graph_launch_cpu_seconds)},
      {"device_seconds_per_step", maybe(steady, st.device_seconds)},
      {"tokens_per_s_per_gpu", maybe(steady, st.tokens_per_second / ranks)},
      {"tflops_per_s_per_gpu", maybe(steady, flops_per_gpu / 1e12)},
      {"mfu",
       maybe(steady && r.peak.flops_per_second > 0, flops_per_gpu / r.peak.flops_per_second)}};
  if (!steady)
    steady_json["note"] =
        "no logged interval qualified: run more iterations (train.train_iters), log more often "
        "(logging.log_interval) or capture sooner (cuda_graph.cuda_graph_warmup_steps)";
  const SteadyState probe = host_probe(last);
  const bool probed = probe.steps > 0;
  json probe_json{
      {"rule",
       "the run's last logging.host_probe_steps steps, each queued while the device was held "
       "after a synchronisation: host enqueue without waits behind a busy device"},
      {"steps", probe.steps},
      {"host_enqueue_seconds_per_step", maybe(probed, probe.host_seconds)},
      {"host_prepare_seconds_per_step", maybe(probed, probe.host_prepare_seconds)},
      {"graph_launch_seconds_per_step", maybe(probed, probe.graph_launch_seconds)},
      {"graph_launch_cpu_seconds_per_step", maybe(probed, probe.graph_launch_cpu_seconds)},
      {"device_seconds_per_step", maybe(probed, probe.device_seconds)},
      {"queue_full_steps", probe.probe_queue_full}};
  // The whole run's totals, from its intervals (each resume keeps those up to its checkpoint).
  StepMetrics sum;
  for (const StepMetrics& m : r.intervals) {
    sum.steps += m.steps;
    sum.samples += m.samples;
    sum.tokens += m.tokens;
    sum.labelled_tokens += m.labelled_tokens;
    sum.flops += m.flops;
    sum.seconds += m.seconds;
    sum.wall_seconds += m.wall_seconds;
    sum.eval_seconds += m.eval_seconds;
    sum.checkpoint_seconds += m.checkpoint_seconds;
    sum.evaluations += m.evaluations;
    sum.checkpoints += m.checkpoints;
    sum.moe_dropped_slots += m.moe_dropped_slots;
    sum.moe_routed_slots += m.moe_routed_slots;
  }
  const bool logged = !r.intervals.empty();
  const auto loss_at = [&](const StepMetrics* m) {
    return json{{"iteration", m ? json(m->iteration) : json(nullptr)},
                {"loss", m ? json(m->loss) : json(nullptr)}};
  };
  json totals{{"steps", sum.steps},
              {"samples", sum.samples},
              {"tokens", sum.tokens},
              {"labelled_tokens", sum.labelled_tokens},
              {"flops", sum.flops},
              {"step_seconds", sum.seconds},
              {"eval_seconds", sum.eval_seconds},
              {"checkpoint_seconds", sum.checkpoint_seconds},
              {"wall_seconds", sum.wall_seconds},
              {"evaluations", sum.evaluations},
              {"checkpoints", sum.checkpoints},
              {"tokens_per_s", maybe(sum.seconds > 0, sum.tokens / sum.seconds)},
              {"moe_dropped_slots", maybe(sum.moe_routed_slots > 0, sum.moe_dropped_slots)},
              {"moe_routed_slots", maybe(sum.moe_routed_slots > 0, sum.moe_routed_slots)},
              {"first_loss", loss_at(logged ? &r.intervals.front() : nullptr)},
              {"last_loss", loss_at(logged ? &r.intervals.back() : nullptr)}};
  json stretches = json::array();
  for (const RunStretch& t : r.stretches)
    stretches.push_back({{"start", t.start},
                         {"final", t.final},
                         {"stop_signal", t.stop_signal},
                         {"device", t.device},
                         {"ranks", t.ranks}});
  json out{
      {"format", "iris run summary 2"},
      {"status", r.status},
      {"device", r.device},
      {"ranks", r.ranks},
      {"iterations",
       {{"start", r.start_iteration},
        {"final", r.final_iteration},
        {"stop_signal", r.stop_signal}}},
      {"stretches", stretches},
      {"totals", totals},
      {"batch",
       {{"micro_batch_size", r.micro_batch_size},
        {"global_batch_size", r.global_batch_size},
        {"seq_length", r.seq_length},
        {"recompute", r.recompute}}},
      {"steady_state", steady_json},
      {"host_probe", probe_json},
      {"peak_flops",
       {{"per_gpu", maybe(r.peak.flops_per_second > 0, r.peak.flops_per_second)},
        {"source", r.peak.source}}},
      {"memory",
       {{"peak_bytes", r.peak_memory_bytes},
        {"source", r.on_gpu ? "device memory in use (cudaMemGetInfo: every process on the GPU), "
                              "the most seen at a logged step or the end"
                            : "peak resident host memory of the process (VmHWM)"}}},
      {"graphs",
       {{"decoder", r.decoder_graphs},
        {"vision", r.vision_graphs},
        {"count", r.graph_count},
        {"capture_ms", r.capture_ms},
        {"memory_bytes", r.on_gpu ? json(r.graph_memory_bytes) : json(nullptr)},
        {"overflow_runs", r.overflow_runs}}},
      {"padding",
       {{"tokens", r.tokens},
        {"padded_tokens", r.padded_tokens},
        {"patches", r.patches},
        {"padded_patches", r.padded_patches},
        {"labels", r.labels},
        {"label_slots", r.label_slots}}}};
  json intervals = json::array();
  for (const StepMetrics& m : r.intervals)
    intervals.push_back(step_metrics_json(m, r.ranks, r.peak.flops_per_second));
  out["intervals"] = intervals;
  return out.dump(2) + "\n";
}

bool read_run_history(const std::string& path, int64_t iteration, RunHistory& history,
                      std::string& why) {
  using nlohmann::json;
  history = RunHistory{};
  if (!std::filesystem::exists(path)) {
    why = "there is no run_summary.json of the stretches before it";
    return false;
  }
  json j;
  try {
    j = read_json_file(path, "run summary");
  } catch (const Error& e) {
    why = str_cat("the one there cannot be read (", e.what(), ")");
    return false;
  }
  const json::json_pointer kIntervals("/intervals");
  if (!j.is_object() || !j.contains(kIntervals) || !j.at(kIntervals).is_array()) {
    why = "the one there has no intervals";
    return false;
  }
  std::vector<RunStretch> stretches;
  try {
    if (j.contains("stretches")) {
      for (const json& t : j.at("stretches"))
        stretches.push_back({t.at("start").get<int64_t>(), t.at("final").get<int64_t>(),
                             t.at("stop_signal").get<int>(), t.at("device").get<std::string>(),
                             t.at("ranks").get<int64_t>()});
    } else {
      // A summary from before stretches were kept describes its own process only.
      const json& it = j.at("iterations");
      stretches.push_back({it.at("start").get<int64_t>(), it.at("final").get<int64_t>(),
                           it.at("stop_signal").get<int>(), j.at("device").get<std::string>(),
                           j.at("ranks").get<int64_t>()});
    }
  } catch (const json::exception& e) {
    why = str_cat("the stretches of the one there are damaged (", e.what(), ")");
    return false;
  }
  std::vector<StepMetrics> intervals;
  for (const json& r : j.at(kIntervals)) {
    StepMetrics m;
    if (!step_metrics_from_json(r, m)) {
      why = "an interval of the one there is damaged";
      return false;
    }
    if (m.iteration <= iteration) intervals.push_back(m);
  }
  // Intervals close at every checkpoint, so a summary that reached the resumed one holds an
  // interval ending exactly there; without one its totals would not add up to the checkpoint.
  if (intervals.empty() || intervals.back().iteration != iteration) {
    why = str_cat("the intervals of the one there do not end at iteration ", iteration,
                  " (it was written before that checkpoint, or by an older Iris)");
    return false;
  }
  for (RunStretch& t : stretches) {
    if (t.start >= iteration) break;
    if (t.final > iteration) {
      // The steps after `iteration` run again now: what this stretch did there does not count.
      t.final = iteration;
      t.stop_signal = 0;
    }
    history.stretches.push_back(t);
  }
  if (history.stretches.empty()) {
    why = "the stretches of the one there start after the checkpoint";
    return false;
  }
  for (const StepMetrics& m : intervals)
    if (m.stretch < 0 || m.stretch >= static_cast<int64_t>(history.stretches.size())) {
      why = "the intervals of the one there name stretches it does not list";
      return false;
    }
  history.intervals = std::move(intervals);
  return true;
}

double training_flops(const ModelConfig& cfg, const SampleShape& shape, const TrainedParts& parts) {
  const ForwardFlops vision = vision_tower_flops(cfg.vision, shape.grids);
  const double vis_w = vision.gemm, vis_att = vision.attention;
  const double merge_w = merger_flops(cfg.vision, count_patches(shape.grids));
  const ForwardFlops text = decoder_flops(cfg.text, static_cast<double>(shape.tokens), 0,
                                          static_cast<double>(shape.logit_rows));
  const double lm_w = text.gemm, lm_att = text.attention;

  const bool vis_flow = parts.vision_tower || parts.vision_tower_adapters;
  const bool merge_flow = vis_flow || parts.merger;
  const bool lm_flow = merge_flow || parts.language_model || parts.language_model_adapters;
  auto part = [](double w, double att, bool flow, bool trained) {
    double f = w + att;
    if (flow) f += w + 2 * att;  // input gradients (both operands of the attention products)
    if (trained) f += w;         // weight gradients
    return f;
  };
  return part(vis_w, vis_att, vis_flow, parts.vision_tower) +
         part(merge_w, 0, merge_flow, parts.merger) +
         part(lm_w, lm_att, lm_flow, parts.language_model);
}

int64_t peak_host_memory_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return 0;
}

nlohmann::json step_metrics_json(const StepMetrics& m, int64_t ranks, double peak) {
  const auto per_step = [&](double total) { return maybe(m.steps > 0, total / m.steps); };
  const double flops_per_gpu = m.seconds > 0 ? m.flops / m.seconds / ranks : 0;
  return {{"iteration", m.iteration},
          {"loss", m.loss},
          {"lr", m.learning_rate},
          {"grad_norm", m.grad_norm},
          {"moe_aux_loss", maybe(m.moe_aux_runs > 0, m.moe_aux_loss)},
          {"moe_dropped_slots", maybe(m.moe_routed_slots > 0, m.moe_dropped_slots)},
          {"moe_routed_slots", maybe(m.moe_routed_slots > 0, m.moe_routed_slots)},
          {"labelled_tokens", m.labelled_tokens},
          {"tokens", m.tokens},
          {"samples", m.samples},
          {"seconds", m.seconds},
          {"wall_s", m.wall_seconds},
          {"eval_s", m.eval_seconds},
          {"checkpoint_s", m.checkpoint_seconds},
          {"evaluations", m.evaluations},
          {"checkpoints", m.checkpoints},
          {"stretch", m.stretch},
          {"tokens_per_s", m.tokens_per_second()},
          {"samples_per_s", m.samples_per_second()},
          {"tflops_per_s", m.tflops_per_second()},
          {"flops", m.flops},
          {"memory_bytes", m.memory_bytes},
          {"steps", m.steps},
          {"step_s", per_step(m.seconds)},
          {"data_s_per_step", per_step(m.data_seconds)},
          {"host_enqueue_s_per_step", per_step(m.host_seconds)},
          {"host_wait_s_per_step", per_step(m.host_wait_seconds)},
          {"host_prepare_s_per_step", per_step(m.host_prepare_seconds)},
          {"graph_launch_s_per_step", per_step(m.graph_launch_seconds)},
          {"graph_launch_cpu_s_per_step", per_step(m.graph_launch_cpu_seconds)},
          {"device_s_per_step", per_step(m.device_seconds)},
          {"tokens_per_s_per_gpu", m.tokens_per_second() / ranks},
          {"tflops_per_s_per_gpu", flops_per_gpu / 1e12},
          {"mfu", maybe(peak > 0, flops_per_gpu / peak)},
          {"graphs_captured", m.graphs_captured},
          {"probed_steps", m.probed_steps},
          {"probe_queue_full", m.probe_queue_full},
          {"op_profiled_steps", m.op_profiled_steps}};
}

bool step_metrics_from_json(const nlohmann::json& j, StepMetrics& m) {
  if (!j.is_object() || !j.contains("iteration") || !j["iteration"].is_number_integer() ||
      !j.contains("loss") || !j["loss"].is_number())
    return false;
  m = StepMetrics{};
  m.iteration = j["iteration"].get<int64_t>();
  m.loss = j["loss"].get<double>();
  // Records written before a field existed read it as zero.
  const auto number = [&](const char* key) {
    return j.contains(key) && j[key].is_number() ? j[key].get<double>() : 0.0;
  };
  const auto integer = [&](const char* key) {
    return j.contains(key) && j[key].is_number_integer() ? j[key].get<int64_t>() : int64_t{0};
  };
  m.learning_rate = number("lr");
  m.grad_norm = number("grad_norm");
  if (j.contains("moe_aux_loss") && j["moe_aux_loss"].is_number()) {
    m.moe_aux_loss = j["moe_aux_loss"].get<double>();
    m.moe_aux_runs = 1;
  }
  m.moe_dropped_slots = integer("moe_dropped_slots");
  m.moe_routed_slots = integer("moe_routed_slots");
  m.labelled_tokens = integer("labelled_tokens");
  m.tokens = integer("tokens");
  m.samples = integer("samples");
  m.seconds = number("seconds");
  m.wall_seconds = j.contains("wall_s") ? number("wall_s") : m.seconds;
  m.eval_seconds = number("eval_s");
  m.checkpoint_seconds = number("checkpoint_s");
  m.evaluations = integer("evaluations");
  m.checkpoints = integer("checkpoints");
  m.stretch = integer("stretch");
  m.flops = number("flops");
  m.memory_bytes = integer("memory_bytes");
  m.steps = integer("steps");
  m.graphs_captured = integer("graphs_captured");
  m.probed_steps = integer("probed_steps");
  m.probe_queue_full = integer("probe_queue_full");
  m.op_profiled_steps = integer("op_profiled_steps");
  // Per-step figures are null when an interval had no steps; the totals follow from them.
  const auto total = [&](const char* key) { return number(key) * static_cast<double>(m.steps); };
  m.data_seconds = total("data_s_per_step");
  m.host_seconds = total("host_enqueue_s_per_step");
  m.host_wait_seconds = total("host_wait_s_per_step");
  m.host_prepare_seconds = total("host_prepare_s_per_step");
  m.graph_launch_seconds = total("graph_launch_s_per_step");
  m.graph_launch_cpu_seconds = total("graph_launch_cpu_s_per_step");
  m.device_seconds = total("device_s_per_step");
  return true;
}

std::string format_log_line(const StepMetrics& m, int64_t total, int64_t ranks, double peak) {
  const int width = static_cast<int>(std::to_string(total).size());
  char head[64];
  std::snprintf(head, sizeof(head), "iter %*lld/%lld", width, static_cast<long long>(m.iteration),
                static_cast<long long>(total));
  const std::string rest =
      str_cat(" | loss ", fmt("%.6f", m.loss), " | lr ", fmt("%.3e", m.learning_rate),
              " | grad norm ", fmt("%.4f", m.grad_norm),
              m.moe_aux_runs > 0 ? str_cat(" | aux loss ", fmt("%.4f", m.moe_aux_loss)) : "",
              m.moe_routed_slots > 0
                  ? str_cat(" | dropped ",
                            fmt("%.2f", 100.0 * static_cast<double>(m.moe_dropped_slots) /
                                            static_cast<double>(m.moe_routed_slots)),
                            "%")
                  : "",
              " | ", fmt("%.1f", m.tokens_per_second()), " tok/s | ",
              fmt("%.2f", m.samples_per_second()), " samples/s | ",
              fmt("%.4g", m.tflops_per_second()), " TFLOP/s | mem ", human_bytes(m.memory_bytes));
  std::string line = str_cat(head, rest);
  if (peak > 0)
    line += str_cat(" | MFU ", fmt("%.1f", 100 * m.tflops_per_second() * 1e12 / ranks / peak), "%");
  if (m.steps > 0)
    line += str_cat(" | step ", fmt("%.4g", m.seconds / m.steps), " s (host ",
                    fmt("%.4g", m.host_seconds / m.steps),
                    m.host_wait_seconds > 0
                        ? str_cat(", host waiting ", fmt("%.4g", m.host_wait_seconds / m.steps))
                        : std::string(),
                    ", device ", fmt("%.4g", m.device_seconds / m.steps), ")");
  if (m.evaluations > 0) line += str_cat(" | eval ", fmt("%.4g", m.eval_seconds), " s");
  if (m.checkpoints > 0) line += str_cat(" | checkpoint ", fmt("%.4g", m.checkpoint_seconds), " s");
  return line;
}

std::string render_svg_plot(const std::vector<PlotPanel>& panels, const std::string& x_label) {
  constexpr double kW = 480, kH = 320, kLeft = 78, kRight = 18, kTop = 34, kBottom = 46;
  const double total_w = kW * std::max<size_t>(1, panels.size());
  std::ostringstream s;
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << total_w << "\" height=\"" << kH
    << "\" viewBox=\"0 0 " << total_w << " " << kH
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  for (size_t p = 0; p < panels.size(); ++p) {
    const PlotPanel& panel = panels[p];
    const double ox = kW * p;
    const double x0 = ox + kLeft, x1 = ox + kW - kRight, y0 = kH - kBottom, y1 = kTop;
    s << "<text x=\"" << (x0 + x1) / 2 << "\" y=\"18\" text-anchor=\"middle\" font-size=\"13\">"
      << xml_escape(panel.title) << "</text>\n";
    double xmin = INFINITY, xmax = -INFINITY, ymin = INFINITY, ymax = -INFINITY;
    for (const PlotSeries& sr : panel.series)
      for (const PlotPoint& pt : sr.points) {
        if (!std::isfinite(pt.x) || !std::isfinite(pt.y)) continue;
        xmin = std::min(xmin, pt.x);
        xmax = std::max(xmax, pt.x);
        ymin = std::min(ymin, pt.y);
        ymax = std::max(ymax, pt.y);
      }
    s << "<rect x=\"" << x0 << "\" y=\"" << y1 << "\" width=\"" << x1 - x0 << "\" height=\""
      << y0 - y1 << "\" fill=\"none\" stroke=\"#444\"/>\n";
    if (!(xmin <= xmax)) {
      s << "<text x=\"" << (x0 + x1) / 2 << "\" y=\"" << (y0 + y1) / 2
        << "\" text-anchor=\"middle\" fill=\"#888\">no data yet</text>\n";
      continue;
    }
    if (xmax == xmin) xmax = xmin + 1;
    if (ymax == ymin) {
      const double pad = ymin == 0 ? 1 : std::fabs(ymin) * 0.1;
      ymin -= pad;
      ymax += pad;
    }
    const double ystep = nice_step(ymax - ymin, 5);
    ymin = std::floor(ymin / ystep) * ystep;
    ymax = std::ceil(ymax / ystep) * ystep;
    const double xstep = nice_step(xmax - xmin, 6);
    auto X = [&](double x) { return x0 + (x - xmin) / (xmax - xmin) * (x1 - x0); };
    auto Y = [&](double y) { return y0 - (y - ymin) / (ymax - ymin) * (y0 - y1); };
    for (double y = ymin; y <= ymax + ystep * 1e-6; y += ystep) {
      s << "<line x1=\"" << x0 << "\" x2=\"" << x1 << "\" y1=\"" << Y(y) << "\" y2=\"" << Y(y)
        << "\" stroke=\"#ddd\"/>\n"
        << "<text x=\"" << x0 - 5 << "\" y=\"" << Y(y) + 4 << "\" text-anchor=\"end\">"
        << tick_label(y, ystep) << "</text>\n";
    }
    for (double x = std::ceil(xmin / xstep) * xstep; x <= xmax + xstep * 1e-6; x += xstep) {
      s << "<line x1=\"" << X(x) << "\" x2=\"" << X(x) << "\" y1=\"" << y0 << "\" y2=\"" << y1
        << "\" stroke=\"#eee\"/>\n"
        << "<text x=\"" << X(x) << "\" y=\"" << y0 + 15 << "\" text-anchor=\"middle\">"
        << tick_label(x, xstep) << "</text>\n";
    }
    s << "<text x=\"" << (x0 + x1) / 2 << "\" y=\"" << kH - 8 << "\" text-anchor=\"middle\">"
      << xml_escape(x_label) << "</text>\n"
      << "<text transform=\"translate(" << ox + 14 << "," << (y0 + y1) / 2
      << ") rotate(-90)\" text-anchor=\"middle\">" << xml_escape(panel.y_label) << "</text>\n";
    double legend_y = y1 + 14;
    for (const PlotSeries& sr : panel.series) {
      if (sr.points.empty()) continue;
      if (sr.points.size() == 1) {
        s << "<circle cx=\"" << X(sr.points[0].x) << "\" cy=\"" << Y(sr.points[0].y)
          << "\" r=\"2.5\" fill=\"" << sr.color << "\"/>\n";
      } else {
        s << "<polyline fill=\"none\" stroke-width=\"1.5\" stroke=\"" << sr.color << "\" points=\"";
        for (const PlotPoint& pt : sr.points)
          if (std::isfinite(pt.x) && std::isfinite(pt.y))
            s << fmt("%.2f", X(pt.x)) << "," << fmt("%.2f", Y(pt.y)) << " ";
        s << "\"/>\n";
      }
      s << "<line x1=\"" << x1 - 110 << "\" x2=\"" << x1 - 90 << "\" y1=\"" << legend_y - 4
        << "\" y2=\"" << legend_y - 4 << "\" stroke=\"" << sr.color << "\" stroke-width=\"2\"/>\n"
        << "<text x=\"" << x1 - 85 << "\" y=\"" << legend_y << "\">" << xml_escape(sr.label)
        << "</text>\n";
      legend_y += 14;
    }
  }
  s << "</svg>\n";
  return s.str();
}

std::string log_line_prefix(LogLevel level, const std::string& rank_tag) {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M:%S", &local);
  const char* name = level == LogLevel::warn ? "WARN" : level == LogLevel::error ? "ERROR" : "INFO";
  return str_cat(stamp, " ", name, " ", rank_tag.empty() ? "" : rank_tag + " ");
}

std::string format_log_message(const std::string& text, const std::string& rank_tag) {
  LogLevel level = LogLevel::info;
  std::string body = text;
  for (const auto& [mark, lvl] :
       {std::pair{"warning: ", LogLevel::warn}, std::pair{"error: ", LogLevel::error}})
    if (body.rfind(mark, 0) == 0) {
      level = lvl;
      body = body.substr(std::strlen(mark));
      break;
    }
  // Every line of a multi-line message (a table) gets the head, so that grep by time or rank
  // finds all of it.
  const std::string head = log_line_prefix(level, rank_tag);
  std::string out;
  for (size_t at = 0;;) {
    const size_t end = body.find('\n', at);
    out += head + body.substr(at, end == std::string::npos ? end : end - at) + "\n";
    if (end == std::string::npos || end + 1 == body.size()) break;
    at = end + 1;
  }
  return out;
}

std::string launcher_rank_tag(bool launched, int rank) {
  return launched ? str_cat("[rank ", rank, "]") : std::string();
}

bool progress_bar_wanted(const std::string& setting, bool stdout_is_terminal, bool launched) {
  if (setting == "on") return true;
  if (setting == "off") return false;
  IRIS_CHECK(setting == "auto", "logging.progress must be auto, on or off, got '", setting, "'");
  return stdout_is_terminal && !launched;
}

namespace {
constexpr const char* kRunDirWhat = "the run directory (checkpoint.dir)";
constexpr const char* kMetricsWhat = "the metrics file (logging.metrics_file)";
}  // namespace

MetricsLog::MetricsLog(const Options& options, int64_t start_iteration) : opt_(options) {
  namespace fs = std::filesystem;
  bar_start_iteration_ = start_iteration;
  bar_start_time_ = now_seconds();
  // Both name files inside the run directory; nothing they say may carry a write out of it.
  if (!opt_.plot_file.empty())
    plot_path_ = output_path_inside(opt_.run_dir, opt_.plot_file, "logging.plot", kRunDirWhat);
  if (opt_.metrics_file.empty()) return;
  metrics_path_ =
      output_path_inside(opt_.run_dir, opt_.metrics_file, "logging.metrics_file", kRunDirWhat);
  check_replaceable(metrics_path_, kMetricsWhat);
  if (fs::exists(metrics_path_)) {
    const std::string text = read_text_file(metrics_path_, kMetricsWhat);
    std::istringstream in(text);
    std::string line, kept;
    while (std::getline(in, line)) {
      // A run killed mid-write leaves a torn last line; it belongs to the dropped tail anyway.
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.is_object() || !j.contains("iteration") ||
          !j["iteration"].is_number_integer())
        continue;
      const int64_t it = j["iteration"].get<int64_t>();
      if (it > start_iteration) continue;
      kept += line + "\n";
      StepMetrics m;
      if (j.contains("eval_loss") && j["eval_loss"].is_number())
        eval_history_.push_back({it, j["eval_loss"].get<double>(),
                                 j.value("eval_labelled_tokens", int64_t{0}),
                                 j.value("eval_samples", int64_t{0})});
      else if (step_metrics_from_json(j, m))
        history_.push_back(m);
    }
    // Appended to as it is; rewritten only to drop what the steps about to run again logged.
    if (kept != text) write_file_atomic(metrics_path_, kept);
  }
  metrics_fd_ = open_append_file(metrics_path_, kMetricsWhat);
  if (!history_.empty()) write_plot();
}

MetricsLog::~MetricsLog() {
  clear_bar();
  if (metrics_fd_ >= 0) ::close(metrics_fd_);
}

void MetricsLog::close_metrics() {
  if (metrics_fd_ < 0) return;
  const int fd = metrics_fd_;
  metrics_fd_ = -1;
  // Where the filesystem reports a failed write only now (NFS, a full disk with delayed
  // allocation), the run must not end as if its metrics were kept.
  const bool synced = ::fsync(fd) == 0 || errno == EINVAL || errno == EROFS;
  const int sync_err = errno;
  if (::close(fd) != 0 || !synced)
    IRIS_FAIL("cannot write ", kMetricsWhat, " ", metrics_path_, ": ",
              std::strerror(synced ? errno : sync_err));
}

void MetricsLog::append_record(const std::string& line) {
  if (metrics_fd_ < 0) return;
  // One write per record (no buffering), so a kill leaves at most one torn line, which the next
  // run drops; a failed write (a full disk) ends the run like a failed checkpoint does.
  const std::string text = line + "\n";
  write_all(metrics_fd_, text.data(), text.size(), kMetricsWhat, metrics_path_);
}

void MetricsLog::clear_bar() {
  if (!bar_drawn_) return;
  std::fputs("\r\033[K", opt_.out);
  bar_drawn_ = false;
}

void MetricsLog::message(const std::string& text) {
  clear_bar();
  std::fputs(format_log_message(text, opt_.rank_tag).c_str(), opt_.out);
  std::fflush(opt_.out);
}

void MetricsLog::log(const StepMetrics& m) {
  history_.push_back(m);
  message(format_log_line(m, opt_.total_iterations, opt_.ranks, opt_.peak_flops_per_second));
  append_record(step_metrics_json(m, opt_.ranks, opt_.peak_flops_per_second).dump());
  write_plot();
}

void MetricsLog::log_eval(const EvalMetrics& m) {
  eval_history_.push_back(m);
  message(str_cat("eval at iter ", m.iteration, " | loss ", fmt("%.6f", m.loss), " over ",
                  m.labelled_tokens, " labelled tokens of ", m.samples, " samples"));
  append_record(nlohmann::json{
      {"iteration", m.iteration},
      {"eval_loss", m.loss},
      {"eval_labelled_tokens", m.labelled_tokens},
      {"eval_samples",
       m.samples}}.dump());
  write_plot();
}

void MetricsLog::progress(int64_t iteration) {
  if (!opt_.progress_bar || opt_.total_iterations <= 0) return;
  constexpr int kWidth = 30;
  const double frac = std::clamp(static_cast<double>(iteration) / opt_.total_iterations, 0.0, 1.0);
  const int filled = static_cast<int>(frac * kWidth);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(kWidth - filled), '-');
  const int64_t done = iteration - bar_start_iteration_;
  std::string eta = "--";
  if (done > 0)
    eta = human_duration((now_seconds() - bar_start_time_) / done *
                         (opt_.total_iterations - iteration));
  std::fprintf(opt_.out, "\r\033[K[%s] %lld/%lld %3.0f%% ETA %s", bar.c_str(),
               static_cast<long long>(iteration), static_cast<long long>(opt_.total_iterations),
               frac * 100, eta.c_str());
  std::fflush(opt_.out);
  bar_drawn_ = true;
}

void MetricsLog::write_plot() {
  if (plot_path_.empty()) return;
  PlotPanel loss{"Loss", "loss", {{"train", "#1f77b4", {}}, {"eval", "#ff7f0e", {}}}};
  PlotPanel lr{"Learning rate", "learning rate", {{"lr", "#2ca02c", {}}}};
  for (const StepMetrics& m : history_) {
    loss.series[0].points.push_back({double(m.iteration), m.loss});
    lr.series[0].points.push_back({double(m.iteration), m.learning_rate});
  }
  for (const EvalMetrics& m : eval_history_)
    loss.series[1].points.push_back({double(m.iteration), m.loss});
  write_file_atomic(plot_path_, render_svg_plot({loss, lr}, "iteration"));
}

}  // namespace iris
