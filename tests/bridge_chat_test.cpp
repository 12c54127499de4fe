// Multi-turn chat with the KV cache kept between turns: every turn must give the tokens of a
// one-shot generate() over the whole conversation, whose prompt is built here independently (the
// earlier replies as the ids generated, the chat template spelled out). On a GPU (skipped without
// one) the chat runs with CUDA graphs: bit for bit the eager chat with decode graphs, and within
// bf16 tolerance of the one-shot prefills with iris generate's decode and vision graphs.
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "bridge/architecture.h"
#include "bridge/chat_prompt.h"
#include "bridge/chat_session.h"
#include "bridge/model_config.h"
#include "bridge/pipeline_stage.h"
#include "bridge/vision_cuda_graph_helper.h"
#include "model_test_util.h"
#include "test_util.h"
#include "video_test_util.h"
#include "vision/image.h"
#include "vision/preprocess.h"
#include "vision/video.h"

namespace iris {
namespace {

using test::grids_of;

const std::string kSystem = "You are a terse assistant.";
const std::string kText1 = "Write one sentence about CUDA graphs.";
const std::string kText2 = "What is in this picture?";
const std::string kText3 = "Describe the picture in a few words.";

ModelLimits chat_limits(int64_t context = 1024) {
  ModelLimits l;
  l.max_context = context;
  l.max_step_tokens = std::min<int64_t>(context, 256);
  l.max_vision_patches = 1024;
  l.max_images = 4;
  return l;
}

// One image of the golden pair: its pixel rows and grid.
struct Image {
  std::vector<float> pixels;
  GridTHW grid;
};

std::vector<Image> golden_images() {
  test::Golden g;
  const HostTensor pv = g.tensor("pixel_values");
  const std::vector<GridTHW> grids = grids_of(g.tensor("image_grid_thw"));
  const int64_t dim = pv.dim(1);
  std::vector<Image> out;
  int64_t row = 0;
  for (const GridTHW& grid : grids) {
    const int64_t rows = grid[0] * grid[1] * grid[2];
    out.push_back(
        {std::vector<float>(pv.data<float>() + row * dim, pv.data<float>() + (row + rows) * dim),
         grid});
    row += rows;
  }
  return out;
}

class ChatFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_file(test::tokenizer_path()));
    images_ = golden_images();
    ASSERT_EQ(images_.size(), 2u);
    settings_.max_new_tokens = 12;
    settings_.sampling.temperature = 0;
    settings_.stop_ids = {tokenizer_->token_id("<|im_end|>"),
                          tokenizer_->token_id("<|endoftext|>")};
    format_ = ChatFormat::from_dir(test::fixture_dir());
    ASSERT_TRUE(format_.has_template());
  }

  std::vector<int32_t> encode(const std::string& s) const { return tokenizer_->encode(s); }

  // The chat template written out for one user message with one image before the text.
  std::string user_turn_with_image(const GridTHW& g, const std::string& text) const {
    std::string s = "<|im_start|>user\n<|vision_start|>";
    for (int64_t i = 0; i < g[0] * g[1] * g[2] / 4; ++i) s += "<|image_pad|>";
    return s + "<|vision_end|>" + text + "<|im_end|>\n<|im_start|>assistant\n";
  }

  // The one-shot prompt after `before` and `reply`: the reply closed as the template closes an
  // assistant message, then the next user turn.
  std::vector<int32_t> continued(std::vector<int32_t> before, const GenerationResult& reply,
                                 const std::string& next_turn) const {
    std::vector<int32_t> content = reply.tokens;
    if (reply.stopped) content.pop_back();
    before.insert(before.end(), content.begin(), content.end());
    before.push_back(tokenizer_->token_id("<|im_end|>"));
    for (const std::string& piece : {std::string("\n"), next_turn})
      for (int32_t id : encode(piece)) before.push_back(id);
    return before;
  }

  GenerationResult one_shot(Qwen3VLModel& m, const std::vector<int32_t>& prompt,
                            const Image* image = nullptr) const {
    GenerationRequest req = settings_;
    req.prompt_ids = prompt;
    if (image != nullptr) {
      req.pixel_values = image->pixels.data();
      req.grids = {image->grid};
    }
    return generate(m, req);
  }

  UserMessage message(const std::string& text, const Image* image = nullptr) const {
    UserMessage m;
    m.text = text;
    if (image != nullptr) {
      m.pixel_values = image->pixels.data();
      m.grids = {image->grid};
    }
    return m;
  }

  // Three turns (the second with an image), /clear, a fourth with the other image: each turn's
  // tokens against a one-shot run of the whole conversation on `one_shot_model`.
  void expect_turns_equal_one_shot(Qwen3VLModel& chat_model, Qwen3VLModel& one_shot_model) {
    ChatSession chat(chat_model, *tokenizer_, format_, kSystem, settings_);
    const std::vector<int32_t> p1 =
        encode("<|im_start|>system\n" + kSystem + "<|im_end|>\n<|im_start|>user\n" + kText1 +
               "<|im_end|>\n<|im_start|>assistant\n");
    const ChatReply r1 = chat.send(message(kText1));
    const GenerationResult o1 = one_shot(one_shot_model, p1);
    ASSERT_FALSE(o1.tokens.empty());
    EXPECT_EQ(r1.result.tokens, o1.tokens) << "turn 1";

    const std::vector<int32_t> p2 =
        continued(p1, o1, user_turn_with_image(images_[1].grid, kText2));
    EXPECT_EQ(static_cast<int64_t>(chat.turn_ids({images_[1].grid}, kText2).size()) +
                  chat.cached_tokens(),
              static_cast<int64_t>(p2.size()));
    // Turn 1 cached everything but its last sampled token.
    EXPECT_EQ(chat.cached_tokens(), static_cast<int64_t>(p1.size() + o1.tokens.size()) - 1);
    const int64_t cached = chat.cached_tokens();
    const ChatReply r2 = chat.send(message(kText2, &images_[1]));
    // The cache is continued, not refilled: turn 2 prefilled only what turn 1 left out.
    EXPECT_EQ(r2.result.timings.prompt_tokens, static_cast<int64_t>(p2.size()) - cached);
    const GenerationResult o2 = one_shot(one_shot_model, p2, &images_[1]);
    EXPECT_EQ(r2.result.tokens, o2.tokens) << "turn 2 (image)";
    ASSERT_GE(chat.conversation().size(), p2.size());
    EXPECT_EQ(std::vector<int32_t>(chat.conversation().begin(),
                                   chat.conversation().begin() + static_cast<int64_t>(p2.size())),
              p2);

    const std::vector<int32_t> p3 =
        continued(p2, o2, "<|im_start|>user\n" + kText3 + "<|im_end|>\n<|im_start|>assistant\n");
    const ChatReply r3 = chat.send(message(kText3));
    EXPECT_EQ(r3.result.tokens, one_shot(one_shot_model, p3, &images_[1]).tokens)
        << "turn 3 (text after an image turn)";

    chat.clear();
    EXPECT_EQ(chat.cached_tokens(), 0);
    EXPECT_EQ(chat_model.n_past(), 0);
    const std::vector<int32_t> p4 = encode("<|im_start|>system\n" + kSystem + "<|im_end|>\n" +
                                           user_turn_with_image(images_[0].grid, kText3));
    const ChatReply r4 = chat.send(message(kText3, &images_[0]));
    EXPECT_EQ(r4.result.timings.prompt_tokens, static_cast<int64_t>(p4.size()));
    EXPECT_EQ(r4.result.tokens, one_shot(one_shot_model, p4, &images_[0]).tokens) << "after /clear";
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<Image> images_;
  GenerationRequest settings_;
  ChatFormat format_;  // the fixture's own chat template (Qwen3-VL Instruct's)
};

