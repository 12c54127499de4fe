// The chat token layout and labels (spec sections 5 and 6) and the JSONL data pipeline: both line
// formats, image path resolution, dropping over-long and bad samples, deterministic shuffling with
// resumption, and mock data.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "bridge/architecture.h"
#include "bridge/chat_prompt.h"
#include "bridge/model_config.h"
#include "core/error.h"
#include "core/fs.h"
#include "test_util.h"
#include "training/chat_format.h"
#include "training/dataset.h"
#include "video_test_util.h"
#include "vision/image.h"
#include "vision/preprocess.h"
#include "vision/video.h"
#include "vision/video_decode.h"

namespace iris {
namespace {

namespace fs = std::filesystem;

constexpr int32_t kImStart = 151644, kImEnd = 151645, kNewline = 198, kUser = 872,
                  kAssistant = 77091, kVisionStart = 151652, kVisionEnd = 151653,
                  kImagePad = 151655;
// red.png is 64x64: smart_resize with the fixture's min_pixels 65536 makes it 256x256, a 16x16
// patch grid, 64 merged tokens. blue.png is 96x64 -> 320x224 -> grid 14x20 -> 70 tokens.
constexpr GridTHW kRedGrid = {1, 16, 16}, kBlueGrid = {1, 14, 20};
constexpr int kRedPads = 64, kBluePads = 70;

const Tokenizer& tok() {
  static const Tokenizer t = Tokenizer::from_file(test::tokenizer_path());
  return t;
}

const PreprocessorConfig& pp() {
  static const PreprocessorConfig c =
      PreprocessorConfig::from_file(test::fixture_dir() + "/preprocessor_config.json");
  return c;
}

// The fixture's own chat template (Qwen3-VL Instruct's), which training renders with.
const ChatFormat& fixture_chat() {
  static const ChatFormat f = ChatFormat::from_dir(test::fixture_dir());
  return f;
}

std::string jsonl_dir() {
  return test::data_dir() + "/jsonl";
}

using test::scratch_dir;

std::string write_scratch(const std::string& name, const std::string& text) {
  const std::string path = (scratch_dir() / name).string();
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

using test::error_of;

std::vector<int32_t> enc(const std::string& s) {
  return tok().encode(s);
}

// a + b + c ... as one id vector.
std::vector<int32_t> cat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

std::vector<int32_t> image_ids(int pads) {
  std::vector<int32_t> v{kVisionStart};
  v.insert(v.end(), static_cast<size_t>(pads), kImagePad);
  v.push_back(kVisionEnd);
  return v;
}

std::vector<int32_t> ignored(size_t n) {
  return std::vector<int32_t>(n, kIgnoreLabel);
}

DataConfig config_for(std::vector<std::string> files) {
  DataConfig c;
  c.train_files = std::move(files);
  c.shuffle = false;
  c.num_workers = 2;
  c.prefetch = 3;
  return c;
}

// "file:line: detail" for each skipped line.
std::vector<std::string> examples(const DataStats& s) {
  std::vector<std::string> out;
  for (const SkippedLine& l : s.skipped)
    out.push_back(l.file + ":" + std::to_string(l.line) + ": " + l.detail);
  return out;
}

bool has_example(const DataStats& s, const std::string& needle) {
  const std::vector<std::string> all = examples(s);
  return std::any_of(all.begin(), all.end(),
                     [&](const std::string& e) { return e.find(needle) != std::string::npos; });
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + "\n";
  return s;
}

std::string good_line(const std::string& question) {
  return R"({"messages": [{"role": "user", "content": ")" + question +
         R"("}, {"role": "assistant", "content": "ok"}]})";
}

// ---------------------------------------------------------------------------------------------
// Chat format

TEST(TrainingChatFormat, SpecialTokenIdsAreQwens) {
  EXPECT_EQ(enc("<|im_start|>user\n"), (std::vector<int32_t>{kImStart, kUser, kNewline}));
  EXPECT_EQ(enc("<|im_start|>assistant\n"), (std::vector<int32_t>{kImStart, kAssistant, kNewline}));
  EXPECT_EQ(enc("<|im_end|>\n"), (std::vector<int32_t>{kImEnd, kNewline}));
}

// The same layout from the fixture's chat template (Qwen3-VL Instruct's) and from the built-in
// ChatML that a checkpoint without a template gets.
TEST(TrainingChatFormat, LabelsCoverAssistantTurnsThroughImEndAndNewline) {
  for (const ChatFormat& format : {fixture_chat(), ChatFormat()}) {
    SCOPED_TRACE(format.describe());
    const std::vector<ChatMessage> msgs = {
        {"user", {ChatPart::make_image(), ChatPart::make_text("What is it?")}},
        {"assistant", {ChatPart::make_text("A dog.")}},
        {"user", {ChatPart::make_text("Sure?")}},
        {"assistant", {ChatPart::make_text("Yes")}}};
    const ChatTokens t =
        build_chat_tokens(tok(), format, msgs, {{1, 4, 6}});  // 24 patches -> 6 pads
    const std::vector<int32_t> a1 = enc("A dog."), a2 = enc("Yes"), q1 = enc("What is it?"),
                               q2 = enc("Sure?");
    const std::vector<int32_t> expected = cat({{kImStart, kUser, kNewline},
                                               image_ids(6),
                                               q1,
                                               {kImEnd, kNewline},
                                               {kImStart, kAssistant, kNewline},
                                               a1,
                                               {kImEnd, kNewline},
                                               {kImStart, kUser, kNewline},
                                               q2,
                                               {kImEnd, kNewline},
                                               {kImStart, kAssistant, kNewline},
                                               a2,
                                               {kImEnd, kNewline}});
    ASSERT_EQ(t.ids, expected);
    ASSERT_EQ(t.labels.size(), t.ids.size());

    // Hand-computed spans: the first reply starts after user turn (3 + 8 + |q1| + 2) and its
    // header.
    const size_t user1 = 3 + 8 + q1.size() + 2;
    const size_t reply1 = user1 + 3, end1 = reply1 + a1.size() + 2;  // one past the "\n"
    const size_t user2 = end1, reply2 = user2 + 3 + q2.size() + 2 + 3;
    const size_t end2 = reply2 + a2.size() + 2;
    ASSERT_EQ(end2, t.ids.size());
    for (size_t i = 0; i < t.ids.size(); ++i) {
      const bool learned = (i >= reply1 && i < end1) || (i >= reply2 && i < end2);
      EXPECT_EQ(t.labels[i], learned ? t.ids[i] : kIgnoreLabel) << "position " << i;
    }
    EXPECT_EQ(t.labels[end1 - 2], kImEnd);
    EXPECT_EQ(t.labels[end1 - 1], kNewline);
    EXPECT_EQ(t.labels[reply1 - 1], kIgnoreLabel);  // the "\n" of "assistant\n"
    EXPECT_EQ(t.labels[reply1 - 2], kIgnoreLabel);  // "assistant"
    for (size_t i = 3; i < 3 + 8; ++i) EXPECT_EQ(t.labels[i], kIgnoreLabel);  // vision tokens
  }
}

TEST(TrainingChatFormat, GoldenPrompt) {
  const test::Golden golden;
  const HostTensor ids_t = golden.tensor("input_ids");
  std::vector<int32_t> golden_ids;
  for (float v : ids_t.to_f32()) golden_ids.push_back(static_cast<int32_t>(v));
  const std::vector<GridTHW> grids = {{1, 14, 20}, {1, 28, 10}};

  // golden.json's prompt has one pad per image; HF's processor expands it before tokenising.
  std::string prompt = golden.json()["prompt"].get<std::string>(), expanded;
  size_t image = 0;
  for (size_t pos = 0;;) {
    const size_t at = prompt.find("<|image_pad|>", pos);
    expanded += prompt.substr(pos, at == std::string::npos ? std::string::npos : at - pos);
    if (at == std::string::npos) break;
    for (int64_t k = 0; k < image_token_count(grids[image]); ++k) expanded += "<|image_pad|>";
    ++image;
    pos = at + 13;
  }
  ASSERT_EQ(image, 2u);
  ASSERT_EQ(enc(expanded), golden_ids);

  const std::string text = "Describe these two pictures.";
  EXPECT_EQ(build_generation_prompt(tok(), fixture_chat(), grids, text, ""), golden_ids);
  const std::vector<ChatMessage> msgs = {
      {"user", {ChatPart::make_image(), ChatPart::make_image(), ChatPart::make_text(text)}}};
  EXPECT_EQ(build_chat_prompt(tok(), fixture_chat(), msgs, grids), golden_ids);

  // Training and the CLI agree with a system turn and without images too.
  const std::vector<ChatMessage> with_system = {{"system", {ChatPart::make_text("Be brief.")}},
                                                msgs[0]};
  EXPECT_EQ(build_chat_prompt(tok(), fixture_chat(), with_system, grids),
            build_generation_prompt(tok(), fixture_chat(), grids, text, "Be brief."));
  std::vector<int32_t> text_ids;
  for (float v : golden.tensor("text_input_ids").to_f32())
    text_ids.push_back(static_cast<int32_t>(v));
  EXPECT_EQ(build_chat_prompt(
                tok(), fixture_chat(),
                {{"user", {ChatPart::make_text("Write one sentence about CUDA graphs.")}}}, {}),
            text_ids);
}

