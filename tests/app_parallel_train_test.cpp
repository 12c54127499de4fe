// iris train under mpirun on the CPU backend with the MPI communicator: data parallel 2 and 4
// give the losses and weights of one process with the same global batch bit for bit (one process
// with N micro-batch replicas, one thread each, is the structure N ranks reproduce:
// training/data_parallel.h); a data_parallel_size that disagrees with the launcher is an error
// naming both; and a rank that fails ends every rank of the job with a non-zero status.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/fs.h"
#include "test_util.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

struct Exit {
  int code = -1;  // exit status, or -1 when killed by a signal
  std::string output;
  double seconds = 0;
};

class AppParallelTrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string(IRIS_MPIEXEC).empty())
      GTEST_SKIP() << "built without MPI (install libopenmpi-dev openmpi-bin: scripts/setup.sh)";
    root_ = fs::temp_directory_path() /
            ("iris_app_parallel_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    if (!root_.empty()) fs::remove_all(root_);
  }

  // Runs argv with extra environment variables, stdout and stderr into one log.
  Exit run(const std::vector<std::string>& args, const std::vector<std::string>& env) {
    const std::string log = (root_ / ("log_" + std::to_string(++runs_) + ".txt")).string();
    const auto t0 = std::chrono::steady_clock::now();
    const pid_t pid = ::fork();
    if (pid == 0) {
      FILE* f = std::freopen(log.c_str(), "w", stdout);
      if (f != nullptr) ::dup2(STDOUT_FILENO, STDERR_FILENO);
      for (const std::string& e : env) ::putenv(const_cast<char*>(e.c_str()));
      std::vector<char*> argv;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      ::_exit(127);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    Exit e;
    if (WIFEXITED(status)) e.code = WEXITSTATUS(status);
    e.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    e.output = read_text_file(log);
    return e;
  }
  Exit iris(std::vector<std::string> args, const std::string& threads) {
    args.insert(args.begin(), IRIS_BINARY);
    return run(args, {"OMP_NUM_THREADS=" + threads});
  }
  // `mpirun -np N iris ...`, one thread per rank.
  Exit mpirun(int np, std::vector<std::string> args) {
    std::vector<std::string> all{IRIS_MPIEXEC, "-np", std::to_string(np)};
    if (!std::string(IRIS_MPIEXEC_FLAGS).empty()) all.push_back(IRIS_MPIEXEC_FLAGS);
    all.push_back(IRIS_BINARY);
    all.insert(all.end(), args.begin(), args.end());
    return run(
        all, {"OMP_NUM_THREADS=1", "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"});
  }

  std::string write_recipe() {
    const Exit d = iris({"data", "shapes", "--out", (root_ / "shapes").string(), "--n", "24",
                         "--seed", "7", "--heldout", "0.25"},
                        "1");
    EXPECT_EQ(d.code, 0) << d.output;
    const std::string path = (root_ / "tiny.yaml").string();
    write_file_atomic(
        path, "model:\n  init: random\n  init_seed: 3\n  config: " + test::fixture_dir() +
                  "/config.json\n  tokenizer: " + test::fixture_dir() + "/tokenizer.json\n" +
                  "data:\n  train_files: [" + (root_ / "shapes/train.jsonl").string() +
                  "]\n  min_pixels: 4096\n  max_pixels: 4096\n  num_workers: 1\n"
                  "train:\n  micro_batch_size: 1\n  global_batch_size: 4\n  train_iters: 3\n"
                  "  seq_length: 64\n"
                  "optimizer:\n  lr: 1.0e-3\n  min_lr: 1.0e-4\n"
                  "schedule:\n  kind: cosine\n  warmup_iters: 1\n"
                  "logging:\n  log_interval: 1\n");
    return path;
  }

  static std::vector<double> losses(const fs::path& run) {
    std::ifstream f(run / "metrics.jsonl");
    std::vector<double> out;
    for (std::string line; std::getline(f, line);)
      out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
    return out;
  }

  fs::path root_;
  int runs_ = 0;
};

