// Training telemetry: the FLOP count against a count written out matmul by matmul, the log line,
// the SVG plot, and the metrics file's truncation on resume.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/fs.h"
#include "core/thread_cpu_clock.h"
#include "test_util.h"
#include "training/metrics_log.h"
#include "training/perf_report.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

ModelConfig fixture_config() {
  return ModelConfig::from_file(test::fixture_dir() + "/config.json");
}

// Forward FLOPs listed per matmul for the fixture (text: H 64, q 64, kv 32, I 128, 3 layers,
// vocab 151936; vision: D 32, I 64, depth 3, patch_dim 1536, merged 128, out 64, 2 deepstack
// mergers), one 1x8x8 image (64 patches, 16 merged rows), T tokens, R logit rows.
struct Forward {
  double vision_w, vision_att, merger_w, text_w, text_att;
};
Forward fixture_forward(double T, double R) {
  const double S = 64;
  Forward f{};
  f.vision_w = 2 * S * 1536 * 32  // patch embedding
               + 3 * (2 * S * 32 * 96 + 2 * S * 32 * 32 + 2 * S * 32 * 64 + 2 * S * 64 * 32);
  f.vision_att = 3 * (2 * S * S * 32 + 2 * S * S * 32);  // scores + weighted sum
  f.merger_w = 3 * (2 * 16 * 128 * 128 + 2 * 16 * 128 * 64);
  f.text_w = 3 * (2 * T * 64 * 64 + 2 * T * 64 * 32 * 2 + 2 * T * 64 * 64 + 2 * T * 64 * 256 +
                  2 * T * 128 * 64) +
             2 * R * 64 * 151936;
  f.text_att = 3 * 2 * (2 * 64 * T * (T + 1) / 2);
  return f;
}

TEST(TrainingFlops, MatchesAMatmulByMatmulCount) {
  const ModelConfig cfg = fixture_config();
  const SampleShape shape{40, 7, {GridTHW{1, 8, 8}}};
  const Forward f = fixture_forward(40, 7);
  const double fwd = f.vision_w + f.vision_att + f.merger_w + f.text_w + f.text_att;

  // Everything trained: forward + input gradients (attention: both operands) + weight gradients.
  const double all = training_flops(cfg, shape, {true, true, true});
  EXPECT_NEAR(all, 3 * fwd, 1e-9 * all);

  // Vision tower frozen: it runs forward only; nothing flows into it.
  const double no_vision = training_flops(cfg, shape, {false, true, true});
  EXPECT_NEAR(no_vision, all - 2 * f.vision_w - 2 * f.vision_att, 1e-9 * all);

  // Only the merger trains: the decoder still backpropagates its input gradient to the image rows
  // but computes no weight gradient.
  const double merger_only = training_flops(cfg, shape, {false, true, false});
  EXPECT_NEAR(merger_only,
              (f.vision_w + f.vision_att) + 3 * f.merger_w + (2 * f.text_w + 3 * f.text_att),
              1e-9 * all);

  // Only the language model trains: mergers and tower run forward only.
  const double lm_only = training_flops(cfg, shape, {false, false, true});
  EXPECT_NEAR(lm_only, f.vision_w + f.vision_att + f.merger_w + 3 * (f.text_w + f.text_att),
              1e-9 * all);

  // LoRA on the language model: its frozen weights get no weight gradient, but the gradient flows
  // through them (input gradients), as through the merger's and a LoRA tower's.
  const double lm_lora = training_flops(cfg, shape, {false, false, false, false, true});
  EXPECT_NEAR(lm_lora, f.vision_w + f.vision_att + f.merger_w + 2 * f.text_w + 3 * f.text_att,
              1e-9 * all);
  const double all_lora = training_flops(cfg, shape, {false, false, false, true, true});
  EXPECT_NEAR(all_lora, 2 * (f.vision_w + f.merger_w + f.text_w) + 3 * (f.vision_att + f.text_att),
              1e-9 * all);

  // Text only: no vision work at all.
  const double text = training_flops(cfg, SampleShape{40, 7, {}}, {true, true, true});
  EXPECT_NEAR(text, 3 * (f.text_w + f.text_att), 1e-9 * text);
}

