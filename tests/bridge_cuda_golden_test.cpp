// The tiny fixture on the CUDA backend (bf16 weights and activations, f32 accumulation) against
// HF's fp32 goldens, with bf16 tolerances. Skipped without a GPU.
//
// Hidden states and vision outputs: relative L2 error ||ours - HF|| / ||HF|| <= 3% (golden.json's
// bf16_rel); single elements of a random-weight model may drift further through bf16 rounding.
//
// Top-8 rule: bf16 moves logits by a few hundredths, so near-ties may reorder. At every position:
//  - every golden top-8 id's logit is within tol of its golden value (tol = 3% relative + 0.05),
//  - an id we rank in the top 8 that HF does not is no larger than HF's 8th value + tol (it can
//    only enter where HF's 8th and 9th values are within bf16 noise),
//  - our top-1 equals HF's top-1 wherever HF's first two values are more than 2 tol apart.
#include <algorithm>
#include <numeric>

#include "bridge/generator.h"
#include "model_test_util.h"
#include "test_util.h"

namespace iris {
namespace {

using test::grids_of;
using test::ids_of;
using test::read_f32;

constexpr float kRel = 0.03f, kAbs = 0.05f;

::testing::AssertionResult rel_l2_within(const std::vector<float>& a, const std::vector<float>& b,
                                         double limit) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "size mismatch";
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  const double rel = std::sqrt(num / std::max(den, 1e-30));
  if (rel <= limit) return ::testing::AssertionSuccess() << "relative L2 " << rel;
  return ::testing::AssertionFailure() << "relative L2 error " << rel << " > " << limit;
}

void check_top8(const float* logits, int64_t rows, int64_t V, const test::Golden& g,
                const std::string& prefix, int64_t row0 = 0) {
  const HostTensor ids = g.tensor(prefix + ".top8_ids"), vals = g.tensor(prefix + ".top8_values");
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * V;
    const int64_t gr = row0 + r;
    const int64_t* gi = ids.data<int64_t>() + gr * 8;
    const float* gv = vals.data<float>() + gr * 8;
    auto tol = [](float v) { return kRel * std::fabs(v) + kAbs; };
    for (int k = 0; k < 8; ++k)
      EXPECT_NEAR(row[gi[k]], gv[k], tol(gv[k])) << prefix << " row " << gr << " rank " << k;
    std::vector<int32_t> order(static_cast<size_t>(V));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 8, order.end(),
                      [&](int32_t a, int32_t b) { return row[a] > row[b]; });
    for (int k = 0; k < 8; ++k)
      if (std::find(gi, gi + 8, order[k]) == gi + 8)
        EXPECT_LE(row[order[k]], gv[7] + tol(gv[7]))
            << prefix << " row " << gr << " id " << order[k];
    if (gv[0] - gv[1] > 2 * tol(gv[0])) EXPECT_EQ(order[0], gi[0]) << prefix << " row " << gr;
  }
}

class CudaGolden : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no GPU";
    backend_ = make_cuda_backend(0);
    ModelLimits limits;
    limits.max_context = 512;
    limits.max_step_tokens = 256;
    limits.max_vision_patches = 1024;
    limits.max_images = 4;
    limits.all_logits = true;
    model_ = std::make_unique<Qwen3VLModel>(*backend_, test::fixture_dir(), limits);
  }
  std::vector<float> read(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    backend_->read(v.data(), DType::f32, t);
    return v;
  }
  test::Golden golden_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Qwen3VLModel> model_;
};

TEST_F(CudaGolden, VisionOutputsWithinBf16Tolerance) {
  const HostTensor pv = golden_.tensor("pixel_values");
  const auto out =
      model_->vision().encode(pv.data<float>(), grids_of(golden_.tensor("image_grid_thw")));
  EXPECT_TRUE(rel_l2_within(read(out.embeds), golden_.tensor("vision.embeds").to_f32(), kRel));
  for (size_t k = 0; k < out.deepstack.size(); ++k)
    EXPECT_TRUE(rel_l2_within(read(out.deepstack[k]),
                              golden_.tensor("vision.deepstack." + std::to_string(k)).to_f32(),
                              kRel));
}

TEST_F(CudaGolden, MultimodalAndTextHiddenStatesAndTop8) {
  for (const std::string prefix : {"mm", "text"}) {
    if (prefix == "mm") {
      const HostTensor pv = golden_.tensor("pixel_values");
      model_->encode_images(pv.data<float>(), grids_of(golden_.tensor("image_grid_thw")));
    } else {
      model_->encode_images(nullptr, {});
    }
    const auto ids = ids_of(golden_.tensor(prefix == "mm" ? "input_ids" : "text_input_ids"));
    std::vector<std::vector<float>> hidden(4);
    model_->prefill(ids, [&](int i, int64_t, const Tensor& rows) { hidden[i] = read(rows); });
    for (int l = 0; l < 4; ++l)
      EXPECT_TRUE(rel_l2_within(
          hidden[l], golden_.tensor(prefix + ".hidden." + std::to_string(l)).to_f32(), kRel))
          << prefix << ".hidden." << l;
    check_top8(model_->prompt_logits().data(), static_cast<int64_t>(ids.size()),
               model_->config().text.vocab_size, golden_, prefix);
  }
}

TEST_F(CudaGolden, ForcedIncrementalDecode) {
  const HostTensor pv = golden_.tensor("pixel_values");
  model_->encode_images(pv.data<float>(), grids_of(golden_.tensor("image_grid_thw")));
  model_->prefill(ids_of(golden_.tensor("input_ids")));
  const int64_t V = model_->config().text.vocab_size;
  std::vector<float> logits = model_->last_logits();
  check_top8(logits.data(), 1, V, golden_, "mm_forced", 0);
  const auto forced = ids_of(golden_.tensor("mm_forced.tokens"));
  for (size_t i = 0; i < forced.size(); ++i) {
    model_->decode(forced[i]);
    logits = model_->last_logits();
    check_top8(logits.data(), 1, V, golden_, "mm_forced", static_cast<int64_t>(i) + 1);
  }
}

TEST_F(CudaGolden, TextGreedyMatchesHF) {
  GenerationRequest req;
  req.prompt_ids = ids_of(golden_.tensor("text_input_ids"));
  req.max_new_tokens = 12;
  req.sampling.temperature = 0;
  const GenerationResult res = generate(*model_, req);
  EXPECT_EQ(res.tokens, golden_.json()["text_greedy_ids"].get<std::vector<int32_t>>());
}

TEST_F(CudaGolden, DecodeLoopDoesNotAllocate) {
  model_->encode_images(nullptr, {});
  model_->prefill(ids_of(golden_.tensor("text_input_ids")));
  const size_t v = model_->vision().arena().allocation_count(),
               d = model_->decoder().arena().allocation_count(),
               w = model_->weights().arena.allocation_count();
  for (int i = 0; i < 16; ++i) model_->decode(100 + i);
  EXPECT_EQ(model_->vision().arena().allocation_count(), v);
  EXPECT_EQ(model_->decoder().arena().allocation_count(), d);
  EXPECT_EQ(model_->weights().arena.allocation_count(), w);
}

}  // namespace
}  // namespace iris
