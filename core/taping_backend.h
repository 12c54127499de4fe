// A backend that runs every op on another backend and can also tape them (Backend::begin_op_tape):
// the CPU's half of the recording graph stand-in. make_cpu_backend() returns the CPU backend
// wrapped in it, so that CPU tests see what a captured CUDA graph would do with a host value that
// changes after capture: nothing.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.h"

namespace iris {

class TapingBackend final : public Backend {
 public:
  explicit TapingBackend(std::unique_ptr<Backend> inner);

  Device device() const override { return in_->device(); }
  std::string name() const override { return in_->name(); }
  DType compute_dtype() const override { return in_->compute_dtype(); }
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr) override;
  void write(const Tensor& dst, const void* host_src, DType src_dtype) override;
  void reserve_write_staging(size_t bytes) override { in_->reserve_write_staging(bytes); }
  void hold_device(double limit_seconds) override { in_->hold_device(limit_seconds); }
  bool release_device() override { return in_->release_device(); }
  void read(void* host_dst, DType dst_dtype, const Tensor& src) override;
  void synchronize() override;
  void* native_stream() override { return in_->native_stream(); }
  void finish_background_startup() override { in_->finish_background_startup(); }
  void set_gemm_tuning(GemmTuning mode) override { in_->set_gemm_tuning(mode); }
  bool save_gemm_tuning() override { return in_->save_gemm_tuning(); }
  GemmTuningReport gemm_tuning_report() override { return in_->gemm_tuning_report(); }
  size_t device_memory_in_use() override { return in_->device_memory_in_use(); }
  size_t device_memory_total() override { return in_->device_memory_total(); }
  void profiler_collect(bool on) override { in_->profiler_collect(on); }
  double device_span_ms(const std::function<void()>& enqueue) override {
    return in_->device_span_ms(enqueue);
  }
  // Host work like write() and read(): never part of a tape.
  void record_timing_mark(int slot) override;
  double timing_mark_elapsed_ms(int from, int to) override;
  size_t lm_head_loss_workspace_bytes(int64_t chunk_rows, int64_t hidden,
                                      int64_t vocab) const override {
    return in_->lm_head_loss_workspace_bytes(chunk_rows, hidden, vocab);
  }
  bool begin_op_tape() override;
  std::function<void()> end_op_tape() override;

