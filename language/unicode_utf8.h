// UTF-8 decoding that follows the Unicode "maximal subpart" rule, so that replacing bad bytes with
// U+FFFD gives the same text as Python's errors="replace" and Rust's from_utf8_lossy.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace iris::utf8 {

inline constexpr char32_t kReplacementCharacter = 0xFFFD;
inline constexpr std::string_view kReplacementUtf8 = "\xEF\xBF\xBD";

enum class StepStatus {
  complete,   // a well-formed sequence of `length` bytes encoding `code_point`
  invalid,    // `length` bytes (a maximal subpart) that can never become well formed
  truncated,  // all `length` remaining bytes are a well-formed prefix: more input may complete it
};

struct Step {
  StepStatus status;
  char32_t code_point;  // valid only when complete
  size_t length;        // at least 1
};

// Decodes the sequence that starts at bytes[0]; bytes must not be empty.
Step decode_step(std::string_view bytes);

// Appends the UTF-8 encoding of a Unicode scalar value.
void append(std::string& out, char32_t code_point);

// Byte offset of the first ill-formed or truncated sequence, or npos when the text is valid.
size_t find_invalid(std::string_view bytes);

// Copies bytes, replacing every maximal ill-formed subpart (and a truncated tail) with U+FFFD.
std::string replace_invalid(std::string_view bytes);

// Appends the decodable part of `bytes` to `out` (ill-formed subparts become U+FFFD) and returns
// how many bytes were used; a truncated sequence at the end is left for more input to complete.
size_t append_complete(std::string& out, std::string_view bytes);

}  // namespace iris::utf8
