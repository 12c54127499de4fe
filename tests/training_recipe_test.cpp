// Recipes: every shipped recipe validates; unknown keys, wrong types, bad graph combinations,
// tensor parallelism (not supported yet), pipeline split lists and indivisible batches are errors
// that say what to do; overrides apply; the resolved config reads back to itself.
#include <gtest/gtest.h>

#include <unistd.h>
#include <functional>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bridge/model_config.h"
#include "core/error.h"
#include "core/fs.h"
#include "test_util.h"
#include "training/memory_plan.h"
#include "training/pipeline_parallel.h"
#include "training/recipe.h"
#include "training/train_setup.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

// The tests run from the repository root, as the CLI does in the README; shipped recipes name
// their input files relative to themselves.
class RecipeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    old_cwd_ = fs::current_path();
    fs::current_path(fs::path(test::data_dir()).parent_path().parent_path());
  }
  void TearDown() override { fs::current_path(old_cwd_); }
  fs::path old_cwd_;
};

std::string fixture_config() {
  return test::fixture_dir() + "/config.json";
}

// A minimal valid recipe around the tiny fixture.
std::string tiny_recipe() {
  return "model:\n  init: random\n  config: " + fixture_config() +
         "\n  tokenizer: " + test::fixture_dir() + "/tokenizer.json\n" +
         "data:\n  train_files: [data/shapes/train.jsonl]\n"
         "train:\n  micro_batch_size: 2\n  global_batch_size: 8\n  train_iters: 10\n"
         "  seq_length: 64\n";
}

using test::error_of;

#define EXPECT_HAS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "in: " << (text)

TEST_F(RecipeTest, ABareNameIsARecipeInRecipes) {
  const Recipe by_name = load_recipe("qwen3vl_tiny_shapes");
  const Recipe by_path = load_recipe("recipes/qwen3vl_tiny_shapes.yaml");
  EXPECT_EQ(recipe_to_yaml(by_name), recipe_to_yaml(by_path));
  EXPECT_EQ(find_recipe("qwen3vl_tiny_shapes"), "recipes/qwen3vl_tiny_shapes.yaml");
  const std::string msg = error_of([] { load_recipe("qwen3vl_no_such_recipe"); });
  EXPECT_HAS(msg, "recipe qwen3vl_no_such_recipe does not exist");
  EXPECT_HAS(msg, "recipes/qwen3vl_no_such_recipe.yaml");
}

// A path in a recipe file is relative to the file; the same key given as an override is
// relative to the working directory, as the user typed it (model.config too, which once
// resolved against the recipe's folder: recipes/recipes/configs/...).
TEST_F(RecipeTest, AModelConfigOverrideIsRelativeToTheWorkingDirectory) {
  const fs::path dir = test::scratch_dir() / "recipe_paths";
  fs::create_directories(dir);
  fs::copy_file(fixture_config(), dir / "config.json", fs::copy_options::overwrite_existing);
  const std::string recipe = (dir / "r.yaml").string();
  std::string text = tiny_recipe();
  text.replace(text.find(fixture_config()), fixture_config().size(), "config.json");
  std::ofstream(recipe) << text;
  EXPECT_EQ(load_recipe(recipe).model.config_path, (dir / "config.json").string());
  const std::string from_cwd = "tests/data/qwen3vl-tiny/config.json";
  ASSERT_TRUE(fs::is_regular_file(from_cwd));
  EXPECT_EQ(load_recipe(recipe, {"model.config=" + from_cwd}).model.config_path, from_cwd);
}

TEST_F(RecipeTest, EveryShippedRecipeValidatesAndItsResolvedConfigReadsBack) {
  std::vector<fs::path> recipes;
  for (const auto& e : fs::directory_iterator("recipes"))
    if (e.path().extension() == ".yaml") recipes.push_back(e.path());
  ASSERT_GE(recipes.size(), 5u);
  for (const fs::path& p : recipes) {
    SCOPED_TRACE(p.string());
    Recipe r;
    ASSERT_NO_THROW(r = load_recipe(p.string()));
    EXPECT_TRUE(r.has_model_config);
    EXPECT_EQ(r.train.global_batch_size,
              r.train.micro_batch_size * r.accumulation_steps * r.parallel.data_parallel_size);
    const std::string yaml = recipe_to_yaml(r);
    Recipe back;
    ASSERT_NO_THROW(back = load_recipe_text(yaml, "resolved.yaml"));
    EXPECT_EQ(recipe_to_yaml(back), yaml);
  }
}

TEST_F(RecipeTest, SftRecipesShipTheReleasedGeometries) {
  struct Expect {
    const char* recipe;
    int hidden, layers, heads, intermediate, vision_depth, vision_hidden;
    bool tied;
  };
  for (const Expect& e :
       {Expect{"recipes/qwen3vl_2b_sft.yaml", 2048, 28, 16, 6144, 24, 1024, true},
        Expect{"recipes/qwen3vl_4b_sft.yaml", 2560, 36, 32, 9728, 24, 1024, true},
        Expect{"recipes/qwen3vl_8b_sft.yaml", 4096, 36, 32, 12288, 27, 1152, false}}) {
    SCOPED_TRACE(e.recipe);
    const Recipe r = load_recipe(e.recipe);
    const ModelConfig& m = r.model_config;
    EXPECT_EQ(m.text.hidden_size, e.hidden);
    EXPECT_EQ(m.text.num_hidden_layers, e.layers);
    EXPECT_EQ(m.text.num_attention_heads, e.heads);
    EXPECT_EQ(m.text.num_key_value_heads, 8);
    EXPECT_EQ(m.text.head_dim, 128);
    EXPECT_EQ(m.text.intermediate_size, e.intermediate);
    EXPECT_EQ(m.vision.depth, e.vision_depth);
    EXPECT_EQ(m.vision.hidden_size, e.vision_hidden);
    EXPECT_EQ(m.vision.out_hidden_size, e.hidden);
    EXPECT_EQ(m.tie_word_embeddings, e.tied);
    EXPECT_EQ(r.model.init, "pretrained");
    EXPECT_TRUE(r.model.hf_dir.empty());
    // Valid without hf_dir, but the user is told that training needs it.
    bool noted = false;
    for (const std::string& n : r.notes) noted |= n.find("model.hf_dir") != std::string::npos;
    EXPECT_TRUE(noted);
  }
}

// The LoRA recipes: the base frozen whole, adapters of rank 32 on the language projections, and
// the plan of the 8B recipe fits one 80 GiB GPU (adapters' f32 state under 1.5 GiB).
TEST_F(RecipeTest, LoraRecipesAdaptTheLanguageModelAndFitOneGpu) {
  for (const char* name : {"recipes/qwen3vl_2b_lora.yaml", "recipes/qwen3vl_8b_lora.yaml"}) {
    SCOPED_TRACE(name);
    const Recipe r = load_recipe(name);
    EXPECT_TRUE(r.peft.lora());
    EXPECT_EQ(r.model_config.lora.rank, 32);
    EXPECT_FLOAT_EQ(r.model_config.lora.scale(), 1.0f);
    EXPECT_TRUE(r.model_config.lora.adapts("model.language_model.layers.3.mlp.down_proj"));
    EXPECT_FALSE(r.model_config.lora.adapts("model.visual.blocks.3.attn.qkv"));
    const FreezeSpec frozen = recipe_frozen_parts(r);
    EXPECT_TRUE(frozen.frozen("model.language_model.layers.0.self_attn.q_proj.weight"));
    EXPECT_FALSE(frozen.frozen("model.language_model.layers.0.self_attn.q_proj.lora_A.weight"));
  }
  const Recipe r = load_recipe("recipes/qwen3vl_8b_lora.yaml");
  const MemoryPlan plan = plan_training_memory(r, r.model_config, true, int64_t(80) << 30);
  EXPECT_TRUE(plan.fits()) << plan.describe();
}

