// The NCCL path on one GPU: a world of one through the NCCL communicator and the bucketed
// fixed-order gradient reduction leaves every gradient bit where it was, and training through it
// gives the losses of training without it; a grouped exchange with itself moves exactly; the
// optimizer's pipeline-stage and sharded modes over a communicator of one, with the bf16 working
// copy, update the weights bit for bit as the plain AdamW does; the stall watchdog ends a process
// whose GPU stops finishing steps. Skips without a GPU or without NCCL.
#include <gtest/gtest.h>

#ifdef IRIS_WITH_CUDA
#include <cuda_runtime.h>
#endif

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "bridge/hf_weights.h"
#include "core/backend.h"
#include "parallel/communicator.h"
#include "parallel/grad_reducer.h"
#include "training/data_parallel.h"
#include "training/optimizer.h"
#include "training_test_util.h"

namespace iris {
namespace {

std::vector<float> read_all(Backend& be, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  be.read(v.data(), DType::f32, t);
  return v;
}

// Three steps of two micro-batches each; the losses of every step.
std::vector<double> train(bool through_nccl, const TrainSample& sample) {
  auto cuda = make_cuda_backend(0);
  cuda->set_gemm_autotune(false);
  const ModelConfig cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  auto working = load_weights(*cuda, cfg, test::fixture_dir());
  auto master = allocate_weights(*cuda, cfg, DType::f32);
  for (size_t i = 0; i < master->bindings.size(); ++i)
    cuda->convert(master->bindings[i].tensor(), working->bindings[i].tensor());
  TrainableQwen3VL model(*cuda, cfg, *working, TrainLimits{});
  AdamW opt(*cuda, cfg, master.get(), model.grads(), AdamWConfig{}, working.get());
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<GradReducer> reducer;
  const Tensor flat(model.grads().arena.base(), DType::f32, Device::cuda,
                    {static_cast<int64_t>(model.grads().arena.capacity() / sizeof(float))});
  if (through_nccl) {
    comm = make_nccl_communicator(*cuda, nullptr, 0, 1);
    EXPECT_EQ(comm->size(), 1);
    // Small buckets: many calls, the last one short.
    reducer = std::make_unique<GradReducer>(*cuda, *comm, flat, 100003);
    EXPECT_GT(reducer->buckets(), 1);
  }
  const float scale = 1.0f / static_cast<float>(2 * labelled_positions(sample.labels));
  std::vector<double> losses;
  for (int step = 0; step < 3; ++step) {
    model.zero_grads();
    for (int m = 0; m < 2; ++m) model.queue_forward_backward({&sample}, scale);
    if (reducer) {
      const std::vector<float> before = read_all(*cuda, flat);
      reducer->reduce();
      const std::vector<float> after = read_all(*cuda, flat);
      EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)), 0)
          << "step " << step;
    }
    opt.step(1e-3f);
    losses.push_back(model.take_loss_sum());
  }
  return losses;
}

TEST(NcclWorldOfOne, TrainsToTheLossesOfTheStepWithoutIt) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  test::Golden golden;
  const TrainSample sample = test::golden_sample(golden);
  const std::vector<double> plain = train(false, sample), nccl = train(true, sample);
  ASSERT_EQ(plain.size(), nccl.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_EQ(plain[i], nccl[i]) << "step " << i + 1;
  EXPECT_NE(plain.front(), plain.back());  // the steps trained
}

// The reduction started during the backward (each bucket queued on NCCL's stream as soon as the
// model names its tensors, the backend computing on) leaves the gradients of the plain backward
// bit for bit, step after step: a bucket launched before its last write, or a next step's
// zero_grads not waiting for the reduction, would show in the bits.
TEST(NcclWorldOfOne, ReductionOverlappedWithTheBackwardGivesThePlainGradients) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  test::Golden golden;
  const TrainSample sample = test::golden_sample(golden);
  auto cuda = make_cuda_backend(0);
  cuda->set_gemm_autotune(false);
  const ModelConfig cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  auto working = load_weights(*cuda, cfg, test::fixture_dir());
  TrainableQwen3VL plain(*cuda, cfg, *working, TrainLimits{});
  TrainableQwen3VL overlapped(*cuda, cfg, *working, TrainLimits{});
  auto comm = make_nccl_communicator(*cuda, nullptr, 0, 1);
  const Tensor flat(overlapped.grads().arena.base(), DType::f32, Device::cuda,
                    {static_cast<int64_t>(overlapped.grads().arena.capacity() / sizeof(float))});
  GradReducer reducer(*cuda, *comm, flat, 100003, {}, gradient_tensors(overlapped.grads()));
  ASSERT_GT(reducer.buckets(), 2);
  overlapped.on_gradients_final([&](const Tensor& g) { reducer.gradient_final(g); });
  const float scale = 1.0f / static_cast<float>(2 * labelled_positions(sample.labels));
  const std::vector<std::vector<const TrainSample*>> step = {{&sample}, {&sample}};
  for (int s = 0; s < 3; ++s) {
    SCOPED_TRACE(s);
    plain.zero_grads();
    overlapped.zero_grads();
    plain.queue_step(step, scale);
    overlapped.queue_step(step, scale);
    EXPECT_GT(reducer.launched(), 0);  // before reduce(): overlapped
    reducer.reduce();
    EXPECT_EQ(reducer.launched_early(), reducer.buckets());  // the sample has an image
    const auto want = test::all_grads(plain), got = test::all_grads(overlapped);
    ASSERT_EQ(want.size(), got.size());
    for (size_t k = 0; k < want.size(); ++k)
      ASSERT_EQ(std::memcmp(want[k].data(), got[k].data(), want[k].size() * sizeof(float)), 0)
          << overlapped.grads().bindings[k].hf_name;
    EXPECT_EQ(plain.take_loss_sum(), overlapped.take_loss_sum());
  }
}

