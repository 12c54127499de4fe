// iris train / export / data through the binary: dry runs and recipe errors, a run killed with
// SIGKILL at random moments (one of them inside a checkpoint write) and restarted ends with the
// losses of an uninterrupted run, as does one stopped with SIGTERM (which saves the step it is on;
// a second run on its folder meanwhile is refused), and the export of a checkpoint generates what
// the checkpoint generates.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <pty.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bridge/peft.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/safetensors.h"
#include "process_util.h"
#include "test_util.h"
#include "training/checkpoint.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Starts the iris binary with stdout and stderr appended to `log`.
pid_t spawn_iris(const std::vector<std::string>& args, const std::string& log) {
  std::vector<std::string> all{IRIS_BINARY};
  all.insert(all.end(), args.begin(), args.end());
  return test::spawn_process(all, log, {}, /*append=*/true);
}

using Exit = test::ProcessExit;

Exit wait_exit(pid_t pid, const std::string& log) {
  return test::wait_process(pid, log);
}

class AppTrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            ("iris_app_train_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }

  Exit iris(const std::vector<std::string>& args) {
    const std::string log = (root_ / ("log_" + std::to_string(++runs_) + ".txt")).string();
    return wait_exit(spawn_iris(args, log), log);
  }

  // The tiny fixture on a small shapes set made by `iris data shapes`.
  std::string write_recipe(int iters) {
    const Exit d = iris({"data", "shapes", "--out", (root_ / "shapes").string(), "--n", "24",
                         "--seed", "7", "--heldout", "0.25"});
    EXPECT_EQ(d.code, 0) << d.output;
    const std::string path = (root_ / "tiny.yaml").string();
    write_file_atomic(
        path, "model:\n  init: random\n  init_seed: 3\n  config: " + test::fixture_dir() +
                  "/config.json\n  tokenizer: " + test::fixture_dir() + "/tokenizer.json\n" +
                  "data:\n  train_files: [" + (root_ / "shapes/train.jsonl").string() +
                  "]\n  min_pixels: 4096\n  max_pixels: 4096\n  num_workers: 1\n"
                  "train:\n  micro_batch_size: 1\n  global_batch_size: 2\n  train_iters: " +
                  std::to_string(iters) +
                  "\n  seq_length: 64\n"
                  "optimizer:\n  lr: 1.0e-3\n  min_lr: 1.0e-4\n"
                  "schedule:\n  kind: cosine\n  warmup_iters: 1\n"
                  "checkpoint:\n  save_interval: 2\n  keep_last: 2\n"
                  "logging:\n  log_interval: 1\n");
    return path;
  }

  static std::vector<std::pair<int64_t, double>> losses(const fs::path& run) {
    std::ifstream f(run / "metrics.jsonl");
    std::vector<std::pair<int64_t, double>> out;
    for (std::string line; std::getline(f, line);) {
      const auto j = nlohmann::json::parse(line);
      out.emplace_back(j["iteration"].get<int64_t>(), j["loss"].get<double>());
    }
    return out;
  }

  // An interrupted and resumed run ended with the uninterrupted run's losses and step-10 weights,
  // bit for bit.
  static void expect_same_run(const fs::path& straight, const fs::path& resumed, int iters) {
    const auto la = losses(straight), lb = losses(resumed);
    ASSERT_EQ(la.size(), static_cast<size_t>(iters));
    ASSERT_EQ(lb.size(), la.size());
    for (size_t i = 0; i < la.size(); ++i) {
      EXPECT_EQ(la[i].first, lb[i].first);
      EXPECT_EQ(la[i].second, lb[i].second) << "iteration " << la[i].first;  // bit-identical
    }
    // Compared whole, not with EXPECT_EQ, whose line diff of two binary files that differ would
    // take memory quadratic in their size.
    const fs::path last = fs::path(checkpoint_name(iters)) / "model.safetensors";
    EXPECT_TRUE(read_text_file((straight / last).string()) ==
                read_text_file((resumed / last).string()))
        << (resumed / last) << " differs from " << (straight / last);
  }

  // `train` run straight through, and stopped after half its iterations and resumed, into the
  // two directories: the same run (expect_same_run).
  using TrainCall = std::function<Exit(const fs::path&, const std::vector<std::string>&)>;
  static void expect_split_run_resumes_exactly(const TrainCall& train, const fs::path& straight,
                                               const fs::path& split, int iters) {
    const Exit a = train(straight, {});
    ASSERT_EQ(a.code, 0) << a.output;
    const Exit b1 = train(split, {"train.train_iters=" + std::to_string(iters / 2)});
    ASSERT_EQ(b1.code, 0) << b1.output;
    const Exit b2 = train(split, {});
    ASSERT_EQ(b2.code, 0) << b2.output;
    expect_same_run(straight, split, iters);
  }

  fs::path root_;
  int runs_ = 0;
};

