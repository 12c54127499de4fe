// iris train with pipeline stages under mpirun on the CPU backend (MPI point to point): 2 stages,
// split before and after a DeepStack injection layer, and 2 stages x 2 data-parallel replicas
// give the losses (and evaluation losses) of one process with the same global batch; checkpoints
// of a pipelined run resume in one process and the reverse; and a stage that stops responding
// ends every rank with a non-zero status within parallel.timeout_seconds. The sharded optimizer
// (optimizer.distributed) over 2 stages x 2 replicas gives the unsharded grid bit for bit and
// its checkpoints resume in one process and the reverse; so does sharding by layer
// (optimizer_grads, optimizer_grads_params) with one micro-batch per replica.
//
// Why a tolerance and not bit equality: the tiny fixture ties its embeddings, so the embedding's
// gradient has two parts, the lookup's (stage 0) and the lm_head's (the last stage). One process
// adds them into one buffer micro-batch by micro-batch, lm_head part first; the stages each sum
// their own part and then add the two. The same terms in another order change that gradient in
// its last bits, and through the update the later losses by a few f32 ulps. Every other gradient
// is summed in the single process's order (each stage's backwards run in micro-batch order into
// one buffer), the first step's loss is exact, a run with the language model frozen (no tied
// gradient) is exact throughout, and training_graphs_test checks the stages' other gradients bit
// for bit.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cfloat>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/fs.h"
#include "mpirun_test_util.h"
#include "test_util.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

using Exit = test::ProcessExit;

// Relative difference allowed between a pipelined run's loss and one process's (see the top).
constexpr double kLossUlps = 8;

class AppPipelineTrainTest : public test::MpirunTest {
 protected:
  AppPipelineTrainTest() : MpirunTest("iris_app_pipeline_test_") {}

  std::string write_recipe() {
    return MpirunTest::write_recipe("  weight_decay: 0.1\n  clip_grad: 1.0\n");
  }

  static void expect_close_losses(const std::vector<double>& got, const std::vector<double>& want,
                                  const std::string& output, bool first_exact = true) {
    ASSERT_EQ(got.size(), want.size()) << output;
    ASSERT_FALSE(got.empty());
    // Before any update the tied gradient has not yet been used: the first loss is exact.
    if (first_exact) EXPECT_EQ(got[0], want[0]);
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_NEAR(got[i], want[i], kLossUlps * FLT_EPSILON * std::abs(want[i]))
          << "iteration " << i + 1;
  }
};

TEST_F(AppPipelineTrainTest, StagesGiveTheLossesOfOneProcessWhereverTheSplitFalls) {
  const std::string recipe = write_recipe();
  const fs::path single = root_ / "single";
  // Evaluation after the last step: the stages run it forward only.
  const std::vector<std::string> eval{
      "train.eval_interval=3", "train.eval_iters=1",
      "data.eval_files=[" + (root_ / "shapes/heldout.jsonl").string() + "]"};
  std::vector<std::string> args{"train", "--recipe", recipe, "checkpoint.dir=" + single.string()};
  args.insert(args.end(), eval.begin(), eval.end());
  const Exit a = iris(args, "1");
  ASSERT_EQ(a.code, 0) << a.output;
  const std::vector<double> want = losses(single);
  ASSERT_EQ(want.size(), 3u);
  ASSERT_EQ(losses(single, "eval_loss").size(), 1u);
  // The fixture has 3 layers and injects DeepStack features after layers 0 and 1: [1, 2] sends
  // the second feature (and its gradient back) across the boundary; [2, 1] splits after both
  // injections; [] is the FLOP-balanced split. Three stages add a middle stage, which exchanges
  // with both neighbours and keeps two micro-batches in flight.
  const struct {
    int stages;
    const char* layers;
  } cases[] = {{2, "[1, 2]"}, {2, "[2, 1]"}, {2, "[]"}, {3, "[]"}};
  for (size_t k = 0; k < std::size(cases); ++k) {
    const auto& c = cases[k];
    const std::string layers = c.layers;
    SCOPED_TRACE(std::to_string(c.stages) + " stages, " + layers);
    // A folder per case: [1, 2] and [2, 1] in one would resume the first one's finished run.
    const fs::path dir = root_ / ("pp" + std::to_string(c.stages) + "_case" + std::to_string(k));
    std::vector<std::string> pp_args{"train",
                                     "--recipe",
                                     recipe,
                                     "checkpoint.dir=" + dir.string(),
                                     "parallel.pipeline_parallel_size=" + std::to_string(c.stages),
                                     "parallel.pipeline_layers=" + layers};
    pp_args.insert(pp_args.end(), eval.begin(), eval.end());
    const Exit b = mpirun(c.stages, pp_args);
    ASSERT_EQ(b.code, 0) << b.output;
    EXPECT_NE(b.output.find(str_cat("pipeline parallel: ", c.stages,
                                    " processes started by mpirun = ", c.stages,
                                    " stages x 1 data-parallel replicas")),
              std::string::npos)
        << b.output;
    if (layers == "[1, 2]") {
      EXPECT_NE(b.output.find("stage 0: decoder layers 0-0, vision encoder and mergers, "
                              "embedding; ranks 0"),
                std::string::npos)
          << b.output;
      EXPECT_NE(b.output.find("stage 1: decoder layers 1-2, final norm, lm_head and loss; ranks 1"),
                std::string::npos)
          << b.output;
    }
    expect_close_losses(losses(dir), want, b.output);
    // After three updates: within the tolerance too, none of them exact.
    expect_close_losses(losses(dir, "eval_loss"), losses(single, "eval_loss"), b.output, false);
  }
}

