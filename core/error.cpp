#include "core/error.h"

namespace iris {

void throw_error(const char* file, int line, const std::string& message) {
  throw Error(str_cat(message, " [", file, ":", line, "]"));
}

}  // namespace iris