TEST_F(AppTrainTest, DryRunPrintsTheResolvedConfigAndTrainsNothing) {
  const std::string recipe = write_recipe(4);
  const std::string run = (root_ / "run").string();
  const Exit e = iris({"train", "--recipe", recipe, "--dry-run", "checkpoint.dir=" + run,
                       "train.train_iters=9", "optimizer.betas=[0.8,0.9]"});
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_NE(e.output.find("train_iters: 9"), std::string::npos) << e.output;
  EXPECT_NE(e.output.find("betas: [0.8, 0.9]"), std::string::npos);
  EXPECT_NE(e.output.find("cuda_graph_impl: none"), std::string::npos);
  EXPECT_NE(e.output.find("recipe is valid"), std::string::npos);
  EXPECT_FALSE(fs::exists(run));
  // The chat template the run would render its conversations with; a broken one fails here.
  EXPECT_NE(e.output.find("chat template: "), std::string::npos) << e.output;
  const std::string bad = (root_ / "bad.jinja").string();
  std::ofstream(bad) << "{% for m in messages %}{{ m|wordcount }}{% endfor %}";
  const Exit broken = iris({"train", "--recipe", recipe, "--dry-run", "data.chat_template=" + bad});
  EXPECT_EQ(broken.code, 1) << broken.output;
  EXPECT_NE(broken.output.find("data.chat_template " + bad +
                               ", line 1: the filter 'wordcount' is not supported"),
            std::string::npos)
      << broken.output;

  // The memory plan per GPU, without a GPU: the device memory from the flag or the recipe key.
  EXPECT_NE(e.output.find("memory plan per GPU"), std::string::npos) << e.output;
  for (const char* line :
       {"weights", "master weights", "gradients", "AdamW moments", "activations",
        "offloaded to host", "workspace", "graph pools", "communication", "per-GPU total: "})
    EXPECT_NE(e.output.find(line), std::string::npos) << line;
  const Exit sized = iris({"train", "--recipe", recipe, "--dry-run", "--device-memory", "80"});
  EXPECT_EQ(sized.code, 0) << sized.output;
  EXPECT_NE(sized.output.find(" GiB of 80.00 GiB"), std::string::npos) << sized.output;
  // A plan over the device is refused, by the dry run as by a run, naming what would fit.
  const Exit over = iris({"train", "--recipe", recipe, "--dry-run", "--device-memory", "0.5"});
  EXPECT_EQ(over.code, 1) << over.output;
  EXPECT_NE(over.output.find("does not fit the GPU's memory"), std::string::npos) << over.output;
  EXPECT_NE(over.output.find("allows 0.50 GiB"), std::string::npos) << over.output;
  const Exit keyed =
      iris({"train", "--recipe", recipe, "--dry-run", "train.device_memory_gib=0.5"});
  EXPECT_EQ(keyed.code, 1) << keyed.output;
  EXPECT_NE(keyed.output.find("train.device_memory_gib (or --device-memory) allows 0.50 GiB"),
            std::string::npos)
      << keyed.output;

  const Exit listed = iris({"train", "--list-keys"});
  EXPECT_EQ(listed.code, 0);
  EXPECT_NE(listed.output.find("train.global_batch_size (integer, default 1)"), std::string::npos);
}

TEST_F(AppTrainTest, RecipeErrorsExitWithTheirMessage) {
  const std::string recipe = write_recipe(4);
  // An override the command line gets wrong (an unknown key, a value of the wrong type) is a
  // usage error (2); settings the recipe cannot run with are the run's failure (1).
  struct Case {
    std::vector<std::string> args;
    int code;
    const char* expect;
  };
  for (const Case& c :
       {Case{{"train.micro_batch=2"}, 2, "did you mean 'train.micro_batch_size'"},
        Case{{"train.train_iters=many"}, 2, "train.train_iters expects an integer, got 'many'"},
        Case{{"parallel.tensor_parallel_size=2"}, 1, "not supported yet"},
        Case{{"train.global_batch_size=3", "train.micro_batch_size=2"}, 1, "use 2 or 4"},
        Case{{"cuda_graph.cuda_graph_impl=full_iteration", "cuda_graph.cuda_graph_modules=[attn]"},
             1,
             "cuda_graph"}}) {
    std::vector<std::string> args{"train", "--recipe", recipe, "--dry-run"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    const Exit e = iris(args);
    EXPECT_EQ(e.code, c.code) << e.output;
    EXPECT_NE(e.output.find(c.expect), std::string::npos) << e.output;
  }
  // A value outside the key's choices, given on the command line, is a usage error too.
  const Exit device = iris({"train", "--recipe", recipe, "--dry-run", "train.device=gpu"});
  EXPECT_EQ(device.code, 2) << device.output;
  EXPECT_NE(device.output.find("train.device"), std::string::npos) << device.output;
  if (!cuda_available()) {
    const Exit no_gpu = iris({"train", "--recipe", recipe, "train.device=cuda",
                              "checkpoint.dir=" + (root_ / "run_cuda").string()});
    EXPECT_EQ(no_gpu.code, 1) << no_gpu.output;
    EXPECT_NE(no_gpu.output.find("set train.device=cpu"), std::string::npos) << no_gpu.output;
  }
  // Graph settings either take effect or are refused with the key to change.
  const Exit modules =
      iris({"train", "--recipe", recipe, "cuda_graph.cuda_graph_impl=local",
            "cuda_graph.cuda_graph_modules=[attn]", "cuda_graph.vision_cuda_graph_impl=local",
            "cuda_graph.vision_cuda_graph_modules=[mlp]", "cuda_graph.cuda_graph_warmup_steps=1",
            "checkpoint.dir=" + (root_ / "run_modules").string()});
  EXPECT_EQ(modules.code, 0) << modules.output;
  EXPECT_NE(modules.output.find("graphs: decoder local (attn), vision local (mlp)"),
            std::string::npos)
      << modules.output;
  const Exit idle_modules =
      iris({"train", "--recipe", recipe, "cuda_graph.vision_cuda_graph_modules=[attn]",
            "checkpoint.dir=" + (root_ / "run_idle_modules").string()});
  EXPECT_EQ(idle_modules.code, 1) << idle_modules.output;
  EXPECT_NE(idle_modules.output.find("set vision_cuda_graph_impl=local"), std::string::npos)
      << idle_modules.output;
  const Exit too_long =
      iris({"train", "--recipe", recipe, "cuda_graph.vision_cuda_graph_impl=local",
            "cuda_graph.max_vision_cuda_graph_seq_length=1048576",
            "checkpoint.dir=" + (root_ / "run_too_long").string()});
  EXPECT_EQ(too_long.code, 1) << too_long.output;
  EXPECT_NE(too_long.output.find("train.max_vision_patches"), std::string::npos) << too_long.output;
  const Exit graphs = iris({"train", "--recipe", recipe, "cuda_graph.cuda_graph_impl=local",
                            "cuda_graph.cuda_graph_warmup_steps=1",
                            "checkpoint.dir=" + (root_ / "run_graphs").string()});
  EXPECT_EQ(graphs.code, 0) << graphs.output;
  EXPECT_NE(graphs.output.find("graphs: decoder local, vision none"), std::string::npos)
      << graphs.output;
  EXPECT_NE(graphs.output.find(" captured in "), std::string::npos) << graphs.output;
  const Exit missing = iris({"train", "--recipe", (root_ / "nope.yaml").string()});
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.output.find("does not exist"), std::string::npos);
}