// With the language model frozen the tied embedding gets no gradient, and nothing is summed in
// another order: two stages give one process's losses and gradient norms bit for bit (the
// vision tower and mergers still train through the stages' backward).
TEST_F(AppPipelineTrainTest, WithoutATiedGradientTwoStagesAreBitForBit) {
  const std::string recipe = write_recipe();
  const fs::path single = root_ / "single", pp = root_ / "pp";
  const Exit a = iris({"train", "--recipe", recipe, "checkpoint.dir=" + single.string(),
                       "train.freeze_language_model=true"},
                      "1");
  ASSERT_EQ(a.code, 0) << a.output;
  const Exit b = mpirun(2, {"train", "--recipe", recipe, "checkpoint.dir=" + pp.string(),
                            "train.freeze_language_model=true", "parallel.pipeline_parallel_size=2",
                            "parallel.pipeline_layers=[1, 2]"});
  ASSERT_EQ(b.code, 0) << b.output;
  for (const char* key : {"loss", "grad_norm"}) {
    const std::vector<double> want = losses(single, key), got = losses(pp, key);
    ASSERT_EQ(want.size(), 3u) << key;
    EXPECT_EQ(got, want) << key;
  }
}

// 2 stages x 2 replicas against one process of 2 micro-batch threads (the reduction structure of
// 2 data-parallel ranks: training/data_parallel.h).
TEST_F(AppPipelineTrainTest, StagesTimesReplicasGiveTheLossesOfOneProcess) {
  const std::string recipe = write_recipe();
  const fs::path single = root_ / "single", grid = root_ / "grid";
  const Exit a = iris({"train", "--recipe", recipe, "checkpoint.dir=" + single.string()}, "2");
  ASSERT_EQ(a.code, 0) << a.output;
  const Exit b = mpirun(4, {"train", "--recipe", recipe, "checkpoint.dir=" + grid.string(),
                            "parallel.pipeline_parallel_size=2", "parallel.data_parallel_size=2"});
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_NE(b.output.find("2 stages x 2 data-parallel replicas (rank = stage x 2 + replica)"),
            std::string::npos)
      << b.output;
  EXPECT_NE(b.output.find("replica 1 (ranks 1, 3): micro-batches 1"), std::string::npos)
      << b.output;
  expect_close_losses(losses(grid), losses(single), b.output);
}

