// Checkpoints: the commit protocol (temporary directory, rename, `latest`), pruning, debris, the
// trainer state, resumption bit-identical to an uninterrupted run, and export to an HF directory
// that generates the same greedy tokens as the checkpoint it came from.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <omp.h>
#include <string>
#include <vector>

#include "bridge/qwen3vl_model.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/safetensors.h"
#include "language/tokenizer.h"
#include "test_util.h"
#include "training/chat_format.h"
#include "training/checkpoint.h"
#include "training/recipe.h"
#include "training/shapes_data.h"
#include "training/trainer.h"
#include "vision/image.h"
#include "vision/preprocess.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("iris_ckpt_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string run_dir(const std::string& name) const { return (root_ / name).string(); }

  // A checkpoint body with the marker file latest_checkpoint() looks for.
  static void fill_minimal(const std::string& dir, int64_t step) {
    TrainerState s;
    s.iteration = step;
    save_trainer_state((fs::path(dir) / "trainer_state.json").string(), s);
    write_file_atomic((fs::path(dir) / "payload.txt").string(), std::to_string(step));
  }

  fs::path root_;
};

TEST_F(CheckpointTest, NamesAreZeroPadded) {
  EXPECT_EQ(checkpoint_name(0), "step_0000000");
  EXPECT_EQ(checkpoint_name(100), "step_0000100");
  EXPECT_EQ(checkpoint_name(12345678), "step_12345678");
  EXPECT_THROW(checkpoint_name(-1), Error);
}

TEST_F(CheckpointTest, CommitNamesLatestAndKeepsTheNewest) {
  const std::string run = run_dir("run");
  EXPECT_EQ(latest_checkpoint(run), "");
  for (int64_t step = 1; step <= 5; ++step) {
    const std::string dir =
        commit_checkpoint(run, step, 2, [&](const std::string& d) { fill_minimal(d, step); });
    EXPECT_EQ(dir, (fs::path(run) / checkpoint_name(step)).string());
    EXPECT_EQ(latest_checkpoint(run), dir);
    EXPECT_EQ(read_text_file((fs::path(dir) / "payload.txt").string()), std::to_string(step));
  }
  EXPECT_EQ(list_checkpoints(run), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(read_text_file(run + "/latest"), "step_0000005\n");
  // keep_last 0 keeps everything.
  const std::string all = run_dir("all");
  for (int64_t step = 1; step <= 3; ++step)
    commit_checkpoint(all, step, 0, [&](const std::string& d) { fill_minimal(d, step); });
  EXPECT_EQ(list_checkpoints(all), (std::vector<int64_t>{1, 2, 3}));
}

TEST_F(CheckpointTest, AWriterThatDiesLeavesATemporaryThatIsNeverTaken) {
  const std::string run = run_dir("run");
  commit_checkpoint(run, 1, 3, [&](const std::string& d) { fill_minimal(d, 1); });
  // The writer of step 2 fails half-way (as a kill would stop it).
  EXPECT_THROW(commit_checkpoint(run, 2, 3,
                                 [&](const std::string& d) {
                                   write_file_atomic(d + "/payload.txt", "half");
                                   IRIS_FAIL("disk full");
                                 }),
               Error);
  EXPECT_TRUE(fs::is_directory(run + "/step_0000002.tmp"));
  EXPECT_EQ(latest_checkpoint(run), run + "/step_0000001");
  EXPECT_EQ(list_checkpoints(run), (std::vector<int64_t>{1}));
  // A leftover temporary `latest` is debris too.
  write_file_atomic(run + "/latest.tmp.12345", "step_0000002\n");
  remove_checkpoint_debris(run);
  EXPECT_FALSE(fs::exists(run + "/step_0000002.tmp"));
  EXPECT_FALSE(fs::exists(run + "/latest.tmp.12345"));
  EXPECT_EQ(latest_checkpoint(run), run + "/step_0000001");
  commit_checkpoint(run, 2, 3, [&](const std::string& d) { fill_minimal(d, 2); });
  EXPECT_EQ(latest_checkpoint(run), run + "/step_0000002");
}

TEST_F(CheckpointTest, LatestMustNameACompleteCheckpoint) {
  const std::string run = run_dir("run");
  fs::create_directories(run + "/step_0000009");
  write_file_atomic(run + "/latest", "step_0000009\n");
  try {
    latest_checkpoint(run);
    FAIL() << "an incomplete checkpoint was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing or incomplete"), std::string::npos) << e.what();
  }
  write_file_atomic(run + "/latest", "garbage\n");
  EXPECT_THROW(latest_checkpoint(run), Error);
}

