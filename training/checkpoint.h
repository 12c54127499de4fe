// Training checkpoints in a run directory, and their export as a Hugging Face model directory.
//
// Layout:
//   <run>/step_0000100/   one checkpoint (see save order in trainer.cpp): model.safetensors (f32,
//                         HF names, so a resume is exact), config.json, optimizer state,
//                         trainer_state.json, resolved_config.yaml, tokenizer files,
//                         preprocessor_config.json, generation_config.json
//   <run>/latest          the name of the newest complete checkpoint ("step_0000100")
//
//   <run>/iris.lock       held (flock) by the run using the directory; holds its pid
//
// A checkpoint is written as step_NNNNNNN.tmp, every file flushed, then renamed; `latest` is
// replaced atomically only after the rename. So whatever moment a run is killed at, every
// step_NNNNNNN directory is complete, `latest` names one (or does not exist yet), and a *.tmp
// directory is never read: it is debris, removed by the next run. Old checkpoints are pruned by
// renaming them to *.tmp first, so a kill during the deletion leaves debris, not a damaged step.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/fs.h"
#include "training/dataset.h"
#include "training/lr_schedule.h"

namespace iris {

// "step_0000100".
std::string checkpoint_name(int64_t step);

// The step of a checkpoint directory name: `name` must be exactly checkpoint_name(step) for a
// step that fits int64 ("step_0000100" -> 100). Anything else ("step_99999999999999999999",
// "step_00000100", "step_12.tmp") is not a checkpoint of this run folder and returns false.
bool parse_checkpoint_name(const std::string& name, int64_t& step);

// Steps of the step_NNNNNNN directories in run_dir (*.tmp and other names excluded), ascending,
// complete or not.
std::vector<int64_t> list_checkpoints(const std::string& run_dir);

// Whether `dir` holds a complete checkpoint: trainer_state.json parses and every file it lists
// exists with the size it recorded. When not, `why` (if given) says what is wrong.
bool checkpoint_complete(const std::string& dir, std::string* why = nullptr);

// The directory `latest` names, or "" when run_dir has no `latest`. Throws when `latest` is
// unreadable or names a directory that is missing or lacks trainer_state.json.
std::string latest_checkpoint(const std::string& run_dir);

// What a run restarted on run_dir continues from: the newest complete checkpoint ("" and step -1
// when there is none). `latest` is only a pointer kept for people and tools; when it is missing,
// damaged or names another step, `warnings` says so and which checkpoint is taken.
struct ResumePoint {
  std::string dir;
  int64_t step = -1;
  std::vector<std::string> warnings;
};
ResumePoint find_resume_point(const std::string& run_dir);

// Whether `name`, an entry of a run directory, is one the run keeps there for itself (latest,
// the lock, step_* checkpoints and their temporaries, resolved_config.yaml, run_summary.json,
// the report files): an output a setting names must not take it over.
bool is_run_directory_entry(const std::string& name);

// Removes leftovers of a killed writer: step_*.tmp directories and temporary `latest` files.
// Call it only while holding the RunLock: another run's checkpoint in progress looks the same.
void remove_checkpoint_debris(const std::string& run_dir);

// Exclusive use of a run directory for the lifetime of the object: an flock on <run>/iris.lock,
// which also records the holder's pid. A second RunLock on the same directory (from any process)
// throws "checkpoint.dir X is in use by process N" at once. The kernel drops the lock when the
// process dies, however it dies, so a killed run never leaves the folder locked.
class RunLock {
 public:
  explicit RunLock(const std::string& run_dir);

