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
#include <functional>
#include <memory>
#include <string>

#include "core/tensor.h"

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
  // src.numel() elements into host memory as dst_dtype (waits for pending work).
  virtual void read(void* host_dst, DType dst_dtype, const Tensor& src) = 0;
  // dst = src, same dtype and element count, both on this backend.
  virtual void copy(const Tensor& dst, const Tensor& src) = 0;
  virtual void fill_zero(const Tensor& dst) = 0;
  virtual void synchronize() = 0;
  // The stream ops are issued on (a cudaStream_t on CUDA); null where there is none. CUDA graph
  // capture records this stream.
  virtual void* native_stream() { return nullptr; }
  // Side work: ops issued between begin_side_work() and end_side_work() start after everything
  // issued before begin_side_work() and may run concurrently with the ops issued after it (a
  // second CUDA stream, a parallel branch of a captured graph). join_side_work() makes later ops
  // wait for all side work. Side ops must not touch buffers that the main ops meanwhile use;
  // the GEMMs there get a workspace of their own, and the decode ops (attention_causal,
  // argmax_rows) are refused. synchronize() waits for both. On the CPU everything runs in order.
  virtual void begin_side_work() {}
  virtual void end_side_work() {}
  virtual void join_side_work() {}
  // Device memory in use by this process's context (cudaMemGetInfo), for reports; 0 on the CPU.
  virtual size_t device_memory_in_use() { return 0; }
  // Runs `enqueue` and waits for its work; returns the milliseconds the device spent from the
  // first to the last piece of that work (events on CUDA), or the wall time where the work runs
  // on the host. For benchmarks: a launch-bound phase shows a device span near its wall time.
  // Brackets work for an external profiler started with its collection off (Nsight Compute's
  // --profile-from-start off): only work issued between on and off is profiled. No-op on the CPU.
  virtual void profiler_collect(bool on) { (void)on; }
  virtual double device_span_ms(const std::function<void()>& enqueue) {
    const auto t0 = std::chrono::steady_clock::now();
    enqueue();
    synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }

  // y[M,N] = x[M,K] . w[N,K]^T (+ bias[N]) (+ y if accumulate). y must not alias x.
  virtual void linear(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
                      bool accumulate) = 0;

  // Row-wise LayerNorm over the last dim with weight and bias (stats in f32). y may alias x.
  virtual void layer_norm(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b,
                          float eps) = 0;
  // Row-wise RMSNorm: y = cast(x * rsqrt(mean(x^2) + eps)) * w (stats in f32). y may alias x.
  virtual void rms_norm(const Tensor& y, const Tensor& x, const Tensor& w, float eps) = 0;

  // Elementwise; y may alias a or b.
  virtual void add(const Tensor& y, const Tensor& a, const Tensor& b) = 0;
  // y = gelu(x) with the tanh approximation / with erf. y may alias x.
  virtual void gelu_tanh(const Tensor& y, const Tensor& x) = 0;
  virtual void gelu_erf(const Tensor& y, const Tensor& x) = 0;
  // y[M,I] = silu(gate_up[:, :I]) * gate_up[:, I:]  (gate_up is [M, 2I]).
  virtual void swiglu(const Tensor& y, const Tensor& gate_up) = 0;

  // In place on a fused projection qkv[T, (n_q + 2*n_kv) * head_dim] laid out as q heads, then k
  // heads, then v heads: optional per-head RMSNorm of q and k (q_norm/k_norm, weights [head_dim]),
  // then rotate-half RoPE on q and k with cos/sin [T, head_dim] f32 tables. When
  // round_tables_to_compute_dtype is set, cos/sin are cast to the compute dtype before use (HF
  // does this for the text M-RoPE; the vision RoPE runs in f32).
  virtual void qkv_norm_rope(const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w,
                             float eps, const Tensor& cos, const Tensor& sin, int n_q_heads,
                             int n_kv_heads, int head_dim, bool round_tables_to_compute_dtype) = 0;

  // Non-causal attention within segments: out[S, n_heads*head_dim] from qkv[S, 3*n_heads*head_dim]
  // (q, k, v blocks). cu_seqlens (i32 [n_segments+1]) splits the S rows into independent segments;
  // zero-length segments are allowed. Softmax in f32. real_rows is undefined or an i32 [1] tensor
  // on this backend, read when the op runs (a captured graph reads it at replay): a segment that
  // starts at or past real_rows[0] is padding, and its rows are written as zeros instead of
  // attended, so that a vision call padded up to a graph bucket pays no attention for padding.
  virtual void attention_segments(const Tensor& out, const Tensor& qkv, const Tensor& cu_seqlens,
                                  int n_segments, int n_heads, int head_dim, float scale,
                                  const Tensor& real_rows) = 0;

  // Appends the k and v heads of qkv[T, (n_q + 2*n_kv)*head_dim] to the caches
  // (k_cache/v_cache [max_len, n_kv*head_dim]) at rows past_len[0] .. past_len[0]+T-1.
  // past_len is an i32 [1] tensor on this backend so that a captured graph reads it at replay.
  virtual void kv_store(const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                        const Tensor& past_len, int n_q_heads, int n_kv_heads, int head_dim) = 0;
  // qkv_norm_rope then kv_store, in one pass where the backend fuses them (a decode step then
  // launches one kernel fewer per layer). The result is that of the two calls.
  virtual void qkv_norm_rope_kv_store(const Tensor& qkv, const Tensor& q_norm_w,
                                      const Tensor& k_norm_w, float eps, const Tensor& cos,
                                      const Tensor& sin, int n_q_heads, int n_kv_heads,
                                      int head_dim, bool round_tables_to_compute_dtype,
                                      const Tensor& k_cache, const Tensor& v_cache,
                                      const Tensor& past_len) {
    qkv_norm_rope(qkv, q_norm_w, k_norm_w, eps, cos, sin, n_q_heads, n_kv_heads, head_dim,
                  round_tables_to_compute_dtype);
    kv_store(k_cache, v_cache, qkv, past_len, n_q_heads, n_kv_heads, head_dim);
  }
  // Causal GQA attention for T new queries at absolute rows past_len[0] + i, over cache rows
  // [0, past_len[0] + i]. out[T, n_q*head_dim]; query head h reads kv head h / (n_q / n_kv).
  // With T = 1 the CUDA kernel reads past_len and the cache rows below past_len[0] while the ops
  // just before it may still run: write those by copies or in earlier steps (as the decoder
  // does: each step uploads past_len, and the new row past_len[0] may come from the op just
  // before), never in the few ops before this call.
  virtual void attention_causal(const Tensor& out, const Tensor& qkv, const Tensor& k_cache,
                                const Tensor& v_cache, const Tensor& past_len, int n_q_heads,
                                int n_kv_heads, int head_dim, float scale) = 0;

  // y[T, H] = table[ids[t], :]; ids i32 [T]. Out-of-range ids are an error on the CPU.
  virtual void embedding(const Tensor& y, const Tensor& table, const Tensor& ids) = 0;
  // dst[index[i], :] = src[i, :] (or += when accumulate); index i32 [N].
  virtual void scatter_rows(const Tensor& dst, const Tensor& src, const Tensor& index,
                            bool accumulate) = 0;
  // y[S, D] += cast(sum_k weight[s,k] * table[index[s,k], :]) for k < 4: the bilinear
  // interpolation of a learned position-embedding grid, summed in f32 and rounded once.
  // index i32 [S, 4], weight f32 [S, 4].
  virtual void add_interpolated_rows(const Tensor& y, const Tensor& table, const Tensor& index,
                                     const Tensor& weight) = 0;
  // out i32 [M] = argmax over each row of x[M, N] (lowest index wins ties).
  virtual void argmax_rows(const Tensor& out, const Tensor& x) = 0;

  // Fused ops. Each has a default made of the ops above, which is its definition (and the CPU
  // oracle's implementation); a backend overrides it where one kernel beats the sequence.
  //
  // y = gelu_tanh(x . w^T + bias): linear then gelu_tanh, except that a backend may apply the
  // GELU before rounding the product to its compute dtype (one rounding instead of two).
  virtual void linear_gelu_tanh(const Tensor& y, const Tensor& x, const Tensor& w,
                                const Tensor& bias) {
    linear(y, x, w, bias, false);
    gelu_tanh(y, y);
  }
  // xn = rms_norm(x, norm_w); y = xn . w^T (no bias); and when act is defined,
  // act = swiglu(y) (y is then the [M, 2I] gate_up, act [M, I]). Every output is written as the
  // unfused sequence writes it. xn must not alias x or y.
  virtual void rms_norm_linear(const Tensor& y, const Tensor& xn, const Tensor& x,
                               const Tensor& norm_w, float eps, const Tensor& w,
                               const Tensor& act) {
    rms_norm(xn, x, norm_w, eps);
    linear(y, xn, w, Tensor(), false);
    if (act.defined()) swiglu(act, y);
  }
};

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
