// iris report: the performance report of a training run (report.json and report.txt beside its
// run_summary.json), or the table of several reports. scripts/performance/run.sh and sweep.sh
// call it, so that they need no JSON tool of their own.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "apps/cli.h"
#include "apps/commands.h"
#include "core/error.h"
#include "core/fs.h"
#include "training/perf_report.h"

namespace iris {

int run_report_command(int argc, char** argv) {
  CLI::App app{
      "Performance reports of training runs. With a run directory (checkpoint.dir of a finished "
      "iris train): writes report.json and report.txt there from its run_summary.json and "
      "prints the text. With --table and report.json files: prints one row per report, the "
      "speed-up taken against the first.",
      "iris report"};
  std::vector<std::string> paths;
  std::string label, command, table_json;
  bool table = false;
  app.add_option("paths", paths, "a run directory; with --table, report.json files")->required();
  app.add_option("--label", label, "the run's name in the report (default: the directory name)");
  app.add_option("--command", command, "the command that ran it, recorded in the report");
  app.add_flag("--table", table, "print a table of the report.json files given");
  app.add_option("--json", table_json, "with --table: also write its rows to this JSON file");
  if (!parse_command_line(app, {argv + 1, argv + argc}, "iris report")) return 0;
  namespace fs = std::filesystem;
  if (table) {
    std::vector<nlohmann::json> reports;
    for (const std::string& p : paths) reports.push_back(read_report(p));
    const SweepTable t = sweep_table(reports);
    std::fputs(t.text.c_str(), stdout);
    if (!table_json.empty()) write_file_atomic(table_json, t.json.dump(2) + "\n");
    return 0;
  }
  IRIS_USAGE_CHECK(paths.size() == 1, "iris report takes one run directory (got ", paths.size(),
                   "); to compare several runs, pass their report.json files with --table");
  IRIS_USAGE_CHECK(table_json.empty(),
                   "--json goes with --table; a run's report.json is written to ", paths[0],
                   " anyway");
  const std::string& dir = paths[0];
  if (label.empty()) label = fs::path(dir).lexically_normal().filename().string();
  if (label.empty()) label = fs::path(dir).lexically_normal().parent_path().filename().string();
  const nlohmann::json report = make_report(dir, label, command);
  const std::string text = format_report(report);
  write_file_atomic((fs::path(dir) / "report.json").string(), report.dump(2) + "\n");
  write_file_atomic((fs::path(dir) / "report.txt").string(), text);
  std::fputs(text.c_str(), stdout);
  return 0;
}

}  // namespace iris
