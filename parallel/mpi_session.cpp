#include "parallel/mpi_session.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "core/error.h"

#ifdef IRIS_WITH_MPI
#include <mpi.h>
#endif

namespace iris {

#ifdef IRIS_WITH_MPI

namespace {

[[noreturn]] void throw_mpi_error(int code, const char* stmt, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  throw_error(file, line,
              str_cat("MPI error ", code, len > 0 ? " (" : "", std::string(text, len),
                      len > 0 ? ")" : "", " in `", stmt, "`"));
}

}  // namespace

#define IRIS_MPI_CHECK(stmt)                                                                   \
  do {                                                                                         \
    const int iris_mpi_rc_ = (stmt);                                                           \
    if (iris_mpi_rc_ != MPI_SUCCESS) throw_mpi_error(iris_mpi_rc_, #stmt, __FILE__, __LINE__); \
  } while (0)

namespace {

// MPI counts are ints: larger transfers go in pieces of this many bytes.
constexpr size_t kMaxPiece = size_t(1) << 30;

int as_count(size_t bytes, const char* what) {
  IRIS_CHECK(bytes <= static_cast<size_t>(INT_MAX), what, ": ", bytes,
             " bytes per rank is more than one MPI call moves; use smaller buckets");
  return static_cast<int>(bytes);
}

void finalize_at_exit() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Finalize();
}

}  // namespace

bool MpiSession::available() {
  return true;
}

struct MpiSession::Group {
  MPI_Comm comm = MPI_COMM_NULL;
};

struct MpiSessionAccess {
  static MPI_Comm comm(const MpiSession& s) { return s.group_ ? s.group_->comm : MPI_COMM_WORLD; }
};

namespace {
MPI_Comm comm_of(const MpiSession& s) {
  return MpiSessionAccess::comm(s);
}
}  // namespace

MpiSession::~MpiSession() {
  // Freed before MPI_Finalize (the groups live in the trainer, the world session to the end). A
  // destructor cannot throw, so a failure here is left unreported, as finalize_at_exit leaves
  // its own: the job is ending either way.
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (group_ && group_->comm != MPI_COMM_NULL && !finalized) MPI_Comm_free(&group_->comm);
}

MpiSession& MpiSession::start(const LaunchEnv& env) {
  static MpiSession session;
  int initialized = 0;
  IRIS_MPI_CHECK(MPI_Initialized(&initialized));
  if (!initialized) {
    // Only the thread that runs the step calls MPI (data workers and OpenMP teams never do).
    int provided = 0;
    IRIS_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    std::atexit(finalize_at_exit);
    // Failures come back as codes that IRIS_MPI_CHECK turns into errors with their call.
    IRIS_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  }
  IRIS_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &session.rank_));
  IRIS_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &session.size_));
  session.world_rank_ = session.rank_;
  IRIS_CHECK(session.rank_ == env.rank && session.size_ == env.world, "the launcher (",
             env.launcher, ") says rank ", env.rank, " of ", env.world, " but MPI says rank ",
             session.rank_, " of ", session.size_,
             "; start iris with the launcher of the MPI it was built with (mpirun -np N, or srun "
             "with --mpi=pmix)");
  return session;
}

namespace {

// Polls until every request is complete; past the deadline the job is aborted with a message
// saying which exchange hung.
void wait_bounded(MPI_Request* reqs, int n, double timeout, int rank, const char* what) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
  for (unsigned spins = 0;; ++spins) {
    int done = 0;
    IRIS_MPI_CHECK(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE));
    if (done) return;
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr,
                   "iris: rank %d waited more than %.0f s for the other ranks in %s (one of "
                   "them failed or hangs; parallel.timeout_seconds); aborting the job\n",
                   rank, timeout, what);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);
      std::_Exit(1);
    }
    // Spinning keeps a step's exchanges fast; a long wait (a peer saving a checkpoint) yields
    // the core to the ranks that share it.
    if (spins > 20000) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace

void MpiSession::all_gather(const void* in, void* out, size_t bytes, const char* what) {
  const int count = as_count(bytes, what);
  const bool in_place = in == static_cast<const char*>(out) + static_cast<size_t>(rank_) * bytes;
  MPI_Request req;
  IRIS_MPI_CHECK(MPI_Iallgather(in_place ? MPI_IN_PLACE : in, count, MPI_BYTE, out, count, MPI_BYTE,
                                comm_of(*this), &req));
  wait_bounded(&req, 1, timeout_seconds_, world_rank_, what);
}

void MpiSession::all_to_all(const void* in, void* out, size_t bytes, const char* what) {
  const int count = as_count(bytes, what);
  MPI_Request req;
  IRIS_MPI_CHECK(MPI_Ialltoall(in, count, MPI_BYTE, out, count, MPI_BYTE, comm_of(*this), &req));
  wait_bounded(&req, 1, timeout_seconds_, world_rank_, what);
}

void MpiSession::broadcast(void* buf, size_t bytes, int root, const char* what) {
  for (size_t off = 0; off < bytes; off += kMaxPiece) {
    MPI_Request req;
    IRIS_MPI_CHECK(MPI_Ibcast(static_cast<char*>(buf) + off,
                              static_cast<int>(std::min(kMaxPiece, bytes - off)), MPI_BYTE, root,
                              comm_of(*this), &req));
    wait_bounded(&req, 1, timeout_seconds_, world_rank_, what);
  }
}

