#include "language/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/fs.h"
#include "core/json_read.h"
#include "language/unicode_nfc.h"
#include "language/unicode_utf8.h"

namespace iris {
namespace {

using nlohmann::json;

// Ids index dense tables, so a corrupt file must not be able to ask for billions of entries.
constexpr int64_t kMaxTokenId = (1 << 24) - 1;
// Past this, words are merged afresh each time rather than remembered.
constexpr size_t kMaxCachedWordBytes = 256;
constexpr size_t kMaxCachedWords = 1 << 15;

// GPT-2's bytes_to_unicode: every byte gets a printable character so that vocabularies can be
// written as text. Printable Latin-1 bytes stand for themselves; the others are moved to U+0100+.
struct ByteLevelAlphabet {
  std::array<char32_t, 256> char_of_byte{};
  std::array<int16_t, 0x144> byte_of_char{};  // -1 where the character stands for no byte

  ByteLevelAlphabet() {
    byte_of_char.fill(-1);
    char32_t next_shifted = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      char_of_byte[b] = printable ? static_cast<char32_t>(b) : next_shifted++;
      byte_of_char[char_of_byte[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteLevelAlphabet& byte_level() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

// The bytes a token spelling stands for, by HF's ByteLevel decoder rule: when every character
// belongs to the byte-level alphabet, the bytes they stand for; otherwise the spelling itself
// (added tokens such as "<|im_start|>" are written in plain text).
std::string bytes_of_spelling(std::string_view spelling) {
  const ByteLevelAlphabet& alphabet = byte_level();
  std::string bytes;
  bytes.reserve(spelling.size());
  size_t i = 0;
  while (i < spelling.size()) {
    const utf8::Step step = utf8::decode_step(spelling.substr(i));
    if (step.status != utf8::StepStatus::complete ||
        step.code_point >= alphabet.byte_of_char.size() ||
        alphabet.byte_of_char[step.code_point] < 0)
      return std::string(spelling);
    bytes.push_back(static_cast<char>(alphabet.byte_of_char[step.code_point]));
    i += step.length;
  }
  return bytes;
}

std::string spelling_of_bytes(std::string_view bytes) {
  std::string spelling;
  spelling.reserve(bytes.size() * 2);
  for (const char c : bytes)
    utf8::append(spelling, byte_level().char_of_byte[static_cast<uint8_t>(c)]);
  return spelling;
}

// Unicode White_Space, which is what HF (Rust's char::is_whitespace, Oniguruma's \s) means by
// whitespace.
bool is_white_space(char32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  if (cp < 0x85) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Oniguruma's \s (used by HF) is Unicode White_Space; PCRE2's UCP \s also takes U+180E. Spelling
// the property out makes both engines split alike.
std::string to_pcre2_pattern(const std::string& pattern) {
  std::string out;
  out.reserve(pattern.size() + 32);
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] != '\\' || i + 1 == pattern.size()) {
      out.push_back(pattern[i]);
      continue;
    }
    const char escaped = pattern[++i];
    if (escaped == 's')
      out += "\\p{White_Space}";
    else if (escaped == 'S')
      out += "\\P{White_Space}";
    else
      out += {'\\', escaped};
  }
  return out;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof buffer) < 0)
    return "PCRE2 error " + std::to_string(code);
  return reinterpret_cast<const char*>(buffer);
}

struct Pcre2CodeDeleter {
  void operator()(pcre2_code* code) const { pcre2_code_free(code); }
};
struct Pcre2MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};
using MatchData = std::unique_ptr<pcre2_match_data, Pcre2MatchDataDeleter>;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using SpellingMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

struct MergeTarget {
  int32_t rank;
  int32_t id;
};

struct AddedToken {
  std::string content;
  int32_t id;
  bool lstrip;
  bool rstrip;
};

struct AddedTokenMatch {
  size_t begin;
  size_t end;
  int32_t id;
};

// Added tokens matched leftmost first, then longest, like HF's Aho-Corasick LeftmostLongest.
class AddedTokenMatcher {
 public:
  void add(AddedToken token) {
    first_bytes_[static_cast<uint8_t>(token.content[0])] = true;
    const auto position =
        std::upper_bound(tokens_.begin(), tokens_.end(), token.content.size(),
                         [](size_t size, const AddedToken& t) { return size > t.content.size(); });
    tokens_.insert(position, std::move(token));
  }
  bool empty() const { return tokens_.empty(); }

