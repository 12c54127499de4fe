// The op profile (core/op_profile.h): what it records of the ops it runs and the families a
// step's time is reported by (a whole training step through it: training_step_profile_test).
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "core/op_profile.h"

namespace iris {
namespace {

// Every op of the interface has a family: an op added without one would be reported as "other".
TEST(OpProfile, EveryBackendOpHasAFamily) {
  std::vector<std::string> ops;
#define IRIS_BACKEND_OP(name, params, args) ops.push_back(#name);
#define IRIS_BACKEND_OP_WITH_DEFAULT IRIS_BACKEND_OP
#include "core/backend_ops.inc"
#undef IRIS_BACKEND_OP
#undef IRIS_BACKEND_OP_WITH_DEFAULT
  const std::set<std::string> structural = {"begin_side_work", "end_side_work", "join_side_work"};
  EXPECT_GT(ops.size(), 50u);  // the list expanded here
  for (const std::string& op : ops)
    if (!structural.count(op)) EXPECT_NE(op_family(op), "other") << op;
}

// Ops between start and stop are recorded in order, with a GEMM's 2 M N K and the bytes of the
// tensors each names; ops outside are run and not recorded.
TEST(OpProfile, RecordsEachOpsTimeFlopsAndBytes) {
  auto cpu = make_cpu_backend();
  ProfilingBackend prof(*cpu);
  Arena a(prof, size_t(1) << 16);
  const int64_t M = 8, K = 16, N = 4;
  const Tensor x = a.alloc(DType::f32, {M, K}), w = a.alloc(DType::f32, {N, K}),
               y = a.alloc(DType::f32, {M, N}), norm_w = a.alloc(DType::f32, {K}),
               xn = a.alloc(DType::f32, {M, K});
  std::vector<float> ones(static_cast<size_t>(M * K), 1.0f);
  prof.write(x, ones.data(), DType::f32);
  prof.write(w, ones.data(), DType::f32);
  prof.write(norm_w, ones.data(), DType::f32);
  prof.copy(xn, x);  // before the start: not recorded
  prof.start();
  EXPECT_THROW(prof.start(), Error);
  prof.linear(y, x, w, Tensor(), false);
  prof.rms_norm(xn, x, norm_w, 1e-6f);
  const std::vector<OpRecord> r = prof.stop();
  EXPECT_THROW(prof.stop(), Error);
  // The ops ran: y = x . w^T over ones is K everywhere.
  std::vector<float> got(static_cast<size_t>(M * N));
  cpu->read(got.data(), DType::f32, y);
  EXPECT_EQ(got, std::vector<float>(got.size(), static_cast<float>(K)));
  prof.fill_zero(y);  // after the stop: run, not recorded
  cpu->read(got.data(), DType::f32, y);
  EXPECT_EQ(got, std::vector<float>(got.size(), 0.0f));
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].op, "linear");
  EXPECT_EQ(r[0].flops, 2.0 * M * N * K);
  EXPECT_EQ(r[0].bytes, 4.0 * (M * N + M * K + N * K));
  EXPECT_EQ(r[1].op, "rms_norm");
  EXPECT_EQ(r[1].flops, 0.0);
  EXPECT_EQ(r[1].bytes, 4.0 * (2 * M * K + K));
  for (const OpRecord& o : r) EXPECT_GE(o.ms, 0.0);

  const std::vector<OpFamilyTotal> t =
      totals_by_family({{"linear", 2.0, 10, 1}, {"rms_norm", 1.0, 0, 5}, {"linear", 3.0, 20, 2}});
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].family, "GEMM forward");
  EXPECT_EQ(t[0].ms, 5.0);
  EXPECT_EQ(t[0].flops, 30.0);
  EXPECT_EQ(t[0].bytes, 3.0);
  EXPECT_EQ(t[0].calls, 2);
  EXPECT_EQ(t[1].family, "norms and RoPE");
}

