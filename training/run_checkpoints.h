// A training run's checkpoints: what each holds (the weights, the optimizer state, the trainer
// state and the files an export needs) and how a pipelined run writes one from its stages.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "language/tokenizer.h"
#include "training/chat_format.h"
#include "training/checkpoint.h"
#include "training/data_parallel.h"
#include "training/dataset.h"
#include "training/recipe.h"
#include "training/run_setup.h"

namespace iris {

inline constexpr const char* kOptimizerFile = "optimizer.safetensors";
inline constexpr const char* kTrainerStateFile = "trainer_state.json";

// The optimizer state of a checkpoint: one file, or one per pipeline stage that wrote it; the
// tensors are found by name in whichever holds them, so any split resumes any other.
std::vector<std::string> optimizer_files(const std::string& dir);

// A config.json as HF loads it: model types and architectures filled in when a hand-written
// (inline) config leaves them out.
std::string hf_config_text(const std::string& config_json);

// Files that travel with every checkpoint so that an export is a complete HF directory.
struct SideFiles {
  std::vector<std::pair<std::string, std::string>> files;  // name, contents
};
SideFiles side_files(const Recipe& r, const Tokenizer& tok, const PreprocessorConfig& pp,
                     const ChatFormat& chat);

class Checkpoints {
 public:
  // start: the run's directory and the checkpoints it continues (which keep_last counts).
  // config_text: the model's config.json; data_files: the training data's fingerprints.
  Checkpoints(const Recipe& r, const RunStart& start, const RankTraining& rank, DataParallel& dp,
              std::string config_text, SideFiles side, std::vector<DataFileFingerprint> data_files);

  // Writes the resolved recipe into the run directory (rank 0).
  void write_resolved_config() const;
  // A checkpoint is saved in two steps, so that the run's record of the step (metrics.jsonl,
  // run_summary.json) is on disk before the checkpoint counts: a run killed in between resumes
  // from the checkpoint before, and runs that step again.
  // write: checkpoint `iteration` with `state` (its data position, seed, threads and files are
  // filled in here) into step_N.tmp; every rank calls it.
  void write(int64_t iteration, TrainerState& state, const DataPosition& position);
  // commit: renames the written checkpoint into place, points `latest` at it and prunes to
  // checkpoint.keep_last. Returns its directory on the rank that wrote it (rank 0), else "".
  std::string commit(int64_t iteration);

 private:
  void fill_state(TrainerState& state, const DataPosition& position) const;
  void write_whole(int64_t iteration, TrainerState& state);
  // Rank 0 makes step_N.tmp, the first replica of each stage writes the tensors (and their
  // moments) that its stage owns as one shard, and once all have written, rank 0 adds the shard
  // index, the side files and the trainer state.
  void write_pipelined(int64_t iteration, TrainerState& state, const DataPosition& position);
  void write_common_files(const std::string& dir) const;

  const Recipe& r_;
  const RankTraining& rank_;
  DataParallel& dp_;
  std::string run_dir_;
  std::vector<int64_t> owned_;
  std::string config_text_;
  std::string resolved_;
  SideFiles side_;
  std::vector<DataFileFingerprint> data_files_;
};

}  // namespace iris
