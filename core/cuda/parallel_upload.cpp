#include "core/cuda/parallel_upload.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "core/cuda/cuda_check.h"
#include "core/cuda/cuda_handles.h"
#include "core/cuda/host_convert.h"

namespace iris::cuda {
namespace {

// Large enough that a copy's fixed costs vanish, small enough that the pinned buffers (two per
// thread) cost little to allocate and the last blocks leave the other threads idle only briefly.
constexpr size_t kBlockBytes = size_t{2} << 20;

struct Job {
  size_t write;
  int64_t begin, count;  // elements
};

}  // namespace

std::vector<int64_t> upload_all_finite(const std::vector<Backend::HostWrite>& writes,
                                       cudaStream_t after, int workers) {
  std::vector<Job> jobs;
  for (size_t i = 0; i < writes.size(); ++i) {
    const Tensor& dst = writes[i].dst;
    const int64_t n = dst.numel();
    if (n > 0)
      IRIS_CHECK(writes[i].src != nullptr, "write: null host source for ", dst.shape_str());
    const int64_t per_block = static_cast<int64_t>(kBlockBytes / dtype_size(dst.dtype));
    for (int64_t b = 0; b < n; b += per_block) jobs.push_back({i, b, std::min(per_block, n - b)});
  }
  std::vector<int64_t> bad(writes.size(), -1);
  if (jobs.empty()) return bad;

  int device = 0;
  IRIS_CUDA_CHECK(cudaGetDevice(&device));
  const int n_workers =
      static_cast<int>(std::min<size_t>(static_cast<size_t>(std::max(workers, 1)), jobs.size()));
  PinnedBuffer pinned(static_cast<size_t>(n_workers) * 2 * kBlockBytes);
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<std::unique_ptr<Event>> buffer_free;  // per worker and half: its last copy
  Event start;
  IRIS_CUDA_CHECK(cudaEventRecord(start.get(), after));
  for (int w = 0; w < n_workers; ++w) {
    streams.push_back(std::make_unique<Stream>());
    IRIS_CUDA_CHECK(cudaStreamWaitEvent(streams.back()->get(), start.get(), 0));
    for (int h = 0; h < 2; ++h) buffer_free.push_back(std::make_unique<Event>());
  }

  std::vector<int64_t> job_bad(jobs.size(), -1);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto work = [&](int w) {
    try {
      IRIS_CUDA_CHECK(cudaSetDevice(device));
      const cudaStream_t stream = streams[w]->get();
      int half = 0;
      for (;;) {
        const size_t j = next.fetch_add(1);
        if (j >= jobs.size() || failed.load()) break;
        const Job& job = jobs[j];
        const Backend::HostWrite& wr = writes[job.write];
        const cudaEvent_t free_event = buffer_free[2 * w + half]->get();
        char* stage = pinned.data() + (2 * static_cast<size_t>(w) + half) * kBlockBytes;
        // The buffer's previous block must be on the device before it is overwritten; an event
        // never recorded is already complete.
        IRIS_CUDA_CHECK(cudaEventSynchronize(free_event));
        const DType to = wr.dst.dtype;
        const char* src = static_cast<const char*>(wr.src) +
                          job.begin * static_cast<int64_t>(dtype_size(wr.src_dtype));
        const int64_t b = wr.src_dtype == to
                              ? copy_finite(stage, src, to, job.count)
                              : convert_finite(stage, to, src, wr.src_dtype, job.count);
        if (b >= 0) {
          job_bad[j] = job.begin + b;
          continue;
        }
        const size_t elem = dtype_size(to);
        IRIS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(wr.dst.data) + job.begin * elem, stage,
                                        static_cast<size_t>(job.count) * elem,
                                        cudaMemcpyHostToDevice, stream));
        IRIS_CUDA_CHECK(cudaEventRecord(free_event, stream));
        half ^= 1;
      }
      IRIS_CUDA_CHECK(cudaStreamSynchronize(stream));
    } catch (...) {
      failed = true;
      // The pinned buffers outlive no copy that reads them.
      cudaStreamSynchronize(streams[w]->get());
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  for (int w = 1; w < n_workers; ++w) threads.emplace_back(work, w);
  work(0);
  for (std::thread& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  for (size_t j = 0; j < jobs.size(); ++j)
    if (job_bad[j] >= 0) {
      int64_t& first = bad[jobs[j].write];
      first = first < 0 ? job_bad[j] : std::min(first, job_bad[j]);
    }
  return bad;
}

}  // namespace iris::cuda
