// scripts/performance/run.sh and sweep.sh driving the iris binary on the CPU with the tiny shapes
// recipe: a run's report.json holds sane steady-state figures (and no MFU on the CPU), a sweep
// of eager and graphed variants prints one row each with the first as the reference, every
// override flag lands on a recipe key iris knows, the Slurm launcher prints an sbatch script with
// srun and the overrides, and an unknown override is iris's error naming it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/fs.h"
#include "process_util.h"
#include "test_util.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using Exit = test::ProcessExit;

// Runs `args` (argv[0] looked up in PATH) with stdout and stderr into `log`.
Exit run(const std::vector<std::string>& args, const std::string& log) {
  return test::run_process(args, log);
}

class PerfScriptsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("iris_perf_scripts_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
    test::tokenizer_path();  // the tiny recipe's tokenizer: fails clearly when it was not fetched
  }
  void TearDown() override { fs::remove_all(root_); }

  Exit sh(const std::string& script, std::vector<std::string> args) {
    args.insert(args.begin(),
                {"bash", std::string(IRIS_SOURCE_DIR) + "/scripts/performance/" + script});
    return run(args, (root_ / ("log_" + std::to_string(++runs_) + ".txt")).string());
  }

  // The tiny shapes recipe on a few generated images, one sample per step: the arguments of
  // run.sh that every test shares.
  std::vector<std::string> tiny_run_args() {
    const std::string shapes = (root_ / "shapes").string();
    const Exit d = run({IRIS_BINARY, "data", "shapes", "--out", shapes, "--n", "8", "--seed", "3"},
                       (root_ / "data_log.txt").string());
    EXPECT_EQ(d.code, 0) << d.output;
    return {"--recipe",
            "qwen3vl_tiny_shapes",
            "--iris",
            IRIS_BINARY,
            "--device",
            "cpu",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "1",
            "data.train_files=[" + shapes + "/train.jsonl]",
            "schedule.warmup_iters=1"};
  }

  fs::path root_;
  int runs_ = 0;
};

TEST_F(PerfScriptsTest, RunWritesAReportWithSaneSteadyStateFigures) {
  std::vector<std::string> args = tiny_run_args();
  const std::string out = (root_ / "run").string();
  for (const char* a : {"--iters", "5", "--host-probe-steps", "2", "--out"}) args.push_back(a);
  args.push_back(out);
  const Exit e = sh("run.sh", args);
  ASSERT_EQ(e.code, 0) << e.output;
  ASSERT_TRUE(fs::exists(fs::path(out) / "report.txt")) << e.output;
  const json r = json::parse(read_text_file(out + "/report.json"));
  const json& st = r.at("steady_state");
  // Five steps logged one by one: the first interval is warm-up, iterations 2-3 the steady state
  // and 4-5 the probed steps (queued behind a held device; on the CPU nothing is held).
  EXPECT_EQ(st.at("steps").get<int64_t>(), 2);
  EXPECT_EQ(st.at("first_iteration").get<int64_t>(), 2);
  EXPECT_EQ(st.at("last_iteration").get<int64_t>(), 3);
  const double step = st.at("step_seconds").get<double>();
  EXPECT_GT(step, 0);
  EXPECT_GT(st.at("tokens_per_s_per_gpu").get<double>(), 0);
  EXPECT_GT(st.at("tflops_per_s_per_gpu").get<double>(), 0);
  // The parts of a step lie within it (the CPU's device time is the host's).
  for (const char* part : {"host_enqueue_seconds_per_step", "device_seconds_per_step"}) {
    EXPECT_GT(st.at(part).get<double>(), 0) << part;
    EXPECT_LE(st.at(part).get<double>(), step) << part;
  }
  EXPECT_GE(st.at("data_seconds_per_step").get<double>(), 0);
  // The CPU backend writes directly: its host never waits for write staging.
  EXPECT_EQ(st.at("host_wait_seconds_per_step").get<double>(), 0);
  EXPECT_TRUE(st.at("mfu").is_null()) << "no MFU on the CPU";
  EXPECT_TRUE(r.at("peak_flops").at("per_gpu").is_null());
  EXPECT_NE(r.at("peak_flops").at("source").get<std::string>().find("CPU"), std::string::npos);
  EXPECT_GT(r.at("memory").at("peak_bytes").get<int64_t>(), 0);
  EXPECT_EQ(r.at("graphs").at("count").get<int64_t>(), 0);
  EXPECT_TRUE(r.at("graphs").at("memory_bytes").is_null());
  const json& p = r.at("padding");
  EXPECT_GT(p.at("tokens").get<int64_t>(), 0);
  EXPECT_EQ(p.at("tokens"), p.at("padded_tokens")) << "eager runs pad nothing";
  EXPECT_GT(p.at("labels").get<int64_t>(), 0);
  EXPECT_EQ(p.at("labels"), p.at("label_slots")) << "eager runs pad nothing";
  EXPECT_EQ(r.at("label").get<std::string>(), "run");
  EXPECT_NE(r.at("command").get<std::string>().find("checkpoint.dir=" + out), std::string::npos);
  // A performance run leaves no checkpoint, and its metrics records carry the step's parts.
  for (const auto& entry : fs::directory_iterator(out))
    EXPECT_NE(entry.path().filename().string().rfind("step_", 0), 0u) << entry.path();
  const json& probe = r.at("host_probe");
  EXPECT_EQ(probe.at("steps").get<int64_t>(), 2);
  EXPECT_GT(probe.at("host_enqueue_seconds_per_step").get<double>(), 0);
  EXPECT_EQ(probe.at("queue_full_steps").get<int64_t>(), 0);
  std::ifstream metrics(out + "/metrics.jsonl");
  int records = 0;
  for (std::string line; std::getline(metrics, line); ++records) {
    const json m = json::parse(line);
    EXPECT_EQ(m.at("steps").get<int64_t>(), 1);
    EXPECT_EQ(m.at("probed_steps").get<int64_t>(), m.at("iteration").get<int64_t>() > 3 ? 1 : 0)
        << line;
    EXPECT_GT(m.at("host_enqueue_s_per_step").get<double>(), 0);
    EXPECT_EQ(m.at("host_wait_s_per_step").get<double>(), 0);
    // Every step prepares its micro-batches' inputs; an eager run launches no graph.
    EXPECT_GT(m.at("host_prepare_s_per_step").get<double>(), 0);
    EXPECT_EQ(m.at("graph_launch_s_per_step").get<double>(), 0);
    EXPECT_EQ(m.at("graph_launch_cpu_s_per_step").get<double>(), 0);
    EXPECT_GT(m.at("device_s_per_step").get<double>(), 0);
    EXPECT_TRUE(m.at("mfu").is_null());
  }
  EXPECT_EQ(records, 5);
  const std::string text = read_text_file(out + "/report.txt");
  for (const char* part : {"step time", "host enqueue", "host, device held", "MFU", "padding"})
    EXPECT_NE(text.find(part), std::string::npos) << part << " in " << text;
}