TEST_F(AppTrainTest, OutputsStayWhereTheyArePointedAndNoWriteFollowsALink) {
  const std::string recipe = write_recipe(2);
  const fs::path notes = root_ / "notes.txt";
  write_file_atomic(notes.string(), "precious");
  const std::string run = "checkpoint.dir=" + (root_ / "a" / "run").string();
  for (const std::string& arg :
       std::vector<std::string>{"logging.metrics_file=../../notes.txt",
                                "logging.plot=" + notes.string(), "logging.plot=/dev/full"}) {
    const Exit e = iris({"train", "--recipe", recipe, run, arg});
    EXPECT_EQ(e.code, 1) << e.output;
    EXPECT_NE(e.output.find("recipe: " + arg.substr(0, arg.find('='))), std::string::npos)
        << e.output;
  }
  EXPECT_EQ(read_text_file(notes.string()), "precious");
  EXPECT_FALSE(fs::exists(root_ / "a" / "run"));

  // A lock file planted as a link: the run stops before writing anything through it.
  const fs::path linked = root_ / "linked";
  fs::create_directories(linked);
  fs::create_symlink(notes, linked / "iris.lock");
  const Exit locked = iris({"train", "--recipe", recipe, "checkpoint.dir=" + linked.string()});
  EXPECT_EQ(locked.code, 1) << locked.output;
  EXPECT_NE(locked.output.find((linked / "iris.lock").string() + " is a symbolic link"),
            std::string::npos)
      << locked.output;
  EXPECT_EQ(read_text_file(notes.string()), "precious");

  // iris data shapes --force over a dataset with a planted link among its images.
  const fs::path shapes = root_ / "shapes";
  fs::remove(shapes / "images" / "000002.png");
  fs::create_symlink(notes, shapes / "images" / "000002.png");
  const Exit forced = iris({"data", "shapes", "--out", shapes.string(), "--n", "6", "--force"});
  EXPECT_EQ(forced.code, 0) << forced.output;
  EXPECT_EQ(read_text_file(notes.string()), "precious");
  EXPECT_FALSE(fs::is_symlink(shapes / "images" / "000002.png"));

  // Four writers into one new folder: one dataset, one winner, three clear refusals.
  const fs::path race = root_ / "race";
  std::vector<pid_t> pids;
  for (int w = 0; w < 4; ++w)
    pids.push_back(spawn_iris(
        {"data", "shapes", "--out", race.string(), "--n", "40", "--seed", std::to_string(w + 1)},
        (root_ / ("race" + std::to_string(w) + ".txt")).string()));
  int winners = 0;
  for (int w = 0; w < 4; ++w) {
    const Exit e = wait_exit(pids[static_cast<size_t>(w)],
                             (root_ / ("race" + std::to_string(w) + ".txt")).string());
    EXPECT_EQ(e.signal, 0) << e.output;
    if (e.code == 0) {
      ++winners;
      continue;
    }
    EXPECT_EQ(e.code, 1) << e.output;
    EXPECT_TRUE(e.output.find("is in use by process") != std::string::npos ||
                e.output.find("already holds a dataset") != std::string::npos)
        << e.output;
  }
  EXPECT_EQ(winners, 1);
}

