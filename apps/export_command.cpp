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
      "transformers load; a LoRA run's checkpoint as its PEFT adapter (--peft) or with the "
      "adapter merged (--merge).",
      "iris export"};
  std::string checkpoint, out_dir, dtype = "bf16";
  bool peft = false, merge = false;
  app.add_option("checkpoint", checkpoint, "checkpoint or run directory")->required();
  app.add_option("out_dir", out_dir, "directory to create (must not exist)")->required();
  app.add_option("--dtype", dtype,
                 "weight dtype: bf16 (as HF ships Qwen3-VL), f16 or f32 (an adapter as trained)")
      ->check(CLI::IsMember({"bf16", "f16", "f32"}))
      ->capture_default_str();
  app.add_flag("--peft", peft,
               "a LoRA run's adapter as PEFT saves it (adapter_config.json, "
               "adapter_model.safetensors)");
  app.add_flag("--merge", merge,
               "a LoRA run's model with its adapters merged in: a plain HF model");
  if (!parse_command_line(app, {argv + 1, argv + argc}, "iris export")) return 0;
  IRIS_USAGE_CHECK(!(peft && merge),
                   "--peft and --merge exclude each other: --peft writes the adapter alone, "
                   "--merge the model with the adapter merged into it; give one");
  const DType dt = dtype == "bf16" ? DType::bf16 : dtype == "f16" ? DType::f16 : DType::f32;
  const ExportKind kind = peft ? ExportKind::peft : merge ? ExportKind::merge : ExportKind::full;
  export_checkpoint(checkpoint, out_dir, dt, kind);
  if (kind == ExportKind::peft)
    std::printf("exported the LoRA adapter of %s to %s (adapter_model.safetensors, %s)\n",
                checkpoint.c_str(), out_dir.c_str(), dtype.c_str());
  else
    std::printf("exported %s to %s (%s weights%s)\n", checkpoint.c_str(), out_dir.c_str(),
                dtype.c_str(), kind == ExportKind::merge ? ", LoRA adapters merged" : "");
  return 0;
}

}  // namespace iris
