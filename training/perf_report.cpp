#include "training/perf_report.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "core/json_read.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

enum class Kind { number, number_or_null, integer, integer_or_null, string };

struct FieldSpec {
  const char* pointer;
  Kind kind;
};

// What reports read from a run summary (training/metrics_log.cpp, run_summary_json).
constexpr FieldSpec kSummaryFields[] = {
    {"/device", Kind::string},
    {"/ranks", Kind::integer},
    {"/iterations/start", Kind::integer},
    {"/iterations/final", Kind::integer},
    {"/batch/micro_batch_size", Kind::integer},
    {"/batch/global_batch_size", Kind::integer},
    {"/batch/seq_length", Kind::integer},
    {"/batch/recompute", Kind::string},
    {"/steady_state/rule", Kind::string},
    {"/steady_state/steps", Kind::integer},
    {"/steady_state/first_iteration", Kind::integer_or_null},
    {"/steady_state/last_iteration", Kind::integer_or_null},
    {"/steady_state/step_seconds", Kind::number_or_null},
    {"/steady_state/data_seconds_per_step", Kind::number_or_null},
    {"/steady_state/host_enqueue_seconds_per_step", Kind::number_or_null},
    {"/steady_state/device_seconds_per_step", Kind::number_or_null},
    {"/steady_state/tokens_per_s_per_gpu", Kind::number_or_null},
    {"/steady_state/tflops_per_s_per_gpu", Kind::number_or_null},
    {"/steady_state/mfu", Kind::number_or_null},
    {"/peak_flops/per_gpu", Kind::number_or_null},
    {"/peak_flops/source", Kind::string},
    {"/memory/peak_bytes", Kind::integer},
    {"/memory/source", Kind::string},
    {"/graphs/decoder", Kind::string},
    {"/graphs/vision", Kind::string},
    {"/graphs/count", Kind::integer},
    {"/graphs/capture_ms", Kind::number},
    {"/graphs/memory_bytes", Kind::integer_or_null},
    {"/graphs/overflow_runs", Kind::integer},
    {"/padding/tokens", Kind::integer},
    {"/padding/padded_tokens", Kind::integer},
    {"/padding/patches", Kind::integer},
    {"/padding/padded_patches", Kind::integer},
    {"/padding/labels", Kind::integer},
    {"/padding/label_slots", Kind::integer},
};

constexpr FieldSpec kReportFields[] = {
    {"/label", Kind::string},
    {"/command", Kind::string},
    {"/run_dir", Kind::string},
};

bool has_kind(const json& v, Kind kind) {
  switch (kind) {
    case Kind::number:
      return v.is_number();
    case Kind::number_or_null:
      return v.is_number() || v.is_null();
    case Kind::integer:
      return v.is_number_integer();
    case Kind::integer_or_null:
      return v.is_number_integer() || v.is_null();
    case Kind::string:
      return v.is_string();
  }
  return false;
}

const char* kind_name(Kind kind) {
  switch (kind) {
    case Kind::number:
      return "a number";
    case Kind::number_or_null:
      return "a number or null";
    case Kind::integer:
      return "an integer";
    case Kind::integer_or_null:
      return "an integer or null";
    case Kind::string:
      return "a string";
  }
  return "?";
}

template <size_t N>
void check_fields(const json& j, const FieldSpec (&fields)[N], const std::string& source,
                  const std::string& fix) {
  IRIS_CHECK(j.is_object(), source, " is not a JSON object; ", fix);
  for (const FieldSpec& f : fields) {
    const json::json_pointer p(f.pointer);
    IRIS_CHECK(j.contains(p), source, " lacks ", f.pointer, "; ", fix);
    IRIS_CHECK(has_kind(j.at(p), f.kind), source, ": ", f.pointer, " must be ", kind_name(f.kind),
               ", got ", json_excerpt(j.at(p)), "; ", fix);
  }
}

const json& at(const json& j, const char* pointer) {
  return j.at(json::json_pointer(pointer));
}

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, v);
  return buf;
}

// A number with `format`, or "-" for null.
std::string num(const json& v, const char* format, double scale = 1) {
  return v.is_null() ? "-" : fmt(format, v.get<double>() * scale);
}