TEST_F(PerfScriptsTest, SweepPrintsOneRowPerVariantAgainstTheFirst) {
  std::vector<std::string> args{"--out", (root_ / "sweep").string(), "--variant",
                                "eager:", "--variant",
                                // One 64 px image is 256 patches: one vision bucket holds it.
                                "graphs: --cuda-graph-impl local --vision-cuda-graph-impl local "
                                "--max-vision-graph-seq-len 256 --vision-buckets 256",
                                "--"};
  for (const std::string& a : tiny_run_args()) args.push_back(a);
  for (const char* a : {"--iters", "4", "--graph-warmup-steps", "1"}) args.push_back(a);
  const Exit e = sh("sweep.sh", args);
  ASSERT_EQ(e.code, 0) << e.output;
  // The table: a header, a rule, then one row per variant in order, the reference at 1.00x.
  std::vector<std::string> rows;
  std::istringstream lines(e.output);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("eager ", 0) == 0 || line.rfind("graphs ", 0) == 0) rows.push_back(line);
  ASSERT_EQ(rows.size(), 2u) << e.output;
  EXPECT_EQ(rows[0].rfind("eager ", 0), 0u);
  EXPECT_NE(rows[0].find(" 1.00x "), std::string::npos) << rows[0];
  const json sweep = json::parse(read_text_file((root_ / "sweep/sweep.json").string()));
  EXPECT_EQ(sweep.at("reference").get<std::string>(), "eager");
  ASSERT_EQ(sweep.at("rows").size(), 2u);
  const json& eager = sweep.at("rows")[0];
  const json& graphs = sweep.at("rows")[1];
  EXPECT_EQ(eager.at("speedup").get<double>(), 1.0);
  EXPECT_EQ(eager.at("graph_count").get<int64_t>(), 0);
  // The graphs ran through the CPU's recording stand-in: captured once (warm-up 1), replayed.
  EXPECT_GT(graphs.at("graph_count").get<int64_t>(), 0);
  EXPECT_GT(graphs.at("capture_ms").get<double>(), 0);
  EXPECT_NEAR(graphs.at("speedup").get<double>(),
              eager.at("step_seconds").get<double>() / graphs.at("step_seconds").get<double>(),
              1e-9);
  // Captured in iteration 2, so the steady state is iterations 3-4.
  EXPECT_EQ(graphs.at("steps").get<int64_t>(), 2);
  const json& pad = graphs.at("padding");
  EXPECT_LT(pad.at("tokens").get<int64_t>(), pad.at("padded_tokens").get<int64_t>())
      << "the graphs run on micro-batches padded up to their bucket";
  // Per-layer graphs leave the loss eager: it runs over the real labels.
  EXPECT_EQ(pad.at("labels"), pad.at("label_slots"));
}