// Ctrl-C or SIGTERM during an export removes its partial copy on the way out. The checkpoint's one
// large (sparse) tensor keeps the export busy long enough for the signal to land mid-way.
TEST_F(AppTrainTest, AnExportStoppedBySigintOrSigtermLeavesNothingBehind) {
  const fs::path ckpt = root_ / "step_0000001";
  fs::create_directories(ckpt);
  for (const char* f : {"config.json", "tokenizer.json"})
    fs::copy_file(fs::path(test::fixture_dir()) / f, ckpt / f);
  write_file_atomic((ckpt / "trainer_state.json").string(), "{}");
  constexpr int64_t kElements = int64_t{1} << 25;
  std::string header = "{\"big\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(kElements) +
                       "],\"data_offsets\":[0," + std::to_string(kElements * 4) + "]}}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i)
    head[static_cast<size_t>(i)] = static_cast<char>(header.size() >> (8 * i));
  const fs::path weights = ckpt / "model.safetensors";
  write_file_atomic(weights.string(), head + header);
  fs::resize_file(weights, fs::file_size(weights) + kElements * 4);  // zeros, sparse

  for (const int sig : {SIGINT, SIGTERM}) {
    const fs::path out = root_ / ("hf_" + std::to_string(sig));
    const std::string log = (root_ / ("export_" + std::to_string(sig) + ".txt")).string();
    // A shell starts background jobs with SIGINT ignored, which the export would inherit and
    // keep (as it should: that is nohup's contract).
    const auto inherited = std::signal(sig, SIG_DFL);
    const pid_t pid = spawn_iris({"export", ckpt.string(), out.string()}, log);
    std::signal(sig, inherited);
    const std::string prefix = out.filename().string() + ".iris-tmp.";
    const auto temporaries = [&] {
      int n = 0;
      for (const auto& e : fs::directory_iterator(root_))
        n += e.path().filename().string().rfind(prefix, 0) == 0;
      return n;
    };
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (temporaries() == 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_GT(temporaries(), 0) << "the export never started";
    ASSERT_EQ(::kill(pid, sig), 0);
    const Exit e = wait_exit(pid, log);
    ASSERT_NE(e.code, 0) << "the export ended before the signal came: " << e.output;
    EXPECT_EQ(e.signal, 0) << e.output;
    EXPECT_EQ(e.code, 1) << e.output;
    EXPECT_NE(
        e.output.find(std::string("was stopped by ") + (sig == SIGINT ? "SIGINT" : "SIGTERM")),
        std::string::npos)
        << e.output;
    EXPECT_EQ(temporaries(), 0);
    EXPECT_FALSE(fs::exists(out));
  }
}

// A frozen part has no optimizer state in its checkpoints; a resume that unfreezes it starts the
// part's moments and step counts at zero, says so, and trains it from there.
TEST_F(AppTrainTest, AResumeThatUnfreezesAPartStartsItsMomentsAtZero) {
  const std::string recipe = write_recipe(4);
  const std::string run = (root_ / "run").string();
  // The cosine's end kept at 4, so that the resume continues the same schedule.
  const Exit frozen =
      iris({"train", "--recipe", recipe, "checkpoint.dir=" + run, "train.train_iters=2",
            "train.freeze_vision_tower=true", "schedule.decay_iters=4"});
  ASSERT_EQ(frozen.code, 0) << frozen.output;
  const std::string patch = "model.visual.patch_embed.proj.weight";
  const std::string embed = "model.language_model.embed_tokens.weight";
  {
    SafetensorsFile state((fs::path(run) / "step_0000002/optimizer.safetensors").string());
    EXPECT_FALSE(state.contains("exp_avg." + patch));
    EXPECT_TRUE(state.contains("exp_avg." + embed));
  }
  const Exit resumed =
      iris({"train", "--recipe", recipe, "checkpoint.dir=" + run, "schedule.decay_iters=4"});
  ASSERT_EQ(resumed.code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("no optimizer state for vision_tower"), std::string::npos)
      << resumed.output;
  SafetensorsFile state((fs::path(run) / "step_0000004/optimizer.safetensors").string());
  auto steps = [&](const std::string& name) {
    int64_t s = -1;
    std::memcpy(&s, state.at("step." + name).data, sizeof(s));
    return s;
  };
  EXPECT_EQ(steps(patch), 2);  // trained since the resume only
  EXPECT_EQ(steps(embed), 4);
}

// LoRA: the base stays as it was drawn (bit for bit), the adapters train, the optimizer holds
// state for them alone, the checkpoint says what they are (adapter_config.json), and a run
// stopped at step 2 and resumed ends with the uninterrupted run's losses and weights, its
// adapter dropout's masks included.
TEST_F(AppTrainTest, LoraTrainsTheAdaptersAloneAndResumesExactly) {
  const std::string recipe = write_recipe(4);
  const std::vector<std::string> lora = {"peft.type=lora",
                                         "peft.rank=4",
                                         "peft.alpha=8",
                                         "peft.dropout=0.2",
                                         "peft.target_modules=[q_proj,v_proj,down_proj,attn.qkv]",
                                         "schedule.decay_iters=4"};
  auto train = [&](const fs::path& run, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"train", "--recipe", recipe, "checkpoint.dir=" + run.string()};
    args.insert(args.end(), lora.begin(), lora.end());
    args.insert(args.end(), extra.begin(), extra.end());
    return iris(args);
  };
  const fs::path straight = root_ / "straight", split = root_ / "split";
  expect_split_run_resumes_exactly(train, straight, split, 4);
  const auto la = losses(straight);

  SafetensorsFile first((fs::path(straight) / "step_0000002/model.safetensors").string());
  SafetensorsFile last((fs::path(straight) / "step_0000004/model.safetensors").string());
  SafetensorsFile state((fs::path(straight) / "step_0000004/optimizer.safetensors").string());
  int adapters = 0;
  for (const auto& [name, e] : last.entries()) {
    const bool adapter = name.find(".lora_") != std::string::npos;
    EXPECT_EQ(state.contains("exp_avg." + name), adapter) << name;
    const std::string bytes(static_cast<const char*>(e.data), e.nbytes);
    const SafetensorsEntry& f = first.at(name);
    const std::string before(static_cast<const char*>(f.data), f.nbytes);
    if (!adapter) {
      EXPECT_EQ(bytes, before) << name << " is frozen but changed";
      continue;
    }
    ++adapters;
    EXPECT_NE(bytes, before) << name << " did not train";
  }
  // q_proj, v_proj, down_proj in each decoder layer and attn.qkv in each block, A and B each.
  const nlohmann::json cfg = nlohmann::json::parse(
      read_text_file((fs::path(test::fixture_dir()) / "config.json").string()));
  EXPECT_EQ(adapters, 2 * (3 * cfg["text_config"]["num_hidden_layers"].get<int>() +
                           cfg["vision_config"]["depth"].get<int>()));
  const nlohmann::json adapter = nlohmann::json::parse(
      read_text_file((fs::path(straight) / "step_0000004/adapter_config.json").string()));
  EXPECT_EQ(adapter["peft_type"], "LORA");
  EXPECT_EQ(adapter["r"], 4);
  EXPECT_EQ(adapter["lora_alpha"], 8.0);
  EXPECT_EQ(adapter["lora_dropout"], 0.2);

  // The dropout does act: without it the adapters, zero at step 1, train to other losses.
  const std::string plain = (root_ / "plain").string();
  const Exit c = train(plain, {"peft.dropout=0"});
  ASSERT_EQ(c.code, 0) << c.output;
  const auto lc = losses(plain);
  ASSERT_EQ(lc.size(), 4u);
  EXPECT_EQ(lc[0].second, la[0].second);
  EXPECT_NE(lc[3].second, la[3].second);

  // A setting LoRA would ignore, and a target that names nothing Iris adapts, are refused.
  const Exit freeze = train(root_ / "bad", {"train.freeze_merger=true"});
  EXPECT_NE(freeze.code, 0);
  EXPECT_NE(freeze.output.find("peft.type=lora"), std::string::npos) << freeze.output;
  const Exit rank = iris({"train", "--recipe", recipe, "peft.rank=8", "--dry-run"});
  EXPECT_NE(rank.code, 0);
  EXPECT_NE(rank.output.find("peft.rank is set but peft.type is none"), std::string::npos)
      << rank.output;
  const Exit target = train(root_ / "bad2", {"peft.target_modules=[qkv_proj]"});
  EXPECT_NE(target.code, 0);
  EXPECT_NE(target.output.find("'qkv_proj'"), std::string::npos) << target.output;
}

// On the GPU a LoRA run's checkpoint holds the frozen base as the bf16 weights the model reads
// (half the bytes of f32, the same values) and the adapters as their f32 master weights, and a
// resume from it continues bit for bit.
TEST_F(AppTrainTest, LoraOnCudaSavesTheFrozenBaseInBf16AndResumesExactly) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU";
  const std::string recipe = write_recipe(4);
  auto train = [&](const fs::path& run, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"train",
                                     "--recipe",
                                     recipe,
                                     "checkpoint.dir=" + run.string(),
                                     "train.device=cuda",
                                     "peft.type=lora",
                                     "peft.rank=4",
                                     "peft.target_modules=[q_proj,v_proj,down_proj,attn.qkv]",
                                     "schedule.decay_iters=4"};
    args.insert(args.end(), extra.begin(), extra.end());
    return iris(args);
  };
  const fs::path straight = root_ / "cuda_straight", split = root_ / "cuda_split";
  expect_split_run_resumes_exactly(train, straight, split, 4);
  SafetensorsFile saved((straight / "step_0000004/model.safetensors").string());
  int adapters = 0, base = 0;
  for (const auto& [name, e] : saved.entries()) {
    const bool adapter = is_lora_tensor(name);
    (adapter ? adapters : base)++;
    EXPECT_EQ(e.dtype, adapter ? DType::f32 : DType::bf16) << name;
  }
  EXPECT_GT(adapters, 0);
  EXPECT_GT(base, adapters);
}