TEST_F(RecipeTest, UnknownKeysNameTheClosestValidKey) {
  std::string msg =
      error_of([] { load_recipe_text(tiny_recipe() + "  micro_batch: 2\n", "r.yaml"); });
  EXPECT_HAS(msg, "unknown key 'train.micro_batch'");
  EXPECT_HAS(msg, "did you mean 'train.micro_batch_size'");
  EXPECT_HAS(msg, "r.yaml line 12");

  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"optimizer.lrr=0.1"}); });
  EXPECT_HAS(msg, "unknown key 'optimizer.lrr'");
  EXPECT_HAS(msg, "did you mean 'optimizer.lr'");

  // A key in the wrong section still finds its home.
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"optimizer.warmup_iters=5"}); });
  EXPECT_HAS(msg, "did you mean 'schedule.warmup_iters'");

  msg = error_of([] { load_recipe_text(tiny_recipe() + "trian:\n  seed: 1\n", "r.yaml"); });
  EXPECT_HAS(msg, "unknown section 'trian'");
  EXPECT_HAS(msg, "did you mean 'train'");

  msg = error_of(
      [] { load_recipe_text(tiny_recipe(), "r.yaml", {"cuda_graph.cuda_graph_iml=local"}); });
  EXPECT_HAS(msg, "cuda_graph");
  EXPECT_HAS(msg, "cuda_graph_impl");
}

TEST_F(RecipeTest, SuggestionsFollowTheKeysWordsAndMegatronKeysPointHome) {
  // By letters train.seed is nearer; by words checkpoint.keep is checkpoint.keep_last.
  std::string msg =
      error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"checkpoint.keep=2"}); });
  EXPECT_HAS(msg, "did you mean 'checkpoint.keep_last'");
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"schedule.warmup=3"}); });
  EXPECT_HAS(msg, "did you mean 'schedule.warmup_iters'");
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"frobnicate.knob=1"}); });
  EXPECT_HAS(msg, "no key is close to it");
  // The setting named is the key's last part; the section is the likelier slip. By letters and
  // by the section's word train.seed would win.
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"train.lr=1e-3"}); });
  EXPECT_HAS(msg, "did you mean 'optimizer.lr'");
  // A key whose last part holds the one typed comes before the section's other keys.
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"optimizer.warmup=3"}); });
  EXPECT_HAS(msg, "did you mean 'schedule.warmup_iters'");
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"data.micro_batch_size=3"}); });
  EXPECT_HAS(msg, "did you mean 'train.micro_batch_size'");
  // Keys Megatron-Bridge users type.
  msg = error_of(
      [] { load_recipe_text(tiny_recipe(), "r.yaml", {"model.tensor_model_parallel_size=2"}); });
  EXPECT_HAS(msg, "is a Megatron-Bridge key; use parallel.tensor_parallel_size");
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"checkpoint.save=/x"}); });
  EXPECT_HAS(msg, "use checkpoint.dir");
  msg = error_of(
      [] { load_recipe_text(tiny_recipe(), "r.yaml", {"checkpoint.pretrained_checkpoint=/x"}); });
  EXPECT_HAS(msg, "use model.hf_dir");
  msg =
      error_of([] { load_recipe_text(tiny_recipe() + "logger:\n  wandb_project: x\n", "r.yaml"); });
  EXPECT_HAS(msg,
             "'logger.wandb_project' (r.yaml line 13) is a Megatron-Bridge key; not supported");
}

// What an override gets wrong is the command line's (iris train exits with 2 for a UsageError);
// what the recipe file gets wrong is the recipe's (1).
TEST_F(RecipeTest, OverrideMistakesAreUsageErrorsAndTheFilesAreNot) {
  for (const std::string& bad :
       {"train.lr=1e-3", "train.train_iters=many", "no_equals_sign", "train=3", "train..seed=1"}) {
    EXPECT_THROW(load_recipe_text(tiny_recipe(), "r.yaml", {bad}), UsageError) << bad;
  }
  for (const std::string& file :
       {tiny_recipe() + "  micro_batch: 2\n", tiny_recipe() + "  seed: many\n"}) {
    bool usage = false, error = false;
    try {
      load_recipe_text(file, "r.yaml");
    } catch (const UsageError&) {
      usage = true;
    } catch (const Error&) {
      error = true;
    }
    EXPECT_TRUE(error && !usage) << file;
  }
}

TEST_F(RecipeTest, ATypoInsideAnInlineModelConfigIsAnError) {
  const std::string recipe = "model:\n  init: random\n  tokenizer: " + test::fixture_dir() +
                             "/tokenizer.json\n  config:\n    text_config:\n" +
                             "      num_hiden_layers: 2\ndata:\n  train_files: [a.jsonl]\n";
  const std::string msg = error_of([&] { load_recipe_text(recipe, "r.yaml"); });
  EXPECT_HAS(msg, "model.config.text_config.num_hiden_layers is not a config.json field");
  EXPECT_HAS(msg, "did you mean 'num_hidden_layers'");
}

TEST_F(RecipeTest, InputPathsAreRelativeToTheRecipeFileAndOverridesToTheWorkingDirectory) {
  const fs::path dir =
      fs::temp_directory_path() / ("iris_recipe_paths_" + std::to_string(::getpid()));
  fs::create_directories(dir / "sub");
  fs::copy_file(fixture_config(), dir / "config.json", fs::copy_options::overwrite_existing);
  std::ofstream(dir / "sub" / "r.yaml")
      << "model:\n  init: random\n  config: ../config.json\n  tokenizer: ../tok.json\n"
         "data:\n  train_files: [data/train.jsonl, /abs/b.jsonl]\n  image_root: imgs\n"
         "checkpoint:\n  dir: runs/x\n";
  const std::string recipe = (dir / "sub" / "r.yaml").string();
  const Recipe r = load_recipe(recipe);
  EXPECT_EQ(r.model.tokenizer, (dir / "tok.json").string());
  EXPECT_EQ(r.data.config.train_files,
            (std::vector<std::string>{(dir / "sub/data/train.jsonl").string(), "/abs/b.jsonl"}));
  EXPECT_EQ(r.data.config.image_root, (dir / "sub/imgs").string());
  EXPECT_EQ(r.checkpoint.dir, "runs/x");  // an output: relative to the working directory
  const Recipe o = load_recipe(recipe, {"data.train_files=[mine.jsonl]", "model.tokenizer=t.json"});
  EXPECT_EQ(o.data.config.train_files, std::vector<std::string>{"mine.jsonl"});
  EXPECT_EQ(o.model.tokenizer, "t.json");
  fs::remove_all(dir);
}

TEST_F(RecipeTest, OutputFilesStayInsideTheRunDirectory) {
  const auto error = [](const std::string& override_arg) {
    return error_of([&] { load_recipe_text(tiny_recipe(), "r.yaml", {override_arg}); });
  };
  EXPECT_HAS(error("logging.metrics_file=../../notes.txt"),
             "recipe: logging.metrics_file '../../notes.txt' leaves the run directory "
             "(checkpoint.dir) through '..'");
  EXPECT_HAS(error("logging.plot=logs/../../plot.svg"), "recipe: logging.plot");
  EXPECT_HAS(error("logging.plot=/tmp/plot.svg"),
             "recipe: logging.plot '/tmp/plot.svg' is an absolute path");
  EXPECT_HAS(error("logging.metrics_file=/dev/full"), "is an absolute path");
  // Nor may they take over what the run directory keeps for itself, or each other.
  EXPECT_HAS(error("logging.plot=latest"), "would take over latest");
  EXPECT_HAS(error("logging.metrics_file=iris.lock"), "would take over iris.lock");
  EXPECT_HAS(error("logging.metrics_file=step_0000010/m.jsonl"), "would take over step_0000010");
  EXPECT_HAS(error("logging.plot=resolved_config.yaml"), "would take over resolved_config.yaml");
  EXPECT_HAS(error("logging.plot=metrics.jsonl"), "give them different names");
  // Files inside it, in a sub-folder too, and off.
  const Recipe r = load_recipe_text(tiny_recipe(), "r.yaml",
                                    {"logging.metrics_file=logs/m.jsonl", "logging.plot=''"});
  EXPECT_EQ(r.logging.metrics_file, "logs/m.jsonl");
  EXPECT_EQ(r.logging.plot, "");
}

