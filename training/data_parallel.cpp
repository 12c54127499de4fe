#include "training/data_parallel.h"

#include <cstdio>
#include <vector>

#include "core/error.h"
#include "parallel/mpi_session.h"

namespace iris {

DataParallel::DataParallel(const ParallelRecipe& p) : env_(read_launch_env()) {
  const int64_t expected = static_cast<int64_t>(env_.world) / p.pipeline_parallel_size;
  if (!env_.launched()) {
    IRIS_CHECK(p.data_parallel_size == 1, "parallel.data_parallel_size is ", p.data_parallel_size,
               " but iris was started as a single process (no mpirun or srun launched it); start "
               "it with `mpirun -np ",
               p.data_parallel_size * p.pipeline_parallel_size,
               " iris train --recipe ...` (or srun), or set parallel.data_parallel_size=1");
    return;
  }
  IRIS_CHECK(p.data_parallel_size == expected &&
                 expected * p.pipeline_parallel_size == static_cast<int64_t>(env_.world),
             "parallel.data_parallel_size is ", p.data_parallel_size, " but the launcher (",
             env_.launcher, ") started ", env_.world,
             " processes; set parallel.data_parallel_size=", env_.world,
             " (processes / parallel.pipeline_parallel_size) or launch ",
             p.data_parallel_size * p.pipeline_parallel_size, " processes");
  if (env_.world == 1) return;  // `mpirun -np 1`: a single process, MPI left alone
  session_ = &MpiSession::start(env_);
  session_->set_timeout(static_cast<double>(p.timeout_seconds));
}

DataParallel::~DataParallel() = default;

int DataParallel::cuda_device() const {
  return local_cuda_device(env_);
}

std::string DataParallel::layout(int64_t micro_batches_per_step, int64_t micro) const {
  if (env_.world == 1) return "";
  std::string text = str_cat("data parallel: ", env_.world, " processes started by ", env_.launcher,
                             "; each step's ", micro_batches_per_step, " micro-batches of ", micro,
                             " samples go round the ranks");
  for (int r = 0; r < env_.world; ++r) {
    text += str_cat("\n  rank ", r, ": micro-batches");
    int64_t shown = 0;
    for (int64_t i = r; i < micro_batches_per_step; i += env_.world, ++shown) {
      if (shown == 4) {
        text += " ...";
        break;
      }
      text += str_cat(" ", i, " (samples ", i * micro, "-", (i + 1) * micro - 1, ")");
    }
  }
  return text;
}

DataParallel::Link DataParallel::connect(Backend& be, ModelWeights& grads,
                                         ModelWeights* const* weights, int n_weights,
                                         bool reduce_gradients) {
  if (env_.world == 1) return Link(*this);
  comm_ = be.device() == Device::cuda ? make_nccl_communicator(be, session_, env_.rank, env_.world)
                                      : make_mpi_communicator(*session_);
  // Gradients of one config share one layout, so they are one flat span (as zero_grads uses).
  const Tensor flat(grads.arena.base(), DType::f32, be.device(),
                    {static_cast<int64_t>(grads.arena.capacity() / sizeof(float))});
  if (reduce_gradients) reducer_ = std::make_unique<GradReducer>(be, *comm_, flat);
  // Every rank initialises or loads the same weights; copying rank 0's makes that a guarantee
  // rather than an assumption (a file changed under one rank, a different build).
  for (int i = 0; i < n_weights; ++i)
    if (weights[i] != nullptr && weights[i]->arena.base() != nullptr)
      comm_->broadcast(Tensor(weights[i]->arena.base(), DType::i32, be.device(),
                              {static_cast<int64_t>(weights[i]->arena.capacity() / 4)}),
                       0);
  be.synchronize();
  return Link(*this);
}

void DataParallel::disconnect() {
  reducer_.reset();
  comm_.reset();
}

std::string DataParallel::describe() const {
  if (!comm_) return "";
  if (!reducer_) return str_cat(comm_->name(), " gradient reduce-scatter in the sharded optimizer");
  return str_cat(comm_->name(), " gradient all-reduce in ", reducer_->buckets(),
                 " fixed-order buckets, scratch ", reducer_->scratch_bytes() / (size_t(1) << 20),
                 " MiB");
}

void DataParallel::reduce_gradients() {
  if (reducer_) reducer_->reduce();
}

double DataParallel::global_loss_sum(double local) {
  if (env_.world == 1) return local;
  std::vector<double> all(static_cast<size_t>(env_.world));
  session_->all_gather(&local, all.data(), sizeof(double), "the loss exchange");
  double sum = 0;
  for (double v : all) sum += v;
  return sum;
}

int DataParallel::agreed_stop(int local) {
  if (env_.world == 1) return local;
  std::vector<int> all(static_cast<size_t>(env_.world));
  session_->all_gather(&local, all.data(), sizeof(int), "the stop-signal exchange");
  for (int v : all)
    if (v != 0) return v;
  return 0;
}

void DataParallel::barrier(const char* what) {
  if (session_ != nullptr) session_->barrier(what);
}

void DataParallel::abort_job(const std::exception& e) {
  std::fflush(stdout);
  std::fprintf(stderr, "error: rank %d of %d: %s\n", env_.rank, env_.world, e.what());
  std::fflush(stderr);
  session_->abort(1);
}

}  // namespace iris
