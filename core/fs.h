// Small file helpers with user-facing errors; writes are atomic (temp file, fsync, rename).
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <string>

namespace iris {

// Opens `path` for reading after checking that it is a regular file: a FIFO, a device or a
// directory is an error naming `what` (e.g. "config file") instead of a read that blocks forever.
// Returns the descriptor (close-on-exec, blocking reads).
int open_regular_file(const std::string& path, const std::string& what);
// Throws unless `path` names an existing regular file (symlinks followed).
void check_regular_file(const std::string& path, const std::string& what);

// The whole file; it must be a regular file of at most `max_bytes`.
std::string read_text_file(const std::string& path, const std::string& what = "file",
                           size_t max_bytes = size_t{1} << 31);
void write_file_atomic(const std::string& path, const std::string& contents);

// Reads the next line of `in` into `line` (without its '\n'); false at the end of the input. A
// line longer than `max_bytes` throws iris::Error naming `source` and the line number `line_no`,
// before more than about `max_bytes` of it is held in memory.
bool read_bounded_line(std::istream& in, std::string& line, size_t max_bytes,
                       const std::string& source, int64_t line_no);

// A new, empty directory beside `target` (same parent, "<name>.tmp.XXXXXX"), created exclusively
// so that it can never be a directory the user already had. The caller renames it onto `target`.
std::string make_temp_dir_beside(const std::string& target);

// Whether two paths name the same file (same device and inode); false if either does not exist.
bool same_file(const std::string& a, const std::string& b);

}  // namespace iris
