// The fixture of the multi-process training suites: a run folder per test, iris and `mpirun -np N
// iris` with their output in logs, and a tiny-model recipe on a small shapes set.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/fs.h"
#include "process_util.h"
#include "test_util.h"

namespace iris::test {

class MpirunTest : public ::testing::Test {
 protected:
  explicit MpirunTest(std::string folder_prefix) : prefix_(std::move(folder_prefix)) {}

  void SetUp() override {
    if (std::string(IRIS_MPIEXEC).empty())
      GTEST_SKIP() << "built without MPI (install libopenmpi-dev openmpi-bin: scripts/setup.sh)";
    root_ = std::filesystem::temp_directory_path() /
            (prefix_ + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    std::filesystem::create_directories(root_);
  }
  void TearDown() override {
    if (!root_.empty()) std::filesystem::remove_all(root_);
  }

  // Runs argv with extra environment variables, stdout and stderr into one log.
  ProcessExit run(const std::vector<std::string>& args, const std::vector<std::string>& env) {
    const std::string log = (root_ / ("log_" + std::to_string(++runs_) + ".txt")).string();
    return run_process(args, log, env);
  }
  ProcessExit iris(std::vector<std::string> args, const std::string& threads) {
    args.insert(args.begin(), IRIS_BINARY);
    return run(args, {"OMP_NUM_THREADS=" + threads});
  }
  // One thread per rank, and OpenMPI's consent to run as root (CI and the GPU machine do).
  static std::vector<std::string> mpi_env() {
    return {"OMP_NUM_THREADS=1", "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"};
  }
  static std::vector<std::string> mpirun_prefix(int np) {
    std::vector<std::string> all{IRIS_MPIEXEC, "-np", std::to_string(np)};
    if (!std::string(IRIS_MPIEXEC_FLAGS).empty()) all.push_back(IRIS_MPIEXEC_FLAGS);
    return all;
  }
  // `mpirun -np N iris ...`.
  ProcessExit mpirun(int np, const std::vector<std::string>& args) {
    std::vector<std::string> all = mpirun_prefix(np);
    all.push_back(IRIS_BINARY);
    all.insert(all.end(), args.begin(), args.end());
    return run(all, mpi_env());
  }

  // The tiny model from random weights on 24 shapes samples, 3 steps of 4; `optimizer_extra`
  // adds lines to the optimizer section.
  std::string write_recipe(const std::string& optimizer_extra = "") {
    const ProcessExit d = iris({"data", "shapes", "--out", (root_ / "shapes").string(), "--n", "24",
                                "--seed", "7", "--heldout", "0.25"},
                               "1");
    EXPECT_EQ(d.code, 0) << d.output;
    const std::string path = (root_ / "tiny.yaml").string();
    write_file_atomic(
        path, "model:\n  init: random\n  init_seed: 3\n  config: " + fixture_dir() +
                  "/config.json\n  tokenizer: " + fixture_dir() + "/tokenizer.json\n" +
                  "data:\n  train_files: [" + (root_ / "shapes/train.jsonl").string() +
                  "]\n  min_pixels: 4096\n  max_pixels: 4096\n  num_workers: 1\n"
                  "train:\n  micro_batch_size: 1\n  global_batch_size: 4\n  train_iters: 3\n"
                  // The CPU backend with the MPI communicator, also where a GPU is present
                  // (several ranks on one GPU is an error of its own).
                  "  seq_length: 64\n  device: cpu\n"
                  "optimizer:\n  lr: 1.0e-3\n  min_lr: 1.0e-4\n" +
                  optimizer_extra +
                  "schedule:\n  kind: cosine\n  warmup_iters: 1\n"
                  "logging:\n  log_interval: 1\n");
    return path;
  }

  // The tiny model's config with untied embeddings (an lm_head of its own, as the 8B and 32B
  // models have), for a recipe's model.config.
  std::string write_untied_config() {
    nlohmann::json config = nlohmann::json::parse(read_text_file(fixture_dir() + "/config.json"));
    config["tie_word_embeddings"] = false;
    config["text_config"]["tie_word_embeddings"] = false;
    const std::string path = (root_ / "untied_config.json").string();
    write_file_atomic(path, config.dump(2));
    return path;
  }

  // The training ("loss") or evaluation ("eval_loss") records of a run, in order.
  static std::vector<double> losses(const std::filesystem::path& run, const char* key = "loss") {
    std::ifstream f(run / "metrics.jsonl");
    std::vector<double> out;
    for (std::string line; std::getline(f, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains(key)) out.push_back(j[key].get<double>());
    }
    return out;
  }

  std::filesystem::path root_;

 private:
  std::string prefix_;
  int runs_ = 0;
};

}  // namespace iris::test