  // Every op: run now, and kept with its arguments when this thread is taping.
  void copy(const Tensor& dst, const Tensor& src) override {
    tape([=, inner = in_.get()] { inner->copy(dst, src); });
  }
  void fill_zero(const Tensor& dst) override {
    tape([=, inner = in_.get()] { inner->fill_zero(dst); });
  }
  void begin_side_work() override {
    tape([=, inner = in_.get()] { inner->begin_side_work(); });
  }
  void end_side_work() override {
    tape([=, inner = in_.get()] { inner->end_side_work(); });
  }
  void join_side_work() override {
    tape([=, inner = in_.get()] { inner->join_side_work(); });
  }
  void linear(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& bias,
              bool accumulate) override {
    tape([=, inner = in_.get()] { inner->linear(y, x, w, bias, accumulate); });
  }
  void layer_norm(const Tensor& y, const Tensor& x, const Tensor& w, const Tensor& b,
                  float eps) override {
    tape([=, inner = in_.get()] { inner->layer_norm(y, x, w, b, eps); });
  }
  void rms_norm(const Tensor& y, const Tensor& x, const Tensor& w, float eps) override {
    tape([=, inner = in_.get()] { inner->rms_norm(y, x, w, eps); });
  }
  void add(const Tensor& y, const Tensor& a, const Tensor& b) override {
    tape([=, inner = in_.get()] { inner->add(y, a, b); });
  }
  void gelu_tanh(const Tensor& y, const Tensor& x) override {
    tape([=, inner = in_.get()] { inner->gelu_tanh(y, x); });
  }
  void gelu_erf(const Tensor& y, const Tensor& x) override {
    tape([=, inner = in_.get()] { inner->gelu_erf(y, x); });
  }
  void quick_gelu(const Tensor& y, const Tensor& x) override {
    tape([=, inner = in_.get()] { inner->quick_gelu(y, x); });
  }
  void swiglu(const Tensor& y, const Tensor& gate_up) override {
    tape([=, inner = in_.get()] { inner->swiglu(y, gate_up); });
  }
  void qkv_norm_rope(const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w, float eps,
                     const Tensor& cos, const Tensor& sin, int n_q_heads, int n_kv_heads,
                     int head_dim, bool round_tables_to_compute_dtype) override {
    tape([=, inner = in_.get()] {
      inner->qkv_norm_rope(qkv, q_norm_w, k_norm_w, eps, cos, sin, n_q_heads, n_kv_heads, head_dim,
                           round_tables_to_compute_dtype);
    });
  }
  void attention_segments(const Tensor& out, const Tensor& qkv, const Tensor& cu_seqlens,
                          int n_segments, int n_heads, int head_dim, float scale,
                          const Tensor& real_rows) override {
    tape([=, inner = in_.get()] {
      inner->attention_segments(out, qkv, cu_seqlens, n_segments, n_heads, head_dim, scale,
                                real_rows);
    });
  }
  void kv_store(const Tensor& k_cache, const Tensor& v_cache, const Tensor& qkv,
                const Tensor& past_len, int n_q_heads, int n_kv_heads, int head_dim) override {
    tape([=, inner = in_.get()] {
      inner->kv_store(k_cache, v_cache, qkv, past_len, n_q_heads, n_kv_heads, head_dim);
    });
  }
  void qkv_norm_rope_kv_store(const Tensor& qkv, const Tensor& q_norm_w, const Tensor& k_norm_w,
                              float eps, const Tensor& cos, const Tensor& sin, int n_q_heads,
                              int n_kv_heads, int head_dim, bool round_tables_to_compute_dtype,
                              const Tensor& k_cache, const Tensor& v_cache,
                              const Tensor& past_len) override {
    tape([=, inner = in_.get()] {
      inner->qkv_norm_rope_kv_store(qkv, q_norm_w, k_norm_w, eps, cos, sin, n_q_heads, n_kv_heads,
                                    head_dim, round_tables_to_compute_dtype, k_cache, v_cache,
                                    past_len);
    });
  }
  void attention_causal(const Tensor& out, const Tensor& qkv, const Tensor& k_cache,
                        const Tensor& v_cache, const Tensor& past_len, int n_q_heads,
                        int n_kv_heads, int head_dim, float scale) override {
    tape([=, inner = in_.get()] {
      inner->attention_causal(out, qkv, k_cache, v_cache, past_len, n_q_heads, n_kv_heads, head_dim,
                              scale);
    });
  }
  void embedding(const Tensor& y, const Tensor& table, const Tensor& ids) override {
    tape([=, inner = in_.get()] { inner->embedding(y, table, ids); });
  }
  void scatter_rows(const Tensor& dst, const Tensor& src, const Tensor& index,
                    bool accumulate) override {
    tape([=, inner = in_.get()] { inner->scatter_rows(dst, src, index, accumulate); });
  }
  void add_interpolated_rows(const Tensor& y, const Tensor& table, const Tensor& index,
                             const Tensor& weight) override {
    tape([=, inner = in_.get()] { inner->add_interpolated_rows(y, table, index, weight); });
  }
  void argmax_rows(const Tensor& out, const Tensor& x) override {
    tape([=, inner = in_.get()] { inner->argmax_rows(out, x); });
  }
  // inv_freq (and pair_axis) are copied into the tape: host values, frozen at capture as kernel
  // arguments are.
  void text_rope_tables(const Tensor& cos, const Tensor& sin, const Tensor& positions,
                        const std::vector<float>& inv_freq,
                        const std::vector<int>& pair_axis) override {
    tape([=, inner = in_.get()] {
      inner->text_rope_tables(cos, sin, positions, inv_freq, pair_axis);
    });
  }
  void vision_tables(const Tensor& cos, const Tensor& sin, const Tensor& pos_index,
                     const Tensor& pos_weight, const Tensor& cu_seqlens, const Tensor& real_rows,
                     const Tensor& grids, const std::vector<float>& inv_freq, int merge_size,
                     int grid_side, const Tensor& window_cu, int window_units) override {
    tape([=, inner = in_.get()] {
      inner->vision_tables(cos, sin, pos_index, pos_weight, cu_seqlens, real_rows, grids, inv_freq,
                           merge_size, grid_side, window_cu, window_units);
    });
  }
  void linear_gelu_tanh(const Tensor& y, const Tensor& x, const Tensor& w,
                        const Tensor& bias) override {
    tape([=, inner = in_.get()] { inner->linear_gelu_tanh(y, x, w, bias); });
  }
  void rms_norm_linear(const Tensor& y, const Tensor& xn, const Tensor& x, const Tensor& norm_w,
                       float eps, const Tensor& w, const Tensor& bias, const Tensor& act) override {
    tape([=, inner = in_.get()] { inner->rms_norm_linear(y, xn, x, norm_w, eps, w, bias, act); });
  }
  void convert(const Tensor& dst, const Tensor& src) override {
    tape([=, inner = in_.get()] { inner->convert(dst, src); });
  }
  void linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w,
                             bool accumulate) override {
    tape([=, inner = in_.get()] { inner->linear_backward_input(dx, dy, w, accumulate); });
  }
  void linear_backward_weight(const Tensor& dw, const Tensor& db, const Tensor& dy,
                              const Tensor& x) override {
    tape([=, inner = in_.get()] { inner->linear_backward_weight(dw, db, dy, x); });
  }
  void layer_norm_train(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                        const Tensor& w, const Tensor& b, float eps) override {
    tape([=, inner = in_.get()] { inner->layer_norm_train(y, mean, rstd, x, w, b, eps); });
  }
  void layer_norm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                           const Tensor& x, const Tensor& mean, const Tensor& rstd,
                           const Tensor& w) override {
    tape([=, inner = in_.get()] { inner->layer_norm_backward(dx, dw, db, dy, x, mean, rstd, w); });
  }
  void rms_norm_train(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w,
                      float eps) override {
    tape([=, inner = in_.get()] { inner->rms_norm_train(y, rstd, x, w, eps); });
  }
  void rms_norm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x,
                         const Tensor& rstd, const Tensor& w) override {
    tape([=, inner = in_.get()] { inner->rms_norm_backward(dx, dw, dy, x, rstd, w); });
  }
  void qkv_norm_rope_train(const Tensor& out, const Tensor& rstd, const Tensor& in,
                           const Tensor& q_norm_w, const Tensor& k_norm_w, float eps,
                           const Tensor& cos, const Tensor& sin, int n_q_heads, int n_kv_heads,
                           int head_dim, bool round_tables_to_compute_dtype) override {
    tape([=, inner = in_.get()] {
      inner->qkv_norm_rope_train(out, rstd, in, q_norm_w, k_norm_w, eps, cos, sin, n_q_heads,
                                 n_kv_heads, head_dim, round_tables_to_compute_dtype);
    });
  }
  void qkv_norm_rope_backward(const Tensor& din, const Tensor& dq_norm_w, const Tensor& dk_norm_w,
                              const Tensor& dout, const Tensor& in, const Tensor& rstd,
                              const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& cos,
                              const Tensor& sin, int n_q_heads, int n_kv_heads, int head_dim,
                              bool round_tables_to_compute_dtype) override {
    tape([=, inner = in_.get()] {
      inner->qkv_norm_rope_backward(din, dq_norm_w, dk_norm_w, dout, in, rstd, q_norm_w, k_norm_w,
                                    cos, sin, n_q_heads, n_kv_heads, head_dim,
                                    round_tables_to_compute_dtype);
    });
  }
  void attention_train(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                       const Tensor& cu_seqlens, int n_segments, int n_q_heads, int n_kv_heads,
                       int head_dim, float scale, bool causal, const Tensor& real_rows) override {
    tape([=, inner = in_.get()] {
      inner->attention_train(out, lse, qkv, cu_seqlens, n_segments, n_q_heads, n_kv_heads, head_dim,
                             scale, causal, real_rows);
    });
  }
  void attention_backward(const Tensor& dqkv, const Tensor& dsum, const Tensor& dout,
                          const Tensor& out, const Tensor& lse, const Tensor& qkv,
                          const Tensor& cu_seqlens, int n_segments, int n_q_heads, int n_kv_heads,
                          int head_dim, float scale, bool causal,
                          const Tensor& real_rows) override {
    tape([=, inner = in_.get()] {
      inner->attention_backward(dqkv, dsum, dout, out, lse, qkv, cu_seqlens, n_segments, n_q_heads,
                                n_kv_heads, head_dim, scale, causal, real_rows);
    });
  }
  void gelu_tanh_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) override {
    tape([=, inner = in_.get()] { inner->gelu_tanh_backward(dx, dy, x); });
  }
  void gelu_erf_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) override {
    tape([=, inner = in_.get()] { inner->gelu_erf_backward(dx, dy, x); });
  }
  void quick_gelu_backward(const Tensor& dx, const Tensor& dy, const Tensor& x) override {
    tape([=, inner = in_.get()] { inner->quick_gelu_backward(dx, dy, x); });
  }
  void swiglu_backward(const Tensor& dgate_up, const Tensor& dy, const Tensor& gate_up) override {
    tape([=, inner = in_.get()] { inner->swiglu_backward(dgate_up, dy, gate_up); });
  }
  void embedding_backward(const Tensor& dtable, const Tensor& dy, const Tensor& ids,
                          int32_t skip_id) override {
    tape([=, inner = in_.get()] { inner->embedding_backward(dtable, dy, ids, skip_id); });
  }
  void gather_rows(const Tensor& dst, const Tensor& src, const Tensor& index) override {
    tape([=, inner = in_.get()] { inner->gather_rows(dst, src, index); });
  }
  void add_interpolated_rows_backward(const Tensor& dtable, const Tensor& dy, const Tensor& index,
                                      const Tensor& weight) override {
    tape([=, inner = in_.get()] {
      inner->add_interpolated_rows_backward(dtable, dy, index, weight);
    });
  }
  void lm_head_loss(const Tensor& loss_sum, const Tensor& dx, const Tensor& dw, const Tensor& x,
                    const Tensor& w, const Tensor& targets, const Tensor& grad_scale,
                    const Tensor& workspace, int64_t chunk_rows) override {
    tape([=, inner = in_.get()] {
      inner->lm_head_loss(loss_sum, dx, dw, x, w, targets, grad_scale, workspace, chunk_rows);
    });
  }
  void grad_norm_clip(const Tensor& grad_stats, const Tensor& grads, const Tensor& spans,
                      const Tensor& hyper, float max_norm) override {
    tape([=, inner = in_.get()] {
      inner->grad_norm_clip(grad_stats, grads, spans, hyper, max_norm);
    });
  }
  void grad_sum_squares(const Tensor& sums, const Tensor& grads, const Tensor& spans,
                        const Tensor& hyper) override {
    tape([=, inner = in_.get()] { inner->grad_sum_squares(sums, grads, spans, hyper); });
  }
  void adamw_step(const Tensor& params, const Tensor& grads, const Tensor& exp_avg,
                  const Tensor& exp_avg_sq, const Tensor& weights, const Tensor& spans,
                  const Tensor& hyper, const Tensor& steps, const Tensor& lr,
                  const Tensor& grad_stats, float beta1, float beta2, float eps) override {
    tape([=, inner = in_.get()] {
      inner->adamw_step(params, grads, exp_avg, exp_avg_sq, weights, spans, hyper, steps, lr,
                        grad_stats, beta1, beta2, eps);
    });
  }

 private:
  template <class Op>
  void tape(Op&& op) {
    op();
    if (taping_ && std::this_thread::get_id() == taping_thread_) ops_.emplace_back(std::move(op));
  }
  // Host traffic cannot be part of a graph: refused while this thread tapes.
  void refuse_while_taping(const char* what) const;

  std::unique_ptr<Backend> in_;
  bool taping_ = false;
  std::thread::id taping_thread_;
  std::vector<std::function<void()>> ops_;
};

}  // namespace iris
