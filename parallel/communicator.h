// Collectives between the ranks of a data-parallel run, on the tensors of one backend: MPI for
// CPU tensors (so that CI runs the parallel code on the CPU backend), NCCL for CUDA tensors.
//
// Reductions have a fixed order. A float sum depends on the order of its terms, and a plain
// MPI_Allreduce or ncclAllReduce does not promise one (NCCL's ring starts each chunk's sum at a
// different rank), so the sums here are made of exact moves and one local sum: all_to_all hands
// rank k every rank's piece k, and rank k adds those pieces in rank order, ((x0 + x1) + x2) + ...;
// all_gather then hands every rank every reduced piece. Each element is summed by exactly one
// rank in rank order, whatever the world size's topology, in every run; the traffic is that of a
// ring all-reduce (reduce-scatter + all-gather).
#pragma once

#include <memory>
#include <span>
#include <string>

#include "core/backend.h"
#include "parallel/launch.h"

namespace iris {

class MpiSession;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "MPI" or "NCCL".
  virtual std::string name() const = 0;
  virtual Device device() const = 0;

  // Data moves, any dtype, contiguous tensors of this communicator's device. On CUDA they are
  // queued on the communicator's stream, after the backend's work queued before the call, and the
  // backend's later work waits for them.
  //
  // out[size() * n] = every rank's in[n] in rank order; in may be out's own piece (in place).
  virtual void all_gather(const Tensor& out, const Tensor& in) = 0;
  // in and out [size() * n]: out's piece r = rank r's in piece rank(). out must not overlap in.
  virtual void all_to_all(const Tensor& out, const Tensor& in) = 0;
  virtual void broadcast(const Tensor& buf, int root) = 0;
  virtual void send(const Tensor& t, int peer) = 0;
  virtual void recv(const Tensor& t, int peer) = 0;
  // One point-to-point message of a grouped exchange: all of `t` to or from rank `peer` (this
  // communicator's numbering; a rank may name itself).
  struct Transfer {
    Tensor t;
    int peer = 0;
  };
  // Posts every receive and send at once and completes them together, so that two ranks that
  // post each other's halves in one call cannot deadlock however large the messages are;
  // messages between two ranks in one direction match in the order they are posted. MPI waits
  // for them on the host, bounded by parallel.timeout_seconds; NCCL queues them as one group on
  // its stream (ordered as the other calls are) and does not wait. `what` names the exchange in
  // errors. At most MpiSession::kMaxTransfers of each on MPI.
  virtual void exchange(std::span<const Transfer> sends, std::span<const Transfer> recvs,
                        const char* what) = 0;
  // Local: out[n] (f32) = ((pieces[0] + pieces[1]) + ...) + pieces[size() - 1] over the size()
  // pieces of pieces[size() * n] (f32); accumulate: out[n] += that sum (one add after the rank-
  // order sum, so that summing micro-batch after micro-batch is a fixed order too). out must not
  // overlap pieces.
  virtual void sum_pieces(const Tensor& out, const Tensor& pieces, bool accumulate) = 0;
  void sum_pieces(const Tensor& out, const Tensor& pieces) { sum_pieces(out, pieces, false); }

  // Fixed-order sums of f32 tensors (see the top of this file).
  // out[n] = sum over ranks in rank order of their in's piece rank() (in [size() * n]); scratch
  // f32 [size() * n] receives the pieces. out may be in's own piece; neither overlaps scratch.
  void reduce_scatter(const Tensor& out, const Tensor& in, const Tensor& scratch);
  // buf[N] = the rank-order sum of every rank's buf, the same bits on every rank, for any N.
  // scratch: f32 of at least N elements rounded up to a multiple of size().
  void all_reduce(const Tensor& buf, const Tensor& scratch);

  // Overlap with the backend's work. Between begin_detached() and end_detached() each call still
  // starts after the backend's work queued before it, but the backend's later work stops waiting
  // for it, so that the backend goes on computing while the calls run (gradient buckets during
  // the backward); end_detached() makes the backend's later work wait for every call made since.
  // Meanwhile the caller keeps the backend's work off the memory the calls touch. On CUDA the
  // order is kept by events, with no host wait; MPI completes each call on the host, so there is
  // nothing to do.
  virtual void begin_detached() {}
  virtual void end_detached() {}
  // Finer than end_detached(): mark_point(k) notes the calls made so far, and wait_point(k) makes
  // the backend's later work wait for those only (the last mark of k; none yet: no wait), so a
  // buffer the calls read can be written again while later calls still run. k < kPoints. MPI
  // completes each call on the host: nothing to do.
  static constexpr int kPoints = 5;
  virtual void mark_point(int /*k*/) {}
  virtual void wait_point(int /*k*/) {}
};

// NCCL waits on the GPU with no timeout: a peer that stops responding leaves this rank's kernels
// spinning and its host blocked in its next read from the device, or in a launch once the queue
// is full, where no exception can reach it. The watchdog bounds that wait as MpiSession bounds
// the host's: mark() records a point on the backend's stream (no host wait; at a step's end and
// behind each pipeline exchange, since a stage stuck mid-step fills its launch queue before the
// end), and a thread of its own checks the oldest point not yet reached. When the GPU has reached
// no point for `timeout_seconds` (parallel.timeout_seconds) while one is pending, it prints why and
// ends the process with exit code 1, which makes the launcher (mpirun, srun) end every other rank.
class StallWatchdog {
 public:
  virtual ~StallWatchdog() = default;
  virtual void mark() = 0;
};
// Null without NCCL (no multi-GPU run to watch). `rank` names the process in the message.
std::unique_ptr<StallWatchdog> make_stall_watchdog(Backend& be, double timeout_seconds, int rank);

// Scratch elements all_reduce needs for a buffer of n elements on `world` ranks.
int64_t all_reduce_scratch_elements(int64_t n, int world);

// MPI between the processes of a launched run (MpiSession), on CPU tensors.
std::unique_ptr<Communicator> make_mpi_communicator(MpiSession& session);
// NCCL between one GPU per process on `be` (a CUDA backend on the process's GPU). With world 1 it
// needs no MPI (session may be null); otherwise rank 0's NCCL id travels over `session`.
// Throws when Iris was built without NCCL.
std::unique_ptr<Communicator> make_nccl_communicator(Backend& be, MpiSession* session, int rank,
                                                     int world);
bool nccl_available();
// The GPU of a process on its host: local_rank among the visible GPUs (one process per GPU).
int local_cuda_device(const LaunchEnv& env);

}  // namespace iris
