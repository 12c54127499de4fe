// The op interface every backend implements. Model code (vision/, language/, bridge/) is written
// once against it; the CPU backend is the fp32 oracle, the CUDA backend runs bf16 with fp32
// accumulation. All tensors are contiguous and row-major; "rows" are all dims but the last.
//
// Conventions shared by all ops:
//  - Float tensors passed to one call share the backend's compute dtype unless a parameter says
//    otherwise (f32 on the CPU, bf16 on CUDA). Index tensors are i32.
//  - An optional tensor is passed as a default-constructed Tensor (defined() == false).
//  - Outputs may alias inputs only where the op's comment says so.
//  - Ops are asynchronous on devices that have streams; read() synchronises.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "core/dropout_draw.h"
#include "core/image_patches.h"
#include "core/tensor.h"
#include "core/tuning_cache.h"

namespace iris {

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Device device() const = 0;
  virtual std::string name() const = 0;
  // dtype of weights and activations on this backend.
  virtual DType compute_dtype() const = 0;

  // Raw device memory, used by Arena (once, up front) and never inside a step loop.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* ptr) = 0;

  // dst.numel() elements from host memory of type src_dtype, converted to dst.dtype.
  virtual void write(const Tensor& dst, const void* host_src, DType src_dtype) = 0;
  // write() of a source that may hold NaN or Inf (a checkpoint's weights): returns the index of
  // the first such element of host_src, dst then holding an unspecified part of it, or -1 when
  // all are finite and dst holds them. A backend that stages its writes checks each block as it
  // copies it, so that the host reads the source once.
  virtual int64_t write_finite(const Tensor& dst, const void* host_src, DType src_dtype) {
    const int64_t bad = first_non_finite(host_src, src_dtype, dst.numel());
    if (bad < 0) write(dst, host_src, src_dtype);
    return bad;
  }
  // write_finite() of many sources at once (a checkpoint's weights): returns, per write, the
  // index of its source's first NaN or Inf element, or -1. A backend that stages its writes may
  // run them concurrently (CUDA: a few host threads, each copying whole blocks into pinned memory
  // of its own and uploading them), so that the host reads at the rate of its memory rather than
  // of one copy loop. Every write has landed (or its failure is known) when it returns.
  struct HostWrite {
    Tensor dst;
    const void* src = nullptr;
    DType src_dtype = DType::f32;
  };
  virtual std::vector<int64_t> write_all_finite(const std::vector<HostWrite>& writes) {
    std::vector<int64_t> bad;
    bad.reserve(writes.size());
    for (const HostWrite& w : writes) bad.push_back(write_finite(w.dst, w.src, w.src_dtype));
    return bad;
  }
  // A backend whose writes go through host staging (CUDA: pinned memory, reused once the copies
  // it fed are done) makes a write wait for the device when the staging is full. A caller that
  // writes up to `bytes` between two points where it waits anyway (a training step, which ends
  // in a read) reserves them here, once and outside any step, so that its writes never wait and
  // the host queues the whole step ahead of the device. Writing directly: nothing to do.
  virtual void reserve_write_staging(size_t bytes) { (void)bytes; }
  // Seconds the host spent in writes waiting for the device to finish with the staging since the
  // last call: a host that runs ahead of the device by the staging's depth waits there, which is
  // throttling, not work.
  virtual double take_write_wait_seconds() { return 0; }
  // Holds the device behind the work queued so far until release_device(), so that a host
  // timed meanwhile queues work that cannot start: its enqueue time is then its own, not time
  // blocked behind a busy device (a launch waits once the launch queue is full). The hold ends
  // by itself after `limit_seconds`; release_device() waits for the device and says whether it
  // did, in which case the host filled the queue (or waited for the device) before releasing.
  // Only ops that have run before may be queued while held: with CUDA's lazy module loading a
  // kernel's first launch loads its module, which waits for the held device, so the host
  // stalls until the limit. Nothing to hold where the host runs the ops itself.
  virtual void hold_device(double limit_seconds) { (void)limit_seconds; }
  virtual bool release_device() { return false; }
  // src.numel() elements into host memory as dst_dtype (waits for pending work).
  virtual void read(void* host_dst, DType dst_dtype, const Tensor& src) = 0;
  virtual void synchronize() = 0;
  // The stream ops are issued on (a cudaStream_t on CUDA); null where there is none. CUDA graph
  // capture records this stream.
  virtual void* native_stream() { return nullptr; }
  // Waits for background start-up work (CUDA: the cuBLASLt warm-up thread) to end. That work
  // loads modules, which waits for the whole context: beside a stream capture it invalidates the
  // capture, and beside a kernel that spins until the host releases it (hold_device) it stalls
  // until the spin's limit. Graph capture calls it before it begins.
  virtual void finish_background_startup() {}
  // How GEMM algorithms are chosen for shapes first planned afterwards (core/tuning_cache.h):
  // `cached` (the default) takes the persistent tuning cache's pick for a shape it holds and
  // cuBLASLt's first choice otherwise, never timing on the user's time; `tune` times each new
  // shape's candidates and records the fastest, which save_gemm_tuning() then writes;
  // `heuristic` takes cuBLASLt's first choice always and ignores the cache, so that the choice
  // depends only on the GPU, the library and the shape (training uses it: a run resumed in a new
  // process continues bit for bit whatever the cache holds). No-op where GEMMs are not tuned.
  virtual void set_gemm_tuning(GemmTuning mode) { (void)mode; }
  // The switch from before the cache: on times new shapes (now also recording them, `tune`), off
  // takes the first choice (`heuristic`).
  void set_gemm_autotune(bool on) {
    set_gemm_tuning(on ? GemmTuning::tune : GemmTuning::heuristic);
  }
  // Writes the tuning cache file when this process recorded picks; true when it did. A failure is
  // a warning, never an error: tuning results are an optimisation.
  virtual bool save_gemm_tuning() { return false; }
  // The current mode, the cache file and where the GEMM plans made so far took their algorithm.
  virtual GemmTuningReport gemm_tuning_report() { return {}; }
  // Device memory in use by this process's context (cudaMemGetInfo), for reports; 0 on the CPU.
  virtual size_t device_memory_in_use() { return 0; }
  // The device's whole memory, which a training run's memory plan must fit; 0 on the CPU.
  virtual size_t device_memory_total() { return 0; }
  // Op tapes, for the recording graph stand-in (core/graph_capture.h): between begin_op_tape()
  // and end_op_tape() the calling thread's ops run and are also recorded with their arguments as
  // they are now, and the function end_op_tape() returns replays that record, exactly as a CUDA
  // graph replays its capture: a host value (a learning rate, a row count) passed at capture is
  // what every replay uses, while tensor contents are read at replay. Host traffic (write, read,
  // allocate, deallocate, synchronize) while taping is an error, as it is inside a CUDA capture.
  // A backend that cannot tape returns false from begin_op_tape().
  virtual bool begin_op_tape() { return false; }
  virtual std::function<void()> end_op_tape() { return nullptr; }
  // Runs `enqueue` and waits for its work; returns the milliseconds the device spent from the
  // first to the last piece of that work (events on CUDA), or the wall time where the work runs
  // on the host. For benchmarks: a launch-bound phase shows a device span near its wall time.
  // Brackets work for an external profiler started with its collection off (Nsight Compute's
  // --profile-from-start off): only work issued between on and off is profiled. No-op on the CPU.
  virtual void profiler_collect(bool on) { (void)on; }
  // Timing marks, for timing a loop's iterations without a synchronisation per iteration (the
  // trainer's step time on the device). record_timing_mark(slot) marks the point that the work
  // issued so far has reached: an event recorded on the stream on CUDA (covering side work issued
  // before it), the host clock on the CPU, whose ops have finished when they return.
  // timing_mark_elapsed_ms(from, to) waits for mark `to` and returns the milliseconds from mark
  // `from` to it as the device saw them. Slots are 0 .. kTimingMarks - 1, made with the backend
  // so that recording one allocates nothing; recording a slot again moves it. Refused inside a
  // graph capture, where an event would be recorded into the graph rather than timed now.
  static constexpr int kTimingMarks = 32;
  virtual void record_timing_mark(int slot) = 0;
  virtual double timing_mark_elapsed_ms(int from, int to) = 0;
  virtual double device_span_ms(const std::function<void()>& enqueue) {
    const auto t0 = std::chrono::steady_clock::now();
    enqueue();
    synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }

  // Activation offload (training/train_model.h): host memory that stays put for the run (pinned
  // on CUDA, so that copies to and from it are asynchronous DMA), allocated once up front, and
  // copies between it and this backend's tensors on a copy stream of the backend's own. A copy
  // starts after the work queued before it and the backend's later work does not wait for it;
  // mark_copies(k) notes the copies queued so far and wait_copies(k) makes the backend's later
  // work wait for them (the last mark of k; none yet: no wait). Outside graph captures only.
  // Where the backend runs on the host (the CPU) the copies are made at once into memory of its
  // own, so that the same path runs in CI.
  static constexpr int kCopyPoints = 4;
  virtual void* allocate_host(size_t bytes);
  virtual void free_host(void* ptr);
  virtual void copy_to_host_async(void* host_dst, const Tensor& src);
  virtual void copy_from_host_async(const Tensor& dst, const void* host_src);
  virtual void mark_copies(int k) { (void)k; }
  virtual void wait_copies(int k) { (void)k; }

  // The ops: core/backend_ops.inc lists them and says what each computes.
#define IRIS_BACKEND_OP(name, params, args) virtual void name params = 0;
#define IRIS_BACKEND_OP_WITH_DEFAULT(name, params, args) virtual void name params;
#include "core/backend_ops.inc"
#undef IRIS_BACKEND_OP
#undef IRIS_BACKEND_OP_WITH_DEFAULT