  // Calls on_text for each run of ordinary text and on_token for each added token, in order.
  template <typename OnText, typename OnToken>
  void split(std::string_view text, OnText&& on_text, OnToken&& on_token) const {
    size_t done = 0;
    while (done < text.size()) {
      const std::optional<AddedTokenMatch> match = find(text, done);
      if (!match) break;
      if (match->begin > done) on_text(text.substr(done, match->begin - done));
      on_token(match->id);
      done = match->end;
    }
    if (done < text.size()) on_text(text.substr(done));
  }

 private:
  std::optional<AddedTokenMatch> find(std::string_view text, size_t from) const {
    for (size_t pos = from; pos < text.size(); ++pos) {
      if (!first_bytes_[static_cast<uint8_t>(text[pos])]) continue;
      for (const AddedToken& token : tokens_) {
        if (text.compare(pos, token.content.size(), token.content) != 0) continue;
        AddedTokenMatch match{pos, pos + token.content.size(), token.id};
        if (token.lstrip) match.begin = skip_white_space_backward(text, match.begin, from);
        if (token.rstrip) match.end = skip_white_space_forward(text, match.end);
        return match;
      }
    }
    return std::nullopt;
  }

  static size_t skip_white_space_forward(std::string_view text, size_t pos) {
    while (pos < text.size()) {
      const utf8::Step step = utf8::decode_step(text.substr(pos));
      if (step.status != utf8::StepStatus::complete || !is_white_space(step.code_point)) break;
      pos += step.length;
    }
    return pos;
  }

  static size_t skip_white_space_backward(std::string_view text, size_t pos, size_t limit) {
    while (pos > limit) {
      size_t start = pos - 1;
      while (start > limit && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
      const utf8::Step step = utf8::decode_step(text.substr(start, pos - start));
      if (step.status != utf8::StepStatus::complete || step.length != pos - start ||
          !is_white_space(step.code_point))
        break;
      pos = start;
    }
    return pos;
  }

  std::vector<AddedToken> tokens_;  // longest first, so the first hit at a position is longest
  std::array<bool, 256> first_bytes_{};
};

}  // namespace

struct Tokenizer::Impl {
  std::string source;  // named in error messages
  std::vector<std::string> token_bytes;
  std::vector<std::string> token_spellings;
  std::vector<uint8_t> token_flags;
  SpellingMap id_of_spelling;
  std::array<int32_t, 256> byte_tokens{};
  std::unordered_map<uint64_t, MergeTarget> merges;
  bool ignore_merges = false;  // a word that is itself in the vocabulary skips merging
  bool apply_nfc = false;
  AddedTokenMatcher raw_added_tokens;         // matched before normalization
  AddedTokenMatcher normalized_added_tokens;  // matched in the normalized text
  std::unique_ptr<pcre2_code, Pcre2CodeDeleter> split_regex;

  mutable std::mutex word_cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>>
      word_cache;

  static constexpr uint8_t kPresent = 1, kAdded = 2, kSpecial = 4;

  void check_id(int32_t id) const {
    IRIS_CHECK(
        id >= 0 && static_cast<size_t>(id) < token_flags.size() && (token_flags[id] & kPresent),
        "token id ", id, " is not in the vocabulary of ", source, " (valid ids are 0..",
        static_cast<int64_t>(token_flags.size()) - 1, ")");
  }

  void encode_text(std::string_view text, pcre2_match_data* match_data,
                   std::vector<int32_t>& ids) const;
  void encode_words(std::string_view text, pcre2_match_data* match_data,
                    std::vector<int32_t>& ids) const;
  void encode_word(std::string_view word, std::vector<int32_t>& ids) const;
  void merge_word(std::string_view word, std::vector<int32_t>& ids) const;
};

namespace {

// The bulk of a tokenizer.json is model.vocab and model.merges: some 150k entries each for Qwen.
// As a DOM they cost most of a load (a node per string, a std::map per object, all freed again),
// so this reader streams them into flat lists and builds a DOM of the rest only. It reads only
// what a well-formed file holds: anything else there (a parse error, a non-integer id, a merge of
// another shape, a key given twice) stops it, and the file is read again as a whole DOM, whose
// checks name the problem. Either way the tokenizer is the same.
class BulkReader {
 public:
  struct Merge {
    std::string left, right;
  };
  json rest;  // the document without model.vocab and model.merges
  std::vector<std::pair<std::string, int64_t>> vocab;
  std::vector<Merge> merges;
  bool has_vocab = false, has_merges = false;