// <__media__> markers (llama-mtmd-cli's) place each image inside the text; the CLI's prompt must
// then equal the training builder's for content [text, image, text, image, text].
TEST(TrainingChatFormat, MediaMarkersPlaceImagesInTheText) {
  const std::vector<GridTHW> grids = {{1, 14, 20}, {1, 28, 10}};
  const std::string text = "Describe these two pictures.";
  EXPECT_EQ(
      build_generation_prompt(tok(), fixture_chat(), grids, "<__media__><__media__>" + text, ""),
      build_generation_prompt(tok(), fixture_chat(), grids, text, ""));
  const std::vector<ChatMessage> placed = {
      {"user",
       {ChatPart::make_text("First "), ChatPart::make_image(), ChatPart::make_text(", then "),
        ChatPart::make_image(), ChatPart::make_text(". Which is larger?")}}};
  const std::vector<int32_t> ids = build_generation_prompt(
      tok(), fixture_chat(), grids, "First <__media__>, then <__media__>. Which is larger?", "");
  EXPECT_EQ(ids, build_chat_prompt(tok(), fixture_chat(), placed, grids));
  EXPECT_NE(ids, build_generation_prompt(tok(), fixture_chat(), grids,
                                         "First , then . Which is larger?", ""));
  for (const std::string& wrong :
       {std::string("one <__media__> only"), std::string("<__media__><__media__><__media__>")}) {
    try {
      build_generation_prompt(tok(), fixture_chat(), grids, wrong, "");
      ADD_FAILURE() << wrong;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("one marker per image"), std::string::npos) << e.what();
    }
  }
}

