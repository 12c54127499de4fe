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
#include <vector>

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
  // dst = src, same dtype and element count, both on this backend.
  virtual void copy(const Tensor& dst, const Tensor& src) = 0;
  virtual void fill_zero(const Tensor& dst) = 0;
  virtual void synchronize() = 0;
  // The stream ops are issued on (a cudaStream_t on CUDA); null where there is none. CUDA graph
  // capture records this stream.
  virtual void* native_stream() { return nullptr; }
  // Waits for background start-up work (CUDA: the cuBLASLt warm-up thread) to end. That work
  // loads modules, which waits for the whole context: beside a stream capture it invalidates the
  // capture, and beside a kernel that spins until the host releases it (hold_device) it stalls
  // until the spin's limit. Graph capture calls it before it begins.
  virtual void finish_background_startup() {}
  // Side work: ops issued between begin_side_work() and end_side_work() start after everything
  // issued before begin_side_work() and may run concurrently with the ops issued after it (a
  // second CUDA stream, a parallel branch of a captured graph). join_side_work() makes later ops
  // wait for all side work. Side ops must not touch buffers that the main ops meanwhile use;
  // the GEMMs there get a workspace of their own, and the decode ops (attention_causal,
  // argmax_rows) are refused. synchronize() waits for both. On the CPU everything runs in order.
  virtual void begin_side_work() {}
  virtual void end_side_work() {}
  virtual void join_side_work() {}
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
  // y = x * sigmoid(1.702 x) (quick_gelu, Qwen2-VL's vision MLP). y may alias x.
  virtual void quick_gelu(const Tensor& y, const Tensor& x) = 0;
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
  // The per-call tables of a vision encoder call, computed from its images' grid sizes, which
  // are read when the op runs: a captured graph computes the tables of whatever grids were
  // written before its replay, so one graph serves every mix of images of a bucket and the host
  // uploads a few ints instead of the tables. grids i32 [1 + 3 * C] (vision_grids_numel, in
  // core/vision_tables.h): the image count n, then (t, h, w) per image; C = segment capacity.
  // The rows are each image's patches in order (per frame, in merge-window order), then padding.
  // Outputs, R = cos.rows(), head_dim = cos.cols() (a multiple of 4):
  //   cos, sin f32 [R, head_dim]: 2D RoPE, per row the first quarter-pairs rotate with the patch
  //     row r (angle r * inv_freq[j]), the next with the column, the second half repeats the
  //     first; padding rows cos 1, sin 0;
  //   pos_index i32 [R, 4], pos_weight f32 [R, 4]: the bilinear corners and weights of the
  //     learned grid_side^2 position grid at torch.linspace(0, grid_side - 1, h or w) (HF's
  //     fast_pos_embed_interpolate); padding rows index 0, weight 0;
  //   cu_seqlens i32 [C + 1]: one segment per image frame, the padding rows (when R exceeds the
  //     patches) one of their own, then zero-length segments up to C;
  //   real_rows i32 [1]: the patch count;
  //   with window_units > 0 (window attention, Qwen2.5-VL) the rows are in window order (see
  //     vision_tables_host in core/vision_tables.h) and window_cu i32 [W + 1] gets one segment
  //     per window, the padding's, then zero-length segments up to W; otherwise window_cu is
  //     undefined.
  // inv_freq (head_dim / 4 values, vision_rope_inv_freq), merge_size and grid_side are fixed per
  // model. The CPU computes exactly vision_tables_host (and refuses invalid grids); the CUDA
  // kernel gives the same indices, weights and segments bit for bit, and cos/sin within an ulp
  // or two of glibc's cosf/sinf (it rounds a double-precision sincos, which glibc's float
  // functions do not always match); it cannot refuse, so its caller validates the grids.
  virtual void vision_tables(const Tensor& cos, const Tensor& sin, const Tensor& pos_index,
                             const Tensor& pos_weight, const Tensor& cu_seqlens,
                             const Tensor& real_rows, const Tensor& grids,
                             const std::vector<float>& inv_freq, int merge_size, int grid_side,
                             const Tensor& window_cu, int window_units) = 0;
  void vision_tables(const Tensor& cos, const Tensor& sin, const Tensor& pos_index,
                     const Tensor& pos_weight, const Tensor& cu_seqlens, const Tensor& real_rows,
                     const Tensor& grids, const std::vector<float>& inv_freq, int merge_size,
                     int grid_side) {
    vision_tables(cos, sin, pos_index, pos_weight, cu_seqlens, real_rows, grids, inv_freq,
                  merge_size, grid_side, Tensor(), 0);
  }

  // The M-RoPE tables of a text call from its tokens' positions, which are read when the op runs
  // (so that a captured graph follows each replay's positions and the host uploads 3 ints a
  // token instead of the tables). positions i32 [L, 3]: (t, h, w) per token; inv_freq[j] and
  // pair_axis[j] (0, 1 or 2), j < head_dim / 2: frequency pair j rotates with position axis
  // pair_axis[j]. cos, sin f32 [L, head_dim]: cos[r, j] = cos[r, j + head_dim / 2] =
  // cos(float(positions[r, pair_axis[j]]) * inv_freq[j]), likewise sin (language/mrope.h's
  // mrope_tables, which the CPU computes exactly; the CUDA kernel rounds a double-precision
  // sincos, within an ulp of glibc's cosf and sinf).
  virtual void text_rope_tables(const Tensor& cos, const Tensor& sin, const Tensor& positions,
                                const std::vector<float>& inv_freq,
                                const std::vector<int>& pair_axis) = 0;

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
  // xn = rms_norm(x, norm_w); y = xn . w^T (+ bias, optional); and when act is defined,
  // act = swiglu(y) (y is then the [M, 2I] gate_up, act [M, I]). Every output is written as the
  // unfused sequence writes it. xn must not alias x or y.
  virtual void rms_norm_linear(const Tensor& y, const Tensor& xn, const Tensor& x,
                               const Tensor& norm_w, float eps, const Tensor& w, const Tensor& bias,
                               const Tensor& act) {
    rms_norm(xn, x, norm_w, eps);
    linear(y, xn, w, bias, false);
    if (act.defined()) swiglu(act, y);
  }

  // ---- Training ops --------------------------------------------------------------------------
  // The forwards below save what their backwards need; the backwards run in reverse order (llm.c
  // style). Dtypes: activations and their gradients are in the compute dtype unless a parameter
  // says "f32 or compute"; statistics (mean, rstd, lse, dsum) are f32; parameter gradients (dw,
  // db, dtable, norm-weight gradients) are f32 and always accumulate (+=), so that micro-batches
  // add up and a frozen parameter is skipped by passing an undefined tensor, which also skips its
  // weight-gradient work. "Overwrites dx" means every element of dx is written. Every backward is
  // deterministic: the same inputs give the same bits (no float atomics).

  // dst = src converted to dst's dtype (same element count; f32 <-> compute dtype).
  virtual void convert(const Tensor& dst, const Tensor& src) = 0;

  // dx[M,K] = dy[M,N] . w[N,K] (+ dx when accumulate). dx: f32 or compute. dx must not alias dy.
  virtual void linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w,
                                     bool accumulate) = 0;
  // dw[N,K] += dy[M,N]^T . x[M,K] and, when db is defined, db[N] += sum over rows of dy; dw and db
  // f32. dw may be undefined (db alone).
  virtual void linear_backward_weight(const Tensor& dw, const Tensor& db, const Tensor& dy,
                                      const Tensor& x) = 0;

  // layer_norm that also saves mean[R] and rstd[R] (f32). y must not alias x.
  virtual void layer_norm_train(const Tensor& y, const Tensor& mean, const Tensor& rstd,
                                const Tensor& x, const Tensor& w, const Tensor& b, float eps) = 0;
  // dx[R,C] (f32, optional) += d/dx; dw, db (f32 [C], optional) += d/dw, d/db. dy: f32 or
  // compute.
  virtual void layer_norm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db,
                                   const Tensor& dy, const Tensor& x, const Tensor& mean,
                                   const Tensor& rstd, const Tensor& w) = 0;
  // rms_norm that also saves rstd[R] (f32). y must not alias x.
  virtual void rms_norm_train(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                              float eps) = 0;
  // dx[R,C] (f32, optional) += d/dx; dw (f32 [C], optional) += d/dw. dy: f32 or compute.
  virtual void rms_norm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy,
                                 const Tensor& x, const Tensor& rstd, const Tensor& w) = 0;

  // qkv_norm_rope out of place: out = rope(norm(in)) on the q and k heads, v heads copied; when
  // q_norm_w/k_norm_w are defined, rstd f32 [T, n_q + n_kv] saves each head's 1/rms (and out
  // must not alias in). Without norms rstd is undefined and out may alias in (the backward then
  // needs only the tables).
  virtual void qkv_norm_rope_train(const Tensor& out, const Tensor& rstd, const Tensor& in,
                                   const Tensor& q_norm_w, const Tensor& k_norm_w, float eps,
                                   const Tensor& cos, const Tensor& sin, int n_q_heads,
                                   int n_kv_heads, int head_dim,
                                   bool round_tables_to_compute_dtype) = 0;
  // Overwrites din[T, width] (v heads: dout as is); din may alias dout. dq_norm_w, dk_norm_w
  // (f32 [head_dim], optional) +=. in and rstd are read only when the norms are present.
  virtual void qkv_norm_rope_backward(const Tensor& din, const Tensor& dq_norm_w,
                                      const Tensor& dk_norm_w, const Tensor& dout, const Tensor& in,
                                      const Tensor& rstd, const Tensor& q_norm_w,
                                      const Tensor& k_norm_w, const Tensor& cos, const Tensor& sin,
                                      int n_q_heads, int n_kv_heads, int head_dim,
                                      bool round_tables_to_compute_dtype) = 0;

  // Attention within segments, optionally causal, with GQA (query head h reads kv head
  // h / (n_q / n_kv)): out[T, n_q*head_dim] from qkv[T, (n_q + 2 n_kv)*head_dim]; row i attends
  // to the rows j of its segment [cu[s], cu[s+1]) (j <= i when causal). Saves lse f32 [T, n_q]
  // (natural-log log-sum-exp of the scaled scores). Rows past cu_seqlens[n_segments], and the
  // rows of segments that start at or past real_rows[0] (when real_rows is defined: padding),
  // get zero output and zero lse. Softmax in f32.
  virtual void attention_train(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                               const Tensor& cu_seqlens, int n_segments, int n_q_heads,
                               int n_kv_heads, int head_dim, float scale, bool causal,
                               const Tensor& real_rows) = 0;
  // Overwrites dqkv[T, width] (zero rows where the forward wrote zeros) and the scratch
  // dsum f32 [T, n_q] (rowwise dout . out).
  virtual void attention_backward(const Tensor& dqkv, const Tensor& dsum, const Tensor& dout,
                                  const Tensor& out, const Tensor& lse, const Tensor& qkv,
                                  const Tensor& cu_seqlens, int n_segments, int n_q_heads,
                                  int n_kv_heads, int head_dim, float scale, bool causal,
                                  const Tensor& real_rows) = 0;

  // Overwrite dx; dx may alias dy. x is the activation's input.
  virtual void gelu_tanh_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) = 0;
  virtual void gelu_erf_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) = 0;
  virtual void quick_gelu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) = 0;
  // Overwrites dgate_up[M, 2I] from dy[M, I] and the forward's input gate_up[M, 2I].
  virtual void swiglu_backward(const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up) = 0;

  // dtable[ids[t], :] (f32) += dy[t, :] for every t with ids[t] != skip_id (rows the vision
  // scatter replaced get no embedding gradient; -1 skips none). dy: f32 or compute. Rows with
  // the same id add up in token order.
  virtual void embedding_backward(const Tensor& dtable, const Tensor& dy, const Tensor& ids,
                                  int32_t skip_id) = 0;
  // dst[i, :] = src[index[i], :]; dst and src f32 or compute, converted.
  virtual void gather_rows(const Tensor& dst, const Tensor& src, const Tensor& index) = 0;
  // dtable (f32) [index[s,k], :] += weight[s,k] * dy[s, :] (k < 4): the backward of
  // add_interpolated_rows. dy: f32 or compute. Contributions to one row add up in (s, k) order.
  virtual void add_interpolated_rows_backward(const Tensor& dtable, const Tensor& dy,
                                              const Tensor& index, const Tensor& weight) = 0;

  // lm_head + cross-entropy over labelled rows: logits = x[N,H] . w[V,H]^T in f32, at most
  // chunk_rows rows at a time (never [N, V] at once). loss_sum f32 [1] += sum over rows of
  // (logsumexp(logits) - logits[target]); targets i32 [N] in [0, V), or negative for a row that
  // is ignored (bucket padding: no loss, a zero dx row, no dw). When dx is defined, the
  // backward of grad_scale[0] * loss runs too: dx[N,H] is overwritten and dw (f32 [V,H],
  // optional) +=. grad_scale is f32 [1] on this backend (a per-step value a graph reads).
  // workspace: a tensor (any dtype) of this backend of at least
  // lm_head_loss_workspace_bytes(chunk_rows, H, V) bytes.
  virtual size_t lm_head_loss_workspace_bytes(int64_t chunk_rows, int64_t hidden,
                                              int64_t vocab) const = 0;
  virtual void lm_head_loss(const Tensor& loss_sum, const Tensor& dx, const Tensor& dw,
                            const Tensor& x, const Tensor& w, const Tensor& targets,
                            const Tensor& grad_scale, const Tensor& workspace,
                            int64_t chunk_rows) = 0;

  // The optimizer over many tensors held in flat f32 buffers (params = master weights, grads,
  // exp_avg, exp_avg_sq, all the same length). spans i64 [n, 3]: tensor i is elements
  // [spans[i,0], spans[i,0] + spans[i,1]) of each flat buffer, and starts at element spans[i,2]
  // of `weights` (the compute-dtype working copy the model reads; undefined where the params
  // are that copy). hyper f32 [n, 2]: weight decay and lr scale; a tensor whose lr scale is 0 is
  // frozen: neither its norm, its state nor its step count is touched.
  //
  // grad_norm_clip: grad_stats f32 [2] = {L2 norm over the unfrozen gradients (squares summed
  // in f64 in a fixed order), clip coefficient max_norm / (norm + 1e-6) when that is below 1,
  // else 1 (always 1 when max_norm <= 0)}.
  virtual void grad_norm_clip(const Tensor& grad_stats, const Tensor& grads, const Tensor& spans,
                              const Tensor& hyper, float max_norm) = 0;
  // grad_sum_squares: sums i64 [n] = per span, the f64 sum of squares of its gradient (0 for a
  // frozen span), stored as the double's bits (Iris has no f64 dtype). On the CPU each value is
  // bit for bit the term grad_norm_clip adds for that span, so that a sharded optimizer, which
  // adds the spans of every rank in the same order, finds the unsharded norm.
  virtual void grad_sum_squares(const Tensor& sums, const Tensor& grads, const Tensor& spans,
                                const Tensor& hyper) = 0;
  // One torch.optim.AdamW step (foreach form: decoupled decay p *= 1 - lr * wd, bias-corrected
  // moments) of every unfrozen tensor with gradient grads * grad_stats[1] (grads are only read), lr
  // = lr[0] times the tensor's lr scale, and its step count steps i64 [n] incremented here; then
  // the tensor's slice of `weights` is rewritten from the updated params. A step whose
  // grad_stats[0] is not finite changes nothing (no update, no step count), so that a host that
  // reads the norm only now and then still finds the weights of the last good step. lr f32 [1]
  // and grad_stats live on this backend so that a captured step reads the step's values.
  virtual void adamw_step(const Tensor& params, const Tensor& grads, const Tensor& exp_avg,
                          const Tensor& exp_avg_sq, const Tensor& weights, const Tensor& spans,
                          const Tensor& hyper, const Tensor& steps, const Tensor& lr,
                          const Tensor& grad_stats, float beta1, float beta2, float eps) = 0;
};

// The compute-dtype copy of an f32 tensor that GEMMs read: src converted into `copy`, or src itself
// where the compute dtype is f32 and `copy` aliases it.
inline Tensor in_compute_dtype(Backend& be, const Tensor& src, const Tensor& copy) {
  if (copy.data == src.data) return src;
  be.convert(copy, src);
  return copy;
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
