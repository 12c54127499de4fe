// Small file helpers with user-facing errors; writes are atomic (temp file, fsync, rename).
#pragma once

#include <string>

namespace iris {

std::string read_text_file(const std::string& path);
void write_file_atomic(const std::string& path, const std::string& contents);

}  // namespace iris