std::string bytes_text(double b) {
  if (b >= 1024.0 * 1024 * 1024) return fmt("%.2f GiB", b / (1024.0 * 1024 * 1024));
  return fmt("%.0f MiB", b / (1024.0 * 1024));
}

std::string bytes_or_dash(const json& v) {
  return v.is_null() ? "-" : bytes_text(v.get<double>());
}

std::string percent_of(int64_t part, int64_t whole) {
  return whole > 0 ? fmt("%.1f%%", 100.0 * static_cast<double>(part) / whole) : "-";
}

// The share of a MoE run's routed slots dropped over the experts' capacity, the whole run (the
// summary's totals; absent in summaries from before the capacity, null for a dropless run): null
// when nothing was routed under a capacity.
json dropped_share(const json& r) {
  const json totals = r.value("totals", json::object());
  const json routed = totals.value("moe_routed_slots", json());
  const json dropped = totals.value("moe_dropped_slots", json());
  if (!routed.is_number_integer() || !dropped.is_number_integer() || routed.get<int64_t>() <= 0)
    return nullptr;
  return static_cast<double>(dropped.get<int64_t>()) / static_cast<double>(routed.get<int64_t>());
}

}  // namespace

json make_report(const std::string& run_dir, const std::string& label, const std::string& command) {
  const std::string path = (fs::path(run_dir) / "run_summary.json").string();
  IRIS_CHECK(fs::exists(path), path,
             " does not exist: iris train writes it at the end of a run into checkpoint.dir; "
             "did the run finish, and is ",
             run_dir, " its checkpoint.dir?");
  json j = read_json_file(path, "run summary");
  check_fields(j, kSummaryFields, path,
               "it was written by another iris version; rerun the training with this one");
  j["label"] = label;
  j["command"] = command;
  j["run_dir"] = fs::absolute(run_dir).lexically_normal().string();
  return j;
}

json read_report(const std::string& path) {
  json j = read_json_file(path, "performance report");
  const std::string fix = "write it with iris report RUN_DIR (scripts/performance/run.sh does)";
  check_fields(j, kSummaryFields, path, fix);
  check_fields(j, kReportFields, path, fix);
  return j;
}

