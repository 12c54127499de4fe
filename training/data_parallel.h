// Data-parallel training across the processes a launcher started (parallel/launch.h): every rank
// holds the whole model, trains on its share of each global batch and sums the gradients with
// the others before the optimizer step.
//
// Bit-identical to one process. Micro-batch i of a step belongs to rank i % world, each rank adds
// its micro-batches into its gradient buffer in order, and the buffers are summed in rank order by
// a fixed-order all-reduce (parallel/communicator.h). That is exactly what one CPU process does
// with `world` micro-batch replicas (one thread each; trainer.cpp: micro-batch i on replica
// i % replicas, replicas added in order), so `mpirun -np 2` with OMP_NUM_THREADS=1 gives the
// losses of a single process with OMP_NUM_THREADS=2, bit for bit, and a single process keeps its
// one gradient buffer (no extra copy for ordinary runs). The loss is the rank-order sum of the
// ranks' sums, again as the replicas' are added.
//
// Every rank walks the same sample sequence (so that the global batch, the skipped samples and
// the resume position agree everywhere) and trains on its own micro-batches only. Rank 0 writes
// the run directory (lock, checkpoints, metrics); every rank's weights stay identical because
// every rank applies the same reduced gradients.
//
// With pipeline parallelism (parallel.pipeline_parallel_size P > 1) the world is a grid of P
// stages x D data-parallel replicas, laid out as Megatron-LM lays out its pipeline dimension:
// outermost, so consecutive ranks hold the same stage of different replicas, rank = stage * D +
// replica. The ranks of one stage form a data-parallel group (micro-batch i of a step belongs to
// replica i % D, and the group sums its gradients in group-rank order as above); the ranks of one
// replica form a pipeline, whose stages exchange activations point to point and sum their
// gradient norms and tied-embedding gradients in stage order.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bridge/hf_weights.h"
#include "core/backend.h"
#include "parallel/communicator.h"
#include "parallel/grad_reducer.h"
#include "parallel/launch.h"
#include "training/recipe.h"

namespace iris {

class MpiSession;

// The element ranges of the gradient tensors in the flat span of `grads` (f32), ascending: each
// binding's whole target once (q/k/v and gate/up share one; a tied lm_head has no binding of its
// own). What TrainableQwen3VL::on_gradients_final names, for GradReducer.
std::vector<std::pair<int64_t, int64_t>> gradient_tensors(const ModelWeights& grads);

class DataParallel {
 public:
  // Reads the launcher's variables and checks parallel.data_parallel_size against them; starts
  // MPI when there is more than one process.
  explicit DataParallel(const ParallelRecipe& p);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const { return env_.rank; }
  // This run's processes on this host, which share its cores.
  int local_processes() const { return env_.local_size; }
  int world() const { return env_.world; }
  // The process grid: this rank's pipeline stage of stages(), and its data-parallel replica of
  // replicas() (the index of its pipeline).
  int stages() const { return stages_; }
  int stage() const { return env_.rank / replicas_; }
  int replicas() const { return replicas_; }
  int replica() const { return env_.rank % replicas_; }
  // The world rank that holds `stage` of this rank's pipeline.
  int stage_rank(int stage) const { return stage * replicas_ + replica(); }
  // The rank that writes the run directory and the log.
  bool writer() const { return env_.rank == 0; }
  // Whether a launcher (mpirun, srun) started this process, whatever the process count.
  bool launched() const { return env_.launched(); }
  // The GPU this rank trains on.
  int cuda_device() const;
  // Micro-batch i of every step is trained by replica i % replicas().
  bool owns(int64_t micro_index) const { return micro_index % replicas_ == replica(); }
  // One line per rank: which micro-batches (and samples) of each step it trains.
  std::string layout(int64_t micro_batches_per_step, int64_t micro_batch_size) const;

  // Ends the connection that connect() made, before the backend it lives on goes away.
  class Link {
   public:
    explicit Link(DataParallel& dp) : dp_(dp) {}
    ~Link() { dp_.disconnect(); }
    Link(const Link&) = delete;
    Link& operator=(const Link&) = delete;