  bool null() { return value(nullptr); }
  bool boolean(bool v) { return value(v); }
  bool number_integer(json::number_integer_t v) { return mode_ == Mode::dom && value(v); }
  bool number_unsigned(json::number_unsigned_t v) {
    if (mode_ == Mode::vocab) {
      if (v > static_cast<json::number_unsigned_t>(kMaxTokenId)) return false;
      vocab.emplace_back(std::move(key_), static_cast<int64_t>(v));
      return true;
    }
    return value(v);
  }
  bool number_float(json::number_float_t v, const std::string&) { return value(v); }
  bool string(std::string& v) {
    if (mode_ == Mode::merges) {  // the older "left right" form
      const size_t space = v.find(' ');
      if (space == std::string::npos || v.find(' ', space + 1) != std::string::npos) return false;
      merges.push_back({v.substr(0, space), v.substr(space + 1)});
      return true;
    }
    if (mode_ == Mode::merge_pair) {
      if (pair_size_ == 0) pair_.left = std::move(v);
      if (pair_size_ == 1) pair_.right = std::move(v);
      return ++pair_size_ <= 2;
    }
    return value(std::move(v));
  }
  bool binary(json::binary_t&) { return false; }
  bool start_object(std::size_t) {
    if (mode_ != Mode::dom) return false;
    if (in_model_object() && key_ == "vocab") {
      if (has_vocab) return false;
      has_vocab = true;
      mode_ = Mode::vocab;
      vocab.reserve(1 << 18);
      return true;
    }
    // A member of the root object (a map node, which stays where it is).
    const bool model = stack_.size() == 1 && stack_.back()->is_object() && key_ == "model";
    stack_.push_back(place(json::value_t::object));
    if (model) model_ = stack_.back();
    return true;
  }
  bool key(std::string& k) {
    if (mode_ == Mode::vocab) {
      key_ = std::move(k);
      return true;
    }
    if (mode_ != Mode::dom) return false;
    // A key given twice keeps its last value in a DOM; these lists would keep both.
    if (stack_.back() == model_ && (k == "vocab" || k == "merges") &&
        (k == "vocab" ? has_vocab : has_merges))
      return false;
    key_ = k;
    member_ = &(*stack_.back())[k];
    return true;
  }
  bool end_object() {
    if (mode_ == Mode::vocab) {
      mode_ = Mode::dom;
      return true;
    }
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) {
    if (mode_ == Mode::merges) {
      mode_ = Mode::merge_pair;
      pair_size_ = 0;
      return true;
    }
    if (mode_ != Mode::dom) return false;
    if (in_model_object() && key_ == "merges") {
      if (has_merges) return false;
      has_merges = true;
      mode_ = Mode::merges;
      merges.reserve(1 << 18);
      return true;
    }
    stack_.push_back(place(json::value_t::array));
    return true;
  }
  bool end_array() {
    if (mode_ == Mode::merge_pair) {
      if (pair_size_ != 2) return false;
      merges.push_back(std::move(pair_));
      mode_ = Mode::merges;
      return true;
    }
    if (mode_ == Mode::merges) {
      mode_ = Mode::dom;
      return true;
    }
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    return false;
  }

 private:
  enum class Mode { dom, vocab, merges, merge_pair };

  bool in_model_object() const { return !stack_.empty() && stack_.back() == model_; }
  // Where the next value goes: the root, the end of the current array, or the member whose key
  // came last.
  template <typename V>
  json* place(V&& v) {
    if (stack_.empty()) {
      rest = json(std::forward<V>(v));
      return &rest;
    }
    if (stack_.back()->is_array()) {
      stack_.back()->emplace_back(std::forward<V>(v));
      return &stack_.back()->back();
    }
    *member_ = json(std::forward<V>(v));
    return member_;
  }
  template <typename V>
  bool value(V&& v) {
    if (mode_ != Mode::dom) return false;
    place(std::forward<V>(v));
    return true;
  }

  Mode mode_ = Mode::dom;
  std::vector<json*> stack_;
  json* model_ = nullptr;
  json* member_ = nullptr;
  std::string key_;
  Merge pair_;
  int pair_size_ = 0;
};

// What the bulk reader found that a well-formed file cannot hold (a token or id given twice): the
// whole-DOM reading names it.
struct BulkAnomaly {};

class Loader {
 public:
  explicit Loader(std::string source) : source_(std::move(source)) {}

