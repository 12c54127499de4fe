#include "core/fs.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"

namespace iris {

namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

void fsync_dir(const std::string& dir) {
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) return;
  // Durability is best effort here: the data itself was written and checked.
  if (::fsync(dfd) != 0) {
  }
  ::close(dfd);
}

void fsync_parent(const std::string& path) {
  fsync_dir(std::filesystem::path(path).parent_path().string());
}

}  // namespace

int open_regular_file(const std::string& path, const std::string& what) {
  IRIS_CHECK(!path.empty(), what, ": the path is empty");
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer before fstat can
  // tell what it is.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) IRIS_FAIL(what, " ", path, " does not exist");
    IRIS_FAIL("cannot open ", what, " ", path, ": ", std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    IRIS_FAIL("cannot stat ", what, " ", path, ": ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    IRIS_FAIL(what, " ", path, " is ", file_kind(st.st_mode), ", not a regular file");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

void make_directories(const std::string& path, const std::string& what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(path, ec);
  if (!ec) return;
  const std::string reason = ec.message();
  // The deepest existing ancestor is what refused: a file where a folder should be, or a folder
  // that cannot be written.
  fs::path at = fs::path(path);
  while (at.has_parent_path() && at != at.parent_path() && !fs::exists(fs::symlink_status(at, ec)))
    at = at.parent_path();
  const bool file_in_way = fs::exists(at, ec) && !fs::is_directory(at, ec);
  IRIS_FAIL("cannot create ", what, " '", path, "': ",
            file_in_way ? "'" + at.string() + "' is a file, not a directory"
                        : reason + " at '" + at.string() + "'",
            "; choose another path");
}

void check_regular_file(const std::string& path, const std::string& what) {
  IRIS_CHECK(!path.empty(), what, ": the path is empty");
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) IRIS_FAIL(what, " ", path, " does not exist");
    IRIS_FAIL("cannot stat ", what, " ", path, ": ", std::strerror(err));
  }
  IRIS_CHECK(S_ISREG(st.st_mode), what, " ", path, " is ", file_kind(st.st_mode),
             ", not a regular file");
}

std::string read_text_file(const std::string& path, const std::string& what, size_t max_bytes) {
  const int fd = open_regular_file(path, what);
  struct stat st {};
  ::fstat(fd, &st);
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    ::close(fd);
    IRIS_FAIL(what, " ", path, " is ", st.st_size, " bytes, more than the ", max_bytes,
              " this reader accepts");
  }
  std::string out;
  out.reserve(static_cast<size_t>(st.st_size));
  std::vector<char> buf(1 << 16);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      IRIS_FAIL("cannot read ", what, " ", path, ": ", std::strerror(err));
    }
    if (n == 0) break;
    // The size can grow under us; the bound holds for what is read, not only for what fstat saw.
    if (out.size() + static_cast<size_t>(n) > max_bytes) {
      ::close(fd);
      IRIS_FAIL(what, " ", path, " grew past the ", max_bytes, " bytes this reader accepts");
    }
    out.append(buf.data(), static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

void check_replaceable(const std::string& path, const std::string& what) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) return;
    IRIS_FAIL("cannot stat ", what, " ", path, ": ", std::strerror(err));
  }
  if (S_ISLNK(st.st_mode))
    IRIS_FAIL(what, " ", path,
              " is a symbolic link; Iris never writes through a link (it would replace the "
              "link's target): remove the link or choose another path");
  if (!S_ISREG(st.st_mode))
    IRIS_FAIL(what, " ", path, " is ", file_kind(st.st_mode),
              "; Iris replaces only regular files: remove it or choose another path");
}