TEST_F(CheckpointTest, CheckpointsPastTheOneCommittedAreDropped) {
  const std::string run = run_dir("run");
  commit_checkpoint(run, 2, 5, [&](const std::string& d) { fill_minimal(d, 2); });
  // A run died after renaming step 4 into place but before `latest` named it; the restarted run
  // resumes from step 2 and diverges.
  fs::create_directories(run + "/step_0000004");
  fill_minimal(run + "/step_0000004", 4);
  commit_checkpoint(run, 3, 5, [&](const std::string& d) { fill_minimal(d, 3); });
  EXPECT_EQ(list_checkpoints(run), (std::vector<int64_t>{2, 3}));
  // The same step again replaces a directory `latest` never named.
  fs::create_directories(run + "/step_0000004");
  fill_minimal(run + "/step_0000004", 99);
  commit_checkpoint(run, 4, 5, [&](const std::string& d) { fill_minimal(d, 4); });
  EXPECT_EQ(read_text_file(run + "/step_0000004/payload.txt"), "4");
}

TEST_F(CheckpointTest, ExportWritesOnlyWhereItIsPointed) {
  // A checkpoint with the fixture's files.
  const fs::path ckpt = root_ / "step_0000001";
  fs::create_directories(ckpt);
  fill_minimal(ckpt.string(), 1);
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"})
    fs::copy_file(fs::path(test::fixture_dir()) / f, ckpt / f);
  // The user's own folder named like the temporary an export once used, and cleared.
  const fs::path out = root_ / "hf";
  fs::create_directories(root_ / "hf.tmp");
  write_file_atomic((root_ / "hf.tmp" / "notes.txt").string(), "mine");
  export_checkpoint(ckpt.string(), out.string());
  EXPECT_TRUE(fs::is_regular_file(out / "model.safetensors"));
  EXPECT_EQ(read_text_file((root_ / "hf.tmp" / "notes.txt").string()), "mine");
  // Nothing else is left beside the target.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"hf", "hf.tmp", "step_0000001"}));
  // An empty target names nothing: once it removed ./.tmp.
  EXPECT_NE(test::error_of([&] { export_checkpoint(ckpt.string(), ""); }).find("empty"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { export_checkpoint(ckpt.string(), "."); }).find("names no new"),
            std::string::npos);
  // A failed export removes its own temporary and nothing else.
  write_file_atomic((ckpt / "config.json").string(), std::string(100, '[') + std::string(100, ']'));
  EXPECT_NE(test::error_of([&] {
              export_checkpoint(ckpt.string(), (root_ / "hf2").string());
            }).find("levels deep"),
            std::string::npos);
  names.clear();
  for (const auto& e : fs::directory_iterator(root_)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"hf", "hf.tmp", "step_0000001"}));
}

TEST_F(CheckpointTest, TrainerStateRoundTrips) {
  TrainerState s;
  s.iteration = 17;
  s.consumed_samples = 34;
  s.consumed_tokens = 1234;
  s.data_position = {2, 5};
  s.data_seed = 99;
  s.threads = 3;
  const std::string path = (root_ / "state.json").string();
  save_trainer_state(path, s);
  const TrainerState b = load_trainer_state(path);
  EXPECT_EQ(b.iteration, 17);
  EXPECT_EQ(b.consumed_samples, 34);
  EXPECT_EQ(b.consumed_tokens, 1234);
  EXPECT_EQ(b.data_position, (DataPosition{2, 5}));
  EXPECT_EQ(b.data_seed, 99u);
  EXPECT_EQ(b.threads, 3);
  write_file_atomic(path, "{\"format\": \"something-else\"}");
  EXPECT_THROW(load_trainer_state(path), Error);
  write_file_atomic(path, "{not json");
  EXPECT_THROW(load_trainer_state(path), Error);
}

