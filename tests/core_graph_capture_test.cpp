// The graph API: the recording stand-in's lifecycle rules on every machine, the CUDA
// implementation on a GPU.
#include "core/graph_capture.h"

#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/arena.h"

namespace iris {
namespace {

using Op = RecordingGraphApi::Op;

std::vector<float> read_f32(Backend& be, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  be.read(v.data(), DType::f32, t);
  return v;
}

// a, b, y of n elements in one arena on the backend.
struct AddBuffers {
  AddBuffers(Backend& be, int64_t n) {
    Arena plan;
    for (int i = 0; i < 3; ++i) plan.alloc(be.compute_dtype(), {n});
    arena = Arena(be, plan.used());
    a = arena.alloc(be.compute_dtype(), {n});
    b = arena.alloc(be.compute_dtype(), {n});
    y = arena.alloc(be.compute_dtype(), {n});
  }
  Arena arena;
  Tensor a, b, y;
};

std::vector<Op> ops_of(const std::vector<RecordingGraphApi::Call>& log) {
  std::vector<Op> out;
  for (const auto& c : log) out.push_back(c.op);
  return out;
}

// Graph id -> how often each op was logged for it.
std::map<uint64_t, std::map<Op, int>> counts_by_graph(const RecordingGraphApi& api) {
  std::map<uint64_t, std::map<Op, int>> out;
  for (const auto& c : api.log())
    if (c.graph != 0) ++out[c.graph][c.op];
  return out;
}

TEST(GraphStandIn, CaptureRunsTheBodyOnceAndEveryLaunchReplaysItsOps) {
  auto be = make_cpu_backend();
  AddBuffers buf(*be, 4);
  const std::vector<float> a = {1, 2, 3, 4}, b = {10, 20, 30, 40}, a2 = {5, 6, 7, 8};
  be->write(buf.a, a.data(), DType::f32);
  be->write(buf.b, b.data(), DType::f32);
  RecordingGraphApi api;
  int runs = 0;
  CapturedGraph g(api, *be, "add", [&] {
    ++runs;
    be->add(buf.y, buf.a, buf.b);
  });
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(read_f32(*be, buf.y), (std::vector<float>{11, 22, 33, 44}));
  EXPECT_TRUE(g.valid());
  EXPECT_EQ(g.label(), "add");

  // A replay reads the static inputs as they are at launch time.
  be->write(buf.a, a2.data(), DType::f32);
  g.launch();
  EXPECT_EQ(runs, 1) << "a launch replays the recorded ops, it does not run the body again";
  EXPECT_EQ(read_f32(*be, buf.y), (std::vector<float>{15, 26, 37, 48}));
  EXPECT_EQ(api.launches(), 1u);
  EXPECT_EQ(ops_of(api.log()), (std::vector<Op>{Op::begin_capture, Op::end_capture, Op::instantiate,
                                                Op::upload, Op::launch}));
  for (const auto& c : api.log()) EXPECT_EQ(c.label, "add");
}

// What a GPU graph does with host values: the ones passed at capture are used by every replay.
// The stand-in must show it, or a CPU test would pass code that replays stale values on a GPU.
TEST(GraphStandIn, HostValuesAreFrozenAtCaptureAsOnAGpu) {
  auto be = make_cpu_backend();
  AddBuffers buf(*be, 4);
  const std::vector<float> a = {1, 2, 3, 4}, b = {10, 20, 30, 40};
  be->write(buf.a, a.data(), DType::f32);
  be->write(buf.b, b.data(), DType::f32);
  be->fill_zero(buf.y);
  RecordingGraphApi api;
  int64_t rows = 2;  // a row count the host changes after capture
  float eps = 0.0f;  // a scalar argument (like a learning rate) the host changes after capture
  CapturedGraph g(api, *be, "planted", [&] {
    be->add(buf.y.slice(0, rows), buf.a.slice(0, rows), buf.b.slice(0, rows));
    be->rms_norm(buf.a.slice(0, 1), buf.a.slice(0, 1), buf.b.slice(0, 1), eps);
  });
  EXPECT_EQ(read_f32(*be, buf.y), (std::vector<float>{11, 22, 0, 0}));
  rows = 4;
  eps = 1e6f;
  be->write(buf.a, a.data(), DType::f32);
  g.launch();
  EXPECT_EQ(read_f32(*be, buf.y), (std::vector<float>{11, 22, 0, 0}))
      << "the replay used the row count of the launch, not the one frozen at capture";
  // rms_norm of the single element 1 with eps 0 is 1 * weight 10; with eps 1e6 it would be ~0.
  EXPECT_FLOAT_EQ(read_f32(*be, buf.a)[0], 10.0f) << "the replay used the new eps";
}

TEST(GraphStandIn, HostTrafficInsideACaptureIsRefusedAsOnAGpu) {
  auto be = make_cpu_backend();
  AddBuffers buf(*be, 2);
  RecordingGraphApi api;
  const std::vector<float> host = {1, 2};
  std::vector<float> back(2);
  EXPECT_THROW(
      CapturedGraph(api, *be, "writes", [&] { be->write(buf.a, host.data(), DType::f32); }), Error);
  EXPECT_THROW(CapturedGraph(api, *be, "reads", [&] { be->read(back.data(), DType::f32, buf.a); }),
               Error);
  EXPECT_THROW(CapturedGraph(api, *be, "syncs", [&] { be->synchronize(); }), Error);
  EXPECT_THROW(CapturedGraph(api, *be, "allocates", [&] { be->allocate(16); }), Error);
  EXPECT_FALSE(api.capturing());
  // Outside a capture the same calls work, and a new capture can open.
  be->write(buf.a, host.data(), DType::f32);
  EXPECT_EQ(read_f32(*be, buf.a), host);
  CapturedGraph ok(api, *be, "ok", [&] { be->add(buf.y, buf.a, buf.a); });
  ok.launch();
  EXPECT_EQ(read_f32(*be, buf.y), (std::vector<float>{2, 4}));
}

TEST(GraphStandIn, TimingMarksTimeTheHostAndAreRefusedInsideACapture) {
  auto be = make_cpu_backend();
  be->record_timing_mark(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  be->record_timing_mark(Backend::kTimingMarks - 1);
  // The CPU's ops finish when issued, so its marks are the host clock's.
  EXPECT_GE(be->timing_mark_elapsed_ms(0, Backend::kTimingMarks - 1), 20.0);
  EXPECT_THROW(be->record_timing_mark(Backend::kTimingMarks), Error);
  EXPECT_THROW(be->timing_mark_elapsed_ms(0, 1), Error) << "slot 1 was never recorded";
  RecordingGraphApi api;
  EXPECT_THROW(CapturedGraph(api, *be, "marks", [&] { be->record_timing_mark(1); }), Error);
  EXPECT_FALSE(api.capturing());
  be->record_timing_mark(1);
  EXPECT_GE(be->timing_mark_elapsed_ms(0, 1), 20.0);
}

TEST(GraphStandIn, EveryGraphIsDestroyedExactlyOnceExecBeforeGraph) {
  auto be = make_cpu_backend();
  RecordingGraphApi api;
  auto noop = [] {};
  {
    CapturedGraph g1(api, *be, "g1", noop);
    CapturedGraph g2(api, *be, "g2", noop);
    CapturedGraph g3(api, *be, "g3", noop);
    EXPECT_EQ(api.live_graphs(), 3u);
    g1.reset();
    g1.reset();  // a second reset does nothing
    EXPECT_FALSE(g1.valid());
    EXPECT_THROW(g1.launch(), Error);
    CapturedGraph moved(std::move(g2));  // ownership moves, no destroy
    EXPECT_FALSE(g2.valid());            // NOLINT(bugprone-use-after-move): checking moved-from
    EXPECT_EQ(api.live_graphs(), 2u);
    moved = std::move(g3);  // the assigned-over graph (g2's) is destroyed now
    EXPECT_EQ(api.live_graphs(), 1u);
    CapturedGraph empty;
    empty.reset();  // nothing to destroy
  }
  EXPECT_EQ(api.live_graphs(), 0u);
  EXPECT_TRUE(api.errors().empty());
  const auto counts = counts_by_graph(api);
  ASSERT_EQ(counts.size(), 3u);
  for (const auto& [id, ops] : counts) {
    EXPECT_EQ(ops.at(Op::destroy_exec), 1) << "graph " << id;
    EXPECT_EQ(ops.at(Op::destroy_graph), 1) << "graph " << id;
  }
  // For each graph, the executable graph goes first.
  std::map<uint64_t, bool> exec_gone;
  for (const auto& c : api.log()) {
    if (c.op == Op::destroy_exec) exec_gone[c.graph] = true;
    if (c.op == Op::destroy_graph) EXPECT_TRUE(exec_gone[c.graph]) << c.label;
  }
}

TEST(GraphStandIn, ABodyThatThrowsLeavesNoCaptureOpenAndNoGraph) {
  auto be = make_cpu_backend();
  RecordingGraphApi api;
  EXPECT_THROW(CapturedGraph(api, *be, "bad", [] { throw Error("body failed"); }), Error);
  EXPECT_FALSE(api.capturing());
  EXPECT_EQ(api.live_graphs(), 0u);
  EXPECT_EQ(ops_of(api.log()), (std::vector<Op>{Op::begin_capture, Op::abort_capture}));
  // The backend can capture again.
  CapturedGraph ok(api, *be, "ok", [] {});
  EXPECT_TRUE(ok.valid());
}

TEST(GraphStandIn, RejectsWhatCudaRejects) {
  auto be = make_cpu_backend();
  RecordingGraphApi api;
  CapturedGraph inner(api, *be, "inner", [] {});
  // Captures do not nest on one stream, and a launch cannot be recorded into another graph.
  EXPECT_THROW(CapturedGraph(api, *be, "outer", [&] { CapturedGraph(api, *be, "nested", [] {}); }),
               Error);
  EXPECT_FALSE(api.capturing());
  EXPECT_THROW(CapturedGraph(api, *be, "outer", [&] { inner.launch(); }), Error);
  EXPECT_FALSE(api.capturing());
  EXPECT_THROW(CapturedGraph(api, *be, "empty", nullptr), Error);
  // Another backend (stream) may capture while one is capturing.
  auto other = make_cpu_backend();
  CapturedGraph side(api, *be, "outer", [&] {
    EXPECT_TRUE(api.capturing(be.get()));
    EXPECT_FALSE(api.capturing(other.get()));
    CapturedGraph on_other(api, *other, "other stream", [] {});
  });
  EXPECT_TRUE(side.valid());
  EXPECT_TRUE(api.errors().empty());
}

TEST(GraphStandIn, DestroyOfAnUnknownGraphIsRecordedNotThrown) {
  RecordingGraphApi api;
  api.destroy(reinterpret_cast<GraphExecHandle>(uintptr_t{77}),
              reinterpret_cast<GraphHandle>(uintptr_t{78}));
  ASSERT_EQ(api.errors().size(), 2u);
  EXPECT_NE(api.errors()[0].find("77"), std::string::npos);
  EXPECT_NE(api.errors()[1].find("78"), std::string::npos);
}

TEST(GraphStandIn, CaptureAndRunRunsTheWorkExactlyOnce) {
  auto be = make_cpu_backend();
  AddBuffers buf(*be, 2);
  const std::vector<float> one = {1, 1}, zero = {0, 0};
  be->write(buf.a, one.data(), DType::f32);
  be->write(buf.y, zero.data(), DType::f32);
  RecordingGraphApi api;
  // Accumulating, so running it twice would show.
  CapturedGraph g = capture_and_run(api, *be, "acc", [&] { be->add(buf.y, buf.y, buf.a); });
  EXPECT_EQ(read_f32(*be, buf.y), (std::vector<float>{1, 1}));
  EXPECT_EQ(api.launches(), 0u);
  g.launch();
  EXPECT_EQ(read_f32(*be, buf.y), (std::vector<float>{2, 2}));
}

TEST(GraphStandIn, NotesShareTheLogOrder) {
  auto be = make_cpu_backend();
  RecordingGraphApi api;
  {
    CapturedGraph g(api, *be, "g", [] {});
    api.note("before destroy");
  }
  api.note("after destroy");
  const auto log = api.log();
  ASSERT_GE(log.size(), 3u);
  EXPECT_EQ(log[log.size() - 4].op, Op::note);
  EXPECT_EQ(log[log.size() - 3].op, Op::destroy_exec);
  EXPECT_EQ(log[log.size() - 2].op, Op::destroy_graph);
  EXPECT_EQ(log.back().label, "after destroy");
  EXPECT_EQ(to_string(Op::destroy_graph), "destroy_graph");
}

TEST(GraphApiFactory, PicksTheStandInOffTheGpu) {
  auto be = make_cpu_backend();
  auto api = make_graph_api(*be);
  EXPECT_TRUE(api->capture_runs_work());
  EXPECT_NE(dynamic_cast<RecordingGraphApi*>(api.get()), nullptr);
#ifndef IRIS_WITH_CUDA
  EXPECT_THROW(make_cuda_graph_api(), Error);
#endif
}

// ---- CUDA ----

class CudaGraphs : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
    be_ = make_cuda_backend();
  }
  std::unique_ptr<Backend> be_;
};

TEST_F(CudaGraphs, CaptureRecordsWithoutRunningAndReplaysReadStaticInputs) {
  for (CaptureMode mode : {CaptureMode::thread_local_mode, CaptureMode::relaxed}) {
    auto api = make_cuda_graph_api(mode);
    EXPECT_FALSE(api->capture_runs_work());
    AddBuffers buf(*be_, 3);
    const std::vector<float> a = {1, 2, 3}, b = {4, 8, 16}, a2 = {-1, 0, 0.5f};
    be_->write(buf.a, a.data(), DType::f32);
    be_->write(buf.b, b.data(), DType::f32);
    be_->fill_zero(buf.y);
    CapturedGraph g(*api, *be_, "add", [&] { be_->add(buf.y, buf.a, buf.b); });
    EXPECT_EQ(read_f32(*be_, buf.y), (std::vector<float>{0, 0, 0})) << "capture ran the work";
    g.launch();
    EXPECT_EQ(read_f32(*be_, buf.y), (std::vector<float>{5, 10, 19}));
    be_->write(buf.a, a2.data(), DType::f32);
    g.launch();
    EXPECT_EQ(read_f32(*be_, buf.y), (std::vector<float>{3, 8, 16.5f}));
  }
}

TEST_F(CudaGraphs, CaptureAndRunRunsTheWorkExactlyOnce) {
  auto api = make_cuda_graph_api();
  AddBuffers buf(*be_, 2);
  const std::vector<float> one = {1, 1};
  be_->write(buf.a, one.data(), DType::f32);
  be_->fill_zero(buf.y);
  CapturedGraph g = capture_and_run(*api, *be_, "acc", [&] { be_->add(buf.y, buf.y, buf.a); });
  EXPECT_EQ(read_f32(*be_, buf.y), (std::vector<float>{1, 1}));
  g.launch();
  g.launch();
  EXPECT_EQ(read_f32(*be_, buf.y), (std::vector<float>{3, 3}));
}

TEST_F(CudaGraphs, TimingMarksTimeQueuedWorkAndAreRefusedInsideACapture) {
  auto api = make_cuda_graph_api();
  AddBuffers buf(*be_, int64_t(1) << 22);
  be_->fill_zero(buf.a);
  be_->fill_zero(buf.b);
  be_->record_timing_mark(0);
  be_->record_timing_mark(1);
  for (int i = 0; i < 50; ++i) be_->add(buf.y, buf.a, buf.b);
  be_->record_timing_mark(2);
  // Marks 0 and 1 are back to back; 1 to 2 spans fifty passes over 3 x 8 MiB.
  const double empty = be_->timing_mark_elapsed_ms(0, 1);
  const double work = be_->timing_mark_elapsed_ms(1, 2);
  EXPECT_GE(empty, 0.0);
  EXPECT_GT(work, empty);
  EXPECT_THROW(CapturedGraph(*api, *be_, "marks",
                             [&] {
                               be_->add(buf.y, buf.a, buf.b);
                               be_->record_timing_mark(3);
                             }),
               Error);
  // The refused mark left the stream usable and the slot unrecorded.
  EXPECT_THROW(be_->timing_mark_elapsed_ms(0, 3), Error);
  be_->record_timing_mark(3);
  EXPECT_GE(be_->timing_mark_elapsed_ms(2, 3), 0.0);
}

// logging.host_probe_steps's hold: work queued behind it waits until the host releases it, and
// a hold the host outlasts ends by itself and says so.
TEST_F(CudaGraphs, HoldDeviceKeepsQueuedWorkWaitingUntilReleasedOrItsLimit) {
  AddBuffers buf(*be_, 2);
  const std::vector<float> a = {1, 2}, b = {10, 20};
  be_->write(buf.a, a.data(), DType::f32);
  be_->write(buf.b, b.data(), DType::f32);
  // The add kernel's first launch loads its module, which would wait for the held device.
  be_->add(buf.y, buf.a, buf.a);
  be_->synchronize();
  be_->record_timing_mark(0);
  be_->hold_device(5.0);
  be_->record_timing_mark(1);
  be_->add(buf.y, buf.a, buf.b);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(be_->release_device()) << "released by the host, not by its limit";
  EXPECT_GE(be_->timing_mark_elapsed_ms(0, 1), 90.0) << "the hold did not hold the device";
  EXPECT_EQ(read_f32(*be_, buf.y), (std::vector<float>{11, 22}));

  be_->hold_device(0.02);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE(be_->release_device()) << "a hold past its limit ends by itself";
  EXPECT_THROW(be_->release_device(), Error);
}

TEST_F(CudaGraphs, AHostSyncInsideCaptureFailsAndLeavesTheStreamUsable) {
  auto api = make_cuda_graph_api();
  AddBuffers buf(*be_, 2);
  const std::vector<float> a = {1, 2};
  be_->write(buf.a, a.data(), DType::f32);
  be_->write(buf.b, a.data(), DType::f32);
  std::vector<float> host(2);
  EXPECT_THROW(CapturedGraph(*api, *be_, "syncs",
                             [&] {
                               be_->add(buf.y, buf.a, buf.b);
                               be_->read(host.data(), DType::f32, buf.y);
                             }),
               Error);
  be_->add(buf.y, buf.a, buf.b);
  EXPECT_EQ(read_f32(*be_, buf.y), (std::vector<float>{2, 4}));
  CapturedGraph ok(*api, *be_, "ok", [&] { be_->add(buf.y, buf.y, buf.a); });
  ok.launch();
  EXPECT_EQ(read_f32(*be_, buf.y), (std::vector<float>{3, 6}));
}

TEST_F(CudaGraphs, DestroyingAGraphInFlightNeitherWaitsNorFails) {
  auto api = make_cuda_graph_api();
  AddBuffers buf(*be_, 1 << 20);
  be_->fill_zero(buf.a);
  be_->fill_zero(buf.b);
  {
    CapturedGraph g(*api, *be_, "big", [&] {
      for (int i = 0; i < 16; ++i) be_->add(buf.y, buf.a, buf.b);
    });
    for (int i = 0; i < 8; ++i) g.launch();
  }  // destroyed while the launches may still run
  be_->synchronize();
  EXPECT_EQ(read_f32(*be_, buf.y.slice(0, 4)), (std::vector<float>{0, 0, 0, 0}));
}

// Side work starts after the main work before it and is joined before the main work after the
// join, eagerly and in a captured graph (where it is a parallel branch).
TEST_F(CudaGraphs, SideWorkIsOrderedByItsForkAndJoinEagerAndCaptured) {
  const int64_t n = 1 << 20;  // long enough for the two streams to overlap
  const DType dt = be_->compute_dtype();
  Arena plan;
  for (int i = 0; i < 5; ++i) plan.alloc(dt, {n});
  Arena arena(*be_, plan.used());
  Tensor a = arena.alloc(dt, {n}), b = arena.alloc(dt, {n}), y = arena.alloc(dt, {n}),
         z = arena.alloc(dt, {n}), w = arena.alloc(dt, {n});
  auto body = [&] {
    be_->add(y, a, b);
    be_->begin_side_work();
    be_->add(z, y, a);  // reads the main stream's y
    be_->add(z, z, z);
    be_->end_side_work();
    be_->add(w, a, a);
    for (int i = 0; i < 8; ++i) be_->add(w, w, a);
    be_->join_side_work();
    be_->add(y, z, w);  // reads the side's z
  };
  // y = 2 (2a + b) + 10a = 14a + 2b
  auto expect = [&](float av, float bv) {
    const std::vector<float> got = read_f32(*be_, y.slice(0, 4)),
                             tail = read_f32(*be_, y.slice(n - 4, n));
    const float want = 14 * av + 2 * bv;
    EXPECT_EQ(got, std::vector<float>(4, want));
    EXPECT_EQ(tail, std::vector<float>(4, want));
  };
  const std::vector<float> ones(static_cast<size_t>(n), 1.f), twos(static_cast<size_t>(n), 2.f),
      halves(static_cast<size_t>(n), 0.5f);
  be_->write(a, ones.data(), DType::f32);
  be_->write(b, twos.data(), DType::f32);
  body();
  expect(1.f, 2.f);
  for (CaptureMode mode : {CaptureMode::thread_local_mode, CaptureMode::relaxed}) {
    auto api = make_cuda_graph_api(mode);
    be_->fill_zero(y);
    CapturedGraph g(*api, *be_, "fork and join", body);
    be_->write(a, halves.data(), DType::f32);
    g.launch();
    expect(0.5f, 2.f);
    be_->write(a, ones.data(), DType::f32);
  }
}

TEST_F(CudaGraphs, SideWorkRefusesDecodeOpsAndMisnesting) {
  const DType dt = be_->compute_dtype();
  Arena plan;
  plan.alloc(dt, {2, 8});
  plan.alloc(DType::i32, {2});
  Arena arena(*be_, plan.used());
  Tensor x = arena.alloc(dt, {2, 8}), ids = arena.alloc(DType::i32, {2});
  be_->fill_zero(x);
  EXPECT_THROW(be_->end_side_work(), Error);
  be_->begin_side_work();
  EXPECT_THROW(be_->begin_side_work(), Error);
  EXPECT_THROW(be_->argmax_rows(ids, x), Error);
  EXPECT_THROW(be_->join_side_work(), Error);
  be_->end_side_work();
  be_->join_side_work();
  be_->argmax_rows(ids, x);
  // An op that throws inside a scope leaves later ops on the main stream.
  EXPECT_THROW(
      {
        const SideWorkScope side(*be_, true);
        be_->argmax_rows(ids, x);
      },
      Error);
  be_->argmax_rows(ids, x);
  be_->begin_side_work();
  be_->end_side_work();
  be_->join_side_work();
  be_->synchronize();
}

TEST_F(CudaGraphs, RejectsABackendWithoutAStream) {
  auto api = make_cuda_graph_api();
  auto cpu = make_cpu_backend();
  EXPECT_THROW(CapturedGraph(*api, *cpu, "cpu", [] {}), Error);
}

}  // namespace
}  // namespace iris