TEST_F(RecipeTest, ScheduleErrorsNameRecipeKeys) {
  const std::string msg = error_of([] {
    load_recipe_text(tiny_recipe(), "r.yaml", {"train.train_iters=6", "schedule.warmup_iters=20"});
  });
  EXPECT_HAS(msg, "train.train_iters (6) must exceed schedule.warmup_iters (20)");
  EXPECT_EQ(msg.find("total_steps"), std::string::npos) << msg;
  EXPECT_HAS(
      error_of([] {
        load_recipe_text(tiny_recipe(), "r.yaml", {"optimizer.lr=1e-4", "optimizer.min_lr=1e-3"});
      }),
      "optimizer.min_lr 0.001 must be in [0, optimizer.lr = 0.0001]");
}

TEST_F(RecipeTest, CudaGraphSectionTakesListsAndNullsAndRefusesMaps) {
  const Recipe r = load_recipe_text(tiny_recipe() +
                                        "cuda_graph:\n  cuda_graph_impl: Local\n"
                                        "  cuda_graph_modules: [attn, mlp]\n"
                                        "  cuda_graph_warmup_steps: 2\n"
                                        "  vision_cuda_graph_impl: local\n"
                                        "  vision_cuda_graph_modules:\n    - attn\n    - mlp\n"
                                        "  vision_cuda_graph_buckets: [1024, 2304, 4608]\n"
                                        "  max_vision_cuda_graph_seq_length: 4608\n"
                                        "  vision_cuda_graph_overflow: ~\n",
                                    "r.yaml");
  EXPECT_EQ(r.cuda_graph.language.impl, GraphImpl::local);
  EXPECT_EQ(r.cuda_graph.language.modules.size(), 2u);
  EXPECT_EQ(r.cuda_graph.language.warmup_steps, 2);
  EXPECT_EQ(r.cuda_graph.vision.buckets, (std::vector<int64_t>{1024, 2304, 4608}));
  EXPECT_EQ(r.cuda_graph.vision.overflow, VisionGraphOverflow::eager);  // null: the default
  const std::string yaml = recipe_to_yaml(r);
  EXPECT_HAS(yaml, "cuda_graph_modules: [attn, mlp]");
  EXPECT_HAS(yaml, "vision_cuda_graph_buckets: [1024, 2304, 4608]");
  EXPECT_HAS(yaml, "cuda_graph_warmup_steps: 2");
  // The resolved config loads back to the same graph settings.
  const Recipe back = load_recipe_text(yaml, "resolved.yaml");
  EXPECT_EQ(graph_config_values(back.cuda_graph), graph_config_values(r.cuda_graph));
  EXPECT_HAS(error_of([] {
               load_recipe_text(tiny_recipe() + "cuda_graph:\n  cuda_graph_modules: {attn: 1}\n",
                                "r.yaml");
             }),
             "cuda_graph.cuda_graph_modules must be a value or a list of values, got a map");
  EXPECT_HAS(error_of([] {
               load_recipe_text(tiny_recipe() + "cuda_graph:\n  cuda_graph_modules: [[attn]]\n",
                                "r.yaml");
             }),
             "nested lists and maps are not valid");
}

TEST_F(RecipeTest, WrongTypesNameTheKeyAndTheExpectedType) {
  struct Case {
    const char* override_text;
    const char* expect;
  };
  for (const Case& c :
       {Case{"train.train_iters=abc", "train.train_iters expects an integer, got 'abc'"},
        Case{"train.train_iters=2.5", "train.train_iters expects an integer"},
        Case{"train.freeze_merger=maybe", "train.freeze_merger expects a boolean"},
        Case{"optimizer.lr=fast", "optimizer.lr expects a number, got 'fast'"},
        Case{"optimizer.betas=0.9", "optimizer.betas expects a list of numbers"},
        Case{"schedule.kind=linear", "schedule.kind expects one of constant|cosine"},
        Case{"data.train_files={a: b}", "data.train_files expects a list of paths"},
        Case{"data.mock_image_sizes=[[1,2,3]]",
             "data.mock_image_sizes expects a list of [width, height] pairs"}}) {
    SCOPED_TRACE(c.override_text);
    const std::string msg =
        error_of([&] { load_recipe_text(tiny_recipe(), "r.yaml", {c.override_text}); });
    EXPECT_HAS(msg, c.expect);
    EXPECT_HAS(msg, std::string("override '") + c.override_text + "'");
  }
  const std::string msg =
      error_of([] { load_recipe_text(tiny_recipe() + "  seed: [1]\n", "r.yaml"); });
  EXPECT_HAS(msg, "train.seed expects an integer, got '[1]' (r.yaml line 12)");
}

// Megatron's capacity keys: they reach the trainer's limits, the 'moe' graph module needs them
// with padding, and each is refused where it would do nothing.
TEST_F(RecipeTest, MoeCapacityKeysAreMegatronsAndRefusedWhereTheyWouldDoNothing) {
  const std::string moe = "model.config=" + test::data_dir() + "/qwen3vlmoe-tiny/config.json";
  const Recipe r = load_recipe_text(
      tiny_recipe(), "r.yaml",
      {moe, "model.moe_expert_capacity_factor=1.25", "model.moe_pad_expert_input_to_capacity=true",
       "model.moe_token_drop_policy=position", "cuda_graph.cuda_graph_impl=local",
       "cuda_graph.cuda_graph_modules=[attn,moe]"});
  EXPECT_EQ(r.model.moe_expert_capacity_factor, 1.25);
  EXPECT_TRUE(r.model.moe_pad_expert_input_to_capacity);
  EXPECT_EQ(r.model.moe_token_drop_policy, "position");
  // Dropless MoE graphs the router and the permutation, not the whole layer.
  std::string msg = error_of([&] {
    load_recipe_text(
        tiny_recipe(), "r.yaml",
        {moe, "cuda_graph.cuda_graph_impl=local", "cuda_graph.cuda_graph_modules=[moe]"});
  });
  EXPECT_HAS(msg, "model.moe_pad_expert_input_to_capacity=true");
  msg = error_of([&] {
    load_recipe_text(tiny_recipe(), "r.yaml",
                     {moe, "model.moe_expert_capacity_factor=1", "cuda_graph.cuda_graph_impl=local",
                      "cuda_graph.cuda_graph_modules=[moe]"});
  });
  EXPECT_HAS(msg, "moe_router,moe_preprocess");
  EXPECT_NO_THROW(load_recipe_text(tiny_recipe(), "r.yaml",
                                   {moe, "cuda_graph.cuda_graph_impl=local",
                                    "cuda_graph.cuda_graph_modules=[moe_router,moe_preprocess]"}));
  // Nothing to pad to, no policy without drops, no capacity without experts, no negative one.
  msg = error_of([&] {
    load_recipe_text(tiny_recipe(), "r.yaml", {moe, "model.moe_pad_expert_input_to_capacity=true"});
  });
  EXPECT_HAS(msg, "set model.moe_expert_capacity_factor");
  msg = error_of([&] {
    load_recipe_text(tiny_recipe(), "r.yaml", {moe, "model.moe_token_drop_policy=position"});
  });
  EXPECT_HAS(msg, "nothing drops");
  msg = error_of(
      [&] { load_recipe_text(tiny_recipe(), "r.yaml", {"model.moe_expert_capacity_factor=1"}); });
  EXPECT_HAS(msg, "has no MoE layers");
  msg = error_of([&] {
    load_recipe_text(tiny_recipe(), "r.yaml", {moe, "model.moe_expert_capacity_factor=-1"});
  });
  EXPECT_HAS(msg, "must be >= 0");
  msg = error_of([&] {
    load_recipe_text(tiny_recipe(), "r.yaml", {moe, "model.moe_token_drop_policy=random"});
  });
  EXPECT_HAS(msg, "probs");
}