TEST(TrainingChatFormat, RejectsBrokenConversations) {
  const std::vector<ChatMessage> reserved = {{"user", {ChatPart::make_text("hi<|im_end|>")}},
                                             {"assistant", {ChatPart::make_text("x")}}};
  EXPECT_NE(
      error_of([&] { build_chat_tokens(tok(), fixture_chat(), reserved, {}); }).find("<|im_end|>"),
      std::string::npos);
  const std::vector<ChatMessage> pad_text = {{"user", {ChatPart::make_text("<|image_pad|>")}}};
  EXPECT_NE(error_of([&] {
              build_chat_tokens(tok(), fixture_chat(), pad_text, {});
            }).find("special token"),
            std::string::npos);
  const std::vector<ChatMessage> image_reply = {{"assistant", {ChatPart::make_image()}}};
  EXPECT_NE(error_of([&] {
              build_chat_tokens(tok(), fixture_chat(), image_reply, {kRedGrid});
            }).find("user turns"),
            std::string::npos);
  const std::vector<ChatMessage> one_image = {{"user", {ChatPart::make_image()}}};
  EXPECT_NE(
      error_of([&] { build_chat_tokens(tok(), fixture_chat(), one_image, {}); }).find("grids"),
      std::string::npos);
  EXPECT_NE(error_of([&] {
              build_chat_tokens(tok(), fixture_chat(), one_image, {kRedGrid, kRedGrid});
            }).find("2 image grids"),
            std::string::npos);
  const std::vector<ChatMessage> role = {{"tool", {ChatPart::make_text("x")}}};
  EXPECT_NE(error_of([&] { build_chat_tokens(tok(), fixture_chat(), role, {}); }).find("'tool'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { image_token_count({1, 3, 3}); }).find("merge_size"), std::string::npos);
}

// Training sequences are the chat template's rendering: for every conversation of golden.json
// (transformers' apply_chat_template over the saved Qwen templates), the training builder's ids
// are the golden text's, its images expanded, and the inference prompt builder's too.
TEST(TrainingChatFormat, SequencesAreTheChatTemplatesRendering) {
  const nlohmann::ordered_json golden = nlohmann::ordered_json::parse(
      read_text_file(test::data_dir() + "/chat_templates/golden.json", "golden.json"));
  int n = 0;
  for (const auto& entry : golden["templates"]) {
    for (const auto& c : entry["cases"]) {
      const std::string file = entry["file"];
      SCOPED_TRACE(file + ": " + c["name"].get<std::string>());
      ChatFormat f = ChatFormat::from_file(test::data_dir() + "/chat_templates/" + file, "template",
                                           {test::fixture_dir()});
      if (!c["kwargs"].empty()) f.set_kwargs(c["kwargs"], "kwargs");
      std::vector<ChatMessage> messages;
      std::vector<GridTHW> grids;
      for (const auto& m : c["messages"]) {
        ChatMessage cm{m["role"].get<std::string>(), {}};
        if (m["content"].is_string()) {
          cm.content.push_back(ChatPart::make_text(m["content"].get<std::string>()));
        } else {
          for (const auto& item : m["content"]) {
            if (item["type"] == "image") {
              cm.content.push_back(ChatPart::make_image());
              grids.push_back(grids.size() % 2 ? kBlueGrid : kRedGrid);
            } else {
              cm.content.push_back(ChatPart::make_text(item["text"].get<std::string>()));
            }
          }
        }
        messages.push_back(std::move(cm));
      }
      const std::vector<int32_t> want =
          encode_chat_text(tok(), c["text"].get<std::string>(), grids, 2);
      if (c["add_generation_prompt"].get<bool>()) {
        EXPECT_EQ(build_chat_prompt(tok(), f, messages, grids), want);
      } else {
        const ChatTokens t = build_chat_tokens(tok(), f, messages, grids);
        EXPECT_EQ(t.ids, want);
        const bool replies = messages.back().role == "assistant";
        EXPECT_EQ(std::count(t.labels.begin(), t.labels.end(), kIgnoreLabel) <
                      static_cast<int64_t>(t.labels.size()),
                  replies);
      }
      ++n;
    }
  }
  EXPECT_GE(n, 15);
}

// What a model learns from the text a template writes, as tokens decoded: every assistant turn
// after its header, <|im_end|> and "\n" included.
std::string learned_text(const ChatTokens& t) {
  std::vector<int32_t> ids;
  for (size_t i = 0; i < t.ids.size(); ++i)
    if (t.labels[i] != kIgnoreLabel) ids.push_back(t.labels[i]);
  return tok().decode(ids);
}

TEST(TrainingChatFormat, AThinkingTemplatesLastReplyIsLearnedWithItsReasoning) {
  const ChatFormat thinking = ChatFormat::from_file(
      test::data_dir() + "/chat_templates/qwen3_vl_thinking.jinja", "template");
  const std::string thought = "<think>\nRound and red.\n</think>\n\nA red circle.";
  const std::vector<ChatMessage> one = {
      {"user", {ChatPart::make_image(), ChatPart::make_text("What is it?")}},
      {"assistant", {ChatPart::make_text(thought)}}};
  EXPECT_EQ(learned_text(build_chat_tokens(tok(), thinking, one, {kRedGrid})),
            thought + "<|im_end|>\n");
  // An earlier reply's reasoning is dropped by the template, so it is not learned; the last reply
  // without reasoning gets the template's empty think block.
  const std::vector<ChatMessage> two = {one[0],
                                        one[1],
                                        {"user", {ChatPart::make_text("Sure?")}},
                                        {"assistant", {ChatPart::make_text("Yes.")}}};
  EXPECT_EQ(learned_text(build_chat_tokens(tok(), thinking, two, {kRedGrid})),
            "A red circle.<|im_end|>\n<think>\n\n</think>\n\nYes.<|im_end|>\n");
  // A reply that starts with newlines: its first "\n" merges with the header's, which Qwen's rule
  // skips as the header's.
  const std::vector<ChatMessage> newline = {{"user", {ChatPart::make_text("Hi")}},
                                            {"assistant", {ChatPart::make_text("\n\nHello")}}};
  const ChatTokens t = build_chat_tokens(tok(), fixture_chat(), newline, {});
  EXPECT_EQ(learned_text(t), "Hello<|im_end|>\n");
}

TEST(TrainingChatFormat, ATemplateWithoutChatMLTurnsIsRefused) {
  const std::string path = write_scratch(
      "plain.jinja", "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}");
  const ChatFormat plain = ChatFormat::from_file(path, "data.chat_template");
  const std::vector<ChatMessage> msgs = {{"user", {ChatPart::make_text("Hi")}},
                                         {"assistant", {ChatPart::make_text("Hello")}}};
  EXPECT_EQ(error_of([&] { build_chat_tokens(tok(), plain, msgs, {}); }),
            "the chat template (" + path +
                ") does not write assistant turns as <|im_start|>assistant\\n...<|im_end|>, "
                "which is how Iris finds the tokens to learn");
}

// ---------------------------------------------------------------------------------------------
// JSONL formats

// A missing or directory held-out file is named as what the recipe calls it (it was called a
// train file, pointing at data.train_files).
TEST(TrainingData, FileErrorsNameTheKeyThatGaveTheFiles) {
  DataConfig eval = config_for({jsonl_dir()});
  eval.files_key = "data.eval_files";
  const std::string dir = error_of([&] { Dataset ds(eval, tok(), pp(), fixture_chat()); });
  EXPECT_NE(dir.find("is a directory"), std::string::npos) << dir;
  EXPECT_NE(dir.find("check data.eval_files"), std::string::npos) << dir;
  EXPECT_EQ(dir.find("train"), std::string::npos) << dir;
  const std::string missing = error_of([&] {
    Dataset ds(config_for({jsonl_dir() + "/no_such.jsonl"}), tok(), pp(), fixture_chat());
  });
  EXPECT_NE(missing.find("check data.train_files"), std::string::npos) << missing;
}

TEST(TrainingData, MessagesFormat) {
  const std::string file = jsonl_dir() + "/messages.jsonl";
  Dataset ds(config_for({file}), tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.size(), 3);  // the blank line is not a sample

  // Line 1: system, user [image, text], assistant.
  Sample s = ds.next();
  EXPECT_EQ(s.source, file + ":1");
  const std::vector<int32_t> system = enc("<|im_start|>system\nYou are terse.<|im_end|>\n"),
                             question = enc("What colour is the square?"), reply = enc("Red.");
  std::vector<int32_t> ids = cat({system,
                                  {kImStart, kUser, kNewline},
                                  image_ids(kRedPads),
                                  question,
                                  {kImEnd, kNewline},
                                  {kImStart, kAssistant, kNewline},
                                  reply,
                                  {kImEnd, kNewline}});
  ASSERT_EQ(s.ids, ids);
  const size_t prompt_len = ids.size() - reply.size() - 2;
  std::vector<int32_t> labels = cat({ignored(prompt_len), reply, {kImEnd, kNewline}});
  EXPECT_EQ(s.labels, labels);
  EXPECT_EQ(s.labels[system.size() + 3], kIgnoreLabel);  // <|vision_start|>
  EXPECT_EQ(s.labels[system.size() + 4], kIgnoreLabel);  // the first pad
  ASSERT_EQ(s.grids, std::vector<GridTHW>{kRedGrid});
  const PreprocessedImage red = preprocess_image(load_image(jsonl_dir() + "/images/red.png"), pp());
  ASSERT_EQ(s.pixel_values.size(), static_cast<size_t>(red.pixel_values.numel()));
  EXPECT_TRUE(
      std::equal(s.pixel_values.begin(), s.pixel_values.end(), red.pixel_values.data<float>()));

  // Line 2: two exchanges, the second image after its text; both replies learned.
  s = ds.next();
  EXPECT_EQ(s.source, file + ":2");
  const std::vector<int32_t> r1 = enc("Hello!"), r2 = enc("A blue circle.");
  const std::vector<int32_t> u1 = enc("<|im_start|>user\nHi there<|im_end|>\n");
  const std::vector<int32_t> u2 =
      cat({enc("<|im_start|>user\nAnd this one?"), image_ids(kBluePads), {kImEnd, kNewline}});
  ids = cat({u1,
             {kImStart, kAssistant, kNewline},
             r1,
             {kImEnd, kNewline},
             u2,
             {kImStart, kAssistant, kNewline},
             r2,
             {kImEnd, kNewline}});
  ASSERT_EQ(s.ids, ids);
  labels = cat({ignored(u1.size() + 3),
                r1,
                {kImEnd, kNewline},
                ignored(u2.size() + 3),
                r2,
                {kImEnd, kNewline}});
  EXPECT_EQ(s.labels, labels);
  EXPECT_EQ(s.grids, std::vector<GridTHW>{kBlueGrid});

  // Line 4 (after a blank line): image items taking their paths from a top-level "images" list.
  s = ds.next();
  EXPECT_EQ(s.source, file + ":4");
  EXPECT_EQ(s.grids, (std::vector<GridTHW>{kBlueGrid, kRedGrid}));
  ids = cat({{kImStart, kUser, kNewline},
             image_ids(kBluePads),
             image_ids(kRedPads),
             enc("Compare them.<|im_end|>\n<|im_start|>assistant\nBlue, then red.<|im_end|>\n")});
  EXPECT_EQ(s.ids, ids);
  EXPECT_EQ(s.pixel_values.size(), static_cast<size_t>(280 + 256) * 1536);
  EXPECT_EQ(ds.stats().bad_samples, 0);
  EXPECT_EQ(ds.stats().dropped_too_long, 0);
}

TEST(TrainingData, ConversationsFormat) {
  const std::string file = jsonl_dir() + "/conversations.jsonl";
  Dataset ds(config_for({file}), tok(), pp(), fixture_chat());
  ASSERT_EQ(ds.size(), 2);

  // "<image>\n" before the question renders like the messages form [image, text].
  Sample s = ds.next();
  EXPECT_EQ(s.source, file + ":1");
  const std::vector<int32_t> reply = enc("Red.");
  const std::vector<int32_t> ids = cat({{kImStart, kUser, kNewline},
                                        image_ids(kRedPads),
                                        enc("What colour is the square?<|im_end|>\n"),
                                        {kImStart, kAssistant, kNewline},
                                        reply,
                                        {kImEnd, kNewline}});
  ASSERT_EQ(s.ids, ids);
  EXPECT_EQ(s.labels, cat({ignored(ids.size() - reply.size() - 2), reply, {kImEnd, kNewline}}));
  const std::vector<ChatMessage> same = {
      {"user", {ChatPart::make_image(), ChatPart::make_text("What colour is the square?")}},
      {"assistant", {ChatPart::make_text("Red.")}}};
  EXPECT_EQ(s.ids, build_chat_tokens(tok(), fixture_chat(), same, {kRedGrid}).ids);

  // Two tags placing two images mid-sentence (whitespace at the tags dropped), a system turn, two
  // replies.
  s = ds.next();
  EXPECT_EQ(s.grids, (std::vector<GridTHW>{kRedGrid, kBlueGrid}));
  const std::vector<int32_t> sys = enc("<|im_start|>system\nYou are terse.<|im_end|>\n");
  const std::vector<int32_t> user =
      cat({enc("<|im_start|>user\nIs"), image_ids(kRedPads), enc("brighter than"),
           image_ids(kBluePads), enc("?<|im_end|>\n")});
  const std::vector<int32_t> a1 = enc("Yes."), a2 = enc("Sure.");
  const std::vector<int32_t> user2 = enc("<|im_start|>user\nSure?<|im_end|>\n");
  ASSERT_EQ(s.ids, cat({sys,
                        user,
                        {kImStart, kAssistant, kNewline},
                        a1,
                        {kImEnd, kNewline},
                        user2,
                        {kImStart, kAssistant, kNewline},
                        a2,
                        {kImEnd, kNewline}}));
  EXPECT_EQ(s.labels, cat({ignored(sys.size() + user.size() + 3),
                           a1,
                           {kImEnd, kNewline},
                           ignored(user2.size() + 3),
                           a2,
                           {kImEnd, kNewline}}));
}

TEST(TrainingData, ImagePathsRelativeToFileOrImageRoot) {
  const PreprocessedImage red = preprocess_image(load_image(jsonl_dir() + "/images/red.png"), pp());
  {
    Dataset ds(config_for({jsonl_dir() + "/nested/relative.jsonl"}), tok(), pp(), fixture_chat());
    const Sample s = ds.next();
    EXPECT_EQ(s.grids, std::vector<GridTHW>{kRedGrid});
    EXPECT_TRUE(
        std::equal(s.pixel_values.begin(), s.pixel_values.end(), red.pixel_values.data<float>()));
  }
  DataConfig c = config_for({jsonl_dir() + "/image_root.jsonl"});
  c.image_root = jsonl_dir() + "/images";
  {
    Dataset ds(c, tok(), pp(), fixture_chat());
    const Sample s = ds.next();
    EXPECT_EQ(s.grids, std::vector<GridTHW>{kRedGrid});
    EXPECT_EQ(s.pixel_values.size(), static_cast<size_t>(red.pixel_values.numel()));
  }
  // Without image_root "red.png" is looked up beside the JSONL file, where it is not.
  c.image_root.clear();
  Dataset ds(c, tok(), pp(), fixture_chat());
  const std::string err = error_of([&] { ds.next(); });
  EXPECT_NE(err.find("image_root.jsonl:1"), std::string::npos) << err;
  EXPECT_NE(err.find("red.png"), std::string::npos) << err;
  EXPECT_EQ(ds.stats().bad_samples, 1);
}

// ---------------------------------------------------------------------------------------------
// The shapes fine-tuning tools write

// shapes.jsonl holds pairs of lines: an HF messages line, then the same conversation in another
// shape. Each shape must give exactly the tokens, labels and pixels of its HF equivalent.
struct ShapePair {
  const char* name;  // the test's name
  int pair;          // lines 2 * pair + 1 (HF messages) and 2 * pair + 2 (the shape)
};

const ShapePair kShapePairs[] = {
    {"MsSwiftImagePlaceholdersWithAnImagesList", 0},
    {"LlamaFactoryPlaceholderStartingALaterTurn", 1},
    {"ShareGptFromValueInMessagesWithATopLevelSystem", 2},
    {"FromValueWithAListOfItemsAndASystemTurn", 3},
    {"LlavaConversationsWithImage", 4},
    {"LlavaConversationsWithAListOfImages", 5},
    {"ImageUrlItemsObjectStringAndFileUrl", 6},
    {"TrlPathlessImageItemsWithNullFields", 7},
    {"ImageItemsNamingTheirFileByPathAndUrl", 8},
};

const std::string& shapes_file() {
  static const std::string f = jsonl_dir() + "/shapes.jsonl";
  return f;
}

DataConfig shapes_config() {
  DataConfig c = config_for({shapes_file()});
  c.on_bad_sample = DataConfig::OnBad::error;  // no line may be dropped, or the pairs would shift
  return c;
}

class TrainingDataShape : public ::testing::TestWithParam<ShapePair> {};

TEST_P(TrainingDataShape, GivesTheSampleOfItsHfMessagesEquivalent) {
  const int pair = GetParam().pair;
  Dataset ds(shapes_config(), tok(), pp(), fixture_chat());
  ds.seek({0, 2 * pair});
  const Sample hf = ds.next(), shape = ds.next();
  ASSERT_EQ(hf.source, shapes_file() + ":" + std::to_string(2 * pair + 1));
  ASSERT_EQ(shape.source, shapes_file() + ":" + std::to_string(2 * pair + 2));
  ASSERT_FALSE(hf.grids.empty());
  EXPECT_NE(std::count(hf.labels.begin(), hf.labels.end(), kIgnoreLabel),
            static_cast<int64_t>(hf.labels.size()));
  EXPECT_EQ(shape.ids, hf.ids);
  EXPECT_EQ(shape.labels, hf.labels);
  EXPECT_EQ(shape.grids, hf.grids);
  EXPECT_EQ(shape.pixel_values, hf.pixel_values);
}

INSTANTIATE_TEST_SUITE_P(Shapes, TrainingDataShape, ::testing::ValuesIn(kShapePairs),
                         [](const ::testing::TestParamInfo<ShapePair>& info) {
                           return std::string(info.param.name);
                         });

TEST(TrainingData, TheShapesFixtureIsPairsOfUsableLines) {
  Dataset ds(shapes_config(), tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.size(), static_cast<int64_t>(2 * std::size(kShapePairs)));
  // The first reference line is the conversation it spells, so agreeing with it means something.
  const std::vector<ChatMessage> first = {
      {"system", {ChatPart::make_text("You are terse.")}},
      {"user",
       {ChatPart::make_text("Is"), ChatPart::make_image(), ChatPart::make_text("brighter than"),
        ChatPart::make_image(), ChatPart::make_text("?")}},
      {"assistant", {ChatPart::make_text("Yes.")}},
      {"user", {ChatPart::make_text("Sure?")}},
      {"assistant", {ChatPart::make_text("Sure.")}}};
  const ChatTokens want = build_chat_tokens(tok(), fixture_chat(), first, {kRedGrid, kBlueGrid});
  const Sample s = ds.next();
  EXPECT_EQ(s.ids, want.ids);
  EXPECT_EQ(s.labels, want.labels);
}

TEST(TrainingData, LocalImageUrlsAreReadAndRemoteOnesRefused) {
  const std::string red = fs::absolute(jsonl_dir() + "/images/red.png").lexically_normal().string();
  auto line = [](const std::string& image_item) {
    return R"({"messages": [{"role": "user", "content": [)" + image_item +
           R"(, {"type": "text", "text": "What?"}]}, {"role": "assistant", "content": "Red."}]})";
  };
  const std::string file = write_scratch(
      "urls.jsonl",
      join(
          {line(R"({"type": "image", "image": ")" + red + R"("})"),
           line(R"({"type": "image_url", "image_url": {"url": "file://)" + red + R"("}})"),
           line(R"({"type": "image_url", "image_url": ")" + red + R"("})"),
           line(R"({"type": "image", "image": "file://)" + red + R"("})"),
           line(R"({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})"),
           R"({"images": ["http://example.com/a.png"], "messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "Red."}]})",
           line(
               R"({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}})")}));
  Dataset ds(config_for({file}), tok(), pp(), fixture_chat());
  ASSERT_EQ(ds.size(), 4);
  const Sample first = ds.next();
  EXPECT_EQ(first.grids, std::vector<GridTHW>{kRedGrid});
  for (int i = 2; i <= 4; ++i) {
    const Sample s = ds.next();
    EXPECT_EQ(s.source, file + ":" + std::to_string(i));
    EXPECT_EQ(s.ids, first.ids);
    EXPECT_EQ(s.pixel_values, first.pixel_values);
  }
  const std::vector<SkippedLine>& skipped = ds.stats().skipped;
  ASSERT_EQ(skipped.size(), 3u) << join(examples(ds.stats()));
  EXPECT_EQ(skipped[0].line, 5);
  EXPECT_EQ(skipped[0].reason, "remote image URL");
  EXPECT_EQ(skipped[0].detail,
            "image 'https://example.com/a.png' is a remote URL; training reads local files only "
            "and downloads nothing, so download it and give its path");
  EXPECT_EQ(skipped[1].line, 6);
  EXPECT_EQ(skipped[1].reason, "remote image URL");
  EXPECT_EQ(skipped[2].line, 7);
  EXPECT_EQ(skipped[2].reason, "unsupported image URL");
}

// The video shapes fine-tuners write, each with the same conversation: a 30-frame clip and the
// question "What happens?".
const std::vector<std::string>& video_shape_lines() {
  static const std::vector<std::string> lines = {
      // HF messages with a video item
      R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mkv"}, {"type": "text", "text": "What happens?"}]}, {"role": "assistant", "content": "A ball rolls."}]})",
      // LLaVA-Video: a "video" key and the tag in the text
      R"({"video": "clip.mkv", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "A ball rolls."}]})",
      // ms-swift / LLaMA-Factory
      R"({"messages": [{"role": "user", "content": "<video>What happens?"}, {"role": "assistant", "content": "A ball rolls."}], "videos": ["clip.mkv"]})",
      // OpenAI's video_url spelling
      R"({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "clip.mkv"}}, {"type": "text", "text": "What happens?"}]}, {"role": "assistant", "content": "A ball rolls."}]})",
      // keyed by field name, no "type"
      R"({"messages": [{"role": "user", "content": [{"video": "clip.mkv"}, {"text": "What happens?"}]}, {"role": "assistant", "content": "A ball rolls."}]})",
      // TRL: a path-less video item and a "videos" list
      R"({"messages": [{"role": "user", "content": [{"type": "video", "video": null}, {"type": "text", "text": "What happens?"}]}, {"role": "assistant", "content": "A ball rolls."}], "videos": ["clip.mkv"]})",
  };
  return lines;
}

// tools/make_video_golden.py's formula video, written losslessly into the scratch folder.
std::string write_clip() {
  const std::string path = (scratch_dir() / "clip.mkv").string();
  write_lossless_video(path, test::formula_frames(), test::kFormulaFps);
  return path;
}

std::shared_ptr<const DataVideo> fixture_video() {
  auto v = std::make_shared<DataVideo>();
  v->model = ModelConfig::from_file(test::fixture_dir() + "/config.json");
  v->processor = model_video_preprocessor(test::fixture_dir(), v->model);
  return v;
}

TEST(TrainingData, WithoutAModelLinesWithVideoAreRefusedNeverTrainedAsText) {
  std::vector<std::string> lines = video_shape_lines();
  // An empty videos list, as tabular exports write "none", is no video.
  lines.push_back(
      R"({"messages": [{"role": "user", "content": "What happens?"}, {"role": "assistant", "content": "Nothing."}], "videos": []})");
  const std::string file = write_scratch("video.jsonl", join(lines));
  DataConfig c = config_for({file});
  Dataset ds(c, tok(), pp(), fixture_chat());
  ASSERT_EQ(ds.size(), 1);
  EXPECT_EQ(ds.next().source, file + ":" + std::to_string(lines.size()));
  const std::vector<SkippedLine>& skipped = ds.stats().skipped;
  ASSERT_EQ(skipped.size(), video_shape_lines().size()) << join(examples(ds.stats()));
  for (size_t i = 0; i < skipped.size(); ++i) {
    EXPECT_EQ(skipped[i].line, static_cast<int64_t>(i + 1));
    EXPECT_EQ(skipped[i].reason, "video not supported");
    EXPECT_NE(skipped[i].detail.find("opened without a model to preprocess videos with"),
              std::string::npos)
        << skipped[i].detail;
  }
  c.on_bad_sample = DataConfig::OnBad::error;
  const std::string err = error_of([&] { Dataset stops(c, tok(), pp(), fixture_chat()); });
  EXPECT_EQ(err, file +
                     ":1: the line has 1 video; this dataset was opened without a model to "
                     "preprocess videos with, so the line is refused rather than trained as text "
                     "without its video; fix or remove the line, or set data.on_bad_sample: skip");
}

TEST(TrainingData, EveryVideoShapeGivesTheSampleOfTheModelsOwnVideoPrompt) {
  if (!video_decoding_available()) GTEST_SKIP() << "this build has no video decoding (OpenCV)";
  write_clip();
  const std::string file = write_scratch("video_shapes.jsonl", join(video_shape_lines()));
  DataConfig c = config_for({file});
  c.on_bad_sample = DataConfig::OnBad::error;
  c.video = fixture_video();
  Dataset ds(c, tok(), pp(), fixture_chat());
  ASSERT_EQ(ds.size(), static_cast<int64_t>(video_shape_lines().size()));

  // The reference: the HF messages rendered and expanded as iris generate --video does it.
  const DataVideo& v = *c.video;
  std::vector<int64_t> keep = v.model.arch->sample_video_frames(30, 12.0, v.processor);
  const DecodedVideo d =
      decode_video((scratch_dir() / "clip.mkv").string(), [&](const VideoInfo&) { return keep; });
  const ResizedSize size =
      v.model.arch->video_frame_size(static_cast<int64_t>(keep.size()), 100, 140, v.processor);
  VideoClip clip = preprocess_video(d.frames, size, v.processor);
  clip.frame_indices = keep;
  clip.total_frames = 30;
  clip.video_fps = 12.0;
  const std::vector<ChatMessage> messages = {
      {"user", {ChatPart::make_video(), ChatPart::make_text("What happens?")}},
      {"assistant", {ChatPart::make_text("A ball rolls.")}}};
  const ChatMediaTokens want =
      build_chat_media_tokens(tok(), fixture_chat(), messages, v.model, {}, {&clip});
  // Qwen3-VL writes each of the clip's 3 frame pairs after its timestamp.
  ASSERT_EQ(want.prompt.runs.size(), 3u);
  EXPECT_NE(tok().decode(want.prompt.ids).find("<0.3 seconds>"), std::string::npos);
  for (size_t i = 0; i < video_shape_lines().size(); ++i) {
    SCOPED_TRACE("line " + std::to_string(i + 1));
    const Sample s = ds.next();
    EXPECT_EQ(s.ids, want.prompt.ids);
    EXPECT_EQ(s.labels, want.labels);
    EXPECT_EQ(s.grids, std::vector<GridTHW>{clip.grid_thw});
    ASSERT_EQ(s.runs.size(), want.prompt.runs.size());
    for (size_t k = 0; k < s.runs.size(); ++k)
      EXPECT_EQ(s.runs[k].tokens(), want.prompt.runs[k].tokens());
    EXPECT_TRUE(
        std::equal(s.pixel_values.begin(), s.pixel_values.end(), clip.pixel_values.data<float>()));
    EXPECT_EQ(static_cast<int64_t>(s.pixel_values.size()), clip.pixel_values.numel());
  }
}

TEST(TrainingData, AVideoAndAnImageKeepTheirPlacesInThePixelRows) {
  if (!video_decoding_available()) GTEST_SKIP() << "this build has no video decoding (OpenCV)";
  write_clip();
  const std::string red = jsonl_dir() + "/images/red.png";
  const std::string file = write_scratch(
      "video_image.jsonl",
      R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mkv"}, {"type": "image", "image": ")" +
          red +
          R"("}, {"type": "text", "text": "Which is red?"}]}, {"role": "assistant", "content": "The picture."}]})" +
          "\n");
  DataConfig c = config_for({file});
  c.on_bad_sample = DataConfig::OnBad::error;
  c.video = fixture_video();
  Dataset ds(c, tok(), pp(), fixture_chat());
  const Sample s = ds.next();
  // The video's grid first, then the image's: the order of their pads.
  ASSERT_EQ(s.grids.size(), 2u);
  EXPECT_GT(s.grids[0][0], 1);
  EXPECT_EQ(s.grids[1], kRedGrid);
  const int64_t video_rows = s.grids[0][0] * s.grids[0][1] * s.grids[0][2];
  const PreprocessedImage image = preprocess_image(load_image(red), pp());
  const int64_t cols = image.pixel_values.dims()[1];
  ASSERT_EQ(static_cast<int64_t>(s.pixel_values.size()),
            (video_rows + image.pixel_values.dims()[0]) * cols);
  EXPECT_TRUE(std::equal(image.pixel_values.data<float>(),
                         image.pixel_values.data<float>() + image.pixel_values.numel(),
                         s.pixel_values.begin() + video_rows * cols));
  const auto first_video = std::find(s.ids.begin(), s.ids.end(), 151656);
  const auto first_image = std::find(s.ids.begin(), s.ids.end(), kImagePad);
  EXPECT_LT(first_video, first_image);
}

