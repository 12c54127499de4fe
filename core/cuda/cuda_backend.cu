// The CUDA backend: bf16 storage, fp32 accumulation, one stream. Ops validate shapes on the host
// and enqueue kernels; nothing but read() and synchronize() waits for the device.
#include "core/cuda/cuda_backend.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include <cuda_profiler_api.h>

#include "core/cuda/attention/attention.h"
#include "core/cuda/cuda_check.h"
#include "core/cuda/cuda_handles.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/elementwise/elementwise.h"
#include "core/cuda/gemm/gemm.h"
#include "core/cuda/gemm/gemm_tuning.h"
#include "core/cuda/host_convert.h"
#include "core/cuda/launch.cuh"
#include "core/cuda/logits/logits.h"
#include "core/cuda/moe/moe.h"
#include "core/cuda/moe/moe_batched_gemm.h"
#include "core/cuda/norm_rope/norm_rope.h"
#include "core/cuda/optimizer/optimizer.h"
#include "core/cuda/parallel_upload.h"
#include "core/cuda/pixels/pixels.h"
#include "core/cuda/rows/rows.h"
#include "core/cuda/tables/tables.h"
#include "core/cuda/train_scratch.h"
#include "core/loss_workspace.h"
#include "core/moe_ops.h"
#include "core/text_rope_tables.h"
#include "core/usable_cores.h"
#include "core/vision_tables.h"

namespace iris {
namespace {

// Frees a buffer obtained from CudaBackend::allocate().
struct DeviceFree {
  void operator()(void* p) const noexcept { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<void, DeviceFree>;

// Spins until the host writes a non-zero *release or `limit_ns` of the GPU's global timer pass;
// *expired says which. Host-mapped memory, so that the host releases it with a plain store while
// its stream is held.
__global__ void hold_device_kernel(const volatile int* release, int* expired, uint64_t limit_ns) {
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while (*release == 0) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > limit_ns) {
      *expired = 1;
      return;
    }
    __nanosleep(1000);
  }
  *expired = 0;
}

// How the host thread waits for the device (synchronize, reads, staging reuse). IRIS_CUDA_HOST_WAIT
// = spin | yield | block; unset: CUDA's own choice (spin while there are fewer contexts than
// cores).
unsigned host_wait_flags() {
  const char* v = std::getenv("IRIS_CUDA_HOST_WAIT");
  if (v == nullptr || *v == 0) return cudaDeviceScheduleAuto;
  const std::string s = v;
  if (s == "spin") return cudaDeviceScheduleSpin;
  if (s == "yield") return cudaDeviceScheduleYield;
  if (s == "block") return cudaDeviceScheduleBlockingSync;
  IRIS_FAIL("IRIS_CUDA_HOST_WAIT=", s, " is not one of spin, yield, block");
}

// ---- host-side dtype conversion for write()/read() ----

// core/dtype's convert_elements with multi-threaded loops for the pairs weights and activations
// go through (f32 <-> bf16).
void convert_host(void* dst, DType to, const void* src, DType from, int64_t n) {
  if (from == to) {
    // A weight in the file's own dtype (the usual bf16 checkpoint): the staging copy is the
    // only pass over it, and one thread does not keep up with the upload.
    cuda::copy_bytes_parallel(dst, src, static_cast<size_t>(n) * dtype_size(to));
    return;
  }
  if (from == DType::f32 && to == DType::bf16) {
    cuda::convert_f32_to_bf16(static_cast<uint16_t*>(dst), static_cast<const float*>(src), n);
    return;
  }
  if (from == DType::bf16 && to == DType::f32) {
    cuda::convert_bf16_to_f32(static_cast<float*>(dst), static_cast<const uint16_t*>(src), n);
    return;
  }
  convert_elements(dst, to, src, from, n);
}

uint16_t* bf(const Tensor& t) {
  return static_cast<uint16_t*>(t.data);
}
const uint16_t* cbf(const Tensor& t) {
  return static_cast<const uint16_t*>(t.data);
}
const uint16_t* cbf_opt(const Tensor& t) {
  return t.defined() ? cbf(t) : nullptr;
}
const int32_t* ci32(const Tensor& t) {
  return static_cast<const int32_t*>(t.data);
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    IRIS_CUDA_CHECK(cudaSetDevice(device_));
    IRIS_CUDA_CHECK(cudaSetDeviceFlags(host_wait_flags()));
    cudaDeviceProp prop{};
    IRIS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    IRIS_CHECK(prop.major >= 8, "CUDA device ", device_, " (", prop.name,
               ") has compute capability ", prop.major, ".", prop.minor,
               "; the bf16 kernels need 8.0 or newer");
    name_ = str_cat("cuda:", device_, " (", prop.name, ")");
    num_sms_ = prop.multiProcessorCount;
    heuristics_warmup_ = std::make_unique<cuda::HeuristicsWarmup>(device_);
    stream_ = std::make_unique<cuda::Stream>();
    for (auto& e : staging_events_) e = std::make_unique<cuda::Event>();
    staging_ = std::make_unique<cuda::PinnedBuffer>(2 * kStagingChunk);
    // The only device allocations besides the arenas, made once here through allocate().
    workspace_.reset(allocate(kGemmWorkspaceBytes));
    tune_scratch_.reset(allocate(kGemmTuneScratchBytes));
    decode_buffer_.reset(allocate(kDecodeScratchBytes));
    argmax_keys_.reset(allocate(kArgmaxScratchRows * sizeof(unsigned long long)));
    // The file is read when the first GEMM is planned from it, not here.
    tuning_cache_ = std::make_unique<GemmTuningCache>(gemm_tuning_cache_path(),
                                                      cuda::gemm_tuning_identity(device_));
    gemm_ =
        std::make_unique<cuda::LtGemm>(workspace_.get(), kGemmWorkspaceBytes, tune_scratch_.get(),
                                       kGemmTuneScratchBytes, tuning_cache_.get());
    side_stream_ = std::make_unique<cuda::Stream>();
    side_fork_ = std::make_unique<cuda::Event>();
    side_done_ = std::make_unique<cuda::Event>();
    side_workspace_.reset(allocate(kGemmWorkspaceBytes));
    for (auto& e : timing_marks_) e = std::make_unique<cuda::Event>(cudaEventDefault);
    // A GEMM's workspace holds live data while it runs, so side work has its own; the tuning
    // scratch only receives trial outputs that nothing reads, so the two share it.
    side_gemm_ = std::make_unique<cuda::LtGemm>(side_workspace_.get(), kGemmWorkspaceBytes,
                                                tune_scratch_.get(), kGemmTuneScratchBytes,
                                                tuning_cache_.get());
    // On the main stream only, between its GEMMs: it shares their workspace.
    moe_gemm_ = std::make_unique<cuda::MoeBatchedGemm>(workspace_.get(), kGemmWorkspaceBytes);
    const int64_t rows = kDecodeScratchRows;
    scratch_.partial_max = static_cast<float*>(decode_buffer_.get());
    scratch_.partial_sum = scratch_.partial_max + rows;
    scratch_.partial_out = scratch_.partial_sum + rows;
    scratch_.capacity_rows = rows;
    scratch_.capacity_floats = kDecodeScratchFloats;
    scratch_.tickets = reinterpret_cast<unsigned*>(scratch_.partial_out + kDecodeScratchFloats);
    scratch_.capacity_tickets = kDecodeTickets;
    IRIS_CUDA_CHECK(
        cudaMemsetAsync(scratch_.tickets, 0, kDecodeTickets * sizeof(unsigned), stream_->get()));
    // Training: its GEMMs go through the main stream's planner, and one scratch buffer serves the
    // deterministic reductions.
    train_scratch_bytes_ =
        cuda::train_scratch_bytes(kTrainMaxCols, kTrainMaxLossRows, kTrainMaxTensors);
    train_scratch_.reset(allocate(train_scratch_bytes_));
    cuda::attention_init();
    cuda::attention_train_init();
    cuda::gemv_init();
    cuda::set_programmatic_launch(prop.major >= 9);
  }

  ~CudaBackend() override {
    // Queued work may still use the buffers that the members below release.
    if (copy_stream_) cudaStreamSynchronize(copy_stream_->get());
    if (side_stream_) cudaStreamSynchronize(side_stream_->get());
    if (stream_) cudaStreamSynchronize(stream_->get());
  }

