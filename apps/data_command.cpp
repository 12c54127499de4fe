// iris data: dataset generators (the synthetic shapes captioning set).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "apps/cli.h"
#include "apps/commands.h"
#include "training/shapes_data.h"
#include "training/shapes_eval.h"

namespace iris {

int run_data_command(int argc, char** argv) {
  CLI::App app{"Generate training data.", "iris data"};
  app.require_subcommand(1);
  CLI::App* shapes = app.add_subcommand(
      "shapes",
      "coloured shapes on a plain background with their captions (\"a red circle above a blue "
      "square\"): train.jsonl, heldout.jsonl and images/ in the HF messages format");
  std::string out_dir;
  int n = 1000;
  uint64_t seed = 1;
  double heldout = 0.1;
  int image_size = 64;
  bool force = false;
  shapes->add_option("--out", out_dir, "output directory")->required();
  shapes->add_flag("--force", force,
                   "replace the dataset already in --out (its train.jsonl, heldout.jsonl and "
                   "images)");
  shapes->add_option("--n", n, "scenes in all (train + held out)")
      ->check(CLI::Range(1, 10000000))
      ->capture_default_str();
  shapes->add_option("--seed", seed, "scene seed")->capture_default_str();
  shapes->add_option("--heldout", heldout, "fraction of the scenes held out for evaluation")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  shapes->add_option("--image-size", image_size, "image side in pixels")
      ->check(CLI::Range(32, 1024))
      ->capture_default_str();
  CLI::App* eval = app.add_subcommand(
      "shapes-eval",
      "caption the held-out shapes images greedily with a model and print the accuracy on colour "
      "and shape words");
  std::string model_dir, heldout_file;
  ShapesEvalOptions eval_opt;
  int show = 5;
  eval->add_option("-m,--model", model_dir, "HF-format model directory (e.g. from iris export)")
      ->required();
  eval->add_option("--heldout", heldout_file, "heldout.jsonl of a shapes set")->required();
  eval->add_option("--limit", eval_opt.limit, "samples to score; 0 = all")->capture_default_str();
  eval->add_option("--device", eval_opt.device, "cpu or cuda")->capture_default_str();
  eval->add_option("--show", show, "predictions to print")->capture_default_str();
  if (!parse_command_line(app, {argv + 1, argv + argc}, "iris data")) return 0;
  if (eval->parsed()) {
    int shown = 0;
    const ShapesScore s = evaluate_shapes(
        model_dir, heldout_file, eval_opt, [&](const std::string& p, const std::string& r) {
          if (shown++ < show)
            std::printf("  predicted: %-40s reference: %s\n", p.c_str(), r.c_str());
        });
    const int hits = s.colour_hits + s.shape_hits, words = s.colours + s.shapes;
    std::printf(
        "held-out captions: %d\ncolour words %.1f%% (%d/%d), shape words %.1f%% (%d/%d), "
        "relations %.1f%%, exact captions %.1f%%\naccuracy on colour and shape words: %.1f%%\n",
        s.captions, 100 * s.colour_accuracy(), s.colour_hits, s.colours, 100 * s.shape_accuracy(),
        s.shape_hits, s.shapes, 100 * s.relation_accuracy(), 100 * s.exact_accuracy(),
        words ? 100.0 * hits / words : 0.0);
    return 0;
  }
  write_shapes_dataset(out_dir, n, seed, heldout, image_size, force);
  std::printf("wrote %d shapes scenes (%g held out) to %s: train.jsonl, heldout.jsonl, images/\n",
              n, heldout, out_dir.c_str());
  return 0;
}

}  // namespace iris
