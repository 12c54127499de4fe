// Error reporting: one exception type carrying where and why, and check macros that fill it in.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace iris {

// Thrown for every recoverable failure (bad input, bad config, failed CUDA call). The message is
// meant for a user: it says what was wrong and, where known, how to fix it.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A command line that cannot be taken as it stands: an unknown flag, subcommand, argument or
// recipe key, a value of the wrong type or out of its range, flags that cannot go together. The
// iris commands exit with 2 for these and 1 for every other Error, as getopt-style tools do, so
// that a script can tell a mistyped call from one that failed at its work.
class UsageError : public Error {
 public:
  using Error::Error;
};

[[noreturn]] void throw_error(const char* file, int line, const std::string& message);
[[noreturn]] void throw_usage_error(const char* file, int line, const std::string& message);
// IRIS_DEBUG=1 (any value but empty or 0) appends the source file and line to every Error.
bool debug_locations_enabled();

namespace detail {
inline void format_into(std::ostringstream&) {}
template <typename T, typename... Rest>
void format_into(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  format_into(os, rest...);
}
}  // namespace detail

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  detail::format_into(os, args...);
  return os.str();
}

}  // namespace iris

// User-facing failure (with the source file:line appended under IRIS_DEBUG=1).
#define IRIS_FAIL(...) ::iris::throw_error(__FILE__, __LINE__, ::iris::str_cat(__VA_ARGS__))

// Precondition check; the message says what was expected.
#define IRIS_CHECK(cond, ...)                                                           \
  do {                                                                                  \
    if (!(cond)) ::iris::throw_error(__FILE__, __LINE__, ::iris::str_cat(__VA_ARGS__)); \
  } while (0)

// A usage failure (UsageError): the command line is wrong, and the message says which part.
#define IRIS_USAGE_FAIL(...) \
  ::iris::throw_usage_error(__FILE__, __LINE__, ::iris::str_cat(__VA_ARGS__))

#define IRIS_USAGE_CHECK(cond, ...)                                                           \
  do {                                                                                        \
    if (!(cond)) ::iris::throw_usage_error(__FILE__, __LINE__, ::iris::str_cat(__VA_ARGS__)); \
  } while (0)