TEST_F(CheckpointTest, RandomInitIsSeededAndFollowsHf) {
  const ModelConfig cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  const std::string text = read_text_file(test::fixture_dir() + "/config.json");
  auto cpu = make_cpu_backend();
  auto a = allocate_weights(*cpu, cfg);
  auto b = allocate_weights(*cpu, cfg);
  auto c = allocate_weights(*cpu, cfg);
  init_random_weights(*cpu, *a, text, 5);
  init_random_weights(*cpu, *b, text, 5);
  init_random_weights(*cpu, *c, text, 6);
  auto host = [&](const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    cpu->read(v.data(), DType::f32, t);
    return v;
  };
  EXPECT_EQ(host(a->text.embed), host(b->text.embed));
  EXPECT_NE(host(a->text.embed), host(c->text.embed));
  for (float v : host(a->text.layers[0].input_norm_w)) EXPECT_EQ(v, 1.0f);
  for (float v : host(a->vision.blocks[0].qkv_b)) EXPECT_EQ(v, 0.0f);
  // Standard deviations follow text_config / vision_config initializer_range (0.2 / 0.05).
  auto stddev = [](const std::vector<float>& v) {
    double s = 0, s2 = 0;
    for (float x : v) s += x, s2 += double(x) * x;
    const double m = s / v.size();
    return std::sqrt(s2 / v.size() - m * m);
  };
  EXPECT_NEAR(stddev(host(a->text.embed)), 0.2, 0.002);
  EXPECT_NEAR(stddev(host(a->vision.blocks[0].fc1_w)), 0.05, 0.005);
}

// A few steps of the tiny fixture on a small shapes set: small enough for CI.
class TinyTrainingTest : public CheckpointTest {
 protected:
  void SetUp() override {
    CheckpointTest::SetUp();
    write_shapes_dataset((root_ / "shapes").string(), 24, 7, 0.25);
  }

  Recipe recipe(const std::string& run, std::vector<std::string> overrides = {}) const {
    const std::string text =
        "model:\n  init: random\n  init_seed: 3\n  config: " + test::fixture_dir() +
        "/config.json\n  tokenizer: " + test::fixture_dir() + "/tokenizer.json\n" +
        "data:\n  train_files: [" + (root_ / "shapes/train.jsonl").string() + "]\n  eval_files: [" +
        (root_ / "shapes/heldout.jsonl").string() +
        "]\n  min_pixels: 4096\n  max_pixels: 4096\n  num_workers: 0\n"
        "train:\n  micro_batch_size: 1\n  global_batch_size: 2\n  train_iters: 6\n"
        "  seq_length: 64\n  eval_interval: 3\n  eval_iters: 1\n"
        "optimizer:\n  lr: 1.0e-3\n  min_lr: 1.0e-4\n  weight_decay: 0.01\n"
        // decay_iters fixed: a run cut short by a smaller train_iters keeps the full run's
        // schedule.
        "schedule:\n  kind: cosine\n  warmup_iters: 1\n  decay_iters: 6\n"
        "checkpoint:\n  dir: " +
        run + "\n  save_interval: 2\n  keep_last: 2\n" + "logging:\n  log_interval: 1\n";
    return load_recipe_text(text, (root_ / "tiny.yaml").string(), overrides);
  }

  static std::vector<std::pair<int64_t, double>> losses(const std::string& run,
                                                        const char* field = "loss") {
    std::ifstream f(run + "/metrics.jsonl");
    std::vector<std::pair<int64_t, double>> out;
    for (std::string line; std::getline(f, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains(field))
        out.emplace_back(j["iteration"].get<int64_t>(), j[field].get<double>());
    }
    return out;
  }

  TrainerOptions quiet() const {
    TrainerOptions o;
    o.out = null_out_;
    return o;
  }

  void TearDown() override {
    std::fclose(null_out_);
    CheckpointTest::TearDown();
  }

  FILE* null_out_ = std::fopen("/dev/null", "w");
};

TEST_F(TinyTrainingTest, ResumingGivesTheLossesOfAnUninterruptedRun) {
  const std::string straight = run_dir("straight"), split = run_dir("split");
  const TrainResult a = run_training(recipe(straight), quiet());
  EXPECT_EQ(a.final_iteration, 6);
  EXPECT_EQ(a.start_iteration, 0);

  // Half the run, then the same recipe with the full length continues from `latest`.
  const TrainResult h = run_training(recipe(split, {"train.train_iters=3"}), quiet());
  EXPECT_EQ(h.final_iteration, 3);
  EXPECT_EQ(latest_checkpoint(split), split + "/step_0000003");
  const TrainResult b = run_training(recipe(split), quiet());
  EXPECT_EQ(b.start_iteration, 3);
  EXPECT_EQ(b.final_iteration, 6);

  const auto la = losses(straight), lb = losses(split);
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), 6u);
  for (size_t i = 0; i < la.size(); ++i) {
    EXPECT_EQ(la[i].first, lb[i].first);
    EXPECT_EQ(la[i].second, lb[i].second) << "iteration " << la[i].first;  // bit-identical
  }
  EXPECT_LT(la.back().second, la.front().second);
  EXPECT_EQ(losses(straight, "eval_loss"), losses(split, "eval_loss"));
  ASSERT_EQ(losses(straight, "eval_loss").size(), 2u);
  // Same weights and optimizer state, byte for byte.
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "trainer_state.json"})
    EXPECT_EQ(read_text_file(straight + "/step_0000006/" + f),
              read_text_file(split + "/step_0000006/" + f))
        << f;
  EXPECT_EQ(list_checkpoints(straight), (std::vector<int64_t>{4, 6}));

  // The run directory and each checkpoint hold the resolved config, which reloads to itself.
  const std::string resolved = read_text_file(straight + "/resolved_config.yaml");
  EXPECT_EQ(resolved, read_text_file(straight + "/step_0000006/resolved_config.yaml"));
  EXPECT_EQ(recipe_to_yaml(load_recipe_text(resolved, "resolved.yaml")), resolved);
  EXPECT_TRUE(fs::exists(straight + "/training_curves.svg"));

  // A finished run has nothing left to do; a longer one continues.
  const TrainResult again = run_training(recipe(straight), quiet());
  EXPECT_EQ(again.start_iteration, 6);
  EXPECT_EQ(again.final_iteration, 6);
}

