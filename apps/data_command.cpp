// iris data: dataset generators (the synthetic shapes captioning set).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "apps/commands.h"
#include "training/shapes_data.h"

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
  shapes->add_option("--out", out_dir, "output directory")->required();
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  write_shapes_dataset(out_dir, n, seed, heldout, image_size);
  std::printf("wrote %d shapes scenes (%g held out) to %s: train.jsonl, heldout.jsonl, images/\n",
              n, heldout, out_dir.c_str());
  return 0;
}

}  // namespace iris
