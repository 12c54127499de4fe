// NFC normalization against Python's unicodedata, and UTF-8 decoding against Python's
// errors="replace".
#include <string>

#include "core/error.h"
#include "language/unicode_nfc.h"
#include "language/unicode_utf8.h"
#include "tests/test_util.h"

namespace iris {
namespace {

using nlohmann::json;

std::string hex(const std::string& s) {
  std::string out;
  char buffer[4];
  for (const char c : s) {
    std::snprintf(buffer, sizeof buffer, "%02X ", static_cast<uint8_t>(c));
    out += buffer;
  }
  return out;
}

TEST(NfcTest, MatchesPythonUnicodedataOnGeneratedCases) {
  // Written by scripts/gen_unicode_nfc.py with the same Python that generated the tables.
  const json data = json::parse(read_text_file(test::data_dir() + "/unicode_nfc_cases.json"));
  EXPECT_EQ(data.at("unicode_version").get<std::string>(), nfc_unicode_version());
  const json& cases = data.at("cases");
  ASSERT_GT(cases.size(), 1000u);
  int failures = 0;
  for (const json& c : cases) {
    const std::string input = c.at(0), expected = c.at(1);
    const std::string actual = nfc_normalize(input);
    if (actual != expected && ++failures <= 10)
      ADD_FAILURE() << "NFC of " << hex(input) << "gave " << hex(actual) << "expected "
                    << hex(expected);
    EXPECT_EQ(nfc_normalize(expected), expected) << "NFC is not idempotent on " << hex(expected);
    if (nfc_quick_check(input))
      EXPECT_EQ(input, expected) << "quick check wrongly said yes for " << hex(input);
  }
  EXPECT_EQ(failures, 0);
}

TEST(NfcTest, ComposesReordersAndLeavesNfcAlone) {
  EXPECT_EQ(nfc_normalize("e\xCC\x81"), "\xC3\xA9");
  // U+0323 (class 220) sorts before U+0307 (230); then s+dot below+dot above is U+1E69.
  EXPECT_EQ(nfc_normalize("s\xCC\x87\xCC\xA3"), "\xE1\xB9\xA9");
  // Conjoining jamo L V T become one syllable.
  EXPECT_EQ(nfc_normalize("\xE1\x84\x92\xE1\x85\xA1\xE1\x86\xAB"), "\xED\x95\x9C");
  EXPECT_EQ(nfc_normalize("\xE2\x84\xAB"), "\xC3\x85");  // ANGSTROM SIGN is a singleton
  EXPECT_EQ(nfc_normalize("plain ASCII"), "plain ASCII");
  EXPECT_EQ(nfc_normalize(""), "");
  EXPECT_TRUE(nfc_quick_check("\xE4\xB8\xAD\xE6\x96\x87"));
  EXPECT_FALSE(nfc_quick_check("e\xCC\x81"));
}

TEST(NfcTest, IllFormedInputIsAnError) {
  try {
    nfc_normalize("e\xCC\x81\xC0");
    FAIL() << "expected iris::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("byte 3"), std::string::npos) << e.what();
  }
}

TEST(Utf8Test, ReplacesMaximalSubpartsLikePython) {
  const std::string r = "\xEF\xBF\xBD";
  // Each expectation is what Python's bytes.decode("utf-8", "replace") returns.
  EXPECT_EQ(utf8::replace_invalid("\xE0\x80"), r + r);
  EXPECT_EQ(utf8::replace_invalid("\xF0\x9F\x98"), r);
  EXPECT_EQ(utf8::replace_invalid("\xED\xA0\x80"), r + r + r);  // a surrogate
  EXPECT_EQ(utf8::replace_invalid("\xC0\xAF"), r + r);          // overlong
  EXPECT_EQ(utf8::replace_invalid("\xF4\x90\x80\x80"), r + r + r + r);
  EXPECT_EQ(utf8::replace_invalid("a\xFF"
                                  "b"),
            "a" + r + "b");
  EXPECT_EQ(utf8::replace_invalid("\xF0\x9F\x98"
                                  "a"),
            r + "a");
  EXPECT_EQ(utf8::replace_invalid("h\xC3\xA9 \xF0\x9F\x99\x82"), "h\xC3\xA9 \xF0\x9F\x99\x82");
}

TEST(Utf8Test, AppendCompleteHoldsBackOnlyATruncatedTail) {
  std::string out;
  EXPECT_EQ(utf8::append_complete(out, "ab\xF0\x9F\x99"), 2u);
  EXPECT_EQ(out, "ab");
  out.clear();
  EXPECT_EQ(utf8::append_complete(out, "\xF0\x9F\x99\x82\xE2"), 4u);
  EXPECT_EQ(out, "\xF0\x9F\x99\x82");
  EXPECT_EQ(utf8::find_invalid("ok\xE2\x82"), 2u);
  EXPECT_EQ(utf8::find_invalid("ok \xE2\x82\xAC"), std::string::npos);
}

TEST(Utf8Test, EncodesEveryScalarValueBackToItself) {
  for (char32_t cp = 0; cp <= 0x10FFFF; ++cp) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string bytes;
    utf8::append(bytes, cp);
    const utf8::Step step = utf8::decode_step(bytes);
    ASSERT_EQ(step.status, utf8::StepStatus::complete) << std::hex << uint32_t(cp);
    ASSERT_EQ(uint32_t(step.code_point), uint32_t(cp));
    ASSERT_EQ(step.length, bytes.size());
  }
}

}  // namespace
}  // namespace iris