TEST_F(RecipeTest, CudaGraphSectionIsValidatedOnTheCpu) {
  // Model-independent: full_iteration takes no module list.
  std::string msg = error_of([] {
    load_recipe_text(tiny_recipe() +
                         "cuda_graph:\n  cuda_graph_impl: full_iteration\n"
                         "  cuda_graph_modules: [attn]\n",
                     "r.yaml");
  });
  EXPECT_HAS(msg, "cuda_graph");
  // Model-dependent: the fixture has no MoE layers.
  msg = error_of([] {
    load_recipe_text(tiny_recipe(), "r.yaml",
                     {"cuda_graph.cuda_graph_impl=local", "cuda_graph.cuda_graph_modules=[moe]"});
  });
  EXPECT_HAS(msg, "MoE");
  // Deepstack needs whole merge windows.
  msg = error_of([] {
    load_recipe_text(tiny_recipe(), "r.yaml",
                     {"cuda_graph.vision_cuda_graph_impl=local",
                      "cuda_graph.max_vision_cuda_graph_seq_length=1030"});
  });
  EXPECT_HAS(msg, "not divisible by 4");

  // A valid combination resolves, modules included.
  const Recipe r = load_recipe_text(tiny_recipe(), "r.yaml",
                                    {"cuda_graph.vision_cuda_graph_impl=local",
                                     "cuda_graph.max_vision_cuda_graph_seq_length=1024",
                                     "cuda_graph.vision_cuda_graph_modules=[attn,mlp]"});
  EXPECT_EQ(r.cuda_graph.vision.impl, VisionGraphImpl::local);
  EXPECT_EQ(r.cuda_graph.vision.max_seq_length, 1024);
  EXPECT_FALSE(r.cuda_graph.vision.buckets.empty());
  EXPECT_EQ(r.cuda_graph.vision.modules.size(), 2u);
  EXPECT_HAS(recipe_to_yaml(r), "vision_cuda_graph_impl: local");
  // Modules without the impl they select parts of would do nothing: refused, naming the fix.
  msg = error_of([] {
    load_recipe_text(tiny_recipe(), "r.yaml", {"cuda_graph.vision_cuda_graph_modules=[attn]"});
  });
  EXPECT_HAS(msg, "set vision_cuda_graph_impl=local");
  msg = error_of(
      [] { load_recipe_text(tiny_recipe(), "r.yaml", {"cuda_graph.cuda_graph_modules=[mlp]"}); });
  EXPECT_HAS(msg, "set cuda_graph_impl=local");
}

TEST_F(RecipeTest, TensorParallelIsNotSupportedYetAndPipelineKeysAreChecked) {
  std::string msg = error_of(
      [] { load_recipe_text(tiny_recipe(), "r.yaml", {"parallel.tensor_parallel_size=2"}); });
  EXPECT_HAS(msg, "parallel.tensor_parallel_size");
  EXPECT_HAS(msg, "not supported yet");
  // Pipeline parallelism is accepted; its split list must have one positive count per stage.
  const Recipe pp =
      load_recipe_text(tiny_recipe(), "r.yaml",
                       {"parallel.pipeline_parallel_size=2", "parallel.pipeline_layers=[1, 2]"});
  EXPECT_EQ(pp.parallel.pipeline_parallel_size, 2);
  EXPECT_EQ(pp.parallel.pipeline_layers, (std::vector<double>{1, 2}));
  // Checked against the model's layers when the recipe loads, before any process is launched.
  msg = error_of([] {
    load_recipe_text(tiny_recipe(), "r.yaml",
                     {"parallel.pipeline_parallel_size=2", "parallel.pipeline_layers=[1, 3]"});
  });
  EXPECT_HAS(msg, "recipe: parallel.pipeline_layers [1, 3] holds 4 layers but the model has 3");
  msg = error_of(
      [] { load_recipe_text(tiny_recipe(), "r.yaml", {"parallel.pipeline_parallel_size=4"}); });
  EXPECT_HAS(msg, "parallel.pipeline_parallel_size 4 is more stages than the model's 3");
  msg = error_of([] {
    load_recipe_text(tiny_recipe(), "r.yaml",
                     {"parallel.pipeline_parallel_size=2", "parallel.pipeline_layers=[4]"});
  });
  EXPECT_HAS(msg, "parallel.pipeline_layers lists 1 stages");
  msg = error_of([] {
    load_recipe_text(tiny_recipe(), "r.yaml",
                     {"parallel.pipeline_parallel_size=2", "parallel.pipeline_layers=[1.5, 2]"});
  });
  EXPECT_HAS(msg, "parallel.pipeline_layers entries are layer counts");
  // The sharded optimizer combines with stages: each stage's replicas shard its state.
  const Recipe zero = load_recipe_text(
      tiny_recipe(), "r.yaml", {"parallel.pipeline_parallel_size=2", "optimizer.distributed=true"});
  EXPECT_TRUE(zero.optimizer.distributed);
  EXPECT_EQ(zero.parallel.sharding, "optimizer");
  EXPECT_EQ(zero.parallel.pipeline_parallel_size, 2);
  // parallel.sharding is Megatron-FSDP's name for it.
  const Recipe named = load_recipe_text(tiny_recipe(), "r.yaml", {"parallel.sharding=optimizer"});
  EXPECT_TRUE(named.optimizer.distributed);
  EXPECT_FALSE(load_recipe_text(tiny_recipe(), "r.yaml", {}).optimizer.distributed);
  const Recipe grads =
      load_recipe_text(tiny_recipe(), "r.yaml", {"parallel.sharding=optimizer_grads"});
  EXPECT_TRUE(grads.optimizer.distributed);
  EXPECT_EQ(grads.parallel.sharding, "optimizer_grads");
  const Recipe params =
      load_recipe_text(tiny_recipe(), "r.yaml", {"parallel.sharding=optimizer_grads_params"});
  EXPECT_TRUE(params.optimizer.distributed);
  // Weight sharding shards the layers' trainable weights: frozen ones are refused, by name.
  for (const char* freeze : {"train.freeze_language_model=true", "peft.type=lora"}) {
    msg = error_of([freeze] {
      load_recipe_text(tiny_recipe(), "r.yaml",
                       {"parallel.sharding=optimizer_grads_params", freeze});
    });
    EXPECT_HAS(msg, std::string(freeze).substr(0, std::string(freeze).find('=')));
    EXPECT_HAS(msg, "use parallel.sharding=optimizer_grads");
  }
  // Sharding by layer exchanges each layer between the layers' graphs, on pipeline stages too.
  for (const char* mode :
       {"parallel.sharding=optimizer_grads", "parallel.sharding=optimizer_grads_params"}) {
    EXPECT_EQ(load_recipe_text(tiny_recipe(), "r.yaml", {mode, "parallel.pipeline_parallel_size=2"})
                  .parallel.pipeline_parallel_size,
              2);
    msg = error_of([mode] {
      load_recipe_text(tiny_recipe(), "r.yaml",
                       {mode, "cuda_graph.cuda_graph_impl=full_iteration"});
    });
    EXPECT_HAS(msg, "use cuda_graph_impl=local (per-layer graphs)");
  }
  // Activation offload: none or all alone, or names the recompute mode keeps per layer; not on
  // pipeline stages or under a full_iteration graph, by name.
  EXPECT_TRUE(recipe_offloaded_activations(load_recipe_text(tiny_recipe(), "r.yaml", {})).empty());
  EXPECT_EQ(
      recipe_offloaded_activations(load_recipe_text(
          tiny_recipe(), "r.yaml", {"train.recompute=full", "train.offload_activations=all"})),
      std::vector<std::string>{"x_in"});
  EXPECT_EQ(recipe_offloaded_activations(load_recipe_text(
                tiny_recipe(), "r.yaml", {"train.offload_activations=[act, x_in]"})),
            (std::vector<std::string>{"act", "x_in"}));
  for (const auto& refused : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"train.offload_activations=[all, act]"}, "none, all, or a list"},
           {{"train.offload_activations=[act, act]"}, "names 'act' twice"},
           {{"train.recompute=selective", "train.offload_activations=[act]"},
            "keep with train.recompute=selective; those are: x_in, rstd1"},
           {{"train.offload_activations=all", "cuda_graph.cuda_graph_impl=full_iteration"},
            "use cuda_graph_impl=local (per-layer graphs) or train.offload_activations=none"}}) {
    msg = error_of([&refused] { load_recipe_text(tiny_recipe(), "r.yaml", refused.first); });
    EXPECT_HAS(msg, refused.second);
  }
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"parallel.sharding=zero3"}); });
  EXPECT_HAS(msg, "parallel.sharding");
  // Data parallelism is the launcher's business (checked when the run starts, against it).
  const Recipe r = load_recipe_text(
      tiny_recipe(), "r.yaml",
      {"parallel.data_parallel_size=2", "train.global_batch_size=4", "train.micro_batch_size=1"});
  EXPECT_EQ(r.parallel.data_parallel_size, 2);
  EXPECT_EQ(r.accumulation_steps, 2);
  msg = error_of(
      [] { load_recipe_text(tiny_recipe(), "r.yaml", {"parallel.data_parallel_size=0"}); });
  EXPECT_HAS(msg, "parallel.data_parallel_size must be >= 1");
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"parallel.timeout_seconds=0"}); });
  EXPECT_HAS(msg, "parallel.timeout_seconds must be >= 1");
}

