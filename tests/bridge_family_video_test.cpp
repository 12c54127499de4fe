// Video for every family on the CPU, against HF transformers' own video processors and models
// (tools/make_video_golden.py: a formula video of 30 frames at 12 fps given to HF as frames and
// metadata, fp32, TF32 off): the frames each family keeps, pixel_values_videos and its grid, the
// prompt ids (Qwen3-VL's per-slice timestamps), M-RoPE positions and deltas, the last logits and
// the greedy ids of a video prompt and of a prompt with an image and a video. Where the build has
// OpenCV, the video also goes through a lossless FFV1 file and the decoder.
#include <unistd.h>
#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>

#include "bridge/architecture.h"
#include "bridge/chat_prompt.h"
#include "bridge/pipeline_stage.h"
#include "bridge/qwen3vl_model.h"
#include "bridge/vision_cuda_graph_helper.h"
#include "core/fs.h"
#include "core/safetensors.h"
#include "model_test_util.h"
#include "test_util.h"
#include "video_test_util.h"
#include "vision/image.h"
#include "vision/preprocess.h"
#include "vision/video.h"
#include "vision/video_decode.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using test::ids_of;
using test::read_f32;

constexpr int kFrames = test::kFormulaFrames, kHeight = test::kFormulaHeight,
              kWidth = test::kFormulaWidth;
constexpr double kVideoFps = test::kFormulaFps;
constexpr float kRel = 1e-4f, kAbs = 1e-4f;

using test::formula_frames;

// The clip of the formula video's kept frames, as iris generate makes it from a decoded file.
VideoClip clip_of(const ModelConfig& cfg, const VideoProcessorConfig& vpre,
                  const std::vector<ImageRGB8>& all, const std::vector<int64_t>& keep) {
  std::vector<ImageRGB8> kept;
  for (int64_t i : keep) kept.push_back(all[static_cast<size_t>(i)]);
  const ResizedSize size =
      cfg.arch->video_frame_size(static_cast<int64_t>(kept.size()), kHeight, kWidth, vpre);
  VideoClip clip = preprocess_video(kept, size, vpre);
  clip.frame_indices = keep;
  clip.total_frames = kFrames;
  clip.video_fps = kVideoFps;
  return clip;
}

// The frames the family's sampling keeps of the formula video, as HF's golden has them.
VideoClip golden_clip(const ModelConfig& cfg, const VideoProcessorConfig& vpre) {
  return clip_of(cfg, vpre, formula_frames(),
                 cfg.arch->sample_video_frames(kFrames, kVideoFps, vpre));
}

ModelLimits video_model_limits() {
  ModelLimits limits;
  limits.max_context = 512;
  limits.max_step_tokens = 256;
  limits.max_vision_patches = 1024;
  limits.max_images = 4;
  return limits;
}

struct Family {
  const char* dir;
  const char* model_type;
};

class FamilyVideo : public ::testing::TestWithParam<Family> {
 protected:
  void SetUp() override {
    dir_ = test::data_dir() + "/" + GetParam().dir;
    golden_ = std::make_unique<SafetensorsFile>(dir_ + "/golden_video.safetensors");
    meta_ = nlohmann::json::parse(read_text_file(dir_ + "/golden_video.json"));
    cfg_ = ModelConfig::from_file(dir_ + "/config.json");
    vpre_ = model_video_preprocessor(dir_, cfg_);
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_file(dir_ + "/tokenizer.json"));
    format_ = ChatFormat::from_dir(dir_);
  }
  HostTensor tensor(const std::string& name) const { return golden_->load(name); }

  VideoClip clip_of(const std::vector<ImageRGB8>& all, const std::vector<int64_t>& keep) const {
    return iris::clip_of(cfg_, vpre_, all, keep);
  }
  VideoClip golden_clip() const { return iris::golden_clip(cfg_, vpre_); }

  MediaPrompt prompt(const std::vector<ChatPart::Kind>& media, const std::string& text,
                     const std::vector<GridTHW>& images, const VideoClip& clip) const {
    const std::string rendered = format_.render({user_message(text, media)}, true);
    return encode_media_prompt(*tokenizer_, rendered, cfg_, images, {&clip});
  }

  std::string dir_;
  std::unique_ptr<SafetensorsFile> golden_;
  nlohmann::json meta_;
  ModelConfig cfg_;
  VideoProcessorConfig vpre_;
  std::unique_ptr<Tokenizer> tokenizer_;
  ChatFormat format_;
};