TEST(TrainingFlops, ScaleWithTheRealCounts) {
  const ModelConfig cfg = fixture_config();
  const TrainedParts all{true, true, true};
  const double one = training_flops(cfg, {40, 7, {GridTHW{1, 8, 8}}}, all);
  const double two = training_flops(cfg, {40, 7, {GridTHW{1, 8, 8}, GridTHW{1, 8, 8}}}, all);
  const double more_rows = training_flops(cfg, {40, 8, {GridTHW{1, 8, 8}}}, all);
  const Forward f = fixture_forward(40, 7);
  EXPECT_NEAR(two - one, 3 * (f.vision_w + f.vision_att + f.merger_w), 1e-9 * two);
  EXPECT_NEAR(more_rows - one, 3 * 2 * 64 * 151936.0, 1e-9 * one);
  // A two-frame video attends within each frame, so attention grows linearly in frames.
  const double video = training_flops(cfg, {40, 7, {GridTHW{2, 8, 8}}}, all);
  EXPECT_NEAR(video - one, 3 * (f.vision_w + f.vision_att + f.merger_w), 1e-9 * video);
}

TEST(MetricsLog, LogLineCarriesEveryFigure) {
  StepMetrics m;
  m.iteration = 7;
  m.loss = 2.5;
  m.learning_rate = 3e-4;
  m.grad_norm = 1.25;
  m.tokens = 1000;
  m.samples = 10;
  m.seconds = 2;
  m.flops = 4e12;
  m.memory_bytes = int64_t(3) << 30;
  const std::string line = format_log_line(m, 100);
  for (const char* part : {"iter   7/100", "loss 2.500000", "lr 3.000e-04", "grad norm 1.2500",
                           "500.0 tok/s", "5.00 samples/s", "2 TFLOP/s", "mem 3.00 GiB"})
    EXPECT_NE(line.find(part), std::string::npos) << part << " in " << line;
}

TEST(MetricsLog, SvgHasOnePolylinePerSeriesAndEscapesText) {
  PlotPanel loss{"Loss <train & eval>", "loss", {{"train", "#1f77b4", {{1, 3}, {2, 2}, {3, 1.5}}}}};
  PlotPanel empty{"Learning rate", "lr", {{"lr", "#2ca02c", {}}}};
  const std::string svg = render_svg_plot({loss, empty}, "iteration");
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_NE(svg.find("Loss &lt;train &amp; eval&gt;"), std::string::npos);
  EXPECT_EQ(svg.find("<train"), std::string::npos);
  size_t polylines = 0;
  for (size_t p = svg.find("<polyline"); p != std::string::npos; p = svg.find("<polyline", p + 1))
    ++polylines;
  EXPECT_EQ(polylines, 1u);
  EXPECT_NE(svg.find("no data yet"), std::string::npos);
  // Self-contained: no scripts, no external references.
  EXPECT_EQ(svg.find("<script"), std::string::npos);
  EXPECT_EQ(svg.find("href"), std::string::npos);
}

class MetricsFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("iris_metrics_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(MetricsFileTest, ResumeDropsRecordsPastTheCheckpointAndATornLine) {
  FILE* null_out = std::fopen("/dev/null", "w");
  MetricsLog::Options o;
  o.run_dir = dir_.string();
  o.total_iterations = 10;
  o.out = null_out;
  {
    MetricsLog log(o, 0);
    for (int it = 1; it <= 5; ++it) {
      StepMetrics m;
      m.iteration = it;
      m.loss = 10.0 / it;
      m.learning_rate = 1e-3;
      log.log(m);
      if (it == 2) log.log_eval({2, 4.5, 100, 8});
    }
  }
  // A run killed mid-write leaves half a record.
  {
    std::ofstream f(dir_ / "metrics.jsonl", std::ios::app);
    f << "{\"iteration\":6,\"loss\":1.2";
  }
  EXPECT_TRUE(fs::exists(dir_ / "training_curves.svg"));
  {
    MetricsLog log(o, 3);
    ASSERT_EQ(log.history().size(), 3u);
    EXPECT_DOUBLE_EQ(log.history()[2].loss, 10.0 / 3);
    StepMetrics m;
    m.iteration = 4;
    m.loss = 9.0;
    log.log(m);
  }
  std::ifstream f(dir_ / "metrics.jsonl");
  std::vector<int64_t> iterations;
  int evals = 0;
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    iterations.push_back(j["iteration"].get<int64_t>());
    evals += j.contains("eval_loss");
  }
  EXPECT_EQ(iterations, (std::vector<int64_t>{1, 2, 2, 3, 4}));
  EXPECT_EQ(evals, 1);
  const std::string svg = read_text_file((dir_ / "training_curves.svg").string());
  EXPECT_NE(svg.find("<polyline"), std::string::npos);
  std::fclose(null_out);
}