// The running M-RoPE position at a text boundary is all a continuation needs: the positions of a
// conversation computed in one walk equal those of its turns computed one after the other.
TEST(ChatRope, TurnsContinueThePositionsOfOneWalk) {
  const int32_t pad = 9;
  const std::vector<GridTHW> grids = {{1, 4, 6}, {1, 8, 2}};
  // text, image (6 pads), text | text, image (4 pads), text
  std::vector<int32_t> first = {1, 2, 3, pad, pad, pad, pad, pad, pad, 4, 5};
  std::vector<int32_t> second = {6, 7, pad, pad, pad, pad, 8};
  std::vector<int32_t> all = first;
  all.insert(all.end(), second.begin(), second.end());
  const RopeIndex whole = compute_rope_index(all, image_runs(grids, pad, 2), pad, -1);
  const RopeIndex a = compute_rope_index(first, image_runs({grids[0]}, pad, 2), pad, -1);
  const int64_t next = static_cast<int64_t>(first.size()) + a.delta;  // max + 1
  const RopeIndex b = compute_rope_index(second, image_runs({grids[1]}, pad, 2), pad, -1, next);
  const int64_t L = static_cast<int64_t>(all.size()), L1 = static_cast<int64_t>(first.size()),
                L2 = static_cast<int64_t>(second.size());
  for (int axis = 0; axis < 3; ++axis) {
    for (int64_t i = 0; i < L1; ++i)
      EXPECT_EQ(a.positions[axis * L1 + i], whole.positions[axis * L + i]) << axis << " " << i;
    for (int64_t i = 0; i < L2; ++i)
      EXPECT_EQ(b.positions[axis * L2 + i], whole.positions[axis * L + L1 + i])
          << axis << " " << L1 + i;
  }
  // Decoding after the second turn: absolute row + delta, the same from either computation.
  EXPECT_EQ(L1 + L2 + (b.delta - L1), L + whole.delta);
  // An image's pads take a row each but share positions, so positions fall behind the rows: a
  // continuation must start from the positions, not from the row count.
  EXPECT_LT(next, L1);
}