TEST(NcclWorldOfOne, CollectivesMoveExactly) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  auto cuda = make_cuda_backend(0);
  auto comm = make_nccl_communicator(*cuda, nullptr, 0, 1);
  const int64_t n = 1001;
  std::vector<float> host(n);
  for (int64_t i = 0; i < n; ++i) host[static_cast<size_t>(i)] = 1.0f / static_cast<float>(i + 3);
  void* mem = cuda->allocate(3 * n * sizeof(float));
  const Tensor a(mem, DType::f32, Device::cuda, {n});
  const Tensor b(static_cast<float*>(mem) + n, DType::f32, Device::cuda, {n});
  const Tensor scratch(static_cast<float*>(mem) + 2 * n, DType::f32, Device::cuda, {n});
  cuda->write(a, host.data(), DType::f32);
  comm->all_gather(b, a);
  EXPECT_EQ(read_all(*cuda, b), host);
  cuda->fill_zero(b);
  comm->all_to_all(b, a);
  EXPECT_EQ(read_all(*cuda, b), host);
  comm->broadcast(a, 0);
  comm->all_reduce(a, scratch);
  EXPECT_EQ(read_all(*cuda, a), host);
  std::vector<float> cpu_v(4);
  EXPECT_THROW(comm->broadcast(Tensor(cpu_v.data(), DType::f32, Device::cpu, {4}), 0), Error);
  cuda->deallocate(mem);
}

TEST(NcclWorldOfOne, GroupedExchangeWithItselfMovesExactly) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  auto cuda = make_cuda_backend(0);
  auto comm = make_nccl_communicator(*cuda, nullptr, 0, 1);
  const int64_t n = 4099, m = 5;
  std::vector<float> host(n + m);
  for (size_t i = 0; i < host.size(); ++i) host[i] = 1.0f / static_cast<float>(i + 7);
  void* mem = cuda->allocate(2 * (n + m) * sizeof(float));
  const Tensor src(mem, DType::f32, Device::cuda, {n + m});
  const Tensor dst(static_cast<float*>(mem) + n + m, DType::f32, Device::cuda, {n + m});
  cuda->write(src, host.data(), DType::f32);
  cuda->fill_zero(dst);
  // Two messages to the same peer in one group land in the order posted.
  using T = Communicator::Transfer;
  const T sends[] = {{src.slice(0, n), 0}, {src.slice(n, n + m), 0}};
  const T recvs[] = {{dst.slice(0, n), 0}, {dst.slice(n, n + m), 0}};
  comm->exchange(sends, recvs, "the test exchange");
  EXPECT_EQ(read_all(*cuda, dst), host);
  const T bad[] = {{src, 1}};
  EXPECT_THROW(comm->exchange(bad, {}, "the bad exchange"), Error);
  cuda->deallocate(mem);
}

