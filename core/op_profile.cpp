#include "core/op_profile.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <string_view>

#include "core/error.h"

namespace iris {
namespace {

double rows(const Tensor* t) {
  return t->defined() ? static_cast<double>(t->rows()) : 0.0;
}
double cols(const Tensor* t) {
  return t->defined() ? static_cast<double>(t->cols()) : 0.0;
}

// 2 M N K of the GEMM ops, from the tensors' shapes (the ops' signatures, core/backend_ops.inc);
// 0 for the rest. t: the op's tensor arguments in order.
double gemm_flops(std::string_view op, const std::vector<const Tensor*>& t) {
  if (op == "linear" || op == "linear_gelu_tanh")  // y [M, N], x [M, K]
    return 2 * rows(t[1]) * cols(t[1]) * cols(t[0]);
  if (op == "rms_norm_linear")  // y [M, N], xn, x [M, K]
    return 2 * rows(t[2]) * cols(t[2]) * cols(t[0]);
  if (op == "linear_backward_input")  // dx [M, K], dy [M, N]
    return 2 * rows(t[1]) * cols(t[1]) * cols(t[0]);
  if (op == "linear_backward_weight")  // dw, db, dy [M, N], x [M, K]
    return t[0]->defined() ? 2 * rows(t[2]) * cols(t[2]) * cols(t[3]) : 0.0;
  if (op == "moe_grouped_linear")  // y [R, N], x [R, K]
    return 2 * rows(t[1]) * cols(t[1]) * cols(t[0]);
  if (op == "moe_grouped_linear_backward")  // dx [R, K], dw, dy [R, N]: dx, and dw when defined
    return 2 * rows(t[2]) * cols(t[2]) * cols(t[0]) * (t[1]->defined() ? 2 : 1);
  if (op == "lm_head_loss") {  // loss, dx, dw, x [M, H], w [V, H]: logits, dx, dw
    const double pass = 2 * rows(t[3]) * cols(t[3]) * rows(t[4]);
    return pass * (1 + (t[1]->defined() ? 1 : 0) + (t[2]->defined() ? 1 : 0));
  }
  return 0;
}

}  // namespace

std::string op_family(const std::string& op) {
  static const std::map<std::string, std::string, std::less<>> kFamilies = {
      {"linear", "GEMM forward"},
      {"linear_gelu_tanh", "GEMM forward"},
      {"rms_norm_linear", "GEMM forward"},
      {"linear_backward_input", "GEMM input gradient"},
      {"linear_backward_weight", "GEMM weight gradient"},
      {"moe_grouped_linear", "MoE experts"},
      {"moe_grouped_linear_backward", "MoE experts"},
      {"moe_route", "MoE routing"},
      {"moe_capacity_drop", "MoE routing"},
      {"moe_dispatch", "MoE routing"},
      {"moe_combine", "MoE routing"},
      {"moe_combine_backward", "MoE routing"},
      {"moe_dispatch_backward", "MoE routing"},
      {"moe_route_backward", "MoE routing"},
      {"moe_route_stats", "MoE routing"},
      {"moe_aux_loss", "MoE routing"},
      {"attention_segments", "attention forward"},
      {"attention_causal", "attention forward"},
      {"attention_train", "attention forward"},
      {"attention_backward", "attention backward"},
      {"kv_store", "attention forward"},
      {"layer_norm", "norms and RoPE"},
      {"rms_norm", "norms and RoPE"},
      {"layer_norm_train", "norms and RoPE"},
      {"rms_norm_train", "norms and RoPE"},
      {"layer_norm_backward", "norms and RoPE"},
      {"rms_norm_backward", "norms and RoPE"},
      {"qkv_norm_rope", "norms and RoPE"},
      {"qkv_norm_rope_kv_store", "norms and RoPE"},
      {"qkv_norm_rope_train", "norms and RoPE"},
      {"qkv_norm_rope_backward", "norms and RoPE"},
      {"vision_tables", "norms and RoPE"},
      {"text_rope_tables", "norms and RoPE"},
      {"image_patches", "copies and gathers"},
      {"add", "activations"},
      {"add_column_block", "copies and gathers"},
      {"dropout", "activations"},
      {"gelu_tanh", "activations"},
      {"gelu_erf", "activations"},
      {"quick_gelu", "activations"},
      {"swiglu", "activations"},
      {"gelu_tanh_backward", "activations"},
      {"gelu_erf_backward", "activations"},
      {"quick_gelu_backward", "activations"},
      {"swiglu_backward", "activations"},
      {"lm_head_loss", "loss"},
      {"argmax_rows", "loss"},
      {"grad_norm_clip", "optimizer"},
      {"grad_sum_squares", "optimizer"},
      {"adamw_step", "optimizer"},
      {"copy", "copies and gathers"},
      {"fill_zero", "copies and gathers"},
      {"convert", "copies and gathers"},
      {"embedding", "copies and gathers"},
      {"embedding_backward", "copies and gathers"},
      {"scatter_rows", "copies and gathers"},
      {"gather_rows", "copies and gathers"},
      {"add_interpolated_rows", "copies and gathers"},
      {"add_interpolated_rows_backward", "copies and gathers"},
  };
  const auto it = kFamilies.find(op);
  return it == kFamilies.end() ? "other" : it->second;
}

namespace {

template <class Key>
std::vector<OpFamilyTotal> totals_by(const std::vector<OpRecord>& records, Key key) {
  std::vector<OpFamilyTotal> out;
  for (const OpRecord& r : records) {
    const std::string name = key(r);
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const OpFamilyTotal& f) { return f.family == name; });
    if (it == out.end()) it = out.insert(out.end(), OpFamilyTotal{name});
    it->ms += r.ms;
    it->flops += r.flops;
    it->bytes += r.bytes;
    ++it->calls;
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const OpFamilyTotal& a, const OpFamilyTotal& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace

std::vector<OpFamilyTotal> totals_by_family(const std::vector<OpRecord>& records) {
  return totals_by(records, [](const OpRecord& r) { return op_family(r.op); });
}

std::vector<OpFamilyTotal> totals_by_op(const std::vector<OpRecord>& records) {
  return totals_by(records, [](const OpRecord& r) { return r.op; });
}

StepProfile step_profile(const std::vector<OpRecord>& records, double wall_ms) {
  StepProfile p;
  p.families = totals_by_family(records);
  for (const OpFamilyTotal& f : p.families) p.ops_ms += f.ms;
  p.idle_ms = std::max(0.0, wall_ms - p.ops_ms);
  return p;
}

namespace {

std::string rate_text(const OpFamilyTotal& f, double gemm_tflops, double copy_gbps) {
  const double s = f.ms / 1e3;
  char rate[64] = "";
  if (f.flops > 0 && s > 0) {
    const double t = f.flops / s / 1e12;
    if (gemm_tflops > 0)
      std::snprintf(rate, sizeof(rate), "%.1f TFLOP/s (%.0f%%)", t, 100 * t / gemm_tflops);
    else
      std::snprintf(rate, sizeof(rate), "%.1f TFLOP/s", t);
  } else if (f.bytes > 0 && s > 0) {
    const double g = f.bytes / s / 1e9;
    if (copy_gbps > 0)
      std::snprintf(rate, sizeof(rate), "%.0f GB/s (%.0f%%)", g, 100 * g / copy_gbps);
    else
      std::snprintf(rate, sizeof(rate), "%.0f GB/s", g);
  }
  return rate;
}

std::vector<std::string> totals_table(const char* heading, const std::vector<OpFamilyTotal>& rows,
                                      size_t max_rows, double total_ms, double gemm_tflops,
                                      double copy_gbps) {
  std::vector<std::string> lines;
  char line[192];
  const double total = std::max(total_ms, 1e-12);
  std::snprintf(line, sizeof(line), "%-30s %10s %7s %8s %26s", heading, "ms", "share", "calls",
                "rate (of its floor)");
  lines.emplace_back(line);
  for (size_t i = 0; i < rows.size() && i < max_rows; ++i) {
    const OpFamilyTotal& f = rows[i];
    std::snprintf(line, sizeof(line), "%-30s %10.2f %6.1f%% %8lld %26s", f.family.c_str(), f.ms,
                  100 * f.ms / total, static_cast<long long>(f.calls),
                  rate_text(f, gemm_tflops, copy_gbps).c_str());
    lines.emplace_back(line);
  }
  return lines;
}

}  // namespace

std::vector<std::string> step_profile_table(const StepProfile& p, double gemm_tflops,
                                            double copy_gbps) {
  std::vector<std::string> lines =
      totals_table("family", p.families, p.families.size(), p.step_ms(), gemm_tflops, copy_gbps);
  char line[192];
  std::snprintf(line, sizeof(line), "%-30s %10.2f %6.1f%%", "idle", p.idle_ms,
                100 * p.idle_ms / std::max(p.step_ms(), 1e-12));
  lines.emplace_back(line);
  return lines;
}

std::vector<std::string> op_totals_table(const std::vector<OpFamilyTotal>& ops, size_t max_rows,
                                         double step_ms, double gemm_tflops, double copy_gbps) {
  return totals_table("op", ops, max_rows, step_ms, gemm_tflops, copy_gbps);
}

nlohmann::json step_profile_json(const StepProfile& p) {
  nlohmann::json rows = nlohmann::json::array();
  for (const OpFamilyTotal& f : p.families)
    rows.push_back({{"family", f.family},
                    {"ms", f.ms},
                    {"calls", f.calls},
                    {"flops", f.flops},
                    {"bytes", f.bytes}});
  return {
      {"ops_ms", p.ops_ms}, {"idle_ms", p.idle_ms}, {"step_ms", p.step_ms()}, {"families", rows}};
}

void ProfilingBackend::start() {
  IRIS_CHECK(!recording_, "the op profile is already recording");
  // The work queued before the start is not the profiled stretch's.
  in_.synchronize();
  records_.clear();
  part_.clear();
  recording_ = true;
}

std::vector<OpRecord> ProfilingBackend::stop() {
  IRIS_CHECK(recording_, "the op profile is not recording");
  recording_ = false;
  return std::move(records_);
}

bool ProfilingBackend::structural(const char* op) {
  const std::string_view o = op;
  return o == "begin_side_work" || o == "end_side_work" || o == "join_side_work";
}

double ProfilingBackend::segment_flops(const Tensor& cu_seqlens, int n_segments, int n_q_heads,
                                       int head_dim, bool causal, const Tensor& real_rows) {
  if (n_segments <= 0) return 0;
  // Small device values, read while the profile synchronises every op anyway.
  std::vector<int32_t> cu(static_cast<size_t>(n_segments) + 1);
  in_.read(cu.data(), DType::i32, cu_seqlens.slice(0, n_segments + 1));
  int32_t real = std::numeric_limits<int32_t>::max();
  if (real_rows.defined()) in_.read(&real, DType::i32, real_rows);
  double flops = 0;
  for (int s = 0; s < n_segments; ++s) {
    if (cu[static_cast<size_t>(s)] >= real) continue;  // padding: written as zeros
    const double L = cu[static_cast<size_t>(s) + 1] - cu[static_cast<size_t>(s)];
    flops += 4.0 * L * L * head_dim * n_q_heads * (causal ? 0.5 : 1.0);
  }
  return flops;
}

double ProfilingBackend::attention_flops(const Tensor&, const Tensor&, const Tensor&,
                                         const Tensor& cu_seqlens, int n_segments, int n_q_heads,
                                         int, int head_dim, float, bool causal,
                                         const Tensor& real_rows) {
  return segment_flops(cu_seqlens, n_segments, n_q_heads, head_dim, causal, real_rows);
}

double ProfilingBackend::attention_flops(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                         const Tensor&, const Tensor&, const Tensor& cu_seqlens,
                                         int n_segments, int n_q_heads, int, int head_dim, float,
                                         bool causal, const Tensor& real_rows) {
  return 2.5 * segment_flops(cu_seqlens, n_segments, n_q_heads, head_dim, causal, real_rows);
}

void ProfilingBackend::record(const char* op, const std::vector<const Tensor*>& tensors,
                              const std::function<void()>& run, double extra_flops) {
  OpRecord r;
  r.op = op;
  r.flops = gemm_flops(r.op, tensors) + extra_flops;
  for (const Tensor* t : tensors)
    if (t->defined()) r.bytes += static_cast<double>(t->nbytes());
  r.ms = in_.device_span_ms(run);
  r.part = part_;
  records_.push_back(std::move(r));
}

}  // namespace iris