// Every file under `dir` (recursively) with its size, modification time and contents.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    struct stat st {};
    ::lstat(e.path().c_str(), &st);
    std::string what =
        str_cat(st.st_mode, " ", st.st_size, " ", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
    if (e.is_regular_file()) what += " " + read_text_file(e.path().string());
    files[e.path().string()] = what;
  }
  return files;
}

// A finished run started again has nothing to do: it says so, with how to train further, and
// leaves every file of its folder as it was (the lock, the summary and the metrics included).
// train.offload_activations: the named activations of every decoder layer go to a host arena in
// the forward and come back one layer ahead in the backward, while the device keeps two layers'
// slots of them; on the CPU the same path copies into memory of its own. Every recompute mode's
// offloadable set, a list, and per-layer graphs (through the recording stand-in) give the run that
// keeps them bit for bit.
TEST_F(AppTrainTest, OffloadedActivationsGiveTheKeptOnesBitForBit) {
  const std::string recipe = write_recipe(4);
  auto train = [&](const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> args{"train", "--recipe", recipe,
                                  "checkpoint.dir=" + (root_ / name).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    return iris(args);
  };
  // Graphs pad each micro-batch to a bucket, which on a GPU rounds differently from the unpadded
  // eager run: the graphed runs are compared with each other.
  const std::vector<std::string> graphs{"cuda_graph.cuda_graph_impl=local",
                                        "cuda_graph.cuda_graph_warmup_steps=1"};
  for (const std::string recompute : {"none", "selective", "full"}) {
    for (const bool graphed : {false, true}) {
      if (graphed && recompute != "none") continue;
      SCOPED_TRACE("train.recompute=" + recompute + (graphed ? " with layer graphs" : ""));
      std::vector<std::string> common{"train.recompute=" + recompute};
      if (graphed) common.insert(common.end(), graphs.begin(), graphs.end());
      const std::string kept = "kept_" + recompute + (graphed ? "_graphs" : "");
      const Exit a = train(kept, common);
      ASSERT_EQ(a.code, 0) << a.output;
      std::vector<std::string> lists{"all"};
      if (recompute == "none" && !graphed) lists.push_back("[act, x_in, lse]");
      for (const std::string& list : lists) {
        SCOPED_TRACE("train.offload_activations=" + list);
        std::vector<std::string> extra = common;
        extra.push_back("train.offload_activations=" + list);
        const std::string name = kept + "_offload_" + std::to_string(list.size());
        const Exit b = train(name, extra);
        ASSERT_EQ(b.code, 0) << b.output;
        EXPECT_NE(b.output.find("offloaded to host"), std::string::npos) << b.output;
        expect_same_run(root_ / kept, root_ / name, 4);
      }
    }
  }
  // Names the recompute mode does not keep per layer are refused, with the ones it keeps.
  const Exit wrong =
      train("wrong", {"train.recompute=full", "train.offload_activations=[x_in, act]"});
  EXPECT_EQ(wrong.code, 1) << wrong.output;
  EXPECT_NE(wrong.output.find("'act', which is not an activation the decoder layers keep with "
                              "train.recompute=full; those are: x_in"),
            std::string::npos)
      << wrong.output;
}

TEST_F(AppTrainTest, AFinishedRunRunAgainSaysSoAndChangesNoFile) {
  const std::string recipe = write_recipe(4);
  const fs::path run = root_ / "run";
  const std::vector<std::string> args{"train", "--recipe", recipe,
                                      "checkpoint.dir=" + run.string()};
  const Exit first = iris(args);
  ASSERT_EQ(first.code, 0) << first.output;
  const auto before = snapshot(run);
  ASSERT_GT(before.size(), 8u);
  const Exit again = iris(args);
  EXPECT_EQ(again.code, 0) << again.output;
  EXPECT_NE(again.output.find(str_cat("INFO run ", run.string(),
                                      " already finished at iteration 4 of 4 (",
                                      (run / "step_0000004").string(),
                                      "); nothing to do (raise train.train_iters to train "
                                      "further; the cosine decay ends at train.train_iters, so "
                                      "also set schedule.decay_iters=4")),
            std::string::npos)
      << again.output;
  EXPECT_EQ(again.output.find("last loss"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("iter "), std::string::npos) << again.output;
  EXPECT_TRUE(snapshot(run) == before) << "a file of the finished run changed";
  // What it says to do works: the schedule kept, the run goes on.
  const Exit longer = iris({"train", "--recipe", recipe, "checkpoint.dir=" + run.string(),
                            "train.train_iters=5", "schedule.decay_iters=4"});
  EXPECT_EQ(longer.code, 0) << longer.output;
  EXPECT_NE(longer.output.find("done: iteration 5 of 5, last loss "), std::string::npos)
      << longer.output;
}

// What iris train writes to a terminal (a pseudo-terminal here), with `env` added.
std::string on_a_terminal(const std::vector<std::string>& args,
                          const std::vector<std::string>& env) {
  int master = -1;
  const pid_t pid = ::forkpty(&master, nullptr, nullptr, nullptr);
  if (pid == 0) {
    std::vector<std::string> copy{IRIS_BINARY}, vars = env;
    copy.insert(copy.end(), args.begin(), args.end());
    for (std::string& e : vars) ::putenv(e.data());
    std::vector<char*> argv;
    for (std::string& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(master, buf, sizeof(buf));
    if (n > 0) out.append(buf, static_cast<size_t>(n));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // EIO once the child has closed its side
  }
  ::close(master);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
  return out;
}

// mpirun and srun give each rank a terminal whose output lands in a log file: there the bar's
// escape codes would fill it. The bar is drawn on a terminal of the user's only, or as
// logging.progress says; under a launcher the log lines name the rank.
TEST_F(AppTrainTest, TheProgressBarStaysOutOfALaunchersLog) {
  const std::string recipe = write_recipe(2);
  int n = 0;
  const auto train = [&](const std::vector<std::string>& extra,
                         const std::vector<std::string>& env) {
    std::vector<std::string> args{"train", "--recipe", recipe,
                                  "checkpoint.dir=" + (root_ / str_cat("run", ++n)).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    return on_a_terminal(args, env);
  };
  const std::vector<std::string> mpirun{"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE=1"};
  const std::vector<std::string> srun{"SLURM_PROCID=0", "SLURM_NTASKS=1", "SLURM_STEP_ID=0"};
  const std::string bar = "\033[K[";  // the bar's redraw
  const std::string mine = train({}, {});
  EXPECT_NE(mine.find(bar), std::string::npos) << "no bar on a terminal: " << mine;
  EXPECT_EQ(mine.find("[rank "), std::string::npos) << mine;
  for (const auto& env : {mpirun, srun}) {
    SCOPED_TRACE(env[0]);
    const std::string launched = train({}, env);
    EXPECT_EQ(launched.find('\033'), std::string::npos) << launched;
    EXPECT_NE(launched.find(" INFO [rank 0] iter 2/2 | loss "), std::string::npos) << launched;
  }
  const std::string off = train({"logging.progress=off"}, {});
  EXPECT_EQ(off.find('\033'), std::string::npos) << off;
  EXPECT_NE(off.find("iter 2/2 | loss "), std::string::npos) << off;
  const std::string on = train({"logging.progress=on"}, mpirun);
  EXPECT_NE(on.find(bar), std::string::npos) << on;
}

TEST_F(AppTrainTest, KilledRunsResumeToTheLossesOfAnUninterruptedRun) {
  constexpr int kIters = 10;
  const std::string recipe = write_recipe(kIters);
  const fs::path straight = root_ / "straight", killed = root_ / "killed";

  const auto t0 = Clock::now();
  const Exit a = iris({"train", "--recipe", recipe, "checkpoint.dir=" + straight.string()});
  ASSERT_EQ(a.code, 0) << a.output;
  const double full_seconds = std::chrono::duration<double>(Clock::now() - t0).count();

  const unsigned seed = std::random_device{}();
  SCOPED_TRACE("kill schedule seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const std::vector<std::string> args{"train", "--recipe", recipe,
                                      "checkpoint.dir=" + killed.string()};
  int kills = 0, tmp_kills = 0;
  // Kill 1 as soon as the first checkpoint is being written (a fresh run always writes one), then
  // twice at a random moment.
  for (int round = 0; round < 3; ++round) {
    const std::string log = (root_ / ("killed_" + std::to_string(round) + ".txt")).string();
    const pid_t pid = spawn_iris(args, log);
    bool done = false;
    if (round == 0) {
      const auto deadline = Clock::now() + std::chrono::duration<double>(3 * full_seconds + 30);
      while (Clock::now() < deadline && !done) {
        bool writing = false;
        if (fs::is_directory(killed))
          for (const auto& e : fs::directory_iterator(killed))
            writing |= e.path().extension() == ".tmp";
        if (writing) {
          ::kill(pid, SIGKILL);
          ++tmp_kills;
          break;
        }
        done = ::waitpid(pid, nullptr, WNOHANG) == pid;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    } else {
      std::uniform_real_distribution<double> when(0.2, 0.7);
      std::this_thread::sleep_for(std::chrono::duration<double>(when(rng) * full_seconds));
      ::kill(pid, SIGKILL);
    }
    if (!done) {
      const Exit e = wait_exit(pid, log);
      if (e.signal == SIGKILL)
        ++kills;
      else
        ASSERT_EQ(e.code, 0) << e.output;  // it finished before the kill landed
    }
    // Whatever the moment, `latest` names a complete checkpoint (or there is none yet).
    ASSERT_NO_THROW(latest_checkpoint(killed.string()));
  }
  EXPECT_GE(kills, 1);
  EXPECT_EQ(tmp_kills, 1) << "no checkpoint write was caught in the act";
  const Exit b = iris(args);
  ASSERT_EQ(b.code, 0) << b.output;

  expect_same_run(straight, killed, kIters);
  for (const auto& e : fs::directory_iterator(killed))
    EXPECT_NE(e.path().extension(), ".tmp") << "debris left: " << e.path();
}

TEST_F(AppTrainTest, SigtermSavesTheCurrentStepAndTheResumeIsExact) {
  constexpr int kIters = 10;
  const std::string recipe = write_recipe(kIters);
  const fs::path straight = root_ / "straight", termed = root_ / "termed";
  const Exit a = iris({"train", "--recipe", recipe, "checkpoint.dir=" + straight.string()});
  ASSERT_EQ(a.code, 0) << a.output;

  const std::vector<std::string> args{"train", "--recipe", recipe,
                                      "checkpoint.dir=" + termed.string()};
  const std::string log = (root_ / "termed.txt").string();
  const pid_t pid = spawn_iris(args, log);
  // Once a step is logged (mid-run: a checkpoint every 2 of 10 steps).
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (Clock::now() < deadline && losses(termed).empty())
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_FALSE(losses(termed).empty()) << "no step was logged";
  // While it runs, the folder is its alone: a second run is refused at once, naming it.
  const std::string holder = "is in use by process " + std::to_string(pid);
  EXPECT_NE(test::error_of([&] { RunLock other(termed.string()); }).find(holder),
            std::string::npos);
  const Exit second = iris(args);
  EXPECT_EQ(second.code, 1) << second.output;
  EXPECT_NE(second.output.find("checkpoint.dir " + termed.string() + " " + holder),
            std::string::npos)
      << second.output;
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  const Exit t = wait_exit(pid, log);
  // 128 + SIGTERM: not finished, as if the signal had ended it, but with the step saved.
  ASSERT_EQ(t.code, 128 + SIGTERM) << "the run ended before the signal? " << t.output;
  const auto done = losses(termed);
  ASSERT_FALSE(done.empty());
  const int64_t last = done.back().first;
  ASSERT_LT(last, kIters);
  const std::string checkpoint = (termed / checkpoint_name(last)).string();
  EXPECT_EQ(latest_checkpoint(termed.string()), checkpoint);
  EXPECT_TRUE(checkpoint_complete(checkpoint));
  EXPECT_NE(t.output.find("stop requested; saving a checkpoint after the current step"),
            std::string::npos)
      << t.output;
  EXPECT_NE(t.output.find(str_cat("stopped by SIGTERM at iteration ", last, " of ", kIters,
                                  "; the last checkpoint is ", checkpoint,
                                  ": run the same command to resume")),
            std::string::npos)
      << t.output;

  const Exit b = iris(args);
  ASSERT_EQ(b.code, 0) << b.output;
  EXPECT_NE(b.output.find("resuming from " + checkpoint), std::string::npos) << b.output;
  expect_same_run(straight, termed, kIters);
}

TEST_F(AppTrainTest, BenchTrainReportsThroughputAgainstTheMeasuredGemmRate) {
  const std::string out = (root_ / "bench.json").string();
  const Exit e =
      iris({"bench",          "--train", "--config", test::fixture_dir() + "/config.json",
            "--device",       "cpu",     "--image",  "64",
            "--seq",          "96",      "--micro",  "2",
            "--accumulation", "2",       "--steps",  "1",
            "--recompute",    "full",    "--json",   out,
            "--profile"});
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_NE(e.output.find("MFU of measured GEMM"), std::string::npos) << e.output;
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(out));
  // --profile: the extra step's ops by family, their shares adding to the ops' time.
  EXPECT_NE(e.output.find("step profile: one step op by op"), std::string::npos) << e.output;
  EXPECT_NE(e.output.find("GEMM weight gradient"), std::string::npos) << e.output;
  double family_ms = 0;
  for (const auto& f : j["profile"]["families"]) {
    EXPECT_NE(f["family"].get<std::string>(), "other");
    EXPECT_GT(f["calls"].get<int64_t>(), 0);
    family_ms += f["ms"].get<double>();
  }
  EXPECT_NEAR(family_ms, j["profile"]["ops_ms"].get<double>(), 1e-6 * family_ms);
  // With the idle time between the ops, the rows add up to the profiled step's time.
  EXPECT_GE(j["profile"]["idle_ms"].get<double>(), 0.0);
  EXPECT_NEAR(family_ms + j["profile"]["idle_ms"].get<double>(),
              j["profile"]["step_ms"].get<double>(), 1e-6 * family_ms);
  EXPECT_NE(e.output.find("attention backward"), std::string::npos) << e.output;
  EXPECT_GT(j["tokens_per_s"].get<double>(), 0.0);
  EXPECT_GT(j["model_tflops"].get<double>(), 0.0);
  EXPECT_GT(j["gemm_tflops_measured"].get<double>(), 0.0);
  // Random weights of std 0.02 predict nearly uniformly over the vocabulary: ln(151936) = 11.93.
  EXPECT_NEAR(j["loss"].get<double>(), 11.93, 0.3);
  const Exit bad = iris({"bench", "--train", "--config", test::fixture_dir() + "/config.json",
                         "--device", "cpu", "--image", "64", "--seq", "5"});
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.output.find("--seq 5 leaves no room"), std::string::npos) << bad.output;
  // A MoE geometry under a capacity reports the share of slots it dropped; a dense one refuses it.
  const std::string moe_out = (root_ / "bench_moe.json").string();
  const Exit moe =
      iris({"bench", "--train", "--config", test::data_dir() + "/qwen3vlmoe-tiny/config.json",
            "--device", "cpu", "--image", "64", "--seq", "96", "--accumulation", "1", "--steps",
            "1", "--moe-expert-capacity-factor", "0.5", "--json", moe_out});
  ASSERT_EQ(moe.code, 0) << moe.output;
  EXPECT_NE(moe.output.find("MoE slots dropped"), std::string::npos) << moe.output;
  const double share =
      nlohmann::json::parse(std::ifstream(moe_out))["moe_dropped_share"].get<double>();
  EXPECT_GT(share, 0.0);
  EXPECT_LT(share, 1.0);
  const Exit dense_capacity =
      iris({"bench", "--train", "--config", test::fixture_dir() + "/config.json", "--device", "cpu",
            "--moe-expert-capacity-factor", "1"});
  EXPECT_EQ(dense_capacity.code, 2) << dense_capacity.output;
  EXPECT_NE(dense_capacity.output.find("applies to MoE geometries"), std::string::npos)
      << dense_capacity.output;
  // A LoRA step: adapters on the targets, everything else frozen. It counts fewer FLOPs than the
  // full step (no base weight gradients), and a target Iris cannot adapt is a usage error.
  const std::string lora_out = (root_ / "bench_lora.json").string();
  const Exit lora = iris({"bench",          "--train",
                          "--config",       test::fixture_dir() + "/config.json",
                          "--device",       "cpu",
                          "--image",        "64",
                          "--seq",          "96",
                          "--micro",        "2",
                          "--accumulation", "2",
                          "--steps",        "1",
                          "--recompute",    "full",
                          "--lora-rank",    "4",
                          "--lora-targets", "q_proj,v_proj,attn.qkv",
                          "--json",         lora_out});
  ASSERT_EQ(lora.code, 0) << lora.output;
  EXPECT_NE(lora.output.find("LoRA rank 4, alpha 4, on q_proj,v_proj,attn.qkv; the rest frozen"),
            std::string::npos)
      << lora.output;
  const nlohmann::json jl = nlohmann::json::parse(std::ifstream(lora_out));
  EXPECT_EQ(jl["lora_rank"].get<int>(), 4);
  EXPECT_EQ(jl["lora_targets"].get<std::vector<std::string>>(),
            (std::vector<std::string>{"q_proj", "v_proj", "attn.qkv"}));
  const double full_flops = j["model_tflops"].get<double>() * j["step_s"].get<double>(),
               lora_flops = jl["model_tflops"].get<double>() * jl["step_s"].get<double>();
  EXPECT_GT(lora_flops, 0.0);
  EXPECT_LT(lora_flops, full_flops);
  const Exit bad_target =
      iris({"bench", "--train", "--config", test::fixture_dir() + "/config.json", "--device", "cpu",
            "--lora-rank", "4", "--lora-targets", "q_prj"});
  EXPECT_EQ(bad_target.code, 2) << bad_target.output;
  EXPECT_NE(bad_target.output.find("'q_prj'"), std::string::npos) << bad_target.output;
}

// logging.op_profile_step: that iteration runs op by op, its table of device time by op family
// goes to the log, and the step is an interval of its own, kept out of the steady state. Graphs
// (a replay is one launch) and an iteration past the run are refused.
TEST_F(AppTrainTest, OpProfileStepLogsWhereTheStepsDeviceTimeGoes) {
  const std::string recipe = write_recipe(4);
  const fs::path run = root_ / "profiled";
  const Exit e = iris({"train", "--recipe", recipe, "checkpoint.dir=" + run.string(),
                       "logging.op_profile_step=3", "logging.log_interval=2"});
  ASSERT_EQ(e.code, 0) << e.output;
  EXPECT_NE(e.output.find("step profile of iteration 3: "), std::string::npos) << e.output;
  for (const char* family : {"GEMM forward", "GEMM weight gradient", "attention forward",
                             "attention backward", "loss", "optimizer", "idle"})
    EXPECT_NE(e.output.find("  " + std::string(family) + " "), std::string::npos) << family;
  std::ifstream f(run / "metrics.jsonl");
  std::vector<int64_t> profiled;
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("op_profiled_steps", int64_t{0}) > 0) profiled.push_back(j["iteration"]);
  }
  EXPECT_EQ(profiled, std::vector<int64_t>{3});
  // The profiled step's time by model part, which a pipelined run can split its stages by.
  EXPECT_NE(e.output.find("pipeline costs of iteration 3: "), std::string::npos) << e.output;
  std::ifstream costs_file(run / "pipeline_costs.json");
  const auto costs = nlohmann::json::parse(costs_file);
  EXPECT_EQ(costs.at("layers").get<int>(), 3);
  for (const char* key : {"layer_ms", "first_ms", "last_ms"})
    EXPECT_GT(costs.at(key).get<double>(), 0.0) << key;
  const std::vector<std::string> two_stages = {"train", "--recipe", recipe, "--dry-run",
                                               "parallel.pipeline_parallel_size=2"};
  auto with = [&](const std::string& override) {
    std::vector<std::string> args = two_stages;
    args.push_back(override);
    return iris(args);
  };
  const Exit by_run = with("parallel.pipeline_costs=" + (run / "pipeline_costs.json").string());
  EXPECT_EQ(by_run.code, 0) << by_run.output;
  // A vision encoder that costs five layers takes a layer off stage 0 (by FLOPs it holds two).
  const fs::path heavy = root_ / "heavy_vision.json";
  write_file_atomic(heavy.string(), R"({"layer_ms": 1, "first_ms": 5, "last_ms": 0})");
  const Exit by_flops = iris(two_stages),
             by_costs = with("parallel.pipeline_costs=" + heavy.string());
  ASSERT_EQ(by_flops.code, 0) << by_flops.output;
  ASSERT_EQ(by_costs.code, 0) << by_costs.output;
  EXPECT_NE(by_flops.output.find("stage 0/2 (vision, embed, layers 0-1)"), std::string::npos)
      << by_flops.output;
  EXPECT_NE(by_costs.output.find("stage 0/2 (vision, embed, layers 0-0)"), std::string::npos)
      << by_costs.output;
  const Exit graphs = iris({"train", "--recipe", recipe, "--dry-run", "logging.op_profile_step=2",
                            "cuda_graph.cuda_graph_impl=local"});
  EXPECT_NE(graphs.code, 0);
  EXPECT_NE(graphs.output.find("cuda_graph.cuda_graph_impl=none"), std::string::npos)
      << graphs.output;
  const Exit past = iris({"train", "--recipe", recipe, "--dry-run", "logging.op_profile_step=9"});
  EXPECT_NE(past.code, 0);
  EXPECT_NE(past.output.find("logging.op_profile_step 9 is past train.train_iters 4"),
            std::string::npos)
      << past.output;
}

TEST_F(AppTrainTest, ExportGeneratesLikeItsCheckpoint) {
  const std::string recipe = write_recipe(2);
  const fs::path run = root_ / "run";
  const Exit t = iris({"train", "--recipe", recipe, "checkpoint.dir=" + run.string()});
  ASSERT_EQ(t.code, 0) << t.output;
  EXPECT_NE(t.output.find("iter 2/2 | loss "), std::string::npos) << t.output;
  EXPECT_TRUE(fs::exists(run / "resolved_config.yaml"));
  const fs::path out = root_ / "hf", out32 = root_ / "hf32";
  const Exit x = iris({"export", (run / "step_0000002").string(), out.string()});
  ASSERT_EQ(x.code, 0) << x.output;
  // What an export killed with SIGKILL left beside its target goes with the next export there.
  const std::string killed = test::temp_dir_of_killed_process((root_ / "hf_killed").string());
  ASSERT_TRUE(fs::is_directory(killed)) << killed;
  const Exit x32 = iris({"export", run.string(), out32.string(), "--dtype", "f32"});
  ASSERT_EQ(x32.code, 0) << x32.output;
  EXPECT_FALSE(fs::exists(killed));
  EXPECT_FALSE(fs::exists(killed + ".lock"));

  auto generate = [&](const fs::path& model) {
    const Exit g = iris({"generate", "-m", model.string(), "--image",
                         (root_ / "shapes/images/000001.png").string(), "-p", "Describe the image.",
                         "-n", "5", "--temp", "0", "--ignore-eos", "--device", "cpu", "--json"});
    EXPECT_EQ(g.code, 0) << g.output;
    const size_t brace = g.output.rfind("\n{");
    const auto j = nlohmann::json::parse(
        g.output.substr(brace == std::string::npos ? g.output.find('{') : brace + 1));
    return j["tokens"].get<std::vector<int32_t>>();
  };
  // The checkpoint directory itself loads in iris generate; the f32 export is the same model.
  const std::vector<int32_t> from_checkpoint = generate(run / "step_0000002");
  ASSERT_EQ(from_checkpoint.size(), 5u);
  EXPECT_EQ(generate(out32), from_checkpoint);
  // bf16 rounding may flip the near-ties of an untrained model after the first token.
  const std::vector<int32_t> from_bf16 = generate(out);
  ASSERT_EQ(from_bf16.size(), 5u);
  EXPECT_EQ(from_bf16[0], from_checkpoint[0]);

  const Exit again = iris({"export", run.string(), out.string()});
  EXPECT_EQ(again.code, 1);
  EXPECT_NE(again.output.find("already exists"), std::string::npos) << again.output;
}

}  // namespace
}  // namespace iris