TEST_F(PerfScriptsTest, EveryOverrideFlagSetsARecipeKeyIrisKnows) {
  const std::vector<std::string> tiny = tiny_run_args();
  std::vector<std::string> args = tiny;
  const std::vector<std::string> flags{"--print-command",
                                       "--iters",
                                       "7",
                                       "--log-interval",
                                       "2",
                                       "--host-probe-steps",
                                       "3",
                                       "--seq-length",
                                       "128",
                                       "--recompute",
                                       "selective",
                                       "--data-parallel-size",
                                       "1",
                                       "--pipeline-parallel-size",
                                       "1",
                                       "--sharding",
                                       "optimizer_grads_params",
                                       "--offload-activations",
                                       "rstd1,attn",
                                       "--cuda-graph-impl",
                                       "local",
                                       "--cuda-graph-modules",
                                       "attn,mlp",
                                       "--vision-cuda-graph-impl",
                                       "local",
                                       "--vision-cuda-graph-modules",
                                       "attn",
                                       "--max-vision-graph-seq-len",
                                       "512",
                                       "--vision-buckets",
                                       "256,512",
                                       "--graph-warmup-steps",
                                       "2",
                                       "--out",
                                       (root_ / "run").string()};
  args.insert(args.end(), flags.begin(), flags.end());
  const Exit printed = sh("run.sh", args);
  ASSERT_EQ(printed.code, 0) << printed.output;
  EXPECT_FALSE(fs::exists(root_ / "run")) << "--print-command runs nothing";
  // The printed command, validated by iris itself: every key must exist and take its value (the
  // dry run plans the run, so the values must be consistent: 128 tokens plan the 512 patches the
  // vision graphs are bounded by).
  std::string command = printed.output;
  while (!command.empty() && command.back() == '\n') command.pop_back();
  const Exit dry = run({"bash", "-c", command + " --dry-run"}, (root_ / "dry.txt").string());
  ASSERT_EQ(dry.code, 0) << command << "\n" << dry.output;
  for (const char* resolved :
       {"train_iters: 7", "log_interval: 2", "host_probe_steps: 3", "seq_length: 128",
        "recompute: selective", "device: cpu", "micro_batch_size: 1", "global_batch_size: 1",
        "cuda_graph_impl: local", "cuda_graph_modules: [attn, mlp]",
        "vision_cuda_graph_impl: local", "vision_cuda_graph_modules: [attn]",
        "max_vision_cuda_graph_seq_length: 512", "vision_cuda_graph_buckets: [256, 512]",
        "cuda_graph_warmup_steps: 2", "save_final: false", "eval_interval: 0",
        "sharding: optimizer_grads_params", "offload_activations: [rstd1, attn]"})
    EXPECT_NE(dry.output.find(resolved), std::string::npos) << resolved << " in\n" << dry.output;
  // The step profile runs eagerly, so it is given apart from the graph flags.
  std::vector<std::string> profiled = tiny;
  for (const char* a : {"--print-command", "--op-profile-step", "2", "--out"})
    profiled.push_back(a);
  profiled.push_back((root_ / "profiled").string());
  const Exit printed_profile = sh("run.sh", profiled);
  ASSERT_EQ(printed_profile.code, 0) << printed_profile.output;
  std::string profile_command = printed_profile.output;
  while (!profile_command.empty() && profile_command.back() == '\n') profile_command.pop_back();
  const Exit dry_profile =
      run({"bash", "-c", profile_command + " --dry-run"}, (root_ / "dry_profile.txt").string());
  ASSERT_EQ(dry_profile.code, 0) << profile_command << "\n" << dry_profile.output;
  EXPECT_NE(dry_profile.output.find("op_profile_step: 2"), std::string::npos) << dry_profile.output;
}