// The sharded optimizer (optimizer.distributed) over 2 stages x 2 replicas: each stage's replicas
// reduce-scatter the stage's gradients, update half of its moments and gather its weights. The
// gradients are summed in the unsharded grid's order (the tied embedding's over each stage's
// replicas first, then across the stages), so the losses, the weights and the moments equal the
// unsharded grid's bit for bit, as with data parallelism alone: the gradient norm adds the same
// per-tensor sums of squares, save that a tensor split between two shards is the f64 sum of its
// two parts, which could move the f32 norm only at a rounding boundary (AdamW in optimizer.h).
// The embedding's two copies (stages 0 and 1) must stay identical for that, as the last stage's
// lm_head reads its own.
TEST_F(AppPipelineTrainTest, ShardedOptimizerOverStagesTimesReplicasGivesTheUnshardedGrid) {
  const std::string recipe = write_recipe();
  const fs::path plain = root_ / "plain", sharded = root_ / "sharded";
  const std::vector<std::string> grid{"train", "--recipe", recipe,
                                      "parallel.pipeline_parallel_size=2",
                                      "parallel.data_parallel_size=2"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = grid;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const Exit a = mpirun(4, with({"checkpoint.dir=" + plain.string()}));
  ASSERT_EQ(a.code, 0) << a.output;
  const Exit b =
      mpirun(4, with({"checkpoint.dir=" + sharded.string(), "optimizer.distributed=true"}));
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_NE(b.output.find("2 stages x 2 data-parallel replicas (rank = stage x 2 + replica)"),
            std::string::npos)
      << b.output;
  EXPECT_NE(b.output.find("this rank's 1/2 of its stage's (parallel.sharding=optimizer)"),
            std::string::npos)
      << b.output;
  EXPECT_NE(b.output.find("gradient reduce-scatter over each stage's 2 replicas"),
            std::string::npos)
      << b.output;
  for (const char* key : {"loss", "grad_norm"}) {
    const std::vector<double> want = losses(plain, key), got = losses(sharded, key);
    ASSERT_EQ(want.size(), 3u) << key;
    EXPECT_EQ(got, want) << key << "\n" << b.output;
  }
  // Each stage's replica 0 saves the stage's weights and gathered moments, as unsharded: these
  // files are the unsharded grid's, so every split that resumes those resumes these. (A bool,
  // not EXPECT_EQ: gtest's diff of two differing binary files of megabytes exhausts memory.)
  for (const char* file :
       {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "optimizer-00001-of-00002.safetensors", "optimizer-00002-of-00002.safetensors"})
    EXPECT_TRUE(read_text_file((plain / "step_0000003" / file).string()) ==
                read_text_file((sharded / "step_0000003" / file).string()))
        << file << " differs";
}

// Sharding by layer (parallel.sharding=optimizer_grads and optimizer_grads_params) over 2 stages x
// 2 replicas: each stage's replicas sum its layers' gradients into their shards of the stage's
// span as its backwards write them, and with weight sharding gather its layers into two slots.
// With one micro-batch per replica the sums are the unsharded grid's, so the losses, gradient
// norms and checkpoint files equal it bit for bit, tied (the embedding's sum over the replicas
// and across the stages first, as unsharded) and untied (the lm_head's gradient on the last
// stage and the embedding's on the first, each in its stage's vocabulary slot); with two, 1F1B
// interleaves the micro-batches' forwards and backwards and weight sharding gives gradient
// sharding's bits, eager and with per-layer graphs.
TEST_F(AppPipelineTrainTest, ShardingByLayerOverStagesTimesReplicasGivesTheUnshardedGrid) {
  const std::string recipe = write_recipe();
  const std::string untied = write_untied_config();
  const std::vector<std::string> files{
      "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
      "optimizer-00001-of-00002.safetensors", "optimizer-00002-of-00002.safetensors"};
  auto expect_same = [&](const fs::path& want, const fs::path& got, const std::string& log) {
    for (const char* key : {"loss", "grad_norm"}) {
      const std::vector<double> a = losses(want, key), b = losses(got, key);
      ASSERT_EQ(a.size(), 3u) << key;
      EXPECT_EQ(b, a) << key << "\n" << log;
    }
    for (const std::string& file : files)
      EXPECT_TRUE(read_text_file((want / "step_0000003" / file).string()) ==
                  read_text_file((got / "step_0000003" / file).string()))
          << file << " differs";
  };
  for (const bool tied : {true, false}) {
    for (const int per_replica : {1, 2}) {
      if (!tied && per_replica == 2) continue;  // CI's time; the tied grid covers 1F1B
      const std::string tag =
          std::string(tied ? "tied" : "untied") + "_" + std::to_string(per_replica);
      SCOPED_TRACE(tag);
      // Graphs::padded_eager: the graphs' bucket padding without a capture, the reference of
      // replay (padding changes a GEMM's row count, and with it other rows' last bits on some
      // CPUs' OpenBLAS kernels).
      enum class Graphs { none, padded_eager, captured };
      auto run = [&](const std::string& sharding, Graphs graphs = Graphs::none) {
        const char* kind = graphs == Graphs::captured       ? "_graphs_"
                           : graphs == Graphs::padded_eager ? "_padded_"
                                                            : "_";
        const fs::path dir = root_ / (sharding + kind + tag);
        std::vector<std::string> args{
            "train", "--recipe", recipe, "parallel.pipeline_parallel_size=2",
            "parallel.data_parallel_size=2",
            "train.global_batch_size=" + std::to_string(2 * per_replica),
            // Several chunks per layer.
            "parallel.grad_bucket_elements=5003", "checkpoint.dir=" + dir.string(),
            "parallel.sharding=" + sharding};
        if (!tied) args.push_back("model.config=" + untied);
        if (graphs != Graphs::none)
          for (const char* g :
               {"cuda_graph.cuda_graph_impl=local", "cuda_graph.vision_cuda_graph_impl=local",
                graphs == Graphs::captured ? "cuda_graph.cuda_graph_warmup_steps=1"
                                           : "cuda_graph.cuda_graph_warmup_steps=100000"})
            args.push_back(g);
        const Exit e = mpirun(4, args);
        EXPECT_EQ(e.code, 0) << e.output;
        return std::pair{dir, e.output};
      };
      const auto [grads_dir, grads_log] = run("optimizer_grads");
      const auto [params_dir, params_log] = run("optimizer_grads_params");
      EXPECT_NE(grads_log.find("(this rank's shard of the sums"), std::string::npos) << grads_log;
      expect_same(grads_dir, params_dir, params_log);
      if (per_replica != 1) {
        // Per-layer graphs (the recording stand-in), captured against the slots: eager's bits.
        const auto [padded_dir, padded_log] = run("optimizer_grads_params", Graphs::padded_eager);
        EXPECT_NE(padded_log.find("graphs: 0 captured"), std::string::npos) << padded_log;
        const auto [graphs_dir, graphs_log] = run("optimizer_grads_params", Graphs::captured);
        EXPECT_NE(graphs_log.find("graphs: decoder local (layers 0-1)"), std::string::npos)
            << graphs_log;
        const size_t captured = graphs_log.find(" captured in ");
        ASSERT_NE(captured, std::string::npos) << graphs_log;
        EXPECT_EQ(graphs_log.rfind("graphs: 0 captured", captured), std::string::npos)
            << graphs_log;
        expect_same(padded_dir, graphs_dir, graphs_log);
        continue;
      }
      const auto [plain_dir, plain_log] = run("optimizer");
      expect_same(plain_dir, grads_dir, grads_log);
    }
  }
}

// Activation offload on pipeline stages: each stage's micro-batches in flight keep their own host
// arenas and device slots, and the losses and checkpoint files are those of the run that keeps
// its activations, bit for bit (the CPU copies synchronously: the plumbing, not the overlap).
TEST_F(AppPipelineTrainTest, OffloadedActivationsOnStagesGiveTheKeptOnesBitForBit) {
  const std::string recipe = write_recipe();
  for (const auto& setting :
       std::vector<std::pair<std::string, std::string>>{{"full", "all"}, {"none", "[act, x_in]"}}) {
    // Named copies: clang 14 (CI's sanitizer build) lets no lambda capture a structured binding.
    const std::string recompute = setting.first, offload = setting.second;
    SCOPED_TRACE("train.recompute=" + recompute + " train.offload_activations=" + offload);
    auto run = [&](const std::string& o) {
      const fs::path dir = root_ / (recompute + "_" + (o == "none" ? "kept" : "offloaded"));
      const Exit e =
          mpirun(2, {"train", "--recipe", recipe, "checkpoint.dir=" + dir.string(),
                     "parallel.pipeline_parallel_size=2", "parallel.pipeline_layers=[1, 2]",
                     "train.recompute=" + recompute, "train.offload_activations=" + o});
      EXPECT_EQ(e.code, 0) << e.output;
      return std::pair{dir, e.output};
    };
    const auto [kept, kept_log] = run("none");
    const auto [offloaded, offloaded_log] = run(offload);
    EXPECT_NE(offloaded_log.find("offloaded to host"), std::string::npos) << offloaded_log;
    const std::vector<double> want = losses(kept), got = losses(offloaded);
    ASSERT_EQ(want.size(), 3u);
    EXPECT_EQ(got, want);
    for (const char* file :
         {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"})
      EXPECT_TRUE(read_text_file((kept / "step_0000003" / file).string()) ==
                  read_text_file((offloaded / "step_0000003" / file).string()))
          << file << " differs";
  }
}

// A checkpoint written by two stages (each its own shard of the weights and of the optimizer
// state, found by name) resumes in one process, and one process's checkpoint resumes in two
// stages, to the losses of a run never stopped.
TEST_F(AppPipelineTrainTest, CheckpointsResumeUnderAnotherPipelineSplit) {
  const std::string recipe = write_recipe();
  const std::vector<std::string> schedule{"schedule.decay_iters=4", "checkpoint.save_interval=2"};
  auto train = [&](const fs::path& dir, int stages, int iters) {
    std::vector<std::string> args{"train", "--recipe", recipe, "checkpoint.dir=" + dir.string(),
                                  "train.train_iters=" + std::to_string(iters)};
    args.insert(args.end(), schedule.begin(), schedule.end());
    if (stages == 1) return iris(args, "1");
    args.push_back("parallel.pipeline_parallel_size=" + std::to_string(stages));
    return mpirun(stages, args);
  };
  const fs::path whole = root_ / "whole";
  const Exit u = train(whole, 1, 4);
  ASSERT_EQ(u.code, 0) << u.output;
  const std::vector<double> want = losses(whole);
  ASSERT_EQ(want.size(), 4u);
  const struct {
    const char* name;
    int first, second;
  } cases[] = {{"pp2_to_pp1", 2, 1}, {"pp1_to_pp2", 1, 2}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path dir = root_ / c.name;
    const Exit first = train(dir, c.first, 2);
    ASSERT_EQ(first.code, 0) << first.output;
    if (c.first == 2) {
      // Each stage's shard, the index that maps every tensor to one, and the optimizer parts.
      for (const char* f : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                            "model.safetensors.index.json", "optimizer-00001-of-00002.safetensors",
                            "optimizer-00002-of-00002.safetensors"})
        EXPECT_TRUE(fs::is_regular_file(dir / "step_0000002" / f)) << f;
      EXPECT_FALSE(fs::exists(dir / "step_0000002.tmp"));
    }
    const Exit second = train(dir, c.second, 4);
    ASSERT_EQ(second.code, 0) << second.output;
    EXPECT_NE(second.output.find("resuming from"), std::string::npos) << second.output;
    expect_close_losses(losses(dir), want, second.output);
  }
  // A pipelined checkpoint exports as one Hugging Face model.
  const fs::path out = root_ / "export";
  const Exit ex =
      iris({"export", (root_ / "pp2_to_pp1" / "step_0000002").string(), out.string()}, "1");
  ASSERT_EQ(ex.code, 0) << ex.output;
  EXPECT_TRUE(fs::is_regular_file(out / "model.safetensors"));
}

// The sharded grid's checkpoint (each stage's moments gathered to its replica 0) resumes in one
// process, and one process's resumes in the sharded grid, each stage's replicas taking their
// shard of it. One process of 2 threads has the grid's reduction structure over the replicas.
TEST_F(AppPipelineTrainTest, ShardedGridCheckpointsResumeInOneProcessAndTheReverse) {
  const std::string recipe = write_recipe();
  const std::vector<std::string> schedule{"schedule.decay_iters=4", "checkpoint.save_interval=2"};
  auto train = [&](const fs::path& dir, bool grid, int iters) {
    std::vector<std::string> args{"train", "--recipe", recipe, "checkpoint.dir=" + dir.string(),
                                  "train.train_iters=" + std::to_string(iters)};
    args.insert(args.end(), schedule.begin(), schedule.end());
    if (!grid) return iris(args, "2");
    args.insert(args.end(), {"parallel.pipeline_parallel_size=2", "parallel.data_parallel_size=2",
                             "optimizer.distributed=true"});
    return mpirun(4, args);
  };
  const fs::path whole = root_ / "whole";
  const Exit u = train(whole, false, 4);
  ASSERT_EQ(u.code, 0) << u.output;
  const std::vector<double> want = losses(whole);
  ASSERT_EQ(want.size(), 4u);
  const struct {
    const char* name;
    bool first_grid;
  } cases[] = {{"grid_to_one", true}, {"one_to_grid", false}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path dir = root_ / c.name;
    const Exit first = train(dir, c.first_grid, 2);
    ASSERT_EQ(first.code, 0) << first.output;
    if (c.first_grid)
      for (const char* f :
           {"optimizer-00001-of-00002.safetensors", "optimizer-00002-of-00002.safetensors"})
        EXPECT_TRUE(fs::is_regular_file(dir / "step_0000002" / f)) << f;
    const Exit second = train(dir, !c.first_grid, 4);
    ASSERT_EQ(second.code, 0) << second.output;
    EXPECT_NE(second.output.find("resuming from"), std::string::npos) << second.output;
    expect_close_losses(losses(dir), want, second.output);
  }
}

// Rank 1 (the last stage) is stopped (SIGSTOP) a second into a long run: rank 0 waits for it
// in a pipeline or gradient-norm exchange, gives up after parallel.timeout_seconds and aborts the
// job, which ends the stopped rank too.
TEST_F(AppPipelineTrainTest, AStageThatStopsRespondingEndsEveryRank) {
  const std::string recipe = write_recipe();
  // $$ is the shell, which exec turns into iris: the background job stops iris itself, once rank 0
  // has written the resolved config (after MPI is up and the groups are made, so that what rank 0
  // waits in is one of the run's bounded exchanges, not MPI's start-up).
  const std::string run_dir = (root_ / "run").string();
  const std::string script =
      "if [ \"$OMPI_COMM_WORLD_RANK\" = 1 ]; then (i=0; while [ ! -e " + run_dir +
      "/resolved_config.yaml ] && [ $i -lt 300 ]; do sleep 0.2; i=$((i+1)); done; sleep 1; "
      "kill -STOP $$) & fi; exec " +
      IRIS_BINARY + " train --recipe " + recipe + " checkpoint.dir=" + run_dir +
      " parallel.pipeline_parallel_size=2 parallel.timeout_seconds=5 train.train_iters=100000 "
      "logging.log_interval=100000 checkpoint.save_final=false";
  std::vector<std::string> args = mpirun_prefix(2);
  args.insert(args.end(), {"sh", "-c", script});
  const Exit e = run(args, mpi_env());
  EXPECT_NE(e.code, 0) << e.output;
  // Rank 0 waits for the stopped rank; on a loaded machine rank 1 may already have waited out
  // the timeout for rank 0 before it was stopped, which ends the job the same way.
  EXPECT_TRUE(e.output.find("rank 0 waited more than 5 s") != std::string::npos ||
              e.output.find("rank 1 waited more than 5 s") != std::string::npos)
      << e.output;
  EXPECT_LT(e.seconds, 60) << e.output;
}

}  // namespace
}  // namespace iris