TEST_F(ChatFixture, TurnsGiveTheTokensOfOneShotRunsOverTheWholeConversation) {
  auto be = make_cpu_backend();
  Qwen3VLModel chat_model(*be, test::fixture_dir(), chat_limits());
  Qwen3VLModel one_shot_model(*be, test::fixture_dir(), chat_limits());
  expect_turns_equal_one_shot(chat_model, one_shot_model);
}

// A session that sends its media as bytes (what iris generate -cnv does) gives the turns of one
// that sends the host's pixel rows bit for bit: the same tokens and prompt logits, through an image
// turn, a text turn after it and an image after a /clear. A message of the other kind is refused.
TEST_F(ChatFixture, ImagesSentAsBytesGiveTheTurnsOfHostRowsBitForBit) {
  auto be = make_cpu_backend();
  Qwen3VLModel rows_model(*be, test::fixture_dir(), chat_limits());
  Qwen3VLModel bytes_model(*be, test::fixture_dir(), chat_limits());
  const PreprocessorConfig pre =
      PreprocessorConfig::from_file(test::fixture_dir() + "/preprocessor_config.json");
  const std::vector<ImageRGB8> decoded = {load_image(test::fixture_dir() + "/images/image0.png"),
                                          load_image(test::fixture_dir() + "/images/image1.png")};
  const PreprocessedBatch rows = preprocess_images(decoded, pre);
  const SizedImages sized = size_images(decoded, pre);
  ASSERT_EQ(rows.grid_thw, sized.grid_thw);
  const int64_t cols = rows.pixel_values.dim(1);
  const float* first_rows = rows.pixel_values.data<float>();
  const float* second_rows = first_rows + count_patches({rows.grid_thw[0]}) * cols;

  GenerationRequest settings = settings_;
  settings.keep_prompt_logits = true;
  ChatSession with_rows(rows_model, *tokenizer_, format_, kSystem, settings);
  ChatSession with_bytes(bytes_model, *tokenizer_, format_, kSystem, settings);
  const PixelTable table = pixel_table(pre);
  with_bytes.send_pixels_as_bytes(table, table);

  struct Turn {
    std::string text;
    int image;  // -1: none
    bool clear_first;
  };
  for (const Turn& turn : {Turn{kText1, -1, false}, Turn{kText2, 1, false}, Turn{kText3, -1, false},
                           Turn{kText3, 0, true}}) {
    SCOPED_TRACE(turn.text + " image " + std::to_string(turn.image));
    if (turn.clear_first) {
      with_rows.clear();
      with_bytes.clear();
    }
    UserMessage as_rows, as_bytes;
    as_rows.text = as_bytes.text = turn.text;
    if (turn.image >= 0) {
      as_rows.pixel_values = turn.image == 0 ? first_rows : second_rows;
      as_rows.grids = as_bytes.grids = {sized.grid_thw[static_cast<size_t>(turn.image)]};
      as_bytes.images = {&sized.images[static_cast<size_t>(turn.image)]};
    }
    const ChatReply a = with_rows.send(as_rows);
    const ChatReply b = with_bytes.send(as_bytes);
    ASSERT_FALSE(a.result.tokens.empty());
    EXPECT_EQ(b.result.tokens, a.result.tokens);
    ASSERT_FALSE(a.result.prompt_logits.empty());
    EXPECT_EQ(b.result.prompt_logits, a.result.prompt_logits);
  }

  UserMessage bytes_to_rows;
  bytes_to_rows.text = kText2;
  bytes_to_rows.grids = {sized.grid_thw[0]};
  bytes_to_rows.images = {&sized.images[0]};
  EXPECT_NE(test::error_of([&] { with_rows.send(bytes_to_rows); }).find("send_pixels_as_bytes"),
            std::string::npos);
  UserMessage rows_to_bytes;
  rows_to_bytes.text = kText2;
  rows_to_bytes.grids = {sized.grid_thw[0]};
  rows_to_bytes.pixel_values = first_rows;
  EXPECT_NE(test::error_of([&] { with_bytes.send(rows_to_bytes); }).find("one per grid"),
            std::string::npos);
}

// The repetition penalty sees the whole conversation, as the one-shot run's prompt.
TEST_F(ChatFixture, RepetitionPenaltyCountsTheEarlierTurns) {
  settings_.sampling.repetition_penalty = 1.5f;
  auto be = make_cpu_backend();
  Qwen3VLModel chat_model(*be, test::fixture_dir(), chat_limits());
  Qwen3VLModel one_shot_model(*be, test::fixture_dir(), chat_limits());
  expect_turns_equal_one_shot(chat_model, one_shot_model);
}