 private:
  DirectoryLock lock_;
};

// Writes checkpoint `step`: `fill` writes the files into a fresh temporary directory, which is
// then renamed into place and named by `latest`. Returns the checkpoint's directory. An existing
// step directory is never replaced: that is an error (the trainer checks for it before training).
std::string commit_checkpoint(const std::string& run_dir, int64_t step,
                              const std::function<void(const std::string& dir)>& fill);
// commit_checkpoint in two halves, for checkpoints that several processes write (each pipeline
// stage its own files): begin makes the fresh temporary directory and returns it, the writers
// fill it, and finish (after every writer is done) flushes it, renames it into place and points
// `latest` at it, returning the checkpoint's directory. One process calls both.
std::string begin_checkpoint(const std::string& run_dir, int64_t step);
std::string finish_checkpoint(const std::string& run_dir, int64_t step);

// Deletes the oldest of `owned` (steps of checkpoints this run wrote or continued) until at most
// `keep_last` remain (0 keeps all), and removes them from `owned`. No other directory is touched.
void prune_checkpoints(const std::string& run_dir, std::vector<int64_t>& owned, int64_t keep_last);

// One training data file as it was when a checkpoint was written; a resume compares them.
struct DataFileFingerprint {
  std::string path;
  int64_t bytes = 0;
  std::string hash;   // 16 hex digits
  bool whole = true;  // hash of the whole file; false: of its first and last MiB and its size
};
// A file up to whole_limit bytes is hashed whole (256 MiB reads in well under a second); a larger
// one, where a whole read could add minutes to every start, by its first and last MiB and its
// size: truncation, appending or replacement show, an edit inside it that keeps the size does
// not. Modification times are left out: staging the data to another disk changes them, not it.
constexpr int64_t kWholeHashLimit = int64_t(256) << 20;
DataFileFingerprint fingerprint_data_file(const std::string& path,
                                          int64_t whole_limit = kWholeHashLimit);
// A sentence per difference between the fingerprints a checkpoint recorded and today's files
// (paths alone may differ: data staged to another disk is the same data); empty when none.
std::vector<std::string> data_changes(const std::vector<DataFileFingerprint>& recorded,
                                      const std::vector<DataFileFingerprint>& now);

// A file of a checkpoint and its size, as trainer_state.json lists them.
struct CheckpointFile {
  std::string name;
  int64_t bytes = 0;
};
// The regular files in `dir` (trainer_state.json excluded), by name.
std::vector<CheckpointFile> list_checkpoint_files(const std::string& dir);

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
  // The training data files; empty in checkpoints written before they were recorded.
  std::vector<DataFileFingerprint> data_files;
  // The schedule the run trained with up to this step; absent (has_schedule false) in
  // checkpoints written before it was recorded, which a resume then cannot compare.
  bool has_schedule = false;
  ScheduleSettings schedule;
  // The checkpoint's other files: trainer_state.json is written last, so its list is what
  // checkpoint_complete() checks. Empty in older checkpoints (then only the state is checked).
  std::vector<CheckpointFile> files;
};

void save_trainer_state(const std::string& path, const TrainerState& s);
TrainerState load_trainer_state(const std::string& path);

// What an export makes of a checkpoint.
enum class ExportKind {
  // The model as it is. A checkpoint holding LoRA adapters is refused: an HF loader does not know
  // their tensors.
  full,
  // A LoRA run's adapter as PEFT saves it: adapter_config.json (the checkpoint's) and
  // adapter_model.safetensors with the adapter tensors and the modules_to_save modules' tensors,
  // under PEFT's keys (base_model.model.<HF name>). Refused for a checkpoint without adapters.
  peft,
  // The full model with every adapter merged into its weight, W + scale B A formed in f32 (scale
  // from adapter_config.json), and no adapter tensors: a plain HF model.
  merge,
};

// Makes an HF model directory from a checkpoint (or from a run directory: its latest one):
// config.json, model.safetensors in `dtype` (bf16 by default, as HF ships Qwen3-VL), tokenizer
// files, preprocessor_config.json, generation_config.json; or a PEFT adapter directory (`kind`).
// out_dir must not exist; it is written under a temporary name (an OwnedTempDir) and renamed when
// complete. SIGINT or SIGTERM meanwhile ends it with an error once the temporary is removed; what
// a killed export left beside out_dir is removed first.
void export_checkpoint(const std::string& checkpoint, const std::string& out_dir,
                       DType dtype = DType::bf16, ExportKind kind = ExportKind::full);

}  // namespace iris