// totals_by_op keeps a family's ops apart, the slowest first, each summing its calls; the table
// lists at most max_rows of them under its heading, each with its share of the step.
TEST(OpProfile, TotalsByOpSplitAFamilyIntoItsOps) {
  const std::vector<OpRecord> r = {{"linear", 2.0, 10, 1},
                                   {"rms_norm_linear", 4.0, 8, 2},
                                   {"linear", 3.0, 20, 2},
                                   {"rms_norm", 0.5, 0, 4}};
  const std::vector<OpFamilyTotal> ops = totals_by_op(r);
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[0].family, "linear");
  EXPECT_EQ(ops[0].ms, 5.0);
  EXPECT_EQ(ops[0].flops, 30.0);
  EXPECT_EQ(ops[0].bytes, 3.0);
  EXPECT_EQ(ops[0].calls, 2);
  EXPECT_EQ(ops[1].family, "rms_norm_linear");
  EXPECT_EQ(ops[2].family, "rms_norm");
  const std::vector<OpFamilyTotal> families = totals_by_family(r);
  ASSERT_EQ(families.size(), 2u);
  EXPECT_EQ(families[0].family, "GEMM forward");
  EXPECT_EQ(families[0].ms, ops[0].ms + ops[1].ms);

  const std::vector<std::string> lines = op_totals_table(ops, 2, 19.0, 0, 0);
  ASSERT_EQ(lines.size(), 3u);  // the heading and two ops
  EXPECT_EQ(lines[0].rfind("op", 0), 0u) << lines[0];
  EXPECT_EQ(lines[1].rfind("linear ", 0), 0u) << lines[1];
  EXPECT_NE(lines[1].find("26.3%"), std::string::npos) << lines[1];  // 5 of 19 ms
  EXPECT_EQ(lines[2].rfind("rms_norm_linear ", 0), 0u) << lines[2];
  EXPECT_NE(lines[2].find("21.1%"), std::string::npos) << lines[2];
}

// A training attention op counts the QK^T and PV products of its real segments: 4 L^2 D per head
// and segment of L rows, half of it causal, the backward 2.5 times its forward; segments that
// start at or past real_rows are padding and count nothing.
TEST(OpProfile, AttentionCountsTheProductsOfItsRealSegments) {
  auto cpu = make_cpu_backend();
  ProfilingBackend prof(*cpu);
  Arena a(prof, size_t(1) << 16);
  const int n_q = 2, n_kv = 1, hd = 4;
  const int64_t T = 8, width = (n_q + 2 * n_kv) * hd;
  const Tensor qkv = a.alloc(DType::f32, {T, width}), out = a.alloc(DType::f32, {T, n_q * hd}),
               lse = a.alloc(DType::f32, {T, n_q}), cu = a.alloc(DType::i32, {3}),
               real = a.alloc(DType::i32, {1}), dqkv = a.alloc(DType::f32, {T, width}),
               dsum = a.alloc(DType::f32, {T, n_q}), dout = a.alloc(DType::f32, {T, n_q * hd});
  std::vector<float> v(static_cast<size_t>(T * width), 0.5f);
  prof.write(qkv, v.data(), DType::f32);
  prof.write(dout, v.data(), DType::f32);
  const int32_t bounds[3] = {0, 3, 8}, three = 3;
  prof.write(cu, bounds, DType::i32);
  prof.write(real, &three, DType::i32);
  prof.start();
  prof.attention_train(out, lse, qkv, cu, 2, n_q, n_kv, hd, 0.5f, true, Tensor());
  prof.attention_backward(dqkv, dsum, dout, out, lse, qkv, cu, 2, n_q, n_kv, hd, 0.5f, true,
                          Tensor());
  prof.attention_train(out, lse, qkv, cu, 2, n_q, n_kv, hd, 0.5f, false, real);
  const std::vector<OpRecord> r = prof.stop();
  ASSERT_EQ(r.size(), 3u);
  const double causal = 4.0 * (3 * 3 + 5 * 5) * hd * n_q * 0.5;
  EXPECT_EQ(r[0].flops, causal);
  EXPECT_EQ(r[1].flops, 2.5 * causal);
  EXPECT_EQ(r[2].flops, 4.0 * 3 * 3 * hd * n_q);  // the second segment is padding
  EXPECT_EQ(op_family(r[0].op), "attention forward");
  EXPECT_EQ(op_family(r[1].op), "attention backward");
}

}  // namespace
}  // namespace iris