void MpiSession::send(const void* buf, size_t bytes, int peer, const char* what) {
  for (size_t off = 0; off < bytes; off += kMaxPiece) {
    MPI_Request req;
    IRIS_MPI_CHECK(MPI_Isend(static_cast<const char*>(buf) + off,
                             static_cast<int>(std::min(kMaxPiece, bytes - off)), MPI_BYTE, peer, 0,
                             comm_of(*this), &req));
    wait_bounded(&req, 1, timeout_seconds_, world_rank_, what);
  }
}

void MpiSession::recv(void* buf, size_t bytes, int peer, const char* what) {
  for (size_t off = 0; off < bytes; off += kMaxPiece) {
    MPI_Request req;
    IRIS_MPI_CHECK(MPI_Irecv(static_cast<char*>(buf) + off,
                             static_cast<int>(std::min(kMaxPiece, bytes - off)), MPI_BYTE, peer, 0,
                             comm_of(*this), &req));
    wait_bounded(&req, 1, timeout_seconds_, world_rank_, what);
  }
}

void MpiSession::barrier(const char* what) {
  MPI_Request req;
  IRIS_MPI_CHECK(MPI_Ibarrier(comm_of(*this), &req));
  wait_bounded(&req, 1, timeout_seconds_, world_rank_, what);
}

std::unique_ptr<MpiSession> MpiSession::split(int color, int key, const char* what) {
  barrier(what);
  std::unique_ptr<MpiSession> g(new MpiSession);
  g->group_ = std::make_unique<Group>();
  IRIS_MPI_CHECK(MPI_Comm_split(comm_of(*this), color, key, &g->group_->comm));
  IRIS_MPI_CHECK(MPI_Comm_set_errhandler(g->group_->comm, MPI_ERRORS_RETURN));
  IRIS_MPI_CHECK(MPI_Comm_rank(g->group_->comm, &g->rank_));
  IRIS_MPI_CHECK(MPI_Comm_size(g->group_->comm, &g->size_));
  g->world_rank_ = world_rank_;
  g->timeout_seconds_ = timeout_seconds_;
  return g;
}

void MpiSession::exchange(const Transfer* sends, int n_sends, const Transfer* recvs, int n_recvs,
                          const char* what) {
  IRIS_CHECK(n_sends >= 0 && n_recvs >= 0 && n_sends <= kMaxTransfers && n_recvs <= kMaxTransfers,
             what, ": at most ", kMaxTransfers, " sends and receives per exchange, got ", n_sends,
             " and ", n_recvs);
  // A message above one MPI call's count goes in pieces, posted (and so matched) in order.
  constexpr int kMaxRequests = 8 * kMaxTransfers;
  MPI_Request reqs[kMaxRequests];
  int n = 0;
  auto post = [&](const Transfer& t, bool send) {
    size_t off = 0;
    do {
      IRIS_CHECK(n < kMaxRequests, what, ": more than ", kMaxRequests,
                 " pieces in one exchange; its messages are too large");
      char* at = static_cast<char*>(t.buf) + off;
      const int count = static_cast<int>(std::min(kMaxPiece, t.bytes - off));
      if (send)
        IRIS_MPI_CHECK(MPI_Isend(at, count, MPI_BYTE, t.peer, 0, comm_of(*this), &reqs[n++]));
      else
        IRIS_MPI_CHECK(MPI_Irecv(at, count, MPI_BYTE, t.peer, 0, comm_of(*this), &reqs[n++]));
      off += kMaxPiece;
    } while (off < t.bytes);
  };
  // Receives first, so that every send finds its receive posted.
  for (int i = 0; i < n_recvs; ++i) post(recvs[i], false);
  for (int i = 0; i < n_sends; ++i) post(sends[i], true);
  if (n > 0) wait_bounded(reqs, n, timeout_seconds_, world_rank_, what);
}

void MpiSession::abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

#else  // !IRIS_WITH_MPI

bool MpiSession::available() {
  return false;
}

MpiSession& MpiSession::start(const LaunchEnv& env) {
  IRIS_FAIL("this process was started by ", env.launcher, " as rank ", env.rank, " of ", env.world,
            ", but this iris was built without MPI, which multi-process training needs; install "
            "libopenmpi-dev and openmpi-bin (scripts/setup.sh does) and rebuild");
}

void MpiSession::all_gather(const void*, void*, size_t, const char*) {
  IRIS_FAIL("built without MPI");
}
void MpiSession::all_to_all(const void*, void*, size_t, const char*) {
  IRIS_FAIL("built without MPI");
}
void MpiSession::broadcast(void*, size_t, int, const char*) {
  IRIS_FAIL("built without MPI");
}
void MpiSession::send(const void*, size_t, int, const char*) {
  IRIS_FAIL("built without MPI");
}
void MpiSession::recv(void*, size_t, int, const char*) {
  IRIS_FAIL("built without MPI");
}
void MpiSession::barrier(const char*) {
  IRIS_FAIL("built without MPI");
}
struct MpiSession::Group {};
MpiSession::~MpiSession() = default;
std::unique_ptr<MpiSession> MpiSession::split(int, int, const char*) {
  IRIS_FAIL("built without MPI");
}
void MpiSession::exchange(const Transfer*, int, const Transfer*, int, const char*) {
  IRIS_FAIL("built without MPI");
}
void MpiSession::abort(int code) {
  std::_Exit(code);
}

#endif

}  // namespace iris
