// Where a stretch of work's device time goes, op by op: a Backend that runs every op on another
// backend and, between start() and stop(), times each one on the device (Backend::device_span_ms:
// the op runs alone, after the one before has finished, so its time is its own and the sum is the
// device's busy time, not the overlap of concurrent work). Each record keeps the op's FLOPs where
// it is a GEMM (from its tensors' shapes; a grouped expert GEMM counts every sorted row, its upper
// bound) or a training attention op (from its segments), and the bytes of the tensors it names
// (each counted once: a floor on its traffic).
// Recording synchronises after every op, so profile a step apart from the timed ones, eagerly:
// a captured graph's replay is one launch, not its ops.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "core/backend.h"

namespace iris {

struct OpRecord {
  std::string op;    // the Backend op's name, e.g. "linear_backward_weight"
  double ms = 0;     // its device time
  double flops = 0;  // 0 unless a GEMM
  double bytes = 0;  // of the tensors it names
  std::string part;  // the label set_part() held when it ran
};

// What an op is for, in the families a step's time is reported by: "GEMM forward", "GEMM input
// gradient", "GEMM weight gradient", "MoE experts", "MoE routing", "attention forward",
// "attention backward", "norms and RoPE", "activations", "loss", "optimizer", "copies and
// gathers", "other".
std::string op_family(const std::string& op);

// Per family: its ops' summed time, calls, FLOPs and bytes, largest time first.
struct OpFamilyTotal {
  std::string family;
  double ms = 0, flops = 0, bytes = 0;
  int64_t calls = 0;
};
std::vector<OpFamilyTotal> totals_by_family(const std::vector<OpRecord>& records);
// The same per op name (held in `family`): which op of a family takes its time.
std::vector<OpFamilyTotal> totals_by_op(const std::vector<OpRecord>& records);

// One step through the profile: its families, the ops' own time, and the idle time between them
// (the step's wall time less the ops'), which add up to the profiled step's time.
struct StepProfile {
  std::vector<OpFamilyTotal> families;
  double ops_ms = 0, idle_ms = 0;
  double step_ms() const { return ops_ms + idle_ms; }
};
StepProfile step_profile(const std::vector<OpRecord>& records, double wall_ms);
// The profile as a table, one line per family (ms, share of the step, calls, and its rate
// against its own floor: a GEMM family's FLOPs at gemm_tflops, the others' tensor bytes at
// copy_gbps; a rate of 0 leaves that floor out), then the idle line.
std::vector<std::string> step_profile_table(const StepProfile& p, double gemm_tflops,
                                            double copy_gbps);
// The first max_rows of totals_by_op as a table like step_profile_table's, shares of step_ms.
std::vector<std::string> op_totals_table(const std::vector<OpFamilyTotal>& ops, size_t max_rows,
                                         double step_ms, double gemm_tflops, double copy_gbps);
// {"ops_ms", "idle_ms", "step_ms", "families": [{"family", "ms", "calls", "flops", "bytes"}]}.
nlohmann::json step_profile_json(const StepProfile& p);

class ProfilingBackend final : public Backend {
 public:
  // Runs the ops on `inner`, which must outlive it.
  explicit ProfilingBackend(Backend& inner) : in_(inner) {}

  // Records from here on (refused when already recording).
  void start();
  // Ends the recording and returns its records in the order the ops ran.
  std::vector<OpRecord> stop();
  bool recording() const { return recording_; }
  // Labels the ops recorded from here on (start() resets it to ""): the caller's name for the
  // part of the work they belong to, e.g. a model part a pipeline split balances.
  void set_part(std::string part) { part_ = std::move(part); }

