// ChatFormat: where a checkpoint's chat template is found (chat_template.jinja, chat_template.json,
// tokenizer_config.json, in that order; none: the built-in ChatML), what it is given (the
// conversation as transformers passes it, the special tokens, extra variables), the golden
// renderings through ChatMessage, and the image pads expanded after it.
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "bridge/chat_prompt.h"
#include "core/error.h"
#include "core/fs.h"
#include "test_util.h"

namespace iris {
namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;
using test::error_of;

std::string template_path(const std::string& file) {
  return test::data_dir() + "/chat_templates/" + file;
}

std::string read(const std::string& path) {
  return read_text_file(path, "test file");
}

// A fresh directory per test with the given files.
class Dir {
 public:
  explicit Dir(const std::string& name) : path_(test::scratch_dir() / name) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  void write(const std::string& file, const std::string& text) const {
    std::ofstream(path_ / file, std::ios::binary) << text;
  }
  std::string path() const { return path_.string(); }
  std::string path(const std::string& file) const { return (path_ / file).string(); }

 private:
  fs::path path_;
};

std::string tokenizer_config_with(const std::string& chat_template) {
  ordered_json cfg = {{"eos_token", "<|im_end|>"}, {"pad_token", "<|endoftext|>"}};
  if (!chat_template.empty()) cfg["chat_template"] = chat_template;
  return cfg.dump();
}

const std::vector<ChatMessage> kHello = {{"user", {ChatPart::make_text("Hello")}}};

TEST(ChatFormat, LooksForTheTemplateAsTransformersDoes) {
  Dir d("lookup");
  d.write("tokenizer_config.json", tokenizer_config_with("from tokenizer_config"));
  ChatFormat f = ChatFormat::from_dir(d.path());
  EXPECT_EQ(f.source(), d.path("tokenizer_config.json"));
  EXPECT_EQ(f.render(kHello, true), "from tokenizer_config");
  d.write("chat_template.json", ordered_json{{"chat_template", "from chat_template.json"}}.dump());
  EXPECT_EQ(ChatFormat::from_dir(d.path()).render(kHello, true), "from chat_template.json");
  d.write("chat_template.jinja", "from chat_template.jinja");
  f = ChatFormat::from_dir(d.path());
  EXPECT_EQ(f.render(kHello, true), "from chat_template.jinja");
  EXPECT_EQ(f.describe(), "chat template: " + d.path("chat_template.jinja"));

  // transformers' list of named templates: the one named "default".
  Dir named("named");
  named.write("tokenizer_config.json",
              ordered_json{{"chat_template",
                            {{{"name", "tool_use"}, {"template", "tools"}},
                             {{"name", "default"}, {"template", "plain"}}}}}
                  .dump());
  EXPECT_EQ(ChatFormat::from_dir(named.path()).render(kHello, true), "plain");

  // The first directory with a template wins (training: model.hf_dir, then the tokenizer's).
  Dir none("none");
  none.write("tokenizer_config.json", tokenizer_config_with(""));
  EXPECT_EQ(ChatFormat::from_dirs({none.path(), d.path()}).render(kHello, true),
            "from chat_template.jinja");
}

TEST(ChatFormat, NoTemplateIsTheBuiltInChatMLAndSaysSo) {
  Dir d("no_template");
  d.write("tokenizer_config.json", tokenizer_config_with(""));
  const ChatFormat f = ChatFormat::from_dir(d.path());
  EXPECT_FALSE(f.has_template());
  EXPECT_EQ(f.describe(), "chat template: none in " + d.path() +
                              " (chat_template.jinja, chat_template.json, "
                              "tokenizer_config.json); using the built-in ChatML");
  const std::vector<ChatMessage> conv = {
      {"system", {ChatPart::make_text("Be brief.")}},
      {"user", {ChatPart::make_image(), ChatPart::make_text("What is it?")}},
      {"assistant", {ChatPart::make_text("A dog.")}}};
  EXPECT_EQ(f.render(conv, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
            "<|image_pad|><|vision_end|>What is it?<|im_end|>\n<|im_start|>assistant\nA dog."
            "<|im_end|>\n<|im_start|>assistant\n");
  // What Qwen3-VL Instruct's template writes for the same conversation.
  const ChatFormat instruct =
      ChatFormat::from_file(template_path("qwen3_vl_instruct.jinja"), "template");
  EXPECT_EQ(f.render(conv, true), instruct.render(conv, true));
  EXPECT_EQ(f.render(conv, false), instruct.render(conv, false));
}

TEST(ChatFormat, TheTemplateSeesWhatTransformersPasses) {
  Dir d("context");
  d.write("tokenizer_config.json", ordered_json{{"eos_token", {{"content", "<|im_end|>"}}},
                                                {"pad_token", "<|endoftext|>"},
                                                {"bos_token", nullptr}}
                                       .dump());
  d.write("chat_template.jinja",
          "{{ messages|tojson }}|{{ add_generation_prompt }}|{{ tools }}|{{ documents }}|"
          "{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}|{{ enable_thinking }}");
  ChatFormat f = ChatFormat::from_dir(d.path());
  const std::vector<ChatMessage> conv = {
      {"user", {ChatPart::make_text("a"), ChatPart::make_image(), ChatPart::make_text("b")}},
      {"assistant", {ChatPart::make_text("c"), ChatPart::make_text("d")}}};
  EXPECT_EQ(f.render(conv, false),
            "[{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"}, {\"type\": "
            "\"image\"}, {\"type\": \"text\", \"text\": \"b\"}]}, {\"role\": \"assistant\", "
            "\"content\": \"cd\"}]|False|None|None|<|im_end|>|<|endoftext|>|False|");
  f.set_kwargs({{"enable_thinking", false}}, "--reasoning");
  EXPECT_NE(f.render(conv, true).find("|True|None|None|<|im_end|>|<|endoftext|>|False|False"),
            std::string::npos);
  EXPECT_EQ(error_of([&] {
              f.set_kwargs({{"messages", 1}}, "--chat-template-kwargs");
            }),
            "--chat-template-kwargs may not set \"messages\": Iris passes the conversation itself");
  EXPECT_NE(error_of([&] {
              f.set_kwargs(ordered_json::array(), "--chat-template-kwargs");
            }).find("must be a JSON object"),
            std::string::npos);
}

TEST(ChatFormat, TemplateFilesGivenByTheUser) {
  Dir d("files");
  d.write("t.jinja", "{% for m in messages %}[{{ m.content }}]{% endfor %}");
  d.write("t.json", ordered_json{{"chat_template", "json: {{ messages|length }}"}}.dump());
  d.write("empty.json", "{}");
  d.write("bad.jinja", "line one\n{% for m in messages %}{{ m.content|upper }}{% endfor %}");
  EXPECT_EQ(ChatFormat::from_file(d.path("t.jinja"), "--chat-template-file").render(kHello, true),
            "[Hello]");
  EXPECT_EQ(ChatFormat::from_file(d.path("t.json"), "--chat-template-file").render(kHello, true),
            "json: 1");
  EXPECT_EQ(error_of([&] { ChatFormat::from_file(d.path("empty.json"), "--chat-template-file"); }),
            "--chat-template-file " + d.path("empty.json") + " has no \"chat_template\"");
  EXPECT_EQ(error_of([&] { ChatFormat::from_file(d.path("bad.jinja"), "--chat-template-file"); }),
            "--chat-template-file " + d.path("bad.jinja") +
                ", line 2: the filter 'upper' is not supported (Iris supports length, count, "
                "string, trim and tojson)");
  EXPECT_NE(error_of([&] {
              ChatFormat::from_file(d.path("missing.jinja"), "--chat-template-file");
            }).find("missing.jinja"),
            std::string::npos);
}

// --chat-template NAME: llama.cpp's chatml is the built-in ChatML, and each Qwen name is the
// family's template byte for byte as the files kept here (whose sources and golden renderings are
// checked); any other name is none of them.
TEST(ChatFormat, BuiltInTemplatesByName) {
  const std::map<std::string, std::string> files = {
      {"qwen2-vl", "qwen2_vl.jinja"},
      {"qwen2.5-vl", "qwen2_vl.jinja"},
      {"qwen3-vl", "qwen3_vl_instruct.jinja"},
      {"qwen3-vl-thinking", "qwen3_vl_thinking.jinja"},
      {"qwen3", "qwen3.jinja"}};
  std::vector<std::string> names;
  for (const auto& [name, models] : ChatFormat::builtin_names()) {
    names.push_back(name);
    EXPECT_FALSE(models.empty()) << name;
  }
  std::vector<std::string> want = {"chatml"};
  for (const auto& [name, _] : files) want.push_back(name);
  std::sort(names.begin(), names.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(names, want);
  for (const auto& [name, file] : files) {
    const std::optional<ChatFormat> f = ChatFormat::builtin(name, {test::fixture_dir()});
    ASSERT_TRUE(f.has_value()) << name;
    ASSERT_TRUE(f->has_template()) << name;
    EXPECT_EQ(f->template_text(), read(template_path(file))) << name;
    EXPECT_EQ(f->describe().rfind("chat template: the built-in " + name + " (", 0), 0u)
        << f->describe();
    const ChatFormat from_file =
        ChatFormat::from_file(template_path(file), "template", {test::fixture_dir()});
    EXPECT_EQ(f->render(kHello, true), from_file.render(kHello, true)) << name;
  }
  const std::optional<ChatFormat> chatml = ChatFormat::builtin("chatml");
  ASSERT_TRUE(chatml.has_value());
  EXPECT_FALSE(chatml->has_template());
  EXPECT_EQ(chatml->describe(), "chat template: the built-in ChatML");
  EXPECT_EQ(chatml->render(kHello, true), ChatFormat().render(kHello, true));
  for (const char* other : {"llama2", "gemma", "Qwen3-VL", "qwen3_vl", ""})
    EXPECT_FALSE(ChatFormat::builtin(other).has_value()) << other;
}

// llama.cpp's --chat-template also takes the template itself.
TEST(ChatFormat, TemplateTextGivenInline) {
  EXPECT_EQ(ChatFormat::from_text("{% for m in messages %}[{{ m.content }}]{% endfor %}",
                                  "--chat-template")
                .render(kHello, true),
            "[Hello]");
  EXPECT_EQ(error_of([] {
              ChatFormat::from_text("{{ messages|upper }}", "--chat-template");
            }).rfind("--chat-template, line 1: the filter 'upper' is not supported", 0),
            0u);
}

// The conversations of golden.json through ChatMessage, as the CLI, the chat and training build
// them: the same text as transformers.
TEST(ChatFormat, RendersTheGoldenConversations) {
  const ordered_json golden = ordered_json::parse(read(template_path("golden.json")));
  int n = 0;
  for (const auto& entry : golden["templates"]) {
    for (const auto& c : entry["cases"]) {
      ChatFormat f = ChatFormat::from_file(template_path(entry["file"].get<std::string>()),
                                           "template", {test::fixture_dir()});
      if (!c["kwargs"].empty()) f.set_kwargs(c["kwargs"], "kwargs");
      std::vector<ChatMessage> messages;
      for (const auto& m : c["messages"]) {
        ChatMessage cm{m["role"].get<std::string>(), {}};
        if (m["content"].is_string()) {
          cm.content.push_back(ChatPart::make_text(m["content"].get<std::string>()));
        } else {
          for (const auto& item : m["content"])
            cm.content.push_back(item["type"] == "image"
                                     ? ChatPart::make_image()
                                     : ChatPart::make_text(item["text"].get<std::string>()));
        }
        messages.push_back(std::move(cm));
      }
      EXPECT_EQ(f.render(messages, c["add_generation_prompt"].get<bool>()),
                c["text"].get<std::string>())
          << entry["file"] << ": " << c["name"];
      ++n;
    }
  }
  EXPECT_GE(n, 50);
}

TEST(ChatFormat, ImagePadsAreExpandedAfterTheTemplate) {
  const Tokenizer tok = Tokenizer::from_file(test::tokenizer_path());
  const int32_t pad = tok.token_id("<|image_pad|>");
  const std::string text =
      "<|vision_start|><|image_pad|><|vision_end|>a<|vision_start|>"
      "<|image_pad|><|vision_end|>";
  const std::vector<int32_t> ids = encode_chat_text(tok, text, {{1, 4, 6}, {1, 2, 2}}, 2);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), pad), 6 + 1);
  EXPECT_EQ(ids.size(), tok.encode(text).size() - 2 + 7);
  EXPECT_EQ(error_of([&] {
              encode_chat_text(tok, text, {{1, 4, 6}}, 2);
            }),
            "the chat has 2 image placeholders (<|image_pad|>) for 1 image: the chat template "
            "must write each image once, and text may not spell <|image_pad|>");
  // A template that drops an image (Qwen3-VL Instruct writes none for a system message).
  const ChatFormat instruct =
      ChatFormat::from_file(template_path("qwen3_vl_instruct.jinja"), "template");
  const std::vector<ChatMessage> system_image = {{"system", {ChatPart::make_image()}},
                                                 {"user", {ChatPart::make_text("hi")}}};
  EXPECT_NE(error_of([&] {
              encode_chat_text(tok, instruct.render(system_image, true), {{1, 2, 2}}, 2);
            }).find("0 image placeholders"),
            std::string::npos);
}