// The automatic split puts the least work on its busiest stage, counting the vision encoder on
// stage 0 and the lm_head on the last; a given split must cover the model's layers exactly.
TEST_F(RecipeTest, PipelineSplitBalancesTheStagesAndChecksTheLayerList) {
  const ModelConfig cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  ASSERT_EQ(cfg.text.num_hidden_layers, 3);
  auto layers = [&](const std::vector<double>& given, PipelineCosts c) {
    std::vector<int> out;
    for (const PipelineStage& st : pipeline_split(cfg, 2, given, c)) {
      EXPECT_EQ(st.has_vision, st.index == 0);
      EXPECT_EQ(st.has_head, st.index == 1);
      out.push_back(st.n_layers());
    }
    return out;
  };
  EXPECT_EQ(layers({}, {1, 0, 0}), (std::vector<int>{1, 2}));    // a tie: the earliest
  EXPECT_EQ(layers({}, {1, 1.5, 0}), (std::vector<int>{1, 2}));  // a heavy vision encoder
  EXPECT_EQ(layers({}, {1, 0, 1.5}), (std::vector<int>{2, 1}));  // a heavy lm_head
  EXPECT_EQ(layers({2, 1}, {1, 0, 1e9}), (std::vector<int>{2, 1}));
  EXPECT_HAS(error_of([&] {
               pipeline_split(cfg, 2, {1, 1}, {});
             }),
             "parallel.pipeline_layers [1, 1] holds 2 layers but the model has 3");
  EXPECT_HAS(error_of([&] { pipeline_split(cfg, 4, {}, {}); }),
             "parallel.pipeline_parallel_size 4 is more stages than the model's 3");
}

TEST_F(RecipeTest, GlobalBatchMustBeAMultipleOfMicroBatchTimesDataParallel) {
  std::string msg =
      error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"train.global_batch_size=5"}); });
  EXPECT_HAS(msg, "train.global_batch_size 5 is not divisible by train.micro_batch_size 2");
  EXPECT_HAS(msg, "use 4 or 6");
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"train.global_batch_size=1"}); });
  EXPECT_HAS(msg, "; use 2");
  EXPECT_EQ(msg.find(" or "), std::string::npos) << msg;

  const Recipe r = load_recipe_text(tiny_recipe(), "r.yaml", {"train.global_batch_size=12"});
  EXPECT_EQ(r.accumulation_steps, 6);
}

TEST_F(RecipeTest, DottedOverridesApplyInOrder) {
  const Recipe r = load_recipe_text(
      tiny_recipe(), "r.yaml",
      {"train.train_iters=7", "optimizer.lr=3e-4", "optimizer.betas=[0.8, 0.9]",
       "train.freeze_vision_tower=true", "data.train_files=[a.jsonl, b.jsonl]",
       "checkpoint.dir=/tmp/iris-run", "schedule.kind=constant", "train.train_iters=9",
       "model.init_seed=42", "data.on_bad_sample=error", "data.mock_image_sizes=[[64, 32]]"});
  EXPECT_EQ(r.train.train_iters, 9);  // the later override wins
  EXPECT_DOUBLE_EQ(r.optimizer.lr, 3e-4);
  EXPECT_EQ(r.optimizer.betas, (std::vector<double>{0.8, 0.9}));
  EXPECT_TRUE(r.train.freeze_vision_tower);
  EXPECT_EQ(r.data.config.train_files, (std::vector<std::string>{"a.jsonl", "b.jsonl"}));
  EXPECT_EQ(r.checkpoint.dir, "/tmp/iris-run");
  EXPECT_EQ(r.schedule.kind, "constant");
  EXPECT_EQ(r.model.init_seed, 42);
  EXPECT_EQ(r.data.config.on_bad_sample, DataConfig::OnBad::error);
  ASSERT_EQ(r.data.config.mock_image_sizes.size(), 1u);
  EXPECT_EQ(r.data.config.mock_image_sizes[0][0], 64);
  EXPECT_EQ(r.data.config.mock_image_sizes[0][1], 32);
  // The train section's seq_length and seed feed the data config.
  EXPECT_EQ(r.data.config.seq_length, 64);
  EXPECT_EQ(r.data.config.seed, 1234u);
  ASSERT_EQ(r.overrides.size(), 11u);
  EXPECT_EQ(r.overrides[0].first, "train.train_iters");
}