// The MoE flags on a mixture-of-experts config: Megatron's drop-and-pad and the 'moe' module.
TEST_F(PerfScriptsTest, MoeCapacityFlagsSetTheModelsCapacityKeys) {
  std::vector<std::string> args = tiny_run_args();
  for (const std::string& a :
       {std::string("--print-command"), std::string("--moe-expert-capacity-factor"),
        std::string("1.5"), std::string("--moe-pad-expert-input-to-capacity"), std::string("true"),
        std::string("--moe-token-drop-policy"), std::string("position"),
        std::string("--cuda-graph-impl"), std::string("local"), std::string("--cuda-graph-modules"),
        std::string("attn,moe"),
        "model.config=" + std::string(IRIS_SOURCE_DIR) + "/tests/data/qwen3vlmoe-tiny/config.json",
        std::string("--out"), (root_ / "run").string()})
    args.push_back(a);
  const Exit printed = sh("run.sh", args);
  ASSERT_EQ(printed.code, 0) << printed.output;
  std::string command = printed.output;
  while (!command.empty() && command.back() == '\n') command.pop_back();
  const Exit dry = run({"bash", "-c", command + " --dry-run"}, (root_ / "dry.txt").string());
  ASSERT_EQ(dry.code, 0) << command << "\n" << dry.output;
  for (const char* resolved :
       {"moe_expert_capacity_factor: 1.5", "moe_pad_expert_input_to_capacity: true",
        "moe_token_drop_policy: position", "cuda_graph_modules: [attn, moe]"})
    EXPECT_NE(dry.output.find(resolved), std::string::npos) << resolved << " in\n" << dry.output;
}

TEST_F(PerfScriptsTest, LaunchersPutTheProcessCountAndOverridesInTheirCommand) {
  const std::vector<std::string> common{"--recipe",
                                        "qwen3vl_tiny_shapes",
                                        "--iris",
                                        IRIS_BINARY,
                                        "--cuda-graph-impl",
                                        "local",
                                        "--vision-buckets",
                                        "256,512",
                                        "train.seed=5",
                                        "--out",
                                        (root_ / "run").string()};
  std::vector<std::string> slurm = common;
  for (const char* a :
       {"--launcher", "slurm", "--gpus", "8", "--nodes", "2", "--sbatch-option", "--time=00:30:00"})
    slurm.push_back(a);
  const Exit s = sh("run.sh", slurm);
  ASSERT_EQ(s.code, 0) << s.output;
  EXPECT_EQ(s.output.rfind("#!/bin/bash\n", 0), 0u) << s.output;
  for (const char* part :
       {"#SBATCH --nodes=2 --ntasks-per-node=8 --gpus-per-node=8", "#SBATCH --time=00:30:00",
        "srun --mpi=pmix ", " train --recipe ", "parallel.data_parallel_size=16",
        "cuda_graph.cuda_graph_impl=local", "'cuda_graph.vision_cuda_graph_buckets=[256,512]'",
        "train.seed=5", " report "})
    EXPECT_NE(s.output.find(part), std::string::npos) << part << " in\n" << s.output;
  EXPECT_FALSE(fs::exists(root_ / "run")) << "the slurm launcher only prints";

  std::vector<std::string> mpi = common;
  for (const char* a : {"--launcher", "mpirun", "--gpus", "4", "--print-command"}) mpi.push_back(a);
  const Exit m = sh("run.sh", mpi);
  ASSERT_EQ(m.code, 0) << m.output;
  EXPECT_EQ(m.output.rfind("mpirun -np 4 ", 0), 0u) << m.output;
  EXPECT_NE(m.output.find("parallel.data_parallel_size=4"), std::string::npos) << m.output;

  std::vector<std::string> direct = common;
  for (const char* a : {"--gpus", "2"}) direct.push_back(a);
  const Exit d = sh("run.sh", direct);
  EXPECT_EQ(d.code, 2);
  EXPECT_NE(d.output.find("--launcher direct starts one process"), std::string::npos) << d.output;
}

TEST_F(PerfScriptsTest, UnknownOverridesAreErrorsNamingThem) {
  std::vector<std::string> args = tiny_run_args();
  for (const char* a : {"--iters", "2", "train.micro_batch_sise=2", "--out"}) args.push_back(a);
  args.push_back((root_ / "run").string());
  // Keys are iris's to check: its error names the key and the one it probably meant.
  const Exit key = sh("run.sh", args);
  EXPECT_EQ(key.code, 2) << key.output;  // iris train's status: a usage error
  EXPECT_NE(key.output.find("unknown key 'train.micro_batch_sise'"), std::string::npos)
      << key.output;
  EXPECT_NE(key.output.find("train.micro_batch_size"), std::string::npos) << key.output;
  EXPECT_FALSE(fs::exists(root_ / "run/report.json"));
  // Flags are the script's.
  const Exit flag = sh("run.sh", {"--recipe", "qwen3vl_tiny_shapes", "--cuda-graphs", "local"});
  EXPECT_EQ(flag.code, 2);
  EXPECT_NE(flag.output.find("unknown flag '--cuda-graphs'"), std::string::npos) << flag.output;
  const Exit variant = sh("sweep.sh", {"--variant", "no colon here", "--", "--recipe", "x"});
  EXPECT_EQ(variant.code, 2);
  EXPECT_NE(variant.output.find("has no ':'"), std::string::npos) << variant.output;
}

}  // namespace
}  // namespace iris