TEST_P(FamilyVideo, KeepsTheFramesHFSamples) {
  const std::vector<int64_t> keep = cfg_.arch->sample_video_frames(kFrames, kVideoFps, vpre_);
  const HostTensor want = tensor("sampled_indices");
  ASSERT_EQ(static_cast<int64_t>(keep.size()), want.numel());
  for (int64_t i = 0; i < want.numel(); ++i) EXPECT_EQ(keep[i], want.data<int64_t>()[i]) << i;
}

TEST_P(FamilyVideo, PixelValuesAndGridEqualHF) {
  const VideoClip clip = golden_clip();
  const HostTensor grid = tensor("video.video_grid_thw");
  for (int k = 0; k < 3; ++k) EXPECT_EQ(clip.grid_thw[k], grid.data<int64_t>()[k]) << k;
  const HostTensor want = tensor("video.pixel_values_videos");
  ASSERT_EQ(clip.pixel_values.dims(), want.dims());
  const float* a = clip.pixel_values.data<float>();
  const float* b = want.data<float>();
  int64_t differ = 0;
  for (int64_t i = 0; i < want.numel(); ++i) differ += a[i] != b[i];
  EXPECT_EQ(differ, 0) << "of " << want.numel() << " values";
}

// The same frames through a lossless file and the decoder: what iris generate --video reads.
TEST_P(FamilyVideo, ALosslessFileDecodesToTheSamePixelValues) {
  if (!video_decoding_available()) GTEST_SKIP() << "this build has no video decoding (OpenCV)";
  const fs::path file =
      fs::temp_directory_path() / ("iris_family_video_" + std::string(GetParam().dir) + "_" +
                                   std::to_string(::getpid()) + ".mkv");
  write_lossless_video(file.string(), formula_frames(), kVideoFps);
  const DecodedVideo d = decode_video(file.string(), [&](const VideoInfo& info) {
    return cfg_.arch->sample_video_frames(info.total_frames, info.fps, vpre_);
  });
  fs::remove(file);
  EXPECT_EQ(d.info.total_frames, kFrames);
  EXPECT_DOUBLE_EQ(d.info.fps, kVideoFps);
  const VideoClip from_file = clip_of(d.frames.empty() ? std::vector<ImageRGB8>{} : d.frames, [&] {
    std::vector<int64_t> all(d.frames.size());
    std::iota(all.begin(), all.end(), 0);
    return all;
  }());
  const HostTensor want = tensor("video.pixel_values_videos");
  ASSERT_EQ(from_file.pixel_values.dims(), want.dims());
  EXPECT_TRUE(std::equal(want.data<float>(), want.data<float>() + want.numel(),
                         from_file.pixel_values.data<float>()));
  EXPECT_EQ(d.indices, golden_clip().frame_indices);
}

class FamilyVideoModel : public FamilyVideo {
 protected:
  void SetUp() override {
    FamilyVideo::SetUp();
    backend_ = make_cpu_backend();
    model_ = std::make_unique<Qwen3VLModel>(*backend_, dir_, video_model_limits());
  }

