// iris export: a training checkpoint as a Hugging Face model directory.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "apps/cli.h"
#include "apps/commands.h"
#include "core/error.h"
#include "training/checkpoint.h"

namespace iris {

int run_export_command(int argc, char** argv) {
  CLI::App app{
      "Export a training checkpoint (a step_NNNNNNN directory, or a run directory for "
      "its latest checkpoint) as a Hugging Face model directory that iris generate and "
      "transformers load.",
      "iris export"};
  std::string checkpoint, out_dir, dtype = "bf16";
  app.add_option("checkpoint", checkpoint, "checkpoint or run directory")->required();
  app.add_option("out_dir", out_dir, "directory to create (must not exist)")->required();
  app.add_option("--dtype", dtype, "weight dtype: bf16 (as HF ships Qwen3-VL), f16 or f32")
      ->check(CLI::IsMember({"bf16", "f16", "f32"}))
      ->capture_default_str();
  if (!parse_command_line(app, {argv + 1, argv + argc}, "iris export")) return 0;
  const DType dt = dtype == "bf16" ? DType::bf16 : dtype == "f16" ? DType::f16 : DType::f32;
  export_checkpoint(checkpoint, out_dir, dt);
  std::printf("exported %s to %s (%s weights)\n", checkpoint.c_str(), out_dir.c_str(),
              dtype.c_str());
  return 0;
}

}  // namespace iris