TEST(TrainingData, MissingAndBadVideosAreSkippedWithTheirReason) {
  const std::string text = write_scratch("notes.mkv", "not a video\n");
  const std::string file = write_scratch(
      "bad_videos.jsonl",
      join(
          {R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "gone.mkv"}, {"type": "text", "text": "?"}]}, {"role": "assistant", "content": "no"}]})",
           R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "notes.mkv"}, {"type": "text", "text": "?"}]}, {"role": "assistant", "content": "no"}]})",
           good_line("fine")}));
  DataConfig c = config_for({file});
  c.video = fixture_video();
  Dataset ds(c, tok(), pp(), fixture_chat());
  const Sample s = ds.next();
  EXPECT_EQ(s.source, file + ":3");
  ASSERT_EQ(ds.stats().skipped.size(), 2u) << join(examples(ds.stats()));
  EXPECT_EQ(ds.stats().skipped[0].reason, "missing video");
  EXPECT_NE(ds.stats().skipped[0].detail.find("gone.mkv"), std::string::npos);
  EXPECT_EQ(ds.stats().skipped[1].reason, "bad video");
  EXPECT_NE(ds.stats().skipped[1].detail.find(text), std::string::npos)
      << ds.stats().skipped[1].detail;
}

TEST(TrainingData, SkippedLinesAreReportedOnceEachAndSummedUpByReason) {
  const std::string file = write_scratch(
      "report.jsonl",
      join(
          {good_line("one"),
           R"({"image": "images/gone.png", "conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "x"}]})",
           good_line("three"),
           R"({"video": "clip.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "A ball rolls."}]})",
           R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "lost.png"}]}, {"role": "assistant", "content": "x"}]})"}));
  Dataset ds(config_for({file}), tok(), pp(), fixture_chat());
  // The video line (this dataset has no model to read videos with) is refused while the files
  // are read, the missing images when reached.
  std::vector<SkippedLine> fresh = ds.take_new_skips();
  ASSERT_EQ(fresh.size(), 1u);
  EXPECT_EQ(fresh[0].describe(),
            file +
                ":4 (video not supported): the line has 1 video; this dataset was opened without a "
                "model to preprocess videos with, so the line is refused rather than trained as "
                "text without its video");
  EXPECT_TRUE(ds.take_new_skips().empty());
  for (int epoch = 0; epoch < 3; ++epoch) {
    EXPECT_EQ(ds.next().source, file + ":1");
    EXPECT_EQ(ds.next().source, file + ":3");
  }
  fresh = ds.take_new_skips();
  ASSERT_EQ(fresh.size(), 2u);
  const std::string dir = scratch_dir().string();
  EXPECT_EQ(fresh[0].file, file);
  EXPECT_EQ(fresh[0].line, 2);
  EXPECT_EQ(fresh[0].reason, "missing image");
  EXPECT_EQ(fresh[0].detail,
            "image file not found: " + (scratch_dir() / "images/gone.png").string() +
                " (the line gives 'images/gone.png'; relative image paths resolve against the "
                "JSONL file's folder (" +
                dir + "), or against data.image_root when it is set)");
  EXPECT_EQ(fresh[1].line, 5);
  EXPECT_EQ(fresh[1].reason, "missing image");
  EXPECT_TRUE(ds.take_new_skips().empty());  // later epochs report nothing again
  EXPECT_EQ(ds.stats().summary(), "skipped 3 of 5 lines: 2 missing image, 1 video not supported");
  EXPECT_EQ(ds.stats().bad_samples, 3);

  DataConfig c = config_for({file});
  c.image_root = jsonl_dir();
  Dataset rooted(c, tok(), pp(), fixture_chat());
  rooted.next();
  rooted.next();
  EXPECT_TRUE(has_example(rooted.stats(),
                          file + ":2: image file not found: " + jsonl_dir() +
                              "/images/gone.png (the line gives 'images/gone.png'; relative image "
                              "paths resolve against data.image_root (" +
                              jsonl_dir() + "))"))
      << join(examples(rooted.stats()));
}

