// iris train: run a training recipe, with dotted overrides (train.train_iters=100).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "apps/cli.h"
#include "apps/commands.h"
#include "core/backend.h"
#include "core/error.h"
#include "parallel/launch.h"
#include "training/memory_plan.h"
#include "training/metrics_log.h"
#include "training/recipe.h"
#include "training/trainer.h"

namespace iris {

int run_train_command(int argc, char** argv) {
  CLI::App app{
      "Train a Qwen3-VL model from a recipe (recipes/*.yaml). Overrides are section.key=value "
      "and apply in order after the recipe, e.g. train.train_iters=100 "
      "optimizer.betas=[0.9,0.95] model.hf_dir=/models/Qwen3-VL-2B-Instruct.",
      "iris train"};
  std::string recipe_path;
  std::vector<std::string> overrides;
  bool dry_run = false, list_keys = false;
  double device_memory_gib = 0;
  app.add_option("--recipe", recipe_path, "the recipe YAML file, or the name of one in recipes/");
  app.add_option("overrides", overrides, "section.key=value overrides");
  app.add_flag("--dry-run", dry_run,
               "validate the recipe and overrides, print the resolved config and the memory plan "
               "per GPU, and exit (no GPU needed)");
  app.add_option("--device-memory", device_memory_gib,
                 "GiB of memory per GPU the memory plan must fit (as train.device_memory_gib; "
                 "default: the GPU's own)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--list-keys", list_keys, "print every recipe key with its type, default and doc");
  if (!parse_command_line(app, {argv + 1, argv + argc}, "iris train")) return 0;
  if (list_keys) {
    std::fputs(describe_recipe_schema().c_str(), stdout);
    return 0;
  }
  IRIS_USAGE_CHECK(!recipe_path.empty(),
                   "--recipe is required: a recipe file or the name of one in recipes/ (iris "
                   "train --help lists the flags)");
  if (device_memory_gib > 0)
    overrides.push_back("train.device_memory_gib=" + std::to_string(device_memory_gib));
  const Recipe recipe = load_recipe(recipe_path, overrides);
  // Of a multi-process run, rank 0 speaks for all (the trainer's log is rank 0's too).
  const LaunchEnv launch = read_launch_env();
  const bool speaks = launch.rank == 0;
  const std::string rank_tag = launcher_rank_tag(launch.launched(), launch.rank);
  const auto say = [&](const std::string& line) {
    std::fputs(format_log_message(line, rank_tag).c_str(), stdout);
  };
  if (speaks) {
    // The config is a document to read or reload, not log lines: printed as it is.
    std::printf("# resolved config (%s%s)\n%s", recipe_path.c_str(),
                overrides.empty() ? "" : " + overrides", recipe_to_yaml(recipe).c_str());
    for (const std::string& note : recipe.notes) say("note: " + note);
  }
  if (dry_run) {
    // The chat template is part of what a run would use: a bad one fails here, not at step 0.
    const ChatFormat chat = recipe_chat_format(recipe);
    if (speaks) std::printf("%s\n", chat.describe().c_str());
    if (!recipe.has_model_config) {
      if (speaks)
        std::printf(
            "no memory plan: the recipe has no model config (set model.config or "
            "model.hf_dir)\nrecipe is valid (dry run: nothing trained)\n");
      return 0;
    }
    // A recipe is planned for the GPUs it is meant for unless it asks for the CPU; the device
    // memory comes from the flag or key, else from the GPU here, if any.
    const bool on_gpu = recipe.train.device != "cpu";
    int64_t device_total = 0;
    if (on_gpu && recipe.train.device_memory_gib <= 0 && cuda_available())
      device_total = static_cast<int64_t>(make_cuda_backend(0)->device_memory_total());
    const MemoryPlan plan = plan_training_memory(recipe, recipe.model_config, on_gpu,
                                                 planned_device_bytes(recipe, device_total));
    if (!plan.fits()) {
      if (speaks)
        std::fprintf(stderr, "iris train: the run does not fit the GPU's memory:\n%s\n",
                     memory_refusal(recipe, recipe.model_config, plan).c_str());
      return 1;
    }
    if (speaks)
      std::printf("%srecipe is valid (dry run: nothing trained)\n", plan.describe().c_str());
    return 0;
  }
  std::fflush(stdout);
  TrainerOptions options;
  options.progress_bar =
      progress_bar_wanted(recipe.logging.progress, ::isatty(STDOUT_FILENO) != 0, launch.launched());
  const TrainResult result = run_training(recipe, options);
  if (!result.finished.empty()) {
    if (speaks) say(result.finished);
    return 0;
  }
  if (speaks) {
    char loss[32];
    std::snprintf(loss, sizeof(loss), "%.6f", result.last_loss);
    say(str_cat(result.stop_signal != 0 ? "stopped" : "done", ": iteration ",
                result.final_iteration, " of ", recipe.train.train_iters,
                result.final_iteration > result.start_iteration ? str_cat(", last loss ", loss)
                                                                : std::string(", no step trained"),
                ", run directory ", result.run_dir,
                result.last_checkpoint.empty() ? "" : ", checkpoint ", result.last_checkpoint));
  }
  // Not finished: 128 + the signal, as a shell reports a process the signal ended, so that
  // `iris train ... && iris export ...` stops here and schedulers that restart failed jobs
  // (Kubernetes, torchrun, Slurm scripts testing the status) restart it, and the restart resumes.
  if (result.stop_signal != 0) return 128 + result.stop_signal;
  return 0;
}

}  // namespace iris
