// The CUDA communicator: NCCL on a stream of its own, ordered against the backend's stream by
// events (each call starts after the backend's work queued before it, and the backend's later
// work waits for it), and the fixed-order piece sum as a kernel on that stream.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "core/cuda/cuda_check.h"
#include "core/cuda/cuda_handles.h"
#include "core/error.h"
#include "parallel/communicator.h"
#include "parallel/mpi_session.h"

namespace iris {
namespace {

[[noreturn]] void throw_nccl_error(ncclResult_t r, const char* stmt, const char* file, int line) {
  throw_error(file, line,
              str_cat("NCCL error ", static_cast<int>(r), " (", ncclGetErrorString(r), ") in `",
                      stmt, "`"));
}

#define IRIS_NCCL_CHECK(stmt)                                                                     \
  do {                                                                                            \
    const ncclResult_t iris_nccl_rc_ = (stmt);                                                    \
    if (iris_nccl_rc_ != ncclSuccess) throw_nccl_error(iris_nccl_rc_, #stmt, __FILE__, __LINE__); \
  } while (0)

// Each output element is its pieces added in rank order, one rounding per addition, as the CPU
// communicator adds them (plain float adds; nothing to contract into an FMA).
__global__ void sum_pieces_kernel(float* out, const float* pieces, int64_t n, int world,
                                  bool accumulate) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float s = pieces[i];
    for (int r = 1; r < world; ++r) s += pieces[r * n + i];
    out[i] = accumulate ? out[i] + s : s;
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(Backend& be, MpiSession* session, int rank, int world)
      : be_(be), rank_(rank), world_(world) {
    IRIS_CHECK(be.device() == Device::cuda, "the NCCL communicator needs a CUDA backend");
    IRIS_CHECK(world == 1 || session != nullptr,
               "a NCCL communicator of more than one rank needs MPI to share its id");
    ncclUniqueId id{};
    if (rank == 0) IRIS_NCCL_CHECK(ncclGetUniqueId(&id));
    if (world > 1) session->broadcast(&id, sizeof(id), 0, "the NCCL id broadcast");
    stream_ = std::make_unique<cuda::Stream>();
    before_ = std::make_unique<cuda::Event>();
    after_ = std::make_unique<cuda::Event>();
    IRIS_NCCL_CHECK(ncclCommInitRank(&comm_, world, id, rank));
  }
  // The communicator goes before the stream and events it uses (members are destroyed after).
  ~NcclCommunicator() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return world_; }
  std::string name() const override { return "NCCL"; }
  Device device() const override { return Device::cuda; }

