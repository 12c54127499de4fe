#include "language/unicode_nfc.h"

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "core/error.h"
#include "language/unicode_utf8.h"

namespace iris {
namespace {

struct CombiningClassRange {
  char32_t first;
  char32_t last;
  uint8_t combining_class;
};

struct CanonicalDecomposition {
  char32_t code_point;
  char32_t first;
  char32_t second;  // 0 for a singleton
  bool composes;    // a primary composite: NFC puts it back together
};

#include "language/unicode_nfc_tables.inc"

// Below U+0300 nothing has a combining class, and nothing decomposes below U+00C0, so Latin-1
// text skips the table searches.
constexpr char32_t kFirstCombining = 0x300;
constexpr char32_t kFirstDecomposable = 0xC0;

// Hangul syllables are composed and decomposed arithmetically (Unicode 3.12).
constexpr char32_t kHangulS = 0xAC00, kHangulL = 0x1100, kHangulV = 0x1161, kHangulT = 0x11A7;
constexpr char32_t kCountL = 19, kCountV = 21, kCountT = 28;
constexpr char32_t kCountN = kCountV * kCountT, kCountS = kCountL * kCountN;

uint8_t combining_class(char32_t cp) {
  if (cp < kFirstCombining) return 0;
  const auto it = std::upper_bound(
      std::begin(kCombiningClassRanges), std::end(kCombiningClassRanges), cp,
      [](char32_t value, const CombiningClassRange& range) { return value < range.first; });
  if (it == std::begin(kCombiningClassRanges)) return 0;
  const CombiningClassRange& range = *(it - 1);
  return cp <= range.last ? range.combining_class : 0;
}

const CanonicalDecomposition* find_decomposition(char32_t cp) {
  if (cp < kFirstDecomposable) return nullptr;
  const auto it = std::lower_bound(
      std::begin(kCanonicalDecompositions), std::end(kCanonicalDecompositions), cp,
      [](const CanonicalDecomposition& d, char32_t value) { return d.code_point < value; });
  if (it == std::end(kCanonicalDecompositions) || it->code_point != cp) return nullptr;
  return &*it;
}

uint64_t pair_key(char32_t first, char32_t second) {
  return (static_cast<uint64_t>(first) << 32) | second;
}

struct CompositionData {
  std::unordered_map<uint64_t, char32_t> composites;
  // Code points for which the quick check cannot answer "yes": those NFC never leaves in place
  // (NFC_QC=No) and those that may merge with what precedes them (NFC_QC=Maybe). Sorted.
  std::vector<char32_t> not_quick_yes;
};

const CompositionData& composition_data() {
  static const CompositionData data = [] {
    CompositionData d;
    d.composites.reserve(std::size(kCanonicalDecompositions));
    for (const CanonicalDecomposition& entry : kCanonicalDecompositions) {
      if (entry.composes) {
        d.composites.emplace(pair_key(entry.first, entry.second), entry.code_point);
        d.not_quick_yes.push_back(entry.second);
      } else {
        d.not_quick_yes.push_back(entry.code_point);
      }
    }
    for (char32_t v = kHangulV; v < kHangulV + kCountV; ++v) d.not_quick_yes.push_back(v);
    for (char32_t t = kHangulT + 1; t < kHangulT + kCountT; ++t) d.not_quick_yes.push_back(t);
    std::sort(d.not_quick_yes.begin(), d.not_quick_yes.end());
    d.not_quick_yes.erase(std::unique(d.not_quick_yes.begin(), d.not_quick_yes.end()),
                          d.not_quick_yes.end());
    return d;
  }();
  return data;
}

void decompose_into(std::vector<char32_t>& out, char32_t cp) {
  if (cp >= kHangulS && cp < kHangulS + kCountS) {
    const char32_t index = cp - kHangulS;
    out.push_back(kHangulL + index / kCountN);
    out.push_back(kHangulV + (index % kCountN) / kCountT);
    if (index % kCountT != 0) out.push_back(kHangulT + index % kCountT);
    return;
  }
  const CanonicalDecomposition* d = find_decomposition(cp);
  if (d == nullptr) {
    out.push_back(cp);
    return;
  }
  decompose_into(out, d->first);
  if (d->second != 0) decompose_into(out, d->second);
}

// The primary composite of the pair, or 0 when the pair does not compose.
char32_t compose_pair(char32_t first, char32_t second) {
  if (first >= kHangulL && first < kHangulL + kCountL && second >= kHangulV &&
      second < kHangulV + kCountV)
    return kHangulS + ((first - kHangulL) * kCountV + (second - kHangulV)) * kCountT;
  if (first >= kHangulS && first < kHangulS + kCountS && (first - kHangulS) % kCountT == 0 &&
      second > kHangulT && second < kHangulT + kCountT)
    return first + (second - kHangulT);
  const auto& composites = composition_data().composites;
  const auto it = composites.find(pair_key(first, second));
  return it == composites.end() ? 0 : it->second;
}

void canonical_order(std::vector<char32_t>& text) {
  size_t i = 0;
  while (i < text.size()) {
    if (combining_class(text[i]) == 0) {
      ++i;
      continue;
    }
    size_t end = i + 1;
    while (end < text.size() && combining_class(text[end]) != 0) ++end;
    if (end - i > 1)
      std::stable_sort(text.begin() + i, text.begin() + end, [](char32_t a, char32_t b) {
        return combining_class(a) < combining_class(b);
      });
    i = end;
  }
}

// Canonical composition (UAX #15): each character joins the last starter unless a character in
// between has the same or a higher combining class (it is "blocked").
void compose(std::vector<char32_t>& text) {
  if (text.empty()) return;
  size_t starter = 0;
  // Text that opens with a non-starter has no starter to compose with; 256 blocks every pair
  // until a real starter arrives (no primary composite starts with a non-starter).
  int last_class = combining_class(text[0]) == 0 ? 0 : 256;
  size_t write = 1;
  for (size_t read = 1; read < text.size(); ++read) {
    const char32_t cp = text[read];
    const int cp_class = combining_class(cp);
    if (last_class == 0 || last_class < cp_class) {
      const char32_t composite = compose_pair(text[starter], cp);
      if (composite != 0) {
        text[starter] = composite;
        continue;
      }
    }
    if (cp_class == 0) starter = write;
    last_class = cp_class;
    text[write++] = cp;
  }
  text.resize(write);
}

bool is_ascii(std::string_view text) {
  for (const char c : text)
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  return true;
}

}  // namespace

bool nfc_quick_check(std::string_view text) {
  if (is_ascii(text)) return true;
  const auto& not_quick_yes = composition_data().not_quick_yes;
  uint8_t last_class = 0;
  size_t i = 0;
  while (i < text.size()) {
    const utf8::Step step = utf8::decode_step(text.substr(i));
    if (step.status != utf8::StepStatus::complete) return false;
    i += step.length;
    const char32_t cp = step.code_point;
    if (cp < kFirstCombining) {
      last_class = 0;
      continue;
    }
    const uint8_t cp_class = combining_class(cp);
    if (cp_class != 0 && last_class > cp_class) return false;
    if (std::binary_search(not_quick_yes.begin(), not_quick_yes.end(), cp)) return false;
    last_class = cp_class;
  }
  return true;
}

std::string nfc_normalize(std::string_view text) {
  if (nfc_quick_check(text)) return std::string(text);
  std::vector<char32_t> code_points;
  code_points.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const utf8::Step step = utf8::decode_step(text.substr(i));
    IRIS_CHECK(step.status == utf8::StepStatus::complete, "text is not valid UTF-8 at byte ", i,
               " of ", text.size(), ": convert it to UTF-8 before normalizing");
    decompose_into(code_points, step.code_point);
    i += step.length;
  }
  canonical_order(code_points);
  compose(code_points);
  std::string out;
  out.reserve(text.size());
  for (const char32_t cp : code_points) utf8::append(out, cp);
  return out;
}

const char* nfc_unicode_version() {
  return kNfcUnicodeVersion;
}

}  // namespace iris
