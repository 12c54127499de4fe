// Qwen2.5-VL and Qwen2-VL through the model registry on the CPU, against HF transformers
// (tools/make_family_golden.py: fp32, TF32 off, checkpoints in the hub's flat layout): config
// reading in both layouts, vision embeddings, position ids, every hidden state, logits and
// greedy ids.
#include <algorithm>
#include <numeric>

#include "bridge/architecture.h"
#include "bridge/qwen3vl_model.h"
#include "model_test_util.h"
#include "test_util.h"

namespace iris {
namespace {

using test::all_close;
using test::Golden;
using test::grids_of;
using test::ids_of;
using test::read_f32;

constexpr float kRel = 1e-4f, kAbs = 1e-4f;

struct Family {
  const char* dir;
  const char* model_type;
};

std::string fixture(const Family& f) {
  return test::data_dir() + "/" + f.dir;
}

class FamilyGolden : public ::testing::TestWithParam<Family> {
 protected:
  void SetUp() override {
    golden_ = std::make_unique<Golden>(fixture(GetParam()));
    backend_ = make_cpu_backend();
    ModelLimits limits;
    limits.max_context = 512;
    limits.max_step_tokens = 256;
    limits.max_vision_patches = 1024;
    limits.max_images = 4;
    limits.all_logits = true;
    model_ = std::make_unique<Qwen3VLModel>(*backend_, fixture(GetParam()), limits);
  }
  void encode_golden_images() {
    const HostTensor pv = golden_->tensor("pixel_values");
    model_->encode_images(pv.data<float>(), grids_of(golden_->tensor("image_grid_thw")));
  }
  // Top-8 ids exactly, their values and each row's logsumexp within 1e-4.
  void check_logits(const float* logits, int64_t rows, const std::string& prefix) {
    test::expect_top8_and_logsumexp(logits, rows, model_->config().text.vocab_size,
                                    golden_->tensor(prefix + ".top8_ids"),
                                    golden_->tensor(prefix + ".top8_values"),
                                    golden_->tensor(prefix + ".logsumexp"), prefix, kRel, kAbs);
  }
  void check_prompt(const std::string& prefix, const std::vector<int32_t>& ids) {
    const int n_hidden = model_->config().text.num_hidden_layers + 1;
    std::vector<std::vector<float>> hidden(static_cast<size_t>(n_hidden));
    model_->prefill(ids, [&](int index, int64_t, const Tensor& rows) {
      hidden[index] = read_f32(*backend_, rows);
    });
    for (int l = 0; l < n_hidden; ++l)
      EXPECT_TRUE(all_close(
          hidden[l], golden_->tensor(prefix + ".hidden." + std::to_string(l)).to_f32(), kRel, kAbs))
          << prefix << ".hidden." << l;
    check_logits(model_->prompt_logits().data(), static_cast<int64_t>(ids.size()), prefix);
  }
  std::vector<int32_t> greedy(const std::vector<int32_t>& ids, int n) {
    model_->prefill(ids);
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) {
      const std::vector<float> l = model_->last_logits();
      out.push_back(static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin()));
      if (i + 1 < n) model_->decode(out.back());
    }
    return out;
  }

  std::unique_ptr<Golden> golden_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Qwen3VLModel> model_;
};

TEST_P(FamilyGolden, RegistryPicksTheArchitectureAndBothConfigLayoutsAgree) {
  const ModelConfig flat = ModelConfig::from_file(fixture(GetParam()) + "/config.json");
  const ModelConfig nested = ModelConfig::from_file(fixture(GetParam()) + "/config_nested.json");
  EXPECT_EQ(flat.arch, &architecture_for(GetParam().model_type, "test"));
  EXPECT_EQ(nested.arch, flat.arch);
  EXPECT_STREQ(flat.arch->model_type(), GetParam().model_type);
  for (const ModelConfig* c : {&flat, &nested}) {
    EXPECT_FALSE(c->text.mrope_interleaved);
    EXPECT_EQ(c->text.mrope_section, (std::array<int, 3>{2, 3, 3}));
    EXPECT_EQ(c->text.hidden_size, 16);
    EXPECT_EQ(c->text.head_dim, 16);
    EXPECT_EQ(c->vision.hidden_size, 32);
    EXPECT_EQ(c->vision.patch_size, 14);
    EXPECT_TRUE(c->vision.deepstack_visual_indexes.empty());
  }
  EXPECT_EQ(nested.tie_word_embeddings, flat.tie_word_embeddings);
  EXPECT_EQ(nested.text.vocab_size, flat.text.vocab_size);
  EXPECT_EQ(nested.vision.intermediate_size, flat.vision.intermediate_size);
  EXPECT_EQ(nested.vision.window_size, flat.vision.window_size);
  EXPECT_EQ(nested.vision.fullatt_block_indexes, flat.vision.fullatt_block_indexes);
}

TEST_P(FamilyGolden, VisionEmbeddingsMatchHF) {
  const HostTensor pv = golden_->tensor("pixel_values");
  const auto out =
      model_->vision().encode(pv.data<float>(), grids_of(golden_->tensor("image_grid_thw")));
  EXPECT_TRUE(out.deepstack.empty());
  EXPECT_TRUE(all_close(read_f32(*backend_, out.embeds), golden_->tensor("vision.embeds").to_f32(),
                        kRel, kAbs));
}

TEST_P(FamilyGolden, PositionIdsAndRopeDeltasMatchExactly) {
  const auto ids = ids_of(golden_->tensor("input_ids"));
  const ModelConfig& cfg = model_->config();
  const RopeIndex r = compute_rope_index(
      ids, image_runs(grids_of(golden_->tensor("image_grid_thw")), cfg.image_token_id, 2),
      cfg.image_token_id, cfg.video_token_id);
  const HostTensor pos = golden_->tensor("position_ids");
  ASSERT_EQ(pos.numel(), static_cast<int64_t>(r.positions.size()));
  for (int64_t i = 0; i < pos.numel(); ++i) ASSERT_EQ(r.positions[i], pos.data<int64_t>()[i]) << i;
  EXPECT_EQ(r.delta, golden_->tensor("rope_deltas").data<int64_t>()[0]);
}

TEST_P(FamilyGolden, MultimodalHiddenStatesAndLogitsMatchHF) {
  encode_golden_images();
  check_prompt("mm", ids_of(golden_->tensor("input_ids")));
}

TEST_P(FamilyGolden, TextOnlyHiddenStatesAndLogitsMatchHF) {
  model_->encode_images(nullptr, {});
  check_prompt("text", ids_of(golden_->tensor("text_input_ids")));
}

TEST_P(FamilyGolden, GreedyIdsEqualHF) {
  const auto want_mm = golden_->json()["mm_greedy_ids"].get<std::vector<int32_t>>();
  encode_golden_images();
  EXPECT_EQ(greedy(ids_of(golden_->tensor("input_ids")), static_cast<int>(want_mm.size())),
            want_mm);
  const auto want_text = golden_->json()["text_greedy_ids"].get<std::vector<int32_t>>();
  model_->encode_images(nullptr, {});
  EXPECT_EQ(greedy(ids_of(golden_->tensor("text_input_ids")), static_cast<int>(want_text.size())),
            want_text);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyGolden,
                         ::testing::Values(Family{"qwen25vl-tiny", "qwen2_5_vl"},
                                           Family{"qwen2vl-tiny", "qwen2_vl"}),
                         [](const ::testing::TestParamInfo<Family>& i) {
                           return std::string(i.param.model_type);
                         });

}  // namespace
}  // namespace iris