  // `prefix`'s prompt ids, positions and deltas equal HF's; then the last logits (top 16 and
  // logsumexp within 1e-4) and the greedy ids.
  void check(const std::string& prefix, const MediaPrompt& p, const std::vector<float>& pixels,
             const std::vector<GridTHW>& grids) {
    const std::vector<int32_t> want_ids = ids_of(tensor(prefix + ".input_ids"));
    ASSERT_EQ(p.ids, want_ids) << prefix;
    const RopeIndex r = compute_rope_index(p.ids, p.runs, cfg_.image_token_id, cfg_.video_token_id);
    const HostTensor pos = tensor(prefix + ".position_ids");
    ASSERT_EQ(pos.numel(), static_cast<int64_t>(r.positions.size()));
    for (int64_t i = 0; i < pos.numel(); ++i)
      ASSERT_EQ(r.positions[i], pos.data<int64_t>()[i]) << prefix << " position " << i;
    EXPECT_EQ(r.delta, tensor(prefix + ".rope_deltas").data<int64_t>()[0]) << prefix;

    model_->encode_vision(pixels.data(), grids, p.runs);
    model_->prefill(p.ids);
    std::vector<float> last = model_->last_logits();
    const HostTensor top_ids = tensor(prefix + ".top16_ids");
    const HostTensor top_values = tensor(prefix + ".top16_values");
    std::vector<int32_t> order(last.size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 16, order.end(),
                      [&](int32_t a, int32_t b) { return last[a] > last[b]; });
    for (int k = 0; k < 16; ++k) {
      const float want = top_values.data<float>()[k];
      EXPECT_NEAR(last[top_ids.data<int64_t>()[k]], want, kRel * std::fabs(want) + kAbs)
          << prefix << " top " << k;
    }
    EXPECT_EQ(order[0], top_ids.data<int64_t>()[0]) << prefix;
    double s = 0;
    for (float v : last) s += std::exp(double(v) - last[order[0]]);
    const float lse = tensor(prefix + ".logsumexp").data<float>()[0];
    EXPECT_NEAR(last[order[0]] + std::log(s), lse, kRel * std::fabs(lse) + kAbs) << prefix;

    std::vector<int32_t> greedy;
    for (size_t i = 0; i < meta_[prefix + ".greedy_ids"].size(); ++i) {
      if (i > 0) last = model_->last_logits();
      greedy.push_back(
          static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin()));
      model_->decode(greedy.back());
    }
    EXPECT_EQ(greedy, meta_[prefix + ".greedy_ids"].get<std::vector<int32_t>>()) << prefix;
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Qwen3VLModel> model_;
};

TEST_P(FamilyVideoModel, AVideoPromptMatchesHF) {
  const VideoClip clip = golden_clip();
  const MediaPrompt p = prompt({ChatPart::Kind::video}, "Describe this video.", {}, clip);
  ASSERT_EQ(p.media_order.size(), 1u);
  std::vector<float> pixels(clip.pixel_values.data<float>(),
                            clip.pixel_values.data<float>() + clip.pixel_values.numel());
  check("video", p, pixels, {clip.grid_thw});
}

TEST_P(FamilyVideoModel, AnImageAndAVideoInOnePromptMatchHF) {
  const VideoClip clip = golden_clip();
  const PreprocessorConfig pre = model_preprocessor(dir_, cfg_);
  const PreprocessedImage image = preprocess_image(load_image(dir_ + "/images/image0.png"), pre);
  const HostTensor image_grid = tensor("mixed.image_grid_thw");
  for (int k = 0; k < 3; ++k) ASSERT_EQ(image.grid_thw[k], image_grid.data<int64_t>()[k]);
  const MediaPrompt p = prompt({ChatPart::Kind::image, ChatPart::Kind::video},
                               "Compare the picture with the video.", {image.grid_thw}, clip);
  // Pixel rows in the prompt's order: the image, then the video.
  ASSERT_EQ(p.media_order.size(), 2u);
  EXPECT_FALSE(p.media_order[0].video);
  EXPECT_TRUE(p.media_order[1].video);
  std::vector<float> pixels(image.pixel_values.data<float>(),
                            image.pixel_values.data<float>() + image.pixel_values.numel());
  pixels.insert(pixels.end(), clip.pixel_values.data<float>(),
                clip.pixel_values.data<float>() + clip.pixel_values.numel());
  check("mixed", p, pixels, {image.grid_thw, clip.grid_thw});
}