TEST(TrainingData, ManySkippedLinesAreAllReportedAndCountedButFewKept) {
  std::vector<std::string> lines(kKeptSkippedLines + 5, "{\"prompt\": \"x\"}");
  lines.push_back(good_line("kept"));
  const std::string file = write_scratch("many_bad.jsonl", join(lines));
  Dataset ds(config_for({file}), tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.stats().skipped.size(), kKeptSkippedLines);
  const std::vector<SkippedLine> reported = ds.take_new_skips();
  ASSERT_EQ(reported.size(), kKeptSkippedLines + 5);
  EXPECT_EQ(reported.back().line, static_cast<int64_t>(kKeptSkippedLines + 5));
  EXPECT_EQ(ds.stats().summary(),
            str_cat("skipped ", kKeptSkippedLines + 5, " of ", kKeptSkippedLines + 6,
                    " lines: ", kKeptSkippedLines + 5, " invalid row"));
}

// ---------------------------------------------------------------------------------------------
// Dropping samples

TEST(TrainingData, OverLongSamplesDroppedAndCounted) {
  const std::string file = write_scratch(
      "long.jsonl",
      join(
          {R"({"messages": [{"role": "user", "content": "short one"}, {"role": "assistant", "content": "ok"}]})",
           R"({"image": ")" + jsonl_dir() +
               R"(/images/red.png", "conversations": [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "Red."}]})",
           R"({"messages": [{"role": "user", "content": "short two"}, {"role": "assistant", "content": "ok"}]})"}));
  DataConfig c = config_for({file});
  // The image line is 3 + 66 + |"What?"| + 2 + 3 + |"Red."| + 2 tokens.
  const int64_t image_len = 3 + 66 + static_cast<int64_t>(enc("What?").size()) + 2 + 3 +
                            static_cast<int64_t>(enc("Red.").size()) + 2;
  c.seq_length = image_len;
  {
    Dataset ds(c, tok(), pp(), fixture_chat());
    ds.next();
    EXPECT_EQ(static_cast<int64_t>(ds.next().ids.size()), image_len);  // exactly at the limit
  }
  c.seq_length = image_len - 1;
  Dataset ds(c, tok(), pp(), fixture_chat());
  std::vector<std::string> seen;
  for (int i = 0; i < 6; ++i) seen.push_back(ds.next().source);  // three epochs
  for (const std::string& s : seen) EXPECT_EQ(s.find(":2"), std::string::npos) << s;
  EXPECT_EQ(seen[0], file + ":1");
  EXPECT_EQ(seen[1], file + ":3");
  EXPECT_EQ(ds.stats().dropped_too_long, 1);  // counted once, not once per epoch
  EXPECT_EQ(ds.stats().bad_samples, 0);
  ASSERT_EQ(examples(ds.stats()).size(), 1u);
  EXPECT_NE(examples(ds.stats())[0].find(file + ":2"), std::string::npos);
  EXPECT_NE(examples(ds.stats())[0].find("seq_length"), std::string::npos);

  // Nothing fits: the error says so instead of looping forever.
  c.seq_length = 5;
  Dataset none(c, tok(), pp(), fixture_chat());
  const std::string err = error_of([&] { none.next(); });
  EXPECT_NE(err.find("seq_length"), std::string::npos) << err;
}

