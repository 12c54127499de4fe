// iris train under mpirun on the CPU backend with the MPI communicator: data parallel 2 and 4
// give the losses and weights of one process with the same global batch bit for bit (one process
// with N micro-batch replicas, one thread each, is the structure N ranks reproduce:
// training/data_parallel.h); a data_parallel_size that disagrees with the launcher is an error
// naming both; and a rank that fails ends every rank of the job with a non-zero status. The
// sharded optimizer (parallel.sharding=optimizer, or optimizer.distributed) gives the unsharded run
// bit for bit with half the moments per rank, and checkpoints resume under another data-parallel
// size and sharding; sharding by layer (parallel.sharding=optimizer_grads and
// optimizer_grads_params) too, with one micro-batch per rank.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/fs.h"
#include "core/safetensors.h"
#include "mpirun_test_util.h"
#include "test_util.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

using Exit = test::ProcessExit;

class AppParallelTrainTest : public test::MpirunTest {
 protected:
  AppParallelTrainTest() : MpirunTest("iris_app_parallel_test_") {}

  // Run `got` logged run `want`'s three losses and saved its step-3 weights (and with_optimizer,
  // its optimizer state: the moments gathered from every shard), bit for bit.
  static void expect_same_three_steps(const fs::path& want, const fs::path& got,
                                      const std::string& log, bool with_optimizer = false) {
    const std::vector<double> a = losses(want), b = losses(got);
    ASSERT_EQ(a.size(), 3u);
    ASSERT_EQ(b.size(), a.size()) << log;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "iteration " << i + 1;
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      if (with_optimizer || std::string(file) == "model.safetensors")
        EXPECT_TRUE(read_text_file((want / "step_0000003" / file).string()) ==
                    read_text_file((got / "step_0000003" / file).string()))
            << file;
  }

  // Run `resumed` (stopped after step 2 and resumed, its second leg's log `log`) logged run
  // `whole`'s four losses and saved its step-4 weights and optimizer state, bit for bit.
  static void expect_resumed_as_whole(const fs::path& whole, const fs::path& resumed,
                                      const std::string& log) {
    EXPECT_NE(log.find("resuming from"), std::string::npos) << log;
    const std::vector<double> want = losses(whole), got = losses(resumed);
    ASSERT_EQ(want.size(), 4u);
    ASSERT_EQ(got.size(), 4u) << log;
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "iteration " << i + 1;
    for (const char* file : {"model.safetensors", "optimizer.safetensors"})
      EXPECT_TRUE(read_text_file((whole / "step_0000004" / file).string()) ==
                  read_text_file((resumed / "step_0000004" / file).string()))
          << file;
  }
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
    expect_same_three_steps(single, dp, b.output);
  }
}

// The gradient buckets start during the backward of each step's last micro-batch (the default),
// each once its gradients are final; in small buckets (dozens of them, most started early) and
// with the overlap off, data parallel 2 gives one process's losses and weights bit for bit.
TEST_F(AppParallelTrainTest, OverlappedReductionInSmallBucketsGivesOneProcessBitForBit) {
  const std::string recipe = write_recipe();
  const fs::path single = root_ / "single";
  const Exit a = iris({"train", "--recipe", recipe, "checkpoint.dir=" + single.string()}, "2");
  ASSERT_EQ(a.code, 0) << a.output;
  for (const bool overlap : {true, false}) {
    SCOPED_TRACE(overlap ? "overlapped" : "after the backward");
    const fs::path dp = root_ / (overlap ? "overlapped" : "after");
    const Exit b =
        mpirun(2, {"train", "--recipe", recipe, "checkpoint.dir=" + dp.string(),
                   "parallel.data_parallel_size=2", "parallel.grad_bucket_elements=4099",
                   std::string("parallel.overlap_grad_reduce=") + (overlap ? "true" : "false")});
    ASSERT_EQ(b.code, 0) << b.output;
    EXPECT_NE(b.output.find(overlap ? "each started during the last micro-batch's backward"
                                    : "after the backward (parallel.overlap_grad_reduce off)"),
              std::string::npos)
        << b.output;
    expect_same_three_steps(single, dp, b.output);
  }
}