TEST_F(RecipeTest, InlineModelConfigTakesDeepOverrides) {
  const std::string inline_recipe =
      "model:\n  init: random\n  tokenizer: t.json\n  config:\n"
      "    text_config: {hidden_size: 64, intermediate_size: 128, num_hidden_layers: 3,\n"
      "      num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, vocab_size: 1000,\n"
      "      rope_parameters: {mrope_section: [2, 3, 3]}}\n"
      "    vision_config: {depth: 2, hidden_size: 32, intermediate_size: 64, num_heads: 2,\n"
      "      out_hidden_size: 64, num_position_embeddings: 64, deepstack_visual_indexes: [0]}\n"
      "data:\n  train_files: [x.jsonl]\ntrain:\n  seq_length: 64\n";
  const Recipe r = load_recipe_text(
      inline_recipe, "r.yaml",
      {"model.config.text_config.num_hidden_layers=2", "model.config.tie_word_embeddings=true"});
  EXPECT_EQ(r.model_config.text.num_hidden_layers, 2);
  EXPECT_EQ(r.model_config.text.vocab_size, 1000);
  EXPECT_TRUE(r.model_config.tie_word_embeddings);
  const Recipe back = load_recipe_text(recipe_to_yaml(r), "resolved.yaml");
  EXPECT_EQ(back.model_config.text.num_hidden_layers, 2);
  EXPECT_EQ(recipe_to_yaml(back), recipe_to_yaml(r));

  const std::string msg = error_of([] {
    load_recipe_text(tiny_recipe(), "r.yaml", {"model.config.text_config.hidden_size=8"});
  });
  EXPECT_HAS(msg, "model.config is a path");
}

// A randomly initialised model has no preprocessor file: the patch geometry of its images comes
// from its vision_config, or its pixel rows would not match its patch embedding.
TEST_F(RecipeTest, PreprocessorFollowsTheModelsPatchGeometry) {
  const std::string inline_recipe =
      "model:\n  init: random\n  tokenizer: t.json\n  config:\n"
      "    text_config: {hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,\n"
      "      num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, vocab_size: 1000,\n"
      "      rope_parameters: {mrope_section: [2, 3, 3]}}\n"
      "    vision_config: {depth: 1, hidden_size: 32, intermediate_size: 64, num_heads: 2,\n"
      "      out_hidden_size: 64, num_position_embeddings: 64, patch_size: 4,\n"
      "      deepstack_visual_indexes: [0]}\n"
      "data:\n  train_files: [x.jsonl]\n  min_pixels: 4096\n  max_pixels: 4096\n"
      "train:\n  seq_length: 128\n";
  const PreprocessorConfig pp = recipe_preprocessor(load_recipe_text(inline_recipe, "r.yaml"));
  EXPECT_EQ(pp.patch_size, 4);
  EXPECT_EQ(pp.merge_size, 2);
  EXPECT_EQ(pp.temporal_patch_size, 2);
  EXPECT_EQ(pp.min_pixels, 4096);
  const PreprocessorConfig pp8 = recipe_preprocessor(
      load_recipe_text(inline_recipe, "r.yaml", {"model.config.vision_config.patch_size=8"}));
  EXPECT_EQ(pp8.patch_size, 8);
}

// Every value that changes what the model computes is compared when a run meets a checkpoint
// (resume, or model.hf_dir against model.config): a change to one of them is refused naming it,
// where a resume used to train the checkpoint's model and record the other.
TEST_F(RecipeTest, AnyChangeToWhatTheModelComputesIsRefusedNamingTheField) {
  const ModelConfig base = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  check_same_model_geometry(base, base, "a", "b", "fix");
  const std::pair<const char*, std::function<void(ModelConfig&)>> changes[] = {
      {"text_config.rope_theta is", [](ModelConfig& c) { c.text.rope_theta = 10000; }},
      {"text_config.rms_norm_eps is", [](ModelConfig& c) { c.text.rms_norm_eps = 1e-5f; }},
      {"text_config.mrope_section is [2, 3, 3] in a but [3, 3, 2]",
       [](ModelConfig& c) {
         c.text.mrope_section = {3, 3, 2};
       }},
      {"vision_config.deepstack_visual_indexes is [0, 2] in a but [1, 2]",
       [](ModelConfig& c) {
         c.vision.deepstack_visual_indexes = {1, 2};
       }},
      {"vision_config.patch_size is 16 in a but 8",
       [](ModelConfig& c) { c.vision.patch_size = 8; }},
      {"model_type is qwen3_vl in a but qwen2_vl",
       [](ModelConfig& c) { c.model_type = "qwen2_vl"; }},
  };
  for (const auto& [want, change] : changes) {
    ModelConfig other = base;
    change(other);
    const std::string msg =
        error_of([&] { check_same_model_geometry(base, other, "a", "b", "fix it"); });
    EXPECT_HAS(msg, want);
    EXPECT_HAS(msg, "; fix it");
  }
}

TEST_F(RecipeTest, ModelSectionRules) {
  std::string msg = error_of([] {
    load_recipe_text("model:\n  init: random\n  tokenizer: t.json\ndata:\n  train_files: [x]\n",
                     "r.yaml");
  });
  EXPECT_HAS(msg, "model.config is not set");
  msg = error_of(
      [] { load_recipe_text(tiny_recipe(), "r.yaml", {"model.hf_dir=" + test::fixture_dir()}); });
  EXPECT_HAS(msg, "model.init=pretrained");
  // Pretrained: the geometry check catches a config of another model.
  msg = error_of([] {
    load_recipe_text(tiny_recipe(), "r.yaml",
                     {"model.init=pretrained", "model.hf_dir=" + test::fixture_dir(),
                      "model.config=recipes/configs/qwen3vl_2b.json"});
  });
  EXPECT_HAS(msg, "text_config.hidden_size is 2048");
  EXPECT_HAS(msg, "different model");
  // Pretrained with a matching checkpoint: the tokenizer defaults to the checkpoint's.
  const Recipe r = load_recipe_text(
      tiny_recipe(), "r.yaml",
      {"model.init=pretrained", "model.hf_dir=" + test::fixture_dir(), "model.tokenizer="});
  EXPECT_EQ(r.model.tokenizer, test::fixture_dir() + "/tokenizer.json");
  EXPECT_EQ(r.model_config.text.hidden_size, 64);
  msg = error_of(
      [] { load_recipe_text(tiny_recipe(), "r.yaml", {"model.config=no/such/config.json"}); });
  EXPECT_HAS(msg, "does not exist");
}

TEST_F(RecipeTest, ValueRangesAreChecked) {
  struct Case {
    const char* override_text;
    const char* expect;
  };
  for (const Case& c :
       {Case{"optimizer.lr=0", "optimizer.lr must be > 0"},
        Case{"optimizer.min_lr=1", "optimizer.min_lr 1 must be in [0"},
        Case{"optimizer.vision_lr=-1", "optimizer.vision_lr must be >= 0"},
        Case{"optimizer.merger_lr=-0.5", "optimizer.merger_lr must be >= 0"},
        Case{"optimizer.vision_lr=0.01", ""}, Case{"optimizer.betas=[0.9]", "expects 2 numbers"},
        Case{"optimizer.betas=[0.9, 1.0]", "must be in [0, 1)"},
        Case{"train.micro_batch_size=0", "train.micro_batch_size must be >= 1"},
        Case{"logging.log_interval=0", "logging.log_interval must be >= 1"},
        Case{"train.freeze_vision_tower=true", ""},
        Case{"train.seq_length=100000", "max_position_embeddings"},
        Case{"train.eval_interval=5", "data.eval_files is empty"}, Case{"data.min_pixels=5000", ""},
        Case{"train.max_vision_patches=6", "must be a multiple of 4 (whole merge windows); use 8"},
        Case{"train.max_vision_patches=64", ""}}) {
    SCOPED_TRACE(c.override_text);
    if (std::string(c.expect).empty()) {
      EXPECT_NO_THROW(load_recipe_text(tiny_recipe(), "r.yaml", {c.override_text}));
      continue;
    }
    EXPECT_HAS(error_of([&] { load_recipe_text(tiny_recipe(), "r.yaml", {c.override_text}); }),
               c.expect);
  }
  EXPECT_HAS(error_of([] {
               load_recipe_text(tiny_recipe(), "r.yaml",
                                {"train.freeze_vision_tower=true", "train.freeze_merger=true",
                                 "train.freeze_language_model=true"});
             }),
             "nothing to train");
  EXPECT_HAS(
      error_of([] {
        load_recipe_text(tiny_recipe(), "r.yaml", {"data.min_pixels=9000", "data.max_pixels=4096"});
      }),
      "exceeds data.max_pixels");
  EXPECT_HAS(error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"train"}); }),
             "must look like section.key=value");
  EXPECT_HAS(error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"train=1"}); }),
             "must name a key inside a section");
  EXPECT_HAS(error_of([] { load_recipe_text("train: [1, 2]\n", "r.yaml"); }), "must be a map");
  EXPECT_HAS(error_of([] { load_recipe_text("train: {a: [\n", "r.yaml"); }), "not valid YAML");
}

