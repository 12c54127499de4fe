// Training on a video conversation, for every family, on the CPU: the training model's loss on a
// video SFT sample equals the cross-entropy of the inference model's logits for the same ids
// (the inference model matches HF's video logits: tests/bridge_family_video_test.cpp), and the
// pad rows of images and videos give the embedding table no gradient while the video gives the
// vision tower one (untied heads: a tied head's output gradient reaches every row).
#include <cmath>

#include "bridge/architecture.h"
#include "bridge/hf_weights.h"
#include "bridge/qwen3vl_model.h"
#include "model_test_util.h"
#include "test_util.h"
#include "training/chat_format.h"
#include "training/train_model.h"
#include "video_test_util.h"
#include "vision/video.h"

namespace iris {
namespace {

using test::formula_frames;

class FamilyVideoTraining : public ::testing::TestWithParam<const char*> {};

TEST_P(FamilyVideoTraining, LossEqualsTheInferenceModelsCrossEntropyAndPadsGetNoGradient) {
  const std::string dir = test::data_dir() + "/" + GetParam();
  const ModelConfig cfg = ModelConfig::from_file(dir + "/config.json");
  const VideoProcessorConfig vpre = model_video_preprocessor(dir, cfg);
  const std::vector<ImageRGB8> all = formula_frames();
  const std::vector<int64_t> keep = cfg.arch->sample_video_frames(30, 12.0, vpre);
  std::vector<ImageRGB8> kept;
  for (int64_t i : keep) kept.push_back(all[static_cast<size_t>(i)]);
  const ResizedSize size =
      cfg.arch->video_frame_size(static_cast<int64_t>(kept.size()), 100, 140, vpre);
  VideoClip clip = preprocess_video(kept, size, vpre);
  clip.frame_indices = keep;
  clip.total_frames = 30;
  clip.video_fps = 12.0;

  const Tokenizer tok = Tokenizer::from_file(dir + "/tokenizer.json");
  const ChatFormat format = ChatFormat::from_dir(dir);
  const std::vector<ChatMessage> messages = {
      {"user", {ChatPart::make_video(), ChatPart::make_text("Describe this video.")}},
      {"assistant", {ChatPart::make_text("A ball rolls across the floor.")}}};
  const ChatMediaTokens t = build_chat_media_tokens(tok, format, messages, cfg, {}, {&clip});
  TrainSample sample;
  sample.ids = t.prompt.ids;
  sample.labels = t.labels;
  sample.pixel_values.assign(clip.pixel_values.data<float>(),
                             clip.pixel_values.data<float>() + clip.pixel_values.numel());
  sample.grids = {clip.grid_thw};
  sample.runs = t.prompt.runs;
  const int64_t labelled = labelled_positions(sample.labels);
  ASSERT_GT(labelled, 0);

  auto backend = make_cpu_backend();
  // The inference model's logits of every position, and the mean cross-entropy of the labelled
  // ones (HF's shift: position i predicts labels[i + 1]).
  double want = 0;
  {
    ModelLimits limits;
    limits.max_context = 512;
    limits.max_step_tokens = 256;
    limits.max_vision_patches = 1024;
    limits.max_images = 8;
    limits.all_logits = true;
    Qwen3VLModel model(*backend, dir, limits);
    model.encode_vision(sample.pixel_values.data(), sample.grids, sample.runs);
    model.prefill(sample.ids);
    const std::vector<float>& logits = model.prompt_logits();
    const int64_t V = cfg.text.vocab_size;
    for (size_t i = 0; i + 1 < sample.ids.size(); ++i) {
      const int32_t y = sample.labels[i + 1];
      if (y == kIgnoreLabel) continue;
      const float* row = logits.data() + static_cast<int64_t>(i) * V;
      double mx = row[0];
      for (int64_t v = 1; v < V; ++v) mx = std::max(mx, double(row[v]));
      double s = 0;
      for (int64_t v = 0; v < V; ++v) s += std::exp(double(row[v]) - mx);
      want += mx + std::log(s) - row[y];
    }
    want /= static_cast<double>(labelled);
  }

  const ModelConfig& c = cfg;
  auto params = load_weights(*backend, c, dir);
  TrainLimits limits;
  limits.max_seq_len = 256;
  limits.max_patches = 1024;
  limits.max_images = 8;
  limits.loss_chunk_rows = 16;
  TrainableQwen3VL train(*backend, c, *params, limits);
  train.zero_grads();
  const LossStats stats = train.forward_backward(sample, 1.0f / static_cast<float>(labelled));
  ASSERT_EQ(stats.n_tokens, labelled);
  EXPECT_NEAR(stats.loss_sum / double(stats.n_tokens), want, 1e-5 * want);

  for (const WeightBinding& b : train.grads().bindings) {
    std::vector<float> g(static_cast<size_t>(b.tensor().numel()));
    backend->read(g.data(), DType::f32, b.tensor());
    // With a tied head the table's rows also get the output projection's gradient (every row is
    // a logit); untied, a pad row gets none, as its embedding is replaced by the vision rows.
    if (b.hf_name == "model.language_model.embed_tokens.weight" && !c.tie_word_embeddings) {
      const int64_t C = b.hf_shape[1];
      for (int32_t pad : {c.image_token_id, c.video_token_id}) {
        double norm = 0;
        for (int64_t k = 0; k < C; ++k) norm += std::fabs(g[static_cast<size_t>(pad * C + k)]);
        EXPECT_EQ(norm, 0.0) << "the embedding row of pad id " << pad;
      }
    }
    if (b.hf_name == "model.visual.patch_embed.proj.weight") {
      double norm = 0;
      for (float v : g) norm += std::fabs(v);
      EXPECT_GT(norm, 0.0) << "the video gives the patch embedding no gradient";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyVideoTraining,
                         ::testing::Values("qwen3vl-tiny", "qwen25vl-tiny", "qwen2vl-tiny"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           std::string n = i.param;
                           return n.substr(0, n.find('-'));
                         });

}  // namespace
}  // namespace iris
