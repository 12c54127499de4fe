// One training step of Qwen2.5-VL and Qwen2-VL against HF transformers autograd
// (tools/make_family_golden.py, fp32): the mean loss and every parameter's gradient in relative
// L2, through the same per-architecture files that inference uses. On the CPU (fp32) within
// 1e-4; on CUDA (bf16 weights and activations, f32 gradients) the loss within 1% and each
// gradient within 6%. The Qwen3-VL CUDA goldens hold 3% (tests/training_gradients_test.cpp); these
// fixtures' vision gradients do not: on an H200 the Qwen2.5-VL fixture's block 0 reached 5.3%
// (attn.qkv.weight), its later blocks 3-4.6%, while the CPU oracle matches HF to 1e-4. Bringing
// them to 3% (more f32 on the vision backward path, or a fixture whose bf16 error is smaller) is
// open; 6% still fails a missing or wrong term by an order of magnitude.
#include <cmath>
#include <cstdio>

#include "bridge/hf_weights.h"
#include "model_test_util.h"
#include "test_util.h"
#include "training/train_model.h"
#include "training_test_util.h"

namespace iris {
namespace {

using test::Golden;

class FamilyGradients : public ::testing::TestWithParam<std::tuple<const char*, bool>> {};

TEST_P(FamilyGradients, LossAndEveryGradientMatchHF) {
  const bool cuda = std::get<1>(GetParam());
  if (cuda && !cuda_available()) GTEST_SKIP() << "no GPU";
  const double grad_tol = cuda ? 0.06 : 1e-4, loss_tol = cuda ? 1e-2 : 1e-5;
  const std::string dir = test::data_dir() + "/" + std::get<0>(GetParam());
  const Golden golden(dir);
  auto backend = cuda ? make_cuda_backend(0) : make_cpu_backend();
  const ModelConfig cfg = ModelConfig::from_file(dir + "/config.json");
  auto params = load_weights(*backend, cfg, dir);
  TrainLimits limits;
  limits.max_seq_len = 256;
  limits.max_patches = 1024;
  limits.max_images = 4;
  limits.loss_chunk_rows = 16;
  TrainableQwen3VL model(*backend, cfg, *params, limits);
  const TrainSample sample = test::golden_sample(golden);
  model.zero_grads();
  const LossStats stats =
      model.forward_backward(sample, 1.0f / static_cast<float>(labelled_positions(sample.labels)));
  const double want_loss = golden.json()["loss"].get<double>();
  EXPECT_NEAR(stats.loss_sum / double(stats.n_tokens), want_loss, loss_tol * want_loss);

  const HostTensor vocab_rows = golden.tensor("grad_rows_of_vocab");
  const int64_t V = cfg.text.vocab_size;
  size_t checked = 0;
  for (const WeightBinding& b : model.grads().bindings) {
    // Iris names tensors as transformers 5.x's modules do, whatever layout the file had.
    const std::string name = "grad." + b.hf_name;
    ASSERT_TRUE(golden.has(name)) << name;
    std::vector<float> got(static_cast<size_t>(b.tensor().numel()));
    backend->read(got.data(), DType::f32, b.tensor());
    if (b.hf_shape.size() == 2 && b.hf_shape[0] == V) {
      // Vocabulary-sized gradients: the golden keeps the rows of the prompt's ids and a stride.
      std::vector<float> rows;
      const int64_t C = b.hf_shape[1];
      for (int64_t i = 0; i < vocab_rows.numel(); ++i) {
        const int64_t r = vocab_rows.data<int64_t>()[i];
        rows.insert(rows.end(), got.begin() + r * C, got.begin() + (r + 1) * C);
      }
      got = rows;
    }
    const std::vector<float> want = golden.tensor(name).to_f32();
    ASSERT_EQ(got.size(), want.size()) << name;
    double diff = 0, norm = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
      norm += double(want[i]) * want[i];
    }
    EXPECT_GT(norm, 0.0) << name << " has an all-zero golden gradient";
    EXPECT_LE(std::sqrt(diff), grad_tol * std::sqrt(norm)) << name;
    if (cuda && std::sqrt(diff) > 0.01 * std::sqrt(norm))
      std::printf("  %-60s relative L2 %.4f\n", name.c_str(), std::sqrt(diff / norm));
    ++checked;
  }
  // Every parameter HF has is one Iris trains (the fused q/k/v and gate/up count per part).
  size_t golden_grads = 0;
  for (const auto& [name, _] : golden.json()["tensors"].items())
    if (name.rfind("grad.", 0) == 0) ++golden_grads;
  EXPECT_EQ(checked, golden_grads);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyGradients,
                         ::testing::Combine(::testing::Values("qwen25vl-tiny", "qwen2vl-tiny"),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<const char*, bool>>& i) {
                           return std::string(std::get<0>(i.param) == std::string("qwen25vl-tiny")
                                                  ? "qwen2_5_vl"
                                                  : "qwen2_vl") +
                                  (std::get<1>(i.param) ? "_cuda" : "_cpu");
                         });

}  // namespace
}  // namespace iris
