// The Qwen byte-level BPE tokenizer against Hugging Face's output for the bundled tokenizer.json.
#include <sys/stat.h>
#include "language/tokenizer.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "core/error.h"
#include "core/json_read.h"
#include "language/unicode_nfc.h"
#include "language/unicode_utf8.h"
#include "tests/test_util.h"

namespace iris {
namespace {

using nlohmann::json;

bool is_valid_utf8(const std::string& s) {
  return utf8::find_invalid(s) == std::string::npos;
}

std::string error_message(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no iris::Error thrown)";
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("iris_tokenizer_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

void write_file(const std::string& path, const std::string& contents) {
  std::ofstream(path, std::ios::binary) << contents;
}

class QwenTokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const auto start = std::chrono::steady_clock::now();
    tokenizer_ = new Tokenizer(Tokenizer::from_file(test::tokenizer_path()));
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("tokenizer.json loaded in %.3f s\n", seconds);
    golden_ = new json(
        json::parse(read_text_file(test::fixture_dir() + "/golden.json")).at("tokenizer_cases"));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete golden_;
  }

  static const Tokenizer& tok() { return *tokenizer_; }
  static const json& cases() { return *golden_; }

  // The id of the token that stands for a single byte.
  static int32_t byte_token(uint8_t byte) {
    for (int32_t id = 0; id < tok().vocab_size(); ++id) {
      if (tok().is_added(id)) continue;
      const std::string text = tok().token_text(id);
      if (text.size() == 1 && static_cast<uint8_t>(text[0]) == byte) return id;
    }
    ADD_FAILURE() << "no token for byte " << int(byte);
    return -1;
  }