   private:
    DataParallel& dp_;
  };
  // With more than one rank: the communicator for `be`'s device (MPI on the CPU, NCCL on CUDA),
  // the gradient reducer over `grads` (one flat span) unless a sharded optimizer sums them
  // (reduce_gradients false), and rank 0's weights copied to every rank. Does nothing for a
  // single process. Keep the Link while `be` lives. reduce_ranges: the element ranges of the flat
  // gradients to sum (a pipeline stage's own tensors); empty: all of them. With
  // parallel.overlap_grad_reduce the reducer learns the gradient tensors from `grads`' bindings,
  // so that gradients_final_hook() can start its buckets during the backward.
  [[nodiscard]] Link connect(Backend& be, ModelWeights& grads, ModelWeights* const* weights,
                             int n_weights, bool reduce_gradients = true,
                             const std::vector<std::pair<int64_t, int64_t>>& reduce_ranges = {});
  // The communicator connect() made; null for a single process.
  Communicator* communicator() { return comm_.get(); }
  // The ranks that hold this rank's pipeline stage (replica order): every rank without a
  // pipeline. Null for a single process (after connect).
  Communicator* data_parallel_communicator() { return stages_ > 1 ? dp_comm_.get() : comm_.get(); }
  // Pipelines only (after connect): the stages of this rank's pipeline, in stage order (for the
  // gradient norm over every stage).
  Communicator* pipeline_communicator() { return pipe_comm_.get(); }
  // Posts the sends to and receives from the neighbouring stages of this rank's pipeline as one
  // grouped exchange of the pipeline communicator (Communicator::exchange), in the order the
  // neighbour posts its halves: on the CPU (MPI) the host waits for them, bounded by
  // parallel.timeout_seconds; on CUDA (NCCL) they are queued between the backend's work and the
  // host goes on (the stall watchdog bounds the wait). A list may be empty; a stage without that
  // neighbour passes empty lists for it.
  void stage_exchange(const std::vector<Tensor>& send_prev, const std::vector<Tensor>& recv_prev,
                      const std::vector<Tensor>& send_next, const std::vector<Tensor>& recv_next,
                      const char* what);
  // Tied embeddings: stage 0 and the last stage of a pipeline each hold the embedding and its
  // gradient; this sums the two (stage 0's first) on both, so that both apply one update.
  // Nothing to do for one stage or for a rank on another stage. `scratch`: f32 of
  // tied_scratch_elements(grad.numel()).
  // sharded: a sharded optimizer sums the data-parallel group's gradients in its step, after
  // this. The two stages' parts must still be added once each has been summed over its replicas
  // (the unsharded run's order), so the embedding's gradient is summed over the group here first,
  // as the reducer would, and then left on replica 0 only, zero on the others: the optimizer's
  // reduce-scatter then adds zeros to it, which hands back the same bits.
  void sum_tied_gradient(Backend& be, const Tensor& grad, const Tensor& scratch,
                         bool sharded = false);
  int64_t tied_scratch_elements(int64_t n) const;
  // On CUDA with more than one rank: a point the stall watchdog (parallel/communicator.h) expects
  // the GPU to reach within parallel.timeout_seconds; once per step, after its work is queued.
  void mark_progress();
  // Communicator and scratch bytes, and when the gradient buckets are reduced, for the memory
  // plan ("" for one process). full_iteration_graphs: the backward runs inside graphs, so the
  // reduction cannot start before it ends.
  std::string describe(bool full_iteration_graphs = false) const;
  // What each model's on_gradients_final calls (TrainableQwen3VL), so that the buckets start
  // during the backward of the step's last micro-batch; empty when nothing overlaps (one
  // process, a sharded optimizer, parallel.overlap_grad_reduce off). After connect.
  std::function<void(const Tensor&)> gradients_final_hook();
  // Sums the gradients over the ranks (fixed order); after the backward of the last micro-batch.
  // Launches the buckets the hook has not, and orders the optimizer after all of them. Nothing
  // to do when a sharded optimizer sums them.
  void reduce_gradients();
  // How many of the gradient buckets started during the backward in the last step (this rank's
  // count; a rank whose last micro-batch had no image starts the vision's after it); "" without
  // a reducer.
  std::string overlap_summary() const;
  // The rank-order sum of every rank's local loss sum.
  double global_loss_sum(double local);
  // The stop signal any rank received (its number), so that every rank stops after the same
  // step; `local` for a single process.
  int agreed_stop(int local);
  // Rank 0's `local`, on every rank (what rank 0 decided, where the ranks could see otherwise).
  int64_t rank0_value(int64_t local, const char* what);
  // Refuses a run whose ranks hold different `value`s (their data files' fingerprints, say):
  // the message names the first rank that differs from rank 0, `what` and `fix`.
  void check_same_on_every_rank(const std::string& value, const std::string& what,
                                const std::string& fix);
  // Every rank waits here for the others (bounded by parallel.timeout_seconds).
  void barrier(const char* what);
  // For an error that escaped a rank of a multi-process run: prints it with the rank and ends
  // every process of the job, so that none waits for this one.
  [[noreturn]] void abort_job(const std::exception& e);

 private:
  void disconnect();

  LaunchEnv env_;
  int stages_ = 1, replicas_ = 1;
  bool overlap_ = true;
  int64_t bucket_elements_ = GradReducer::kDefaultBucketElements;
  MpiSession* session_ = nullptr;
  std::unique_ptr<MpiSession> dp_session_, pipe_session_;
  std::unique_ptr<Communicator> comm_, dp_comm_, pipe_comm_;
  std::unique_ptr<GradReducer> reducer_;
  std::unique_ptr<StallWatchdog> watchdog_;
};

}  // namespace iris
