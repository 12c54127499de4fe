// Graphs for the Qwen2.5-VL and Qwen2-VL fixtures: a vision bucket (Qwen2.5-VL's holds several
// windows and a full-attention block between windowed ones) and per-layer decode graphs replay
// the eager results bit for bit, through the recording stand-in on the CPU (CI) and through CUDA
// graphs on a GPU; and on the GPU, the goldens within the bf16 tolerances of the Qwen3-VL CUDA
// goldens (tests/bridge_cuda_golden_test.cpp).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "bridge/pipeline_stage.h"
#include "bridge/qwen3vl_model.h"
#include "bridge/vision_cuda_graph_helper.h"
#include "model_test_util.h"
#include "test_util.h"

namespace iris {
namespace {

using test::Golden;
using test::grids_of;
using test::ids_of;
using test::read_f32;

GraphConfigs family_graph_configs(const std::string& scope) {
  GraphConfigs c = parse_graph_configs({{"cuda_graph_impl", "local"},
                                        {"inference_cuda_graph_scope", scope},
                                        {"cuda_graph_warmup_steps", "1"},
                                        {"vision_cuda_graph_impl", "local"},
                                        {"vision_inference_cuda_graph_scope", "block"},
                                        {"max_vision_cuda_graph_seq_length", "1024"},
                                        {"vision_cuda_graph_buckets", "256,512,1024"},
                                        {"vision_cuda_graph_overflow", "eager"}});
  GraphModelTraits traits;
  traits.has_deepstack = false;
  traits.spatial_merge_size = 2;
  finalize_graph_configs(c, traits);
  return c;
}

ModelLimits family_limits() {
  ModelLimits l;
  l.max_context = 512;
  l.max_step_tokens = 256;
  l.max_vision_patches = 1024;
  l.max_images = 4;
  return l;
}

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

std::vector<int32_t> greedy(Qwen3VLModel& m, const std::vector<int32_t>& prompt, int n) {
  m.prefill(prompt);
  std::vector<int32_t> out{argmax(m.last_logits())};
  while (static_cast<int>(out.size()) < n) {
    m.decode(out.back());
    out.push_back(argmax(m.last_logits()));
  }
  return out;
}

class FamilyGraphs : public ::testing::TestWithParam<std::tuple<const char*, bool>> {
 protected:
  void SetUp() override {
    const bool cuda = std::get<1>(GetParam());
    if (cuda && !cuda_available()) GTEST_SKIP() << "no GPU";
    dir_ = test::data_dir() + "/" + std::get<0>(GetParam());
    golden_ = std::make_unique<Golden>(dir_);
    backend_ = cuda ? make_cuda_backend(0) : make_cpu_backend();
    const HostTensor pv = golden_->tensor("pixel_values");
    pixels_.assign(pv.data<float>(), pv.data<float>() + pv.numel());
    grids_ = grids_of(golden_->tensor("image_grid_thw"));
  }
  std::string dir_;
  std::unique_ptr<Golden> golden_;
  std::unique_ptr<Backend> backend_;
  std::vector<float> pixels_;
  std::vector<GridTHW> grids_;
};

TEST_P(FamilyGraphs, VisionBucketReplayIsBitIdenticalToEagerOnTheSamePaddedInput) {
  Qwen3VLModel m(*backend_, dir_, family_limits());
  VisionEncoder& enc = m.vision();
  const GraphConfigs cfg = family_graph_configs("block");
  const PaddedVisionCall call =
      plan_padded_vision_call(m.config().vision, cfg.vision, grids_, enc.max_segments());
  ASSERT_EQ(call.n_patches, 248);
  ASSERT_EQ(*call.bucket, 256);  // 8 padding rows: a segment (and a window) of their own
  if (m.config().vision.window_units() > 0) {
    EXPECT_EQ(call.call.n_windows, 4 + 3 + 1);
  }
  enc.upload(pixels_.data(), grids_, *call.bucket);
  const auto eager = enc.run(*call.bucket, enc.max_segments());
  const std::vector<float> want = read_f32(*backend_, eager.embeds.slice(0, 62));
  // The padded call gives the unpadded embeddings (padding is a segment of its own).
  const auto unpadded = enc.encode(pixels_.data(), grids_);
  EXPECT_TRUE(test::all_close(read_f32(*backend_, unpadded.embeds), want, 1e-6f, 1e-6f));

  VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], cfg);
  for (int call_no = 0; call_no < 4; ++call_no) {  // warm-up, capture, replay, replay
    const auto out = h.encode(pixels_.data(), grids_);
    EXPECT_EQ(read_f32(*backend_, out.embeds), want) << "call " << call_no;
  }
  EXPECT_TRUE(h.graphs_created(GraphSet::vision));
}

