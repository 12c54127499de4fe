// The process's MPI connection for a launched run (parallel/launch.h): started once, finalized at
// exit, and the host-side collectives the trainer and the communicators build on. Every call is
// checked (an iris::Error naming the call, the file and the line), and every wait is bounded: a
// rank that waits longer than the timeout for its peers (one of them failed or hangs) prints why
// and aborts the whole job, so that no rank waits forever.
#pragma once

#include <cstddef>
#include <memory>

#include "parallel/launch.h"

namespace iris {

class MpiSession {
 public:
  // Whether this iris was built with MPI.
  static bool available();
  // Initialises MPI for `env` (a launched run) on first use and returns the session; MPI's own
  // rank and size must match the launcher's variables.
  static MpiSession& start(const LaunchEnv& env);
  // Seconds a collective may wait for the other ranks before the job is aborted.
  void set_timeout(double seconds) { timeout_seconds_ = seconds; }
  double timeout() const { return timeout_seconds_; }

  int rank() const { return rank_; }
  int size() const { return size_; }

  // The ranks of this session with the same `color`, ranked by `key` (MPI_Comm_split): the
  // data-parallel group of a pipeline stage, or one pipeline's stages. Every rank of this session
  // calls it (after a bounded barrier, so that a failed rank cannot leave the others in the
  // split); the group keeps this session's timeout and aborts the whole job on one.
  std::unique_ptr<MpiSession> split(int color, int key, const char* what);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  // One point-to-point message: `bytes` at `buf` to or from rank `peer` of this session.
  struct Transfer {
    void* buf = nullptr;
    size_t bytes = 0;
    int peer = 0;
  };
  // Posts every receive and send at once and waits for all of them (bounded). Messages between
  // two ranks in one direction match in the order they are posted, so pipeline stages that
  // post each other's halves in the same call cannot deadlock however large the messages are.
  // At most kMaxTransfers of each.
  static constexpr int kMaxTransfers = 32;
  void exchange(const Transfer* sends, int n_sends, const Transfer* recvs, int n_recvs,
                const char* what);

  // Host memory, raw bytes; `what` names the exchange in a timeout message.
  // out[size * bytes] = every rank's in[bytes] in rank order; in may be out + rank * bytes.
  void all_gather(const void* in, void* out, size_t bytes, const char* what);
  // out piece r (bytes each) = rank r's in piece rank(); out must not overlap in.
  void all_to_all(const void* in, void* out, size_t bytes, const char* what);
  void broadcast(void* buf, size_t bytes, int root, const char* what);
  void send(const void* buf, size_t bytes, int peer, const char* what);
  void recv(void* buf, size_t bytes, int peer, const char* what);
  void barrier(const char* what);
  // Ends every process of the job with `code` (MPI_Abort).
  [[noreturn]] void abort(int code);

 private:
  MpiSession() = default;
  friend struct MpiSessionAccess;
  struct Group;
  // Null: MPI_COMM_WORLD.
  std::unique_ptr<Group> group_;
  int world_rank_ = 0;  // for messages
  int rank_ = 0, size_ = 1;
  double timeout_seconds_ = 900;
};

}  // namespace iris