  static Tokenizer* tokenizer_;
  static json* golden_;
};

Tokenizer* QwenTokenizerTest::tokenizer_ = nullptr;
json* QwenTokenizerTest::golden_ = nullptr;

TEST_F(QwenTokenizerTest, GoldenCasesEncodeToHuggingFaceIds) {
  ASSERT_GE(cases().size(), 10u);
  for (const json& c : cases()) {
    const std::string text = c.at("text");
    SCOPED_TRACE("text: \"" + text + "\"");
    EXPECT_EQ(tok().encode(text), c.at("ids").get<std::vector<int32_t>>());
  }
}

TEST_F(QwenTokenizerTest, GoldenCasesDecodeBackToText) {
  for (const json& c : cases()) {
    const std::string text = c.at("text");
    SCOPED_TRACE("text: \"" + text + "\"");
    EXPECT_EQ(tok().decode(c.at("ids").get<std::vector<int32_t>>()), text);
  }
}

TEST_F(QwenTokenizerTest, StreamingDecodeOfGoldenCasesEqualsDecode) {
  for (const json& c : cases()) {
    const std::vector<int32_t> ids = c.at("ids");
    SCOPED_TRACE("text: \"" + c.at("text").get<std::string>() + "\"");
    StreamingDecoder stream(tok());
    std::string streamed;
    for (const int32_t id : ids) {
      const std::string piece = stream.push(id);
      EXPECT_TRUE(is_valid_utf8(piece)) << "partial UTF-8 emitted after id " << id;
      streamed += piece;
    }
    EXPECT_FALSE(stream.has_pending());
    streamed += stream.flush();
    EXPECT_EQ(streamed, tok().decode(ids));
  }
}

TEST_F(QwenTokenizerTest, StreamingNeverEmitsPartOfACharacter) {
  const std::string emoji = "\xF0\x9F\x99\x82";  // U+1F642
  StreamingDecoder stream(tok());
  std::string streamed;
  for (size_t i = 0; i < emoji.size(); ++i) {
    const std::string piece = stream.push(byte_token(static_cast<uint8_t>(emoji[i])));
    EXPECT_TRUE(is_valid_utf8(piece));
    if (i + 1 < emoji.size()) EXPECT_EQ(piece, "") << "after byte " << i;
    streamed += piece;
  }
  EXPECT_EQ(streamed, emoji);
  EXPECT_EQ(stream.flush(), "");

  // A character cut short by the end of the stream or by a byte that cannot continue it.
  EXPECT_EQ(stream.push(byte_token(0xF0)), "");
  EXPECT_EQ(stream.push(byte_token(0x9F)), "");
  EXPECT_EQ(stream.push(byte_token('a')),
            "\xEF\xBF\xBD"
            "a");
  EXPECT_EQ(stream.push(byte_token(0xE2)), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.push(tok().token_id("<|im_end|>")), "<|im_end|>");
}

TEST_F(QwenTokenizerTest, DecodeReplacesIllFormedBytesLikePython) {
  // Python: b"\xf0\x9f\x98a".decode("utf-8", "replace") == "\ufffda", b"\xe2\x80" -> "\ufffd".
  EXPECT_EQ(tok().decode({byte_token(0xF0), byte_token(0x9F), byte_token(0x98), byte_token('a')}),
            "\xEF\xBF\xBD"
            "a");
  EXPECT_EQ(tok().decode({tok().token_id("âĢ")}), "\xEF\xBF\xBD");
  EXPECT_EQ(tok().decode({byte_token(0xC0), byte_token(0xAF)}), "\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST_F(QwenTokenizerTest, NfcMakesDecomposedAndComposedTextAlike) {
  EXPECT_EQ(tok().encode("e\xCC\x81"), tok().encode("\xC3\xA9"));  // e + U+0301
  EXPECT_EQ(tok().encode("cafe\xCC\x81 au lait"), tok().encode("caf\xC3\xA9 au lait"));
  EXPECT_EQ(tok().encode("\xE1\x84\x92\xE1\x85\xA1\xE1\x86\xAB"), tok().encode("\xED\x95\x9C"));
  EXPECT_EQ(tok().encode("\xE2\x84\xA6"), tok().encode("\xCE\xA9"));  // OHM SIGN -> OMEGA
  EXPECT_NE(tok().encode("e\xCC\x81"), tok().encode("e"));
}

// The loader streams model.vocab and model.merges past the DOM, and reads a file whose lists it
// does not take as they stand (here a vocabulary entry given twice, which a DOM keeps once) as a
// whole DOM instead: both readings give the same tokenizer.
TEST_F(QwenTokenizerTest, StreamedAndWholeDomReadingsGiveTheSameTokenizer) {
  std::string text = read_text_file(test::tokenizer_path());
  const size_t vocab = text.find("\"vocab\"");
  ASSERT_NE(vocab, std::string::npos);
  const size_t brace = text.find('{', vocab);
  ASSERT_NE(brace, std::string::npos);
  const std::string first = tok().token_string(0);
  text.insert(brace + 1, json(first).dump() + ": 0, ");
  const Tokenizer dom = Tokenizer::from_json_text(text, "tokenizer.json");
  ASSERT_EQ(dom.vocab_size(), tok().vocab_size());
  for (int32_t id = 0; id < tok().vocab_size(); ++id) {
    ASSERT_EQ(dom.contains_id(id), tok().contains_id(id)) << id;
    if (!tok().contains_id(id)) continue;
    ASSERT_EQ(dom.token_string(id), tok().token_string(id)) << id;
    ASSERT_EQ(dom.is_special(id), tok().is_special(id)) << id;
  }
  for (const json& c : cases()) {
    const std::string t = c.at("text");
    EXPECT_EQ(dom.encode(t), tok().encode(t)) << t;
  }
}

TEST_F(QwenTokenizerTest, AddedTokensSplitTextAnywhere) {
  const int32_t im_end = tok().token_id("<|im_end|>");
  std::vector<int32_t> expected = tok().encode("abc");
  expected.push_back(im_end);
  for (const int32_t id : tok().encode("def")) expected.push_back(id);
  EXPECT_EQ(tok().encode("abc<|im_end|>def"), expected);
  // Not an added token: "<|im_end" is ordinary text.
  const std::vector<int32_t> partial = tok().encode("<|im_end");
  EXPECT_EQ(std::count(partial.begin(), partial.end(), im_end), 0);
  EXPECT_EQ(tok().decode(partial), "<|im_end");
}

TEST_F(QwenTokenizerTest, VocabularyQueries) {
  EXPECT_EQ(tok().vocab_size(), 151669);
  const int32_t im_start = tok().token_id("<|im_start|>");
  EXPECT_EQ(im_start, 151644);
  EXPECT_TRUE(tok().is_special(im_start));
  EXPECT_TRUE(tok().is_added(im_start));
  const int32_t think = tok().token_id("<think>");
  EXPECT_FALSE(tok().is_special(think));
  EXPECT_TRUE(tok().is_added(think));
  EXPECT_FALSE(tok().is_special(1879));
  EXPECT_EQ(tok().token_string(1879), "Ġworld");
  EXPECT_EQ(tok().token_text(1879), " world");
  EXPECT_EQ(tok().token_id("Ġworld"), 1879);
  EXPECT_EQ(tok().token_text(im_start), "<|im_start|>");
  EXPECT_EQ(tok().find_token("no such token here"), std::nullopt);
  EXPECT_NE(error_message([] { tok().token_id("no such token here"); }).find("no such token here"),
            std::string::npos);
  EXPECT_NE(error_message([] { tok().token_text(151669); }).find("151669"), std::string::npos);
  EXPECT_NE(error_message([] { tok().decode({1, -5}); }).find("-5"), std::string::npos);
}

TEST_F(QwenTokenizerTest, DecodeCanSkipSpecialTokens) {
  const std::vector<int32_t> ids = tok().encode("<|im_start|>user\nhi<think></think><|im_end|>");
  EXPECT_EQ(tok().decode(ids, /*skip_special_tokens=*/true), "user\nhi<think></think>");
  EXPECT_EQ(tok().decode(ids), "<|im_start|>user\nhi<think></think><|im_end|>");
}

TEST_F(QwenTokenizerTest, InvalidUtf8InputIsRejected) {
  const std::string message = error_message([] { tok().encode("ok \xFF bad"); });
  EXPECT_NE(message.find("not valid UTF-8 at byte 3"), std::string::npos) << message;
}

TEST_F(QwenTokenizerTest, RoundTripsRandomUnicodeAndLongRuns) {
  std::mt19937 rng(7);
  const std::vector<std::pair<char32_t, char32_t>> ranges = {
      {0x20, 0x7E},     {0x09, 0x0D},     {0xA0, 0x17F},    {0x300, 0x36F},
      {0x391, 0x3C9},   {0x410, 0x44F},   {0x3040, 0x30FF}, {0x4E00, 0x4F00},
      {0xAC00, 0xAD00}, {0x1100, 0x11FF}, {0x2000, 0x206F}, {0x1F600, 0x1F64F}};
  for (int trial = 0; trial < 300; ++trial) {
    std::string text;
    const int length = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < length; ++i) {
      const auto& [lo, hi] = ranges[rng() % ranges.size()];
      utf8::append(text, lo + static_cast<char32_t>(rng() % (hi - lo + 1)));
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    EXPECT_EQ(tok().decode(tok().encode(text)), nfc_normalize(text));
  }
  for (const std::string unit : {" ", "a", "\n", " \n", "1", "!", "\xE4\xB8\xAD", "\xC2\xA0"}) {
    std::string text;
    while (text.size() < 200000) text += unit;
    text += "x";
    EXPECT_EQ(tok().decode(tok().encode(text)), text) << "run of \"" << unit << "\"";
  }
}

TEST_F(QwenTokenizerTest, EncodeIsThreadSafe) {
  std::vector<std::vector<int32_t>> expected;
  for (const json& c : cases()) expected.push_back(c.at("ids"));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round)
        for (size_t i = 0; i < cases().size(); ++i)
          if (tok().encode(cases()[i].at("text").get<std::string>()) != expected[i])
            ++mismatches[t];
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

TEST(TokenizerLoadTest, MissingFileNamesThePath) {
  const std::string path = temp_path("does_not_exist.json");
  const std::string message = error_message([&] { Tokenizer::from_file(path); });
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("does not exist"), std::string::npos) << message;
}

TEST(TokenizerLoadTest, MalformedJsonNamesThePath) {
  const std::string path = temp_path("malformed.json");
  write_file(path, "{\"model\": {\"vocab\": {\"a\": 0,");
  const std::string message = error_message([&] { Tokenizer::from_file(path); });
  std::filesystem::remove(path);
  EXPECT_NE(message.find(path), std::string::npos) << message;
  EXPECT_NE(message.find("not valid JSON"), std::string::npos) << message;
}

TEST(TokenizerLoadTest, DeepNestingAndMistypedEntriesAreBoundedErrors) {
  // 200,000 levels once overflowed the stack in nlohmann's recursive dump() of an error message.
  const std::string deep =
      "{\"model\": {\"type\": \"BPE\", \"vocab\": " + std::string(200000, '[') +
      std::string(200000, ']') + "}}";
  std::string message = error_message([&] { Tokenizer::from_json_text(deep, "tokenizer.json"); });
  EXPECT_NE(message.find("tokenizer.json nests"), std::string::npos) << message;
  EXPECT_LT(message.size(), 400u);
  // A pre_tokenizer that is a huge structure is quoted in a few hundred characters at most.
  json real = json::parse(read_text_file(test::tokenizer_path()));
  real["pre_tokenizer"] = {{"type", "Other"}, {"x", std::vector<int>(100000, 7)}};
  const std::string text = real.dump();
  message = error_message([&] { Tokenizer::from_json_text(text, "tokenizer.json"); });
  EXPECT_NE(message.find("pre_tokenizer"), std::string::npos) << message;
  EXPECT_LT(message.size(), 600u) << message.size();
}

TEST(TokenizerLoadTest, SizeAndValueCountAreBoundedBeforeParsing) {
  std::string many = "{\"model\": {\"type\": \"BPE\", \"unused\": [0";
  for (int64_t i = 0; i < kJsonTokenizerLimits.max_values; ++i) many += ",0";
  many += "]}}";
  std::string message =
      error_message([&] { Tokenizer::from_json_text(many, "model/tokenizer.json"); });
  EXPECT_NE(message.find("model/tokenizer.json holds"), std::string::npos) << message;
  EXPECT_NE(message.find("more than the " + std::to_string(kJsonTokenizerLimits.max_values)),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("fetch_tokenizer.sh"), std::string::npos) << message;
  const std::string big = "{\"x\": \"" + std::string(kJsonTokenizerLimits.max_bytes, 'x') + "\"}";
  message = error_message([&] { Tokenizer::from_json_text(big, "model/tokenizer.json"); });
  EXPECT_NE(message.find("model/tokenizer.json is " + std::to_string(big.size()) + " bytes"),
            std::string::npos)
      << message;
}

TEST(TokenizerLoadTest, AFifoIsRefusedNotWaitedOn) {
  const std::string path = temp_path("tokenizer_fifo.json");
  std::filesystem::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  const std::string message = error_message([&] { Tokenizer::from_file(path); });
  std::filesystem::remove(path);
  EXPECT_NE(message.find("FIFO"), std::string::npos) << message;
}

TEST(TokenizerLoadTest, TruncatedRealFileNamesThePath) {
  const std::string path = temp_path("truncated.json");
  write_file(path, read_text_file(test::tokenizer_path()).substr(0, 100000));
  const std::string message = error_message([&] { Tokenizer::from_file(path); });
  std::filesystem::remove(path);
  EXPECT_NE(message.find(path), std::string::npos) << message;
}

// A tokenizer.json small enough to write by hand: the 256 byte tokens plus a few merges.
json tiny_tokenizer(const json& merges) {
  json vocab = json::object();
  char32_t next_shifted = 0x100;  // GPT-2's bytes_to_unicode
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    std::string spelling;
    utf8::append(spelling, printable ? static_cast<char32_t>(b) : next_shifted++);
    vocab[spelling] = b;
  }
  int32_t next_id = 256;
  for (const std::string merged : {"ab", "abc", "bc", "Ġa"}) vocab[merged] = next_id++;
  return json{
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         json::array(
             {{{"type", "Split"},
               {"pattern", {{"Regex", " ?\\p{L}+|\\s+"}}},
               {"behavior", "Isolated"},
               {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"added_tokens",
       json::array(
           {{{"id", 300}, {"content", "<eos>"}, {"special", true}, {"normalized", false}}})},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
}

TEST(TokenizerLoadTest, MergesAsPairsAndAsStringsAgree) {
  const json pairs = json::array({{"a", "b"}, {"ab", "c"}, {"b", "c"}, {"Ġ", "a"}});
  const json strings = json::array({"a b", "ab c", "b c", "Ġ a"});
  const Tokenizer from_pairs = Tokenizer::from_json_text(tiny_tokenizer(pairs).dump(), "pairs");
  const Tokenizer from_strings =
      Tokenizer::from_json_text(tiny_tokenizer(strings).dump(), "strings");
  const std::vector<int32_t> expected = {257, 259, 'a', 300};  // abc, Ġa, a, <eos>
  EXPECT_EQ(from_pairs.encode("abc aa<eos>"), expected);
  EXPECT_EQ(from_strings.encode("abc aa<eos>"), expected);
  EXPECT_EQ(from_pairs.encode("bc"), (std::vector<int32_t>{258}));
  // Rank decides between overlapping pairs: with "b c" first, "abc" can no longer become "abc".
  const json bc_first = json::array({{"b", "c"}, {"a", "b"}, {"ab", "c"}});
  const Tokenizer reordered = Tokenizer::from_json_text(tiny_tokenizer(bc_first).dump(), "bc");
  EXPECT_EQ(reordered.encode("abc"), (std::vector<int32_t>{'a', 258}));
  EXPECT_EQ(from_pairs.vocab_size(), 301);
  EXPECT_TRUE(from_pairs.is_special(300));
}

TEST(TokenizerLoadTest, BrokenStructureIsExplained) {
  json unknown_merge = tiny_tokenizer(json::array({{"a", "zz"}}));
  EXPECT_NE(error_message([&] {
              Tokenizer::from_json_text(unknown_merge.dump(), "t.json");
            }).find("needs token \"zz\""),
            std::string::npos);
  // The merges are looked up on several threads; the error still names the first bad one.
  json many = json::array();
  for (int r = 0; r < 1000; ++r)
    many.push_back(r == 700   ? json::array({"a", "zz"})
                   : r == 900 ? json::array({"yy", "b"})
                              : json::array({"a", "b"}));
  EXPECT_NE(error_message([&] {
              Tokenizer::from_json_text(tiny_tokenizer(many).dump(), "t.json");
            }).find("merge 700 needs token \"zz\""),
            std::string::npos);
  json bad_merge = tiny_tokenizer(json::array({"a b c"}));
  EXPECT_NE(
      error_message([&] { Tokenizer::from_json_text(bad_merge.dump(), "t.json"); }).find("merge 0"),
      std::string::npos);
  json no_model = tiny_tokenizer(json::array());
  no_model.erase("model");
  EXPECT_NE(error_message([&] {
              Tokenizer::from_json_text(no_model.dump(), "t.json");
            }).find("\"model\""),
            std::string::npos);
  json wordpiece = tiny_tokenizer(json::array());
  wordpiece["model"]["type"] = "WordPiece";
  EXPECT_NE(error_message([&] {
              Tokenizer::from_json_text(wordpiece.dump(), "t.json");
            }).find("WordPiece"),
            std::string::npos);
  json bad_regex = tiny_tokenizer(json::array());
  bad_regex["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  EXPECT_NE(error_message([&] {
              Tokenizer::from_json_text(bad_regex.dump(), "t.json");
            }).find("does not compile"),
            std::string::npos);
  json missing_byte = tiny_tokenizer(json::array());
  missing_byte["model"]["vocab"].erase("a");
  EXPECT_NE(error_message([&] {
              Tokenizer::from_json_text(missing_byte.dump(), "t.json");
            }).find("byte 97"),
            std::string::npos);
  json bad_id = tiny_tokenizer(json::array());
  bad_id["model"]["vocab"]["a"] = -3;
  EXPECT_NE(error_message([&] { Tokenizer::from_json_text(bad_id.dump(), "t.json"); }).find("-3"),
            std::string::npos);
}

}  // namespace
}  // namespace iris
