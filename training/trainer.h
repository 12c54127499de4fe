// The training driver: recipe -> data -> TrainableQwen3VL -> AdamW with its schedule, with
// checkpoints, resumption and telemetry.
//
// A step takes global_batch_size samples in micro-batches of micro_batch_size and accumulates
// their gradients. The loss is the mean over every labelled token of the global batch, as if the
// batch were one sequence: the labels are in hand before any forward pass, so the step counts the
// labelled tokens first and gives each forward_backward grad_scale = 1 / that count. No rescaling
// pass over the gradients and no loss-only pre-pass are needed, and the gradient does not depend
// on how the batch is split into micro-batches.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "bridge/hf_weights.h"
#include "bridge/model_config.h"
#include "training/recipe.h"

namespace iris {

struct TrainerOptions {
  FILE* out = stdout;
  // Redraw a progress bar with ETA between log lines; the CLI sets it as logging.progress says
  // (progress_bar_wanted in training/metrics_log.h).
  bool progress_bar = false;
};

struct TrainResult {
  std::string run_dir;
  int64_t start_iteration = 0;  // 0, or the step of the checkpoint resumed from
  int64_t final_iteration = 0;
  double last_loss = 0;         // mean loss of the last step
  std::string last_checkpoint;  // directory of the newest checkpoint, "" if none
  // SIGTERM or SIGINT when one stopped the run early (after saving the step it was on), else 0.
  int stop_signal = 0;
  // The checkpoint the run would continue is at train.train_iters: nothing was trained, loaded
  // or written, and `finished` says so in recipe keys (start and final iteration are its step).
  std::string finished;
};

// Runs (or resumes, per checkpoint.resume) the recipe to train.train_iters; returns at once,
// having written nothing, when the checkpoint it would resume is already there
// (TrainResult::finished). Throws iris::Error.
// Holds checkpoint.dir's RunLock throughout. While it runs, SIGTERM and SIGINT stop it after the
// current step with a checkpoint of that step (TrainResult::stop_signal); a second signal ends the
// process at once.
TrainResult run_training(const Recipe& recipe, const TrainerOptions& options = {});

// HF-style initialisation with a seeded, platform-independent generator: linear weights,
// embeddings and position embeddings ~ N(0, initializer_range) (text_config's for the decoder,
// vision_config's for the vision tower and mergers, 0.02 when absent), biases 0, norm weights 1.
// `config_json` is the config.json text (initializer_range is not part of ModelConfig).
void init_random_weights(Backend& backend, ModelWeights& weights, const std::string& config_json,
                         uint64_t seed);

// OpenMP threads for the host side of a GPU run (each step's uploads are converted and copied on
// the host in parallel): the host's cores shared among this host's processes of the run, less
// the data workers and the thread that queues the step, at least one. More threads than that
// leave a parallel region waiting for a thread the workers displaced: on 16 cores with 4 mock-data
// workers, 16 threads spent 21-32 ms of each 0.22 s step converting pixels, 4 threads 3.8 ms.
int gpu_host_threads(int cores, int processes_on_host, int data_workers);

}  // namespace iris