TEST_P(FamilyGraphs, GreedyDecodeWithLayerGraphsEqualsEager) {
  Qwen3VLModel m(*backend_, dir_, family_limits());
  m.encode_images(pixels_.data(), grids_);
  const auto prompt = ids_of(golden_->tensor("input_ids"));
  const auto want = greedy(m, prompt, 24);
  for (const char* scope : {"block", "layer"}) {
    VisionCudaGraphHelper h(m, split_stages(m.config(), 1)[0], family_graph_configs(scope));
    m.attach_graphs(&h);
    m.encode_images(pixels_.data(), grids_);
    EXPECT_EQ(greedy(m, prompt, 24), want) << scope;
    EXPECT_TRUE(h.graphs_created(GraphSet::decoder)) << scope;
    m.detach_graphs(&h);
  }
}

// The bf16 rules of the Qwen3-VL CUDA goldens: relative L2 of vision outputs and hidden states
// at most 3%, every HF top-8 logit within 3% + 0.05.
TEST_P(FamilyGraphs, CudaGoldensWithinBf16Tolerance) {
  if (!std::get<1>(GetParam())) GTEST_SKIP() << "the CPU's fp32 goldens are bridge_family_golden";
  ModelLimits limits = family_limits();
  limits.all_logits = true;
  Qwen3VLModel m(*backend_, dir_, limits);
  auto rel_l2 = [](const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
      den += double(b[i]) * b[i];
    }
    return std::sqrt(num / std::max(den, 1e-30));
  };
  const auto vision = m.vision().encode(pixels_.data(), grids_);
  EXPECT_LE(rel_l2(read_f32(*backend_, vision.embeds), golden_->tensor("vision.embeds").to_f32()),
            0.03);
  m.encode_images(pixels_.data(), grids_);
  const auto ids = ids_of(golden_->tensor("input_ids"));
  const int n_hidden = m.config().text.num_hidden_layers + 1;
  std::vector<std::vector<float>> hidden(static_cast<size_t>(n_hidden));
  m.prefill(ids,
            [&](int i, int64_t, const Tensor& rows) { hidden[i] = read_f32(*backend_, rows); });
  for (int l = 0; l < n_hidden; ++l)
    EXPECT_LE(rel_l2(hidden[l], golden_->tensor("mm.hidden." + std::to_string(l)).to_f32()), 0.03)
        << "mm.hidden." << l;
  const int64_t V = m.config().text.vocab_size;
  const HostTensor top_ids = golden_->tensor("mm.top8_ids"),
                   top = golden_->tensor("mm.top8_values");
  for (size_t r = 0; r < ids.size(); ++r)
    for (int k = 0; k < 8; ++k) {
      const float want = top.data<float>()[r * 8 + k];
      const int64_t id = top_ids.data<int64_t>()[r * 8 + k];
      EXPECT_NEAR(m.prompt_logits()[r * V + id], want, 0.03f * std::fabs(want) + 0.05f)
          << "row " << r << " rank " << k;
    }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyGraphs,
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