  // vision_tables without window attention.
  void vision_tables(const Tensor& cos, const Tensor& sin, const Tensor& pos_index,
                     const Tensor& pos_weight, const Tensor& cu_seqlens, const Tensor& real_rows,
                     const Tensor& grids, const std::vector<float>& inv_freq, int merge_size,
                     int grid_side) {
    vision_tables(cos, sin, pos_index, pos_weight, cu_seqlens, real_rows, grids, inv_freq,
                  merge_size, grid_side, Tensor(), 0);
  }

  // The bytes of the workspace that lm_head_loss needs.
  virtual size_t lm_head_loss_workspace_bytes(int64_t chunk_rows, int64_t hidden,
                                              int64_t vocab) const = 0;
};

// The defaults of the ops that have one (core/backend_ops.inc): side work runs in order where a
// backend has no second stream, and a fused op is the sequence it fuses.
inline void* Backend::allocate_host(size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
inline void Backend::free_host(void* ptr) {
  std::free(ptr);
}
inline void Backend::copy_to_host_async(void* host_dst, const Tensor& src) {
  IRIS_CHECK(src.device == Device::cpu, "copy_to_host_async: ", name(),
             " keeps its tensors off the host and must make the copy itself");
  if (src.nbytes() > 0) std::memcpy(host_dst, src.data, src.nbytes());
}
inline void Backend::copy_from_host_async(const Tensor& dst, const void* host_src) {
  IRIS_CHECK(dst.device == Device::cpu, "copy_from_host_async: ", name(),
             " keeps its tensors off the host and must make the copy itself");
  if (dst.nbytes() > 0) std::memcpy(dst.data, host_src, dst.nbytes());
}

inline void Backend::begin_side_work() {}
inline void Backend::end_side_work() {}
inline void Backend::join_side_work() {}

inline void Backend::qkv_norm_rope_kv_store(const Tensor& qkv, const Tensor& q_norm_w,
                                            const Tensor& k_norm_w, float eps, const Tensor& cos,
                                            const Tensor& sin, int n_q_heads, int n_kv_heads,
                                            int head_dim, bool round_tables_to_compute_dtype,
                                            const Tensor& k_cache, const Tensor& v_cache,
                                            const Tensor& past_len) {
  qkv_norm_rope(qkv, q_norm_w, k_norm_w, eps, cos, sin, n_q_heads, n_kv_heads, head_dim,
                round_tables_to_compute_dtype);
  kv_store(k_cache, v_cache, qkv, past_len, n_q_heads, n_kv_heads, head_dim);
}

inline void Backend::linear_gelu_tanh(const Tensor& y, const Tensor& x, const Tensor& w,
                                      const Tensor& bias) {
  linear(y, x, w, bias, false);
  gelu_tanh(y, y);
}

inline void Backend::rms_norm_linear(const Tensor& y, const Tensor& xn, const Tensor& x,
                                     const Tensor& norm_w, float eps, const Tensor& w,
                                     const Tensor& bias, const Tensor& act) {
  rms_norm(xn, x, norm_w, eps);
  linear(y, xn, w, bias, false);
  if (act.defined()) swiglu(act, y);
}
// The compute-dtype copy of an f32 tensor that GEMMs read: src converted into `copy`, or src itself
// where the compute dtype is f32 and `copy` aliases it.
inline Tensor in_compute_dtype(Backend& be, const Tensor& src, const Tensor& copy) {
  if (copy.data == src.data) return src;
  be.convert(copy, src);
  return copy;
}

// The draws below which an element is dropped, for a probability p in [0, 1).
inline uint32_t dropout_threshold(float p) {
  IRIS_CHECK(p >= 0.0f && p < 1.0f, "dropout probability ", p, " outside [0, 1)");
  return static_cast<uint32_t>(static_cast<double>(p) * 4294967296.0);
}

// add_column_block's shape rules, which every backend checks the same way.
inline void check_column_block(const Tensor& dst, int64_t dst_col, const Tensor& src,
                               int64_t src_col, int64_t cols) {
  IRIS_CHECK(dst.ndim == 2 && src.ndim == 2 && dst.rows() == src.rows(), "add_column_block: dst ",
             dst.shape_str(), " and src ", src.shape_str(), " must be matrices with the same rows");
  IRIS_CHECK(cols >= 0 && dst_col >= 0 && src_col >= 0 && dst_col + cols <= dst.cols() &&
                 src_col + cols <= src.cols(),
             "add_column_block: columns [", src_col, ", ", src_col + cols, ") of ", src.shape_str(),
             " to [", dst_col, ", ", dst_col + cols, ") of ", dst.shape_str(), " are out of range");
  IRIS_CHECK(dst.data != src.data, "add_column_block: dst and src must not overlap");
}

// Side work for a scope: begun on construction (when `active`), ended on destruction, also when
// an op inside throws, so that a failed call does not leave later ops on the side stream.
class SideWorkScope {
 public:
  SideWorkScope(Backend& be, bool active) : be_(active ? &be : nullptr) {
    if (be_) be_->begin_side_work();
  }
  ~SideWorkScope() {
    if (be_ == nullptr) return;
    try {
      be_->end_side_work();
    } catch (...) {  // a destructor never throws; the error that unwound here is the one to see
    }
  }
  SideWorkScope(const SideWorkScope&) = delete;
  SideWorkScope& operator=(const SideWorkScope&) = delete;

 private:
  Backend* be_;
};

std::unique_ptr<Backend> make_cpu_backend();
// Throws a clear error when Iris was built without CUDA or no GPU is present.
std::unique_ptr<Backend> make_cuda_backend(int device_index = 0);
// "cpu" or "cuda"/"cuda:N".
std::unique_ptr<Backend> make_backend(const std::string& spec);
bool cuda_available();

}  // namespace iris
