// The device memory a recipe's run holds per GPU, by buffer, computed from the recipe and the model
// config without allocating anything: the parameter specs (training/param_spec.h) give the
// weights, master weights, gradients and moments, the models' planning arenas
// (TrainableQwen3VL::plan_arena) the activations and workspace, and the exchanges their scratch.
// `iris train --dry-run` prints it; a run whose plan exceeds the device is refused before it
// allocates anything, with the settings that would make it fit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bridge/model_config.h"
#include "training/recipe.h"

namespace iris {

// One line of a plan: a buffer's bytes on one GPU and how they were counted.
struct MemoryItem {
  std::string name;
  int64_t bytes = 0;
  std::string how;
  // Host memory (offloaded activations): shown, not counted in the GPU's total.
  bool on_host = false;
};

// What one GPU of a pipeline stage holds (every data-parallel replica of a stage holds the same,
// up to one element of a shard).
struct StageMemory {
  int stage = 0;
  std::string ranks;  // which ranks this GPU plan is for
  std::vector<MemoryItem> items;
  int64_t total() const;
};

struct MemoryPlan {
  bool on_gpu = true;  // planned for GPUs (bf16 weights), else for CPU processes (f32)
  int stages = 1, replicas = 1;
  int64_t device_bytes = 0;  // memory per GPU the plan must fit; 0: unknown
  std::vector<StageMemory> per_stage;
  // The largest stage's total: what every GPU must be able to hold.
  int64_t peak() const;
  bool fits() const { return device_bytes <= 0 || peak() <= device_bytes; }
  // The plan, one block per stage, ending in `per-GPU total: X GiB of Y GiB`.
  std::string describe() const;
};

// The plan of recipe `r` training `cfg`. on_gpu: plan for GPUs (train.device cuda or auto with a
// GPU, and a dry run for a recipe meant for one). device_bytes: the GPU's memory (0: unknown).
MemoryPlan plan_training_memory(const Recipe& r, const ModelConfig& cfg, bool on_gpu,
                                int64_t device_bytes);

// The refusal of a plan that does not fit: the plan, then the settings (recipe keys) that would
// make it fit, each checked by planning the recipe with it, alone or together.
std::string memory_refusal(const Recipe& r, const ModelConfig& cfg, const MemoryPlan& plan);

// The memory per GPU a run must fit: train.device_memory_gib when set, else `device_total`
// (the GPU's, 0 when there is none).
int64_t planned_device_bytes(const Recipe& r, int64_t device_total);

}  // namespace iris