  Device device() const override { return in_.device(); }
  std::string name() const override { return in_.name(); }
  DType compute_dtype() const override { return in_.compute_dtype(); }
  void* allocate(size_t bytes) override { return in_.allocate(bytes); }
  void deallocate(void* ptr) override { in_.deallocate(ptr); }
  void write(const Tensor& dst, const void* host_src, DType src_dtype) override {
    in_.write(dst, host_src, src_dtype);
  }
  int64_t write_finite(const Tensor& dst, const void* host_src, DType src_dtype) override {
    return in_.write_finite(dst, host_src, src_dtype);
  }
  std::vector<int64_t> write_all_finite(const std::vector<HostWrite>& writes) override {
    return in_.write_all_finite(writes);
  }
  void reserve_write_staging(size_t bytes) override { in_.reserve_write_staging(bytes); }
  double take_write_wait_seconds() override { return in_.take_write_wait_seconds(); }
  void hold_device(double limit_seconds) override { in_.hold_device(limit_seconds); }
  bool release_device() override { return in_.release_device(); }
  void read(void* host_dst, DType dst_dtype, const Tensor& src) override {
    in_.read(host_dst, dst_dtype, src);
  }
  void synchronize() override { in_.synchronize(); }
  void* native_stream() override { return in_.native_stream(); }
  void finish_background_startup() override { in_.finish_background_startup(); }
  void* allocate_host(size_t bytes) override { return in_.allocate_host(bytes); }
  void free_host(void* ptr) override { in_.free_host(ptr); }
  void copy_to_host_async(void* host_dst, const Tensor& src) override {
    in_.copy_to_host_async(host_dst, src);
  }
  void copy_from_host_async(const Tensor& dst, const void* host_src) override {
    in_.copy_from_host_async(dst, host_src);
  }
  void mark_copies(int k) override { in_.mark_copies(k); }
  void wait_copies(int k) override { in_.wait_copies(k); }
  void set_gemm_tuning(GemmTuning mode) override { in_.set_gemm_tuning(mode); }
  bool save_gemm_tuning() override { return in_.save_gemm_tuning(); }
  GemmTuningReport gemm_tuning_report() override { return in_.gemm_tuning_report(); }
  size_t device_memory_in_use() override { return in_.device_memory_in_use(); }
  size_t device_memory_total() override { return in_.device_memory_total(); }
  bool begin_op_tape() override { return in_.begin_op_tape(); }
  std::function<void()> end_op_tape() override { return in_.end_op_tape(); }
  void profiler_collect(bool on) override { in_.profiler_collect(on); }
  void record_timing_mark(int slot) override { in_.record_timing_mark(slot); }
  double timing_mark_elapsed_ms(int from, int to) override {
    return in_.timing_mark_elapsed_ms(from, to);
  }
  double device_span_ms(const std::function<void()>& enqueue) override {
    return in_.device_span_ms(enqueue);
  }
  size_t lm_head_loss_workspace_bytes(int64_t chunk_rows, int64_t hidden,
                                      int64_t vocab) const override {
    return in_.lm_head_loss_workspace_bytes(chunk_rows, hidden, vocab);
  }

  // Every op: run on the inner backend, timed while recording.
#define IRIS_BACKEND_OP(name, params, args)                                    \
  void name params override {                                                  \
    if (!recording_ || structural(#name)) {                                    \
      in_.name args;                                                           \
      return;                                                                  \
    }                                                                          \
    record(                                                                    \
        #name, tensors_of args, [&] { in_.name args; }, attention_flops args); \
  }
#define IRIS_BACKEND_OP_WITH_DEFAULT IRIS_BACKEND_OP
#include "core/backend_ops.inc"
#undef IRIS_BACKEND_OP
#undef IRIS_BACKEND_OP_WITH_DEFAULT

 private:
  // The tensors among an op's arguments, in order (undefined ones included: positions matter).
  template <class... A>
  static std::vector<const Tensor*> tensors_of(const A&... args) {
    std::vector<const Tensor*> out;
    (push_tensor(out, args), ...);
    return out;
  }
  template <class A>
  static void push_tensor(std::vector<const Tensor*>& out, const A& a) {
    if constexpr (std::is_same_v<A, Tensor>) out.push_back(&a);
  }
  // The side-work brackets order work rather than do it.
  static bool structural(const char* op);
  // The FLOPs of a training attention op (the QK^T and PV products over its real segments, read
  // from cu_seqlens and real_rows: 4 L^2 D per head and segment of L rows, half that causal; the
  // backward 2.5 times the forward, as FlashAttention counts it); 0 for every other op.
  double attention_flops(const Tensor& out, const Tensor& lse, const Tensor& qkv,
                         const Tensor& cu_seqlens, int n_segments, int n_q_heads, int n_kv_heads,
                         int head_dim, float scale, bool causal, const Tensor& real_rows);
  double attention_flops(const Tensor& dqkv, const Tensor& dsum, const Tensor& dout,
                         const Tensor& out, const Tensor& lse, const Tensor& qkv,
                         const Tensor& cu_seqlens, int n_segments, int n_q_heads, int n_kv_heads,
                         int head_dim, float scale, bool causal, const Tensor& real_rows);
  template <class... A>
  double attention_flops(const A&...) {
    return 0;
  }
  double segment_flops(const Tensor& cu_seqlens, int n_segments, int n_q_heads, int head_dim,
                       bool causal, const Tensor& real_rows);
  void record(const char* op, const std::vector<const Tensor*>& tensors,
              const std::function<void()>& run, double extra_flops);

  Backend& in_;
  bool recording_ = false;
  std::vector<OpRecord> records_;
  std::string part_;
};

}  // namespace iris