// A failed write of the metrics file (a full disk) ends the run with an error naming the file,
// as a failed checkpoint or plot does, instead of an exit 0 with the records lost. The file size
// limit makes the kernel fail the writes for real (EFBIG), part-way through a record.
TEST_F(MetricsFileTest, AFailedWriteIsAnErrorNamingTheFile) {
  FILE* null_out = std::fopen("/dev/null", "w");
  MetricsLog::Options o;
  o.run_dir = dir_.string();
  o.plot_file = "";
  o.total_iterations = 10;
  o.out = null_out;
  MetricsLog log(o, 0);
  StepMetrics m;
  m.iteration = 1;
  m.loss = 2.5;
  log.log(m);
  const auto written = fs::file_size(dir_ / "metrics.jsonl");
  ASSERT_GT(written, 0u);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = written + 10;  // room for part of the next record
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  m.iteration = 2;
  const std::string msg = test::error_of([&] { log.log(m); });
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(msg.find("cannot write the metrics file (logging.metrics_file) " +
                     (dir_ / "metrics.jsonl").string() + ": " + std::strerror(EFBIG)),
            std::string::npos)
      << msg;
  EXPECT_EQ(fs::file_size(dir_ / "metrics.jsonl"), written + 10);
  std::fclose(null_out);
}

TEST_F(MetricsFileTest, FilesStayInsideTheRunDirectoryAndNeverFollowALink) {
  FILE* null_out = std::fopen("/dev/null", "w");
  const fs::path run = dir_ / "run", victim = dir_ / "notes.txt";
  fs::create_directories(run);
  write_file_atomic(victim.string(), "precious");
  MetricsLog::Options o;
  o.run_dir = run.string();
  o.total_iterations = 10;
  o.out = null_out;
  const auto error_with = [&](const std::string& metrics, const std::string& plot) {
    MetricsLog::Options with = o;
    with.metrics_file = metrics;
    with.plot_file = plot;
    return test::error_of([&] { MetricsLog log(with, 0); });
  };
  std::string msg = error_with("../notes.txt", "");
  EXPECT_NE(msg.find("logging.metrics_file '../notes.txt' leaves the run directory"),
            std::string::npos)
      << msg;
  msg = error_with("", victim.string());
  EXPECT_NE(msg.find("logging.plot '" + victim.string() + "' is an absolute path"),
            std::string::npos)
      << msg;
  fs::create_symlink(victim, run / "metrics.jsonl");
  msg = error_with("metrics.jsonl", "");
  EXPECT_NE(msg.find("symbolic link"), std::string::npos) << msg;
  fs::create_symlink(victim, run / "training_curves.svg");
  msg = error_with("", "training_curves.svg");
  EXPECT_NE(msg.find("symbolic link"), std::string::npos) << msg;
  EXPECT_EQ(read_text_file(victim.string()), "precious");
  std::fclose(null_out);
}

TEST_F(MetricsFileTest, ProgressBarShowsEta) {
  const fs::path out_path = dir_ / "out.txt";
  FILE* out = std::fopen(out_path.c_str(), "w");
  MetricsLog::Options o;
  o.run_dir = dir_.string();
  o.metrics_file = "";
  o.plot_file = "";
  o.total_iterations = 4;
  o.progress_bar = true;
  o.out = out;
  {
    MetricsLog log(o, 0);
    log.progress(2);
    log.message("hello");
  }
  std::fclose(out);
  const std::string text = read_text_file(out_path.string());
  EXPECT_NE(text.find("2/4  50% ETA"), std::string::npos) << text;
  // The bar is cleared before the message's line.
  EXPECT_TRUE(std::regex_search(text, std::regex("\r\033\\[K[0-9-]+ [0-9:]+ INFO hello\n")))
      << text;
  EXPECT_FALSE(fs::exists(dir_ / "metrics.jsonl"));
}

TEST(LogLines, CarryTheTimeTheLevelAndTheRankUnderALauncher) {
  const std::regex head("^[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2} ");
  const std::string info = format_log_message("iter 1/2 | loss 3.0", "");
  EXPECT_TRUE(std::regex_search(info, head)) << info;
  EXPECT_EQ(info.substr(20), "INFO iter 1/2 | loss 3.0\n");
  // A warning says so once, as its level.
  EXPECT_EQ(format_log_message("warning: data: skipped x", "").substr(20),
            "WARN data: skipped x\n");
  EXPECT_EQ(format_log_message("error: gone", "").substr(20), "ERROR gone\n");
  EXPECT_EQ(format_log_message("note: kept", "[rank 1]").substr(20), "INFO [rank 1] note: kept\n");
  // Every line of a table gets the head; a trailing newline adds no empty line.
  const std::string table = format_log_message("stages:\n  0: layers 0-1\n  1: layers 2-3\n", "");
  size_t lines = 0;
  for (size_t at = 0; (at = table.find('\n', at)) != std::string::npos; ++at) ++lines;
  EXPECT_EQ(lines, 3u) << table;
  for (const char* part : {" INFO stages:\n", " INFO   0: layers 0-1\n", " INFO   1: layers 2-3\n"})
    EXPECT_NE(table.find(part), std::string::npos) << part << " in " << table;
  EXPECT_EQ(launcher_rank_tag(true, 0), "[rank 0]");
  EXPECT_EQ(launcher_rank_tag(true, 3), "[rank 3]");
  EXPECT_EQ(launcher_rank_tag(false, 0), "");
}

