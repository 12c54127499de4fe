#include "core/fs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
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

void write_file_atomic(const std::string& path, const std::string& contents) {
  IRIS_CHECK(!path.empty(), "cannot write a file: the output path is empty");
  // mkstemp: a name beside the target that no other file has, created exclusively, so that a
  // failed write never removes anything but its own temporary.
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  IRIS_CHECK(fd >= 0, "cannot create a temporary file beside ", path, ": ", std::strerror(errno));
  ::fchmod(fd, 0644);
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0) {
      const int err = errno;
      if (err == EINTR) continue;
      ::close(fd);
      ::unlink(tmp.c_str());
      IRIS_FAIL("writing ", tmp, " failed: ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
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
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
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

std::string make_temp_dir_beside(const std::string& target) {
  IRIS_CHECK(!target.empty(), "the output directory path is empty");
  std::string tmp = target + ".tmp.XXXXXX";
  IRIS_CHECK(::mkdtemp(tmp.data()) != nullptr, "cannot create a temporary directory beside ",
             target, ": ", std::strerror(errno));
  return tmp;
}

bool same_file(const std::string& a, const std::string& b) {
  struct stat sa {
  }, sb{};
  if (::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0) return false;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

}  // namespace iris
