// The CPU reference against HF transformers on the tiny Qwen3-VL fixture (fp32 goldens).
#include <algorithm>
#include <numeric>

#include "bridge/qwen3vl_model.h"
#include "model_test_util.h"
#include "test_util.h"

namespace iris {
namespace {

using test::grids_of;
using test::ids_of;
using test::read_f32;

using test::all_close;
using test::Golden;

constexpr float kRel = 1e-4f, kAbs = 1e-4f;

class GoldenModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    golden_ = new Golden();
    backend_ = make_cpu_backend().release();
    ModelLimits limits;
    limits.max_context = 512;
    limits.max_step_tokens = 256;
    limits.max_vision_patches = 1024;
    limits.max_images = 4;
    limits.all_logits = true;
    model_ = new Qwen3VLModel(*backend_, test::fixture_dir(), limits);
  }
  static void TearDownTestSuite() {
    delete model_;
    delete backend_;
    delete golden_;
  }
  void encode_golden_images() {
    const HostTensor pv = golden_->tensor("pixel_values");
    model_->encode_images(pv.data<float>(), grids_of(golden_->tensor("image_grid_thw")));
  }

  // Checks top-8 ids exactly, top-8 values and logsumexp within 1e-4 relative, for each row.
  static void check_logits(const float* logits, int64_t rows, const std::string& prefix,
                           int64_t golden_row0 = 0) {
    const int64_t V = model_->config().text.vocab_size;
    const HostTensor ids = golden_->tensor(prefix + ".top8_ids");
    const HostTensor vals = golden_->tensor(prefix + ".top8_values");
    const HostTensor lse = golden_->tensor(prefix + ".logsumexp");
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = logits + r * V;
      std::vector<int32_t> order(static_cast<size_t>(V));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + 8, order.end(), [&](int32_t a, int32_t b) {
        return row[a] > row[b] || (row[a] == row[b] && a < b);
      });
      const int64_t g = golden_row0 + r;
      for (int k = 0; k < 8; ++k) {
        EXPECT_EQ(order[k], ids.data<int64_t>()[g * 8 + k])
            << prefix << " row " << g << " rank " << k;
        const float want = vals.data<float>()[g * 8 + k];
        EXPECT_NEAR(row[order[k]], want, kRel * std::fabs(want) + kAbs) << prefix << " row " << g;
      }
      const float mx = row[order[0]];
      double s = 0;
      for (int64_t v = 0; v < V; ++v) s += std::exp(double(row[v]) - mx);
      const float l = mx + static_cast<float>(std::log(s));
      const float want = lse.data<float>()[g];
      EXPECT_NEAR(l, want, kRel * std::fabs(want) + kAbs) << prefix << " logsumexp row " << g;
    }
  }

  static Golden* golden_;
  static Backend* backend_;
  static Qwen3VLModel* model_;
};

Golden* GoldenModel::golden_ = nullptr;
Backend* GoldenModel::backend_ = nullptr;
Qwen3VLModel* GoldenModel::model_ = nullptr;

TEST_F(GoldenModel, VisionEmbeddingsAndDeepstackMatchHF) {
  const HostTensor pv = golden_->tensor("pixel_values");
  const auto out =
      model_->vision().encode(pv.data<float>(), grids_of(golden_->tensor("image_grid_thw")));
  EXPECT_TRUE(all_close(read_f32(*backend_, out.embeds), golden_->tensor("vision.embeds").to_f32(),
                        kRel, kAbs));
  ASSERT_EQ(out.deepstack.size(), 2u);
  for (size_t k = 0; k < out.deepstack.size(); ++k)
    EXPECT_TRUE(all_close(read_f32(*backend_, out.deepstack[k]),
                          golden_->tensor("vision.deepstack." + std::to_string(k)).to_f32(), kRel,
                          kAbs))
        << "deepstack " << k;
}

TEST_F(GoldenModel, PositionIdsAndRopeDeltasMatchExactly) {
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

TEST_F(GoldenModel, MultimodalHiddenStatesAndLogitsMatchHF) {
  encode_golden_images();
  const auto ids = ids_of(golden_->tensor("input_ids"));
  std::vector<std::vector<float>> hidden(4);
  model_->prefill(ids, [&](int index, int64_t, const Tensor& rows) {
    hidden[index] = read_f32(*backend_, rows);
  });
  for (int l = 0; l < 4; ++l)
    EXPECT_TRUE(all_close(hidden[l], golden_->tensor("mm.hidden." + std::to_string(l)).to_f32(),
                          kRel, kAbs))
        << "mm.hidden." << l;
  check_logits(model_->prompt_logits().data(), static_cast<int64_t>(ids.size()), "mm");
}

TEST_F(GoldenModel, TextOnlyHiddenStatesAndLogitsMatchHF) {
  model_->encode_images(nullptr, {});
  const auto ids = ids_of(golden_->tensor("text_input_ids"));
  std::vector<std::vector<float>> hidden(4);
  model_->prefill(ids, [&](int index, int64_t, const Tensor& rows) {
    hidden[index] = read_f32(*backend_, rows);
  });
  for (int l = 0; l < 4; ++l)
    EXPECT_TRUE(all_close(hidden[l], golden_->tensor("text.hidden." + std::to_string(l)).to_f32(),
                          kRel, kAbs))
        << "text.hidden." << l;
  check_logits(model_->prompt_logits().data(), static_cast<int64_t>(ids.size()), "text");
}

TEST_F(GoldenModel, IncrementalDecodeOfForcedTokensMatchesFullSequence) {
  encode_golden_images();
  const auto ids = ids_of(golden_->tensor("input_ids"));
  const auto forced = ids_of(golden_->tensor("mm_forced.tokens"));
  model_->prefill(ids);
  std::vector<float> logits = model_->last_logits();
  check_logits(logits.data(), 1, "mm_forced", 0);
  for (size_t i = 0; i < forced.size(); ++i) {
    model_->decode(forced[i]);
    logits = model_->last_logits();
    check_logits(logits.data(), 1, "mm_forced", static_cast<int64_t>(i) + 1);
  }
}

TEST_F(GoldenModel, ChunkedPrefillMatchesSingleChunk) {
  ModelLimits limits;
  limits.max_context = 512;
  limits.max_step_tokens = 40;  // image pads straddle chunk edges
  limits.max_vision_patches = 1024;
  limits.max_images = 4;
  Qwen3VLModel chunked(*backend_, test::fixture_dir(), limits);
  const HostTensor pv = golden_->tensor("pixel_values");
  chunked.encode_images(pv.data<float>(), grids_of(golden_->tensor("image_grid_thw")));
  chunked.prefill(ids_of(golden_->tensor("input_ids")));
  std::vector<float> l = chunked.last_logits();
  check_logits(l.data(), 1, "mm_forced", 0);
}

}  // namespace
}  // namespace iris

namespace iris {
namespace {

// Memory is planned once: decode steps add no allocation to any arena.
TEST_F(GoldenModel, DecodeLoopDoesNotAllocate) {
  model_->encode_images(nullptr, {});
  model_->prefill(ids_of(golden_->tensor("text_input_ids")));
  const size_t d = model_->decoder().arena().allocation_count();
  const size_t v = model_->vision().arena().allocation_count();
  for (int i = 0; i < 8; ++i) model_->decode(100 + i);
  EXPECT_EQ(model_->decoder().arena().allocation_count(), d);
  EXPECT_EQ(model_->vision().arena().allocation_count(), v);
}

}  // namespace
}  // namespace iris