  std::shared_ptr<Tokenizer::Impl> load(std::string_view text) {
    // Bounded before either reader below allocates for it.
    try {
      check_json_bounds(text, source_, kJsonTokenizerLimits);
    } catch (const Error& e) {
      IRIS_FAIL(e.what(),
                "; re-fetch it with scripts/fetch_tokenizer.sh or point to a tokenizer.json");
    }
    {
      BulkReader bulk;
      if (json::sax_parse(text.begin(), text.end(), &bulk) && bulk.has_vocab && bulk.has_merges &&
          !bulk.vocab.empty()) {
        try {
          return load(bulk.rest, &bulk);
        } catch (const BulkAnomaly&) {
        }
      }
    }
    json root;
    try {
      root = parse_json(text, source_, kJsonTokenizerLimits);
    } catch (const Error& e) {
      IRIS_FAIL(e.what(),
                "; re-fetch it with scripts/fetch_tokenizer.sh or point to a tokenizer.json");
    }
    return load(root, nullptr);
  }

 private:
  // bulk: model.vocab and model.merges as the bulk reader listed them (root lacks them), or null
  // to read them from root.
  std::shared_ptr<Tokenizer::Impl> load(const json& root, BulkReader* bulk) {
    impl_ = std::make_shared<Tokenizer::Impl>();
    impl_->source = source_;
    try {
      IRIS_CHECK(root.is_object(), source_,
                 " is not a tokenizer.json: the top level is not an object");
      load_model(member(root, "model", "the top level"), bulk);
      load_normalizer(root.value("normalizer", json()));
      load_added_tokens(root);
      load_pre_tokenizer(root.value("pre_tokenizer", json()));
      check_decoder(root.value("decoder", json()));
    } catch (const json::exception& e) {
      IRIS_FAIL(source_, " has an unexpected structure (", json_error_text(e), ")");
    }
    return std::move(impl_);
  }

  const json& member(const json& object, const char* key, const char* where) {
    IRIS_CHECK(object.is_object() && object.contains(key), source_, ": ", where, " has no \"", key,
               "\" entry; is this a Hugging Face tokenizer.json?");
    return object.at(key);
  }

  int32_t checked_id(const json& value, const std::string& token) {
    IRIS_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0 &&
                   value.get<int64_t>() <= kMaxTokenId,
               source_, ": token \"", clip_text(token, 80), "\" has id ", json_excerpt(value),
               ", expected an integer in 0..", kMaxTokenId);
    return static_cast<int32_t>(value.get<int64_t>());
  }

  void set_token(int32_t id, const std::string& spelling, uint8_t flags) {
    impl_->id_of_spelling[spelling] = id;
    set_token_entry(id, spelling, flags);
  }
  // set_token without the spelling's map entry.
  void set_token_entry(int32_t id, const std::string& spelling, uint8_t flags) {
    Tokenizer::Impl& t = *impl_;
    if (static_cast<size_t>(id) >= t.token_flags.size()) {
      t.token_bytes.resize(id + 1);
      t.token_spellings.resize(id + 1);
      t.token_flags.resize(id + 1, 0);
    }
    t.token_bytes[id] = bytes_of_spelling(spelling);
    t.token_spellings[id] = spelling;
    t.token_flags[id] |= flags | Tokenizer::Impl::kPresent;
  }

  void load_model(const json& model, BulkReader* bulk) {
    const std::string type = model.value("type", "BPE");
    IRIS_CHECK(type == "BPE", source_, ": model type \"", type,
               "\" is not supported; only byte-level BPE (Qwen, GPT-2 style) is implemented");
    IRIS_CHECK(!model.value("byte_fallback", false), source_,
               ": byte_fallback BPE (SentencePiece style) is not supported");
    IRIS_CHECK(model.value("dropout", json()).is_null(), source_,
               ": BPE dropout is not supported (it makes encoding random)");
    for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      const json value = model.value(affix, json());
      IRIS_CHECK(value.is_null() || value == "", source_, ": model.", affix, " ",
                 json_excerpt(value), " is not supported; byte-level BPE uses none");
    }
    impl_->ignore_merges = model.value("ignore_merges", false);