// The video on CUDA (bf16 weights and activations) and through vision graphs, on the CPU too with
// the recording stand-in: the graphs' calls replay the padded eager call bit for bit, and on a GPU
// the last logits keep the bf16 rules of the Qwen3-VL CUDA goldens (every HF top-16 logit within
// 3% + 0.05; HF's top-1 ours wherever HF's first two are more than twice that apart) and the
// greedy ids of such clear margins follow.
class FamilyVideoDevice : public ::testing::TestWithParam<std::tuple<Family, bool>> {
 protected:
  void SetUp() override {
    cuda_ = std::get<1>(GetParam());
    if (cuda_ && !cuda_available()) GTEST_SKIP() << "no GPU";
    dir_ = test::data_dir() + "/" + std::get<0>(GetParam()).dir;
    golden_ = std::make_unique<SafetensorsFile>(dir_ + "/golden_video.safetensors");
    const ModelConfig cfg = ModelConfig::from_file(dir_ + "/config.json");
    clip_ = golden_clip(cfg, model_video_preprocessor(dir_, cfg));
    pixels_.assign(clip_.pixel_values.data<float>(),
                   clip_.pixel_values.data<float>() + clip_.pixel_values.numel());
    backend_ = cuda_ ? make_cuda_backend(0) : make_cpu_backend();
    model_ = std::make_unique<Qwen3VLModel>(*backend_, dir_, video_model_limits());
  }
  GraphConfigs graph_configs() const {
    GraphConfigs c = parse_graph_configs({{"cuda_graph_impl", "local"},
                                          {"inference_cuda_graph_scope", "block"},
                                          {"cuda_graph_warmup_steps", "1"},
                                          {"vision_cuda_graph_impl", "local"},
                                          {"vision_inference_cuda_graph_scope", "block"},
                                          {"max_vision_cuda_graph_seq_length", "1024"},
                                          {"vision_cuda_graph_buckets", "256,512,1024"},
                                          {"vision_cuda_graph_overflow", "error"}});
    GraphModelTraits traits;
    traits.has_deepstack = !model_->config().vision.deepstack_visual_indexes.empty();
    traits.spatial_merge_size = model_->config().vision.spatial_merge_size;
    finalize_graph_configs(c, traits);
    return c;
  }
  bool cuda_ = false;
  std::string dir_;
  std::unique_ptr<SafetensorsFile> golden_;
  VideoClip clip_;
  std::vector<float> pixels_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Qwen3VLModel> model_;
};

TEST_P(FamilyVideoDevice, VideoThroughVisionGraphsEqualsThePaddedEagerCallBitForBit) {
  VisionEncoder& enc = model_->vision();
  const GraphConfigs cfg = graph_configs();
  const std::vector<GridTHW> grids{clip_.grid_thw};
  const PaddedVisionCall call =
      plan_padded_vision_call(model_->config().vision, cfg.vision, grids, enc.max_segments());
  ASSERT_TRUE(call.bucket.has_value());
  // Frame pairs are segments of their own: a video of several pairs holds several.
  ASSERT_GE(clip_.grid_thw[0], 2);
  enc.upload(pixels_.data(), grids, *call.bucket);
  const int64_t real = call.n_patches / model_->config().vision.merge_unit();
  const auto eager = enc.run(*call.bucket, enc.max_segments());
  const std::vector<float> want = read_f32(*backend_, eager.embeds.slice(0, real));
  std::vector<std::vector<float>> want_deepstack;
  for (const Tensor& d : eager.deepstack)
    want_deepstack.push_back(read_f32(*backend_, d.slice(0, real)));
  VisionCudaGraphHelper h(*model_, split_stages(model_->config(), 1)[0], cfg);
  for (int call_no = 0; call_no < 4; ++call_no) {  // warm-up, capture, replay, replay
    const auto out = h.encode(pixels_.data(), grids);
    EXPECT_EQ(h.last_bucket(), *call.bucket);
    EXPECT_EQ(read_f32(*backend_, out.embeds), want) << "call " << call_no;
    ASSERT_EQ(out.deepstack.size(), want_deepstack.size());
    for (size_t k = 0; k < want_deepstack.size(); ++k)
      EXPECT_EQ(read_f32(*backend_, out.deepstack[k]), want_deepstack[k]) << "call " << call_no;
  }
  EXPECT_TRUE(h.graphs_created(GraphSet::vision));
}

