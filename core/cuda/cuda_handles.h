// Owners of CUDA streams, events and pinned host memory (non-copyable). Creation is checked;
// destruction ignores errors, so that the destructors that run it never throw.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "core/cuda/cuda_check.h"

namespace iris::cuda {

// A non-blocking stream: it does not wait for the legacy default stream.
class Stream {
 public:
  Stream() { IRIS_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Event {
 public:
  // flags: cudaEventDefault for an event that times.
  explicit Event(unsigned flags = cudaEventDisableTiming) {
    IRIS_CUDA_CHECK(cudaEventCreateWithFlags(&e_, flags));
  }
  ~Event() {
    if (e_) cudaEventDestroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

class PinnedBuffer {
 public:
  // flags: cudaHostAllocMapped for memory that kernels also read and write.
  explicit PinnedBuffer(size_t bytes, unsigned flags = cudaHostAllocDefault) : bytes_(bytes) {
    IRIS_CUDA_CHECK(cudaHostAlloc(&p_, bytes, flags));
  }
  ~PinnedBuffer() {
    if (p_) cudaFreeHost(p_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  char* data() const { return static_cast<char*>(p_); }
  size_t size() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

}  // namespace iris::cuda
