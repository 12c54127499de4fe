// Training checkpoints in a run directory, and their export as a Hugging Face model directory.
//
// Layout:
//   <run>/step_0000100/   one checkpoint (see save order in trainer.cpp): model.safetensors (f32,
//                         HF names, so a resume is exact), config.json, optimizer state,
//                         trainer_state.json, resolved_config.yaml, tokenizer files,
//                         preprocessor_config.json, generation_config.json
//   <run>/latest          the name of the newest complete checkpoint ("step_0000100")
//
// A checkpoint is written as step_NNNNNNN.tmp, every file flushed, then renamed; `latest` is
// replaced atomically only after the rename. So whatever moment a run is killed at, `latest`
// names a complete directory (or does not exist yet), and a *.tmp directory is never read: it is
// debris, removed by the next run.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "training/dataset.h"

namespace iris {

// "step_0000100".
std::string checkpoint_name(int64_t step);

// Steps of the complete checkpoints in run_dir (step_NNNNNNN directories, *.tmp excluded),
// ascending.
std::vector<int64_t> list_checkpoints(const std::string& run_dir);

// The directory `latest` names, or "" when run_dir has no `latest`. Throws when `latest` is
// unreadable or names a directory that is missing or lacks trainer_state.json.
std::string latest_checkpoint(const std::string& run_dir);

// Removes leftovers of a killed writer: step_*.tmp directories and temporary `latest` files.
void remove_checkpoint_debris(const std::string& run_dir);

// Writes checkpoint `step`: `fill` writes the files into a fresh temporary directory, which is
// then renamed into place and named by `latest`; afterwards all but the newest `keep_last`
// checkpoints are deleted (0 keeps all). Returns the checkpoint's directory.
std::string commit_checkpoint(const std::string& run_dir, int64_t step, int64_t keep_last,
                              const std::function<void(const std::string& dir)>& fill);

// Where training stands, beyond the weights and the optimizer (trainer_state.json).
struct TrainerState {
  int64_t iteration = 0;         // optimizer steps completed
  int64_t consumed_samples = 0;  // training samples fed
  int64_t consumed_tokens = 0;   // input tokens fed
  DataPosition data_position;    // of the training stream, for Dataset::seek
  // The data order depends only on (seed, epoch, index); storing the seed lets a resume check
  // that it continues the same stream.
  uint64_t data_seed = 0;
  // CPU threads of the run that wrote it: sums split across threads round differently, so a
  // resume matches an uninterrupted run bit for bit only with the same count. 0: unknown.
  int threads = 0;
};

void save_trainer_state(const std::string& path, const TrainerState& s);
TrainerState load_trainer_state(const std::string& path);

// Makes an HF model directory from a checkpoint (or from a run directory: its latest one):
// config.json, model.safetensors in `dtype` (bf16 by default, as HF ships Qwen3-VL), tokenizer
// files, preprocessor_config.json, generation_config.json. out_dir must not exist; it is written
// under a temporary name and renamed when complete.
void export_checkpoint(const std::string& checkpoint, const std::string& out_dir,
                       DType dtype = DType::bf16);

}  // namespace iris
