// A whole training step through the op profile (core/op_profile.h): the loss of a step without
// it, and every op of the step in a named family.
#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "core/op_profile.h"
#include "test_util.h"
#include "training/train_model.h"
#include "training_test_util.h"

namespace iris {
namespace {

// A whole MoE training step through the profile: the same loss as without it, every op of it in a
// named family (the ones a step must have among them), and the ops' time within the step's.
TEST(OpProfile, AMoeTrainingStepsOpsAllHaveFamilies) {
  const std::string dir = test::data_dir() + "/qwen3vlmoe-tiny";
  const test::Golden golden(dir);
  auto cpu = make_cpu_backend();
  const ModelConfig cfg = ModelConfig::from_file(dir + "/config.json");
  auto params = load_weights(*cpu, cfg, dir);
  TrainLimits limits;
  limits.max_seq_len = 128;
  limits.max_patches = 256;
  limits.max_images = 4;
  const TrainSample sample = test::golden_sample(golden);
  TrainableQwen3VL plain(*cpu, cfg, *params, limits);
  const double want = plain.forward_backward({&sample}, 1.0f).loss_sum;

  ProfilingBackend prof(*cpu);
  TrainableQwen3VL m(prof, cfg, *params, limits);
  prof.start();
  const auto t0 = std::chrono::steady_clock::now();
  const double got = m.forward_backward({&sample}, 1.0f).loss_sum;
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const std::vector<OpRecord> records = prof.stop();
  EXPECT_EQ(got, want);
  std::set<std::string> families;
  double ms = 0;
  for (const OpRecord& r : records) {
    families.insert(op_family(r.op));
    ms += r.ms;
  }
  EXPECT_EQ(families.count("other"), 0u);
  for (const char* f :
       {"GEMM forward", "GEMM input gradient", "GEMM weight gradient", "MoE experts", "MoE routing",
        "attention forward", "attention backward", "norms and RoPE", "loss"})
    EXPECT_EQ(families.count(f), 1u) << f;
  EXPECT_GT(ms, 0.0);
  EXPECT_LE(ms, wall_ms);
}

}  // namespace
}  // namespace iris