    if (bulk != nullptr) {
      load_bulk_vocab(*bulk);
    } else {
      const json& vocab = member(model, "vocab", "model");
      IRIS_CHECK(vocab.is_object() && !vocab.empty(), source_,
                 ": model.vocab must be a non-empty object mapping tokens to ids");
      impl_->id_of_spelling.reserve(vocab.size() + 64);
      for (const auto& [spelling, id_value] : vocab.items()) {
        const int32_t id = checked_id(id_value, spelling);
        IRIS_CHECK(static_cast<size_t>(id) >= impl_->token_flags.size() ||
                       !(impl_->token_flags[id] & Tokenizer::Impl::kPresent),
                   source_, ": id ", id, " is given to both \"", impl_->token_spellings[id],
                   "\" and \"", spelling, "\" in model.vocab");
        set_token(id, spelling, 0);
      }
    }
    for (int b = 0; b < 256; ++b) {
      std::string spelling;
      utf8::append(spelling, byte_level().char_of_byte[b]);
      const auto it = impl_->id_of_spelling.find(spelling);
      IRIS_CHECK(it != impl_->id_of_spelling.end(), source_, ": model.vocab has no token for byte ",
                 b, " (\"", spelling, "\"), so it is not a byte-level BPE vocabulary");
      impl_->byte_tokens[b] = it->second;
    }
    if (bulk != nullptr) {
      load_bulk_merges(*bulk);
    } else {
      load_merges(member(model, "merges", "model"));
    }
  }