TEST(TrainingData, BadLinesSkippedWithFileAndLine) {
  const std::string file = jsonl_dir() + "/bad.jsonl";
  Dataset ds(config_for({file}), tok(), pp(), fixture_chat());
  // Malformed JSON (2), no messages/conversations (5) and a tag/image mismatch (7) are found while
  // reading; the missing (3) and corrupt (4) images when the workers get to them.
  EXPECT_EQ(ds.size(), 4);
  EXPECT_EQ(ds.stats().bad_samples, 3);
  EXPECT_TRUE(has_example(ds.stats(), file + ":2: malformed JSON"));
  EXPECT_TRUE(has_example(ds.stats(), file + ":5: a line needs a \"messages\""));
  EXPECT_TRUE(has_example(ds.stats(), file + ":7: the conversation has 2 <image> tags but 1"));
  EXPECT_EQ(ds.next().source, file + ":1");
  EXPECT_EQ(ds.next().source, file + ":8");
  EXPECT_EQ(ds.stats().bad_samples, 5);
  EXPECT_TRUE(has_example(ds.stats(), file + ":3: "));
  EXPECT_TRUE(has_example(ds.stats(), "no_such_image.png"));
  EXPECT_TRUE(has_example(ds.stats(), file + ":4: "));
  EXPECT_TRUE(has_example(ds.stats(), "corrupt.png"));
  EXPECT_EQ(ds.next().source, file + ":1");  // next epoch; the bad lines are not counted again
  EXPECT_EQ(ds.stats().bad_samples, 5);
}

TEST(TrainingData, OnBadSampleErrorNamesFileAndLine) {
  DataConfig c = config_for({jsonl_dir() + "/bad.jsonl"});
  c.on_bad_sample = DataConfig::OnBad::error;
  std::string err = error_of([&] { Dataset ds(c, tok(), pp(), fixture_chat()); });
  EXPECT_NE(err.find("bad.jsonl:2: malformed JSON"), std::string::npos) << err;

  c.train_files = {jsonl_dir() + "/bad_image.jsonl"};
  Dataset ds(c, tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.next().source, c.train_files[0] + ":1");
  err = error_of([&] { ds.next(); });
  EXPECT_NE(err.find("bad_image.jsonl:2: "), std::string::npos) << err;
  EXPECT_NE(err.find("no_such_image.png"), std::string::npos) << err;
}

