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
  void* allocate_host(size_t bytes) override { return in_->allocate_host(bytes); }
  void free_host(void* ptr) override { in_->free_host(ptr); }
  void copy_to_host_async(void* host_dst, const Tensor& src) override {
    in_->copy_to_host_async(host_dst, src);
  }
  void copy_from_host_async(const Tensor& dst, const void* host_src) override {
    in_->copy_from_host_async(dst, host_src);
  }
  void mark_copies(int k) override { in_->mark_copies(k); }
  void wait_copies(int k) override { in_->wait_copies(k); }
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

  // Every op: run now, and kept with its arguments when this thread is taping. Host values among
  // them (vectors included) are copied into the tape: frozen at capture, as kernel arguments are.
#define IRIS_BACKEND_OP(name, params, args)             \
  void name params override {                           \
    tape([=, inner = in_.get()] { inner->name args; }); \
  }
#define IRIS_BACKEND_OP_WITH_DEFAULT IRIS_BACKEND_OP
#include "core/backend_ops.inc"
#undef IRIS_BACKEND_OP
#undef IRIS_BACKEND_OP_WITH_DEFAULT

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