std::string format_report(const json& r) {
  const json& st = r.at("steady_state");
  const int64_t steps = st.at("steps").get<int64_t>();
  std::string out = "iris performance report: " + r.at("label").get<std::string>() + "\n";
  auto line = [&](const std::string& name, const std::string& value) {
    char head[32];
    std::snprintf(head, sizeof(head), "%-22s", name.c_str());
    out += head + value + "\n";
  };
  line("run directory", r.at("run_dir").get<std::string>());
  if (!r.at("command").get<std::string>().empty())
    line("command", r.at("command").get<std::string>());
  const int64_t ranks = r.at("ranks").get<int64_t>();
  line("device", str_cat(r.at("device").get<std::string>(), ", ", ranks,
                         ranks == 1 ? " process" : " processes"));
  const json& b = r.at("batch");
  line("batch", str_cat("micro ", b.at("micro_batch_size").get<int64_t>(), ", global ",
                        b.at("global_batch_size").get<int64_t>(), ", seq_length ",
                        b.at("seq_length").get<int64_t>(), ", recompute ",
                        b.at("recompute").get<std::string>()));
  if (steps > 0) {
    line("steady state", str_cat("iterations ", st.at("first_iteration").get<int64_t>(), "-",
                                 st.at("last_iteration").get<int64_t>(), " (", steps, " steps; ",
                                 st.at("rule").get<std::string>(), ")"));
  } else {
    line("steady state", "none: " + st.value("note", std::string("no interval qualified")));
  }
  line("step time", num(st.at("step_seconds"), "%.4f s"));
  line("  data wait", num(st.at("data_seconds_per_step"), "%.4f s per step"));
  line("  host enqueue", num(st.at("host_enqueue_seconds_per_step"), "%.4f s per step"));
  line("    prepare inputs",
       num(st.value("host_prepare_seconds_per_step", json()), "%.4f s per step"));
  line("    graph launches",
       str_cat(num(st.value("graph_launch_seconds_per_step", json()), "%.4f s per step"), " (CPU ",
               num(st.value("graph_launch_cpu_seconds_per_step", json()), "%.4f s"),
               " of it: a launch that waits for a full launch queue may sleep)"));
  line("  host waiting", num(st.value("host_wait_seconds_per_step", json()),
                             "%.4f s per step (for write staging the device still reads)"));
  line("  device", num(st.at("device_seconds_per_step"), "%.4f s per step"));
  // Optional: written by runs since logging.host_probe_steps exists, and only when set.
  const json probe = r.value("host_probe", json());
  if (probe.is_object() && probe.value("steps", int64_t{0}) > 0) {
    const int64_t full = probe.value("queue_full_steps", int64_t{0});
    line("host, device held",
         str_cat(num(probe.at("host_enqueue_seconds_per_step"), "%.4f s per step"), " (prepare ",
                 num(probe.at("host_prepare_seconds_per_step"), "%.4f"), ", graph launches ",
                 num(probe.at("graph_launch_seconds_per_step"), "%.4f"), "; the last ",
                 probe.at("steps").get<int64_t>(),
                 " steps, queued while the device waited: the host's own enqueue work",
                 full > 0 ? str_cat("; ", full,
                                    " of them filled the launch queue, so that figure includes "
                                    "waiting for the device")
                          : std::string(""),
                 ")"));
  }
  line("tokens/s per GPU", num(st.at("tokens_per_s_per_gpu"), "%.1f"));
  line("model TFLOP/s per GPU", num(st.at("tflops_per_s_per_gpu"), "%.4g"));
  const json& peak = r.at("peak_flops");
  if (st.at("mfu").is_null()) {
    line("MFU", "- (peak: " + peak.at("source").get<std::string>() + ")");
  } else {
    line("MFU", str_cat(num(st.at("mfu"), "%.1f%%", 100), " of ",
                        num(peak.at("per_gpu"), "%.1f TFLOP/s", 1e-12), " (",
                        peak.at("source").get<std::string>(), ")"));
  }
  const json& mem = r.at("memory");
  line("peak memory", str_cat(bytes_text(mem.at("peak_bytes").get<double>()), " (",
                              mem.at("source").get<std::string>(), ")"));
  const json& g = r.at("graphs");
  line("graphs", str_cat("decoder ", g.at("decoder").get<std::string>(), ", vision ",
                         g.at("vision").get<std::string>(), ": ", g.at("count").get<int64_t>(),
                         " graphs captured in ", fmt("%.1f", g.at("capture_ms").get<double>()),
                         " ms, ", g.at("overflow_runs").get<int64_t>(),
                         " micro-batches above the largest bucket ran eagerly"));
  line("graph memory", g.at("memory_bytes").is_null()
                           ? std::string("- (the CPU backend has no device memory to measure)")
                           : bytes_text(g.at("memory_bytes").get<double>()) +
                                 " (device memory in use after the captures minus before)");
  const json& p = r.at("padding");
  const int64_t tokens = p.at("tokens").get<int64_t>(),
                padded = p.at("padded_tokens").get<int64_t>();
  const int64_t patches = p.at("patches").get<int64_t>(),
                padded_patches = p.at("padded_patches").get<int64_t>();
  const int64_t labels = p.at("labels").get<int64_t>(),
                label_slots = p.at("label_slots").get<int64_t>();
  const json dropped = dropped_share(r);
  if (!dropped.is_null()) {
    const json& totals = r.at("totals");
    line("MoE slots dropped",
         str_cat(num(dropped, "%.2f%%", 100), " (", totals.at("moe_dropped_slots").get<int64_t>(),
                 " of ", totals.at("moe_routed_slots").get<int64_t>(),
                 " routed slots over the experts' capacity, the whole run)"));
  }
  line("padding",
       str_cat("tokens ", tokens, " real of ", padded, " run (", percent_of(tokens, padded),
               "), patches ", patches, " real of ", padded_patches, " run (",
               percent_of(patches, padded_patches), "), labels ", labels, " real of ", label_slots,
               " slots (", percent_of(labels, label_slots), ")"));
  return out;
}