  // The vocabulary the bulk reader listed: ids checked and the map built in order, the tokens'
  // bytes and spellings (each id its own entry) filled on every thread, as a load of Qwen's 151k
  // tokens otherwise spends much of its time there while `iris generate` waits for it.
  void load_bulk_vocab(const BulkReader& bulk) {
    Tokenizer::Impl& t = *impl_;
    int64_t max_id = -1;
    for (const auto& entry : bulk.vocab) max_id = std::max(max_id, entry.second);
    if (static_cast<size_t>(max_id + 1) > t.token_flags.size()) {
      t.token_bytes.resize(static_cast<size_t>(max_id + 1));
      t.token_spellings.resize(static_cast<size_t>(max_id + 1));
      t.token_flags.resize(static_cast<size_t>(max_id + 1), 0);
    }
    t.id_of_spelling.reserve(bulk.vocab.size() + 64);
    for (const auto& [spelling, id] : bulk.vocab) {
      if (t.token_flags[id] & Tokenizer::Impl::kPresent) throw BulkAnomaly{};
      if (!t.id_of_spelling.try_emplace(spelling, static_cast<int32_t>(id)).second)
        throw BulkAnomaly{};
      t.token_flags[id] |= Tokenizer::Impl::kPresent;
    }
    const auto n = static_cast<int64_t>(bulk.vocab.size());
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < n; ++k) {
      const auto& [spelling, id] = bulk.vocab[static_cast<size_t>(k)];
      t.token_bytes[id] = bytes_of_spelling(spelling);
      t.token_spellings[id] = spelling;
    }
  }

  // The merges the bulk reader listed: their three tokens looked up on every thread (the map is
  // only read), then entered in rank order. A merge naming a token the vocabulary lacks fails as
  // the one-by-one load fails, at the first such rank.
  void load_bulk_merges(const BulkReader& bulk) {
    const SpellingMap& ids = impl_->id_of_spelling;
    const auto n = static_cast<int64_t>(bulk.merges.size());
    std::vector<std::array<int32_t, 3>> found(bulk.merges.size());
    int64_t first_missing = n;
#pragma omp parallel
    {
      std::string joined;
      int64_t missing = n;
#pragma omp for schedule(static)
      for (int64_t r = 0; r < n; ++r) {
        const BulkReader::Merge& m = bulk.merges[static_cast<size_t>(r)];
        joined.assign(m.left);
        joined += m.right;
        std::array<int32_t, 3>& f = found[static_cast<size_t>(r)];
        int k = 0;
        for (std::string_view spelling :
             {std::string_view(m.left), std::string_view(m.right), std::string_view(joined)}) {
          const auto it = ids.find(spelling);
          f[k++] = it == ids.end() ? -1 : it->second;
        }
        if ((f[0] < 0 || f[1] < 0 || f[2] < 0) && missing == n) missing = r;
      }
#pragma omp critical
      first_missing = std::min(first_missing, missing);
    }
    if (first_missing < n) {
      const BulkReader::Merge& m = bulk.merges[static_cast<size_t>(first_missing)];
      add_merge(m.left, m.right, static_cast<size_t>(first_missing));  // throws, naming it
    }
    impl_->merges.reserve(bulk.merges.size());
    for (int64_t r = 0; r < n; ++r) {
      const std::array<int32_t, 3>& f = found[static_cast<size_t>(r)];
      // A repeated pair keeps its first (best) rank, as in HF.
      impl_->merges.try_emplace(pair_key(f[0], f[1]), MergeTarget{static_cast<int32_t>(r), f[2]});
    }
  }

  void add_merge(const std::string& left, const std::string& right, size_t rank) {
    const int32_t left_id = vocab_id(left, rank);
    const int32_t right_id = vocab_id(right, rank);
    const int32_t merged_id = vocab_id(left + right, rank);
    // A repeated pair keeps its first (best) rank, as in HF.
    impl_->merges.try_emplace(pair_key(left_id, right_id),
                              MergeTarget{static_cast<int32_t>(rank), merged_id});
  }

  void load_merges(const json& merges) {
    IRIS_CHECK(merges.is_array(), source_, ": model.merges must be an array");
    impl_->merges.reserve(merges.size());
    std::string left, right;
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const json& merge = merges[rank];
      if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
        left = merge[0].get_ref<const std::string&>();
        right = merge[1].get_ref<const std::string&>();
      } else if (merge.is_string()) {  // the older "left right" form
        const std::string& line = merge.get_ref<const std::string&>();
        const size_t space = line.find(' ');
        IRIS_CHECK(space != std::string::npos && line.find(' ', space + 1) == std::string::npos,
                   source_, ": merge ", rank, " \"", line,
                   "\" must be two tokens separated by one space");
        left = line.substr(0, space);
        right = line.substr(space + 1);
      } else {
        IRIS_FAIL(source_, ": merge ", rank, " is ", json_excerpt(merge),
                  "; expected [\"left\", \"right\"] or \"left right\"");
      }
      add_merge(left, right, rank);
    }
  }

  int32_t vocab_id(const std::string& spelling, size_t rank) {
    const auto it = impl_->id_of_spelling.find(spelling);
    IRIS_CHECK(it != impl_->id_of_spelling.end(), source_, ": merge ", rank, " needs token \"",
               spelling, "\", which is not in model.vocab");
    return it->second;
  }

  void load_added_tokens(const json& root) {
    if (!root.contains("added_tokens") || root.at("added_tokens").is_null()) return;
    const json& added = root.at("added_tokens");
    IRIS_CHECK(added.is_array(), source_, ": added_tokens must be an array");
    for (const json& entry : added) {
      const std::string& content =
          member(entry, "content", "an added_tokens entry").get_ref<const std::string&>();
      IRIS_CHECK(!content.empty(), source_, ": an added token has empty content");
      IRIS_CHECK(utf8::find_invalid(content) == std::string::npos, source_, ": added token \"",
                 content, "\" is not valid UTF-8");
      const int32_t id = checked_id(member(entry, "id", "an added_tokens entry"), content);
      IRIS_CHECK(!entry.value("single_word", false), source_, ": added token \"", content,
                 "\" has single_word=true, which is not supported");
      const bool special = entry.value("special", false);
      set_token(id, content, Tokenizer::Impl::kAdded | (special ? Tokenizer::Impl::kSpecial : 0));
      AddedToken token{content, id, entry.value("lstrip", false), entry.value("rstrip", false)};
      // HF matches "normalized" tokens in the normalized text, in their normalized form.
      if (entry.value("normalized", !special)) {
        if (impl_->apply_nfc) token.content = nfc_normalize(token.content);
        impl_->normalized_added_tokens.add(std::move(token));
      } else {
        impl_->raw_added_tokens.add(std::move(token));
      }
    }
  }

  void load_normalizer(const json& normalizer) {
    if (normalizer.is_null()) return;
    const std::string type = normalizer.value("type", "");
    if (type == "Sequence") {
      for (const json& step : member(normalizer, "normalizers", "the Sequence normalizer"))
        load_normalizer(step);
      return;
    }
    IRIS_CHECK(type == "NFC", source_, ": normalizer \"", type,
               "\" is not supported; only NFC (what Qwen uses) is implemented");
    impl_->apply_nfc = true;
  }

  void load_pre_tokenizer(const json& pre_tokenizer) {
    const char* expected =
        "; expected Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)] as in Qwen";
    IRIS_CHECK(pre_tokenizer.is_object() && pre_tokenizer.value("type", "") == "Sequence", source_,
               ": pre_tokenizer ", json_excerpt(pre_tokenizer, 200), " is not supported", expected);
    const json& steps = member(pre_tokenizer, "pretokenizers", "the Sequence pre_tokenizer");
    IRIS_CHECK(steps.is_array() && steps.size() == 2 && steps[0].value("type", "") == "Split" &&
                   steps[1].value("type", "") == "ByteLevel",
               source_, ": pre_tokenizer ", json_excerpt(pre_tokenizer, 200), " is not supported",
               expected);
    const json& split = steps[0];
    IRIS_CHECK(split.value("behavior", "") == "Isolated" && !split.value("invert", false), source_,
               ": Split pre_tokenizer must have behavior Isolated and invert false", expected);
    const json& byte_level_step = steps[1];
    IRIS_CHECK(!byte_level_step.value("use_regex", true) &&
                   !byte_level_step.value("add_prefix_space", false),
               source_, ": ByteLevel pre_tokenizer must have use_regex and add_prefix_space false",
               expected);

    const json& pattern = member(split, "pattern", "the Split pre_tokenizer");
    uint32_t options = PCRE2_UTF | PCRE2_UCP;
    std::string regex;
    if (pattern.contains("Regex")) {
      regex = to_pcre2_pattern(pattern.at("Regex").get<std::string>());
    } else {
      regex = member(pattern, "String", "the Split pattern").get<std::string>();
      options |= PCRE2_LITERAL;
    }
    int error = 0;
    PCRE2_SIZE error_offset = 0;
    impl_->split_regex.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(regex.data()), regex.size(),
                                           options, &error, &error_offset, nullptr));
    IRIS_CHECK(impl_->split_regex != nullptr, source_,
               ": the pre_tokenizer regex does not compile (", pcre2_message(error), " at offset ",
               error_offset, "): ", regex);
    // Without JIT the interpreter still works, only slower; nothing to report.
    pcre2_jit_compile(impl_->split_regex.get(), PCRE2_JIT_COMPLETE);
  }

  void check_decoder(const json& decoder) {
    IRIS_CHECK(decoder.is_null() || decoder.value("type", "") == "ByteLevel", source_, ": decoder ",
               json_excerpt(decoder, 200), " is not supported; expected ByteLevel");
  }

  std::string source_;
  std::shared_ptr<Tokenizer::Impl> impl_;
};

}  // namespace

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::error_code error;
  IRIS_CHECK(std::filesystem::exists(path, error), "tokenizer file ", path, " does not exist",
             " (run scripts/fetch_tokenizer.sh, or pass the tokenizer.json of the model)");
  return from_json_text(read_text_file(path, "tokenizer file", kJsonTokenizerLimits.max_bytes),
                        path);
}