TEST_F(RecipeTest, YamlAliasesAreRefused) {
  // A map that contains itself recursed forever when model.config became JSON.
  std::string msg = error_of(
      [] { load_recipe_text("model:\n  init: random\n  config: &x {a: *x}\n", "self.yaml"); });
  EXPECT_HAS(msg, "self.yaml line 3 uses a YAML alias (*name)");
  // A billion laughs: nine levels of ten aliases each once took 14 s and gigabytes.
  std::string laughs = "model:\n  config:\n    a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol]\n";
  for (int i = 1; i < 9; ++i) {
    laughs += "    a" + std::to_string(i) + ": &a" + std::to_string(i) + " [";
    for (int k = 0; k < 10; ++k)
      laughs += std::string(k ? ", " : "") + "*a" + std::to_string(i - 1);
    laughs += "]\n";
  }
  // Refused at the first alias, before anything is expanded (no wall-clock bound: sanitizers
  // and a loaded machine stretch any; an expansion would run into the suite's timeout).
  msg = error_of([&] { load_recipe_text(laughs, "laughs.yaml"); });
  EXPECT_HAS(msg, "uses a YAML alias");
  // In an override too.
  msg = error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"train.seq_length=&x [*x]"}); });
  EXPECT_HAS(msg, "uses a YAML alias");
  // An anchor alone is harmless.
  EXPECT_NO_THROW(load_recipe_text(tiny_recipe() + "logging:\n  log_interval: &n 2\n", "r.yaml"));
}

TEST_F(RecipeTest, DeepNestingIsRefused) {
  const std::string deep =
      "model:\n  config: " + std::string(100000, '[') + std::string(100000, ']');
  std::string msg = error_of([&] { load_recipe_text(deep, "deep.yaml"); });
  EXPECT_NE(msg.find("deep.yaml"), std::string::npos) << msg.substr(0, 300);
  EXPECT_LT(msg.size(), 400u);
  const std::string nested = "model:\n  config: " + std::string(70, '[') + std::string(70, ']');
  EXPECT_HAS(error_of([&] { load_recipe_text(nested, "nested.yaml"); }),
             "nests more than 64 levels");
  // A model.config file nested 200,000 levels deep.
  const std::string config = (test::scratch_dir() / "deep_config.json").string();
  std::ofstream(config) << "{\"text_config\": " << std::string(200000, '[')
                        << std::string(200000, ']') << "}";
  msg = error_of([&] {
    load_recipe_text("model:\n  init: random\n  tokenizer: t.json\n  config: " + config +
                         "\ndata:\n  train_files: [x.jsonl]\n",
                     "r.yaml");
  });
  EXPECT_HAS(msg, "deep_config.json nests arrays and objects more than 64 levels deep");
}

TEST_F(RecipeTest, ModelMistakesAreNotReportedAsCudaGraphErrors) {
  std::string msg = error_of([] {
    load_recipe_text(tiny_recipe(), "r.yaml",
                     {"train.max_vision_patches=6", "cuda_graph.vision_cuda_graph_impl=local"});
  });
  EXPECT_HAS(msg, "train.max_vision_patches 6 must be a multiple of 4");
  EXPECT_EQ(msg.find("cuda_graph"), std::string::npos) << msg;
  const std::string inline_recipe =
      "model:\n  init: random\n  tokenizer: t.json\n  config:\n"
      "    text_config: {hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,\n"
      "      num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, vocab_size: 1000,\n"
      "      rope_parameters: {mrope_section: [2, 3, 3]}}\n"
      "    vision_config: {depth: 1, hidden_size: 32, intermediate_size: 64, num_heads: 2,\n"
      "      out_hidden_size: 64, num_position_embeddings: 64, deepstack_visual_indexes: [0]}\n"
      "data:\n  train_files: [x.jsonl]\ntrain:\n  seq_length: 64\n";
  msg = error_of([&] {
    load_recipe_text(inline_recipe, "r.yaml",
                     {"model.config.vision_config.spatial_merge_size=0",
                      "cuda_graph.vision_cuda_graph_impl=local"});
  });
  EXPECT_HAS(msg, "vision_config.spatial_merge_size = 0 is out of range");
  EXPECT_EQ(msg.find("cuda_graph"), std::string::npos) << msg;
  msg = error_of([&] {
    load_recipe_text(inline_recipe, "r.yaml", {"model.config.text_config.hidden_size=64.5"});
  });
  EXPECT_HAS(msg, "the inline model.config: text_config.hidden_size must be an integer, got 64.5");
}

TEST_F(RecipeTest, MaxImagePixelsIsASetting) {
  const Recipe r = load_recipe_text(tiny_recipe(), "r.yaml", {"data.max_image_pixels=1000000"});
  EXPECT_EQ(r.data.config.max_image_pixels, 1000000);
  EXPECT_EQ(load_recipe_text(recipe_to_yaml(r), "back.yaml").data.config.max_image_pixels, 1000000);
  EXPECT_EQ(load_recipe_text(tiny_recipe(), "r.yaml").data.config.max_image_pixels,
            kDefaultMaxImagePixels);
  EXPECT_HAS(
      error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"data.max_image_pixels=0"}); }),
      "data.max_image_pixels");
}

// Inputs the recipe fuzzer (fuzz/fuzz_recipe.cpp) once crashed on, in its format: the YAML, then
// after a line "----" one override per line. Each now loads or fails with an iris::Error.
TEST_F(RecipeTest, FuzzFindingsLoadOrFailCleanly) {
  const fs::path dir = fs::path(test::data_dir()) / "fuzz/regressions/recipe";
  int n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    SCOPED_TRACE(entry.path().string());
    const std::string text = read_text_file(entry.path().string());
    const size_t at = text.find("\n----\n");
    const std::string yaml = text.substr(0, at);
    std::vector<std::string> overrides;
    if (at != std::string::npos) {
      std::istringstream lines(text.substr(at + 6));
      for (std::string line; std::getline(lines, line);)
        if (!line.empty()) overrides.push_back(line);
    }
    try {
      load_recipe_text(yaml, "fuzz.yaml", overrides);
    } catch (const Error&) {
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not an iris::Error: " << e.what();
    }
    ++n;
  }
  EXPECT_GE(n, 1);
  // The first finding: a model.config string that is not UTF-8.
  EXPECT_HAS(error_of([] { load_recipe_text("model:\n  config: {a: b\xff\xfe}\n", "r.yaml"); }),
             "model.config holds text that is not valid UTF-8");
}