// The logits after a continued prefill are those of the whole conversation prefilled at once.
TEST_F(ChatFixture, ContinuedPrefillLogitsEqualTheWholePrefill) {
  settings_.keep_prompt_logits = true;
  auto be = make_cpu_backend();
  Qwen3VLModel chat_model(*be, test::fixture_dir(), chat_limits());
  Qwen3VLModel one_shot_model(*be, test::fixture_dir(), chat_limits());
  ChatSession chat(chat_model, *tokenizer_, format_, "", settings_);
  const ChatReply r1 = chat.send(message(kText1));
  const std::vector<int32_t> p2 =
      continued(build_generation_prompt(*tokenizer_, format_, {}, kText1, ""), r1.result,
                user_turn_with_image(images_[0].grid, kText2));
  const ChatReply r2 = chat.send(message(kText2, &images_[0]));
  const GenerationResult o2 = one_shot(one_shot_model, p2, &images_[0]);
  ASSERT_EQ(r2.result.prompt_logits.size(), o2.prompt_logits.size());
  float worst = 0, scale = 0;
  for (size_t i = 0; i < o2.prompt_logits.size(); ++i) {
    worst = std::max(worst, std::fabs(r2.result.prompt_logits[i] - o2.prompt_logits[i]));
    scale = std::max(scale, std::fabs(o2.prompt_logits[i]));
  }
  EXPECT_GT(scale, 0.1f);
  EXPECT_LE(worst, 1e-4f * scale + 1e-5f);
  EXPECT_EQ(chat_model.next_position(), one_shot_model.next_position());
}

// A reply that the caller's stop cuts short (a Ctrl-C, a reverse prompt) stays in the conversation
// as generated, as one cut short by -n does: the next turn gives the tokens of a one-shot run over
// the conversation with that partial reply.
TEST_F(ChatFixture, AReplyCutShortByStopStaysInTheConversationAsGenerated) {
  auto be = make_cpu_backend();
  Qwen3VLModel chat_model(*be, test::fixture_dir(), chat_limits());
  Qwen3VLModel one_shot_model(*be, test::fixture_dir(), chat_limits());
  ChatSession chat(chat_model, *tokenizer_, format_, "", settings_);
  const std::vector<int32_t> p1 = build_generation_prompt(*tokenizer_, format_, {}, kText1, "");
  const GenerationResult full = one_shot(one_shot_model, p1);
  ASSERT_GE(full.tokens.size(), 6u);
  int asked = 0;
  const ChatReply r1 = chat.send(message(kText1), {}, [&] { return ++asked == 5; });
  EXPECT_TRUE(r1.result.halted);
  EXPECT_FALSE(r1.result.stopped);
  EXPECT_FALSE(r1.context_full);
  ASSERT_EQ(r1.result.tokens.size(), 5u);
  EXPECT_EQ(r1.result.tokens, std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + 5));
  const std::vector<int32_t> p2 =
      continued(p1, r1.result, user_turn_with_image(images_[0].grid, kText2));
  const ChatReply r2 = chat.send(message(kText2, &images_[0]));
  EXPECT_FALSE(r2.result.halted);
  EXPECT_EQ(r2.result.tokens, one_shot(one_shot_model, p2, &images_[0]).tokens);
  // A stop that never says so leaves the reply whole; one asked is never asked after the last
  // token, so a reply that -n ends is not taken for a stopped one.
  int calls = 0;
  GenerationRequest req = settings_;
  req.prompt_ids = p1;
  req.max_new_tokens = 4;
  req.stop_ids.clear();
  const GenerationResult unstopped = generate(one_shot_model, req, {}, [&] {
    ++calls;
    return false;
  });
  EXPECT_EQ(unstopped.tokens.size(), 4u);
  EXPECT_FALSE(unstopped.halted);
  EXPECT_EQ(calls, 3);
}

TEST_F(ChatFixture, AMessageBeyondTheContextIsRefusedAndTheChatGoesOn) {
  auto be = make_cpu_backend();
  const std::vector<int32_t> p1 =
      build_generation_prompt(*tokenizer_, format_, {}, kText1, kSystem);
  // Room for the first prompt and 5 reply tokens: the reply stops there.
  const int64_t context = static_cast<int64_t>(p1.size()) + 5;
  Qwen3VLModel chat_model(*be, test::fixture_dir(), chat_limits(context));
  Qwen3VLModel one_shot_model(*be, test::fixture_dir(), chat_limits());
  ChatSession chat(chat_model, *tokenizer_, format_, kSystem, settings_);
  const ChatReply r1 = chat.send(message(kText1));
  EXPECT_TRUE(r1.context_full);
  const GenerationResult o1 = one_shot(one_shot_model, p1);
  ASSERT_GT(o1.tokens.size(), 5u) << "the fixture stops early; the cut is not exercised";
  EXPECT_EQ(r1.result.tokens, std::vector<int32_t>(o1.tokens.begin(), o1.tokens.begin() + 5));

  const std::vector<int32_t> before = chat.conversation();
  const int64_t cached = chat.cached_tokens();
  try {
    chat.send(message(kText2));
    ADD_FAILURE() << "a message beyond the context was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("/clear"), std::string::npos) << what;
    EXPECT_NE(what.find(std::to_string(context)), std::string::npos) << what;
  }
  EXPECT_EQ(chat.conversation(), before);
  EXPECT_EQ(chat.cached_tokens(), cached);
  EXPECT_EQ(chat_model.n_past(), cached);

  chat.clear();
  const ChatReply again = chat.send(message(kText1));
  EXPECT_EQ(again.result.tokens, r1.result.tokens);

  // A first message larger than the whole context says to raise it.
  Qwen3VLModel tiny(*be, test::fixture_dir(), chat_limits(16));
  ChatSession small(tiny, *tokenizer_, format_, kSystem, settings_);
  try {
    small.send(message(kText1));
    ADD_FAILURE() << "a message larger than the context was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--ctx-size"), std::string::npos) << e.what();
  }
}

