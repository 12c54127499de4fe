// Performance reports (iris report, behind scripts/performance/run.sh and sweep.sh): the run
// summary that iris train leaves in its run directory (run_summary.json, training/metrics_log.h)
// turned into report.json and report.txt, and a table comparing several reports. The scripts
// read no JSON themselves, so that running them needs nothing but bash and the iris binary.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace iris {

// <run_dir>/run_summary.json with `label`, `command` and `run_dir` added: the report.json
// document. A summary missing a field that reports use is an error naming the file and field.
nlohmann::json make_report(const std::string& run_dir, const std::string& label,
                           const std::string& command);

// report.txt: the steady-state step time and its host and device parts, throughput, MFU and
// where its peak came from, memory, graphs and padding; absent figures say why.
std::string format_report(const nlohmann::json& report);

// A table of reports, one row each in the order given: step time, tokens/s and TFLOP/s per GPU,
// MFU, the speed-up over the first report (its step time over the row's), peak and graph memory,
// graphs, capture time and the host enqueue and device time per step. `json` holds the same rows
// with every figure (null where absent) for sweep.json.
struct SweepTable {
  std::string text;
  nlohmann::json json;
};
SweepTable sweep_table(const std::vector<nlohmann::json>& reports);

// Reads a report.json written by make_report (checked as make_report checks a summary).
nlohmann::json read_report(const std::string& path);

}  // namespace iris
