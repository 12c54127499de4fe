// One training step of Qwen3-VL-MoE against HF transformers autograd (tools/make_moe_golden.py,
// fp32, eager experts): the LM loss, the load-balancing loss (HF's, with output_router_logits)
// and every parameter's gradient in relative L2, the router's and the experts' included, with the
// load-balancing loss's coefficient at the config's 0.001 (HF's grad_aux.*) and at 0 (grad.*).
// HF holds the experts as [E, out, in] in memory (its loader transposes the checkpoints' [E, in,
// out]); their golden gradients are transposed back here. CPU (fp32) within 1e-4; CUDA (bf16
// weights and activations, f32 gradients) within 6%, as the other families' CUDA gradients.
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

// An expert tensor's golden gradient [E, a, b] as the checkpoint's [E, b, a].
std::vector<float> transposed_per_expert(const HostTensor& t) {
  const int64_t E = t.dim(0), a = t.dim(1), b = t.dim(2);
  const std::vector<float> v = t.to_f32();
  std::vector<float> out(v.size());
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < a; ++i)
      for (int64_t j = 0; j < b; ++j) out[(e * b + j) * a + i] = v[(e * a + i) * b + j];
  return out;
}

class MoeGradients : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(MoeGradients, LossesAndEveryGradientMatchHF) {
  const auto [cuda, with_aux] = GetParam();
  if (cuda && !cuda_available()) GTEST_SKIP() << "no GPU";
  const double grad_tol = cuda ? 0.06 : 1e-4, loss_tol = cuda ? 1e-2 : 1e-5;
  const std::string dir = test::data_dir() + "/qwen3vlmoe-tiny";
  const Golden golden(dir);
  auto backend = cuda ? make_cuda_backend(0) : make_cpu_backend();
  ModelConfig cfg = ModelConfig::from_file(dir + "/config.json");
  ASSERT_FLOAT_EQ(cfg.text.router_aux_loss_coef, 0.001f);
  if (!with_aux) cfg.text.router_aux_loss_coef = 0.0f;
  auto params = load_weights(*backend, cfg, dir);
  TrainLimits limits;
  limits.max_seq_len = 128;
  limits.max_patches = 256;
  limits.max_images = 4;
  limits.loss_chunk_rows = 16;
  TrainableQwen3VL model(*backend, cfg, *params, limits);
  const TrainSample sample = test::golden_sample(golden);
  model.zero_grads();
  const LossStats stats =
      model.forward_backward(sample, 1.0f / static_cast<float>(labelled_positions(sample.labels)));
  const double want_loss = golden.json()["loss"].get<double>();
  EXPECT_NEAR(stats.loss_sum / double(stats.n_tokens), want_loss, loss_tol * want_loss);
  // The load-balancing loss is reported apart from the LM loss, whatever its coefficient.
  const auto [aux, runs] = model.take_moe_aux_loss();
  EXPECT_EQ(runs, 1);
  const double want_aux = golden.json()["aux_loss"].get<double>();
  EXPECT_NEAR(aux, want_aux, loss_tol * want_aux);

  const std::string prefix = with_aux ? "grad_aux." : "grad.";
  size_t checked = 0;
  for (const WeightBinding& b : model.grads().bindings) {
    const std::string name = prefix + b.hf_name;
    ASSERT_TRUE(golden.has(name)) << name;
    std::vector<float> got(static_cast<size_t>(b.tensor().numel()));
    backend->read(got.data(), DType::f32, b.tensor());
    const HostTensor g = golden.tensor(name);
    const std::vector<float> want = b.hf_shape.size() == 3 ? transposed_per_expert(g) : g.to_f32();
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
  size_t golden_grads = 0;
  for (const auto& [name, _] : golden.json()["tensors"].items())
    if (name.rfind(prefix, 0) == 0) ++golden_grads;
  EXPECT_EQ(checked, golden_grads);
}

// The router's gradient is where the load-balancing loss shows: it must differ between the two
// goldens, or the comparison above would not see a missing aux term.
TEST(MoeGradientGolden, TheLoadBalancingLossMovesTheRoutersGradient) {
  const Golden golden(test::data_dir() + "/qwen3vlmoe-tiny");
  const std::string router = "model.language_model.layers.0.mlp.gate.weight";
  const std::vector<float> a = golden.tensor("grad." + router).to_f32(),
                           b = golden.tensor("grad_aux." + router).to_f32();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(a[i]) * a[i];
  }
  EXPECT_GT(std::sqrt(diff), 1e-3 * std::sqrt(norm));
}

INSTANTIATE_TEST_SUITE_P(Backends, MoeGradients,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<bool, bool>>& i) {
                           return std::string(std::get<1>(i.param) ? "with_aux" : "lm_only") +
                                  (std::get<0>(i.param) ? "_cuda" : "_cpu");
                         });

}  // namespace
}  // namespace iris
