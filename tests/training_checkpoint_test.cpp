// Checkpoints: the commit protocol (temporary directory, rename, `latest`), pruning, debris, the
// trainer state, resumption bit-identical to an uninterrupted run, and export to an HF directory
// that generates the same greedy tokens as the checkpoint it came from.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include <omp.h>
#include <string>
#include <vector>

#include "bridge/hf_weights.h"
#include "bridge/qwen3vl_model.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/safetensors.h"
#include "core/splitmix.h"
#include "language/tokenizer.h"
#include "process_util.h"
#include "test_util.h"
#include "training/chat_format.h"
#include "training/checkpoint.h"
#include "training/lr_schedule.h"
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

  // A checkpoint body: a payload, then the state listing it (as the trainer writes them).
  static void fill_minimal(const std::string& dir, int64_t step) {
    write_file_atomic((fs::path(dir) / "payload.txt").string(), std::to_string(step));
    TrainerState s;
    s.iteration = step;
    s.files = list_checkpoint_files(dir);
    save_trainer_state((fs::path(dir) / "trainer_state.json").string(), s);
  }
  // Commits `step` and prunes `owned` to keep_last, as the trainer does after each save.
  static std::string commit_and_prune(const std::string& run, int64_t step, int64_t keep_last,
                                      std::vector<int64_t>& owned) {
    const std::string dir =
        commit_checkpoint(run, step, [&](const std::string& d) { fill_minimal(d, step); });
    owned.push_back(step);
    prune_checkpoints(run, owned, keep_last);
    return dir;
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
  std::vector<int64_t> owned;
  for (int64_t step = 1; step <= 5; ++step) {
    const std::string dir = commit_and_prune(run, step, 2, owned);
    EXPECT_EQ(dir, (fs::path(run) / checkpoint_name(step)).string());
    EXPECT_EQ(latest_checkpoint(run), dir);
    EXPECT_EQ(read_text_file((fs::path(dir) / "payload.txt").string()), std::to_string(step));
  }
  EXPECT_EQ(list_checkpoints(run), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(owned, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(read_text_file(run + "/latest"), "step_0000005\n");
  // keep_last 0 keeps everything.
  const std::string all = run_dir("all");
  std::vector<int64_t> all_owned;
  for (int64_t step = 1; step <= 3; ++step) commit_and_prune(all, step, 0, all_owned);
  EXPECT_EQ(list_checkpoints(all), (std::vector<int64_t>{1, 2, 3}));
}

TEST_F(CheckpointTest, AWriterThatDiesLeavesATemporaryThatIsNeverTaken) {
  const std::string run = run_dir("run");
  commit_checkpoint(run, 1, [&](const std::string& d) { fill_minimal(d, 1); });
  // The writer of step 2 fails half-way (as a kill would stop it).
  EXPECT_THROW(commit_checkpoint(run, 2,
                                 [&](const std::string& d) {
                                   write_file_atomic(d + "/payload.txt", "half");
                                   IRIS_FAIL("disk full");
                                 }),
               Error);
  EXPECT_TRUE(fs::is_directory(run + "/step_0000002.tmp"));
  EXPECT_EQ(latest_checkpoint(run), run + "/step_0000001");
  EXPECT_EQ(list_checkpoints(run), (std::vector<int64_t>{1}));
  // A leftover temporary `latest`, or of another file the run keeps, is debris too; the user's
  // own files are not.
  write_file_atomic(run + "/latest.tmp.12345", "step_0000002\n");
  write_file_atomic(run + "/resolved_config.yaml.tmp.a1B2c3", "half");
  write_file_atomic(run + "/notes.txt.tmp.a1B2c3", "mine");
  remove_checkpoint_debris(run);
  EXPECT_FALSE(fs::exists(run + "/step_0000002.tmp"));
  EXPECT_FALSE(fs::exists(run + "/latest.tmp.12345"));
  EXPECT_FALSE(fs::exists(run + "/resolved_config.yaml.tmp.a1B2c3"));
  EXPECT_EQ(read_text_file(run + "/notes.txt.tmp.a1B2c3"), "mine");
  EXPECT_EQ(latest_checkpoint(run), run + "/step_0000001");
  commit_checkpoint(run, 2, [&](const std::string& d) { fill_minimal(d, 2); });
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

TEST_F(CheckpointTest, OnlyCheckpointsOfThisRunAreDeletedAndNoneIsReplaced) {
  const std::string run = run_dir("run");
  // A step written by someone else (another run, or one a resume was pointed away from).
  fs::create_directories(run + "/step_0000007");
  fill_minimal(run + "/step_0000007", 7);
  std::vector<int64_t> owned;
  for (int64_t step = 1; step <= 3; ++step) commit_and_prune(run, step, 2, owned);
  EXPECT_EQ(list_checkpoints(run), (std::vector<int64_t>{2, 3, 7}));
  EXPECT_EQ(read_text_file(run + "/step_0000007/payload.txt"), "7");
  // Reaching that step is an error, and the directory keeps what it held.
  const std::string err = test::error_of(
      [&] { commit_checkpoint(run, 7, [&](const std::string& d) { fill_minimal(d, 70); }); });
  EXPECT_NE(err.find("already holds step_0000007, which this run did not write"), std::string::npos)
      << err;
  EXPECT_EQ(read_text_file(run + "/step_0000007/payload.txt"), "7");
  EXPECT_EQ(latest_checkpoint(run), run + "/step_0000003");
  // Pruning leaves nothing behind, not even its renamed temporaries.
  for (const auto& e : fs::directory_iterator(run))
    EXPECT_NE(e.path().extension(), ".tmp") << e.path();
}

TEST_F(CheckpointTest, StepNamesAreParsedSafely) {
  int64_t step = -1;
  EXPECT_TRUE(parse_checkpoint_name("step_0000005", step));
  EXPECT_EQ(step, 5);
  EXPECT_TRUE(parse_checkpoint_name("step_12345678", step));
  EXPECT_EQ(step, 12345678);
  for (const char* bad :
       {"step_99999999999999999999", "step_00000005", "step_000005", "step_-000005",
        "step_0000005.tmp", "step_+000005", "xstep_0000005", "step_000000a"})
    EXPECT_FALSE(parse_checkpoint_name(bad, step)) << bad;
  // A stray folder named like a huge step is ignored by listing, committing, pruning and debris
  // removal, and left alone.
  const std::string run = run_dir("run");
  fs::create_directories(run + "/step_99999999999999999999");
  fs::create_directories(run + "/step_99999999999999999999.tmp");
  std::vector<int64_t> owned;
  for (int64_t s = 1; s <= 3; ++s) commit_and_prune(run, s, 1, owned);
  remove_checkpoint_debris(run);
  EXPECT_EQ(list_checkpoints(run), (std::vector<int64_t>{3}));
  EXPECT_EQ(find_resume_point(run).step, 3);
  EXPECT_TRUE(fs::is_directory(run + "/step_99999999999999999999"));
  EXPECT_TRUE(fs::is_directory(run + "/step_99999999999999999999.tmp"));
}

TEST_F(CheckpointTest, ResumeTakesTheNewestCompleteCheckpoint) {
  const std::string run = run_dir("run");
  EXPECT_EQ(find_resume_point(run).step, -1);
  std::vector<int64_t> owned;
  for (int64_t s = 1; s <= 3; ++s) commit_and_prune(run, s, 0, owned);
  auto expect = [&](int64_t step, const std::string& warning) {
    const ResumePoint rp = find_resume_point(run);
    EXPECT_EQ(rp.step, step);
    EXPECT_EQ(rp.dir, run + "/" + checkpoint_name(step));
    std::string all;
    for (const std::string& w : rp.warnings) all += w + "\n";
    if (warning.empty())
      EXPECT_EQ(all, "");
    else
      EXPECT_NE(all.find(warning), std::string::npos) << all;
  };
  expect(3, "");
  fs::remove(run + "/latest");
  expect(3, "latest does not exist; resuming from the newest complete checkpoint");
  write_file_atomic(run + "/latest", std::string(5000, 'x'));
  expect(3, "cannot be read");
  write_file_atomic(run + "/latest", "garbage\n");
  expect(3, "holds 'garbage', not a checkpoint name");
  write_file_atomic(run + "/latest", "step_0000009\n");
  expect(3, "names step_0000009, which does not exist");
  // Pointed back at an older one by hand: the newer ones win, and the warning says how to go back.
  write_file_atomic(run + "/latest", "step_0000001\n");
  expect(3, "move the newer step folders out of checkpoint.dir");
  write_file_atomic(run + "/latest", "step_0000003\n");
  // A file of step 3 shorter than recorded, then a state that does not parse: step 2 is taken.
  write_file_atomic(run + "/step_0000003/payload.txt", "");
  expect(2, "payload.txt is 0 bytes, not the 1 written");
  std::string why;
  EXPECT_FALSE(checkpoint_complete(run + "/step_0000003", &why));
  fs::remove(run + "/step_0000003/payload.txt");
  EXPECT_FALSE(checkpoint_complete(run + "/step_0000003", &why));
  EXPECT_EQ(why, "it lacks payload.txt");
  write_file_atomic(run + "/step_0000002/trainer_state.json", "{\"format\": ");
  expect(1, "step_0000002 is not a complete checkpoint");
  EXPECT_TRUE(fs::is_directory(run + "/step_0000002"));  // skipped, not removed
}

TEST_F(CheckpointTest, ARunFolderHasOneUser) {
  const std::string run = run_dir("run");
  fs::create_directories(run);
  {
    const RunLock first(run);
    EXPECT_EQ(read_text_file(run + "/iris.lock"), std::to_string(::getpid()) + "\n");
    const std::string err = test::error_of([&] { RunLock second(run); });
    EXPECT_NE(
        err.find("checkpoint.dir " + run + " is in use by process " + std::to_string(::getpid())),
        std::string::npos)
        << err;
  }
  // Released with its holder; the stale pid is not left to mislead.
  EXPECT_EQ(read_text_file(run + "/iris.lock"), "");
  EXPECT_NO_THROW(RunLock again(run));
}

TEST_F(CheckpointTest, DataFingerprintsTellChangedData) {
  const std::string a = (root_ / "a.jsonl").string(), b = (root_ / "b.jsonl").string();
  write_file_atomic(a, "{\"x\": 1}\n{\"x\": 2}\n");
  const DataFileFingerprint fa = fingerprint_data_file(a);
  EXPECT_EQ(fa.bytes, 18);
  EXPECT_TRUE(fa.whole);
  EXPECT_EQ(fa.hash.size(), 16u);
  // The same bytes elsewhere are the same data.
  fs::copy_file(a, b);
  EXPECT_TRUE(data_changes({fa}, {fingerprint_data_file(b)}).empty());
  EXPECT_TRUE(data_changes({}, {fa}).empty());  // an older checkpoint recorded none
  write_file_atomic(a, "{\"x\": 1}\n{\"x\": 3}\n");
  std::vector<std::string> c = data_changes({fa}, {fingerprint_data_file(a)});
  ASSERT_EQ(c.size(), 1u);
  EXPECT_NE(c[0].find("same size but other contents"), std::string::npos) << c[0];
  write_file_atomic(a, "{\"x\": 1}\n");
  c = data_changes({fa}, {fingerprint_data_file(a)});
  ASSERT_EQ(c.size(), 1u);
  EXPECT_NE(c[0].find("data.train_files[0] " + a + " is 9 bytes; it was 18"), std::string::npos)
      << c[0];
  EXPECT_EQ(data_changes({fa}, {fa, fa}).size(), 1u);
  // Above the limit only the first and last MiB and the size count.
  std::string big(3 << 20, 'a');
  write_file_atomic(a, big);
  const DataFileFingerprint sampled = fingerprint_data_file(a, 1 << 20);
  EXPECT_FALSE(sampled.whole);
  big[100] = 'b';
  write_file_atomic(a, big);
  EXPECT_EQ(data_changes({sampled}, {fingerprint_data_file(a, 1 << 20)}).size(), 1u);
  big[100] = 'a';
  big[big.size() - 100] = 'b';
  write_file_atomic(a, big);
  EXPECT_EQ(data_changes({sampled}, {fingerprint_data_file(a, 1 << 20)}).size(), 1u);
  big[big.size() - 100] = 'a';
  big[big.size() / 2] = 'b';  // the middle is not read
  write_file_atomic(a, big);
  EXPECT_TRUE(data_changes({sampled}, {fingerprint_data_file(a, 1 << 20)}).empty());
  // The state keeps them.
  TrainerState s;
  s.data_files = {fa, sampled};
  s.files = {{"model.safetensors", 123}};
  const std::string path = (root_ / "state.json").string();
  save_trainer_state(path, s);
  const TrainerState r = load_trainer_state(path);
  ASSERT_EQ(r.data_files.size(), 2u);
  EXPECT_EQ(r.data_files[1].hash, sampled.hash);
  EXPECT_FALSE(r.data_files[1].whole);
  EXPECT_TRUE(data_changes(s.data_files, r.data_files).empty());
  ASSERT_EQ(r.files.size(), 1u);
  EXPECT_EQ(r.files[0].bytes, 123);
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
  // What an export killed with SIGKILL left beside the target: the next export removes it.
  const std::string killed = test::temp_dir_of_killed_process((root_ / "hf-old").string());
  ASSERT_TRUE(fs::is_directory(killed)) << killed;
  fs::create_directories(root_ / "hf.tmp");
  write_file_atomic((root_ / "hf.tmp" / "notes.txt").string(), "mine");
  export_checkpoint(ckpt.string(), out.string());
  EXPECT_TRUE(fs::is_regular_file(out / "model.safetensors"));
  EXPECT_FALSE(fs::exists(killed));
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

TEST_F(CheckpointTest, ALockFileThatIsALinkIsRefusedAndItsTargetKept) {
  const fs::path run = root_ / "run", victim = root_ / "notes.txt";
  fs::create_directories(run);
  write_file_atomic(victim.string(), "precious");
  fs::create_symlink(victim, run / "iris.lock");
  const std::string msg = test::error_of([&] { RunLock lock(run.string()); });
  EXPECT_NE(msg.find((run / "iris.lock").string() + " is a symbolic link"), std::string::npos)
      << msg;
  EXPECT_EQ(read_text_file(victim.string()), "precious");
  // A run directory's own debris is cleaned, and so is what a killed export left beside it.
  const std::string beside = test::temp_dir_of_killed_process((root_ / "hf").string());
  const std::string inside = test::temp_dir_of_killed_process((run / "hf").string());
  ASSERT_TRUE(fs::is_directory(beside) && fs::is_directory(inside));
  remove_checkpoint_debris(run.string());
  EXPECT_FALSE(fs::exists(beside));
  EXPECT_FALSE(fs::exists(inside));
  EXPECT_EQ(read_text_file(victim.string()), "precious");
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

// The initialisation is one SplitMix64 stream of normals in binding order (so a seed gives the
// same weights on every machine), whatever number of threads draws it.
TEST_F(CheckpointTest, RandomInitIsOneSequentialStreamOnAnyThreadCount) {
  const ModelConfig cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  const std::string text = read_text_file(test::fixture_dir() + "/config.json");
  auto cpu = make_cpu_backend();
  auto w = allocate_weights(*cpu, cfg);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(3);
  init_random_weights(*cpu, *w, text, 11);
  omp_set_num_threads(threads);
  SplitMix64 rng(11);
  int64_t checked = 0;
  for (const WeightBinding& b : w->bindings) {
    const Tensor t = b.target->slice(b.row_offset, b.row_offset + b.hf_shape[0]);
    std::vector<float> got(static_cast<size_t>(t.numel()));
    cpu->read(got.data(), DType::f32, t);
    const bool bias = b.hf_name.ends_with(".bias");
    const bool norm =
        !bias && b.hf_shape.size() == 1 && b.hf_name.find("norm") != std::string::npos;
    if (bias || norm) continue;
    const double std = b.hf_name.starts_with("model.visual.") ? 0.05 : 0.2;
    for (size_t i = 0; i < got.size(); ++i) {
      const float want = static_cast<float>(rng.normal() * std);
      if (got[i] != want) FAIL() << b.hf_name << "[" << i << "] " << got[i] << " != " << want;
    }
    checked += static_cast<int64_t>(got.size());
  }
  EXPECT_GT(checked, int64_t(1) << 17);  // tensors above one chunk of the parallel fill
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

  static nlohmann::json summary(const std::string& run) {
    return nlohmann::json::parse(read_text_file(run + "/run_summary.json"));
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
  // Same weights and optimizer state, byte for byte, and the same trainer state but for the file
  // sizes it lists (resolved_config.yaml names the run directory).
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_text_file(straight + "/step_0000006/" + f),
              read_text_file(split + "/step_0000006/" + f))
        << f;
  auto state = [](const std::string& run) {
    nlohmann::json j =
        nlohmann::json::parse(read_text_file(run + "/step_0000006/trainer_state.json"));
    EXPECT_EQ(j["files"].size(), 9u);  // chat_template.jinja among them
    j.erase("files");
    return j;
  };
  EXPECT_EQ(state(straight), state(split));
  EXPECT_EQ(list_checkpoints(straight), (std::vector<int64_t>{4, 6}));
  // keep_last counts the checkpoints of the run a resume continues (2 and 3 here) with its own.
  EXPECT_EQ(list_checkpoints(split), (std::vector<int64_t>{4, 6}));

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

// A resume whose recipe would move the learning rates under the run (here: a cosine that decays
// over train.train_iters, raised) is refused naming the keys and the next step's rates, and
// touches no checkpoint and no record; schedule.override_on_resume takes the new schedule and
// says so, and the checkpoints then record it.
TEST_F(TinyTrainingTest, AResumeThatChangesTheScheduleIsRefusedUnlessOverridden) {
  const std::string run = run_dir("run");
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), {"schedule.decay_iters=0", "train.eval_interval=0"});
    return recipe(run, extra);
  };
  run_training(with({"train.train_iters=3"}), quiet());
  const std::vector<int64_t> steps = list_checkpoints(run);
  const std::string metrics = read_text_file(run + "/metrics.jsonl");
  const std::string resolved = read_text_file(run + "/resolved_config.yaml");
  const std::string summary = read_text_file(run + "/run_summary.json");

  std::string err = test::error_of([&] { run_training(with({}), quiet()); });
  for (const std::string part :
       {"the recipe changes the learning-rate schedule that " + run +
            "/step_0000003 was trained "
            "with: train.train_iters 3 -> 6;",
        std::string("the learning rate of iteration 4 is 0.0001 under the checkpoint's schedule"),
        std::string("keep the cosine's end with schedule.decay_iters=3"),
        std::string("set schedule.override_on_resume=true")})
    EXPECT_NE(err.find(part), std::string::npos) << part << "\nin: " << err;
  err = test::error_of([&] {
    run_training(with({"schedule.decay_iters=3", "optimizer.lr=5e-4"}), quiet());
  });
  EXPECT_NE(err.find("was trained with: optimizer.lr 0.001 -> 0.0005;"), std::string::npos) << err;
  EXPECT_EQ(list_checkpoints(run), steps);
  EXPECT_EQ(read_text_file(run + "/metrics.jsonl"), metrics);
  EXPECT_EQ(read_text_file(run + "/resolved_config.yaml"), resolved);
  EXPECT_EQ(read_text_file(run + "/run_summary.json"), summary);

  const std::string log_path = (root_ / "log.txt").string();
  TrainerOptions o;
  o.out = std::fopen(log_path.c_str(), "w");
  const TrainResult r = run_training(with({"schedule.override_on_resume=true"}), o);
  std::fclose(o.out);
  EXPECT_EQ(r.start_iteration, 3);
  EXPECT_EQ(r.final_iteration, 6);
  const std::string log = read_text_file(log_path);
  EXPECT_NE(log.find("INFO note: schedule.override_on_resume: the recipe's learning-rate schedule "
                     "differs from the one " +
                     run +
                     "/step_0000003 was trained with (train.train_iters 3 -> 6) and is "
                     "used from iteration 4 on"),
            std::string::npos)
      << log;
  const LrSchedule now = recipe_schedule(with({})).lr_schedule();
  for (const auto& [it, lr] : losses(run, "lr"))
    if (it > 3) EXPECT_EQ(static_cast<float>(lr), now.at(it - 1)) << "iteration " << it;
  const TrainerState state = load_trainer_state(run + "/step_0000006/trainer_state.json");
  ASSERT_TRUE(state.has_schedule);
  EXPECT_EQ(state.schedule.train_iters, 6);
  EXPECT_TRUE(schedule_changes(state.schedule, recipe_schedule(with({}))).empty());

  // A checkpoint from before schedules were recorded cannot be compared: the log says so.
  nlohmann::json j =
      nlohmann::json::parse(read_text_file(run + "/step_0000006/trainer_state.json"));
  j.erase("schedule");
  write_file_atomic(run + "/step_0000006/trainer_state.json", j.dump(2));
  o.out = std::fopen(log_path.c_str(), "w");
  run_training(with({"train.train_iters=7"}), o);
  std::fclose(o.out);
  EXPECT_NE(read_text_file(log_path).find("step_0000006 records no learning-rate schedule"),
            std::string::npos)
      << read_text_file(log_path);
}

// run_summary.json and metrics.jsonl after resumes read as one run: the totals, the first and
// last loss and each step's record once, also where a stretch went on past its last checkpoint
// (its later steps run again and count once).
TEST_F(TinyTrainingTest, TheSummaryAndTheMetricsCoverTheWholeRunAcrossResumes) {
  const std::string straight = run_dir("straight"), split = run_dir("split"),
                    rerun = run_dir("rerun");
  run_training(recipe(straight), quiet());
  run_training(recipe(split, {"train.train_iters=3"}), quiet());
  EXPECT_EQ(summary(split).at("status").get<std::string>(), "finished");
  const TrainResult b = run_training(recipe(split), quiet());
  EXPECT_EQ(b.start_iteration, 3);
  // Without a final checkpoint the first stretch's steps 5 and 6 are lost to a resume, which
  // continues from step 4 and runs them again.
  run_training(recipe(rerun, {"checkpoint.save_interval=4", "checkpoint.save_final=false"}),
               quiet());
  EXPECT_EQ(summary(rerun).at("iterations").at("final").get<int64_t>(), 6);
  const TrainResult c = run_training(recipe(rerun), quiet());
  EXPECT_EQ(c.start_iteration, 4);

  const nlohmann::json a = summary(straight);
  for (const std::string& run : {split, rerun}) {
    SCOPED_TRACE(run);
    const nlohmann::json s = summary(run);
    EXPECT_EQ(s.at("status").get<std::string>(), "finished");
    EXPECT_EQ(s.at("iterations").at("start").get<int64_t>(), 0);
    EXPECT_EQ(s.at("iterations").at("final").get<int64_t>(), 6);
    for (const char* k : {"steps", "samples", "tokens", "labelled_tokens", "evaluations"})
      EXPECT_EQ(s.at("totals").at(k).get<int64_t>(), a.at("totals").at(k).get<int64_t>()) << k;
    EXPECT_EQ(s.at("totals").at("flops").get<double>(), a.at("totals").at("flops").get<double>());
    // Bit-identical losses: the first one logged by the first stretch, the last by the second.
    EXPECT_EQ(s.at("totals").at("first_loss"), a.at("totals").at("first_loss"));
    EXPECT_EQ(s.at("totals").at("last_loss"), a.at("totals").at("last_loss"));
    std::vector<int64_t> logged;
    for (const nlohmann::json& m : s.at("intervals")) logged.push_back(m.at("iteration"));
    EXPECT_EQ(logged, (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
    std::vector<int64_t> recorded;
    for (const auto& [it, loss] : losses(run)) recorded.push_back(it);
    EXPECT_EQ(recorded, logged);
    EXPECT_EQ(losses(run), losses(straight));
    ASSERT_EQ(s.at("stretches").size(), 2u);
    EXPECT_EQ(s.at("stretches")[0].at("final"), s.at("stretches")[1].at("start"));
    EXPECT_EQ(s.at("intervals")[0].at("stretch").get<int64_t>(), 0);
    EXPECT_EQ(s.at("intervals")[5].at("stretch").get<int64_t>(), 1);
  }
  // Saves at 2 and 4 and 6; the split run's first stretch also saved its end, 3.
  EXPECT_EQ(a.at("totals").at("checkpoints").get<int64_t>(), 3);
  EXPECT_EQ(summary(split).at("totals").at("checkpoints").get<int64_t>(), 4);
  EXPECT_EQ(summary(split).at("stretches")[0].at("final").get<int64_t>(), 3);
  // The stretch that went on to 6 is cut at the checkpoint the resume continued.
  EXPECT_EQ(summary(rerun).at("stretches")[0].at("final").get<int64_t>(), 4);
  EXPECT_EQ(summary(rerun).at("totals").at("checkpoints").get<int64_t>(), 2);
}

// A checkpoint every step: the interval's step time leaves out the saves (and the evaluations),
// whose time the records and the summary give apart, as the saves themselves measured it.
TEST_F(TinyTrainingTest, EvaluationsAndCheckpointsAreTimedApartFromTheSteps) {
  const std::string run = run_dir("run");
  const std::string log_path = (root_ / "log.txt").string();
  TrainerOptions o;
  o.out = std::fopen(log_path.c_str(), "w");
  run_training(recipe(run, {"train.train_iters=4", "checkpoint.save_interval=1",
                            "train.eval_interval=2", "checkpoint.keep_last=1"}),
               o);
  std::fclose(o.out);
  const std::string log = read_text_file(log_path);
  // Each save's own duration, as its log line gives it (4 significant digits).
  double saved = 0;
  int saves = 0;
  const std::string mark = "saved checkpoint ";
  for (size_t at = log.find(mark); at != std::string::npos; at = log.find(mark, at + 1)) {
    const size_t in = log.find(" in ", at), eol = log.find('\n', at);
    ASSERT_LT(in, eol) << log.substr(at, eol - at);
    saved += std::stod(log.substr(in + 4, eol - in - 4));
    ++saves;
  }
  EXPECT_EQ(saves, 4) << log;

  double checkpoint_s = 0, eval_s = 0;
  int records = 0, evals = 0;
  std::ifstream f(run + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    ++records;
    SCOPED_TRACE(line);
    const double seconds = j.at("seconds"), wall = j.at("wall_s"), ckpt = j.at("checkpoint_s"),
                 ev = j.at("eval_s");
    const int64_t steps = j.at("steps");
    EXPECT_EQ(j.at("checkpoints").get<int64_t>(), 1);
    EXPECT_GT(ckpt, 0.0);
    evals += j.at("evaluations").get<int>();
    // The parts make the interval's wall time, and the step time is below the time with the save.
    EXPECT_NEAR(seconds + ev + ckpt, wall, 1e-9 * wall);
    EXPECT_LT(j.at("step_s").get<double>(), wall / static_cast<double>(steps));
    // The step's own measured parts fit in its logged time.
    EXPECT_LE(
        (j.at("data_s_per_step").get<double>() + j.at("host_enqueue_s_per_step").get<double>()) *
            static_cast<double>(steps),
        seconds * (1 + 1e-9));
    EXPECT_NEAR(j.at("tokens_per_s").get<double>(), j.at("tokens").get<double>() / seconds,
                1e-9 * j.at("tokens_per_s").get<double>());
    checkpoint_s += ckpt;
    eval_s += ev;
  }
  EXPECT_EQ(records, 4);
  EXPECT_EQ(evals, 2);
  EXPECT_NEAR(checkpoint_s, saved, 5e-4 * saved);
  const nlohmann::json t = summary(run).at("totals");
  EXPECT_NEAR(t.at("checkpoint_seconds").get<double>(), checkpoint_s, 1e-9 * checkpoint_s);
  EXPECT_NEAR(t.at("eval_seconds").get<double>(), eval_s, 1e-9 * eval_s);
  EXPECT_EQ(t.at("checkpoints").get<int64_t>(), 4);
  EXPECT_EQ(t.at("evaluations").get<int64_t>(), 2);
  EXPECT_GT(eval_s, 0.0);
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

TEST_F(TinyTrainingTest, ARunFolderIsNeverClobbered) {
  const std::string run = run_dir("run");
  auto with = [&](const std::string& dir, std::vector<std::string> extra) {
    extra.insert(extra.begin(), {"train.eval_interval=0", "checkpoint.keep_last=0"});
    return recipe(dir, extra);
  };
  run_training(with(run, {"train.train_iters=4"}), quiet());
  const std::string step2 = read_text_file(run + "/step_0000002/model.safetensors");
  // `latest` lost, and a stray folder named like a step past int64.
  fs::remove(run + "/latest");
  fs::create_directories(run + "/step_99999999999999999999");
  // resume: never looks at the step folders, not at `latest`.
  std::string err =
      test::error_of([&] { run_training(with(run, {"checkpoint.resume=never"}), quiet()); });
  EXPECT_NE(err.find("already holds checkpoints (step_0000004 and 1 more) and checkpoint.resume "
                     "is never; set checkpoint.resume=auto"),
            std::string::npos)
      << err;
  {
    const RunLock other(run);
    err = test::error_of([&] { run_training(with(run, {"train.train_iters=6"}), quiet()); });
    EXPECT_NE(err.find("is in use by process " + std::to_string(::getpid())), std::string::npos)
        << err;
  }
  // The data changes under the run: one more sample.
  const std::string train = (root_ / "shapes/train.jsonl").string();
  const std::string data = read_text_file(train);
  write_file_atomic(train, data + data.substr(0, data.find('\n') + 1));

  const std::string log_path = (root_ / "log.txt").string();
  TrainerOptions o;
  o.out = std::fopen(log_path.c_str(), "w");
  const TrainResult r = run_training(with(run, {"train.train_iters=6"}), o);
  std::fclose(o.out);
  EXPECT_EQ(r.start_iteration, 4);
  EXPECT_EQ(r.final_iteration, 6);
  const std::string log = read_text_file(log_path);
  EXPECT_NE(log.find("latest does not exist; resuming from the newest complete checkpoint, " + run +
                     "/step_0000004"),
            std::string::npos)
      << log;
  EXPECT_NE(
      log.find("WARN data.train_files[0] " + train + " is " + std::to_string(fs::file_size(train)) +
               " bytes; it was " + std::to_string(data.size())),
      std::string::npos)
      << log;
  EXPECT_EQ(list_checkpoints(run), (std::vector<int64_t>{2, 4, 6}));
  EXPECT_EQ(read_text_file(run + "/step_0000002/model.safetensors"), step2);
  EXPECT_EQ(latest_checkpoint(run), run + "/step_0000006");
  EXPECT_TRUE(fs::is_directory(run + "/step_99999999999999999999"));

  // A step folder this run would reach but cannot resume from is refused before any step, and
  // kept.
  const std::string other = run_dir("other");
  fs::create_directories(other + "/step_0000002");
  write_file_atomic(other + "/step_0000002/notes.txt", "mine");
  err = test::error_of([&] { run_training(with(other, {"train.train_iters=2"}), quiet()); });
  EXPECT_NE(err.find("holds step_0000002, past step 0 where this run starts"), std::string::npos)
      << err;
  EXPECT_EQ(read_text_file(other + "/step_0000002/notes.txt"), "mine");
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

TEST_F(TinyTrainingTest, SkippedLinesAreWarnedOnceEachAndSummedUpByReason) {
  // Two shapes samples, a missing image and a LLaVA video row.
  const std::string train = (root_ / "shapes/train.jsonl").string();
  const std::string shapes = read_text_file(train);
  const size_t first_end = shapes.find('\n') + 1;
  const std::string first = shapes.substr(0, first_end),
                    second = shapes.substr(first_end, shapes.find('\n', first_end) + 1 - first_end);
  write_file_atomic(
      train,
      first +
          R"({"image": "gone.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "x"}]})"
          "\n" +
          second +
          R"({"video": "clip.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "A ball rolls."}]})"
          "\n");
  const std::string log_path = (root_ / "log.txt").string();
  TrainerOptions o;
  o.out = std::fopen(log_path.c_str(), "w");
  // Three steps of two samples: every line is reached, most of them more than once.
  run_training(recipe(run_dir("run"), {"train.train_iters=3", "train.eval_interval=0"}), o);
  std::fclose(o.out);
  const std::string log = read_text_file(log_path);
  auto count = [&](const std::string& s) {
    size_t n = 0;
    for (size_t at = log.find(s); at != std::string::npos; at = log.find(s, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("WARN data: skipped " + train + ":2 (missing image): image file not found: " +
                  (root_ / "shapes/gone.png").string()),
            1u)
      << log;
  // The run has a model, so the video row is read as video, and its file is missing.
  EXPECT_EQ(count("WARN data: skipped " + train + ":4 (missing video): video file not found: " +
                  (root_ / "shapes/clip.mp4").string()),
            1u)
      << log;
  EXPECT_EQ(count("WARN data: skipped "), 2u) << log;
  EXPECT_EQ(count("data: skipped 2 of 4 lines: 1 missing image, 1 missing video\n"), 1u) << log;

  // data.on_bad_sample=error: the first refused line reached stops the run, naming its line.
  const std::string err = test::error_of([&] {
    run_training(recipe(run_dir("strict"), {"train.train_iters=1", "train.eval_interval=0",
                                            "data.on_bad_sample=error"}),
                 quiet());
  });
  EXPECT_NE(err.find(train + ":2: image file not found"), std::string::npos) << err;
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

// data.chat_template renders the conversations and travels with the checkpoints, so that the
// export is prompted as the run trained; the run's log says which template it used.
TEST_F(TinyTrainingTest, AChatTemplateFileIsTrainedWithAndKept) {
  const std::string run = run_dir("run");
  const std::string file = test::data_dir() + "/chat_templates/qwen2_vl.jinja";
  TrainerOptions o = quiet();
  std::FILE* log = std::tmpfile();
  ASSERT_NE(log, nullptr);
  o.out = log;
  const TrainResult r = run_training(
      recipe(run, {"data.chat_template=" + file, "train.train_iters=1", "train.eval_interval=0"}),
      o);
  EXPECT_EQ(r.final_iteration, 1);
  EXPECT_EQ(read_text_file(run + "/step_0000001/chat_template.jinja"), read_text_file(file));
  std::rewind(log);
  std::string text;
  for (int c; (c = std::fgetc(log)) != EOF;) text += static_cast<char>(c);
  std::fclose(log);
  EXPECT_NE(text.find("chat template: " + file), std::string::npos) << text;
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
  model.prefill(build_generation_prompt(tok, ChatFormat::from_dir(dir), grids, kShapesPrompt, ""));
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
  // The chat template the run trained with, found first when the export is prompted.
  EXPECT_EQ(read_text_file(out + "/chat_template.jinja"),
            read_text_file(test::data_dir() + "/chat_templates/qwen3_vl_instruct.jinja"));
  EXPECT_EQ(ChatFormat::from_dir(out).source(), out + "/chat_template.jinja");
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

TEST(GpuHostThreads, TheCoresLeftByTheDataWorkersAndTheStepThreadShared) {
  EXPECT_EQ(gpu_host_threads(16, 1, 4), 11);
  EXPECT_EQ(gpu_host_threads(16, 1, 0), 15);
  // Two ranks on one host share its cores.
  EXPECT_EQ(gpu_host_threads(16, 2, 2), 5);
  // Never none, however many workers.
  EXPECT_EQ(gpu_host_threads(2, 1, 4), 1);
  EXPECT_EQ(gpu_host_threads(8, 16, 0), 1);
}

}  // namespace
}  // namespace iris