  void all_gather(const Tensor& out, const Tensor& in) override {
    check(out, "all_gather");
    check(in, "all_gather");
    IRIS_CHECK(out.nbytes() == in.nbytes() * static_cast<size_t>(world_),
               "all_gather: out must hold size() copies of in, got ", out.shape_str(), " and ",
               in.shape_str());
    Ordered o(*this);
    IRIS_NCCL_CHECK(
        ncclAllGather(in.data, out.data, in.nbytes(), ncclUint8, comm_, stream_->get()));
  }
  void all_to_all(const Tensor& out, const Tensor& in) override {
    check(out, "all_to_all");
    check(in, "all_to_all");
    IRIS_CHECK(out.nbytes() == in.nbytes() && in.nbytes() % static_cast<size_t>(world_) == 0,
               "all_to_all: in and out of the same size, a multiple of size(), got ",
               in.shape_str(), " and ", out.shape_str());
    const size_t piece = in.nbytes() / static_cast<size_t>(world_);
    Ordered o(*this);
    IRIS_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < world_; ++r) {
      IRIS_NCCL_CHECK(ncclSend(static_cast<const char*>(in.data) + r * piece, piece, ncclUint8, r,
                               comm_, stream_->get()));
      IRIS_NCCL_CHECK(ncclRecv(static_cast<char*>(out.data) + r * piece, piece, ncclUint8, r, comm_,
                               stream_->get()));
    }
    IRIS_NCCL_CHECK(ncclGroupEnd());
  }
  void broadcast(const Tensor& buf, int root) override {
    check(buf, "broadcast");
    Ordered o(*this);
    IRIS_NCCL_CHECK(
        ncclBroadcast(buf.data, buf.data, buf.nbytes(), ncclUint8, root, comm_, stream_->get()));
  }
  void send(const Tensor& t, int peer) override {
    check(t, "send");
    Ordered o(*this);
    IRIS_NCCL_CHECK(ncclSend(t.data, t.nbytes(), ncclUint8, peer, comm_, stream_->get()));
  }
  void recv(const Tensor& t, int peer) override {
    check(t, "recv");
    Ordered o(*this);
    IRIS_NCCL_CHECK(ncclRecv(t.data, t.nbytes(), ncclUint8, peer, comm_, stream_->get()));
  }
  void exchange(std::span<const Transfer> sends, std::span<const Transfer> recvs,
                const char* what) override {
    // Every check before the group opens, so that a bad call leaves no group half built.
    bool any = false;
    for (const auto* list : {&sends, &recvs})
      for (const Transfer& x : *list) {
        check(x.t, what);
        IRIS_CHECK(x.peer >= 0 && x.peer < world_, what, ": peer ", x.peer,
                   " is not a rank of this communicator of ", world_);
        any = any || x.t.nbytes() > 0;
      }
    if (!any) return;
    Ordered o(*this);
    // One group: NCCL posts the receives and sends together, and (as MPI does) matches the
    // messages between two ranks in one direction in the order they are posted. Both sides
    // compute the same sizes, so an empty message is skipped on both.
    IRIS_NCCL_CHECK(ncclGroupStart());
    for (const Transfer& x : recvs)
      if (x.t.nbytes() > 0)
        IRIS_NCCL_CHECK(ncclRecv(x.t.data, x.t.nbytes(), ncclUint8, x.peer, comm_, stream_->get()));
    for (const Transfer& x : sends)
      if (x.t.nbytes() > 0)
        IRIS_NCCL_CHECK(ncclSend(x.t.data, x.t.nbytes(), ncclUint8, x.peer, comm_, stream_->get()));
    IRIS_NCCL_CHECK(ncclGroupEnd());
  }
  void mark_point(int k) override {
    IRIS_CHECK(k >= 0 && k < kPoints, "mark_point: point ", k, " of ", kPoints);
    if (!points_[k]) points_[k] = std::make_unique<cuda::Event>();
    IRIS_CUDA_CHECK(cudaEventRecord(points_[k]->get(), stream_->get()));
  }
  void wait_point(int k) override {
    IRIS_CHECK(k >= 0 && k < kPoints, "wait_point: point ", k, " of ", kPoints);
    if (!points_[k]) return;
    IRIS_CUDA_CHECK(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(be_.native_stream()), points_[k]->get(), 0));
  }
  void begin_detached() override { detached_ = true; }
  void end_detached() override {
    if (!detached_) return;
    detached_ = false;
    // The stream runs its calls in order, so waiting for its last one waits for all of them.
    IRIS_CUDA_CHECK(cudaEventRecord(after_->get(), stream_->get()));
    IRIS_CUDA_CHECK(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(be_.native_stream()), after_->get(), 0));
  }
  using Communicator::sum_pieces;
  void sum_pieces(const Tensor& out, const Tensor& pieces, bool accumulate) override {
    check(out, "sum_pieces");
    check(pieces, "sum_pieces");
    const int64_t n = out.numel();
    IRIS_CHECK(
        out.dtype == DType::f32 && pieces.dtype == DType::f32 && pieces.numel() == n * world_,
        "sum_pieces: f32 out [n] and pieces [", world_, " * n], got ", out.shape_str(), " and ",
        pieces.shape_str());
    if (n == 0) return;
    Ordered o(*this);
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 4096));
    sum_pieces_kernel<<<blocks, threads, 0, stream_->get()>>>(out.as<float>(), pieces.as<float>(),
                                                              n, world_, accumulate);
    IRIS_CUDA_LAUNCH_CHECK();
  }

 private:
  // Brackets one call: the communicator's stream waits for the backend's work so far, and the
  // backend's stream waits for the call (unless detached: then end_detached() makes it wait).
  class Ordered {
   public:
    explicit Ordered(NcclCommunicator& c) : c_(c) {
      auto compute = static_cast<cudaStream_t>(c_.be_.native_stream());
      IRIS_CUDA_CHECK(cudaEventRecord(c_.before_->get(), compute));
      IRIS_CUDA_CHECK(cudaStreamWaitEvent(c_.stream_->get(), c_.before_->get(), 0));
    }
    ~Ordered() noexcept(false) {
      if (std::uncaught_exceptions() > 0 || c_.detached_) return;
      auto compute = static_cast<cudaStream_t>(c_.be_.native_stream());
      IRIS_CUDA_CHECK(cudaEventRecord(c_.after_->get(), c_.stream_->get()));
      IRIS_CUDA_CHECK(cudaStreamWaitEvent(compute, c_.after_->get(), 0));
    }

   private:
    NcclCommunicator& c_;
  };

  static void check(const Tensor& t, const char* op) {
    IRIS_CHECK(t.device == Device::cuda, op,
               ": the NCCL communicator moves CUDA tensors (use MPI for CPU ones)");
  }

  Backend& be_;
  int rank_, world_;
  ncclComm_t comm_ = nullptr;
  // Made in the constructor once the checks and the id broadcast have passed.
  std::unique_ptr<cuda::Stream> stream_;
  std::unique_ptr<cuda::Event> before_, after_;
  std::array<std::unique_ptr<cuda::Event>, kPoints> points_;
  bool detached_ = false;
};