SweepTable sweep_table(const std::vector<json>& reports) {
  IRIS_CHECK(!reports.empty(), "a sweep table needs at least one report");
  SweepTable t;
  const json& ref_step = at(reports.front(), "/steady_state/step_seconds");
  const std::vector<std::string> header{
      "variant",     "step s",      "tok/s/GPU",     "TFLOP/s/GPU",      "MFU",
      "speed-up",    "peak mem",    "graph mem",     "graphs",           "capture ms",
      "host s/step", "wait s/step", "device s/step", "held host s/step", "MoE dropped"};
  std::vector<std::vector<std::string>> cells{header};
  t.json = {{"reference", reports.front().at("label")}, {"rows", json::array()}};
  for (const json& r : reports) {
    const json& st = r.at("steady_state");
    const json& step = st.at("step_seconds");
    json speedup = nullptr;
    if (!ref_step.is_null() && !step.is_null() && step.get<double>() > 0)
      speedup = ref_step.get<double>() / step.get<double>();
    const json& g = r.at("graphs");
    // The host's own enqueue (logging.host_probe_steps), "full" where it filled the launch
    // queue and so still waited for the device.
    const json probe = r.value("host_probe", json());
    const bool probed = probe.is_object() && probe.value("steps", int64_t{0}) > 0;
    const json held_host = probed ? probe.at("host_enqueue_seconds_per_step") : json();
    const bool queue_full = probed && probe.value("queue_full_steps", int64_t{0}) > 0;
    cells.push_back({r.at("label").get<std::string>(), num(step, "%.4f"),
                     num(st.at("tokens_per_s_per_gpu"), "%.1f"),
                     num(st.at("tflops_per_s_per_gpu"), "%.4g"), num(st.at("mfu"), "%.1f%%", 100),
                     num(speedup, "%.2fx"), bytes_text(at(r, "/memory/peak_bytes").get<double>()),
                     bytes_or_dash(g.at("memory_bytes")),
                     std::to_string(g.at("count").get<int64_t>()),
                     fmt("%.1f", g.at("capture_ms").get<double>()),
                     num(st.at("host_enqueue_seconds_per_step"), "%.4f"),
                     num(st.value("host_wait_seconds_per_step", json()), "%.4f"),
                     num(st.at("device_seconds_per_step"), "%.4f"),
                     queue_full ? num(held_host, "%.4f") + " full" : num(held_host, "%.4f"),
                     num(dropped_share(r), "%.2f%%", 100)});
    t.json["rows"].push_back(
        {{"variant", r.at("label")},
         {"run_dir", r.at("run_dir")},
         {"steps", st.at("steps")},
         {"step_seconds", step},
         {"speedup", speedup},
         {"tokens_per_s_per_gpu", st.at("tokens_per_s_per_gpu")},
         {"tflops_per_s_per_gpu", st.at("tflops_per_s_per_gpu")},
         {"mfu", st.at("mfu")},
         {"peak_flops_source", at(r, "/peak_flops/source")},
         {"peak_memory_bytes", at(r, "/memory/peak_bytes")},
         {"graph_memory_bytes", g.at("memory_bytes")},
         {"graph_count", g.at("count")},
         {"capture_ms", g.at("capture_ms")},
         {"data_seconds_per_step", st.at("data_seconds_per_step")},
         {"host_enqueue_seconds_per_step", st.at("host_enqueue_seconds_per_step")},
         {"host_wait_seconds_per_step", st.value("host_wait_seconds_per_step", json())},
         {"device_seconds_per_step", st.at("device_seconds_per_step")},
         {"held_host_enqueue_seconds_per_step", held_host},
         {"held_queue_full", queue_full},
         {"moe_dropped_share", dropped_share(r)},
         {"padding", r.at("padding")}});
  }
  std::vector<size_t> width(header.size(), 0);
  for (const auto& row : cells)
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  for (size_t i = 0; i < cells.size(); ++i) {
    std::string line;
    for (size_t c = 0; c < cells[i].size(); ++c) {
      const std::string& cell = cells[i][c];
      const std::string pad(width[c] - cell.size(), ' ');
      // Names left-aligned, figures right-aligned.
      line += (c == 0 ? cell + pad : pad + cell) + (c + 1 < cells[i].size() ? "  " : "");
    }
    t.text += line + "\n";
    if (i == 0) {
      size_t total = 0;
      for (size_t w : width) total += w + 2;
      t.text += std::string(total - 2, '-') + "\n";
    }
  }
  t.text += str_cat("speed-up: the step time of ", reports.front().at("label").get<std::string>(),
                    " over each variant's (steady state; see each report.txt)\n");
  return t;
}

}  // namespace iris
