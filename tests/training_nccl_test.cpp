// The NCCL path on one GPU: a world of one through the NCCL communicator and the bucketed
// fixed-order gradient reduction leaves every gradient bit where it was, and training through it
// gives the losses of training without it. Skips without a GPU or without NCCL.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "bridge/hf_weights.h"
#include "core/backend.h"
#include "parallel/communicator.h"
#include "parallel/grad_reducer.h"
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
  AdamW opt(*cuda, cfg, *master, model.grads(), AdamWConfig{}, working.get());
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

}  // namespace
}  // namespace iris
