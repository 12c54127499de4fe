// Byte-level BPE tokenizer for Qwen models, read from a Hugging Face tokenizer.json.
//
// Encoding follows the Hugging Face pipeline: added tokens (<|im_start|>, <think>, ...) are found
// in the raw text first, longest match first; each piece between them is NFC-normalized, split by
// the pre-tokenizer regex (PCRE2 with Unicode properties), mapped to bytes and merged by BPE rank.
// Decoding concatenates the tokens' bytes and replaces ill-formed UTF-8 with U+FFFD, as HF does
// with errors="replace".
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace iris {

class Tokenizer {
 public:
  // Throws iris::Error naming the path when the file is missing, is not JSON, or describes a
  // tokenizer this class does not implement.
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  // The same from the JSON text itself; `source_name` is what error messages call it.
  static Tokenizer from_json_text(std::string_view json_text, const std::string& source_name);

  // Thread safe. Throws iris::Error when the text is not valid UTF-8.
  std::vector<int32_t> encode(const std::string& utf8_text) const;
  // Throws iris::Error for an id that names no token.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

  // The bytes one token stands for; they may be part of a multi-byte character, so not valid
  // UTF-8 on their own.
  std::string token_text(int32_t id) const;
  // The token as spelled in tokenizer.json (byte-level form, e.g. "Ġworld"), like HF's
  // convert_ids_to_tokens.
  std::string token_string(int32_t id) const;
  // Lookups by that spelling (added tokens by their content, e.g. "<|im_start|>").
  int32_t token_id(const std::string& token) const;
  std::optional<int32_t> find_token(const std::string& token) const;

  int32_t vocab_size() const;          // largest id + 1
  bool contains_id(int32_t id) const;  // whether decode() accepts the id
  bool is_special(int32_t id) const;
  bool is_added(int32_t id) const;  // any added token, special or not (e.g. <think>)

  struct Impl;  // defined in tokenizer.cpp; named here so that its loader can build one

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;  // immutable tables shared by copies, plus a locked cache
};

// Streaming detokenizer: push ids one at a time and get back only complete UTF-8 characters,
// never part of one. The concatenation of everything returned (flush included) equals
// Tokenizer::decode of all pushed ids.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tok);
  std::string push(int32_t id);
  // Whatever is pending: an incomplete sequence becomes U+FFFD. The decoder can be reused after.
  std::string flush();
  bool has_pending() const { return !pending_.empty(); }

 private:
  Tokenizer tokenizer_;  // a cheap copy sharing the tables, so the decoder cannot dangle
  std::string pending_;
};

}  // namespace iris