const std::string kTextLine = R"({"messages": [{"role": "user", "content": "hi"}, )"
                              R"({"role": "assistant", "content": "hello"}]})";

TEST(TrainingData, OverlongLinesAreAnErrorNamingFileAndLine) {
  // A line past the limit is refused before it is all in memory; lines up to it index normally.
  const std::string ok_line = kTextLine;
  const std::string path = write_scratch("long.jsonl", ok_line + "\n" + ok_line + "\n{\"x\": \"" +
                                                           std::string(kMaxJsonlLineBytes, 'x') +
                                                           "\"}\n" + ok_line + "\n");
  const std::string err =
      error_of([&] { Dataset ds(config_for({path}), tok(), pp(), fixture_chat()); });
  EXPECT_NE(err.find("long.jsonl:3: the line is longer than " + std::to_string(kMaxJsonlLineBytes)),
            std::string::npos)
      << err.substr(0, 300);
  EXPECT_LT(err.size(), 400u);
}

TEST(TrainingData, ALineOfMillionsOfValuesIsRefusedUnparsed) {
  // A 60 MB line took 2.2 GB once parsed; a line within the byte limit but past the value limit
  // is refused from its text, naming the file, the line and the limit.
  std::string many = R"({"messages": [], "unused": [{})";
  for (int64_t i = 0; i < kJsonLineLimits.max_values; ++i) many += ",{}";
  many += "]}";
  ASSERT_LT(many.size(), kMaxJsonlLineBytes);
  const std::string path = write_scratch("many.jsonl", kTextLine + "\n" + many + "\n");
  Dataset ds(config_for({path}), tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.stats().bad_samples, 1);
  EXPECT_TRUE(has_example(ds.stats(), path + ":2: malformed JSON: the line holds " +
                                          std::to_string(kJsonLineLimits.max_values + 4) +
                                          " JSON values (arrays, objects, strings, numbers), "
                                          "more than the " +
                                          std::to_string(kJsonLineLimits.max_values)))
      << join(examples(ds.stats()));
}

TEST(TrainingData, FifosAreRefusedNotWaitedOn) {
  // As a train file: an error at indexing.
  const std::string fifo = (scratch_dir() / "train_fifo.jsonl").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string err = error_of([&] { Dataset ds(config_for({fifo}), tok(), pp(), fixture_chat()); });
  EXPECT_NE(err.find("train file " + fifo + " is a FIFO"), std::string::npos) << err;
  // As an image of a line: a bad sample, where a data worker once blocked forever.
  const std::string image = (scratch_dir() / "fifo_image.png").string();
  ASSERT_EQ(::mkfifo(image.c_str(), 0600), 0);
  const std::string path = write_scratch(
      "fifo_image.jsonl",
      R"({"messages": [{"role": "user", "content": [{"type": "image", "image": ")" + image +
          R"("}, {"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "a pipe"}]})"
          "\n" +
          kTextLine + "\n");
  Dataset ds(config_for({path}), tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.next().source, path + ":2");
  EXPECT_TRUE(has_example(ds.stats(), "fifo_image.png is a FIFO")) << join(examples(ds.stats()));
}

TEST(TrainingData, ImagesAboveThePixelLimitAreBadSamples) {
  DataConfig c = config_for({jsonl_dir() + "/messages.jsonl"});
  c.max_image_pixels = 64 * 64;  // red.png (line 1) is 64x64, blue.png (line 2) 96x64
  Dataset ds(c, tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.next().source, c.train_files[0] + ":1");
  EXPECT_NE(ds.next().source, c.train_files[0] + ":2");
  EXPECT_TRUE(
      has_example(ds.stats(), "blue.png is 96x64 = 6144 pixels, more than the limit of 4096"))
      << join(examples(ds.stats()));
  c.max_image_pixels = 0;
  EXPECT_NE(error_of([&] { c.validate(); }).find("data.max_image_pixels"), std::string::npos);
}

TEST(TrainingData, DeeplyNestedLinesAreBadSamplesNotCrashes) {
  const std::string path =
      write_scratch("deep.jsonl", "{\"messages\": " + std::string(100000, '[') +
                                      std::string(100000, ']') + "}\n" + kTextLine + "\n");
  Dataset ds(config_for({path}), tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.stats().bad_samples, 1);
  EXPECT_TRUE(has_example(ds.stats(), path + ":1: malformed JSON: the line nests"))
      << join(examples(ds.stats()));
}

TEST(TrainingData, StructureErrors) {
  struct Case {
    const char* line;
    const char* message;
  };
  const std::vector<Case> cases = {
      {R"([1, 2])", "must be a JSON object"},
      {R"({"messages": []})", "non-empty array"},
      {R"({"messages": [{"role": "user", "content": "hi"}]})", "no assistant turn"},
      {R"({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]})",
       "must be a string or a list"},
      {R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]}, {"role": "assistant", "content": "x"}]})",
       "the line has 1 video; this dataset was opened without a model"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]})",
       "1 image items without a path but the line has no \"images\" list"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image", "image": "https://x/a.png"}]}, {"role": "assistant", "content": "x"}]})",
       "is a remote URL; training reads local files only"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}]})",
       "only appear in user turns"},
      {R"({"messages": [{"role": "robot", "content": "a"}, {"role": "assistant", "content": "x"}]})",
       "unknown role 'robot'"},
      {R"({"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "x"}]})",
       "unknown \"from\": 'bot'"},
      {R"({"image": "a.png", "conversations": [{"from": "human", "value": "no tag"}, {"from": "gpt", "value": "x"}]})",
       "0 <image> tags but 1 images"},
      {R"({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "<image>"}]})",
       "only appear in human turns"},
      {R"({"image": "a.png", "images": ["b.png"], "conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}]})",
       "both \"image\" and"},
      {R"({"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "x"}]})",
       "1 <image> tags but the line has no \"images\" list"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}, {"role": "assistant", "content": "x"}]})",
       "\"image_url\" must be {\"url\": ...} or a string, got number"},
      {R"({"system": "a", "messages": [{"role": "system", "content": "b"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "x"}]})",
       "both a top-level \"system\" and a system turn"},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}], "conversations": []})",
       "both \"messages\" and \"conversations\""},
      {R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}], "tools": "[{\"name\": \"f\"}]"})",
       "the line has \"tools\", which Iris does not render into the prompt"},
      {R"({"messages": [{"from": "human"}, {"from": "gpt", "value": "x"}]})",
       "a human message has no \"content\" (or ShareGPT \"value\") field"},
  };
  std::string text;
  for (const Case& c : cases) text += std::string(c.line) + "\n";
  text +=
      R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})";
  const std::string file = write_scratch("structure.jsonl", text + "\n");
  Dataset ds(config_for({file}), tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.size(), 1);
  EXPECT_EQ(ds.stats().bad_samples, static_cast<int64_t>(cases.size()));
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string where = file + ":" + std::to_string(i + 1) + ": ";
    const auto& ex = examples(ds.stats());
    const bool found = std::any_of(ex.begin(), ex.end(), [&](const std::string& e) {
      return e.rfind(where, 0) == 0 && e.find(cases[i].message) != std::string::npos;
    });
    EXPECT_TRUE(found) << "line " << i + 1 << " should report '" << cases[i].message << "'; got:\n"
                       << join(ex);
  }
}

// ---------------------------------------------------------------------------------------------
// Order, resumption, workers

std::string text_lines(int n, int missing_image_line) {
  std::string text;
  for (int i = 1; i <= n; ++i) {
    if (i == missing_image_line) {
      text +=
          R"({"image": "nope.png", "conversations": [{"from": "human", "value": "<image>x"}, {"from": "gpt", "value": "y"}]})";
    } else {
      text += R"({"messages": [{"role": "user", "content": "sample )" + std::to_string(i) +
              R"("}, {"role": "assistant", "content": "reply"}]})";
    }
    text += "\n";
  }
  return text;
}

std::vector<std::string> take_sources(Dataset& ds, int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(ds.next().source);
  return out;
}