TEST_P(FamilyVideoDevice, AVideoPromptOnCudaKeepsTheBf16RulesOfHF) {
  if (!cuda_) GTEST_SKIP() << "the CPU's fp32 video goldens are FamilyVideoModel";
  const ModelConfig& cfg = model_->config();
  const std::string rendered = ChatFormat::from_dir(dir_).render(
      {user_message("Describe this video.", {ChatPart::Kind::video})}, true);
  const Tokenizer tokenizer = Tokenizer::from_file(dir_ + "/tokenizer.json");
  const VideoClip& clip = clip_;
  const MediaPrompt p = encode_media_prompt(tokenizer, rendered, cfg, {}, {&clip});
  ASSERT_EQ(p.ids, ids_of(golden_->load("video.input_ids")));
  // Eager, then through the graph helper: its warm-up, its capture and a replay.
  VisionCudaGraphHelper h(*model_, split_stages(cfg, 1)[0], graph_configs());
  for (int run = 0; run < 4; ++run) {
    if (run == 1) model_->attach_graphs(&h);
    const std::string what = run == 0 ? "eager" : "graph helper call " + std::to_string(run);
    model_->encode_vision(pixels_.data(), {clip.grid_thw}, p.runs);
    model_->prefill(p.ids);
    std::vector<float> last = model_->last_logits();
    const HostTensor top_ids = golden_->load("video.top16_ids");
    const HostTensor top = golden_->load("video.top16_values");
    auto tol = [](float v) { return 0.03f * std::fabs(v) + 0.05f; };
    for (int k = 0; k < 16; ++k) {
      const float want = top.data<float>()[k];
      EXPECT_NEAR(last[top_ids.data<int64_t>()[k]], want, tol(want)) << what << " top " << k;
    }
    const float* v = top.data<float>();
    const int32_t ours =
        static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
    if (v[0] - v[1] > 2 * tol(v[0])) EXPECT_EQ(ours, top_ids.data<int64_t>()[0]) << what;
  }
  EXPECT_TRUE(h.graphs_created(GraphSet::vision));
  model_->detach_graphs(&h);
}

const Family kFamilies[] = {
    {"qwen3vl-tiny", "qwen3_vl"}, {"qwen25vl-tiny", "qwen2_5_vl"}, {"qwen2vl-tiny", "qwen2_vl"}};
std::string family_name(const ::testing::TestParamInfo<Family>& info) {
  return info.param.model_type;
}
INSTANTIATE_TEST_SUITE_P(Families, FamilyVideo, ::testing::ValuesIn(kFamilies), family_name);
INSTANTIATE_TEST_SUITE_P(Families, FamilyVideoModel, ::testing::ValuesIn(kFamilies), family_name);
INSTANTIATE_TEST_SUITE_P(Families, FamilyVideoDevice,
                         ::testing::Combine(::testing::ValuesIn(kFamilies), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<Family, bool>>& i) {
                           return std::string(std::get<0>(i.param).model_type) +
                                  (std::get<1>(i.param) ? "_cuda" : "_cpu");
                         });

}  // namespace
}  // namespace iris