TEST_F(AppParallelTrainTest, ShardedOptimizerGivesTheUnshardedRunBitForBitWithAFractionOfTheState) {
  const std::string recipe = write_recipe();
  // Weight decay and clipping on, so that every part of the sharded update (decay by tensor
  // rank, the global norm over the shards) shows in the weights.
  const std::vector<std::string> common{"train",
                                        "--recipe",
                                        recipe,
                                        "parallel.data_parallel_size=2",
                                        "optimizer.weight_decay=0.1",
                                        "optimizer.clip_grad=1.0"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const fs::path plain = root_ / "plain", sharded = root_ / "sharded";
  const Exit a = mpirun(2, with({"checkpoint.dir=" + plain.string()}));
  ASSERT_EQ(a.code, 0) << a.output;
  const Exit b =
      mpirun(2, with({"checkpoint.dir=" + sharded.string(), "parallel.sharding=optimizer"}));
  ASSERT_EQ(b.code, 0) << b.output;
  // The weights, and the moments gathered from both shards, in the ordinary format.
  expect_same_three_steps(plain, sharded, b.output, /*with_optimizer=*/true);
  // Each rank holds half of the moments.
  auto moments_mib = [](const std::string& out) {
    const size_t at = out.find("AdamW moments ");
    return at == std::string::npos ? -1 : std::stoi(out.substr(at + 14));
  };
  const int full = moments_mib(a.output), half = moments_mib(b.output);
  EXPECT_GT(full, 0) << a.output;
  EXPECT_EQ(half, full / 2) << b.output;
  EXPECT_NE(b.output.find("this rank's 1/2 (parallel.sharding=optimizer)"), std::string::npos)
      << b.output;
  // And half of the f32 master weights, which the unsharded CPU run has none of apart from the
  // weights the model reads (whole on every rank in both).
  auto master_mib = [](const std::string& out) {
    const size_t at = out.find("f32 master weights ");
    return at == std::string::npos ? -1 : std::stoi(out.substr(at + 19));
  };
  EXPECT_EQ(master_mib(a.output), -1) << a.output;
  // Two moments per master weight: a quarter of the unsharded moments, give or take the rounding.
  EXPECT_NEAR(master_mib(b.output), full / 4, 1) << b.output;
}

// Gradient sharding (parallel.sharding=optimizer_grads, training/sharded_gradients.h): with one
// micro-batch per rank, data parallel 2 and 4 give the unsharded run's losses, weights and
// optimizer state bit for bit, while each rank holds the tensors outside the decoder layers, two
// layers' slots and its shard of the sums instead of every gradient; weight sharding too
// (optimizer_grads_params, training/sharded_weights.h), each rank holding two layers' weights
// and its shard of them instead of every layer's. With two micro-batches per rank the layers'
// sums are added micro-batch after micro-batch (the unsharded run adds each rank's first), which
// changes f32 roundings only, and weight sharding gives gradient sharding's bits.
TEST_F(AppParallelTrainTest, ShardingByLayerGivesTheUnshardedRunBitForBitWithOneMicroBatchPerRank) {
  const std::string recipe = write_recipe();
  auto mib_after = [](const std::string& out, const std::string& what) {
    const size_t at = out.find(what);
    return at == std::string::npos ? -1 : std::stoi(out.substr(at + what.size()));
  };
  for (const int np : {2, 4}) {
    SCOPED_TRACE("mpirun -np " + std::to_string(np));
    const std::vector<std::string> common{"train", "--recipe", recipe,
                                          "parallel.data_parallel_size=" + std::to_string(np),
                                          "train.global_batch_size=" + std::to_string(np),
                                          "optimizer.weight_decay=0.1", "optimizer.clip_grad=1.0",
                                          // Several chunks per layer and shard boundaries inside
                                          // layers.
                                          "parallel.grad_bucket_elements=5003"};
    auto with = [&](std::vector<std::string> extra) {
      std::vector<std::string> a = common;
      a.insert(a.end(), extra.begin(), extra.end());
      return a;
    };
    const fs::path plain = root_ / ("plain_" + std::to_string(np));
    const Exit a = mpirun(np, with({"checkpoint.dir=" + plain.string()}));
    ASSERT_EQ(a.code, 0) << a.output;
    for (const std::string mode : {"optimizer_grads", "optimizer_grads_params"}) {
      SCOPED_TRACE(mode);
      const fs::path sharded = root_ / (mode + "_" + std::to_string(np));
      const Exit b =
          mpirun(np, with({"checkpoint.dir=" + sharded.string(), "parallel.sharding=" + mode}));
      ASSERT_EQ(b.code, 0) << b.output;
      expect_same_three_steps(plain, sharded, b.output, /*with_optimizer=*/true);
      EXPECT_NE(b.output.find("(this rank's shard of the sums"), std::string::npos) << b.output;
      const int whole = mib_after(a.output, ", gradients "),
                held = mib_after(b.output, ", gradients ");
      EXPECT_GT(whole, 0) << a.output;
      EXPECT_GE(held, 0) << b.output;
      EXPECT_LT(held, whole) << b.output;
      if (mode == "optimizer_grads_params") {
        EXPECT_NE(b.output.find("(outside the decoder layers, and 2 layer slots)"),
                  std::string::npos)
            << b.output;
        EXPECT_LT(mib_after(b.output, ": weights "), mib_after(a.output, ": weights ")) << b.output;
      }
    }
  }
  // Two micro-batches per rank: the same run up to f32 rounding, and weight sharding gives
  // gradient sharding's bits.
  const std::vector<std::string> common{"train", "--recipe", recipe,
                                        "parallel.data_parallel_size=2"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const fs::path plain = root_ / "plain_two";
  const Exit a = mpirun(2, with({"checkpoint.dir=" + plain.string()}));
  ASSERT_EQ(a.code, 0) << a.output;
  const std::vector<double> la = losses(plain);
  ASSERT_EQ(la.size(), 3u);
  for (const std::string mode : {"optimizer_grads", "optimizer_grads_params"}) {
    SCOPED_TRACE(mode);
    const fs::path sharded = root_ / (mode + "_two");
    const Exit b =
        mpirun(2, with({"checkpoint.dir=" + sharded.string(), "parallel.sharding=" + mode}));
    ASSERT_EQ(b.code, 0) << b.output;
    const std::vector<double> lb = losses(sharded);
    ASSERT_EQ(lb.size(), la.size()) << b.output;
    EXPECT_EQ(la[0], lb[0]);  // the first step's loss comes before any update
    for (size_t i = 1; i < la.size(); ++i) EXPECT_NEAR(la[i], lb[i], 1e-5 * std::abs(la[i]));
  }
  expect_same_three_steps(root_ / "optimizer_grads_two", root_ / "optimizer_grads_params_two", "",
                          /*with_optimizer=*/true);
}

// An untied embedding and lm_head take turns in one gradient slot (training/sharded_gradients.h):
// the lm_head's sum runs during the backward and the embedding's after it, so a rank holds one
// vocabulary-sized gradient instead of two, with the unsharded run's bits (one micro-batch per
// rank) and gradient sharding's with weight sharding (two), on 2 ranks.
TEST_F(AppParallelTrainTest, UntiedEmbeddingAndLmHeadShareOneGradientSlotBitForBit) {
  const std::string recipe = write_recipe();
  const std::string untied = write_untied_config();
  // Two ranks only (CI's time): the tied model's test covers four, and the slot is per rank.
  for (const int np : {2}) {
    SCOPED_TRACE("mpirun -np " + std::to_string(np));
    for (const int per_rank : {1, 2}) {
      SCOPED_TRACE(std::to_string(per_rank) + " micro-batches per rank");
      const std::string tag = std::to_string(np) + "_" + std::to_string(per_rank);
      auto run = [&](const std::string& name, const std::string& sharding) {
        const fs::path dir = root_ / (name + "_" + tag);
        const Exit e =
            mpirun(np, {"train", "--recipe", recipe, "model.config=" + untied,
                        "parallel.data_parallel_size=" + std::to_string(np),
                        "train.global_batch_size=" + std::to_string(np * per_rank),
                        "optimizer.weight_decay=0.1", "optimizer.clip_grad=1.0",
                        "parallel.grad_bucket_elements=5003", "checkpoint.dir=" + dir.string(),
                        "parallel.sharding=" + sharding});
        EXPECT_EQ(e.code, 0) << e.output;
        return std::pair{dir, e.output};
      };
      const auto [grads_dir, grads_log] = run("grads", "optimizer_grads");
      const auto [params_dir, params_log] = run("params", "optimizer_grads_params");
      expect_same_three_steps(grads_dir, params_dir, params_log, /*with_optimizer=*/true);
      if (per_rank != 1) continue;
      const auto [plain_dir, plain_log] = run("plain", "optimizer");
      expect_same_three_steps(plain_dir, grads_dir, grads_log, /*with_optimizer=*/true);
    }
  }
}

// Weight sharding with per-layer decoder graphs and vision graphs (through the recording stand-in
// on the CPU): each layer's graphs are captured against its slot and replayed while the layers
// take turns in it, with eager's losses and checkpoints bit for bit (Megatron-LM PR #4232's test:
// the loss difference is zero).
TEST_F(AppParallelTrainTest, WeightShardingWithLayerGraphsGivesEagerBitForBit) {
  const std::string recipe = write_recipe();
  const std::vector<std::string> common{"train",
                                        "--recipe",
                                        recipe,
                                        "parallel.data_parallel_size=2",
                                        "train.global_batch_size=2",
                                        "parallel.sharding=optimizer_grads_params"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const fs::path eager = root_ / "eager", graphs = root_ / "graphs";
  const std::vector<std::string> graph_configs{"cuda_graph.cuda_graph_impl=local",
                                               "cuda_graph.vision_cuda_graph_impl=local"};
  // The eager reference pads its micro-batches to the graphs' buckets too (it never reaches its
  // capture step): padding changes a GEMM's row count, which changes the other rows' last bits on
  // some CPUs' OpenBLAS kernels (AVX-512 ones among them), and replay must give eager's bits
  // whatever the BLAS.
  std::vector<std::string> eager_args = graph_configs, graph_args = graph_configs;
  eager_args.push_back("cuda_graph.cuda_graph_warmup_steps=100000");
  eager_args.push_back("checkpoint.dir=" + eager.string());
  graph_args.push_back("cuda_graph.cuda_graph_warmup_steps=1");
  graph_args.push_back("checkpoint.dir=" + graphs.string());
  const Exit a = mpirun(2, with(eager_args));
  ASSERT_EQ(a.code, 0) << a.output;
  EXPECT_NE(a.output.find("graphs: 0 captured"), std::string::npos) << a.output;
  const Exit b = mpirun(2, with(graph_args));
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_NE(b.output.find("graphs: decoder local, vision local"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find(" captured in "), std::string::npos) << b.output;
  expect_same_three_steps(eager, graphs, b.output, /*with_optimizer=*/true);
}

// Frozen parts hold no optimizer state (training/param_spec.h): the sharded optimizer shards the
// trainable tensors only and writes the frozen ones' weights through from the weights the model
// reads; the run is still the unsharded one bit for bit, and both checkpoints keep every weight.
TEST_F(AppParallelTrainTest, FrozenPartsShardNothingAndGiveTheUnshardedRunBitForBit) {
  const std::string recipe = write_recipe();
  const std::vector<std::string> common{"train",
                                        "--recipe",
                                        recipe,
                                        "parallel.data_parallel_size=2",
                                        "optimizer.weight_decay=0.1",
                                        "train.freeze_vision_tower=true",
                                        "train.freeze_merger=true"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const fs::path plain = root_ / "plain", sharded = root_ / "sharded";
  const Exit a = mpirun(2, with({"checkpoint.dir=" + plain.string()}));
  ASSERT_EQ(a.code, 0) << a.output;
  const Exit b =
      mpirun(2, with({"checkpoint.dir=" + sharded.string(), "optimizer.distributed=true"}));
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_EQ(losses(plain), losses(sharded));
  for (const char* file : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_TRUE(read_text_file((plain / "step_0000003" / file).string()) ==
                read_text_file((sharded / "step_0000003" / file).string()))
        << file;
  // The frozen parts' weights are saved unchanged, and their moments are not saved at all.
  SafetensorsFile weights((plain / "step_0000003" / "model.safetensors").string());
  EXPECT_TRUE(weights.contains("model.visual.patch_embed.proj.weight"));
  SafetensorsFile moments((plain / "step_0000003" / "optimizer.safetensors").string());
  EXPECT_FALSE(moments.contains("exp_avg.model.visual.patch_embed.proj.weight"));
  EXPECT_TRUE(moments.contains("exp_avg.model.language_model.embed_tokens.weight"));
  EXPECT_NE(a.output.find("f32 master weights "), std::string::npos) << a.output;
}

// LoRA with adapter dropout: each micro-batch's masks follow its place in the global batch, so two
// ranks, sharded or not, give the losses and adapters of one process with two replicas bit for bit.
TEST_F(AppParallelTrainTest, LoraWithDropoutGivesOneProcessBitForBit) {
  const std::string recipe = write_recipe();
  const std::vector<std::string> lora{"peft.type=lora", "peft.rank=4", "peft.alpha=8",
                                      "peft.dropout=0.3",
                                      "peft.target_modules=[q_proj,v_proj,down_proj,attn.qkv]"};
  auto with = [&](std::vector<std::string> args) {
    args.insert(args.end(), lora.begin(), lora.end());
    return args;
  };
  const fs::path single = root_ / "single", dp = root_ / "dp", sharded = root_ / "sharded";
  const Exit a =
      iris(with({"train", "--recipe", recipe, "checkpoint.dir=" + single.string()}), "2");
  ASSERT_EQ(a.code, 0) << a.output;
  const Exit b = mpirun(2, with({"train", "--recipe", recipe, "checkpoint.dir=" + dp.string(),
                                 "parallel.data_parallel_size=2"}));
  ASSERT_EQ(b.code, 0) << b.output;
  expect_same_three_steps(single, dp, b.output);
  const Exit c = mpirun(2, with({"train", "--recipe", recipe, "checkpoint.dir=" + sharded.string(),
                                 "parallel.data_parallel_size=2", "optimizer.distributed=true"}));
  ASSERT_EQ(c.code, 0) << c.output;
  expect_same_three_steps(single, sharded, c.output);
}

// A checkpoint does not depend on the data-parallel size or the sharding: a run stopped at step 2
// continues under another layout to the losses, weights and moments of a run never stopped. One
// process with 2 threads has the reduction structure of 2 ranks of one thread each.
TEST_F(AppParallelTrainTest, ResumesUnderAnotherDataParallelSizeBitForBit) {
  const std::string recipe = write_recipe();
  // The schedule spans 4 steps whichever step a leg ends at.
  const std::vector<std::string> schedule{"schedule.decay_iters=4", "checkpoint.save_interval=2"};
  struct Leg {
    int ranks;  // 1: one process of 2 threads
    bool sharded;
  };
  auto train = [&](const fs::path& dir, const Leg& leg, int iters) {
    std::vector<std::string> args{"train", "--recipe", recipe, "checkpoint.dir=" + dir.string(),
                                  "train.train_iters=" + std::to_string(iters)};
    args.insert(args.end(), schedule.begin(), schedule.end());
    if (leg.ranks == 1) return iris(args, "2");
    args.push_back("parallel.data_parallel_size=" + std::to_string(leg.ranks));
    if (leg.sharded) args.push_back("optimizer.distributed=true");
    return mpirun(leg.ranks, args);
  };
  const fs::path whole = root_ / "whole";
  const Exit u = train(whole, {1, false}, 4);
  ASSERT_EQ(u.code, 0) << u.output;
  const std::vector<double> want = losses(whole);
  ASSERT_EQ(want.size(), 4u);
  const struct {
    const char* name;
    Leg first, second;
  } cases[] = {{"dp2_to_dp1", {2, false}, {1, false}},
               {"dp1_to_dp2_sharded", {1, false}, {2, true}},
               {"dp2_sharded_to_dp1", {2, true}, {1, false}}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path dir = root_ / c.name;
    const Exit first = train(dir, c.first, 2);
    ASSERT_EQ(first.code, 0) << first.output;
    const Exit second = train(dir, c.second, 4);
    ASSERT_EQ(second.code, 0) << second.output;
    expect_resumed_as_whole(whole, dir, second.output);
  }
}

// Checkpoints of a run sharded by layer are the ordinary ones: a run resumes into and out of
// parallel.sharding=optimizer_grads and optimizer_grads_params (one micro-batch per rank), and
// from one into the other, with the uninterrupted run's bits.
TEST_F(AppParallelTrainTest, ResumesIntoAndOutOfShardingByLayerBitForBit) {
  const std::string recipe = write_recipe();
  const std::vector<std::string> fixed{"schedule.decay_iters=4", "checkpoint.save_interval=2",
                                       "train.global_batch_size=2"};
  auto train = [&](const fs::path& dir, const std::string& mode, int iters) {
    std::vector<std::string> args{"train", "--recipe", recipe, "checkpoint.dir=" + dir.string(),
                                  "train.train_iters=" + std::to_string(iters)};
    args.insert(args.end(), fixed.begin(), fixed.end());
    if (mode.empty()) return iris(args, "2");
    args.push_back("parallel.data_parallel_size=2");
    args.push_back("parallel.sharding=" + mode);
    return mpirun(2, args);
  };
  const fs::path whole = root_ / "whole";
  const Exit u = train(whole, "", 4);
  ASSERT_EQ(u.code, 0) << u.output;
  const std::vector<double> want = losses(whole);
  ASSERT_EQ(want.size(), 4u);
  // Into and out of each mode, and from one mode into the other.
  const std::vector<std::pair<std::string, std::string>> legs{
      {"optimizer_grads", ""},
      {"", "optimizer_grads"},
      {"optimizer_grads_params", ""},
      {"", "optimizer_grads_params"},
      {"optimizer_grads", "optimizer_grads_params"}};
  for (const auto& [first_mode, second_mode] : legs) {
    auto name = [](const std::string& m) { return m.empty() ? std::string("one") : m; };
    SCOPED_TRACE(name(first_mode) + " -> " + name(second_mode));
    const fs::path dir = root_ / (name(first_mode) + "_to_" + name(second_mode));
    const Exit first = train(dir, first_mode, 2);
    ASSERT_EQ(first.code, 0) << first.output;
    const Exit second = train(dir, second_mode, 4);
    ASSERT_EQ(second.code, 0) << second.output;
    expect_resumed_as_whole(whole, dir, second.output);
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
  // With stages the size to set is processes / stages, not the process count.
  const Exit staged =
      mpirun(2, {"train", "--recipe", recipe, "parallel.pipeline_parallel_size=2",
                 "parallel.data_parallel_size=2", "checkpoint.dir=" + (root_ / "c").string()});
  EXPECT_NE(staged.code, 0) << staged.output;
  EXPECT_NE(staged.output.find("set parallel.data_parallel_size=1 "), std::string::npos)
      << staged.output;
}

// Ranks reading different data (started in other folders, relative paths naming other files)
// are refused before training: only rank 0's fingerprints would reach the checkpoints.
TEST_F(AppParallelTrainTest, RanksReadingDifferentDataAreRefused) {
  const std::string recipe = write_recipe();
  const fs::path other = root_ / "other.jsonl";
  {
    std::string lines = read_text_file((root_ / "shapes" / "train.jsonl").string());
    lines.resize(lines.find('\n', lines.size() / 2) + 1);  // a shorter file of the same lines
    write_file_atomic(other.string(), lines);
  }
  const std::string script =
      std::string("if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then f=") + other.string() +
      "; else f=" + (root_ / "shapes" / "train.jsonl").string() + "; fi; exec " + IRIS_BINARY +
      " train --recipe " + recipe + " parallel.data_parallel_size=2 data.train_files=[$f]" +
      " checkpoint.dir=" + (root_ / "diff").string();
  std::vector<std::string> args{IRIS_MPIEXEC, "-np", "2"};
  if (!std::string(IRIS_MPIEXEC_FLAGS).empty()) args.push_back(IRIS_MPIEXEC_FLAGS);
  args.insert(args.end(), {"sh", "-c", script});
  const Exit e = run(
      args, {"OMP_NUM_THREADS=1", "OMPI_ALLOW_RUN_AS_ROOT=1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"});
  EXPECT_NE(e.code, 0) << e.output;
  EXPECT_NE(e.output.find("rank 1 of 2 has other data files"), std::string::npos) << e.output;
  EXPECT_FALSE(fs::exists(root_ / "diff" / "step_0000003")) << e.output;
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