TEST(ProgressBar, AutoDrawsItOnlyOnATerminalNoLauncherGave) {
  EXPECT_TRUE(progress_bar_wanted("auto", true, false));
  EXPECT_FALSE(progress_bar_wanted("auto", true, true)) << "mpirun and srun give ranks terminals";
  EXPECT_FALSE(progress_bar_wanted("auto", false, false));
  EXPECT_TRUE(progress_bar_wanted("on", false, true));
  EXPECT_FALSE(progress_bar_wanted("off", true, false));
  EXPECT_THROW(progress_bar_wanted("yes", true, false), Error);
}

// The metrics file is appended to across resumes: rewritten (a new file) only when records past
// the resumed checkpoint must go.
TEST_F(MetricsFileTest, AResumeAppendsAndRewritesOnlyToDropWhatRunsAgain) {
  FILE* null_out = std::fopen("/dev/null", "w");
  MetricsLog::Options o;
  o.run_dir = dir_.string();
  o.plot_file = "";
  o.total_iterations = 10;
  o.out = null_out;
  const auto record = [](int64_t it) {
    StepMetrics m;
    m.iteration = it;
    m.loss = 1.0 / static_cast<double>(it);
    m.steps = 1;
    return m;
  };
  const fs::path file = dir_ / "metrics.jsonl";
  const auto inode = [&] {
    struct stat st {};
    ::stat(file.c_str(), &st);
    return st.st_ino;
  };
  {
    MetricsLog log(o, 0);
    for (int64_t it = 1; it <= 4; ++it) log.log(record(it));
  }
  const std::string four = read_text_file(file.string());
  const auto first = inode();
  {
    // Resumed at the last record: nothing to drop, the same file grows.
    MetricsLog log(o, 4);
    EXPECT_EQ(log.history().size(), 4u);
    EXPECT_EQ(inode(), first);
    EXPECT_EQ(read_text_file(file.string()), four);
    log.log(record(5));
    log.log(record(6));
  }
  EXPECT_EQ(inode(), first);
  EXPECT_EQ(read_text_file(file.string()).rfind(four, 0), 0u);
  {
    // Resumed at 5: record 6 is of a step about to run again.
    MetricsLog log(o, 5);
    EXPECT_NE(inode(), first);
    log.log(record(6));
  }
  std::vector<int64_t> iterations;
  std::ifstream f(file);
  for (std::string line; std::getline(f, line);)
    iterations.push_back(nlohmann::json::parse(line)["iteration"].get<int64_t>());
  EXPECT_EQ(iterations, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  std::fclose(null_out);
}

TEST(MetricsLog, LogLineAddsMfuAndTheStepsPartsWhenKnown) {
  StepMetrics m;
  m.iteration = 4;
  m.seconds = 2;
  m.flops = 4e12;  // 2 TFLOP/s over 2 ranks: 1 per GPU
  m.steps = 4;
  m.host_seconds = 1;
  m.device_seconds = 1.6;
  const std::string line = format_log_line(m, 10, 2, 10e12);
  for (const char* part : {"MFU 10.0%", "step 0.5 s (host 0.25, device 0.4)"})
    EXPECT_NE(line.find(part), std::string::npos) << part << " in " << line;
  EXPECT_EQ(format_log_line(m, 10).find("MFU"), std::string::npos) << "no peak, no MFU";
}

TEST(DevicePeak, DatasheetFiguresByDeviceNameAndNoneWhereUnknown) {
  struct Case {
    const char* name;
    double tflops;
  };
  for (const Case& c :
       {Case{"cuda:0 (NVIDIA H100 80GB HBM3)", 989.4}, Case{"cuda:1 (NVIDIA H100 PCIe)", 756.0},
        Case{"cuda:0 (NVIDIA H100 NVL)", 835.5}, Case{"cuda:0 (NVIDIA H200)", 989.4},
        Case{"cuda:0 (NVIDIA H200 NVL)", 835.5}, Case{"cuda:0 (NVIDIA GH200 480GB)", 989.4},
        Case{"cuda:0 (NVIDIA A100-SXM4-80GB)", 312.0},
        Case{"cuda:0 (NVIDIA A100 80GB PCIe)", 312.0}}) {
    const DevicePeak p = dense_bf16_peak(Device::cuda, c.name);
    EXPECT_DOUBLE_EQ(p.flops_per_second, c.tflops * 1e12) << c.name;
    EXPECT_NE(p.source.find(c.name), std::string::npos) << p.source;
  }
  const DevicePeak unknown = dense_bf16_peak(Device::cuda, "cuda:0 (NVIDIA L4)");
  EXPECT_EQ(unknown.flops_per_second, 0);
  EXPECT_NE(unknown.source.find("not in the peak table"), std::string::npos) << unknown.source;
  const DevicePeak cpu = dense_bf16_peak(Device::cpu, "cpu");
  EXPECT_EQ(cpu.flops_per_second, 0);
  EXPECT_NE(cpu.source.find("CPU"), std::string::npos) << cpu.source;
}

StepMetrics interval(int64_t iteration, int64_t steps, double seconds, int64_t graphs = 0) {
  StepMetrics m;
  m.iteration = iteration;
  m.steps = steps;
  m.seconds = seconds;
  m.host_seconds = seconds / 2;
  m.device_seconds = seconds * 0.9;
  m.tokens = 100 * steps;
  m.flops = 1e12 * static_cast<double>(steps);
  m.graphs_captured = graphs;
  return m;
}

TEST(SteadyState, SkipsTheFirstIntervalAndEverythingUpToTheLastCapture) {
  // Warm-up interval, an interval with a capture, then two steady ones of different lengths.
  const std::vector<StepMetrics> run{interval(2, 2, 10), interval(4, 2, 8, 3), interval(5, 1, 1),
                                     interval(8, 3, 6)};
  const SteadyState s = steady_state(run);
  EXPECT_EQ(s.steps, 4);
  EXPECT_EQ(s.first_iteration, 5);
  EXPECT_EQ(s.last_iteration, 8);
  EXPECT_DOUBLE_EQ(s.step_seconds, 7.0 / 4);  // weighted by steps
  EXPECT_DOUBLE_EQ(s.host_seconds, 3.5 / 4);
  EXPECT_DOUBLE_EQ(s.device_seconds, 7.0 * 0.9 / 4);
  EXPECT_DOUBLE_EQ(s.tokens_per_second, 400.0 / 7);
  EXPECT_DOUBLE_EQ(s.flops_per_second, 4e12 / 7);
  // One interval, or a capture in the last one: no steady state.
  EXPECT_EQ(steady_state({interval(3, 3, 3)}).steps, 0);
  EXPECT_EQ(steady_state({interval(1, 1, 1), interval(2, 1, 1, 1)}).steps, 0);
}

TEST(SteadyState, ProbedStepsStayOutAndHaveTheirOwnMeans) {
  // Warm-up, two steady steps, then two probed ones (logging.host_probe_steps), one of which
  // filled the launch queue.
  std::vector<StepMetrics> run{interval(1, 1, 5), interval(2, 1, 1), interval(3, 1, 1),
                               interval(4, 1, 3), interval(5, 1, 5)};
  for (size_t i = 3; i < run.size(); ++i) run[i].probed_steps = 1;
  run[4].probe_queue_full = 1;
  const SteadyState s = steady_state(run);
  EXPECT_EQ(s.steps, 2);
  EXPECT_EQ(s.last_iteration, 3);
  EXPECT_DOUBLE_EQ(s.step_seconds, 1.0);
  const SteadyState p = host_probe(run);
  EXPECT_EQ(p.steps, 2);
  EXPECT_EQ(p.first_iteration, 4);
  EXPECT_DOUBLE_EQ(p.host_seconds, (1.5 + 2.5) / 2);
  EXPECT_EQ(p.probe_queue_full, 1);
  EXPECT_EQ(host_probe({interval(1, 1, 5), interval(2, 1, 1)}).steps, 0);
}

// What the graph launches' CPU figure rests on: work counts, sleeping does not.
TEST(ThreadCpuClock, CountsWorkAndNotSleep) {
  const double t0 = thread_cpu_seconds();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const double slept = thread_cpu_seconds() - t0;
  // Busy until the clock says 50 ms of work, within 5 s however loaded the machine is.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  volatile double sink = 0;
  const double t1 = thread_cpu_seconds();
  while (thread_cpu_seconds() - t1 < 0.05 && std::chrono::steady_clock::now() < give_up)
    sink = sink + 1;
  EXPECT_LT(slept, 0.03);
  EXPECT_GE(thread_cpu_seconds() - t1, 0.05) << "5 s of busy work did not reach 50 ms of CPU";
}

TEST(StepTimer, SumsEachStepsSpanAcrossTheRingWithoutLosingSteps) {
  auto be = make_cpu_backend();
  StepTimer timer(*be);
  // More steps than the ring holds: the oldest are read as their slots come round again.
  // On the CPU a mark is the host clock, so the sum lies between the time inside the marks and
  // the time around the calls; the sleeps between steps are in neither.
  using Clock = std::chrono::steady_clock;
  const auto secs = [](Clock::duration d) { return std::chrono::duration<double>(d).count(); };
  double inside = 0, around = 0;
  for (int i = 0; i < Backend::kTimingMarks; ++i) {
    const auto t0 = Clock::now();
    timer.begin_step();
    const auto t1 = Clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    const auto t2 = Clock::now();
    timer.end_step();
    const auto t3 = Clock::now();
    inside += secs(t2 - t1);
    around += secs(t3 - t0);
    std::this_thread::sleep_for(std::chrono::milliseconds(3));
  }
  const double total = timer.take_seconds();
  EXPECT_GE(total, inside);
  EXPECT_LE(total, around) << "the gaps between steps were counted";
  EXPECT_EQ(timer.take_seconds(), 0.0) << "each step is counted once";
  EXPECT_THROW(timer.end_step(), Error);
  timer.begin_step();
  EXPECT_THROW(timer.begin_step(), Error);
}

TEST(RunSummary, SteadyFiguresPerGpuAndNullsForWhatDoesNotExist) {
  RunSummary r;
  r.device = "cuda:0 (NVIDIA H100 80GB HBM3)";
  r.on_gpu = true;
  r.ranks = 2;
  r.intervals = {interval(1, 1, 5, 4), interval(3, 2, 2), interval(5, 2, 2)};
  r.peak = dense_bf16_peak(Device::cuda, r.device);
  r.graph_count = 4;
  r.capture_ms = 12.5;
  r.graph_memory_bytes = int64_t(3) << 20;
  r.tokens = 90;
  r.padded_tokens = 128;
  r.labels = 40;
  r.label_slots = 64;
  const nlohmann::json j = nlohmann::json::parse(run_summary_json(r));
  const nlohmann::json& st = j.at("steady_state");
  EXPECT_EQ(st.at("steps").get<int64_t>(), 4);
  EXPECT_DOUBLE_EQ(st.at("step_seconds").get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(st.at("tokens_per_s_per_gpu").get<double>(), 100.0 / 2);
  EXPECT_DOUBLE_EQ(st.at("tflops_per_s_per_gpu").get<double>(), 0.5);
  EXPECT_DOUBLE_EQ(st.at("mfu").get<double>(), 0.5e12 / 989.4e12);
  EXPECT_EQ(j.at("graphs").at("memory_bytes").get<int64_t>(), int64_t(3) << 20);
  EXPECT_EQ(j.at("padding").at("padded_tokens").get<int64_t>(), 128);
  EXPECT_EQ(j.at("padding").at("labels").get<int64_t>(), 40);
  EXPECT_EQ(j.at("padding").at("label_slots").get<int64_t>(), 64);
  EXPECT_EQ(j.at("intervals").size(), 3u);

  // On the CPU: no MFU and no graph memory; a run of one interval: no steady state, said why.
  r.on_gpu = false;
  r.device = "cpu";
  r.peak = dense_bf16_peak(Device::cpu, "cpu");
  r.intervals = {interval(3, 3, 3)};
  const nlohmann::json c = nlohmann::json::parse(run_summary_json(r));
  EXPECT_TRUE(c.at("graphs").at("memory_bytes").is_null());
  EXPECT_TRUE(c.at("peak_flops").at("per_gpu").is_null());
  for (const char* k : {"step_seconds", "tokens_per_s_per_gpu", "mfu", "device_seconds_per_step"})
    EXPECT_TRUE(c.at("steady_state").at(k).is_null()) << k;
  EXPECT_NE(c.at("steady_state").at("note").get<std::string>().find("train_iters"),
            std::string::npos);
}

// A run resumed once: totals and losses over both stretches, the steady state (a performance
// figure of the process that wrote the summary) over the last one only.
TEST(RunSummary, TotalsCoverEveryStretchAndTheSteadyStateTheLast) {
  RunSummary r;
  r.device = "cpu";
  r.peak = dense_bf16_peak(Device::cpu, "cpu");
  r.stretches = {{0, 4, SIGTERM, "cpu", 1}, {4, 8, 0, "cpu", 1}};
  r.start_iteration = 0;
  r.final_iteration = 8;
  // Stretch 0: 4 steps of 1 s (a slow warm-up first); stretch 1: 4 steps of 2 s.
  r.intervals = {interval(1, 1, 9), interval(2, 1, 1), interval(4, 2, 2),
                 interval(5, 1, 9), interval(6, 1, 2), interval(8, 2, 4)};
  for (size_t i = 0; i < r.intervals.size(); ++i) {
    StepMetrics& m = r.intervals[i];
    m.stretch = i < 3 ? 0 : 1;
    m.loss = 10.0 - static_cast<double>(i);
    m.eval_seconds = 0.25;
    m.evaluations = 1;
    m.checkpoint_seconds = i == 2 || i == 5 ? 3.0 : 0.0;
    m.checkpoints = i == 2 || i == 5 ? 1 : 0;
    m.wall_seconds = m.seconds + m.eval_seconds + m.checkpoint_seconds;
  }
  const nlohmann::json j = nlohmann::json::parse(run_summary_json(r));
  EXPECT_EQ(j.at("format").get<std::string>(), "iris run summary 2");
  const nlohmann::json& t = j.at("totals");
  EXPECT_EQ(t.at("steps").get<int64_t>(), 8);
  EXPECT_EQ(t.at("tokens").get<int64_t>(), 800);
  EXPECT_DOUBLE_EQ(t.at("step_seconds").get<double>(), 27.0);
  EXPECT_DOUBLE_EQ(t.at("eval_seconds").get<double>(), 1.5);
  EXPECT_DOUBLE_EQ(t.at("checkpoint_seconds").get<double>(), 6.0);
  EXPECT_DOUBLE_EQ(t.at("wall_seconds").get<double>(), 34.5);
  EXPECT_EQ(t.at("evaluations").get<int64_t>(), 6);
  EXPECT_EQ(t.at("checkpoints").get<int64_t>(), 2);
  EXPECT_EQ(t.at("first_loss").at("iteration").get<int64_t>(), 1);
  EXPECT_DOUBLE_EQ(t.at("first_loss").at("loss").get<double>(), 10.0);
  EXPECT_EQ(t.at("last_loss").at("iteration").get<int64_t>(), 8);
  EXPECT_DOUBLE_EQ(t.at("last_loss").at("loss").get<double>(), 5.0);
  ASSERT_EQ(j.at("stretches").size(), 2u);
  EXPECT_EQ(j.at("stretches")[0].at("stop_signal").get<int>(), SIGTERM);
  EXPECT_EQ(j.at("stretches")[1].at("start").get<int64_t>(), 4);
  // Stretch 1 after its first interval: iterations 6-8, 3 steps of 2 s.
  const nlohmann::json& st = j.at("steady_state");
  EXPECT_EQ(st.at("first_iteration").get<int64_t>(), 6);
  EXPECT_EQ(st.at("steps").get<int64_t>(), 3);
  EXPECT_DOUBLE_EQ(st.at("step_seconds").get<double>(), 2.0);
  EXPECT_EQ(j.at("intervals").size(), 6u);
}

// What a resume reads back of the run before it: the intervals and stretches up to its
// checkpoint, or why it cannot.
TEST_F(MetricsFileTest, TheRunHistoryIsReadUpToTheResumedCheckpoint) {
  RunSummary r;
  r.device = "cpu";
  r.stretches = {{0, 6, 0, "cpu", 1}};
  r.final_iteration = 6;
  for (int64_t it : {2, 4, 5, 6}) {
    r.intervals.push_back(interval(it, it == 2 ? 2 : it == 4 ? 2 : 1, 1));
    r.intervals.back().checkpoint_seconds = 0.5;
    r.intervals.back().checkpoints = 1;
  }
  const std::string path = (dir_ / "run_summary.json").string();
  write_file_atomic(path, run_summary_json(r));
  RunHistory h;
  std::string why;
  ASSERT_TRUE(read_run_history(path, 4, h, why)) << why;
  ASSERT_EQ(h.intervals.size(), 2u);
  EXPECT_EQ(h.intervals.back().iteration, 4);
  EXPECT_DOUBLE_EQ(h.intervals.back().checkpoint_seconds, 0.5);
  EXPECT_EQ(h.intervals.back().checkpoints, 1);
  // The stretch that went on past the checkpoint is cut there: its later steps run again.
  ASSERT_EQ(h.stretches.size(), 1u);
  EXPECT_EQ(h.stretches[0].final, 4);
  // No interval ends at 3: the totals could not add up to the checkpoint.
  EXPECT_FALSE(read_run_history(path, 3, h, why));
  EXPECT_NE(why.find("do not end at iteration 3"), std::string::npos) << why;
  EXPECT_TRUE(h.intervals.empty());
  EXPECT_FALSE(read_run_history((dir_ / "none.json").string(), 4, h, why));
  EXPECT_EQ(why, "there is no run_summary.json of the stretches before it");
  write_file_atomic(path, "{\"intervals\": 3}");
  EXPECT_FALSE(read_run_history(path, 4, h, why));
}

TEST_F(MetricsFileTest, ReportsAndTheSweepTableReadTheRunSummary) {
  RunSummary r;
  r.device = "cpu";
  r.peak = dense_bf16_peak(Device::cpu, "cpu");
  r.intervals = {interval(1, 1, 4), interval(3, 2, 2)};
  const fs::path eager = dir_ / "eager", graphs = dir_ / "graphs";
  fs::create_directories(eager);
  fs::create_directories(graphs);
  write_file_atomic((eager / "run_summary.json").string(), run_summary_json(r));
  r.intervals = {interval(1, 1, 4, 2), interval(3, 2, 0.5), interval(4, 1, 0.2)};
  // A MoE run under an expert capacity: its drops summed over the run's intervals.
  r.intervals[0].moe_dropped_slots = 10;
  r.intervals[0].moe_routed_slots = 400;
  r.intervals[1].moe_dropped_slots = 30;
  r.intervals[1].moe_routed_slots = 800;
  r.intervals.back().probed_steps = 1;
  r.intervals.back().probe_queue_full = 1;
  r.decoder_graphs = "local";
  r.graph_count = 2;
  write_file_atomic((graphs / "run_summary.json").string(), run_summary_json(r));

  const nlohmann::json a = make_report(eager.string(), "eager", "run.sh --recipe x");
  const nlohmann::json b = make_report(graphs.string(), "graphs", "");
  const std::string text = format_report(a);
  for (const char* part : {"iris performance report: eager", "command               run.sh",
                           "step time             1.0000 s", "iterations 2-3 (2 steps",
                           "MFU                   - (peak: none: the run is on the CPU",
                           "graph memory          - (the CPU"})
    EXPECT_NE(text.find(part), std::string::npos) << part << " in\n" << text;

  const SweepTable t = sweep_table({a, b});
  EXPECT_EQ(t.json.at("reference").get<std::string>(), "eager");
  ASSERT_EQ(t.json.at("rows").size(), 2u);
  EXPECT_DOUBLE_EQ(t.json.at("rows")[0].at("speedup").get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(t.json.at("rows")[1].at("speedup").get<double>(), 4.0);
  EXPECT_NE(t.text.find("1.00x"), std::string::npos) << t.text;
  EXPECT_NE(t.text.find("4.00x"), std::string::npos) << t.text;
  EXPECT_LT(t.text.find("\neager "), t.text.find("\ngraphs ")) << t.text;
  // The probed step: not in the steady state, in its own column, marked where the queue filled.
  EXPECT_TRUE(t.json.at("rows")[0].at("held_host_enqueue_seconds_per_step").is_null());
  EXPECT_DOUBLE_EQ(t.json.at("rows")[1].at("held_host_enqueue_seconds_per_step").get<double>(),
                   0.1);
  EXPECT_NE(t.text.find("0.1000 full"), std::string::npos) << t.text;
  EXPECT_NE(format_report(b).find("host, device held     0.1000 s per step"), std::string::npos)
      << format_report(b);
  // 40 of 1200 routed slots dropped; the dropless run has no such line and a dash in the table.
  EXPECT_NE(format_report(b).find("MoE slots dropped     3.33% (40 of 1200 routed slots"),
            std::string::npos)
      << format_report(b);
  EXPECT_EQ(text.find("MoE slots dropped"), std::string::npos) << text;
  EXPECT_TRUE(t.json.at("rows")[0].at("moe_dropped_share").is_null());
  EXPECT_DOUBLE_EQ(t.json.at("rows")[1].at("moe_dropped_share").get<double>(), 40.0 / 1200);
  EXPECT_NE(t.text.find("3.33%"), std::string::npos) << t.text;

  // A summary without a field reports use is an error naming it.
  nlohmann::json broken =
      nlohmann::json::parse(read_text_file((eager / "run_summary.json").string()));
  broken["steady_state"].erase("device_seconds_per_step");
  write_file_atomic((eager / "run_summary.json").string(), broken.dump());
  try {
    make_report(eager.string(), "eager", "");
    FAIL() << "a summary without device_seconds_per_step was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/steady_state/device_seconds_per_step"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(make_report((dir_ / "missing").string(), "x", ""), Error);
}

}  // namespace
}  // namespace iris
