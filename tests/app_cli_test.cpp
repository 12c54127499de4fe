// The command line every iris command shares (apps/cli.h): help, the closest known command,
// subcommand, flag or recipe key suggested for a mistyped one, the last of a repeated flag
// winning, and the exit status: 2 when the command line is wrong, 1 when the command fails at its
// work, each with one "iris CMD: error: ..." line.
#include <sys/wait.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/fs.h"
#include "test_util.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// `args` as a shell would split them; stdin is empty.
RunResult run_iris(const std::string& args) {
  const fs::path dir = test::scratch_dir();
  const std::string out = (dir / "out").string(), err = (dir / "err").string();
  const std::string cmd =
      "timeout 120 " + std::string(IRIS_BINARY) + " " + args + " </dev/null >" + out + " 2>" + err;
  const int status = std::system(cmd.c_str());
  RunResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

std::string q(const std::string& s) {
  return "'" + s + "'";
}

std::string recipe() {
  return q(std::string(IRIS_SOURCE_DIR) + "/recipes/qwen3vl_tiny_shapes.yaml");
}

// A usage or runtime error: its status, one line naming what was wrong, no build paths.
void expect_failure(const std::string& args, int code, const std::string& needle) {
  SCOPED_TRACE("iris " + args);
  const RunResult r = run_iris(args);
  EXPECT_EQ(r.exit_code, code) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find(".cpp:"), std::string::npos) << r.err;
  // Not CLI11's own wording or exit codes (105, 109, 114...).
  EXPECT_EQ(r.err.find("The following arguments were not expected"), std::string::npos) << r.err;
  if (code == 2) EXPECT_NE(r.err.find("error: "), std::string::npos) << r.err;
}

TEST(AppCli, HelpListsTheCommandsAndEachCommandsFlags) {
  for (const char* spelling : {"help", "--help", "-h"}) {
    const RunResult r = run_iris(spelling);
    EXPECT_EQ(r.exit_code, 0) << spelling;
    for (const char* command : {"generate", "train", "bench", "export", "data", "report", "help"})
      EXPECT_NE(r.out.find("  " + std::string(command) + " "), std::string::npos)
          << spelling << ": " << command << "\n"
          << r.out;
  }
  const RunResult train = run_iris("help train");
  EXPECT_EQ(train.exit_code, 0) << train.err;
  EXPECT_NE(train.out.find("--dry-run"), std::string::npos) << train.out;
  EXPECT_EQ(train.out, run_iris("train --help").out);
  const RunResult data = run_iris("help data");
  EXPECT_EQ(data.exit_code, 0) << data.err;
  EXPECT_NE(data.out.find("shapes-eval"), std::string::npos) << data.out;
  // With no command at all the list goes to stderr, as a usage error.
  const RunResult bare = run_iris("");
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_EQ(bare.out, "");
  EXPECT_NE(bare.err.find("usage: iris <command>"), std::string::npos) << bare.err;
}

TEST(AppCli, MistypedAndShortenedCommandsSuggestTheClosest) {
  expect_failure("gen -m x", 2, "unknown command 'gen'; did you mean 'generate'?");
  expect_failure("genrate -m x", 2, "unknown command 'genrate'; did you mean 'generate'?");
  expect_failure("hlep", 2, "unknown command 'hlep'; did you mean 'help'?");
  expect_failure("help gen", 2, "unknown command 'gen'; did you mean 'generate'?");
  expect_failure("help trian", 2, "did you mean 'train'?");
  expect_failure("--verison", 2, "unknown flag '--verison'; did you mean '--version'?");
  const RunResult far = run_iris("xyzzy");
  EXPECT_EQ(far.exit_code, 2);
  EXPECT_NE(far.err.find("unknown command 'xyzzy'"), std::string::npos) << far.err;
  EXPECT_EQ(far.err.find("did you mean"), std::string::npos) << far.err;
}