// The optimizer's modes with the bf16 working copy on one GPU: the plain step, a pipeline of one
// stage that holds every tensor, and a shard of one, from the same weights and gradients.
TEST(NcclWorldOfOne, WorkingCopyPipelineAndShardedStepsMatchThePlainStep) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  auto cuda = make_cuda_backend(0);
  cuda->set_gemm_autotune(false);
  const ModelConfig cfg = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  auto loaded = load_weights(*cuda, cfg, test::fixture_dir());
  // Gradients from one micro-batch, shared (read only) by every optimizer below.
  test::Golden golden;
  const TrainSample sample = test::golden_sample(golden);
  TrainableQwen3VL model(*cuda, cfg, *loaded, TrainLimits{});
  model.zero_grads();
  model.queue_forward_backward({&sample},
                               1.0f / static_cast<float>(labelled_positions(sample.labels)));
  auto comm = make_nccl_communicator(*cuda, nullptr, 0, 1);
  StageTensors stages;
  stages.stages = comm.get();
  stages.held.assign(1, std::vector<bool>(loaded->bindings.size(), true));
  AdamWConfig ac;
  ac.weight_decay = 0.1f;  // clipping off: the norm's sum may round apart between the modes
  struct Run {
    std::unique_ptr<ModelWeights> master, working;
    std::unique_ptr<AdamW> opt;
  };
  // The sharded optimizer keeps its own master weights, filled from a host f32 copy.
  auto cpu = make_cpu_backend();
  auto host_master = allocate_weights(*cpu, cfg, DType::f32);
  for (size_t i = 0; i < loaded->bindings.size(); ++i) {
    const Tensor t = loaded->bindings[i].tensor();
    std::vector<float> v(static_cast<size_t>(t.numel()));
    cuda->read(v.data(), DType::f32, t);
    cpu->write(host_master->bindings[i].tensor(), v.data(), DType::f32);
  }
  std::vector<Run> runs(3);
  for (int k = 0; k < 3; ++k) {
    Run& r = runs[size_t(k)];
    r.working = allocate_weights(*cuda, cfg);
    if (k != 2) r.master = allocate_weights(*cuda, cfg, DType::f32);
    for (size_t i = 0; i < loaded->bindings.size(); ++i) {
      cuda->copy(r.working->bindings[i].tensor(), loaded->bindings[i].tensor());
      if (r.master) cuda->convert(r.master->bindings[i].tensor(), loaded->bindings[i].tensor());
    }
    r.opt = std::make_unique<AdamW>(*cuda, cfg, r.master.get(), model.grads(), ac, r.working.get(),
                                    k == 2 ? comm.get() : nullptr, int64_t(1) << 25,
                                    k == 1 ? &stages : nullptr);
    if (k == 2) r.opt->init_master(*host_master);
  }
  for (int step = 0; step < 3; ++step)
    for (Run& r : runs) r.opt->step(1e-3f);
  runs[2].opt->gather_state();
  // A tensor's bytes as they sit on the device (read in its own dtype: no conversion).
  auto raw = [&](const Tensor& t) {
    std::vector<char> b(t.nbytes());
    cuda->read(b.data(), t.dtype, t);
    return b;
  };
  const std::vector<float> norms = runs[0].opt->take_grad_norms();
  for (int k = 1; k < 3; ++k) {
    SCOPED_TRACE(k == 1 ? "pipeline stage" : "sharded");
    for (size_t i = 0; i < loaded->bindings.size(); ++i) {
      const int64_t n = loaded->bindings[i].tensor().numel();
      std::vector<float> a(static_cast<size_t>(n)), b(a.size());
      runs[0].opt->read_master(i, a.data());
      runs[size_t(k)].opt->read_master(i, b.data());
      ASSERT_EQ(a, b) << "master " << loaded->bindings[i].hf_name;
      ASSERT_EQ(raw(runs[0].working->bindings[i].tensor()),
                raw(runs[size_t(k)].working->bindings[i].tensor()))
          << "working " << loaded->bindings[i].hf_name;
    }
    const std::vector<float> other = runs[size_t(k)].opt->take_grad_norms();
    ASSERT_EQ(other.size(), norms.size());
    for (size_t s = 0; s < norms.size(); ++s) EXPECT_NEAR(other[s], norms[s], 1e-6 * norms[s]);
  }
  // The weights moved.
  EXPECT_NE(raw(runs[0].working->text.embed), raw(loaded->text.embed));
}

#ifdef IRIS_WITH_CUDA
// A host function that holds the stream, as a kernel waiting in NCCL for a dead peer does.
void CUDART_CB hold_stream(void*) {
  std::this_thread::sleep_for(std::chrono::seconds(5));
}

void stall_past_the_watchdog() {
  auto cuda = make_cuda_backend(0);
  auto dog = make_stall_watchdog(*cuda, 0.5, 0);
  dog->mark();  // reached at once
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto stream = static_cast<cudaStream_t>(cuda->native_stream());
  if (cudaLaunchHostFunc(stream, hold_stream, nullptr) != cudaSuccess) std::_Exit(3);
  dog->mark();  // not reached for 5 s
  cudaStreamSynchronize(stream);
  std::_Exit(0);  // the watchdog did not fire
}

TEST(StallWatchdog, EndsTheProcessWhenTheGpuStopsFinishingSteps) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  // Steps that finish keep it quiet.
  {
    auto cuda = make_cuda_backend(0);
    auto dog = make_stall_watchdog(*cuda, 0.5, 0);
    for (int i = 0; i < 20; ++i) {
      dog->mark();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    cuda->synchronize();
  }
  // The child starts afresh (CUDA does not survive a fork).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(stall_past_the_watchdog(), ::testing::ExitedWithCode(1), "parallel.timeout_seconds");
}
#endif

}  // namespace
}  // namespace iris
