#include "core/error.h"

#include <cstdlib>
#include <cstring>

namespace iris {

bool debug_locations_enabled() {
  // Read each time: tests and long-lived processes may set it after start-up.
  const char* v = std::getenv("IRIS_DEBUG");
  return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
}

void throw_error(const char* file, int line, const std::string& message) {
  // The build's source path means nothing to a user; developers ask for it with IRIS_DEBUG=1.
  if (debug_locations_enabled()) throw Error(str_cat(message, " [", file, ":", line, "]"));
  throw Error(message);
}

void throw_usage_error(const char* file, int line, const std::string& message) {
  if (debug_locations_enabled()) throw UsageError(str_cat(message, " [", file, ":", line, "]"));
  throw UsageError(message);
}

}  // namespace iris
