// Levenshtein distance, for "did you mean" suggestions on unknown keys and flags.
#pragma once

#include <cstddef>
#include <string_view>

namespace iris {

size_t edit_distance(std::string_view a, std::string_view b);

}  // namespace iris