// Step ends reached, as the GPU writes them into host memory: the watchdog thread reads them
// with no CUDA call, which could wait behind the main thread's blocked one.
__global__ void store_reached_kernel(unsigned long long* reached, unsigned long long seq) {
  *reinterpret_cast<volatile unsigned long long*>(reached) = seq;
  __threadfence_system();
}

class MarkWatchdog final : public StallWatchdog {
 public:
  MarkWatchdog(Backend& be, double timeout_seconds, int rank)
      : stream_(static_cast<cudaStream_t>(be.native_stream())),
        timeout_(timeout_seconds),
        rank_(rank) {
    IRIS_CHECK(be.device() == Device::cuda, "the stall watchdog watches a CUDA backend");
    reached_ =
        std::make_unique<cuda::PinnedBuffer>(sizeof(unsigned long long), cudaHostAllocMapped);
    reached_host_ = reinterpret_cast<unsigned long long*>(reached_->data());
    *reached_host_ = 0;
    void* dev = nullptr;
    IRIS_CUDA_CHECK(cudaHostGetDevicePointer(&dev, reached_host_, 0));
    reached_dev_ = static_cast<unsigned long long*>(dev);
    thread_ = std::thread([this] { watch(); });
  }
  ~MarkWatchdog() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
    // The last mark may still be queued: it writes the memory that reached_ frees after this.
    cudaStreamSynchronize(stream_);
  }

  void mark() override {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    IRIS_CUDA_CHECK(cudaStreamIsCapturing(stream_, &capturing));
    if (capturing != cudaStreamCaptureStatusNone) return;  // a graph must not hold the mark
    const unsigned long long seq = marked_.load(std::memory_order_relaxed) + 1;
    marked_at_[seq % kTimes].store(Clock::now().time_since_epoch().count(),
                                   std::memory_order_relaxed);
    marked_.store(seq, std::memory_order_release);
    store_reached_kernel<<<1, 1, 0, stream_>>>(reached_dev_, seq);
    IRIS_CUDA_LAUNCH_CHECK();
  }

 private:
  using Clock = std::chrono::steady_clock;
  // Mark times kept; a host further ahead overwrites the oldest with later times, which only
  // lengthens the wait tolerated.
  static constexpr size_t kTimes = 64;

  void watch() {
    unsigned long long seen = 0;
    Clock::time_point progress = Clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    while (!wake_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; })) {
      const unsigned long long reached =
          *reinterpret_cast<volatile unsigned long long*>(reached_host_);
      const unsigned long long marked = marked_.load(std::memory_order_acquire);
      if (reached != seen) {
        seen = reached;
        progress = Clock::now();
      }
      if (reached >= marked) continue;
      const Clock::time_point pending_since{
          Clock::duration(marked_at_[(reached + 1) % kTimes].load(std::memory_order_relaxed))};
      const double waited =
          std::chrono::duration<double>(Clock::now() - std::max(progress, pending_since)).count();
      if (waited > timeout_) {
        std::fflush(stdout);
        std::fprintf(stderr,
                     "error: rank %d: the GPU has not finished a step for %.0f s: a collective "
                     "or pipeline exchange waits in NCCL for a rank that stopped responding or "
                     "died (parallel.timeout_seconds is %.0f); ending the job\n",
                     rank_, waited, timeout_);
        std::fflush(stderr);
        // The main thread may be blocked inside a CUDA call, where no exception reaches it, so
        // the process ends here (its kernels with it); its launcher then ends the other ranks.
        std::_Exit(1);
      }
    }
  }

  cudaStream_t stream_;
  double timeout_;
  int rank_;
  std::unique_ptr<cuda::PinnedBuffer> reached_;  // made after the backend check
  unsigned long long* reached_host_ = nullptr;   // reached_'s memory, as the host sees it
  unsigned long long* reached_dev_ = nullptr;    // and as kernels see it
  std::atomic<unsigned long long> marked_{0};
  std::array<std::atomic<Clock::rep>, kTimes> marked_at_{};
  std::mutex mu_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

std::unique_ptr<StallWatchdog> make_stall_watchdog(Backend& be, double timeout_seconds, int rank) {
  return std::make_unique<MarkWatchdog>(be, timeout_seconds, rank);
}

std::unique_ptr<Communicator> make_nccl_communicator(Backend& be, MpiSession* session, int rank,
                                                     int world) {
  return std::make_unique<NcclCommunicator>(be, session, rank, world);
}

bool nccl_available() {
  return true;
}

}  // namespace iris