void write_all(int fd, const char* data, size_t size, const std::string& what,
               const std::string& path) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      IRIS_FAIL("cannot write ", what, " ", path, ": ", std::strerror(errno));
    }
    done += static_cast<size_t>(n);
  }
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  IRIS_CHECK(!path.empty(), "cannot write a file: the output path is empty");
  check_replaceable(path);
  // mkstemp: a name beside the target that no other file has, created exclusively, so that a
  // failed write never removes anything but its own temporary.
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  IRIS_CHECK(fd >= 0, "cannot create a temporary file beside ", path, ": ", std::strerror(errno));
  if (::fchmod(fd, 0644) != 0) {
    // mkstemp's 0600 only makes the file private; the contents are still right.
  }
  try {
    write_all(fd, contents.data(), contents.size(), "the temporary file", tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    IRIS_FAIL("flushing ", tmp, " failed: ", std::strerror(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    IRIS_FAIL("renaming ", tmp, " to ", path, " failed: ", std::strerror(err));
  }
  // The rename is durable only once the directory entry is flushed too.
  fsync_parent(path);
}

void write_new_file(const std::string& path, const std::string& contents) {
  IRIS_CHECK(!path.empty(), "cannot write a file: the output path is empty");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    if (err == EEXIST)
      IRIS_FAIL("cannot create ", path, ": something of that name appeared while it was written");
    IRIS_FAIL("cannot create ", path, ": ", std::strerror(err));
  }
  try {
    write_all(fd, contents.data(), contents.size(), "file", path);
  } catch (...) {
    ::close(fd);
    ::unlink(path.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    IRIS_FAIL("cannot write ", path, ": ", std::strerror(err));
  }
}

int open_append_file(const std::string& path, const std::string& what) {
  IRIS_CHECK(!path.empty(), what, ": the path is empty");
  // O_NONBLOCK: a FIFO planted at the path must be refused below, not waited on.
  const int fd = ::open(path.c_str(),
                        O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    // A link (ELOOP) or a FIFO without a reader (ENXIO): say what is there.
    check_replaceable(path, what);
    IRIS_FAIL("cannot open ", what, " ", path, ": ", std::strerror(err));
  }
  struct stat st {};
  std::string problem;
  if (::fstat(fd, &st) != 0)
    problem = str_cat("cannot stat it: ", std::strerror(errno));
  else if (!S_ISREG(st.st_mode))
    problem = str_cat("it is ", file_kind(st.st_mode), "; Iris appends only to regular files");
  else if (st.st_nlink > 1)
    problem = str_cat("it has ", st.st_nlink - 1,
                      " other hard link(s); appending would change another file too");
  if (!problem.empty()) {
    ::close(fd);
    IRIS_FAIL(what, " ", path, ": ", problem, "; remove it or choose another path");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

void check_relative_output(const std::string& relative, const std::string& what,
                           const std::string& dir_what) {
  namespace fs = std::filesystem;
  const fs::path p(relative);
  IRIS_CHECK(!relative.empty(), what, " is empty; it names a file inside ", dir_what);
  IRIS_CHECK(!p.is_absolute(), what, " '", relative,
             "' is an absolute path; it names a file inside ", dir_what,
             " and must be relative to it (e.g. ", p.filename().string(), ")");
  for (const fs::path& part : p)
    IRIS_CHECK(part != "..", what, " '", relative, "' leaves ", dir_what,
               " through '..'; it names a file inside it: use a path without '..' (e.g. ",
               p.filename().string(), ")");
  const fs::path norm = p.lexically_normal();
  IRIS_CHECK(!norm.empty() && norm != "." && !norm.filename().empty() && norm.filename() != ".",
             what, " '", relative, "' names a directory, not a file inside ", dir_what);
}

std::string output_path_inside(const std::string& dir, const std::string& relative,
                               const std::string& what, const std::string& dir_what) {
  namespace fs = std::filesystem;
  check_relative_output(relative, what, dir_what);
  // A link anywhere below `dir` would carry the write out of it, whatever the path says.
  fs::path at(dir);
  for (const fs::path& part : fs::path(relative).lexically_normal()) {
    at /= part;
    struct stat st {};
    if (::lstat(at.c_str(), &st) != 0) break;  // absent: the writer creates it (or fails)
    IRIS_CHECK(!S_ISLNK(st.st_mode), what, " '", relative, "': ", at.string(),
               " is a symbolic link, which would carry the write out of ", dir_what,
               "; remove the link or set another ", what);
  }
  return (fs::path(dir) / fs::path(relative).lexically_normal()).string();
}

bool read_bounded_line(std::istream& in, std::string& line, size_t max_bytes,
                       const std::string& source, int64_t line_no) {
  line.clear();
  char chunk[1 << 16];
  bool any = false;
  for (;;) {
    in.getline(chunk, sizeof(chunk));
    const auto got = static_cast<size_t>(in.gcount());
    if (got == 0 && in.fail()) return any;  // the end of the input, nothing left on this line
    any = true;
    const bool chunk_full = in.fail() && !in.eof();  // no newline within the chunk
    const bool newline = !in.fail() && !in.eof();    // the newline was read (and counted)
    line.append(chunk, newline ? got - 1 : got);
    IRIS_CHECK(line.size() <= max_bytes, source, ":", line_no, ": the line is longer than ",
               max_bytes,
               " bytes; a line holds one sample (its text and image paths), so the "
               "file is corrupt or not JSONL");
    if (!chunk_full) return true;
    in.clear();
  }
}

namespace {

constexpr const char* kTempInfix = ".iris-tmp.";
constexpr const char* kTempLockSuffix = ".lock";
// The lock file's first line; only files that start with it are ever taken for abandoned ones.
constexpr const char* kTempMarker = "iris temporary directory of process ";

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A path with a trailing separator names its directory: "out/" is out.
std::string without_trailing_separator(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

// rename(2) that never replaces: RENAME_NOREPLACE where the filesystem has it, else a check
// first (a race there can only replace an empty directory made in between).
int rename_no_replace(const std::string& from, const std::string& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return 0;
  if (errno != EINVAL && errno != ENOSYS) return -1;
  struct stat st {};
  if (::lstat(to.c_str(), &st) == 0) {
    errno = EEXIST;
    return -1;
  }
  return ::rename(from.c_str(), to.c_str());
}

}  // namespace

OwnedTempDir::OwnedTempDir(const std::string& target)
    : target_(without_trailing_separator(target)) {
  IRIS_CHECK(!target_.empty(), "the output directory path is empty");
  // The lock file first, so that the directory never exists without a lock that says whose it
  // is; the directory takes the lock's name without ".lock" and must be new too.
  for (int attempt = 0; attempt < 16; ++attempt) {
    std::string lock = target_ + kTempInfix + "XXXXXX" + kTempLockSuffix;
    // O_CLOEXEC: a child that inherited the descriptor would hold the lock after we die.
    const int fd =
        ::mkostemps(lock.data(), static_cast<int>(std::strlen(kTempLockSuffix)), O_CLOEXEC);
    IRIS_CHECK(fd >= 0, "cannot create a temporary directory beside ", target_, ": ",
               std::strerror(errno));
    const std::string marker = str_cat(kTempMarker, ::getpid(), "\n");
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0 ||
        ::write(fd, marker.data(), marker.size()) != static_cast<ssize_t>(marker.size())) {
      const int err = errno;
      ::close(fd);
      ::unlink(lock.c_str());
      IRIS_FAIL("cannot create a temporary directory beside ", target_, ": ", std::strerror(err));
    }
    const std::string dir = lock.substr(0, lock.size() - std::strlen(kTempLockSuffix));
    if (::mkdir(dir.c_str(), 0755) == 0) {
      lock_fd_ = fd;
      lock_path_ = lock;
      path_ = dir;
      return;
    }
    const int err = errno;
    ::unlink(lock.c_str());
    ::close(fd);
    if (err != EEXIST)
      IRIS_FAIL("cannot create a temporary directory beside ", target_, ": ", std::strerror(err));
  }
  IRIS_FAIL("cannot create a temporary directory beside ", target_, ": every name tried was taken");
}

OwnedTempDir::~OwnedTempDir() {
  if (!committed_) {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
    if (ec) {
      // The lock file stays (unlocked once closed), so that the next cleaner tries again.
      ::close(lock_fd_);
      lock_fd_ = -1;
      return;
    }
  }
  release();
}

void OwnedTempDir::release() {
  if (lock_fd_ < 0) return;
  // Unlinked before the lock goes: a cleaner that finds the file unlocked may remove the
  // directory, which must be gone (renamed or removed) by then.
  ::unlink(lock_path_.c_str());
  ::close(lock_fd_);
  lock_fd_ = -1;
}

void OwnedTempDir::commit(bool replace) {
  IRIS_CHECK(!committed_, "internal: ", path_, " was already renamed to ", target_);
  struct stat st {};
  const bool target_exists = ::lstat(target_.c_str(), &st) == 0;
  if (replace && target_exists) {
    // One step, so that the target is never missing; the old one ends up under our name.
    if (::renameat2(AT_FDCWD, path_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE) != 0) {
      const int err = errno;
      if (err != EINVAL && err != ENOSYS)
        IRIS_FAIL("cannot replace ", target_, " with ", path_, ": ", std::strerror(err));
      std::error_code ec;
      std::filesystem::remove_all(target_, ec);
      IRIS_CHECK(!ec, "cannot remove the old ", target_, ": ", ec.message());
      IRIS_CHECK(::rename(path_.c_str(), target_.c_str()) == 0, "renaming ", path_, " to ", target_,
                 " failed: ", std::strerror(errno));
    }
    committed_ = true;
    fsync_parent(target_);
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);  // the old target, now under the temporary name
    release();
    IRIS_CHECK(!ec, "cannot remove the replaced ", target_, " (now ", path_, "): ", ec.message());
    return;
  }
  if (rename_no_replace(path_, target_) != 0) {
    const int err = errno;
    if (err == EEXIST || err == ENOTEMPTY)
      IRIS_FAIL(target_,
                " appeared while it was being written (another process?); remove it "
                "or choose another path");
    IRIS_FAIL("renaming ", path_, " to ", target_, " failed: ", std::strerror(err));
  }
  committed_ = true;
  fsync_parent(target_);
  release();
}

std::vector<std::string> remove_abandoned_temp_dirs(const std::string& parent) {
  namespace fs = std::filesystem;
  std::vector<std::string> removed;
  std::error_code ec;
  fs::directory_iterator it(parent.empty() ? fs::path(".") : fs::path(parent), ec);
  if (ec) return removed;  // nothing to clean where nothing can be listed
  std::vector<fs::path> locks;
  for (const fs::directory_entry& e : it) {
    const std::string name = e.path().filename().string();
    const size_t infix = name.rfind(kTempInfix);
    // <target>.iris-tmp.XXXXXX.lock
    if (infix == std::string::npos || !ends_with(name, kTempLockSuffix) ||
        name.size() != infix + std::strlen(kTempInfix) + 6 + std::strlen(kTempLockSuffix))
      continue;
    locks.push_back(e.path());
  }
  for (const fs::path& lock : locks) {
    const int fd = ::open(lock.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat st {};
    char head[64] = {};
    const size_t marker_len = std::strlen(kTempMarker);
    const bool ours = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
                      ::pread(fd, head, marker_len, 0) == static_cast<ssize_t>(marker_len) &&
                      std::memcmp(head, kTempMarker, marker_len) == 0;
    // A live owner holds the lock; only a dead one's can be taken.
    if (!ours || ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);
      continue;
    }
    const std::string lock_name = lock.string();
    const fs::path dir = lock_name.substr(0, lock_name.size() - std::strlen(kTempLockSuffix));
    struct stat dst {};
    bool gone = true;
    if (::lstat(dir.c_str(), &dst) == 0) {
      std::error_code rm;
      if (S_ISDIR(dst.st_mode)) fs::remove_all(dir, rm);
      gone = !rm && S_ISDIR(dst.st_mode);
      if (gone) removed.push_back(dir.string());
    }
    if (gone) ::unlink(lock.c_str());
    ::close(fd);
  }
  return removed;
}

DirectoryLock::DirectoryLock(const std::string& dir, const std::string& file_name,
                             const std::string& what, const std::string& advice) {
  const std::string path = (std::filesystem::path(dir) / file_name).string();
  // O_NOFOLLOW: a link planted at the lock's name must not have its target truncated.
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    const int err = errno;
    if (err == ELOOP) check_replaceable(path, "the lock file");
    IRIS_FAIL("cannot open ", path, ": ", std::strerror(err), " (", what,
              " must be a writable directory)");
  }
  struct stat st {};
  std::string problem;
  if (::fstat(fd_, &st) != 0)
    problem = str_cat("cannot stat it: ", std::strerror(errno));
  else if (!S_ISREG(st.st_mode))
    problem = str_cat("it is ", file_kind(st.st_mode), ", not a regular file");
  else if (st.st_nlink > 1)
    problem = "it has other hard links, whose contents the lock would overwrite";
  if (!problem.empty()) {
    ::close(fd_);
    fd_ = -1;
    IRIS_FAIL("the lock file ", path, ": ", problem, "; remove it and start again");
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd_, buf, sizeof(buf) - 1, 0);
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK) {
      std::string pid(buf, n > 0 ? static_cast<size_t>(n) : 0);
      while (!pid.empty() && std::isspace(static_cast<unsigned char>(pid.back()))) pid.pop_back();
      IRIS_FAIL(what, " ", dir, " is in use by process ",
                pid.empty() ? std::string("(unknown)") : pid, "; ", advice);
    }
    IRIS_FAIL("cannot lock ", path, ": ", std::strerror(err));
  }
  // The file is never deleted: a lock on an unlinked file would not exclude a process that opens
  // the path afresh.
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    IRIS_FAIL("cannot write ", path, ": ", std::strerror(err));
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ < 0) return;
  // A pid left behind would name an unrelated process in the next message.
  if (::ftruncate(fd_, 0) != 0) {
    // Nothing to do: the lock goes with the descriptor either way.
  }
  ::close(fd_);
}

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {
  }, sb{};
  if (::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0) return false;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

}  // namespace iris