// Qwen3-VL Thinking's template rewrites a reply once another question follows (it keeps only
// what comes after </think>, and the generation prompt's "<think>\n" is gone): each turn still
// gives the tokens of a one-shot run over the template's rendering of the whole conversation,
// built here from the template alone, and the chat refills its cache only from the rewritten
// reply on.
TEST_F(ChatFixture, ATemplateThatRewritesEarlierRepliesStillGivesOneShotTokens) {
  const ChatFormat thinking = ChatFormat::from_file(
      test::data_dir() + "/chat_templates/qwen3_vl_thinking.jinja", "chat template");
  auto be = make_cpu_backend();
  Qwen3VLModel chat_model(*be, test::fixture_dir(), chat_limits());
  Qwen3VLModel one_shot_model(*be, test::fixture_dir(), chat_limits());
  ChatSession chat(chat_model, *tokenizer_, thinking, kSystem, settings_);
  std::vector<ChatMessage> conversation = {{"system", {ChatPart::make_text(kSystem)}}};
  std::vector<GridTHW> grids;
  std::vector<float> pixels;
  const std::vector<UserMessage> turns = {message(kText1), message(kText2, &images_[1]),
                                          message(kText3)};
  for (size_t t = 0; t < turns.size(); ++t) {
    SCOPED_TRACE("turn " + std::to_string(t + 1));
    // Where the last reply's turn starts: the conversation before it, rendered without a
    // generation prompt.
    const std::vector<ChatMessage> before_reply(conversation.begin(),
                                                conversation.end() - (t > 0 ? 1 : 0));
    const int64_t kept = static_cast<int64_t>(
        encode_chat_text(*tokenizer_, thinking.render(before_reply, false), grids, 2).size());
    conversation.push_back(user_message(turns[t].text, turns[t].grids.size()));
    if (!turns[t].grids.empty()) {
      grids.push_back(images_[1].grid);
      pixels.insert(pixels.end(), images_[1].pixels.begin(), images_[1].pixels.end());
    }
    const std::string text = thinking.render(conversation, true);
    const std::string generation_prompt = "<|im_start|>assistant\n<think>\n";
    ASSERT_EQ(text.substr(text.size() - generation_prompt.size()), generation_prompt);
    GenerationRequest req = settings_;
    req.prompt_ids = encode_chat_text(*tokenizer_, text, grids, 2);
    req.pixel_values = pixels.empty() ? nullptr : pixels.data();
    req.grids = grids;
    GenerationResult want = generate(one_shot_model, req);
    const ChatReply got = chat.send(turns[t]);
    EXPECT_EQ(got.result.tokens, want.tokens);
    if (t > 0) {
      EXPECT_EQ(got.result.timings.prompt_tokens,
                static_cast<int64_t>(req.prompt_ids.size()) - kept)
          << "the chat should refill from the rewritten reply on";
    }
    if (want.stopped) want.tokens.pop_back();
    conversation.push_back({"assistant", {ChatPart::make_text(tokenizer_->decode(want.tokens))}});
  }
  // What the chat holds is the template's rendering of the whole conversation.
  EXPECT_EQ(chat.conversation_text(), thinking.render(conversation, false));
  EXPECT_EQ(chat.conversation(),
            encode_chat_text(*tokenizer_, thinking.render(conversation, false), grids, 2));
  EXPECT_LE(chat.cached_tokens(), chat_model.n_past());
}

// Generating through the model behind the chat's back is detected, not built upon.
TEST_F(ChatFixture, AModelUsedOutsideTheChatIsRefused) {
  auto be = make_cpu_backend();
  Qwen3VLModel m(*be, test::fixture_dir(), chat_limits());
  ChatSession chat(m, *tokenizer_, format_, "", settings_);
  const ChatReply r = chat.send(message(kText1));
  m.decode(r.result.tokens.back());
  EXPECT_THROW(chat.send(message(kText3)), Error);
}

// ---- Video ----

