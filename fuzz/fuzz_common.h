// Shared pieces of the libFuzzer targets. A target feeds its input to one loader; iris::Error is
// the expected answer to bad input, and anything else (a crash, a sanitizer report, another
// exception escaping, a hang) is a finding.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <utility>

namespace iris::fuzz {

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

// Splits the input at the first occurrence of `separator`: the first part, then the rest (empty
// when the separator is absent). Lets one input carry two files.
inline std::pair<std::string, std::string> split_input(std::string_view text,
                                                       std::string_view separator) {
  const size_t at = text.find(separator);
  if (at == std::string_view::npos) return {std::string(text), std::string()};
  return {std::string(text.substr(0, at)), std::string(text.substr(at + separator.size()))};
}

// A file of this process's own under /tmp holding `bytes`, for loaders that read paths.
inline std::string write_scratch_file(const std::string& name, std::string_view bytes) {
  const std::string path = "/tmp/iris_fuzz_" + std::to_string(::getpid()) + "_" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size());
  return path;
}

}  // namespace iris::fuzz