TEST_F(TinyTrainingTest, ResumeSettingsAreEnforced) {
  const std::string run = run_dir("run");
  run_training(recipe(run, {"train.train_iters=2"}), quiet());
  try {
    run_training(recipe(run, {"checkpoint.resume=never"}), quiet());
    FAIL() << "resume=never accepted a directory with checkpoints";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint.resume=auto"), std::string::npos);
  }
  try {
    run_training(recipe(run, {"train.seed=5"}), quiet());
    FAIL() << "a different data order was resumed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("train.seed=1234"), std::string::npos) << e.what();
  }
  // An explicit checkpoint path resumes from it, wherever the run directory is.
  const TrainResult r =
      run_training(recipe(run_dir("other"),
                          {"checkpoint.resume=" + run + "/step_0000002", "train.train_iters=3"}),
                   quiet());
  EXPECT_EQ(r.start_iteration, 2);
  EXPECT_EQ(r.final_iteration, 3);
  // Restarting that command continues the new run directory, not the seed checkpoint.
  const TrainResult r2 =
      run_training(recipe(run_dir("other"),
                          {"checkpoint.resume=" + run + "/step_0000002", "train.train_iters=4"}),
                   quiet());
  EXPECT_EQ(r2.start_iteration, 3);
  EXPECT_EQ(r2.final_iteration, 4);
  EXPECT_THROW(run_training(recipe(run_dir("x"), {"checkpoint.resume=" + run}), quiet()), Error);
}

TEST_F(TinyTrainingTest, ResumingWithAnotherThreadCountIsReported) {
  const std::string run = run_dir("run");
  const int threads = omp_get_max_threads();
  omp_set_num_threads(threads + 1);
  run_training(recipe(run, {"train.train_iters=1", "train.eval_interval=0"}), quiet());
  omp_set_num_threads(threads);
  const std::string log_path = (root_ / "log.txt").string();
  TrainerOptions o;
  o.out = std::fopen(log_path.c_str(), "w");
  run_training(recipe(run, {"train.train_iters=2", "train.eval_interval=0"}), o);
  std::fclose(o.out);
  const std::string log = read_text_file(log_path);
  EXPECT_NE(log.find(str_cat("written with ", threads + 1, " threads and this run has ", threads)),
            std::string::npos)
      << log;
}