// A chat whose first message carries a video, then one with an image, then text: each turn gives
// the tokens of a one-shot generate() over the whole conversation, whose prompt is the template's
// rendering expanded as a one-shot video prompt (encode_media_prompt: Qwen3-VL's per-slice
// timestamps, Qwen2.5-VL's time-scaled runs), built here from the earlier replies' ids; the video
// is encoded once, by the turn that brings it.
class ChatVideo : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    dir_ = test::data_dir() + "/" + GetParam();
    cfg_ = ModelConfig::from_file(dir_ + "/config.json");
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::from_file(dir_ + "/tokenizer.json"));
    format_ = ChatFormat::from_dir(dir_);
    settings_.max_new_tokens = 8;
    settings_.sampling.temperature = 0;
    settings_.stop_ids = {tokenizer_->token_id("<|im_end|>"),
                          tokenizer_->token_id("<|endoftext|>")};
    // As iris generate samples: the random tiny models would otherwise pick padding rows.
    settings_.sampleable = sampleable_ids(*tokenizer_, cfg_.text.vocab_size);
  }

  // tools/make_video_golden.py's formula video (30 frames of 140x100 at 12 fps), its frames kept
  // and preprocessed as the family's video processor does.
  VideoClip formula_clip() const {
    constexpr int kFrames = test::kFormulaFrames, kHeight = test::kFormulaHeight,
                  kWidth = test::kFormulaWidth;
    const VideoProcessorConfig vpre = model_video_preprocessor(dir_, cfg_);
    const std::vector<int64_t> keep =
        cfg_.arch->sample_video_frames(kFrames, test::kFormulaFps, vpre);
    std::vector<ImageRGB8> frames;
    for (int64_t f : keep) frames.push_back(test::formula_frame(f));
    const ResizedSize size =
        cfg_.arch->video_frame_size(static_cast<int64_t>(frames.size()), kHeight, kWidth, vpre);
    VideoClip clip = preprocess_video(frames, size, vpre);
    clip.frame_indices = keep;
    clip.total_frames = kFrames;
    clip.video_fps = test::kFormulaFps;
    return clip;
  }

  ModelLimits limits() const {
    ModelLimits l;
    l.max_context = 1024;
    l.max_step_tokens = 256;
    l.max_vision_patches = 2048;
    l.max_images = 8;
    return l;
  }

  std::string dir_;
  ModelConfig cfg_;
  std::unique_ptr<Tokenizer> tokenizer_;
  ChatFormat format_;
  GenerationRequest settings_;
};

TEST_P(ChatVideo, TurnsAfterAVideoGiveTheTokensOfOneShotRuns) {
  const VideoClip clip = formula_clip();
  ASSERT_GE(clip.grid_thw[0], 2) << "the video should have several frame pairs";
  const PreprocessedImage image =
      preprocess_image(load_image(dir_ + "/images/image0.png"), model_preprocessor(dir_, cfg_));
  auto be = make_cpu_backend();
  Qwen3VLModel chat_model(*be, dir_, limits());
  Qwen3VLModel one_shot_model(*be, dir_, limits());
  ChatSession chat(chat_model, *tokenizer_, format_, "", settings_);
  const std::string text1 = "Describe this video.", text2 = "<__media__>What is in this picture?",
                    text3 = "Say it again.";

  // Turn 1: the video, as iris generate --video renders and expands it.
  UserMessage m1;
  m1.text = text1;
  m1.videos = {&clip};
  m1.media = {ChatPart::Kind::video};
  std::vector<ChatMessage> conversation = {user_message(text1, m1.media)};
  const MediaPrompt mp1 =
      encode_media_prompt(*tokenizer_, format_.render(conversation, true), cfg_, {}, {&clip});
  EXPECT_EQ(chat.turn_ids(m1), mp1.ids);
  GenerationRequest req = settings_;
  req.prompt_ids = mp1.ids;
  req.runs = mp1.runs;
  std::vector<float> pixels(clip.pixel_values.data<float>(),
                            clip.pixel_values.data<float>() + clip.pixel_values.numel());
  req.pixel_values = pixels.data();
  req.grids = {clip.grid_thw};
  const GenerationResult o1 = generate(one_shot_model, req);
  const ChatReply r1 = chat.send(m1);
  ASSERT_FALSE(o1.tokens.empty());
  EXPECT_EQ(r1.result.tokens, o1.tokens) << "turn 1 (video)";
  EXPECT_EQ(r1.result.timings.image_patches, count_patches({clip.grid_thw}));

  // The one-shot prompt goes on with the reply's ids, closed, and the next user turn.
  auto continue_with = [&](const GenerationResult& reply, const std::string& next_turn) {
    std::vector<int32_t> content = reply.tokens;
    if (reply.stopped) content.pop_back();
    req.prompt_ids.insert(req.prompt_ids.end(), content.begin(), content.end());
    const std::vector<int32_t> rest =
        tokenizer_->encode("<|im_end|>\n<|im_start|>user\n" + next_turn);
    req.prompt_ids.insert(req.prompt_ids.end(), rest.begin(), rest.end());
  };

  // Turn 2: an image after the video turn; the video stays in the conversation, the image is
  // the only thing encoded.
  std::string image_turn = "<|vision_start|>";
  for (int64_t i = 0; i < image_token_count(image.grid_thw, 2); ++i) image_turn += "<|image_pad|>";
  image_turn += "<|vision_end|>What is in this picture?<|im_end|>\n<|im_start|>assistant\n";
  continue_with(o1, image_turn);
  req.runs.push_back(image_runs({image.grid_thw}, cfg_.image_token_id, 2)[0]);
  pixels.insert(pixels.end(), image.pixel_values.data<float>(),
                image.pixel_values.data<float>() + image.pixel_values.numel());
  req.pixel_values = pixels.data();
  req.grids.push_back(image.grid_thw);
  UserMessage m2;
  m2.text = text2;
  m2.pixel_values = image.pixel_values.data<float>();
  m2.grids = {image.grid_thw};
  const int64_t cached = chat.cached_tokens();
  EXPECT_EQ(static_cast<int64_t>(chat.turn_ids(m2).size()) + cached,
            static_cast<int64_t>(req.prompt_ids.size()));
  const GenerationResult o2 = generate(one_shot_model, req);
  const ChatReply r2 = chat.send(m2);
  EXPECT_EQ(r2.result.tokens, o2.tokens) << "turn 2 (an image after the video)";
  EXPECT_EQ(r2.result.timings.prompt_tokens, static_cast<int64_t>(req.prompt_ids.size()) - cached);
  EXPECT_EQ(r2.result.timings.image_patches, count_patches({image.grid_thw}));
  ASSERT_GE(chat.conversation().size(), req.prompt_ids.size());
  EXPECT_EQ(std::vector<int32_t>(
                chat.conversation().begin(),
                chat.conversation().begin() + static_cast<int64_t>(req.prompt_ids.size())),
            req.prompt_ids);

  // Turn 3: text only.
  continue_with(o2, text3 + "<|im_end|>\n<|im_start|>assistant\n");
  UserMessage m3;
  m3.text = text3;
  const GenerationResult o3 = generate(one_shot_model, req);
  const ChatReply r3 = chat.send(m3);
  EXPECT_EQ(r3.result.tokens, o3.tokens) << "turn 3 (text after the media turns)";
  EXPECT_EQ(r3.result.timings.image_patches, 0);
  EXPECT_EQ(chat_model.next_position() - chat_model.n_past(),
            one_shot_model.next_position() - one_shot_model.n_past());
}

