#include "language/unicode_utf8.h"

#include <cstdint>

namespace iris::utf8 {

Step decode_step(std::string_view bytes) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(bytes[i]); };
  const uint8_t lead = byte(0);
  if (lead < 0x80) return {StepStatus::complete, lead, 1};
  // Table 3-7 of the Unicode standard: the lead byte fixes the length and the range allowed for
  // the second byte (which is what rules out overlongs, surrogates and values past U+10FFFF).
  size_t length;
  uint8_t second_min = 0x80, second_max = 0xBF;
  char32_t code_point;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
    code_point = lead & 0x1F;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    code_point = lead & 0x0F;
    if (lead == 0xE0) second_min = 0xA0;
    if (lead == 0xED) second_max = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    code_point = lead & 0x07;
    if (lead == 0xF0) second_min = 0x90;
    if (lead == 0xF4) second_max = 0x8F;
  } else {
    return {StepStatus::invalid, 0, 1};
  }
  for (size_t i = 1; i < length; ++i) {
    if (i >= bytes.size()) return {StepStatus::truncated, 0, i};
    const uint8_t lo = i == 1 ? second_min : 0x80;
    const uint8_t hi = i == 1 ? second_max : 0xBF;
    if (byte(i) < lo || byte(i) > hi) return {StepStatus::invalid, 0, i};
    code_point = (code_point << 6) | (byte(i) & 0x3F);
  }
  return {StepStatus::complete, code_point, length};
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t find_invalid(std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    if (static_cast<uint8_t>(bytes[i]) < 0x80) {
      ++i;
      continue;
    }
    const Step step = decode_step(bytes.substr(i));
    if (step.status != StepStatus::complete) return i;
    i += step.length;
  }
  return std::string_view::npos;
}

size_t append_complete(std::string& out, std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    const Step step = decode_step(bytes.substr(i));
    if (step.status == StepStatus::truncated) break;
    if (step.status == StepStatus::complete)
      out.append(bytes.data() + i, step.length);
    else
      out.append(kReplacementUtf8);
    i += step.length;
  }
  return i;
}

std::string replace_invalid(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  const size_t used = append_complete(out, bytes);
  if (used < bytes.size()) out.append(kReplacementUtf8);
  return out;
}

}  // namespace iris::utf8