TEST_F(AppParallelTrainTest, DataParallelGivesTheLossesOfOneProcessBitForBit) {
  const std::string recipe = write_recipe();
  for (const int np : {2, 4}) {
    SCOPED_TRACE("mpirun -np " + std::to_string(np));
    const fs::path single = root_ / ("single_" + std::to_string(np)),
                   dp = root_ / ("dp_" + std::to_string(np));
    // One process with np micro-batch replicas (one thread each) against np ranks.
    const Exit a = iris({"train", "--recipe", recipe, "checkpoint.dir=" + single.string()},
                        std::to_string(np));
    ASSERT_EQ(a.code, 0) << a.output;
    const Exit b = mpirun(np, {"train", "--recipe", recipe, "checkpoint.dir=" + dp.string(),
                               "parallel.data_parallel_size=" + std::to_string(np)});
    ASSERT_EQ(b.code, 0) << b.output;
    EXPECT_NE(b.output.find("data parallel: " + std::to_string(np) +
                            " processes started by "
                            "mpirun"),
              std::string::npos)
        << b.output;
    EXPECT_NE(b.output.find("rank " + std::to_string(np - 1) + ": micro-batches " +
                            std::to_string(np - 1)),
              std::string::npos)
        << b.output;
    const std::vector<double> la = losses(single), lb = losses(dp);
    ASSERT_EQ(la.size(), 3u);
    ASSERT_EQ(lb.size(), la.size()) << b.output;
    for (size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "iteration " << i + 1;
    EXPECT_EQ(read_text_file((single / "step_0000003/model.safetensors").string()),
              read_text_file((dp / "step_0000003/model.safetensors").string()));
  }
}

TEST_F(AppParallelTrainTest, DataParallelSizeMustMatchTheLauncher) {
  const std::string recipe = write_recipe();
  const Exit mismatch =
      mpirun(2, {"train", "--recipe", recipe, "checkpoint.dir=" + (root_ / "a").string()});
  EXPECT_NE(mismatch.code, 0) << mismatch.output;
  EXPECT_NE(mismatch.output.find("parallel.data_parallel_size is 1 but the launcher (mpirun) "
                                 "started 2 processes"),
            std::string::npos)
      << mismatch.output;
  const Exit alone = iris({"train", "--recipe", recipe, "parallel.data_parallel_size=2",
                           "checkpoint.dir=" + (root_ / "b").string()},
                          "1");
  EXPECT_EQ(alone.code, 1) << alone.output;
  EXPECT_NE(alone.output.find("mpirun -np 2 iris train"), std::string::npos) << alone.output;
}

TEST_F(AppParallelTrainTest, AFailingRankEndsEveryRank) {
  const std::string recipe = write_recipe();
  // Rank 1 alone is pointed at a folder it must refuse (resume never over a checkpoint) after
  // MPI is up, while rank 0 goes on to its first exchange.
  const fs::path taken = root_ / "taken";
  fs::create_directories(taken / "step_0000001");
  const std::string script =
      std::string("if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then dir=") + taken.string() +
      "; else dir=" + (root_ / "ok").string() + "; fi; exec " + IRIS_BINARY + " train --recipe " +
      recipe + " parallel.data_parallel_size=2 checkpoint.resume=never checkpoint.dir=$dir";
  std::vector<std::string> args{IRIS_MPIEXEC, "-np", "2"};
  if (!std::string(IRIS_MPIEXEC_FLAGS).empty()) args.push_back(IRIS_MPIEXEC_FLAGS);
  args.insert(args.end(), {"sh", "-c", script});
  const Exit e = run(
      args, {"OMP_NUM_THREADS=1", "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"});
  EXPECT_NE(e.code, 0) << e.output;
  EXPECT_NE(e.output.find("rank 1 of 2"), std::string::npos) << e.output;
  EXPECT_NE(e.output.find("checkpoint.resume is never"), std::string::npos) << e.output;
  EXPECT_LT(e.seconds, 120) << e.output;
}

}  // namespace
}  // namespace iris