TEST_F(TinyTrainingTest, SamplesAboveThePlannedPatchesAreSkipped) {
  // Every shapes image is 16 patches: with room for 8, nothing fits.
  try {
    run_training(recipe(run_dir("run"), {"train.max_vision_patches=8"}), quiet());
    FAIL() << "a sample above train.max_vision_patches was trained on";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no sample fits train.max_vision_patches = 8"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(TinyTrainingTest, StartsFromAPretrainedDirectory) {
  const std::string run = run_dir("run");
  const TrainResult r =
      run_training(recipe(run, {"model.init=pretrained", "model.hf_dir=" + test::fixture_dir(),
                                "model.config=", "train.train_iters=1", "train.eval_interval=0"}),
                   quiet());
  EXPECT_EQ(r.final_iteration, 1);
  EXPECT_TRUE(std::isfinite(r.last_loss));
  // The fixture's own generation config travels with the checkpoint.
  EXPECT_EQ(read_text_file(run + "/step_0000001/generation_config.json"),
            read_text_file(test::fixture_dir() + "/generation_config.json"));
}

struct Greedy {
  std::vector<int32_t> tokens;
  std::vector<float> first_logits;  // after the prompt
};

// Greedy decoding of a shapes prompt through Qwen3VLModel loaded from `dir`.
Greedy greedy(const std::string& dir, const std::string& image, int n) {
  auto cpu = make_cpu_backend();
  ModelLimits limits;
  limits.max_context = 256;
  limits.max_step_tokens = 128;
  limits.max_vision_patches = 256;
  Qwen3VLModel model(*cpu, dir, limits);
  const Tokenizer tok = Tokenizer::from_file(dir + "/tokenizer.json");
  const PreprocessorConfig pp = PreprocessorConfig::from_file(dir + "/preprocessor_config.json");
  const PreprocessedImage img = preprocess_image(load_image(image), pp);
  const std::vector<GridTHW> grids{img.grid_thw};
  model.encode_images(img.pixel_values.data<float>(), grids);
  model.prefill(build_generation_prompt(tok, grids, kShapesPrompt, ""));
  Greedy g;
  for (int i = 0; i < n; ++i) {
    const std::vector<float> logits = model.last_logits();
    if (i == 0) g.first_logits = logits;
    const int32_t t =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    g.tokens.push_back(t);
    model.decode(t);
  }
  return g;
}

TEST_F(TinyTrainingTest, ExportIsAnHfDirectoryWithTheSameGreedyTokens) {
  const std::string run = run_dir("run");
  run_training(recipe(run, {"train.train_iters=4", "train.eval_interval=0"}), quiet());
  const std::string ckpt = latest_checkpoint(run);
  const std::string out = run_dir("export");
  export_checkpoint(run, out);  // a run directory exports its latest checkpoint
  for (const char* f :
       {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
        "preprocessor_config.json", "generation_config.json"})
    EXPECT_TRUE(fs::is_regular_file(fs::path(out) / f)) << f;
  EXPECT_FALSE(fs::exists(out + ".tmp"));
  EXPECT_FALSE(fs::exists(fs::path(out) / "optimizer.safetensors"));
  const auto config = nlohmann::json::parse(read_text_file(out + "/config.json"));
  EXPECT_EQ(config["dtype"], "bfloat16");
  EXPECT_EQ(config["architectures"][0], "Qwen3VLForConditionalGeneration");
  const auto gen = nlohmann::json::parse(read_text_file(out + "/generation_config.json"));
  EXPECT_EQ(gen["eos_token_id"], nlohmann::json({151645, 151643}));

  // Every tensor is the checkpoint's, rounded to bf16 once.
  SafetensorsFile f32(ckpt + "/model.safetensors"), bf16(out + "/model.safetensors");
  ASSERT_EQ(f32.entries().size(), bf16.entries().size());
  for (const auto& [name, e] : f32.entries()) {
    ASSERT_TRUE(bf16.contains(name)) << name;
    EXPECT_EQ(e.dtype, DType::f32);
    EXPECT_EQ(bf16.at(name).dtype, DType::bf16);
    const std::vector<float> a = f32.load(name).to_f32(), b = bf16.load(name).to_f32();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      ASSERT_EQ(round_bf16(a[i]), b[i]) << name << "[" << i << "]";
  }

  // An f32 export is the checkpoint's model exactly: same logits, same greedy tokens.
  const std::string image = (root_ / "shapes/images/000000.png").string();
  const Greedy from_ckpt = greedy(ckpt, image, 6);
  const std::string out32 = run_dir("export32");
  export_checkpoint(ckpt, out32, DType::f32);
  const Greedy from_f32 = greedy(out32, image, 6);
  EXPECT_EQ(from_f32.tokens, from_ckpt.tokens);
  EXPECT_EQ(from_f32.first_logits, from_ckpt.first_logits);
  // The bf16 export differs only by the weight rounding: the same first token, logits within the
  // error that rounding leaves (an untrained model's later tokens are near-ties that it may flip).
  const Greedy from_bf16 = greedy(out, image, 6);
  EXPECT_EQ(from_bf16.tokens[0], from_ckpt.tokens[0]);
  float worst = 0, range = 0;
  for (size_t i = 0; i < from_ckpt.first_logits.size(); ++i) {
    worst = std::max(worst, std::fabs(from_bf16.first_logits[i] - from_ckpt.first_logits[i]));
    range = std::max(range, std::fabs(from_ckpt.first_logits[i]));
  }
  EXPECT_GT(worst, 0.0f);  // it was rounded
  EXPECT_LT(worst, 0.02f * range) << "worst " << worst << " of range " << range;

  // The target must not exist: an export never overwrites.
  EXPECT_THROW(export_checkpoint(ckpt, out), Error);
  EXPECT_THROW(export_checkpoint(root_.string(), run_dir("export2")), Error);
}

}  // namespace
}  // namespace iris