// A video whose frame pairs exceed what the encoder was planned for is refused before the model
// runs, and the conversation stays as it was.
TEST_P(ChatVideo, AVideoBeyondTheEncodersPlanIsRefusedAndTheChatGoesOn) {
  const VideoClip clip = formula_clip();
  ModelLimits l = limits();
  l.max_images = static_cast<int>(clip.grid_thw[0]) - 1;
  auto be = make_cpu_backend();
  Qwen3VLModel model(*be, dir_, l);
  ChatSession chat(model, *tokenizer_, format_, "", settings_);
  UserMessage m;
  m.text = "Describe this video.";
  m.videos = {&clip};
  try {
    chat.send(m);
    ADD_FAILURE() << "a video beyond the encoder's plan was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--video-max-frames"), std::string::npos) << e.what();
  }
  EXPECT_EQ(chat.turns(), 0);
  EXPECT_EQ(model.n_past(), 0);
  UserMessage text;
  text.text = "hi";
  EXPECT_FALSE(chat.send(text).result.tokens.empty());
}

INSTANTIATE_TEST_SUITE_P(Families, ChatVideo,
                         ::testing::Values("qwen3vl-tiny", "qwen25vl-tiny", "qwen2vl-tiny"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           name.erase(std::remove(name.begin(), name.end(), '-'), name.end());
                           return name;
                         });

// ---- CUDA ----

// Warmup 0 captures at the first call (the one image turn then has a vision graph), 1 after an
// eager one.
GraphConfigs cuda_graphs(bool vision, int warmup) {
  GraphConfigInput in = {{"cuda_graph_impl", "local"},
                         {"inference_cuda_graph_scope", "block"},
                         {"cuda_graph_warmup_steps", std::to_string(warmup)}};
  if (vision) {
    in.emplace_back("vision_cuda_graph_impl", "local");
    in.emplace_back("max_vision_cuda_graph_seq_length", "1024");
    in.emplace_back("vision_cuda_graph_buckets", "256,1024");
  }
  GraphConfigs c = parse_graph_configs(in);
  GraphModelTraits traits;
  traits.has_deepstack = true;
  traits.spatial_merge_size = 2;
  finalize_graph_configs(c, traits);
  return c;
}