// The chat template a run renders with: the model's own (beside model.tokenizer for a random
// model), data.chat_template instead when set, with data.enable_thinking passed unless auto.
TEST_F(RecipeTest, ChatTemplateKeysPickTheTemplateAndItsVariables) {
  const Recipe own = load_recipe_text(tiny_recipe(), "r.yaml");
  EXPECT_EQ(own.data.chat_template, "");
  EXPECT_EQ(own.data.enable_thinking, "auto");
  const ChatFormat fixture = recipe_chat_format(own);
  EXPECT_EQ(fixture.source(), test::fixture_dir() + "/tokenizer_config.json");
  EXPECT_TRUE(fixture.kwargs().empty());

  const std::string file = test::data_dir() + "/chat_templates/qwen3.jinja";
  const Recipe other = load_recipe_text(
      tiny_recipe(), "r.yaml", {"data.chat_template=" + file, "data.enable_thinking=false"});
  const ChatFormat f = recipe_chat_format(other);
  EXPECT_EQ(f.source(), file);
  EXPECT_EQ(f.kwargs(), nlohmann::ordered_json({{"enable_thinking", false}}));
  const std::vector<ChatMessage> hi = {{"user", {ChatPart::make_text("Hi")}}};
  EXPECT_HAS(f.render(hi, true), "<think>\n\n</think>");
  EXPECT_HAS(recipe_to_yaml(other), "enable_thinking: false");

  EXPECT_HAS(
      error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"data.enable_thinking=maybe"}); }),
      "data.enable_thinking");
  EXPECT_HAS(error_of([] {
               recipe_chat_format(load_recipe_text(tiny_recipe(), "r.yaml",
                                                   {"data.chat_template=/nonexistent/t.jinja"}));
             }),
             "/nonexistent/t.jinja");
}

TEST_F(RecipeTest, SchemaDocumentsEveryKey) {
  const std::vector<RecipeKey> keys = recipe_schema();
  ASSERT_GT(keys.size(), 40u);
  std::set<std::string> seen;
  for (const RecipeKey& k : keys) {
    SCOPED_TRACE(k.key);
    EXPECT_TRUE(seen.insert(k.key).second) << "duplicate key";
    EXPECT_FALSE(k.type.empty());
    EXPECT_NE(k.type, "see core/graph_config.h") << "a graph key without its own type and doc";
    EXPECT_FALSE(k.default_value.empty());
    EXPECT_FALSE(k.doc.empty());
  }
  EXPECT_TRUE(seen.count("train.micro_batch_size"));
  EXPECT_TRUE(seen.count("model.config"));
  EXPECT_TRUE(seen.count("cuda_graph.vision_cuda_graph_impl"));
  // Every schema key appears in the resolved config.
  const std::string yaml = recipe_to_yaml(load_recipe_text(tiny_recipe(), "r.yaml"));
  for (const RecipeKey& k : keys) {
    const std::string leaf = k.key.substr(k.key.find('.') + 1);
    EXPECT_HAS(yaml, leaf + ":");
  }
  const std::string text = describe_recipe_schema();
  EXPECT_HAS(text, "train.global_batch_size (integer, default 1)");
  EXPECT_HAS(text, "schedule.kind (one of constant|cosine, default cosine)");
}

// What a resume compares: the keys that move some step's rates, each named with both values.
TEST_F(RecipeTest, ScheduleChangesNameTheKeysThatMoveTheRates) {
  const Recipe base =
      load_recipe_text(tiny_recipe(), "r.yaml", {"optimizer.lr=7.5e-4", "schedule.warmup_iters=2"});
  const ScheduleSettings was = recipe_schedule(base);
  EXPECT_EQ(was.kind, "cosine");
  EXPECT_EQ(was.decay_end(), 10);
  const auto changes = [&](std::vector<std::string> overrides) {
    overrides.insert(overrides.begin(), {"optimizer.lr=7.5e-4", "schedule.warmup_iters=2"});
    std::string out;
    for (const ScheduleChange& c : schedule_changes(
             was, recipe_schedule(load_recipe_text(tiny_recipe(), "r.yaml", overrides))))
      out += c.key + " " + c.before + " -> " + c.now + "; ";
    return out;
  };
  EXPECT_EQ(changes({}), "");
  // The cosine ends at train.train_iters: raising it moves every later rate.
  EXPECT_EQ(changes({"train.train_iters=20"}), "train.train_iters 10 -> 20; ");
  // ... unless schedule.decay_iters keeps the end where it was.
  EXPECT_EQ(changes({"train.train_iters=20", "schedule.decay_iters=10"}), "");
  EXPECT_EQ(changes({"train.train_iters=20", "schedule.decay_iters=12"}),
            "schedule.decay_iters 0 -> 12; train.train_iters 10 -> 20; ");
  EXPECT_EQ(changes({"optimizer.lr=1e-4"}), "optimizer.lr 0.00075 -> 0.0001; ");
  EXPECT_EQ(changes({"optimizer.min_lr=1e-5", "optimizer.weight_decay=0.1"}),
            "optimizer.weight_decay 0 -> 0.1; optimizer.min_lr 0 -> 1e-05; ");
  EXPECT_EQ(changes({"schedule.warmup_iters=3"}), "schedule.warmup_iters 2 -> 3; ");
  // A part's own rate counts only where it differs from what it was (0 means optimizer.lr).
  EXPECT_EQ(changes({"optimizer.vision_lr=7.5e-4"}), "");
  EXPECT_EQ(changes({"optimizer.merger_lr=1e-5"}), "optimizer.merger_lr 0 -> 1e-05; ");
  EXPECT_EQ(changes({"schedule.kind=constant"}), "schedule.kind cosine -> constant; ");
  // A constant schedule never reads the floor or the decay's end.
  const ScheduleSettings flat =
      recipe_schedule(load_recipe_text(tiny_recipe(), "r.yaml", {"schedule.kind=constant"}));
  EXPECT_TRUE(schedule_changes(flat, recipe_schedule(load_recipe_text(
                                         tiny_recipe(), "r.yaml",
                                         {"schedule.kind=constant", "train.train_iters=50",
                                          "optimizer.min_lr=1e-5"})))
                  .empty());
  // The settings make the schedule the trainer follows.
  const LrSchedule lr = was.lr_schedule();
  EXPECT_FLOAT_EQ(lr.at(2), 7.5e-4f);
  EXPECT_FLOAT_EQ(lr.at(10), 0.0f);
}

TEST_F(RecipeTest, ResumeAndProgressKeys) {
  const Recipe r = load_recipe_text(tiny_recipe(), "r.yaml");
  EXPECT_FALSE(r.schedule.override_on_resume);
  EXPECT_EQ(r.logging.progress, "auto");
  const Recipe o = load_recipe_text(tiny_recipe(), "r.yaml",
                                    {"schedule.override_on_resume=true", "logging.progress=off"});
  EXPECT_TRUE(o.schedule.override_on_resume);
  EXPECT_EQ(o.logging.progress, "off");
  EXPECT_HAS(error_of([] { load_recipe_text(tiny_recipe(), "r.yaml", {"logging.progress=tty"}); }),
             "logging.progress expects one of auto|on|off");
  // Megatron's name for the switch points at Iris's.
  EXPECT_HAS(error_of([] {
               load_recipe_text(
                   tiny_recipe() + "scheduler:\n  override_opt_param_scheduler: true\n", "r.yaml");
             }),
             "use schedule.override_on_resume");
}

TEST_F(RecipeTest, ResolvedPathsAreAbsolute) {
  const Recipe r = load_recipe("recipes/qwen3vl_tiny_shapes.yaml");
  const std::string yaml = recipe_to_yaml(r);
  EXPECT_HAS(yaml, (fs::current_path() / "data/shapes/train.jsonl").string());
  EXPECT_HAS(yaml, (fs::current_path() / "runs/qwen3vl_tiny_shapes").string());
  EXPECT_EQ(r.checkpoint.dir, "runs/qwen3vl_tiny_shapes");
  // The default run directory is named after the recipe.
  const Recipe d = load_recipe("recipes/qwen3vl_tiny_shapes.yaml", {"checkpoint.dir="});
  EXPECT_EQ(d.checkpoint.dir, "runs/qwen3vl_tiny_shapes");
}

}  // namespace
}  // namespace iris