TEST(ChatFormat, MediaMarkersPlaceTheImages) {
  const ChatMessage m = user_message("First <__media__>, then <__media__>.", 2);
  ASSERT_EQ(m.content.size(), 5u);
  EXPECT_EQ(m.content[0].text, "First ");
  EXPECT_EQ(m.content[1].kind, ChatPart::Kind::image);
  EXPECT_EQ(m.content[3].kind, ChatPart::Kind::image);
  EXPECT_EQ(m.content[4].text, ".");
  const ChatMessage before = user_message("Describe.", 2);
  ASSERT_EQ(before.content.size(), 3u);
  EXPECT_EQ(before.content[2].text, "Describe.");
  EXPECT_NE(error_of([] { user_message("one <__media__>", 2); }).find("one marker per image"),
            std::string::npos);
}

// A message that types a vision token is refused for what it is, not as a template's or the
// prompt's placeholder count (issue: a chat line with <|image_pad|> blamed the chat template).
TEST(ChatFormat, TypedVisionTokensAreRefusedNamingTheToken) {
  for (const char* token : {"<|image_pad|>", "<|video_pad|>", "<|vision_start|>"}) {
    const std::string msg = error_of([&] { user_message(std::string("what is ") + token, 0); });
    EXPECT_NE(msg.find(std::string("the message spells ") + token), std::string::npos) << msg;
    EXPECT_NE(msg.find("--image or /image"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace iris

namespace iris {
namespace {

// A config.json whose image_token_id is not the tokenizer's <|image_pad|> is refused naming both
// files and the field (it surfaced as a template or pad-count error).
TEST(ChatFormat, VisionTokenIdsMustBeTheTokenizers) {
  const Tokenizer tok = Tokenizer::from_file(test::tokenizer_path());
  check_vision_token_ids(tok, "tokenizer.json", 151655, 151656, 151652, 151653, "config.json");
  const std::string msg = test::error_of([&] {
    check_vision_token_ids(tok, "tokenizer.json", 151654, 151656, 151652, 151653, "config.json");
  });
  EXPECT_NE(msg.find("config.json gives image_token_id 151654 but tokenizer.json writes "
                     "<|image_pad|> as 151655"),
            std::string::npos)
      << msg;
}

}  // namespace
}  // namespace iris
