#include "training/data_parallel.h"

#include <algorithm>
#include <cstdio>
#include <vector>

#include "core/error.h"
#include "parallel/mpi_session.h"

namespace iris {

std::vector<std::pair<int64_t, int64_t>> gradient_tensors(const ModelWeights& grads) {
  std::vector<std::pair<int64_t, int64_t>> tensors;
  for (const WeightBinding& b : grads.bindings) {
    if (!b.allocated()) continue;  // a frozen part has no gradient to reduce
    const auto begin = static_cast<int64_t>(
        (static_cast<const char*>(b.target->data) - static_cast<const char*>(grads.arena.base())) /
        sizeof(float));
    tensors.push_back({begin, begin + b.target->numel()});
  }
  std::sort(tensors.begin(), tensors.end());
  tensors.erase(std::unique(tensors.begin(), tensors.end()), tensors.end());
  return tensors;
}

DataParallel::DataParallel(const ParallelRecipe& p) : env_(read_launch_env()) {
  stages_ = static_cast<int>(p.pipeline_parallel_size);
  overlap_ = p.overlap_grad_reduce;
  bucket_elements_ = p.grad_bucket_elements;
  const int64_t expected = static_cast<int64_t>(env_.world) / p.pipeline_parallel_size;
  if (!env_.launched()) {
    IRIS_CHECK(p.data_parallel_size == 1, "parallel.data_parallel_size is ", p.data_parallel_size,
               " but iris was started as a single process (no mpirun or srun launched it); start "
               "it with `mpirun -np ",
               p.data_parallel_size * p.pipeline_parallel_size,
               " iris train --recipe ...` (or srun), or set parallel.data_parallel_size=1");
    IRIS_CHECK(p.pipeline_parallel_size == 1, "parallel.pipeline_parallel_size is ",
               p.pipeline_parallel_size,
               " but iris was started as a single process; pipeline stages are processes: start "
               "it with `mpirun -np ",
               p.data_parallel_size * p.pipeline_parallel_size, " iris train --recipe ...`");
    stages_ = 1;
    return;
  }
  IRIS_CHECK(env_.world % p.pipeline_parallel_size == 0, "the launcher (", env_.launcher,
             ") started ", env_.world, " processes, which do not split into ",
             p.pipeline_parallel_size,
             " pipeline stages (parallel.pipeline_parallel_size); launch a multiple of ",
             p.pipeline_parallel_size, " processes");
  IRIS_CHECK(p.data_parallel_size == expected, "parallel.data_parallel_size is ",
             p.data_parallel_size, " but the launcher (", env_.launcher, ") started ", env_.world,
             " processes for ", p.pipeline_parallel_size,
             " pipeline stage(s); set parallel.data_parallel_size=", expected,
             " (processes / parallel.pipeline_parallel_size) or launch ",
             p.data_parallel_size * p.pipeline_parallel_size, " processes");
  replicas_ = env_.world / stages_;
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
  std::string text =
      stages_ == 1
          ? str_cat("data parallel: ", env_.world, " processes started by ", env_.launcher,
                    "; each step's ", micro_batches_per_step, " micro-batches of ", micro,
                    " samples go round the ranks")
          : str_cat("pipeline parallel: ", env_.world, " processes started by ", env_.launcher,
                    " = ", stages_, " stages x ", replicas_,
                    " data-parallel replicas (rank = stage x ", replicas_,
                    " + replica); each step's ", micro_batches_per_step, " micro-batches of ",
                    micro,
                    " samples go round the replicas, each through its pipeline in 1F1B order");
  if (stages_ > 1 && replicas_ == 1) return text;
  for (int r = 0; r < replicas_; ++r) {
    text += stages_ == 1 ? str_cat("\n  rank ", r, ": micro-batches")
                         : str_cat("\n  replica ", r, " (ranks ", r, ", ", replicas_ + r,
                                   stages_ > 2 ? ", ..." : "", "): micro-batches");
    int64_t shown = 0;
    for (int64_t i = r; i < micro_batches_per_step; i += replicas_, ++shown) {
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
                                         bool reduce_gradients,
                                         const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  if (env_.world == 1) return Link(*this);
  const bool cuda = be.device() == Device::cuda;
  comm_ = cuda ? make_nccl_communicator(be, session_, env_.rank, env_.world)
               : make_mpi_communicator(*session_);
  Communicator* reduce_over = comm_.get();
  if (stages_ > 1) {
    // Keys: a group's rank is the replica in the data-parallel group and the stage in the
    // pipeline, which is how stage_exchange and sum_tied_gradient name their peers.
    dp_session_ = session_->split(stage(), replica(), "the data-parallel group split");
    pipe_session_ = session_->split(replica(), stage(), "the pipeline group split");
    // Every rank makes the data-parallel group's communicator before the pipeline's: NCCL's
    // initialisation waits for the group's ranks, so one order everywhere cannot deadlock.
    auto group = [&](MpiSession& s) {
      return cuda ? make_nccl_communicator(be, &s, s.rank(), s.size()) : make_mpi_communicator(s);
    };
    dp_comm_ = group(*dp_session_);
    pipe_comm_ = group(*pipe_session_);
    IRIS_CHECK(pipe_comm_->rank() == stage() && dp_comm_->rank() == replica(),
               "the pipeline group split gave rank ", env_.rank, " pipeline rank ",
               pipe_comm_->rank(), " (stage ", stage(), ") and data-parallel rank ",
               dp_comm_->rank(), " (replica ", replica(), ")");
    reduce_over = replicas_ > 1 ? dp_comm_.get() : nullptr;
  }
  if (cuda) watchdog_ = make_stall_watchdog(be, session_->timeout(), env_.rank);
  // Gradients of one config share one layout, so they are one flat span (as zero_grads uses).
  const Tensor flat(grads.arena.base(), DType::f32, be.device(),
                    {static_cast<int64_t>(grads.arena.capacity() / sizeof(float))});
  if (reduce_gradients && reduce_over != nullptr) {
    reducer_ = std::make_unique<GradReducer>(
        be, *reduce_over, flat, bucket_elements_, ranges,
        overlap_ ? gradient_tensors(grads) : std::vector<std::pair<int64_t, int64_t>>());
  }
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
  watchdog_.reset();
  reducer_.reset();
  comm_.reset();
  dp_comm_.reset();
  pipe_comm_.reset();
  dp_session_.reset();
  pipe_session_.reset();
}

void DataParallel::stage_exchange(const std::vector<Tensor>& send_prev,
                                  const std::vector<Tensor>& recv_prev,
                                  const std::vector<Tensor>& send_next,
                                  const std::vector<Tensor>& recv_next, const char* what) {
  IRIS_CHECK(pipe_comm_ != nullptr, what, ": the pipeline is not connected");
  using Transfer = Communicator::Transfer;
  constexpr int kMax = MpiSession::kMaxTransfers;
  Transfer sends[kMax], recvs[kMax];
  int ns = 0, nr = 0;
  // Peers by stage: the pipeline communicator's rank is the stage (connect's split key).
  auto add = [&](Transfer* list, int& n, const std::vector<Tensor>& ts, int stage) {
    if (ts.empty()) return;
    IRIS_CHECK(stage >= 0 && stage < stages_, what, ": stage ", this->stage(),
               " has no neighbour stage ", stage);
    for (const Tensor& t : ts) {
      IRIS_CHECK(n < kMax, what, ": more than ", kMax, " tensors in one exchange");
      list[n++] = Transfer{t, stage};
    }
  };
  add(sends, ns, send_prev, stage() - 1);
  add(sends, ns, send_next, stage() + 1);
  add(recvs, nr, recv_prev, stage() - 1);
  add(recvs, nr, recv_next, stage() + 1);
  if (ns + nr == 0) return;
  pipe_comm_->exchange({sends, size_t(ns)}, {recvs, size_t(nr)}, what);
  // A mark behind each exchange: a stage whose host then waits on its stream (a staging buffer,
  // a read) while a peer has stopped still leaves a mark pending, which the watchdog times out;
  // marks only at the step's end left such a wait unwatched, and the job hung.
  mark_progress();
}

int64_t DataParallel::tied_scratch_elements(int64_t n) const {
  return std::max(n, all_reduce_scratch_elements(n, replicas_));
}

void DataParallel::sum_tied_gradient(Backend& be, const Tensor& grad, const Tensor& scratch,
                                     bool sharded) {
  if (stages_ == 1 || (stage() != 0 && stage() != stages_ - 1)) return;
  const bool summed_here = sharded && replicas_ > 1;
  if (summed_here) dp_comm_->all_reduce(grad, scratch);
  const bool first = stage() == 0;
  const int peer = first ? stages_ - 1 : 0;
  const Communicator::Transfer send{grad, peer},
      recv{scratch.slice(0, grad.numel()).view(grad.dims()), peer};
  pipe_comm_->exchange({&send, 1}, {&recv, 1}, "the tied-embedding gradient exchange");
  mark_progress();
  // Stage 0's term first on both sides: the same bits, so both copies stay identical. (On CUDA
  // the add is queued after the exchange, which the backend's stream waits for.)
  const Tensor other = scratch.slice(0, grad.numel()).view(grad.dims());
  if (first)
    be.add(grad, grad, other);
  else
    be.add(grad, other, grad);
  if (summed_here && replica() != 0) be.fill_zero(grad);
}

void DataParallel::mark_progress() {
  if (watchdog_) watchdog_->mark();
}

std::string DataParallel::describe(bool full_iteration_graphs) const {
  if (!comm_) return "";
  if (!reducer_ && stages_ > 1 && replicas_ == 1)
    return str_cat(comm_->name(), " point-to-point activations between ", stages_,
                   " pipeline stages, no gradient reduction (one replica)");
  if (!reducer_ && stages_ > 1 && replicas_ > 1)
    return str_cat(comm_->name(), " point-to-point activations between ", stages_,
                   " pipeline stages, gradient reduce-scatter over each stage's ", replicas_,
                   " replicas in the sharded optimizer");
  if (!reducer_) return str_cat(comm_->name(), " gradient reduce-scatter in the sharded optimizer");
  return str_cat(comm_->name(), " gradient all-reduce in ", reducer_->buckets(),
                 " fixed-order buckets, scratch ", reducer_->scratch_bytes() / (size_t(1) << 20),
                 " MiB, ",
                 !overlap_ ? "after the backward (parallel.overlap_grad_reduce off)"
                 : full_iteration_graphs
                     ? "after the backward (full_iteration graphs hold the whole backward; "
                       "eager runs and local graphs overlap it)"
                     : "each started during the last micro-batch's backward as soon as its "
                       "gradients are final (overlapped; not with full_iteration graphs)");
}

std::function<void(const Tensor&)> DataParallel::gradients_final_hook() {
  if (!reducer_ || !overlap_) return {};
  return [r = reducer_.get()](const Tensor& grad) { r->gradient_final(grad); };
}

std::string DataParallel::overlap_summary() const {
  if (!reducer_) return "";
  return str_cat("gradient reduction: ", reducer_->launched_early(), " of ", reducer_->buckets(),
                 " buckets started during the backward of the last step's last micro-batch");
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

int64_t DataParallel::rank0_value(int64_t local, const char* what) {
  if (env_.world == 1 || session_ == nullptr) return local;
  std::vector<int64_t> all(static_cast<size_t>(env_.world));
  session_->all_gather(&local, all.data(), sizeof(int64_t), what);
  return all[0];
}

void DataParallel::check_same_on_every_rank(const std::string& value, const std::string& what,
                                            const std::string& fix) {
  if (env_.world == 1 || session_ == nullptr) return;
  // FNV-1a of the value: equal values give equal digests on every rank.
  uint64_t digest = 1469598103934665603ull;
  for (unsigned char c : value) digest = (digest ^ c) * 1099511628211ull;
  std::vector<uint64_t> all(static_cast<size_t>(env_.world));
  session_->all_gather(&digest, all.data(), sizeof(uint64_t), "the data check");
  for (size_t r = 1; r < all.size(); ++r)
    IRIS_CHECK(all[r] == all[0], "rank ", r, " of ", env_.world, " has other ", what,
               " than rank 0; every rank must train on the same data: ", fix);
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
