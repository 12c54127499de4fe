// Small file helpers with user-facing errors; writes are atomic (temp file, fsync, rename) and
// never follow a symbolic link.
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <string>
#include <vector>

namespace iris {

// Opens `path` for reading after checking that it is a regular file: a FIFO, a device or a
// directory is an error naming `what` (e.g. "config file") instead of a read that blocks forever.
// Returns the descriptor (close-on-exec, blocking reads).
int open_regular_file(const std::string& path, const std::string& what);
// Throws unless `path` names an existing regular file (symlinks followed).
void check_regular_file(const std::string& path, const std::string& what);
// Creates `path` and its missing parents; a failure (a read-only filesystem, a file in the way,
// no permission) names `what` (the key or flag that gave the path) and the part that failed.
void make_directories(const std::string& path, const std::string& what);

// The whole file; it must be a regular file of at most `max_bytes`.
std::string read_text_file(const std::string& path, const std::string& what = "file",
                           size_t max_bytes = size_t{1} << 31);

// Writers never write through a symbolic link and never replace what is not a regular file: a
// link planted in an output folder would otherwise carry the write to its target, and a rename
// onto a device node (/dev/full, as root) would replace the node.
//
// Throws unless `path` is absent or a regular file that is not a symbolic link (lstat).
void check_replaceable(const std::string& path, const std::string& what = "output file");
// Writes `contents` to a temporary beside `path`, fsyncs it and renames it onto `path`;
// check_replaceable first.
void write_file_atomic(const std::string& path, const std::string& contents);
// Creates `path`, which must not exist (O_EXCL, no link followed), with `contents`; not fsynced.
void write_new_file(const std::string& path, const std::string& contents);
// Opens `path` for appending, creating it if absent: no link is followed, and an existing file
// must be a regular file with no other hard link. `what` names it in errors.
int open_append_file(const std::string& path, const std::string& what);
// Writes all of `data` to `fd` (retrying short writes); an error names `what` and `path`.
void write_all(int fd, const char* data, size_t size, const std::string& what,
               const std::string& path);

// The file an output setting `what` (a recipe key or flag) names relative to `dir`: `relative`
// must be a relative path without "..", so that it stays inside `dir`, and no part of it that
// exists may be a symbolic link. Checks the filesystem; check_relative_output is the same
// without it.
std::string output_path_inside(const std::string& dir, const std::string& relative,
                               const std::string& what, const std::string& dir_what);
void check_relative_output(const std::string& relative, const std::string& what,
                           const std::string& dir_what);

// Reads the next line of `in` into `line` (without its '\n'); false at the end of the input. A
// line longer than `max_bytes` throws iris::Error naming `source` and the line number `line_no`,
// before more than about `max_bytes` of it is held in memory.
bool read_bounded_line(std::istream& in, std::string& line, size_t max_bytes,
                       const std::string& source, int64_t line_no);

// A new, empty directory beside `target` (same parent, "<name>.iris-tmp.XXXXXX"), created
// exclusively so that it can never be a directory the user already had, and owned by this process
// until commit(): a "<dir>.lock" file beside it stays locked (flock) while the owner lives, so
// that remove_abandoned_temp_dirs can tell what a killed process left (SIGKILL mid-export) from
// what a live one is still writing, whatever the pids.
class OwnedTempDir {
 public:
  explicit OwnedTempDir(const std::string& target);
  // Removes the directory unless it was committed.
  ~OwnedTempDir();
  OwnedTempDir(const OwnedTempDir&) = delete;
  OwnedTempDir& operator=(const OwnedTempDir&) = delete;

  const std::string& path() const { return path_; }
  // Renames the directory onto the target. Without `replace` the target must not exist, and one
  // that appears meanwhile is an error, never replaced; with it an existing target is swapped
  // out and removed (a symbolic link as a link, never its target).
  void commit(bool replace = false);

 private:
  void release();
  std::string target_, path_, lock_path_;
  int lock_fd_ = -1;
  bool committed_ = false;
};

// Removes the temporary directories of dead owners in `parent` (see OwnedTempDir); returns their
// paths. A live owner's, and anything not made by OwnedTempDir, is left alone.
std::vector<std::string> remove_abandoned_temp_dirs(const std::string& parent);

// An exclusive lock on the folder `dir` for the object's life: flock on dir/file_name (created if
// absent, never through a link), which records the holder's pid. A second lock on the same folder
// from any process throws "<what> <dir> is in use by process N; <advice>" at once. The kernel
// drops the lock when the process dies, however it dies.
class DirectoryLock {
 public:
  DirectoryLock(const std::string& dir, const std::string& file_name, const std::string& what,
                const std::string& advice);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

// Whether two paths name the same file (same device and inode); false if either does not exist.
bool same_file(const std::string& a, const std::string& b);

}  // namespace iris
