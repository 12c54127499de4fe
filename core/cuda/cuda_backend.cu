// The CUDA backend: bf16 storage, fp32 accumulation, one stream. Ops validate shapes on the host
// and enqueue kernels; nothing but read() and synchronize() waits for the device.
#include "core/cuda/cuda_backend.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include <cuda_profiler_api.h>

#include "core/cuda/cuda_check.h"
#include "core/cuda/device_utils.cuh"
#include "core/cuda/gemm.h"
#include "core/cuda/host_convert.h"
#include "core/cuda/kernels.h"

namespace iris {
namespace {

// ---- RAII owners (non-copyable; destructors ignore errors so that they never throw) ----

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
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    IRIS_CUDA_CHECK(cudaHostAlloc(&p_, bytes, cudaHostAllocDefault));
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

// Frees a buffer obtained from CudaBackend::allocate().
struct DeviceFree {
  void operator()(void* p) const noexcept { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<void, DeviceFree>;

// ---- host-side dtype conversion for write()/read() ----

// core/dtype's convert_elements with multi-threaded loops for the pairs weights and activations
// go through (f32 <-> bf16).
void convert(void* dst, DType to, const void* src, DType from, int64_t n) {
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
    cudaDeviceProp prop{};
    IRIS_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    IRIS_CHECK(prop.major >= 8, "CUDA device ", device_, " (", prop.name,
               ") has compute capability ", prop.major, ".", prop.minor,
               "; the bf16 kernels need 8.0 or newer");
    name_ = str_cat("cuda:", device_, " (", prop.name, ")");
    num_sms_ = prop.multiProcessorCount;
    stream_ = std::make_unique<Stream>();
    for (auto& e : staging_events_) e = std::make_unique<Event>();
    staging_ = std::make_unique<PinnedBuffer>(2 * kStagingChunk);
    // The only device allocations besides the arenas, made once here through allocate().
    workspace_.reset(allocate(kGemmWorkspaceBytes));
    tune_scratch_.reset(allocate(kGemmTuneScratchBytes));
    decode_buffer_.reset(allocate(kDecodeScratchBytes));
    argmax_keys_.reset(allocate(kArgmaxScratchRows * sizeof(unsigned long long)));
    gemm_ = std::make_unique<cuda::LtGemm>(workspace_.get(), kGemmWorkspaceBytes,
                                           tune_scratch_.get(), kGemmTuneScratchBytes);
    side_stream_ = std::make_unique<Stream>();
    side_fork_ = std::make_unique<Event>();
    side_done_ = std::make_unique<Event>();
    side_workspace_.reset(allocate(kGemmWorkspaceBytes));
    // A GEMM's workspace holds live data while it runs, so side work has its own; the tuning
    // scratch only receives trial outputs that nothing reads, so the two share it.
    side_gemm_ = std::make_unique<cuda::LtGemm>(side_workspace_.get(), kGemmWorkspaceBytes,
                                                tune_scratch_.get(), kGemmTuneScratchBytes);
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
    cuda::attention_init();
    cuda::gemv_init();
    cuda::set_programmatic_launch(prop.major >= 9);
  }

  ~CudaBackend() override {
    // Queued work may still use the buffers that the members below release.
    if (side_stream_) cudaStreamSynchronize(side_stream_->get());
    if (stream_) cudaStreamSynchronize(stream_->get());
  }

  cudaStream_t stream() const { return on_side_ ? side_stream_->get() : stream_->get(); }
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
    bind();
    check_device(dst, "write");
    const int64_t n = dst.numel();
    if (n == 0) return;
    IRIS_CHECK(host_src != nullptr, "write: null host source for ", dst.shape_str());
    const size_t elem = dtype_size(dst.dtype), src_elem = dtype_size(src_dtype);
    const int64_t per_chunk = static_cast<int64_t>(kStagingChunk / elem);
    for (int64_t i = 0; i < n;) {
      const int64_t m = std::min(n - i, per_chunk);
      const size_t bytes = static_cast<size_t>(m) * elem;
      // Small writes pack into the current half of the staging buffer; a full half hands over
      // to the other, which is reusable once its last copy (tracked by an event) is done.
      if (staging_offset_ + bytes > kStagingChunk) {
        staging_half_ ^= 1;
        IRIS_CUDA_CHECK(cudaEventSynchronize(staging_events_[staging_half_]->get()));
        staging_offset_ = 0;
      }
      char* stage = staging_->data() + staging_half_ * kStagingChunk + staging_offset_;
      convert(stage, dst.dtype, static_cast<const char*>(host_src) + i * src_elem, src_dtype, m);
      IRIS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst.data) + i * elem, stage, bytes,
                                      cudaMemcpyHostToDevice, stream()));
      IRIS_CUDA_CHECK(cudaEventRecord(staging_events_[staging_half_]->get(), stream()));
      staging_offset_ += (bytes + 255) / 256 * 256;
      i += m;
    }
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
      convert(static_cast<char*>(host_dst) + i * dst_elem, dst_dtype, staging_->data(), src.dtype,
              m);
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
    Event start(cudaEventDefault), stop(cudaEventDefault);
    IRIS_CUDA_CHECK(cudaEventRecord(start.get(), stream()));
    enqueue();
    IRIS_CUDA_CHECK(cudaEventRecord(stop.get(), stream()));
    IRIS_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float ms = 0.f;
    IRIS_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    return ms;
  }

  // Graph capture starts and ends on the main stream; side work joins it through events.
  void* native_stream() override { return stream_->get(); }
  size_t device_memory_in_use() override {
    size_t free_bytes = 0, total_bytes = 0;
    IRIS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    return total_bytes - free_bytes;
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
                       float eps, const Tensor& w, const Tensor& act) override {
    bind();
    check_rowwise(xn, x, norm_w, "rms_norm_linear");
    check_linear(y, xn, w, Tensor(), "rms_norm_linear");
    IRIS_CHECK(xn.data != x.data && xn.data != y.data, "rms_norm_linear: xn must not alias x or y");
    if (act.defined()) {
      check_act(act, "rms_norm_linear", "act");
      IRIS_CHECK(y.cols() % 2 == 0 && act.rows() == y.rows() && act.cols() == y.cols() / 2,
                 "rms_norm_linear: act ", act.shape_str(), " does not match gate_up ",
                 y.shape_str(), " (expected [M, I] and [M, 2I])");
    }
    const int64_t m = x.rows(), k = x.cols(), n = w.shape[0];
    // One kernel for a decode step: every block normalises the few x rows while staging them.
    if (m > 0 && n > 0 && cuda::gemv_supported(m, n, k, x.data, w.data) &&
        cuda::aligned16(xn.data) && cuda::aligned16(norm_w.data) &&
        (!act.defined() || n % 2 == 0)) {
      cuda::launch_gemv_rms_norm(bf(y), bf(xn), act.defined() ? bf(act) : nullptr, cbf(x),
                                 cbf(norm_w), eps, cbf(w), m, n, k, stream());
      return;
    }
    rms_norm(xn, x, norm_w, eps);
    linear(y, xn, w, Tensor(), false);
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

  void add(const Tensor& y, const Tensor& a, const Tensor& b) override {
    bind();
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

 private:
  static constexpr size_t kStagingChunk = size_t{8} << 20;
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
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> staging_events_[2];
  std::unique_ptr<PinnedBuffer> staging_;
  int staging_half_ = 0;
  size_t staging_offset_ = 0;
  DeviceBuffer workspace_;
  DeviceBuffer tune_scratch_;
  DeviceBuffer decode_buffer_;
  DeviceBuffer argmax_keys_;
  cuda::DecodeScratch scratch_;
  std::unique_ptr<Stream> side_stream_;
  std::unique_ptr<Event> side_fork_, side_done_;
  bool on_side_ = false, side_pending_ = false;
  DeviceBuffer side_workspace_;
  // Destroyed before the workspaces they use.
  std::unique_ptr<cuda::LtGemm> gemm_;
  std::unique_ptr<cuda::LtGemm> side_gemm_;
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