  cudaStream_t stream() const { return on_side_ ? side_stream_->get() : stream_->get(); }
  // The offload copies' stream, made on first use.
  cudaStream_t copy_stream() {
    if (!copy_stream_) {
      copy_stream_ = std::make_unique<cuda::Stream>();
      copy_fork_ = std::make_unique<cuda::Event>();
    }
    return copy_stream_->get();
  }
  void queue_copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    bind();
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    IRIS_CUDA_CHECK(cudaStreamIsCapturing(stream(), &capturing));
    IRIS_CHECK(capturing == cudaStreamCaptureStatusNone,
               "offload copies run between graphs, not inside a capture");
    if (bytes == 0) return;
    const cudaStream_t copies = copy_stream();
    IRIS_CUDA_CHECK(cudaEventRecord(copy_fork_->get(), stream()));
    IRIS_CUDA_CHECK(cudaStreamWaitEvent(copies, copy_fork_->get(), 0));
    IRIS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, copies));
  }
  void finish_background_startup() override { heuristics_warmup_.reset(); }
  cuda::LtGemm& gemm() const { return on_side_ ? *side_gemm_ : *gemm_; }

  void begin_side_work() override {
    bind();
    IRIS_CHECK(!on_side_, "begin_side_work: side work is already open");
    IRIS_CUDA_CHECK(cudaEventRecord(side_fork_->get(), stream_->get()));
    IRIS_CUDA_CHECK(cudaStreamWaitEvent(side_stream_->get(), side_fork_->get(), 0));
    on_side_ = true;
  }

  void end_side_work() override {
    bind();
    IRIS_CHECK(on_side_, "end_side_work without begin_side_work");
    IRIS_CUDA_CHECK(cudaEventRecord(side_done_->get(), side_stream_->get()));
    on_side_ = false;
    side_pending_ = true;
  }

  void join_side_work() override {
    bind();
    IRIS_CHECK(!on_side_, "join_side_work while side work is open (call end_side_work first)");
    if (!side_pending_) return;
    IRIS_CUDA_CHECK(cudaStreamWaitEvent(stream_->get(), side_done_->get(), 0));
    side_pending_ = false;
  }

  void* allocate_host(size_t bytes) override {
    bind();
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (err != cudaSuccess) {
      cudaGetLastError();
      IRIS_FAIL("could not pin ", bytes, " bytes of host memory for offloaded activations (",
                cudaGetErrorString(err),
                "); offload fewer of them (train.offload_activations) or free host memory");
    }
    return p;
  }
  void free_host(void* ptr) override {
    if (ptr != nullptr) cudaFreeHost(ptr);  // from destructors: errors are not thrown
  }
  void copy_to_host_async(void* host_dst, const Tensor& src) override {
    check_device(src, "copy_to_host_async");
    queue_copy(host_dst, src.data, src.nbytes(), cudaMemcpyDeviceToHost);
  }
  void copy_from_host_async(const Tensor& dst, const void* host_src) override {
    check_device(dst, "copy_from_host_async");
    queue_copy(dst.data, host_src, dst.nbytes(), cudaMemcpyHostToDevice);
  }
  void mark_copies(int k) override {
    bind();
    IRIS_CHECK(k >= 0 && k < kCopyPoints, "mark_copies: point ", k, " of ", kCopyPoints);
    if (!copy_points_[k]) copy_points_[k] = std::make_unique<cuda::Event>();
    IRIS_CUDA_CHECK(cudaEventRecord(copy_points_[k]->get(), copy_stream()));
  }
  void wait_copies(int k) override {
    bind();
    IRIS_CHECK(k >= 0 && k < kCopyPoints, "wait_copies: point ", k, " of ", kCopyPoints);
    if (copy_points_[k]) IRIS_CUDA_CHECK(cudaStreamWaitEvent(stream(), copy_points_[k]->get(), 0));
  }

  Device device() const override { return Device::cuda; }
  std::string name() const override { return name_; }
  DType compute_dtype() const override { return DType::bf16; }

  void* allocate(size_t bytes) override {
    bind();
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear it, so the next launch check does not report it again
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      IRIS_FAIL("cudaMalloc of ", bytes, " bytes on ", name_, " failed (", cudaGetErrorString(err),
                "); ", free_b, " of ", total_b, " bytes free");
    }
    return p;
  }

  void deallocate(void* ptr) override {
    if (ptr == nullptr) return;
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != device_) cudaSetDevice(device_);
    cudaFree(ptr);  // called from destructors: errors are deliberately not thrown
  }

  void write(const Tensor& dst, const void* host_src, DType src_dtype) override {
    stage_write(dst, host_src, src_dtype, false);
  }

  int64_t write_finite(const Tensor& dst, const void* host_src, DType src_dtype) override {
    return stage_write(dst, host_src, src_dtype, true);
  }

  std::vector<int64_t> write_all_finite(const std::vector<HostWrite>& writes) override {
    bind();
    for (const HostWrite& w : writes) check_device(w.dst, "write");
    return cuda::upload_all_finite(writes, stream(), std::min(usable_cores(), kUploadThreads));
  }

  void reserve_write_staging(size_t bytes) override {
    bind();
    // Each half holds what the caller writes between its waits, so a write reuses a half only
    // once the copies of an earlier span are done. Past kMaxStagingHalf the first writes of a
    // span wait for the copies of the previous one, which leaves the host that far ahead.
    const size_t half =
        std::min(kMaxStagingHalf, (std::max(bytes, kStagingChunk) + 4095) / 4096 * 4096);
    if (half <= staging_half_bytes_) return;
    IRIS_CUDA_CHECK(cudaStreamSynchronize(stream()));
    staging_.reset();
    staging_ = std::make_unique<cuda::PinnedBuffer>(2 * half);
    staging_half_bytes_ = half;
    staging_half_ = 0;
    staging_offset_ = 0;
  }

  double take_write_wait_seconds() override { return std::exchange(write_wait_seconds_, 0.0); }

  void hold_device(double limit_seconds) override {
    bind();
    IRIS_CHECK(!holding_, "hold_device: the device is already held");
    finish_background_startup();
    if (hold_flags_ == nullptr) {
      hold_flags_ = std::make_unique<cuda::PinnedBuffer>(2 * sizeof(int), cudaHostAllocMapped);
    }
    int* flags = reinterpret_cast<int*>(hold_flags_->data());
    flags[0] = 0;  // release
    flags[1] = 0;  // expired
    int* dev = nullptr;
    IRIS_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), flags, 0));
    hold_device_kernel<<<1, 1, 0, stream()>>>(dev, dev + 1,
                                              static_cast<uint64_t>(limit_seconds * 1e9));
    IRIS_CUDA_LAUNCH_CHECK();
    holding_ = true;
  }

  bool release_device() override {
    bind();
    IRIS_CHECK(holding_, "release_device without hold_device");
    holding_ = false;
    volatile int* flags = reinterpret_cast<volatile int*>(hold_flags_->data());
    flags[0] = 1;
    IRIS_CUDA_CHECK(cudaStreamSynchronize(stream()));
    return flags[1] != 0;
  }

  void read(void* host_dst, DType dst_dtype, const Tensor& src) override {
    bind();
    check_device(src, "read");
    const int64_t n = src.numel();
    IRIS_CUDA_CHECK(cudaStreamSynchronize(stream()));
    // Everything queued is done, so the whole staging buffer is free.
    staging_offset_ = 0;
    if (n == 0) return;
    IRIS_CHECK(host_dst != nullptr, "read: null host destination for ", src.shape_str());
    const size_t elem = dtype_size(src.dtype), dst_elem = dtype_size(dst_dtype);
    const int64_t per_chunk = static_cast<int64_t>(staging_->size() / elem);
    for (int64_t i = 0; i < n;) {
      const int64_t m = std::min(n - i, per_chunk);
      IRIS_CUDA_CHECK(
          cudaMemcpyAsync(staging_->data(), static_cast<const char*>(src.data) + i * elem,
                          static_cast<size_t>(m) * elem, cudaMemcpyDeviceToHost, stream()));
      IRIS_CUDA_CHECK(cudaStreamSynchronize(stream()));
      convert_host(static_cast<char*>(host_dst) + i * dst_elem, dst_dtype, staging_->data(),
                   src.dtype, m);
      i += m;
    }
  }

  void copy(const Tensor& dst, const Tensor& src) override {
    bind();
    check_device(dst, "copy");
    check_device(src, "copy");
    IRIS_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy: ", dst.shape_str(),
               " <- ", src.shape_str(), " (dtype and element count must match)");
    if (dst.numel() == 0 || dst.data == src.data) return;
    IRIS_CUDA_CHECK(
        cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice, stream()));
  }

  void fill_zero(const Tensor& dst) override {
    bind();
    check_device(dst, "fill_zero");
    if (dst.numel() == 0) return;
    IRIS_CUDA_CHECK(cudaMemsetAsync(dst.data, 0, dst.nbytes(), stream()));
  }

  void synchronize() override {
    bind();
    if (copy_stream_) IRIS_CUDA_CHECK(cudaStreamSynchronize(copy_stream_->get()));
    IRIS_CUDA_CHECK(cudaStreamSynchronize(side_stream_->get()));
    IRIS_CUDA_CHECK(cudaStreamSynchronize(stream_->get()));
  }

  void profiler_collect(bool on) override {
    synchronize();
    if (on) {
      IRIS_CUDA_CHECK(cudaProfilerStart());
    } else {
      IRIS_CUDA_CHECK(cudaProfilerStop());
    }
  }

  double device_span_ms(const std::function<void()>& enqueue) override {
    bind();
    cuda::Event start(cudaEventDefault), stop(cudaEventDefault);
    IRIS_CUDA_CHECK(cudaEventRecord(start.get(), stream()));
    enqueue();
    IRIS_CUDA_CHECK(cudaEventRecord(stop.get(), stream()));
    IRIS_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float ms = 0.f;
    IRIS_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    return ms;
  }

  void record_timing_mark(int slot) override {
    bind();
    IRIS_CHECK(slot >= 0 && slot < kTimingMarks, "timing mark slot ", slot, " is outside 0..",
               kTimingMarks - 1);
    IRIS_CHECK(!on_side_, "record_timing_mark while side work is open (end_side_work first)");
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    IRIS_CUDA_CHECK(cudaStreamIsCapturing(stream_->get(), &capture));
    IRIS_CHECK(capture == cudaStreamCaptureStatusNone,
               "record_timing_mark inside a graph capture: the event would become a node of the "
               "graph instead of timing this moment; record marks between captured bodies");
    // The mark is on the main stream; side work issued before it must be part of what it covers.
    join_side_work();
    IRIS_CUDA_CHECK(cudaEventRecord(timing_marks_[slot]->get(), stream_->get()));
    timing_recorded_[static_cast<size_t>(slot)] = true;
  }

  double timing_mark_elapsed_ms(int from, int to) override {
    bind();
    for (int s : {from, to})
      IRIS_CHECK(s >= 0 && s < kTimingMarks && timing_recorded_[static_cast<size_t>(s)],
                 "timing mark slot ", s, " was never recorded");
    // Both, so that marks given in either order are complete before they are compared.
    IRIS_CUDA_CHECK(cudaEventSynchronize(timing_marks_[from]->get()));
    IRIS_CUDA_CHECK(cudaEventSynchronize(timing_marks_[to]->get()));
    float ms = 0.f;
    IRIS_CUDA_CHECK(
        cudaEventElapsedTime(&ms, timing_marks_[from]->get(), timing_marks_[to]->get()));
    return ms;
  }

  void set_gemm_tuning(GemmTuning mode) override {
    gemm_->set_tuning(mode);
    side_gemm_->set_tuning(mode);
  }

  bool save_gemm_tuning() override { return tuning_cache_->save(); }

  GemmTuningReport gemm_tuning_report() override {
    GemmTuningReport r;
    r.mode = gemm_->tuning();
    r.cache_path = tuning_cache_->path();
    r.plans += gemm_->plan_counts();
    r.plans += side_gemm_->plan_counts();
    return r;
  }

  // Graph capture starts and ends on the main stream; side work joins it through events.
  void* native_stream() override { return stream_->get(); }
  size_t device_memory_in_use() override {
    size_t free_bytes = 0, total_bytes = 0;
    IRIS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return total_bytes - free_bytes;
  }

  size_t device_memory_total() override {
    bind();
    size_t free_bytes = 0, total_bytes = 0;
    IRIS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return total_bytes;
  }

  void linear(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
              bool accumulate) override {
    bind();
    check_linear(y, x, w, bias, "linear");
    const int64_t m = x.rows(), k = x.cols(), n = w.shape[0];
    if (m == 0 || n == 0) return;
    IRIS_CHECK(k > 0, "linear: K is 0");
    // A few rows (decode steps) stream the weights through the GEMV kernels.
    if (cuda::gemv_supported(m, n, k, x.data, w.data)) {
      cuda::launch_gemv(bf(y), cbf(x), cbf(w), cbf_opt(bias), m, n, k, accumulate, stream());
      return;
    }
    gemm().run(bf(y), cbf(x), cbf(w), cbf_opt(bias), m, n, k, accumulate, false, stream());
  }

  void linear_gelu_tanh(const Tensor& y, const Tensor& x, const Tensor& w,
                        const Tensor& bias) override {
    bind();
    check_linear(y, x, w, bias, "linear_gelu_tanh");
    const int64_t m = x.rows(), k = x.cols(), n = w.shape[0];
    if (m == 0 || n == 0) return;
    IRIS_CHECK(k > 0, "linear_gelu_tanh: K is 0");
    if (cuda::gemv_supported(m, n, k, x.data, w.data)) {
      cuda::launch_gemv(bf(y), cbf(x), cbf(w), cbf_opt(bias), m, n, k, false, stream());
      cuda::launch_gelu_tanh(bf(y), cbf(y), y.numel(), stream());
      return;
    }
    // cuBLASLt's GELU epilogue: the activation is applied to the f32 sum before the one rounding,
    // which saves a kernel and a round trip of the [M, N] activation through memory.
    if (gemm().run(bf(y), cbf(x), cbf(w), cbf_opt(bias), m, n, k, false, true, stream())) return;
    gemm().run(bf(y), cbf(x), cbf(w), cbf_opt(bias), m, n, k, false, false, stream());
    cuda::launch_gelu_tanh(bf(y), cbf(y), y.numel(), stream());
  }

  void rms_norm_linear(const Tensor& y, const Tensor& xn, const Tensor& x, const Tensor& norm_w,
                       float eps, const Tensor& w, const Tensor& bias, const Tensor& act) override {
    bind();
    check_rowwise(xn, x, norm_w, "rms_norm_linear");
    check_linear(y, xn, w, bias, "rms_norm_linear");
    IRIS_CHECK(xn.data != x.data && xn.data != y.data, "rms_norm_linear: xn must not alias x or y");
    if (act.defined()) {
      check_act(act, "rms_norm_linear", "act");
      IRIS_CHECK(y.cols() % 2 == 0 && act.rows() == y.rows() && act.cols() == y.cols() / 2,
                 "rms_norm_linear: act ", act.shape_str(), " does not match gate_up ",
                 y.shape_str(), " (expected [M, I] and [M, 2I])");
    }
    const int64_t m = x.rows(), k = x.cols(), n = w.shape[0];
    // One kernel for a decode step: every block normalises the few x rows while staging them.
    // The fused GEMV has no bias epilogue (Qwen2's biased q/k/v take the two-kernel path).
    if (m > 0 && n > 0 && !bias.defined() && cuda::gemv_supported(m, n, k, x.data, w.data) &&
        cuda::aligned16(xn.data) && cuda::aligned16(norm_w.data) &&
        (!act.defined() || n % 2 == 0)) {
      cuda::launch_gemv_rms_norm(bf(y), bf(xn), act.defined() ? bf(act) : nullptr, cbf(x),
                                 cbf(norm_w), eps, cbf(w), m, n, k, stream());
      return;
    }
    rms_norm(xn, x, norm_w, eps);
    linear(y, xn, w, bias, false);
    if (act.defined()) swiglu(act, y);
  }

  void layer_norm(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b,
                  float eps) override {
    bind();
    check_rowwise(y, x, w, "layer_norm");
    check_act(b, "layer_norm", "b");
    IRIS_CHECK(b.numel() == x.cols(), "layer_norm: b ", b.shape_str(), " should have ", x.cols(),
               " elements");
    cuda::launch_layer_norm(bf(y), cbf(x), cbf(w), cbf(b), x.rows(), x.cols(), eps, stream());
  }

  void rms_norm(const Tensor& y, const Tensor& x, const Tensor& w, float eps) override {
    bind();
    check_rowwise(y, x, w, "rms_norm");
    cuda::launch_rms_norm(bf(y), cbf(x), cbf(w), x.rows(), x.cols(), eps, stream());
  }

  void dropout(const Tensor& y, const Tensor& x, float p, const Tensor& seed,
               uint64_t mask_stream) override {
    bind();
    check_act_or_f32(y, "dropout", "y");
    check_act_or_f32(x, "dropout", "x");
    IRIS_CHECK(y.dtype == x.dtype && y.numel() == x.numel(), "dropout: ", x.shape_str(), " -> ",
               y.shape_str());
    check_device(seed, "dropout");
    IRIS_CHECK(seed.dtype == DType::i64 && seed.numel() == 1, "dropout: seed must be i64 [1], got ",
               seed.shape_str());
    cuda::launch_dropout(y.data, x.data, x.dtype == DType::f32, x.numel(), dropout_threshold(p),
                         1.0f / (1.0f - p), static_cast<const int64_t*>(seed.data), mask_stream,
                         stream());
  }

  void add_column_block(const Tensor& dst, int64_t dst_col, const Tensor& src, int64_t src_col,
                        int64_t cols, float scale, bool accumulate) override {
    bind();
    check_act_or_f32(dst, "add_column_block", "dst");
    check_act_or_f32(src, "add_column_block", "src");
    check_column_block(dst, dst_col, src, src_col, cols);
    cuda::launch_add_column_block(dst.data, dst.dtype == DType::f32, dst.cols(), dst_col, src.data,
                                  src.dtype == DType::f32, src.cols(), src_col, dst.rows(), cols,
                                  scale, accumulate, stream());
  }

  void add(const Tensor& y, const Tensor& a, const Tensor& b) override {
    bind();
    if (y.dtype == DType::f32) {
      // Gradients (the tied embedding's two parts in a pipeline) are summed in f32.
      for (const Tensor* t : {&y, &a, &b}) {
        check_device(*t, "add");
        IRIS_CHECK(t->dtype == DType::f32, "add: f32 y needs f32 a and b, got ", a.shape_str(),
                   " and ", b.shape_str());
      }
      IRIS_CHECK(a.numel() == y.numel() && b.numel() == y.numel(), "add: ", y.shape_str(), " = ",
                 a.shape_str(), " + ", b.shape_str(), " (element counts differ)");
      cuda::launch_add_f32(y.as<float>(), a.as<float>(), b.as<float>(), y.numel(), stream());
      return;
    }
    check_act(y, "add", "y");
    check_act(a, "add", "a");
    check_act(b, "add", "b");
    IRIS_CHECK(a.numel() == y.numel() && b.numel() == y.numel(), "add: ", y.shape_str(), " = ",
               a.shape_str(), " + ", b.shape_str(), " (element counts differ)");
    cuda::launch_add(bf(y), cbf(a), cbf(b), y.numel(), stream());
  }

  void gelu_tanh(const Tensor& y, const Tensor& x) override {
    bind();
    check_unary(y, x, "gelu_tanh");
    cuda::launch_gelu_tanh(bf(y), cbf(x), y.numel(), stream());
  }

  void gelu_erf(const Tensor& y, const Tensor& x) override {
    bind();
    check_unary(y, x, "gelu_erf");
    cuda::launch_gelu_erf(bf(y), cbf(x), y.numel(), stream());
  }

  void quick_gelu(const Tensor& y, const Tensor& x) override {
    bind();
    check_unary(y, x, "quick_gelu");
    cuda::launch_quick_gelu(bf(y), cbf(x), y.numel(), stream());
  }

  void swiglu(const Tensor& y, const Tensor& gate_up) override {
    bind();
    check_act(y, "swiglu", "y");
    check_act(gate_up, "swiglu", "gate_up");
    IRIS_CHECK(gate_up.cols() == 2 * y.cols() && gate_up.rows() == y.rows(), "swiglu: y ",
               y.shape_str(), " does not match gate_up ", gate_up.shape_str(),
               " (expected [M, I] and [M, 2I])");
    cuda::launch_swiglu(bf(y), cbf(gate_up), y.rows(), y.cols(), stream());
  }

  void qkv_norm_rope(const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, float eps,
                     const Tensor& cos, const Tensor& sin, int n_q_heads, int n_kv_heads,
                     int head_dim, bool round_tables_to_compute_dtype) override {
    bind();
    check_qkv_norm_rope(qkv, q_norm_w, k_norm_w, cos, sin, n_q_heads, n_kv_heads, head_dim);
    cuda::launch_qkv_norm_rope(bf(qkv), cbf_opt(q_norm_w), cbf_opt(k_norm_w), eps,
                               static_cast<const float*>(cos.data),
                               static_cast<const float*>(sin.data), qkv.rows(), n_q_heads,
                               n_kv_heads, head_dim, round_tables_to_compute_dtype, stream());
  }

  void qkv_norm_rope_kv_store(const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w,
                              float eps, const Tensor& cos, const Tensor& sin, int n_q_heads,
                              int n_kv_heads, int head_dim, bool round_tables_to_compute_dtype,
                              const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& past_len) override {
    bind();
    check_qkv_norm_rope(qkv, q_norm_w, k_norm_w, cos, sin, n_q_heads, n_kv_heads, head_dim);
    check_causal_shapes(qkv, k_cache, v_cache, past_len, n_q_heads, n_kv_heads, head_dim,
                        "qkv_norm_rope_kv_store");
    const auto* cos_f = static_cast<const float*>(cos.data);
    const auto* sin_f = static_cast<const float*>(sin.data);
    if (cuda::launch_qkv_norm_rope_kv_store(bf(qkv), cbf_opt(q_norm_w), cbf_opt(k_norm_w), eps,
                                            cos_f, sin_f, qkv.rows(), n_q_heads, n_kv_heads,
                                            head_dim, round_tables_to_compute_dtype, bf(k_cache),
                                            bf(v_cache), ci32(past_len), k_cache.rows(), stream()))
      return;
    // Shapes the fused kernel does not cover: the two ops.
    Backend::qkv_norm_rope_kv_store(qkv, q_norm_w, k_norm_w, eps, cos, sin, n_q_heads, n_kv_heads,
                                    head_dim, round_tables_to_compute_dtype, k_cache, v_cache,
                                    past_len);
  }

 private:
  void check_qkv_norm_rope(const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w,
                           const Tensor& cos, const Tensor& sin, int n_q_heads, int n_kv_heads,
                           int head_dim) {
    check_act(qkv, "qkv_norm_rope", "qkv");
    IRIS_CHECK(
        n_q_heads > 0 && n_kv_heads > 0 && head_dim > 0 && head_dim % 2 == 0 && head_dim <= 256,
        "qkv_norm_rope: head_dim ", head_dim, " must be even and at most 256");
    IRIS_CHECK(qkv.cols() == int64_t{n_q_heads + 2 * n_kv_heads} * head_dim, "qkv_norm_rope: qkv ",
               qkv.shape_str(), " is not [T, (", n_q_heads, " + 2*", n_kv_heads, ") * ", head_dim,
               "]");
    const int64_t t = qkv.rows();
    for (const Tensor* table : {&cos, &sin}) {
      check_device(*table, "qkv_norm_rope");
      IRIS_CHECK(table->dtype == DType::f32 && table->numel() == t * head_dim,
                 "qkv_norm_rope: cos/sin ", table->shape_str(), " should be f32 [", t, ", ",
                 head_dim, "]");
    }
    for (const Tensor* nw : {&q_norm_w, &k_norm_w}) {
      if (!nw->defined()) continue;
      check_act(*nw, "qkv_norm_rope", "norm weight");
      IRIS_CHECK(nw->numel() == head_dim, "qkv_norm_rope: norm weight ", nw->shape_str(),
                 " should have ", head_dim, " elements");
    }
  }

 public:
  void attention_segments(const Tensor& out, const Tensor& qkv, const Tensor& cu_seqlens,
                          int n_segments, int n_heads, int head_dim, float scale,
                          const Tensor& real_rows) override {
    bind();
    check_act(out, "attention_segments", "out");
    check_act(qkv, "attention_segments", "qkv");
    check_index(cu_seqlens, "attention_segments", "cu_seqlens");
    if (real_rows.defined()) {
      check_index(real_rows, "attention_segments", "real_rows");
      IRIS_CHECK(real_rows.numel() == 1, "attention_segments: real_rows ", real_rows.shape_str(),
                 " should hold one count");
    }
    check_head_dim(head_dim, "attention_segments");
    IRIS_CHECK(n_heads > 0 && n_segments >= 0, "attention_segments: bad head/segment counts");
    const int64_t hidden = int64_t{n_heads} * head_dim;
    IRIS_CHECK(qkv.cols() == 3 * hidden, "attention_segments: qkv ", qkv.shape_str(),
               " is not [S, 3 * ", n_heads, " * ", head_dim, "]");
    IRIS_CHECK(out.cols() == hidden && out.rows() == qkv.rows(), "attention_segments: out ",
               out.shape_str(), " should be [", qkv.rows(), ", ", hidden, "]");
    IRIS_CHECK(cu_seqlens.numel() >= n_segments + 1, "attention_segments: cu_seqlens ",
               cu_seqlens.shape_str(), " needs ", n_segments + 1, " entries");
    check_aligned(qkv, 16, "attention_segments", "qkv");
    check_aligned(out, 4, "attention_segments", "out");
    cuda::launch_attention_segments(bf(out), cbf(qkv), ci32(cu_seqlens),
                                    real_rows.defined() ? ci32(real_rows) : nullptr, n_segments,
                                    qkv.rows(), n_heads, head_dim, scale, num_sms_, stream());
  }

  void kv_store(const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                const Tensor& past_len, int n_q_heads, int n_kv_heads, int head_dim) override {
    bind();
    check_causal_shapes(qkv, k_cache, v_cache, past_len, n_q_heads, n_kv_heads, head_dim,
                        "kv_store");
    cuda::launch_kv_store(bf(k_cache), bf(v_cache), cbf(qkv), ci32(past_len), qkv.rows(),
                          k_cache.rows(), n_q_heads, n_kv_heads, head_dim, stream());
  }

  void attention_causal(const Tensor& out, const Tensor& qkv, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& past_len, int n_q_heads,
                        int n_kv_heads, int head_dim, float scale) override {
    bind();
    check_causal_shapes(qkv, k_cache, v_cache, past_len, n_q_heads, n_kv_heads, head_dim,
                        "attention_causal");
    check_act(out, "attention_causal", "out");
    check_head_dim(head_dim, "attention_causal");
    IRIS_CHECK(n_q_heads % n_kv_heads == 0, "attention_causal: ", n_q_heads,
               " query heads do not split evenly over ", n_kv_heads, " kv heads");
    IRIS_CHECK(out.rows() == qkv.rows() && out.cols() == int64_t{n_q_heads} * head_dim,
               "attention_causal: out ", out.shape_str(), " should be [", qkv.rows(), ", ",
               n_q_heads * head_dim, "]");
    check_aligned(qkv, 16, "attention_causal", "qkv");
    check_aligned(k_cache, 16, "attention_causal", "k_cache");
    check_aligned(v_cache, 16, "attention_causal", "v_cache");
    check_aligned(out, 4, "attention_causal", "out");
    main_only("attention_causal");
    cuda::launch_attention_causal(bf(out), cbf(qkv), cbf(k_cache), cbf(v_cache), ci32(past_len),
                                  qkv.rows(), k_cache.rows(), n_q_heads, n_kv_heads, head_dim,
                                  scale, scratch_, num_sms_, stream());
  }

  void embedding(const Tensor& y, const Tensor& table, const Tensor& ids) override {
    bind();
    check_act(y, "embedding", "y");
    check_act(table, "embedding", "table");
    check_index(ids, "embedding", "ids");
    IRIS_CHECK(table.ndim == 2 && y.cols() == table.shape[1] && y.rows() == ids.numel(),
               "embedding: y ", y.shape_str(), ", table ", table.shape_str(), ", ids ",
               ids.shape_str(), " (expected [T, H], [V, H], [T])");
    cuda::launch_embedding(bf(y), cbf(table), ci32(ids), ids.numel(), table.shape[0], y.cols(),
                           stream());
  }

  void scatter_rows(const Tensor& dst, const Tensor& src, const Tensor& index,
                    bool accumulate) override {
    bind();
    check_act(dst, "scatter_rows", "dst");
    check_act(src, "scatter_rows", "src");
    check_index(index, "scatter_rows", "index");
    IRIS_CHECK(dst.cols() == src.cols() && index.numel() == src.rows(), "scatter_rows: dst ",
               dst.shape_str(), ", src ", src.shape_str(), ", index ", index.shape_str(),
               " (expected [R, D], [N, D], [N])");
    cuda::launch_scatter_rows(bf(dst), cbf(src), ci32(index), src.rows(), dst.rows(), dst.cols(),
                              accumulate, stream());
  }

  void add_interpolated_rows(const Tensor& y, const Tensor& table, const Tensor& index,
                             const Tensor& weight) override {
    bind();
    check_act(y, "add_interpolated_rows", "y");
    check_act(table, "add_interpolated_rows", "table");
    check_index(index, "add_interpolated_rows", "index");
    check_device(weight, "add_interpolated_rows");
    IRIS_CHECK(weight.dtype == DType::f32, "add_interpolated_rows: weight must be f32, got ",
               weight.shape_str());
    IRIS_CHECK(
        table.cols() == y.cols() && index.numel() == 4 * y.rows() && weight.numel() == 4 * y.rows(),
        "add_interpolated_rows: y ", y.shape_str(), ", table ", table.shape_str(), ", index ",
        index.shape_str(), ", weight ", weight.shape_str(),
        " (expected [S, D], [R, D], [S, 4], [S, 4])");
    cuda::launch_add_interpolated_rows(bf(y), cbf(table), ci32(index),
                                       static_cast<const float*>(weight.data), y.rows(),
                                       table.rows(), y.cols(), stream());
  }

  void argmax_rows(const Tensor& out, const Tensor& x) override {
    bind();
    check_act(x, "argmax_rows", "x");
    check_index(out, "argmax_rows", "out");
    IRIS_CHECK(out.numel() == x.rows() && x.cols() > 0, "argmax_rows: out ", out.shape_str(),
               " should have one entry per row of x ", x.shape_str());
    main_only("argmax_rows");
    cuda::launch_argmax_rows(static_cast<int32_t*>(out.data), cbf(x), x.rows(), x.cols(),
                             static_cast<unsigned long long*>(argmax_keys_.get()),
                             kArgmaxScratchRows, stream());
  }

  void moe_route(const Tensor& ids, const Tensor& weights, const Tensor& probs,
                 const Tensor& logits, int k, const Tensor& real_rows) override {
    bind();
    check_act(logits, "moe_route", "logits");
    check_act(weights, "moe_route", "weights");
    check_index(ids, "moe_route", "ids");
    if (probs.defined()) check_device(probs, "moe_route");
    if (real_rows.defined()) check_index(real_rows, "moe_route", "real_rows");
    check_moe_route_shapes(ids, weights, probs, logits, k, real_rows);
    IRIS_CHECK(logits.cols() <= cuda::kMoeRouteMaxExperts, "moe_route: ", logits.cols(),
               " experts, more than the router kernel's ", cuda::kMoeRouteMaxExperts);
    cuda::launch_moe_route(static_cast<int32_t*>(ids.data), bf(weights),
                           probs.defined() ? f32(probs) : nullptr, cbf(logits), logits.rows(),
                           static_cast<int>(logits.cols()), k,
                           real_rows.defined() ? ci32(real_rows) : nullptr, stream());
  }

  void moe_capacity_drop(const Tensor& kept_ids, const Tensor& dropped, const Tensor& ids,
                         const Tensor& weights, int experts, int64_t capacity,
                         int policy) override {
    bind();
    check_index(kept_ids, "moe_capacity_drop", "kept_ids");
    check_index(ids, "moe_capacity_drop", "ids");
    check_act(weights, "moe_capacity_drop", "weights");
    if (dropped.defined()) check_index(dropped, "moe_capacity_drop", "dropped");
    check_moe_capacity_drop_shapes(kept_ids, dropped, ids, weights, experts, capacity, policy);
    cuda::launch_moe_capacity_drop(
        static_cast<int32_t*>(kept_ids.data),
        dropped.defined() ? static_cast<int32_t*>(dropped.data) : nullptr, ci32(ids), cbf(weights),
        ids.numel(), experts, capacity, policy == static_cast<int>(MoeDropPolicy::probs), stream());
  }

  void moe_dispatch(const Tensor& x_sorted, const Tensor& offsets, const Tensor& slot_rows,
                    const Tensor& x, const Tensor& ids, int64_t padded_capacity) override {
    bind();
    check_act(x_sorted, "moe_dispatch", "x_sorted");
    check_act(x, "moe_dispatch", "x");
    check_index(offsets, "moe_dispatch", "offsets");
    check_index(slot_rows, "moe_dispatch", "slot_rows");
    check_index(ids, "moe_dispatch", "ids");
    check_moe_dispatch_shapes(x_sorted, offsets, slot_rows, x, ids, padded_capacity);
    const int64_t E = offsets.numel() - 1;
    IRIS_CHECK(E <= cuda::kMoeRouteMaxExperts, "moe_dispatch: ", E,
               " experts, more than the plan kernel's ", cuda::kMoeRouteMaxExperts);
    cuda::launch_moe_dispatch(bf(x_sorted), static_cast<int32_t*>(offsets.data),
                              static_cast<int32_t*>(slot_rows.data), cbf(x), ci32(ids), ids.rows(),
                              static_cast<int>(ids.cols()), static_cast<int>(E), x.cols(),
                              padded_capacity, stream());
  }

  void moe_grouped_linear(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& offsets,
                          int64_t rows_per_expert) override {
    bind();
    check_act(y, "moe_grouped_linear", "y");
    check_act(x, "moe_grouped_linear", "x");
    check_act(w, "moe_grouped_linear", "w");
    check_index(offsets, "moe_grouped_linear", "offsets");
    check_moe_grouped_linear_shapes(y, x, w, offsets);
    check_moe_rows_per_expert(x, w, rows_per_expert, "moe_grouped_linear");
    const int64_t E = w.shape[0];
    // Padded experts are one batched GEMM on tensor cores.
    if (rows_per_expert > 0) {
      IRIS_CHECK(!on_side_, "moe_grouped_linear: padded experts run on the main stream only");
      moe_gemm_->forward(bf(y), cbf(x), cbf(w), E, rows_per_expert, w.shape[1], w.shape[2],
                         stream());
      return;
    }
    IRIS_CHECK((x.rows() + 63) / 64 + E <= 65535, "moe_grouped_linear: ", x.rows(), " rows over ",
               E, " experts need more row tiles than one launch holds");
    cuda::launch_moe_grouped_linear(bf(y), cbf(x), cbf(w), ci32(offsets), x.rows(),
                                    static_cast<int>(E), w.shape[2], w.shape[1], stream());
  }

  void moe_combine(const Tensor& y, const Tensor& y_sorted, const Tensor& slot_rows,
                   const Tensor& weights, bool accumulate) override {
    bind();
    check_act(y, "moe_combine", "y");
    check_act(y_sorted, "moe_combine", "y_sorted");
    check_act(weights, "moe_combine", "weights");
    check_index(slot_rows, "moe_combine", "slot_rows");
    check_moe_combine_shapes(y, y_sorted, slot_rows, weights);
    cuda::launch_moe_combine(bf(y), cbf(y_sorted), ci32(slot_rows), cbf(weights), y.rows(),
                             static_cast<int>(slot_rows.cols()), y.cols(), accumulate, stream());
  }

  void moe_combine_backward(const Tensor& dy_sorted, const Tensor& dweights, const Tensor& dy,
                            const Tensor& y_sorted, const Tensor& slot_rows,
                            const Tensor& weights) override {
    bind();
    check_act(dy_sorted, "moe_combine_backward", "dy_sorted");
    check_act(y_sorted, "moe_combine_backward", "y_sorted");
    check_act(weights, "moe_combine_backward", "weights");
    check_act_or_f32(dy, "moe_combine_backward", "dy");
    check_device(dweights, "moe_combine_backward");
    check_index(slot_rows, "moe_combine_backward", "slot_rows");
    check_moe_combine_backward_shapes(dy_sorted, dweights, dy, y_sorted, slot_rows, weights);
    cuda::launch_moe_combine_backward(bf(dy_sorted), f32(dweights), dy.data, dy.dtype == DType::f32,
                                      cbf(y_sorted), ci32(slot_rows), cbf(weights), dy.rows(),
                                      static_cast<int>(slot_rows.cols()), dy.cols(), stream());
  }

  void moe_route_backward(const Tensor& dlogits, const Tensor& dweights, const Tensor& probs,
                          const Tensor& ids, const Tensor& aux_dprob) override {
    bind();
    check_act(dlogits, "moe_route_backward", "dlogits");
    check_device(dweights, "moe_route_backward");
    check_device(probs, "moe_route_backward");
    check_index(ids, "moe_route_backward", "ids");
    if (aux_dprob.defined()) check_device(aux_dprob, "moe_route_backward");
    check_moe_route_backward_shapes(dlogits, dweights, probs, ids, aux_dprob);
    cuda::launch_moe_route_backward(bf(dlogits), f32(dweights), f32(probs), ci32(ids),
                                    aux_dprob.defined() ? f32(aux_dprob) : nullptr, probs.rows(),
                                    static_cast<int>(probs.cols()), static_cast<int>(ids.cols()),
                                    stream());
  }

  void moe_route_stats(const Tensor& load, const Tensor& prob_sum, const Tensor& ids,
                       const Tensor& probs) override {
    bind();
    for (const Tensor* t : {&load, &prob_sum, &probs}) check_device(*t, "moe_route_stats");
    check_index(ids, "moe_route_stats", "ids");
    check_moe_route_stats_shapes(load, prob_sum, ids, probs);
    cuda::launch_moe_route_stats(f32(load), f32(prob_sum), ci32(ids), f32(probs), probs.rows(),
                                 static_cast<int>(probs.cols()), static_cast<int>(ids.cols()),
                                 stream());
  }

  void moe_aux_loss(const Tensor& aux_sum, const Tensor& dprob, const Tensor& load,
                    const Tensor& prob_sum, const Tensor& real_rows, int layers,
                    float grad_scale) override {
    bind();
    for (const Tensor* t : {&aux_sum, &dprob, &load, &prob_sum}) check_device(*t, "moe_aux_loss");
    check_index(real_rows, "moe_aux_loss", "real_rows");
    check_moe_aux_loss_shapes(aux_sum, dprob, load, prob_sum, real_rows, layers);
    cuda::launch_moe_aux_loss(f32(aux_sum), f32(dprob), f32(load), f32(prob_sum), ci32(real_rows),
                              static_cast<int>(load.numel()), layers, grad_scale, stream());
  }

  void moe_grouped_linear_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy,
                                   const Tensor& x, const Tensor& w, const Tensor& offsets,
                                   int64_t rows_per_expert) override {
    bind();
    check_act(dx, "moe_grouped_linear_backward", "dx");
    check_act(dy, "moe_grouped_linear_backward", "dy");
    check_act(x, "moe_grouped_linear_backward", "x");
    check_act(w, "moe_grouped_linear_backward", "w");
    check_index(offsets, "moe_grouped_linear_backward", "offsets");
    check_moe_grouped_linear_shapes(dy, x, w, offsets);
    IRIS_CHECK(dx.rows() == x.rows() && dx.cols() == x.cols(), "moe_grouped_linear_backward: dx ",
               dx.shape_str(), " should be shaped as x ", x.shape_str());
    if (dw.defined()) {
      check_f32(dw, "moe_grouped_linear_backward", "dw");
      IRIS_CHECK(dw.numel() == w.numel(), "moe_grouped_linear_backward: dw ", dw.shape_str(),
                 " should be shaped as w ", w.shape_str());
    }
    check_moe_rows_per_expert(x, w, rows_per_expert, "moe_grouped_linear_backward");
    const int64_t E = w.shape[0];
    if (rows_per_expert > 0) {
      IRIS_CHECK(!on_side_,
                 "moe_grouped_linear_backward: padded experts run on the main stream "
                 "only");
      const int64_t K = w.shape[1], N = w.shape[2];
      moe_gemm_->backward_input(bf(dx), cbf(dy), cbf(w), E, rows_per_expert, K, N, stream());
      if (dw.defined())
        moe_gemm_->backward_weight(f32(dw), cbf(x), cbf(dy), E, rows_per_expert, K, N, stream());
      return;
    }
    IRIS_CHECK((x.rows() + 63) / 64 + E <= 65535 && E <= 65535,
               "moe_grouped_linear_backward: ", x.rows(), " rows over ", E,
               " experts need more row tiles than one launch holds");
    cuda::launch_moe_grouped_linear_backward(bf(dx), dw.defined() ? f32(dw) : nullptr, cbf(dy),
                                             cbf(x), cbf(w), ci32(offsets), x.rows(),
                                             static_cast<int>(E), w.shape[1], w.shape[2], stream());
  }

  void moe_dispatch_backward(const Tensor& dx, const Tensor& dx_sorted,
                             const Tensor& slot_rows) override {
    bind();
    check_act_or_f32(dx, "moe_dispatch_backward", "dx");
    check_act(dx_sorted, "moe_dispatch_backward", "dx_sorted");
    check_index(slot_rows, "moe_dispatch_backward", "slot_rows");
    check_moe_dispatch_backward_shapes(dx, dx_sorted, slot_rows);
    cuda::launch_moe_dispatch_backward(dx.data, dx.dtype == DType::f32, cbf(dx_sorted),
                                       ci32(slot_rows), dx.rows(),
                                       static_cast<int>(slot_rows.cols()), dx.cols(), stream());
  }

  void text_rope_tables(const Tensor& cos, const Tensor& sin, const Tensor& positions,
                        const std::vector<float>& inv_freq,
                        const std::vector<int>& pair_axis) override {
    bind();
    check_device(cos, "text_rope_tables");
    check_device(sin, "text_rope_tables");
    check_device(positions, "text_rope_tables");
    check_text_rope_tables(cos, sin, positions, inv_freq, pair_axis, "text_rope_tables");
    IRIS_CHECK(cos.cols() / 2 <= cuda::kTextRopeMaxPairs, "text_rope_tables: head_dim ", cos.cols(),
               " is above the kernel's ", 2 * cuda::kTextRopeMaxPairs);
    cuda::launch_text_rope_tables(f32(cos), f32(sin), ci32(positions), cos.rows(),
                                  static_cast<int>(cos.cols() / 2), inv_freq.data(),
                                  pair_axis.data(), stream());
  }

  void vision_tables(const Tensor& cos, const Tensor& sin, const Tensor& pos_index,
                     const Tensor& pos_weight, const Tensor& cu_seqlens, const Tensor& real_rows,
                     const Tensor& grids, const std::vector<float>& inv_freq, int merge_size,
                     int grid_side, const Tensor& window_cu, int window_units) override {
    bind();
    check_f32(cos, "vision_tables", "cos");
    check_f32(sin, "vision_tables", "sin");
    check_index(pos_index, "vision_tables", "pos_index");
    check_f32(pos_weight, "vision_tables", "pos_weight");
    check_index(cu_seqlens, "vision_tables", "cu_seqlens");
    check_index(real_rows, "vision_tables", "real_rows");
    check_index(grids, "vision_tables", "grids");
    const int64_t R = cos.rows(), hd = cos.cols(), capacity = cu_seqlens.numel() - 1;
    IRIS_CHECK(sin.rows() == R && sin.cols() == hd && pos_index.numel() == R * 4 &&
                   pos_weight.numel() == R * 4 && real_rows.numel() == 1 && capacity >= 1 &&
                   capacity <= cuda::kVisionTablesMaxCapacity &&
                   grids.numel() == vision_grids_numel(static_cast<int>(capacity)) &&
                   R <= std::numeric_limits<int32_t>::max(),
               "vision_tables: cos ", cos.shape_str(), ", sin ", sin.shape_str(), ", pos_index ",
               pos_index.shape_str(), ", pos_weight ", pos_weight.shape_str(), ", cu_seqlens ",
               cu_seqlens.shape_str(), ", real_rows ", real_rows.shape_str(), ", grids ",
               grids.shape_str(), " (expected [R, hd] twice, [R, 4] twice, [C + 1] with C at most ",
               cuda::kVisionTablesMaxCapacity, ", [1], [1 + 3C])");
    IRIS_CHECK(hd % 4 == 0 && hd <= 4 * cuda::kVisionTablesMaxQuarter &&
                   static_cast<int64_t>(inv_freq.size()) == hd / 4 && merge_size >= 1 &&
                   grid_side >= 1,
               "vision_tables: head_dim ", hd, " (a multiple of 4 up to ",
               4 * cuda::kVisionTablesMaxQuarter, ") with ", inv_freq.size(),
               " frequencies, merge size ", merge_size, ", grid side ", grid_side);
    int window_capacity = 0;
    if (window_units > 0) {
      check_index(window_cu, "vision_tables", "window_cu");
      window_capacity = static_cast<int>(window_cu.numel() - 1);
    }
    cuda::launch_vision_tables(
        f32(cos), f32(sin), static_cast<int32_t*>(pos_index.data), f32(pos_weight),
        static_cast<int32_t*>(cu_seqlens.data), static_cast<int32_t*>(real_rows.data), ci32(grids),
        static_cast<int>(capacity), R, static_cast<int>(hd), inv_freq.data(), merge_size, grid_side,
        window_units > 0 ? static_cast<int32_t*>(window_cu.data) : nullptr, window_units,
        window_capacity, stream());
  }

  void image_patches(const Tensor& dst, const Tensor& frames, const Tensor& table,
                     const Tensor& dst_rows, const ImagePatchGeometry& g) override {
    bind();
    check_act_or_f32(dst, "image_patches", "dst");
    check_device(frames, "image_patches");
    check_device(table, "image_patches");
    check_index(dst_rows, "image_patches", "dst_rows");
    check_image_patches(dst, frames, table, dst_rows, g, "image_patches");
    IRIS_CHECK(g.patches() <= std::numeric_limits<int32_t>::max(), "image_patches: ", g.patches(),
               " patches in one image");
    const int64_t frame_bytes = int64_t{g.height} * g.width * 3;
    cuda::launch_image_patches(dst.data, dst.dtype == DType::f32,
                               static_cast<const uint8_t*>(frames.data),
                               frames.numel() == frame_bytes ? 1 : g.temporal_patch_size,
                               static_cast<const float*>(table.data), ci32(dst_rows), g, stream());
  }

  // ---- Training ops (core/backend.h). They run on the main stream only.

  void convert(const Tensor& dst, const Tensor& src) override {
    bind();
    main_only("convert");
    check_device(dst, "convert");
    check_device(src, "convert");
    IRIS_CHECK(dst.numel() == src.numel(), "convert: ", src.shape_str(), " -> ", dst.shape_str());
    if (dst.dtype == src.dtype) {
      copy(dst, src);
    } else if (dst.dtype == DType::bf16 && src.dtype == DType::f32) {
      cuda::launch_convert_f32_to_bf16(bf(dst), static_cast<const float*>(src.data), dst.numel(),
                                       stream());
    } else if (dst.dtype == DType::f32 && src.dtype == DType::bf16) {
      cuda::launch_convert_bf16_to_f32(f32(dst), cbf(src), dst.numel(), stream());
    } else {
      IRIS_FAIL("convert: ", src.shape_str(), " -> ", dst.shape_str(), " (only f32 <-> bf16)");
    }
  }

  void linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w,
                             bool accumulate) override {
    bind();
    main_only("linear_backward_input");
    check_act(dy, "linear_backward_input", "dy");
    check_act(w, "linear_backward_input", "weight");
    check_act_or_f32(dx, "linear_backward_input", "dx");
    const int64_t M = dy.rows(), N = dy.cols(), K = w.dim(1);
    IRIS_CHECK(w.ndim == 2 && w.dim(0) == N && dx.rows() == M && dx.cols() == K,
               "linear_backward_input: dy ", dy.shape_str(), ", weight ", w.shape_str(), ", dx ",
               dx.shape_str());
    IRIS_CHECK(dx.data != dy.data, "linear_backward_input: dx aliases dy");
    if (M == 0 || K == 0) return;
    gemm_->backward_input(dx.data, dx.dtype == DType::f32, cbf(dy), cbf(w), M, N, K, accumulate,
                          stream());
  }

  void linear_backward_weight(const Tensor& dw, const Tensor& db, const Tensor& dy,
                              const Tensor& x) override {
    bind();
    main_only("linear_backward_weight");
    check_act(dy, "linear_backward_weight", "dy");
    check_act(x, "linear_backward_weight", "x");
    const int64_t M = dy.rows(), N = dy.cols(), K = x.cols();
    IRIS_CHECK(x.rows() == M, "linear_backward_weight: dy ", dy.shape_str(), " and x ",
               x.shape_str(), " differ in rows");
    if (dw.defined()) {
      check_f32(dw, "linear_backward_weight", "dw");
      IRIS_CHECK(dw.rows() == N && dw.cols() == K, "linear_backward_weight: dw ", dw.shape_str(),
                 " should be [", N, ", ", K, "]");
    }
    if (db.defined()) {
      check_f32(db, "linear_backward_weight", "db");
      IRIS_CHECK(db.numel() == N, "linear_backward_weight: db ", db.shape_str(), " should have ",
                 N);
    }
    if (!dw.defined() && !db.defined()) return;
    gemm_->backward_weight(opt_f32(dw), opt_f32(db), cbf(dy), cbf(x), M, N, K, stream());
  }

  void layer_norm_train(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                        const Tensor& w, const Tensor& b, float eps) override {
    bind();
    main_only("layer_norm_train");
    check_rowwise(y, x, w, "layer_norm_train");
    check_act(b, "layer_norm_train", "bias");
    check_stats(mean, x.rows(), "layer_norm_train", "mean");
    check_stats(rstd, x.rows(), "layer_norm_train", "rstd");
    IRIS_CHECK(y.data != x.data, "layer_norm_train: y aliases x");
    cuda::launch_layer_norm_train(bf(y), f32(mean), f32(rstd), cbf(x), cbf(w), cbf(b), x.rows(),
                                  x.cols(), eps, stream());
  }

  void layer_norm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                           const Tensor& x, const Tensor& mean, const Tensor& rstd,
                           const Tensor& w) override {
    bind();
    main_only("layer_norm_backward");
    const int64_t R = x.rows(), C = x.cols();
    check_norm_backward(dx, dy, x, w, R, C, "layer_norm_backward");
    check_stats(mean, R, "layer_norm_backward", "mean");
    check_stats(rstd, R, "layer_norm_backward", "rstd");
    check_param_grad(dw, C, "layer_norm_backward", "dw");
    check_param_grad(db, C, "layer_norm_backward", "db");
    cuda::launch_layer_norm_backward(opt_f32(dx), opt_f32(dw), opt_f32(db), dy.data,
                                     dy.dtype == DType::f32, cbf(x), cf32(mean), cf32(rstd), cbf(w),
                                     R, C, train_scratch(), train_scratch_floats(), stream());
  }

  void rms_norm_train(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                      float eps) override {
    bind();
    main_only("rms_norm_train");
    check_rowwise(y, x, w, "rms_norm_train");
    check_stats(rstd, x.rows(), "rms_norm_train", "rstd");
    IRIS_CHECK(y.data != x.data, "rms_norm_train: y aliases x");
    cuda::launch_rms_norm_train(bf(y), f32(rstd), cbf(x), cbf(w), x.rows(), x.cols(), eps,
                                stream());
  }

  void rms_norm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x,
                         const Tensor& rstd, const Tensor& w) override {
    bind();
    main_only("rms_norm_backward");
    const int64_t R = x.rows(), C = x.cols();
    check_norm_backward(dx, dy, x, w, R, C, "rms_norm_backward");
    check_stats(rstd, R, "rms_norm_backward", "rstd");
    check_param_grad(dw, C, "rms_norm_backward", "dw");
    cuda::launch_rms_norm_backward(opt_f32(dx), opt_f32(dw), dy.data, dy.dtype == DType::f32,
                                   cbf(x), cf32(rstd), cbf(w), R, C, train_scratch(),
                                   train_scratch_floats(), stream());
  }

  void qkv_norm_rope_train(const Tensor& out, const Tensor& rstd, const Tensor& in,
                           const Tensor& q_norm_w, const Tensor& k_norm_w, float eps,
                           const Tensor& cos, const Tensor& sin, int nq, int nkv, int hd,
                           bool round_tables) override {
    bind();
    main_only("qkv_norm_rope_train");
    check_act(out, "qkv_norm_rope_train", "out");
    check_qkv_norm_rope(in, q_norm_w, k_norm_w, cos, sin, nq, nkv, hd);
    IRIS_CHECK(out.numel() == in.numel(), "qkv_norm_rope_train: out ", out.shape_str(), " vs in ",
               in.shape_str());
    const bool norms = q_norm_w.defined() || k_norm_w.defined();
    if (norms) {
      IRIS_CHECK(out.data != in.data, "qkv_norm_rope_train: out aliases in with q/k norms");
      if (rstd.defined()) check_stats(rstd, in.rows() * (nq + nkv), "qkv_norm_rope_train", "rstd");
    }
    cuda::launch_qkv_norm_rope_train(bf(out), norms ? opt_f32(rstd) : nullptr, cbf(in),
                                     cbf_opt(q_norm_w), cbf_opt(k_norm_w), eps, cf32(cos),
                                     cf32(sin), in.rows(), nq, nkv, hd, round_tables, stream());
  }

  void qkv_norm_rope_backward(const Tensor& din, const Tensor& dq_norm_w, const Tensor& dk_norm_w,
                              const Tensor& dout, const Tensor& in, const Tensor& rstd,
                              const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& cos,
                              const Tensor& sin, int nq, int nkv, int hd,
                              bool round_tables) override {
    bind();
    main_only("qkv_norm_rope_backward");
    check_act(din, "qkv_norm_rope_backward", "din");
    check_qkv_norm_rope(dout, q_norm_w, k_norm_w, cos, sin, nq, nkv, hd);
    IRIS_CHECK(din.numel() == dout.numel(), "qkv_norm_rope_backward: din ", din.shape_str(),
               " vs dout ", dout.shape_str());
    const bool norms = q_norm_w.defined() || k_norm_w.defined();
    if (norms) {
      check_act(in, "qkv_norm_rope_backward", "saved input");
      IRIS_CHECK(in.numel() == dout.numel(), "qkv_norm_rope_backward: saved input ",
                 in.shape_str());
      check_stats(rstd, dout.rows() * (nq + nkv), "qkv_norm_rope_backward", "rstd");
    }
    check_param_grad(dq_norm_w, hd, "qkv_norm_rope_backward", "dq_norm_w");
    check_param_grad(dk_norm_w, hd, "qkv_norm_rope_backward", "dk_norm_w");
    cuda::launch_qkv_norm_rope_backward(
        bf(din), opt_f32(dq_norm_w), opt_f32(dk_norm_w), cbf(dout), norms ? cbf(in) : nullptr,
        norms ? cf32(rstd) : nullptr, cbf_opt(q_norm_w), cbf_opt(k_norm_w), cf32(cos), cf32(sin),
        dout.rows(), nq, nkv, hd, round_tables, train_scratch(), train_scratch_floats(), stream());
  }

  void attention_train(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                       const Tensor& cu_seqlens, int n_segments, int nq, int nkv, int hd,
                       float scale, bool causal, const Tensor& real_rows) override {
    bind();
    main_only("attention_train");
    check_attention_train(out, qkv, cu_seqlens, n_segments, nq, nkv, hd, real_rows,
                          "attention_train");
    check_stats(lse, qkv.rows() * nq, "attention_train", "lse");
    cuda::launch_attention_train_forward(bf(out), f32(lse), cbf(qkv), ci32(cu_seqlens),
                                         real_rows.defined() ? ci32(real_rows) : nullptr,
                                         n_segments, qkv.rows(), nq, nkv, hd, scale, causal,
                                         num_sms_, stream());
  }

  void attention_backward(const Tensor& dqkv, const Tensor& dsum, const Tensor& dout,
                          const Tensor& out, const Tensor& lse, const Tensor& qkv,
                          const Tensor& cu_seqlens, int n_segments, int nq, int nkv, int hd,
                          float scale, bool causal, const Tensor& real_rows) override {
    bind();
    main_only("attention_backward");
    check_attention_train(out, qkv, cu_seqlens, n_segments, nq, nkv, hd, real_rows,
                          "attention_backward");
    check_act(dqkv, "attention_backward", "dqkv");
    check_act(dout, "attention_backward", "dout");
    IRIS_CHECK(dqkv.numel() == qkv.numel() && dout.numel() == out.numel(),
               "attention_backward: dqkv ", dqkv.shape_str(), " or dout ", dout.shape_str(),
               " does not match");
    check_stats(lse, qkv.rows() * nq, "attention_backward", "lse");
    check_stats(dsum, qkv.rows() * nq, "attention_backward", "dsum");
    cuda::launch_attention_train_backward(
        bf(dqkv), f32(dsum), cbf(dout), cbf(out), cf32(lse), cbf(qkv), ci32(cu_seqlens),
        real_rows.defined() ? ci32(real_rows) : nullptr, n_segments, qkv.rows(), nq, nkv, hd, scale,
        causal, num_sms_, stream());
  }

  void gelu_tanh_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) override {
    bind();
    main_only("gelu_tanh_backward");
    check_elementwise_backward(dx, dy, x, "gelu_tanh_backward");
    cuda::launch_gelu_tanh_backward(bf(dx), cbf(dy), cbf(x), x.numel(), stream());
  }
  void gelu_erf_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) override {
    bind();
    main_only("gelu_erf_backward");
    check_elementwise_backward(dx, dy, x, "gelu_erf_backward");
    cuda::launch_gelu_erf_backward(bf(dx), cbf(dy), cbf(x), x.numel(), stream());
  }
  void quick_gelu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) override {
    bind();
    main_only("quick_gelu_backward");
    check_elementwise_backward(dx, dy, x, "quick_gelu_backward");
    cuda::launch_quick_gelu_backward(bf(dx), cbf(dy), cbf(x), x.numel(), stream());
  }
  void swiglu_backward(const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up) override {
    bind();
    main_only("swiglu_backward");
    check_act(dgate_up, "swiglu_backward", "dgate_up");
    check_act(dy, "swiglu_backward", "dy");
    check_act(gate_up, "swiglu_backward", "gate_up");
    const int64_t M = dy.rows(), I = dy.cols();
    IRIS_CHECK(gate_up.rows() == M && gate_up.cols() == 2 * I && dgate_up.numel() == M * 2 * I,
               "swiglu_backward: dy ", dy.shape_str(), ", gate_up ", gate_up.shape_str());
    cuda::launch_swiglu_backward(bf(dgate_up), cbf(dy), cbf(gate_up), M, I, stream());
  }

  void embedding_backward(const Tensor& dtable, const Tensor& dy, const Tensor& ids,
                          int32_t skip_id) override {
    bind();
    main_only("embedding_backward");
    check_f32(dtable, "embedding_backward", "dtable");
    check_act_or_f32(dy, "embedding_backward", "dy");
    check_index(ids, "embedding_backward", "ids");
    const int64_t T = ids.numel(), H = dtable.cols();
    IRIS_CHECK(dy.rows() == T && dy.cols() == H, "embedding_backward: dy ", dy.shape_str(),
               " should be [", T, ", ", H, "]");
    cuda::launch_embedding_backward(f32(dtable), dy.data, dy.dtype == DType::f32, ci32(ids), T,
                                    dtable.rows(), H, skip_id, stream());
  }

  void gather_rows(const Tensor& dst, const Tensor& src, const Tensor& index) override {
    bind();
    main_only("gather_rows");
    check_act_or_f32(dst, "gather_rows", "destination");
    check_act_or_f32(src, "gather_rows", "source");
    check_index(index, "gather_rows", "index");
    IRIS_CHECK(dst.rows() == index.numel() && dst.cols() == src.cols(), "gather_rows: dst ",
               dst.shape_str(), ", src ", src.shape_str(), ", index ", index.shape_str());
    cuda::launch_gather_rows(dst.data, dst.dtype == DType::f32, src.data, src.dtype == DType::f32,
                             ci32(index), index.numel(), src.rows(), src.cols(), stream());
  }

  void add_interpolated_rows_backward(const Tensor& dtable, const Tensor& dy, const Tensor& index,
                                      const Tensor& weight) override {
    bind();
    main_only("add_interpolated_rows_backward");
    check_f32(dtable, "add_interpolated_rows_backward", "dtable");
    check_act_or_f32(dy, "add_interpolated_rows_backward", "dy");
    check_index(index, "add_interpolated_rows_backward", "index");
    check_f32(weight, "add_interpolated_rows_backward", "weight");
    const int64_t S = dy.rows();
    IRIS_CHECK(dtable.cols() == dy.cols() && index.numel() == 4 * S && weight.numel() == 4 * S,
               "add_interpolated_rows_backward: dtable ", dtable.shape_str(), ", dy ",
               dy.shape_str(), ", index ", index.shape_str());
    cuda::launch_add_interpolated_rows_backward(f32(dtable), dy.data, dy.dtype == DType::f32,
                                                ci32(index), cf32(weight), S, dtable.rows(),
                                                dy.cols(), stream());
  }

  size_t lm_head_loss_workspace_bytes(int64_t chunk_rows, int64_t hidden,
                                      int64_t vocab) const override {
    (void)hidden;
    return cuda_lm_head_loss_workspace_bytes(chunk_rows, vocab);
  }

  void lm_head_loss(const Tensor& loss_sum, const Tensor& dx, const Tensor& dw, const Tensor& x,
                    const Tensor& w, const Tensor& targets, const Tensor& grad_scale,
                    const Tensor& workspace, int64_t chunk_rows) override {
    bind();
    main_only("lm_head_loss");
    check_f32(loss_sum, "lm_head_loss", "loss_sum");
    check_act(x, "lm_head_loss", "rows");
    check_act(w, "lm_head_loss", "weight");
    check_index(targets, "lm_head_loss", "targets");
    check_device(workspace, "lm_head_loss");
    const int64_t N = x.rows(), H = x.cols(), V = w.rows();
    IRIS_CHECK(w.cols() == H && targets.numel() == N && loss_sum.numel() == 1,
               "lm_head_loss: rows ", x.shape_str(), ", weight ", w.shape_str(), ", targets ",
               targets.shape_str());
    IRIS_CHECK(chunk_rows > 0 && chunk_rows <= kTrainMaxLossRows, "lm_head_loss: chunk_rows ",
               chunk_rows, " outside [1, ", kTrainMaxLossRows, "]");
    IRIS_CHECK(workspace.nbytes() >= lm_head_loss_workspace_bytes(chunk_rows, H, V),
               "lm_head_loss: workspace of ", workspace.nbytes(), " bytes, ",
               lm_head_loss_workspace_bytes(chunk_rows, H, V), " needed");
    const bool backward = dx.defined();
    if (backward) {
      check_act(dx, "lm_head_loss", "dx");
      check_f32(grad_scale, "lm_head_loss", "grad_scale");
      IRIS_CHECK(dx.rows() == N && dx.cols() == H, "lm_head_loss: dx ", dx.shape_str());
    }
    check_param_grad(dw, V * H, "lm_head_loss", "dw");
    float* logits = static_cast<float*>(workspace.data);
    uint16_t* dlogits = reinterpret_cast<uint16_t*>(static_cast<char*>(workspace.data) +
                                                    align256(size_t(chunk_rows) * size_t(V) * 4));
    for (int64_t r0 = 0; r0 < N; r0 += chunk_rows) {
      const int64_t n = std::min(chunk_rows, N - r0);
      const uint16_t* xc = cbf(x) + r0 * H;
      gemm_->forward_f32(logits, xc, cbf(w), n, V, H, stream());
      cuda::launch_cross_entropy(f32(loss_sum), backward ? dlogits : nullptr, logits,
                                 ci32(targets) + r0, backward ? cf32(grad_scale) : nullptr, n, V,
                                 train_scratch(), train_scratch_floats(), stream());
      if (!backward) continue;
      // dx rows = d(logits) . w; the weight gradient += d(logits)^T . x rows.
      gemm_->backward_input(bf(dx) + r0 * H, false, dlogits, cbf(w), n, V, H, false, stream());
      if (dw.defined()) gemm_->backward_weight(f32(dw), nullptr, dlogits, xc, n, V, H, stream());
    }
  }

  void grad_norm_clip(const Tensor& grad_stats, const Tensor& grads, const Tensor& spans,
                      const Tensor& hyper, float max_norm) override {
    bind();
    main_only("grad_norm_clip");
    check_f32(grad_stats, "grad_norm_clip", "grad_stats");
    check_f32(grads, "grad_norm_clip", "grads");
    const int64_t n = check_spans(spans, hyper, "grad_norm_clip");
    cuda::launch_grad_norm_clip(f32(grad_stats), cf32(grads),
                                static_cast<const int64_t*>(spans.data), cf32(hyper), n, max_norm,
                                train_scratch(), train_scratch_floats(), stream());
  }

  void grad_sum_squares(const Tensor& sums, const Tensor& grads, const Tensor& spans,
                        const Tensor& hyper) override {
    bind();
    main_only("grad_sum_squares");
    check_f32(grads, "grad_sum_squares", "grads");
    const int64_t n = check_spans(spans, hyper, "grad_sum_squares");
    check_device(sums, "grad_sum_squares");
    IRIS_CHECK(sums.dtype == DType::i64 && sums.numel() == n, "grad_sum_squares: sums ",
               sums.shape_str(), " should be i64 [", n, "]");
    cuda::launch_grad_sum_squares(static_cast<double*>(sums.data), cf32(grads),
                                  static_cast<const int64_t*>(spans.data), cf32(hyper), n,
                                  stream());
  }

  void adamw_step(const Tensor& params, const Tensor& grads, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, const Tensor& weights, const Tensor& spans,
                  const Tensor& hyper, const Tensor& steps, const Tensor& lr,
                  const Tensor& grad_stats, float beta1, float beta2, float eps) override {
    bind();
    main_only("adamw_step");
    for (const Tensor* t : {&params, &grads, &exp_avg, &exp_avg_sq, &lr, &grad_stats})
      check_f32(*t, "adamw_step", "buffer");
    IRIS_CHECK(grads.numel() == params.numel() && exp_avg.numel() == params.numel() &&
                   exp_avg_sq.numel() == params.numel(),
               "adamw_step: flat buffers of different lengths");
    if (weights.defined()) check_act(weights, "adamw_step", "weights");
    const int64_t n = check_spans(spans, hyper, "adamw_step");
    check_device(steps, "adamw_step");
    IRIS_CHECK(steps.dtype == DType::i64 && steps.numel() == n, "adamw_step: steps ",
               steps.shape_str(), " should be i64 [", n, "]");
    cuda::launch_adamw_step(f32(params), cf32(grads), f32(exp_avg), f32(exp_avg_sq),
                            weights.defined() ? bf(weights) : nullptr,
                            static_cast<const int64_t*>(spans.data), cf32(hyper),
                            static_cast<int64_t*>(steps.data), cf32(lr), cf32(grad_stats), n, beta1,
                            beta2, eps, train_scratch(), train_scratch_floats(), stream());
  }

 private:
  // The training scratch serves norm widths up to this many columns, loss chunks up to this many
  // rows and optimizers over up to this many tensors (Qwen3-VL-8B has about 700).
  static constexpr int64_t kTrainMaxCols = 16384;
  static constexpr int64_t kTrainMaxLossRows = 4096;
  static constexpr int64_t kTrainMaxTensors = 8192;

  static size_t align256(size_t b) { return (b + 255) / 256 * 256; }
  static float* f32(const Tensor& t) { return static_cast<float*>(t.data); }
  static const float* cf32(const Tensor& t) { return static_cast<const float*>(t.data); }
  static float* opt_f32(const Tensor& t) { return t.defined() ? f32(t) : nullptr; }
  float* train_scratch() const { return static_cast<float*>(train_scratch_.get()); }
  int64_t train_scratch_floats() const {
    return static_cast<int64_t>(train_scratch_bytes_ / sizeof(float));
  }
  static void check_f32(const Tensor& t, const char* op, const char* what) {
    check_device(t, op);
    IRIS_CHECK(t.dtype == DType::f32, op, ": ", what, " must be f32, got ", t.shape_str());
  }
  static void check_act_or_f32(const Tensor& t, const char* op, const char* what) {
    check_device(t, op);
    IRIS_CHECK(t.dtype == DType::f32 || t.dtype == DType::bf16, op, ": ", what,
               " must be f32 or bf16, got ", t.shape_str());
  }
  static void check_stats(const Tensor& t, int64_t n, const char* op, const char* what) {
    check_f32(t, op, what);
    IRIS_CHECK(t.numel() == n, op, ": ", what, " ", t.shape_str(), " should have ", n, " elements");
  }
  static void check_param_grad(const Tensor& g, int64_t n, const char* op, const char* what) {
    if (!g.defined()) return;
    check_stats(g, n, op, what);
  }
  static void check_norm_backward(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                  const Tensor& w, int64_t R, int64_t C, const char* op) {
    check_act(x, op, "x");
    check_act(w, op, "weight");
    check_act_or_f32(dy, op, "dy");
    IRIS_CHECK(dy.rows() == R && dy.cols() == C && w.numel() == C, op, ": dy ", dy.shape_str(),
               " or weight ", w.shape_str(), " does not match x ", x.shape_str());
    if (dx.defined()) {
      check_f32(dx, op, "dx");
      IRIS_CHECK(dx.rows() == R && dx.cols() == C, op, ": dx ", dx.shape_str());
    }
  }
  static void check_elementwise_backward(const Tensor& dx, const Tensor& dy, const Tensor& x,
                                         const char* op) {
    check_act(dx, op, "dx");
    check_act(dy, op, "dy");
    check_act(x, op, "x");
    IRIS_CHECK(dx.numel() == x.numel() && dy.numel() == x.numel(), op, ": ", dx.shape_str(), " ",
               dy.shape_str(), " ", x.shape_str());
  }
  static void check_attention_train(const Tensor& out, const Tensor& qkv, const Tensor& cu,
                                    int n_segments, int nq, int nkv, int hd,
                                    const Tensor& real_rows, const char* op) {
    check_act(out, op, "out");
    check_act(qkv, op, "qkv");
    check_index(cu, op, "cu_seqlens");
    if (real_rows.defined()) check_index(real_rows, op, "real_rows");
    IRIS_CHECK(
        hd % 2 == 0 && hd <= cuda::kAttentionTrainMaxHeadDim && nq > 0 && nkv > 0 && nq % nkv == 0,
        op, ": ", nq, " query heads over ", nkv, " kv heads of ", hd, " (head_dim even, at most ",
        cuda::kAttentionTrainMaxHeadDim, ")");
    IRIS_CHECK(qkv.cols() == int64_t(nq + 2 * nkv) * hd && out.rows() == qkv.rows() &&
                   out.cols() == int64_t(nq) * hd,
               op, ": qkv ", qkv.shape_str(), ", out ", out.shape_str());
    IRIS_CHECK(n_segments >= 0 && cu.numel() >= n_segments + 1, op, ": cu_seqlens ", cu.shape_str(),
               " for ", n_segments, " segments");
  }
  static int64_t check_spans(const Tensor& spans, const Tensor& hyper, const char* op) {
    check_device(spans, op);
    check_f32(hyper, op, "hyper");
    IRIS_CHECK(spans.dtype == DType::i64 && spans.cols() == 3 && hyper.cols() == 2 &&
                   hyper.rows() == spans.rows(),
               op, ": spans ", spans.shape_str(), " should be i64 [n, 3] and hyper f32 [n, 2]");
    IRIS_CHECK(spans.rows() <= kTrainMaxTensors, op, ": ", spans.rows(), " tensors, more than the ",
               kTrainMaxTensors, " planned");
    return spans.rows();
  }

  // write() through the pinned staging; `check`: also find the source's first NaN or Inf (the
  // returned index, -1 for none), in the staging copy where the dtypes agree.
  int64_t stage_write(const Tensor& dst, const void* host_src, DType src_dtype, bool check) {
    bind();
    check_device(dst, "write");
    const int64_t n = dst.numel();
    if (n == 0) return -1;
    IRIS_CHECK(host_src != nullptr, "write: null host source for ", dst.shape_str());
    const size_t elem = dtype_size(dst.dtype), src_elem = dtype_size(src_dtype);
    const int64_t per_chunk = static_cast<int64_t>(kStagingChunk / elem);
    for (int64_t i = 0; i < n;) {
      const int64_t m = std::min(n - i, per_chunk);
      const size_t bytes = static_cast<size_t>(m) * elem;
      // Small writes pack into the current half of the staging buffer; a full half hands over
      // to the other, which is reusable once its last copy (tracked by an event) is done.
      if (staging_offset_ + bytes > staging_half_bytes_) {
        staging_half_ ^= 1;
        const auto wait_start = std::chrono::steady_clock::now();
        IRIS_CUDA_CHECK(cudaEventSynchronize(staging_events_[staging_half_]->get()));
        write_wait_seconds_ +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - wait_start).count();
        staging_offset_ = 0;
      }
      char* stage = staging_->data() + staging_half_ * staging_half_bytes_ + staging_offset_;
      const char* src = static_cast<const char*>(host_src) + i * src_elem;
      if (check) {
        const int64_t bad = src_dtype == dst.dtype
                                ? cuda::copy_finite_parallel(stage, src, src_dtype, m)
                                : first_non_finite(src, src_dtype, m);
        if (bad >= 0) return i + bad;
        if (src_dtype != dst.dtype) convert_host(stage, dst.dtype, src, src_dtype, m);
      } else {
        convert_host(stage, dst.dtype, src, src_dtype, m);
      }
      IRIS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst.data) + i * elem, stage, bytes,
                                      cudaMemcpyHostToDevice, stream()));
      IRIS_CUDA_CHECK(cudaEventRecord(staging_events_[staging_half_]->get(), stream()));
      staging_offset_ += (bytes + 255) / 256 * 256;
      i += m;
    }
    return -1;
  }

  static constexpr size_t kStagingChunk = size_t{8} << 20;
  // A checkpoint's upload: 16 threads read a page-cached file at 42 GB/s on an H200 host, 4 at
  // 32 GB/s.
  static constexpr int kUploadThreads = 16;
  static constexpr size_t kMaxStagingHalf = size_t{1} << 30;
  // cuBLASLt's recommendation for Hopper.
  static constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;
  // Trial outputs of accumulating GEMMs while their algorithms are timed (gemm.h): covers the
  // residual projections of a 4096-token prefill chunk and of an 8-image vision call.
  static constexpr size_t kGemmTuneScratchBytes = size_t{16} << 20;
  // 64 query heads x 128 splits of head_dim 128 partials, plus their maxima and sums, and the
  // decode kernel's per-kv-head tickets.
  static constexpr int64_t kDecodeScratchRows = 64 * 128;
  static constexpr int64_t kDecodeScratchFloats = kDecodeScratchRows * 128;
  static constexpr int kDecodeTickets = 64;
  static constexpr size_t kDecodeScratchBytes =
      (2 * kDecodeScratchRows + kDecodeScratchFloats) * sizeof(float) +
      kDecodeTickets * sizeof(unsigned);
  // Rows that argmax_rows spreads over many blocks at once; more fall back to a block per row.
  static constexpr int64_t kArgmaxScratchRows = 4096;

  // Keeps multi-GPU use correct: every entry point runs against this backend's device.
  void bind() const {
    int current = -1;
    IRIS_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device_) IRIS_CUDA_CHECK(cudaSetDevice(device_));
  }

  static void check_device(const Tensor& t, const char* op) {
    IRIS_CHECK(t.device == Device::cuda, op, ": tensor ", t.shape_str(),
               " is not on the CUDA device");
    IRIS_CHECK(t.defined() || t.numel() == 0, op, ": tensor ", t.shape_str(), " has no data");
  }
  static void check_act(const Tensor& t, const char* op, const char* what) {
    check_device(t, op);
    IRIS_CHECK(t.dtype == DType::bf16, op, ": ", what, " is ", t.shape_str(),
               "; the CUDA backend computes in bf16");
  }
  static void check_index(const Tensor& t, const char* op, const char* what) {
    check_device(t, op);
    IRIS_CHECK(t.dtype == DType::i32, op, ": ", what, " must be i32, got ", t.shape_str());
  }
  static void check_linear(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
                           const char* op) {
    check_act(y, op, "y");
    check_act(x, op, "x");
    check_act(w, op, "w");
    const int64_t m = x.rows(), k = x.cols();
    IRIS_CHECK(w.ndim == 2 && w.shape[1] == k, op, ": w ", w.shape_str(), " does not match x ",
               x.shape_str(), " (expected [N, ", k, "])");
    const int64_t n = w.shape[0];
    IRIS_CHECK(y.cols() == n && y.rows() == m, op, ": y ", y.shape_str(), " should be [", m, ", ",
               n, "]");
    IRIS_CHECK(y.data != x.data, op, ": y must not alias x");
    if (bias.defined()) {
      check_act(bias, op, "bias");
      IRIS_CHECK(bias.numel() == n, op, ": bias ", bias.shape_str(), " should have ", n,
                 " elements");
    }
  }
  static void check_unary(const Tensor& y, const Tensor& x, const char* op) {
    check_act(y, op, "y");
    check_act(x, op, "x");
    IRIS_CHECK(y.numel() == x.numel(), op, ": y ", y.shape_str(), " and x ", x.shape_str(),
               " differ in size");
  }
  static void check_rowwise(const Tensor& y, const Tensor& x, const Tensor& w, const char* op) {
    check_unary(y, x, op);
    check_act(w, op, "w");
    IRIS_CHECK(w.numel() == x.cols(), op, ": w ", w.shape_str(), " should have ", x.cols(),
               " elements");
  }
  static void check_head_dim(int head_dim, const char* op) {
    IRIS_CHECK(cuda::attention_head_dim_supported(head_dim), op, ": head_dim ", head_dim,
               " has no CUDA kernel (supported: 16, 64, 72, 80, 128)");
  }
  static void check_aligned(const Tensor& t, size_t bytes, const char* op, const char* what) {
    IRIS_CHECK(cuda::aligned(t.data, bytes), op, ": ", what, " must be ", bytes,
               "-byte aligned (arena tensors and their row slices are)");
  }
  static void check_causal_shapes(const Tensor& qkv, const Tensor& k_cache, const Tensor& v_cache,
                                  const Tensor& past_len, int n_q, int n_kv, int head_dim,
                                  const char* op) {
    check_act(qkv, op, "qkv");
    check_act(k_cache, op, "k_cache");
    check_act(v_cache, op, "v_cache");
    check_index(past_len, op, "past_len");
    IRIS_CHECK(n_q > 0 && n_kv > 0 && head_dim > 0, op, ": bad head counts");
    IRIS_CHECK(qkv.cols() == int64_t{n_q + 2 * n_kv} * head_dim, op, ": qkv ", qkv.shape_str(),
               " is not [T, (", n_q, " + 2*", n_kv, ") * ", head_dim, "]");
    IRIS_CHECK(k_cache.cols() == int64_t{n_kv} * head_dim && v_cache.cols() == k_cache.cols() &&
                   v_cache.rows() == k_cache.rows(),
               op, ": caches ", k_cache.shape_str(), " / ", v_cache.shape_str(),
               " are not [max_len, ", n_kv * head_dim, "]");
    IRIS_CHECK(past_len.numel() >= 1, op, ": past_len is empty");
  }

  // Ops whose scratch buffers exist once, for the main stream.
  void main_only(const char* op) const {
    IRIS_CHECK(!on_side_, op,
               " cannot run as side work: its scratch buffers belong to the main "
               "stream");
  }

  int device_;
  std::string name_;
  int num_sms_ = 0;
  std::unique_ptr<cuda::Stream> stream_;
  std::unique_ptr<cuda::Event> staging_events_[2];
  std::unique_ptr<cuda::PinnedBuffer> staging_;
  int staging_half_ = 0;
  size_t staging_half_bytes_ = kStagingChunk;
  double write_wait_seconds_ = 0;
  std::unique_ptr<cuda::PinnedBuffer> hold_flags_;  // hold_device's release and expired flags
  bool holding_ = false;
  size_t staging_offset_ = 0;
  DeviceBuffer workspace_;
  DeviceBuffer tune_scratch_;
  DeviceBuffer decode_buffer_;
  DeviceBuffer argmax_keys_;
  cuda::DecodeScratch scratch_;
  std::unique_ptr<cuda::Stream> side_stream_;
  std::unique_ptr<cuda::Stream> copy_stream_;
  std::unique_ptr<cuda::Event> copy_fork_;
  std::array<std::unique_ptr<cuda::Event>, kCopyPoints> copy_points_;
  std::unique_ptr<cuda::Event> side_fork_, side_done_;
  bool on_side_ = false, side_pending_ = false;
  std::unique_ptr<cuda::Event> timing_marks_[kTimingMarks];
  std::array<bool, kTimingMarks> timing_recorded_{};
  DeviceBuffer side_workspace_;
  DeviceBuffer train_scratch_;
  size_t train_scratch_bytes_ = 0;
  // Shared by the planners below, which are destroyed first.
  std::unique_ptr<GemmTuningCache> tuning_cache_;
  // Destroyed before the workspaces they use.
  std::unique_ptr<cuda::LtGemm> gemm_;
  std::unique_ptr<cuda::LtGemm> side_gemm_;
  std::unique_ptr<cuda::MoeBatchedGemm> moe_gemm_;
  // Last, so that its thread is joined first when the backend goes.
  std::unique_ptr<cuda::HeuristicsWarmup> heuristics_warmup_;
};

}  // namespace

bool cuda_available() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();  // a missing driver is an answer here, not a pending error
    return false;
  }
  return n > 0;
}

std::unique_ptr<Backend> make_cuda_backend(int device_index) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    IRIS_FAIL("no usable CUDA device: ", cudaGetErrorString(err),
              " (check the driver, or use the cpu backend)");
  }
  IRIS_CHECK(device_index >= 0 && device_index < n, "CUDA device ", device_index,
             " does not exist (", n, " device(s) present)");
  return std::make_unique<CudaBackend>(device_index);
}

cudaStream_t cuda_stream(Backend& backend) {
  auto* cuda_backend = dynamic_cast<CudaBackend*>(&backend);
  IRIS_CHECK(cuda_backend != nullptr, "backend ", backend.name(), " is not a CUDA backend");
  return cuda_backend->stream();
}

}  // namespace iris