Tokenizer Tokenizer::from_json_text(std::string_view json_text, const std::string& source_name) {
  return Tokenizer(Loader(source_name).load(json_text));
}

void Tokenizer::Impl::encode_text(std::string_view text, pcre2_match_data* match_data,
                                  std::vector<int32_t>& ids) const {
  const auto push_token = [&](int32_t id) { ids.push_back(id); };
  const auto encode_normalized = [&](std::string_view normalized) {
    normalized_added_tokens.split(
        normalized, [&](std::string_view words) { encode_words(words, match_data, ids); },
        push_token);
  };
  raw_added_tokens.split(
      text,
      [&](std::string_view piece) {
        if (apply_nfc && !nfc_quick_check(piece))
          encode_normalized(nfc_normalize(piece));
        else
          encode_normalized(piece);
      },
      push_token);
}

// The Split pre-tokenizer with behavior Isolated: every regex match is a word, and so is every
// stretch of text between matches.
void Tokenizer::Impl::encode_words(std::string_view text, pcre2_match_data* match_data,
                                   std::vector<int32_t>& ids) const {
  const auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t word_begin = 0;
  size_t search_from = 0;
  while (search_from < text.size()) {
    int rc = pcre2_match(split_regex.get(), subject, text.size(), search_from, PCRE2_NO_UTF_CHECK,
                         match_data, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // the interpreter keeps its backtracking on the heap
      rc = pcre2_match(split_regex.get(), subject, text.size(), search_from,
                       PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, match_data, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    IRIS_CHECK(rc >= 0, "the pre_tokenizer regex of ", source, " failed on a text of ", text.size(),
               " bytes: ", pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_data);
    const size_t begin = ovector[0], end = ovector[1];
    if (end == begin) {  // an empty match splits nothing; step over one character
      if (begin >= text.size()) break;
      search_from = begin + utf8::decode_step(text.substr(begin)).length;
      continue;
    }
    if (begin > word_begin) encode_word(text.substr(word_begin, begin - word_begin), ids);
    encode_word(text.substr(begin, end - begin), ids);
    word_begin = search_from = end;
  }
  if (word_begin < text.size()) encode_word(text.substr(word_begin), ids);
}

void Tokenizer::Impl::encode_word(std::string_view word, std::vector<int32_t>& ids) const {
  if (word.size() == 1) {
    ids.push_back(byte_tokens[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (ignore_merges) {
    const auto it = id_of_spelling.find(spelling_of_bytes(word));
    if (it != id_of_spelling.end() && !(token_flags[it->second] & kAdded)) {
      ids.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::lock_guard lock(word_cache_mutex);
    const auto it = word_cache.find(word);
    if (it != word_cache.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = ids.size();
  merge_word(word, ids);
  if (cacheable) {
    std::lock_guard lock(word_cache_mutex);
    if (word_cache.size() < kMaxCachedWords)
      word_cache.try_emplace(std::string(word), ids.begin() + first, ids.end());
  }
}

// HF's Word::merge_all without dropout: repeatedly merge the adjacent pair of lowest rank,
// leftmost first, using a heap of candidates and discarding those that merges made stale.
void Tokenizer::Impl::merge_word(std::string_view word, std::vector<int32_t>& ids) const {
  struct Symbol {
    int32_t id;  // -1 once merged into its left neighbour
    int32_t prev;
    int32_t next;
  };
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t merged_id;
    bool operator>(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : pos > other.pos;
    }
  };
  const int32_t n = static_cast<int32_t>(word.size());
  std::vector<Symbol> symbols(n);
  for (int32_t i = 0; i < n; ++i)
    symbols[i] = {byte_tokens[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1};

  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  const auto consider = [&](int32_t pos) {
    const Symbol& left = symbols[pos];
    const auto it = merges.find(pair_key(left.id, symbols[left.next].id));
    if (it != merges.end()) queue.push({it->second.rank, pos, it->second.id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i);

  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (left.id < 0 || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    const auto it = merges.find(pair_key(left.id, right.id));
    if (it == merges.end() || it->second.id != top.merged_id) continue;
    left.id = top.merged_id;
    right.id = -1;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) consider(left.prev);
    if (left.next >= 0) consider(top.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
}

std::vector<int32_t> Tokenizer::encode(const std::string& text) const {
  const size_t bad = utf8::find_invalid(text);
  IRIS_CHECK(bad == std::string::npos, "cannot tokenize: the text is not valid UTF-8 at byte ", bad,
             " of ", text.size(), "; convert it to UTF-8 first");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 1);
  const MatchData match_data(
      pcre2_match_data_create_from_pattern(impl_->split_regex.get(), nullptr));
  IRIS_CHECK(match_data != nullptr, "out of memory allocating regex match data");
  impl_->encode_text(text, match_data.get(), ids);
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::string bytes;
  for (const int32_t id : ids) {
    impl_->check_id(id);
    if (skip_special_tokens && (impl_->token_flags[id] & Impl::kSpecial)) continue;
    bytes += impl_->token_bytes[id];
  }
  return utf8::replace_invalid(bytes);
}

std::string Tokenizer::token_text(int32_t id) const {
  impl_->check_id(id);
  return impl_->token_bytes[id];
}

std::string Tokenizer::token_string(int32_t id) const {
  impl_->check_id(id);
  return impl_->token_spellings[id];
}

std::optional<int32_t> Tokenizer::find_token(const std::string& token) const {
  const auto it = impl_->id_of_spelling.find(token);
  if (it == impl_->id_of_spelling.end()) return std::nullopt;
  return it->second;
}

int32_t Tokenizer::token_id(const std::string& token) const {
  const std::optional<int32_t> id = find_token(token);
  IRIS_CHECK(id.has_value(), "token \"", token, "\" is not in the vocabulary of ", impl_->source,
             " (tokens are spelled as in tokenizer.json, e.g. \"Ġworld\" for \" world\")");
  return *id;
}

int32_t Tokenizer::vocab_size() const {
  return static_cast<int32_t>(impl_->token_flags.size());
}

bool Tokenizer::contains_id(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->token_flags.size() &&
         (impl_->token_flags[id] & Impl::kPresent);
}

bool Tokenizer::is_special(int32_t id) const {
  impl_->check_id(id);
  return impl_->token_flags[id] & Impl::kSpecial;
}

bool Tokenizer::is_added(int32_t id) const {
  impl_->check_id(id);
  return impl_->token_flags[id] & Impl::kAdded;
}

StreamingDecoder::StreamingDecoder(const Tokenizer& tok) : tokenizer_(tok) {}

std::string StreamingDecoder::push(int32_t id) {
  pending_ += tokenizer_.token_text(id);
  std::string ready;
  const size_t used = utf8::append_complete(ready, pending_);
  pending_.erase(0, used);
  return ready;
}

std::string StreamingDecoder::flush() {
  std::string rest = utf8::replace_invalid(pending_);
  pending_.clear();
  return rest;
}

}  // namespace iris