// The decode graphs read past_len, the token and the rotary tables from the decoder's buffers, so
// a turn's prefill continuing the cache between replays must leave them valid: with the decode
// step captured (vision eager on both sides, so the inputs are the same bits), a chat gives the
// eager chat's tokens exactly, turn after turn.
TEST_F(ChatFixture, CudaChatWithDecodeGraphsEqualsTheEagerChat) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  auto be = make_cuda_backend();
  Qwen3VLModel eager(*be, test::fixture_dir(), chat_limits());
  Qwen3VLModel graphed(*be, test::fixture_dir(), chat_limits());
  VisionCudaGraphHelper helper(graphed, split_stages(graphed.config(), 1)[0],
                               cuda_graphs(false, 1));
  graphed.attach_graphs(&helper);
  ChatSession a(eager, *tokenizer_, format_, kSystem, settings_),
      b(graphed, *tokenizer_, format_, kSystem, settings_);
  const std::vector<UserMessage> turns = {message(kText1), message(kText2, &images_[1]),
                                          message(kText3)};
  for (size_t t = 0; t < turns.size(); ++t) {
    const ChatReply ra = a.send(turns[t]), rb = b.send(turns[t]);
    EXPECT_EQ(rb.result.tokens, ra.result.tokens) << "turn " << t + 1;
    EXPECT_EQ(graphed.n_past(), eager.n_past()) << "turn " << t + 1;
    EXPECT_EQ(graphed.next_position(), eager.next_position()) << "turn " << t + 1;
  }
  EXPECT_TRUE(helper.graphs_created(GraphSet::decoder));
  a.clear();
  b.clear();
  EXPECT_EQ(b.send(turns[1]).result.tokens, a.send(turns[1]).result.tokens) << "after /clear";
}

// With iris generate's graphs (decode and padded vision), each turn's logits after its continued
// prefill are those of an eager one-shot prefill of the whole conversation (the chat's own
// replies as the earlier turns), within bf16 tolerance (3% + 0.05, as the CUDA goldens), and the
// top token agrees wherever the one-shot's first two are clearly apart.
TEST_F(ChatFixture, CudaGraphedChatTurnsMatchOneShotPrefillsWithinBf16) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  settings_.keep_prompt_logits = true;
  auto be = make_cuda_backend();
  Qwen3VLModel graphed(*be, test::fixture_dir(), chat_limits());
  VisionCudaGraphHelper helper(graphed, split_stages(graphed.config(), 1)[0], cuda_graphs(true, 0));
  graphed.attach_graphs(&helper);
  Qwen3VLModel one_shot_model(*be, test::fixture_dir(), chat_limits());
  // The CUDA goldens' bf16 policy (bridge_cuda_golden_test): the whole row within 3% relative L2,
  // the reference's top 8 each within 3% + 0.05, and the same top-1 where the reference's margin
  // exceeds twice that. Single logits of a random-weight model drift further than that through
  // bf16 rounding, because a chat turn's cache holds keys computed one decode step at a time
  // where the one-shot prefill computes them in one GEMM.
  auto expect_close = [](const std::vector<float>& got, const std::vector<float>& want,
                         const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double num = 0, den = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      num += double(got[i] - want[i]) * (got[i] - want[i]);
      den += double(want[i]) * want[i];
    }
    EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), 0.03) << what << ": relative L2 error";
    auto tol = [](float v) { return 0.03f * std::fabs(v) + 0.05f; };
    std::vector<size_t> order(want.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::partial_sort(order.begin(), order.begin() + 8, order.end(),
                      [&](size_t a, size_t b) { return want[a] > want[b]; });
    for (int k = 0; k < 8; ++k)
      EXPECT_NEAR(got[order[k]], want[order[k]], tol(want[order[k]]))
          << what << " rank " << k << " id " << order[k];
    if (want[order[0]] - want[order[1]] > 2 * tol(want[order[0]]))
      EXPECT_EQ(std::max_element(got.begin(), got.end()) - got.begin(),
                static_cast<std::ptrdiff_t>(order[0]))
          << what;
  };
  ChatSession chat(graphed, *tokenizer_, format_, kSystem, settings_);
  const std::vector<int32_t> p1 =
      build_generation_prompt(*tokenizer_, format_, {}, kText1, kSystem);
  const ChatReply r1 = chat.send(message(kText1));
  expect_close(r1.result.prompt_logits, one_shot(one_shot_model, p1).prompt_logits, "turn 1");
  const std::vector<int32_t> p2 =
      continued(p1, r1.result, user_turn_with_image(images_[1].grid, kText2));
  const ChatReply r2 = chat.send(message(kText2, &images_[1]));
  expect_close(r2.result.prompt_logits, one_shot(one_shot_model, p2, &images_[1]).prompt_logits,
               "turn 2");
  const std::vector<int32_t> p3 = continued(
      p2, r2.result, "<|im_start|>user\n" + kText3 + "<|im_end|>\n<|im_start|>assistant\n");
  const ChatReply r3 = chat.send(message(kText3));
  expect_close(r3.result.prompt_logits, one_shot(one_shot_model, p3, &images_[1]).prompt_logits,
               "turn 3");
  // The same position offset after the conversation (the replies' lengths may differ).
  EXPECT_EQ(graphed.next_position() - graphed.n_past(),
            one_shot_model.next_position() - one_shot_model.n_past());
  EXPECT_TRUE(helper.graphs_created(GraphSet::decoder));
  EXPECT_TRUE(helper.graphs_created(GraphSet::vision));
}

}  // namespace
}  // namespace iris