TEST(TrainingData, DeterministicShuffleAndResume) {
  const int n = 23;
  const std::string file = write_scratch("order.jsonl", text_lines(n, 11));
  DataConfig c = config_for({file});
  c.shuffle = true;
  c.seed = 7;
  c.num_workers = 3;
  c.prefetch = 5;

  Dataset a(c, tok(), pp(), fixture_chat());
  ASSERT_EQ(a.size(), n);
  const std::vector<std::string> seq = take_sources(a, 60);  // 22 usable per epoch: ~3 epochs
  EXPECT_EQ(a.stats().bad_samples, 1);

  // Each epoch is a permutation of the usable lines, shuffled, and differently each epoch.
  std::vector<std::string> file_order;
  for (int i = 1; i <= n; ++i)
    if (i != 11) file_order.push_back(file + ":" + std::to_string(i));
  const std::vector<std::string> e0(seq.begin(), seq.begin() + 22),
      e1(seq.begin() + 22, seq.begin() + 44);
  std::vector<std::string> sorted0 = e0, sorted1 = e1, sorted_file = file_order;
  std::sort(sorted0.begin(), sorted0.end());
  std::sort(sorted1.begin(), sorted1.end());
  std::sort(sorted_file.begin(), sorted_file.end());
  EXPECT_EQ(sorted0, sorted_file);
  EXPECT_EQ(sorted1, sorted_file);
  EXPECT_NE(e0, file_order);
  EXPECT_NE(e0, e1);

  // The same seed gives the same sequence with any number of workers; another seed does not.
  c.num_workers = 0;
  Dataset sync(c, tok(), pp(), fixture_chat());
  EXPECT_EQ(take_sources(sync, 60), seq);
  c.seed = 8;
  Dataset other(c, tok(), pp(), fixture_chat());
  EXPECT_NE(take_sources(other, 22), e0);
  c.seed = 7;
  c.num_workers = 2;

  // Resume: a fresh dataset seeked to a saved position continues the sequence exactly, including
  // positions just after the skipped bad line and across epoch boundaries.
  for (int cut : {1, 9, 21, 22, 30, 47}) {
    Dataset first(c, tok(), pp(), fixture_chat());
    const std::vector<std::string> before = take_sources(first, cut);
    ASSERT_EQ(before, std::vector<std::string>(seq.begin(), seq.begin() + cut));
    const DataPosition pos = first.position();
    Dataset resumed(c, tok(), pp(), fixture_chat());
    resumed.seek(pos);
    EXPECT_EQ(resumed.position(), pos);
    EXPECT_EQ(take_sources(resumed, 60 - cut),
              std::vector<std::string>(seq.begin() + cut, seq.end()))
        << "resumed at sample " << cut << " (epoch " << pos.epoch << ", index " << pos.index << ")";
  }
  // Seeking back inside one dataset replays too, discarding what the workers had prepared.
  Dataset again(c, tok(), pp(), fixture_chat());
  take_sources(again, 5);
  const DataPosition p5 = again.position();
  const std::vector<std::string> next10 = take_sources(again, 10);
  again.seek(p5);
  EXPECT_EQ(take_sources(again, 10), next10);
  again.seek({2, 0});
  EXPECT_EQ(again.position(), (DataPosition{2, 0}));
  EXPECT_EQ(again.next().source, seq[44]);

  EXPECT_NE(error_of([&] { again.seek({0, n}); }).find("outside this dataset"), std::string::npos);
}

TEST(TrainingData, PositionCountsLinesConsidered) {
  const std::string file = write_scratch("pos.jsonl", text_lines(5, 2));
  Dataset ds(config_for({file}), tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.position(), (DataPosition{0, 0}));
  ds.next();
  EXPECT_EQ(ds.position(), (DataPosition{0, 1}));
  EXPECT_EQ(ds.next().source, file + ":3");  // line 2 is skipped inside next()
  EXPECT_EQ(ds.position(), (DataPosition{0, 3}));
  ds.next();
  ds.next();
  EXPECT_EQ(ds.position(), (DataPosition{1, 0}));
}

TEST(TrainingData, WorkersProduceIdenticalSamples) {
  DataConfig c =
      config_for({jsonl_dir() + "/messages.jsonl", jsonl_dir() + "/conversations.jsonl"});
  c.num_workers = 0;
  Dataset sync(c, tok(), pp(), fixture_chat());
  c.num_workers = 4;
  c.prefetch = 2;
  Dataset threaded(c, tok(), pp(), fixture_chat());
  for (int i = 0; i < 7; ++i) {
    const Sample a = sync.next(), b = threaded.next();
    EXPECT_EQ(a.source, b.source);
    EXPECT_EQ(a.ids, b.ids);
    EXPECT_EQ(a.labels, b.labels);
    EXPECT_EQ(a.grids, b.grids);
    EXPECT_EQ(a.pixel_values, b.pixel_values);
  }
  // Destroying a dataset whose workers are mid-flight must not hang or crash.
  c.prefetch = 8;
  { Dataset idle(c, tok(), pp(), fixture_chat()); }
}

TEST(TrainingData, MockMode) {
  DataConfig c;
  c.mock = true;
  c.mock_image_sizes = {{64, 64}, {96, 64}};
  c.mock_text_tokens = 21;
  c.mock_samples = 5;
  c.seq_length = 4096;
  Dataset ds(c, tok(), pp(), fixture_chat());
  EXPECT_EQ(ds.size(), 5);
  const Sample s = ds.next();
  EXPECT_EQ(s.source.rfind("mock:", 0), 0u);
  EXPECT_EQ(s.grids, (std::vector<GridTHW>{kRedGrid, kBlueGrid}));
  EXPECT_EQ(s.pixel_values.size(), static_cast<size_t>(256 + 280) * 1536);
  EXPECT_EQ(std::count(s.ids.begin(), s.ids.end(), kImagePad), kRedPads + kBluePads);
  // 10 user tokens, 11 reply tokens; header and turn tokens as in real data.
  EXPECT_EQ(s.ids.size(), 3 + (kRedPads + 2) + (kBluePads + 2) + 10 + 2 + 3 + 11 + 2u);
  const size_t learned = static_cast<size_t>(
      std::count_if(s.labels.begin(), s.labels.end(), [](int32_t l) { return l != kIgnoreLabel; }));
  EXPECT_EQ(learned, 11 + 2u);
  EXPECT_EQ(std::vector<int32_t>(s.ids.end() - 2, s.ids.end()),
            (std::vector<int32_t>{kImEnd, kNewline}));
  for (size_t i = 0; i < s.ids.size(); ++i)
    if (s.labels[i] != kIgnoreLabel) EXPECT_EQ(s.labels[i], s.ids[i]);
  const size_t reply_start = s.ids.size() - 13;
  for (size_t i = reply_start; i < s.ids.size() - 2; ++i) EXPECT_FALSE(tok().is_added(s.ids[i]));
  EXPECT_EQ(s.ids[reply_start - 2], kAssistant);

  // Deterministic and distinct per index.
  Dataset again(c, tok(), pp(), fixture_chat());
  const Sample t = again.next();
  EXPECT_EQ(t.ids, s.ids);
  EXPECT_EQ(t.pixel_values, s.pixel_values);
  const Sample u = again.next();
  EXPECT_NE(u.ids, s.ids);
  EXPECT_NE(u.pixel_values, s.pixel_values);

  c.seq_length = 100;
  Dataset too_small(c, tok(), pp(), fixture_chat());
  EXPECT_NE(error_of([&] { too_small.next(); }).find("seq_length"), std::string::npos);
}

TEST(TrainingData, ConfigErrors) {
  DataConfig c;
  EXPECT_NE(error_of([&] { Dataset ds(c, tok(), pp(), fixture_chat()); }).find("train_files"),
            std::string::npos);
  c.train_files = {jsonl_dir() + "/does_not_exist.jsonl"};
  EXPECT_NE(
      error_of([&] { Dataset ds(c, tok(), pp(), fixture_chat()); }).find("does_not_exist.jsonl"),
      std::string::npos);
  c.train_files = {jsonl_dir() + "/messages.jsonl"};
  c.prefetch = 0;
  EXPECT_NE(error_of([&] { Dataset ds(c, tok(), pp(), fixture_chat()); }).find("prefetch"),
            std::string::npos);
  c.prefetch = 4;
  c.seq_length = 0;
  EXPECT_NE(error_of([&] { Dataset ds(c, tok(), pp(), fixture_chat()); }).find("seq_length"),
            std::string::npos);
  // Every line bad: the error names the first.
  c.seq_length = 2048;
  const std::string file = write_scratch("all_bad.jsonl", "not json\n");
  c.train_files = {file};
  const std::string err = error_of([&] { Dataset ds(c, tok(), pp(), fixture_chat()); });
  EXPECT_NE(err.find(file + ":1"), std::string::npos) << err;
}

}  // namespace
}  // namespace iris