// Each command: a mistyped flag gets the closest one, and the parser's refusals (a missing
// argument, a value of the wrong type or out of range, an unexpected word) exit with 2, while a
// command that fails at its work (a file that is not there) exits with 1.
TEST(AppCli, EveryCommandExitsWithTwoForUsageAndOneForRuntimeErrors) {
  const std::string m = " -m " + q(test::fixture_dir());
  const std::string nowhere = q((test::scratch_dir() / "nowhere").string());
  // generate
  expect_failure("generate" + m + " -p hi --temprature 0", 2,
                 "unknown flag --temprature; did you mean --temperature?");
  expect_failure("generate -p hi", 2, "--model is required");
  expect_failure("generate" + m + " -p hi -t 0", 2, "--threads");
  expect_failure("generate" + m + " -p hi --seed abc", 2, "--seed");
  expect_failure("generate" + m + " -p hi -n -2", 2, "-n/--n-predict -2 must be -1");
  expect_failure("generate" + m + " -p hi stray", 2, "unexpected argument 'stray'");
  expect_failure("generate" + m + " -p hi --logits-out x.safetensors -cnv", 2,
                 "--logits-out needs a one-shot prompt");
  expect_failure("generate" + m + " -p hi --chat-template-kwargs '{bad'", 2,
                 "--chat-template-kwargs is not JSON");
  expect_failure("generate -m " + nowhere + " -p hi", 1, "does not exist");
  // train
  expect_failure("train --recipe " + recipe() + " --dryrun", 2,
                 "unknown flag --dryrun; did you mean --dry-run?");
  expect_failure("train --dry-run", 2, "--recipe is required");
  expect_failure("train --recipe " + recipe() + " --device-memory -1 --dry-run", 2,
                 "--device-memory");
  expect_failure(
      "train --recipe " + recipe() + " --dry-run train.lr=1e-3", 2,
      "unknown key 'train.lr' in override 'train.lr=1e-3'; did you mean 'optimizer.lr'?");
  expect_failure("train --recipe " + recipe() + " --dry-run train.train_iters=many", 2,
                 "train.train_iters expects an integer, got 'many'");
  expect_failure("train --recipe " + nowhere + " --dry-run", 1, "does not exist");
  // bench
  expect_failure("bench --itres 2", 2, "unknown flag --itres; did you mean --iters?");
  expect_failure("bench --only vison", 2, "--only");
  expect_failure("bench --train --stepz 2", 2, "unknown flag --stepz; did you mean --steps?");
  expect_failure("bench --train --micro 0", 2, "--micro, --accumulation and --steps must be");
  expect_failure("bench --quick --device cpu --iters 1 --config " + nowhere, 1, "nowhere");
  // export
  expect_failure("export", 2, "checkpoint is required");
  expect_failure("export a b c", 2, "unexpected argument 'c'");
  expect_failure("export a b --dtype f8", 2, "--dtype");
  expect_failure("export " + nowhere + " " + q((test::scratch_dir() / "out").string()), 1,
                 "nowhere");
  // data
  expect_failure("data shapez --out x", 2,
                 "unknown subcommand 'shapez'; did you mean 'shapes'? (iris data takes shapes, "
                 "shapes-eval)");
  expect_failure("data shapes", 2, "--out is required");
  expect_failure("data shapes --out x --n 0", 2, "--n");
  expect_failure("data shapes --outt x", 2,
                 "unknown flag --outt; did you mean --out? (iris data shapes --help lists the "
                 "flags)");
  expect_failure("data shapes-eval -m " + nowhere + " --heldout " + nowhere, 1, "nowhere");
  // report
  expect_failure("report", 2, "paths is required");
  expect_failure("report --tabl a", 2, "unknown flag --tabl; did you mean --table?");
  expect_failure("report a b", 2, "iris report takes one run directory (got 2)");
  expect_failure("report " + nowhere, 1, "nowhere");
}

// As in llama.cpp (and iris generate), the last of a repeated flag wins in every command.
TEST(AppCli, TheLastOfARepeatedFlagWinsInEveryCommand) {
  const fs::path first = test::scratch_dir() / "shapes_first",
                 last = test::scratch_dir() / "shapes_last";
  const RunResult data = run_iris("data shapes --out " + q(first.string()) + " --out " +
                                  q(last.string()) + " --n 2 --n 3 --image-size 32");
  ASSERT_EQ(data.exit_code, 0) << data.err;
  EXPECT_FALSE(fs::exists(first));
  EXPECT_NE(data.out.find("wrote 3 shapes scenes"), std::string::npos) << data.out;
  EXPECT_TRUE(fs::exists(last / "train.jsonl"));
  const RunResult train =
      run_iris("train --recipe " + q((test::scratch_dir() / "none.yaml").string()) + " --recipe " +
               recipe() + " --dry-run --dry-run");
  EXPECT_EQ(train.exit_code, 0) << train.err;
  EXPECT_NE(train.out.find("recipe is valid"), std::string::npos) << train.out;
}

// `iris bench --quick` on the CPU with the tiny fixture's geometry and `flags`: its JSON results
// (null when it wrote none), with the run in `r`.
nlohmann::json quick_cpu_bench(const std::string& flags, RunResult& r) {
  const fs::path json_path = test::scratch_dir() / "bench.json";
  fs::remove(json_path);
  r = run_iris("bench --quick --device cpu --iters 1 " + flags + " --config " +
               q(test::fixture_dir() + "/config.json") + " --json " + q(json_path.string()));
  return fs::exists(json_path) ? nlohmann::json::parse(slurp(json_path.string()))
                               : nlohmann::json();
}

// The attention figures of `iris bench` time the training forward and backward beside the
// inference op, for every case, with rates against the GEMM rate of the same run.
TEST(AppCli, BenchAttentionTimesTheTrainingForwardAndBackwardOfEveryCase) {
  RunResult r;
  const nlohmann::json results = quick_cpu_bench("--only attention", r);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(results.contains("attention")) << results.dump();
  const auto& cases = results["attention"];
  EXPECT_EQ(cases.size(), 4u) << cases.dump();  // three vision cases and the causal prefill
  for (const auto& [name, c] : cases.items()) {
    SCOPED_TRACE(name);
    for (const char* key : {"tflops", "train_forward_tflops", "train_backward_tflops"})
      EXPECT_GT(c.at(key).get<double>(), 0.0) << key;
    EXPECT_NE(r.out.find("attention " + name + " train forward"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("attention " + name + " train backward"), std::string::npos) << r.out;
  }
}

// --busy-host measures the figures again beside one spinning thread per core and prints each
// one's slowdown against its quiet time.
TEST(AppCli, BenchBusyHostPrintsEachFiguresSlowdown) {
  RunResult r;
  const nlohmann::json results = quick_cpu_bench("--only prefill,decode --busy-host", r);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  ASSERT_TRUE(results.contains("busy_host_slowdown")) << results.dump();
  const auto& slowdown = results["busy_host_slowdown"];
  for (const char* key : {"prefill_32", "prefill_128", "decode"}) {
    ASSERT_TRUE(slowdown.contains(key)) << key << ": " << slowdown.dump();
    EXPECT_GT(slowdown[key].get<double>(), 0.0) << key;
    EXPECT_NE(r.out.find("graphs " + std::string(key) + " slowdown"), std::string::npos) << r.out;
  }
  EXPECT_GE(results.at("busy_host_threads").get<int>(), 1);
  EXPECT_TRUE(results.contains("graphs_busy_host"));
}

}  // namespace
}  // namespace iris
